"""`featbake merge`: fragments of sharded builds folded into the catalog, idempotently.

Parts are built in-process with ``build(..., shard="i/N")`` (the same code path as the CLI's
``--shard``); readers and the merge itself run as separate processes where concurrency is
what is tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import soundfile
import torch
from torch.utils.data import DataLoader

from featbake.bake.pipeline import build
from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.state import TOUCH_FLUSH_SECONDS, TOUCH_FLUSH_SECONDS_SHARED, WRITEBACK_SECONDS
from featbake.store import fragment_catalog as fragment_catalog_module
from featbake.store import fragments as fragments_module
from featbake.store.catalog import Catalog, hash_cache_rows
from featbake.store.filesystem import SharedFilesystemWarning
from featbake.store.fragment_catalog import FragmentCatalog, RankPart
from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    FragmentName,
    RootRecords,
    fragment_shard_names,
    fragments_dir,
    read_fragment,
    sealed_fragments,
    write_fragment,
)
from featbake.store.hash_cache import FileStat, HashRow
from featbake.store.layout import Layout
from featbake.store.merge import adopt_sealed_parts, merge, pending_builds
from featbake.store.roots import RootSpec
from featbake.store.shard import SealedShard, ShardEntry, write_shard
from featbake.testing import make_tone, write_audio_folder
from featbake.upkeep.gc import GcOptions, gc
from tests.conftest import REPO, invoke, live_features
from tests.helpers import assert_store_consistent, fails_after, stored_features


def catalog_dump(store: Path) -> dict[str, list[tuple]]:
    """Every row of every table, sorted, plus the root manifest files: the store's whole index."""
    conn = sqlite3.connect(store / "catalog.sqlite")
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        dump = {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in tables}
    finally:
        conn.close()
    dump["root files"] = sorted(
        (p.name, p.read_text()) for p in (store / "roots").glob("*.json")
    )  # fmt: skip
    return dump


def store_with_a_root(tmp_path: Path, encoder_file: Path) -> Path:
    """``tmp_path / "store"``, a catalog with one root already (3 clips built the plain way)."""
    store, other = tmp_path / "store", tmp_path / "other"
    write_audio_folder(other, 3, seconds=0.4, seed=4)
    build(other, encoder_file, cache=store, workers=0)
    return store


def build_parts(data: Path, encoder: Path, store: Path, world: int, ranks=None) -> None:
    for rank in range(world) if ranks is None else ranks:
        report = build(data, encoder, cache=store, workers=0, shard=f"{rank}/{world}")
        assert report.ok and report.fragment


def assert_equals_live(store: Path, data: Path, encoder: Path) -> None:
    (root,) = Catalog(Layout(store)).roots()
    got = stored_features(store, root.name)
    assert sorted(got) == sorted(p.relative_to(data).as_posix() for p in data.rglob("*.wav"))
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder, data / rel))
    assert_store_consistent(store)


def test_merge_publishes_the_whole_manifest_and_twice_changes_nothing(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    store = tmp_path / "store"
    build_parts(audio_dir, encoder_file, store, 3)
    assert not (store / "catalog.sqlite").exists()
    report = merge(Layout(store))
    assert len(report.roots) == 1 and report.fragments >= 3 and not report.pending
    assert sealed_fragments(Layout(store)) == []
    assert_equals_live(store, audio_dir, encoder_file)
    # The manifest is the one a single process publishes: same paths, same keys, same order.
    single = tmp_path / "single"
    build(audio_dir, encoder_file, cache=single, workers=0)
    name = Catalog(Layout(single)).roots()[0].name
    assert Catalog(Layout(store)).root_items(name) == Catalog(Layout(single)).root_items(name)

    first = catalog_dump(store)
    again = merge(Layout(store))
    assert (again.roots, again.fragments, again.new_features) == ([], 0, 0)
    assert catalog_dump(store) == first


def test_one_merge_at_a_time_and_a_fragment_gone_meanwhile_is_never_made_again(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """Two merges at once (or a build adopting parts beside a merge): the second attached a
    fragment the first had folded and removed, and SQLite made an empty file of its name in
    fragments/ (verify then called it damaged; every later merge failed on it). A merge now
    holds the store's merge lock for its run, and a fragment is attached read-only."""
    from featbake.store.locks import locked
    from featbake.store.merge import MERGE_LOCK

    store = tmp_path / "store"
    build_parts(audio_dir, encoder_file, store, 2)
    layout = Layout(store)
    gone = sealed_fragments(layout)[0].path
    held: list[bool] = []

    def step(name: str) -> None:
        if name == "root":  # another merge waits for this one: the lock is taken
            try:
                with locked(store / MERGE_LOCK, wait=0):
                    held.append(False)
            except TimeoutError:
                held.append(True)

    merge(layout, between=step)
    assert held == [True] and not gone.exists()
    with Catalog(layout) as catalog, pytest.raises(sqlite3.Error):
        catalog.add_fragment_shards(gone)  # merged and removed meanwhile: not made again
    assert not gone.exists() and sealed_fragments(layout) == []
    assert_equals_live(store, audio_dir, encoder_file)


def test_a_merge_waiting_for_another_says_so_once_then_merges_what_is_left(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second merge waited in silence for the first (a long merge: it looked hung). It now
    says once that it waits, then merges what is left (here everything: the lock was held
    by the test, not by a merge)."""
    from featbake.store.locks import locked
    from featbake.store.merge import MERGE_LOCK, MergeWaitWarning

    store = tmp_path / "store"
    build_parts(audio_dir, encoder_file, store, 2)
    said, reports = threading.Event(), []

    def shown(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, MergeWaitWarning):
            said.set()

    monkeypatch.setattr(warnings, "showwarning", shown)
    with locked(store / MERGE_LOCK):
        waiting = threading.Thread(target=lambda: reports.append(merge(Layout(store))))
        with warnings.catch_warnings():
            warnings.simplefilter("always", MergeWaitWarning)
            monkeypatch.setattr(warnings, "showwarning", shown)
            waiting.start()
            assert said.wait(timeout=60)
            assert waiting.is_alive()  # it waits for the lock
    waiting.join(timeout=120)
    assert not waiting.is_alive() and len(reports[0].roots) == 1
    assert_equals_live(store, audio_dir, encoder_file)


class Killed(Exception):
    """Stands for SIGKILL at one step of a merge."""


@pytest.mark.parametrize("step", ["root", "rows", "hashes"])
def test_a_merge_killed_at_any_step_then_rerun_gives_the_same_catalog(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, step: str
) -> None:
    store = tmp_path / "store"
    build_parts(audio_dir, encoder_file, store, 2)
    straight = tmp_path / "straight"
    shutil.copytree(store, straight)
    merge(Layout(straight))

    def die(at: str) -> None:
        if at == step:
            raise Killed(at)

    with pytest.raises(Killed):
        merge(Layout(store), between=die)
    assert len(sealed_fragments(Layout(store))) >= 2  # fragments go only after the fold
    merge(Layout(store))
    assert catalog_dump(store) == catalog_dump(straight)
    assert_equals_live(store, audio_dir, encoder_file)


def test_a_build_with_a_part_missing_stays_pending(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    store = store_with_a_root(tmp_path, encoder_file)
    build_parts(audio_dir, encoder_file, store, 2, ranks=[1])
    report = merge(Layout(store))
    assert report.roots == [] and len(report.pending) == 1
    assert report.pending[0].ranks_done == (1,) and report.pending[0].world == 2
    assert len(Catalog(Layout(store)).roots()) == 1  # not published: it would be partial
    for command in ("roots", "stats"):
        shown = invoke(command, "--cache", store)
        assert shown.returncode == 0, shown.stderr
        assert "pending" in shown.stdout and "1 of 2 ranks done" in shown.stdout

    build_parts(audio_dir, encoder_file, store, 2, ranks=[0])
    assert all(
        f.kind in (FragmentKind.PART, FragmentKind.DONE) for f in sealed_fragments(Layout(store))
    )
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0 and "1 roots published" in merged.stdout
    assert pending_builds(Layout(store)) == []
    assert len(Catalog(Layout(store)).roots()) == 2


def file_digest(path: Path) -> str:
    """The bytes' digest; a missing file counts as empty (a read-only reader of a WAL database
    may create the empty -wal file SQLite expects, which writes nothing)."""
    return hashlib.sha256(path.read_bytes() if path.exists() else b"").hexdigest()


def test_a_rank_never_writes_the_shared_catalog(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    store = store_with_a_root(tmp_path, encoder_file)
    files = [store / "catalog.sqlite", store / "catalog.sqlite-wal"]
    before = [file_digest(p) for p in files]
    build_parts(audio_dir, encoder_file, store, 2)
    assert [file_digest(p) for p in files] == before
    assert merge(Layout(store)).roots


READER = """
import sys, time
from pathlib import Path
import torch
from featbake import CachedFeatureDataset
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.recipe import Recipe

data, encoder, store, stop, ready = sys.argv[1:6]
with torchscript_quietly():
    module = torch.jit.load(encoder)
ds = CachedFeatureDataset(data, encoder=encoder, cache=store, on_miss="error")
src = source_for(Recipe())
with torch.inference_mode():
    want = [module(src.load(ds.path(i)).unsqueeze(0))[0] for i in range(len(ds))]
Path(ready).touch()
passes = 0
while not Path(stop).exists() or passes == 0:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], want[i])
    passes += 1
