"""Reusable page-locked staging buffers for host-to-device copies, keyed by (shape, dtype).

Allocating pinned memory per batch is slow (a ``cudaHostAlloc`` plus page-locking) and
fragments host memory, so :class:`~featbake.serve.prefetch.DevicePrefetcher` stages batches
through this pool. All CUDA calls go through :mod:`featbake.device`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import featbake.device as dev
from featbake.units import parse_bytes

__all__ = ["PinnedPool", "PoolKey", "PoolStats"]

PoolKey = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`PinnedPool`.

    Attributes:
        allocations: Buffers newly allocated.
        reuses: Requests served by a previously released buffer.
        evictions: Free buffers dropped to stay within the byte budget.
        free: Buffers ready for reuse.
        in_flight: Buffers released but whose copy may not have finished.
        bytes: Bytes held by the pool (free and in-flight buffers).
    """

    allocations: int
    reuses: int
    evictions: int
    free: int
    in_flight: int
    bytes: int


class PinnedPool:
    """Reusable host staging buffers keyed by ``(shape, dtype)``.

    A buffer is handed out by :meth:`acquire`, filled and used as the source of an
    asynchronous copy, then given back with :meth:`release` together with an event
    recorded after that copy. It becomes reusable only once the event has completed,
    so a buffer is never overwritten while the GPU may still read it. Events are
    anything with a ``query() -> bool`` method (CUDA events, or test doubles); ``None``
    means the copy is already complete (the CPU case).

    The byte budget bounds the memory kept around: free buffers are evicted least
    recently used first to make room, and a buffer coming back while the pool is over
    budget is dropped. Buffers in flight are never dropped, so the pool can exceed
    the budget by at most what is in flight at once.

    Not thread-safe: one pool belongs to one prefetcher.

    Args:
        max_bytes: Byte budget, as an int or a string such as ``"1GiB"``.
        pin: Allocate page-locked memory (only effective when CUDA is available).

    Example:
        >>> pool = PinnedPool(max_bytes="1MiB", pin=False)
        >>> buf = pool.acquire((2, 3), torch.float32)
        >>> pool.release([buf], None)
        >>> pool.acquire((2, 3), torch.float32) is buf
        True
    """

    def __init__(self, max_bytes: int | str = "1GiB", *, pin: bool = True) -> None:
        self._max_bytes = parse_bytes(max_bytes)
        self._pin = pin
        # key -> free buffers; key order is recency of use, least recent first.
        self._free: OrderedDict[PoolKey, list[torch.Tensor]] = OrderedDict()
        # FIFO of (event, buffers); copies on one stream complete in order.
        self._in_flight: deque[tuple[Any, list[torch.Tensor]]] = deque()
        self._bytes = 0
        self._allocations = 0
        self._reuses = 0
        self._evictions = 0

    @property
    def max_bytes(self) -> int:
        """The byte budget."""
        return self._max_bytes

    def acquire(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Return a host buffer of ``shape`` and ``dtype`` that nothing else is using.

        Reuses a free buffer of the same key when one exists (after reclaiming those
        whose copies have completed), otherwise allocates one.

        Args:
            shape: The buffer's shape.
            dtype: The buffer's dtype.

        Returns:
            An uninitialised tensor, exclusively the caller's until :meth:`release`.
        """
        key: PoolKey = (tuple(shape), dtype)
        self._reclaim()
        bucket = self._free.get(key)
        if bucket:
            buf = bucket.pop()
            if not bucket:
                del self._free[key]
            else:
                self._free.move_to_end(key)
            self._reuses += 1
            return buf
        nbytes = _nbytes(key)
        self._evict_until(self._max_bytes - nbytes)
        buf = dev.alloc_pinned(key[0], dtype) if self._pin else torch.empty(key[0], dtype=dtype)
        self._bytes += nbytes
        self._allocations += 1
        return buf

    def release(self, buffers: Iterable[torch.Tensor], event: Any | None) -> None:
        """Give buffers back; they are reusable once ``event`` has completed.

        Args:
            buffers: Buffers obtained from :meth:`acquire`.
            event: Recorded after the last use of ``buffers`` (``None``: already done).
        """
        bufs = list(buffers)
        if bufs:
            self._in_flight.append((event, bufs))

    def stats(self) -> PoolStats:
        """Return the pool's counters."""
        return PoolStats(
            allocations=self._allocations,
            reuses=self._reuses,
            evictions=self._evictions,
            free=sum(len(b) for b in self._free.values()),
            in_flight=sum(len(b) for _, b in self._in_flight),
            bytes=self._bytes,
        )

    def clear(self) -> None:
        """Drop every free buffer (buffers in flight stay until they complete)."""
        self._reclaim()
        self._evict_until(-1)

    def _reclaim(self) -> None:
        while self._in_flight and dev.event_query(self._in_flight[0][0]):
            _, bufs = self._in_flight.popleft()
            for buf in bufs:
                if self._bytes > self._max_bytes:
                    self._bytes -= buf.nbytes
                    self._evictions += 1
                    continue
                key: PoolKey = (tuple(buf.shape), buf.dtype)
                self._free.setdefault(key, []).append(buf)
                self._free.move_to_end(key)

    def _evict_until(self, limit: int) -> None:
        """Drop least recently used free buffers until the pool holds <= ``limit`` bytes."""
        while self._bytes > limit and self._free:
            key, bucket = next(iter(self._free.items()))
            buf = bucket.pop()
            if not bucket:
                del self._free[key]
            self._bytes -= buf.nbytes
            self._evictions += 1


def _nbytes(key: PoolKey) -> int:
    numel = 1
    for s in key[0]:
        numel *= s
    return numel * key[1].itemsize
