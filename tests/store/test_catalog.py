"""The SQLite catalog: WAL, schema version, first-wins rows, the hash cache and roots;
connections per thread and process, the transaction helper, typed rows and the views.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake import process
from featbake.bake.pipeline import build
from featbake.encode.fingerprints import cached_file_encoder_fp, encoder_fingerprint, hash_inputs
from featbake.encode.loaders import load_encoder
from featbake.errors import StoreError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import SCHEMA_VERSION, Access, Catalog, EncoderRow, ShardFeature
from featbake.store.hash_cache import FileStat, HashEntry, HashRow
from featbake.store.layout import Layout
from featbake.store.old_catalog import OldCatalog, read_old_catalog
from featbake.store.roots import RootItem, RootSpec
from featbake.store.shard import ShardReader, write_shard
from featbake.testing import TinyConvEncoder, save_torchscript
from tests.conftest import REPO, invoke, live_features
from tests.helpers import can_mount_privately

EFP, RFP = "e" * 64, "r" * 64


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(tmp_path / "store").ensure()


@pytest.fixture
def cat(layout: Layout):
    c = Catalog(layout)
    yield c
    c.close()


def test_wal_mode_and_schema_version(cat: Catalog, layout: Layout) -> None:
    assert cat.conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    other = sqlite3.connect(layout.catalog)  # a plain client sees the same database
    assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert other.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone() == (
        str(SCHEMA_VERSION),
    )
    tables = {r[0] for r in other.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"meta", "shards", "features", "encoders", "roots", "root_items", "hash_cache"} <= tables
    other.close()


def test_schema_version_mismatch_is_a_clear_store_error(cat: Catalog, layout: Layout) -> None:
    cat.conn.execute("UPDATE meta SET value='99' WHERE name='schema_version'")
    cat.close()
    with pytest.raises(StoreError, match=r"schema version 99.*upgrade featbake.*verify --repair"):
        _ = Catalog(layout).conn


def test_a_catalog_too_old_to_upgrade_says_to_repair_not_to_upgrade_featbake(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A catalog of a schema this featbake no longer migrates (1) was refused with "upgrade
    featbake", which the user of the newer featbake cannot follow. It says an older featbake
    wrote it and to repair; the repair rebuilds it from the shards and manifests, and every
    item is served equal to the encoder run now."""
    store = tmp_path / "store"
    build(audio_dir, encoder_file, cache=store, workers=0)
    with sqlite3.connect(store / "catalog.sqlite") as conn:
        conn.execute("UPDATE meta SET value='1' WHERE name='schema_version'")
    conn.close()
    stats = invoke("stats", "--cache", store)
    assert stats.returncode == 5 and "upgrade featbake" not in stats.stderr, stats.stderr
    assert "written by an older featbake" in stats.stderr and "verify --repair" in stats.stderr
    repair = invoke("verify", "--cache", store, "--repair")
    assert repair.returncode == 10 and "repaired" in repair.stdout, repair.stdout + repair.stderr
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store, on_miss="error")
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


def test_a_damaged_catalog_file_is_a_store_error(layout: Layout) -> None:
    layout.catalog.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="move it aside"):
        _ = Catalog(layout).conn


def test_add_shard_is_first_wins(cat: Catalog, layout: Layout) -> None:
    a = write_shard(layout, {"k1": torch.ones(2), "k2/h": torch.ones(3)}, EFP, RFP)
    b = write_shard(layout, {"k1": torch.zeros(2), "k3": torch.zeros(1)}, EFP, RFP)
    assert cat.add_shard(a) == 2
    assert cat.add_shard(b) == 1  # k1 was there: only k3 is new
    assert cat.add_shard(b) == 0  # the same shard twice is harmless
    (loc,) = cat.locate("k1")
    assert loc.shard == a.name and loc.dtype == "F32" and loc.shape == (2,)
    with ShardReader(cat.shard_path(loc.shard)) as r:
        assert torch.equal(r.read(loc.tensor), torch.ones(2))
    assert [x.tensor for x in cat.locate("k2")] == ["k2/h"]
    assert cat.present_keys(["k1", "k2", "k3", "nope"]) == {"k1", "k2", "k3"}
    assert cat.conn.execute("SELECT COUNT(*) FROM shards").fetchone() == (2,)


def test_rows_naming_a_lost_shard_file_are_not_present_and_move_to_a_new_copy(
    cat: Catalog, layout: Layout
) -> None:
    """Issue 11, item 9: a shard file deleted by hand leaves rows that name nothing. Its keys
    are not present (a build encodes them again), and the next shard holding them takes their
    rows (first wins only among features that exist); the lost shard's row goes with them."""
    a = write_shard(layout, {"k1": torch.ones(2), "k2/h": torch.ones(3)}, EFP, RFP)
    b = write_shard(layout, {"k3": torch.ones(1)}, EFP, RFP)
    cat.add_shard(a)
    cat.add_shard(b)
    a.path.unlink()
    assert cat.present_keys(["k1", "k2", "k3"]) == {"k3"}
    again = write_shard(layout, {"k1": torch.ones(2), "k2/h": torch.ones(3), "k3": torch.ones(1),
                                 "k4": torch.ones(1)}, EFP, RFP)  # fmt: skip
    assert cat.add_shard(again) == 3  # k4 is new, k1 and k2/h move; k3 keeps its sound row
    assert {loc.shard for k in ("k1", "k2") for loc in cat.locate(k)} == {again.name}
    assert [loc.shard for loc in cat.locate("k3")] == [b.name]
    assert cat.present_keys(["k1", "k2", "k3", "k4"]) == {"k1", "k2", "k3", "k4"}
    names = {r[0] for r in cat.conn.execute("SELECT name FROM shards")}
    assert names == {b.name, again.name}


def test_lookups_span_more_keys_than_one_query_takes(cat: Catalog, layout: Layout) -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(1234)]
    shard = write_shard(layout, {k: torch.tensor([float(i)]) for i, k in enumerate(keys)}, EFP, RFP)
    cat.add_shard(shard)
    assert cat.present_keys([*keys, "x" * 64]) == set(keys)
    located = cat.locate_many(keys)
    assert len(located) == len(keys) and all(v[0].shard == shard.name for v in located.values())


