"""gc on a bucket store while readers hold an older catalog version: nothing a kept version
names is deleted within the retention period; after it, a reader of the old version encodes
what it lost live. Every served feature is compared with running the encoder now. gc and verify
are one algorithm over a place: the same tests run on a directory and on a bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import ConfigError
from featbake.progress import GcProgress
from featbake.store.bucket import shard_object
from featbake.store.catalog import open_sqlite
from featbake.store.hash_cache import RACY_NS
from featbake.store.layout import Layout
from featbake.store.objects import ObjectStore
from featbake.store.open import open_store, place_of
from featbake.store.shard import write_shard
from featbake.store.url import BucketURL
from featbake.store.versions import newest, version_name
from featbake.testing import write_audio_folder
from featbake.units import format_bytes
from featbake.upkeep import GcOptions, execute_gc, gc, plan_gc, verify
from featbake.upkeep.check import verify_named
from featbake.upkeep.gc import GcPlan, GcResult
from tests.conftest import REPO, invoke, live_features
from tests.helpers import age, change_every_other_clip
from tests.store.bucket.conftest import S3, Place, Remote, bucket_store

HOUR = 3600.0


def assert_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def readers_hash_the_inputs_again(data: Path) -> None:
    """Give the inputs a stat the build's hash rows do not match, older than the racy window
    when the readers open: the readers then record hash rows, and seal them in serving
    fragments, whatever the machine's speed. Before, whether they did depended on it: files
    hashed by the build within 1 s of being written are racy, their rows dropped, and the
    readers recorded them; on a busy machine the build came later, kept the rows, the readers
    had nothing to record, and gc found no fragment (2 catalog versions, not 3)."""
    for wav in data.rglob("*.wav"):
        age(wav, 60.0)  # same bytes, same keys; a new mtime (and ctime)
    time.sleep(RACY_NS / 1e9 + 0.1)  # a lower bound on time passed: the same on any machine


def test_gc_keeps_what_an_older_version_names_until_the_retention_period_passes(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    shards = place.objects("shards/")
    readers_hash_the_inputs_again(audio_dir)
    # Two readers open the store now (version 1), before gc drops the root.
    holder = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "r1", on_miss="error"
    )
    late = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "r2", write_back=False
    )
    later = time.time() + 100  # the root is unused for 100 s: --older-than 1s drops it
    first = gc(
        bucket_store(place.url, tmp_path / "gc").layout,
        GcOptions(older_than=1.0, retention=HOUR),
        now=later,
    )
    assert first.published and first.roots_dropped
    assert first.shards_deleted == 0 and first.versions_deleted == 0
    # gc folded the readers' serving fragments first (version 2; issue 28 item 7), then
    # published its own change (version 3).
    assert place.objects("shards/") == shards and len(place.objects("catalog/")) == 3
    assert_live(holder, encoder_file)  # read from the bucket through version 1: stored, not live
    assert holder.cache_info().encoded == 0

    layout = bucket_store(place.url, tmp_path / "gc").layout
    second = gc(layout, GcOptions(retention=HOUR), now=later + 2 * HOUR)
    assert second.versions_deleted == 2 and second.shards_deleted == len(shards)
    assert not place.objects("shards/") and place.objects("catalog/") == [
        "catalog/v000000003.sqlite"
    ]
    # A reader still on version 1 after the retention period: its shards are gone, so it
    # encodes live (this one never fetched them), and serves nothing wrong.
    assert_live(late, encoder_file)
    assert late.cache_info().encoded == len(late)


def test_gc_keeps_young_unnamed_shards_and_the_cli_says_so(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    time.sleep(1.5)  # the root is now unused for longer than --older-than 1s
    dry = invoke("gc", "--cache", place.url, "--older-than", "1s", "--grace", "2h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    # --grace is a directory's age: said to do nothing here, in one line, and nothing else is
    assert dry.stderr.strip() == (
        f"note: --grace does nothing for a bucket store ({place.url}): it sets how long gc "
        "leaves a directory store's unnamed shards and tmp/ files alone (a bucket store's "
        "unnamed shards wait out --retention)"
    )
    assert "dry run" in dry.stdout and "would delete 0 old catalog versions" in dry.stdout
    done = invoke("gc", "--cache", place.url, "--older-than", "1s")
    assert done.returncode == 0, done.stderr
    # The root went in a new version; its shards are unnamed now but young: kept (7 days).
    assert "unnamed shards kept" in done.stdout and place.objects("shards/")
    assert len(place.objects("catalog/")) == 2


def test_retention_0s_keeps_a_just_uploaded_unnamed_shard_for_an_hour(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A build into a bucket uploads each shard as it seals it and names it in a fragment
    later, in batches: ``gc --retention 0s`` beside a running build deleted half its shards
    (the build reported every item stored; readers missed). A shard object nothing names is
    kept an hour at least, and gc says so; older, it goes."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    uploaded = plant_unnamed_shard(s3.url, tmp_path)  # as a running build's, not named yet
    done = invoke("gc", "--cache", s3.url, "--retention", "0s")
    assert done.returncode == 0, done.stderr
    assert "1 unnamed shards kept until they pass the retention period (an hour at" in (
        " ".join(done.stdout.split())
    ), done.stdout
    assert shard_object(uploaded) in s3.objects("shards/")
    store = bucket_store(s3.url, tmp_path / "gc")
    later = gc(store.layout, GcOptions(retention=0.0), now=time.time() + HOUR + 60)
    assert later.orphans_removed == 1
    assert shard_object(uploaded) not in s3.objects("shards/")


def test_a_reader_whose_shards_gc_deleted_finds_a_rebuild_through_the_newest_version(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    reader = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "r", write_back=False
    )
    later = time.time() + 100
    store = bucket_store(place.url, tmp_path / "gc")
    gc(store.layout, GcOptions(older_than=1.0, retention=HOUR), now=later)
    gc(store.layout, GcOptions(retention=HOUR), now=later + 2 * HOUR)
    assert not place.objects("shards/")
    # Built again by another node, into other shards (another shard size: other names).
    again = open_store(place.url, local_cache=tmp_path / "other")
    build(audio_dir, encoder_file, cache=again, workers=0, shard_bytes=200_000)
    assert place.objects("shards/")
    assert_live(reader, encoder_file)  # its version-1 shards are gone: looked up in the newest
    assert reader.cache_info().encoded == 0


# -- one gc, one verify, any place (issue 27 item 1) ----------------------------------------------
# ``place_store`` (conftest.py): a directory, then a bucket of each scheme.
def plant_unnamed_shard(store: str, tmp: Path) -> str:
    """A sound shard the place holds and nothing names (a build killed before its commit)."""
    layout = open_store(store)
    scratch = layout if layout.remote is None else Layout(tmp / "scratch")
    sealed = write_shard(scratch, {"a" * 64: torch.ones(3)}, "e" * 64, "r" * 64)
    if layout.remote is not None:
        ObjectStore(BucketURL.parse(store)).upload(shard_object(sealed.name), sealed.path)
    return sealed.name


def test_one_gc_plans_commits_and_sweeps_a_directory_and_a_bucket_alike(
    place_store: str, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    report = build(audio_dir, encoder_file, cache=place_store, workers=0, shard_bytes=60_000)
    orphan = plant_unnamed_shard(place_store, tmp_path)
    later = time.time() + 2 * HOUR  # the root is unused, the orphan older than either age
    opts = GcOptions(older_than=1.0, grace=HOUR, retention=HOUR)

    plan = plan_gc(place_store, opts, now=later)  # the same frozen plan, whatever the place
    assert [d.name for d in plan.drop_roots] == [report.root]
    assert [Path(h.name).stem for h in plan.orphan_shards] == [orphan]
    assert len(plan.unreached) == 16 and plan.changes_catalog
    result = execute_gc(plan)
    assert result.roots_dropped == [report.root] and result.rows_deleted == 16
    assert result.published and result.orphans_removed == 1
    place = place_of(open_store(place_store))
    assert orphan not in place.shard_objects()
    # The next run sweeps what the dropped root's shards were (a directory already deleted
    # them with their rows; a bucket's retired version named them): nothing is left.
    gc(place_store, GcOptions(grace=HOUR, retention=HOUR), now=later + 2 * HOUR)
    assert place.shard_objects() == {} and place.named_shards() == {}
    assert plan_gc(place_store, opts, now=later + 2 * HOUR).nothing_to_do


def test_the_python_gc_and_the_cli_agree_on_either_place(
    place_store: str, audio_dir: Path, encoder_file: Path
) -> None:
    report = build(audio_dir, encoder_file, cache=place_store, workers=0, shard_bytes=60_000)
    time.sleep(1.1)  # the root is now unused for longer than --older-than 1s
    args = ("gc", "--cache", place_store, "--older-than", "1s", "--json")
    dry = invoke(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    said = json.loads(dry.stdout)["plan"]
    planned = gc(place_store, GcOptions(older_than=1.0), dry_run=True)
    assert [d["name"] for d in said["roots_dropped"]] == planned.roots_dropped == [report.root]
    assert said["unreached_features"] == planned.rows_deleted == 16
    assert said["store"] == str(place_of(open_store(place_store)))
    done = invoke(*args)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)["result"]
    assert got["roots_dropped"] == planned.roots_dropped and got["published"]
    assert got["rows_deleted"] == planned.rows_deleted
    assert gc(place_store, GcOptions(older_than=1.0), dry_run=True).rows_deleted == 0


def test_verify_reads_what_either_place_names_and_repair_is_the_place_s_call(
    place_store: str, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place_store, workers=0, shard_bytes=60_000)
    layout = open_store(place_store)
    place = place_of(layout)
    assert verify_named(layout).status == "clean"  # one check of the place's own bytes
    name = sorted(place.named_shards())[0]
    bad = tmp_path / "bad.safetensors"
    place.download_shard(name, bad)
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    if layout.remote is None:
        layout.shard_path(name).chmod(0o644)
        layout.shard_path(name).write_bytes(bytes(data))
    else:
        ObjectStore(BucketURL.parse(place_store)).upload(shard_object(name), bad)
    (finding,) = verify_named(layout).remaining
    assert finding.subject == place.shard_where(name) and finding.kind == "corrupt-shard"
    assert verify(place_store).status == "damaged"
    if place.repair_refusal() is None:
        assert verify(place_store, repair_damage=True).status == "repaired"
    else:
        with pytest.raises(ConfigError, match="not built for a bucket store"):
            verify(place_store, repair_damage=True)


# -- reads count as use ----------------------------------------------------------------------
DAY = 86400.0

READ_ALL = """
import sys
from featbake import CachedFeatureDataset
data, encoder, cache, tier = sys.argv[1:5]
ds = CachedFeatureDataset(data, encoder, cache=cache, local_cache=tier, on_miss="error")
for i in range(len(ds)):
    ds[i]
