"""Overlap host-to-device copies of batches with the training step.

:class:`DevicePrefetcher` wraps a DataLoader and keeps ``depth`` batches in flight
to the GPU on a side CUDA stream, in the manner of NVIDIA apex's ``data_prefetcher``
(``examples/imagenet/main_amp.py``). Batches that are not already in pinned memory
are first copied into page-locked staging buffers taken from a :class:`PinnedPool`,
which reuses buffers by ``(shape, dtype)`` because allocating pinned memory per batch
is slow (it is a ``cudaHostAlloc`` plus page-locking) and fragments host memory.

On the CPU the prefetcher is a pass-through: same batches, same order, no copies.
All CUDA calls go through :mod:`featbake.device`.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import featbake.device as dev
from featbake.errors import ConfigError
from featbake.lru import ByteLRU, CacheInfo
from featbake.units import parse_bytes

# == pinned ========================================================================================
# Reusable page-locked staging buffers for host-to-device copies, keyed by (shape, dtype).
#
# Allocating pinned memory per batch is slow (a ``cudaHostAlloc`` plus page-locking) and
# fragments host memory, so :class:`~featbake.serve.prefetch.DevicePrefetcher` stages batches
# through this pool. All CUDA calls go through :mod:`featbake.device`.
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


# == prefetch ======================================================================================
def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists and dicts.

    Containers are rebuilt with the same type (namedtuples included); any other value
    is returned unchanged.

    Args:
        fn: Applied to each tensor.
        obj: A tensor, a container nesting tensors, or any other value.

    Returns:
        ``obj`` with every tensor replaced by ``fn(tensor)``.

    Example:
        >>> map_tensors(lambda t: t * 2, {"x": torch.ones(1), "id": "a"})
        {'x': tensor([2.]), 'id': 'a'}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        rebuild: Callable[[dict[Any, Any]], Any] = type(obj)  # dict, OrderedDict, BatchFeature...
        try:
            return rebuild(items)
        except TypeError:  # a Mapping type without a dict constructor
            return items
    if isinstance(obj, tuple):
        items_t = [map_tensors(fn, v) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple: positional constructor
            return type(obj)(*items_t)
        return tuple(items_t)
    if isinstance(obj, list):
        return [map_tensors(fn, v) for v in obj]
    return obj


@dataclass(frozen=True)
class PrefetchStats:
    """Counters of a :class:`DevicePrefetcher` over its lifetime.

    Attributes:
        batches: Batches yielded.
        tensors: Tensors moved to the device (0 on the CPU pass-through).
        staged: Tensors copied through a staging buffer (the rest were already pinned).
        pool: The staging pool's counters.
    """

    batches: int
    tensors: int
    staged: int
    pool: PoolStats
    device_cache: CacheInfo | None = None

    @property
    def allocations(self) -> int:
        """Staging buffers allocated."""
        return self.pool.allocations

    @property
    def reuses(self) -> int:
        """Staging buffer requests served by reuse."""
        return self.pool.reuses


class DevicePrefetcher:
    """Iterate over batches already on ``device``, copied ``depth`` batches ahead.

    Batches may be tensors or any nest of tuples, lists and dicts; every tensor is
    moved to ``device`` and other values pass through. On CUDA, copies run on a side
    stream from pinned memory; before a batch is yielded the current stream waits
    for the side stream and each handed-out tensor is ``record_stream``-ed on the
    current stream so the caching allocator does not recycle it early. On the CPU
    the wrapped iterable's batches are yielded unchanged.

    Each ``iter()`` starts a new pass (epoch) over the wrapped iterable. Not
    thread-safe; iterate from one thread.

    Args:
        loader: Any iterable of batches, typically a ``DataLoader``.
        device: Target device (see :func:`featbake.device.resolve_device`).
        depth: Batches to keep in flight ahead of the consumer (>= 1).
        pool_bytes: Byte budget of the pinned staging pool, e.g. ``"1GiB"``.
        staging: Copy through the staging pool; ``None`` means "on CUDA only".
            ``True`` on the CPU runs the CUDA code path with plain copies, which is
            how it is tested on machines without a GPU.
        device_cache: Byte budget of a device-memory LRU of items, by dataset index (0: off).
            ``loader`` must then be a DataLoader over a map-style dataset with a batch size;
            items missing on the device are read in this process, later epochs of items that
            fit skip the host (and the loader's workers) entirely.

    Raises:
        ConfigError: If ``device`` is invalid or unavailable.
        ValueError: If ``depth`` < 1.

    Example:
        >>> loader = [torch.zeros(2), torch.ones(2)]
        >>> [b.tolist() for b in DevicePrefetcher(loader, device="cpu")]
        [[0.0, 0.0], [1.0, 1.0]]
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device | None = None,
        depth: int = 2,
        *,
        pool_bytes: int | str = "1GiB",
        staging: bool | None = None,
        device_cache: int | str = 0,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._loader = loader
        self._device = dev.resolve_device(device)
        self._depth = depth
        self._staging = dev.is_cuda(self._device) if staging is None else staging
        self._pool = PinnedPool(pool_bytes, pin=dev.is_cuda(self._device))
        self._stream = dev.new_stream(self._device)
        budget = parse_bytes(device_cache)
        self._items: ByteLRU[int, Any] | None = None
        if budget:
            self._check_item_loader(loader)
            self._items = ByteLRU(budget)
        self._batches = 0
        self._tensors = 0
        self._staged = 0

    @property
    def device(self) -> torch.device:
        """The device batches are moved to."""
        return self._device

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]  # TypeError if it has none

    def __iter__(self) -> Iterator[Any]:
        if self._items is not None:
            yield from self._iter_device_cached()
            return
        if not self._staging and not dev.is_cuda(self._device):
            for batch in self._loader:
                self._batches += 1
                yield batch
            return
        yield from self._iter_prefetch()

    def stats(self) -> PrefetchStats:
        """Return the counters: batches yielded, tensors moved, pool reuse."""
        return PrefetchStats(
            batches=self._batches,
            tensors=self._tensors,
            staged=self._staged,
            pool=self._pool.stats(),
            device_cache=self._items.info() if self._items is not None else None,
        )

    def _iter_prefetch(self) -> Iterator[Any]:
        it = iter(self._loader)
        ahead: deque[Any] = deque()

        def fill() -> None:
            while len(ahead) < self._depth:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                ahead.append(self._start_copy(batch))

        fill()
        while ahead:
            batch = ahead.popleft()
            dev.wait_stream(self._device, self._stream)
            current = dev.current_stream(self._device)
            map_tensors(functools.partial(dev.record_stream, stream=current), batch)
            # Queue the next copy before handing this batch out, so it overlaps the step.
            fill()
            self._batches += 1
            yield batch

    def _start_copy(self, batch: Any) -> Any:
        staged: list[torch.Tensor] = []

        def move(t: torch.Tensor) -> torch.Tensor:
            self._tensors += 1
            src = t
            if t.device.type == "cpu" and self._staging and not t.is_pinned():
                src = self._pool.acquire(t.shape, t.dtype)
                src.copy_(t)
                staged.append(src)
                self._staged += 1
            # copy=True: on the CPU path the result must not alias a pooled buffer.
            return src.to(self._device, non_blocking=True, copy=src is not t)

        with dev.stream_context(self._stream):
            out = map_tensors(move, batch)
            event = dev.new_event(self._device)
            dev.record_event(event, self._stream)
        self._pool.release(staged, event)
        return out

    # -- the device tier ------------------------------------------------------------------------
    @staticmethod
    def _check_item_loader(loader: Any) -> None:
        sampler = getattr(loader, "batch_sampler", None)
        dataset = getattr(loader, "dataset", None)
        if sampler is None or dataset is None or not hasattr(dataset, "__getitem__"):
            raise ConfigError(
                "device_cache needs a DataLoader over a map-style dataset with a batch_size "
                "(it caches items by index); pass device_cache=0 for other iterables"
            )

    def _iter_device_cached(self) -> Iterator[Any]:
        """Batches assembled on the device from cached items; only missing items touch the host.

        Items not on the device yet are read in this process (the loader's workers cannot know
        which indices are cached), moved to the device and kept under the byte budget; the
        loader's ``collate_fn`` then runs on device tensors (``pad_collate`` does).
        """
        assert self._items is not None
        loader: Any = self._loader
        dataset, collate = loader.dataset, loader.collate_fn
        getitems = getattr(dataset, "__getitems__", None)
        for indices in loader.batch_sampler:
            items: list[Any] = [self._items.get(i) for i in indices]
            missing = [j for j, item in enumerate(items) if item is None]
            if missing:
                wanted = [indices[j] for j in missing]
                fetched = getitems(wanted) if getitems else [dataset[i] for i in wanted]
                with dev.stream_context(self._stream):
                    moved = [map_tensors(self._to_device, item) for item in fetched]
                dev.wait_stream(self._device, self._stream)
                for j, i, item in zip(missing, wanted, moved, strict=True):
                    items[j] = item
                    self._items.put(i, item)
            self._batches += 1
            yield collate(items)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        self._tensors += 1
        # A copy even on the CPU: the cached item must not alias a batch the user may modify.
        return t.to(self._device, copy=True)


__all__ = [
    "DevicePrefetcher",
    "PinnedPool",
    "PoolKey",
    "PoolStats",
    "PrefetchStats",
    "map_tensors",
]
