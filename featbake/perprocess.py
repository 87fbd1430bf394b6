"""The one rule for state that must not cross ``fork``: stamp it with the pid that made it.

DataLoader workers are forked from the process that made a dataset or a ``CachedEncoder``. A
forked child inherits copies of everything its parent held: SQLite connections (using one is
how databases get corrupted), shard file descriptors, a thread pool whose threads did not come
along, a write-back shard that is the parent's to seal, and (soon) object-store clients that are
not fork-safe. Every such thing is held by a :class:`PerProcess` (made lazily, once per process)
or stamped with a :class:`ProcessStamp` (made eagerly, checked before use): a child sees a pid
that is not its own and makes its own, never using, saving or closing the parent's.

diskcache does the same with one pid-stamped property; checking costs one ``os.getpid()``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess", "ProcessStamp"]

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
