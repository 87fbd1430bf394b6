"""Asking the kernel to start reading a byte range of a shard, without waiting for it.

A cold read (a store larger than the page cache) waits for the disk once per ``pread``; one
read at a time, a shuffled epoch of ~600 KB items ran at about half the disk's bandwidth here.
Reads a loader knows it will make soon can be started now with ``posix_fadvise(WILLNEED)``:
the kernel queues them and returns, so many are in flight while the caller reads (and checks)
the one it needs, and each later ``pread`` finds its pages in the cache.

A hint costs a system call even when the pages are cached already (~11 us for 700 KB here, a
cost a warm epoch would pay for nothing), so a one-byte ``pread`` with ``RWF_NOWAIT`` (~1 us,
never waits for the disk) first asks whether a page inside the range is cached, and a cached
range is left alone. Where the platform has neither call (macOS has no ``posix_fadvise``),
nothing is hinted and reads are as before.
"""

from __future__ import annotations

import os

#: The page size the probe aligns to; a wrong guess only makes the probe less precise.
_PAGE = 4096
_FADVISE = getattr(os, "posix_fadvise", None)
_WILLNEED: int = getattr(os, "POSIX_FADV_WILLNEED", 3)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: The probe's byte: its value is never looked at, so threads may share it.
_PROBE = bytearray(1)


def can_hint() -> bool:
    """Whether :func:`will_need` can start reads on this platform."""
    return _FADVISE is not None


def cached(fd: int, begin: int, nbytes: int) -> bool | None:
    """Whether a page inside ``[begin, begin + nbytes)`` is in the page cache (never waits).

    The page probed lies in the range's middle, away from its ends, whose pages a neighbouring
    tensor that was read may share. None when the platform cannot tell without waiting.
    """
    if _NOWAIT is None or nbytes <= 0:
        return None
    mid = begin + nbytes // 2
    probe = max(begin, mid - mid % _PAGE)
    try:
        return os.preadv(fd, [_PROBE], probe, _NOWAIT) == 1
    except BlockingIOError:  # EAGAIN: reading it would have waited for the disk
        return False
    except OSError:  # EOPNOTSUPP (a filesystem without RWF_NOWAIT), a closed fd: cannot tell
        return None


def will_need(fd: int, begin: int, nbytes: int) -> bool:
    """Start reading ``nbytes`` at ``begin`` into the page cache, unless they are there already.

    A hint: it never raises for a file that cannot be read ahead (the read that follows
    reports any real error) and returns at once; the kernel reads in the background.

    Args:
        fd: an open, readable file descriptor.
        begin: the first byte.
        nbytes: how many bytes.

    Returns:
        True when reads were started (the range was not cached, or the platform cannot tell).

    Example:
        >>> fd = os.open(path, os.O_RDONLY)  # doctest: +SKIP
        >>> will_need(fd, 4096, 600_000)  # doctest: +SKIP
        True
    """
    if _FADVISE is None or nbytes <= 0 or cached(fd, begin, nbytes):
        return False
    try:
        _FADVISE(fd, begin, nbytes, _WILLNEED)
    except OSError:  # a descriptor closed meanwhile, a filesystem that refuses hints
        return False
    return True
