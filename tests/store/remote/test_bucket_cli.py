"""Every command takes a bucket URL: build, stats, roots, verify, export (real subprocesses
against the loopback S3 server); exported features equal live encoding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import zarr

from featbake.store.bucket import Bucket
from featbake.store.url import BucketURL
from tests.conftest import invoke, live_features
from tests.store.remote.conftest import S3


def test_the_commands_take_a_bucket_url(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    tier = ["--local-cache", tmp_path / "tier", "--local-cache-size", "50MiB"]
    built = invoke(
        "build", "-e", encoder_file, "-d", audio_dir, "--cache", s3.url, *tier,
        "--workers", "0", "--shard-size", "60KB", "--json",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["encoded"] == 16
    assert list((tmp_path / "tier").rglob("catalog.sqlite"))  # the named tier was used

    stats = invoke(
        "stats", "--cache", s3.url, "--json", env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "tier")}
    )
    assert stats.returncode == 0, stats.stderr
    held = json.loads(stats.stdout)
    assert held["path"] == s3.url and held["features"] == 16
    assert held["tier"]["version"] == 1 and held["tier"]["budget"] == 100 << 30
    roots = invoke("roots", "--cache", s3.url)
    assert roots.returncode == 0 and "r-" in roots.stdout, roots.stderr

    clean = invoke("verify", "--cache", s3.url)
    assert clean.returncode == 0 and "verify: clean" in clean.stdout, clean.stderr

    out = tmp_path / "feats.zarr"
    exported = invoke("export", "--format", "zarr", out, "--cache", s3.url)
    assert exported.returncode == 0, exported.stderr
    group = zarr.open_group(str(out), mode="r")
    paths = [str(p) for p in group["paths"][:]]
    offsets = group["offsets"][:]
    for i in (0, len(paths) - 1):
        got = torch.from_numpy(np.asarray(group["values"][offsets[i] : offsets[i + 1]]))
        torch.testing.assert_close(got, live_features(encoder_file, audio_dir / paths[i]))

    name = roots.stdout.split("r-", 1)[1].split()[0]
    dropped = invoke("roots", "drop", f"r-{name}", "--cache", s3.url)
    assert dropped.returncode == 0, dropped.stderr
    assert len(s3.objects("catalog/")) == 2  # the drop went out as the next version
    assert "r-" not in invoke("roots", "--cache", s3.url).stdout

    shard = s3.objects("shards/")[0]
    Bucket(BucketURL.parse(s3.url)).delete([shard])
    damaged = invoke("verify", "--cache", s3.url, env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "v")})
    assert damaged.returncode == 11, damaged.stderr
    assert "missing" in damaged.stdout and Path(shard).stem in damaged.stdout
    refused = invoke("verify", "--cache", s3.url, "--repair")
    assert refused.returncode == 2 and "not built for a bucket" in refused.stderr