"""


def read_in_a_fresh_process(place: Place, data: Path, encoder: Path, tier: Path) -> None:
    """Read every item of ``data``'s root from the bucket in a new Python process (on_miss
    "error": each is a stored feature) that exits without closing the dataset."""
    done = subprocess.run(
        [sys.executable, "-c", READ_ALL, str(data), str(encoder), place.url, str(tier)],
        env={**place.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr


def age_every_build(place: Place, work: Path, days: float) -> None:
    """Publish the next catalog version with every root built, and every feature last used,
    ``days`` ago."""
    bucket = ObjectStore(BucketURL.parse(place.url))
    version = newest(o.name for o in bucket.list("catalog/"))
    edited = work / "aged.sqlite"
    bucket.download(version_name(version), edited)
    then = time.time() - days * DAY
    conn = open_sqlite(edited)
    conn.execute("UPDATE roots SET created=?, last_used=?", (then, then))
    conn.execute("UPDATE features SET last_used=?", (then,))
    conn.close()
    bucket.upload(version_name(version + 1), edited, create=True)


def test_gc_older_than_keeps_a_bucket_root_a_fresh_process_read_and_drops_one_unread(
    place: Place, encoder_file: Path, tmp_path: Path
) -> None:
    """Round four item 10: a bucket store dropped a root a dataset read that day. The reading
    process sealed its last uses into a serving fragment at exit, but the upload (boto3's
    upload_file, a thread pool) failed once the interpreter refused new threads, in silence;
    a process that called close() was fine. Small objects now go up in one request on the
    calling thread. The builds are aged by publishing the next catalog version with their
    times 40 days back; the read is now, in a fresh process; gc runs on another node."""
    read, unread = tmp_path / "read", tmp_path / "unread"
    write_audio_folder(read, 3, seconds=0.3, seed=21)
    write_audio_folder(unread, 3, seconds=0.3, seed=22)
    names = {d: build(d, encoder_file, cache=place.url, workers=0).root for d in (read, unread)}
    age_every_build(place, tmp_path, days=40)
    read_in_a_fresh_process(place, read, encoder_file, tmp_path / "reader")
    # A dry run folds nothing in: it counts the uses waiting in the bucket's fragments.
    node = open_store(place.url, local_cache=tmp_path / "dry")
    assert gc(node, GcOptions(older_than=DAY), dry_run=True).roots_dropped == [names[unread]]
    done = gc(open_store(place.url, local_cache=tmp_path / "gc"), GcOptions(older_than=DAY))
    assert done.roots_dropped == [names[unread]]
    kept = CachedFeatureDataset(
        read, encoder_file, cache=place.url, local_cache=tmp_path / "after", on_miss="error"
    )
    assert_live(kept, encoder_file)  # every feature of the kept root served, none encoded
    kept.close()


def test_a_bucket_gc_counts_no_bytes_of_a_leftover_another_gc_removed(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round nine, upkeep: up9.6 counts only the leftovers a run removed itself
    (``tmp_removed``); a bucket's sweep still reported the plan's bytes as freed, the bytes of
    a leftover another gc on the node took first too. It counts what it removed."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    store = bucket_store(s3.url, tmp_path / "node")
    left = store.layout.tmp / "work-killed"
    left.mkdir(parents=True)
    (left / "catalog.sqlite").write_bytes(b"x" * 5000)
    for p in (left / "catalog.sqlite", left):
        age(p, 7200)
    plan = plan_gc(store.layout, GcOptions(grace=3600.0))
    assert [Path(h.name).name for h in plan.sweep.loose] == ["work-killed"]
    (left / "catalog.sqlite").unlink()  # another gc on the node took it first
    left.rmdir()
    done = execute_gc(plan)
    assert (done.tmp_removed, done.bytes_freed) == (0, 0)


def named_bytes(url: str, tier: Path) -> int:
    """The bytes of the shards the bucket's newest catalog version names (read from ``tier``)."""
    store = bucket_store(url, tier)
    store.sync_catalog()
    return sum(store.named_shards().values())


