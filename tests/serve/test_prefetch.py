"""Tests for featbake.prefetch and featbake.device on the CPU (no GPU in CI)."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from featbake import device as dev
from featbake.errors import ConfigError
from featbake.serve.collate import pad_collate
from featbake.serve.prefetch import DevicePrefetcher, PinnedPool, map_tensors

Pair = namedtuple("Pair", ["feat", "label"])


class FakeEvent:
    """Stands in for a CUDA event: complete only when the test says so."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def nested_batches(n: int = 5) -> list:
    return [
        {
            "feat": torch.full((2, i + 1), float(i)),
            "meta": {"ids": [f"a{i}", f"b{i}"], "len": torch.tensor([i, i])},
            "pair": (torch.tensor(i), "text", None),
            "named": Pair(torch.ones(i + 1), i),
        }
        for i in range(n)
    ]


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


# --- map_tensors ---------------------------------------------------------------------------


def test_map_tensors_preserves_structure() -> None:
    batch = nested_batches(2)[1]
    out = map_tensors(lambda t: t + 1, batch)
    assert isinstance(out["named"], Pair)
    assert out["pair"][1:] == ("text", None)
    assert out["meta"]["ids"] == ["a1", "b1"]
    assert torch.equal(out["feat"], batch["feat"] + 1)
    assert map_tensors(lambda t: t, 3) == 3


# --- CPU pass-through ----------------------------------------------------------------------


def test_cpu_passthrough_yields_same_objects_in_order() -> None:
    batches = nested_batches()
    pf = DevicePrefetcher(batches, device="cpu")
    out = list(pf)
    assert len(out) == len(batches)
    assert all(o is b for o, b in zip(out, batches, strict=True))  # no copies
    assert pf.stats().batches == 5
    assert pf.stats().tensors == 0


def test_len_follows_loader() -> None:
    assert len(DevicePrefetcher([1, 2, 3], device="cpu")) == 3
    gen = (torch.zeros(1) for _ in range(2))
    with pytest.raises(TypeError):
        len(DevicePrefetcher(gen, device="cpu"))


def test_second_epoch_works_and_stats_accumulate() -> None:
    batches = [torch.full((3,), float(i)) for i in range(4)]
    pf = DevicePrefetcher(batches, device="cpu")
    first = [b.tolist() for b in pf]
    second = [b.tolist() for b in pf]
    assert first == second == [[float(i)] * 3 for i in range(4)]
    assert pf.stats().batches == 8


def test_with_dataloader_and_pad_collate() -> None:
    data = [(torch.randn(n, 2), n) for n in (3, 1, 4, 1, 5)]
    loader = DataLoader(data, batch_size=2, collate_fn=pad_collate)
    pf = DevicePrefetcher(loader, device="cpu")
    assert len(pf) == 3
    got = list(pf)
    ref = list(loader)
    assert len(got) == 3
    for a, b in zip(got, ref, strict=True):
        assert_same(a, b)


def test_empty_loader() -> None:
    for staging in (False, True):
        pf = DevicePrefetcher([], device="cpu", staging=staging)
        assert list(pf) == []
        assert pf.stats().batches == 0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], device="cpu", depth=0)
    with pytest.raises(ConfigError):
        DevicePrefetcher([], device="tpu")
    with pytest.raises(ConfigError):
        DevicePrefetcher([], device="cpu", pool_bytes="lots")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda_is_config_error() -> None:
    with pytest.raises(ConfigError, match="--device cpu"):
        DevicePrefetcher([], device="cuda")


# --- the staging (CUDA) code path, exercised on the CPU ---------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 5, 10])
def test_staging_path_yields_equal_copies_in_order(depth: int) -> None:
    batches = nested_batches(6)
    pf = DevicePrefetcher(batches, device="cpu", depth=depth, staging=True)
    out = list(pf)
    assert len(out) == 6
    for o, b in zip(out, batches, strict=True):
        assert_same(o, b)
        assert o["feat"] is not b["feat"]
        assert o["feat"].data_ptr() != b["feat"].data_ptr()
    stats = pf.stats()
    assert stats.batches == 6
    assert stats.tensors == 6 * 4
    assert stats.staged == 6 * 4


