"""The SQLite catalog: an index over the shards (features, shards, encoders, roots, hash cache).

The store's ``catalog.sqlite`` and every query on it, in this order: the schema (tables, version,
migrations); the typed records of its rows; connections (per thread and per process, read-only
opening, the transaction helper); feature rows, the hash cache and encoders
(:class:`FeatureRows`); root rows (:class:`RootRows`, which writes a root's files through
:mod:`featbake.store.roots` inside its transactions); what stats, gc and verify read and change
(:class:`UpkeepRows`); :class:`Catalog`, which combines the three; the queries only upkeep runs;
and the Protocols builds and datasets are typed against (:class:`BuildCatalog`,
:class:`ServingStore`), which :class:`~featbake.store.fragment_catalog.FragmentCatalog` answers
too. ``Catalog(layout, read_only=True)`` opens it ``mode=ro`` (stats, export, inspection, a store
on a read-only mount), where SQLite itself refuses every write.

What lives beside the catalog has modules of its own: the hash cache's records and trust rule
(:mod:`featbake.store.hash_cache`), a root and its files (:mod:`featbake.store.roots`), a root's
fidelity record (:mod:`featbake.store.fidelity`), and what survives of a catalog that cannot be
used as is (:mod:`featbake.store.old_catalog`).

Example:
    >>> with Catalog(Layout(Path(".featbake")).ensure()) as cat:  # doctest: +SKIP
    ...     cat.locate("3f...")
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError
from featbake.process import PerThread, ProcessLocalState, critical_section
from featbake.store.fidelity import Measured, fidelity_file, write_fidelity
from featbake.store.files import fsync_dir, fsync_file, holding, remove_file, temporary_path
from featbake.store.filesystem import detect, set_journal_mode
from featbake.store.hash_cache import HashCacheRow, HashEntry, HashRow, trusted_entry
from featbake.store.layout import Layout
from featbake.store.place import holds_shard, place_holds_shard
from featbake.store.roots import (
    Root,
    RootItem,
    RootSpec,
    append_root_items,
    held_file,
    items_file,
    read_held,
    read_undecodable,
    root_file,
    tombstone_file,
    undecodable_file,
    unlink_quietly,
    write_held,
    write_root_file,
    write_undecodable,
)
from featbake.store.shard import SealedShard, ShardEntry, tensor_name

# The catalog's tables, its schema version and the migrations between versions.
#
# Versions:
#     2: ``shards.data_bytes``; ``features_shard`` covers (nbytes, last_used).
#     3: ``hash_cache.ctime_ns`` and ``hash_cache.recorded_ns`` (issue 11, item 1: a file copied
#        over with ``cp -p`` keeps size, mtime and inode, not ctime; an entry recorded within a
#        second of its file's mtime is "racy" and not trusted). Rows migrated from version 2 get
#        0 in both columns, so their files are simply hashed again once.
#     4: ``roots.workdir``: the folder a root's data's relative paths were taken from (a Kaldi
#        folder's ``wav.scp``, lhotse cuts: the build's working directory, see
#        :class:`~featbake.store.roots.Root`). Roots migrated from version 3 get ``''``: their
#        data is read from the working directory, as before.
SCHEMA_VERSION = 4

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
    last_used REAL NOT NULL,
    workdir TEXT NOT NULL DEFAULT ''    -- schema 4: where the data's relative paths are taken from
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


def _migrate_3_to_4(conn: sqlite3.Connection) -> None:
    if "workdir" not in {r[1] for r in conn.execute("PRAGMA table_info(roots)")}:
        conn.execute("ALTER TABLE roots ADD COLUMN workdir TEXT NOT NULL DEFAULT ''")


#: Versions a read-only connection reads as they are, not refused until a writable open
#: upgrades them: every later version only adds columns whose reads supply their default
#: (``roots.workdir``: ``''``, see :meth:`RootRows.root_select`), so a store on a read-only
#: mount, and a read-only reader of a store no writer opened since the upgrade, keep working.
READ_AS_IS = frozenset({3})

#: from version -> the step that brings a catalog to the next version (inside one transaction).
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    2: _migrate_2_to_3,
    3: _migrate_3_to_4,
}


def schema_version(conn: sqlite3.Connection) -> int | None:
    """The catalog's schema version, or None for a database without one (a new catalog).

    Raises:
        sqlite3.OperationalError: anything but a missing table (a hot journal a read-only
            connection cannot roll back reads "attempt to write a readonly database").
        sqlite3.DatabaseError: a version that is not a number (a damaged page).
    """
    try:
        row = conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return None
        raise
    if row is None:
        return None
    try:
        return int(row[0])
    except (TypeError, ValueError):  # a damaged page: read as SQLite's own damage is
        raise sqlite3.DatabaseError(f"its schema_version {row[0]!r} is not a number") from None


def ensure_schema(
    conn: sqlite3.Connection, path: Path, *, writable: bool, version: int | None
) -> None:
    """Create the tables of a new catalog, or migrate an older one; check the version
    (``version``: :func:`schema_version` as the connection read it, read again under the
    write lock before any change).

    Raises:
        StoreError: a version this featbake does not read, or (read-only) one it would have to
            create or migrate.
    """
    if version == SCHEMA_VERSION:
        return
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(
            f"the catalog {path} has schema version {version}, this featbake reads "
            f"{SCHEMA_VERSION}; upgrade featbake, or rebuild with `featbake verify --repair`"
        )
    if version is not None and version not in MIGRATIONS:
        raise StoreError(
            f"the catalog {path} has schema version {version}, written by an older featbake "
            f"whose catalogs this one ({SCHEMA_VERSION}) no longer upgrades; rebuild it from the "
            "shards and root manifests with `featbake verify --repair` (no feature is lost)"
        )
    if not writable and version in READ_AS_IS:
        return
    if not writable:
        what = "no tables" if version is None else f"schema version {version}"
        raise StoreError(
            f"the catalog {path} has {what} and is read-only here, so it cannot be "
            f"{'created' if version is None else 'upgraded'}; open the store once where it is "
            "writable (any featbake command that writes upgrades it)"
        )
    with critical_section():
        conn.execute("BEGIN IMMEDIATE")
        try:
            _create_or_migrate(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def upgradable(path: Path) -> bool:
    """Whether the catalog file at ``path`` is of an older schema this featbake migrates (read
    read-only): sound, only waiting for a writable open to upgrade it."""
    try:
        conn = open_sqlite(path, read_only_access(path))
    except sqlite3.Error:
        return False
    try:
        return schema_version(conn) in MIGRATIONS
    except (sqlite3.Error, ValueError):
        return False
    finally:
        conn.close()


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


# Typed records of the catalog's rows: every column read or written by name, never by position.
#
# Records that callers used to receive as plain tuples (encoder rows, feature rows of a shard) are
# ``NamedTuple``s, so tuple unpacking keeps working while new code reads ``row.key``. Each record
# that maps a table row says which columns it reads (:func:`columns`), so a ``SELECT`` is built
# from the record's fields, not typed twice. A root's records are in :mod:`featbake.store.roots`
# (its manifest file holds them too), the hash cache's in :mod:`featbake.store.hash_cache`.
def columns(record: type[Any]) -> str:
    """The comma-separated column list of a NamedTuple record (its fields, in order)."""
    return ", ".join(record._fields)


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


class EncoderRow(NamedTuple):
    """An encoder the store has seen, and how the user named it."""

    fp: str
    label: str
    kind: str
    first_seen: float
    last_used: float


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

    COLUMNS = ("id", "name", "bytes", "data_bytes", "items", "encoder_fp", "recipe_fp", "created")


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

    COLUMNS = ("key", "part", "shard_id", "nbytes", "last_used")


class ShardFeature(NamedTuple):
    """A feature row as seen from its shard (``shape`` is the stored JSON list)."""

    key: str
    part: str
    dtype: str
    shape: str
    nbytes: int


class FeatureRow(NamedTuple):
    """A whole ``features`` row (``shape`` is the stored JSON list), as verify compares it with
    its shard's header."""

    key: str
    part: str
    shard_id: int
    dtype: str
    shape: str
    nbytes: int

    @property
    def tensor(self) -> str:
        return tensor_name(self.key, self.part)

    def matches(self, dtype: str, shape: tuple[int, ...]) -> bool:
        """Whether the header's dtype and shape are what this row records."""
        try:
            return self.dtype == dtype and json.loads(self.shape) == list(shape)
        except (ValueError, RecursionError):
            return False


class MovedRow(NamedTuple):
    """A feature row compaction moves: it is repointed only if it still names ``old_shard_id``."""

    key: str
    part: str
    old_shard_id: int


