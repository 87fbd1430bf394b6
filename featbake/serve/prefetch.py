"""Overlap host-to-device copies of batches with the training step.

:class:`DevicePrefetcher` wraps a DataLoader and keeps ``depth`` batches in flight
to the GPU on a side CUDA stream, in the manner of NVIDIA apex's ``data_prefetcher``
(``examples/imagenet/main_amp.py``). Batches that are not already in pinned memory
are first copied into page-locked staging buffers taken from a :class:`PinnedPool`,
which reuses buffers by size because allocating pinned memory per batch is slow (it is
a ``cudaHostAlloc`` plus page-locking) and fragments host memory. The copies are
:class:`Staging`'s, which ``FeatureLoader(device="cuda")`` uses too: its reader builds
each batch in the pool's buffers, and the copy reads it from there.

On the CPU the prefetcher is a pass-through: same batches, same order, no copies.
All CUDA calls go through :mod:`featbake.device`.
"""

from __future__ import annotations

import bisect
import functools
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, StackDataset, Subset

import featbake.device as dev
from featbake.errors import ConfigError
from featbake.lru import ByteLRU, CacheInfo
from featbake.units import parse_bytes

# == pinned ========================================================================================
# Reusable page-locked staging buffers for host-to-device copies, by size.
#
# Allocating pinned memory per batch is slow (a ``cudaHostAlloc`` plus page-locking) and
# fragments host memory, so every host-to-device copy featbake makes (``DevicePrefetcher``'s and
# ``FeatureLoader(device="cuda")``'s, both through :class:`Staging`) goes through this pool. All
# CUDA calls go through :mod:`featbake.device`.
#: A buffer's size class in bytes (see :func:`size_class`).
PoolKey = int