def test_hash_cache_hit_skips_the_read_and_a_stat_change_misses(
    cat: Catalog, tmp_path: Path
) -> None:
    files = []
    for i in range(3):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(1000 + i))
        files.append(str(p))
    digests, failed = hash_inputs(cat, files)
    assert failed == {}
    assert digests == {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in files}
    # Poison one cached digest: an unchanged stat means the cache is trusted, the file unread
    # (recorded as if 2 s after the file last changed: not "racy", see test_catalog_hardening).
    st = FileStat.of(files[0])
    cat.put_hashes([(files[0], st, "0" * 64)], recorded_ns=st.ctime_ns + 2 * 10**9)
    assert hash_inputs(cat, files)[0][files[0]] == "0" * 64
    # Touch it (mtime changes): the cache misses and the true digest comes back.
    st = os.stat(files[0])
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert hash_inputs(cat, files)[0][files[0]] == digests[files[0]]
    row = cat.hash_rows(files)[files[0]]
    assert (row.stat, row.sha256) == (FileStat.of(files[0]), digests[files[0]])
    # An unreadable file is reported, not raised.
    os.unlink(files[2])
    got, failed = hash_inputs(cat, files)
    assert files[2] not in got and "cannot stat" in failed[files[2]]


def test_roots_are_replaced_at_rebuild(cat: Catalog) -> None:
    common = {"data": "/d", "encoder_label": "enc.pt", "encoder_fp": EFP, "recipe_fp": RFP}
    cat.replace_root(
        RootSpec("r-1", **common, recipe={"a": 1}), [("a.wav", "k1"), ("b.wav", "k2")], now=100.0
    )
    cat.replace_root(
        RootSpec("r-1", **common, recipe={"a": 1}), [("b.wav", "k2"), ("c.wav", "k3")], now=200.0
    )
    assert cat.root_items("r-1") == [("b.wav", "k2"), ("c.wav", "k3")]
    root = cat.root("r-1")
    assert root is not None
    assert (root.items, root.created, root.last_used, root.recipe) == (2, 100.0, 200.0, {"a": 1})
    cat.replace_root(RootSpec("r-2", **common, recipe={}), [], now=300.0)
    assert [r.name for r in cat.roots()] == ["r-2", "r-1"]
    assert cat.root("nope") is None


def test_record_encoder_keeps_first_seen(cat: Catalog) -> None:
    cat.record_encoder(EFP, "a.pt", "torchscript", now=1.0)
    cat.record_encoder(EFP, "b.pt", "torchscript", now=2.0)
    assert cat.conn.execute("SELECT label, first_seen, last_used FROM encoders").fetchall() == [
        ("b.pt", 1.0, 2.0)
    ]


def test_touch_updates_last_used(cat: Catalog, layout: Layout) -> None:
    cat.add_shard(write_shard(layout, {"k1": torch.ones(1)}, EFP, RFP), now=1.0)
    cat.touch(["k1", "k1"], when=5.0)
    assert cat.conn.execute("SELECT last_used FROM features").fetchone() == (5.0,)


def test_a_failed_transaction_rolls_back(cat: Catalog) -> None:
    with pytest.raises(RuntimeError), cat.transaction() as c:
        c.execute("INSERT INTO meta VALUES ('x', 'y')")
        raise RuntimeError("boom")
    assert cat.conn.execute("SELECT COUNT(*) FROM meta WHERE name='x'").fetchone() == (0,)


def test_catalog_reconnects_in_a_forked_child_and_never_closes_the_parents(cat: Catalog) -> None:
    cat.put_hashes([HashRow("p", FileStat(1, 2, 3, 4), "a" * 64)], recorded_ns=10**10)
    parent_conn = cat.conn
    cat.conn.execute("BEGIN")  # the parent holds a read transaction across the fork
    cat.conn.execute("SELECT count(*) FROM hash_cache").fetchone()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = cat.cached_hashes(["p"])["p"].sha256 == "a" * 64 and cat.conn is not parent_conn
        cat.close()  # drops the child's own connection; the inherited one is never closed
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    cat.conn.execute("COMMIT")
    assert cat.conn is parent_conn and cat.cached_hashes(["p"])["p"].sha256 == "a" * 64


def test_no_connection_of_any_thread_is_closed_in_a_forked_child(cat: Catalog) -> None:
    """The child frees the other threads' thread-locals right after fork(); Python's sqlite3
    would close their connections as they are collected. They are kept instead."""
    opened, done = threading.Event(), threading.Event()

    def worker() -> None:
        cat.conn.execute("SELECT 1").fetchone()
        opened.set()
        done.wait()
        cat.close()

    t = threading.Thread(target=worker)
    t.start()
    opened.wait()
    cat.conn.execute("SELECT 1").fetchone()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        gc.collect()
        cat.record_encoder(EFP, "child", "torchscript")  # the child's own, fresh connection
        kept = process.INHERITED_ACROSS_FORK
        try:
            ok = len(kept) >= 2 and not any(c.in_transaction for c in kept)  # raises if closed
        except sqlite3.ProgrammingError:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    done.set()
    t.join()
    assert os.WEXITSTATUS(status) == 0
    assert [r.label for r in cat.encoder_rows()] == ["child"]


def test_one_connection_per_thread(cat: Catalog) -> None:
    cat.put_hashes([HashRow("p", FileStat(1, 2, 3, 4), "a" * 64)], recorded_ns=10**10)
    seen: dict[str, object] = {}

    def in_thread() -> None:
        seen["conn"] = cat.conn
        seen["sha"] = cat.cached_hashes(["p"])["p"].sha256  # no "created in another thread"
        cat.close()

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen["sha"] == "a" * 64 and seen["conn"] is not cat.conn
    assert cat.conn is cat.conn  # the same thread keeps its own


def test_catalog_is_a_context_manager(layout: Layout) -> None:
    with Catalog(layout) as cat:
        conn = cat.conn
        cat.record_encoder(EFP, "a.pt", "torchscript")
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        conn.execute("SELECT 1")
    with Catalog(layout) as again:  # reopens on use after a close
        assert [r.label for r in again.encoder_rows()] == ["a.pt"]


