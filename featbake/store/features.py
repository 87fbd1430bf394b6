"""Reading features by key through the catalog, and the one rule for a shard that vanished.

:func:`relocated` is that rule for every reader of stored features (the dataset,
``CachedEncoder`` and export): gc may have moved a feature since it was looked up, so it is
looked up once more; gone for good is a miss, never an error on a read path.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from featbake.errors import ShardMissing
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.store.catalog import Catalog, Location
from featbake.store.files import is_same_file
from featbake.store.layout import Layout
from featbake.store.place import RemotePlace, remote_place
from featbake.store.shard import Leases, ShardReader, VerifyMode

if TYPE_CHECKING:  # torch where tensors are made: handles and locations import none
    import torch

# == handles =======================================================================================
# A per-process LRU of open shard readers, bounded in open files and reset after fork.
#
# Several threads of a process read through one set of handles (FeatureLoader's read thread and
# the training loop's own ``ds[i]``): a reader is handed out leased (:meth:`ShardHandles.lease`)
# and an eviction retires it, so its file closes when the last read using it is done, never
# under one (see ``featbake.store.shard.ReaderState``). The LRU's changes (opens, evictions)
# take one lock; a lookup of an open reader takes none. A batch holds the readers of all its
# shards until its read is done: a batch over more shards than ``max_open`` keeps those it
# evicted open that long.
#: A bucket store's process looks for evicted files among its open readers at least this often
#: (on every fetch, and at most once a second on other opens: up to 64 ``fstat`` calls).
TEND_SECONDS = 1.0


#: Fetches of one shard a reader tries when the node's other processes keep evicting it between
#: the fetch and the open (a tier far too small for its readers).
FETCH_TRIES = 3


class ShardHandles(ProcessLocalState):
    """A per-process cache of open :class:`ShardReader` objects, bounded in open files.

    After ``fork`` (DataLoader workers) the child drops its parent's handles and opens its own.
    With a ``remote`` (a bucket store), a shard missing from the local tier is fetched first.
    """

    def __init__(
        self,
        max_open: int = 64,
        verify: VerifyMode | str = VerifyMode.FIRST,
        remote: RemotePlace | None = None,
    ) -> None:
        self.max_open = max_open
        self.remote = remote  # a bucket store's place (its shards fetched on first use)
        self._tended = 0.0
        self.verify = VerifyMode.parse(verify)  # a ConfigError now, not at the first read

    @classmethod
    def of(
        cls, layout: Layout, max_open: int = 64, verify: VerifyMode | str = VerifyMode.FIRST
    ) -> ShardHandles:
        """The handles of the store ``layout``: its shards fetched from its place first where
        that is a bucket."""
        return cls(max_open=max_open, verify=verify, remote=remote_place(layout))

    @staticmethod
    def _close_inherited(readers: OrderedDict[Path, ShardReader]) -> None:
        # The parent's readers are its bookkeeping, but the fds are this process's own
        # copies: close them, or each forked worker keeps up to max_open files open. Closed
        # outright: no thread of this process reads them (the parent's threads are not here).
        for r in readers.values():
            r.close()

    #: This process's open readers by path, least recently used first.
    _readers: ProcessLocal[OrderedDict[Path, ShardReader]] = ProcessLocal(
        lambda self: OrderedDict(), on_inherited=_close_inherited, lock=True
    )
    #: Taken by every change of ``_readers`` (re-entrant: a bucket's fetch calls back into
    #: ``_close_evicted``); this process's own, so a fork never leaves it held.
    _lock: ProcessLocal[threading.RLock] = ProcessLocal(lambda self: threading.RLock(), lock=True)

    def lease(self, path: Path, held: Leases) -> ShardReader:
        """An open reader for ``path``, leased into ``held`` (open until ``held`` ends, even
        if another thread evicts it meanwhile), opening (and retiring the least recent) as
        needed.

        Raises:
            ShardMissing: the shard is gone (from the bucket too).
        """
        reader = self._readers.get(path)
        if reader is not None and held.take(reader):  # no lock: a lease fails once closed
            self.touch(path)
            return reader
        with self._lock:
            readers = self._readers
            reader = readers.get(path)
            if reader is not None and held.take(reader):  # another thread opened it meanwhile
                readers.move_to_end(path)
                return reader
            reader = self._open(path)
            held.require(reader)
            readers[path] = reader
            while len(readers) > self.max_open:
                _, old = readers.popitem(last=False)
                old.retire()
            return reader

    def get(self, path: Path) -> ShardReader:
        """An open reader for ``path`` (see :meth:`lease`), not leased: for looking at its
        header; a read of it raises ``ReaderClosed`` if another thread evicted it first."""
        with Leases() as held:
            return self.lease(path, held)

    def touch(self, path: Path) -> None:
        """Mark ``path``'s reader as just used (a no-op once another thread evicted it)."""
        with contextlib.suppress(KeyError):
            self._readers.move_to_end(path)

    def _open(self, path: Path) -> ShardReader:
        """A new reader of ``path``; from a bucket store, fetched into its tier when missing.

        Raises:
            ShardMissing: the shard is gone (from the bucket too).
        """
        if self.remote is None:
            return ShardReader(path, verify=self.verify)
        try:
            reader = ShardReader(path, verify=self.verify)
        except ShardMissing:
            name = path.name.removesuffix(".safetensors")
            ranged = self.remote.ranged_reader(name, path, self.verify)
            if ranged is not None:
                return ranged
            reader = self._fetched(name, path)
        else:
            if time.monotonic() - self._tended > TEND_SECONDS:  # another process's evictions
                self._tend_tier(self.remote)
        self.remote.opened(path)
        return reader

    def _fetched(self, name: str, path: Path) -> ShardReader:
        """A reader of shard ``name`` fetched into the tier. Another process of the node may
        evict it between the fetch and the open (the tier is shared): fetched again then, not
        taken for a shard gone from the store.

        Raises:
            ShardMissing: the bucket has no such shard, or it kept vanishing.
        """
        assert self.remote is not None
        for attempt in range(FETCH_TRIES):
            self._tend_tier(self.remote)  # before the fetch evicts: see _tend_tier
            if self.remote.fetch_shard(name, self._close_evicted) is None:
                raise ShardMissing(f"shard {name} is gone from {self.remote} (deleted by gc)")
            try:
                return ShardReader(path, verify=self.verify)
            except ShardMissing:
                if attempt == FETCH_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _tend_tier(self, remote: RemotePlace) -> None:
        """Before a bucket store's tier may evict for a new shard: close the readers of files it
        evicted (an open file keeps its disk space, beyond the tier's budget), and stamp the
        rest as used (a reader held open all epoch reads its shard, unseen by file times), in
        the order this process used them."""
        self._tended = time.monotonic()
        self._close_evicted()
        # Least recently used first, 1 us apart: file times come from a coarse clock, so one
        # stamp for all would tie them, and ties evict by name (the current shards too).
        # (What RemotePlace.opened does, with the time given.)
        now = time.time_ns() - len(self._readers) * 1000
        for k, path in enumerate(self._readers):
            with contextlib.suppress(OSError):  # a ranged reader's shard has no file here
                os.utime(path, ns=(now + k * 1000,) * 2)

    def _close_evicted(self) -> None:
        """Close the readers of files the tier unlinked (their space is freed only then)."""
        with self._lock:
            for path, reader in list(self._readers.items()):
                if reader.unlinked():
                    del self._readers[path]
                    reader.retire()

    @property
    def open_readers(self) -> OrderedDict[Path, ShardReader]:
        """The open readers by path, least recently used first. Read-only: hit paths check
        a remembered reader with one lookup and, when they switch shards, keep the LRU order
        with :meth:`touch` (another thread may have evicted it meanwhile)."""
        return self._readers

    def forget(self, path: Path) -> None:
        """Close and drop the handle of a shard that moved or vanished (once no read uses it)."""
        with self._lock:
            reader = self._readers.pop(path, None)
        if reader is not None:
            reader.retire()

    def forget_replaced(self) -> int:
        """Close and drop the handles of shards whose path no longer holds the file open here
        (quarantined by ``featbake verify --repair``, or removed); how many. An open file keeps
        its bytes: a shard damaged in place after its items' first check, then quarantined,
        was read on from the open handle for the rest of the process (with ``verify="first"``
        nothing checks those bytes again). Its items are then looked up again, as after gc."""
        with self._lock:
            paths = list(self._readers)
        return sum(self.forget_if_replaced(path) for path in paths)

    def forget_if_replaced(self, path: Path) -> bool:
        """Whether ``path`` no longer holds the shard file open here (or, none open, holds
        nothing), its handle then closed and dropped: a read that found it damaged, or a
        repair's quarantine, looks its items up again rather than refusing them with the
        repair's own advice. Never on a bucket's tier: no repair quarantines there, and a
        shard read by ranges has no file (its evictions: :meth:`_tend_tier`)."""
        if self.remote is not None:
            return False
        with self._lock:
            reader = self._readers.get(path)
        replaced = not path.exists() if reader is None else not is_same_file(path, reader.fd)
        if replaced:
            self.forget(path)
        return replaced

    def close(self) -> None:
        """Close every reader, each once no read uses it."""
        with self._lock:
            while self._readers:
                _, r = self._readers.popitem()
                r.retire()

    def __iter__(self) -> Iterator[Path]:
        return iter(self._readers)


