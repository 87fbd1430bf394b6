"""Upkeep over a bucket store with several catalog versions: gc racing the builds and merges that
publish them (round seven, upkeep). Served features are compared with the encoder run now."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import StoreError
from featbake.store.bucket import BucketStore, merge_bucket
from featbake.store.catalog import Catalog
from featbake.store.fragment_catalog import FragmentCatalog
from featbake.store.fragments import sealed_fragments
from featbake.store.objects import ObjectStore
from featbake.store.place import removed_leftover
from featbake.upkeep import GcOptions, VerifyReport, drop_root, gc, stats, verify
from featbake.upkeep.gc import CRASH_ENV, GcPlan
from tests.conftest import REPO, live_features, run_cli
from tests.store.bucket.conftest import S3, bucket_store

#: gc as eager as it can be: no grace, no retention.
EAGER = GcOptions(grace=0.0, retention=0.0)


def test_gc_of_a_bucket_keeps_what_parts_sealed_after_its_plan(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A bucket store built (version 1), its root dropped (version 2), then gc: after its plan
    (every row unreached) the same data is built again in two parts, which find every feature
    stored and upload their done fragments naming the 16 keys. gc's look at the fragments just
    before its DELETE read the copy of the catalog it works on, where no fragment is, so it
    deleted the 16 rows (version 3) and swept their shard objects; the merge then published
    a root of 16 items, every one missing. It reads the bucket's fragments now."""
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    drop_root(bucket_store(s3.url, tmp_path / "dropper").layout, first.root)

    def parts_meanwhile(plan: GcPlan) -> None:
        assert len({r.key for r in plan.unreached}) == 16
        for part in ("0/2", "1/2"):
            again = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
            assert again.encoded == 0  # reused what the plan will delete

    done = gc(bucket_store(s3.url, tmp_path / "gc").layout, EAGER, on_plan=parts_meanwhile)
    assert done.rows_deleted == 0 and done.shards_deleted == 0

    assert merge_bucket(bucket_store(s3.url, tmp_path / "merger")).roots == [first.root]
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert len(ds) == 16
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


def test_a_root_dropped_stays_dropped_when_gc_runs_on_a_node_that_copied_its_fragments(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A build in two parts into a bucket; node A brings the fragments into its tier (as a
    build or gc there does), node B merges them (version 1, the fragments deleted from the
    bucket), the root is dropped (version 2), then gc runs on node A. Before, gc's first step
    merged the copies A still held: version 3 published the dropped root again, and gc freed
    nothing. Now a merge folds only fragments the bucket holds, and a tier lets go of copies
    whose object is gone, so gc frees the 16 features."""
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    assert bucket_store(s3.url, tmp_path / "a").sync_fragments() == 4
    (root,) = merge_bucket(bucket_store(s3.url, tmp_path / "b")).roots
    drop_root(bucket_store(s3.url, tmp_path / "c").layout, root)

    done = gc(bucket_store(s3.url, tmp_path / "a").layout, EAGER)
    assert done.rows_deleted == 16 and done.roots_dropped == []
    reader = bucket_store(s3.url, tmp_path / "d")
    reader.sync_catalog()
    with Catalog(reader.layout, read_only=True) as catalog:
        assert catalog.roots() == [] and catalog.unreached_features() == []
    assert sealed_fragments(bucket_store(s3.url, tmp_path / "a").layout) == []
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_gc_killed_on_a_bucket_store_leaves_no_catalog_copy_behind_for_ever(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """gc of a bucket store works on a copy of the newest catalog version in the tier's
    ``tmp/work-*`` folder and publishes it as the next one. Killed there (SIGKILL, between its
    DELETE and its publish), it published nothing, and its copy stayed: the tier's sweep left
    ``tmp/`` alone and a directory's sweep takes files only, so every killed gc, merge or drop
    left a whole catalog on the node's disk. The rerun's sweep removes such folders once past
    the grace period; the store is whole throughout."""
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "gc"
    drop_root(bucket_store(s3.url, tier).layout, first.root)
    versions = s3.objects("catalog/")
    killed = run_cli(
        "gc", "--cache", s3.url, "--local-cache", tier, "--grace", "0s", "--retention", "0s",
        env={**s3.env, CRASH_ENV: "rows-deleted"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert s3.objects("catalog/") == versions  # nothing published
    (left,) = bucket_store(s3.url, tier).layout.tmp.glob("work-*")
    assert (left / "catalog.sqlite").exists()

    done = gc(bucket_store(s3.url, tier).layout, EAGER)
    assert done.rows_deleted == 16 and done.tmp_removed == 1
    assert not left.exists()
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_part_into_a_bucket_that_a_gc_raced_says_so_and_its_rerun_encodes_what_went(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket store built, its root dropped, then built again in two parts; part 0/2 finds
    its 8 features stored and reuses them, and a gc on another node publishes a version
    without them before the part seals its done fragment. Before, the part sealed it anyway
    and the merge published a root with those 8 items missing. Now the part looks its reused
    keys up again in the newest version first and stops in one line; its rerun encodes them."""
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    drop_root(bucket_store(s3.url, tmp_path / "dropper").layout, first.root)
    sealing = FragmentCatalog.finish
    deleted: list[int] = []

    def gc_then_finish(self: FragmentCatalog) -> str | None:
        if self.part is not None and self.part.rank == 0 and not deleted:
            deleted.append(gc(bucket_store(s3.url, tmp_path / "gc").layout, EAGER).rows_deleted)
        return sealing(self)

    monkeypatch.setattr(FragmentCatalog, "finish", gc_then_finish)
    with pytest.raises(StoreError, match="run this part again") as e:
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard="0/2")
    assert deleted == [16] and "\n" not in str(e.value)
    monkeypatch.setattr(FragmentCatalog, "finish", sealing)
    for part in ("0/2", "1/2"):
        assert build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part).encoded == 8

    assert merge_bucket(bucket_store(s3.url, tmp_path / "merger")).roots == [first.root]
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert ds.stored() == len(ds) == 16
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


