"""The daemon threads a stop may leave behind (featbake/threadpool.py)."""

from __future__ import annotations

import threading

import pytest

from featbake.threadpool import DaemonThreads, map_in_threads


def test_results_come_in_order_and_a_finished_pool_leaves_no_thread() -> None:
    assert list(map_in_threads(lambda x: x * x, list(range(20)), threads=4)) == [
        x * x for x in range(20)
    ]
    with DaemonThreads(3, "featbake-test") as pool:
        futures = [pool.submit(pow, x, 2) for x in range(7)]
    assert [f.result() for f in futures] == [x * x for x in range(7)]
    assert not [t for t in threading.enumerate() if t.name.startswith("featbake-test")]


def test_a_stop_leaves_a_stuck_call_behind_on_a_daemon_thread_and_cancels_the_rest() -> None:
    """A call stuck for ever (an Event nobody sets, as a read of a server gone) does not hold
    the ``with`` that a stop leaves: what has not started is cancelled, and the stuck thread is
    a daemon, which the interpreter's exit does not join."""
    never, started = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        never.wait()

    with pytest.raises(KeyboardInterrupt), DaemonThreads(1, "featbake-stuck") as pool:
        first = pool.submit(stuck)
        later = pool.submit(pow, 2, 2)
        started.wait()
        raise KeyboardInterrupt  # the stop
    assert later.cancelled() and not first.done()
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("featbake-stuck")]
    assert thread.daemon
    never.set()  # let it go: the test process's own threads end clean
    thread.join()


def test_an_initializer_that_fails_fails_each_call_never_leaves_one_waiting() -> None:
    """A thread whose initializer raised ended at once, so the calls queued for it were never
    answered and a caller waiting on one waited for ever (ThreadPoolExecutor marks itself
    broken instead). Each call the thread takes now fails with the initializer's error."""

    def refuse() -> None:
        raise RuntimeError("no thread settings here")

    with DaemonThreads(1, "t-init", initializer=refuse) as pool:
        futures = [pool.submit(lambda x: x, i) for i in range(3)]
        for f in futures:
            with pytest.raises(RuntimeError, match="no thread settings here"):
                f.result(timeout=60)
