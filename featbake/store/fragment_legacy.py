"""Reading fragments of formats 1 and 2, written before a fragment was a catalog.

They had tables of their own: ``shards(name, bytes, encoder_fp, recipe_fp)``, ``entries(shard,
key, part, dtype, shape, nbytes)``, ``items(idx, path, key)``, ``hashes(path, size, mtime_ns,
inode, sha256, ctime_ns, recorded_ns)`` and (format 2) ``uses(key, used)``. A store upgraded
between a sharded build and its merge still merges them; nothing writes them any more.
"""

from __future__ import annotations

import json
import sqlite3
from typing import NamedTuple

from featbake.store.catalog import HashCacheRow
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard, ShardEntry


class FragmentRows(NamedTuple):
    """What a fragment holds besides its meta, whatever its format."""

    shards: tuple[SealedShard, ...]
    items: tuple[tuple[int, str, str], ...]  # (idx, path, key)
    hashes: tuple[HashCacheRow, ...]
    uses: tuple[tuple[str, float], ...]  # (key, used)


def read_legacy_body(
    conn: sqlite3.Connection, layout: Layout, *, with_entries: bool
) -> FragmentRows:
    """The rows of a format 1 or 2 fragment (``conn`` open on it, read-only)."""
    entries: dict[str, list[ShardEntry]] = {}
    if with_entries:
        for shard, key, part, dtype, shape, nbytes in conn.execute(
            "SELECT shard, key, part, dtype, shape, nbytes FROM entries ORDER BY key, part"
        ):
            entries.setdefault(shard, []).append(
                ShardEntry(key, part, dtype, tuple(json.loads(shape)), nbytes)
            )
    shards = tuple(
        SealedShard(name, layout.shard_path(name), nbytes, efp, rfp, tuple(entries.get(name, ())))
        for name, nbytes, efp, rfp in conn.execute(
            "SELECT name, bytes, encoder_fp, recipe_fp FROM shards ORDER BY name"
        )
    )
    items = tuple(conn.execute("SELECT idx, path, key FROM items ORDER BY idx"))
    hashes = tuple(
        HashCacheRow(path, size, mtime, inode, ctime, sha, recorded)
        for path, size, mtime, inode, sha, ctime, recorded in conn.execute(
            "SELECT path, size, mtime_ns, inode, sha256, ctime_ns, recorded_ns FROM hashes"
        )
    )
    has_uses = conn.execute("SELECT 1 FROM sqlite_master WHERE name='uses'").fetchone()
    uses = tuple(conn.execute("SELECT key, used FROM uses ORDER BY key")) if has_uses else ()
    return FragmentRows(shards, items, hashes, uses)
