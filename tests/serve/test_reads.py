"""Batches read on several threads (serve/reads.py): the same rows, the same errors.

``MIN_PARALLEL_BYTES`` is lowered to 0 so the tiny test stores take the threaded path; each
batch is compared with live encoding, first epoch (checked rows) and later epoch (located rows),
read by the Python path on the pool and by the compiled read on threads it starts itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import featbake.serve.loader as loader_module
import featbake.serve.reads as row_pool
from featbake import native
from featbake.bake.pipeline import build
from featbake.errors import StoreCorrupt
from featbake.process import PerProcess
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import Waiting
from tests.conftest import live_features


@pytest.fixture
def threaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every batch on 2 threads of the pool, the Python read path's (the compiled read starts
    its own threads: ``compiled_threads``); yields the list that counts batches run on it."""
    calls: list[int] = []
    run_all = row_pool._run_all

    def counted(jobs):
        if threading.current_thread() is not threading.main_thread():
            calls.append(len(jobs))
        return run_all(jobs)

    monkeypatch.setattr(row_pool, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(row_pool, "read_threads", lambda: 2)
    monkeypatch.setattr(row_pool, "_run_all", counted)
    with native.fallback():
        yield calls


class _ThreadsAsked:
    """The compiled kernels, recording the threads each batch read was asked to run on."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read_rows(self, *args: Any) -> Any:
        self.threads.append(args[5])
        return self.inner.read_rows(*args)  # type: ignore[attr-defined]


@pytest.fixture
def compiled_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every batch on 2 threads of the compiled read; yields the threads each call was given."""
    if native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    asked = _ThreadsAsked(native.kernels())
    monkeypatch.setattr(row_pool, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(row_pool, "read_threads", lambda: 2)
    monkeypatch.setitem(native._state, "kernels", asked)
    return asked.threads


@pytest.mark.parametrize("path", ["threaded", "compiled_threads"])
def test_threaded_batches_equal_live_encoding_first_and_later_epochs(
    audio_dir: Path, encoder_file: Path, store_dir: Path, path: str, request: pytest.FixtureRequest
) -> None:
    threaded = request.getfixturevalue(path)
    # Small shards: a batch spans several shard files, read by different threads.
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=20_000)
    assert len(list((store_dir / "shards").rglob("*.safetensors"))) > 2
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(5)).tolist()
    for _epoch in range(2):  # first: checked reads (_fill); later: located reads
        loader = DataLoader(ds, batch_size=5, sampler=order, collate_fn=pad_collate)
        seen = 0
        for b, (padded, lengths) in enumerate(loader):
            for j, n in enumerate(lengths.tolist()):
                torch.testing.assert_close(padded[j, :n], want[order[b * 5 + j]])
                assert not padded[j, n:].any()  # the padding is zeros
                seen += 1
        assert seen == len(ds)
    assert threaded, "no batch ran on the pool"
    assert path == "threaded" or set(threaded) == {2}  # the compiled read: 2 threads a batch
    assert ds.cache_info().store_reads == 2 * len(ds)  # every row read from the store


@pytest.mark.parametrize("path", ["threaded", "compiled_threads"])
def test_a_corrupt_row_read_on_a_thread_raises_and_is_never_served(
    audio_dir: Path, encoder_file: Path, store_dir: Path, path: str, request: pytest.FixtureRequest
) -> None:
    threaded = request.getfixturevalue(path)
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    (shard,) = list((store_dir / "shards").rglob("*.safetensors"))
    blob = bytearray(shard.read_bytes())
    blob[-100] ^= 0xFF  # the last tensor's data
    os.chmod(shard, 0o644)
    shard.write_bytes(bytes(blob))
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    with pytest.raises(StoreCorrupt, match="checksum mismatch"):
        ds.__getitems__(list(range(len(ds))))
    assert threaded


def test_run_rows_runs_every_job_and_raises_the_first_error_after_all_finished() -> None:
    done: list[int] = []

    def job(k: int) -> None:
        time.sleep(0.01 * (k % 3))
        done.append(k)
        if k in (2, 5):
            raise ValueError(f"row {k}")

    with pytest.raises(ValueError, match=r"row [25]"):
        row_pool.run_rows([lambda k=k: job(k) for k in range(8)], nbytes=1 << 30, threads=3)
    assert sorted(done) == list(range(8))  # no job was still running when the error came


