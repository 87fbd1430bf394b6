"""A block-shuffled epoch from a bucket store through a tier of a third of the data (issue 30
item 3): each shard is fetched once, where a full shuffle fetches shards over and over. The
tier must hold two windows of shards: a batch may straddle two windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import StackDataset

from featbake import CachedFeatureDataset, FeatureLoader
from featbake.bake.pipeline import build
from featbake.store.bucket import Bucket
from featbake.store.url import BucketURL
from featbake.testing import write_audio_folder
from tests.conftest import live_features
from tests.store.remote.conftest import S3


def _fetches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The whole-shard downloads from the bucket, by name, as they happen."""
    got: list[str] = []
    download = Bucket.download

    def counted(self: Bucket, name: str, dest: Path) -> int:
        if "shards/" in name:
            got.append(name)
        return download(self, name, dest)

    monkeypatch.setattr(Bucket, "download", counted)
    return got


def test_a_block_shuffled_epoch_through_a_third_of_the_data_fetches_each_shard_about_once(
    s3: S3, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    build(audio, encoder_file, cache=s3.url, workers=0, shard_bytes=50_000)
    shards = Bucket(BucketURL.parse(s3.url)).list("shards/")
    assert len(shards) >= 16
    third = sum(o.size for o in shards) // 3
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")  # whole shards into the tier
    fetched = _fetches(monkeypatch)
    per_epoch = {}
    for shuffle in ("blocks", True):
        tier = tmp_path / f"tier-{shuffle}"
        ds = CachedFeatureDataset(
            audio, encoder_file, cache=s3.url, local_cache=tier, local_cache_size=third,
            on_miss="error",
        )  # fmt: skip
        labelled = StackDataset(ds, torch.arange(len(ds)))
        loader = FeatureLoader(labelled, batch_size=4, shuffle=shuffle, window=2, seed=1)
        fetched.clear()
        seen = []
        for padded, lengths, labels in loader:
            for row, n, i in zip(padded, lengths, labels, strict=True):
                want = live_features(encoder_file, Path(ds.path(int(i))))
                torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)
                seen.append(int(i))
        assert sorted(seen) == list(range(len(ds)))
        per_epoch[shuffle] = len(fetched)
    # Each shard once. (Before the open shards were stamped in their order of use, one coarse
    # clock tick stamped them all alike and the tier evicted by name: 25 fetches here.)
    assert per_epoch["blocks"] <= len(shards)
    assert per_epoch[True] > per_epoch["blocks"]  # what a full shuffle costs the same tier
