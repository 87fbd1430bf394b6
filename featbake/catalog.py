"""The catalog: a SQLite index over the shards (derived data; shards are the truth).

It maps each feature key to the shard and tensor that hold it, and keeps the encoders seen, the
roots (named manifests of keys, one per data folder x encoder as named x recipe, replaced at each
build), coarse last-use times, and the hash cache (path, size, mtime_ns, inode -> SHA-256) that lets
an unchanged file go unread.

Concurrency: WAL mode, a busy timeout, and short ``BEGIN IMMEDIATE`` transactions, so several
builds and DataLoader workers can write at once. A key inserted twice keeps its first row.
Each process opens its own connection (after ``fork`` the child reconnects on first use).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from featbake.errors import StoreError
from featbake.store import Layout, SealedShard, tensor_name

SCHEMA_VERSION = 1
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
    created REAL NOT NULL
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
CREATE INDEX IF NOT EXISTS features_shard ON features(shard_id);
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

    def __init__(self, layout: Layout, *, timeout: float = 60.0) -> None:
        self.layout = layout
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
            conn.execute("PRAGMA journal_mode=WAL")
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
        return {"layout": self.layout, "path": self.path, "timeout": self.timeout}

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
            c.execute(
                "INSERT OR IGNORE INTO shards(name, bytes, items, encoder_fp, recipe_fp, created)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    shard.name,
                    shard.nbytes,
                    len(shard.entries),
                    shard.encoder_fp,
                    shard.recipe_fp,
                    now,
                ),
            )
            (shard_id,) = c.execute("SELECT id FROM shards WHERE name=?", (shard.name,)).fetchone()
            before = c.total_changes
            c.executemany(
                "INSERT OR IGNORE INTO features"
                "(key, part, shard_id, dtype, shape, nbytes, last_used) VALUES (?, ?, ?, ?, ?, ?, ?)",
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
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            c.execute(
                "INSERT OR REPLACE INTO roots VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    name,
                    data,
                    encoder_label,
                    encoder_fp,
                    recipe_fp,
                    json.dumps(recipe, sort_keys=True),
                    len(items),
                    old[0] if old else now,
                    now,
                ),
            )
            c.executemany(
                "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
                [(name, i, p, k) for i, (p, k) in enumerate(items)],
            )

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


def _root(row: tuple) -> Root:
    name, data, label, efp, rfp, recipe, items, created, last_used = row
    return Root(name, data, label, efp, rfp, json.loads(recipe), items, created, last_used)
