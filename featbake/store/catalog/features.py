"""Feature rows, the hash cache and encoder rows: what builds and datasets read and add."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from featbake.errors import ShardMissing
from featbake.store.catalog.connection import CatalogConnection, Transaction
from featbake.store.catalog.rows import (
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    columns,
    trusted_entry,
)
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard

CHUNK = 500  # keys per IN (...) query, far below SQLite's variable limit


def chunks(seq: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def insert_shard(c: Transaction, shard: SealedShard, now: float) -> int:
    """Record a sealed shard (once: its name is its content) and return its row id."""
    c.execute(
        "INSERT OR IGNORE INTO shards"
        "(name, bytes, items, encoder_fp, recipe_fp, created, data_bytes)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            shard.name,
            shard.nbytes,
            len(shard.entries),
            shard.encoder_fp,
            shard.recipe_fp,
            now,
            sum(e.nbytes for e in shard.entries),
        ),
    )
    (shard_id,) = c.execute("SELECT id FROM shards WHERE name=?", (shard.name,)).fetchone()
    return shard_id


def lost_shards(
    conn: sqlite3.Connection | Transaction, layout: Layout, shard_ids: Iterable[int]
) -> set[int]:
    """The ids among ``shard_ids`` whose file is gone (or that name no shard row at all)."""
    ids = sorted(set(shard_ids))
    found: set[int] = set()
    lost: set[int] = set()
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i : i + CHUNK]
        q = ",".join("?" * len(chunk))
        for sid, name in conn.execute(f"SELECT id, name FROM shards WHERE id IN ({q})", chunk):
            found.add(sid)
            if not layout.shard_path(name).is_file():
                lost.add(sid)
    return lost | (set(ids) - found)


def repoint_lost_rows(c: Transaction, layout: Layout, shard: SealedShard, shard_id: int) -> int:
    """Point the rows of ``shard``'s tensors that name a lost shard file at ``shard_id``.

    Runs inside ``add_shard``'s transaction, under the write lock: gc removes a shard's rows
    before its file, and unlinks only under this lock, so a row naming a missing file here
    means the file was lost, not that gc is moving it. Returns the rows repointed.
    """
    entries = {(e.key, e.part): e for e in shard.entries}
    others: list[tuple[str, str, int]] = []
    keys = sorted({e.key for e in shard.entries})
    for chunk in chunks(keys):
        q = ",".join("?" * len(chunk))
        others += c.execute(
            f"SELECT key, part, shard_id FROM features WHERE key IN ({q}) AND shard_id != ?",
            (*chunk, shard_id),
        ).fetchall()
    lost = lost_shards(c, layout, {sid for _, _, sid in others})
    moves = [
        (shard_id, e.dtype, json.dumps(list(e.shape)), e.nbytes, key, part, sid)
        for key, part, sid in others
        if sid in lost and (e := entries.get((key, part))) is not None
    ]
    if not moves:
        return 0
    before = c.total_changes
    c.executemany(
        "UPDATE features SET shard_id=?, dtype=?, shape=?, nbytes=? "
        "WHERE key=? AND part=? AND shard_id=?",
        moves,
    )
    moved = c.total_changes - before
    c.executemany(
        "DELETE FROM shards WHERE id=? AND NOT EXISTS (SELECT 1 FROM features WHERE shard_id=?)",
        [(sid, sid) for sid in lost],
    )
    return moved


class FeatureReads(CatalogConnection):
    """Lookups: where a key's tensors are, which keys are stored, what the hash cache knows."""

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """The subset of ``keys`` that are stored: cataloged, in shard files that exist.

        A key whose shard file is gone although rows still name it (deleted by hand, lost in a
        partial copy of the store) is not present: a build encodes it again, and
        :meth:`FeatureWrites.add_shard` points its rows at the new copy. One ``stat`` per
        distinct shard of the keys found.
        """
        shards_of: dict[str, set[int]] = {}
        for chunk in chunks(list(keys)):
            q = ",".join("?" * len(chunk))
            for key, sid in self.conn.execute(
                f"SELECT key, shard_id FROM features WHERE key IN ({q})", tuple(chunk)
            ):
                shards_of.setdefault(key, set()).add(sid)
        lost = lost_shards(self.conn, self.layout, {s for ids in shards_of.values() for s in ids})
        return {k for k, ids in shards_of.items() if not ids & lost}

    def locate_many(self, keys: Sequence[str]) -> dict[str, list[Location]]:
        """key -> its tensors' locations, for the keys that are stored."""
        out: dict[str, list[Location]] = {}
        for chunk in chunks(list(keys)):
            q = ",".join("?" * len(chunk))
            rows = self.conn.execute(
                "SELECT f.key, f.part, s.name, f.dtype, f.shape, f.nbytes FROM features f "
                f"JOIN shards s ON s.id = f.shard_id WHERE f.key IN ({q}) ORDER BY f.key, f.part",
                tuple(chunk),
            )
            for key, part, shard, dtype, shape, nbytes in rows:
                loc = Location(key, part, shard, dtype, tuple(json.loads(shape)), nbytes)
                out.setdefault(key, []).append(loc)
        return out

    def locate(self, key: str) -> list[Location]:
        """The locations of one key's tensors (empty if it is not stored)."""
        return self.locate_many([key]).get(key, [])

    def shard_path(self, shard: str) -> Path:
        """The file of the shard named ``shard``."""
        return self.layout.shard_path(shard)

    def hash_rows(self, paths: Sequence[str]) -> dict[str, HashCacheRow]:
        """The hash-cache rows of ``paths`` as stored, trusted or not."""
        out: dict[str, HashCacheRow] = {}
        for chunk in chunks(list(paths)):
            q = ",".join("?" * len(chunk))
            for r in self.conn.execute(
                f"SELECT {columns(HashCacheRow)} FROM hash_cache WHERE path IN ({q})",
                tuple(chunk),
            ):
                row = HashCacheRow._make(r)
                out[row.path] = row
        return out

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        """Trusted hash-cache entries of ``paths``: path -> (stat when hashed, sha256).

        A caller trusts an entry only if the file's :class:`FileStat` now equals ``stat``.
        Entries that are racy (recorded within a second of the file's mtime or ctime) or that
        predate ctime are left out: their files are hashed again.
        """
        out: dict[str, HashEntry] = {}
        for chunk in chunks(list(paths)):
            q = ",".join("?" * len(chunk))
            for row in self.conn.execute(
                f"SELECT {columns(HashCacheRow)} FROM hash_cache WHERE path IN ({q})",
                tuple(chunk),
            ):
                entry = trusted_entry(row)
                if entry is not None:
                    out[row[0]] = entry
        return out


