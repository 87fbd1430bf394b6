"""A store in a bucket on a real S3 server (moto, loopback): build, rebuild, serve, merge.

Every served feature is compared with running the encoder now.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.store.bucket import version_of
from featbake.store.open import open_store
from tests.conftest import live_features
from tests.store.remote.conftest import S3


def bake(data: Path, encoder: Path, where: object, **kw: object):
    return build(data, encoder, cache=where, workers=0, shard_bytes=60_000, **kw)


def assert_dataset_is_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def test_a_build_into_a_bucket_publishes_shards_and_a_catalog_version(
    s3: S3, audio_dir: Path, encoder_file: Path
) -> None:
    report = bake(audio_dir, encoder_file, s3.url)
    assert report.encoded == 16 and report.merged
    objects = s3.objects()
    assert [o for o in objects if o.startswith("catalog/")] == ["catalog/v000000001.sqlite"]
    assert any(o.startswith("shards/") for o in objects)
    assert not [o for o in objects if o.startswith("fragments/")]  # folded, then deleted


def test_a_rebuild_from_a_fresh_node_encodes_nothing(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    bake(audio_dir, encoder_file, s3.url)
    other_node = open_store(s3.url, local_cache=tmp_path / "other-node")
    report = bake(audio_dir, encoder_file, other_node)
    assert report.encoded == 0 and report.reused == 16
    versions = [version_of(o) for o in s3.objects("catalog/")]
    assert versions == [1, 2]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataset_serves_a_bucket_store_through_workers(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, context: str
) -> None:
    bake(audio_dir, encoder_file, s3.url)
    tier = tmp_path / f"tier-{context}"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tier, local_cache_size="1GiB",
        on_miss="error",
    )  # fmt: skip
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context=context, shuffle=False
    )
    got = list(loader)
    assert len(got) == len(ds) == 16
    for i, value in enumerate(got):
        torch.testing.assert_close(value, live_features(encoder_file, Path(ds.path(i))))
    assert list(tier.rglob("*.safetensors"))  # the shards came through the local tier


def test_a_second_epoch_that_fits_the_tier_downloads_nothing(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    bake(audio_dir, encoder_file, s3.url)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "tier", on_miss="error"
    )
    assert_dataset_is_live(ds, encoder_file)
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    first = tier.fetched
    assert first > 0
    for i in range(len(ds)):
        ds[i]
    assert tier.fetched == first


def test_a_whole_shard_fetch_is_one_get_and_no_head(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog holds each shard's size, so fetching a shard whole asks the server nothing
    else (a HEAD for the size per shard before): counted in the server's access log."""
    bake(audio_dir, encoder_file, s3.url)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "tier", on_miss="error"
    )
    mark = s3.log_mark()
    assert_dataset_is_live(ds, encoder_file)
    shards = [r for r in s3.requests(mark) if r.shard]
    assert [r.method for r in shards] == ["GET"] * len(s3.objects("shards/"))
    assert all(r.status == 200 for r in shards)