print(passes)
"""


@pytest.mark.filterwarnings("ignore::featbake.store.filesystem.SharedFilesystemWarning")
@pytest.mark.parametrize("shared_fs", ["0", "1"])
def test_two_processes_read_one_store_while_a_merge_runs(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, shared_fs: str, monkeypatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", shared_fs)
    store = tmp_path / "store"
    served = tmp_path / "served"
    write_audio_folder(served, 6, seconds=(0.3, 0.8), seed=8)
    build(served, encoder_file, cache=store, workers=0)
    # Many small shards, so the merge has many transactions to interleave with the readers.
    for rank in range(2):
        build(audio_dir, encoder_file, cache=store, workers=0, shard=f"{rank}/2", shard_bytes=1)
    (tmp_path / "reader.py").write_text(READER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_SHARED_FS": shared_fs}

    def stop_ready(i: int) -> list[Path]:
        return [tmp_path / "stop", tmp_path / f"ready{i}"]

    readers = [
        subprocess.Popen(
            [sys.executable, tmp_path / "reader.py", served, encoder_file, store, *stop_ready(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(r.poll() is None for r in readers)
        time.sleep(0.05)
    # The merge in this process; the readers are the two other processes.
    merged = invoke("merge", "--cache", store, env={"FEATBAKE_SHARED_FS": shared_fs})
    (tmp_path / "stop").touch()
    for r in readers:
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        assert int(out.split()[-1]) >= 1
    assert merged.returncode == 0, merged.stderr
    assert "1 roots published" in merged.stdout
    assert len(Catalog(Layout(store)).roots()) == 2
    mode = sqlite3.connect(store / "catalog.sqlite").execute("PRAGMA journal_mode").fetchone()
    assert mode == (("delete",) if shared_fs == "1" else ("wal",))


def test_gc_keeps_the_shards_of_a_build_not_merged_yet(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    store = store_with_a_root(tmp_path, encoder_file)
    build_parts(audio_dir, encoder_file, store, 2, ranks=[0])
    gc = invoke("gc", "--grace", "0s", "--cache", store)  # no grace: only fragments protect
    assert gc.returncode == 0, gc.stderr
    build_parts(audio_dir, encoder_file, store, 2, ranks=[1])
    report = merge(Layout(store))
    assert report.missing_shards == [] and report.roots
    name = next(r.name for r in Catalog(Layout(store)).roots() if r.data == str(audio_dir))
    assert len(stored_features(store, name)) == len(list(audio_dir.rglob("*.wav")))


def write_as_legacy_fragment(path: Path, version: int) -> None:
    """Rewrite a sealed fragment in the tables of fragment format 1 or 2 (before format 3 made
    a fragment a catalog), as a featbake of that format wrote them."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE entries AS SELECT s.name AS shard, f.key, f.part, f.dtype, f.shape, f.nbytes
            FROM features f JOIN shards s ON s.id = f.shard_id;
        CREATE TABLE old_shards AS SELECT name, bytes, encoder_fp, recipe_fp FROM shards;
        CREATE TABLE items AS SELECT idx, path, key FROM root_items;
        CREATE TABLE hashes AS SELECT path, size, mtime_ns, inode, sha256, ctime_ns, recorded_ns
            FROM hash_cache;
        DROP TABLE features; DROP TABLE shards; DROP TABLE root_items; DROP TABLE roots;
        DROP TABLE hash_cache; DROP TABLE encoders;
        ALTER TABLE old_shards RENAME TO shards;
        DELETE FROM meta WHERE name = 'schema_version';
        """
    )
    if version == 1:
        conn.execute("DROP TABLE uses")
    conn.execute("UPDATE meta SET value=? WHERE name='format_version'", (str(version),))
    conn.commit()
    conn.close()


@pytest.mark.parametrize("version", [1, 2])
def test_fragments_of_older_formats_are_still_merged(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, version: int
) -> None:
    store = tmp_path / "store"
    build_parts(audio_dir, encoder_file, store, 2)
    for frag in sealed_fragments(Layout(store)):
        write_as_legacy_fragment(frag.path, version)
    assert merge(Layout(store)).roots
    with Catalog(Layout(store)) as cat:  # the hash rows came over too
        assert len(hash_cache_rows(cat)) >= len(list(audio_dir.rglob("*.wav")))
    assert_equals_live(store, audio_dir, encoder_file)


def test_a_merge_points_rows_of_a_lost_shard_file_at_the_new_copy(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """A catalog row naming a lost shard file, and a fragment holding that tensor in another
    shard: the merge (rows copied through ATTACH) points the row at the new shard."""
    store = tmp_path / "store"
    layout = Layout(store)
    build_parts(audio_dir, encoder_file, store, 2)
    merge(layout)
    with Catalog(layout) as cat:
        lost = cat.shard_rows()[0]
        entries = tuple(
            ShardEntry(f.key, f.part, f.dtype, tuple(json.loads(f.shape)), f.nbytes)
            for f in cat.features_of_shard(lost.id)
        )
    # The same bytes under another name stand for a shard another writer sealed meanwhile.
    moved = hashlib.sha256(lost.name.encode()).hexdigest()
    layout.shard_path(moved).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(layout.shard_path(lost.name), layout.shard_path(moved))
    layout.shard_path(lost.name).unlink()
    shard = SealedShard(
        moved, layout.shard_path(moved), lost.bytes, lost.encoder_fp, lost.recipe_fp, entries
    )
    info = BuildInfo("c" * 32, 0, 1, "", "", "", "", lost.encoder_fp, "", {})
    write_fragment(layout, info, FragmentKind.SERVE, [shard])

    report = merge(layout)
    assert report.new_features == len(entries) > 0
    with Catalog(layout) as cat:
        assert {loc.shard for e in entries for loc in cat.locate(e.key)} == {moved}
        assert lost.name not in {s.name for s in cat.shard_rows()}
        (root,) = cat.roots()
    got = stored_features(store, root.name)
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel))
    assert len(got) == len(list(audio_dir.rglob("*.wav")))


# == test_serving_fragments ========================================================================
# Serving on a shared filesystem (issue 10, items 3 and 4): the catalog only read, writes in
# ``serve`` fragments, ``featbake merge`` folding them in, and DDP ranks reading while it runs.
#
# ``FEATBAKE_SHARED_FS=1`` forces the mode. Everything is real: builds, SQLite files, DataLoader
# workers, ``featbake merge`` / ``gc`` / ``verify`` as subprocesses, torchrun with gloo; every
# served feature is compared with running the encoder now.

TOL = {"rtol": 1e-5, "atol": 1e-6}
SHARED = {"FEATBAKE_SHARED_FS": "1"}

# Said once per store and process; the tests that check the line catch it themselves.
pytestmark = pytest.mark.filterwarnings("ignore::featbake.store.filesystem.SharedFilesystemWarning")


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def add_new_files(data: Path, n: int, seed: int = 70) -> list[Path]:
    """Files the build never saw: a dataset over ``data`` misses them."""
    new = [data / f"zz_new{j}.wav" for j in range(n)]
    for j, path in enumerate(new):
        soundfile.write(path, make_tone(0.4 + 0.1 * j, seed=seed + j), 16000)
    return new


def catalog_state(store: Path) -> tuple[bytes, int, list[str]]:
    """The catalog's bytes, its mtime and the SQLite files beside it."""
    cat = store / "catalog.sqlite"
    return cat.read_bytes(), cat.stat().st_mtime_ns, sorted(p.name for p in store.glob("catalog*"))