# The catalog's connections: one per thread and per process, opened and dropped in one place.
#
# SQLite connections belong to the thread that opened them, and must never be used, nor closed,
# in a process that inherited them across ``fork()`` (SQLite's "How To Corrupt Your Database
# Files", 2.6: the child would release or clobber the parent's POSIX locks). So a catalog keeps
# one connection per thread and per process (a :class:`~featbake.process.PerThread`): a forked
# child opens fresh ones, and keeps every connection open at the fork, whichever thread opened
# it, referenced and unused (:data:`featbake.process.INHERITED_ACROSS_FORK`).
#
# A store that cannot be written (a read-only mount, a shared file system without write
# permission) is opened read-only: ``mode=ro`` when the directory can hold SQLite's ``-shm`` file,
# else ``immutable=1``. In read-only mode the caches a reader fills (the hash cache, last use,
# encoder labels) are skipped, and every other write raises a :class:`StoreError`.
#: Set to 1 to open every catalog read-only (what a read-only mount forces), e.g. to check that a
#: command only reads.
READ_ONLY_ENV = "FEATBAKE_READ_ONLY"


class Access(StrEnum):
    """How a catalog file is opened."""

    READ_WRITE = "read-write"
    READ_ONLY = "read-only"  # mode=ro: sees other writers' commits (needs a usable -shm file)
    IMMUTABLE = "immutable"  # immutable=1: a directory nobody can write, read as a snapshot


#: How ``$FEATBAKE_READ_ONLY`` is read: these say yes, these no (any case, spaces around).
READ_ONLY_YES = frozenset({"1", "true", "yes", "on"})
READ_ONLY_NO = frozenset({"", "0", "false", "no", "off"})


def read_only_forced() -> bool:
    """Whether ``$FEATBAKE_READ_ONLY`` says this process must not write to any store.

    Before, any value but ``0`` said yes: ``FEATBAKE_READ_ONLY=false`` made every build fail
    "read-only here (FEATBAKE_READ_ONLY=1)".

    Raises:
        ConfigError: a value that is neither a yes nor a no.
    """
    value = os.environ.get(READ_ONLY_ENV, "").strip().lower()
    if value in READ_ONLY_YES:
        return True
    if value in READ_ONLY_NO:
        return False
    raise ConfigError(
        f"{READ_ONLY_ENV}={os.environ[READ_ONLY_ENV]!r} is neither yes nor no; set it to 1 to "
        "open stores read-only, or to 0 (or unset it)"
    )


def read_only_here(layout: Layout) -> StoreError:
    """The one line for a command that must write to a store this process may only read."""
    return StoreError(
        f"the store {layout.root} is read-only here (a read-only mount, no write permission, "
        f"or {READ_ONLY_ENV}=1) and this needs to write to it; run it where the store is writable"
    )


def access_for(layout: Layout, *, read_only: bool = False) -> Access:
    """How this process can open ``layout``'s catalog (root ignores permission bits, not mounts)."""
    path = layout.catalog
    forced = read_only or read_only_forced()
    file_ok = os.access(path, os.W_OK) or not path.exists()
    dir_ok = os.access(path.parent, os.W_OK | os.X_OK) or not path.parent.exists()
    if not forced and file_ok and dir_ok:
        return Access.READ_WRITE
    return read_only_access(path)


def read_only_access(path: Path) -> Access:
    """``mode=ro`` where SQLite can use a ``-shm`` file beside ``path``, else ``immutable=1``."""
    wal_files = all(os.path.exists(f"{path}{s}") for s in ("-wal", "-shm"))
    if os.access(path.parent, os.W_OK | os.X_OK) or wal_files:
        return Access.READ_ONLY
    return Access.IMMUTABLE


def _uri(path: Path, access: Access) -> str:
    """``file:`` URI of ``path`` for ``access``, quoted (a ``?`` or ``#`` in a folder name would
    otherwise end the path)."""
    flags = {Access.IMMUTABLE: "?mode=ro&immutable=1", Access.READ_ONLY: "?mode=ro"}
    # Its bytes quoted: a folder name that is not UTF-8 (surrogates in str) is one too.
    quoted = urllib.parse.quote(os.fsencode(Path(path).absolute()))
    return f"file:{quoted}{flags.get(access, '')}"


def open_sqlite(
    path: Path | str, access: Access = Access.READ_WRITE, *, timeout: float = 5.0
) -> sqlite3.Connection:
    """A connection to the SQLite file at ``path``: the one place featbake connects.

    ``Access.READ_ONLY`` sees other writers' commits; ``Access.IMMUTABLE`` reads a file nobody
    changes (a sealed fragment, a downloaded catalog version) with no lock at all. Every
    connection is opened by URI, so what it ``ATTACH``es is opened by URI too (a fragment
    read-only: :meth:`FeatureRows.add_fragment_shards`), whatever SQLite's build defaults to.
    """
    return sqlite3.connect(
        _uri(Path(path), access), uri=True, timeout=timeout, isolation_level=None
    )


#: The first bytes of every SQLite database file.
SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_header_problem(header: bytes, size: int) -> str | None:
    """What is wrong with a whole SQLite file (no ``-wal`` beside it: a downloaded catalog
    version) by its 100-byte header and its size, or None: not SQLite, cut short (the
    header's page count times its page size is past its end; bytes after those pages SQLite
    ignores, as the download's ``quick_check`` does), or holding no table (its
    schema cookie is 0: an emptied file). Reads no page: a tier's copy is checked at each
    open, where ``quick_check`` (at download) would read the whole file.

    Example:
        >>> head = bytearray(SQLITE_MAGIC + bytes(84))
        >>> for at, width, value in ((16, 2, 4096), (24, 4, 1), (28, 4, 2), (40, 4, 3),
        ...                          (92, 4, 1)):
        ...     head[at : at + width] = value.to_bytes(width, "big")
        >>> sqlite_header_problem(bytes(head), 8192), sqlite_header_problem(bytes(head), 4096)
        (None, 'its header counts 2 pages of 4096 bytes (8192), the file holds 4096')
        >>> sqlite_header_problem(bytes(head), 12288) is None  # grown: read as SQLite reads it
        True
        >>> sqlite_header_problem(b"", 0)
        'not an SQLite file (0 bytes)'
    """
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        return f"not an SQLite file ({size} bytes)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    counted = header[92:96] == header[24:28]  # the page count is valid for this change
    if counted and pages * page_size > size:  # bytes past the counted pages SQLite ignores
        return (
            f"its header counts {pages} pages of {page_size} bytes ({pages * page_size}), "
            f"the file holds {size}"
        )
    if int.from_bytes(header[40:44], "big") == 0:
        return "it holds no table"
    return None


def whole_catalog_problem(path: Path) -> str | None:
    """What keeps the file at ``path`` from being a whole catalog, read cheaply (its header,
    :func:`sqlite_header_problem`, then its schema version: two pages), or None. A missing
    or unreadable file: its error. Damage inside a page is ``quick_check``'s to find."""
    try:
        with open(path, "rb") as f:
            problem = sqlite_header_problem(f.read(100), os.fstat(f.fileno()).st_size)
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if problem is not None:
        return problem
    try:
        conn = open_sqlite(path, Access.IMMUTABLE)
        try:
            version = schema_version(conn)
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        return f"unreadable: {e}"
    return "it holds no catalog tables" if version is None else None


def create_catalog_whole(path: Path, tmp_dir: Path, timeout: float) -> bool:
    """Make a new, empty catalog appear at ``path`` whole: its schema and journal mode written
    to a file in a folder of ``tmp_dir`` (same filesystem) with no sync of SQLite's own, that
    file fsynced once and linked at ``path``, and ``path``'s folder fsynced. True if this call
    made it.

    SQLite made the file in place: the switch to WAL (a rollback-journal transaction) and the
    tables cost six syncs of four files before a build could begin (a new catalog took
    2.7-3.2 ms on a quiet disk, 17-65 ms on a shared one; issue 42 item 4); this costs two, and
    no reader, and no power cut, ever sees a half-made catalog. A link never replaces a file:
    where another process made the catalog first, its file stays and this one is dropped.
    Where links are refused (some network and FUSE mounts), nothing is linked and SQLite fills
    an empty file made at ``path``, as before.

    The folder is held while it is used (``holding``: a gc sweep of ``tmp/`` keeps it, and
    removes it with the SQLite files beside the new one if this process is killed), and the
    file is made by featbake as the umask allows (:func:`made_as_umask_allows`), so the
    catalog and its ``-wal``/``-shm`` (SQLite gives them the catalog's mode) are a group's to
    write in a store it shares.
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with holding(temporary_path(path, tmp_dir), folder=True) as held:
        made = held.path / path.name
        made_as_umask_allows(made)
        conn = open_sqlite(made, Access.READ_WRITE, timeout=timeout)
        try:
            conn.execute("PRAGMA synchronous=OFF")  # the one fsync below makes it durable
            conn.execute(f"PRAGMA journal_mode={detect(path.parent).journal_mode}")
            ensure_schema(conn, made, writable=True, version=None)  # a new file
        finally:
            conn.close()  # in WAL mode the last close folds the WAL into the file
        fsync_file(made)
        try:
            os.link(made, path)
        except FileExistsError:
            return False  # another process made it first: that one is the catalog
        except OSError:
            made_as_umask_allows(path)  # no hard links here: SQLite fills it in place
            return False
        fsync_dir(path.parent)
        return True


def made_as_umask_allows(path: Path) -> None:
    """Make an empty file at ``path`` (0o666 asked, so the umask decides: a store a group
    shares, umask 002, gets a file every member may write), unless one is there. SQLite makes
    a database 0o644 whatever the umask; it opens an empty file as an empty database, and
    gives the ``-wal`` and ``-shm`` it makes beside it the database's mode."""
    with suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


