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
import time
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.store.catalog import Catalog, hash_cache_rows
from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    merge,
    pending_builds,
    sealed_fragments,
    write_fragment,
)
from featbake.store.layout import Layout
from featbake.store.shard import SealedShard, ShardEntry
from featbake.testing import write_audio_folder
from tests.conftest import REPO, invoke, live_features, run_cli
from tests.helpers import assert_store_consistent, stored_features


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
    store = tmp_path / "store"
    other = tmp_path / "other"
    write_audio_folder(other, 3, seconds=0.4, seed=4)
    build(other, encoder_file, cache=store, workers=0)  # a catalog with one root already
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
    store = tmp_path / "store"
    other = tmp_path / "other"
    write_audio_folder(other, 3, seconds=0.4, seed=4)
    build(other, encoder_file, cache=store, workers=0)
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


@pytest.mark.filterwarnings("ignore::featbake.store.layout.SharedFilesystemWarning")
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
    merged = run_cli("merge", "--cache", store, env={"FEATBAKE_SHARED_FS": shared_fs})
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
    store = tmp_path / "store"
    other = tmp_path / "other"
    write_audio_folder(other, 3, seconds=0.4, seed=4)
    build(other, encoder_file, cache=store, workers=0)
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
