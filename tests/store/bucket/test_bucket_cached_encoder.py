"""CachedEncoder over a bucket store: it writes back through the place as a dataset does, and
another node's process reads the cached rows back, equal to running the module now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder, make_tone
from tests.conftest import REPO, run_cli
from tests.helpers import run_past_a_marker
from tests.store.bucket.conftest import S3, Remote

#: Another node: a CachedEncoder over the bucket, its own local tier; the rows it serves and
#: its counters (rows found in the store, rows encoded) saved for the test.
READER = """
import sys, torch
from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder

url, x_file, out_file = sys.argv[1:]
ce = CachedEncoder(TinyConvEncoder().eval().requires_grad_(False), cache=url, ram_cache=0)
x = torch.load(x_file)
out = ce(x, ids=[f"utt{i}" for i in range(len(x))])
stats = {k: ce.stats[k] for k in ("encoded", "hits_store")}
torch.save({"out": out, **stats}, out_file)
"""


def waves(n: int) -> torch.Tensor:
    return torch.stack([torch.from_numpy(make_tone(0.5, seed=i)[:, 0]) for i in range(n)])


def test_a_cached_encoder_over_a_bucket_caches_and_another_node_reads_it_back(
    place: Remote | S3, tmp_path: Path
) -> None:
    """The Place complete (item 2): CachedEncoder refused a bucket URL (it opened its store as
    a directory, to write its catalog in place). It now writes back as a dataset does over a
    bucket: shards, then a serve fragment naming them, uploaded; `featbake merge` publishes
    them, and a process on another node (its own tier) serves every row from the bucket,
    running the encoder on none, equal to the module run now."""
    x, ids = waves(4), [f"utt{i}" for i in range(4)]
    module = TinyConvEncoder().eval().requires_grad_(False)
    with torch.no_grad():
        now = module(x)
    ce = CachedEncoder(module, cache=place.url, ram_cache=0)
    torch.testing.assert_close(ce(x, ids=ids), now, rtol=1e-5, atol=1e-6)
    ce.flush()
    assert place.objects("shards/") and place.objects("fragments/")  # written through the place
    merged = run_cli("merge", "--cache", place.url, env=place.env)
    assert merged.returncode == 0, merged.stderr
    torch.save(x, tmp_path / "x.pt")
    env = {
        **os.environ, **place.env, "PYTHONPATH": str(REPO),
        "FEATBAKE_LOCAL_CACHE": str(tmp_path / "other-node"),
    }  # fmt: skip
    args = [place.url, str(tmp_path / "x.pt"), str(tmp_path / "got.pt")]
    done = subprocess.run([sys.executable, "-c", READER, *args], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    got = torch.load(tmp_path / "got.pt")
    assert got["encoded"] == 0 and got["hits_store"] == 4, "the other node encoded what was cached"
    torch.testing.assert_close(got["out"], now, rtol=1e-5, atol=1e-6)


#: Two CachedEncoders over one bucket store, one dropped inside a reference cycle with features
#: pending; the live one's flush uploads its shard and trims the local tier under tier.lock,
#: then records its fragment under fragments.lock: the collector runs the dropped one's
#: finalizer under one of them (forced where argv[2] says).
_COLLECTED_IN_A_BUCKET_LOCK = """
import gc, importlib, sys
import torch
from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder, make_tone

url = sys.argv[1]
module = TinyConvEncoder().eval().requires_grad_(False)
x = torch.stack([torch.from_numpy(make_tone(0.5, seed=i)[:, 0]) for i in range(3)])
live = CachedEncoder(module, cache=url, ram_cache=0)
live(x[:1], ids=["live"])  # pending in the live wrapper's write-back
gc.disable()
dropped = CachedEncoder(module, cache=url, ram_cache=0)
dropped(x[1:], ids=["dropped-1", "dropped-2"])  # pending, then dropped in a cycle
dropped.cycle = [dropped]
del dropped
# Where to collect: inside live's trim (under tier.lock), or inside its record of the
# fragments it published (under fragments.lock), whichever lock the dropped one then takes.
module_name, name, lock_file = {
    "tier.lock": ("featbake.store.tier", "evictions", None),
    "fragments.lock": ("featbake.store.bucket", "publish_file", "fragments.seen"),
}[sys.argv[2]]
held_in = importlib.import_module(module_name)
real, collected = getattr(held_in, name), []

def collecting(*args, **kwargs):
    first_under_the_lock = lock_file is None or args[0].name == lock_file
    if first_under_the_lock and not collected:
        collected.append(True)
        gc.collect()  # what any allocation under the lock may do
    return real(*args, **kwargs)

setattr(held_in, name, collecting)
print("flushing", flush=True)
live.flush()
print("flushed", bool(collected), flush=True)
"""


@pytest.mark.parametrize("lock", ["tier.lock", "fragments.lock"])
def test_a_write_back_collected_inside_a_bucket_lock_does_not_hang(s3: S3, lock: str) -> None:
    """``flock`` belongs to an open file, not a process: the finalizer's trim opens tier.lock
    again and waits, with no timeout, on the live trim that the same thread is inside, so the
    live CachedEncoder's flush (any forward that seals) never returns. The same holds of
    fragments.lock, which each publication of a fragment takes to record it."""
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", _COLLECTED_IN_A_BUCKET_LOCK, s3.url, lock]
    assert run_past_a_marker(args, "flushing", env) == "flushed True"
