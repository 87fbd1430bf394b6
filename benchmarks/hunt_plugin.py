"""`make hunt`: the suite run where races and many-core paths show (a pytest plugin).

Loaded only by ``make hunt`` (``-p benchmarks.hunt_plugin``); benchmarks/ is outside the test
paths, so ``make test`` never imports it. In every pytest process it (and the children those
fork) runs in:

- 16 CPUs: ``featbake.cpus.process_cpus``, ``os.cpu_count`` and ``os.sched_getaffinity``
  report :data:`CPUS`, so a 2-core machine takes the paths a big node does (a build's forked
  decode workers, wide reads, pools sized by the CPU count). Spawned children and CLI
  subprocesses see the machine's own CPUs.
- The cyclic collector every 60 allocations (``gc.set_threshold(60, 5, 5)``; CPython's default
  is 700, 10, 10): finalizers run at many more points, inside locks and transactions, where a
  race between a finalizer and the code it interrupts shows.

A failure found so is repeated with ``make hunt HUNT_ARGS="tests/the_file.py -n 0"`` and then
written as a test of its own that forces the same moment (a ``gc.collect()`` at the point, a
patched CPU count), never left to this plugin.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest

#: The CPUs every hunted process reports.
CPUS = 16
#: The cyclic collector's thresholds while hunting (generation 0 every 60 allocations).
GC_THRESHOLD = (60, 5, 5)


def sixteen_cpus() -> int:
    """What ``featbake.cpus.process_cpus`` and ``os.cpu_count`` say while hunting."""
    return CPUS


def sixteen_cpu_mask(pid: int) -> set[int]:
    """What ``os.sched_getaffinity`` says while hunting (for any process)."""
    return set(range(CPUS))


def report_many_cpus() -> None:
    """Patch the three CPU counts here, and every featbake module that imported
    ``process_cpus`` by name; modules imported later take the patched one."""
    import featbake.cpus  # where it is defined; no torch (featbake.device imports it by name)

    real = featbake.cpus.process_cpus
    os.cpu_count = sixteen_cpus
    if hasattr(os, "sched_getaffinity"):
        os.sched_getaffinity = sixteen_cpu_mask
    for name, module in list(sys.modules.items()):
        if name.startswith("featbake") and getattr(module, "process_cpus", None) is real:
            module.process_cpus = sixteen_cpus  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    # After pytest-xdist sized `-n auto` (at pytest_cmdline_main) by the machine's own CPUs.
    report_many_cpus()
    gc.set_threshold(*GC_THRESHOLD)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"hunt: {CPUS} CPUs reported, gc threshold {GC_THRESHOLD}"]


def pytest_runtest_setup(item: Any) -> None:
    # A test that set its own thresholds (or featbake.gcpause's restore) leaves the next as hunted.
    if gc.get_threshold() != GC_THRESHOLD:
        gc.set_threshold(*GC_THRESHOLD)
