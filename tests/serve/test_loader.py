"""FeatureLoader (issue 19, items 2 and 3): batches read ahead on a thread, no worker processes,
and the next items' reads started early for a store that is not in the page cache.

It must yield exactly what a DataLoader over the same sampler order yields (labels through
StackDataset included), every item equal to running the encoder now, and split epochs over
ranks as DistributedSampler does; it hints each item of its own share once, before reading it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, StackDataset, Subset

import featbake.serve.loader as loader_module
from featbake import BlockSampler, CachedFeatureDataset, FeatureLoader, build, native, pad_collate
from featbake.errors import CacheMiss, ConfigError, StoreError
from featbake.pace import Pace, ReadsOn
from featbake.serve.loader import SAMPLE, WARM_STREAK, ReadAhead, reads_on_of, staging_to
from featbake.serve.sampling import EpochPlan
from featbake.testing import drop_page_cache, write_audio_folder
from tests.conftest import REPO, live_features

LOADER_THREAD = "featbake-loader"


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOADER_THREAD]


class _Indexable(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 40),
    world=st.integers(1, 5),
    data=st.data(),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    epoch=st.integers(0, 5),
)
def test_epoch_plan_is_distributed_samplers_order(
    n: int, world: int, data: st.DataObject, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    if n == 0 and not drop_last and world > 1:
        return  # DistributedSampler itself divides by zero padding an empty dataset
    sampler = DistributedSampler(
        _Indexable(n),
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    plan = EpochPlan(n, 3, shuffle, seed, epoch, rank, world, drop_last)
    assert plan.indices() == list(sampler)
    want = [b for b in DataLoader(_Indexable(n), 3, sampler=sampler, drop_last=drop_last)]
    assert plan.batches() == [b.tolist() for b in want]
    assert plan.batch_count() == len(want)


def test_ranks_cover_every_index_each_epoch() -> None:
    for epoch in range(3):
        seen = [i for r in range(3) for i in EpochPlan(10, 4, True, 7, epoch, r, 3).indices()]
        assert sorted(set(seen)) == list(range(10)) and len(seen) == 12  # 2 repeated to even out


@pytest.fixture
def baked(audio_dir: Path, encoder_file: Path, store_dir: Path) -> CachedFeatureDataset:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    return CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")


def _dataloader_batches(ds: object, seed: int, epoch: int, drop_last: bool = False) -> list:
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    loader = DataLoader(
        ds,  # type: ignore[arg-type]
        batch_size=5,
        sampler=sampler,
        collate_fn=pad_collate,
        drop_last=drop_last,
    )
    return list(loader)


def _assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_yields_the_dataloaders_batches_with_labels_and_live_features(
    baked: CachedFeatureDataset, encoder_file: Path
) -> None:
    labels = torch.arange(len(baked)) * 10
    ds = StackDataset(baked, labels)
    loader = FeatureLoader(ds, batch_size=5, seed=3, prefetch=2)
    assert len(loader) == 4  # 16 items
    for epoch in range(2):
        got = list(loader)  # each iter() is the next epoch
        _assert_same_batches(got, _dataloader_batches(ds, 3, epoch))
        seen = []
        for padded, lengths, labs in got:
            for row, n, label in zip(padded, lengths, labs, strict=True):
                i = int(label) // 10
                seen.append(i)
                want = live_features(encoder_file, Path(baked.path(i)))
                torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)
                assert not row[n:].any()  # padding is zeros
        assert sorted(seen) == list(range(len(baked)))
    loader.set_epoch(0)
    _assert_same_batches(list(loader), _dataloader_batches(ds, 3, 0))


def test_drop_last_and_no_shuffle(baked: CachedFeatureDataset) -> None:
    loader = FeatureLoader(baked, batch_size=5, shuffle=False, drop_last=True)
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    plain = DataLoader(baked, batch_size=5, collate_fn=pad_collate, drop_last=True)
    _assert_same_batches(batches, list(plain))


def test_misses_are_encoded_on_the_reader_thread(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # nothing built
    for padded, _lengths in FeatureLoader(ds, batch_size=4, shuffle=False):
        assert padded.shape[0] == 4
    assert ds.cache_info().encoded == len(ds)
    for i, (padded, lengths) in enumerate(FeatureLoader(ds, batch_size=1, shuffle=False)):
        want = live_features(encoder_file, Path(ds.path(i)))
        torch.testing.assert_close(padded[0, : lengths[0]], want, rtol=1e-5, atol=1e-5)


def test_a_read_error_reaches_the_training_loop_and_leaves_no_thread(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    build(audio_dir / "fixed", encoder_file, cache=store_dir, workers=0)  # 4 of the 16 clips
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    with pytest.raises(CacheMiss):
        for _ in FeatureLoader(ds, batch_size=4):
            pass
    assert _loader_threads() == []


def test_the_batches_before_a_failed_read_reach_the_loop_in_order(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    # The reader holds each batch until the next one's rows are read: a read that fails
    # (here a miss with on_miss="error") hands the held batch over first, then the error.
    build(audio_dir / "fixed", encoder_file, cache=store_dir, workers=0)  # 4 of the 16 clips
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    stored = (ds.placement().shards >= 0).tolist()
    batches = [list(range(b, min(len(ds), b + 2))) for b in range(0, len(ds), 2)]
    failing = next(k for k, idx in enumerate(batches) if not all(stored[i] for i in idx))
    assert failing >= 1  # batches before it to hand over
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    with pytest.raises(CacheMiss):
        for batch in FeatureLoader(ds, batch_size=2, shuffle=False, prefetch=1):
            got.append(batch)
    assert len(got) == failing
    for idx, (padded, lengths) in zip(batches[:failing], got, strict=True):
        for row, (i, n) in enumerate(zip(idx, lengths.tolist(), strict=True)):
            want = live_features(encoder_file, Path(ds.path(i)))
            torch.testing.assert_close(padded[row, :n], want, rtol=1e-5, atol=1e-5)
    assert _loader_threads() == []


def test_a_batch_reaches_the_loop_while_the_next_ones_rows_are_read(
    baked: CachedFeatureDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batch b is handed over just before batch b+1's rows are read, so the training thread
    # takes it while the reader reads with the GIL released. A hand-over after that read would
    # leave the second read waiting here for a batch the loop never got.
    taken = threading.Event()
    seen: list[bool] = []
    reads = [0]

    def hold() -> None:
        if threading.current_thread().name != LOADER_THREAD:
            return
        reads[0] += 1
        if reads[0] == 2:  # the second batch's rows: the first batch is the loop's by now
            seen.append(taken.wait(60))  # a bound for a broken loader, never reached here

    monkeypatch.setitem(native._state, "kernels", _HeldKernels(native.kernels(), hold))
    got = []
    loader = FeatureLoader(baked, batch_size=4, shuffle=False, prefetch=2, reads_on="thread")
    for batch in loader:
        got.append(batch)
        taken.set()
    assert seen == [True]
    _assert_same_batches(got, list(DataLoader(baked, batch_size=4, collate_fn=pad_collate)))


def test_pad_collate_takes_the_datasets_batch_with_no_item_views_made(
    baked: CachedFeatureDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch read in place is handed to pad_collate as its padded tensor: the 32 item views
    # PaddedBatch made (45-85 us a batch) were never read. Through a StackDataset the labels
    # are paired with the items, so there they are made.
    from featbake.serve.collate import PaddedBatch

    made: list[int] = []
    with_views = PaddedBatch.with_views

    def counted(self: PaddedBatch) -> PaddedBatch:
        made.append(len(self.lengths))
        return with_views(self)

    monkeypatch.setattr(PaddedBatch, "with_views", counted)
    want = list(DataLoader(baked, batch_size=4, collate_fn=pad_collate))
    made.clear()
    _assert_same_batches(list(FeatureLoader(baked, batch_size=4, shuffle=False)), want)
    subset = Subset(baked, list(range(8)))
    _assert_same_batches(list(FeatureLoader(subset, batch_size=4, shuffle=False)), want[:2])
    assert made == []
    labels = torch.arange(len(baked))
    stacked = list(FeatureLoader(StackDataset(baked, labels), batch_size=4, shuffle=False))
    for k, ((padded, lengths, got), (w_padded, w_lengths)) in enumerate(
        zip(stacked, want, strict=True)
    ):
        assert torch.equal(padded, w_padded) and torch.equal(lengths, w_lengths)
        assert got.tolist() == list(range(4 * k, 4 * k + 4))
    assert made and all(n == 4 for n in made)  # the views StackDataset pairs with labels
    firsts = [items[0] for items in FeatureLoader(baked, 4, shuffle=False, collate_fn=list)]
    assert all(torch.equal(f, w[0][0, : w[1][0]]) for f, w in zip(firsts, want, strict=True))


def test_a_loader_for_a_device_stages_through_the_prefetchers_pool(
    baked: CachedFeatureDataset,
) -> None:
    # FeatureLoader(device=...) and DevicePrefetcher share one Staging: the reader builds each
    # batch in its pool (page-locked on CUDA) and the copy reads it there; lengths and labels
    # are staged through the same pool. Run on the CPU with staging=True (plain copies).
    labelled = StackDataset(baked, torch.arange(len(baked)))
    for ds, staged_per_batch in ((baked, 1), (labelled, 2)):  # lengths (and labels)
        staged = FeatureLoader(ds, 4, shuffle=False, device="cpu", staging=True)
        assert staged.staging is not None
        pool, made, plain = staged.staging.pool, [], FeatureLoader(ds, 4, shuffle=False)
        for _ in range(2):
            got = list(staged)
            _assert_same_batches(got, list(plain))
            for batch in got:
                assert not any(pool.lent(t) for t in batch)  # copies, never a pool buffer
            assert len({b[0].data_ptr() for b in got}) == len(got)
            assert pool.stats().lent == 0  # every buffer given back
            made.append(pool.stats().allocations)
        assert made[1] == made[0]  # the same order again: the first epoch's buffers serve it
        assert staged.staging.copied == staged_per_batch * len(got) * 2
        it = iter(staged)
        next(it), next(it)  # a batch more is started on the device ahead of the loop
        assert staged.state_dict()["position"] == 2  # what the loop took, not what was staged
        del it
        assert _loader_threads() == []
        assert pool.stats().lent == 0


class _HeldRead:
    """Holds the loader thread's first read of each epoch between taking its shards'
    descriptors and using them (``os.preadv`` called, or the compiled ``read_rows`` handed its
    spans) until the test lets it go: meanwhile another thread evicts those shards."""

    def __init__(self, epochs: int) -> None:
        self.holding = [threading.Event() for _ in range(epochs)]
        self.go = [threading.Event() for _ in range(epochs)]
        self.armed: int | None = None  # the epoch whose first read is held next

    def hold(self) -> None:
        epoch = self.armed
        if epoch is not None and threading.current_thread().name == LOADER_THREAD:
            self.armed = None
            self.holding[epoch].set()
            self.go[epoch].wait(60)  # a bound for a broken test, never reached when it runs

    def release_all(self) -> None:
        for event in (*self.holding, *self.go):
            event.set()


class _HeldKernels:
    """The compiled kernels, each batch read first passing ``hold``."""

    def __init__(self, inner: Any, hold: Callable[[], None]) -> None:
        self.inner = inner
        self.hold = hold

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_rows(self, *args: Any) -> Any:
        self.hold()
        return self.inner.read_rows(*args)


def _hold_reads(held: _HeldRead, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of a shard passes ``held.hold`` once it has its descriptors."""
    if compiled:
        monkeypatch.setitem(native._state, "kernels", _HeldKernels(native.kernels(), held.hold))
        return
    preadv = os.preadv

    def held_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        if not flags:  # a read (a page-cache probe passes RWF_NOWAIT)
            held.hold()
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", held_preadv)


