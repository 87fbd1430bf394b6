"""Helpers shared by tests/test_padded.py and tests/test_hf.py (not a test file)."""

from __future__ import annotations

from pathlib import Path

import torch

from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout


def stored_features(cache: Path, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Relative path -> stored parts, for every item of a root that is stored."""
    layout = Layout(cache)
    cat = Catalog(layout)
    reader = FeatureReader(layout, verify="always")
    try:
        items = cat.root_items(root)
        got = reader.get_many([k for _, k in items])
        return {p: got[k] for p, k in items if k in got}
    finally:
        reader.close()
        cat.close()


def root_keys(cache: Path, root: str) -> dict[str, str]:
    """Relative path -> key, from a root's manifest."""
    cat = Catalog(Layout(cache))
    try:
        return dict(cat.root_items(root))
    finally:
        cat.close()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (inf for a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