#: SQLite's primary result codes that say the catalog's disk refused a write: full, failing
#: (on a full disk a WAL's shared-memory file cannot grow: ``SQLITE_IOERR_SHMSIZE``), or
#: read-only underneath an open connection (a mount remounted read-only). Reads that fail are
#: not among them: those may be a damaged file.
_WRITE_REFUSED = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY)
_READ_FAILED = (sqlite3.SQLITE_IOERR_READ, sqlite3.SQLITE_IOERR_SHORT_READ)


def cannot_write(error: BaseException | None, *, writing: bool = True) -> bool:
    """Whether SQLite failed because the disk refused a write (not a bug, not a damaged file);
    ``error`` may be the StoreError such a failure became (its cause is looked at).

    A connection that is not ``writing`` (read-only) meets SQLITE_READONLY where a hot journal
    needs rolling back, which says nothing of the disk: only a full or failing disk counts.
    """
    if isinstance(error, StoreError):
        error = error.__cause__
    code = getattr(error, "sqlite_errorcode", None)
    if not isinstance(error, sqlite3.Error) or code is None or code in _READ_FAILED:
        return False
    refused = _WRITE_REFUSED if writing else (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
    return code & 0xFF in refused


#: SQLite's primary result codes that say the catalog file itself is damaged.
_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def damaged_file(error: BaseException | None) -> bool:
    """Whether SQLite failed because the catalog file is damaged (a page that is not what its
    b-tree says: "database disk image is malformed"), which a rebuild from the shards fixes;
    ``error`` may be the StoreError such a failure became (its cause is looked at)."""
    if isinstance(error, StoreError):
        error = error.__cause__
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.Error) and code is not None and code & 0xFF in _DAMAGED


def _file_size(path: str) -> int:
    """The size of the file at ``path``; 0 where there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def unwritable_catalog(path: Path, error: sqlite3.Error, *, opening: bool = False) -> StoreError:
    """The one-line error for a catalog write the disk refused, with what to do; ``opening``:
    refused while opening it to write (a read-only open, which needs no space, reads it)."""
    fix = (
        "the disk is full, failing or read-only: free space (or move the store with --cache "
        "DIR) and check the disk, then run it again; the catalog itself is not damaged"
    )
    if opening:
        fix += f"; to serve the store meanwhile, set {READ_ONLY_ENV}=1 (stats and roots read it)"
    return StoreError(f"cannot write the catalog {path} ({error}); {fix}")


def _roll_back(conn: sqlite3.Connection) -> None:
    """ROLLBACK what is open; nothing when SQLite rolled it back itself (a failed COMMIT)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


class Transaction:
    """An open write transaction: run statements, and queue file removals for after COMMIT.

    Files a transaction retires (tombstones, replaced files) are removed only once the rows that
    stopped naming them are committed (diskcache's ``_transact`` does the same), so a crash or a
    ROLLBACK never leaves a row that names a removed file.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.callbacks: list[Callable[[], Any]] = []

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, params: Any) -> sqlite3.Cursor:
        return self.conn.executemany(sql, params)

    @property
    def total_changes(self) -> int:
        return self.conn.total_changes

    def after_commit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once the transaction has committed (never if it rolls back)."""
        self.callbacks.append(fn)


