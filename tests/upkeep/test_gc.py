"""gc: frees what no live root reaches, keeps the rest servable, survives SIGKILL at every step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from featbake.serve.dataset import CachedFeatureDataset
from featbake.store import files as files_mod
from featbake.store import place
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.files import holding
from featbake.store.filesystem import SharedFilesystemWarning
from featbake.store.fragments import sealed_fragments
from featbake.store.layout import Layout
from featbake.store.objects import ObjectInfo
from featbake.store.place import Held
from featbake.store.roots import RootSpec
from featbake.store.shard import write_shard
from featbake.store.versions import kept_versions, sweep, version_name
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder
from featbake.upkeep import (
    CRASH_ENV,
    CRASH_POINTS,
    GcOptions,
    drop_root,
    execute_gc,
    plan_gc,
    stats,
    verify,
)
from tests.conftest import REPO, invoke
from tests.helpers import (
    Live,
    age,
    assert_serves,
    bake,
    manifest,
    shard_files,
    shards_of_encoder,
)

DAY = 86400.0


def gc(store: Path, **opts: object):
    plan = plan_gc(store, GcOptions(**opts))  # type: ignore[arg-type]
    return plan, execute_gc(plan)


def test_retrained_checkpoint_frees_exactly_the_old_weights_bytes(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    old = bake(audio_dir, encoder_file, store_dir)
    second = bake(audio_dir, other, store_dir)
    old_shards = shards_of_encoder(store_dir, old.encoder_fp)
    second_shards = shards_of_encoder(store_dir, second.encoder_fp)
    assert old_shards and second_shards

    save_torchscript(TinyConvEncoder(seed=7), encoder_file)  # retrained in place
    new = bake(audio_dir, encoder_file, store_dir)
    assert new.root == old.root and new.encoder_fp != old.encoder_fp and new.encoded == 16
    new_shards = shards_of_encoder(store_dir, new.encoder_fp)

    plan, result = gc(store_dir)
    assert plan.freed_bytes == sum(old_shards.values())
    assert result.bytes_freed == sum(old_shards.values())
    assert result.rows_deleted == 16 and result.shards_written == 0
    assert shard_files(store_dir) == {**new_shards, **second_shards}
    assert assert_serves(store_dir, new.root, audio_dir, encoder_file, live) == 16
    assert assert_serves(store_dir, second.root, audio_dir, other, live) == 16
    assert verify(store_dir).status == "clean"
    assert plan_gc(store_dir).nothing_to_do


def test_older_than_drops_only_stale_roots(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    stale = bake(audio_dir, encoder_file, store_dir)
    fresh = bake(audio_dir, other, store_dir)
    with sqlite3.connect(store_dir / "catalog.sqlite") as c:
        c.execute("UPDATE roots SET last_used=? WHERE name=?", (time.time() - 40 * DAY, stale.root))
        # Its features were last read then too (a read counts as use of the root).
        stale_keys = "SELECT key FROM root_items WHERE root=?"
        c.execute(f"UPDATE features SET last_used=0 WHERE key IN ({stale_keys})", (stale.root,))

    plan = plan_gc(store_dir, GcOptions(older_than=30 * DAY))
    assert [d.name for d in plan.drop_roots] == [stale.root]
    assert plan_gc(store_dir, GcOptions(older_than=50 * DAY)).drop_roots == ()
    result = execute_gc(plan)
    assert result.roots_dropped == [stale.root]
    assert not shards_of_encoder(store_dir, stale.encoder_fp)
    assert not (store_dir / "roots" / f"{stale.root}.json").exists()
    assert assert_serves(store_dir, fresh.root, audio_dir, other, live) == 16


def test_a_one_process_build_whose_reused_features_gc_evicts_meanwhile_says_so(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder of 6 stored clips gains 6; while the rebuild encodes the new ones, a
    ``gc --max-bytes`` (another process's catalog connection) evicts the 6 it reused. Before,
    the build said "reused 6", exit 0, and its root missed them. Now each is failed in one
    line, not recorded undecodable (a dataset takes them for misses), and the rerun encodes
    them: the root whole, every item equal to the encoder now."""
    import featbake.bake.pipeline as pipeline

    data, store = tmp_path / "a", tmp_path / "store"
    write_audio_folder(data, 6, seconds=(0.4, 0.8), seed=1)
    bake(data, encoder_file, store)
    for i, p in enumerate(write_audio_folder(tmp_path / "new", 6, seconds=(0.4, 0.8), seed=9)):
        os.replace(p, data / f"new{i}.wav")
    encode, ran = pipeline._Bake.encode, []

    def encode_beside_gc(self: pipeline._Bake, *args: object, **kwargs: object) -> None:
        if not ran:
            ran.append(gc(store, max_bytes=1024, grace=0.0))
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(pipeline._Bake, "encode", encode_beside_gc)
    report = pipeline.build(data, encoder_file, cache=store, workers=0)
    assert ran and ran[0][1].rows_deleted >= 6
    assert report.encoded == 6 and report.reused == 0 and len(report.failed) == 6
    assert all("deleted while the build ran" in why for _, why in report.failed)
    monkeypatch.setattr(pipeline._Bake, "encode", encode)
    again = pipeline.build(data, encoder_file, cache=store, workers=0)
    assert not again.failed and again.encoded == 6 and again.reused == 6
    assert assert_serves(store, again.root, data, encoder_file, Live()) == 12


