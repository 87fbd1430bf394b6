"""Everything one process opens to serve a dataset, made on first use and never shared.

The state holds the catalog connection, the open shards (an LRU of handles), the RAM tier, the
live encoder once loaded, the write-back, the last-use queue, and each item's location once it
was read. It never crosses ``fork`` or pickling: see :mod:`featbake.serve.state` for the rule.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import multiprocessing.util as mp_util
import os
import queue
import sqlite3
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from featbake.encode.encoders import LoadedEncoder
from featbake.errors import StoreError
from featbake.lru import ByteLRU, CacheInfo
from featbake.process import (
    PerProcess,
    ProcessStamp,
    after_critical_section,
    fork_safe_lock,
    in_critical_section,
)
from featbake.store.catalog import Access, ServingStore, access_for
from featbake.store.features import ShardHandles
from featbake.store.fragment_catalog import open_serving_catalog
from featbake.store.layout import Layout
from featbake.store.shard import Leases, SealedShard, ShardReader, ShardWriter

# == process =======================================================================================
# Per-process serving state, and the one rule for "is this state stale after ``fork``?".
#
# Everything a dataset opens (shard handles, the catalog connection, the RAM tier, the live
# encoder, the write-back shard) belongs to the process that opened it. DataLoader workers are
# forked from the process that made the dataset, and a forked child must neither use nor save its
# parent's state: its file descriptors are copies, its pending write-back is the parent's to seal.
#
# The rule is featbake's one rule (:mod:`featbake.process`): the dataset holds this state in a
# :class:`~featbake.process.ProcessLocal`, stamped with the pid that made it; a forked child's
# first use closes its copies of the parent's shard files (:meth:`ProcessState.drop_inherited`)
# and makes its own. What a finalizer saves (write-back, last uses) carries a
# :class:`~featbake.process.ProcessStamp`, so a child never seals its parent's shard.
Clock = Callable[[], float]


def store_read_only(layout: Layout) -> bool:
    """True when this process cannot write ``layout``'s catalog: a read-only mount, no write
    permission, or ``$FEATBAKE_READ_ONLY=1``. A dataset then serves the store as it is."""
    return access_for(layout) is not Access.READ_WRITE


def read_only_misses(layout: Layout, misses: int) -> str:
    """The warning of a dataset over a read-only store that will encode ``misses`` items."""
    return (
        f"featbake: the store {layout.root} is read-only here, and {misses} item(s) are not in "
        "it: they are encoded live at every read and not stored; bake them with `featbake "
        "build` where the store is writable, or pass on_miss='error'"
    )


@dataclass(frozen=True)
class ServeStats:
    """What one process's dataset did (DataLoader workers each count their own).

    Attributes:
        ram: the RAM LRU's counters (hits, misses, evictions, bytes, budget).
        store_reads: items read from shards.
        encoded: items encoded live (misses).
        written: items written back to this process's shards (sealed or pending).
    """

    ram: CacheInfo
    store_reads: int
    encoded: int
    written: int

    @property
    def hits(self) -> int:
        return self.ram.hits

    @property
    def misses(self) -> int:
        return self.ram.misses

    @property
    def evictions(self) -> int:
        return self.ram.evictions

    @property
    def bytes(self) -> int:
        return self.ram.bytes

    @property
    def items(self) -> int:
        return self.ram.items


class SharedFlags:
    """Per-item flags in anonymous shared memory that forked workers inherit.

    Byte layout of a mapping for ``n`` items::

        [0, n)            verified: uint8, the item's checksum was checked in this dataset
        [n, 2n)           touched:  bool, the item's last use was recorded since ``epoch``
        [align8(2n), +8)  epoch:    float64 wall time when ``touched`` was last cleared
        [+8, +1)          workers:  uint8, 1 once a DataLoader worker used this dataset

    Workers started afresh each epoch then neither check every checksum again nor record every
    key's last use again; and the main process knows its own counters are not the workers'.
    """

    def __init__(self, buffer: Any, n: int) -> None:
        self.buffer = buffer
        self.verified = np.frombuffer(buffer, dtype=np.uint8, count=n)
        self.touched = np.frombuffer(buffer, dtype=np.bool_, count=n, offset=n)
        self.epoch = np.frombuffer(buffer, dtype=np.float64, count=1, offset=self.epoch_offset(n))
        self.workers = np.frombuffer(
            buffer, dtype=np.uint8, count=1, offset=self.epoch_offset(n) + 8
        )

    @staticmethod
    def epoch_offset(n: int) -> int:
        return (2 * n + 7) // 8 * 8

    @classmethod
    def nbytes(cls, n: int) -> int:
        return cls.epoch_offset(n) + 9

    @classmethod
    def allocate(cls, n: int) -> mmap.mmap:
        """A zeroed anonymous mapping for ``n`` items, shared with children forked later."""
        return mmap.mmap(-1, cls.nbytes(n))


#: RAM-tier entries at least this big get their own anonymous mapping (see mapped_empty).
MAP_MIN_BYTES = 64 * 1024


def mapped_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in its own anonymous memory mapping.

    Entries of the RAM tier come and go in every size; from the heap, their evictions would leave
    holes that malloc keeps (the worker's memory creeps above the budget). A mapping of its own
    goes back to the OS the moment the entry is evicted and no batch still uses it.
    """
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes < MAP_MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)