class CatalogConnection(ProcessLocalState):
    """A store's ``catalog.sqlite``: per-thread, per-process connections and transactions.

    Use it as a context manager (``with Catalog(layout) as cat:``) to close this thread's
    connection at the end; other threads' connections close when their thread ends.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        timeout: float = 60.0,
        read_only: bool = False,
        rebuild: bool = False,
        fragment: Path | None = None,
    ) -> None:
        self.layout = layout
        # A fragment (store/fragments.py) is a catalog in a file of its own: written by one
        # process before it is sealed by a rename, read as an immutable snapshot after.
        self.fragment = fragment
        self.path = layout.catalog if fragment is None else fragment
        self.timeout = timeout
        self.read_only_requested = read_only
        self.access = self._access()
        self.rebuild = rebuild  # verify --repair makes a new catalog beside surviving shards

    #: This thread's connection in this process, opened (schema checked) on first use.
    conn: PerThread[sqlite3.Connection] = PerThread(lambda self: self._connect())

    def _access(self) -> Access:
        if self.fragment is None:
            return access_for(self.layout, read_only=self.read_only_requested)
        return Access.IMMUTABLE if self.read_only_requested else Access.READ_WRITE

    @property
    def read_only(self) -> bool:
        return self.access is not Access.READ_WRITE

    # -- connections -------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        try:
            fresh = self.fragment is None and self.access is Access.READ_WRITE
            made_here = fresh and not self.path.exists()
            if made_here:
                self.layout.refuse_fresh_catalog(allow=self.rebuild)
                create_catalog_whole(self.path, self.layout.tmp, self.timeout)
            conn = self._open()
            checked = self.fragment is None or self.access is Access.READ_WRITE
            version = schema_version(conn) if checked else None
            if self.fragment is None and not (made_here or self.rebuild):
                self._refuse_emptied(conn, version)
            # A sealed fragment is read by column name whatever schema version wrote it.
            if checked:
                writable = self.access is Access.READ_WRITE
                ensure_schema(conn, self.path, writable=writable, version=version)
        except sqlite3.OperationalError as e:
            if self._no_room_for_shm(e):
                # A full disk: a read-only open of a WAL catalog must make (or size) its -shm
                # file and cannot. With no frame in a -wal file, every commit is in the catalog
                # file itself, which an immutable open reads whole, needing no file of its own.
                self.access = Access.IMMUTABLE
                return self._connect()
            if cannot_write(e, writing=self.access is Access.READ_WRITE):
                raise unwritable_catalog(self.path, e, opening=True) from e
            raise self.unreadable(e) from e
        except sqlite3.DatabaseError as e:
            raise self.unreadable(e) from e
        return conn

    def _refuse_emptied(self, conn: sqlite3.Connection, version: int | None) -> None:
        """Raise where the store's catalog has no tables (a file emptied or truncated to
        nothing) though the store holds shards or root manifests: taken as a new catalog, it
        read as a store holding nothing, a build encoded everything again and gc deleted every
        shard as unnamed. Rebuilding it is ``verify --repair``'s (``rebuild``)."""
        if self.layout.remote is not None or version is not None:
            return
        if not self.layout.holds_what_a_catalog_names():
            return  # a store's first catalog, another process filling it in place
        conn.close()
        raise StoreError(
            f"the catalog {self.path} is empty (no tables) though the store holds shards or "
            "root manifests; run `featbake verify --repair` to rebuild it from them (taken as "
            "new, every feature would be encoded again and gc would delete the shards)"
        )

    def _no_room_for_shm(self, error: sqlite3.OperationalError) -> bool:
        """Whether a read-only open failed only for want of room to make its ``-shm`` file: a
        full or failing disk (not SQLITE_READONLY, which a hot journal gives), with no frame in
        a ``-wal`` file and no ``-journal`` a killed writer left (an immutable open would read
        its half-written pages)."""
        return (
            self.access is Access.READ_ONLY
            and self.fragment is None
            and cannot_write(error, writing=False)
            and _file_size(f"{self.path}-wal") == 0
            and not os.path.exists(f"{self.path}-journal")
        )

    def unreadable(self, error: sqlite3.DatabaseError) -> StoreError:
        """The error for a catalog SQLite refused to read, with the fix for the likely cause."""
        fix = (
            "if it is damaged, move it aside and run `featbake verify --repair` to rebuild it "
            "from the shards"
        )
        if self.layout.remote is not None:
            # A node's copy of a bucket's catalog version: the bucket's own is whole (checked
            # at download); this copy was damaged on this node's disk since.
            fix = (
                "it is this node's copy of the bucket's catalog: delete it and catalog.version "
                "beside it, and the next command downloads it again"
            )
        elif self.read_only and os.path.exists(f"{self.path}-journal"):
            # A rollback journal left by a writer killed mid-transaction: only a read-write
            # connection can roll it back (SQLite does on its first read).
            fix = (
                f"a writer was killed mid-transaction and left {self.path.name}-journal, which "
                "a read-only reader cannot roll back; run `featbake merge` once where the store "
                "is writable (it rolls it back), then retry"
            )
        return StoreError(
            f"cannot read the catalog {self.path} ({self.access.value}): {error}; {fix}"
        )

    def _open(self) -> sqlite3.Connection:
        if self.access is Access.READ_WRITE:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = open_sqlite(self.path, self.access, timeout=self.timeout)
        conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        if self.fragment is not None and self.access is Access.READ_WRITE:
            # One writer, a file no one sees until it is fsynced and renamed: no journal needed.
            conn.execute("PRAGMA journal_mode=OFF")
            conn.execute("PRAGMA synchronous=OFF")
        elif self.access is Access.READ_WRITE:
            set_journal_mode(conn, self.path, self.timeout)  # WAL, or DELETE on a shared FS
            # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt the file;
            # a lost row only means a feature is encoded again (the shard itself was fsynced).
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=OFF")
        return conn

    def close(self) -> None:
        """Close this thread's connection (a connection inherited across fork is only dropped)."""
        conn = CatalogConnection.conn.reset(self)
        if conn is not None:
            conn.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Connections never cross (ProcessLocalState). The extra rule: another process (or
        # machine) may see the store differently (a read-only mount there), so look again.
        super().__setstate__(state)
        self.access = self._access()

    # -- transactions ------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """A short write transaction: BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error.

        Callbacks queued with :meth:`Transaction.after_commit` run after COMMIT, in order.

        Raises:
            StoreError: the catalog is read-only here, or locked past the timeout.
        """
        if self.read_only:
            raise read_only_here(self.layout)
        conn = self.conn
        with critical_section():  # a finalizer run inside hands its commit over
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise StoreError(f"the catalog {self.path} is locked or unwritable: {e}") from e
            txn = Transaction(conn)
            try:
                yield txn
                conn.execute("COMMIT")
            except sqlite3.OperationalError as e:
                _roll_back(conn)
                if not cannot_write(e):
                    raise
                raise unwritable_catalog(self.path, e) from e
            except BaseException:
                _roll_back(conn)
                raise
        for fn in txn.callbacks:
            fn()


def _restore_manifest(dead: Path, live: Path) -> None:
    """Rename a drop's tombstone back to the root's manifest file (its drop did not commit);
    quietly where it cannot (the tombstone then lets gc finish the drop, as after a crash)."""
    try:
        if dead.exists() and not live.exists():
            os.replace(dead, live)
            fsync_dir(live.parent)
    except OSError:
        pass


# Feature rows, the hash cache and encoder rows: what builds and datasets read and add.
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


#: Adds a shard's feature rows inside ``add_shard``'s transaction (given the shard's row id),
#: less those of keys replaced at or after the given time (:meth:`VoidRows.age_of`).
RowCopy = Callable[[Transaction, int, float], object]

#: The age of a shard no replaced key's row is void in (no key is replaced).
NOTHING_VOID = float("inf")


@dataclass(frozen=True)
class VoidRows:
    """The rows no fold may add: a key's rows are void in a shard recorded at or before the
    newest replacement of the key (``at``: key -> when the fragment saying so was sealed)
    and not named again after it (``named``: shard name -> when a fragment last named it), as
    :class:`featbake.store.merge.Replacements` says. Both ages come down to one per shard
    (:meth:`age_of`): a row of key k in shard s is void when ``at[k] >= age_of(s)``.

    A merge's folds skip them (:meth:`FeatureRows.add_fragment_shards`, :meth:`~FeatureRows.
    add_shard`) rather than a drop after each fold: a merge killed between a fold's commit
    and that drop left the catalog serving a row its build had replaced until the next merge.
    Now no commit adds one. gc's compaction ages the shards it writes by :meth:`age_of` too.
    """

    at: Mapping[str, float] = field(default_factory=dict)
    named: Mapping[str, float] = field(default_factory=dict)

    def age_of(self, name: str, created: float) -> float:
        """The age of shard ``name``, last recorded at ``created``: when it was last recorded
        or named. A key's row in it is void where the key was replaced at or after then."""
        return max(created, self.named.get(name, created))

    def voids(self, key: str, age: float) -> bool:
        """Whether ``key``'s row in a shard of age ``age`` (:meth:`age_of`) is void."""
        return key in self.at and self.at[key] >= age


#: No key replaced: every row a fold finds is added.
NO_VOID = VoidRows()


def chunks(seq: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def insert_shard(c: Transaction, shard: SealedShard, now: float, size: ShardSize) -> int:
    """Record a sealed shard (once: its name is its content) and return its row id.

    ``size`` is its tensors' count and bytes (:meth:`ShardSize.of` a shard with its entries).
    A shard recorded again (the same bytes sealed again: a writer stored the same features
    again) is as new as its latest recording: ``created`` only moves forward. Its age says
    whether a replacement of a key voids its row (:class:`VoidRows`), and rows sealed again
    after a replacement are not void. Before, the first recording's time stood: a one-process
    rebuild storing a replaced key again, with the same bytes, had its one good row dropped as
    void by the next merge. (``created`` is read for that alone: gc's grace and ``--older-than``
    go by files' mtimes and roots' last use.)
    """
    c.execute(
        "INSERT INTO shards"
        "(name, bytes, items, encoder_fp, recipe_fp, created, data_bytes)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET created = MAX(created, excluded.created)",
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
    """The ids among ``shard_ids`` whose file is gone from the place (or that name no shard
    row at all): a bucket's object, whatever copy a tier keeps (:func:`place_holds_shard`)."""
    ids = sorted(set(shard_ids))
    found: set[int] = set()
    lost: set[int] = set()
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i : i + CHUNK]
        q = ",".join("?" * len(chunk))
        for sid, name in conn.execute(f"SELECT id, name FROM shards WHERE id IN ({q})", chunk):
            found.add(sid)
            if not place_holds_shard(layout, name):
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
    catalog's key index: inserts touch each B-tree page once), less the void ones: those of
    keys in ``temp.void_keys`` (:meth:`FeatureRows.hold_void`) replaced at or after ``age``,
    the shard's. The plain copy where nothing is void: a merge with no replacement pays
    nothing."""

    def copy(c: Transaction, shard_id: int, age: float) -> None:
        select = f"SELECT key, part, ?, dtype, shape, nbytes, last_used FROM {schema}.features f"
        params: tuple[float, ...]
        if age == NOTHING_VOID:
            where, params = "", (shard_id, fragment_shard_id)
        else:
            where = " AND NOT EXISTS (SELECT 1 FROM temp.void_keys v WHERE v.key = f.key"
            where += " AND v.at >= ?)"
            params = (shard_id, fragment_shard_id, age)
        c.execute(
            f"INSERT OR IGNORE INTO main.features({FEATURE_COLUMNS}) {select}"
            f" WHERE shard_id = ?{where} ORDER BY key, part",
            params,
        )

    return copy


def _created(c: Transaction, shard_id: int) -> float:
    """When shard ``shard_id`` was recorded (last, :func:`insert_shard`)."""
    return float(c.execute("SELECT created FROM shards WHERE id=?", (shard_id,)).fetchone()[0])


def _without_void(shard: SealedShard, void: VoidRows, age: float) -> SealedShard:
    """``shard`` less the entries that are void in it (:meth:`VoidRows.voids`): a row naming
    a lost file is never pointed at one of them."""
    if age == NOTHING_VOID:
        return shard
    kept = tuple(e for e in shard.entries if not void.voids(e.key, age))
    return dataclasses.replace(shard, entries=kept)


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

    #: This thread's (connection, VoidRows) whose keys ``temp.void_keys`` holds (hold_void).
    _void_held: PerThread[list[tuple[sqlite3.Connection, VoidRows]]] = PerThread(lambda _: [])

    def others_commits(self) -> int | None:
        """A count that changes when another connection commits to the catalog (SQLite's
        ``data_version`` on this thread's connection; this connection's own commits leave it):
        two equal readings mean nobody else wrote between them."""
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """The subset of ``keys`` that are stored: cataloged, in shard files that exist.

        A key whose shard file is gone although rows still name it (deleted by hand, lost in a
        partial copy of the store) is not present: a build encodes it again, and
        :meth:`FeatureRows.add_shard` points its rows at the new copy. One ``stat`` per
        distinct shard of the keys found; in a bucket, its object (a listing once per
        process), not the tier's copy.
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

    def add_shard(
        self, shard: SealedShard, now: float | None = None, *, void: VoidRows = NO_VOID
    ) -> int:
        """Record a sealed shard and its features in one transaction; returns new feature rows.

        Features already present keep their existing row (first wins), so two writers that
        encoded the same input leave one row and one unreferenced copy for gc. A row whose
        shard file is gone (deleted by hand, lost in a partial copy) is no feature: it is
        pointed at this shard instead, and the lost shard's row goes once nothing names it.
        The rows ``void`` says are void are left out (a merge's fold, :class:`VoidRows`).
        """
        now = time.time() if now is None else now
        values = [
            (e.key, e.part, e.dtype, json.dumps(list(e.shape)), e.nbytes) for e in shard.entries
        ]

        def insert(c: Transaction, shard_id: int, age: float) -> None:
            c.executemany(
                INSERT_FEATURES,
                [
                    (k, p, shard_id, d, s, n, now)
                    for k, p, d, s, n in values
                    if not void.voids(k, age)
                ],
            )

        return self._add_shard(shard, now, insert, lambda: shard, ShardSize.of(shard), void)

    def add_fragment_shards(
        self, fragment: Path, schema: str = "fragment", *, void: VoidRows = NO_VOID
    ) -> FragmentRowsAdded:
        """Add every shard of a sealed fragment (a catalog file, store/fragments.py), as
        :meth:`add_shard` does, its rows copied SQL-side through ``ATTACH`` (none passes
        through Python) with the fragment's own timestamps, less those ``void`` says are void.
        A shard whose file is gone is listed, not added (its features are encoded again when
        next needed)."""
        self.hold_void(void)
        conn = self.conn
        # Read-only (a sealed file, as fragments are read): one another merge folded and
        # removed meanwhile fails to attach (sqlite3.Error), where a plain path made an empty
        # file of its name in fragments/ (verify then called it damaged, and every later
        # merge failed on it).
        conn.execute(f"ATTACH DATABASE ? AS {schema}", (_uri(fragment, Access.IMMUTABLE),))
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
                    out.features += self._add_shard(shard, row.created, copy, entries, size, void)
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
        void: VoidRows = NO_VOID,
    ) -> int:
        with self.transaction() as c:
            # Checked under the write lock, as gc unlinks under it (unlink_shard_file): a file
            # gc removed after our rename (it held a byte-identical shard of the same name) is
            # seen here, and the caller writes it again instead of committing rows to nothing.
            if not holds_shard(self.layout, shard.name):
                raise ShardMissing(
                    f"shard {shard.name} vanished before its rows were committed (gc removed an "
                    "identical shard); it is written again"
                )
            shard_id = insert_shard(c, shard, now, size)
            age = void.age_of(shard.name, _created(c, shard_id)) if void.at else NOTHING_VOID
            before = c.total_changes
            copy(c, shard_id, age)
            added = c.total_changes - before
            if added < size.items:  # some rows exist: those naming a lost file move
                kept = _without_void(with_entries(), void, age)
                added += repoint_lost_rows(c, self.layout, kept, shard_id)
            return added

    def hold_void(self, void: VoidRows) -> None:
        """Put ``void``'s keys in this connection's ``temp.void_keys``, which a fold's copy
        reads (:func:`_copy_from`): once per connection and ``void`` (a merge folds thousands
        of fragments against one), nothing where no key is replaced."""
        held = self._void_held
        if not void.at or (held and held[0][0] is self.conn and held[0][1] is void):
            return
        with self.transaction() as c:
            c.execute(
                "CREATE TEMP TABLE IF NOT EXISTS void_keys (key TEXT PRIMARY KEY, at REAL NOT NULL)"
                " WITHOUT ROWID"
            )
            c.execute("DELETE FROM temp.void_keys")
            c.executemany("INSERT INTO temp.void_keys VALUES (?, ?)", void.at.items())
        held[:] = [(self.conn, void)]

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


# Roots: their catalog rows, written with their files (``roots/<name>.json``, featbake.store.roots).
#
# A root's row and items are written in ONE place (:func:`write_root_rows`), inside the same write
# transaction as its manifest file, so two builds of one root cannot leave them disagreeing.
#: The latest last use of a root's features. Serving records use per feature (coarsely, see
#: serve/state.py), never per root: this is how a root a dataset reads counts as used.
ROOT_READ_SELECT = (
    "SELECT max(f.last_used) FROM root_items ri JOIN features f ON f.key = ri.key WHERE ri.root=?"
)

ROOT_SELECT = f"SELECT {', '.join(Root.COLUMNS)} FROM roots"
#: The roots of a catalog before schema 4 (read as it is, :data:`READ_AS_IS`): no folder recorded.
ROOT_SELECT_3 = (
    f"SELECT {', '.join(c if c != 'workdir' else repr('') for c in Root.COLUMNS)} FROM roots"
)
ITEMS_SELECT = f"SELECT {columns(RootItem)} FROM root_items WHERE root=? ORDER BY idx"


def write_root_rows(
    c: Transaction,
    root: Root,
    items: Sequence[tuple[str, str]],
    *,
    first: int = 0,
    indices: Sequence[int] | None = None,
) -> None:
    """Write a root's row, and ``items`` as its items from index ``first`` on (the only writer
    of both; ``first`` > 0 appends to the items already there). ``indices`` gives each item's
    index instead (a rank's fragment holds its slice of the whole build's manifest)."""
    c.execute(
        f"INSERT OR REPLACE INTO roots({', '.join(Root.COLUMNS)}) "
        f"VALUES ({','.join('?' * len(Root.COLUMNS))})",
        root.row(),
    )
    where = range(first, first + len(items)) if indices is None else indices
    c.executemany(
        "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
        [(root.name, i, p, k) for i, (p, k) in zip(where, items, strict=True)],
    )


def _named_keys(c: Transaction, name: str, keys: Sequence[str]) -> set[str]:
    """Which of ``keys`` root ``name`` names already (through the key index: no item scan)."""
    named: set[str] = set()
    for s in range(0, len(keys), 500):  # well under SQLite's bound on parameters
        chunk = keys[s : s + 500]
        marks = ",".join("?" * len(chunk))
        rows = c.execute(
            f"SELECT key FROM root_items WHERE key IN ({marks}) AND root=?", (*chunk, name)
        )
        named.update(k for (k,) in rows)
    return named


class RootRows(CatalogConnection):
    """Roots and their manifests: reading them, publishing them (builds, datasets,
    CachedEncoder: never a delete of features) and dropping them (gc, ``featbake roots drop``)."""

    def root_select(self) -> str:
        """The ``SELECT`` of every root column: a catalog of schema 3 read as it is (read-only,
        :data:`READ_AS_IS`) has no ``workdir``, read as ``''`` (its data read from the working
        directory, as that featbake read it)."""
        has = {r[1] for r in self.conn.execute("PRAGMA table_info(roots)")}
        return ROOT_SELECT if "workdir" in has else ROOT_SELECT_3

    def root(self, name: str) -> Root | None:
        """The root named ``name``, or None."""
        row = self.conn.execute(f"{self.root_select()} WHERE name=?", (name,)).fetchone()
        return Root.from_row(row) if row else None

    def roots(self) -> list[Root]:
        """Every root, most recently built first."""
        rows = self.conn.execute(f"{self.root_select()} ORDER BY last_used DESC").fetchall()
        return [Root.from_row(r) for r in rows]

    def root_items(self, name: str) -> list[RootItem]:
        """A root's manifest: (relative path, key) in file order."""
        return [RootItem._make(r) for r in self.conn.execute(ITEMS_SELECT, (name,))]

    def with_reads(self, root: Root) -> Root:
        """``root`` with ``last_used`` the later of its build (or publish) and the last read
        of any of its features, so ``gc --older-than`` keeps a root a dataset reads.

        A feature several roots name counts for each (a read of it is a use of them all).
        """
        read = self.conn.execute(ROOT_READ_SELECT, (root.name,)).fetchone()[0] or 0.0
        return dataclasses.replace(root, last_used=max(root.last_used, read))

    # -- publishing ----------------------------------------------------------------------------

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None:
        """Replace root ``spec.name``'s manifest with ``items`` ((relative path, key), in
        order)."""
        now = time.time() if now is None else now
        name = spec.name
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            root = spec.root(len(items), old[0] if old else now, now)
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            write_root_rows(c, root, items)
            # The manifest file is what `verify --repair` rebuilds roots from (roots are not in
            # shards). Written while this transaction holds the write lock, so two builds of one
            # root cannot leave the file and the row disagreeing.
            write_root_file(self.layout, root, items)

    def extend_root(self, spec: RootSpec, keys: Sequence[str], now: float | None = None) -> int:
        """Append ``keys`` not yet named to root ``name`` (made if absent); returns how many.

        For writers with no data folder to rebuild a manifest from (``CachedEncoder``): what
        they store stays reachable, so gc keeps it until the root is dropped (``featbake roots
        drop`` or ``gc --older-than``). Items get an empty path. Call it before
        :meth:`add_shard` for those keys, so gc never sees their rows unreached. Its cost is
        that of the keys added: they are looked up through the key index and appended to the
        manifest's ``.items`` file (fsynced, inside the transaction), never the whole manifest
        read or rewritten (which made a CachedEncoder's write-back quadratic in its root).

        Example:
            >>> spec = RootSpec("cached-encoder-3f1c", "cached-encoder:3f1c", "MyEncoder",
            ...     fp, rfp, {})  # doctest: +SKIP
            >>> cat.extend_root(spec, ["9a..."])  # doctest: +SKIP
        """
        now = time.time() if now is None else now
        name = spec.name
        wanted = list(dict.fromkeys(keys))
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            named = _named_keys(c, name, wanted) if old is not None else set()
            new = [RootItem("", k) for k in wanted if k not in named]
            if old is not None and not new:
                c.execute("UPDATE roots SET last_used=? WHERE name=?", (now, name))
                return 0
            first = c.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM root_items WHERE root=?", (name,)
            ).fetchone()[0]
            root = spec.root(first + len(new), old[0] if old else now, now)
            write_root_rows(c, root, new, first=first)
            if first and root_file(self.layout, name).exists():
                append_root_items(self.layout, name, new)  # what was added, not the manifest
            else:  # a new root (or its file lost): the whole manifest, once
                items = [RootItem._make(r) for r in c.execute(ITEMS_SELECT, (name,))]
                write_root_file(self.layout, root, items)
        return len(new)

    # -- dropping ------------------------------------------------------------------------------

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
        no root and a tombstone (gc unlinks it); never a root whose manifest file is lost. A
        drop that fails without a crash (the COMMIT refused on a full disk: the caller is told
        it did not happen) renames the tombstone back, so no later gc finishes it.
        ``unused_before`` drops it only if it was not built or read since then (a build that
        refreshed it, or a dataset that read its features, meanwhile wins). ``between`` is a
        test hook called between the steps.
        """
        live, dead = root_file(self.layout, name), tombstone_file(self.layout, name)
        renamed, committed = False, False

        def mark_committed() -> None:
            nonlocal committed
            committed = True

        try:
            with self.transaction() as c:
                row = c.execute("SELECT last_used FROM roots WHERE name=?", (name,)).fetchone()
                if row is None or (unused_before is not None and row[0] >= unused_before):
                    return False
                read = c.execute(ROOT_READ_SELECT, (name,)).fetchone()[0] or 0.0
                if unused_before is not None and read >= unused_before:
                    return False  # read since the plan: still in use
                if live.exists():
                    os.replace(live, dead)
                    renamed = True
                    fsync_dir(live.parent)
                if between:
                    between("drop-root-renamed")
                c.execute("DELETE FROM root_items WHERE root=?", (name,))
                c.execute("DELETE FROM roots WHERE name=?", (name,))
                c.after_commit(mark_committed)
                if between:
                    c.after_commit(lambda: between("drop-root-committed"))
                c.after_commit(lambda: unlink_quietly(dead))
                c.after_commit(lambda: unlink_quietly(items_file(self.layout, name)))
                c.after_commit(lambda: unlink_quietly(fidelity_file(self.layout, name)))
                c.after_commit(lambda: unlink_quietly(undecodable_file(self.layout, name)))
                c.after_commit(lambda: unlink_quietly(held_file(self.layout, name)))
        except BaseException:
            if renamed and not committed:
                _restore_manifest(dead, live)
            raise
        return True

    def finish_drop(self, name: str) -> bool:
        """Finish a drop that a crash interrupted (a tombstone is left); True if rows went.

        If the root was built again since (its manifest file is back), only the tombstone goes.
        """
        dead = tombstone_file(self.layout, name)
        if root_file(self.layout, name).exists():
            unlink_quietly(dead)
            return False
        with self.transaction() as c:
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            dropped = c.execute("DELETE FROM roots WHERE name=?", (name,)).rowcount > 0
            c.after_commit(lambda: unlink_quietly(dead))
            c.after_commit(lambda: unlink_quietly(items_file(self.layout, name)))
            c.after_commit(lambda: unlink_quietly(fidelity_file(self.layout, name)))
            c.after_commit(lambda: unlink_quietly(undecodable_file(self.layout, name)))
            c.after_commit(lambda: unlink_quietly(held_file(self.layout, name)))
        return dropped


# What ``featbake stats``, ``gc`` and ``verify --repair`` read and change in the catalog.
#
# Queries that touch every feature walk the tables in key order (ORDER BY key), so their lookups
# into the other table go in key order too and stay in cache: ~0.4 s per million rows instead of
# ~2 s. Deletes run in short transactions, so builds and readers are never locked out for long.
_FEATURE_REFS = f"SELECT {', '.join('f.' + c for c in FeatureRef.COLUMNS)} FROM features f"


class UpkeepRows(CatalogConnection):
    """What stats, gc and verify need: store-wide reads, then gc's and repair's changes
    (deleting rows and files, moving rows, restoring rows)."""

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """The reads inside see one state of the catalog (one read transaction), so numbers
        added up across them never mix a writer's commit half in (stats while a build or gc
        runs)."""
        conn = self.conn
        with critical_section():  # a read transaction holds off a rollback journal's writers
            conn.execute("BEGIN")
            try:
                yield
            finally:
                conn.execute("COMMIT")  # it only read: this ends the snapshot

    def shard_rows(self) -> list[ShardRow]:
        """Every shard row, by id."""
        rows = self.conn.execute(f"SELECT {', '.join(ShardRow.COLUMNS)} FROM shards ORDER BY id")
        return [ShardRow(*r) for r in rows]

    def shard_row(self, shard_id: int) -> ShardRow | None:
        """The row of shard ``shard_id``; None where none has that id (deleted since)."""
        row = self.conn.execute(
            f"SELECT {', '.join(ShardRow.COLUMNS)} FROM shards WHERE id=?", (shard_id,)
        ).fetchone()
        return None if row is None else ShardRow(*row)

    def shard_id(self, name: str) -> int | None:
        """The id of the shard named ``name``; None where no row names it."""
        row = self.conn.execute("SELECT id FROM shards WHERE name=?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def shard_usage(self) -> dict[int, ShardUsage]:
        """shard id -> (feature rows, their bytes, their latest use), from the covering index.

        Raises:
            TypeError: a byte count is not an integer (:func:`whole_sum`).
        """
        return {
            sid: ShardUsage(rows=n, nbytes=whole_sum(b or 0), last_used=lu or 0.0)
            for sid, n, b, lu in self.conn.execute(
                "SELECT shard_id, count(*), sum(nbytes), max(last_used) FROM features "
                "GROUP BY shard_id"
            )
        }

    def feature_totals(self) -> FeatureTotals:
        """Features (distinct keys), bytes, and how many some root reaches, in one pass.

        A row counts as a feature if it is its key's first part; the CASE spares single-output
        stores (part '') the extra lookup. ~0.5 s per million rows.

        Raises:
            TypeError: a byte count is not an integer (:func:`whole_sum`).
        """
        features, nbytes, live, live_nbytes = self.conn.execute(
            "SELECT coalesce(sum(first), 0), coalesce(sum(nbytes), 0), "
            "coalesce(sum(first * live), 0), coalesce(sum(live * nbytes), 0) FROM ("
            "SELECT f.nbytes, CASE WHEN f.part = '' THEN 1 ELSE NOT EXISTS (SELECT 1 FROM "
            "features g WHERE g.key = f.key AND g.part < f.part) END AS first, "
            "EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) AS live "
            "FROM features f ORDER BY f.key, f.part)"
        ).fetchone()
        return FeatureTotals(
            features=features,
            nbytes=whole_sum(nbytes),
            live_features=live,
            live_nbytes=whole_sum(live_nbytes),
        )

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
            f"{_FEATURE_REFS} WHERE NOT EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) "
            "ORDER BY f.key, f.part"
        )
        return [FeatureRef(*r) for r in rows]

    def reached_features(self) -> list[FeatureRef]:
        """Feature rows some root reaches, in key order (what a byte budget evicts from)."""
        rows = self.conn.execute(
            f"{_FEATURE_REFS} WHERE EXISTS (SELECT 1 FROM root_items r WHERE r.key = f.key) "
            "ORDER BY f.key, f.part"
        )
        return [FeatureRef(*r) for r in rows]

    def features_of_shard(self, shard_id: int) -> list[ShardFeature]:
        """(key, part, dtype, shape JSON, nbytes) of each row pointing into shard ``shard_id``."""
        rows = self.conn.execute(
            f"SELECT {columns(ShardFeature)} FROM features WHERE shard_id=? ORDER BY key, part",
            (shard_id,),
        )
        return [ShardFeature._make(r) for r in rows]

    def encoder_rows(self) -> list[EncoderRow]:
        """(fp, label, kind, first_seen, last_used) of every encoder seen."""
        rows = self.conn.execute(f"SELECT {columns(EncoderRow)} FROM encoders ORDER BY first_seen")
        return [EncoderRow._make(r) for r in rows]

    def dangling_feature_rows(self) -> int:
        """Feature rows whose shard id names no shard row (a catalog edited by hand)."""
        (n,) = self.conn.execute(
            "SELECT count(*) FROM features f WHERE NOT EXISTS "
            "(SELECT 1 FROM shards s WHERE s.id = f.shard_id)"
        ).fetchone()
        return n

    def all_feature_rows(self) -> Iterator[FeatureRow]:
        """(key, part, shard id, dtype, shape JSON, nbytes) of every row, by shard."""
        rows = self.conn.execute(f"SELECT {columns(FeatureRow)} FROM features ORDER BY shard_id")
        return map(FeatureRow._make, rows)

    # -- gc's and repair's changes ----------------------------------------------------------

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

    def forget_keys(self, keys: Sequence[str]) -> int:
        """Delete every row of these keys (a build replacing features it stored inexactly, see
        bake/pipeline.py); their shards' bytes stay until gc finds them unreferenced."""
        done = 0
        for i in range(0, len(keys), 500):
            chunk = list(keys[i : i + 500])
            with self.transaction() as c:
                q = ",".join("?" * len(chunk))
                done += c.execute(f"DELETE FROM features WHERE key IN ({q})", chunk).rowcount
        return done

    def forget_rows_sealed_by(self, keys: Sequence[str], when: float, kept: Iterable[str]) -> int:
        """Delete the rows of ``keys`` whose shards were (last) recorded at or before ``when``,
        except in the shards named ``kept``: rows a build stored before it replaced those keys
        (store/merge.py); how many."""
        if not keys:
            return 0
        done = 0
        with self.transaction() as c:
            c.execute("CREATE TEMP TABLE IF NOT EXISTS kept_shards (name TEXT PRIMARY KEY)")
            c.execute("DELETE FROM temp.kept_shards")
            c.executemany("INSERT OR IGNORE INTO temp.kept_shards VALUES (?)", ((n,) for n in kept))
            for i in range(0, len(keys), 500):
                chunk = list(keys[i : i + 500])
                q = ",".join("?" * len(chunk))
                done += c.execute(
                    f"DELETE FROM features WHERE key IN ({q}) AND shard_id IN (SELECT id FROM "
                    "shards WHERE created <= ? AND name NOT IN "
                    "(SELECT name FROM temp.kept_shards))",
                    [*chunk, when],
                ).rowcount
        return done

    def unlink_shard_file(self, name: str, written_at: float | None = None) -> int:
        """Remove shard ``name``'s file unless a row names it again; returns the bytes freed.

        Shard names are content hashes, so a writer may seal a byte-identical shard at the same
        path after gc deleted its row. The unlink happens deliberately UNDER the write lock (not
        after COMMIT like every other removal), and add_shard checks the file under the same
        lock, so one of the two always sees the other.

        A writer that names its shards in a fragment (a build in parts, a write-back on a shared
        filesystem) commits nothing here, so the lock cannot tell gc about it. With
        ``written_at`` (the file's mtime when gc planned to remove it) the file goes only if it
        is still that write: one sealed again since is a new shard that a fragment is about to
        name (:func:`unlink_if_written_at`).
        """
        with self.transaction() as c:
            if c.execute("SELECT 1 FROM shards WHERE name=?", (name,)).fetchone():
                return 0
            path = self.layout.shard_path(name)
            if written_at is None:
                return remove_file(path)
            return unlink_if_written_at(path, written_at, self.layout.tmp)

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
        self, shard: SealedShard, moved: Sequence[tuple[str, str, int]], created: float
    ) -> int:
        """Record a shard written by compaction and point the moved rows at it, atomically.

        ``moved`` holds :class:`MovedRow` (key, part, old shard id); a row that changed
        meanwhile is left as is. Returns how many rows now point at the new shard. The shard is
        recorded at ``created``: the age its rows keep (gc gives the oldest age of the shards
        they come from, see ``featbake.upkeep.gc.Compaction``): a row's shard's age says
        whether a replacement of its key voids it (:class:`VoidRows`).
        """
        with self.transaction() as c:
            sid = insert_shard(c, shard, created, ShardSize.of(shard))
            before = c.total_changes
            c.executemany(
                "UPDATE features SET shard_id=? WHERE key=? AND part=? AND shard_id=?",
                [(sid, m.key, m.part, m.old_shard_id) for m in map(MovedRow._make, moved)],
            )
            return c.total_changes - before

    def forget_unused_encoders(self) -> int:
        """Delete encoder rows that no shard and no root mentions; returns how many."""
        with self.transaction() as c:
            before = c.total_changes
            c.execute(
                "DELETE FROM encoders WHERE fp NOT IN (SELECT encoder_fp FROM shards) "
                "AND fp NOT IN (SELECT encoder_fp FROM roots)"
            )
            return c.total_changes - before

    def delete_rows_of_shards(self, shard_ids: Sequence[int]) -> int:
        """Forget shards entirely (their feature rows, then them); returns feature rows deleted."""
        done = 0
        with self.transaction() as c:
            for sid in shard_ids:
                done += c.execute("DELETE FROM features WHERE shard_id=?", (sid,)).rowcount
                c.execute("DELETE FROM shards WHERE id=?", (sid,))
        return done

    def delete_dangling_feature_rows(self) -> int:
        with self.transaction() as c:
            return c.execute(
                "DELETE FROM features WHERE shard_id NOT IN (SELECT id FROM shards)"
            ).rowcount

    def insert_root(self, root: Root, items: Sequence[tuple[str, str]]) -> None:
        """Put a root back exactly as given (``verify --repair`` restoring it from its file)."""
        with self.transaction() as c:
            c.execute("DELETE FROM root_items WHERE root=?", (root.name,))
            write_root_rows(c, replace(root, items=len(items)), items)

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
                f"INSERT OR IGNORE INTO encoders({columns(EncoderRow)}) VALUES (?,?,?,?,?)",
                (fp, label, kind, first, last),
            )

    def restore_hashes(self, rows: Iterable[Sequence]) -> None:
        """Carry hash-cache rows over from an old catalog (:class:`HashCacheRow`s).

        Rows of 5 values (path, size, mtime_ns, inode, sha256: schema 2, or an old reader) come
        without ctime and recording time: they are kept but never trusted, so each such file is
        hashed once more, then cached as usual.
        """
        full = [
            HashCacheRow._make(r) if len(r) == len(HashCacheRow._fields) else _from_v2(r)
            for r in rows
        ]
        with self.transaction() as c:
            c.executemany(
                f"INSERT OR IGNORE INTO hash_cache({columns(HashCacheRow)}) VALUES (?,?,?,?,?,?,?)",
                full,
            )

    def delete_hash_rows(self, rows: Sequence[tuple[str, str]]) -> int:
        """Delete hash-cache rows by (path, sha256) (a row recorded again since is kept)."""
        with self.transaction() as c:
            before = c.total_changes
            c.executemany("DELETE FROM hash_cache WHERE path=? AND sha256=?", rows)
            return c.total_changes - before

    def drop_hash_rows_with_prefix(self, prefix: str) -> int:
        """Delete the hash-cache rows whose id starts with ``prefix``; returns how many."""
        with self.transaction() as c:
            return c.execute(
                "DELETE FROM hash_cache WHERE substr(path, 1, ?) = ?", (len(prefix), prefix)
            ).rowcount


def unlink_if_written_at(path: Path, written_at: float, tmp_dir: Path) -> int:
    """Remove the file at ``path`` if it is the one last written at ``written_at``; returns the
    bytes freed (0: gone already, or written again since, which stays).

    The file is first renamed aside into a folder of ``tmp_dir`` this process holds
    (``holding``: no gc sweep takes what is set aside there), one atomic step that takes
    whichever file is there, then judged by its own mtime: a shard sealed again since
    (``os.replace`` of a fresh file under the same content name) is put back, byte for byte
    what a writer sealed there, so no writer's rename between the look and the unlink is ever
    lost.
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)  # else the rename fails as if the file were gone
    with holding(temporary_path(path, tmp_dir), folder=True) as held:
        aside = held.path / path.name
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return 0
        st = os.stat(aside)
        if st.st_mtime != written_at:
            os.replace(aside, path)  # the same content name: the same bytes, whoever wrote last
            return 0
        os.unlink(aside)
        return st.st_size


def _from_v2(r: Sequence) -> HashCacheRow:
    path, size, mtime_ns, inode, sha256 = r
    return HashCacheRow(path, size, mtime_ns, inode, 0, sha256, 0)


class Catalog(UpkeepRows, RootRows, FeatureRows):
    """A store's ``catalog.sqlite``, every operation (one connection per thread and process).

    Example:
        >>> with Catalog(Layout(Path(".featbake")).ensure()) as cat:  # doctest: +SKIP
        ...     cat.locate("3f...")
    """

    def __init__(
        self,
        layout: Layout,
        *,
        timeout: float = 60.0,
        read_only: bool = False,
        rebuild: bool = False,
        fragment: Path | None = None,
    ) -> None:
        CatalogConnection.__init__(
            self, layout, timeout=timeout, read_only=read_only, rebuild=rebuild, fragment=fragment
        )

    # -- what a build asks of any catalog (a FragmentCatalog seals fragments here) ------------
    #: Writes go to this file, not to fragments (see :class:`BuildCatalog`).
    fragmented = False

    def record_fidelity(self, root: str, measured: Measured, bound: float | None) -> None:
        """Record what an int8/fp8 build measured beside ``root`` (``featbake roots``)."""
        write_fidelity(self.layout, root, measured, bound)

    def record_undecodable(self, root: str, failed: dict[str, str]) -> None:
        """Record the keys ``root``'s build could not decode (key -> reason), for datasets."""
        write_undecodable(self.layout, root, failed)

    def undecodable(self, root: str) -> dict[str, str]:
        """The keys ``root``'s last build could not decode (key -> reason); ``{}`` if none."""
        return read_undecodable(self.layout, root)

    def held(self, root: str) -> dict[str, str]:
        """The table rows of ``root`` a dataset kept back (row -> key as built; ``{}`` if
        none: store/roots.py's held record)."""
        return read_held(self.layout, root)

    def record_held(self, root: str, rows: Mapping[str, str]) -> None:
        """Record ``rows`` (row -> key as built) as the table rows ``root`` keeps but a dataset
        does not serve, replacing the record where it says otherwise (none: removed)."""
        if read_held(self.layout, root) != rows:
            write_held(self.layout, root, dict(rows))

    def flush(self) -> None:
        """Nothing to do: each shard's rows were committed as it came."""

    def finish(self) -> str | None:
        """Nothing to seal (a build's rows are committed): None."""
        return None


# Catalog queries that only ``featbake.upkeep`` runs (verify, repair, rebuild), by column name.
#
# They were raw SQL inside upkeep; here they sit with the catalog, as functions taking a
# :class:`Catalog` (or a path, for a catalog too damaged to open as one), so that upkeep reads typed
# rows and never a positional ``SELECT *``.
#: Every table the catalog needs and the columns upkeep and the catalog read from it (checked
#: against a freshly created catalog by tests/upkeep/test_verify.py).
REQUIRED_COLUMNS: dict[str, frozenset[str]] = {
    "meta": frozenset({"name", "value"}),
    "shards": frozenset(
        {"id", "name", "bytes", "items", "encoder_fp", "recipe_fp", "created", "data_bytes"}
    ),
    "features": frozenset({"key", "part", "shard_id", "dtype", "shape", "nbytes", "last_used"}),
    "encoders": frozenset(EncoderRow._fields),
    "roots": frozenset(Root.COLUMNS) - {"workdir"},  # schema 4 added it: a 3 is migrated
    "root_items": frozenset({"root", "idx", "path", "key"}),
    "hash_cache": frozenset({"path", "size", "mtime_ns", "inode", "sha256"}),
}


_NUMBER = "('real', 'integer')"


def whole_sum(total: int | float) -> int:
    """``total``, SQLite's ``sum()`` over a column of integers, checked to be one.

    SQLite's ``sum`` takes a text value for 0 and answers a float once any value it adds is not
    an integer, so a float here is the only sign that a byte count of the wrong kind was summed
    (the row's kind is checked in one scan where upkeep needs it: :func:`refuse_wrong_kinds`).

    Raises:
        TypeError: ``total`` is not an integer; the caller names the rows (``refuse_wrong_kinds``).

    >>> whole_sum(12)
    12
    """
    if not isinstance(total, int):
        raise TypeError(f"a sum of byte counts is {total!r}, not an integer")
    return total


#: Per table, a condition true of a row holding a value not of its column's kind: SQLite keeps
#: whatever a column is given (a catalog edited by hand, or damage inside a page that still
#: reads), and quick_check says nothing of it, while stats, gc and serving add, compare and
#: parse these values.
WRONG_KIND: dict[str, str] = {
    "features": (
        "typeof(shard_id) != 'integer' OR typeof(nbytes) != 'integer' OR typeof(dtype) != 'text' "
        f"OR typeof(last_used) NOT IN {_NUMBER} OR typeof(shape) != 'text' "
        "OR NOT json_valid(shape)"
    ),
    "shards": (
        "typeof(bytes) != 'integer' OR typeof(items) != 'integer' "
        f"OR typeof(data_bytes) != 'integer' OR typeof(created) NOT IN {_NUMBER}"
    ),
    "roots": (
        f"typeof(items) != 'integer' OR typeof(created) NOT IN {_NUMBER} "
        f"OR typeof(last_used) NOT IN {_NUMBER} OR typeof(recipe) != 'text' "
        "OR CASE WHEN json_valid(recipe) THEN json_type(recipe) != 'object' ELSE 1 END"
    ),
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
    return out or _wrong_kinds(conn)


def wrong_kinds(catalog: Catalog) -> list[str]:
    """``N rows of T hold values of the wrong kind`` for each table of :data:`WRONG_KIND` (one
    scan of each; empty for a sound catalog)."""
    return _wrong_kinds(catalog.conn)


def refuse_wrong_kinds(catalog: Catalog) -> None:
    """Refuse a catalog holding values of the wrong kind (what upkeep adds and compares).

    Raises:
        StoreCorrupt: some rows do, named by table; the message says to run verify --repair.
    """
    problems = wrong_kinds(catalog)
    if problems:
        raise StoreCorrupt(
            f"the catalog {catalog.path} is damaged ({'; '.join(problems)}); run `featbake "
            "verify --repair` to rebuild it from the shards and root manifests"
        )


