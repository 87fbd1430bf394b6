"""Ctrl-C at safe points: the bake stops between items, so sealing never hangs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def interrupt_at_safe_points() -> Iterator[Callable[[], None]]:
    """Turn Ctrl-C into a KeyboardInterrupt at the next checkpoint (between items).

    A KeyboardInterrupt raised at an arbitrary bytecode can land inside ``queue.Queue.put`` and
    lose the writer's wake-up, hanging the seal that Ctrl-C promises. The first SIGINT only
    sets a flag; a second one raises at once. Outside the main thread (where signal handlers
    cannot be installed) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    hits: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    def checkpoint() -> None:
        if hits:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield checkpoint
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if hits:  # a Ctrl-C that came after the last checkpoint still stops the caller
        raise KeyboardInterrupt
