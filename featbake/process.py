"""How many CPUs a build may use, and how to split them between decoding and encoding (pure).

The reading of ``/sys/fs/cgroup`` and the affinity mask lives in :mod:`featbake.device`; the
rules live here, so they are tested over plain values.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Generic, NamedTuple, TypeVar

# == cpus ==========================================================================================
#: More decode workers than this only adds start-up time and memory.
MAX_AUTO_WORKERS = 8


def parse_cpu_max(text: str) -> float:
    """CPUs allowed by a cgroup v2 ``cpu.max`` ("200000 100000" -> 2.0; "max 100000" -> inf).

    Example:
        >>> parse_cpu_max("150000 100000"), parse_cpu_max("max 100000")
        (1.5, inf)
    """
    quota, _, period = text.strip().partition(" ")
    try:
        if quota == "max":
            return math.inf
        value = int(quota) / int(period or 100_000)
    except (ValueError, ZeroDivisionError):
        return math.inf
    return value if value > 0 else math.inf


def parse_cfs_quota(quota: str, period: str) -> float:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no limit).

    Example:
        >>> parse_cfs_quota("-1", "100000"), parse_cfs_quota("50000", "100000")
        (inf, 0.5)
    """
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return math.inf
    return q / p if q > 0 and p > 0 else math.inf


def usable_cpus(affinity: Collection[int], quota: float) -> int:
    """CPUs a process may keep busy: its affinity mask, capped by its cgroup quota (rounded up).

    Not ``os.cpu_count()``: that counts the host's CPUs, also those ``taskset`` or a
    container's ``--cpus`` keep this process from using, and threads sized by it oversubscribe.

    Example:
        >>> usable_cpus(range(64), 2.5), usable_cpus({0, 1}, math.inf)
        (3, 2)
    """
    n = len(affinity)
    if math.isfinite(quota) and quota > 0:
        n = min(n, math.ceil(quota))
    return max(1, n)


class BakeThreads(NamedTuple):
    """How a build spends its CPUs: decode worker processes and the encoder's torch threads."""

    decode_workers: int
    encoder_threads: int


def encoder_threads(asked: int | None, current: int, cpus: int, *, env_pinned: bool) -> int:
    """The encoder's torch intra-op threads: the user's setting, never featbake's guess.

    ``asked`` (``--threads N``) wins. Otherwise the count torch has now stays: the user's
    ``torch.set_num_threads``, ``OMP_NUM_THREADS``, an encoder factory's own setting (silero-vad
    sets 1) or torch's default. Overriding it made a many-small-ops model build 3.8x slower than
    the user's own loop on a node shared with other work (issue 19). The one change: a count
    above the CPUs this process may use (a container's CPU quota, which torch's default ignores)
    is lowered to them, unless ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (``env_pinned``) set it.

    Example:
        >>> encoder_threads(None, 1, 2, env_pinned=False)  # the user's 1 stays
        1
        >>> encoder_threads(None, 64, 2, env_pinned=False)  # torch's default in a 2-CPU cgroup
        2
        >>> encoder_threads(3, 1, 2, env_pinned=True)  # --threads 3
        3
    """
    if asked is not None:
        return asked
    if current > cpus and not env_pinned:
        return max(1, cpus)
    return max(1, current)