# == features ======================================================================================
V = TypeVar("V")

#: One key's stored tensors by output part ("" for a single tensor).
Parts = dict[str, "torch.Tensor"]


def read_locations(
    locations: Sequence[Location], open_shard: Callable[[str], ShardReader]
) -> dict[str, torch.Tensor]:
    """Each located part, read (and checked as its reader's mode says) by output part.

    ``open_shard`` gives the open reader of a shard named by content.

    Raises:
        ShardMissing: a shard the locations name is gone.
        StoreCorrupt: the bytes fail their checksum (never silent garbage).
    """
    return {loc.part: open_shard(loc.shard).read(loc.tensor) for loc in locations}


def relocated(
    key: str,
    locate: Callable[[str], list[Location]],
    read: Callable[[list[Location]], V],
) -> tuple[list[Location], V] | None:
    """``key`` looked up again and read where the store now puts it; None: a miss.

    The one "a shard vanished" rule of every read, called once a read found its shard gone
    (after dropping its handle): gc may have moved the feature (compaction commits the new
    location before it deletes the old file), so it is looked up once more with ``locate``
    and read with ``read``. A feature gc dropped, or whose shard is gone although the catalog
    still names it (deleted by hand, a partial copy of the store), is a miss, never an error
    on a read path. Corrupt bytes still raise :class:`StoreCorrupt`.
    """
    fresh = locate(key)
    if not fresh:
        return None
    try:
        return fresh, read(fresh)
    except ShardMissing:
        return None