def test_small_batches_and_workers_stay_on_the_callers_thread() -> None:
    threads: set[str] = set()
    jobs = [lambda: threads.add(threading.current_thread().name) for _ in range(4)]
    row_pool.run_rows(jobs, nbytes=row_pool.MIN_PARALLEL_BYTES - 1, threads=4)
    assert threads == {threading.current_thread().name}
    row_pool.run_rows(jobs, nbytes=1 << 30, threads=4)
    assert len(threads) > 1


def _open_shard_files(store: Path) -> int:
    """Files of ``store`` this process has open now (its descriptors, as /proc lists them)."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if _link(fd).startswith(f"{store.resolve()}/shards/"))


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return ""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_batch_over_more_shards_than_kept_open_reads_each_row_then_closes_them(
    audio_dir: Path, encoder_file: Path, store_dir: Path, threaded: list[int]
) -> None:
    # One open shard at a time: opening the batch's last shard evicted its first ones, which
    # stay leased (open) until the batch is read, each row from its own shard, and close after.
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, on_miss="error", max_open_shards=1
    )
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    idx = list(range(len(ds)))[::-1]
    padded, lengths = pad_collate(ds.__getitems__(idx))
    for row, i in enumerate(idx):
        torch.testing.assert_close(padded[row, : lengths[row]], want[i])
    assert len(ds._state.open_readers) == 1
    assert _open_shard_files(store_dir) == 1  # the evicted ones closed once the batch was read


def test_a_fork_while_another_thread_makes_the_pool_leaves_the_child_a_free_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 22 item 6: the pool's module lock was not held across fork. A child forked while
    another thread was making the pool got a copy of the lock that no thread would ever
    release, and hung at its first threaded batch. The child runs a threaded batch here, under
    a deadline (a regression fails, it does not hang the run)."""
    holding, done = threading.Event(), threading.Event()

    def slow_pool() -> ThreadPoolExecutor:
        holding.set()
        time.sleep(0.5)  # a thread inside the holder's lock, for longer than usual
        return ThreadPoolExecutor(2)

    monkeypatch.setattr(row_pool, "_pools", PerProcess(slow_pool, lock=True))

    def hold() -> None:
        row_pool._pools.get()
        done.set()

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    pid = os.fork()
    if pid == 0:  # the child: one threaded batch, then out without running the parent's atexit
        ran: list[int] = []
        row_pool.run_rows([lambda k=k: ran.append(k) for k in range(4)], 1 << 30, threads=2)
        os._exit(0 if sorted(ran) == [0, 1, 2, 3] else 3)
    forked_after_release = done.is_set()  # fork waited for the holder to let go
    deadline = time.monotonic() + 20
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if status[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the row pool's lock")
    holder.join()
    assert os.waitstatus_to_exitcode(status[1]) == 0 and forked_after_release


def test_the_read_thread_cap_holds_on_its_own_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_pool, "_cpus", PerProcess(lambda: 4))
    assert row_pool.read_threads() == 4
    seen: list[int] = []
    with row_pool.read_threads_at_most(1):
        assert row_pool.read_threads() == 1
        other = threading.Thread(target=lambda: seen.append(row_pool.read_threads()))
        other.start()
        other.join()
        with row_pool.read_threads_at_most(None):
            assert row_pool.read_threads() == 4
        assert row_pool.read_threads() == 1
    assert row_pool.read_threads() == 4 and seen == [4]


