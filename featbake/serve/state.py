"""Everything one process opens to serve a dataset, made on first use and never shared.

The state holds the catalog connection, the open shards (an LRU of handles), the RAM tier, the
live encoder once loaded, the write-back, the last-use queue, and each item's location once it
was read. It never crosses ``fork`` or pickling: see :mod:`featbake.serve.process` for the rule.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from featbake.encode.encoders import LoadedEncoder
from featbake.perprocess import ProcessStamp
from featbake.serve.lastuse import LastUse
from featbake.serve.process import (
    Clock,
    ServeStats,
    SharedFlags,
    ThreadCatalog,
    ram_tier,
    wall_clock,
)
from featbake.serve.writeback import WriteBack
from featbake.store.handles import ShardHandles
from featbake.store.reader import ShardReader

__all__ = ["Located", "ProcessState"]


class Located(NamedTuple):
    """Where one item's single tensor lies, remembered on its first read in this process.

    Valid while ``reader`` is still the open handle of ``path`` here and the index still puts
    the item in shard ``sid`` (gc may move it): the hit path then costs one list index and one
    pread instead of key decoding and header lookups.
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

    def __init__(self, writeback: WriteBack, lastuse: LastUse, catalogs: ThreadCatalog) -> None:
        self.lifetime = ProcessStamp()
        self.writeback = writeback
        self.lastuse = lastuse
        self.catalogs = catalogs
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
        self.catalogs.close()


def save_at_exit(saver: Saver) -> None:
    """The finalizer of a process's state (at exit, or when the state is collected)."""
    try:
        saver.close()
    except Exception as e:  # at exit there is no caller left to raise to
        warnings.warn(f"featbake: could not save written-back features: {e}", stacklevel=1)


#: What cache_info() in the main process says once DataLoader workers served the dataset.
WORKERS_COUNT_APART = (
    "cache_info() here counts this process only: DataLoader workers count (and keep their RAM "
    "cache) in their own processes, so after an epoch with workers these numbers are not the "
    "epoch's; call ds.cache_info() inside a worker (e.g. in worker_init_fn or the training "
    "loop's collate_fn), or read with num_workers=0 / featbake.FeatureLoader, which count here"
)


class ProcessState:
    """One process's serving state for one dataset.

    Args:
        n: items in the dataset.
        shared: the dataset's shared flag mapping (None in a spawned copy: keep our own).
        writeback: this process's write-back.
        catalogs: this process's catalog connection.
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
        catalogs: ThreadCatalog,
        keys: np.ndarray,
        ram_total: int,
        verify: str,
        max_open_shards: int,
        clock: Clock = time.monotonic,
    ) -> None:
        self.lifetime = ProcessStamp()
        self.catalogs = catalogs
        self.writeback = writeback
        self.handles = ShardHandles(
            max_open=max_open_shards, verify=verify, remote=catalogs.layout.remote
        )
        self.open_readers = self.handles.open_readers  # checked by the hit path
        self.last_path: Path | None = None
        self.lru = ram_tier(ram_total)
        self.use_lru = self.lru.max_bytes > 0
        self.encoder: LoadedEncoder | None = None
        self.pending_idx: dict[str, list[int]] = {}  # key -> items, written back, not sealed
        self.flags = SharedFlags(shared if shared is not None else SharedFlags.allocate(n), n)
        if get_worker_info() is not None:
            self.flags.workers[0] = 1  # cache_info() in the main process is then not the sum
        self.verified = self.flags.verified
        self.touched = self.flags.touched
        self.lastuse = LastUse(keys, self.flags, catalogs, clock, wall_clock)
        self.saver = Saver(writeback, self.lastuse, catalogs)
        self.touch_queue = self.lastuse.queue  # the same list: appended on the hot path
        self.check_first = verify == "first"
        self.check_always = verify == "always"
        self.ops = 0
        self.store_reads = 0
        self.encoded = 0
        self.closed = False
        # Per process (made after fork), so workers never copy the parent's pages.
        self.loc: list[Located | None] = [None] * n

    def stats(self) -> ServeStats:
        """This process's counters; in the main process of a dataset DataLoader workers used,
        a warning says so (each worker counts, and holds its RAM tier, in its own process)."""
        if self.flags.workers[0] and get_worker_info() is None:
            warnings.warn(WORKERS_COUNT_APART, stacklevel=3)
        return ServeStats(self.lru.info(), self.store_reads, self.encoded, self.writeback.written)

    def reader(self, path: Path) -> ShardReader:
        """The open reader of ``path`` (opened, least recently used closed, as needed).

        Raises:
            ShardMissing: the shard file is gone.
        """
        reader = self.handles.get(path)
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
        """Seal an aged write-back, flush last uses when due, expire the shared touch flags."""
        self.writeback.seal_if_due()
        if self.lastuse.due(self.lastuse.clock()):
            self.lastuse.flush()
        self.lastuse.expire_shared()

    def close(self) -> None:
        """Seal, record last uses, close shard files and the catalog (this process only)."""
        if self.lifetime.stale:
            return
        self.saver.close()
        self.handles.close()

    def drop_inherited(self) -> None:
        """In a forked child: close this process's copies of the parent's shard files."""
        self.handles.close()
