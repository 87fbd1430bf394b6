"""How many CPUs a build may use, and how to split them between decoding and encoding (pure).

The reading of ``/sys/fs/cgroup`` and the affinity mask lives in :mod:`featbake.device`; the
rules live here, so they are tested over plain values.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import NamedTuple

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


def bake_threads(cpus: int, workers: int | None, *, on_gpu: bool = False) -> BakeThreads:
    """Decode workers and encoder threads for ``cpus``; chosen ones fit in ``cpus`` together.

    Chosen (``workers`` None): each CPU given to a decode worker is taken from the encoder's
    intra-op threads, since sized both to the whole machine they compete and a small encoder's
    calls slow down by more than the overlapped decoding saves (measured: ~40% longer encoder
    calls with 2 workers on 2 CPUs). A CPU encoder decodes in its own process on up to 2 CPUs,
    and beyond uses one worker per 4 CPUs; a GPU encoder needs one CPU thread to feed it, so
    the other CPUs decode.

    Asked for (``--workers N``): N workers, and a CPU encoder keeps every CPU, as in a
    hand-written loop with ``DataLoader(num_workers=N)``. Taking the workers' CPUs from the
    encoder instead starves a large encoder whose workers mostly wait (measured on 2 CPUs with
    ``--workers 2``: a 128-channel conv encoder 1.75x slower on 1 thread than on 2).

    Args:
        cpus: from :func:`usable_cpus`.
        workers: the ``--workers`` asked for, or None to choose.
        on_gpu: the encoder runs on an accelerator.

    Example:
        >>> bake_threads(2, None)
        BakeThreads(decode_workers=0, encoder_threads=2)
        >>> bake_threads(16, None)
        BakeThreads(decode_workers=4, encoder_threads=12)
        >>> bake_threads(2, 2)
        BakeThreads(decode_workers=2, encoder_threads=2)
    """
    cpus = max(1, cpus)
    if on_gpu:
        chosen = min(MAX_AUTO_WORKERS, cpus - 1)
        return BakeThreads(chosen if workers is None else workers, 1)
    if workers is not None:
        return BakeThreads(workers, cpus)
    workers = 0 if cpus <= 2 else min(MAX_AUTO_WORKERS, max(1, cpus // 4))
    return BakeThreads(workers, cpus - workers)
