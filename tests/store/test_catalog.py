"""The SQLite catalog: WAL, schema version, first-wins rows, the hash cache and roots;
connections per thread and process, the transaction helper, typed rows and the views."""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import sqlite3
import threading
from pathlib import Path

import pytest
import torch

from featbake import process
from featbake.encode.fingerprints import hash_inputs
from featbake.errors import StoreError
from featbake.store.catalog import (
    SCHEMA_VERSION,
    Catalog,
    EncoderRow,
    FileStat,
    HashRow,
    OldCatalog,
    RootItem,
    RootSpec,
    ShardFeature,
    read_old_catalog,
)
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, write_shard

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
        "CREATE TABLE roots (last_used REAL NOT NULL, created REAL NOT NULL, items INTEGER NOT "
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
