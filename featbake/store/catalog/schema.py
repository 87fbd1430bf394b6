"""The catalog's tables, its schema version and the migrations between versions.

Versions:
    2: ``shards.data_bytes``; ``features_shard`` covers (nbytes, last_used).
    3: ``hash_cache.ctime_ns`` and ``hash_cache.recorded_ns`` (issue 11, item 1: a file copied
       over with ``cp -p`` keeps size, mtime and inode, not ctime; an entry recorded within a
       second of its file's mtime is "racy" and not trusted). Rows migrated from version 2 get
       0 in both columns, so their files are simply hashed again once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from featbake.errors import StoreError

SCHEMA_VERSION = 3

DDL = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,          -- sha256 of the shard file's bytes
    bytes INTEGER NOT NULL,
    items INTEGER NOT NULL,
    encoder_fp TEXT NOT NULL,
    recipe_fp TEXT NOT NULL,
    created REAL NOT NULL,
    data_bytes INTEGER NOT NULL DEFAULT 0 -- sum of the tensors' bytes (file bytes minus header)
);
CREATE TABLE IF NOT EXISTS features (
    key TEXT NOT NULL,
    part TEXT NOT NULL DEFAULT '',      -- '' for single-output encoders, else the output's name
    shard_id INTEGER NOT NULL REFERENCES shards(id),
    dtype TEXT NOT NULL,                -- safetensors dtype string (F32, F16, BF16, ...)
    shape TEXT NOT NULL,                -- JSON list
    nbytes INTEGER NOT NULL,
    last_used REAL NOT NULL,
    PRIMARY KEY (key, part)
) WITHOUT ROWID;
-- Covering: per-shard counts, bytes and last use (stats, gc) scan this index alone.
CREATE INDEX IF NOT EXISTS features_shard ON features(shard_id, nbytes, last_used);
CREATE TABLE IF NOT EXISTS encoders (
    fp TEXT PRIMARY KEY,
    label TEXT NOT NULL,                -- the encoder as the user named it (path or import string)
    kind TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS roots (
    name TEXT PRIMARY KEY,              -- keys.root_id(data, encoder_label, recipe_fp)
    data TEXT NOT NULL,
    encoder_label TEXT NOT NULL,
    encoder_fp TEXT NOT NULL,
    recipe_fp TEXT NOT NULL,
    recipe TEXT NOT NULL,               -- canonical JSON of the recipe
    items INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS root_items (
    root TEXT NOT NULL,
    idx INTEGER NOT NULL,
    path TEXT NOT NULL,                 -- relative to the root's data folder
    key TEXT NOT NULL,
    PRIMARY KEY (root, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS root_items_key ON root_items(key);
CREATE TABLE IF NOT EXISTS hash_cache (
    path TEXT PRIMARY KEY,              -- absolute path (or a namespaced id, e.g. encoder:...)
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    inode INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    ctime_ns INTEGER NOT NULL DEFAULT 0,    -- schema 3, 0 if unknown (hashed again)
    recorded_ns INTEGER NOT NULL DEFAULT 0  -- when the file was stat'ed for this hash
) WITHOUT ROWID;
"""


def _migrate_2_to_3(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE hash_cache ADD COLUMN ctime_ns INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE hash_cache ADD COLUMN recorded_ns INTEGER NOT NULL DEFAULT 0")


#: from version -> the step that brings a catalog to the next version (inside one transaction).
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {2: _migrate_2_to_3}


def schema_version(conn: sqlite3.Connection) -> int | None:
    """The catalog's schema version, or None for a database without one (a new catalog).

    Raises:
        sqlite3.OperationalError: anything but a missing table (a hot journal a read-only
            connection cannot roll back reads "attempt to write a readonly database").
    """
    try:
        row = conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return None
        raise
    return None if row is None else int(row[0])


def ensure_schema(conn: sqlite3.Connection, path: Path, *, writable: bool) -> None:
    """Create the tables of a new catalog, or migrate an older one; check the version.

    Raises:
        StoreError: a version this featbake does not read, or (read-only) one it would have to
            create or migrate.
    """
    version = schema_version(conn)
    if version == SCHEMA_VERSION:
        return
    if version is not None and (version > SCHEMA_VERSION or version not in MIGRATIONS):
        raise StoreError(
            f"the catalog {path} has schema version {version}, this featbake reads "
            f"{SCHEMA_VERSION}; upgrade featbake, or rebuild with `featbake verify --repair`"
        )
    if not writable:
        what = "no tables" if version is None else f"schema version {version}"
        raise StoreError(
            f"the catalog {path} has {what} and is read-only here, so it cannot be "
            f"{'created' if version is None else 'upgraded'}; open the store once where it is "
            "writable (any featbake command that writes upgrades it)"
        )
    conn.execute("BEGIN IMMEDIATE")
    try:
        _create_or_migrate(conn)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _create_or_migrate(conn: sqlite3.Connection) -> None:
    # Read again under the write lock: another process may have created or migrated it.
    version = schema_version(conn)
    if version is None:
        # executescript() would COMMIT on its own: run the statements one by one.
        for stmt in DDL.split(";"):
            if stmt.strip():
                conn.execute(stmt)
        conn.execute(
            "INSERT OR IGNORE INTO meta(name, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )
        return
    while version in MIGRATIONS:
        MIGRATIONS[version](conn)
        version += 1
    conn.execute("UPDATE meta SET value=? WHERE name='schema_version'", (str(version),))
