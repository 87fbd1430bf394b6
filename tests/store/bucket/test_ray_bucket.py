"""A bucket store written by Ray workers (``featbake build --engine ray --cache s3://...``).

The build starts its own local Ray instance, so its workers inherit the loopback server's
environment as a node's workers inherit their node's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder
from tests.conftest import invoke, live_features, run_cli
from tests.store.bucket.conftest import S3

pytest.importorskip("ray")
pytest.importorskip("ray.data")

pytestmark = pytest.mark.slow


def test_ray_workers_write_a_bucket_store_a_plain_build_finds(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    clips = tmp_path / "audio"
    write_audio_folder(clips, 4, seconds=(0.2, 0.5), seed=5)
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", s3.url, "--json"]
    proc = run_cli(*args, "--engine", "ray", "--workers", "1", env=s3.env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["encoded"], report["failed"], report["merged"]) == (4, [], True)
    objects = s3.objects()
    assert any(o.startswith("shards/") for o in objects)
    assert not [o for o in objects if o.startswith("fragments/")]  # folded, then deleted
    again = invoke(*args)  # a plain build on this node
    assert again.returncode == 0, again.stderr
    assert (json.loads(again.stdout)["encoded"], json.loads(again.stdout)["reused"]) == (0, 4)
    ds = CachedFeatureDataset(clips, encoder_file, cache=s3.url, on_miss="error")
    assert len(ds) == 4
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