def test_gc_max_bytes_on_a_bucket_deletes_whole_shards_and_plans_no_rewrite(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A bucket store never rewrites a shard, so ``gc --max-bytes`` evicts whole shards, least
    recently used first, until those left fit. Before, the byte budget forced a rewrite back
    on: the dry run said "1 rewritten", and the run warned that the shard "is gone" from its
    catalog copy's folder and to run `featbake verify --repair`, which a bucket refuses. The
    dry run and the run agree, and every item serves equal to the encoder now (the evicted
    ones encoded again)."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=16_384)
    budget = named_bytes(s3.url, tmp_path / "before") // 2
    args = ("gc", "--cache", s3.url, "--max-bytes", str(budget), "--json")
    dry = invoke(*args, "--dry-run", env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "dry")})
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)["plan"]
    assert plan["shards_rewritten"] == 0 and plan["shards_deleted"] >= 1, plan
    assert plan["over_budget_bytes"] == 0

    ran = invoke(*args, env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "gc")})
    assert ran.returncode == 0 and "warning" not in ran.stderr and "note" not in ran.stderr, (
        ran.stderr
    )
    done = json.loads(ran.stdout)
    assert done["plan"]["shards_deleted"] == plan["shards_deleted"]
    assert done["plan"]["evicted_features"] == plan["evicted_features"]
    assert done["result"]["shards_written"] == 0
    assert named_bytes(s3.url, tmp_path / "after") <= budget
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r")
    assert_live(ds, encoder_file)


