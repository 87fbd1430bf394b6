"""The SQLite catalog: an index over the shards (features, shards, encoders, roots, hash cache)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.store.filesystem import read_only_connection, set_journal_mode
from featbake.store.layout import Layout, fsync_dir, remove_file
from featbake.store.shard_format import tensor_name
from featbake.store.writer import SealedShard

SCHEMA_VERSION = 2  # 2: shards.data_bytes; features_shard covers (nbytes, last_used)


_CHUNK = 500  # keys per IN (...) query, far below SQLite's variable limit


_SCHEMA = """
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
    sha256 TEXT NOT NULL
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class FileStat:
    """What the hash cache trusts to say a file is unchanged (git's index does the same)."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileStat:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class Location:
    """Where one tensor of a feature lives."""

    key: str
    part: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def tensor(self) -> str:
        return tensor_name(self.key, self.part)


@dataclass(frozen=True)
class Root:
    """A named manifest: the keys one build of (data, encoder, recipe) produced, in file order."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    items: int
    created: float
    last_used: float


def _chunks(seq: Sequence[str], n: int = _CHUNK) -> Iterator[Sequence[str]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


class Catalog:
    """A connection to a store's ``catalog.sqlite`` (one per process; reconnects after fork).

    Example:
        >>> cat = Catalog(Layout(Path(".featbake")).ensure())  # doctest: +SKIP
        >>> cat.locate("3f...")  # doctest: +SKIP
    """

    def __init__(self, layout: Layout, *, timeout: float = 60.0, read_only: bool = False) -> None:
        self.layout = layout
        self.read_only = read_only  # for rank builds and readers on a shared filesystem
        self.path = layout.catalog
        self.timeout = timeout
        self._conn: sqlite3.Connection | None = None
        self._pid = -1

    # -- connection ------------------------------------------------------------------------
    @property
    def conn(self) -> sqlite3.Connection:
        """This process's connection, opened (and the schema created) on first use."""
        if self._conn is None or self._pid != os.getpid():
            self._conn = self._connect()
            self._pid = os.getpid()
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        try:
            if self.read_only:
                return read_only_connection(self.path, self.timeout)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
            set_journal_mode(conn, self.path, self.timeout)  # WAL, or DELETE on a shared FS
            # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt the file;
            # a lost row only means a feature is encoded again (the shard itself was fsynced).
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=OFF")
            self._ensure_schema(conn)
        except sqlite3.DatabaseError as e:
            raise StoreError(
                f"cannot open the catalog {self.path}: {e}; if it is damaged, move it aside and "
                "run `featbake verify --repair` to rebuild it from the shards"
            ) from e
        return conn

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        row = None
        with contextlib.suppress(sqlite3.OperationalError):  # no meta table: a new catalog
            row = conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        if row is None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # executescript() would COMMIT on its own: run the statements one by one.
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                conn.execute(
                    "INSERT OR IGNORE INTO meta(name, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        elif int(row[0]) != SCHEMA_VERSION:
            raise StoreError(
                f"the catalog {self.path} has schema version {row[0]}, this featbake reads "
                f"{SCHEMA_VERSION}; upgrade featbake, or rebuild with `featbake verify --repair`"
            )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise StoreError(f"the catalog {self.path} is locked or unwritable: {e}") from e
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def __getstate__(self) -> dict:
        return {
            "layout": self.layout,
            "path": self.path,
            "timeout": self.timeout,
            "read_only": self.read_only,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._conn = None
        self._pid = -1

    # -- hash cache ------------------------------------------------------------------------
    def cached_hashes(self, paths: Sequence[str]) -> dict[str, tuple[FileStat, str]]:
        """Hash-cache entries for ``paths``: path -> (stat when hashed, sha256)."""
        out: dict[str, tuple[FileStat, str]] = {}
        for chunk in _chunks(paths):
            q = ",".join("?" * len(chunk))
            for path, size, mtime, inode, sha in self.conn.execute(
                f"SELECT path, size, mtime_ns, inode, sha256 FROM hash_cache WHERE path IN ({q})",
                tuple(chunk),
            ):
                out[path] = (FileStat(size, mtime, inode), sha)
        return out

    def put_hashes(self, rows: Iterable[tuple[str, FileStat, str]]) -> None:
        """Remember that ``path`` with ``stat`` hashed to ``sha``."""
        data = [(p, s.size, s.mtime_ns, s.inode, h) for p, s, h in rows]
        if not data:
            return
        with self.transaction() as c:
            c.executemany("INSERT OR REPLACE INTO hash_cache VALUES (?, ?, ?, ?, ?)", data)

    # -- features --------------------------------------------------------------------------
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
            shard_id = _insert_shard(c, shard, now)
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

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """The subset of ``keys`` that have at least one stored tensor."""
        found: set[str] = set()
        for chunk in _chunks(list(keys)):
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
        for chunk in _chunks(list(keys)):
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

    def touch(self, keys: Iterable[str], when: float | None = None) -> None:
        """Record a coarse last use of ``keys`` (callers batch these; never once per read)."""
        when = time.time() if when is None else when
        data = [(when, k) for k in set(keys)]
        if data:
            with self.transaction() as c:
                c.executemany("UPDATE features SET last_used=? WHERE key=?", data)

    # -- encoders and roots ----------------------------------------------------------------
    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None:
        """Remember an encoder fingerprint and how the user named it."""
        now = time.time() if now is None else now
        with self.transaction() as c:
            c.execute(
                "INSERT INTO encoders(fp, label, kind, first_seen, last_used) VALUES (?,?,?,?,?) "
                "ON CONFLICT(fp) DO UPDATE SET last_used=excluded.last_used, label=excluded.label",
                (fp, label, kind, now, now),
            )

    def replace_root(
        self,
        name: str,
        *,
        data: str,
        encoder_label: str,
        encoder_fp: str,
        recipe_fp: str,
        recipe: dict,
        items: Sequence[tuple[str, str]],
        now: float | None = None,
    ) -> None:
        """Replace root ``name``'s manifest with ``items`` ((relative path, key), in order)."""
        now = time.time() if now is None else now
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            root = Root(
                name,
                data,
                encoder_label,
                encoder_fp,
                recipe_fp,
                recipe,
                len(items),
                old[0] if old else now,
                now,
            )
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            _upsert_root(c, root)
            c.executemany(
                "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
                [(name, i, p, k) for i, (p, k) in enumerate(items)],
            )
            # The manifest file is what `verify --repair` rebuilds roots from (roots are not in
            # shards). Written while this transaction holds the write lock, so two builds of one
            # root cannot leave the file and the row disagreeing.
            write_root_file(self.layout, root, items)

    def extend_root(
        self,
        name: str,
        *,
        data: str,
        encoder_label: str,
        encoder_fp: str,
        recipe_fp: str,
        recipe: dict,
        keys: Sequence[str],
        now: float | None = None,
    ) -> int:
        """Append ``keys`` not yet named to root ``name`` (made if absent); returns how many.

        For writers with no data folder to rebuild a manifest from (``CachedEncoder``): what
        they store stays reachable, so gc keeps it until the root is dropped (``featbake roots
        drop`` or ``gc --older-than``). Items get an empty path. Call it before
        :meth:`add_shard` for those keys, so gc never sees their rows unreached. The manifest
        file is rewritten whole, inside the transaction, as :meth:`replace_root` does.

        Example:
            >>> cat.extend_root("cached-encoder-3f1c", data="cached-encoder:3f1c",
            ...     encoder_label="MyEncoder", encoder_fp=fp, recipe_fp=rfp, recipe={},
            ...     keys=["9a..."])  # doctest: +SKIP
        """
        now = time.time() if now is None else now
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            items = c.execute(
                "SELECT path, key FROM root_items WHERE root=? ORDER BY idx", (name,)
            ).fetchall()
            named = {k for _, k in items}
            new = [k for k in dict.fromkeys(keys) if k not in named]
            if old is not None and not new:
                c.execute("UPDATE roots SET last_used=? WHERE name=?", (now, name))
                return 0
            c.executemany(
                "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
                [(name, len(items) + i, "", k) for i, k in enumerate(new)],
            )
            items += [("", k) for k in new]
            root = Root(
                name,
                data,
                encoder_label,
                encoder_fp,
                recipe_fp,
                recipe,
                len(items),
                old[0] if old else now,
                now,
            )
            _upsert_root(c, root)
            write_root_file(self.layout, root, items)
        return len(new)

    def root(self, name: str) -> Root | None:
        """The root named ``name``, or None."""
        row = self.conn.execute("SELECT * FROM roots WHERE name=?", (name,)).fetchone()
        return _root(row) if row else None

    def roots(self) -> list[Root]:
        """Every root, most recently built first."""
        rows = self.conn.execute("SELECT * FROM roots ORDER BY last_used DESC").fetchall()
        return [_root(r) for r in rows]

    def root_items(self, name: str) -> list[tuple[str, str]]:
        """A root's manifest: (relative path, key) in file order."""
        return self.conn.execute(
            "SELECT path, key FROM root_items WHERE root=? ORDER BY idx", (name,)
        ).fetchall()

    def shard_path(self, shard: str) -> Path:
        """The file of the shard named ``shard``."""
        return self.layout.shard_path(shard)

    # == upkeep: stats, gc, verify (featbake.upkeep) =========================================
    # Everything below is read by `featbake stats` / `gc` / `verify`. Queries that touch every
    # feature walk the tables in key order (ORDER BY key), so their lookups into the other table
    # go in key order too and stay in cache: ~0.4 s per million rows instead of ~2 s.

    def shard_rows(self) -> list[ShardRow]:
        """Every shard row, by id."""
        rows = self.conn.execute(
            "SELECT id, name, bytes, data_bytes, items, encoder_fp, recipe_fp, created "
            "FROM shards ORDER BY id"
        ).fetchall()
        return [ShardRow(*r) for r in rows]

    def shard_usage(self) -> dict[int, ShardUsage]:
        """shard id -> (feature rows, their bytes, their latest use), from the covering index."""
        return {
            sid: ShardUsage(n, b or 0, lu or 0.0)
            for sid, n, b, lu in self.conn.execute(
                "SELECT shard_id, count(*), sum(nbytes), max(last_used) FROM features "
                "GROUP BY shard_id"
            )
        }

    def feature_totals(self) -> FeatureTotals:
        """Features (distinct keys), bytes, and how many some root reaches, in one pass.

        A row counts as a feature if it is its key's first part; the CASE spares single-output
        stores (part '') the extra lookup. ~0.5 s per million rows.
        """
        row = self.conn.execute(
            "SELECT coalesce(sum(first), 0), coalesce(sum(nbytes), 0), "
            "coalesce(sum(first * live), 0), coalesce(sum(live * nbytes), 0) FROM ("
            "SELECT f.nbytes, CASE WHEN f.part = '' THEN 1 ELSE NOT EXISTS (SELECT 1 FROM "
            "features g WHERE g.key = f.key AND g.part < f.part) END AS first, "
            "EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) AS live "
            "FROM features f ORDER BY f.key, f.part)"
        ).fetchone()
        return FeatureTotals(*row)

    def missing_per_root(self) -> dict[str, int]:
        """root -> items of its manifest with no stored feature (roots missing none left out)."""
        return dict(
            self.conn.execute(
                "SELECT r.root, count(*) FROM root_items r INDEXED BY root_items_key "
                "WHERE NOT EXISTS (SELECT 1 FROM features f WHERE f.key = r.key) GROUP BY r.root"
            ).fetchall()
        )

    def unreached_features(self) -> list[FeatureRef]:
        """Feature rows whose key no root's manifest names (what gc drops)."""
        rows = self.conn.execute(
            "SELECT f.key, f.part, f.shard_id, f.nbytes, f.last_used FROM features f "
            "WHERE NOT EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) "
            "ORDER BY f.key, f.part"
        ).fetchall()
        return [FeatureRef(*r) for r in rows]

    def reached_features(self) -> list[FeatureRef]:
        """Feature rows some root reaches, in key order (what a byte budget evicts from)."""
        rows = self.conn.execute(
            "SELECT f.key, f.part, f.shard_id, f.nbytes, f.last_used FROM features f "
            "WHERE EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) "
            "ORDER BY f.key, f.part"
        ).fetchall()
        return [FeatureRef(*r) for r in rows]

    def features_of_shard(self, shard_id: int) -> list[tuple[str, str, str, str, int]]:
        """(key, part, dtype, shape JSON, nbytes) of each row pointing into shard ``shard_id``."""
        return self.conn.execute(
            "SELECT key, part, dtype, shape, nbytes FROM features WHERE shard_id=? "
            "ORDER BY key, part",
            (shard_id,),
        ).fetchall()

    def delete_features(self, refs: Sequence[FeatureRef], *, only_unreached: bool) -> int:
        """Delete these exact rows (key, part, shard) in short transactions; returns rows deleted.

        With ``only_unreached`` a row goes only if still no root names its key, checked in the
        same statement: a build that just published a root naming it keeps it.
        """
        sql = "DELETE FROM features WHERE key=? AND part=? AND shard_id=?"
        if only_unreached:
            sql += " AND NOT EXISTS (SELECT 1 FROM root_items r WHERE r.key = features.key)"
        done = 0
        for i in range(0, len(refs), 5000):
            with self.transaction() as c:
                before = c.total_changes
                c.executemany(sql, [(r.key, r.part, r.shard_id) for r in refs[i : i + 5000]])
                done += c.total_changes - before
        return done

    def unlink_shard_file(self, name: str) -> int:
        """Remove shard ``name``'s file unless a row names it again; returns the bytes freed.

        Shard names are content hashes, so a writer may seal a byte-identical shard at the same
        path after gc deleted its row. The unlink happens under the write lock, and add_shard
        checks the file under the same lock, so one of the two always sees the other.
        """
        with self.transaction() as c:
            if c.execute("SELECT 1 FROM shards WHERE name=?", (name,)).fetchone():
                return 0
            return remove_file(self.layout.shard_path(name))

    def delete_shards_if_empty(self, shard_ids: Iterable[int]) -> list[str]:
        """Delete the rows of those shards no feature row points into; returns their names."""
        gone = []
        with self.transaction() as c:
            for sid in shard_ids:
                row = c.execute(
                    "SELECT name FROM shards WHERE id=? AND NOT EXISTS "
                    "(SELECT 1 FROM features WHERE shard_id=?)",
                    (sid, sid),
                ).fetchone()
                if row:
                    c.execute("DELETE FROM shards WHERE id=?", (sid,))
                    gone.append(row[0])
        return gone

    def commit_moved(
        self, shard: SealedShard, moved: Sequence[tuple[str, str, int]], now: float | None = None
    ) -> int:
        """Record a shard written by compaction and point the moved rows at it, atomically.

        ``moved`` holds (key, part, old shard id); a row that changed meanwhile is left as is.
        Returns how many rows now point at the new shard.
        """
        now = time.time() if now is None else now
        with self.transaction() as c:
            sid = _insert_shard(c, shard, now)
            before = c.total_changes
            c.executemany(
                "UPDATE features SET shard_id=? WHERE key=? AND part=? AND shard_id=?",
                [(sid, k, p, old) for k, p, old in moved],
            )
            return c.total_changes - before

    def encoder_rows(self) -> list[tuple[str, str, str, float, float]]:
        """(fp, label, kind, first_seen, last_used) of every encoder seen."""
        return self.conn.execute(
            "SELECT fp, label, kind, first_seen, last_used FROM encoders ORDER BY first_seen"
        ).fetchall()

    def forget_unused_encoders(self) -> int:
        """Delete encoder rows that no shard and no root mentions; returns how many."""
        with self.transaction() as c:
            before = c.total_changes
            c.execute(
                "DELETE FROM encoders WHERE fp NOT IN (SELECT encoder_fp FROM shards) "
                "AND fp NOT IN (SELECT encoder_fp FROM roots)"
            )
            return c.total_changes - before

    def drop_root(
        self,
        name: str,
        *,
        unused_before: float | None = None,
        between: Callable[[str], None] | None = None,
    ) -> bool:
        """Drop root ``name`` (row, manifest and file); returns False if it was not dropped.

        Order: inside one write transaction the manifest file is renamed to a tombstone
        (``roots/<name>.dropped``), then the rows go; after COMMIT the tombstone is unlinked. A
        crash leaves either the root intact with a tombstone beside it (gc finishes the drop) or
        no root and a tombstone (gc unlinks it); never a root whose manifest file is lost.
        ``unused_before`` drops it only if it was not built or used since then (a build that
        refreshed it meanwhile wins). ``between`` is a test hook called between the steps.
        """
        live, dead = root_file(self.layout, name), tombstone_file(self.layout, name)
        with self.transaction() as c:
            row = c.execute("SELECT last_used FROM roots WHERE name=?", (name,)).fetchone()
            if row is None or (unused_before is not None and row[0] >= unused_before):
                return False
            if live.exists():
                os.replace(live, dead)
                fsync_dir(live.parent)
            if between:
                between("drop-root-renamed")
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            c.execute("DELETE FROM roots WHERE name=?", (name,))
        if between:
            between("drop-root-committed")
        with contextlib.suppress(FileNotFoundError):
            dead.unlink()
        return True

    def finish_drop(self, name: str) -> bool:
        """Finish a drop that a crash interrupted (a tombstone is left); True if rows went.

        If the root was built again since (its manifest file is back), only the tombstone goes.
        """
        dead = tombstone_file(self.layout, name)
        dropped = False
        if not root_file(self.layout, name).exists():
            with self.transaction() as c:
                c.execute("DELETE FROM root_items WHERE root=?", (name,))
                dropped = c.execute("DELETE FROM roots WHERE name=?", (name,)).rowcount > 0
        with contextlib.suppress(FileNotFoundError):
            dead.unlink()
        return dropped

    def insert_root(self, root: Root, items: Sequence[tuple[str, str]]) -> None:
        """Put a root back exactly as given (``verify --repair`` restoring it from its file)."""
        with self.transaction() as c:
            c.execute("DELETE FROM root_items WHERE root=?", (root.name,))
            c.execute(
                "INSERT OR REPLACE INTO roots VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    root.name,
                    root.data,
                    root.encoder_label,
                    root.encoder_fp,
                    root.recipe_fp,
                    json.dumps(root.recipe, sort_keys=True),
                    len(items),
                    root.created,
                    root.last_used,
                ),
            )
            c.executemany(
                "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
                [(root.name, i, p, k) for i, (p, k) in enumerate(items)],
            )

    def delete_rows_of_shards(self, shard_ids: Sequence[int]) -> int:
        """Forget shards entirely (their feature rows, then them); returns feature rows deleted."""
        done = 0
        with self.transaction() as c:
            for sid in shard_ids:
                done += c.execute("DELETE FROM features WHERE shard_id=?", (sid,)).rowcount
                c.execute("DELETE FROM shards WHERE id=?", (sid,))
        return done

    def dangling_feature_rows(self) -> int:
        """Feature rows whose shard id names no shard row (a catalog edited by hand)."""
        (n,) = self.conn.execute(
            "SELECT count(*) FROM features f WHERE NOT EXISTS "
            "(SELECT 1 FROM shards s WHERE s.id = f.shard_id)"
        ).fetchone()
        return n

    def delete_dangling_feature_rows(self) -> int:
        with self.transaction() as c:
            return c.execute(
                "DELETE FROM features WHERE shard_id NOT IN (SELECT id FROM shards)"
            ).rowcount

    def all_feature_rows(self) -> Iterator[tuple[str, str, int, str, str, int]]:
        """(key, part, shard id, dtype, shape JSON, nbytes) of every row, by shard."""
        return self.conn.execute(
            "SELECT key, part, shard_id, dtype, shape, nbytes FROM features ORDER BY shard_id"
        )

    def set_last_used(self, rows: Sequence[tuple[str, float]]) -> None:
        """Set (key, last_used) exactly, e.g. carried over from an old catalog by a rebuild."""
        for i in range(0, len(rows), 20000):
            with self.transaction() as c:
                c.executemany(
                    "UPDATE features SET last_used=? WHERE key=?",
                    [(t, k) for k, t in rows[i : i + 20000]],
                )

    def put_encoder_row(self, fp: str, label: str, kind: str, first: float, last: float) -> None:
        """Insert an encoder row as is, unless one exists."""
        with self.transaction() as c:
            c.execute(
                "INSERT OR IGNORE INTO encoders VALUES (?,?,?,?,?)", (fp, label, kind, first, last)
            )


@dataclass(frozen=True)
class ShardRow:
    """A shard as the catalog records it."""

    id: int
    name: str
    bytes: int
    data_bytes: int
    items: int
    encoder_fp: str
    recipe_fp: str
    created: float


@dataclass(frozen=True)
class ShardUsage:
    """The feature rows that point into one shard."""

    rows: int
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class FeatureTotals:
    """Counts over distinct keys: all stored, and those some root reaches."""

    features: int
    nbytes: int
    live_features: int
    live_nbytes: int


@dataclass(frozen=True)
class FeatureRef:
    """One feature row, exactly (gc deletes by (key, part, shard) so a moved row is spared)."""

    key: str
    part: str
    shard_id: int
    nbytes: int
    last_used: float


ROOT_FORMAT = "featbake-root"


ROOT_FORMAT_VERSION = 1


def roots_dir(layout: Layout) -> Path:
    """``<store>/roots``: one JSON manifest per root, so roots survive the loss of the catalog."""
    return layout.root / "roots"


def root_file(layout: Layout, name: str) -> Path:
    return roots_dir(layout) / f"{name}.json"


def tombstone_file(layout: Layout, name: str) -> Path:
    """Left by a root drop while it runs; a crash leaves it for gc to finish the drop."""
    return roots_dir(layout) / f"{name}.dropped"


def root_payload(root: Root, items: Sequence[tuple[str, str]]) -> dict:
    """The JSON document of a root manifest file."""
    return {
        "format": ROOT_FORMAT,
        "format_version": ROOT_FORMAT_VERSION,
        "name": root.name,
        "data": root.data,
        "encoder_label": root.encoder_label,
        "encoder_fp": root.encoder_fp,
        "recipe_fp": root.recipe_fp,
        "recipe": root.recipe,
        "created": root.created,
        "last_used": root.last_used,
        "items": [[p, k] for p, k in items],
    }


def write_root_file(layout: Layout, root: Root, items: Sequence[tuple[str, str]]) -> Path:
    """Write a root's manifest file durably (tmp, fsync, rename, fsync dir) and drop its tombstone.

    Raises:
        StoreError: the store is not writable.
    """
    final = root_file(layout, root.name)
    tmp = layout.tmp / f"root-{uuid.uuid4().hex}.part"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        layout.tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(root_payload(root, items), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        with contextlib.suppress(FileNotFoundError):
            tombstone_file(layout, root.name).unlink()
        fsync_dir(final.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(
            f"could not write the root manifest {final}: {e.strerror or e}; "
            "check that the cache directory is writable and has space"
        ) from e
    return final


def read_root_file(path: Path) -> tuple[Root, list[tuple[str, str]]]:
    """Parse a root manifest file.

    Raises:
        StoreCorrupt: the file is not a readable featbake root manifest.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != ROOT_FORMAT:
            raise ValueError("not a featbake root manifest")
        items = [(str(p), str(k)) for p, k in doc["items"]]
        root = Root(
            doc["name"],
            doc["data"],
            doc["encoder_label"],
            doc["encoder_fp"],
            doc["recipe_fp"],
            doc["recipe"],
            len(items),
            float(doc["created"]),
            float(doc["last_used"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreCorrupt(
            f"root manifest {path} is unreadable ({e}); `featbake verify --repair` moves it to "
            "quarantine/, and rebuilding that data folder publishes the root again"
        ) from e
    return root, items


def _upsert_root(c: sqlite3.Connection, root: Root) -> None:
    """Write a root's row (not its items)."""
    c.execute(
        "INSERT OR REPLACE INTO roots VALUES (?,?,?,?,?,?,?,?,?)",
        (
            root.name,
            root.data,
            root.encoder_label,
            root.encoder_fp,
            root.recipe_fp,
            json.dumps(root.recipe, sort_keys=True),
            root.items,
            root.created,
            root.last_used,
        ),
    )


def _insert_shard(c: sqlite3.Connection, shard: SealedShard, now: float) -> int:
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


def _root(row: tuple) -> Root:
    name, data, label, efp, rfp, recipe, items, created, last_used = row
    return Root(name, data, label, efp, rfp, json.loads(recipe), items, created, last_used)
