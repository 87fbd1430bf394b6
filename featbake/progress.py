"""Progress records that long operations hand to a callback (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """A progress report: ``phase`` is "hash" or "encode"; counts are items."""

    phase: str
    done: int
    total: int
    bytes_written: int = 0
    failed: int = 0


# -- gc: execute ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GcProgress:
    """Progress of :func:`execute_gc`: ``phase`` is drop, rows, shards, compact or files."""

    phase: str
    done: int
    total: int