def serve_fragments(store: Path) -> list[Path]:
    return [f.path for f in sealed_fragments(Layout(store)) if f.kind is FragmentKind.SERVE]


def cataloged_shards(store: Path) -> set[str]:
    conn = sqlite3.connect(f"file:{store / 'catalog.sqlite'}?mode=ro", uri=True)
    try:
        return {name for (name,) in conn.execute("SELECT name FROM shards")}
    finally:
        conn.close()


def assert_serves_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))), **TOL)


def test_a_dataset_reads_the_catalog_only_and_writes_back_to_fragments_that_merge_folds_in(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")  # DataLoader workers inherit it
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    new = add_new_files(audio_dir, 3)
    before = catalog_state(store_dir)
    with pytest.warns(SharedFilesystemWarning) as said:
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    lines = [str(w.message) for w in said if "read-only" in str(w.message)]
    assert len(lines) == 1 and "featbake merge" in lines[0] and "\n" not in lines[0]
    assert ds.stored() == len(ds) - len(new)

    # One epoch in two workers: hits are read, the misses encoded and written back.
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list)
    got = [item for batch in loader for item in batch]
    for i, feat in enumerate(got):
        torch.testing.assert_close(feat, live_features(encoder_file, Path(ds.path(i))), **TOL)
    assert catalog_state(store_dir) == before  # not a byte written, no journal left behind
    frags = serve_fragments(store_dir)
    written = fragment_shard_names(Layout(store_dir)) - cataloged_shards(store_dir)
    assert frags and written  # the workers' shards are named by fragments, not by rows
    assert all(Layout(store_dir).shard_path(n).is_file() for n in written)

    # Before any merge another dataset finds them in the fragments (on_miss="error": no encoding).
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedFilesystemWarning)  # said once per store
        again = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert again.stored() == len(again)
    assert_serves_live(again, encoder_file)
    again.close()
    assert catalog_state(store_dir) == before

    roots = invoke("roots", "--cache", store_dir, env=SHARED)
    assert roots.returncode == 0 and "serving fragments" in roots.stdout, roots.stderr
    # gc keeps shards that only unmerged fragments name, even with no grace period.
    gc = invoke("gc", "--grace", "0s", "--cache", store_dir, env=SHARED)
    assert gc.returncode == 0, gc.stderr
    assert all(Layout(store_dir).shard_path(n).is_file() for n in written)

    merged = invoke("merge", "--cache", store_dir, env=SHARED)
    assert merged.returncode == 0, merged.stderr
    assert "merged" in merged.stdout and serve_fragments(store_dir) == []
    assert written <= cataloged_shards(store_dir)
    fresh = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert fresh.stored() == len(fresh)
    assert_serves_live(fresh, encoder_file)
    assert fresh.cache_info().encoded == 0
    fresh.close()  # seals its last uses (and hash rows no longer racy): folded by a merge
    assert serve_fragments(store_dir)
    assert invoke("merge", "--cache", store_dir, env=SHARED).returncode == 0
    gc = invoke("gc", "--grace", "0s", "--cache", store_dir, env=SHARED)
    assert gc.returncode == 0, gc.stderr
    assert all(Layout(store_dir).shard_path(n).is_file() for n in written)  # the root has them
    verify = invoke("verify", "--cache", store_dir, env=SHARED)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert invoke("merge", "--cache", store_dir, env=SHARED).stdout.strip() == "nothing to merge"


def test_the_writer_serves_its_write_back_and_last_uses_reach_the_catalog_through_merge(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with Catalog(Layout(store_dir)) as cat:
        cat.conn.execute("UPDATE features SET last_used=0")
    (new,) = add_new_files(audio_dir, 1)
    before = catalog_state(store_dir)
    clock = FakeClock()
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, clock=clock)
    miss = next(i for i in range(len(ds)) if ds.path(i) == str(new))
    want = live_features(encoder_file, new)
    torch.testing.assert_close(ds[miss], want, **TOL)
    clock.now += WRITEBACK_SECONDS + 1
    hits = [i for i in range(len(ds)) if i != miss]
    ds[hits[0]]  # past its age: the write-back shard is sealed, with a fragment naming it
    assert len(serve_fragments(store_dir)) >= 1 and ds.stored() == len(ds)
    reads = ds.cache_info().store_reads
    torch.testing.assert_close(ds[miss], want, **TOL)  # read back from its shard, not encoded
    assert ds.cache_info().encoded == 1 and ds.cache_info().store_reads == reads + 1

    # Last uses: not every 30 s as in the catalog, but every 10 minutes, one fragment each.
    def with_uses() -> int:
        return sum(
            bool(read_fragment(p, Layout(store_dir)).uses) for p in serve_fragments(store_dir)
        )

    clock.now += TOUCH_FLUSH_SECONDS
    for _ in range(300):  # past 256 reads: upkeep runs
        ds[hits[1]]
    assert with_uses() == 0
    clock.now += TOUCH_FLUSH_SECONDS_SHARED
    for _ in range(300):
        ds[hits[1]]
    assert with_uses() == 1
    assert catalog_state(store_dir) == before
    ds.close()

    report = merge(Layout(store_dir))
    assert report.serving_fragments >= 2 and report.new_features == 1
    with Catalog(Layout(store_dir)) as cat:
        used = dict(cat.conn.execute("SELECT key, last_used FROM features").fetchall())
    assert used[ds.key(hits[1])] > 0 and used[ds.key(miss)] > 0  # the miss: its shard's time
    assert used[ds.key(hits[2])] == 0  # never read


