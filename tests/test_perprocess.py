"""featbake.process: the one pid-stamped rule for state that must not cross fork."""

from __future__ import annotations

import os
import threading

from featbake.process import PerProcess, ProcessStamp


def _in_child(check) -> int:
    """Run ``check()`` in a forked child; its exit code (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            code = 0 if check() else 3
        except BaseException:
            code = 4
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_stamp_is_fresh_here_and_stale_in_a_forked_child() -> None:
    stamp = ProcessStamp()
    assert not stamp.stale
    assert _in_child(lambda: stamp.stale) == 0


def test_a_value_is_made_once_per_process_and_the_inherited_one_handed_back() -> None:
    made: list[int] = []
    inherited: list[object] = []

    def make() -> object:
        made.append(os.getpid())
        return object()

    holder = PerProcess(make, on_inherited=inherited.append)
    assert holder.peek() is None
    first = holder.get()
    assert holder.get() is first and holder.peek() is first and made == [os.getpid()]
    assert not inherited  # never called on this process's own value

    def child_sees_its_own() -> bool:
        assert holder.peek() is None  # the parent's value is not this process's
        mine = holder.get()
        return mine is not first and inherited == [first] and holder.get() is mine

    assert _in_child(child_sees_its_own) == 0
    assert holder.get() is first and made == [os.getpid()] and not inherited


def test_two_threads_make_one_value_with_the_lock() -> None:
    barrier = threading.Barrier(8)
    calls: list[int] = []

    def make() -> list[int]:
        calls.append(1)
        return []

    holder = PerProcess(make, lock=True)
    got: list[object] = []

    def worker() -> None:
        barrier.wait()
        got.append(holder.get())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)