def _read_every_item(
    ds: CachedFeatureDataset, want: list[torch.Tensor], held: _HeldRead, stop: threading.Event
) -> list[str]:
    """The other thread: at each epoch's held read, ``ds[i]`` of every item (evicting the
    loader's shards), then lets the read go and goes on reading until ``stop``; what it saw
    wrong, one line each."""
    wrong: list[str] = []
    k = 0
    for holding, go in zip(held.holding, held.go, strict=True):
        holding.wait(60)
        try:
            for i in range(len(ds)):
                wrong += _compared(ds, i, want)
        finally:
            go.set()
    while not stop.is_set():
        wrong += _compared(ds, k % len(ds), want)
        k += 1
    return wrong


def _compared(ds: CachedFeatureDataset, i: int, want: list[torch.Tensor]) -> list[str]:
    try:
        got = ds[i]
    except Exception as e:
        return [f"ds[{i}]: {e}"]
    same = got.shape == want[i].shape and torch.allclose(got, want[i], rtol=1e-5, atol=1e-5)
    return [] if same else [f"ds[{i}] is not item {i}'s features"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_shard_evicted_by_another_thread_is_never_closed_under_a_loaders_read(
    audio_dir: Path,
    encoder_file: Path,
    store_dir: Path,
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue "round four" item 3: FeatureLoader reading while another thread calls ds[i], over
    more shards than max_open_shards; the evicted reader was closed under the loader's read
    (served another item's features, or "Bad file descriptor")."""
    if compiled and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)  # an item a shard
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, on_miss="error", max_open_shards=2
    )
    n = len(ds)
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(n)]
    held, stop, wrong = _HeldRead(2), threading.Event(), []
    _hold_reads(held, compiled, monkeypatch)
    other = threading.Thread(target=lambda: wrong.extend(_read_every_item(ds, want, held, stop)))
    loader = FeatureLoader(
        StackDataset(ds, torch.arange(n)), batch_size=4, seed=3, reads_on="thread"
    )
    seen: list[int] = []
    with native.fallback() if not compiled else contextlib.nullcontext():
        other.start()
        try:
            for epoch in range(2):  # first: checked reads; then located reads
                held.armed = epoch
                for padded, lengths, items in loader:
                    for row, length, i in zip(padded, lengths, items.tolist(), strict=True):
                        torch.testing.assert_close(row[:length], want[i], rtol=1e-5, atol=1e-5)
                        seen.append(i)
        finally:
            stop.set()
            held.release_all()
            other.join()
    assert held.armed is None  # each epoch's first read was held while the other evicted
    assert wrong == []
    assert sorted(seen) == sorted(list(range(n)) * 2)


class _OpensOnFirstUse(torch.utils.data.Dataset):
    """Opens its CachedFeatureDataset at the first attribute it is asked for, in whichever
    thread asks (as datasets that open their store lazily do): here, the loader's reader."""

    def __init__(self, audio_dir: Path, encoder_file: Path, cache: Path) -> None:
        self.args = (audio_dir, encoder_file, cache)

    def __len__(self) -> int:
        return 16

    def __getattr__(self, name: str) -> object:
        if name.startswith("__") or name == "args":
            raise AttributeError(name)
        audio_dir, encoder_file, cache = self.args
        return getattr(CachedFeatureDataset(audio_dir, encoder_file, cache=cache), name)

    def __getitem__(self, i: int) -> object:
        return self.__getattr__("will_need") and None