def _wrong_kinds(conn: sqlite3.Connection) -> list[str]:
    """``N rows of T hold values of the wrong kind`` for each table of :data:`WRONG_KIND`."""
    out = []
    for table, wrong in WRONG_KIND.items():
        (n,) = conn.execute(f"SELECT count(*) FROM {table} WHERE {wrong}").fetchone()
        if n:
            out.append(f"{n} rows of {table} hold values of the wrong kind")
    return out


def catalog_file_problems(path: Path, access: Access | None = None) -> list[str]:
    """Why the catalog file at ``path`` cannot be used (empty if it can), read-only (``access``:
    :func:`read_only_access` by default; ``IMMUTABLE`` for a file nobody changes, as a bucket's
    downloaded catalog version).

    SQLite's ``quick_check`` finds damaged pages (one line for them all); a catalog that opens
    but lacks a table or a column (edited by hand, or another program's database) is named too,
    before anything runs a query on it that would fail halfway.

    Raises:
        StoreError: the disk refused a write reading it needs (a WAL catalog's shared-memory
            file on a full disk): that says nothing of the file, which must not be rebuilt.
    """
    try:
        conn = open_sqlite(path, access or read_only_access(path), timeout=10)
    except sqlite3.Error as e:
        return _unreadable(path, e)
    conn.text_factory = lambda b: b.decode("utf-8", "replace")  # damaged pages hold any bytes
    try:
        (res,) = conn.execute("PRAGMA quick_check").fetchone()
        if res != "ok":  # a line per problem, under a "*** in database main ***" head
            found = [line.strip() for line in res.splitlines() if not line.startswith("***")]
            return [f"damaged: {'; '.join(filter(None, found))[:300]}"]
        return _schema_problems(conn)
    except (sqlite3.Error, ValueError) as e:
        return _unreadable(path, e)
    finally:
        conn.close()