def test_gc_max_bytes_on_a_bucket_says_what_shards_a_part_not_merged_keep_hold(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A bucket store built whole, then part 0/2 of a build in two parts (its `done` fragment
    names the 8 stored features it reused, and no merge ran): the shards holding them stay
    whole, and one note, the same in the dry run and the run, says by how much the budget
    stays exceeded, who holds what, and what stays beside them in those shards."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=100_000)
    part0 = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard="0/2")
    assert part0.reused == 8
    args = ("gc", "--cache", s3.url, "--max-bytes", "1")
    dry = invoke(*args, "--dry-run", env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "dry")})
    ran = invoke(*args, env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "gc")})
    notes = [
        [line for line in r.stderr.splitlines() if "over --max-bytes" in line] for r in (dry, ran)
    ]
    assert dry.returncode == ran.returncode == 0 and "warning" not in ran.stderr, ran.stderr
    assert len(notes[0]) == 1 and notes[0] == notes[1], (dry.stdout, ran.stderr)
    left = named_bytes(s3.url, tmp_path / "after")
    assert f"gc stays {format_bytes(left - 1)} over --max-bytes 1 B" in notes[1][0]
    assert "build in parts (1 of 2 done)" in notes[1][0]
    assert "never rewrites a shard" in notes[1][0]
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r")
    assert_live(ds, encoder_file)


