"""A bucket store read by ranged GETs: when the tier cannot hold the store, each tensor's bytes
come in one ranged GET (CRC-checked), nothing is fetched whole. Every item equals live."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import StoreCorrupt
from featbake.store.bucket import Bucket, RangedShardReader
from featbake.store.url import BucketURL
from tests.conftest import live_features
from tests.store.remote.conftest import S3


def serve(s3: S3, data: Path, encoder: Path, tier: Path, **kw: object) -> CachedFeatureDataset:
    return CachedFeatureDataset(data, encoder, cache=s3.url, local_cache=tier, **kw)


def test_a_tier_smaller_than_the_store_reads_items_by_ranges(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "tier"
    ds = serve(s3, audio_dir, encoder_file, tier, local_cache_size="64KiB", on_miss="error")
    assert ds._layout.remote.reads_ranged()  # type: ignore[union-attr]
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    batch = ds.__getitems__([3, 0, 7])  # a batch's rows: spans read on several threads
    for i, got in zip([3, 0, 7], batch, strict=True):
        torch.testing.assert_close(got, live_features(encoder_file, Path(ds.path(i))))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))  # forked workers, own clients
    for i, value in enumerate(got):
        torch.testing.assert_close(value, live_features(encoder_file, Path(ds.path(i))))
    # The tier keeps the shard that fits (issue 32 item 8); the rest are read by ranges.
    kept = list(tier.rglob("*.safetensors"))
    assert len(kept) == 1 and sum(p.stat().st_size for p in kept) <= 64 << 10
    readers = ds._proc().handles.open_readers.values()
    assert readers and sum(isinstance(r, RangedShardReader) for r in readers) == len(readers) - 1


def test_a_damaged_span_is_read_twice_then_named(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    bucket = Bucket(BucketURL.parse(s3.url))
    for obj in s3.objects("shards/"):  # every shard's last tensor loses a byte
        local = tmp_path / "x"
        bucket.download(obj, local)
        data = bytearray(local.read_bytes())
        data[-3] ^= 0xFF
        local.write_bytes(bytes(data))
        bucket.upload(obj, local)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")
    ds = serve(s3, audio_dir, encoder_file, tmp_path / "tier", on_miss="error")
    with pytest.raises(StoreCorrupt, match=r"s3://.*shards/.*on two reads: the object is damaged"):
        for i in range(len(ds)):
            ds[i]


def test_feature_loader_starts_ranged_gets_ahead_and_yields_live_batches(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from featbake import FeatureLoader

    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")  # every shard by ranges
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    ds = serve(s3, audio_dir, encoder_file, tmp_path / "tier", local_cache_size="64KiB")
    started = ds.will_need(range(len(ds)))  # opens ranged readers, starts every item's GET
    assert started == len(ds)
    readers = list(ds._proc().handles.open_readers.values())
    assert all(isinstance(r, RangedShardReader) for r in readers)
    for i in range(len(ds)):  # each read takes its GET's bytes
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    assert all(not r._ahead for r in readers)  # every started GET was consumed
    loader = FeatureLoader(ds, batch_size=4, shuffle=False, read_ahead=8)
    rows = [p[:n] for padded, lengths in loader for p, n in zip(padded, lengths, strict=True)]
    assert len(rows) == len(ds)
    for i, row in enumerate(rows):  # in order: the loader's hints ran ahead of these reads
        torch.testing.assert_close(row, live_features(encoder_file, Path(ds.path(i))))