def kept_copy(value: Any) -> Any:
    """A copy of ``value`` (a tensor, or a dict of parts) for the RAM tier to keep, each in
    its own mapping (:func:`mapped_empty`): what was served from ``value`` stays the caller's."""
    if isinstance(value, Mapping):
        return {name: kept_copy(t) for name, t in value.items()}
    return mapped_empty(tuple(value.shape), value.dtype).copy_(value)


def resident_bytes(value: Any) -> int:
    """What a RAM-tier entry really occupies: mapped entries take whole pages."""
    if isinstance(value, Mapping):
        return sum(resident_bytes(v) for v in value.values())
    nbytes = value.nbytes
    if nbytes < MAP_MIN_BYTES:
        return nbytes
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def ram_budget_for_process(total: int) -> int:
    """The RAM tier's budget in this process: ``total`` split evenly between DataLoader workers.

    Splitting keeps the whole pipeline's memory at ``total`` plus a fixed overhead, whatever
    ``num_workers`` is (a per-worker budget would multiply it).

    Example:
        >>> ram_budget_for_process(1 << 30)  # in the main process
        1073741824
    """
    info = get_worker_info()
    return total if info is None else total // max(1, info.num_workers)


def ram_tier(total: int) -> ByteLRU[int, Any]:
    """This process's RAM tier: its share of ``total``, sized as entries really occupy memory."""
    return ByteLRU(ram_budget_for_process(total), getsizeof=resident_bytes)


def wall_clock() -> float:
    """Seconds since the epoch: last-use times are compared across processes and runs."""
    return time.time()


# == lastuse =======================================================================================
# Last-use times of served items, recorded in the catalog in coarse batches.
#
# gc's least-recently-used eviction needs days, not milliseconds, so a process records each key's
# use at most once per :data:`TOUCH_REPEAT_SECONDS` (shared between forked workers through
# :class:`~featbake.serve.state.SharedFlags`) and writes the queue at most every
# :data:`TOUCH_FLUSH_SECONDS` or :data:`TOUCH_FLUSH_ITEMS`: never one write per read.
#
# On a shared filesystem each flush seals a fragment (store/fragments.py) instead of a
# catalog transaction; there the queue is written every :data:`TOUCH_FLUSH_SECONDS_SHARED`, so
# many ranks and workers leave a few small files an hour each, not hundreds, until a merge.
TOUCH_FLUSH_SECONDS = 30.0
TOUCH_FLUSH_SECONDS_SHARED = 600.0
TOUCH_REPEAT_SECONDS = 3600.0
TOUCH_FLUSH_ITEMS = 50_000


