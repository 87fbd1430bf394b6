"""Stores named by a URL: ``s3://`` opens a bucket store; other schemes, and a URL where only a
directory will do (CachedEncoder), are refused in one line, before anything is created."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from featbake.errors import ConfigError
from featbake.serve.cached_encoder import CachedEncoder
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.open import open_store
from featbake.store.url import BucketURL
from tests.conftest import invoke


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://team/features", "team", "features"), ("s3://team", "team", ""),
     ("s3:/team/a/b/", "team", "a/b")],
)  # fmt: skip
def test_an_s3_url_names_a_bucket_and_a_prefix(url: str, bucket: str, prefix: str) -> None:
    assert BucketURL.parse(url) == BucketURL(bucket, prefix)


@pytest.mark.parametrize("url", ["gs://b/p", "https://host/store", "az://c/p"])
def test_a_url_of_another_scheme_is_refused_and_not_read_as_a_folder(url: str) -> None:
    with pytest.raises(ConfigError, match=r"speak S3.*s3://"):
        open_store(url)
    assert not Path(url.split(":")[0] + ":").exists()


def test_cached_encoder_refuses_a_bucket_url() -> None:
    with pytest.raises(ConfigError, match=r"bucket URL.*needs a store directory"):
        CachedEncoder(torch.nn.Linear(2, 2), cache="s3://bucket/features")
    assert not Path("s3:").exists()


def test_build_and_stats_refuse_another_scheme_and_create_no_folder(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    for args in (
        ["build", "-e", encoder_file, "-d", audio_dir, "--cache", "gs://bucket/features"],
        ["stats", "--cache", "gs://bucket/features"],
    ):
        done = invoke(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "speak S3" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "gs:").exists()


def test_a_dataset_refuses_another_scheme(audio_dir: Path, encoder_file: Path) -> None:
    paths = sorted(audio_dir.rglob("*.wav"))
    with pytest.raises(ConfigError, match="speak S3"):
        CachedFeatureDataset(paths, encoder_file, cache="gs://bucket/features")
