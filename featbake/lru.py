"""A least-recently-used cache bounded by bytes rather than by item count.

Decoded features vary wildly in size (a 2 s clip and a 2 min clip differ by 60x), so
an item-count limit would either waste memory or blow through it. :class:`ByteLRU`
keeps the summed size of its values within a strict byte budget, evicting the least
recently used entries first. The design follows ``cachetools.LRUCache``: an
``OrderedDict`` ordered from least to most recently used, ``move_to_end`` on a hit
and ``popitem(last=False)`` to evict.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from featbake.process import ProcessLocal, ProcessLocalState

__all__ = ["ByteLRU", "CacheInfo", "nbytes_of"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


def nbytes_of(value: Any) -> int:
    """Return the number of bytes held by a feature value.

    Works for anything with an ``nbytes`` attribute (``torch.Tensor`` since 2.1,
    ``numpy.ndarray``), and sums over dicts (multi-output features), tuples and lists.
    Only the visible elements are counted, not the whole underlying storage of a view,
    which is what a cache budget wants for the common case of owned, contiguous data.

    Args:
        value: A tensor, array, or a dict/tuple/list nesting of them.

    Returns:
        The total size in bytes.

    Raises:
        TypeError: If a leaf has no ``nbytes`` and is not a container.

    Example:
        >>> import numpy as np
        >>> nbytes_of({"a": np.zeros(4, dtype=np.float32), "b": np.zeros(2, dtype=np.int64)})
        32
    """
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if isinstance(value, Mapping):
        return sum(nbytes_of(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(nbytes_of(v) for v in value)
    raise TypeError(
        f"cannot size a {type(value).__name__}: pass getsizeof= to ByteLRU for such values"
    )


@dataclass(frozen=True)
class CacheInfo:
    """A snapshot of a :class:`ByteLRU`'s counters.

    Attributes:
        hits: ``get`` calls that found their key.
        misses: ``get`` calls that did not.
        evictions: Entries dropped to make room for newer ones.
        rejected: ``put`` calls not stored because the value alone exceeds the budget
            (or the cache is disabled with ``max_bytes == 0``).
        items: Entries currently stored.
        bytes: Summed size of the stored values.
        max_bytes: The byte budget.
    """

    hits: int
    misses: int
    evictions: int
    rejected: int
    items: int
    bytes: int
    max_bytes: int

    @property
    def hit_rate(self) -> float:
        """Fraction of ``get`` calls that hit, or 0.0 before any lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class ByteLRU(ProcessLocalState, Generic[K, V]):
    """An LRU cache whose stored values never exceed ``max_bytes`` in total.

    ``get`` and ``put`` are O(1) (``put`` amortised over the evictions it causes).
    Each value's size is measured once, when it is stored, so values must not grow
    after insertion.

    Thread-safe: each call holds the cache's lock while it reads or changes the entries and
    their byte count (a process's RAM tier is read by a loader's reader thread and by the
    training loop's own ``ds[i]`` at once; unlocked, two ``put`` calls interleaved drifted the
    count from what is held, until an eviction found nothing to evict). The lock is
    uncontended in the common case, a few tens of nanoseconds a call.

    Args:
        max_bytes: The byte budget; ``0`` disables caching entirely.
        getsizeof: Returns a value's size in bytes; defaults to :func:`nbytes_of`.

    Raises:
        ValueError: If ``max_bytes`` is negative.

    Example:
        >>> import numpy as np
        >>> cache = ByteLRU(max_bytes=64)
        >>> cache.put("a", np.zeros(8, dtype=np.float32))
        True
        >>> cache.get("a").shape
        (8,)
        >>> cache.info().bytes
        32
    """

    # One per process (the one pickling rule): a pickled copy, or a child forked while another
    # thread held it, makes its own.
    _lock: ProcessLocal[threading.Lock] = ProcessLocal(lambda _: threading.Lock(), lock=True)

    def __init__(self, max_bytes: int, getsizeof: Callable[[V], int] = nbytes_of) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = int(max_bytes)
        self._getsizeof = getsizeof
        # key -> (value, size); insertion order is recency, least recent first.
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected = 0

    @property
    def max_bytes(self) -> int:
        """The byte budget."""
        return self._max_bytes

    @property
    def bytes(self) -> int:
        """Summed size of the stored values."""
        return self._bytes

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: Any = None) -> Any:
        """Return the value for ``key`` and mark it most recently used.

        Counts a hit or a miss.

        Args:
            key: The key to look up.
            default: Returned when the key is absent.

        Returns:
            The cached value, or ``default``.

        Example:
            >>> cache = ByteLRU(100, getsizeof=len)
            >>> cache.get("x", "absent")
            'absent'
        """
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self._misses += 1
                return default
            self._hits += 1
            self._data.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Store ``value`` under ``key`` as the most recently used entry.

        Replaces any existing value for ``key``, then evicts least recently used
        entries until the new value fits. A value larger than the whole budget is not
        stored (and any old value for ``key`` is dropped, so a stale entry is never
        served); it is counted in ``rejected``.

        Args:
            key: The key.
            value: The value; its size is measured with ``getsizeof`` now.

        Returns:
            True if the value was stored, False if it was rejected.

        Example:
            >>> cache = ByteLRU(4, getsizeof=len)
            >>> cache.put("a", "abc"), cache.put("b", "toolong")
            (True, False)
        """
        size = int(self._getsizeof(value))
        if size < 0:
            raise ValueError(f"getsizeof returned a negative size ({size}) for key {key!r}")
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self._max_bytes or self._max_bytes == 0:
                self._rejected += 1
                return False
            while self._bytes + size > self._max_bytes:
                _, (_, victim_size) = self._data.popitem(last=False)
                self._bytes -= victim_size
                self._evictions += 1
            self._data[key] = (value, size)
            self._bytes += size
            return True

    def pop(self, key: K, default: Any = None) -> Any:
        """Remove ``key`` and return its value, or ``default`` if absent.

        Does not count as a hit, miss or eviction.

        Args:
            key: The key to remove.
            default: Returned when the key is absent.

        Returns:
            The removed value, or ``default``.
        """
        with self._lock:
            entry = self._data.pop(key, None)
            if entry is None:
                return default
            self._bytes -= entry[1]
            return entry[0]

    def clear(self) -> None:
        """Remove every entry; counters are kept (they describe the cache's lifetime)."""
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def keys(self) -> list[K]:
        """Return the keys from least to most recently used."""
        with self._lock:
            return list(self._data)

    def info(self) -> CacheInfo:
        """Return a snapshot of the counters and current occupancy."""
        with self._lock:
            return CacheInfo(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                rejected=self._rejected,
                items=len(self._data),
                bytes=self._bytes,
                max_bytes=self._max_bytes,
            )

    def __contains__(self, key: object) -> bool:
        # Membership is a peek: it must not change recency or counters.
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"ByteLRU(items={len(self._data)}, bytes={self._bytes}, max_bytes={self._max_bytes})"