def _unreadable(path: Path, error: Exception) -> list[str]:
    if cannot_write(error, writing=False):
        raise unwritable_catalog(path, error) from error  # type: ignore[arg-type]
    return [f"unreadable: {error}"]


def feature_rows(catalog: Catalog) -> Iterator[FeatureRow]:
    """Every feature row, by shard."""
    return catalog.all_feature_rows()


def hash_cache_rows(cat: Catalog) -> list[HashCacheRow]:
    """Every hash-cache row as stored (inputs and cached encoder fingerprints)."""
    cols = ", ".join(HashCacheRow._fields)
    rows = cat.conn.execute(f"SELECT {cols} FROM hash_cache ORDER BY path")
    return [HashCacheRow._make(r) for r in rows]


# What builds and datasets call on a catalog, as Protocols: the catalog itself, or a stand-in.
#
# Two objects answer these calls: :class:`~featbake.store.catalog.Catalog` (the store's own
# ``catalog.sqlite``) and :class:`~featbake.store.fragment_catalog.FragmentCatalog` (a rank of
# a sharded build or any build into a bucket; a dataset or CachedEncoder on a shared filesystem
# or a bucket's tier), which reads the catalog read-only and seals what it would have written
# into fragments, catalogs themselves (store/fragments.py). Typing the callers against these
# Protocols, not a union of classes, is what lets mypy check that both answer every call with
# the catalog's own signature; ``fragmented`` says which one a caller holds.
class CatalogWrites(Protocol):
    """What every writer adds: hash-cache rows, encoders, root manifests and sealed shards."""

    @property
    def fragmented(self) -> bool:
        """True when writes are sealed into fragments (folded in by ``featbake merge``)."""
        ...

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]: ...

    def put_hashes(
        self, rows: Iterable[HashRow | tuple], *, recorded_ns: int | None = None
    ) -> None: ...

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None: ...

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None: ...

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int: ...

    def close(self) -> None: ...


