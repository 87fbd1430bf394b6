"""Stores named by a URL: ``s3://``, ``gs://``, ``az://`` open a bucket store; other schemes,
and a URL where only a directory will do (CachedEncoder), are refused in one line, before
anything is created."""

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


@pytest.mark.parametrize("scheme", ["gs", "az", "GS"])
def test_gs_and_az_urls_name_a_bucket_a_prefix_and_their_scheme(scheme: str) -> None:
    url = BucketURL.parse(f"{scheme}://team/a/b/")
    assert url == BucketURL("team", "a/b", scheme.lower())
    assert str(url) == f"{scheme.lower()}://team/a/b"


@pytest.mark.parametrize("url", ["hdfs://b/p", "https://host/store", "abfs://c/p"])
def test_a_url_of_another_scheme_is_refused_and_not_read_as_a_folder(url: str) -> None:
    with pytest.raises(ConfigError, match=r"speak s3://, gs://, az://"):
        open_store(url)
    assert not Path(url.split(":")[0] + ":").exists()


def test_cached_encoder_refuses_a_url_of_another_scheme_and_creates_no_folder() -> None:
    """A bucket URL opens as a bucket store (tests/store/bucket/test_bucket_cached_encoder.py);
    one featbake cannot open is refused in one line, never read as a folder."""
    with pytest.raises(ConfigError, match=r"speak s3://, gs://, az://"):
        CachedEncoder(torch.nn.Linear(2, 2), cache="hdfs://bucket/features")
    assert not Path("hdfs:").exists()


def test_build_and_stats_refuse_another_scheme_and_create_no_folder(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    for args in (
        ["build", "-e", encoder_file, "-d", audio_dir, "--cache", "hdfs://bucket/features"],
        ["stats", "--cache", "hdfs://bucket/features"],
    ):
        done = invoke(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "speak s3://" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "hdfs:").exists()


def test_a_dataset_refuses_another_scheme(audio_dir: Path, encoder_file: Path) -> None:
    paths = sorted(audio_dir.rglob("*.wav"))
    with pytest.raises(ConfigError, match="speak s3://"):
        CachedFeatureDataset(paths, encoder_file, cache="hdfs://bucket/features")