#: ``featbake verify`` of a bucket store killed (SIGKILL) once it brought its first shard into
#: the tier's scratch folder to check it, as a preempted node kills it.
VERIFY_KILLED = """
import os, signal, sys
from featbake.store.bucket import BucketStore
from featbake.upkeep import verify
download = BucketStore.download_shard
def download_then_die(self, name, dest):
    download(self, name, dest)
    os.kill(os.getpid(), signal.SIGKILL)
BucketStore.download_shard = download_then_die
verify(sys.argv[1], local_cache=sys.argv[2])
"""


def test_a_verify_killed_on_a_bucket_store_leaves_no_scratch_folder_behind_for_ever(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round eight, upkeep: verify of a bucket store brings each shard into the tier's
    ``tmp/verify/`` to check it and removes the folder when done; killed, it left the folder
    (a whole shard in it), and the tier's sweep took only ``tmp/work-*``: it stayed for ever.
    The sweep removes it too now, once nothing in it changed for the grace period."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", VERIFY_KILLED, s3.url, str(tier)]
    killed = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    tmp = bucket_store(s3.url, tier).layout.tmp
    (scratch,) = tmp.glob("verify*")  # the killed verify's own
    (copy,) = scratch.glob("*/*.safetensors")  # the shard it was checking
    # stats counts what the sweep takes, by the sweep's own rule (round nine, upkeep)
    seen = stats(bucket_store(s3.url, tier).layout)
    assert (seen.tmp_files, seen.tmp_bytes) == (1, copy.stat().st_size)
    # and verify's note, by the same rule (its own scratch, made after, is not counted)
    noted = verify(s3.url, local_cache=tier)
    assert noted.status == "clean"
    assert [f.detail.split(" left ")[0] for f in noted.findings if f.kind == "tmp-leftovers"] == [
        f"1 leftovers ({seen.tmp_bytes} bytes)"
    ]

    done = gc(bucket_store(s3.url, tier).layout, EAGER)
    assert (done.rows_deleted, done.tmp_removed) == (0, 1)
    assert not scratch.exists()
    assert not list(tmp.glob("swept-*"))
    assert verify(s3.url, local_cache=tier).status == "clean"


