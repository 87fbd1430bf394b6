"""What can still be read from a catalog that cannot be used as is: damaged, or of any schema.

``verify --repair`` rebuilds a catalog from the shards and the root manifests; what only the old
catalog knew (last uses, the hash cache, encoder labels, roots whose manifest file is gone) it
carries over from here, each table read by column name, on its own.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from featbake.errors import StoreError
from featbake.store.catalog import (
    ITEMS_SELECT,
    EncoderRow,
    columns,
    open_sqlite,
    read_only_access,
)
from featbake.store.hash_cache import HashCacheRow
from featbake.store.roots import Root, RootItem


@dataclass
class OldCatalog:
    """What can still be read from a catalog that cannot be used as is (any schema)."""

    last_used: list[tuple[str, float]] = field(default_factory=list)
    hash_rows: list[HashCacheRow] = field(default_factory=list)
    encoders: list[EncoderRow] = field(default_factory=list)
    roots: list[tuple[Root, list[RootItem]]] = field(default_factory=list)


def read_old_catalog(path: Path) -> OldCatalog:
    """Read what survives of a damaged or foreign catalog, each table by column name.

    Each part is read on its own: a table that is missing or unreadable leaves its part empty.
    """
    out = OldCatalog()
    try:
        conn = open_sqlite(path, read_only_access(path))
    except sqlite3.Error:
        return out
    conn.text_factory = lambda b: b.decode("utf-8", "replace")  # damaged pages hold any bytes
    unreadable = (sqlite3.Error, ValueError, TypeError, RecursionError, StoreError)
    try:
        with contextlib.suppress(*unreadable):
            out.last_used = conn.execute(  # a time of the wrong kind is not carried over
                "SELECT key, max(last_used) FROM features "
                "WHERE typeof(last_used) IN ('real', 'integer') GROUP BY key"
            ).fetchall()
        with contextlib.suppress(*unreadable):
            have = {r[1] for r in conn.execute("PRAGMA table_info(hash_cache)")}
            cols = [c if c in have else "0" for c in HashCacheRow._fields]
            rows = conn.execute(f"SELECT {', '.join(cols)} FROM hash_cache")
            out.hash_rows = [HashCacheRow._make(r) for r in rows]
        with contextlib.suppress(*unreadable):
            rows = conn.execute(f"SELECT {columns(EncoderRow)} FROM encoders")
            out.encoders = [EncoderRow._make(r) for r in rows]
        with contextlib.suppress(*unreadable):
            have = {r[1] for r in conn.execute("PRAGMA table_info(roots)")}
            # a root of a catalog before schema 4 names no workdir: its data read from the cwd
            cols = [c if c in have else "''" for c in Root.COLUMNS]
            roots = conn.execute(f"SELECT {', '.join(cols)} FROM roots").fetchall()
            out.roots = [_old_root(conn, r) for r in roots]
    finally:
        conn.close()
    return out


def _old_root(conn: sqlite3.Connection, row: Sequence) -> tuple[Root, list[RootItem]]:
    items = [RootItem._make(r) for r in conn.execute(ITEMS_SELECT, (row[0],))]
    return replace(Root.from_row(row), items=len(items)), items
