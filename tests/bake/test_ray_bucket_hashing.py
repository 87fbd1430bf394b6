"""A Ray build of a bucket prefix (``--data s3://bucket/audio/``) hashes its new objects in Ray
tasks: the driver GETs none of them. The build runs in a process of its own that starts its own
local Ray instance, so its workers inherit the loopback server's environment as a node's workers
inherit their node's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.objects import ObjectStore
from featbake.store.url import BucketURL
from featbake.testing import write_audio_folder
from tests.conftest import REPO, live_features
from tests.helpers import stored_features
from tests.store.bucket.conftest import (  # noqa: F401  (fixtures, shared)
    S3,
    s3,
    s3_server,
)

pytest.importorskip("ray")
pytest.importorskip("ray.data")

pytestmark = pytest.mark.slow

#: The driver of a Ray build whose every object GET to hash raises (Ray's workers import
#: featbake afresh: the patch stays in this process); prints the report.
DRIVER = """
import json, sys
from featbake.bake.pipeline import build
from featbake.bake.ray_engine import RayEngine
from featbake.store.byteplace import Objects

def refused(self, path, expect, held=None):
    raise AssertionError(f"the driver read {path} to hash it")

Objects.digest = refused
engine = RayEngine(workers=1, cluster_hashing_from=1)
report = build(sys.argv[1], sys.argv[2], cache=sys.argv[3], engine=engine)
print(json.dumps({"root": report.root, "encoded": report.encoded, "failed": report.failed}))
"""


def test_a_ray_build_of_a_bucket_prefix_hashes_its_objects_in_ray_tasks(
    s3: S3,  # noqa: F811  (the fixture imported above)
    encoder_file: Path,
    tmp_path: Path,
) -> None:
    clips = tmp_path / "audio"
    write_audio_folder(clips, 4, seconds=(0.2, 0.5), seed=11)
    url = f"s3://{s3.bucket}/audio/"
    bucket = ObjectStore(BucketURL.parse(url))
    for p in sorted(clips.iterdir()):
        bucket.upload(p.name, p)
    store = tmp_path / "store"
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, url, str(encoder_file), str(store)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (report["encoded"], report["failed"]) == (4, [])
    plain = build(url, encoder_file, cache=tmp_path / "plain", workers=0)
    with Catalog(Layout(store), read_only=True) as ray_cat:
        keys = dict(ray_cat.root_items(report["root"]))
        cached = ray_cat.cached_hashes([url + p.name for p in clips.iterdir()])
    with Catalog(Layout(tmp_path / "plain"), read_only=True) as plain_cat:
        assert keys == dict(plain_cat.root_items(plain.root))
    assert len(cached) == 4  # objects are never racy: a rebuild reads none
    for rel, parts in stored_features(store, report["root"]).items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, clips / rel), msg=rel)
