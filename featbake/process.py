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
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any, Generic, NamedTuple, TypeVar, overload

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
# The one rule for state that must not cross ``fork`` or pickling: hold it in a ProcessLocal.
#
# DataLoader workers are forked from the process that made a dataset or a ``CachedEncoder``, and
# inherit copies of what it held: SQLite connections (using one corrupts databases), shard file
# descriptors, thread pools without their threads, locks a parent thread held, a write-back
# that is the parent's to seal, object-store clients. Each is a :class:`ProcessLocal` attribute,
# made on first use and stamped with the pid that made it: a child makes its own, handing the
# inherited value to ``on_inherited`` (to close its copies of the parent's fds), never using,
# saving or closing it as its own. A holder mixes in :class:`ProcessLocalState`, the one
# pickling rule (a copy carries the rest). A module-level value is a :class:`PerProcess`, a
# per-thread one (a SQLite connection) a :class:`PerThread`, whose values this module's one
# fork hook keeps referenced in a child; :class:`ProcessStamp` marks an object whose
# finalizer runs only where it was made.
# diskcache does the same with one pid-stamped property. The pid is a variable a fork hook
# refreshes (``os.getpid()`` is a system call): the check is one comparison.
T = TypeVar("T")

_pid = os.getpid()


class _Slot:
    """One thread's :class:`PerThread` value, tracked weakly so a fork can keep it."""

    __slots__ = ("__weakref__", "value")

    def __init__(self, value: Any) -> None:
        self.value = value


#: In a forked child, every thread's :class:`PerThread` values inherited from the parent: kept
#: referenced, never used nor closed (a SQLite connection closed in a child would release or
#: clobber its parent's locks).
INHERITED_ACROSS_FORK: list[Any] = []
_SLOTS: weakref.WeakSet[_Slot] = weakref.WeakSet()
_SLOTS_LOCK = threading.Lock()
_AT_FORK: list[Any] = []


def _hold_before_fork() -> None:
    # A forked child frees the parent's other threads' thread-locals (their slots) before any
    # after-fork hook runs (collecting a sqlite3 connection closes it), so the references are
    # taken here, in the parent. The lock is held across fork() so that no other thread's hold
    # on it is copied into the child.
    _SLOTS_LOCK.acquire()
    _AT_FORK[:] = [s.value for s in _SLOTS]


def _after_fork_in_parent() -> None:
    _AT_FORK.clear()
    _SLOTS_LOCK.release()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    INHERITED_ACROSS_FORK.extend(_AT_FORK)
    _AT_FORK.clear()
    _SLOTS_LOCK.release()


