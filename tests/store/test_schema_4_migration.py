"""Catalog schema 4 (``roots.workdir``) met by several processes: a schema-3 store opened by
writers at once (one migrates, the others find it migrated), and a reader that opened it at 3
while a writer migrated it. Real SQLite files, real processes released together."""

from __future__ import annotations

import multiprocessing
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from featbake.store.catalog import SCHEMA_VERSION, Catalog
from featbake.store.layout import Layout
from featbake.testing import write_audio_folder
from tests.export.test_round15_paths import _as_schema_3
from tests.helpers import bake

WRITERS = 3


def _open_at_once(store: str, barrier: Any, out: Any) -> None:
    """A writable open of the store once every writer is ready; its roots' folders, or why not."""
    barrier.wait()
    try:
        with Catalog(Layout(Path(store))) as cat:
            out.put(sorted((r.name, r.workdir) for r in cat.roots()))
    except BaseException as e:  # said to the test, which fails on it
        out.put(f"{type(e).__name__}: {e}")


def _columns(store: Path) -> list[str]:
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        return [r[1] for r in conn.execute("PRAGMA table_info(roots)")]


def _version(store: Path) -> str:
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        return conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()[0]


def _schema_3_store(tmp_path: Path, encoder_file: Path) -> tuple[Path, str]:
    clips, store = tmp_path / "clips", tmp_path / "store"
    write_audio_folder(clips, 2, seconds=(0.2, 0.4), seed=1)
    root = bake(clips, encoder_file, store).root
    _as_schema_3(store)
    return store, root


def test_writers_opening_a_schema_3_store_at_once_migrate_it_once(
    tmp_path: Path, encoder_file: Path
) -> None:
    store, root = _schema_3_store(tmp_path, encoder_file)
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(WRITERS), ctx.Queue()
    args = (str(store), barrier, out)
    procs = [ctx.Process(target=_open_at_once, args=args) for _ in range(WRITERS)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == [[(root, "")]] * WRITERS, got
    assert _version(store) == str(SCHEMA_VERSION)
    assert _columns(store).count("workdir") == 1


def test_a_reader_that_opened_schema_3_reads_on_after_a_writer_migrates(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A read-only reader (a dataset on a store no writer opened since the upgrade) holds its
    connection at schema 3; a writer migrates and publishes a root with a recorded folder:
    the reader's next reads see the column and the new root's folder, not a stale ''."""
    store, root = _schema_3_store(tmp_path, encoder_file)
    reader = Catalog(Layout(store), read_only=True)
    try:
        assert [(r.name, r.workdir) for r in reader.roots()] == [(root, "")]
        assert _version(store) == "3"
        with Catalog(Layout(store)) as writer:  # another connection: the migration
            assert writer.root(root) is not None
            writer.conn.execute("BEGIN IMMEDIATE")
            writer.conn.execute("UPDATE roots SET workdir=? WHERE name=?", ("/data/here", root))
            writer.conn.execute("COMMIT")
        assert _version(store) == str(SCHEMA_VERSION)
        assert [(r.name, r.workdir) for r in reader.roots()] == [(root, "/data/here")]
        got = reader.root(root)
        assert got is not None and got.workdir == "/data/here"
    finally:
        reader.close()
