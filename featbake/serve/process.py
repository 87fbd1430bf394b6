"""Per-process serving state, and the one rule for "is this state stale after ``fork``?".

Everything a dataset opens (shard handles, the catalog connection, the RAM tier, the live
encoder, the write-back shard) belongs to the process that opened it. DataLoader workers are
forked from the process that made the dataset, and a forked child must neither use nor save its
parent's state: its file descriptors are copies, its pending write-back is the parent's to seal.

The rule is featbake's one rule (:mod:`featbake.perprocess`): state is stamped with the pid
that made it (:class:`~featbake.perprocess.ProcessStamp`) and is stale in any other process.
In a forked child, :func:`_after_fork_in_child` also drops every registered owner's state
(closing the copied descriptors), so the hit path only tests ``state is None`` and pays
nothing for the rule.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info

from featbake.lru import ByteLRU, CacheInfo
from featbake.store.catalog.connection import Access, access_for
from featbake.store.catalog_api import ServingStore
from featbake.store.layout import Layout
from featbake.store.serving_fragments import open_serving_catalog

__all__ = [
    "ServeStats",
    "SharedFlags",
    "ThreadCatalog",
    "forget_after_fork",
    "mapped_empty",
    "ram_budget_for_process",
    "resident_bytes",
]

Clock = Callable[[], float]


#: Objects whose per-process state a forked child drops (weakly held).
_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()


class StateOwner(Protocol):
    """An object whose per-process state a forked child drops (see :func:`forget_after_fork`)."""

    def drop_inherited_state(self) -> None: ...


def _after_fork_in_child() -> None:
    for owner in list(_OWNERS):
        owner.drop_inherited_state()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def forget_after_fork(owner: StateOwner) -> None:
    """Have ``owner.drop_inherited_state()`` called in every forked child (weakly held)."""
    _OWNERS.add(owner)


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


class ThreadCatalog:
    """The catalog connection of the thread that made this object, or a fresh one elsewhere.

    SQLite connections are bound to their thread; a finalizer may run in whichever thread the
    garbage collector runs in, so other threads get a connection of their own for one use.
    With ``shared`` (a store on a shared filesystem) each is the read-only stand-in that writes
    fragments (:class:`~featbake.store.serving_fragments.FragmentServingCatalog`).
    """

    def __init__(self, layout: Layout, *, shared: bool = False) -> None:
        self.layout = layout
        self.shared = shared
        self.thread = threading.get_ident()
        self.home = open_serving_catalog(layout, shared=shared)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[ServingStore]:
        """This thread's connection, closed afterwards when it was opened for this use."""
        if threading.get_ident() == self.thread:
            yield self.home
            return
        catalog = open_serving_catalog(self.layout, shared=self.shared)
        try:
            yield catalog
        finally:
            catalog.close()

    def close(self) -> None:
        if threading.get_ident() == self.thread:
            self.home.close()


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