def size_class(nbytes: int) -> PoolKey:
    """``nbytes`` rounded up to the pool's size class: a multiple of an eighth of its highest
    power of two (at most 12.5% more), so batches whose longest item differs by a few frames
    share buffers."""
    if nbytes <= 8:
        return nbytes
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`PinnedPool`.

    Attributes:
        allocations: Buffers newly allocated.
        reuses: Requests served by a previously released buffer.
        evictions: Free buffers dropped to stay within the byte budget.
        free: Buffers ready for reuse.
        in_flight: Buffers released but whose copy may not have finished.
        bytes: Bytes held by the pool (free, in-flight and lent buffers).
        lent: Buffers handed out and not back yet.
    """

    allocations: int
    reuses: int
    evictions: int
    free: int
    in_flight: int
    bytes: int
    lent: int = 0


class PinnedPool:
    """Reusable host staging buffers by size class (:func:`size_class`).

    A buffer is handed out by :meth:`acquire` as a tensor of the shape and dtype asked (a view
    of the buffer's first bytes), filled and used as the source of an asynchronous copy, then
    given back with :meth:`release` together with an event recorded after that copy. It becomes
    reusable only once the event has completed, so a buffer is never overwritten while the GPU
    may still read it. Events are anything with a ``query() -> bool`` method (CUDA events, or
    test doubles); ``None`` means the copy is already complete (the CPU case).

    A buffer is also never handed out while a tensor, view or array of it is alive: each buffer
    is a numpy array that every tensor made from it references (``torch.from_numpy``), so one
    whose only reference is the pool's is unused (as :class:`~featbake.serve.collate.BatchPool`
    does). A buffer whose tensors are all dropped without :meth:`release` (a batch read and
    never copied: the loop stopped, or its read failed) is free again.

    The byte budget bounds the memory kept around: free buffers are evicted least recently used
    first to make room, and a buffer coming back while the pool is over budget is dropped.
    Buffers in flight or in use are never dropped, so the pool can exceed the budget by at most
    what is in use at once.

    Thread-safe: ``FeatureLoader``'s reader thread builds batches in its buffers while the
    training thread copies and releases them.

    Args:
        max_bytes: Byte budget, as an int or a string such as ``"1GiB"``.
        pin: Allocate page-locked memory (only effective when CUDA is available).

    Example:
        >>> pool = PinnedPool(max_bytes="1MiB", pin=False)
        >>> buf = pool.acquire((2, 3), torch.float32)
        >>> where = buf.data_ptr()
        >>> pool.release([buf], None)
        >>> del buf  # nothing of it alive: reusable
        >>> pool.acquire((3, 2), torch.float32).data_ptr() == where
        True
    """

    def __init__(self, max_bytes: int | str = "1GiB", *, pin: bool = True) -> None:
        self._max_bytes = parse_bytes(max_bytes)
        self._pin = pin
        self._lock = threading.Lock()
        # size class -> free buffers; key order is recency of use, least recent first.
        self._free: OrderedDict[PoolKey, list[_Buffer]] = OrderedDict()
        # FIFO of (event, buffers); copies on one stream complete in order.
        self._in_flight: deque[tuple[Any, list[_Buffer]]] = deque()
        self._lent: list[_Buffer] = []  # handed out, not released
        self._bytes = 0
        self._allocations = 0
        self._reuses = 0
        self._evictions = 0

    @property
    def max_bytes(self) -> int:
        """The byte budget."""
        return self._max_bytes

    def acquire(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Return a host tensor of ``shape`` and ``dtype`` whose memory nothing else uses.

        Reuses a free buffer of the same size class when one exists (after reclaiming those
        whose copies have completed), otherwise allocates one.

        Args:
            shape: The tensor's shape.
            dtype: The tensor's dtype.

        Returns:
            An uninitialised tensor, exclusively the caller's until :meth:`release`, or until
            it and every view of it are dropped.
        """
        shape = tuple(shape)
        nbytes = _nbytes(shape, dtype)
        if not nbytes:  # nothing to copy from: no buffer (empty arrays share one address)
            return torch.empty(shape, dtype=dtype)
        with self._lock:  # made under the lock: until it exists the buffer looks unused
            self._reclaim()
            buf = self._take(size_class(nbytes))
            out = torch.from_numpy(buf.array)[:nbytes].view(dtype).view(shape)
            self._lent.append(buf)
        return out

    def lent(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in a buffer handed out by :meth:`acquire` and not released."""
        if t.device.type != "cpu":
            return False
        addr = t.untyped_storage().data_ptr()
        with self._lock:
            return any(b.addr == addr for b in self._lent)

    def release(self, buffers: Iterable[torch.Tensor], event: Any | None) -> None:
        """Give buffers back; they are reusable once ``event`` has completed.

        Args:
            buffers: Tensors obtained from :meth:`acquire` (a buffer given twice counts once).
            event: Recorded after the last use of ``buffers`` (``None``: already done).
        """
        addrs = {t.untyped_storage().data_ptr() for t in buffers}
        with self._lock:
            back = [b for b in self._lent if b.addr in addrs]
            if back:
                self._lent = [b for b in self._lent if b.addr not in addrs]
                self._in_flight.append((event, back))

    def stats(self) -> PoolStats:
        """Return the pool's counters (buffers whose copies completed or whose tensors are
        gone counted free)."""
        with self._lock:
            self._reclaim()
            return PoolStats(
                allocations=self._allocations,
                reuses=self._reuses,
                evictions=self._evictions,
                free=sum(len(b) for b in self._free.values()),
                in_flight=sum(len(b) for _, b in self._in_flight),
                bytes=self._bytes,
                lent=len(self._lent),
            )

    def clear(self) -> None:
        """Drop every free buffer (buffers in flight or in use stay until they come back)."""
        with self._lock:
            self._reclaim()
            self._evict_until(-1)

    def _take(self, key: PoolKey) -> _Buffer:
        """A free buffer of size class ``key`` nothing uses, else a new one (evicting free
        buffers to stay within the budget)."""
        bucket = self._free.get(key, [])
        for k in range(len(bucket) - 1, -1, -1):
            if bucket[k].unused():
                buf = bucket.pop(k)
                if not bucket:
                    del self._free[key]
                else:
                    self._free.move_to_end(key)
                self._reuses += 1
                return buf
        self._evict_until(self._max_bytes - key)
        shape, byte = (key,), torch.uint8
        made = dev.alloc_pinned(shape, byte) if self._pin else torch.empty(shape, dtype=byte)
        self._bytes += key
        self._allocations += 1
        return _Buffer(made.numpy())

    def _reclaim(self) -> None:
        """Buffers whose copies completed, and buffers dropped without a release, are free."""
        dropped = [b for b in self._lent if b.unused()]
        if dropped:
            self._lent = [b for b in self._lent if b not in dropped]
            self._in_flight.appendleft((None, dropped))
        while self._in_flight and dev.event_query(self._in_flight[0][0]):
            _, bufs = self._in_flight.popleft()
            for buf in bufs:
                if self._bytes > self._max_bytes:
                    self._bytes -= buf.nbytes
                    self._evictions += 1
                    continue
                key: PoolKey = buf.nbytes
                self._free.setdefault(key, []).append(buf)
                self._free.move_to_end(key)

    def _evict_until(self, limit: int) -> None:
        """Drop least recently used free buffers nothing uses until the pool holds <= ``limit``
        bytes (or none is left to drop)."""
        for key in list(self._free):
            bucket = self._free[key]
            for buf in [b for b in bucket if b.unused()]:
                if self._bytes <= limit:
                    return
                bucket.remove(buf)
                self._bytes -= buf.nbytes
                self._evictions += 1
            if not bucket:
                del self._free[key]


class _Buffer:
    """One buffer of a :class:`PinnedPool`: a numpy array over its memory, which every tensor
    made from it (``torch.from_numpy``) references while it lives."""

    __slots__ = ("addr", "array", "nbytes")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.addr = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)

    def unused(self) -> bool:
        """Whether no tensor, view or array of the buffer is alive."""
        # 2 references: this object's slot and getrefcount's own argument.
        return sys.getrefcount(self.array) == 2


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * dtype.itemsize


# == prefetch ======================================================================================
def tensor_bytes(item: Any) -> int:
    """The bytes of the tensors in ``item`` (a nest as :func:`map_tensors` walks it); a label,
    an id or any other value weighs nothing: what the device tier holds of an item.

    Example:
        >>> tensor_bytes((torch.zeros(4), 7, "id"))
        16
    """
    sizes: list[int] = []
    map_tensors(lambda t: sizes.append(t.nbytes), item)
    return sum(sizes)


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


class Staging:
    """Host-to-device copies of batches on a side stream, through one :class:`PinnedPool`: what
    :class:`DevicePrefetcher` and ``FeatureLoader(device=...)`` both do to hand batches over
    on the device.

    :meth:`start` queues a batch's copies on the side stream: a tensor already in one of the
    pool's buffers (``FeatureLoader``'s reader builds its batches there) or pinned by the user is
    copied from where it lies; any other host tensor is first copied into a pool buffer. An
    event recorded after the copies gives the buffers back to the pool. :meth:`hand_out` makes
    the current stream wait for the side stream and ``record_stream``-s every tensor on it
    (apex's ``data_prefetcher``). On the CPU with ``staged=True`` the same path runs with plain
    copies (events and streams ``None``), which is how it is tested without a GPU.

    Not thread-safe but for the pool: copies are started and handed out on one thread.

    Args:
        device: Where batches go.
        pool_bytes: Byte budget of the pinned pool.
        staged: Copy host tensors through the pool; ``None`` means "on CUDA only".
    """

    def __init__(
        self, device: torch.device, pool_bytes: int | str = "1GiB", staged: bool | None = None
    ) -> None:
        self.device = device
        self.staged = dev.is_cuda(device) if staged is None else staged
        self.pool = PinnedPool(pool_bytes, pin=dev.is_cuda(device))
        self.stream = dev.new_stream(device)
        self.tensors = 0  # moved to the device
        self.copied = 0  # copied into a pool buffer first

    def start(self, batch: Any) -> Any:
        """``batch`` with every tensor's copy to the device queued on the side stream."""
        used: list[torch.Tensor] = []

        def move(t: torch.Tensor) -> torch.Tensor:
            self.tensors += 1
            src, pooled = t, False
            if t.device.type == "cpu" and self.staged:
                pooled = self.pool.lent(t)  # built in the pool: copied from where it lies
                if not pooled and not t.is_pinned():
                    src, pooled = self.pool.acquire(t.shape, t.dtype), True
                    src.copy_(t)
                    self.copied += 1
                if pooled:
                    used.append(src)
            # copy=True: on the CPU path the result must not alias a pool buffer.
            return src.to(self.device, non_blocking=True, copy=pooled)

        with dev.stream_context(self.stream):
            out = map_tensors(move, batch)
            event = dev.new_event(self.device)
            dev.record_event(event, self.stream)
        self.pool.release(used, event)
        return out

    def hand_out(self, batch: Any) -> Any:
        """``batch`` (started by :meth:`start`) ready to use on the current stream."""
        dev.wait_stream(self.device, self.stream)
        current = dev.current_stream(self.device)
        map_tensors(functools.partial(dev.record_stream, stream=current), batch)
        return batch

    def ahead(self, batches: Iterable[Any], depth: int) -> Iterator[Any]:
        """``batches`` on the device, each one's copies started ``depth`` batches before it is
        handed out (the next copy is queued before a batch is handed out, so that it overlaps
        the step). An error reading a batch ahead is raised in that batch's turn, after the
        batches before it (the loop does not stop steps early, nor a resume count them as
        read). Closing this iterator closes ``batches``'s."""
        it = iter(batches)
        started: deque[Any] = deque()
        failed: list[Exception] = []  # the error reading a batch ahead, raised in its turn

        def fill() -> None:
            try:
                while not failed and len(started) < depth:
                    batch = next(it, _DONE)
                    if batch is _DONE:
                        return
                    started.append(self.start(batch))
            except Exception as e:
                failed.append(e)

        try:
            fill()
            while started:
                batch = self.hand_out(started.popleft())
                fill()  # the next copy queued before this batch is handed out
                yield batch
            if failed:
                raise failed[0]
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


_DONE = object()


def identity_of(dataset: Any) -> Callable[[int], Hashable]:
    """What index ``i`` of ``dataset`` serves, as a value equal wherever it serves the same
    item in any epoch: a cache of items by index (``DevicePrefetcher(device_cache=...)``) keys
    by it. ``i`` itself for a dataset whose items stay put; for a
    :class:`~featbake.MixedDataset` (it has ``locate``) the dataset and the identity of the
    item that position ``i`` draws this epoch; the dataset's own ``identity`` where it serves
    other items per epoch (``ViewsDataset``); reached through ``Subset``, ``ConcatDataset``
    and ``StackDataset`` (each member's, together).

    Raises:
        ConfigError: the dataset (or a member) serves other items at an index from epoch to
            epoch (it has ``set_epoch``) and does not say which (no ``identity``), or checks
            its files at every read (``revalidate=True``), which a cache by index would skip.
    """
    if getattr(dataset, "revalidate", False) is True:
        raise ConfigError(
            "a cache of items by index would skip the reads that revalidate=True checks each "
            "file at; drop device_cache, or make the dataset with revalidate=False"
        )
    locate = getattr(dataset, "locate", None)
    if callable(locate):  # a MixedDataset: position i is its dataset k's item j this epoch
        members = [identity_of(d) for d in dataset.datasets]

        def mixed(i: int) -> Hashable:
            k, j = locate(i)
            return k, members[k](j)

        return mixed
    own = getattr(dataset, "identity", None)
    if callable(own):
        return own
    if isinstance(dataset, Subset):
        inner, indices = identity_of(dataset.dataset), dataset.indices
        return lambda i: inner(indices[i])
    if isinstance(dataset, ConcatDataset):
        return _concatenated(dataset)
    if isinstance(dataset, StackDataset):
        stacked = dataset.datasets
        found = [
            identity_of(m) for m in (stacked.values() if isinstance(stacked, dict) else stacked)
        ]
        return lambda i: tuple(f(i) for f in found)
    if callable(getattr(dataset, "set_epoch", None)):
        raise ConfigError(
            f"{type(dataset).__name__} serves other items at an index from epoch to epoch and "
            "does not say which (it has no identity()), so a cache of items by index would "
            "serve an earlier epoch's; drop device_cache for it"
        )
    held = moving_attribute(dataset)
    if held is not None:
        raise ConfigError(
            f"{type(dataset).__name__} holds a dataset ({held}) whose items move from epoch to "
            "epoch or are checked at every read (revalidate=True), and does not say which item "
            "index i serves, so a cache of items by index would serve old ones; give it "
            "identity(i) or drop device_cache"
        )
    return _same


def moves(dataset: Any, depth: int = 3) -> bool:
    """Whether a dataset serves other items at an index from epoch to epoch (a mixture, a
    dataset with ``set_epoch`` or ``identity``) or checks its files at every read
    (``revalidate=True``), itself or through ``Subset``, ``ConcatDataset``, ``StackDataset``
    or a dataset it holds, looked for ``depth`` datasets deep (:func:`moving_attribute`)."""
    if depth <= 0:
        return False
    if getattr(dataset, "revalidate", False) is True:
        return True
    if any(callable(getattr(dataset, a, None)) for a in ("locate", "identity", "set_epoch")):
        return True
    if isinstance(dataset, Subset):
        return moves(dataset.dataset, depth)
    if isinstance(dataset, ConcatDataset | StackDataset):
        stacked = dataset.datasets
        members = stacked.values() if isinstance(stacked, dict) else stacked
        return any(moves(m, depth) for m in members)
    return moving_attribute(dataset, depth - 1) is not None


def moving_attribute(dataset: Any, depth: int = 3) -> str | None:
    """The attribute of a dataset of the user's own (``Labelled(mixed)``) that holds a dataset
    that :func:`moves` (in a list, tuple or dict too), looked for ``depth`` datasets deep;
    None when none does. Keyed by index, such a wrapper would be served an earlier epoch's
    items (or a file's old features) from a cache."""
    return holding_attribute(dataset, lambda d: moves(d, depth))


def holding_attribute(dataset: Any, wanted: Callable[[Any], bool]) -> str | None:
    """The attribute of a dataset of the user's own that holds a dataset for which ``wanted``
    says yes (in a list, tuple or dict too); None when none does. What a loader or a cache
    learns of a wrapper it cannot see into (a torch ``Dataset`` with the data in an
    attribute), to refuse it rather than read it wrong."""
    for name, value in vars(dataset).items() if hasattr(dataset, "__dict__") else ():
        inner = value.values() if isinstance(value, dict) else value
        held = inner if isinstance(inner, list | tuple) else [value]
        if any(isinstance(d, Dataset) and d is not dataset and wanted(d) for d in held):
            return name
    return None


def _concatenated(dataset: ConcatDataset) -> Callable[[int], Hashable]:
    """:func:`identity_of` a ``ConcatDataset``: which dataset index ``i`` falls in, and what
    that dataset's item there is."""
    members = [identity_of(d) for d in dataset.datasets]
    ends = list(dataset.cumulative_sizes)

    def concatenated(i: int) -> Hashable:
        i = i + ends[-1] if i < 0 else i
        k = bisect.bisect_right(ends, i)
        return k, members[k](i - (ends[k - 1] if k else 0))

    return concatenated


def _same(i: int) -> Hashable:
    return i


def owned_batch(batch: Any, kept: list[Any]) -> Any:
    """``batch`` with a copy of every tensor that lies in the memory of one of ``kept`` (the
    device tier's items): a collate that hands items on as they are (``collate_fn=list``)
    would give the step the tier's own tensors, and a step that edits its batch in place
    (``x -= x.mean()``) would change what later epochs are served. ``pad_collate`` and
    ``default_collate`` build new tensors: nothing is copied for them."""
    held: set[int] = set()
    map_tensors(lambda t: held.add(t.untyped_storage().data_ptr()), kept)
    return map_tensors(lambda t: t.clone() if t.untyped_storage().data_ptr() in held else t, batch)


class DevicePrefetcher:
    """Iterate over batches already on ``device``, copied ``depth`` batches ahead.

    Batches may be tensors or any nest of tuples, lists and dicts; every tensor is
    moved to ``device`` and other values pass through. On CUDA, copies run on a side
    stream from pinned memory; before a batch is yielded the current stream waits
    for the side stream and each handed-out tensor is ``record_stream``-ed on the
    current stream so the caching allocator does not recycle it early. On the CPU
    the wrapped iterable's batches are yielded unchanged.

    Each ``iter()`` starts a new pass (epoch) over the wrapped iterable. Not
    thread-safe; iterate from one thread. A :class:`~featbake.FeatureLoader` wrapped counts
    only the batches handed to the loop, so its ``state_dict()`` saved in the loop resumes
    exactly; another loader's state (torchdata's ``StatefulDataLoader``) counts the ``depth``
    batches started ahead as read too.

    Args:
        loader: Any iterable of batches, typically a ``DataLoader``.
        device: Target device (see :func:`featbake.device.resolve_device`).
        depth: Batches to keep in flight ahead of the consumer (>= 1).
        pool_bytes: Byte budget of the pinned staging pool, e.g. ``"1GiB"``.
        staging: Copy through the staging pool; ``None`` means "on CUDA only".
            ``True`` on the CPU runs the CUDA code path with plain copies, which is
            how it is tested on machines without a GPU.
        device_cache: Byte budget of a device-memory LRU of items, by what each dataset
            index serves (the index itself; a ``MixedDataset`` position's drawn item, a
            ``ViewsDataset`` item's view: :func:`identity_of`) (0: off).
            ``loader`` must then be a DataLoader over a map-style dataset with a batch size;
            items missing on the device are read in this process, later epochs of items that
            fit skip the host (and the loader's workers) entirely.

    Raises:
        ConfigError: If ``device`` is invalid or unavailable, or ``device_cache`` is asked
            of a dataset whose items at an index cannot be told apart from epoch to epoch.
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
        self._stage = Staging(self._device, pool_bytes, staging)
        budget = parse_bytes(device_cache)
        self._items: ByteLRU[Hashable, Any] | None = None
        if budget:
            self._check_item_loader(loader)
            # What each index serves, not the index: a mixture draws other items there each
            # epoch, and the tier must never hand out an earlier epoch's.
            self._identity = identity_of(getattr(loader, "dataset", None))
            self._items = ByteLRU(budget, getsizeof=tensor_bytes)
        self._batches = 0
        self._tensors = 0  # moved by the device tier (the staging counts its own)

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
        if not self._stage.staged and not dev.is_cuda(self._device):
            for batch in self._loader:
                self._batches += 1
                yield batch
            return
        yield from self._iter_prefetch()

    def stats(self) -> PrefetchStats:
        """Return the counters: batches yielded, tensors moved, pool reuse."""
        return PrefetchStats(
            batches=self._batches,
            tensors=self._tensors + self._stage.tensors,
            staged=self._stage.copied,
            pool=self._stage.pool.stats(),
            device_cache=self._items.info() if self._items is not None else None,
        )

    def _iter_prefetch(self) -> Iterator[Any]:
        # A loader that counts the batches it hands out (FeatureLoader) stages them inside its
        # count: the ones started ahead are not taken for read by a state saved in the loop.
        staged = getattr(self._loader, "staged_through", None)
        ahead = staged(self._stage, self._depth) if staged else None
        for batch in ahead or self._stage.ahead(self._loader, self._depth):
            self._batches += 1
            yield batch

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
            keys = [self._identity(i) for i in indices]
            items: list[Any] = [self._items.get(key) for key in keys]
            missing = [j for j, item in enumerate(items) if item is None]
            if missing:
                wanted = [indices[j] for j in missing]
                fetched = getitems(wanted) if getitems else [dataset[i] for i in wanted]
                with dev.stream_context(self._stage.stream):
                    moved = [map_tensors(self._to_device, item) for item in fetched]
                # Used on the current stream from now on (record_stream): an evicted item's
                # memory is not reused by the side stream's next copy while kernels queued on
                # the current stream still read it.
                moved = self._stage.hand_out(moved)
                for j, item in zip(missing, moved, strict=True):
                    items[j] = item
                    self._items.put(keys[j], item)
            self._batches += 1
            yield owned_batch(collate(items), items)

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
    "Staging",
    "map_tensors",
    "size_class",
]
