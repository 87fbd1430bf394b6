"""Ctrl-C and SIGTERM at safe points: the bake stops between items, so sealing never hangs.

SIGTERM is how torchrun stops the surviving ranks when one fails, and how SLURM, Kubernetes and
docker stop a job: it must keep sealed work exactly as Ctrl-C does, and end with its own code
(143 = 128 + SIGTERM, :class:`~featbake.errors.Terminated`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from featbake.errors import Terminated

#: The signals a bake stops on at its next safe point.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_error(signum: int) -> BaseException:
    """What a stop signal becomes: KeyboardInterrupt for Ctrl-C, Terminated for SIGTERM."""
    if signum == signal.SIGTERM:
        return Terminated(
            "stopped by SIGTERM (torchrun, SLURM, Kubernetes or docker asked this process to stop)"
        )
    return KeyboardInterrupt()


def raise_on_sigterm(signum: int, frame: Any) -> None:
    """A SIGTERM handler that raises :class:`Terminated` where the program is, as Python's own
    SIGINT handler raises KeyboardInterrupt (for commands whose every step is safe to stop)."""
    raise stop_error(signum)


class _Stops:
    """The stop signals a safe-point block has seen, and whether the main thread is waiting on
    another thread's or process's work just now (:func:`stoppable_wait`)."""

    def __init__(self) -> None:
        self.hits: list[int] = []
        self.waiting = False

    def checkpoint(self) -> None:
        if self.hits:
            raise stop_error(self.hits[0])


#: The safe-point blocks open in the main thread, innermost last (signals reach it alone).
_open: list[_Stops] = []


def _in_block() -> _Stops | None:
    main = threading.current_thread() is threading.main_thread()
    return _open[-1] if main and _open else None


@contextmanager
def interrupt_at_safe_points(*, after: bool = True) -> Iterator[Callable[[], None]]:
    """Turn Ctrl-C and SIGTERM into an exception at the next checkpoint (between items), or at
    once where the main thread waits on other threads' work (:func:`stoppable_wait`).

    An exception raised at an arbitrary bytecode can land inside ``queue.Queue.put`` and lose
    the writer's wake-up, hanging the seal that stopping promises. The first signal only sets
    a flag; a second Ctrl-C raises at once (a user who insists). A second SIGTERM does not: a
    job's processes can each receive it twice (SLURM signals every process of a step, and
    ``featbake build``'s supervisor passes its own on), and whoever sends SIGTERM escalates to
    SIGKILL after its grace period anyway. Outside the main thread (where signal handlers
    cannot be installed) this does nothing. A signal that came after the last checkpoint
    stops the caller as the block ends, unless ``after`` is False (an export whose output
    was published: its work is whole, and the process ends next anyway).
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    stops = _Stops()
    hits = stops.hits

    def on_signal(signum: int, frame: Any) -> None:
        hits.append(signum)
        if stops.waiting or (signum == signal.SIGINT and hits.count(signal.SIGINT) > 1):
            raise stop_error(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    _open.append(stops)
    try:
        yield stops.checkpoint
    finally:
        _open.remove(stops)
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if hits and after:  # a signal that came after the last checkpoint still stops the caller
        raise stop_error(hits[0])


@contextmanager
def stoppable_wait() -> Iterator[None]:
    """Around the main thread's wait for work another thread or process does (the next decoded
    input): a stop signal raises there at once instead of at the next checkpoint, so a build
    whose decoding is stuck in a read that never returns (an NFS server gone, a FIFO) still
    stops, keeping what it sealed. The wait holds none of the writer's locks or queues, which
    is what safe points protect; the stuck thread is left behind (see
    :class:`featbake.threadpool.DaemonThreads`). Outside a safe-point block, or off the main
    thread, it does nothing.
    """
    stops = _in_block()
    if stops is None:
        yield
        return
    stops.waiting = True  # first: a signal handled from here on raises, not only counts
    stops.checkpoint()  # a stop that came before the wait
    try:
        yield
    finally:
        stops.waiting = False


def stop_requested() -> bool:
    """Whether the innermost safe-point block has seen a stop signal (its work then ends
    without waiting on threads or processes that may be stuck)."""
    stops = _in_block()
    return stops is not None and bool(stops.hits)