def test_the_loader_reads_on_one_thread_while_the_loop_has_a_batch_waiting(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second read thread beside a training step on its own CPUs only takes turns with it:
    # the loader reads wide while the loop may be waiting (an empty queue), narrow while not.
    from featbake import FeatureLoader

    if native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    asked = _ThreadsAsked(native.kernels())
    monkeypatch.setattr(row_pool, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(row_pool, "_cpus", PerProcess(lambda: 2))
    monkeypatch.setitem(native._state, "kernels", asked)
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    for _epoch in range(2):  # first: checked reads (_fill); later: located reads
        asked.threads.clear()
        seen = 0
        for b, (padded, lengths) in enumerate(FeatureLoader(ds, 2, shuffle=False, prefetch=2)):
            time.sleep(0.05)  # a step: the reader fills the queue meanwhile
            for j, n in enumerate(lengths.tolist()):
                torch.testing.assert_close(padded[j, :n], want[2 * b + j])
                seen += 1
        assert seen == len(ds)
        assert asked.threads[0] == 2  # the first batch: the loop waits for it
        assert 1 in asked.threads  # later ones while the loop had a batch to go on with


class _CountedWaits(Waiting):
    """The loader's ``Waiting``, counting each time the training thread starts to wait for a
    batch (its first wait included), so a test can see that the loop waits now."""

    waits = 0
    changed = threading.Condition()

    @property  # type: ignore[override]
    def now(self) -> bool:
        return self.__dict__.get("_now", False)

    @now.setter
    def now(self, value: bool) -> None:
        with _CountedWaits.changed:
            if value and not self.__dict__.get("_now", False):
                _CountedWaits.waits += 1
                _CountedWaits.changed.notify_all()
            self.__dict__["_now"] = value


class _AfterTheLoopWaits(torch.utils.data.Dataset):
    """A dataset whose batch ``k``, once read, waits until the loop took batch ``k - 1`` (handed
    over during this read) and waits for batch ``k``: so the reader plans batch ``k + 1``'s
    threads while the loop waits, with batch ``k`` held and none queued."""

    def __init__(self, inner: CachedFeatureDataset) -> None:
        self.inner = inner
        self.calls = 0
        with _CountedWaits.changed:
            _CountedWaits.waits = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, idx: list[int]) -> Any:
        got = self.inner.__getitems__(idx)
        self.calls += 1
        with _CountedWaits.changed:
            waited = _CountedWaits.changed.wait_for(
                lambda: _CountedWaits.waits >= self.calls, timeout=60
            )
        assert waited, "the loop never came back to wait for the batch just read"
        return got


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_loop_waiting_for_every_batch_has_each_read_wide(
    audio_dir: Path,
    encoder_file: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    # Read only: the loop waits for every batch. The reader holds batch k until batch k + 1's
    # rows are read, so a waiting loop has none to go on with though one batch is held: batch
    # k + 1 is read wide. The old rule (any batch ready: one thread) read every batch after the
    # first on one thread: FeatureLoader read-only at ~0.55x DataLoader(num_workers=0) on 2 CPUs
    # (issue 31). The dataset returns batch k once the loop waits for it, so the reader plans
    # each batch's threads while the loop waits, however the threads are scheduled.
    from featbake import FeatureLoader

    if path == "compiled" and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    monkeypatch.setattr(row_pool, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(row_pool, "_cpus", PerProcess(lambda: 2))
    asked: list[int] = []
    read_threads = row_pool.read_threads

    def recorded() -> int:
        asked.append(read_threads())
        return asked[-1]

    monkeypatch.setattr(row_pool, "read_threads", recorded)
    monkeypatch.setattr(loader_module, "Waiting", _CountedWaits)
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    try:
        with native.fallback() if path == "python" else contextlib.nullcontext():
            for _epoch in range(2):  # first: checked reads (_fill); later: located reads
                asked.clear()
                slow = _AfterTheLoopWaits(ds)
                got: list[torch.Tensor] = []
                for padded, lengths in FeatureLoader(slow, 2, shuffle=False, prefetch=2):
                    got += [padded[j, :n] for j, n in enumerate(lengths.tolist())]
                assert len(asked) == slow.calls > 1 and all(t == 2 for t in asked), asked
                assert len(got) == len(ds)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w)
    finally:
        sys.setswitchinterval(switch)


def _with_sharing(item: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A worker's collate_fn for one item per step: the item, and whether it was read into
    shared memory in the worker (before the DataLoader sends it)."""
    return item, item.is_shared()


def test_a_workers_item_is_read_into_shared_memory_and_served_as_live(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """One item per step through DataLoader workers: each item is read into shared memory in
    its worker (torch would copy it there again before sending it), and still equals running
    the encoder now, first epoch (checked) and later epoch (located) alike."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    for _epoch in range(2):
        loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=_with_sharing)
        seen = [(item, shared) for item, shared in loader]
        assert [shared for _, shared in seen] == [True] * len(ds)
        for i, (item, _) in enumerate(seen):
            torch.testing.assert_close(item, want[i])
    assert ds[0].is_shared() is False  # the main process reads into its own memory