def test_merge_keeps_a_root_built_after_the_dataset_made_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    layout = Layout(tmp_path / "store").ensure()
    args = {"data": "/d", "encoder_label": "e", "encoder_fp": "e" * 64, "recipe_fp": "r" * 64}
    with Catalog(layout) as cat:
        cat.replace_root(RootSpec("r", **args, recipe={}), [("a.wav", "k1")], now=1.0)
    served = FragmentCatalog(layout)
    served.replace_root(RootSpec("r", **args, recipe={}), [("a.wav", "k1"), ("b.wav", "k2")])
    served.close()
    merge(Layout(layout.root))
    with Catalog(layout) as cat:  # the dataset's manifest is newer than the catalog's: it wins
        assert [tuple(x) for x in cat.root_items("r")] == [("a.wav", "k1"), ("b.wav", "k2")]
        served = FragmentCatalog(layout)
        served.replace_root(RootSpec("r", **args, recipe={}), [("old.wav", "k0")])
        served.close()  # its fragment is sealed now ...
        later = time.time() + 60
        cat.replace_root(
            RootSpec("r", **args, recipe={}), [("c.wav", "k3")], now=later
        )  # ... a build
    report = merge(Layout(layout.root))
    assert report.serving_fragments == 1 and report.roots == []
    with Catalog(layout) as cat:
        assert [tuple(x) for x in cat.root_items("r")] == [("c.wav", "k3")]


DDP_READER = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler
from featbake.serve.dataset import CachedFeatureDataset
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.recipe import Recipe

data, encoder, store, tmp = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()
with torchscript_quietly():
    module = torch.jit.load(encoder)
ds = CachedFeatureDataset(data, encoder=encoder, cache=store)
src = source_for(Recipe())
with torch.inference_mode():
    want = [module(src.load(ds.path(i)).unsqueeze(0))[0] for i in range(len(ds))]
sampler = DistributedSampler(ds, shuffle=True, seed=0)
Path(tmp, f"ready{rank}").touch()
epoch = reads = 0
while not Path(tmp, "stop").exists() or epoch < 3:
    sampler.set_epoch(epoch)
    for i in sampler:
        torch.testing.assert_close(ds[i], want[i], rtol=1e-5, atol=1e-6)
        reads += 1
    ds.flush()  # seal this epoch's write-back (a fragment), as a worker does when it exits
    epoch += 1
    Path(tmp, f"epoch{rank}").touch()