def test_a_store_that_fails_to_open_in_the_reader_reaches_the_training_loop(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a store")
    ds = _OpensOnFirstUse(audio_dir, encoder_file, tmp_path / "a-file" / "store")
    raised: list[BaseException] = []

    def train() -> None:
        try:
            for _ in FeatureLoader(ds, batch_size=4):
                pass
        except BaseException as e:  # whatever reached the loop is checked below
            raised.append(e)

    loop = threading.Thread(target=train, daemon=True)
    loop.start()
    loop.join(60)  # the old loader waited forever here
    assert not loop.is_alive(), "the training loop is still waiting for a batch"
    assert len(raised) == 1 and isinstance(raised[0], StoreError)
    assert "cannot create the cache directory" in str(raised[0])
    assert _loader_threads() == []


def test_stopping_early_stops_the_reader(baked: CachedFeatureDataset) -> None:
    for _batch in FeatureLoader(baked, batch_size=2, prefetch=1):
        break
    assert _loader_threads() == []


#: A step-counted script: it takes 3 batches of an iterator on the reader thread and ends.
LEFT_OPEN_SCRIPT = """
import sys
from featbake import CachedFeatureDataset, FeatureLoader
ds = CachedFeatureDataset(sys.argv[1], sys.argv[2], cache=sys.argv[3], on_miss="error")
it = iter(FeatureLoader(ds, batch_size=2, seed=0, reads_on="thread"))
for _ in range(3):
    next(it)
print("stepped")
"""


def test_an_iterator_left_open_at_exit_ends_quietly(
    baked: CachedFeatureDataset, audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A script that ends with an iterator open closed it in the interpreter's teardown, when
    its modules' names were gone: ``Exception ignored in: <generator object
    FeatureLoader._handed>`` and a traceback on every run, and now and then the reader, still
    in torch's code, ended the process with ``terminate called without an active
    exception``. Its reader is stopped at exit now, before the teardown."""
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", LEFT_OPEN_SCRIPT, audio_dir, encoder_file, store_dir],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert (proc.returncode, proc.stdout.strip(), proc.stderr.strip()) == (0, "stepped", "")


def test_an_iterator_closed_on_its_own_reader_thread_stops_it_without_joining_itself() -> None:
    """The cyclic collector closes an iterator left in a reference cycle (a trainer keeping
    its loader and iterator) on whichever thread allocates, often the loader's reader: the
    close joined the current thread (``Exception ignored ... RuntimeError: cannot join current
    thread``). On the reader it now only tells the reader to stop."""
    import queue

    run = loader_module._ThreadRun(batches=[], ready=queue.Queue())
    raised: list[BaseException] = []

    def reader() -> None:
        try:
            FeatureLoader._reader_stopped(run, threading.current_thread())
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join()
    assert raised == [] and run.stop.is_set()


def test_rank_and_world_come_from_torch_distributed(
    baked: CachedFeatureDataset, tmp_path: Path
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        loader = FeatureLoader(baked, batch_size=4)
        assert loader.seed == 0  # every rank must draw the same order: no random seed
        assert len(loader) == 4
    finally:
        dist.destroy_process_group()
    shard = FeatureLoader(baked, batch_size=4, rank=1, world_size=2, seed=5)
    want = EpochPlan(len(baked), 4, True, 5, 0, 1, 2).batches()
    got = [lengths.tolist() for _, lengths in shard]
    assert [len(b) for b in want] == [len(g) for g in got]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prefetch": 0}, "prefetch"),
        ({"read_ahead": -1}, "read_ahead"),
        ({"read_ahead": True}, "read_ahead"),
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 1}, "both rank and world_size"),
        ({"rank": 2, "world_size": 2}, "rank must be from 0"),
        ({"shuffle": "shards"}, 'shuffle must be True, False or "blocks"'),
        ({"batch_frames": 0}, "batch_frames must be a whole number from 1"),
        ({"shuffle": "blocks", "window": 0}, "window must be a whole number from 1"),
        ({"reads_on": "worker"}, "reads_on must be 'auto', 'thread' or 'loop', got 'worker'"),
    ],
)
def test_bad_options_are_refused(baked: CachedFeatureDataset, kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FeatureLoader(baked, **kw)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 30), batch=st.integers(1, 7), window=st.integers(0, 10))
def test_read_ahead_hints_each_item_once_before_its_batch(n: int, batch: int, window: int) -> None:
    batches = EpochPlan(n, batch, True, 1, 0).batches()
    hinted: list[int] = []
    ahead = ReadAhead(batches, window, hinted.extend)
    order = [i for b in batches for i in b]
    for b in range(len(batches)):
        ahead.before(b)
        if window:
            end = sum(len(x) for x in batches[: b + 1])
            assert hinted == order[: len(hinted)]  # in reading order, each once
            assert end <= len(hinted) <= end + window  # this batch's items, and few more
    assert hinted == (order if window else [])  # each once, in reading order


def test_a_warm_store_is_hinted_by_sample_until_it_goes_cold() -> None:
    n = WARM_STREAK + 20 * SAMPLE
    batches = [[i] for i in range(n)]  # one item per step, in order
    cold_from = WARM_STREAK + 10 * SAMPLE + 3  # items from here are not in the page cache
    hinted: list[int] = []

    def hint(idx: list[int]) -> int:
        hinted.extend(idx)
        return sum(i >= cold_from for i in idx)

    ahead = ReadAhead(batches, 4, hint)
    for b in range(n):
        ahead.before(b)
    last_warm = cold_from - cold_from % SAMPLE  # the last sample that found its item cached
    assert hinted[:WARM_STREAK] == list(range(WARM_STREAK))  # every item, until the streak
    sampled = [i for i in hinted if WARM_STREAK <= i <= last_warm]
    assert sampled == list(range(WARM_STREAK, last_warm + 1, SAMPLE))  # then every SAMPLE-th
    assert set(range(last_warm, n)) <= set(hinted)  # cold again: every item since that sample
    assert len(hinted) == len(set(hinted))  # none twice


def _spy(ds: CachedFeatureDataset, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record each ``will_need`` call on ``ds`` (and still make it)."""
    calls: list[list[int]] = []
    real = ds.will_need

    def will_need(indices: list[int]) -> int:
        calls.append(list(indices))
        return real(indices)

    monkeypatch.setattr(ds, "will_need", will_need)
    return calls


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_a_cold_store_is_read_ahead_and_served_as_encoded(
    baked: CachedFeatureDataset,
    encoder_file: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy(baked, monkeypatch)
    labels = torch.arange(len(baked)) * 10
    ds = StackDataset(baked, labels)
    for epoch, batch in enumerate((5, 1)):
        drop_page_cache(store_dir)
        calls.clear()
        loader = FeatureLoader(ds, batch_size=batch, seed=4, read_ahead=3)
        loader.set_epoch(epoch)
        got = list(loader)
        plan = EpochPlan(len(baked), batch, True, 4, epoch)
        assert [i for c in calls for i in c] == plan.indices()  # each item hinted once, in order
        assert calls[0] == plan.indices()[: batch + 3]  # the first batch and 3 items past it
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        want = list(DataLoader(ds, batch, sampler=sampler, collate_fn=pad_collate))  # type: ignore[arg-type]
        _assert_same_batches(got, want)
        for padded, lengths, labs in got:
            for row, n, label in zip(padded, lengths, labs, strict=True):
                live = live_features(encoder_file, Path(baked.path(int(label) // 10)))
                torch.testing.assert_close(row[:n], live, rtol=1e-5, atol=1e-5)
    assert baked.will_need(range(len(baked))) == 0  # all read: every page is cached now


def test_ranks_and_subsets_hint_their_own_items(
    baked: CachedFeatureDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(baked, monkeypatch)
    seen = []
    labelled = StackDataset(baked, torch.arange(len(baked)))
    for rank in range(3):
        calls.clear()
        loader = FeatureLoader(labelled, 4, seed=2, rank=rank, world_size=3)
        labels = [int(i) for _, _, labs in loader for i in labs]
        assert labels == EpochPlan(16, 4, True, 2, 0, rank, 3).indices()
        assert [i for c in calls for i in c] == labels  # its own share, each once
        seen += labels
    assert set(seen) == set(range(len(baked)))  # every index once an epoch (2 repeated to even out)
    calls.clear()
    subset = Subset(baked, [15, 3, 9])
    got = list(FeatureLoader(subset, 2, shuffle=False))
    assert [i for c in calls for i in c] == [15, 3, 9]
    torch.testing.assert_close(got[0][0][1, : got[0][1][1]], baked[3])
    calls.clear()
    assert len(list(FeatureLoader(baked, 2, read_ahead=0))) == 8 and calls == []


# Run by each rank with RESUME_RANK_SCRIPT after it, in one launch (see ``gloo_ranks``).
RANK_SCRIPT = """\
import itertools, json, sys
import torch
import torch.distributed as dist
from torch.utils.data import StackDataset, Subset
from featbake import CachedFeatureDataset, FeatureLoader

data, encoder, store, seen, out = sys.argv[1:6]
dist.init_process_group("gloo")
ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
loader = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=3)
epochs = []
for epoch in range(2):
    loader.set_epoch(epoch)
    mine = [int(i) for _, _, labels in loader for i in labels]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    epochs.append(every)
if dist.get_rank() == 0:
    with open(seen, "w") as f:
        json.dump(epochs, f)
"""


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What two torchrun ranks (gloo) saw: one launch runs :data:`RANK_SCRIPT` and then
    :data:`RESUME_RANK_SCRIPT` over the store of the ``resumable`` fixture (16 items in shards
    of 4 KiB). A launch is three processes each importing torch: the two tests below read
    its two reports. Returns ``{"epochs": ..., "resume": ..., "n": 16}``."""
    from featbake.testing import TinyConvEncoder, save_torchscript

    tmp = tmp_path_factory.mktemp("gloo")
    audio = tmp / "audio"
    write_audio_folder(audio, 12, seconds=(0.3, 1.2), subdirs=2, seed=1)  # tests.conftest's
    write_audio_folder(audio / "fixed", 4, seconds=1.0, seed=2)  # audio_dir, 16 items
    encoder = save_torchscript(TinyConvEncoder(), tmp / "encoder.pt")
    store = tmp / "store"
    build(audio, encoder, cache=store, workers=0, shard_bytes=4096)
    n = len(CachedFeatureDataset(audio, encoder, cache=store, on_miss="error"))
    script = RANK_SCRIPT + RESUME_RANK_SCRIPT
    report = _torchrun(script, tmp, audio, encoder, store, tmp / "seen.json")
    return {"epochs": json.loads((tmp / "seen.json").read_text()), "resume": report, "n": n}


def test_two_torchrun_ranks_read_every_index_each_epoch(gloo_ranks: dict) -> None:
    epochs = gloo_ranks["epochs"]
    n = gloo_ranks["n"]  # 16: divides over 2 ranks, so each index is read exactly once
    assert n == 16
    orders = []
    for every in epochs:
        assert [len(m) for m in every] == [n // 2, n // 2]
        assert sorted(every[0] + every[1]) == list(range(n))
        orders.append(every[0])
    assert orders[0] != orders[1]  # set_epoch reshuffles


def _npy_store(tmp_path: Path, n: int) -> tuple[CachedFeatureDataset, torch.nn.Module, Path]:
    """A store of ``n`` items of ``[300, 1024]`` float32 (1.2 MB: batches of 2 are pooled)."""
    import numpy as np

    from featbake.recipe import Recipe

    data = tmp_path / "arrays"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        np.save(data / f"a{i:02d}.npy", rng.standard_normal((300, 8)).astype(np.float32))
    lin = torch.nn.Linear(8, 1024)
    recipe = Recipe(source="npy")
    build(data, lin, cache=tmp_path / "c", recipe=recipe, workers=0)
    ds = CachedFeatureDataset(data, lin, cache=tmp_path / "c", recipe=recipe, on_miss="error")
    return ds, lin, data


def test_a_training_loop_reuses_the_loaders_batch_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Behind a step the queue is full: prefetch batches, the reader's, the dataset's batch a
    # collate copies from, and the loop's current and previous one are alive at once. The
    # process's pool kept 3 buffers, so most batches were fresh mappings, page-faulted as they
    # were read (3.4x the read's CPU time per batch on 2 CPUs).
    import mmap
    import time

    from featbake.encode.sources import source_for
    from featbake.recipe import Recipe

    ds, lin, data = _npy_store(tmp_path, 16)
    src = source_for(Recipe(source="npy"))
    with torch.no_grad():
        want = [lin(src.load(data / f"a{i:02d}.npy")) for i in range(len(ds))]

    def check(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        padded, lengths, idx = batch
        assert padded.nbytes >= 1 << 20  # pooled, not the ordinary allocator's
        for j, (n, i) in enumerate(zip(lengths.tolist(), idx.tolist(), strict=True)):
            torch.testing.assert_close(padded[j, :n], want[i], rtol=1e-5, atol=1e-5)

    made: list[int] = []
    real = mmap.mmap

    def counted(*args: object, **kw: object) -> mmap.mmap:
        made.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    loader = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=2, prefetch=2)
    for epoch in range(2):
        monkeypatch.setattr(mmap, "mmap", counted)
        made.clear()
        previous = None
        for batch in loader:
            time.sleep(0.03)  # a step: the reader fills the queue meanwhile
            check(batch)
            if previous is not None:
                check(previous)  # the loop's previous batch was not written over
            previous = batch
        monkeypatch.undo()
        if epoch == 1:  # the buffers of the first epoch serve the second: no new mapping
            assert made == []


# == test_loader_orders ============================================================================
# FeatureLoader's orders beyond DistributedSampler's, on a real store (issue 30 items 2 and 3):
# batches by length (``batch_frames``), planned from the catalog's lengths with no feature read, and
# blocks of shards (``shuffle="blocks"``); every served feature checked against the encoder now.


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """48 clips of 0.5-15 s (speech-like mixed lengths: 50-1500 frames) baked in small shards."""
    from featbake.testing import TinyConvEncoder, save_torchscript

    root = tmp_path_factory.mktemp("mixed")
    write_audio_folder(root / "audio", 48, seconds=(0.5, 15.0), seed=5)
    enc = save_torchscript(TinyConvEncoder(), root / "encoder.pt")
    build(root / "audio", enc, cache=root / "store", workers=0, shard_bytes=1 << 20)
    return root / "audio", enc, root / "store"


def test_batch_frames_keep_the_budget_with_little_padding_and_no_read_to_plan(
    mixed: tuple[Path, Path, Path],
) -> None:
    audio, enc, store = mixed
    ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    loader = FeatureLoader(ds, batch_frames=6000, seed=1)
    assert len(loader) > 0 and ds.cache_info().store_reads == 0  # planned from the catalog
    orders = []
    for _ in range(2):
        seen, real, padded_frames = [], 0, 0
        batches = list(loader)
        for padded, lengths in batches:
            assert padded.shape[0] * padded.shape[1] <= 6000
            real += int(lengths.sum())
            padded_frames += padded.shape[0] * padded.shape[1]
            seen.append([int(n) for n in lengths])
        print(f"real frames {real / padded_frames:.3f}")
        assert real / padded_frames >= 0.85
        assert sum(len(s) for s in seen) == len(ds)
        orders.append(seen)
    assert orders[0] != orders[1]  # shuffled by epoch


def test_batch_frames_serve_every_item_once_equal_to_live(mixed: tuple[Path, Path, Path]) -> None:
    audio, enc, store = mixed
    ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    labelled = torch.utils.data.StackDataset(ds, torch.arange(len(ds)))
    seen = []
    for padded, lengths, labels in FeatureLoader(labelled, batch_frames=6000, seed=2):
        for row, n, i in zip(padded, lengths, labels, strict=True):
            want = live_features(enc, Path(ds.path(int(i))))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)
            seen.append(int(i))
    assert sorted(seen) == list(range(len(ds)))


def test_batch_frames_read_an_item_over_budget_alone_and_refuse_items_not_stored(
    mixed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """An item longer than batch_frames is a batch of its own, one warning saying how many
    (as lhotse's samplers; before, the loader refused to start). Items not stored are refused."""
    audio, enc, store = mixed
    ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    lengths = ds.placement().lengths
    budget = int(sorted(lengths)[-4])  # the three longest are over it
    over = int((lengths > budget).sum())
    loader = FeatureLoader(ds, batch_frames=budget, seed=3)
    with pytest.warns(UserWarning, match=f"^{over} items are longer than batch_frames={budget}"):
        batches = list(loader)
    alone = [int(n[0]) for padded, n in batches if int(n.max()) > budget]
    assert sorted(alone) == sorted(int(x) for x in lengths if x > budget)  # each on its own
    assert sum(len(n) for _, n in batches) == len(ds)
    assert all(p.shape[0] * p.shape[1] <= budget for p, n in batches if int(n.max()) <= budget)
    with pytest.warns(UserWarning, match="no featbake store"):
        fresh = CachedFeatureDataset(audio, enc, cache=tmp_path / "empty")  # nothing stored
    with pytest.raises(ConfigError, match="not stored yet"):
        len(FeatureLoader(fresh, batch_frames=6000))
    with pytest.raises(ConfigError, match="need a CachedFeatureDataset"):
        len(FeatureLoader(list(range(10)), batch_frames=6000))


def test_items_written_back_get_their_lengths_for_batch_frames(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # nothing built yet
    for _ in FeatureLoader(ds, batch_size=4):  # epoch 1 encodes every item and writes it back
        pass
    ds.flush()  # sealed: the index points the items at their shard, with their lengths
    got = []
    for padded, lengths in FeatureLoader(ds, batch_frames=400):
        assert padded.shape[0] * padded.shape[1] <= 400
        got += lengths.tolist()
    assert len(got) == len(ds) and ds.cache_info().encoded == len(ds)  # none encoded twice


def open_at_once(shards: list[int]) -> int:
    """The most shards "open" at one point of a reading order: a shard is open from its first
    item read to its last."""
    first = {s: shards.index(s) for s in set(shards)}
    last = {s: len(shards) - 1 - shards[::-1].index(s) for s in set(shards)}
    return max(
        (sum(first[s] <= p <= last[s] for s in first) for p in range(len(shards))), default=0
    )


def test_block_shuffle_reads_every_item_once_a_window_of_shards_at_a_time(
    mixed: tuple[Path, Path, Path],
) -> None:
    audio, enc, store = mixed
    ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    shard_of = ds.placement().shards.tolist()
    assert len(set(shard_of)) >= 6
    labelled = torch.utils.data.StackDataset(ds, torch.arange(len(ds)))
    loader = FeatureLoader(labelled, batch_size=4, shuffle="blocks", window=2, seed=3)
    orders = []
    for _ in range(2):
        order = []
        for padded, lengths, labels in loader:
            for row, n, i in zip(padded, lengths, labels, strict=True):
                want = live_features(enc, Path(ds.path(int(i))))
                torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)
                order.append(int(i))
        assert sorted(order) == list(range(len(ds)))
        assert open_at_once([shard_of[i] for i in order]) <= 2
        orders.append(order)
    assert orders[0] != orders[1]
    # The same order for DataLoader users, through BlockSampler and set_epoch.
    sampler = BlockSampler(labelled, seed=3, window=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert list(sampler) == orders[epoch] and len(sampler) == len(ds)
    dl = DataLoader(labelled, batch_size=4, sampler=sampler, collate_fn=pad_collate)
    assert [int(i) for *_, labels in dl for i in labels] == orders[1]


# == test_loader_resume ============================================================================
# FeatureLoader's state (issue 30 item 1): stopped anywhere and resumed by a new loader with the
# same arguments, it yields exactly the rest of the epoch (same items, order and batches, labels
# included), then the epochs the uninterrupted loader would; under two gloo ranks each rank's own.
# A state from another world size, or from options that give another order, is refused.

KINDS = [
    {"batch_size": 3},
    {"batch_size": 3, "shuffle": False, "drop_last": True},
    {"batch_frames": 400},
    {"batch_size": 2, "shuffle": "blocks", "window": 2},
]


@pytest.fixture
def resumable(audio_dir: Path, encoder_file: Path, store_dir: Path) -> CachedFeatureDataset:
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=4096)
    return CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")


def _epoch(loader: FeatureLoader, stop: int | None = None) -> list[tuple]:
    """An epoch's batches, or its first ``stop`` (the training loop takes no more)."""
    return list(itertools.islice(loader, stop))


def _same(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw", KINDS)
def test_a_resumed_loader_yields_the_rest_of_the_epoch_then_the_next_ones(
    resumable: CachedFeatureDataset, encoder_file: Path, kw: dict
) -> None:
    ds = StackDataset(resumable, torch.arange(len(resumable)))
    whole = FeatureLoader(ds, seed=11, **kw)
    epochs = [_epoch(whole) for _ in range(3)]
    assert len(set(resumable.placement().shards.tolist())) >= 4  # blocks have shards to visit
    for stop in range(len(epochs[1]) + 1):
        first = FeatureLoader(ds, seed=11, **kw)
        _epoch(first)
        _epoch(first, stop)  # preempted after `stop` batches of epoch 1
        state = json.loads(json.dumps(first.state_dict()))  # plain: survives any checkpoint
        assert state["epoch"] == (1 if stop < len(epochs[1]) else 2)
        again = FeatureLoader(ds, **kw)  # its own random seed: the state's wins
        again.load_state_dict(state)
        if state["epoch"] == 1:
            rest = _epoch(again)
            _same(rest, epochs[1][stop:])
        _same(_epoch(again), epochs[2])
    for padded, lengths, labels in epochs[1]:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            want = live_features(encoder_file, Path(resumable.path(int(i))))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


def test_set_epoch_keeps_a_resumed_epoch_and_drops_it_for_another(
    resumable: CachedFeatureDataset,
) -> None:
    first = FeatureLoader(resumable, batch_size=3, seed=2)
    whole = [_epoch(first) for _ in range(2)]
    first.set_epoch(1)
    _epoch(first, 2)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    again = FeatureLoader(resumable, batch_size=3, seed=2)
    again.load_state_dict(state)
    again.set_epoch(1)  # the usual loop calls set_epoch before each epoch
    _same(_epoch(again), whole[1][2:])
    again.load_state_dict(state)
    again.set_epoch(0)
    _same(_epoch(again), whole[0])


def test_a_state_from_other_ranks_or_options_is_refused(
    resumable: CachedFeatureDataset,
) -> None:
    state = FeatureLoader(resumable, batch_size=4, rank=0, world_size=2).state_dict()
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(resumable, batch_size=5).load_state_dict(state)  # and another world size
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(resumable, batch_size=5, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(
            resumable, batch_size=4, rank=1, world_size=2, even_batches=False
        ).load_state_dict(state)
    bad_runs = ({**state, "resumed": [[0, 1]]}, {**state, "resumed": "2"})
    for bad in ({**state, "position": -1}, {**state, "epoch": "1"}, [1, 2], *bad_runs):
        with pytest.raises(ConfigError, match="state"):
            FeatureLoader(resumable, batch_size=4, rank=0, world_size=2).load_state_dict(bad)  # type: ignore[arg-type]


def test_a_negative_seed_resumes_its_own_state(resumable: CachedFeatureDataset) -> None:
    """A loader, a length sampler and a block sampler take a negative seed (as ``randperm``
    does); each refused its own state (``'seed' is -1``), as a state's counts are from 0. A
    resumed epoch now reads the batches the uninterrupted one read after the stop."""
    from featbake import LengthBatchSampler

    def resumed_after_one(make: Callable[[], Any]) -> tuple[list, list]:
        whole, first = list(make()), make()
        next(iter(first))
        again = make()
        again.load_state_dict(first.state_dict())
        return list(again), whole[1:]

    _same(*resumed_after_one(lambda: FeatureLoader(resumable, batch_size=3, seed=-1)))
    for make in (
        lambda: LengthBatchSampler(resumable, 300, seed=-1),
        lambda: BlockSampler(resumable, seed=-1, window=1),
    ):
        got, want = resumed_after_one(make)
        assert got == want and len(want) > 1


# Run after RANK_SCRIPT in the same processes (its imports, arguments and process group).
RESUME_RANK_SCRIPT = """\
ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
ds = Subset(StackDataset(ds, torch.arange(len(ds))), range(15))  # 15: 2 ranks cannot split it
labels = lambda loader, stop=None: [b[2].tolist() for b in itertools.islice(loader, stop)]
report = {}
for name, kw in {"items": {"batch_size": 3}, "frames": {"batch_frames": 300},
                 "uneven": {"batch_size": 3, "even_batches": False},
                 "frames-uneven": {"batch_frames": 300, "even_batches": False}}.items():
    whole = FeatureLoader(ds, **kw)
    epochs = [labels(whole) for _ in range(2)]
    first = FeatureLoader(ds, **kw)
    stop = dist.get_rank() + 1  # each rank stops at its own place
    labels(first, stop)
    again = FeatureLoader(ds, **kw)
    again.load_state_dict(first.state_dict())
    resumed = [labels(again), labels(again)]
    mine = {"epochs": epochs, "resumed": resumed, "stop": stop}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    report[name] = every
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(report, f)
dist.destroy_process_group()
"""


def _torchrun(script: str, tmp_path: Path, *args: object) -> dict:
    path = tmp_path / "ranks.py"
    path.write_text(script)
    out = tmp_path / "report.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    repo = str(Path(__file__).resolve().parents[2])
    cmd = [torchrun, "--nproc-per-node", "2", "--standalone", path, *args, out]
    res = subprocess.run(
        [str(a) for a in cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo},
    )
    assert res.returncode == 0, res.stderr
    report: dict = json.loads(out.read_text())
    return report


def test_two_gloo_ranks_resume_their_own_epochs_and_even_batches_false_repeats_nothing(
    gloo_ranks: dict,
) -> None:
    report = gloo_ranks["resume"]  # RESUME_RANK_SCRIPT's, run in the same launch
    n = 15  # of the 16 items: one over an even split
    for name, ranks in report.items():
        for r in ranks:
            stop = r["stop"]
            assert r["resumed"] == [r["epochs"][0][stop:], r["epochs"][1]], name
        counts = [len(r["epochs"][0]) for r in ranks]
        seen = sorted(i for r in ranks for b in r["epochs"][0] for i in b)
        if name.endswith("uneven"):  # for evaluation: each item read exactly once
            assert seen == list(range(n)), name
        else:  # every rank takes as many steps, as DDP needs (items or batches repeated)
            assert counts[0] == counts[1] and set(seen) == set(range(n)), name
    assert [sum(map(len, r["epochs"][0])) for r in report["uneven"]] == [8, 7]
    assert [sum(map(len, r["epochs"][0])) for r in report["items"]] == [8, 8]


# == test_loader_resume_after_the_store_changed ===================================================
# Round four, item 5: an epoch by block or by length is planned from the store's placement (each
# item's shard, each item's length). A build, a gc or the write-back of misses moves items between
# shards (gc can drop them), so an epoch resumed after one of those and re-planned from today's
# placement repeated some items and skipped others (7 of 18 each). The state now carries the
# placement the epoch was planned from: the rest of the epoch is exactly what the first run did
# not serve, every item equal to the encoder run now.


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Path, Path, Path]:
    """18 clips in three folders of 6 (audio/part0..part2), a TinyConvEncoder, a store path."""
    from featbake.testing import TinyConvEncoder, save_torchscript

    write_audio_folder(tmp_path / "audio", 18, seconds=(0.3, 1.0), subdirs=3, seed=4)
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "encoder.pt")
    return tmp_path / "audio", enc, tmp_path / "store"


def _served(batches: list[tuple]) -> list[int]:
    return [int(i) for *_, labels in batches for i in labels]


def _assert_live(batches: list[tuple], ds: CachedFeatureDataset, encoder: Path) -> None:
    for padded, lengths, labels in batches:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            want = live_features(encoder, Path(ds.path(int(i))))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


def _compact(store: Path) -> None:
    """gc rewriting every shard into one (every item moves)."""
    from featbake.upkeep import GcOptions
    from featbake.upkeep.gc import gc

    gc(store, GcOptions(compact_below=1.0, merge_small=True, grace=0, shard_bytes=1 << 20))


def _change_three_ways(audio: Path, encoder: Path, store: Path) -> None:
    """The store changes three ways before the run resumes: misses of part2 encoded and written
    back by a dataset with misses enabled, a build adding the rest of part2, gc moving every
    item into one shard."""
    other = CachedFeatureDataset(audio / "part2", encoder, cache=store)
    for i in range(3):
        other[i]
    other.flush()
    build(audio, encoder, cache=store, workers=0, shard_bytes=4096)
    _compact(store)


@pytest.mark.parametrize(
    "kw", [{"batch_size": 2, "shuffle": "blocks", "window": 2}, {"batch_size": 2}]
)
def test_an_epoch_resumed_after_write_back_a_build_and_gc_serves_each_item_once(
    parts: tuple[Path, Path, Path], kw: dict
) -> None:
    audio, enc, store = parts
    for part in ("part0", "part1"):  # part2 is not stored: its items are misses
        build(audio / part, enc, cache=store, workers=0, shard_bytes=4096)
    ds = CachedFeatureDataset(audio, enc, cache=store)
    before = ds.placement().shards.tolist()
    first = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), seed=5, **kw)
    head = _epoch(first, 4)  # preempted after 4 of the epoch's 9 batches
    state = json.loads(json.dumps(first.state_dict()))
    _change_three_ways(audio, enc, store)
    again_ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    assert again_ds.placement().shards.tolist() != before
    again = FeatureLoader(StackDataset(again_ds, torch.arange(len(again_ds))), **kw)
    again.load_state_dict(state)
    rest = _epoch(again)
    assert sorted(_served(head) + _served(rest)) == list(range(18))  # each item once
    _assert_live(head, ds, enc)
    _assert_live(rest, again_ds, enc)
    assert sorted(_served(_epoch(again))) == list(range(18))  # the next epoch: today's plan


@pytest.mark.parametrize(
    "kw", [{"batch_frames": 300}, {"batch_frames": 300, "shuffle": "blocks", "window": 2}]
)
def test_an_epoch_by_length_resumed_after_gc_moved_and_dropped_items_serves_each_once(
    parts: tuple[Path, Path, Path], kw: dict
) -> None:
    """gc compacts every shard, then evicts half the bytes: the dropped items have no length
    in the catalog now, and the rest of the epoch serves them encoded live, in its order."""
    from featbake.upkeep import GcOptions
    from featbake.upkeep.gc import gc

    audio, enc, store = parts
    build(audio, enc, cache=store, workers=0, shard_bytes=4096)
    ds = CachedFeatureDataset(audio, enc, cache=store)
    first = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), seed=6, **kw)
    total = len(first)
    head = _epoch(first, total // 2)
    state = json.loads(json.dumps(first.state_dict()))
    _compact(store)
    budget = sum(p.stat().st_size for p in (store / "shards").glob("*/*.safetensors")) // 2
    gc(store, GcOptions(max_bytes=budget, grace=0))
    again_ds = CachedFeatureDataset(audio, enc, cache=store)
    assert (again_ds.placement().lengths < 0).any()  # some items dropped
    again = FeatureLoader(StackDataset(again_ds, torch.arange(len(again_ds))), **kw)
    again.load_state_dict(state)
    assert len(again) == total
    rest = _epoch(again)
    assert len(head) + len(rest) == total
    assert sorted(_served(head) + _served(rest)) == list(range(18))
    _assert_live(head, ds, enc)
    _assert_live(rest, again_ds, enc)


def test_a_state_without_its_epochs_placement_is_refused_part_way_and_not_at_the_start(
    resumable: CachedFeatureDataset,
) -> None:
    kw: dict = {"batch_size": 2, "shuffle": "blocks", "window": 2}
    first = FeatureLoader(resumable, seed=1, **kw)
    whole = _epoch(FeatureLoader(resumable, seed=1, **kw))
    _epoch(first, 3)
    state = first.state_dict()
    assert state["plan"].startswith("plan1;blocks=")
    old = {k: v for k, v in state.items() if k != "plan"}  # as an older featbake saved it
    with pytest.raises(ConfigError, match="start the epoch over") as e:
        FeatureLoader(resumable, **kw).load_state_dict(old)
    assert "\n" not in str(e.value)
    again = FeatureLoader(resumable, **kw)
    again.load_state_dict({**old, "position": 0})
    _same(_epoch(again), whole)
    not_a_state = r"not a (FeatureLoader|loader's or sampler's) state"
    for bad in ("plan0;x", "plan1;blocks=<u2:AAAA", "plan1;lengths=<i8:" + "A" * 8, 7):
        with pytest.raises(ConfigError, match=not_a_state):
            FeatureLoader(resumable, **kw).load_state_dict({**state, "plan": bad})
    items = FeatureLoader(resumable, batch_size=2, seed=1)  # a plain shuffle needs none
    _epoch(items, 3)
    assert items.state_dict()["plan"] == ""


def test_a_block_sampler_loaded_after_the_store_changed_yields_the_rest_of_its_epoch(
    parts: tuple[Path, Path, Path],
) -> None:
    """DataLoader users: a BlockSampler made after a write-back, a build and gc that loads the
    state of the one before yields the rest of that epoch (``yielded`` counts the indices
    handed out, as torchdata's StatefulDistributedSampler), then the epochs the first would."""
    audio, enc, store = parts
    for part in ("part0", "part1"):
        build(audio / part, enc, cache=store, workers=0, shard_bytes=4096)
    ds = CachedFeatureDataset(audio, enc, cache=store)
    labelled = StackDataset(ds, torch.arange(len(ds)))
    sampler = BlockSampler(labelled, seed=5, window=2)
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.set_epoch(2)
    after = list(sampler)
    sampler.set_epoch(1)
    loader = DataLoader(labelled, 2, sampler=sampler, collate_fn=pad_collate)
    head = _served(list(itertools.islice(loader, 4)))
    state = json.loads(json.dumps(sampler.state_dict()))
    assert (state["epoch"], state["yielded"]) == (1, 8) and head == whole[:8]
    _change_three_ways(audio, enc, store)
    again_ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    again_labelled = StackDataset(again_ds, torch.arange(len(again_ds)))
    fresh = BlockSampler(again_labelled, seed=5, window=2)
    fresh.set_epoch(1)
    assert list(fresh) != whole  # planned from today's placement: another order
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    rest = list(DataLoader(again_labelled, 2, sampler=fresh, collate_fn=pad_collate))
    assert head + _served(rest) == whole and sorted(whole) == list(range(18))
    _assert_live(rest, again_ds, enc)
    fresh.set_epoch(2)
    assert list(fresh) == after  # the epochs after it: the first sampler's
    with pytest.raises(ConfigError, match="another order"):
        BlockSampler(again_labelled, seed=5, window=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="not a BlockSampler state"):
        fresh.load_state_dict({**state, "plan": 3})


# == elastic resume ================================================================================
# Round four: a state saved over one world size resumes over another. Each item the old ranks
# had not read is shared out over the new ones (the first `position` batches of every old rank
# are what was read: any rank's state says it, all being at the same step), so every item of
# the epoch is read once across the runs with even_batches=False; with it, the only repeats are
# those that even out each run's ranks. Before, such a state was refused.

ELASTIC = [
    {"batch_size": 3, "even_batches": False},
    {"batch_frames": 150, "even_batches": False},
    {"batch_size": 2, "shuffle": "blocks", "window": 2, "even_batches": False},
    {"batch_frames": 150, "shuffle": "blocks", "window": 2, "even_batches": False},
    {"batch_size": 3},
    {"batch_frames": 150},
]


def _run(ds: object, world: int, kw: dict, state: dict | None, stop: int | None) -> tuple:
    """``world`` ranks of epoch 1, each loading ``state`` (rank 0's of the run before) and
    reading ``stop`` batches: the batches read, and each rank's state after."""
    batches, states = [], []
    for r in range(world):
        loader = FeatureLoader(ds, seed=4, rank=r, world_size=world, **kw)
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(1)
        whole = len(loader)
        got = _epoch(loader, stop)
        assert stop is not None or len(got) == whole
        batches += got
        states.append(json.loads(json.dumps(loader.state_dict())))
    return batches, states


@pytest.mark.parametrize("kw", ELASTIC)
def test_an_epoch_saved_over_two_ranks_resumes_over_three_then_one_reading_each_item_once(
    resumable: CachedFeatureDataset, encoder_file: Path, kw: dict
) -> None:
    ds = StackDataset(resumable, torch.arange(len(resumable)))
    first, states = _run(ds, 2, kw, None, 1)
    second, states = _run(ds, 3, kw, states[0], 1)  # rank 0's: it has the most batches
    assert (states[0]["epoch"], states[0]["resumed"], states[0]["world_size"]) == (1, [[2, 1]], 3)
    third, _ = _run(ds, 1, kw, states[0], None)
    read = _served(first) + _served(second) + _served(third)
    if kw.get("even_batches", True):  # evened out: 2 and 3 ranks pad at most 1 and 2 units
        assert set(read) == set(range(len(ds)))
        unit = 3 if "batch_size" in kw else max(len(n) for _, n, _ in first + second + third)
        assert len(read) - len(ds) <= 3 * unit
    else:
        assert sorted(read) == list(range(len(ds)))
    _assert_live(second + third, resumable, encoder_file)
    with pytest.raises(ConfigError, match="another order"):
        other = FeatureLoader(ds, seed=4, rank=0, world_size=3, **{**kw, "drop_last": True})
        other.load_state_dict(states[0])


# == LengthBatchSampler ============================================================================
# Round four: batches by length for DataLoader users, as FeatureLoader(batch_frames=) reads
# them, resumed exactly through torchdata's StatefulDataLoader; an item longer than batch_frames
# is a batch of its own with one warning (as lhotse), in the loader and the sampler alike.


def test_a_length_batch_sampler_gives_the_loaders_batches_and_resumes_in_a_stateful_dataloader(
    resumable: CachedFeatureDataset, encoder_file: Path
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from featbake import LengthBatchSampler

    ds = StackDataset(resumable, torch.arange(len(resumable)))
    kw = {"batch_size": 4, "seed": 6}
    sampler = LengthBatchSampler(ds, 300, **kw)
    sampler.set_epoch(1)
    loader = FeatureLoader(ds, batch_frames=300, **kw)
    loader.set_epoch(1)
    whole = list(DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate))
    _same(whole, _epoch(loader))
    assert all(len(n) <= 4 and p.shape[0] * p.shape[1] <= 300 for p, n, _ in whole)
    sampler.set_epoch(2)
    after = list(sampler)
    for stop, workers in ((0, 0), (3, 0), (3, 2), (len(whole), 0)):
        first = LengthBatchSampler(ds, 300, **kw)
        first.set_epoch(1)
        stateful = StatefulDataLoader(
            ds, batch_sampler=first, collate_fn=pad_collate, num_workers=workers
        )
        head = list(itertools.islice(stateful, stop))
        state = json.loads(json.dumps(stateful.state_dict()))
        again = LengthBatchSampler(ds, 300, **{**kw, "seed": 0})  # the state's seed wins
        resumed = StatefulDataLoader(
            ds, batch_sampler=again, collate_fn=pad_collate, num_workers=workers
        )
        resumed.load_state_dict(state)
        rest = list(resumed)
        _same(head + rest, whole)
        _assert_live(rest, resumable, encoder_file)
    again.set_epoch(2)
    assert list(again) == after
    with pytest.raises(ConfigError, match="another order"):
        LengthBatchSampler(ds, 301, **kw).load_state_dict(first.state_dict())


@pytest.mark.parametrize("kind", ["length", "blocks"])
@pytest.mark.parametrize("resumed_at", [0, 1], ids=["the-epoch-saved", "the-next-epoch"])
def test_a_sampler_state_saved_as_an_epoch_ended_resumes_in_a_stateful_dataloader(
    resumable: CachedFeatureDataset, kind: str, resumed_at: int
) -> None:
    """A per-epoch checkpoint through StatefulDataLoader: saved after epoch 0's loop ran out,
    then on resume ``load_state_dict``, ``set_epoch(e)`` and iterate, ``e`` the next epoch or
    the one the state names (a loop resuming "the epoch it was in").

    Next epoch: torchdata loads the sampler's state at that ``iter()``, after the loop's
    ``set_epoch``: the sampler went back to the state's epoch and epoch 0 was read again (a
    mixture's epoch 1 draw never read). Now the epoch the loop set is read.

    The epoch saved: torchdata's restore makes an iterator of the sampler and, the state's
    epoch being over, drops it for a new one. The samplers planned at ``iter()``: the dropped
    one took the loaded position and the new one read all of epoch 0 again (every item twice,
    where torchdata's own sampler reads none). Planned at the first ``next``, epoch 0 reads
    nothing; then epoch 1 is the uninterrupted run's."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from featbake import BlockSampler, LengthBatchSampler

    ds = StackDataset(resumable, torch.arange(len(resumable)))

    def loader() -> tuple[Any, StatefulDataLoader]:
        if kind == "length":
            sampler: Any = LengthBatchSampler(ds, 300, seed=3)
            return sampler, StatefulDataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)
        sampler = BlockSampler(ds, seed=3)
        return sampler, StatefulDataLoader(
            ds, batch_size=3, sampler=sampler, collate_fn=pad_collate
        )

    def epoch(sampler: Any, stateful: StatefulDataLoader, e: int) -> list[list[int]]:
        sampler.set_epoch(e)
        return [b[2].tolist() for b in stateful]

    sampler, stateful = loader()
    uninterrupted = [epoch(sampler, stateful, e) for e in range(2)]
    assert uninterrupted[0] != uninterrupted[1]
    sampler, stateful = loader()
    epoch(sampler, stateful, 0)
    state = json.loads(json.dumps(stateful.state_dict()))
    sampler, stateful = loader()
    stateful.load_state_dict(state)
    if resumed_at == 0:
        assert epoch(sampler, stateful, 0) == []
    assert epoch(sampler, stateful, 1) == uninterrupted[1]


def test_a_loader_state_saved_at_an_epochs_last_batch_resumes_with_that_epoch_read(
    resumable: CachedFeatureDataset,
) -> None:
    """A loop saving ``(epoch, loader.state_dict())`` every step and resuming with ``for e in
    range(saved_epoch, E): loader.set_epoch(e)``: a state saved at an epoch's last batch
    says the next epoch's start, so ``set_epoch(saved_epoch)`` dropped it and read that whole
    epoch again (every item twice). That epoch now reads nothing, the next reads whole."""
    n = len(resumable)
    kw = {"batch_size": 4, "seed": 2}
    whole = FeatureLoader(resumable, **kw)
    uninterrupted = []
    for e in range(3):
        whole.set_epoch(e)
        uninterrupted.append([len(b[1]) for b in whole])
    first = FeatureLoader(resumable, **kw)
    first.set_epoch(0)
    steps = list(first)
    assert len(steps) == len(uninterrupted[0])
    saved_epoch, state = 0, json.loads(json.dumps(first.state_dict()))  # at its last batch
    again = FeatureLoader(resumable, **kw)
    again.load_state_dict(state)
    read = []
    for e in range(saved_epoch, 3):
        again.set_epoch(e)
        read.append([len(b[1]) for b in again])
    assert read == [[], uninterrupted[1], uninterrupted[2]]
    assert sum(map(sum, read)) == 2 * n


def test_a_sampler_reads_an_item_longer_than_batch_frames_alone_with_one_warning(
    resumable: CachedFeatureDataset,
) -> None:
    from featbake import LengthBatchSampler

    lengths = resumable.placement().lengths
    budget = int(sorted(lengths)[-3])  # the two longest are over it
    sampler = LengthBatchSampler(resumable, budget, seed=1)
    with pytest.warns(UserWarning, match=f"^2 items are longer than batch_frames={budget}"):
        batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(resumable)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert sum(1 for b in batches if max(lengths[i] for i in b) > budget) == 2


# -- where batches are read: the reader thread or the loop (featbake.pace) --------------------
def test_reads_in_the_loop_start_no_thread_and_yield_the_dataloaders_batches(
    baked: CachedFeatureDataset, encoder_file: Path
) -> None:
    ds = StackDataset(baked, torch.arange(len(baked)))
    loader = FeatureLoader(ds, batch_size=5, seed=3, reads_on="loop")
    for epoch in range(2):
        got = []
        for batch in loader:
            assert _loader_threads() == []  # read here, in the loop's thread
            got.append(batch)
        _assert_same_batches(got, _dataloader_batches(ds, 3, epoch))
        for padded, lengths, labels in got:
            for row, n, i in zip(padded, lengths, labels, strict=True):
                want = live_features(encoder_file, Path(baked.path(int(i))))
                torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


class _Scripted(Pace):
    """A pace that moves the reads as a script says: choice k (True: in the loop) for the
    k-th time it is asked, the last one from then on; notes what it was told."""

    script: ClassVar[list[bool]] = []

    def __init__(self, reads_on: ReadsOn = ReadsOn.AUTO) -> None:
        super().__init__(reads_on)
        self.asked = 0
        self.steps_noted = 0
        self.reads_noted = 0

    def stepped(self, seconds: float) -> None:
        self.steps_noted += 1

    def read(self, seconds: float) -> None:
        self.reads_noted += 1

    def choose(self) -> bool:
        k = min(self.asked, len(self.script) - 1)
        self.asked += 1
        self.in_loop = self.script[k]
        return self.in_loop


@pytest.mark.parametrize(
    "script",
    [
        [False, False, True, True, True, False],  # thread, then the loop, then the thread again
        [True, False, True, False, True, False, True],  # every batch: flapping
        [False, True],  # to the loop after the first batch, for good
    ],
)
def test_reads_moved_between_thread_and_loop_keep_the_epochs_batches_in_order(
    resumable: CachedFeatureDataset,
    encoder_file: Path,
    script: list[bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ds = StackDataset(resumable, torch.arange(len(resumable)))
    want = [_epoch(FeatureLoader(ds, batch_size=2, seed=7, reads_on="thread"))]
    monkeypatch.setattr(_Scripted, "script", script)
    monkeypatch.setattr(loader_module, "Pace", _Scripted)
    loader = FeatureLoader(ds, batch_size=2, seed=7)
    got, alone = [], 0
    for batch in loader:
        got.append(batch)
        alone += not _loader_threads()
    _same(got, want[0])
    pace = loader._pace
    assert isinstance(pace, _Scripted)
    assert pace.steps_noted == len(got)  # every step noted, whichever thread read
    assert pace.reads_noted == len(got)
    assert alone >= 1  # some batches were read with no reader thread alive
    assert _loader_threads() == []
    # A state saved part way through an epoch read in the loop resumes it as the thread would.
    first = FeatureLoader(ds, batch_size=2, seed=7, reads_on="loop")
    _epoch(first, 3)
    again = FeatureLoader(ds, batch_size=2, reads_on="thread")
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    _same(_epoch(again), want[0][3:])
    for padded, lengths, labels in got:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            live = live_features(encoder_file, Path(resumable.path(int(i))))
            torch.testing.assert_close(row[:n], live, rtol=1e-5, atol=1e-5)


def test_a_read_error_in_the_loop_reaches_it_after_the_batches_before(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    build(audio_dir / "fixed", encoder_file, cache=store_dir, workers=0)  # 4 of the 16 clips
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    stored = (ds.placement().shards >= 0).tolist()
    failing = stored.index(False)
    got = []
    with pytest.raises(CacheMiss):
        for batch in FeatureLoader(ds, batch_size=1, shuffle=False, reads_on="loop"):
            got.append(batch)
    assert len(got) == failing
    assert _loader_threads() == []


def test_batches_staged_to_a_device_are_read_on_the_thread_unless_asked() -> None:
    staging = staging_to(torch.device("cpu"), True)
    assert reads_on_of("auto", staging) is ReadsOn.THREAD
    assert reads_on_of("auto", None) is ReadsOn.AUTO
    assert reads_on_of("loop", staging) is ReadsOn.LOOP
    with pytest.raises(ConfigError, match="reads_on must be 'auto', 'thread' or 'loop'"):
        reads_on_of("main", None)


def test_a_state_part_way_through_an_epoch_is_not_resumed_over_other_items(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Between a save and its resume one clip was deleted, another added and the store rebuilt:
    the dataset has as many items as before, so the state's options matched, and the rest of
    the epoch was read by position over other files (one clip read twice, one never). The
    state carries a digest of the items now: such a state is refused in one line, the same
    state at an epoch's start is taken, and a state without the digest (saved before it was
    kept) still resumes over the same items."""
    import shutil

    from tests.helpers import bake

    data = tmp_path / "data"
    write_audio_folder(data, 8, seconds=0.4, seed=4)
    store = tmp_path / "store"
    bake(data, encoder_file, store)

    def loader() -> FeatureLoader:
        ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
        return FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=2, seed=3)

    first = loader()
    head = list(itertools.islice(iter(first), 2))
    state = json.loads(json.dumps(first.state_dict()))
    same = loader()
    older = {k: v for k, v in state.items() if k != "items"}  # saved before it was kept
    same.load_state_dict(older)
    rest = [int(i) for *_, labels in same for i in labels]
    read = [int(i) for *_, labels in head for i in labels]
    assert sorted(read + rest) == list(range(8))
    sampled = BlockSampler(CachedFeatureDataset(data, encoder_file, cache=store), window=2)
    list(itertools.islice(iter(sampled), 3))
    sampler_state = json.loads(json.dumps(sampled.state_dict()))
    next(data.rglob("*.wav")).unlink()
    write_audio_folder(tmp_path / "more", 1, seconds=0.4, seed=11)
    shutil.copyfile(next((tmp_path / "more").rglob("*.wav")), data / "zz_new.wav")
    bake(data, encoder_file, store)
    changed = loader()
    assert len(changed) == len(first)
    with pytest.raises(ConfigError, match="other items than this dataset's") as refused:
        changed.load_state_dict(state)
    assert "\n" not in str(refused.value)
    changed.load_state_dict({**state, "position": 0, "resumed": []})  # the epoch from its start
    again = BlockSampler(CachedFeatureDataset(data, encoder_file, cache=store), window=2)
    with pytest.raises(ConfigError, match="other items than this dataset's"):
        again.load_state_dict(sampler_state)
    assert sorted(int(i) for *_, labels in changed for i in labels) == list(range(8))
    # A list of files mounted elsewhere (the same files under another folder) is the same items.
    moved = tmp_path / "moved"
    shutil.copytree(data, moved / "data")

    def listed(top: Path) -> FeatureLoader:
        files = sorted(str(p) for p in top.rglob("*.wav"))
        ds = CachedFeatureDataset(files, encoder_file, cache=store, on_miss="error")
        return FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=2, seed=3)

    here = listed(data)
    head = list(itertools.islice(iter(here), 1))
    there = listed(moved)
    there.load_state_dict(json.loads(json.dumps(here.state_dict())))
    read = [int(i) for *_, labels in head for i in labels]
    assert sorted(read + [int(i) for *_, labels in there for i in labels]) == list(range(8))


def test_a_state_resumed_over_the_dataset_wrapped_otherwise_names_the_wrapping(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A state saved part way over the dataset and loaded over ``StackDataset(ds, labels)``
    is refused (the digest of the items is the wrapper's), in one line that names the
    wrapping as a cause; it named a build or gc alone, and none had run."""
    from tests.helpers import bake

    data = tmp_path / "data"
    write_audio_folder(data, 6, seconds=0.4, seed=4)
    store = tmp_path / "store"
    bake(data, encoder_file, store)
    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    first = FeatureLoader(ds, batch_size=2, seed=3)
    list(itertools.islice(iter(first), 1))
    state = json.loads(json.dumps(first.state_dict()))
    wrapped = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=2, seed=3)
    with pytest.raises(ConfigError, match="other items than this dataset's") as refused:
        wrapped.load_state_dict(state)
    said = str(refused.value)
    assert "\n" not in said and "wrapped otherwise than when it was saved" in said


def test_lists_of_files_of_the_same_names_in_two_folders_are_other_items(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A list of files was named relative to the folder its files share, so two speakers'
    lists of the same file names (and any two one-file lists) had one items digest, and a
    state saved part way through one was resumed over the other. They are named from the
    folder above now: such a state is refused in one line, and the same files mounted under
    another folder of the same name still resume."""
    import shutil

    from featbake.serve.loader import items_of
    from tests.helpers import bake

    data, store = tmp_path / "data", tmp_path / "store"
    write_audio_folder(data / "spk1", 4, seconds=0.4, seed=4)
    write_audio_folder(data / "spk2", 4, seconds=0.4, seed=5)
    shutil.copytree(data / "spk1", tmp_path / "mnt" / "spk1")
    bake(data, encoder_file, store)

    def listed(files: list[Path]) -> CachedFeatureDataset:
        return CachedFeatureDataset([str(f) for f in files], encoder_file, cache=store)

    def speaker(top: Path) -> FeatureLoader:
        ds = listed(sorted(top.rglob("*.wav")))
        return FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=2, seed=3)

    names = [p.name for p in sorted((data / "spk1").rglob("*.wav"))]
    assert names == [p.name for p in sorted((data / "spk2").rglob("*.wav"))]
    first = speaker(data / "spk1")
    next(iter(first))
    state = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(ConfigError, match="other items than this dataset's") as refused:
        speaker(data / "spk2").load_state_dict(state)
    assert "\n" not in str(refused.value)
    speaker(tmp_path / "mnt" / "spk1").load_state_dict(state)  # mounted elsewhere: resumed
    one, other = sorted((data / "spk1").rglob("*.wav"))[0], sorted(data.rglob("*.wav"))[-1]
    assert items_of(listed([one])) != items_of(listed([other]))
