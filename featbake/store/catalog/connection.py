"""The catalog's connections: one per thread and per process, opened and dropped in one place.

SQLite connections belong to the thread that opened them, and must never be used, nor closed,
in a process that inherited them across ``fork()`` (SQLite's "How To Corrupt Your Database
Files", 2.6: the child would release or clobber the parent's POSIX locks). So a catalog keeps
one connection per thread, remembers the process that opened it, and in a forked child simply
opens a fresh one. Every connection open at a fork, whichever thread opened it, is kept
referenced in the child (:data:`INHERITED_ACROSS_FORK`): never used, never closed, never
collected (Python's sqlite3 closes a connection when it is collected, and a forked child frees
the other threads' thread-locals right after the fork).

A store that cannot be written (a read-only mount, a shared file system without write
permission) is opened read-only: ``mode=ro`` when the directory can hold SQLite's ``-shm`` file,
else ``immutable=1``. In read-only mode the caches a reader fills (the hash cache, last use,
encoder labels) are skipped, and every other write raises a :class:`StoreError`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from featbake.errors import StoreError
from featbake.perprocess import ProcessStamp
from featbake.store.catalog.schema import ensure_schema
from featbake.store.filesystem import set_journal_mode
from featbake.store.layout import Layout

#: Set to 1 to open every catalog read-only (what a read-only mount forces), e.g. to check that a
#: command only reads.
READ_ONLY_ENV = "FEATBAKE_READ_ONLY"

#: In a forked child, the connections inherited from the parent: kept so they are never closed.
INHERITED_ACROSS_FORK: list[sqlite3.Connection] = []


class Slot:
    """One thread's connection and the process that opened it (weakly tracked for fork)."""

    __slots__ = ("__weakref__", "conn", "stamp")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn: sqlite3.Connection | None = conn
        self.stamp = ProcessStamp()


_SLOTS: weakref.WeakSet[Slot] = weakref.WeakSet()
_SLOTS_LOCK = threading.Lock()
_AT_FORK: list[sqlite3.Connection] = []


def _hold_connections_before_fork() -> None:
    # Strong references taken in the parent survive into the child, where the other threads'
    # thread-locals (and so their Slots) are freed before any after-fork hook could run. The
    # lock is held across fork() so that no other thread's hold on it is copied into the child.
    _SLOTS_LOCK.acquire()
    _AT_FORK[:] = [s.conn for s in _SLOTS if s.conn is not None]


def _release_after_fork_in_parent() -> None:
    _AT_FORK.clear()
    _SLOTS_LOCK.release()


def _keep_inherited_in_child() -> None:
    INHERITED_ACROSS_FORK.extend(_AT_FORK)
    _AT_FORK.clear()
    _SLOTS_LOCK.release()


os.register_at_fork(
    before=_hold_connections_before_fork,
    after_in_parent=_release_after_fork_in_parent,
    after_in_child=_keep_inherited_in_child,
)


class Access(StrEnum):
    """How a catalog file is opened."""

    READ_WRITE = "read-write"
    READ_ONLY = "read-only"  # mode=ro: sees other writers' commits (needs a usable -shm file)
    IMMUTABLE = "immutable"  # immutable=1: a directory nobody can write, read as a snapshot


def read_only_forced() -> bool:
    """Whether ``$FEATBAKE_READ_ONLY`` says this process must not write to any store."""
    return os.environ.get(READ_ONLY_ENV, "") not in ("", "0")


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
    """``file:`` URI of ``path`` for a read-only ``access``, quoted (a ``?`` or ``#`` in a folder
    name would otherwise end the path)."""
    flag = "mode=ro&immutable=1" if access is Access.IMMUTABLE else "mode=ro"
    return f"file:{urllib.parse.quote(str(Path(path).absolute()))}?{flag}"


def open_sqlite(
    path: Path | str, access: Access = Access.READ_WRITE, *, timeout: float = 5.0
) -> sqlite3.Connection:
    """A connection to the SQLite file at ``path``: the one place featbake connects.

    ``Access.READ_ONLY`` sees other writers' commits; ``Access.IMMUTABLE`` reads a file nobody
    changes (a sealed fragment, a downloaded catalog version) with no lock at all.
    """
    if access is Access.READ_WRITE:
        return sqlite3.connect(path, timeout=timeout, isolation_level=None)
    return sqlite3.connect(
        _uri(Path(path), access), uri=True, timeout=timeout, isolation_level=None
    )


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


class CatalogConnection:
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
        self._local = threading.local()

    def _access(self) -> Access:
        if self.fragment is None:
            return access_for(self.layout, read_only=self.read_only_requested)
        return Access.IMMUTABLE if self.read_only_requested else Access.READ_WRITE

    @property
    def read_only(self) -> bool:
        return self.access is not Access.READ_WRITE

    # -- connections -------------------------------------------------------------------------
    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection in this process, opened (schema checked) on first use."""
        slot: Slot | None = getattr(self._local, "slot", None)
        if slot is not None and slot.conn is not None and not slot.stamp.stale:
            return slot.conn
        self._drop(slot)
        conn = self._connect()
        slot = Slot(conn)
        with _SLOTS_LOCK:
            _SLOTS.add(slot)
        self._local.slot = slot
        return conn

    def _drop(self, slot: Slot | None) -> None:
        """Forget this thread's connection: closed if this process opened it, else only kept."""
        self._local.slot = None
        if slot is None or slot.conn is None:
            return
        conn, slot.conn = slot.conn, None
        if not slot.stamp.stale:
            conn.close()
        else:  # inherited across fork: never use it, never close it
            INHERITED_ACROSS_FORK.append(conn)

    def _connect(self) -> sqlite3.Connection:
        if self.fragment is None and self.access is Access.READ_WRITE and not self.path.exists():
            self.layout.refuse_fresh_catalog(allow=self.rebuild)
        try:
            conn = self._open()
            # A sealed fragment is read by column name whatever schema version wrote it.
            if self.fragment is None or self.access is Access.READ_WRITE:
                ensure_schema(conn, self.path, writable=self.access is Access.READ_WRITE)
        except sqlite3.DatabaseError as e:
            raise self.unreadable(e) from e
        return conn

    def unreadable(self, error: sqlite3.DatabaseError) -> StoreError:
        """The error for a catalog SQLite refused to read, with the fix for the likely cause."""
        fix = (
            "if it is damaged, move it aside and run `featbake verify --repair` to rebuild it "
            "from the shards"
        )
        if self.read_only and os.path.exists(f"{self.path}-journal"):
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
        self._drop(getattr(self._local, "slot", None))

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Connections never cross a process boundary: the copy opens its own.
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        # Another process (or machine) may see the store differently: look again.
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
            raise StoreError(
                f"the store {self.layout.root} is read-only here (a read-only mount, no write "
                f"permission, or {READ_ONLY_ENV}=1) and this needs to write to it; run it where "
                "the store is writable"
            )
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise StoreError(f"the catalog {self.path} is locked or unwritable: {e}") from e
        txn = Transaction(conn)
        try:
            yield txn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        for fn in txn.callbacks:
            fn()