dist.barrier()
Path(tmp, f"result{rank}").write_text(f"{reads} {ds.cache_info().encoded}")
ds.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ddp_ranks_read_one_shared_store_while_a_merge_runs(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    store = tmp_path / "store"
    served = tmp_path / "served"
    write_audio_folder(served, 6, seconds=(0.3, 0.8), seed=8)
    build(served, encoder_file, cache=store, workers=0)
    new = add_new_files(served, 3)  # misses: each rank writes back what it meets
    # A sharded build not merged yet, in many small shards: the merge has much to fold.
    for rank in range(2):
        build(audio_dir, encoder_file, cache=store, workers=0, shard=f"{rank}/2", shard_bytes=1)
    (tmp_path / "reader.py").write_text(DDP_READER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **SHARED}
    torchrun = Path(sys.executable).with_name("torchrun")
    ranks = subprocess.Popen(
        [torchrun, "--nproc-per-node", "2", "--standalone", tmp_path / "reader.py", served,
         encoder_file, store, tmp_path],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not all((tmp_path / f"epoch{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and ranks.poll() is None, ranks.communicate()
        time.sleep(0.05)
    assert serve_fragments(store)  # the ranks' write-back, waiting for a merge
    merged = invoke("merge", "--cache", store, "--json", env=SHARED)  # while both ranks read
    (tmp_path / "stop").touch()
    out, err = ranks.communicate(timeout=240)
    assert ranks.returncode == 0, out + err
    assert merged.returncode == 0, merged.stderr
    report = json.loads(merged.stdout)
    assert report["serving_fragments"] >= 2 and report["roots"] and not report["missing_shards"]
    results = [(tmp_path / f"result{r}").read_text().split() for r in range(2)]
    assert all(int(reads) > 0 for reads, _ in results)
    assert sum(int(encoded) for _, encoded in results) >= len(new)  # each miss, once or twice

    final = invoke("merge", "--cache", store, env=SHARED)  # what they wrote after the merge
    assert final.returncode == 0, final.stderr
    verify = invoke("verify", "--cache", store, env=SHARED)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    ds = CachedFeatureDataset(served, encoder_file, cache=store, on_miss="error")
    assert ds.stored() == len(ds) == 9
    assert_serves_live(ds, encoder_file)
    ds.close()
    other = CachedFeatureDataset(audio_dir, encoder_file, cache=store, on_miss="error")
    assert other.stored() == len(other) == 16
    other.close()


def test_an_unreadable_serving_fragment_is_named_with_what_moving_it_aside_loses(
    tmp_path: Path,
) -> None:
    layout = Layout(tmp_path / "store").ensure()
    FragmentCatalog(layout).touch(["k" * 64])
    (path,) = serve_fragments(layout.root)
    path.write_bytes(b"not sqlite" * 100)
    with pytest.raises(StoreCorrupt, match=r"serving fragment .* encoded again when next needed"):
        merge(layout)
    path.rename(tmp_path / "aside.sqlite")
    assert merge(layout).serving_fragments == 0


KILLED_WRITER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA cache_size=1")  # dirty pages spill into the file: the journal is hot
conn.execute("BEGIN IMMEDIATE")
conn.executemany(
    "INSERT INTO hash_cache(path, size, mtime_ns, inode, sha256) VALUES (?, 0, 0, 0, '')",
    [(f"/killed/{i:05d}/" + "x" * 200,) for i in range(3000)],
)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_writer_killed_mid_transaction_is_named_and_the_next_merge_rolls_it_back(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch
) -> None:
    """In rollback-journal mode a writer killed mid-transaction leaves a hot journal that a
    read-only reader cannot roll back: the dataset says what to run, and merge does it."""
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, store_dir / "catalog.sqlite"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    writer.kill()
    writer.wait()
    assert (store_dir / "catalog.sqlite-journal").exists()
    with pytest.raises(StoreError, match=r"killed mid-transaction.*featbake merge"):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    merged = invoke("merge", "--cache", store_dir, env=SHARED)
    assert merged.returncode == 0, merged.stderr
    assert not (store_dir / "catalog.sqlite-journal").exists()
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert ds.stored() == len(ds) == 16
    assert_serves_live(ds, encoder_file)
    ds.close()
    verify = invoke("verify", "--cache", store_dir, env=SHARED)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_one_fragment_catalog_seals_a_ranks_part_and_done_and_a_readers_serve_fragments(
    tmp_path: Path,
) -> None:
    """Issue 27: one FragmentCatalog, one seal path, for a build rank (``part`` per shard, then
    ``done`` with its manifest slice) and a serving process (``serve``), told apart by its
    ``fragmented`` property, not its class; a serving one is used from any thread (a
    finalizer's), and what another thread sealed is read back here before any merge."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    built, served = "a" * 64, "b" * 64
    spec = RootSpec("r", "/d", "enc", efp, rfp, {})
    rank = FragmentCatalog(layout, RankPart(0, 1, [("a.wav", 10)]))
    with Catalog(layout) as cat:
        assert rank.fragmented and not cat.fragmented
    rank.record_encoder(efp, "enc", "torchscript")
    rank.replace_root(spec, [("a.wav", built)])
    rank.add_shard(write_shard(layout, {built: torch.ones(3)}, efp, rfp))
    assert rank.finish() is not None
    rank.close()
    assert sorted(n.kind for n in sealed_fragments(layout)) == [
        FragmentKind.DONE,
        FragmentKind.PART,
    ]

    reader = FragmentCatalog(layout)
    assert reader.fragmented and reader.kind is FragmentKind.SERVE
    shard = write_shard(layout, {served: torch.full((2,), 2.0)}, efp, rfp)
    sealer = threading.Thread(target=reader.add_shard, args=(shard,))  # e.g. a finalizer
    sealer.start()
    sealer.join()
    assert [loc.shard for loc in reader.locate(served)] == [shard.name]  # no merge yet
    reader.close()
    serve = [n for n in sealed_fragments(layout) if n.kind is FragmentKind.SERVE]
    assert len(serve) == 1 and serve[0].build_id == reader.serve_id

    merge(layout)
    with Catalog(layout) as cat:
        assert [tuple(i)[-2:] for i in cat.root_items("r")] == [("a.wav", built)]
        assert cat.present_keys([built, served]) == {built, served}


def test_a_shard_gone_before_its_fragment_never_stops_later_seals(tmp_path: Path) -> None:
    """Review: a shard whose file vanished before its fragment was sealed stayed pending, so
    every later seal named it again and failed (the write-back's and last-use fragments, whose
    errors are passed over, were lost for the rest of the run)."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    gone, kept = "a" * 64, "b" * 64
    reader = FragmentCatalog(layout)
    reader.record_encoder(efp, "enc", "torchscript")
    shard = write_shard(layout, {gone: torch.ones(3)}, efp, rfp)
    layout.shard_path(shard.name).unlink()  # gc removed a byte-identical copy meanwhile
    with pytest.raises(ShardMissing):
        reader.add_shard(shard)
    other = write_shard(layout, {kept: torch.full((2,), 2.0)}, efp, rfp)
    reader.add_shard(other)  # sealed: the vanished shard is no longer pending
    reader.touch([kept])
    reader.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert cat.present_keys([gone, kept]) == {kept}


class HeldUp:
    """``write_fragment`` held up at its start until released (the one point patched): what a
    slow upload of a fragment into a bucket looks like to the threads around it. Records the
    shards and hash rows each call was given."""

    def __init__(self, after: Callable[[], None] = lambda: None) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls: list[tuple[list[str], list[str]]] = []  # (shard names, hashed paths)
        self.real = fragments_module.write_fragment
        self.after = after  # called once the fragment is renamed into place

    def __call__(self, layout, info, kind, shards, items=(), hashes=(), uses=(), fidelity="", **kw):
        self.calls.append(([s.name for s in shards], [h.path for h in hashes]))
        self.entered.set()
        self.release.wait(timeout=120)  # released by the test; bounded so nothing hangs for good
        path = self.real(layout, info, kind, shards, items, hashes, uses, fidelity, **kw)
        self.after()
        return path


def test_a_read_never_waits_for_a_seal_writing_its_fragment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FragmentCatalog held its one lock while a seal wrote (and into a bucket uploaded) its
    fragment, so a serving loader's read thread waited for each write-back's seal. A read of a
    key in the catalog and of one in another process's serve fragment now returns while a seal
    is held up in write_fragment; released, that seal completes and its shard is found."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    in_catalog, in_fragment, written = "a" * 64, "b" * 64, "c" * 64
    with Catalog(layout) as cat:
        cat.add_shard(write_shard(layout, {in_catalog: torch.ones(3)}, efp, rfp))
    earlier = FragmentCatalog(layout)  # another process's write-back, not merged yet
    kept = write_shard(layout, {in_fragment: torch.full((2,), 2.0)}, efp, rfp)
    earlier.add_shard(kept)
    earlier.close()

    held = HeldUp()
    monkeypatch.setattr(fragment_catalog_module, "write_fragment", held)
    serving = FragmentCatalog(layout)
    shard = write_shard(layout, {written: torch.full((4,), 3.0)}, efp, rfp)
    sealer = threading.Thread(target=serving.add_shard, args=(shard,))
    found: dict = {}
    reader = threading.Thread(
        target=lambda: found.update(serving.locate_many([in_catalog, in_fragment]))
    )
    try:
        sealer.start()
        assert held.entered.wait(timeout=60), "the seal never reached write_fragment"
        reader.start()
        reader.join(timeout=30)  # a bound on a hang, not a speed: it returns in milliseconds
        assert not reader.is_alive(), "a read waited for another thread's seal to be written"
        assert sealer.is_alive() and not held.release.is_set()  # the seal is still held up
    finally:
        held.release.set()
        sealer.join(timeout=60)
        reader.join(timeout=60)
    assert [loc.shard for loc in found[in_fragment]] == [kept.name]
    assert len(found[in_catalog]) == 1
    assert not sealer.is_alive() and len(serving.fragments) == 1
    assert [loc.shard for loc in serving.locate(written)] == [shard.name]  # no merge yet
    serving.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert cat.present_keys([in_catalog, in_fragment, written]) == {
            in_catalog,
            in_fragment,
            written,
        }


def test_what_other_threads_add_during_a_seal_is_sealed_next_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seal takes what it writes and writes outside the lock: a shard another thread adds
    and a hash row put while it writes are not in its fragment, are not let go when it
    succeeds, and are sealed by the next seal, each shard in exactly one fragment."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    one, two = "a" * 64, "b" * 64
    held = HeldUp()
    monkeypatch.setattr(fragment_catalog_module, "write_fragment", held)
    serving = FragmentCatalog(layout)
    serving.record_encoder(efp, "enc", "torchscript")
    first = write_shard(layout, {one: torch.ones(3)}, efp, rfp)
    second = write_shard(layout, {two: torch.full((2,), 2.0)}, efp, rfp)
    row = HashRow("/d/late.wav", FileStat(10, 1, 7, 1), "f" * 64)  # hashed long ago: trusted
    sealer = threading.Thread(target=serving.add_shard, args=(first,))
    adder = threading.Thread(target=serving.add_shard, args=(second,))
    try:
        sealer.start()
        assert held.entered.wait(timeout=60), "the seal never reached write_fragment"
        adder.start()
        deadline = time.monotonic() + 30  # a bound on a hang: it is added at once
        while second.name not in serving._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second.name in serving._pending, "add_shard waited for another thread's seal"
        serving.put_hashes([row])
        assert sealer.is_alive() and adder.is_alive()  # the first seal is still held up
    finally:
        held.release.set()
        sealer.join(timeout=60)
        adder.join(timeout=60)
    assert held.calls == [([first.name], []), ([second.name], [row.path])]
    serving.flush()  # nothing is left held: no third fragment
    assert len(serving.fragments) == 2
    frags = [read_fragment(fragments_dir(layout) / n, layout) for n in serving.fragments]
    assert [[s.name for s in f.shards] for f in frags] == [[first.name], [second.name]]
    assert [f.info.encoder_kind for f in frags] == ["torchscript", ""]  # carried once
    assert {loc.shard for k in (one, two) for loc in serving.locate(k)} == {
        first.name,
        second.name,
    }
    serving.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert cat.present_keys([one, two]) == {one, two}
        assert [r.path for r in hash_cache_rows(cat)] == [row.path]


def test_a_seal_that_cannot_be_written_keeps_what_it_held_for_the_next(tmp_path: Path) -> None:
    """A seal whose fragment cannot be written (fragments/ is a file here) raises StoreError
    and lets go of nothing: the next seal carries the shard, the manifest, the encoder and
    the hash rows, and merge publishes them."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    key = "a" * 64
    serving = FragmentCatalog(layout)
    serving.record_encoder(efp, "enc", "torchscript")
    serving.replace_root(RootSpec("r", "/d", "enc", efp, rfp, {}), [("/d/a.wav", key)])
    serving.put_hashes([HashRow("/d/a.wav", FileStat(10, 1, 7, 1), "f" * 64)])
    shard = write_shard(layout, {key: torch.ones(3)}, efp, rfp)
    blocker = fragments_dir(layout)
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match="could not write the catalog fragment"):
        serving.add_shard(shard)
    assert serving.fragments == []
    blocker.unlink()
    serving.flush()
    assert len(serving.fragments) == 1
    frag = read_fragment(blocker / serving.fragments[0], layout)
    assert [s.name for s in frag.shards] == [shard.name]
    assert [(i.path, i.key) for i in frag.items] == [("/d/a.wav", key)]
    assert [h.path for h in frag.hashes] == ["/d/a.wav"] and frag.info.encoder_kind
    serving.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert [tuple(i)[-2:] for i in cat.root_items("r")] == [("/d/a.wav", key)]
        assert cat.present_keys([key]) == {key}
        assert [r.path for r in hash_cache_rows(cat)] == ["/d/a.wav"]


def test_a_refresh_between_a_fragments_rename_and_its_seal_finds_each_tensor_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal writes outside the lock, so a refresh may read this process's own fragment
    once it is renamed into place and before the seal records it: its shard's tensors are
    still located once, not twice."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp, key = "e" * 64, "r" * 64, "a" * 64
    serving = FragmentCatalog(layout)
    held = HeldUp(after=serving.refresh)  # the refresh a reader thread makes in that moment
    held.release.set()
    monkeypatch.setattr(fragment_catalog_module, "write_fragment", held)
    shard = write_shard(layout, {key: torch.ones(3)}, efp, rfp)
    serving.add_shard(shard)
    assert [(loc.shard, loc.part) for loc in serving.locate(key)] == [(shard.name, "")]
    serving.close()


def test_a_root_grown_by_two_seals_before_a_merge_names_the_keys_of_both(tmp_path: Path) -> None:
    """A serving process's write-back grows its root (``extend_root``, as a CachedEncoder's
    does) and seals, then again before any merge: the second fragment's manifest was the
    catalog's items and the second keys only, and the merge (newest manifest wins) published
    it, so the root lost the first keys and gc could free their features. It now names both,
    and a third seal after a merge still names all three."""
    layout = Layout(tmp_path / "store").ensure()
    with Catalog(layout) as cat:
        cat.roots()  # a merged catalog, as serving needs
    efp, rfp = "e" * 64, "r" * 64
    spec = RootSpec("cached-encoder-e-r", "cached-encoder:e", "enc", efp, rfp, {})
    serving = FragmentCatalog(layout)
    keys = ["a" * 64, "b" * 64, "c" * 64]
    for key in keys[:2]:
        assert serving.extend_root(spec, [key]) == 1
        serving.add_shard(write_shard(layout, {key: torch.ones(2)}, efp, rfp))
    merge(layout)
    with Catalog(layout) as cat:
        assert [i.key for i in cat.root_items(spec.name)] == keys[:2]
    assert serving.extend_root(spec, [keys[2]]) == 1
    serving.add_shard(write_shard(layout, {keys[2]: torch.ones(2)}, efp, rfp))
    serving.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert [i.key for i in cat.root_items(spec.name)] == keys
        assert cat.present_keys(keys) == set(keys)


def test_a_seal_entered_again_on_its_own_thread_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seal that runs code which seals the same catalog again on the same thread (a
    finalizer's flush run by a garbage collection during the write, say) finishes: with a
    plain lock around seals it waited for itself forever. The shard is published once."""
    layout = Layout(tmp_path / "store").ensure()
    key = "a" * 64
    real = fragments_module.write_fragment
    serving = FragmentCatalog(layout)
    nested: list[str | None] = []

    def writes_and_flushes(*args: Any, **kwargs: Any) -> Path:
        if not nested:
            nested.append(None)
            serving.flush()  # the same catalog, the same thread, inside a seal
        return real(*args, **kwargs)

    monkeypatch.setattr(fragment_catalog_module, "write_fragment", writes_and_flushes)
    shard = write_shard(layout, {key: torch.ones(5)}, "e" * 64, "r" * 64)
    with fails_after(20, "a seal entered again on its own thread"):
        serving.add_shard(shard)
    serving.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert cat.present_keys([key]) == {key}
        assert [loc.shard for loc in cat.locate(key)] == [shard.name]


def test_a_merge_folds_an_unfinished_builds_shards_gc_keeps_them_and_parts_in_another_shape_reuse(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """Round four item 9: what an unfinished build sealed is folded by `merge` (it did
    nothing), kept by gc while its fragments wait, reused by a rerun in three parts (only the
    same two parts did), and retired once that rerun's root is published."""
    store = store_with_a_root(tmp_path, encoder_file)
    layout = Layout(store)
    build_parts(audio_dir, encoder_file, store, 2, ranks=[0])  # part 1 of 2 never ran
    sealed = fragments_module.fragment_keys([f.path for f in sealed_fragments(layout)])
    assert sealed
    report = merge(layout)
    assert report.waiting_shards > 0 and report.new_features == len(sealed)
    assert len(report.pending) == 1 and report.superseded == []
    assert Catalog(layout).present_keys(sorted(sealed)) == sealed
    gc = invoke("gc", "--grace", "0s", "--cache", store)
    assert gc.returncode == 0, gc.stderr
    assert Catalog(layout).present_keys(sorted(sealed)) == sealed  # kept while it waits

    reused = 0
    for rank in range(3):
        part = build(audio_dir, encoder_file, cache=store, workers=0, shard=f"{rank}/3")
        reused += part.reused
    assert reused == len(sealed)
    done = merge(layout)
    assert len(done.roots) == 1 and done.superseded == [done.roots[0]]
    assert sealed_fragments(layout) == [] and pending_builds(layout) == []
    assert invoke("verify", "--cache", store).returncode == 0
    root = next(r for r in Catalog(layout).roots() if r.data == str(audio_dir))
    got = stored_features(store, root.name)
    assert sorted(got) == sorted(
        p.relative_to(audio_dir).as_posix() for p in audio_dir.rglob("*.wav")
    )
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel))
    assert_store_consistent(store)


def test_an_abandoned_build_is_retired_and_what_it_stored_is_reused_then_freed(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """A build one part of which was killed for good stayed pending for ever ("`featbake
    merge` when all are done"), and gc kept what it sealed even once nothing else named it:
    nothing could tell the dead part from one still to start. `merge --abandon ROOT` retires
    it: `roots` says how, a root without an unfinished build is refused in one line changing
    nothing, a rebuild reuses what it sealed, and gc frees it once no root names it."""
    store = tmp_path / "store"
    layout = Layout(store)
    build_parts(audio_dir, encoder_file, store, 2, ranks=[0])  # part 1 of 2 was killed
    sealed = fragments_module.fragment_keys([f.path for f in sealed_fragments(layout)])
    (pending,) = pending_builds(layout)
    listed = invoke("roots", "--cache", store)
    assert f"`featbake merge --abandon {pending.root}` if a part was killed" in listed.stdout

    for typo_name in ("r-nosuchroot", "r", "r-"):  # every root's prefix names none
        typo = invoke("merge", "--cache", store, "--abandon", typo_name)
        assert typo.returncode == 2 and len(typo.stderr.strip().splitlines()) == 1, typo.stderr
        assert "names no root with an unfinished build" in typo.stderr, typo.stderr
    assert pending.root in typo.stderr and pending_builds(layout) == [pending]  # nothing changed

    got = invoke("merge", "--cache", store, "--abandon", pending.root[:8])  # a prefix, as roots
    assert got.returncode == 0, got.stderr
    assert f"abandoned: the unfinished builds of root {pending.root}" in got.stdout
    assert sealed_fragments(layout) == [] and pending_builds(layout) == []
    assert "pending" not in invoke("roots", "--cache", store).stdout

    whole = build(audio_dir, encoder_file, cache=store, workers=0)
    clips = len(list(audio_dir.rglob("*.wav")))
    assert whole.reused == len(sealed) and whole.encoded == clips - len(sealed)
    assert_equals_live(store, audio_dir, encoder_file)
    assert invoke("roots", "drop", whole.root, "--cache", store).returncode == 0
    assert invoke("gc", "--grace", "0s", "--cache", store).returncode == 0
    assert Catalog(layout).present_keys(sorted(sealed)) == set()
    assert list((store / "shards").rglob("*.safetensors")) == []


def test_a_done_fragment_carries_its_undecodable_inputs_and_older_ones_read_as_none(
    tmp_path: Path,
) -> None:
    """A rank's ``done`` fragment records the keys it could not decode as a meta row; one
    without that row (written before ranks recorded them), or with an unreadable one, reads as
    none recorded (those inputs are then misses, as before), never as a damaged fragment."""
    layout = Layout(tmp_path / "store").ensure()
    info = BuildInfo("d" * 32, 0, 1, "r", "", "", "", "e" * 64, "", {})
    failed = (("a" * 64, "not audio"), ("b" * 64, "too short"))
    path = write_fragment(layout, info, FragmentKind.DONE, [], records=RootRecords("", failed))
    assert read_fragment(path, layout).undecodable == failed
    older = write_fragment(layout, info, FragmentKind.DONE, [])
    assert read_fragment(older, layout).undecodable == ()
    conn = sqlite3.connect(older)
    with conn:
        conn.execute("INSERT INTO meta(name, value) VALUES ('undecodable', '[not json')")
    conn.close()
    assert read_fragment(older, layout).undecodable == ()


def test_a_build_adopts_an_unfinished_builds_fragments_newest_first(tmp_path: Path) -> None:
    """A Ray build whose padding check failed stores those keys again alone, in later part
    fragments (the first row folded wins). A driver killed before its merge left both; a plain
    build over the store adopted them in their names' order and kept the padded row."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    key = "a" * 64
    rank = FragmentCatalog(layout, RankPart(0, 1, [("a.wav", 10)]))
    rank.record_encoder(efp, "enc", "torchscript")
    rank.replace_root(RootSpec("r", "/d", "enc", efp, rfp, {}), [("a.wav", key)])
    rank.add_shard(write_shard(layout, {key: torch.ones(3)}, efp, rfp))  # padded
    exact = write_shard(layout, {key: torch.full((3,), 2.0)}, efp, rfp)  # encoded alone, later
    rank.add_shard(exact)
    rank.close()  # no finish(): the driver was killed before the merge
    with Catalog(layout) as cat:
        assert adopt_sealed_parts(cat) == 1
        assert [loc.shard for loc in cat.locate(key)] == [exact.name]


def test_keys_a_build_stores_again_replace_their_rows_wherever_they_were_folded(
    tmp_path: Path,
) -> None:
    """A rank stores keys a and b padded (and c, in a shard of its own); a merge folds its
    fragments while it waits (as a bucket's published version then holds them); its padding
    check then fails, it forgets all three and stores a again alone (b's encode fails; c's
    gives the same bytes, so the same shard, named by its bytes). Before, the merge kept the
    rows the catalog held (first row folded wins): a and b served padded. Now the fragment
    sealed as it forgets says it replaces them: a's row is the one stored again, b has none (a
    miss, encoded when read), c's shard sealed again is c's anew, and a merge run again changes
    nothing."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    listing = [("a.wav", 10), ("b.wav", 10), ("c.wav", 10)]
    rank = FragmentCatalog(layout, RankPart(0, 1, listing))
    rank.record_encoder(efp, "enc", "torchscript")
    spec = RootSpec("r", "/d", "enc", efp, rfp, {})
    rank.replace_root(spec, [("a.wav", a), ("b.wav", b), ("c.wav", c)])
    padded = write_shard(layout, {a: torch.ones(3), b: torch.ones(3)}, efp, rfp)
    rank.add_shard(padded)
    same = write_shard(layout, {c: torch.zeros(3)}, efp, rfp)
    rank.add_shard(same)
    merge(layout)  # folds the waiting build's rows
    with Catalog(layout) as cat:
        assert {k: [loc.shard for loc in locs] for k, locs in cat.locate_many([a, b]).items()} == {
            a: [padded.name],
            b: [padded.name],
        }
    rank.forget_keys([a, b, c])
    said = [read_fragment(f.path, layout).replaced for f in sealed_fragments(layout)]
    alone = write_shard(layout, {a: torch.full((3,), 2.0)}, efp, rfp)
    rank.add_shard(alone)
    again = write_shard(layout, {c: torch.zeros(3)}, efp, rfp)
    assert again.name == same.name
    rank.add_shard(again)
    rank.finish()
    rank.close()
    assert merge(layout).roots == ["r"]
    with Catalog(layout) as cat:
        assert [loc.shard for loc in cat.locate(a)] == [alone.name]
        assert cat.locate(b) == []
        assert [loc.shard for loc in cat.locate(c)] == [same.name]
    assert sorted(said, key=len) == [frozenset(), frozenset(), {a, b, c}]  # sealed as it forgot
    assert merge(layout).roots == []


def the_fragment_with_meta(layout: Layout, name: str, value: str) -> FragmentName:
    """The store's one sealed fragment, its meta row ``name`` set to ``value`` (damaged)."""
    (fragment,) = sealed_fragments(layout)
    conn = sqlite3.connect(fragment.path)
    with conn:
        conn.execute("UPDATE meta SET value = ? WHERE name = ?", (value, name))
    conn.close()
    return fragment


def test_a_fragment_whose_replaced_keys_cannot_be_read_is_damaged(tmp_path: Path) -> None:
    """A fragment whose record of the keys it replaces is unreadable is never folded (its
    old rows would be kept as if sound): reading it says it is damaged and what to do."""
    layout = Layout(tmp_path / "store").ensure()
    rank = FragmentCatalog(layout, RankPart(0, 1, [("a.wav", 10)]))
    rank.replace_root(RootSpec("r", "/d", "enc", "e" * 64, "r" * 64, {}), [("a.wav", "a" * 64)])
    rank.forget_keys(["a" * 64])
    rank.close()
    fragment = the_fragment_with_meta(layout, "replaced", '{"a": 1}')
    with pytest.raises(StoreCorrupt, match="move it aside and rerun that rank"):
        read_fragment(fragment.path, layout)


@pytest.mark.parametrize("stored_by", ["another root", "the root rebuilt"])
def test_rows_stored_after_a_waiting_build_replaced_their_key_are_kept(
    tmp_path: Path, stored_by: str
) -> None:
    """Part 0/2 of a build of root w stores a padded, forgets it (its check failed) and is
    killed. Afterwards a build in one process stores a exactly: of another root (the same
    clip elsewhere: the same key), or of w again, superseding the parts. Every later merge
    keeps that row: only rows in shards recorded before the part forgot a are void. Before
    (as first written), every merge dropped each row of a, and with w rebuilt the superseded
    parts' fragments went: a was lost for good."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    a = "a" * 64
    spec = RootSpec("w", "/d", "enc", efp, rfp, {})
    rank = FragmentCatalog(layout, RankPart(0, 2, [("a.wav", 10), ("z.wav", 10)]))
    rank.record_encoder(efp, "enc", "torchscript")
    rank.replace_root(spec, [("a.wav", a)])
    rank.add_shard(write_shard(layout, {a: torch.ones(3)}, efp, rfp))
    rank.forget_keys([a])
    rank.close()  # killed before it stored a again
    later = max(read_fragment(f.path, layout).created for f in sealed_fragments(layout)) + 1
    other = RootSpec("s", "/other", "enc", efp, rfp, {})
    with Catalog(layout) as cat:
        cat.record_encoder(efp, "enc", "torchscript")
        cat.replace_root(other if stored_by == "another root" else spec, [("a.wav", a)], now=later)
        exact = write_shard(layout, {a: torch.full((3,), 2.0)}, efp, rfp)
        cat.add_shard(exact, now=later)
    for _ in range(2):
        merge(layout)
        with Catalog(layout) as cat:
            assert [loc.shard for loc in cat.locate(a)] == [exact.name]
    superseded = stored_by == "the root rebuilt"
    assert (list(sealed_fragments(layout)) == []) == superseded


def test_an_engine_drivers_replacement_voids_what_its_workers_stored(tmp_path: Path) -> None:
    """An engine build: a worker seals a padded under the workers' build id; the driver,
    whose check then failed, forgets a in its own fragments (its build id), and a is not
    stored again. Before, the merge folded the worker's padded row back after the driver's
    fragments: it was served. Now it is void whichever build holds it: a is a miss."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    a = "a" * 64
    spec = RootSpec("w", "/d", "enc", efp, rfp, {})
    worker = FragmentCatalog(layout, RankPart(0, 1, ()))
    worker.record_encoder(efp, "enc", "torchscript")
    worker.replace_root(spec, [])
    worker.add_shard(write_shard(layout, {a: torch.ones(3)}, efp, rfp))
    worker.close()
    driver = FragmentCatalog(layout, RankPart(0, 1, [("a.wav", 10)]))
    driver.record_encoder(efp, "enc", "torchscript")
    driver.replace_root(spec, [("a.wav", a)])
    driver.forget_keys([a])
    driver.finish()
    driver.close()
    merge(layout)
    with Catalog(layout) as cat:
        assert cat.locate(a) == []


@pytest.mark.parametrize("compacted", [False, True])
def test_a_void_row_gc_moves_stays_void(tmp_path: Path, compacted: bool) -> None:
    """A merge lists the fragments, then a part forgets key a (its padding check fails), so
    that merge folds the part's padded row of a back into the catalog; a is stored again; a
    gc compacts the small shards before the next merge. Before, compaction recorded the moved
    padded row's new shard as new, so the next merge kept it over the row stored again: the
    padded row was served. A compacted shard is as old as the oldest its rows came from."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    a, c = "a" * 64, "c" * 64
    rank = FragmentCatalog(layout, RankPart(0, 2, [("a.wav", 10), ("z.wav", 10)]))
    rank.record_encoder(efp, "enc", "torchscript")
    rank.replace_root(RootSpec("w", "/d", "enc", efp, rfp, {}), [("a.wav", a)])
    rank.add_shard(write_shard(layout, {a: torch.ones(3)}, efp, rfp))  # padded
    other = FragmentCatalog(layout, RankPart(0, 1, [("c.wav", 10)]))
    other.record_encoder(efp, "enc", "torchscript")
    other.replace_root(RootSpec("o", "/o", "enc", efp, rfp, {}), [("c.wav", c)])
    other.add_shard(write_shard(layout, {c: torch.zeros(3)}, efp, rfp))
    other.finish()
    other.close()

    def check_fails(step: str) -> None:
        if step == "root":  # the part forgets a, in its fragments and in the store's catalog
            rank.forget_keys([a])
            with Catalog(layout) as cat:
                cat.forget_keys([a])

    merge(layout, between=check_fails)
    exact = write_shard(layout, {a: torch.full((3,), 2.0)}, efp, rfp)
    rank.add_shard(exact)
    if compacted:
        assert gc(layout, GcOptions(merge_small=True, grace=0.0)).shards_written >= 1
    merge(layout)
    with Catalog(layout) as cat:
        assert [loc.shard for loc in cat.locate(a)] == [exact.name]


def test_a_fragment_whose_format_cannot_be_read_leaves_merges_going(tmp_path: Path) -> None:
    """A waiting part's fragment whose format version is not a number: every merge raised
    `ValueError` reading what it replaces. It is left waiting (unreadable), as before."""
    layout = Layout(tmp_path / "store").ensure()
    efp, rfp = "e" * 64, "r" * 64
    rank = FragmentCatalog(layout, RankPart(0, 2, [("a.wav", 10)]))
    rank.record_encoder(efp, "enc", "torchscript")
    rank.replace_root(RootSpec("w", "/d", "enc", efp, rfp, {}), [("a.wav", "a" * 64)])
    rank.add_shard(write_shard(layout, {"a" * 64: torch.ones(3)}, efp, rfp))
    rank.close()
    fragment = the_fragment_with_meta(layout, "format_version", "3.x")
    report = merge(layout)
    assert fragment.path.exists() and report.new_features == 0
