"""How many CPUs a build may use, and how to split them between decoding and encoding.

The rules are pure functions, tested over plain values; :func:`process_cpus` reads the affinity
mask and ``/sys/fs/cgroup`` for them (without torch: a command checks ``--workers`` and
``--threads`` against it before torch is imported).
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

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


def encoder_threads(asked: int | None, current: int, cpus: int, *, env_pinned: bool) -> int:
    """The encoder's torch intra-op threads: the user's setting, never featbake's guess.

    ``asked`` (``--threads N``) wins. Otherwise the count torch has now stays: the user's
    ``torch.set_num_threads``, ``OMP_NUM_THREADS``, an encoder factory's own setting (silero-vad
    sets 1) or torch's default. Overriding it made a many-small-ops model build 3.8x slower than
    the user's own loop on a node shared with other work (issue 19). The one change: a count
    above the CPUs this process may use (a container's CPU quota, which torch's default ignores)
    is lowered to them, unless ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (``env_pinned``) set it.

    Example:
        >>> encoder_threads(None, 1, 2, env_pinned=False)  # the user's 1 stays
        1
        >>> encoder_threads(None, 64, 2, env_pinned=False)  # torch's default in a 2-CPU cgroup
        2
        >>> encoder_threads(3, 1, 2, env_pinned=True)  # --threads 3
        3
    """
    if asked is not None:
        return asked
    if current > cpus and not env_pinned:
        return max(1, cpus)
    return max(1, current)


def bake_threads(
    cpus: int, workers: int | None, threads: int, *, on_gpu: bool = False
) -> BakeThreads:
    """Decode workers for ``cpus`` beside an encoder on ``threads`` (from :func:`encoder_threads`).

    Chosen (``workers`` None): a CPU encoder decodes in its own process on up to 2 CPUs (workers
    there only steal the encoder's time: ~40% longer encoder calls measured with 2 workers on 2
    CPUs), and beyond uses one worker per 4 CPUs, as a hand-written loop would give its
    DataLoader; a GPU encoder needs one CPU thread to feed it, so the other CPUs decode. Asked
    for (``--workers N``): N workers. The encoder's threads are never lowered to make room: they
    are the user's (see :func:`encoder_threads`).

    Example:
        >>> bake_threads(2, None, 2)
        BakeThreads(decode_workers=0, encoder_threads=2)
        >>> bake_threads(16, None, 16)
        BakeThreads(decode_workers=4, encoder_threads=16)
        >>> bake_threads(8, None, 1, on_gpu=True)
        BakeThreads(decode_workers=7, encoder_threads=1)
    """
    cpus = max(1, cpus)
    if workers is not None:
        return BakeThreads(workers, threads)
    if on_gpu:
        return BakeThreads(min(MAX_AUTO_WORKERS, cpus - 1), threads)
    chosen = 0 if cpus <= 2 else min(MAX_AUTO_WORKERS, max(1, cpus // 4))
    return BakeThreads(chosen, threads)


# -- this process ------------------------------------------------------------------------------
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: str | os.PathLike[str] = CGROUP_ROOT, own: str | None = None) -> float:
    """This process's cgroup CPU quota in CPUs (``inf``: none), the tightest of v2 and v1 files.

    Args:
        root: where the cgroup filesystem is mounted (tests pass a folder of fake files).
        own: this process's cgroup path (default: read from ``/proc/self/cgroup``).

    Example:
        >>> cgroup_cpu_limit("/nonexistent", own="/")
        inf
    """
    root = Path(root)
    own = _own_cgroup() if own is None else own
    folders = [root] + ([root / own.strip("/")] if own.strip("/") else [])
    limits = [parse_cpu_max(_read(d / "cpu.max", "max")) for d in folders]
    v1 = root / "cpu"
    limits.append(parse_cfs_quota(_read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")))
    return min(limits)


def _read(path: Path, missing: str = "") -> str:
    try:
        return path.read_text()
    except OSError:
        return missing


def _own_cgroup() -> str:
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        if line.startswith("0::"):  # the cgroup v2 unified hierarchy
            return line[3:].strip()
    return ""


def process_cpus() -> int:
    """CPUs this process may keep busy: affinity mask and cgroup quota, not ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        affinity: Any = os.sched_getaffinity(0)
    else:  # macOS, Windows
        affinity = range(os.cpu_count() or 1)
    return usable_cpus(affinity, cgroup_cpu_limit())
