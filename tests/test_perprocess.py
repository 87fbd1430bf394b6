"""featbake.process: the one pid-stamped rule for state that must not cross fork."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from typing import Any, ClassVar

import pytest

from featbake.process import PerProcess, ProcessLocal, ProcessLocalState, ProcessStamp


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


# == ProcessLocal: the descriptor every class holding per-process state declares ==================
class _Holder(ProcessLocalState):
    """A class with one per-process value (a list standing in for open files) and plain state."""

    made: ClassVar[list[int]] = []  # pids that made a value, across instances
    inherited: ClassVar[list[object]] = []

    def _make(self) -> list[str]:
        _Holder.made.append(os.getpid())
        return [self.name]

    value: ProcessLocal[list[str]] = ProcessLocal(_make, on_inherited=inherited.append)

    def __init__(self, name: str) -> None:
        self.name = name


def _fresh_holder(name: str) -> _Holder:
    _Holder.made.clear()
    _Holder.inherited.clear()
    return _Holder(name)


def test_a_pickled_copy_carries_the_rest_and_makes_its_own_value() -> None:
    h = _fresh_holder("a")
    first = h.value
    copy = pickle.loads(pickle.dumps(h))
    assert copy.name == "a" and type(_Holder.value).__name__ == "ProcessLocal"
    assert _Holder.value.peek(copy) is None  # nothing crossed
    assert copy.value == ["a"] and copy.value is not first and h.value is first
    assert _Holder.made == [os.getpid(), os.getpid()]


class _Bare:
    """A class holding a per-process value without the pickling rule."""

    value: ProcessLocal[list[int]] = ProcessLocal(lambda self: [])


def test_a_class_without_the_pickling_rule_refuses_to_pickle_its_value() -> None:
    b = _Bare()
    pickle.dumps(b)  # nothing made yet: nothing per-process to carry
    b.value.append(1)
    with pytest.raises(TypeError, match="ProcessLocalState"):
        pickle.dumps(b)


def test_a_forked_child_makes_its_own_and_hands_back_the_parents() -> None:
    h = _fresh_holder("b")
    first = h.value
    assert _Holder.value.peek(h) is first

    def child() -> bool:
        assert _Holder.value.peek(h) is None  # the parent's is not this process's
        mine = h.value
        return (
            mine is not first
            and _Holder.inherited == [first]  # on_inherited got the parent's own object
            and h.value is mine
            and _Holder.made == [os.getppid(), os.getpid()]
        )

    assert _in_child(child) == 0
    assert h.value is first and not _Holder.inherited and _Holder.made == [os.getpid()]


def _report_in_worker(h: _Holder, parent_id: int, out: Any) -> None:
    out.put((id(h.value), h.value, [id(x) for x in _Holder.inherited], parent_id))


def test_a_multiprocessing_fork_worker_makes_its_own() -> None:
    h = _fresh_holder("c")
    first = h.value
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    worker = ctx.Process(target=_report_in_worker, args=(h, id(first), out))
    worker.start()
    value_id, value, inherited_ids, parent_id = out.get(timeout=60)
    worker.join(60)
    assert worker.exitcode == 0 and value == ["c"]
    assert inherited_ids == [parent_id] and value_id != parent_id
    assert h.value is first


def test_reset_returns_this_processs_value_and_the_next_use_makes_another() -> None:
    h = _fresh_holder("d")
    assert _Holder.value.reset(h) is None
    first = h.value
    assert _Holder.value.reset(h) is first and _Holder.value.peek(h) is None
    assert h.value is not first and len(_Holder.made) == 2


def test_threads_under_the_lock_make_one_value_per_instance() -> None:
    calls: list[int] = []

    class Slow(ProcessLocalState):
        def _make(self) -> object:
            calls.append(1)
            time.sleep(0.01)  # widen the window two makers would race in
            return object()

        value: ProcessLocal[object] = ProcessLocal(_make, lock=True)

    one, two = Slow(), Slow()
    barrier = threading.Barrier(8)
    got: list[tuple[object, object]] = []

    def worker() -> None:
        barrier.wait()
        got.append((one.value, two.value))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 and all(g == got[0] for g in got)
    assert got[0][0] is not got[0][1]


def test_the_lock_is_free_in_a_child_forked_while_another_thread_makes() -> None:
    """A thread inside make() when the process forks: the child's first use must not hang."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(ProcessLocalState):
        def _make(self) -> object:
            if threading.current_thread() is not threading.main_thread():
                entered.set()
                release.wait(10)
            return object()

        value: ProcessLocal[object] = ProcessLocal(_make, lock=True)

    b = Blocking()
    t = threading.Thread(target=lambda: b.value)
    t.start()
    entered.wait(10)
    release.set()  # fork waits for the lock, so the maker must be let go
    code = _in_child(lambda: b.value is not None)
    t.join()
    assert code == 0