def test_max_bytes_evicts_least_recently_used_down_to_the_budget(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir, shard_bytes=40_000)
    keys = [k for _, k in manifest(store_dir, report.root)]
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(0)).tolist()
    cat = Catalog(Layout(store_dir))
    for rank, i in enumerate(order):
        cat.touch([keys[i]], when=1_000_000.0 + rank)
    cat.close()
    budget = sum(shard_files(store_dir).values()) // 2

    plan, result = gc(store_dir, max_bytes=budget)
    assert plan.evict and result.rows_deleted == len(plan.evict)
    assert sum(shard_files(store_dir).values()) <= budget
    reader = FeatureReader(Layout(store_dir))
    kept = {k for k in keys if reader.get(k) is not None}
    reader.close()
    rank = {keys[i]: r for r, i in enumerate(order)}
    evicted = set(keys) - kept
    assert kept and evicted
    assert min(rank[k] for k in kept) > max(rank[k] for k in evicted)  # most recent kept
    served = assert_serves(
        store_dir, report.root, audio_dir, encoder_file, live, allow_missing=True
    )
    assert served == len(kept)
    assert verify(store_dir).status == "clean"


def _pristine(tmp_path: Path, encoder_file: Path, audio_dir: Path) -> tuple[Path, dict]:
    """A store where one gc run takes every step: drops, deletes, compacts, removes files."""
    store = tmp_path / "pristine"
    half = tmp_path / "half"  # copies of every other clip: the same keys, a second root
    for i, p in enumerate(sorted(audio_dir.rglob("*.wav"))):
        if i % 2 == 0:
            dest = half / p.relative_to(audio_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, dest)
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    stale_enc = save_torchscript(TinyConvEncoder(seed=4), tmp_path / "stale.pt")
    a = bake(audio_dir, encoder_file, store)
    b = bake(half, encoder_file, store)
    c = bake(audio_dir, other, store)
    d = bake(audio_dir / "fixed", stale_enc, store)
    with sqlite3.connect(store / "catalog.sqlite") as conn:
        conn.execute(
            "UPDATE roots SET last_used=? WHERE name IN (?, ?)",
            (time.time() - 40 * DAY, a.root, d.root),
        )
        conn.execute(  # nor read since (a read counts as use of the root)
            "UPDATE features SET last_used=0 WHERE key IN "
            "(SELECT key FROM root_items WHERE root IN (?, ?))",
            (a.root, d.root),
        )
    layout = Layout(store)
    write_shard(layout, {"f" * 64: torch.zeros(10)}, "e" * 64, "r" * 64)  # never cataloged
    (store / "tmp" / "junk.part").write_bytes(b"x" * 100)
    for p in [*shard_files(store), store / "tmp" / "junk.part"]:
        age(p, 2 * 3600)
    return store, {"half": half, "other": other, "b": b, "c": c}


GC_ARGS = ("--older-than", "30d", "--compact-below", "0.9", "--grace", "1h")
GC_OPTS = {"older_than": 30 * DAY, "compact_below": 0.9, "grace": 3600.0}