class LastUse:
    """Items used in this process whose last use the catalog has not been told yet.

    Args:
        keys: the dataset's keys by item (``S64`` bytes).
        flags: the shared per-item flags (``touched`` and its ``epoch``).
        catalog: where to write, from whichever thread flushes (one connection per thread).
        clock: monotonic seconds (when to flush).
        wall: seconds since the epoch (when the shared ``touched`` flags expire).
    """

    def __init__(
        self,
        keys: np.ndarray,
        flags: SharedFlags,
        catalog: ServingStore,
        clock: Clock,
        wall: Clock,
    ) -> None:
        self.keys = keys
        self.flags = flags
        self.catalog = catalog
        self.clock = clock
        self.wall = wall
        self.queue: list[int] = []  # appended on the hit path: one list, never replaced
        self.last_flush = clock()
        self.flush_seconds = (
            TOUCH_FLUSH_SECONDS_SHARED if catalog.fragmented else TOUCH_FLUSH_SECONDS
        )
        if not flags.epoch[0]:
            flags.epoch[0] = wall()

    def due(self, now: float) -> bool:
        """True when the queue is long enough, or old enough, to be written."""
        queue = self.queue
        return len(queue) >= TOUCH_FLUSH_ITEMS or (
            bool(queue) and now - self.last_flush >= self.flush_seconds
        )

    def flush(self) -> None:
        """Write the queued items' last use now (a hint: a failure never fails a read)."""
        self.last_flush = self.clock()
        if not self.queue:
            return
        queue = self.queue[:]
        self.queue.clear()
        with contextlib.suppress(Exception):
            self.catalog.touch(self.keys[i].decode() for i in queue)

    def expire_shared(self) -> None:
        """Forget which items were recorded once the shared epoch is an hour old."""
        wall = self.wall()
        if wall - self.flags.epoch[0] >= TOUCH_REPEAT_SECONDS:
            self.flags.touched[:] = False
            self.flags.epoch[0] = wall


# == writeback =====================================================================================
# The one write-back object: features encoded while serving, on their way to this process's
# own shards, under one sealing policy for the dataset and :class:`CachedEncoder` alike.
#
# A pending feature is sealed into a shard when the pending shard is full (bytes or items) or
# when its oldest feature is :data:`WRITEBACK_SECONDS` old, so a killed process loses little.
# Sealing writes the shard, then commits its catalog rows (the caller's ``publish`` may add more
# to that, e.g. a root), then tells the caller (``on_sealed``). On a shared filesystem the
# "catalog" is the read-only stand-in of store/fragment_catalog.py, which seals a fragment naming
# the shard instead.
#
# Write-back is an optimisation: it never fails a read. When a shard cannot be written or
# published (a full disk, an unwritable store), the pending features are dropped, encoded again
# when next needed, and the failure is reported once per process as a warning.
#: Write-back shards are sealed at this size, item count or age, so a killed worker loses little.
WRITEBACK_BYTES = 64 * 1024 * 1024
WRITEBACK_ITEMS = 256
WRITEBACK_SECONDS = 5.0

#: What a failed seal may raise: the store's own errors, the OS's, and SQLite's.
_WRITE_FAILURES = (StoreError, OSError, sqlite3.Error)

PartsIn = Mapping[str, torch.Tensor]
Publish = Callable[[ServingStore, SealedShard], None]


@dataclass(frozen=True)
class SealPolicy:
    """When a pending write-back shard is sealed: whichever limit is reached first."""

    max_bytes: int = WRITEBACK_BYTES
    max_items: int = WRITEBACK_ITEMS
    max_seconds: float = WRITEBACK_SECONDS


def add_rows(catalog: ServingStore, shard: SealedShard) -> None:
    """The default publication: the shard's feature rows, nothing else."""
    catalog.add_shard(shard)