def test_files_are_removed_only_after_commit(cat: Catalog, tmp_path: Path) -> None:
    doomed = tmp_path / "doomed"
    doomed.write_text("x")
    with pytest.raises(RuntimeError), cat.transaction() as c:
        c.after_commit(doomed.unlink)
        raise RuntimeError("boom")
    assert doomed.exists()  # rolled back: the file stays
    with cat.transaction() as c:
        c.after_commit(doomed.unlink)
        assert doomed.exists()  # not before COMMIT
    assert not doomed.exists()


def test_rows_are_typed_and_named(cat: Catalog, layout: Layout) -> None:
    cat.record_encoder(EFP, "a.pt", "torchscript", now=1.0)
    assert cat.encoder_rows() == [EncoderRow(EFP, "a.pt", "torchscript", 1.0, 1.0)]
    cat.add_shard(write_shard(layout, {"k1": torch.ones(2)}, EFP, RFP), now=1.0)
    (sid,) = [s.id for s in cat.shard_rows()]
    (feat,) = cat.features_of_shard(sid)
    assert isinstance(feat, ShardFeature) and (feat.key, feat.shape, feat.nbytes) == (
        "k1",
        "[2]",
        8,
    )
    cat.replace_root(
        RootSpec("r", data="/d", encoder_label="a.pt", encoder_fp=EFP, recipe_fp=RFP, recipe={}),
        [("a.wav", "k1")],
    )
    (item,) = cat.root_items("r")
    assert item == RootItem(path="a.wav", key="k1") == ("a.wav", "k1")  # still a tuple


def test_roots_are_read_and_written_by_column_name(layout: Layout) -> None:
    """A roots table whose columns are in another order (an older or hand-made catalog) still
    round-trips: no positional INSERT ... VALUES or SELECT * is left."""
    conn = sqlite3.connect(layout.catalog)
    conn.execute(
        "CREATE TABLE roots (workdir TEXT NOT NULL DEFAULT '', "
        "last_used REAL NOT NULL, created REAL NOT NULL, items INTEGER NOT "
        "NULL, recipe TEXT NOT NULL, recipe_fp TEXT NOT NULL, encoder_fp TEXT NOT NULL, "
        "encoder_label TEXT NOT NULL, data TEXT NOT NULL, name TEXT PRIMARY KEY)"
    )
    conn.close()
    with Catalog(layout) as cat:
        cat.replace_root(
            RootSpec(
                "r-1",
                data="/d",
                encoder_label="enc.pt",
                encoder_fp=EFP,
                recipe_fp=RFP,
                recipe={"a": 1},
            ),
            [("a.wav", "k1")],
            now=100.0,
        )
        root = cat.root("r-1")
    assert root is not None
    assert (root.name, root.data, root.encoder_label, root.encoder_fp, root.recipe_fp) == (
        "r-1",
        "/d",
        "enc.pt",
        EFP,
        RFP,
    )
    assert (root.recipe, root.items, root.created, root.last_used) == ({"a": 1}, 1, 100.0, 100.0)


def test_a_read_only_catalog_reads_and_sqlite_refuses_its_writes(cat: Catalog) -> None:
    """One Catalog class: its read-only mode is SQLite's ``mode=ro``, not a narrower view."""
    cat.record_encoder(EFP, "a.pt", "torchscript")
    with Catalog(cat.layout, read_only=True) as reader:
        assert reader.read_only
        assert [r.fp for r in reader.encoder_rows()] == [EFP]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.conn.execute("DELETE FROM encoders")


def test_a_shard_gc_unlinked_before_its_rows_commit_is_written_again(
    cat: Catalog, layout: Layout
) -> None:
    """Shard names are content hashes: gc may delete the row of a shard, and a writer may then
    seal byte-identical content at the same path. If gc's unlink lands between the writer's
    rename and its commit, the commit must not name a missing file."""
    from featbake.store.features import FeatureReader
    from featbake.store.shard import ShardWriter

    calls = []

    def on_seal(shard) -> None:
        calls.append(shard.name)
        if len(calls) == 1:
            assert cat.unlink_shard_file(shard.name) > 0  # gc's unlink, in the window
        cat.add_shard(shard)

    tensors = {"k1": torch.arange(4.0), "k2": torch.ones(3)}
    with ShardWriter(layout, EFP, RFP, on_seal=on_seal) as w:
        for key, t in tensors.items():
            w.add(key, {"": t})
    assert len(calls) == 2 and calls[0] == calls[1]  # refused once, then written again
    assert layout.shard_path(calls[0]).is_file()
    reader = FeatureReader(layout, verify="always")
    for key, t in tensors.items():
        assert torch.equal(reader.get(key)[""], t)
    reader.close()


def test_gc_never_unlinks_a_shard_a_row_names(cat: Catalog, layout: Layout) -> None:
    shard = write_shard(layout, {"k1": torch.ones(2)}, EFP, RFP)
    cat.add_shard(shard)
    assert cat.unlink_shard_file(shard.name) == 0 and shard.path.is_file()
    cat.conn.execute("DELETE FROM features")
    cat.conn.execute("DELETE FROM shards")
    assert cat.unlink_shard_file(shard.name) == shard.nbytes and not shard.path.exists()


def test_a_pickled_catalog_opens_its_own_connection(cat: Catalog) -> None:
    cat.record_encoder(EFP, "a.pt", "torchscript")
    copy = pickle.loads(pickle.dumps(cat))  # what a spawned DataLoader worker receives
    assert copy.conn is not cat.conn and [r.fp for r in copy.encoder_rows()] == [EFP]
    copy.close()


