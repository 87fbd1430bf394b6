"""How the encoder's idle OpenMP threads wait, chosen from how busy the node is (a leaf).

torch's OpenMP runtime (libgomp in the wheels) keeps a thread that finished its part of a
parallel op spinning for a while before it sleeps, so that the next op starts without a
wake-up. On a node where every CPU is already taken, a spinning thread burns the time slice
its team-mate needs to reach the barrier it waits at, and the team crawls: a 32-channel conv
encoder's build of 120 clips beside other work (1-minute load 7-15 on 2 CPUs, two busy
processes more) took 16-219 s, and the user's own loop 3-492 s, against 0.7 s quiet. With
``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep at once) the same build took 1.3-8.4 s. On a
quiet node passive waiting costs a wake-up per op: that conv build 1.16x, so it is chosen only
where the node is busy (issue 42 item 4).

The runtime reads the policy once, when torch loads it: the command line's build child sets it
in its environment before it imports torch (:mod:`featbake.cli.supervise`). A user's own
setting (any of :data:`WAIT_SETTINGS`) is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

#: Settings by which a user chose how OpenMP threads wait (libgomp's and Intel's runtime's).
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
#: The node is busy when its 1-minute load average reaches this many runnable tasks per CPU:
#: above 1.0 so that a build's own last minute (a previous build, its decode thread) does not
#: count a quiet node as busy.
BUSY_LOAD_PER_CPU = 1.5
#: Where Linux keeps the load averages (``os.getloadavg`` elsewhere).
LOADAVG = Path("/proc/loadavg")


def node_is_busy(load: float, cpus: int) -> bool:
    """Whether a node with ``cpus`` CPUs and this 1-minute ``load`` has no CPU to spare.

    Both are the node's, not the job's: Linux's load average counts every runnable task of
    the host, in a container too.

    Example:
        >>> node_is_busy(0.8, 2), node_is_busy(3.0, 2), node_is_busy(40.0, 64)
        (False, True, False)
    """
    return load >= BUSY_LOAD_PER_CPU * max(1, cpus)


def wait_policy(env: Mapping[str, str], load: float, cpus: int) -> str | None:
    """The ``OMP_WAIT_POLICY`` to set for a build, or None to leave the environment as it is.

    Example:
        >>> wait_policy({}, 6.0, 2), wait_policy({}, 0.5, 2)
        ('PASSIVE', None)
        >>> wait_policy({"OMP_WAIT_POLICY": "active"}, 6.0, 2) is None  # the user's choice
        True
    """
    if any(env.get(name, "").strip() for name in WAIT_SETTINGS):
        return None
    return "PASSIVE" if node_is_busy(load, cpus) else None


def node_load() -> float:
    """The node's 1-minute load average (0.0 where it cannot be read)."""
    try:
        return float(LOADAVG.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def choose_wait_policy(env: MutableMapping[str, str]) -> str | None:
    """Set ``OMP_WAIT_POLICY`` in ``env`` as :func:`wait_policy` says for this node now; returns
    what was set (None: nothing). Call it before torch is imported."""
    policy = wait_policy(env, node_load(), os.cpu_count() or 1)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return policy