class BuildCatalog(CatalogWrites, Protocol):
    """What the build pipeline calls: also which keys are stored, and dropping its root."""

    def present_keys(self, keys: Sequence[str]) -> set[str]: ...

    def others_commits(self) -> int | None: ...

    def drop_root(self, name: str) -> bool: ...

    def record_fidelity(self, root: str, measured: Measured, bound: float | None) -> None: ...

    def record_undecodable(self, root: str, failed: dict[str, str]) -> None: ...

    def forget_keys(self, keys: Sequence[str]) -> int: ...

    def flush(self) -> None: ...

    def finish(self) -> str | None: ...


class ServingStore(CatalogWrites, Protocol):
    """What serving calls: lookups, root manifests and last uses."""

    def root(self, name: str) -> Root | None: ...

    def root_items(self, name: str) -> list[RootItem]: ...

    def undecodable(self, root: str) -> dict[str, str]: ...

    def held(self, root: str) -> dict[str, str]: ...

    def record_held(self, root: str, rows: Mapping[str, str]) -> None: ...

    def hash_rows(self, paths: Sequence[str]) -> dict[str, HashCacheRow]: ...

    def locate_many(self, keys: Sequence[str]) -> dict[str, list[Location]]: ...

    def locate(self, key: str) -> list[Location]: ...

    def touch(self, keys: Iterable[str], when: float | None = None) -> None: ...


__all__ = [
    "READ_ONLY_ENV",
    "REQUIRED_COLUMNS",
    "SCHEMA_VERSION",
    "Access",
    "Catalog",
    "CatalogConnection",
    "EncoderRow",
    "FeatureRef",
    "FeatureRow",
    "FeatureTotals",
    "Location",
    "MovedRow",
    "ShardFeature",
    "ShardRow",
    "ShardUsage",
    "Transaction",
    "catalog_file_problems",
    "feature_rows",
    "hash_cache_rows",
    "upgradable",
]