def test_an_old_catalog_is_read_by_column_name_and_its_hashes_carried_over(
    cat: Catalog, layout: Layout, tmp_path: Path
) -> None:
    """What verify --repair salvages from a catalog it replaces (read_old_catalog)."""
    cat.record_encoder(EFP, "a.pt", "torchscript", now=1.0)
    cat.replace_root(
        RootSpec(
            "r", data="/d", encoder_label="a.pt", encoder_fp=EFP, recipe_fp=RFP, recipe={"x": 1}
        ),
        [("a.wav", "k1")],
        now=2.0,
    )
    st = FileStat(1, 2, 3, 4)
    cat.put_hashes([HashRow("p", st, "a" * 64)], recorded_ns=10**10)
    cat.close()
    old = read_old_catalog(layout.catalog)
    assert [e.label for e in old.encoders] == ["a.pt"]
    ((root, items),) = old.roots
    assert (root.name, root.recipe, root.items, items) == ("r", {"x": 1}, 1, [("a.wav", "k1")])
    (row,) = old.hash_rows
    assert (row.stat, row.recorded_ns) == (st, 10**10)
    fresh = Catalog(Layout(tmp_path / "fresh").ensure())
    fresh.restore_hashes(old.hash_rows)  # a schema-3 row stays trusted
    fresh.restore_hashes([("q", 1, 2, 3, "b" * 64)])  # a schema-2 row is kept, not trusted
    assert set(fresh.cached_hashes(["p", "q"])) == {"p"} and set(fresh.hash_rows(["q"])) == {"q"}
    fresh.close()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    assert read_old_catalog(garbage) == OldCatalog()


# == test_catalog_hardening ========================================================================
# Catalog hardening (issue 11): stale hash-cache entries (item 1), a lost catalog beside intact
# shards and roots (item 8), and a store that cannot be written (item 17).

#: A root the tests publish before they take the catalog away or make the store read-only.
ROOT = RootSpec("r", "/d", encoder_label="e", encoder_fp="e" * 64, recipe_fp="r" * 64, recipe={})
ARCHIVE_TIME = 1_500_000_000  # a fixed date, as a reproducible tarball or a zip gives its files


def _settle() -> None:
    """Let a second pass, so entries recorded from now on are not "racy" for files made so far."""
    time.sleep(1.1)


def _cp_p(src: Path, dst: Path) -> None:
    """The real ``cp -p``: rewrites ``dst`` in place (same inode), keeping ``src``'s mtime."""
    subprocess.run(["cp", "-p", str(src), str(dst)], check=True)


def _same_size_versions(folder: Path) -> tuple[Path, Path]:
    old, new = folder / "v1.bin", folder / "v2.bin"
    old.write_bytes(b"A" * 4096)
    new.write_bytes(b"B" * 4096)
    for p in (old, new):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    return old, new


# -- item 1: stat-cache staleness ----------------------------------------------------------------
def test_cp_p_of_a_new_version_over_a_hashed_file_is_hashed_again(tmp_path: Path) -> None:
    old, new = _same_size_versions(tmp_path)
    data = tmp_path / "data.bin"
    _cp_p(old, data)
    _settle()
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        assert hash_inputs(cat, [str(data)])[0] == {
            str(data): hashlib.sha256(b"A" * 4096).hexdigest()
        }
        before = os.stat(data)
        _cp_p(new, data)
        after = os.stat(data)
        # What the cache used to trust is all unchanged; only ctime tells.
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
            before.st_size,
            before.st_mtime_ns,
            before.st_ino,
        )
        assert hash_inputs(cat, [str(data)])[0] == {
            str(data): hashlib.sha256(b"B" * 4096).hexdigest()
        }


def test_a_hash_recorded_within_a_second_of_the_files_change_is_not_trusted(
    tmp_path: Path,
) -> None:
    """git's "racy" rule: a write right after hashing may leave the whole stat unchanged on a
    file system with coarse timestamps, so such an entry is treated as unknown."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"new bytes")
    st = FileStat.of(f)
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        # The same stat as now, with the old content's digest, recorded as the file changed.
        cat.put_hashes([HashRow(str(f), st, "0" * 64)], recorded_ns=st.mtime_ns)
        assert cat.cached_hashes([str(f)]) == {}
        assert hash_inputs(cat, [str(f)])[0][str(f)] == hashlib.sha256(b"new bytes").hexdigest()
        # Recorded well after the change, the same entry is trusted (the file is not read).
        cat.put_hashes([HashRow(str(f), st, "0" * 64)], recorded_ns=st.ctime_ns + 2 * 10**9)
        assert hash_inputs(cat, [str(f)])[0][str(f)] == "0" * 64


def test_a_hash_recorded_within_two_seconds_of_a_fat_stamp_is_not_trusted(tmp_path: Path) -> None:
    """The racy window is the stamps' tick: FAT keeps mtime to 2 s (and ctime is mtime), so a
    file hashed 1.5 s after its stamp's tick and rewritten within the same 2 s (same size)
    keeps its whole stat; git compares with its index file's own stamp, of the same tick.
    Before, a one-second window trusted the old digest for the new bytes."""
    f = tmp_path / "clip.wav"
    f.write_bytes(b"new bytes")
    real = FileStat.of(f)
    tick = (real.mtime_ns // 2_000_000_000) * 2_000_000_000
    fat = FileStat(real.size, tick, real.inode, tick)  # as a FAT volume stats the file
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        cat.put_hashes([HashRow(str(f), fat, "0" * 64)], recorded_ns=tick + 1_500_000_000)
        assert cat.cached_hashes([str(f)]) == {}  # the file may have changed since: read it
        assert fat.racy(tick + 1_500_000_000)
        cat.put_hashes([HashRow(str(f), fat, "0" * 64)], recorded_ns=tick + 2_000_000_001)
        assert cat.cached_hashes([str(f)]) == {str(f): HashEntry(fat, "0" * 64)}
        # A file system of finer stamps keeps the one-second window.
        cat.put_hashes([HashRow(str(f), real, "1" * 64)], recorded_ns=real.ctime_ns + 1_500_000_000)
        assert cat.cached_hashes([str(f)]) == {str(f): HashEntry(real, "1" * 64)}


def test_a_retrained_checkpoint_copied_over_with_cp_p_is_fingerprinted_again(
    tmp_path: Path,
) -> None:
    v1 = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "v1.pt")
    v2 = save_torchscript(TinyConvEncoder(seed=1), tmp_path / "v2.pt")
    assert v1.stat().st_size == v2.stat().st_size  # same architecture: same size
    for p in (v1, v2):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    enc = tmp_path / "enc.pt"
    _cp_p(v1, enc)
    _settle()
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        fp1 = encoder_fingerprint(load_encoder(enc), cat, None)
        assert cached_file_encoder_fp(cat, enc) == fp1  # the no-load path trusts it
        _cp_p(v2, enc)
        assert cached_file_encoder_fp(cat, enc) is None  # ctime changed: cannot vouch
        fp2 = encoder_fingerprint(load_encoder(enc), cat, None)
    assert fp2 != fp1 and fp2 == load_encoder(v2).fingerprint


def test_a_checkpoint_renamed_over_while_it_is_loaded_is_not_fingerprinted_as_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training job publishes a new checkpoint (written beside, renamed over) while a build
    loads the old one: the build encodes with the module it loaded, under that module's
    fingerprint, and caches nothing for the file now there. Before, the loaded module's
    fingerprint was recorded under the new file's stat (taken after the load), so the next
    build trusted it without loading: "reused 3", the old encoder's features served as the
    new one's."""
    import featbake.bake.pipeline as pipeline
    from featbake.testing import write_audio_folder

    v1 = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "v1.pt")
    v2 = save_torchscript(TinyConvEncoder(seed=1), tmp_path / "v2.pt")
    enc, data, store = tmp_path / "enc.pt", tmp_path / "data", tmp_path / "store"
    shutil.copyfile(v1, enc)
    write_audio_folder(data, 3, seconds=0.5, seed=1)
    real = pipeline.loaded_encoder

    def load_then_publish(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        os.replace(shutil.copyfile(v2, tmp_path / "next.pt"), enc)
        return loaded

    monkeypatch.setattr(pipeline, "loaded_encoder", load_then_publish)
    first = build(data, enc, cache=store, workers=0)
    assert first.encoded == 3
    monkeypatch.setattr(pipeline, "loaded_encoder", real)
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    again = build(data, enc, cache=store, workers=0)
    assert again.encoded == 3  # v2's keys are new: encoded by v2
    ds = CachedFeatureDataset(data, enc, cache=store, on_miss="error")
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(v2, Path(ds.path(i))))