def test_gc_runs_on_one_node_take_turns_and_on_two_nodes_race_to_publish_as_merges_do(
    s3: S3,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bucket store's gc lock is in the node's local cache. Two gc runs on one node: the
    second, started once the first has planned, says once that it waits, then plans afresh
    (nothing left to do). Two gc runs on two nodes: neither waits; the first, held inside its
    change of version N, loses the race for N+1 to the other node's gc, runs its steps again on
    N+1 and publishes N+2, as a merge does; N+1 is never overwritten, neither names a problem,
    the other's --max-bytes holds, and every item is served equal to the encoder now."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=16_384)
    change_every_other_clip(audio_dir)
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=16_384)
    heard: list[str] = []
    moved = threading.Event()  # the second gc on the node said it waits (or planned)

    def shown(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if "another gc of" in str(message):  # the one line a gc that waits says
            heard.append(str(message))
            moved.set()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", shown)
        plans = gc_twice_on_one_node(s3.url, tmp_path / "node-a", moved)
        assert len(heard) == 1 and "\n" not in heard[0], heard
        assert f"on this node (local cache {tmp_path / 'node-a'}{os.sep}" in heard[0]
        assert plans[0].changes_catalog and not plans[1].changes_catalog  # planned afresh

        change_every_other_clip(audio_dir, seed=9_000)
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=16_384)
        objects = ObjectStore(BucketURL.parse(s3.url))
        before = newest(o.name for o in objects.list("catalog/"))
        budget = named_bytes(s3.url, tmp_path / "count") // 2  # node b's run evicts too
        other = gc_on_two_nodes(s3.url, tmp_path, objects, GcOptions(max_bytes=budget))
        assert len(heard) == 1  # neither of the two nodes' runs waited
    assert other == objects.head(version_name(before + 1)).etag  # never overwritten
    assert newest(o.name for o in objects.list("catalog/")) == before + 2
    assert named_bytes(s3.url, tmp_path / "after") <= budget
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "r")
    assert len(ds) == 16
    assert_live(ds, encoder_file)  # the evicted items encoded again, the rest served
    ds.close()


#: Bounds on waiting for another thread: a hang fails, a slow machine passes.
BOUND_S = 300.0


def gc_twice_on_one_node(url: str, tier: Path, moved: threading.Event) -> list[GcPlan]:
    """Two gc runs through one local cache: the second started once the first has planned;
    the first held until the second moved on (``moved``: set where it says it waits, or by
    its plan). Both plans, in order."""
    planned, done = threading.Event(), threading.Event()
    plans: list[GcPlan] = []
    results: list[GcResult] = []

    def first(plan: GcPlan) -> None:
        plans.append(plan)
        planned.set()
        assert moved.wait(BOUND_S)

    def second(plan: GcPlan) -> None:
        plans.append(plan)
        moved.set()
        assert done.wait(BOUND_S)

    def run(on_plan: Callable[[GcPlan], None], after: threading.Event) -> None:
        try:
            results.append(gc(open_store(url, local_cache=tier), on_plan=on_plan))
        finally:
            after.set()

    one = threading.Thread(target=run, args=(first, done), daemon=True)
    one.start()
    assert planned.wait(BOUND_S)
    two = threading.Thread(target=run, args=(second, threading.Event()), daemon=True)
    two.start()
    one.join(BOUND_S)
    two.join(BOUND_S)
    assert not one.is_alive() and not two.is_alive() and len(results) == 2
    assert [r.problems for r in results] == [[], []]
    return plans


def gc_on_two_nodes(url: str, tmp: Path, objects: ObjectStore, b_options: GcOptions) -> str:
    """A gc on node a held inside its change (its first step's progress) while a gc on node b
    (with ``b_options``: another change, so another catalog) runs and publishes; then a's
    goes on. The etag of the version b published."""
    inside, published = threading.Event(), threading.Event()
    results: list[GcResult] = []

    def held(progress: GcProgress) -> None:
        if not inside.is_set():
            inside.set()
            assert published.wait(BOUND_S)

    def node_a() -> None:
        results.append(gc(open_store(url, local_cache=tmp / "node-a"), progress=held))

    a = threading.Thread(target=node_a, daemon=True)
    a.start()
    assert inside.wait(BOUND_S)
    try:
        b = gc(open_store(url, local_cache=tmp / "node-b"), b_options)
        mine = objects.head(version_name(newest(o.name for o in objects.list("catalog/"))))
    finally:
        published.set()
    a.join(BOUND_S)
    assert not a.is_alive() and results[0].published and b.published
    assert results[0].problems == [] and b.problems == []
    assert mine is not None
    return mine.etag
