"""int8 / fp8 builds done in parts: `--shard i/2` processes and torchrun ranks each carry what
they measured in their ``done`` fragment; the merge pools it into the root's fidelity record,
equal to what one process measures, and every feature is served equal to live encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.quantize import Fidelity, Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import read_fidelity
from featbake.store.fragments import sealed_fragments
from featbake.store.layout import Layout
from tests.conftest import REPO, invoke, live_features
from tests.helpers import assert_store_consistent
from tests.test_ranks import torchrun


def _args(data: Path, encoder: Path, store: Path, dtype: str) -> tuple[object, ...]:
    # --batch-size 1: each part runs what live encoding runs, so stored codes are equal.
    return ("build", "-e", encoder, "-d", data, "--cache", store, "--workers", "0",
            "--dtype", dtype, "--batch-size", "1")  # fmt: skip


def _one_process(data: Path, encoder: Path, store: Path, dtype: str) -> Fidelity:
    report = build(data, encoder, cache=store, recipe=Recipe(dtype=dtype), batch_size=1)
    assert report.ok and report.fidelity is not None
    return Fidelity.from_json(report.fidelity)


def _root(store: Path) -> str:
    out = invoke("roots", "--json", "--cache", store)
    assert out.returncode == 0, out.stderr
    (root,) = json.loads(out.stdout)
    return root["name"]


def _assert_merged_and_served(
    store: Path, data: Path, encoder: Path, dtype: str, alone: Fidelity
) -> None:
    """The pooled record equals one process's measurement; every item is served as live."""
    assert sealed_fragments(Layout(store)) == []
    pooled = read_fidelity(Layout(store), _root(store))
    assert pooled is not None
    assert (pooled.items, pooled.served) == (alone.items, alone.served)
    for field in ("rel_rms", "worst_rel_rms", "mean_cosine", "min_cosine"):
        assert getattr(pooled, field) == pytest.approx(getattr(alone, field), rel=1e-9)
    shown = invoke("roots", "--cache", store)
    assert f"{pooled.rel_rms:.2%} rel. RMS error" in shown.stdout
    scheme = Scheme(dtype)
    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error", dtype=dtype)
    for i in range(len(ds)):
        live = live_features(encoder, Path(ds.path(i)), Recipe())
        assert isinstance(live, torch.Tensor)
        assert torch.equal(ds[i], dequantize(quantize(live, scheme), scheme, torch.float16)), i
    assert_store_consistent(store)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_shard_parts_record_fidelity_and_the_merge_pools_it(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, dtype: str
) -> None:
    store = tmp_path / "parts"
    for part in ("0/2", "1/2"):
        done = invoke(*_args(audio_dir, encoder_file, store, dtype), "--shard", part)
        assert done.returncode == 0, done.stderr  # main: exit 5, "could not record ... fidelity"
    assert len(sealed_fragments(Layout(store))) >= 2
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0, merged.stderr
    alone = _one_process(audio_dir, encoder_file, tmp_path / "alone", dtype)
    _assert_merged_and_served(store, audio_dir, encoder_file, dtype, alone)


def test_torchrun_ranks_build_int8_and_merge_its_fidelity(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    store = tmp_path / "ranks"
    done = torchrun(*_args(audio_dir, encoder_file, store, "int8"), env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    alone = _one_process(audio_dir, encoder_file, tmp_path / "alone", "int8")
    _assert_merged_and_served(store, audio_dir, encoder_file, "int8", alone)
