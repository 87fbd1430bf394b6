"""A store named by a URL (``s3://...``) is refused in one line, before anything is created."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.errors import ConfigError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import layout_at
from tests.conftest import run_cli


@pytest.mark.parametrize("url", ["s3://bucket/features", "gs://b/p", "https://host/store"])
def test_a_url_is_not_read_as_a_folder(url: str) -> None:
    with pytest.raises(ConfigError, match=r"is a URL.*object_store\.md.*--cache"):
        layout_at(url)


def test_build_and_stats_refuse_a_url_and_create_no_folder(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    for args in (
        ["build", "-e", encoder_file, "-d", audio_dir, "--cache", "s3://bucket/features"],
        ["stats", "--cache", "s3://bucket/features"],
    ):
        done = run_cli(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "is a URL" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "s3:").exists()


def test_a_dataset_refuses_a_url(tmp_path: Path, audio_dir: Path, encoder_file: Path) -> None:
    paths = sorted(audio_dir.rglob("*.wav"))
    with pytest.raises(ConfigError, match="is a URL"):
        CachedFeatureDataset(paths, encoder_file, cache="s3://bucket/features")
    assert not Path("s3:").exists()