#: Every write-back of this process: what one reader wrote back and has not sealed yet, the
#: others over the same store read at once (issue 18 item 4: two CachedEncoders over one store
#: saw each other's features only after flush()).
_LIVE: weakref.WeakSet[WriteBack] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def pending_in_process(own: WriteBack, key: str) -> PartsIn | None:
    """``key``'s parts held, not sealed yet, by ``own`` or any other write-back of this process
    over the same store; None when none holds it."""
    parts = own.get(key)
    if parts is not None:
        return parts
    with _LIVE_LOCK:
        others = [w for w in _LIVE if w is not own and w.store_id == own.store_id]
    for w in others:
        if not w.lifetime.stale and (parts := w.get(key)) is not None:
            return parts
    return None


def owned_parts(parts: PartsIn) -> dict[str, torch.Tensor]:
    """A copy of ``parts`` on the host in storage of its own (C order, as a shard writes it).

    A write-back holds features until it seals them, and the same tensors were (or will be)
    served: a training loop that normalises its item in place (``x -= mean``) must change
    neither the bytes sealed under the item's key nor what a later read of it serves.
    """
    return {
        name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for name, t in parts.items()
    }


class WriteBack:
    """Features encoded in this process, written to shards of its own and published.

    It holds no reference to its owner (a dataset or a CachedEncoder), so a finalizer that seals
    it never keeps a dropped owner alive. Thread-safe: adds and seals take one lock.

    Args:
        layout: the store.
        recipe_fp: the recipe fingerprint of every feature written.
        publish: commits a sealed shard to the catalog (default: its feature rows).
        on_sealed: told of each shard once it is published (e.g. to point an index at it).
        clock: monotonic seconds; tests pass a fake one to age pending features at will.
        policy: the sealing limits.
        what: how warnings name what is written (``"written-back features"``).
        catalog: the owner's catalog (default: one of its own, a FragmentCatalog where
            serving writes fragments), used from whichever thread seals.
    """

    def __init__(
        self,
        layout: Layout,
        recipe_fp: str,
        *,
        publish: Publish = add_rows,
        on_sealed: Callable[[SealedShard], None] | None = None,
        clock: Clock = time.monotonic,
        policy: SealPolicy = SealPolicy(),
        what: str = "written-back features",
        catalog: ServingStore | None = None,
    ) -> None:
        self.layout = layout
        self.recipe_fp = recipe_fp
        self.publish = publish
        self.on_sealed = on_sealed
        self.clock = clock
        self.policy = policy
        self.what = what
        self.lifetime = ProcessStamp()
        self.lock = threading.Lock()
        #: key -> parts of every feature added and not yet sealed (readable before sealing).
        self.pending: dict[str, PartsIn] = {}
        #: clock time of the oldest pending feature; 0.0 while nothing is pending.
        self.first_pending = 0.0
        self.written = 0
        self.failures = 0
        self._writer: ShardWriter | None = None
        self._own_catalog = catalog is None
        # On a shared filesystem the write-back's own catalog is a FragmentCatalog (a
        # CachedEncoder's; a dataset passes its own): SQLite is never written from many hosts.
        self._catalog = catalog if catalog is not None else open_serving_catalog(layout)
        self.store_id = os.path.realpath(layout.root)
        _SEALER.get()  # the thread a finalizer run inside a critical section hands it to
        with _LIVE_LOCK:
            _LIVE.add(self)

    def add(self, encoder_fp: str, key: str, parts: PartsIn, owned: bool = False) -> None:
        """Queue one feature; seals when the shard is full or its oldest feature is due.

        Only in the process that made it: its owner holds it in a ProcessLocal, so a forked
        child makes a write-back of its own. ``owned``: the caller hands over host tensors
        nothing else holds or serves (a miss served as a copy), kept as they are, not copied."""
        with self.lock:
            if key in self.pending:
                return
            writer = self._writer_for(encoder_fp)
            if writer is None:
                return
            if not owned:  # the caller may hand out (and edit) what it passed
                parts = owned_parts(parts)
            self.pending[key] = parts
            self.written += 1
            if not self.first_pending:
                self.first_pending = self.clock()
            try:
                writer.add(key, parts)  # seals (and publishes) when full
            except _WRITE_FAILURES as e:
                self._drop(e)
        self.seal_if_due()

    def get(self, key: str) -> PartsIn | None:
        """A copy of a pending feature's parts (not yet sealed), or None: what is read here is
        served, and a caller's in-place edit of it must not reach the shard this seals."""
        parts = self.pending.get(key)
        return None if parts is None else owned_parts(parts)

    def holds(self, key: str) -> bool:
        """Whether ``key`` is pending here (added, not sealed yet)."""
        return key in self.pending

    @property
    def due(self) -> bool:
        """True when the oldest pending feature is older than the policy allows."""
        first = self.first_pending
        return bool(first) and self.clock() - first >= self.policy.max_seconds

    def seal_if_due(self) -> None:
        if self.due:
            self.seal()

    def seal(self) -> SealedShard | None:
        """Seal what is pending now; None when nothing was (or it could not be) sealed."""
        if self.lifetime.stale:
            return None  # a forked copy of another process's write-back: that process seals it
        with self.lock:
            if self._writer is None:
                return None
            try:
                return self._writer.seal()
            except _WRITE_FAILURES as e:
                self._drop(e)
                return None

    def close(self) -> None:
        """Seal what is pending and close the catalog connection (once, by its own process)."""
        if self.lifetime.stale:
            return  # a forked copy of another process's write-back: that process saves it
        self.seal()
        if self._own_catalog:
            self._catalog.close()

    # -- internals ----------------------------------------------------------------------------
    def _writer_for(self, encoder_fp: str) -> ShardWriter | None:
        writer = self._writer
        if writer is not None and writer.encoder_fp == encoder_fp:
            return writer
        if writer is not None:  # another encoder: its features go to a shard of their own
            try:
                writer.seal()
            except _WRITE_FAILURES as e:
                self._drop(e)
        self._writer = ShardWriter(
            self.layout,
            encoder_fp,
            self.recipe_fp,
            target_bytes=self.policy.max_bytes,
            max_items=self.policy.max_items,
            on_seal=self._published,
        )
        return self._writer

    def _published(self, shard: SealedShard) -> None:
        self.publish(self._catalog, shard)
        for entry in shard.entries:
            self.pending.pop(entry.key, None)
        self.first_pending = self.clock() if self.pending else 0.0
        if self.on_sealed is not None:
            self.on_sealed(shard)

    def _drop(self, error: Exception) -> None:
        """Forget what is pending after a failed seal; warn the first time only."""
        self.pending.clear()
        self.first_pending = 0.0
        self.failures += 1
        if self.failures == 1:
            warnings.warn(
                f"featbake: could not store {self.what} ({error}); they were dropped and are "
                "encoded again when next needed (reads of stored features are unaffected)",
                stacklevel=3,
            )


