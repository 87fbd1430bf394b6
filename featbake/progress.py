"""Progress records that long operations hand to a callback (pure)."""

from __future__ import annotations

from dataclasses import dataclass

#: A rate measured over less time than this is noise (a phase of cached items "runs" at
#: millions of items/s): it is shown as "-".
MIN_RATE_SECONDS = 0.5


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


def rate_text(done: int, seconds: float) -> str:
    """``done`` items over ``seconds`` as "1,234 items/s", or "-" over too short a time.

    Example:
        >>> rate_text(1200, 2.0), rate_text(10, 0.001)
        ('600 items/s', '-')
    """
    if seconds < MIN_RATE_SECONDS or done <= 0:
        return "-"
    return f"{done / seconds:,.0f} items/s"


def progress_line(phase: str, done: int, total: int, seconds: float, written: str = "") -> str:
    """One labelled log line for a phase (no terminal): counts, rate, elapsed, ETA, bytes.

    Example:
        >>> progress_line("encode", 250, 1000, 5.0, "1.2 MiB")
        'encode: 250/1,000, 50 items/s, elapsed 5s, ETA 15s, 1.2 MiB written'
        >>> progress_line("hash", 10, 10, 0.01)
        'hash: 10/10, done in 0.01s'
    """
    head = f"{phase}: {done:,}/{total:,}"
    tail = f", {written} written" if written else ""
    if done >= total and seconds < MIN_RATE_SECONDS:
        return f"{head}, done in {seconds:.2f}s{tail}"
    rate = rate_text(done, seconds)
    parts = [head, rate, f"elapsed {seconds:.0f}s"]
    if rate != "-" and done < total:
        parts.append(f"ETA {(total - done) * seconds / done:.0f}s")
    return ", ".join(parts) + tail