def bake_threads(
    cpus: int, workers: int | None, threads: int, *, on_gpu: bool = False
) -> BakeThreads:
    """Decode workers for ``cpus`` beside an encoder on ``threads`` (from :func:`encoder_threads`).

    Chosen (``workers`` None): a CPU encoder decodes in its own process on up to 2 CPUs (workers
    there only steal the encoder's time: ~40% longer encoder calls measured with 2 workers on 2
    CPUs), and beyond uses one worker per 4 CPUs, as a hand-written loop would give its
    DataLoader; a GPU encoder needs one CPU thread to feed it, so the other CPUs decode. Asked
    for (``--workers N``): N workers. The encoder's threads are never lowered to make room: they
    are the user's (see :func:`encoder_threads`).

    Example:
        >>> bake_threads(2, None, 2)
        BakeThreads(decode_workers=0, encoder_threads=2)
        >>> bake_threads(16, None, 16)
        BakeThreads(decode_workers=4, encoder_threads=16)
        >>> bake_threads(8, None, 1, on_gpu=True)
        BakeThreads(decode_workers=7, encoder_threads=1)
    """
    cpus = max(1, cpus)
    if workers is not None:
        return BakeThreads(workers, threads)
    if on_gpu:
        return BakeThreads(min(MAX_AUTO_WORKERS, cpus - 1), threads)
    chosen = 0 if cpus <= 2 else min(MAX_AUTO_WORKERS, max(1, cpus // 4))
    return BakeThreads(chosen, threads)


# == threads =======================================================================================
#: Threads that hash files at once: hashlib releases the GIL, and a few keep a disk (or an NFS
#: mount) busy; more only queue on it.
HASH_THREADS = 4
#: Threads that hash a bucket's objects at once: each waits mostly on its GET.
OBJECT_THREADS = 8

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def map_in_threads(
    fn: Callable[[_In], _Out], items: Collection[_In], threads: int = HASH_THREADS
) -> Iterator[_Out]:
    """``fn`` over ``items`` on up to ``threads`` threads, results in ``items``' order, each as
    soon as it and those before it are done: the one pool every hashing loop uses (input files,
    bucket objects, the hash-cache check). One item or one thread runs inline, with no pool.
    """
    if len(items) <= 1 or threads <= 1:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="featbake-hash") as pool:
        yield from pool.map(fn, items)


# == gcpause =======================================================================================
# Pausing Python's cyclic garbage collector around bulk bookkeeping (a leaf, no I/O).
#
# Building ten thousand small rows (a build's plan, a dataset's index) allocates enough objects
# to trigger the collector's full passes over everything the process holds: torch's modules and a
# training script's state included. Those passes found nothing to free here (the rows hold no
# reference cycles) and cost a third of a 10,000-file rebuild. Reference counting still frees
# what is dropped meanwhile; only the cycle search waits until the block ends.
@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector in the block; restore the caller's setting after.

    Nests, and leaves the collector off if the caller had turned it off.

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# == perprocess ====================================================================================
# The one rule for state that must not cross ``fork``: stamp it with the pid that made it.
#
# DataLoader workers are forked from the process that made a dataset or a ``CachedEncoder``. A
# forked child inherits copies of everything its parent held: SQLite connections (using one is
# how databases get corrupted), shard file descriptors, a thread pool whose threads did not come
# along, a write-back shard that is the parent's to seal, and (soon) object-store clients that are
# not fork-safe. Every such thing is held by a :class:`PerProcess` (made lazily, once per process)
# or stamped with a :class:`ProcessStamp` (made eagerly, checked before use): a child sees a pid
# that is not its own and makes its own, never using, saving or closing the parent's.
#
# diskcache does the same with one pid-stamped property; checking costs one ``os.getpid()``.
T = TypeVar("T")


class ProcessStamp:
    """The process something was made in: :attr:`stale` in a forked copy of that process.

    Example:
        >>> ProcessStamp().stale
        False
    """

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def stale(self) -> bool:
        """True in any process but the one that made this stamp (a forked child, a grandchild)."""
        return self.pid != os.getpid()


class PerProcess(Generic[T]):
    """A value made on first use in each process; a forked child makes its own.

    Args:
        make: makes the value (called once per process, on first :meth:`get`).
        on_inherited: called with a value a forked child inherited, before it is replaced
            (e.g. to close this process's copies of the parent's file descriptors). Never
            called on the value in the process that made it.
        lock: made thread-safe: two threads of one process never make two values. The lock
            is held across ``fork`` so a child never inherits it held by a thread it lacks.

    Example:
        >>> pool = PerProcess(list)
        >>> pool.get() is pool.get()
        True
    """

    def __init__(
        self,
        make: Callable[[], T],
        *,
        on_inherited: Callable[[T], None] | None = None,
        lock: bool = False,
    ) -> None:
        self._make = make
        self._on_inherited = on_inherited
        self._pid = -1
        self._value: T | None = None
        self._lock = threading.Lock() if lock else None
        if self._lock is not None:
            held = self._lock
            os.register_at_fork(
                before=held.acquire, after_in_parent=held.release, after_in_child=held.release
            )

    def get(self) -> T:
        """This process's value, made now if this process has none yet."""
        value = self._value
        if value is not None and self._pid == os.getpid():
            return value
        if self._lock is None:
            return self._replace()
        with self._lock:
            value = self._value
            if value is not None and self._pid == os.getpid():
                return value
            return self._replace()

    def peek(self) -> T | None:
        """This process's value if it made one, else None (never makes one)."""
        return self._value if self._pid == os.getpid() else None

    def _replace(self) -> T:
        old = self._value
        if old is not None and self._on_inherited is not None:
            self._on_inherited(old)
        value = self._make()
        self._value, self._pid = value, os.getpid()
        return value


__all__ = [
    "PerProcess",
    "ProcessStamp",
]