os.register_at_fork(
    before=_hold_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


class ProcessStamp:
    """The process something was made in: :attr:`stale` in a forked copy of that process.

    For finalizers (a write-back's seal at exit or collection), not a :class:`ProcessLocal`:
    an inherited object is not replaced on use but must never act, and a forked child may
    collect one while it clears the parent's other threads, before any fork hook has run, so
    :attr:`stale` asks the kernel (``os.getpid()``), not the pid the hook refreshes.

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


class Held(NamedTuple):
    """A per-process value and the pid that made it; refuses to be pickled (see
    :class:`ProcessLocalState`), so no copy ever takes another process's value for its own."""

    pid: int
    value: Any

    def __reduce__(self) -> Any:
        raise TypeError(
            "a featbake per-process value (a connection, open files, a client) cannot be "
            "pickled; the class holding it must mix in featbake.process.ProcessLocalState"
        )


def fork_safe_lock() -> threading.Lock:
    """A lock held across ``fork``, so a child never inherits it held by a thread it lacks."""
    lock = threading.Lock()
    os.register_at_fork(
        before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release
    )
    return lock


class ProcessLocal(Generic[T]):
    """An attribute whose value is made on first use in each process, never pickled.

    Args:
        make: makes the value from the instance (called once per process and instance).
        on_inherited: called with a value a forked child inherited, before it is replaced
            (e.g. to close this process's copies of the parent's file descriptors). Never
            called on the value in the process that made it.
        lock: made thread-safe: two threads never make two values for one instance (one lock
            per attribute, held across ``fork``).

    The holding class mixes in :class:`ProcessLocalState` (pickling a held value raises).

    Example:
        >>> class Pool(ProcessLocalState):
        ...     items: ProcessLocal[list[int]] = ProcessLocal(lambda self: [])
        >>> p = Pool()
        >>> p.items is p.items
        True
    """

    def __init__(
        self,
        make: Callable[[Any], T],
        *,
        on_inherited: Callable[[T], None] | None = None,
        lock: bool = False,
    ) -> None:
        self.make = make
        self.on_inherited = on_inherited
        self.lock = fork_safe_lock() if lock else None
        self.key = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"_{name}_held"  # where the instance's Held record lives in its __dict__

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> ProcessLocal[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        held = instance.__dict__.get(self.key)
        if held is not None and held[0] == _pid:  # the hit path: one lookup, one comparison
            return held[1]
        if self.lock is None:
            return self._replace(instance)
        with self.lock:  # made once: another thread may have made it while this one waited
            held = instance.__dict__.get(self.key)
            if held is not None and held[0] == _pid:
                return held[1]
            return self._replace(instance)

    def _replace(self, instance: object) -> T:
        old = instance.__dict__.pop(self.key, None)  # None, or a forked child's inherited one
        if old is not None and self.on_inherited is not None:
            self.on_inherited(old[1])
        value = self.make(instance)
        instance.__dict__[self.key] = Held(_pid, value)
        return value

    def __set__(self, instance: object, value: T) -> None:
        instance.__dict__[self.key] = Held(_pid, value)

    def peek(self, instance: object) -> T | None:
        """This process's value if it made one, else None (never makes one)."""
        held = instance.__dict__.get(self.key)
        return held[1] if held is not None and held[0] == _pid else None

    def reset(self, instance: object) -> T | None:
        """Forget this process's value and return it (for the caller to close); the next use
        makes a new one. An inherited value is handed to ``on_inherited`` and None returned."""
        held = instance.__dict__.pop(self.key, None)
        if held is None:
            return None
        if held[0] == _pid:
            return held[1]
        if self.on_inherited is not None:
            self.on_inherited(held[1])
        return None


class PerThread(Generic[T]):
    """An attribute with one value per thread and per process (a SQLite connection), made on
    first use in the thread, never pickled: a :class:`ProcessLocal` ``threading.local``.

    A thread's value is dropped (so collected) when the thread ends. Across ``fork`` every
    thread's value is kept referenced in the child (:data:`INHERITED_ACROSS_FORK`), never used
    nor closed there; the child's threads make their own.

    Example:
        >>> class Conns(ProcessLocalState):
        ...     conn: PerThread[list[int]] = PerThread(lambda self: [])
        >>> c = Conns()
        >>> c.conn is c.conn, Conns.conn.reset(c) is not None, Conns.conn.peek(c)
        (True, True, None)
    """

    def __init__(self, make: Callable[[Any], T]) -> None:
        self.make = make
        self.locals: ProcessLocal[threading.local] = ProcessLocal(lambda _: threading.local())

    def __set_name__(self, owner: type, name: str) -> None:
        self.locals.__set_name__(owner, name)

    @property
    def key(self) -> str:
        return self.locals.key

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> PerThread[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        local = self.locals.__get__(instance)
        slot: _Slot | None = getattr(local, "slot", None)
        if slot is not None:
            return slot.value
        value = self.make(instance)
        slot = _Slot(value)
        with _SLOTS_LOCK:
            _SLOTS.add(slot)
        local.slot = slot
        return value

    def peek(self, instance: object) -> T | None:
        """This thread's value in this process, else None (never makes one)."""
        slot = getattr(self.locals.peek(instance), "slot", None)
        return None if slot is None else slot.value

    def reset(self, instance: object) -> T | None:
        """Forget this thread's value in this process and return it (for the caller to close);
        None when it has none (an inherited one is kept, see :data:`INHERITED_ACROSS_FORK`)."""
        local = self.locals.peek(instance)
        slot: _Slot | None = getattr(local, "slot", None)
        if slot is None:
            return None
        local.slot = None  # type: ignore[union-attr]
        return slot.value


_KEYS: dict[type, tuple[str, ...]] = {}


def process_local_keys(cls: type) -> tuple[str, ...]:
    """Where instances of ``cls`` keep their ProcessLocal (and PerThread) values (all its
    bases' too)."""
    keys = _KEYS.get(cls)
    if keys is None:
        kinds = (ProcessLocal, PerThread)
        found = (v for k in cls.__mro__ for v in vars(k).values() if isinstance(v, kinds))
        keys = _KEYS[cls] = tuple(v.key for v in found)
    return keys


class ProcessLocalState:
    """The one pickling rule of a class holding :class:`ProcessLocal` attributes: a copy
    carries everything else and makes its own per-process values on first use (handles,
    connections and clients never cross a process boundary)."""

    def __getstate__(self) -> dict[str, Any]:
        # Cooperative: a base's own rule (``nn.Module`` drops its compiled call) runs first.
        state: dict[str, Any] = dict(super().__getstate__())  # type: ignore[call-overload]
        for key in process_local_keys(type(self)):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore = getattr(super(), "__setstate__", None)
        if restore is None:
            self.__dict__.update(state)
        else:
            restore(state)


class PerProcess(Generic[T]):
    """A module-level value made on first use in each process; a forked child makes its own:
    a :class:`ProcessLocal` on a holder of its own, for a value with no instance to hang it on
    (a module's thread pool). Arguments as :class:`ProcessLocal`'s, ``make`` taking none.

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
        self._local = ProcessLocal(lambda _: make(), on_inherited=on_inherited, lock=lock)
        self._local.key = "_value_held"

    def get(self) -> T:
        """This process's value, made now if this process has none yet."""
        return self._local.__get__(self)

    def peek(self) -> T | None:
        """This process's value if it made one, else None (never makes one)."""
        return self._local.peek(self)


__all__ = [
    "INHERITED_ACROSS_FORK",
    "PerProcess",
    "PerThread",
    "ProcessLocal",
    "ProcessLocalState",
    "ProcessStamp",
]
