"""Reading the rows of one batch on several threads (the main process only).

A row's read is a ``pread`` from the page cache and, on its first read in a process, a CRC-32C
of the bytes: both release the GIL, and together they are ~95% of a batch's time. On 2 CPUs,
two threads read a batch of 32 fp32 ``[T, 768]`` rows in about half the time. All bookkeeping
(which rows were checked, the handles' LRU order, the RAM tier) stays on the caller's thread:
a row job touches only its own slice of the batch and the shard's read-only file descriptor.

No pool inside a DataLoader worker: there, ``num_workers`` processes already share the CPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import get_worker_info

from featbake.device import process_cpus
from featbake.perprocess import PerProcess
from featbake.store.reader import Span, read_spans

#: Below this many bytes a batch is read on the caller's thread: a hand-off costs ~20 us.
MIN_PARALLEL_BYTES = 4 << 20
#: More threads than this only contend for memory bandwidth.
MAX_THREADS = 4

RowJob = Callable[[], None]


def _new_pool() -> ThreadPoolExecutor:
    # MAX_THREADS at most; a run submits threads - 1 parts, and threads start only when needed.
    return ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="featbake-read")


#: This process's pool: a forked child makes its own (the parent's threads are not there), and
#: the holder's lock is held across fork(), so a parent thread making the pool at that moment
#: cannot leave the child a lock held forever (its first batch would hang).
_pools: PerProcess[ThreadPoolExecutor] = PerProcess(_new_pool, lock=True)
#: The CPUs this process may use (affinity + cgroup files, ~76 us), counted once per process.
_cpus: PerProcess[int] = PerProcess(process_cpus)


def read_threads() -> int:
    """Threads a batch may be read on here: the CPUs this process may use, 1 in a worker."""
    if get_worker_info() is not None:
        return 1
    return max(1, min(MAX_THREADS, _cpus.get()))


def run_rows(jobs: Sequence[RowJob], nbytes: int, threads: int | None = None) -> None:
    """Run every row job, on ``threads`` threads when the batch is large enough.

    Each thread runs a contiguous run of rows. The first exception raised by a job (a short
    read, a checksum mismatch) is raised here after every job has finished, so no thread is
    still writing into the batch when the caller sees it.
    """
    run = RowRun(nbytes, threads)
    parts = run.split(len(jobs))
    for part in parts[:-1]:
        run.submit(jobs[part])
    run.run_here(jobs[parts[-1]] if parts else [])


def read_rows(
    rows: Sequence[Any], nbytes: int, span_of: Callable[[Any], Span] | None = None
) -> None:
    """Read a batch's rows with :func:`~featbake.store.reader.read_spans`, a run per thread.

    ``rows`` are spans, or made into spans by ``span_of``, on this thread, just before their
    run is handed to the pool: making the last run's spans (Python, under the GIL: checksum
    descriptors) then overlaps the pool reading the first ones. Errors are raised as by
    :func:`run_rows`, after every run has finished.
    """
    run = RowRun(nbytes)
    parts = run.split(len(rows))
    for k, part in enumerate(parts):
        chunk = rows[part]
        spans = chunk if span_of is None else [span_of(r) for r in chunk]
        job = functools.partial(read_spans, spans)
        if k < len(parts) - 1:
            run.submit([job])
        else:
            run.run_here([job])


class RowRun:
    """One batch's row jobs: the first runs handed to the pool, the last run on this thread.

    The caller may build each run's jobs just before handing it over, so that building the
    last run's jobs (Python, under the GIL) overlaps the pool reading the first ones.
    """

    def __init__(self, nbytes: int, threads: int | None = None) -> None:
        threads = read_threads() if threads is None else threads
        self.threads = 1 if nbytes < MIN_PARALLEL_BYTES else max(1, threads)
        self._futures: list[Future[None]] = []

    def split(self, n: int) -> list[slice]:
        """``n`` rows as contiguous runs, one per thread (the last one is this thread's)."""
        k = max(1, min(self.threads, n))
        step = -(-n // k) if n else 0
        return [slice(s, min(n, s + step)) for s in range(0, n, step)] if n else []

    def submit(self, jobs: Sequence[RowJob]) -> None:
        """Hand a run of jobs to the pool (run here when there is no pool)."""
        if self.threads <= 1:
            _run_all(jobs)
            return
        self._futures.append(_pools.get().submit(_run_all, jobs))

    def run_here(self, jobs: Sequence[RowJob]) -> None:
        """Run the last run here, then wait for the pool's; raise the first error of any."""
        errors: list[BaseException] = []
        try:
            _run_all(jobs)
        except Exception as e:
            errors.append(e)
        for f in self._futures:
            failed = f.exception()
            if failed is not None:
                errors.append(failed)
        self._futures = []
        if errors:
            raise errors[0]


def _run_all(jobs: Sequence[RowJob]) -> None:
    for job in jobs:
        job()
