"""Feature rows, the hash cache and encoder rows: what builds and datasets read and add."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from featbake.errors import ShardMissing
from featbake.store.catalog.connection import CatalogConnection, Transaction
from featbake.store.catalog.rows import (
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    ShardFeature,
    ShardRow,
    columns,
    trusted_entry,
)
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard, ShardEntry

CHUNK = 500  # keys per IN (...) query, far below SQLite's variable limit

#: The ``features`` columns every insert names (from Python values, or copied from a fragment).
FEATURE_COLUMNS = "key, part, shard_id, dtype, shape, nbytes, last_used"
#: The one statement that adds feature rows from Python values (a build, write-back).
INSERT_FEATURES = f"INSERT OR IGNORE INTO features({FEATURE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"


class ShardSize(NamedTuple):
    """What a shard row records of its tensors: how many, and their bytes."""

    items: int
    data_bytes: int

    @classmethod
    def of(cls, shard: SealedShard) -> ShardSize:
        """The size of a shard that comes with its entries."""
        return cls(len(shard.entries), sum(e.nbytes for e in shard.entries))


#: Adds a shard's feature rows inside ``add_shard``'s transaction (given the shard's row id).
RowCopy = Callable[[Transaction, int], object]


def chunks(seq: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def insert_shard(c: Transaction, shard: SealedShard, now: float, size: ShardSize) -> int:
    """Record a sealed shard (once: its name is its content) and return its row id.

    ``size`` is its tensors' count and bytes (:meth:`ShardSize.of` a shard with its entries).
    """
    c.execute(
        "INSERT OR IGNORE INTO shards"
        "(name, bytes, items, encoder_fp, recipe_fp, created, data_bytes)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            shard.name,
            shard.nbytes,
            size.items,
            shard.encoder_fp,
            shard.recipe_fp,
            now,
            size.data_bytes,
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
            if not layout.has_shard(name):
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


@dataclass
class FragmentRowsAdded:
    """What :meth:`FeatureRows.add_fragment_shards` added: feature rows, shards, and the
    shards whose files were gone."""

    features: int = 0
    shards: int = 0
    missing: list[str] = field(default_factory=list)


def _copy_from(schema: str, fragment_shard_id: int) -> RowCopy:
    """Copy one shard's feature rows from an attached fragment, in key order (the order of the
    catalog's key index: inserts touch each B-tree page once)."""

    def copy(c: Transaction, shard_id: int) -> None:
        c.execute(
            f"INSERT OR IGNORE INTO main.features({FEATURE_COLUMNS})"
            f" SELECT key, part, ?, dtype, shape, nbytes, last_used FROM {schema}.features"
            " WHERE shard_id = ? ORDER BY key, part",
            (shard_id, fragment_shard_id),
        )

    return copy


def _entries_from(
    conn: sqlite3.Connection, schema: str, shard: SealedShard, fragment_shard_id: int
) -> Callable[[], SealedShard]:
    """``shard`` with its entries read from the attached fragment (only when rows must move)."""

    def entries() -> SealedShard:
        rows = conn.execute(
            f"SELECT {columns(ShardFeature)} FROM {schema}.features WHERE shard_id = ?",
            (fragment_shard_id,),
        )
        found = tuple(
            ShardEntry(f.key, f.part, f.dtype, tuple(json.loads(f.shape)), f.nbytes)
            for f in map(ShardFeature._make, rows)
        )
        return dataclasses.replace(shard, entries=found)

    return entries