@pytest.mark.slow
def test_gc_killed_at_every_step_leaves_a_clean_store_and_a_rerun_finishes(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    live = Live()
    pristine, s = _pristine(tmp_path, encoder_file, audio_dir)
    reference = tmp_path / "reference"
    shutil.copytree(pristine, reference)
    _, done = gc(reference, **GC_OPTS)
    assert len(done.roots_dropped) == 2 and done.shards_written and done.shards_deleted
    assert done.orphans_removed == 1 and done.tmp_removed == 1
    want = (sorted(shard_files(reference).values()), _rows(reference))

    stores = {point: tmp_path / f"crash-{point}" for point in CRASH_POINTS}
    for store in stores.values():
        shutil.copytree(pristine, store)
    killed = killed_at_each_point(stores)
    for point, store in stores.items():
        assert killed[point] == -signal.SIGKILL, f"{point}: gc never reached it\n{killed['']}"
        report = verify(store)
        assert report.status == "clean", (point, report.findings)
        gc(store, **GC_OPTS)  # the rerun finishes the job ...
        assert verify(store).status == "clean", point
        assert plan_gc(store, GcOptions(**GC_OPTS)).nothing_to_do, point  # type: ignore[arg-type]
        assert assert_serves(store, s["b"].root, s["half"], encoder_file, live) == 8
        assert assert_serves(store, s["c"].root, audio_dir, s["other"], live) == 16
        # A shard sealed but not committed before the kill is an orphan that waits out the grace
        # period (a rerun writes its features again; safetensors orders metadata differently in
        # each process, so the copy gets another name). Past the grace, the store is exactly
        # what one uninterrupted run leaves.
        for f in shard_files(store):
            age(f, 7200)
        gc(store, **GC_OPTS)
        assert (sorted(shard_files(store).values()), _rows(store)) == want, point


#: `featbake gc` killed at each step: one interpreter imports the command once, then forks a
#: child per step that runs ``featbake gc`` over that step's store with ``$CRASH_ENV`` naming
#: the step, and waits for it (a process of its own, SIGKILLed where gc reaches the step, as a
#: `featbake gc` started afresh is: nothing ran in the parent before the fork but the imports
#: a gc run makes, done once there).
#: Prints each step's exit status (negative: the signal), and the children's stderr under "".
KILL_LOOP = """
import contextlib, json, os, sys, traceback
from featbake.cli.main import main
import featbake.store.open, featbake.upkeep  # what a gc run imports: once, before the forks
with contextlib.suppress(ImportError):
    import pydantic  # typer's, for parsing the options

env, args, stores = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
status = {}
for point, store in stores.items():
    pid = os.fork()
    if pid == 0:
        os.environ[env] = point
        code = 0  # gc finished: it never reached the step
        try:
            main(["gc", "--cache", store, *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 70
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never back into the loop
    status[point] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(status))
"""


def killed_at_each_point(stores: dict[str, Path]) -> dict[str, object]:
    """``featbake gc`` (:data:`GC_ARGS`) over each store, killed at its step (:data:`KILL_LOOP`):
    step -> the exit status of the process that ran it, and "" -> their stderr."""
    paths = {point: str(store) for point, store in stores.items()}
    done = subprocess.run(
        [sys.executable, "-c", KILL_LOOP, CRASH_ENV, json.dumps(GC_ARGS), json.dumps(paths)],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "FEATBAKE_DEBUG"} | {
            "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "": done.stderr}


def _rows(store: Path) -> set[tuple[str, str]]:
    with sqlite3.connect(store / "catalog.sqlite") as c:
        return set(c.execute("SELECT key, part FROM features").fetchall())


class _ByKey(Dataset):
    """A dataset-like reader: item i -> the stored feature of keys[i] (as training would read)."""

    def __init__(self, store: Path, keys: list[str]) -> None:
        self.reader = FeatureReader(Layout(store))
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        got = self.reader.get(self.keys[i])
        if got is None:
            raise KeyError(f"{self.keys[i]} is not served")
        return got[""]


def test_dataloader_reads_correctly_while_gc_moves_every_shard(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    base = bake(audio_dir, encoder_file, store_dir, shard_bytes=30_000)
    items = manifest(store_dir, base.root)
    keys = [k for _, k in items]
    want = [live_t for live_t in (Live()(encoder_file, audio_dir / rel) for rel, _ in items)]
    moved: list[int] = []
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for r in range(3):  # each round adds small shards, then merges them all (moving ours)
                write_audio_folder(tmp_path / f"new{r}", 3, seconds=0.5, seed=100 + r)
                bake(tmp_path / f"new{r}", encoder_file, store_dir, shard_bytes=10_000)
                _, res = gc(store_dir, merge_small=True)
                moved.append(res.features_moved)
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    loader = DataLoader(
        _ByKey(store_dir, keys), batch_size=None, num_workers=2, persistent_workers=True
    )
    it = iter(loader)  # fork the workers before the gc thread exists
    first = next(it)
    torch.testing.assert_close(first, want[0])
    worker = threading.Thread(target=churn)
    worker.start()
    reads, epochs = 0, 0
    while worker.is_alive() or epochs < 2:
        for i, t in enumerate(loader):
            torch.testing.assert_close(t, want[i])
            reads += 1
        epochs += 1
    worker.join()
    assert not errors, errors
    assert len(moved) == 3 and all(m >= len(keys) for m in moved), moved
    assert reads >= 2 * len(keys)
    assert verify(store_dir).status == "clean"


def test_reader_holding_an_old_location_re_resolves_after_compaction(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    base = bake(audio_dir, encoder_file, store_dir)
    write_audio_folder(tmp_path / "more", 2, seconds=0.4, seed=9)
    bake(tmp_path / "more", encoder_file, store_dir)
    rel, key = manifest(store_dir, base.root)[0]
    reader = FeatureReader(Layout(store_dir))
    old = reader.catalog.locate(key)
    _, res = gc(store_dir, merge_small=True)
    assert res.features_moved and not reader.layout.shard_path(old[0].shard).exists()
    got = reader.get_located(key, old)  # the shard it names is gone: looks the key up again
    reader.close()
    assert got is not None
    torch.testing.assert_close(got[""], Live()(encoder_file, audio_dir / rel))


def test_dry_run_changes_nothing_and_young_files_wait_for_the_grace_period(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    report = bake(audio_dir, encoder_file, store_dir)
    orphan = write_shard(Layout(store_dir), {"a" * 64: torch.ones(3)}, "e" * 64, "r" * 64)
    leftover = store_dir / "tmp" / "x.part"
    leftover.write_bytes(b"123")
    Catalog(Layout(store_dir)).drop_root(report.root)
    before = shard_files(store_dir)

    proc = invoke("gc", "--cache", store_dir, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "would free" in proc.stdout and shard_files(store_dir) == before

    plan, result = gc(store_dir)  # default grace: 1 h
    assert plan.young_orphans == 1 and orphan.path.exists() and leftover.exists()
    assert result.rows_deleted == 16 and set(shard_files(store_dir)) == {orphan.path}
    age(orphan.path, 7200)
    age(leftover, 7200)
    _, result = gc(store_dir)
    assert result.orphans_removed == 1 and result.tmp_removed == 1
    assert not shard_files(store_dir) and not leftover.exists()


def _paths(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.wav"))


def test_gc_keeps_what_a_list_of_paths_dataset_wrote(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """A list-of-paths dataset publishes a root, so a gc right after its epoch keeps its features;
    after the checkpoint is retrained in place, gc frees exactly the old features' bytes."""
    from featbake.serve.dataset import CachedFeatureDataset

    live = Live()
    paths = _paths(audio_dir)
    ds = CachedFeatureDataset(paths, encoder_file, cache=store_dir)
    for i in range(len(ds)):
        ds[i]  # every item misses, is encoded and written back
    ds.close()
    old_shards = shards_of_encoder(store_dir, ds.encoder_fingerprint)
    assert old_shards
    _, result = gc(store_dir)
    assert result.rows_deleted == 0 and shard_files(store_dir) == old_shards
    again = CachedFeatureDataset(paths, encoder_file, cache=store_dir, on_miss="error")
    assert again.stored() == len(paths)
    for i, p in enumerate(paths):
        torch.testing.assert_close(again[i], live(encoder_file, p), rtol=1e-5, atol=1e-6)
    again.close()

    save_torchscript(TinyConvEncoder(seed=7), encoder_file)  # retrained in place
    new = CachedFeatureDataset(paths, encoder_file, cache=store_dir)
    assert new.encoder_fingerprint != ds.encoder_fingerprint
    for i in range(len(new)):
        new[i]
    new.close()
    new_shards = shards_of_encoder(store_dir, new.encoder_fingerprint)
    _, result = gc(store_dir)
    assert result.bytes_freed == sum(old_shards.values()) and result.rows_deleted == len(paths)
    assert shard_files(store_dir) == new_shards
    assert verify(store_dir).status == "clean"


def test_extend_root_keeps_features_written_without_a_folder(store_dir: Path) -> None:
    """Writers with no data folder (CachedEncoder) append their keys to a root: gc keeps them
    until that root is dropped, and the root's manifest file stays in step with the catalog."""
    from featbake.store.roots import read_root_file, root_file

    layout = Layout(store_dir).ensure()
    cat = Catalog(layout)
    efp, rfp = "e" * 64, "r" * 64
    spec = RootSpec("cached-encoder-x", "cached-encoder:eeee", "Enc", efp, rfp, {"kind": "tensor"})
    shards = []
    for n in range(2):
        tensors = {f"{n}{i}".ljust(64, "0"): torch.full((3,), float(i)) for i in range(3)}
        shard = write_shard(layout, tensors, efp, rfp)
        cat.add_shard(shard)
        shards.append(shard)
        cat.extend_root(spec, list(tensors))
    items = manifest(store_dir, "cached-encoder-x")
    assert len(items) == 6 and len({k for _, k in items}) == 6
    root, file_items = read_root_file(root_file(layout, "cached-encoder-x"))
    assert file_items == items and root.items == 6
    cat.extend_root(spec, [items[0][1]])
    assert len(manifest(store_dir, "cached-encoder-x")) == 6
    _, result = gc(store_dir)
    assert result.rows_deleted == 0 and all(s.path.exists() for s in shards)
    cat.drop_root("cached-encoder-x")
    cat.close()
    _, result = gc(store_dir)
    assert result.rows_deleted == 6 and not any(s.path.exists() for s in shards)


def test_gc_and_verify_while_a_merge_folds_in_and_removes_a_fragment(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 item 6: a `featbake merge` that folded a fragment in and removed it between gc's
    (or verify's) listing of fragments and its opening of one ended both in an internal error.
    Here the merge runs at exactly that moment: gc and verify finish, and gc, even with no grace,
    plans to delete none of the merged shards (they moved into the catalog meanwhile)."""
    import featbake.store.fragments as fragments
    import featbake.store.merge as merging
    from featbake.bake.pipeline import build
    from featbake.store.merge import merge

    store = tmp_path / "store"
    build(audio_dir / "fixed", encoder_file, cache=store, workers=0)  # the store's catalog
    for part in ("0/2", "1/2"):
        report = build(
            audio_dir, encoder_file, cache=store, workers=0, shard=part, shard_bytes=20_000
        )
    layout = Layout(store)
    listing = fragments.sealed_fragments

    def list_with(lister) -> None:  # every module that lists sealed fragments
        for module in (fragments, merging):
            monkeypatch.setattr(module, "sealed_fragments", lister)

    def listed_then_merged(lay: Layout):  # the listing a reader made, then the merge ran
        found = listing(lay)
        if found and any(f.path.exists() for f in found):
            list_with(listing)
            merge(layout)
            assert not any(f.path.exists() for f in found)
        return found

    list_with(listed_then_merged)
    plan = plan_gc(store, GcOptions(grace=0))
    assert not plan.orphan_shards
    assert invoke("verify", "--cache", store).returncode == 0  # merged: a clean store
    list_with(listed_then_merged)
    checked = verify(store)
    assert checked.status == "clean", checked.findings
    execute_gc(plan)
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


def test_gc_max_bytes_on_a_row_whose_shard_row_is_gone_says_to_repair(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Issue 22 item 6: ``gc --max-bytes`` raised KeyError on a feature row naming no shard."""
    bake(audio_dir, encoder_file, store_dir)
    with sqlite3.connect(store_dir / "catalog.sqlite") as conn:
        conn.execute("PRAGMA foreign_keys=OFF")
        first = "(SELECT MIN(key) FROM features)"
        conn.execute(f"UPDATE features SET shard_id = 999999 WHERE key = {first}")
    res = invoke("gc", "--cache", store_dir, "--max-bytes", "1KiB")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 5 and len(lines) == 1, res.stderr
    assert "verify --repair" in lines[0] and "Traceback" not in res.stderr


# == test_gc_reads =================================================================================
# gc --older-than counts a dataset's reads as use of the root it reads (issue 28 item 7).
#
# Serving records last use per feature (serve/state.py), never per root: a root built 40 days
# ago and read every day since must not look 40 days idle.


def _built_days_ago(store: Path, root: str, days: float) -> None:
    """Make ``root`` look built, and last read, ``days`` ago (its row and its features)."""
    then = time.time() - days * DAY
    with sqlite3.connect(store / "catalog.sqlite") as c:
        c.execute("UPDATE roots SET last_used=? WHERE name=?", (then, root))
        c.execute(
            "UPDATE features SET last_used=? WHERE key IN "
            "(SELECT key FROM root_items WHERE root=?)",
            (then, root),
        )


def _read_everything(data: Path, encoder: Path, store: Path) -> None:
    """A training job's day: every item served, last uses flushed."""
    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    for i in range(len(ds)):
        ds[i]
    ds.close()


def test_a_root_read_today_is_kept_by_older_than(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    read = bake(audio_dir, encoder_file, store_dir)
    idle = bake(audio_dir, other, store_dir)
    for root in (read.root, idle.root):
        _built_days_ago(store_dir, root, 40)
    _read_everything(audio_dir, encoder_file, store_dir)

    plan = plan_gc(store_dir, GcOptions(older_than=DAY))
    assert [d.name for d in plan.drop_roots] == [idle.root]
    # Two days on, with no read since, the read root is idle too (time given, not waited).
    later = plan_gc(store_dir, GcOptions(older_than=DAY), now=time.time() + 2 * DAY)
    assert {d.name for d in later.drop_roots} == {read.root, idle.root}
    assert execute_gc(plan).roots_dropped == [idle.root]
    assert assert_serves(store_dir, read.root, audio_dir, encoder_file, Live()) == 16


def test_a_root_read_after_the_plan_is_not_dropped_by_it(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """The drop re-checks reads, as it re-checks builds: a job that started meanwhile wins."""
    read = bake(audio_dir, encoder_file, store_dir)
    _built_days_ago(store_dir, read.root, 40)
    plan = plan_gc(store_dir, GcOptions(older_than=DAY))
    assert [d.name for d in plan.drop_roots] == [read.root]
    _read_everything(audio_dir, encoder_file, store_dir)
    assert execute_gc(plan).roots_dropped == []
    assert assert_serves(store_dir, read.root, audio_dir, encoder_file, Live()) == 16


def test_a_root_read_today_on_a_shared_filesystem_is_kept_before_any_merge(
    tmp_path: Path,
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round four item 10, on a store on a shared filesystem: a dataset records its reads in
    serving fragments (it never writes the catalog there), and gc --older-than dropped the root
    it read until someone ran `featbake merge`. gc counts the uses sealed fragments record."""
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    read = bake(audio_dir, encoder_file, store_dir)
    idle = bake(audio_dir, other, store_dir)
    for root in (read.root, idle.root):
        _built_days_ago(store_dir, root, 40)
    with pytest.warns(SharedFilesystemWarning):
        _read_everything(audio_dir, encoder_file, store_dir)
    assert sealed_fragments(Layout(store_dir))  # the reads wait in fragments, not merged

    plan = plan_gc(store_dir, GcOptions(older_than=DAY))
    assert [d.name for d in plan.drop_roots] == [idle.root]
    assert execute_gc(plan).roots_dropped == [idle.root]
    assert assert_serves(store_dir, read.root, audio_dir, encoder_file, Live()) == 16


# == test_bucket_sweep =============================================================================
# The bucket sweep's rules, checked against a naive model over random listings.

times = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(st.lists(times, min_size=1, max_size=8), times, st.floats(min_value=0, max_value=500))
def test_the_newest_version_is_always_kept_and_a_version_goes_once_its_successor_is_old(
    published: list[float], now: float, retention: float
) -> None:
    ordered = sorted(published)
    versions = [ObjectInfo(version_name(i + 1), 1, t, "") for i, t in enumerate(ordered)]
    kept = kept_versions(versions, now + 1000, retention)
    assert len(ordered) in kept
    for n in range(1, len(ordered)):
        retired_for = now + 1000 - ordered[n]  # version n was replaced when n+1 appeared
        assert (n in kept) == (retired_for < retention)


@given(
    st.dictionaries(st.text("ab", min_size=1, max_size=3), times, max_size=8),
    st.sets(st.text("ab", min_size=1, max_size=3)),
    st.sets(st.text("ab", min_size=1, max_size=3)),
    st.floats(min_value=0, max_value=500),
)
def test_a_shard_goes_only_when_nothing_names_it_and_it_is_older_than_the_retention(
    shards: dict[str, float], named: set[str], pending: set[str], retention: float
) -> None:
    from featbake.store.versions import UPLOADED_UNNAMED_S

    # Shards from 0 to 1000 s old past the hour an unnamed one is kept whatever the retention
    # (a running build's uploads), so each side of the retention is drawn.
    now = 1000.0 + UPLOADED_UNNAMED_S
    listing = [ObjectInfo(f"shards/{n[:2]}/{n}.safetensors", 10, t, "") for n, t in shards.items()]
    got = sweep([], listing, {1: named}, pending, now, retention + UPLOADED_UNNAMED_S)
    got_floor = sweep([], listing, {1: named}, pending, now - 1000.0, retention)
    deleted = {o.name.rsplit("/", 1)[1].removesuffix(".safetensors") for o in got.shards}
    age = retention + UPLOADED_UNNAMED_S
    unnamed = {n: t for n, t in shards.items() if n not in named | pending}
    assert deleted == {n for n, t in unnamed.items() if now - t >= age}
    assert got.young_shards == sum(1 for t in unnamed.values() if now - t < age)
    # Under the hour, nothing unnamed goes, whatever the retention.
    assert all(now - 1000.0 - o.modified >= UPLOADED_UNNAMED_S for o in got_floor.shards)


def test_gc_keeps_an_orphan_sealed_again_by_a_part_rerun_after_its_plan(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Round six, upkeep: a part of a build killed before its fragment left its shard unnamed
    (an orphan past the grace period); gc planned to sweep it, and the part's rerun, between
    that plan and the sweep, sealed the byte-identical shard at the same content name and a
    fragment naming it. The sweep re-checked only the catalog's rows, so it unlinked the
    rerun's shard: the merge found it missing and the part's features were lost. The sweep
    now removes a file only if it is still the write it planned to remove."""
    from featbake.bake.pipeline import build
    from featbake.store.merge import merge

    store = tmp_path / "store"
    build(audio_dir / "fixed", encoder_file, cache=store, workers=0)  # the store's catalog
    build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")
    layout = Layout(store)
    for fragment in sealed_fragments(layout):  # the part was killed before its fragments
        fragment.path.unlink()
    orphans = set(shard_files(store)) - {p for p in shard_files(store) if _named(store, p)}
    assert orphans
    for p in orphans:
        age(p, 2 * DAY)

    plan = plan_gc(store, GcOptions())
    assert {Path(h.name) for h in plan.orphan_shards} == orphans
    build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")  # the rerun
    assert sealed_fragments(layout)
    execute_gc(plan)
    assert all(p.exists() for p in orphans)

    report = build(audio_dir, encoder_file, cache=store, workers=0, shard="1/2")
    merged = merge(layout)
    assert merged.missing_shards == []
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


def _named(store: Path, shard: Path) -> bool:
    with closing(Catalog(Layout(store))) as cat:
        return any(s.name == shard.stem for s in cat.shard_rows())


class _FullAtCommit(sqlite3.Connection):
    """A catalog connection on a disk that fills up: every COMMIT is refused as SQLite
    refuses it there (SQLITE_FULL)."""

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:  # type: ignore[override]
        if sql == "COMMIT":
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
            raise error
        return super().execute(sql, *args)


def test_gc_on_a_full_disk_is_one_line_and_leaves_the_store_whole(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round six, upkeep: a gc whose catalog writes a full disk refuses ended in an internal
    error (`OperationalError: database or disk is full`, exit 1). It is one line now (exit 5),
    nothing is half done, and the same gc run once there is room frees the dropped root."""
    import featbake.store.catalog as catalog_module

    store = tmp_path / "store"
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    kept, dropped = bake(audio_dir, encoder_file, store), bake(audio_dir, other, store)
    assert invoke("roots", "drop", dropped.root, "--cache", store).returncode == 0
    real = catalog_module.open_sqlite

    def filling(path, access=catalog_module.Access.READ_WRITE, **kw):
        if Path(path).name == "catalog.sqlite" and access is catalog_module.Access.READ_WRITE:
            return sqlite3.connect(path, isolation_level=None, factory=_FullAtCommit, **kw)
        return real(path, access, **kw)

    monkeypatch.setattr(catalog_module, "open_sqlite", filling)
    out = invoke("gc", "--cache", store)
    assert out.returncode == 5, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: cannot write the catalog")
    assert "internal error" not in out.stdout + out.stderr
    monkeypatch.setattr(catalog_module, "open_sqlite", real)
    assert verify(store).status == "clean"
    again = invoke("gc", "--cache", store)
    assert again.returncode == 0 and "dropped 0 roots, 16 feature rows" in again.stdout
    assert assert_serves(store, kept.root, audio_dir, encoder_file, Live()) == 16


def test_gc_keeps_what_a_build_in_parts_reused_until_its_merge(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Round six, upkeep: a build in two parts of data whose features were stored found them
    all and reused them: its fragments' manifests name the keys, their rows are the catalog's.
    Before the merge, `gc --older-than` dropped the old root and deleted those rows, as gc
    counted only the keys fragments store; the merge then published a root of 16 items with
    every one missing. gc now keeps the keys sealed build fragments name too."""
    from featbake.bake.pipeline import build
    from featbake.store.merge import merge

    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    for part in ("0/2", "1/2"):
        reused = build(audio_dir, encoder_file, cache=store, workers=0, shard=part)
        assert reused.encoded == 0
    plan = plan_gc(store, GcOptions(older_than=30 * DAY), now=time.time() + 40 * DAY)
    assert [d.name for d in plan.drop_roots] == [first.root]  # not read for 40 days
    assert execute_gc(plan).rows_deleted == 0

    assert merge(Layout(store)).roots == [first.root]
    assert verify(store).status == "clean"
    assert assert_serves(store, first.root, audio_dir, encoder_file, Live()) == 16


def test_gc_keeps_what_a_dataset_on_a_shared_filesystem_published_before_the_merge(
    encoder_file: Path, audio_dir: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round six, upkeep: on a shared filesystem a dataset publishes its root in a `serve`
    fragment. Over a folder whose root was dropped, it found every feature stored and named
    the 16 keys in that root; gc, counting only build fragments, deleted their rows before the
    merge, which then published a root with all 16 missing (encoded again by the next epoch).
    gc keeps what any sealed fragment names now."""
    from featbake.store.merge import merge

    first = bake(audio_dir, encoder_file, store_dir)
    drop_root(store_dir, first.root)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # hits: no encoding
        assert ds.stored() == len(ds) == 16 and all(ds[i] is not None for i in range(16))
        ds.close()
    assert sealed_fragments(Layout(store_dir))  # the root waits in a serve fragment
    monkeypatch.delenv("FEATBAKE_SHARED_FS")  # gc and the merge, on the store's own host

    assert execute_gc(plan_gc(store_dir, GcOptions())).rows_deleted == 0
    assert merge(Layout(store_dir)).roots == [first.root]
    assert manifest(store_dir, first.root)
    assert assert_serves(store_dir, first.root, audio_dir, encoder_file, Live()) == 16


def test_gc_removes_folders_left_in_tmp_past_the_grace_and_keeps_one_in_use(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round eight, upkeep: a directory store's sweep took only files from ``tmp/``, so a
    folder a killed process left there (a scratch copy of a shard, say) stayed for ever. It
    goes once nothing in it changed for the grace period; a folder as old whose newest entry
    is recent (a process still writing into it) stays."""
    first = bake(audio_dir, encoder_file, store_dir)
    tmp = store_dir / "tmp"
    left = tmp / "scratch-of-a-killed-run" / "ab"
    left.mkdir(parents=True)
    shard = next(iter(shard_files(store_dir)))
    shutil.copyfile(shard, left / shard.name)
    busy = tmp / "scratch-in-use"
    busy.mkdir()
    (busy / "old.part").write_bytes(b"x" * 10)
    for p in (left / shard.name, left, left.parent, busy / "old.part", busy):
        age(p, 2 * 3600)
    (busy / "being-written.part").write_bytes(b"y" * 10)  # written now: the folder is in use
    before = {p: p.stat().st_size for p in shard_files(store_dir)}
    # stats counts what gc's sweep weighs: each folder a leftover, with the bytes inside it
    seen = stats(store_dir)
    assert (seen.tmp_files, seen.tmp_bytes) == (2, shard.stat().st_size + 20)

    _, done = gc(store_dir, grace=3600.0)
    assert done.tmp_removed == 1
    assert (stats(store_dir).tmp_files, stats(store_dir).tmp_bytes) == (1, 20)
    assert not left.parent.exists()
    assert sorted(p.name for p in busy.iterdir()) == ["being-written.part", "old.part"]
    assert {p: p.stat().st_size for p in shard_files(store_dir)} == before
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, first.root, audio_dir, encoder_file, Live()) == 16


def test_a_folder_or_file_a_live_process_holds_is_kept_by_the_sweep_however_old(
    tmp_path: Path,
) -> None:
    """Round nine, upkeep: the sweep weighed a leftover folder again, then removed it, so a
    process still using it (a merge's catalog copy, verify's scratch, a download being
    checked) lost it under it whenever the folder looked old: renamed aside (up9.1) or not, a
    rule of ages cannot tell a live process's folder from a killed one's. Whatever a process
    makes in ``tmp/`` it holds (``flock``) for its life; the sweep takes only what it can lock
    itself, so a held folder or file is kept however old, and goes once let go (a killed
    process's lock drops with it)."""
    tmp = tmp_path / "tmp"
    with holding(tmp / "scratch", folder=True) as folder, holding(tmp / "x.part") as file:
        (folder.path / "old.part").write_bytes(b"x" * 10)
        file.path.write_bytes(b"y" * 5)
        for p in (folder.path / "old.part", folder.path, file.path):
            age(p, 2 * 3600)
        weighed = Held(str(file.path), 5, file.path.stat().st_mtime)
        planned = [place.held_folder(folder.path), weighed]
        assert [place.removed_leftover(h) for h in planned if h is not None] == [None, None]
        assert (folder.path / "old.part").read_bytes() == b"x" * 10
        assert file.path.read_bytes() == b"y" * 5
    assert not tmp.exists() or not list(tmp.iterdir())  # let go: removed by their maker

    left = tmp / "killed"  # what a killed process left: nobody holds it
    left.mkdir(parents=True)
    (left / "old.part").write_bytes(b"x" * 10)
    planned_left = place.held_folder(left)
    assert planned_left is not None and place.removed_leftover(planned_left) == 10
    assert not left.exists()


def test_a_maker_whose_folder_a_sweep_takes_before_it_holds_it_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep may lock a scratch folder in the moment between its maker's ``mkdir`` and its
    lock (a ``--grace 0s``): the maker waits for the lock, finds the path is no longer the
    folder it locked, and makes it again; it never works in a folder a sweep removes."""
    path = tmp_path / "tmp" / "work-1"
    made = files_mod._made
    swept: list[int | None] = []

    def made_then_swept(p: Path, folder: bool) -> files_mod.LockFile:
        fd = made(p, folder)
        if not swept:
            held = place.held_folder(p)
            assert held is not None
            swept.append(place.removed_leftover(held))
        return fd

    monkeypatch.setattr(files_mod, "_made", made_then_swept)
    with holding(path, folder=True) as hold:
        assert swept == [0] and hold.intact()
        (path / "a").write_bytes(b"z")
        held = place.held_folder(path)
        assert held is not None and place.removed_leftover(held) is None
        assert (path / "a").read_bytes() == b"z"


def test_a_sweep_that_found_no_lock_file_in_a_folder_never_removes_it_under_its_maker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round ten, holds: a sweep (a ``--grace 0s``) may open a scratch folder between its
    maker's ``mkdir`` and the making of its lock file: finding none, it judged the folder by
    age alone, and removed it after its maker had made and locked the lock file, so the maker
    worked in a folder being removed. The sweep makes the lock file itself where there is none
    (the maker's, made meanwhile, is tried as any), so such a folder is kept while held."""
    path = tmp_path / "tmp" / "work-1"
    made_by_the_maker, weighed_by_the_sweep, holds = (threading.Event() for _ in range(3))
    opened_lock, weighed = files_mod.opened_lock, place._weighed
    swept: list[int | None] = []

    def lock_file_made_after_the_sweep_looked(*args: object, **kw: object) -> files_mod.LockFile:
        made_by_the_maker.set()  # its folder is made, its lock file not yet
        assert weighed_by_the_sweep.wait(60)
        return opened_lock(*args, **kw)  # type: ignore[arg-type]

    def weighed_then_held(p: Path, fd: int) -> Held | None:
        now = weighed(p, fd)
        weighed_by_the_sweep.set()
        assert holds.wait(60)  # its maker made, locked and checked its lock file meanwhile
        return now

    def sweep() -> None:
        assert made_by_the_maker.wait(60)
        planned = place.held_folder(path)
        assert planned is not None
        swept.append(place.removed_leftover(planned))

    monkeypatch.setattr(files_mod, "opened_lock", lock_file_made_after_the_sweep_looked)
    monkeypatch.setattr(place, "_weighed", weighed_then_held)
    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    with holding(path, folder=True) as hold:
        holds.set()
        sweeper.join(60)
        assert swept == [None]
        assert hold.intact()
        (path / "a").write_bytes(b"z")
        assert (path / "a").read_bytes() == b"z"


def test_a_folder_taken_up_after_the_plan_is_put_back_whole(tmp_path: Path) -> None:
    """The other side of the rename aside: a folder written into between gc's plan and its
    sweep is weighed again under its aside name, found changed and renamed back, whole."""
    left = tmp_path / "tmp" / "scratch"
    left.mkdir(parents=True)
    (left / "old.part").write_bytes(b"x" * 10)
    age(left / "old.part", 2 * 3600)
    age(left, 2 * 3600)
    planned = place.held_folder(left)
    assert planned is not None
    (left / "new.part").write_bytes(b"y" * 10)  # taken up after the plan
    assert place.removed_leftover(planned) is None
    assert sorted(p.name for p in left.iterdir()) == ["new.part", "old.part"]
    assert [p.name for p in left.parent.iterdir()] == ["scratch"]


def test_a_leftover_another_gc_removed_after_the_plan_is_not_counted_twice(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round nine, upkeep: two gc runs on one store plan the same ``tmp/`` leftovers; the one
    that comes second found them gone and still counted each as a leftover it removed, so the
    two reports added up to more than was ever there. A leftover gone before the sweep reached
    it is not counted (a folder already was not: ``removed_leftover``)."""
    bake(audio_dir, encoder_file, store_dir)
    tmp = store_dir / "tmp"
    (tmp / "a.part").write_bytes(b"x" * 10)
    (tmp / "b.part").write_bytes(b"")
    for p in tmp.iterdir():
        age(p, 2 * 3600)
    first = plan_gc(store_dir, GcOptions(grace=3600.0))
    second = plan_gc(store_dir, GcOptions(grace=3600.0))
    assert len(first.sweep.loose) == len(second.sweep.loose) == 2
    (tmp / "a.part").unlink()  # the first run took this one, then was killed
    assert execute_gc(second).tmp_removed == 1  # only b.part, empty, was removed by this one
    assert execute_gc(first).tmp_removed == 0
    assert not list(tmp.glob("*.part"))


def test_the_estimate_of_merging_small_shards_is_what_the_merge_frees(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """``gc --merge-small --dry-run`` counted every rewritten shard's header as garbage: small
    shards merged "would free about 313 KiB" where the merge freed 1.5 KiB. The estimate now
    weighs the kept tensors' header share: it errs low, by at most what each merged shard's
    header held of its own (a few hundred bytes a shard)."""
    bake(audio_dir, encoder_file, store_dir)
    for seed in range(3):  # small tail shards of short builds
        write_audio_folder(tmp_path / f"more{seed}", 2, seconds=0.4, seed=20 + seed)
        bake(tmp_path / f"more{seed}", encoder_file, store_dir)
    shards = list((store_dir / "shards").rglob("*.safetensors"))
    before = sum(p.stat().st_size for p in shards)
    plan, res = gc(store_dir, merge_small=True, grace=0)
    after = sum(p.stat().st_size for p in (store_dir / "shards").rglob("*.safetensors"))
    assert len(plan.compact) == len(shards) >= 4 and res.features_moved
    freed = before - after
    assert 0 <= freed - plan.freed_bytes <= 512 * len(shards), (plan.freed_bytes, freed)


@given(
    st.lists(st.tuples(st.integers(1, 10**9), st.integers(1, 50)), min_size=1, max_size=20),
    st.integers(0, 10**6),
)
def test_a_shortfall_of_shared_shards_counts_every_byte(
    shards: list[tuple[int, int]], budget: int
) -> None:
    """A bucket shard's bytes are shared among its keys as fractions: their sum can fall a
    hair short of the whole, and the shortfall cut it to one byte less than gc leaves (a run
    then warned of bytes it had not foreseen). Every byte is counted, for any sizes and
    shares."""
    from featbake.upkeep.kept import shortfall

    costs: dict[str, float] = {}
    for s, (size, keys) in enumerate(shards):
        for k in range(keys):
            costs[f"{s}:{k}"] = size / keys
    total = sum(size for size, _ in shards)
    short = shortfall(Layout(Path("/nonexistent-store")), budget, costs, frozenset(costs))
    if total <= budget:
        assert short is None
    else:
        assert short is not None and short.over_bytes == total - budget
        assert short.kept_bytes == total