# == state =========================================================================================
class Located(NamedTuple):
    """Where one item's single tensor lies, remembered on its first read in this process.

    Valid while ``reader`` is still the open handle of ``path`` here and the index still puts
    the item in shard ``sid`` (gc may move it): the hit path then costs one list index and one
    pread instead of key decoding and header lookups. ``featbake.serve.reads.Reads.located``
    is the one check, and leases ``reader`` (another thread may have evicted it since: the
    lease then fails and the item is planned from its shard's header again).
    """

    sid: int
    path: Path
    reader: ShardReader
    offset: int  # absolute file offset of the tensor's bytes
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Saver:
    """What must be saved even when a dataset is dropped: its write-back and last-use times.

    It holds no reference to the dataset or its process state, so the finalizer that saves it
    (at process exit, or when the state is collected) never keeps a dropped dataset alive.
    """

    def __init__(self, writeback: WriteBack, lastuse: LastUse, catalog: ServingStore) -> None:
        self.lifetime = ProcessStamp()
        self.writeback = writeback
        self.lastuse = lastuse
        self.catalog = catalog
        self.closed = False

    def flush(self) -> None:
        self.writeback.seal()
        self.lastuse.flush()

    def close(self) -> None:
        """Seal, record last uses and close the catalog, once, in the process that made it."""
        if self.closed or self.lifetime.stale:
            return  # a forked copy of the parent's: the parent saves its own
        self.closed = True
        self.flush()
        self.writeback.close()
        self.catalog.close()


