"""gc on a bucket store while readers hold an older catalog version: nothing a kept version
names is deleted within the retention period; after it, a reader of the old version encodes
what it lost live. Every served feature is compared with running the encoder now."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.store.bucket import BucketStore
from featbake.store.open import open_store
from featbake.upkeep.gc import GcOptions, gc_bucket
from tests.conftest import live_features, run_cli
from tests.store.remote.conftest import S3

HOUR = 3600.0


def bucket(url: str, tier: Path) -> BucketStore:
    store = open_store(url, local_cache=tier).remote
    assert isinstance(store, BucketStore)
    return store


def assert_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def test_gc_keeps_what_an_older_version_names_until_the_retention_period_passes(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    shards = s3.objects("shards/")
    # Two readers open the store now (version 1), before gc drops the root.
    holder = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r1", on_miss="error"
    )
    late = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r2", write_back=False
    )
    later = time.time() + 100  # the root is unused for 100 s: --older-than 1s drops it
    first = gc_bucket(
        bucket(s3.url, tmp_path / "gc"), GcOptions(older_than=1.0), retention=HOUR, now=later
    )
    assert first.published and first.catalog.roots_dropped
    assert first.shards_deleted == 0 and first.versions_deleted == 0
    # gc folded the readers' serving fragments first (version 2; issue 28 item 7), then
    # published its own change (version 3).
    assert s3.objects("shards/") == shards and len(s3.objects("catalog/")) == 3
    assert_live(holder, encoder_file)  # read from the bucket through version 1: stored, not live
    assert holder.cache_info().encoded == 0

    second = gc_bucket(bucket(s3.url, tmp_path / "gc"), retention=HOUR, now=later + 2 * HOUR)
    assert second.versions_deleted == 2 and second.shards_deleted == len(shards)
    assert not s3.objects("shards/") and s3.objects("catalog/") == ["catalog/v000000003.sqlite"]
    # A reader still on version 1 after the retention period: its shards are gone, so it
    # encodes live (this one never fetched them), and serves nothing wrong.
    assert_live(late, encoder_file)
    assert late.cache_info().encoded == len(late)


def test_gc_keeps_young_unnamed_shards_and_the_cli_says_so(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    time.sleep(1.5)  # the root is now unused for longer than --older-than 1s
    dry = run_cli("gc", "--cache", s3.url, "--older-than", "1s", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "dry run" in dry.stdout and "would delete 0 old catalog versions" in dry.stdout
    done = run_cli("gc", "--cache", s3.url, "--older-than", "1s")
    assert done.returncode == 0, done.stderr
    # The root went in a new version; its shards are unnamed now but young: kept (7 days).
    assert "unnamed shards kept" in done.stdout and s3.objects("shards/")
    assert len(s3.objects("catalog/")) == 2


def test_a_reader_whose_shards_gc_deleted_finds_a_rebuild_through_the_newest_version(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    reader = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r", write_back=False
    )
    later = time.time() + 100
    store = bucket(s3.url, tmp_path / "gc")
    gc_bucket(store, GcOptions(older_than=1.0), retention=HOUR, now=later)
    gc_bucket(store, retention=HOUR, now=later + 2 * HOUR)
    assert not s3.objects("shards/")
    # Built again by another node, into other shards (another shard size: other names).
    again = open_store(s3.url, local_cache=tmp_path / "other")
    build(audio_dir, encoder_file, cache=again, workers=0, shard_bytes=200_000)
    assert s3.objects("shards/")
    assert_live(reader, encoder_file)  # its version-1 shards are gone: looked up in the newest
    assert reader.cache_info().encoded == 0