class FeatureRows(CatalogConnection):
    """Feature rows, the hash cache and encoders: where a key's tensors are, which keys are
    stored, what the hash cache knows; and what builds and write-back add (shards with their
    feature rows, hashes, encoders, last use)."""

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """The subset of ``keys`` that are stored: cataloged, in shard files that exist.

        A key whose shard file is gone although rows still name it (deleted by hand, lost in a
        partial copy of the store) is not present: a build encodes it again, and
        :meth:`FeatureRows.add_shard` points its rows at the new copy. One ``stat`` per
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
        return {r[0]: HashCacheRow._make(r) for r in self._hash_cache_rows(paths)}

    def _hash_cache_rows(self, paths: Sequence[str]) -> Iterator[tuple]:
        """The ``hash_cache`` rows of ``paths``, in :class:`HashCacheRow`'s column order (plain
        tuples: the hit path reads a million of them when a large folder is indexed)."""
        for chunk in chunks(list(paths)):
            q = ",".join("?" * len(chunk))
            yield from self.conn.execute(
                f"SELECT {columns(HashCacheRow)} FROM hash_cache WHERE path IN ({q})",
                tuple(chunk),
            )

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        """Trusted hash-cache entries of ``paths``: path -> (stat when hashed, sha256).

        A caller trusts an entry only if the file's :class:`FileStat` now equals ``stat``.
        Entries that are racy (recorded within a second of the file's mtime or ctime) or that
        predate ctime are left out: their files are hashed again.
        """
        out: dict[str, HashEntry] = {}
        for row in self._hash_cache_rows(paths):
            entry = trusted_entry(row)
            if entry is not None:
                out[row[0]] = entry
        return out

    # -- writes --------------------------------------------------------------------------------

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Record a sealed shard and its features in one transaction; returns new feature rows.

        Features already present keep their existing row (first wins), so two writers that
        encoded the same input leave one row and one unreferenced copy for gc. A row whose
        shard file is gone (deleted by hand, lost in a partial copy) is no feature: it is
        pointed at this shard instead, and the lost shard's row goes once nothing names it.
        """
        now = time.time() if now is None else now
        values = [
            (e.key, e.part, e.dtype, json.dumps(list(e.shape)), e.nbytes) for e in shard.entries
        ]

        def insert(c: Transaction, shard_id: int) -> None:
            c.executemany(
                INSERT_FEATURES, [(k, p, shard_id, d, s, n, now) for k, p, d, s, n in values]
            )

        return self._add_shard(shard, now, insert, lambda: shard, ShardSize.of(shard))

    def add_fragment_shards(self, fragment: Path, schema: str = "fragment") -> FragmentRowsAdded:
        """Add every shard of a sealed fragment (a catalog file, store/fragments.py), as
        :meth:`add_shard` does, its rows copied SQL-side through ``ATTACH`` (none passes
        through Python) with the fragment's own timestamps. A shard whose file is gone is
        listed, not added (its features are encoded again when next needed)."""
        conn = self.conn
        conn.execute(f"ATTACH DATABASE ? AS {schema}", (str(fragment),))
        out = FragmentRowsAdded()
        try:
            rows = conn.execute(
                f"SELECT {', '.join(ShardRow.COLUMNS)} FROM {schema}.shards ORDER BY name"
            ).fetchall()
            for row in (ShardRow(*r) for r in rows):
                shard = SealedShard(
                    row.name, self.layout.shard_path(row.name), row.bytes, row.encoder_fp,
                    row.recipe_fp, (),
                )  # fmt: skip
                copy = _copy_from(schema, row.id)
                entries = _entries_from(conn, schema, shard, row.id)
                size = ShardSize(row.items, row.data_bytes)
                try:
                    out.features += self._add_shard(shard, row.created, copy, entries, size)
                    out.shards += 1
                except ShardMissing:
                    out.missing.append(row.name)
        finally:
            conn.execute(f"DETACH DATABASE {schema}")
        return out

    def _add_shard(
        self,
        shard: SealedShard,
        now: float,
        copy: RowCopy,
        with_entries: Callable[[], SealedShard],
        size: ShardSize,
    ) -> int:
        with self.transaction() as c:
            # Checked under the write lock, as gc unlinks under it (unlink_shard_file): a file
            # gc removed after our rename (it held a byte-identical shard of the same name) is
            # seen here, and the caller writes it again instead of committing rows to nothing.
            if not self.layout.has_shard(shard.name):
                raise ShardMissing(
                    f"shard {shard.name} vanished before its rows were committed (gc removed an "
                    "identical shard); it is written again"
                )
            shard_id = insert_shard(c, shard, now, size)
            before = c.total_changes
            copy(c, shard_id)
            added = c.total_changes - before
            if added < size.items:  # some rows exist: those naming a lost file move
                added += repoint_lost_rows(c, self.layout, with_entries(), shard_id)
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