def test_staging_results_do_not_alias_pool_buffers() -> None:
    # Same shapes every batch, so buffers are reused; earlier results must stay intact.
    batches = [torch.full((4, 3), float(i)) for i in range(6)]
    pf = DevicePrefetcher(batches, device="cpu", depth=2, staging=True)
    out = list(pf)
    for i, o in enumerate(out):
        assert torch.equal(o, batches[i])
    stats = pf.stats()
    assert stats.allocations == 1  # on the CPU copies complete at once (event None)
    assert stats.reuses == 5


def test_staging_second_epoch_reuses_pool() -> None:
    batches = [torch.zeros(2, 2), torch.zeros(3, 2)]
    pf = DevicePrefetcher(batches, device="cpu", staging=True)
    list(pf)
    allocs = pf.stats().allocations
    list(pf)
    assert pf.stats().allocations == allocs
    assert pf.stats().batches == 4


def test_staging_stops_cleanly_when_consumer_breaks() -> None:
    def gen() -> Iterator[torch.Tensor]:
        yield from (torch.full((1,), float(i)) for i in range(100))

    pf = DevicePrefetcher(gen(), device="cpu", depth=3, staging=True)
    seen = []
    for b in pf:
        seen.append(b.item())
        if len(seen) == 4:
            break
    assert seen == [0.0, 1.0, 2.0, 3.0]


def test_an_error_reading_ahead_comes_after_the_batches_before_it() -> None:
    """Staged, batch 2's error was raised as batch 0 was handed out (the copy of the next
    batches is queued first): a run with one bad item stopped two steps early. The loop gets
    batches 0 and 1, then the error, as without staging."""

    def gen() -> Iterator[torch.Tensor]:
        yield torch.zeros(1)
        yield torch.ones(1)
        raise ValueError("batch 2 is unreadable")

    pf = DevicePrefetcher(gen(), device="cpu", depth=2, staging=True)
    seen: list[float] = []
    with pytest.raises(ValueError, match="batch 2 is unreadable"):
        for b in pf:
            seen.append(b.item())
    assert seen == [0.0, 1.0]