def save_at_exit(saver: Saver) -> None:
    """The finalizer of a process's state (at exit, or when the state is collected): saves it
    now, or hands it to the sealing thread (:func:`finalized`)."""
    finalized(saver.close)


def close_at_exit(writeback: WriteBack) -> None:
    """The finalizer of a ``CachedEncoder``'s write-back: as :func:`save_at_exit`."""
    finalized(writeback.close)


def _warned(work: Callable[[], None]) -> None:
    """Run a finalizer's ``work``; a failure is a warning (no caller is left to raise to)."""
    try:
        work()
    except Exception as e:
        warnings.warn(f"featbake: could not save written-back features: {e}", stacklevel=1)


# == the sealing thread ============================================================================
# The cyclic collector runs a finalizer on whatever thread allocates, under whatever that thread
# holds. A seal takes the store's write.lock, the tier's and the fragments' locks (``flock`` on
# a new descriptor: it waits for ever on a lock its own thread holds) and commits on a
# connection of its own (its ``BEGIN IMMEDIATE`` waits the whole busy timeout on its own
# thread's transaction). So where the thread is inside one of those
# (:func:`featbake.process.in_critical_section`, kept by ``store.locks.locked`` and the
# catalog's transactions), a finalizer hands its work to this process's one sealing thread (a
# ``SimpleQueue.put`` under a lock held for nothing else) and returns; everywhere else it works
# inline, as before, so a dropped dataset's rows are in the store when its collection returns.
#
# The handed-over work is done before the process exits: the thread is drained and joined by a
# multiprocessing Finalize run after the saves (at exit, and as a DataLoader worker ends, before
# its ``os._exit``). From the moment the drain begins the thread takes nothing more, and what a
# finalizer would hand over then (one the collector runs in an exit hook after the drain, in a
# multiprocessing finalizer of lower priority, on the sealing thread as it finishes, or on a
# thread still running) is done by the thread that ran it, as it leaves its outermost critical
# section (:func:`featbake.process.after_critical_section`), where it holds none of those locks.
# A sealer first made once the process is exiting (its drain would never run) starts stopped.
# Never lost: the check of the stop and the put are one step under the sealer's lock, so a
# hand-over either reaches the queue before the stop (the thread does it before it reads the
# stop) or is refused and left to the section's end.
# Left: work left by a daemon thread that has not left its section when the interpreter stops
# daemon threads (or a worker calls ``os._exit``) is lost with that thread's own work.
class Sealer:
    """This process's sealing thread (``featbake-seal``) and its queue of handed-over work."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: Held only to read ``stopped`` and put (:meth:`take`), or to set it (:meth:`drain`):
        #: reentrant and held across ``fork``, as a finalizer may run on its holder.
        self.lock = fork_safe_lock()
        #: True once the drain began (or the process was already exiting): nothing is taken.
        self.stopped = _exiting()
        self.thread = threading.Thread(target=self._run, name="featbake-seal", daemon=True)
        if not self.stopped:
            self.thread.start()
            mp_util.Finalize(None, self.drain, exitpriority=0)  # after the saves (priority 10)

    def _run(self) -> None:
        while (work := self.queue.get()) is not None:
            _warned(work)

    def take(self, work: Callable[[], None]) -> bool:
        """Queue ``work`` for the thread; False once the drain began (the caller does it)."""
        with self.lock:
            if self.stopped:
                return False
            self.queue.put(work)
            return True

    def drain(self) -> None:
        """Do everything handed over, then stop the thread (at exit). Nothing is taken once
        this began, so the thread has done all that was taken when it reads the stop."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        self.queue.put(None)
        self.thread.join()

    def wait(self) -> None:
        """Return once everything handed over before this call is done (at once on the
        sealing thread itself, or where this thread is inside a critical section, which that
        work may wait on, or once the drain began, which does it)."""
        if in_critical_section() or threading.current_thread() is self.thread:
            return
        done = threading.Event()
        if self.take(done.set):
            done.wait()