class FeatureReader:
    """Reads stored features of one store; one instance per process (reconnects after fork).

    Example:
        >>> reader = FeatureReader(Layout(Path(".featbake")))  # doctest: +SKIP
        >>> reader.get(key)  # {"": tensor} or {"hidden": ..., "pooled": ...}  # doctest: +SKIP
    """

    def __init__(
        self,
        layout: Layout,
        *,
        max_open: int = 64,
        verify: VerifyMode | str = VerifyMode.FIRST,
        read_only: bool = False,
    ) -> None:
        self.layout = layout
        self.catalog = Catalog(layout, read_only=read_only)
        self.handles = ShardHandles.of(layout, max_open, verify)

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored for ``key`` by output part, or None if the key is not stored.

        Raises:
            StoreCorrupt: the bytes fail their checksum (never silent garbage).
        """
        return self.get_located(key, self.catalog.locate(key))

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Like :meth:`get` for many keys in one catalog query; absent keys are left out."""
        located = self.catalog.locate_many(keys)
        out = {}
        for key in keys:
            got = self.get_located(key, located.get(key, []))
            if got is not None:
                out[key] = got
        return out

    def get_located(self, key: str, locations: list[Location]) -> dict[str, torch.Tensor] | None:
        """Read ``key`` from looked-up ``locations``; None when the store no longer has it
        (a shard that vanished is followed by :func:`relocated`).

        Raises:
            StoreCorrupt: the bytes fail their checksum.
        """
        if not locations:
            return None
        try:
            return self._read(locations)
        except ShardMissing:
            for loc in locations:
                self.handles.forget(self.layout.shard_path(loc.shard))
        got = relocated(key, self.catalog.locate, self._read)
        return got[1] if got is not None else None

    def _read(self, locations: Sequence[Location]) -> dict[str, torch.Tensor]:
        with Leases() as held:
            return read_locations(
                locations, lambda shard: self.handles.lease(self.layout.shard_path(shard), held)
            )

    def close(self) -> None:
        self.handles.close()
        self.catalog.close()
