"""State that must not cross ``fork`` or pickling: the one per-process rule (see the comment
below): :class:`ProcessLocal`, :class:`PerThread`, :class:`PerProcess`, :class:`ProcessStamp`
and the pickling rule :class:`ProcessLocalState` (a leaf, no I/O).

How many CPUs a build uses is :mod:`featbake.cpus`, the hashing threads
:mod:`featbake.threadpool`, pausing the garbage collector :mod:`featbake.gcpause`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar, overload

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
#: Weak references to every live slot; each removes itself when its slot is collected. A plain
#: set of references, not a ``WeakSet``: :func:`_hold_before_fork` copies it in one C call.
_SLOTS: set[weakref.ref[_Slot]] = set()
#: Reentrant, as every lock a fork hook holds: the cyclic collector may run a finalizer on the
#: thread that holds it (inside ``fork``'s hooks, or inside :meth:`PerThread.__get__`), and a
#: finalizer that makes a per-thread value (a dataset's last-use flush opens a catalog
#: connection) then takes it again on that thread; with a plain lock that thread waited on
#: itself for ever (a fork-mode DataLoader's start hung).
_SLOTS_LOCK = threading.RLock()
_AT_FORK: list[Any] = []


#: One entry for each ``fork`` this process began, and for each that returned in it: the
#: counts :func:`forks_begun` and :func:`forks_returned` read. ``list.append`` is one atomic
#: operation, with no lock (two threads may fork at once; a count read while a fork is under
#: way is never torn), at 8 bytes a fork.
_FORKS_BEGUN: list[None] = []
_FORKS_RETURNED: list[None] = []


def forks_begun() -> int:
    """How many ``fork`` calls this process (and, before it, its parents) began: a fork whose
    child is made after a moment was begun before it or is counted by the next read."""
    return len(_FORKS_BEGUN)


def forks_returned() -> int:
    """How many ``fork`` calls returned in this process (failed ones too): a fork not yet
    counted here at some moment made its child, if at all, after that moment."""
    return len(_FORKS_RETURNED)


def _hold_before_fork() -> None:
    _FORKS_BEGUN.append(None)
    # A forked child frees the parent's other threads' thread-locals (their slots) before any
    # after-fork hook runs (collecting a sqlite3 connection closes it), so the references are
    # taken here, in the parent. The lock is held across fork() so that no other thread's hold
    # on it is copied into the child.
    _SLOTS_LOCK.acquire()
    # A copy of the set's references first (one C call, no Python code runs): a finalizer
    # the collector runs meanwhile may add a slot to the set, never to the list walked here.
    refs = list(_SLOTS)
    _AT_FORK[:] = [slot.value for ref in refs if (slot := ref()) is not None]


def _after_fork_in_parent() -> None:
    _FORKS_RETURNED.append(None)
    _AT_FORK.clear()
    _SLOTS_LOCK.release()


#: What else a forked child must do at once, not on first use (:func:`in_forked_child`).
_CHILD_HOOKS: list[Callable[[], None]] = []


def in_forked_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every child forked from now on, right after the fork: through this
    module's one fork hook, for state that must be let go before the child does anything (a
    lock this process holds on a file, which a child that outlives it would keep)."""
    _CHILD_HOOKS.append(hook)


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    _FORKS_RETURNED.append(None)
    INHERITED_ACROSS_FORK.extend(_AT_FORK)
    _AT_FORK.clear()
    _SLOTS_LOCK.release()
    later = getattr(_INSIDE, "later", None)
    if later:  # the forking thread's work left for the end of its section: the parent's to do
        later.clear()
    for hook in _CHILD_HOOKS:
        hook()


os.register_at_fork(
    before=_hold_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


#: Per thread: how many of featbake's own critical sections it is inside now (a file lock of
#: the store or its tier taken through :func:`featbake.store.locks.locked`, a catalog
#: transaction). A finalizer the collector runs on such a thread must not take them again (a
#: ``flock`` on a new descriptor waits on its own thread for ever, a second connection's
#: ``BEGIN IMMEDIATE`` for the whole busy timeout): it hands its work over instead
#: (:func:`in_critical_section`), to another thread, or to this thread once it has left every
#: section (:func:`after_critical_section`, kept in ``later``).
_INSIDE = threading.local()


@contextlib.contextmanager
def critical_section() -> Iterator[None]:
    """Mark this thread as inside a critical section for the block: entered before the lock or
    transaction is taken, left once it is let go, so no moment while it is held is unmarked.
    Leaving the outermost runs the work :func:`after_critical_section` left for then."""
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1
        if not _INSIDE.depth:
            _run_later()


def in_critical_section() -> bool:
    """Whether this thread is inside a :func:`critical_section` now.

    Example:
        >>> with critical_section():
        ...     in_critical_section()
        True
        >>> in_critical_section()
        False
    """
    return getattr(_INSIDE, "depth", 0) > 0


def after_critical_section(work: Callable[[], None]) -> None:
    """Run ``work`` on this thread once it has left every critical section it is inside now
    (at once where it is in none): where no lock or transaction of featbake's is held by it.

    For a finalizer's work that can neither be done inside (it would wait on its own thread)
    nor handed to another thread (at exit none is left to take it). ``work`` must not raise:
    it runs as the outermost section is left, inside its ``finally``.

    Example:
        >>> done = []
        >>> with critical_section():
        ...     after_critical_section(lambda: done.append(in_critical_section()))
        ...     done
        []
        >>> done
        [False]
    """
    if not in_critical_section():
        work()
        return
    later = getattr(_INSIDE, "later", None)
    if later is None:
        later = _INSIDE.later = collections.deque()
    later.append(work)


def _run_later() -> None:
    """Run what was left for the end of this thread's sections, each once: work that enters a
    section of its own runs what was left meanwhile as it leaves it (``popleft``, one taker)."""
    later: collections.deque[Callable[[], None]] | None = getattr(_INSIDE, "later", None)
    while later:
        later.popleft()()


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


def fork_safe_lock() -> threading.RLock:
    """A lock held across ``fork``, so a child never inherits it held by a thread it lacks.

    Reentrant (see :data:`_SLOTS_LOCK`): a finalizer the collector runs during a later fork
    hook, on the forking thread, may take it again.
    """
    lock = threading.RLock()
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
            per attribute, held across ``fork``). A finalizer the collector runs inside the
            make, on the making thread, passes the (reentrant) lock: where it uses the
            attribute it makes and stores a value, which the outer make then returns too,
            dropping its own unused; every caller gets the one value stored.

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
        # The first value stored is the one: a finalizer the collector ran inside ``make`` on
        # this thread passes the reentrant lock (see :data:`_SLOTS_LOCK`) and may have made and
        # stored one meanwhile, which it already uses; this make's value is then handed to no
        # one (``setdefault``: one dict operation, nothing runs between the check and the store).
        return instance.__dict__.setdefault(self.key, Held(_pid, value))[1]

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
            _SLOTS.add(weakref.ref(slot, _SLOTS.discard))
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
    "after_critical_section",
    "critical_section",
    "in_critical_section",
]