class FeatureWrites(CatalogConnection):
    """What builds and write-back add: shards with their feature rows, hashes, encoders, use."""

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Record a sealed shard and its features in one transaction; returns new feature rows.

        Features already present keep their existing row (first wins), so two writers that
        encoded the same input leave one row and one unreferenced copy for gc. A row whose
        shard file is gone (deleted by hand, lost in a partial copy) is no feature: it is
        pointed at this shard instead, and the lost shard's row goes once nothing names it.
        """
        now = time.time() if now is None else now
        with self.transaction() as c:
            # Checked under the write lock, as gc unlinks under it (unlink_shard_file): a file
            # gc removed after our rename (it held a byte-identical shard of the same name) is
            # seen here, and the caller writes it again instead of committing rows to nothing.
            if not self.layout.shard_path(shard.name).is_file():
                raise ShardMissing(
                    f"shard {shard.name} vanished before its rows were committed (gc removed an "
                    "identical shard); it is written again"
                )
            shard_id = insert_shard(c, shard, now)
            before = c.total_changes
            c.executemany(
                "INSERT OR IGNORE INTO features(key, part, shard_id, dtype, shape, nbytes,"
                " last_used) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (e.key, e.part, shard_id, e.dtype, json.dumps(list(e.shape)), e.nbytes, now)
                    for e in shard.entries
                ],
            )
            added = c.total_changes - before
            if added < len(shard.entries):  # some rows exist: those naming a lost file move
                added += repoint_lost_rows(c, self.layout, shard, shard_id)
            return added

    def put_hashes(
        self, rows: Iterable[HashRow | tuple], *, recorded_ns: int | None = None
    ) -> None:
        """Remember that ``path`` with ``stat`` hashed to ``sha256`` (a cache: skipped read-only).

        Args:
            rows: (path, FileStat, sha256) records.
            recorded_ns: when the stats were taken (``time.time_ns()``), before the files were
                read; now if not given. Entries whose files changed within a second of it are
                not trusted later (see :meth:`FileStat.racy`).
        """
        recorded = time.time_ns() if recorded_ns is None else recorded_ns
        self.put_hash_rows(HashCacheRow.of(*row, recorded) for row in map(HashRow._make, rows))

    def put_hash_rows(self, rows: Iterable[HashCacheRow]) -> None:
        """Store hash-cache rows as given, each with its own recording time (a fragment's rows
        being merged); a row for the same path is replaced. Skipped read-only."""
        data = list(rows)
        if not data or self.read_only:
            return
        with self.transaction() as c:
            c.executemany(
                f"INSERT OR REPLACE INTO hash_cache({columns(HashCacheRow)}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                data,
            )

    def touch(self, keys: Iterable[str], when: float | None = None) -> None:
        """Record a coarse last use of ``keys`` (callers batch these; skipped read-only)."""
        when = time.time() if when is None else when
        data = [(when, k) for k in set(keys)]
        if data and not self.read_only:
            with self.transaction() as c:
                c.executemany("UPDATE features SET last_used=? WHERE key=?", data)

    def record_uses(self, uses: Iterable[tuple[str, float]]) -> None:
        """Fold last uses recorded elsewhere ((key, when) from serving fragments): a feature's
        time only moves forward, so folding them in any order, or twice, gives the same rows."""
        data = [(when, key) for key, when in uses]
        if data and not self.read_only:
            with self.transaction() as c:
                c.executemany("UPDATE features SET last_used=max(last_used, ?) WHERE key=?", data)

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None:
        """Remember an encoder fingerprint and how the user named it (skipped read-only)."""
        now = time.time() if now is None else now
        if self.read_only:
            return
        with self.transaction() as c:
            c.execute(
                "INSERT INTO encoders(fp, label, kind, first_seen, last_used) VALUES (?,?,?,?,?) "
                "ON CONFLICT(fp) DO UPDATE SET last_used=excluded.last_used, label=excluded.label",
                (fp, label, kind, now, now),
            )
