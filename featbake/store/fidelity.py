"""A root's measured fidelity: ``roots/<name>.fidelity``, written by a quantised build.

Why a file beside the manifest and not a catalog column: the measurement belongs to the root
(its data, encoder and recipe), is written once per build and read only by ``stats`` and
``roots``; a small JSON file needs no schema migration, and the manifest itself is written
before encoding starts (so readers can map items to keys), when nothing has been measured yet.
Dropping a root removes it with the manifest (:mod:`featbake.store.catalog.roots`).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from featbake.errors import StoreError
from featbake.quantize import Fidelity
from featbake.store.layout import Layout, checked_root_name

#: The dtypes whose roots carry a fidelity record.
QUANTISED = ("int8", "fp8")


def fidelity_file(layout: Layout, name: str) -> Path:
    """``roots/<name>.fidelity`` (not ``.json``: upkeep reads every ``*.json`` as a manifest)."""
    return layout.roots / f"{checked_root_name(name)}.fidelity"


def write_fidelity(layout: Layout, name: str, fidelity: Fidelity, bound: float | None) -> None:
    """Record what a build measured (tmp, rename: a reader sees the old record or the new).

    Raises:
        StoreError: the store is not writable.

    Example:
        >>> write_fidelity(layout, "r-3f1c", tally.result(), 0.05)  # doctest: +SKIP
    """
    doc: dict[str, Any] = {"fidelity": fidelity.to_json(), "bound": bound}
    final = fidelity_file(layout, name)
    tmp = layout.tmp / f"fidelity-{uuid.uuid4().hex}.part"
    try:
        layout.tmp.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8")
        os.replace(tmp, final)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(
            f"could not record the measured fidelity in {final}: {e.strerror or e}; "
            "check that the cache directory is writable"
        ) from e


def read_fidelity(layout: Layout, name: str) -> Fidelity | None:
    """The fidelity recorded for root ``name``, or None (none measured, or unreadable).

    Example:
        >>> read_fidelity(Layout(Path(".featbake")), "r-3f1c").rel_rms  # doctest: +SKIP
        0.0077
    """
    try:
        doc = json.loads(fidelity_file(layout, name).read_text(encoding="utf-8"))
        return Fidelity.from_json(doc["fidelity"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