def _exiting() -> bool:
    """Whether this process began to exit: multiprocessing ran (or runs) its exit finalizers,
    so a drain registered now would never run, or the interpreter is finalizing."""
    return bool(getattr(mp_util, "_exiting", False)) or sys.is_finalizing()


#: Made with this process's first write-back (never inside a finalizer, which only puts); a
#: forked child makes its own, as its first write-back does.
_SEALER: PerProcess[Sealer] = PerProcess(Sealer, lock=True)


def finalized(work: Callable[[], None]) -> None:
    """Run a finalizer's ``work`` now, or, on a thread inside featbake's critical section
    (a store or tier lock held, a catalog transaction open), hand it to the sealing thread and
    return at once; once that thread has stopped (at exit), leave it to this thread, to be done
    as it leaves its outermost critical section. A failure is a warning either way."""
    if not in_critical_section():
        _warned(work)
        return
    sealer = _SEALER.peek()
    if sealer is None or not sealer.take(work):
        after_critical_section(functools.partial(_warned, work))


def handed_over_sealed() -> None:
    """Wait until every seal a finalizer handed over in this process so far is done (a
    ``flush`` waits for them too, so that what it returns to finds them stored)."""
    sealer = _SEALER.peek()
    if sealer is not None:
        sealer.wait()


#: What cache_info() in the main process says once DataLoader workers served the dataset.
WORKERS_COUNT_APART = (
    "cache_info() here counts this process only: DataLoader workers count (and keep their RAM "
    "cache) in their own processes, so after an epoch with workers these numbers are not the "
    "epoch's; call ds.cache_info() inside a worker (e.g. in worker_init_fn or the training "
    "loop's collate_fn), or read with num_workers=0 / featbake.FeatureLoader, which count here"
)


