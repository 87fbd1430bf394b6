"""Serving int8 / fp8 stores: every read path serves the encoder's output now, quantised, then
dequantised (or raw, packed, with ``dequantize=False``); misses quantise what they write back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from featbake.bake.pipeline import build
from featbake.errors import ConfigError
from featbake.quantize import SCALE_BYTES, Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.serve.collate import PaddedBatch, pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import FeatureLoader
from tests.conftest import live_features

FLOAT = Recipe()  # the encoder's float32 output, what int8 and fp8 are quantised from


def _want(encoder: Path, ds: CachedFeatureDataset, scheme: Scheme) -> list[torch.Tensor]:
    """Each item's stored form, from running the encoder now and quantising it."""
    out = []
    for i in range(len(ds)):
        live = live_features(encoder, Path(ds.path(i)), FLOAT)
        assert isinstance(live, torch.Tensor)
        out.append(quantize(live, scheme))
    return out


def _built(audio_dir: Path, encoder: Path, store: Path, dtype: str) -> None:
    # batch_size=1: the build runs what live encoding runs, so stored bytes are equal.
    report = build(audio_dir, encoder, cache=store, recipe=Recipe(dtype=dtype), batch_size=1)
    assert report.ok and report.encoded == 16


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("ram_cache", [0, "64MiB"])
def test_every_read_path_serves_the_live_output_quantised_then_dequantised(
    audio_dir: Path, encoder_file: Path, store_dir: Path, dtype: str, ram_cache: object
) -> None:
    scheme = Scheme(dtype)
    _built(audio_dir, encoder_file, store_dir, dtype)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype=dtype, on_miss="error", ram_cache=ram_cache
    )
    want = [dequantize(p, scheme, torch.float16) for p in _want(encoder_file, ds, scheme)]
    for _ in range(2):  # the general path, then the located hit path (or the RAM tier)
        for i in range(len(ds)):
            got = ds[i]
            assert got.dtype == torch.float16 and torch.equal(got, want[i]), i
    for _ in range(2):  # padded batches: planned, then located
        batch = ds.__getitems__([3, 0, 7, 12])
        assert isinstance(batch, PaddedBatch) and batch.padded.dtype == torch.float16
        for j, i in enumerate([3, 0, 7, 12]):
            assert torch.equal(batch[j], want[i])
        padded, lengths = pad_collate(batch)
        assert padded is batch.padded and not padded[1, lengths[1] :].any()
    assert ds.cache_info().encoded == 0


def test_workers_and_serve_dtype(audio_dir: Path, encoder_file: Path, store_dir: Path) -> None:
    _built(audio_dir, encoder_file, store_dir, "int8")
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", serve_dtype="float32"
    )
    want = [dequantize(p, Scheme.INT8, torch.float32) for p in _want(encoder_file, ds, Scheme.INT8)]
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=pad_collate)
    seen = 0
    for b, (padded, lengths) in enumerate(loader):
        assert padded.dtype == torch.float32
        for j, n in enumerate(lengths.tolist()):
            assert torch.equal(padded[j, :n], want[b * 5 + j])
            assert not padded[j, n:].any()
            seen += 1
    assert seen == 16


def test_raw_items_are_the_stored_packed_tensors_and_dequantise_after_collate(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    _built(audio_dir, encoder_file, store_dir, "fp8")
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="fp8", dequantize=False
    )
    want = _want(encoder_file, ds, Scheme.FP8)
    for i in range(len(ds)):
        assert torch.equal(ds[i], want[i])
    # Items of several lengths through pad_collate: zero rows pad, and dequantise to zero.
    items = [ds[i] for i in range(len(ds))]
    padded, lengths = pad_collate(items)
    assert padded.dtype == torch.uint8 and padded.shape[-1] == 64 + SCALE_BYTES
    served = dequantize(padded, Scheme.FP8, torch.float16)  # e.g. on the GPU, after the copy
    for j, n in enumerate(lengths.tolist()):
        assert torch.equal(served[j, :n], dequantize(want[j], Scheme.FP8, torch.float16))
        assert not served[j, n:].any()
    batch = ds.__getitems__([0, 5, 9])
    assert isinstance(batch, PaddedBatch) and batch.padded.dtype == torch.uint8
    assert all(torch.equal(batch[j], want[i]) for j, i in enumerate([0, 5, 9]))


def test_misses_are_quantised_written_back_and_then_hit(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, dtype="int8")
    assert ds.stored() == 0
    want = [dequantize(p, Scheme.INT8, torch.float16) for p in _want(encoder_file, ds, Scheme.INT8)]
    for i in range(len(ds)):
        assert torch.equal(ds[i], want[i])  # encoded one at a time: bit for bit
    assert ds.cache_info().encoded == 16
    ds.close()  # seals the write-back shard
    again = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", on_miss="error"
    )
    assert again.stored() == 16
    assert all(torch.equal(again[i], want[i]) for i in range(len(again)))
    raw = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", dequantize=False, on_miss="error"
    )
    assert raw[0].dtype == torch.int8 and raw[0].shape[-1] == 64 + SCALE_BYTES


def test_dict_outputs_are_dequantised_part_by_part(
    audio_dir: Path, multi_encoder_file: Path, store_dir: Path
) -> None:
    build(audio_dir, multi_encoder_file, cache=store_dir, recipe=Recipe(dtype="int8"), batch_size=1)
    ds = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, dtype="int8", on_miss="error"
    )
    for i in range(len(ds)):
        live = live_features(multi_encoder_file, Path(ds.path(i)), FLOAT)
        assert isinstance(live, dict)
        got = ds[i]
        assert set(got) == set(live)
        for name, value in live.items():
            want = dequantize(quantize(value, Scheme.INT8), Scheme.INT8, torch.float16)
            assert torch.equal(got[name], want), (i, name)


def test_serving_options_are_checked(audio_dir: Path, encoder_file: Path, store_dir: Path) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with pytest.raises(ConfigError, match="apply to int8 and fp8 stores"):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, serve_dtype="float32")
    with pytest.raises(ConfigError, match="apply to int8 and fp8 stores"):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, dequantize=False)
    with pytest.raises(ConfigError, match="serve_dtype must be one of"):
        CachedFeatureDataset(
            audio_dir, encoder_file, cache=store_dir, dtype="int8", serve_dtype="int8"
        )
    with pytest.raises(ConfigError, match="drop serve_dtype"):
        CachedFeatureDataset(
            audio_dir,
            encoder_file,
            cache=store_dir,
            dtype="int8",
            serve_dtype=torch.float32,
            dequantize=False,
        )


@pytest.mark.parametrize("raw", [False, True])
def test_feature_loader_batches_dequantised_or_raw(
    audio_dir: Path, encoder_file: Path, store_dir: Path, raw: bool
) -> None:
    _built(audio_dir, encoder_file, store_dir, "int8")
    extra = {"dequantize": False} if raw else {}
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", on_miss="error", **extra
    )
    want = [dequantize(p, Scheme.INT8, torch.float16) for p in _want(encoder_file, ds, Scheme.INT8)]
    seen = 0
    for b, (padded, lengths) in enumerate(FeatureLoader(ds, batch_size=6, shuffle=False)):
        assert padded.dtype == (torch.int8 if raw else torch.float16)
        served = dequantize(padded, Scheme.INT8, torch.float16) if raw else padded
        for j, n in enumerate(lengths.tolist()):
            assert torch.equal(served[j, :n], want[b * 6 + j]) and not served[j, n:].any()
            seen += 1
    assert seen == len(ds)
