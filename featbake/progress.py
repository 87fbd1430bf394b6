"""Progress records that long operations hand to a callback (pure)."""

from __future__ import annotations

from dataclasses import dataclass

#: A rate measured over less time than this is noise (a phase of cached items "runs" at
#: millions of items/s): it is shown as "-".
MIN_RATE_SECONDS = 0.5


@dataclass(frozen=True)
class Progress:
    """A progress report: ``phase`` is "hash" or "encode"; counts are items.

    ``bytes_written`` is what is sealed (durable: it survives a SIGKILL); ``bytes_pending``
    was encoded but is still in the writer's hands (a shard being filled).
    """

    phase: str
    done: int
    total: int
    bytes_written: int = 0
    failed: int = 0
    bytes_pending: int = 0


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


def bytes_text(sealed: str, pending: str = "") -> str:
    """Bytes sealed (what survives a kill) and, if any, still pending: "1.2 MiB sealed".

    Example:
        >>> bytes_text("1.2 MiB", "300 KiB"), bytes_text("", "300 KiB"), bytes_text("")
        ('1.2 MiB sealed, 300 KiB pending', '0 B sealed, 300 KiB pending', '')
    """
    if not pending:
        return f"{sealed} sealed" if sealed else ""
    return f"{sealed or '0 B'} sealed, {pending} pending"


def progress_line(
    phase: str, done: int, total: int, seconds: float, written: str = "", pending: str = ""
) -> str:
    """One labelled log line for a phase (no terminal): counts, rate, elapsed, ETA, bytes
    sealed (``written``) and pending.

    Example:
        >>> progress_line("encode", 250, 1000, 5.0, "1.2 MiB", "300 KiB")
        'encode: 250/1,000, 50 items/s, elapsed 5s, ETA 15s, 1.2 MiB sealed, 300 KiB pending'
        >>> progress_line("hash", 10, 10, 0.01)
        'hash: 10/10, done in 0.01s'
    """
    head = f"{phase}: {done:,}/{total:,}"
    text = bytes_text(written, pending)
    tail = f", {text}" if text else ""
    if done >= total and seconds < MIN_RATE_SECONDS:
        return f"{head}, done in {seconds:.2f}s{tail}"
    rate = rate_text(done, seconds)
    parts = [head, rate, f"elapsed {seconds:.0f}s"]
    if rate != "-" and done < total:
        parts.append(f"ETA {(total - done) * seconds / done:.0f}s")
    return ", ".join(parts) + tail