def folder_state(folder: Path) -> tuple[int, int] | None:
    """``folder``'s inode and modification time, None while there is none: what changes when a
    file is moved into it."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class ProcessState:
    """One process's serving state for one dataset.

    Args:
        n: items in the dataset.
        shared: the dataset's shared flag mapping (None in a spawned copy: keep our own).
        writeback: this process's write-back.
        catalog: this process's catalog (used from any thread).
        keys: the dataset's keys (for last-use records).
        ram_total: the RAM tier's budget for the whole pipeline.
        verify: ``"first"``, ``"always"`` or ``"never"``.
        max_open_shards: open shard files kept here.
        clock: monotonic seconds (write-back age, last-use flushes).
    """

    def __init__(  # noqa: PLR0913 - one process's state from the dataset's settings
        self,
        n: int,
        shared: Any,
        writeback: WriteBack,
        catalog: ServingStore,
        keys: np.ndarray,
        ram_total: int,
        verify: str,
        max_open_shards: int,
        clock: Clock = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.writeback = writeback
        self.handles = ShardHandles.of(writeback.layout, max_open_shards, verify)
        self.open_readers = self.handles.open_readers  # checked by the hit path
        self.last_path: Path | None = None
        self.lru = ram_tier(ram_total)
        self.use_lru = self.lru.max_bytes > 0
        self.encoder: LoadedEncoder | None = None
        self.pending_idx: dict[str, list[int]] = {}  # key -> items, written back, not sealed
        self.flags = SharedFlags(shared if shared is not None else SharedFlags.allocate(n), n)
        #: A DataLoader worker's state: its items are read into shared memory (see Reads).
        self.in_worker = get_worker_info() is not None
        if self.in_worker:
            self.flags.workers[0] = 1  # cache_info() in the main process is then not the sum
        self.verified = self.flags.verified
        self.touched = self.flags.touched
        self.lastuse = LastUse(keys, self.flags, catalog, clock, wall_clock)
        self.saver = Saver(writeback, self.lastuse, catalog)
        self.touch_queue = self.lastuse.queue  # the same list: appended on the hot path
        self.check_first = verify == "first"
        self.check_always = verify == "always"
        self.check_never = verify == "never"
        self.ops = 0
        self.store_reads = 0
        self.encoded = 0
        self.closed = False
        # Per process (made after fork), so workers never copy the parent's pages.
        self.loc: list[Located | None] = [None] * n
        self.quarantine = writeback.layout.quarantine
        self.quarantined = folder_state(self.quarantine)

    def stats(self) -> ServeStats:
        """This process's counters; in the main process of a dataset DataLoader workers used,
        a warning says so (each worker counts, and holds its RAM tier, in its own process)."""
        if self.flags.workers[0] and get_worker_info() is None:
            warnings.warn(WORKERS_COUNT_APART, stacklevel=3)
        return ServeStats(self.lru.info(), self.store_reads, self.encoded, self.writeback.written)

    def reader(self, path: Path, held: Leases) -> ShardReader:
        """The open reader of ``path``, leased into ``held`` (opened, least recently used
        retired, as needed): another thread's eviction closes it only once ``held`` ends.

        Raises:
            ShardMissing: the shard file is gone.
        """
        reader = self.handles.lease(path, held)
        self.last_path = path
        return reader

    def touch(self, i: int) -> None:
        """Item ``i`` was served: queue its last use; every 256 reads, time-driven upkeep."""
        if not self.touched[i]:
            self.touched[i] = True
            self.touch_queue.append(i)
        self.ops += 1
        if self.writeback.first_pending or not self.ops & 255:
            self.tick()

    def forget(self, i: int) -> None:
        """Item ``i`` was re-keyed: forget its location, checksum and last-use flags and its
        RAM-tier copy, so its next read is of the new key's feature."""
        self.loc[i] = None
        self.verified[i] = 0
        self.touched[i] = 0
        if self.use_lru:
            self.lru.pop(i)

    def tick(self) -> None:
        """Seal an aged write-back, flush last uses when due, expire the shared touch flags,
        and drop the open shards a repair has quarantined since (one stat of ``quarantine/``:
        :meth:`ShardHandles.forget_replaced` once it changed)."""
        now = folder_state(self.quarantine)
        if now != self.quarantined:
            self.quarantined = now
            self.handles.forget_replaced()
        self.writeback.seal_if_due()
        if self.lastuse.due(self.lastuse.clock()):
            self.lastuse.flush()
        self.lastuse.expire_shared()

    def close(self) -> None:
        """Seal, record last uses, close shard files and the catalog (the dataset's
        ProcessLocal hands this process's own state only; see :meth:`drop_inherited`)."""
        self.saver.close()
        self.handles.close()

    def drop_inherited(self) -> None:
        """In a forked child: close this process's copies of the parent's shard files."""
        self.handles.close()


__all__ = [
    "TOUCH_FLUSH_ITEMS",
    "TOUCH_FLUSH_SECONDS",
    "TOUCH_FLUSH_SECONDS_SHARED",
    "TOUCH_REPEAT_SECONDS",
    "WRITEBACK_BYTES",
    "WRITEBACK_ITEMS",
    "WRITEBACK_SECONDS",
    "LastUse",
    "Located",
    "ProcessState",
    "SealPolicy",
    "ServeStats",
    "SharedFlags",
    "WriteBack",
    "mapped_empty",
    "ram_budget_for_process",
    "resident_bytes",
]
