"""Pausing Python's cyclic garbage collector around bulk bookkeeping and the command line's
start-up (a leaf, no I/O; why: the comments below)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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


# The command line pauses it for its start-up as well: importing typer, rich, pydantic, torch and
# featbake makes hundreds of thousands of objects and no garbage, and the collector's full passes
# over them (three in a no-op rebuild, ~0.15-0.3 s of CPU on a busy node: a tenth of the command;
# issue 31 item 4) freed nothing. Once the imports are done, what they made is frozen (moved out
# of the generations the collector walks) and the collector resumes for the command's own work.
_startup = {"paused": False}


def pause_gc_for_startup() -> None:
    """Pause the cyclic collector until :func:`end_startup` (the command's own process only:
    frozen objects are never freed, which a long-lived caller's garbage must be)."""
    if gc.isenabled():
        gc.disable()
        _startup["paused"] = True


def end_startup() -> None:
    """The command's own work begins: freeze what start-up made and resume the collector; a
    no-op unless :func:`pause_gc_for_startup` paused it."""
    if _startup["paused"]:
        _startup["paused"] = False
        gc.freeze()
        gc.enable()