def test_build_and_dataset_after_cp_p_serve_the_new_version(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    from featbake.testing import write_audio_folder

    data, versions = tmp_path / "data", tmp_path / "versions"
    write_audio_folder(data, 3, seconds=0.5, seed=1)
    write_audio_folder(versions, 1, seconds=0.5, seed=9)
    target = sorted(data.rglob("*.wav"))[0]
    (new,) = sorted(versions.rglob("*.wav"))
    assert new.stat().st_size == target.stat().st_size
    for p in (target, new):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    _settle()
    first = build(data, encoder_file, cache=store_dir, workers=0)
    assert first.encoded == 3
    _cp_p(new, target)
    second = build(data, encoder_file, cache=store_dir, workers=0)
    assert (second.encoded, second.reused) == (1, 2)  # not "reused 3"
    ds = CachedFeatureDataset(data, encoder_file, cache=store_dir, on_miss="error")
    i = [ds.path(j) for j in range(len(ds))].index(str(target))
    torch.testing.assert_close(ds[i], live_features(encoder_file, target))


@pytest.mark.parametrize("held", [True, False])
def test_a_folder_swapped_while_it_is_hashed_caches_no_digest_for_the_other_version(
    tmp_path: Path, encoder_file: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data folder is swapped for another version (a directory renamed over, which keeps
    its files' stats) after the build stat'ed the files and before it read them. Each
    digest must be recorded only under the stat of the file it was read from. Before, B's
    digests were recorded under A's stats: once A was swapped back, a rebuild trusted them
    ("reused 2": B's features served for A's files), or, where B failed to decode, stored A's
    features under B's keys (served for B)."""
    from featbake.testing import write_audio_folder

    if not held:
        monkeypatch.setattr("featbake.encode.fingerprints.HELD_BYTES", 0)
    data, other, store = tmp_path / "data", tmp_path / "other", tmp_path / "store"
    write_audio_folder(data, 2, seconds=0.5, seed=1)  # version A
    write_audio_folder(other, 2, seconds=0.5, seed=7)  # version B: the same names
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in other.iterdir())
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later

    def swap() -> None:
        os.rename(data, tmp_path / "swap")
        os.rename(other, data)
        os.rename(tmp_path / "swap", other)

    real = Catalog.cached_hashes
    swapped: list[bool] = []

    def swap_after_the_stats(self: Catalog, paths: Any) -> Any:
        if not swapped and any(str(p).startswith(str(data)) for p in paths):
            swapped.append(True)  # hash_inputs has stat'ed every file: now it reads them
            swap()
        return real(self, paths)

    monkeypatch.setattr(Catalog, "cached_hashes", swap_after_the_stats)
    first = build(data, encoder_file, cache=store, workers=0)
    assert swapped and not first.ok
    assert all("changed while featbake was reading it" in why for _, why in first.failed)
    monkeypatch.setattr(Catalog, "cached_hashes", real)
    swap()  # A back in place
    again = build(data, encoder_file, cache=store, workers=0)
    assert again.ok and again.encoded == 2
    b = build(other, encoder_file, cache=store, workers=0)  # B's keys: never A's features
    assert b.ok
    for folder in (data, other):
        ds = CachedFeatureDataset(folder, encoder_file, cache=store, on_miss="error")
        for i in range(len(ds)):
            torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


def test_a_schema_2_catalog_is_migrated_and_its_hash_rows_are_hashed_again(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 10)
    os.utime(f, (ARCHIVE_TIME, ARCHIVE_TIME))
    with Catalog(layout) as cat:
        cat.record_encoder("e" * 64, "a.pt", "torchscript")
    conn = sqlite3.connect(layout.catalog)  # make it a version-2 catalog with a cached hash
    conn.execute("ALTER TABLE hash_cache DROP COLUMN ctime_ns")
    conn.execute("ALTER TABLE hash_cache DROP COLUMN recorded_ns")
    st = os.stat(f)
    conn.execute(
        "INSERT INTO hash_cache VALUES (?,?,?,?,?)",
        (str(f), st.st_size, st.st_mtime_ns, st.st_ino, "0" * 64),  # a stale digest
    )
    conn.execute("UPDATE meta SET value='2' WHERE name='schema_version'")
    conn.commit()
    conn.close()
    with Catalog(layout) as cat:
        assert [r.label for r in cat.encoder_rows()] == ["a.pt"]  # old rows kept
        row = cat.hash_rows([str(f)])[str(f)]
        assert (row.ctime_ns, row.recorded_ns) == (0, 0)
        assert hash_inputs(cat, [str(f)])[0][str(f)] == hashlib.sha256(b"x" * 10).hexdigest()
        version = cat.conn.execute("SELECT value FROM meta WHERE name='schema_version'")
        assert version.fetchone() == (str(SCHEMA_VERSION),)


# -- item 8: the catalog deleted, shards and roots/*.json intact --------------------------------
def _delete_catalog(store: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store / 'catalog.sqlite'}{suffix}").unlink(missing_ok=True)


def test_a_new_catalog_beside_root_manifests_is_refused(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    with Catalog(layout) as cat:
        cat.replace_root(ROOT, [("a.wav", "k")])
    _delete_catalog(layout.root)
    with pytest.raises(StoreError, match=r"no catalog\.sqlite.*featbake verify --repair"):
        _ = Catalog(layout).conn
    assert not layout.catalog.exists()
    with Catalog(layout, rebuild=True) as cat:  # what verify --repair does
        assert cat.roots() == []


@pytest.mark.slow
def test_build_refuses_to_start_over_when_the_catalog_is_lost(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    first = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert first.returncode == 0, first.stderr
    shards = sorted(p.name for p in store_dir.rglob("*.safetensors"))
    _delete_catalog(store_dir)
    again = invoke("build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir)
    assert again.returncode == 5, again.stdout + again.stderr
    assert "featbake verify --repair" in again.stderr and "Traceback" not in again.stderr
    assert not (store_dir / "catalog.sqlite").exists()  # nothing started over
    assert sorted(p.name for p in store_dir.rglob("*.safetensors")) == shards
    repaired = invoke("verify", "--cache", store_dir, "--repair")
    assert repaired.returncode == 10, repaired.stdout + repaired.stderr
    res = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert res.returncode == 0 and '"encoded": 0' in res.stdout, res.stdout + res.stderr


# -- item 17: a store that cannot be written ---------------------------------------------------
READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from featbake.export.zarr import export_zarr
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.upkeep import list_roots, stats, verify
    store, data, enc, out = sys.argv[1:5]
    s = stats(store)
    roots = list_roots(store)
    report = verify(store)
    exported = export_zarr(out, cache=store)
    ds = CachedFeatureDataset(data, enc, cache=store, on_miss="error")
    feats = [ds[i] for i in range(len(ds))]
    from torch.utils.data import DataLoader  # forked workers open their own read-only catalog
    for i, f in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
        assert torch.equal(f, feats[i])
    torch.save({ds.path(i): f for i, f in enumerate(feats)}, out + ".pt")
    print(json.dumps({"features": s.features, "roots": len(roots), "status": report.status,
                      "exit": report.exit_code, "stored": ds.stored(), "n": len(ds)}))
    """
)


def _check_read_only_run(proc: subprocess.CompletedProcess, out: Path, audio_dir: Path,
                         encoder_file: Path) -> None:  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert got["status"] == "clean" and got["exit"] == 0
    assert got["features"] == 16 and got["roots"] == 1 and got["stored"] == got["n"] == 16
    served = torch.load(str(out) + ".pt")
    for path, feat in served.items():
        torch.testing.assert_close(feat, live_features(encoder_file, Path(path)))
    assert (out / "zarr.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_store_on_a_read_only_mount_is_read(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A real read-only bind mount (root ignores chmod, not a read-only mount): stats, roots,
    verify, export and the dataset with on_miss="error" work, and verify says clean."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    _settle()
    CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # hashes no longer racy
    assert not Path(f"{store_dir / 'catalog.sqlite'}-wal").exists()  # closed cleanly
    before = {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()}
    ro, out = tmp_path / "ro", tmp_path / "out.zarr"
    ro.mkdir()
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY_SCRIPT)
    shell = (
        f"mount --bind {store_dir} {ro} && mount -o remount,bind,ro {ro} && "
        f"{sys.executable} {script} {ro} {audio_dir} {encoder_file} {out}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    _check_read_only_run(proc, out, audio_dir, encoder_file)
    assert {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()} == before
    cli = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {store_dir} {ro} && mount -o remount,bind,ro "
         f"{ro} && {sys.executable} -m featbake stats --cache {ro} && {sys.executable} -m featbake "
         f"verify --cache {ro} && {sys.executable} -m featbake roots --cache {ro}"],
        capture_output=True, text=True, env={**env, "COLUMNS": "200"}, timeout=300, check=False,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "damaged" not in cli.stdout + cli.stderr


@pytest.mark.slow
def test_a_store_opened_read_only_is_read_and_writes_say_so(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """The same reads with the catalog forced read-only (FEATBAKE_READ_ONLY=1, what a store
    without write permission gets for a non-root user), and a build says why it cannot run."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    out = tmp_path / "out.zarr"
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_READ_ONLY": "1"}
    proc = subprocess.run(
        [sys.executable, script, store_dir, audio_dir, encoder_file, out],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    _check_read_only_run(proc, out, audio_dir, encoder_file)
    res = invoke("build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir,
                  env={"FEATBAKE_READ_ONLY": "1"})  # fmt: skip
    assert res.returncode == 5 and "read-only" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr


def test_a_store_without_write_permission_is_read(
    tmp_path: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files and directories chmod'ed read-only. Root ignores permission bits, so what a
    non-root user's os.access() says is simulated (the mount test above is the real thing)."""
    layout = Layout(store_dir).ensure()
    with Catalog(layout) as cat:
        cat.replace_root(ROOT, [("a.wav", "k")])
    paths = [store_dir, *store_dir.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    real_access = os.access

    def access(path: object, mode: int, **kw: object) -> bool:
        return False if mode & os.W_OK else real_access(path, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    try:
        with Catalog(layout) as cat:
            assert cat.access is Access.IMMUTABLE  # no -wal/-shm left, the folder is read-only
            assert [r.name for r in cat.roots()] == ["r"]
            assert cat.root_items("r") == [("a.wav", "k")]
            cat.touch(["k"])  # a cache: skipped, not an error
            with pytest.raises(StoreError, match="read-only"):
                cat.drop_root("r")
    finally:
        for p in paths:
            p.chmod(0o755 if p.is_dir() else 0o644)


# -- a new catalog appears whole (issue 42 item 4) ---------------------------------------------
def _linked_catalogs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Record (journal mode, schema version, tables) of each file linked as a catalog, as it is
    when it is linked."""
    import featbake.store.catalog as catalog_mod

    seen: list[tuple[str, str, int]] = []
    real_link = os.link

    def link(src: Any, dst: Any) -> None:
        conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
        try:
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            version = conn.execute("SELECT value FROM meta WHERE name='schema_version'")
            tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table'")
            seen.append((mode, version.fetchone()[0], tables.fetchone()[0]))
        finally:
            conn.close()
        real_link(src, dst)

    monkeypatch.setattr(catalog_mod.os, "link", link)
    return seen


def test_a_new_catalog_appears_at_its_path_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its tables and WAL mode are in the file before it has the catalog's name (made in
    ``tmp/`` and linked), so no reader sees a half-made one; nothing is left in ``tmp/``."""
    seen = _linked_catalogs(monkeypatch)
    layout = Layout(tmp_path / "store").ensure()
    with Catalog(layout) as cat:
        cat.record_encoder(EFP, "enc", "torchscript")
        assert cat.conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert len(seen) == 1 and seen[0][:2] == ("wal", str(SCHEMA_VERSION)) and seen[0][2] > 3
    assert list(layout.tmp.iterdir()) == []
    with Catalog(layout, read_only=True) as cat:
        assert [r.fp for r in cat.encoder_rows()] == [EFP]


def test_a_catalog_made_first_elsewhere_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes making one new catalog: the link never replaces the one made first (its
    rows stay), and the second opens that one."""
    import featbake.store.catalog as catalog_mod

    layout = Layout(tmp_path / "store").ensure()
    real_link = os.link

    def other_process_first(src: Any, dst: Any) -> None:
        monkeypatch.setattr(catalog_mod.os, "link", real_link)
        with Catalog(layout) as first:  # made, and written, while this one was making its own
            first.record_encoder(EFP, "first", "torchscript")
        real_link(src, dst)  # FileExistsError

    monkeypatch.setattr(catalog_mod.os, "link", other_process_first)
    with Catalog(layout) as second:
        assert [r.label for r in second.encoder_rows()] == ["first"]
    assert list(layout.tmp.iterdir()) == []


def test_where_links_are_refused_sqlite_makes_the_catalog_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import featbake.store.catalog as catalog_mod

    def refused(src: Any, dst: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(catalog_mod.os, "link", refused)
    layout = Layout(tmp_path / "store").ensure()
    with Catalog(layout) as cat:
        cat.record_encoder(EFP, "enc", "torchscript")
        assert cat.conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert list(layout.tmp.iterdir()) == []
    with Catalog(layout, read_only=True) as cat:
        assert [r.fp for r in cat.encoder_rows()] == [EFP]


def test_publishing_a_new_root_fsyncs_its_folder_once(
    layout: Layout, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename's fsync of ``roots/`` is the one a new root needs; a stale ``.items`` file
    removed after it makes one more (the removal made durable), never none."""
    import featbake.store.files as files_mod
    import featbake.store.roots as roots_mod

    synced: list[Path] = []
    real = files_mod.fsync_dir

    def noting(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(files_mod, "fsync_dir", noting)
    monkeypatch.setattr(roots_mod, "fsync_dir", noting)
    spec = RootSpec("r-1", "/data", "enc", EFP, RFP, {})
    cat.replace_root(spec, [("a.wav", "k" * 64)])
    roots = roots_mod.root_file(layout, "r-1").parent
    assert synced.count(roots) == 1
    synced.clear()
    stale = roots_mod.items_file(layout, "r-1")
    stale.write_text('["b.wav","' + "j" * 64 + '"]\n')
    cat.replace_root(spec, [("a.wav", "k" * 64)])
    assert synced.count(roots) == 2 and not stale.exists()


# == round ten: upkeep ============================================================================
def _sweep_tmp(layout: Layout) -> int:
    """What gc ``--grace 0s`` does to ``tmp/`` now: every leftover no live process holds is
    removed; the bytes freed."""
    from featbake.store.open import place_of
    from featbake.store.place import removed_leftover

    freed = [removed_leftover(h) for h in place_of(layout).leftovers()]
    return sum(n for n in freed if n is not None)


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "made-in-place"])
def test_a_new_catalog_and_its_wal_files_are_made_as_the_umask_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: bool
) -> None:
    """In a store a group shares (umask 002) every member's process writes the catalog. Before,
    SQLite made ``catalog.sqlite`` 0o644 whatever the umask (its default), and its ``-wal`` and
    ``-shm`` copy that mode, so another member opened the store read-only, while the lock files
    and ``claims/index`` follow the umask (cl9.9). Now featbake makes the file itself (0o666
    asked) before SQLite opens it, made whole and linked or, where links are refused, in place."""
    import featbake.store.catalog as catalog_mod

    if not linked:

        def refused(src: Any, dst: Any) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(catalog_mod.os, "link", refused)
    layout = Layout(tmp_path / "store").ensure()
    before = os.umask(0o002)
    try:
        with Catalog(layout) as cat:
            cat.record_encoder(EFP, "enc", "torchscript")
            files = [layout.catalog, *(Path(f"{layout.catalog}{s}") for s in ("-wal", "-shm"))]
            modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    finally:
        os.umask(before)
    assert modes == {p.name: "0o664" for p in files}
    assert list(layout.tmp.iterdir()) == []


def test_a_new_catalog_a_sweep_reaches_before_it_is_linked_is_made_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new catalog is written in ``tmp/`` and linked at its name; a gc sweep with
    ``--grace 0s`` (another process's store opened first) reaching it between its schema and
    its link took the file from under the maker: the open failed with a raw
    ``FileNotFoundError``. Now the maker holds it (``holding``), so the sweep keeps it."""
    import featbake.store.catalog as catalog_mod

    layout = Layout(tmp_path / "store").ensure()
    real_fsync = catalog_mod.fsync_file
    swept: list[int] = []

    def sweep_then_fsync(path: Path) -> None:
        swept.append(_sweep_tmp(layout))  # the maker stopped between its schema and its link
        real_fsync(path)

    monkeypatch.setattr(catalog_mod, "fsync_file", sweep_then_fsync)
    with Catalog(layout) as cat:
        cat.record_encoder(EFP, "enc", "torchscript")
    assert swept == [0]
    assert list(layout.tmp.iterdir()) == []
    with Catalog(layout, read_only=True) as cat:
        assert [r.fp for r in cat.encoder_rows()] == [EFP]


def test_a_shard_sealed_again_that_a_sweep_reaches_while_set_aside_is_put_back(
    layout: Layout, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc removes an unnamed shard by renaming it aside into ``tmp/``, then judging it by its
    mtime: one sealed again since the plan (a part's rerun, a fragment about to name it) is put
    back. A second gc's sweep with ``--grace 0s`` reaching the shard set aside took it: the
    rerun's shard was lost, and the first gc failed with a raw ``FileNotFoundError``. Now the
    shard is set aside in a folder gc holds, so the sweep keeps it and it is put back."""
    import featbake.store.catalog as catalog_mod

    shard = write_shard(layout, {"k" * 64: torch.ones(3)}, EFP, RFP)
    path = layout.shard_path(shard.name)
    planned_at = path.stat().st_mtime - 10.0  # the write gc planned on; this one is later
    real_rename = catalog_mod.os.rename
    swept: list[int] = []

    def rename_then_sweep(src: Any, dst: Any) -> None:
        real_rename(src, dst)
        if Path(src) == path:
            swept.append(_sweep_tmp(layout))  # the first gc stopped with the shard set aside

    monkeypatch.setattr(catalog_mod.os, "rename", rename_then_sweep)
    assert cat.unlink_shard_file(shard.name, planned_at) == 0
    assert swept == [0]
    with ShardReader(path, verify="always") as reader:
        assert reader.read("k" * 64).equal(torch.ones(3))
    assert list(layout.tmp.iterdir()) == []


def test_a_drop_that_does_not_commit_leaves_the_root_whole(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """``roots drop`` on a full disk: the manifest file was renamed to its tombstone inside
    the transaction and the COMMIT refused; the user was told (exit 5) the drop did not
    happen, but the tombstone stayed, so the next ``gc`` finished the drop ("an interrupted
    drop") and freed every feature of the root. The failure is raised here where a full disk
    raises it, after the rename: the tombstone is renamed back, the root and its file stay,
    and ``gc`` reaches every feature. A drop that commits still removes the file."""
    report = build(audio_dir, encoder_file, cache=store_dir, workers=0)
    layout = Layout(store_dir)
    live = store_dir / "roots" / f"{report.root}.json"
    assert live.exists()

    def disk_full(step: str) -> None:
        if step == "drop-root-renamed":
            assert not live.exists()  # the tombstone is there, as on the full disk
            raise StoreError("cannot write the catalog: database or disk is full")

    with Catalog(layout) as catalog:
        with pytest.raises(StoreError, match="disk is full"):
            catalog.drop_root(report.root, between=disk_full)
        assert catalog.root(report.root) is not None
    assert live.exists() and not (store_dir / "roots" / f"{report.root}.dropped").exists()
    gc = invoke("gc", "--cache", store_dir, "--dry-run", "--json")
    assert gc.returncode == 0 and '"unreached_features": 0' in gc.stdout, gc.stdout + gc.stderr
    with Catalog(layout) as catalog:
        assert catalog.drop_root(report.root)
    assert not live.exists() and not (store_dir / "roots" / f"{report.root}.dropped").exists()


@pytest.mark.parametrize(
    ("value", "forced"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("", False),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
def test_featbake_read_only_reads_yes_and_no(
    monkeypatch: pytest.MonkeyPatch, value: str, forced: bool
) -> None:
    """Any value but ``0`` forced read-only: ``FEATBAKE_READ_ONLY=false`` made every build
    fail "read-only here (FEATBAKE_READ_ONLY=1)". The usual words for yes and no are read as
    such; anything else is refused in one line naming it."""
    from featbake.store.catalog import read_only_forced

    monkeypatch.setenv("FEATBAKE_READ_ONLY", value)
    assert read_only_forced() is forced


def test_featbake_read_only_of_another_word_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from featbake.errors import ConfigError
    from featbake.store.catalog import read_only_forced

    monkeypatch.setenv("FEATBAKE_READ_ONLY", "maybe")
    with pytest.raises(ConfigError, match="FEATBAKE_READ_ONLY='maybe' is neither yes nor no"):
        read_only_forced()


@pytest.mark.slow
def test_an_emptied_catalog_is_refused_as_a_lost_one_and_repaired(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A catalog.sqlite truncated to nothing (0 bytes, no tables) was taken as a new store's:
    `stats` said it held nothing, a dataset missed every item, a build encoded them all again,
    and `gc` deleted every shard as unnamed. Each command now refuses in one line naming
    `verify --repair`, which rebuilds every row from the shards and manifests."""
    built = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert built.returncode == 0, built.stderr
    shards = sorted(p.name for p in store_dir.rglob("*.safetensors"))
    (store_dir / "catalog.sqlite").write_bytes(b"")
    for command in (
        ["stats"],
        ["gc", "--grace", "0s"],
        ["build", "--data", audio_dir, "--encoder", encoder_file],
    ):
        refused = invoke(*command, "--cache", store_dir)
        assert refused.returncode == 5, (command, refused.stdout + refused.stderr)
        said = refused.stderr.strip()
        assert "empty (no tables)" in said and "featbake verify --repair" in said, said
        assert "Traceback" not in said and len(said.splitlines()) == 1, said
    assert sorted(p.name for p in store_dir.rglob("*.safetensors")) == shards
    with sqlite3.connect(store_dir / "catalog.sqlite") as conn:  # nothing started over
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    with pytest.raises(StoreError, match="empty"):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    repaired = invoke("verify", "--cache", store_dir, "--repair")
    assert repaired.returncode in (0, 10), repaired.stdout + repaired.stderr
    again = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert again.returncode == 0 and '"encoded": 0' in again.stdout, again.stdout + again.stderr
