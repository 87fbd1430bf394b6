"""Last-use times of served items, recorded in the catalog in coarse batches.

gc's least-recently-used eviction needs days, not milliseconds, so a process records each key's
use at most once per :data:`TOUCH_REPEAT_SECONDS` (shared between forked workers through
:class:`~featbake.serve.process.SharedFlags`) and writes the queue at most every
:data:`TOUCH_FLUSH_SECONDS` or :data:`TOUCH_FLUSH_ITEMS`: never one write per read.

On a shared filesystem each flush seals a fragment (store/serving_fragments.py) instead of a
catalog transaction; there the queue is written every :data:`TOUCH_FLUSH_SECONDS_SHARED`, so
many ranks and workers leave a few small files an hour each, not hundreds, until a merge.
"""

from __future__ import annotations

import contextlib

import numpy as np

from featbake.serve.process import Clock, SharedFlags, ThreadCatalog

__all__ = [
    "TOUCH_FLUSH_ITEMS",
    "TOUCH_FLUSH_SECONDS",
    "TOUCH_FLUSH_SECONDS_SHARED",
    "TOUCH_REPEAT_SECONDS",
    "LastUse",
]

TOUCH_FLUSH_SECONDS = 30.0
TOUCH_FLUSH_SECONDS_SHARED = 600.0
TOUCH_REPEAT_SECONDS = 3600.0
TOUCH_FLUSH_ITEMS = 50_000


class LastUse:
    """Items used in this process whose last use the catalog has not been told yet.

    Args:
        keys: the dataset's keys by item (``S64`` bytes).
        flags: the shared per-item flags (``touched`` and its ``epoch``).
        catalogs: where to write, from whichever thread flushes.
        clock: monotonic seconds (when to flush).
        wall: seconds since the epoch (when the shared ``touched`` flags expire).
    """

    def __init__(
        self,
        keys: np.ndarray,
        flags: SharedFlags,
        catalogs: ThreadCatalog,
        clock: Clock,
        wall: Clock,
    ) -> None:
        self.keys = keys
        self.flags = flags
        self.catalogs = catalogs
        self.clock = clock
        self.wall = wall
        self.queue: list[int] = []  # appended on the hit path: one list, never replaced
        self.last_flush = clock()
        self.flush_seconds = TOUCH_FLUSH_SECONDS_SHARED if catalogs.shared else TOUCH_FLUSH_SECONDS
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
        with contextlib.suppress(Exception), self.catalogs.scoped() as catalog:
            catalog.touch(self.keys[i].decode() for i in queue)

    def expire_shared(self) -> None:
        """Forget which items were recorded once the shared epoch is an hour old."""
        wall = self.wall()
        if wall - self.flags.epoch[0] >= TOUCH_REPEAT_SECONDS:
            self.flags.touched[:] = False
            self.flags.epoch[0] = wall