def test_two_verifies_of_a_bucket_store_on_one_node_keep_to_their_own_scratch(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: every verify of a bucket store on one node brought its shards into
    the same ``tmp/verify/`` and removed that folder when done, so a second verify that ended
    while the first was bringing a shard in removed the first one's folder under it: the first
    reported a sound shard "deleted while verify ran". Each verify has a scratch of its own
    now (``tmp/verify-<id>``), removed at its end."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    download = BucketStore.download_shard
    started: list[bool] = []
    second: list[VerifyReport] = []

    def first_download_waits_for_a_whole_verify(self: BucketStore, name: str, dest: Path) -> None:
        if not started:  # the first verify's first shard: a second verify runs from start to end
            started.append(True)
            second.append(verify(s3.url, local_cache=tier))
        download(self, name, dest)

    monkeypatch.setattr(BucketStore, "download_shard", first_download_waits_for_a_whole_verify)
    first = verify(s3.url, local_cache=tier)
    assert [r.status for r in second] == ["clean"]
    assert first.status == "clean", [f.detail for f in first.findings]
    assert first.shards_checked == second[0].shards_checked > 1
    assert not list(bucket_store(s3.url, tier).layout.tmp.glob("verify*"))


#: gc of a bucket store killed (SIGKILL) once it brought an older catalog version into the
#: tier's ``tmp/`` to read the shards it names (its plan keeps versions within the retention).
GC_KILLED = """
import os, signal, sys
from featbake.store import bucket
from featbake.store.open import open_store
from featbake.upkeep import GcOptions, gc
shards = bucket.catalog_shards
def read_then_die(path, **how):
    if path.parent.name == "tmp":
        os.kill(os.getpid(), signal.SIGKILL)
    return shards(path, **how)
bucket.catalog_shards = read_then_die
gc(open_store(sys.argv[1], local_cache=sys.argv[2]), GcOptions(grace=0.0))
"""


def test_a_gc_killed_reading_an_older_version_leaves_no_catalog_copy_behind_for_ever(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round nine, upkeep: gc of a bucket store brings each catalog version it keeps but the
    tier's own into the tier's ``tmp/`` as a file (``gc-v<n>.<id>.sqlite``) to read the shards
    it names. Killed then, it left the file, and the tier's sweep took folders only: a whole
    catalog stayed on the node's disk for ever, and stats never counted it. The tier's files
    in ``tmp/`` (but its lock) are leftovers now, by the one rule stats and the sweep share."""
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    drop_root(bucket_store(s3.url, tier).layout, first.root)  # version 2, version 1 kept
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", GC_KILLED, s3.url, str(tier)]
    killed = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    tmp = bucket_store(s3.url, tier).layout.tmp
    (copy,) = tmp.glob("gc-v1.*.sqlite")
    seen = stats(bucket_store(s3.url, tier).layout)
    assert (seen.tmp_files, seen.tmp_bytes) == (1, copy.stat().st_size)

    done = gc(bucket_store(s3.url, tier).layout, EAGER)
    assert done.rows_deleted == 16 and done.tmp_removed == 1
    assert not copy.exists()
    assert (tmp / "catalog.lock").exists()  # the tier's lock is no leftover
    assert stats(bucket_store(s3.url, tier).layout).tmp_files == 0
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_gc_whose_copy_of_an_older_version_is_swept_under_it_deletes_nothing(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard the rule above needs: the copy of a kept version gc brings into ``tmp/`` is a
    file another gc's sweep on the node may take (with a grace shorter than the read). Read as
    a catalog that names nothing, the version's shards would go within the retention period;
    gc stops in one line instead, and nothing is deleted."""
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    drop_root(bucket_store(s3.url, tier).layout, first.root)  # version 2, version 1 kept
    before = s3.objects()
    download = ObjectStore.download

    def download_then_lose(self: ObjectStore, name: str, dest: Path) -> int:
        got = download(self, name, dest)
        if dest.name.startswith("gc-v"):
            dest.unlink()  # another gc's sweep took it
        return got

    monkeypatch.setattr(ObjectStore, "download", download_then_lose)
    with pytest.raises(StoreError, match="nothing was deleted: run gc again") as e:
        gc(bucket_store(s3.url, tier).layout, GcOptions(grace=0.0))
    assert "\n" not in str(e.value)
    assert s3.objects() == before


def test_a_merge_whose_catalog_copy_a_gc_sweep_took_says_so_in_one_line(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round nine, upkeep: a merge (gc, drop) works on a catalog copy in the tier's
    ``tmp/work-*``; a gc on the same node whose grace is shorter than the change has run may
    take that folder as a killed change's leftover. The change then fails in one line that
    says what happened and what to do, publishes nothing, and a rerun merges."""
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    versions = s3.objects("catalog/")
    swept: list[int] = []

    def sweep_the_tier(step: str) -> None:
        if not swept:  # gc --grace 0s on this node, its sweep of the tier's tmp/
            swept.extend(n for n in map(removed_leftover, store.leftovers()) if n is not None)

    with pytest.raises(StoreError, match="run it again") as e:
        merge_bucket(store, between=sweep_the_tier)
    assert len(swept) == 1 and "\n" not in str(e.value)
    assert s3.objects("catalog/") == versions
    assert merge_bucket(bucket_store(s3.url, tier)).roots
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_verify_whose_scratch_a_gc_sweep_took_checks_every_shard_still(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: verify of a bucket store brings each shard into its scratch in the
    tier's ``tmp/``; a gc on the same node whose grace is shorter than the verify takes that
    folder as a killed verify's leftover. The shard's download then failed and verify reported
    a sound shard "deleted while verify ran". It asks the bucket whether the shard is there,
    and brings it in again into its scratch made anew."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    download = BucketStore.download_shard
    swept: list[int] = []

    def sweep_then_download(self: BucketStore, name: str, dest: Path) -> None:
        if not swept:  # gc --grace 0s on this node, its sweep of the tier's tmp/
            swept.extend(n for n in map(removed_leftover, store.leftovers()) if n is not None)
        download(self, name, dest)

    monkeypatch.setattr(BucketStore, "download_shard", sweep_then_download)
    report = verify(s3.url, local_cache=tier)
    assert len(swept) == 1  # the verify's scratch
    assert report.status == "clean", [f.detail for f in report.findings]
    assert report.shards_checked == len(store.named_shards()) > 1
    assert not list(store.layout.tmp.glob("verify*"))