def test_a_feature_loaders_state_saved_under_a_prefetcher_resumes_exactly(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``DevicePrefetcher(FeatureLoader(...))`` started ``depth`` batches ahead of the loop,
    and the loader counted them as handed out: a state saved after 2 batches said 4, and the
    two runs served 3 of 5 batches. The loader now counts only those the loop took; the two
    runs serve each batch once, equal to the encoder run now."""
    from featbake import FeatureLoader
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.testing import write_audio_folder
    from tests.helpers import Live, bake

    write_audio_folder(tmp_path / "a", 10, seconds=(0.3, 0.8), seed=2)
    bake(tmp_path / "a", encoder_file, tmp_path / "store")
    ds = CachedFeatureDataset(tmp_path / "a", encoder_file, cache=tmp_path / "store")

    def loader() -> FeatureLoader:
        return FeatureLoader(ds, batch_size=2, shuffle=False)

    first = loader()
    it = iter(DevicePrefetcher(first, device="cpu", depth=2, staging=True))
    served = [next(it) for _ in range(2)]
    state = first.state_dict()
    it.close()
    again = loader()
    again.load_state_dict(state)
    served += list(DevicePrefetcher(again, device="cpu", depth=2, staging=True))
    rows = [(p, n) for padded, lengths in served for p, n in zip(padded, lengths, strict=True)]
    assert len(rows) == len(ds)
    live = Live()
    for i, (row, n) in enumerate(rows):
        torch.testing.assert_close(row[:n], live(encoder_file, Path(ds.path(i))))


# --- PinnedPool ----------------------------------------------------------------------------


def _at(t: torch.Tensor) -> int:
    """The address of the pool buffer ``t`` lies in."""
    return t.untyped_storage().data_ptr()


def test_pool_reuses_a_buffer_of_its_size_class_once_its_copy_completed() -> None:
    pool = PinnedPool(max_bytes="1MiB", pin=False)
    a = pool.acquire((4, 8), torch.float32)
    assert a.shape == (4, 8) and a.dtype == torch.float32
    where = _at(a)
    pool.release([a], FakeEvent(done=True))
    del a
    b = pool.acquire((8, 4), torch.float32)  # another shape of the same bytes
    assert _at(b) == where and b.shape == (8, 4)
    del b  # dropped without a release: free again
    c = pool.acquire((64,), torch.float16)  # another dtype too
    assert _at(c) == where and c.dtype == torch.float16
    s = pool.stats()
    assert (s.allocations, s.reuses, s.free, s.in_flight, s.lent) == (1, 2, 0, 0, 1)


def test_size_classes_waste_at_most_an_eighth() -> None:
    from featbake.serve.prefetch import size_class

    for n in [*range(0, 300), 12_345, 15_728_640, 15_728_641, 2**31 + 7]:
        k = size_class(n)
        assert n <= k <= n + n // 8 + 1, n
        assert size_class(k) == k  # a class is its own class
    # batches whose longest item differs by a few frames share a class
    assert size_class(32 * 350 * 768 * 2) == size_class(32 * 352 * 768 * 2)


def test_pool_never_hands_out_a_buffer_in_flight_or_in_use() -> None:
    pool = PinnedPool(pin=False)
    a = pool.acquire((16,), torch.float32)
    where = _at(a)
    ev = FakeEvent(done=False)
    pool.release([a], ev)
    del a
    b = pool.acquire((16,), torch.float32)
    assert _at(b) != where and pool.stats().in_flight == 1
    c = pool.acquire((16,), torch.float32)
    assert _at(c) not in (where, _at(b))
    assert pool.stats().allocations == 3
    ev.done = True
    d = pool.acquire((16,), torch.float32)
    assert _at(d) == where and pool.stats().reuses == 1
    view = d[2:5]  # a view still alive keeps the buffer in use after its release
    pool.release([d], None)
    del d
    e = pool.acquire((16,), torch.float32)
    assert _at(e) != where
    e.fill_(7.0)
    del view
    f = pool.acquire((16,), torch.float32)
    assert _at(f) == where


def test_pool_buffers_dropped_unreleased_come_back_and_lent_ones_are_known() -> None:
    # FeatureLoader's reader builds batches in the pool; one never copied (the loop stopped,
    # or the read failed) is free once its tensors are gone.
    pool = PinnedPool(pin=False)
    a = pool.acquire((3, 5), torch.float32)
    row = a[1]
    assert pool.lent(a) and pool.lent(row) and not pool.lent(torch.zeros(3))
    assert pool.stats().lent == 1
    where = _at(a)
    del a, row
    b = pool.acquire((5, 3), torch.float32)
    assert _at(b) == where and pool.stats().reuses == 1
    pool.release([b, b[0]], None)  # the same buffer twice counts once
    assert not pool.lent(b)
    s = pool.stats()  # free, though not handed out again while b lives
    assert (s.lent, s.in_flight, s.free) == (0, 0, 1)
    assert _at(pool.acquire((5, 3), torch.float32)) != where


def test_pool_reclaims_in_fifo_order_only() -> None:
    pool = PinnedPool(pin=False)
    a, b = pool.acquire((2,), torch.int64), pool.acquire((2,), torch.int64)
    where = {_at(a), _at(b)}
    ev_a, ev_b = FakeEvent(False), FakeEvent(True)
    pool.release([a], ev_a)
    pool.release([b], ev_b)
    del a, b
    # b's event completed but a's (earlier on the same stream) did not: nothing is free yet.
    c = pool.acquire((2,), torch.int64)
    assert _at(c) not in where
    ev_a.done = True
    got = [pool.acquire((2,), torch.int64), pool.acquire((2,), torch.int64)]
    assert {_at(t) for t in got} == where


def test_pool_budget_evicts_lru_free_buffers() -> None:
    pool = PinnedPool(max_bytes=100, pin=False)  # room for a 40- and a 48-byte buffer
    a = pool.acquire((10,), torch.float32)
    b = pool.acquire((12,), torch.float32)
    at_a = _at(a)
    pool.release([a, b], None)
    del a, b
    a = pool.acquire((10,), torch.float32)  # reuse a -> its class is now the most recent
    pool.release([a], None)
    del a
    c = pool.acquire((4, 2), torch.float32)  # 32 bytes, a new class: evict b (least recent)
    s = pool.stats()
    assert s.evictions == 1 and s.bytes == 72
    assert _at(pool.acquire((10,), torch.float32)) == at_a
    before = pool.stats()
    pool.acquire((12,), torch.float32)  # b was evicted: made anew (maybe where b lay: not checked)
    s = pool.stats()
    assert (s.allocations, s.reuses) == (before.allocations + 1, before.reuses)
    del c


def test_pool_drops_returning_buffers_when_over_budget() -> None:
    pool = PinnedPool(max_bytes=64, pin=False)
    bufs = [pool.acquire((8,), torch.float32) for _ in range(4)]  # 128 bytes, all in use
    assert pool.stats().bytes == 128
    where = {_at(b) for b in bufs}
    pool.release(bufs, None)
    del bufs
    again = pool.acquire((8,), torch.float32)  # reclaims: keeps two, drops two
    assert _at(again) in where
    s = pool.stats()
    assert (s.bytes, s.free, s.evictions, s.reuses) == (64, 1, 2, 1)
    byte = pool.acquire((1,), torch.uint8)  # a new allocation evicts the free buffer to fit
    s = pool.stats()
    assert (s.bytes, s.free, s.evictions, s.lent) == (33, 0, 3, 2)
    del again, byte


def test_pool_zero_budget_keeps_nothing() -> None:
    pool = PinnedPool(max_bytes=0, pin=False)
    a = pool.acquire((4,), torch.float32)
    pool.release([a], None)
    del a
    pool.acquire((4,), torch.float32)
    assert pool.stats().reuses == 0


def test_pool_clear() -> None:
    pool = PinnedPool(pin=False)
    held = pool.acquire((3,), torch.float32)
    inflight = pool.acquire((3,), torch.float32)
    pool.release([held], None)
    pool.release([inflight], FakeEvent(False))
    del held, inflight
    pool.clear()
    s = pool.stats()
    assert (s.free, s.in_flight, s.bytes) == (0, 1, 12)


# --- featbake.device on the CPU (the CUDA boundary must be inert without CUDA) ---------------


def test_device_helpers_are_noops_on_cpu() -> None:
    cpu = dev.resolve_device("cpu")
    assert cpu == torch.device("cpu")
    assert dev.resolve_device(" CPU ") == cpu
    assert dev.resolve_device(torch.device("cpu")) == cpu
    assert dev.resolve_device("cpu:0") == cpu
    if not torch.cuda.is_available():
        assert dev.resolve_device(None) == cpu
    assert not dev.is_cuda(cpu) and not dev.is_cuda(None)
    assert dev.is_cuda("cuda:3") and dev.is_cuda(torch.device("cuda", 0))
    t = torch.zeros(3)
    if not torch.cuda.is_available():
        assert dev.pin(t) is t
    assert dev.new_stream(cpu) is None
    assert dev.current_stream(cpu) is None
    assert dev.new_event(cpu) is None
    with dev.stream_context(None):
        pass
    dev.wait_stream(cpu, None)
    dev.record_stream(t, None)
    dev.record_event(None)
    assert dev.event_query(None)
    dev.event_synchronize(None)
    dev.synchronize("cpu")
    dev.synchronize()
    assert dev.alloc_pinned((2, 3), torch.float16).shape == (2, 3)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:1", "mps", "", "cuda:-1"])
def test_resolve_device_rejects_garbage(bad: str) -> None:
    with pytest.raises(ConfigError, match="cuda:N"):
        dev.resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("req", ["cuda", "cuda:0", "cuda:1"])
def test_resolve_device_cuda_unavailable(req: str) -> None:
    with pytest.raises(ConfigError, match=r"CUDA is not available.*--device cpu"):
        dev.resolve_device(req)


# --- the device tier (device_cache), on the CPU ------------------------------------------------


class Recording(torch.utils.data.Dataset):
    """Variable-length items; records which indices were read."""

    def __init__(self, n: int) -> None:
        self.items = [torch.full((i % 5 + 1, 3), float(i)) for i in range(n)]
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads.append(i)
        return self.items[i]


def test_device_cache_skips_the_host_once_items_fit() -> None:
    ds = Recording(10)
    order = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    loader = DataLoader(ds, batch_size=3, sampler=order, collate_fn=pad_collate)
    want = [pad_collate([ds.items[i] for i in order[k : k + 3]]) for k in range(0, 10, 3)]
    pf = DevicePrefetcher(loader, device="cpu", device_cache="1MiB")
    for epoch in range(3):
        got = list(pf)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
        if epoch == 0:
            assert sorted(set(ds.reads)) == sorted(set(order)) and len(ds.reads) == 7
    assert len(ds.reads) == 7  # epochs 2 and 3 read nothing from the dataset
    info = pf.stats().device_cache
    assert info is not None and info.items == 7


def test_device_cache_budget_holds() -> None:
    ds = Recording(40)
    loader = DataLoader(ds, batch_size=4, shuffle=True, collate_fn=pad_collate)
    budget = 10 * 5 * 3 * 4  # ten of the largest items
    pf = DevicePrefetcher(loader, device="cpu", device_cache=budget)
    for _ in range(3):
        for padded, lengths in pf:
            assert padded.shape[0] == lengths.shape[0]
            assert pf.stats().device_cache.bytes <= budget
    assert pf.stats().device_cache.evictions > 0


def test_device_cache_needs_an_indexed_loader() -> None:
    with pytest.raises(ConfigError, match="device_cache"):
        DevicePrefetcher([torch.zeros(1)], device="cpu", device_cache="1MiB")


def test_device_cache_over_a_mixture_serves_each_epochs_draw(
    tmp_path: Path, encoder_file: Path
) -> None:
    """The device tier keyed items by dataset index; a MixedDataset draws another item at each
    position every epoch, so from the second epoch on the tier served the first epoch's items
    (8 of 8 positions wrong in epoch 1). It now keys by what the index serves
    (:func:`~featbake.serve.prefetch.identity_of`): each epoch's batches are that epoch's draw,
    equal to the encoder run now, and items drawn again still skip the host."""
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.serve.mixing import MixedDataset
    from featbake.testing import write_audio_folder
    from tests.helpers import Live, bake

    folders = [tmp_path / "a", tmp_path / "b"]
    for n, (folder, seed) in enumerate(zip(folders, (4, 5), strict=True)):
        write_audio_folder(folder, 6 - 2 * n, seconds=(0.3, 0.8), seed=seed)
        bake(folder, encoder_file, tmp_path / f"store{n}")
    sets = [
        CachedFeatureDataset(f, encoder_file, cache=tmp_path / f"store{n}", on_miss="error")
        for n, f in enumerate(folders)
    ]
    mixed = MixedDataset(sets, weights=[1, 1], epoch_items=8, seed=1)
    loader = DataLoader(mixed, batch_size=4, collate_fn=pad_collate)
    pf = DevicePrefetcher(loader, device="cpu", device_cache="64MiB")
    live = Live()
    for epoch in range(3):
        mixed.set_epoch(epoch)
        rows = [(p, n) for padded, lengths in pf for p, n in zip(padded, lengths, strict=True)]
        assert len(rows) == len(mixed)
        for i, (row, n) in enumerate(rows):
            k, j = mixed.locate(i)
            torch.testing.assert_close(row[:n], live(encoder_file, Path(sets[k].path(j))))
    info = pf.stats().device_cache
    assert info is not None and info.hits > 0  # items drawn again came from the tier


def test_device_cache_serves_items_with_labels(tmp_path: Path, encoder_file: Path) -> None:
    """Items served with labels (``StackDataset(ds, labels)``, the README's way) hold an int:
    the tier sized each item by every leaf's ``nbytes`` and refused the first batch
    (``TypeError: cannot size a int``). It weighs an item's tensors; every epoch's batches are
    the encoder run now with their labels, the second from the tier."""
    from torch.utils.data import StackDataset

    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.testing import write_audio_folder
    from tests.helpers import Live, bake

    write_audio_folder(tmp_path / "a", 5, seconds=(0.3, 0.8), seed=3)
    bake(tmp_path / "a", encoder_file, tmp_path / "store")
    ds = CachedFeatureDataset(tmp_path / "a", encoder_file, cache=tmp_path / "store")
    labels = [10 + i for i in range(len(ds))]
    loader = DataLoader(StackDataset(ds, labels), batch_size=2, collate_fn=pad_collate)
    pf = DevicePrefetcher(loader, device="cpu", device_cache="64MiB")
    live = Live()
    for _ in range(2):
        served = [(p, n, lab) for padded, lengths, got in pf for p, n, lab in zip(
            padded, lengths, got.tolist(), strict=True)]  # fmt: skip
        assert [lab for _, _, lab in served] == labels
        for i, (row, n, _) in enumerate(served):
            torch.testing.assert_close(row[:n], live(encoder_file, Path(ds.path(i))))
    info = pf.stats().device_cache
    assert info is not None and info.hits == len(ds) and info.bytes > 0


def test_device_cache_refuses_datasets_whose_items_it_cannot_tell_apart(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A dataset that serves other items at an index each epoch without saying which, and a
    dataset that checks its files at every read (``revalidate=True``), are refused in one line:
    before, a rewritten file kept its first epoch's features on the tier."""
    from featbake.serve.dataset import CachedFeatureDataset

    class Drawn(Recording):
        def set_epoch(self, epoch: int) -> None:
            self.items = self.items[epoch:] + self.items[:epoch]

    loader = DataLoader(Drawn(4), batch_size=2, collate_fn=pad_collate)
    with pytest.raises(ConfigError, match="Drawn serves other items at an index") as refused:
        DevicePrefetcher(loader, device="cpu", device_cache="1MiB")
    assert "\n" not in str(refused.value)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=tmp_path / "s", revalidate=True)
    loader = DataLoader(ds, batch_size=2, collate_fn=pad_collate)
    with pytest.raises(ConfigError, match="revalidate=True") as refused:
        DevicePrefetcher(loader, device="cpu", device_cache="1MiB")
    assert "\n" not in str(refused.value)


def test_a_batch_edited_in_place_never_reaches_the_device_tier() -> None:
    """With a collate that hands items on as they are (``collate_fn=list``) the batch held the
    tier's own tensors, and a step normalising them in place (``x -= x.mean()``) changed what
    every later epoch was served. The batch now holds copies of them (``pad_collate`` builds a
    new batch: nothing is copied there)."""
    ds = Recording(6)
    for item in ds.items:
        item += torch.arange(item.numel(), dtype=item.dtype).view_as(item)  # not constant
    want = [t.clone() for t in ds.items]
    pf = DevicePrefetcher(
        DataLoader(ds, batch_size=2, collate_fn=list), device="cpu", device_cache="1MiB"
    )
    for _ in range(3):
        served = [x for batch in pf for x in batch]
        for x, w in zip(served, want, strict=True):
            assert torch.equal(x, w)
            x -= x.mean()  # the step's own edit
    assert pf.stats().device_cache.hits > 0
    padded = DevicePrefetcher(
        DataLoader(ds, batch_size=2, collate_fn=pad_collate), device="cpu", device_cache="1MiB"
    )
    for _ in range(2):
        for (batch, lengths), start in zip(padded, range(0, 6, 2), strict=True):
            for row, n, w in zip(batch, lengths, want[start : start + 2], strict=True):
                assert torch.equal(row[:n], w)
            batch.mul_(0)


def test_device_cache_over_a_concatenation_of_a_mixture_serves_each_epochs_draw(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A ``ConcatDataset`` hid its members from the tier's keys: a MixedDataset concatenated
    with another set was cached by index and served its first epoch's draw again (3 of 3
    mixture positions wrong from epoch 1 on)."""
    from torch.utils.data import ConcatDataset

    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.serve.mixing import MixedDataset
    from featbake.testing import write_audio_folder
    from tests.helpers import Live, bake

    sets = []
    for n, seed in ((6, 4), (4, 5)):
        folder = tmp_path / f"d{seed}"
        write_audio_folder(folder, n, seconds=(0.3, 0.8), seed=seed)
        bake(folder, encoder_file, tmp_path / f"s{seed}")
        sets.append(
            CachedFeatureDataset(folder, encoder_file, cache=tmp_path / f"s{seed}", on_miss="error")
        )
    mixed = MixedDataset([sets[0]], epoch_items=3, seed=1)
    joined = ConcatDataset([mixed, sets[1]])
    loader = DataLoader(joined, batch_size=7, collate_fn=pad_collate)
    pf = DevicePrefetcher(loader, device="cpu", device_cache="64MiB")
    live = Live()
    for epoch in range(3):
        mixed.set_epoch(epoch)
        ((padded, lengths),) = list(pf)
        want = [sets[0].path(mixed.locate(i)[1]) for i in range(3)]
        want += [sets[1].path(j) for j in range(4)]
        for row, n, path in zip(padded, lengths, want, strict=True):
            torch.testing.assert_close(row[:n], live(encoder_file, Path(path)))
    assert pf.stats().device_cache.hits >= 8  # the concatenated set's items, epochs 1 and 2


def test_device_cache_refuses_a_wrapper_of_datasets_whose_items_move(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A user's own Dataset around a mixture (``Labelled(mixed)``, the user calling
    ``mixed.set_epoch``) or around a ``revalidate=True`` dataset was keyed by index: from
    epoch 1 on the tier served epoch 0's draw, and a rewritten file's old features. Such a
    wrapper without ``identity`` is refused in one line now; one around a dataset whose items
    stay put, or that says what index i serves, still gets the tier."""
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.serve.mixing import MixedDataset

    class Labelled(torch.utils.data.Dataset):
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)  # type: ignore[arg-type]

        def __getitem__(self, i: int) -> object:
            return self.inner[i]  # type: ignore[index]

    class Named(Labelled):
        def identity(self, i: int) -> object:
            return self.inner.locate(i)  # type: ignore[attr-defined]

    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=tmp_path / "s")
        checked = CachedFeatureDataset(
            audio_dir, encoder_file, cache=tmp_path / "s", revalidate=True
        )
    mixed = MixedDataset([ds], epoch_items=3, seed=1)
    for wrapped in (Labelled(mixed), Labelled(checked), Labelled(Labelled(mixed))):
        loader = DataLoader(wrapped, batch_size=2, collate_fn=list)
        with pytest.raises(ConfigError, match=r"Labelled holds a dataset \(inner\).*identity") as e:
            DevicePrefetcher(loader, device="cpu", device_cache="1MiB")
        assert "\n" not in str(e.value)
    for fine in (Labelled(ds), Named(mixed), Labelled(Recording(4))):
        DevicePrefetcher(DataLoader(fine, batch_size=2, collate_fn=list), device_cache="1MiB")
