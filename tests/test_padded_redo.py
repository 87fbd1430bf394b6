"""Padding found inexact in a later batch: the items earlier padded batches sealed are encoded
again alone and replace theirs (bake/pipeline.py), so every served item equals the encoder run now
on that item alone, whatever batch it was first encoded in."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from featbake.encode.sources import source_for
from featbake.quantize import Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import LengthsEncoder, write_audio_folder
from tests.helpers import assert_store_consistent

#: Padding below this many samples (but not none) shifts the output: the most padded item of a
#: batch, the one the guard re-runs, passes while its less padded neighbours are off.
LITTLE = 1600


class LittlePaddingLeaks(nn.Module):
    """A lengths encoder whose output is off by 0.5 when its input is padded by 1..LITTLE-1."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LengthsEncoder()

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_lengths = self.inner(wav, lengths)
        pad = wav.shape[-1] - lengths
        bump = ((pad > 0) & (pad < LITTLE)).to(feats.dtype) * 0.5
        return feats + bump[:, None, None], out_lengths


def clips(root: Path) -> Path:
    """Batches of three (batch_size=3, sorted by length): in the first three the shortest clip
    is padded by 0.5 s (the guard passes) and the middle one by 0.04 s (off); in the last, all
    three are within 0.04 s (the guard fails there)."""
    seconds = [1.0, 0.96, 0.5, 1.5, 1.46, 1.0, 2.0, 1.96, 1.5, 2.5, 2.48, 2.46]
    for n, sec in enumerate(seconds):
        write_audio_folder(root / f"c{n:02d}", 1, seconds=sec, seed=n)
    return root


def alone(module: nn.Module, path: Path) -> torch.Tensor:
    x = source_for(Recipe()).load(path)
    with torch.inference_mode():
        feats, n = module(x[None], torch.tensor([x.shape[-1]]))
    return feats[0, : int(n[0])]


def assert_serves_alone(data: Path, module: nn.Module, **kw: object) -> None:
    ds = CachedFeatureDataset(data, module, on_miss="error", **kw)  # type: ignore[arg-type]
    assert len(ds) == 12
    for i in range(len(ds)):
        want = alone(module, Path(ds.path(i)))
        torch.testing.assert_close(ds[i], want, rtol=1e-4, atol=1e-5, msg=ds.path(i))


def test_items_sealed_before_the_guard_failed_are_encoded_again_alone(tmp_path: Path) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    store = tmp_path / "store"
    report = build(data, module, cache=store, workers=0, batch_size=3, batching="padded")
    assert report.ok and report.encoded == 12
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    assert "items padded before were encoded again alone" in report.batching_note
    assert_serves_alone(data, module, cache=store)  # main: 3 of 12 off by 0.5
    assert_store_consistent(store)
    again = build(data, module, cache=store, workers=0, batch_size=3)
    assert (again.encoded, again.reused) == (0, 12)


def test_padding_that_stays_exact_encodes_nothing_again(tmp_path: Path) -> None:
    data, module = clips(tmp_path / "clips"), LengthsEncoder()
    report = build(data, module, cache=tmp_path / "s", workers=0, batch_size=3, batching="padded")
    assert report.batching == BatchingMode.PADDED and "encoded again" not in report.batching_note
    assert_serves_alone(data, module, cache=tmp_path / "s")


def test_an_int8_build_stores_the_items_encoded_again_quantised_and_measures_each_once(
    tmp_path: Path,
) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    store = tmp_path / "store"
    recipe = Recipe(dtype="int8")
    report = build(data, module, cache=store, recipe=recipe, workers=0, batch_size=3)
    assert "items padded before were encoded again alone" in report.batching_note
    assert report.fidelity is not None and report.fidelity["items"] == 12
    ds = CachedFeatureDataset(data, module, cache=store, on_miss="error", dtype="int8")
    for i in range(len(ds)):
        want = dequantize(quantize(alone(module, Path(ds.path(i))), Scheme.INT8), Scheme.INT8)
        assert torch.equal(ds[i], want), ds.path(i)
