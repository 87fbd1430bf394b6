"""Catalog queries that only ``featbake.upkeep`` runs (verify, repair, rebuild), by column name.

They were raw SQL inside upkeep; here they sit with the catalog, as functions taking a
:class:`Catalog` (or a path, for a catalog too damaged to open as one), so that upkeep reads typed
rows and never a positional ``SELECT *``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from featbake.store.catalog import Catalog, EncoderRow, Root
from featbake.store.catalog.connection import open_sqlite, read_only_access
from featbake.store.catalog.rows import ENCODER_FP_PREFIX, FeatureRow, HashCacheRow

#: Every table the catalog needs and the columns upkeep and the catalog read from it (checked
#: against a freshly created catalog by tests/upkeep/test_verify_hardening.py).
REQUIRED_COLUMNS: dict[str, frozenset[str]] = {
    "meta": frozenset({"name", "value"}),
    "shards": frozenset(
        {"id", "name", "bytes", "items", "encoder_fp", "recipe_fp", "created", "data_bytes"}
    ),
    "features": frozenset({"key", "part", "shard_id", "dtype", "shape", "nbytes", "last_used"}),
    "encoders": frozenset(EncoderRow._fields),
    "roots": frozenset(Root.COLUMNS),
    "root_items": frozenset({"root", "idx", "path", "key"}),
    "hash_cache": frozenset({"path", "size", "mtime_ns", "inode", "sha256"}),
}


def _schema_problems(conn: sqlite3.Connection) -> list[str]:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    out = []
    for table, columns in REQUIRED_COLUMNS.items():
        if table not in tables:
            out.append(f"no table {table}")
            continue
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        out.extend(f"no column {table}.{c}" for c in sorted(columns - have))
    return out


def catalog_file_problems(path: Path) -> list[str]:
    """Why the catalog file at ``path`` cannot be used (empty if it can), read-only.

    SQLite's ``quick_check`` finds damaged pages; a catalog that opens but lacks a table or a
    column (edited by hand, or another program's database) is named too, before anything runs a
    query on it that would fail halfway.
    """
    try:
        conn = open_sqlite(path, read_only_access(path), timeout=10)
    except sqlite3.Error as e:
        return [f"unreadable: {e}"]
    conn.text_factory = lambda b: b.decode("utf-8", "replace")  # damaged pages hold any bytes
    try:
        (res,) = conn.execute("PRAGMA quick_check").fetchone()
        if res != "ok":
            return [f"damaged: {res}"]
        return _schema_problems(conn)
    except (sqlite3.Error, ValueError) as e:
        return [f"unreadable: {e}"]
    finally:
        conn.close()


def feature_rows(catalog: Catalog) -> Iterator[FeatureRow]:
    """Every feature row, by shard."""
    return catalog.all_feature_rows()


def hash_cache_rows(cat: Catalog) -> list[HashCacheRow]:
    """Every hash-cache row as stored (inputs and cached encoder fingerprints)."""
    cols = ", ".join(HashCacheRow._fields)
    rows = cat.conn.execute(f"SELECT {cols} FROM hash_cache ORDER BY path")
    return [HashCacheRow._make(r) for r in rows]


__all__ = [
    "ENCODER_FP_PREFIX",
    "REQUIRED_COLUMNS",
    "FeatureRow",
    "catalog_file_problems",
    "feature_rows",
    "hash_cache_rows",
]
