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

import featbake.store.place as place_mod
from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import StoreCorrupt, StoreError
from featbake.store import bucket as bucket_mod
from featbake.store.bucket import BucketStore, merge_bucket, tier_leftovers
from featbake.store.catalog import Catalog
from featbake.store.files import Taken
from featbake.store.fragment_catalog import FragmentCatalog
from featbake.store.fragments import sealed_fragments
from featbake.store.layout import Layout
from featbake.store.objects import ObjectStore
from featbake.store.open import open_store
from featbake.store.place import Held, removed_leftover
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


def test_a_fragment_retired_between_the_listing_and_its_download_is_passed_over(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another node's merge retires a fragment after this node listed the fragments and before
    it downloads it (two builds of one root at once: one run in four): the build failed with
    ``internal error: FileNotFoundError``. The fragment is passed over (the other node's
    catalog version holds what it named), the rest downloaded."""
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    node = bucket_store(s3.url, tmp_path / "a")
    retired = sorted(o.name for o in node.bucket.list(bucket_mod.FRAGMENTS))[0]
    download = node.bucket.download

    def retired_first(name: str, dest: Path) -> int:
        if name == retired:
            node.bucket.delete([retired])  # the other node's merge, between list and read
        return download(name, dest)

    monkeypatch.setattr(node.bucket, "download", retired_first)
    assert node.sync_fragments() == 3
    assert Path(retired).name not in node.listed_fragments
    assert len(node.listed_fragments) == 3


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
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: a merge (gc, drop) works on a catalog copy in the tier's
    ``tmp/work-*``, which it holds; on a disk without locks, a gc on the same node whose grace
    is shorter than the change has run may take that folder as a killed change's leftover all
    the same. The change then fails in one line that says what happened and what to do,
    publishes nothing, and a rerun merges."""
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    versions = s3.objects("catalog/")
    swept: list[int] = []
    without_locks(monkeypatch)  # a held folder is kept: only a disk without locks loses it

    def sweep_the_tier(step: str) -> None:
        if not swept:  # gc --grace 0s on this node, its sweep of the tier's tmp/
            swept.extend(sweep(tier_leftovers(store.layout.tmp)))

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
    tier's ``tmp/``, which it holds; on a disk without locks, a gc on the same node whose grace
    is shorter than the verify takes that folder as a killed verify's leftover all the same.
    The shard's download then failed and verify reported a sound shard "deleted while verify
    ran". It asks the bucket whether the shard is there, and brings it in again into its
    scratch made anew."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    download = BucketStore.download_shard
    swept: list[int] = []
    without_locks(monkeypatch)  # a held scratch is kept: only a disk without locks loses it

    def sweep_then_download(self: BucketStore, name: str, dest: Path) -> None:
        if not swept:  # gc --grace 0s on this node, its sweep of the tier's tmp/
            swept.extend(sweep(tier_leftovers(store.layout.tmp)))
        download(self, name, dest)

    monkeypatch.setattr(BucketStore, "download_shard", sweep_then_download)
    report = verify(s3.url, local_cache=tier)
    assert len(swept) == 1  # the verify's scratch
    assert report.status == "clean", [f.detail for f in report.findings]
    assert report.shards_checked == len(store.named_shards()) > 1
    assert not list(store.layout.tmp.glob("verify*"))


# -- round nine, upkeep: a live process holds what it uses in the tier's tmp/ ----------------------
# gc --grace 0s on the node, as the rows above model it: ``removed_leftover`` over the tier's
# leftovers, run by a hook at the step named (no sleep).


def sweep(leftovers: list[Held]) -> list[int]:
    """gc --grace 0s on this node: its sweep of the tier's tmp/ (the bytes of each removed)."""
    return [n for n in map(removed_leftover, leftovers) if n is not None]


def without_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep on a disk without locks (NFS without a lock daemon): it cannot tell a held
    scratch from a killed process's, and decides by the grace period alone."""
    monkeypatch.setattr(place_mod, "lock_taken", lambda fd, **how: Taken.NO_LOCKS, raising=False)


def test_a_merge_whose_work_folder_a_sweep_reaches_before_its_records_are_restored_keeps_every_root(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: a sweep that took a merge's ``tmp/work-*`` after its catalog copy
    and before the roots' records were restored let ``restore_records`` make the folder again,
    and the merge folded the fragments into a catalog made anew, empty: the version it
    published had lost every older root. The merge holds its folder now: the sweep keeps it,
    and the version published names both roots."""
    (audio_dir / "broken.wav").write_bytes(b"RIFF\x00\x00junk")  # version 1 carries a record
    first = build(audio_dir, encoder_file, cache=s3.url, workers=0)
    other = tmp_path / "other"
    other.mkdir()
    for clip in sorted(audio_dir.rglob("clip*.wav"))[:4]:
        (other / clip.name).write_bytes(clip.read_bytes())
    for part in ("0/2", "1/2"):  # a second root, waiting in fragments
        second = build(other, encoder_file, cache=s3.url, workers=0, shard=part)
    store = bucket_store(s3.url, tmp_path / "node")
    restore = bucket_mod.restore_records
    tried: list[list[int]] = []

    def swept_then_restored(work: Layout, records: dict[str, str]) -> None:
        if not tried:  # the sweep between the copy and its records
            tried.append(sweep(tier_leftovers(store.layout.tmp)))
        restore(work, records)

    monkeypatch.setattr(bucket_mod, "restore_records", swept_then_restored)
    merge_bucket(store)
    assert tried == [[]]  # the work folder, held, was kept
    with Catalog(open_store(s3.url, local_cache=tmp_path / "reader")) as catalog:
        roots = {r.name for r in catalog.roots()}
    assert {first.root, second.root} <= roots
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_merge_whose_work_folder_is_swept_and_made_again_publishes_nothing(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same sweep on a disk without locks takes the work folder, and ``restore_records``
    makes it again: the change is lost by the folder's identity (not by a name being there),
    so it fails in one line and publishes nothing."""
    (audio_dir / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    store = bucket_store(s3.url, tmp_path / "node")
    versions = s3.objects("catalog/")
    restore = bucket_mod.restore_records
    swept: list[int] = []
    without_locks(monkeypatch)

    def swept_then_restored(work: Layout, records: dict[str, str]) -> None:
        if not swept:
            swept.extend(sweep(tier_leftovers(store.layout.tmp)))
        restore(work, records)  # makes tmp/work-* again

    monkeypatch.setattr(bucket_mod, "restore_records", swept_then_restored)
    with pytest.raises(StoreError, match="run it again") as e:
        merge_bucket(store)
    assert len(swept) == 1 and "\n" not in str(e.value)
    assert s3.objects("catalog/") == versions


def test_a_merge_swept_while_it_makes_its_catalog_standalone_merges(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: a sweep renamed the merge's work folder aside while the merge
    opened its catalog (which failed) and back (the folder had changed since its plan); the
    guard asked only whether the folder was there, so SQLite's own error went up raw. The
    merge holds its folder now: the sweep keeps it and never weighs it, and the merge goes on."""
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    store = bucket_store(s3.url, tmp_path / "node")
    standalone = bucket_mod._standalone
    weigh = place_mod.held_folder
    kept: list[object] = []
    ran: list[bool] = []

    def standalone_during_a_sweep(work: Layout) -> None:
        (held,) = [h for h in tier_leftovers(store.layout.tmp) if "work-" in h.name]
        planned = held._replace(modified=held.modified - 1)  # planned before the merge wrote

        def weigh_after(folder: Path) -> Held | None:
            ran.append(True)
            standalone(work)  # the change opens its catalog while the sweep weighs it
            return weigh(folder)

        monkeypatch.setattr(place_mod, "held_folder", weigh_after)
        kept.append(removed_leftover(planned))
        monkeypatch.setattr(place_mod, "held_folder", weigh)
        if not ran:
            standalone(work)

    monkeypatch.setattr(bucket_mod, "_standalone", standalone_during_a_sweep)
    assert merge_bucket(store).roots
    assert kept == [None]
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"


def test_a_verify_whose_scratch_a_sweep_reaches_after_a_download_reports_no_damage(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: a sweep right after a shard was brought into verify's scratch (not
    yet checked) took the file the check reads, and verify called the sound object damaged
    ("unreadable: No such file or directory; delete this object"). verify holds its scratch:
    the sweep keeps it."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    download = BucketStore.download_shard
    tried: list[list[int]] = []

    def download_then_sweep(self: BucketStore, name: str, dest: Path) -> None:
        download(self, name, dest)
        if not tried:
            tried.append(sweep(tier_leftovers(store.layout.tmp)))

    monkeypatch.setattr(BucketStore, "download_shard", download_then_sweep)
    report = verify(s3.url, local_cache=tier)
    assert tried == [[]]
    assert report.status == "clean", [f.detail for f in report.findings]
    assert report.shards_checked == len(store.named_shards()) > 1


def test_a_verify_whose_scratch_copy_went_before_its_check_brings_it_in_again(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scratch copy gone between its download and its check (a sweep on a disk without
    locks) is brought in again when the bucket still holds the shard: never called damaged."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    download = BucketStore.download_shard
    swept: list[int] = []
    without_locks(monkeypatch)

    def download_then_sweep(self: BucketStore, name: str, dest: Path) -> None:
        download(self, name, dest)
        if not swept:
            swept.extend(sweep(tier_leftovers(store.layout.tmp)))

    monkeypatch.setattr(BucketStore, "download_shard", download_then_sweep)
    report = verify(s3.url, local_cache=tier)
    assert len(swept) == 1
    assert report.status == "clean", [f.detail for f in report.findings]
    assert report.shards_checked == len(store.named_shards()) > 1
    assert not list(store.layout.tmp.glob("verify*"))


def test_a_verify_whose_scratch_a_sweep_reaches_during_a_download_reports_no_missing_shard(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: a sweep renamed verify's scratch aside, found it changed since its
    plan and renamed it back; the download that opened its file in between failed, and
    verify, finding the folder there again, took the shard for gone from the bucket without
    asking it ("deleted while verify ran"). verify holds its scratch: the sweep keeps it and
    never weighs it, and a shard is missing only when the bucket says so."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "node"
    store = bucket_store(s3.url, tier)
    download = BucketStore.download_shard
    weigh = place_mod.held_folder
    calls: list[str] = []
    kept: list[object] = []

    def download_during_a_sweep(self: BucketStore, name: str, dest: Path) -> None:
        calls.append(name)
        if len(calls) != 2:
            return download(self, name, dest)
        (held,) = [h for h in tier_leftovers(store.layout.tmp) if "verify-" in h.name]
        planned = held._replace(modified=held.modified - 1)  # planned before this shard
        done: list[bool] = []

        def weigh_after_the_download(folder: Path) -> Held | None:
            done.append(True)
            download(self, name, dest)  # verify opens its file while the sweep weighs it
            return weigh(folder)

        monkeypatch.setattr(place_mod, "held_folder", weigh_after_the_download)
        kept.append(removed_leftover(planned))
        monkeypatch.setattr(place_mod, "held_folder", weigh)
        if not done:
            download(self, name, dest)
        return None

    monkeypatch.setattr(BucketStore, "download_shard", download_during_a_sweep)
    report = verify(s3.url, local_cache=tier)
    assert kept == [None]  # the sweep kept the folder
    assert report.status == "clean", [f.detail for f in report.findings]


def test_a_catalog_download_a_sweep_reaches_is_kept_and_installed(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: every file of a tier's ``tmp/`` but ``catalog.lock`` is a leftover
    (up9.5), so a gc sweep on the node took ``tmp/catalog-v<n>.<id>.download`` between its
    download and its check, and the sound version was called damaged ("delete that object").
    The download is held while it is used: the sweep keeps it, and the version is installed."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    tier = tmp_path / "node"
    download = ObjectStore.download
    tried: list[list[int]] = []

    def download_then_sweep(self: ObjectStore, name: str, dest: Path) -> int:
        got = download(self, name, dest)
        if dest.name.endswith(".download") and not tried:
            tried.append(sweep(tier_leftovers(dest.parent)))
        return got

    monkeypatch.setattr(ObjectStore, "download", download_then_sweep)
    said = ""
    try:
        store = open_store(s3.url, local_cache=tier).remote
        assert isinstance(store, BucketStore)
        assert store.sync_catalog() == 1
    except (StoreError, StoreCorrupt) as e:
        said = f"{type(e).__name__}: {e}"
    assert tried == [[]], said
    assert not said
    tmp = bucket_store(s3.url, tier).layout.tmp
    assert [p.name for p in tmp.iterdir() if p.is_file()] == ["catalog.lock"]


def test_a_part_file_a_build_writes_in_the_tier_is_kept_by_a_sweep(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round nine, upkeep: the ``.part`` files a build writes in the tier's ``tmp/`` (a shard,
    a fragment, a published mark) are leftovers to the tier's sweep (up9.5); each is held
    while it is written, so a sweep on the node then keeps it and the build ends whole."""
    replace = os.replace
    tried: list[list[int]] = []

    def swept_then_renamed(src: object, dst: object) -> None:
        part = Path(str(src))
        if part.name.endswith(".part") and part.parent.name == "tmp":  # the build's tier's
            tried.append(sweep(tier_leftovers(part.parent)))
        replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", swept_then_renamed)
    done = build(audio_dir, encoder_file, cache=s3.url, workers=0)
    monkeypatch.setattr(os, "replace", replace)
    assert len(tried) > 2 and all(t == [] for t in tried), tried
    with Catalog(open_store(s3.url, local_cache=tmp_path / "reader")) as catalog:
        assert done.root in {r.name for r in catalog.roots()}
    assert verify(s3.url, local_cache=tmp_path / "verifier").status == "clean"
