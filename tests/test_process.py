"""featbake.process: the one pid-stamped rule for state that must not cross fork."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import featbake
from featbake.process import PerProcess, PerThread, ProcessLocal, ProcessLocalState, ProcessStamp
from featbake.store.blocks import BlockPlan
from featbake.store.bucket import BucketStore
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.store.url import BucketURL
from tests.conftest import live_features
from tests.helpers import bake, held_by_a_thread

TOL = {"rtol": 1e-5, "atol": 1e-6}  # the CPU kernels may round differently by batch size


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


#: A process whose fork begins while garbage with a finalizer waits for the collector, which the
#: fork hooks' first allocation runs on the forking thread: the finalizer makes a per-thread or
#: a locked per-process value (a dropped dataset's last-use flush opening a catalog connection).
_COLLECTED_AT_THE_FORK = """
import gc, os, sys, weakref
from featbake.process import PerProcess, PerThread, ProcessLocalState
class Conns(ProcessLocalState):
    conn = PerThread(lambda self: [])
holder, pool, made = Conns(), PerProcess(list, lock=True), []
def finalizer():
    made.append(holder.conn if sys.argv[1] == "per-thread" else pool.get())
class Cycle:
    pass
gc.disable()
garbage = Cycle()
garbage.me = garbage
weakref.finalize(garbage, finalizer)
del garbage
gc.set_threshold(1)
gc.enable()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("made", len(made))
"""


@pytest.mark.parametrize("value", ["per-thread", "per-process"])
def test_a_finalizer_the_collector_runs_inside_a_fork_hook_does_not_hang_the_fork(
    value: str,
) -> None:
    """Round eleven, holds: the fork hooks hold the per-thread registry's lock and each locked
    per-process value's; a finalizer the collector ran on the forking thread inside them (a
    dropped dataset's last-use flush, opening its catalog connection) took one again and the
    thread waited on itself for ever: a fork-mode DataLoader's start hung. Both are
    reentrant now."""
    run = subprocess.run(
        [sys.executable, "-c", _COLLECTED_AT_THE_FORK, value],
        capture_output=True,
        text=True,
        timeout=120,  # a hang, not a slow machine: the fork takes milliseconds
        check=False,
    )
    assert (run.returncode, run.stdout.strip()) == (0, "made 1"), run.stderr


# == the classes that hold per-process state =======================================================
def test_every_class_holding_a_process_local_has_the_one_pickling_rule() -> None:
    """No class writes its own pair to drop handles: each holder mixes in ProcessLocalState,
    and no module but featbake.process registers a fork hook. A class with pickling methods
    of its own is a ProcessLocalState (an extra rule beside the one) or holds a cache that
    stays valid in a forked child and only a pickled copy must compute again (a loaded
    encoder, a module's fingerprint)."""
    package = Path(featbake.__file__).parent
    caches = {"LiveEncoder", "ModuleWatch"}
    holders = []
    for path in sorted(package.rglob("*.py")):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            made_here = isinstance(obj, type) and obj.__module__ == name
            kinds = (ProcessLocal, PerThread)
            if made_here and any(isinstance(v, kinds) for v in vars(obj).values()):
                holders.append(obj)
            own_rule = made_here and {"__getstate__", "__setstate__"} & set(vars(obj))
            if own_rule and obj.__name__ not in caches and name != "featbake.process":
                assert issubclass(obj, ProcessLocalState), obj
        text = path.read_text()
        if "register_at_fork(" in text:
            assert name == "featbake.process", name
    assert len(holders) >= 5  # the bucket client, shard handles, catalog, dataset, CachedEncoder
    assert all(issubclass(h, ProcessLocalState) for h in holders), holders


def test_a_pickled_read_only_reader_stays_read_only_and_reads_the_store(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A FeatureReader's pickled copy kept only layout, max_open and verify, so a reader told to
    only read came back read-write (its catalog then wrote caches to a store it must not)."""
    result = bake(audio_dir, encoder_file, store_dir)
    layout = Layout(store_dir)
    with Catalog(layout) as cat:
        items = cat.root_items(result.root)
    reader = FeatureReader(layout, read_only=True, max_open=3)
    rel, key = items[0]
    first = reader.get(key)
    assert first is not None and reader.catalog.read_only
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.catalog.read_only and copy.handles.max_open == 3
    assert not list(copy.handles)  # no open shard crossed
    for rel, key in items:
        got = copy.get(key)
        assert got is not None
        torch.testing.assert_close(got[""], live_features(encoder_file, audio_dir / rel))
    assert list(reader.handles)  # the original's readers are its own, still open
    copy.close()
    reader.close()


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_forked_child_reads_through_its_own_readers(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """The child closes its copies of the parent's shard fds on first use and opens its own;
    the parent's stay open and keep reading."""
    result = bake(audio_dir, encoder_file, store_dir)
    layout = Layout(store_dir)
    with Catalog(layout) as cat:
        items = cat.root_items(result.root)
    reader = FeatureReader(layout)
    for _, key in items:
        reader.get(key)
    parents = {p: r.fd for p, r in reader.handles.open_readers.items()}
    assert parents
    want = [live_features(encoder_file, audio_dir / rel) for rel, _ in items]

    def child() -> bool:
        torch.set_num_threads(1)  # as DataLoader workers do: OpenMP's pool is not fork-safe
        mine = [reader.get(key) for _, key in items]  # first use: the inherited fds closed
        shards = {str(p) for p in store_dir.rglob("*.safetensors")}
        open_here = [fd for fd in os.listdir("/proc/self/fd") if _target(fd) in shards]
        assert len(open_here) == len(reader.handles.open_readers)  # its own, none of the parent's
        return all(torch.allclose(m[""], w, **TOL) for m, w in zip(mine, want, strict=True))

    assert _in_child(child) == 0
    assert {p: r.fd for p, r in reader.handles.open_readers.items()} == parents
    assert all(_target(str(fd)) == str(p) for p, fd in parents.items())  # open in the parent
    assert reader.get(items[0][1]) is not None
    reader.close()


def test_a_child_forked_during_bucket_prefetches_starts_its_own(tmp_path: Path) -> None:
    """A DataLoader worker forked while the parent's two background fetches ran inherited
    their names (and so never prefetched: the threads that would clear them are not in the
    child) and their lock, held by a parent thread (so the child's next hint hung)."""
    store = BucketStore(BucketURL.parse("s3://team/features"), tmp_path / "tier", 1 << 20)
    store._prefetching.update({"a" * 64, "b" * 64})  # two fetches in flight here

    def child() -> bool:
        signal.alarm(20)  # a hang fails the test instead of stalling it
        return store.prefetches_in_flight() == 0

    with held_by_a_thread(store._prefetch_lock):  # a fetch thread inside the lock at the fork
        code = _in_child(child)
    assert code == 0
    assert store.prefetches_in_flight() == 2  # the parent's own, untouched


def test_a_forked_child_never_follows_its_parents_block_plan(tmp_path: Path) -> None:
    """The plan a bucket store's reads follow is this process's (a ProcessLocal, as its
    prefetches): a forked worker reads as without a plan until it is given its own."""
    store = BucketStore(BucketURL.parse("s3://team/features"), tmp_path / "tier", 1 << 20)
    plan = BlockPlan([["a" * 64], ["b" * 64]])
    store._plan = plan
    assert store._following() is plan
    assert _in_child(lambda: store._following() is None) == 0
    assert store._following() is plan  # the parent's own, untouched
    copy = pickle.loads(pickle.dumps(store))
    assert copy._following() is None


class _Conns(ProcessLocalState):
    """One value per thread and process (a list standing in for a SQLite connection)."""

    conn: PerThread[list[str]] = PerThread(lambda self: [threading.current_thread().name])


def test_each_thread_makes_its_own_and_a_forked_child_keeps_every_threads_unused() -> None:
    """A child frees the parent's other threads' thread-locals before any fork hook runs
    (collecting a SQLite connection closes it): every thread's value is kept referenced there,
    never handed out; the child's threads make their own. A pickled copy makes its own."""
    from featbake.process import INHERITED_ACROSS_FORK

    c = _Conns()
    mine = c.conn
    assert c.conn is mine and _Conns.conn.peek(c) is mine
    made, done = threading.Event(), threading.Event()
    theirs: list[list[str]] = []

    def other() -> None:
        theirs.append(c.conn)
        made.set()
        done.wait(30)

    t = threading.Thread(target=other, name="other")
    t.start()
    made.wait(10)
    assert theirs[0] is not mine and theirs[0] == ["other"]

    def child() -> bool:
        kept = [id(v) for v in INHERITED_ACROSS_FORK]
        fresh = _Conns.conn.peek(c) is None and c.conn is not mine
        return fresh and id(mine) in kept and id(theirs[0]) in kept

    code = _in_child(child)
    done.set()
    t.join()
    assert code == 0 and c.conn is mine
    assert pickle.loads(pickle.dumps(c)).conn is not mine
    assert _Conns.conn.reset(c) is mine and _Conns.conn.peek(c) is None
    assert c.conn is not mine


class _Empty(ProcessLocalState):
    """A per-process value that is falsy (an empty set, as a bucket's in-flight prefetches)."""

    calls: ClassVar[list[int]] = []

    def _make(self) -> set[str]:
        _Empty.calls.append(1)
        time.sleep(0.01)
        return set()

    value: ProcessLocal[set[str]] = ProcessLocal(_make, lock=True)


def test_an_empty_value_made_under_the_lock_is_made_once() -> None:
    e = _Empty()
    barrier = threading.Barrier(6)
    got: list[set[str]] = []

    def worker() -> None:
        barrier.wait()
        got.append(e.value)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _Empty.calls == [1] and all(g is got[0] for g in got)


def test_a_finalizer_the_collector_runs_inside_a_make_gets_the_one_value() -> None:
    """The fork hooks' locks became reentrant (round eleven) so that a finalizer on the thread
    holding one no longer waits on itself; a locked ProcessLocal's make holds the same lock,
    and a finalizer the collector runs at an allocation inside it that uses the same attribute
    (a dropped holder's flush reaching a shared pool or client) now passes the lock and, finding
    no value yet, makes one of its own. The outer make then stores its value over it: the
    finalizer used a value the attribute never keeps (a pool's threads, a client's sockets
    orphaned), and ``make`` ran twice where the lock promises once.

    The rule now: the first value stored is the one. The finalizer's nested make stores its
    value and uses it; the outer make, finding it stored, returns it and drops its own, which
    no caller ever got (a pool never submitted to has no threads). The nested make cannot be
    avoided (the outer one is under way, its value not yet made), so ``make`` runs twice, but
    every caller, the finalizer included, gets the one value the attribute keeps."""
    import gc

    made: list[list[int]] = []
    seen: list[list[int]] = []

    class Holder(ProcessLocalState):
        def _make(self) -> list[int]:
            gc.collect()  # what the make's first allocation may do
            value = [len(made)]
            made.append(value)
            return value

        value: ProcessLocal[list[int]] = ProcessLocal(_make, lock=True)

    holder = Holder()

    class Cycle:
        me: object = None

    def use_it_at_collection() -> None:
        garbage = Cycle()
        garbage.me = garbage
        weakref.finalize(garbage, lambda: seen.append(holder.value))

    got: list[list[int]] = []
    gc.disable()
    try:
        use_it_at_collection()  # garbage whose finalizer uses the attribute, not collected yet
        t = threading.Thread(target=lambda: got.append(holder.value), daemon=True)
        t.start()
        t.join(60)  # a hang (a plain lock) fails here, not in pytest
    finally:
        gc.enable()
    assert not t.is_alive(), "a finalizer inside the make waited on the make's own lock"
    assert seen == got == [holder.value] and seen[0] is got[0] is holder.value, (seen, got)
    assert holder.value is made[0] and len(made) == 2, made  # the outer make's [1]: unused
