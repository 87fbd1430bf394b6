"""Feature rows, the hash cache and encoder rows: what builds and datasets read and add."""

from __future__ import annotations

import json
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


class FeatureReads(CatalogConnection):
    """Lookups: where a key's tensors are, which keys are stored, what the hash cache knows."""

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """The subset of ``keys`` that have at least one stored tensor."""
        found: set[str] = set()
        for chunk in chunks(list(keys)):
            q = ",".join("?" * len(chunk))
            found.update(
                r[0]
                for r in self.conn.execute(
                    f"SELECT DISTINCT key FROM features WHERE key IN ({q})", tuple(chunk)
                )
            )
        return found

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
        encoded the same input leave one row and one unreferenced copy for gc.
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
            return c.total_changes - before

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
        data = [
            HashCacheRow(p, st.size, st.mtime_ns, st.inode, st.ctime_ns, sha, recorded)
            for p, st, sha in map(HashRow._make, rows)
        ]
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
