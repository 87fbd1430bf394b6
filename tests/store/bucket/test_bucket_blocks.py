"""A block-shuffled epoch from a bucket store through a tier of a third of the data (issue 30
item 3): each shard is fetched once, where a full shuffle fetches shards over and over. The
tier must hold two windows of shards: a batch may straddle two windows.

Under a block order the store reads whole shards even where the store outweighs the tier (the
default read mode would read it by ranges), fetches the next window's shards on a background
thread and evicts a window's once the reads moved on; a whole-shard fetch sends one GET and no
HEAD. Requests are counted at the byte seam (``featbake.testing.counted_requests``), so every
test here runs on each place (s3, gs, az) but the one about a window over the tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, StackDataset

from featbake import BlockSampler, CachedFeatureDataset, FeatureLoader
from featbake.bake.pipeline import build
from featbake.store.blocks import BlockPlan, BlockWindowWarning
from featbake.store.bucket import BucketStore
from featbake.store.objects import ObjectStore
from featbake.store.url import BucketURL
from featbake.testing import counted_requests, write_audio_folder
from tests.conftest import live_features
from tests.store.bucket.conftest import S3, Remote


def _fetches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The whole-shard downloads from the bucket, by name, as they happen."""
    got: list[str] = []
    download = ObjectStore.download

    def counted(self: ObjectStore, name: str, dest: Path) -> int:
        if "shards/" in name:
            got.append(name)
        return download(self, name, dest)

    monkeypatch.setattr(ObjectStore, "download", counted)
    return got


def test_a_ranks_padding_window_is_not_entered_by_a_read_of_the_current_window() -> None:
    """A rank whose share is padded repeats the epoch's first items at its end, so a shard of
    its first window is in its last window too: opening it moved the plan to the last window,
    and for the rest of the epoch no window was fetched ahead or let go."""
    plan = BlockPlan([["2"], ["0"], ["1"], ["2"]])
    plan.current = 0
    assert plan.opened("2") is None  # the current window's
    assert plan.opened("0") == 1
    plan.current = 1
    assert plan.opened("2") is None and plan.keep(1) == ("0", "1")  # a passed window's
    assert plan.opened("1") == 2


def test_each_padding_window_at_an_epochs_end_is_entered_in_turn() -> None:
    """Padding of two windows repeats the first two windows' shards at the end: each read of
    them there moves the plan on one window, so the second padding window is kept and fetched
    ahead as any other (the plan stayed in the last real window, the padding never kept)."""
    plan = BlockPlan([["a"], ["b"], ["c"], ["a"], ["b"]])
    for k, name in enumerate("abc"):
        assert plan.opened(name) == k
        plan.current = k
    assert plan.opened("b") is None  # a late read of a passed window moves nothing
    assert plan.opened("a") == 3
    plan.current = 3
    assert plan.keep(3) == ("a", "b")
    assert plan.opened("b") == 4
    plan.current = 4
    assert plan.opened("a") is None and plan.passed(4) == ["a", "c"]


def test_a_block_shuffled_epoch_through_a_third_of_the_data_fetches_each_shard_about_once(
    place: Remote | S3, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    build(audio, encoder_file, cache=place.url, workers=0, shard_bytes=50_000)
    shards = ObjectStore(BucketURL.parse(place.url)).list("shards/")
    assert len(shards) >= 16
    third = sum(o.size for o in shards) // 3
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")  # whole shards into the tier
    fetched = _fetches(monkeypatch)
    per_epoch = {}
    for shuffle in ("blocks", True):
        tier = tmp_path / f"tier-{shuffle}"
        ds = CachedFeatureDataset(
            audio, encoder_file, cache=place.url, local_cache=tier, local_cache_size=third,
            on_miss="error",
        )  # fmt: skip
        labelled = StackDataset(ds, torch.arange(len(ds)))
        loader = FeatureLoader(labelled, batch_size=4, shuffle=shuffle, window=2, seed=1)
        fetched.clear()
        seen = []
        for padded, lengths, labels in loader:
            for row, n, i in zip(padded, lengths, labels, strict=True):
                want = live_features(encoder_file, Path(ds.path(int(i))))
                torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)
                seen.append(int(i))
        assert sorted(seen) == list(range(len(ds)))
        per_epoch[shuffle] = len(fetched)
    # Each shard about once. (Before the open shards were stamped in their order of use, one
    # coarse clock tick stamped them all alike and the tier evicted by name: 25 fetches here.
    # The passed windows now make room for the next one's prefetch: a batch straddling two
    # windows, read on several threads, may open a shard of the one just evicted again.)
    assert per_epoch["blocks"] <= 1.1 * len(shards)
    assert per_epoch[True] > per_epoch["blocks"]  # what a full shuffle costs the same tier


# -- the default read mode under a block order (whole shards, the next window ahead) ----------
def _store(place: Remote | S3, audio: Path, encoder: Path, shard_bytes: int = 30_000) -> list[int]:
    """Build ``audio`` into the test's bucket; the shard objects' sizes."""
    build(audio, encoder, cache=place.url, workers=0, shard_bytes=shard_bytes)
    return [o.size for o in ObjectStore(BucketURL.parse(place.url)).list("shards/")]


def _dataset(
    place: Remote | S3, audio: Path, encoder: Path, tier: Path, budget: int
) -> CachedFeatureDataset:
    return CachedFeatureDataset(audio, encoder, cache=place.url, local_cache=tier,
                                local_cache_size=budget, on_miss="error")  # fmt: skip


class Live:
    """Each item's features computed now, once per item (epochs compare against them)."""

    def __init__(self, ds: CachedFeatureDataset, encoder: Path) -> None:
        self.ds, self.encoder, self.got = ds, encoder, {}

    def check(self, row: torch.Tensor, n: int, i: int) -> None:
        if i not in self.got:
            self.got[i] = live_features(self.encoder, Path(self.ds.path(i)))
        torch.testing.assert_close(row[:n], self.got[i], rtol=1e-5, atol=1e-5)


def test_blocks_in_the_default_read_mode_fetch_each_shard_about_once_an_epoch(
    place: Remote | S3, encoder_file: Path, tmp_path: Path
) -> None:
    """The store outweighs the tier (a third of it), so ``auto`` reads ranges; a block order
    reads whole shards instead: each shard about once an epoch (<= 1.1x shards), no ranged GET,
    no HEAD, and the tier within its budget after every batch, on every place (counted at the
    byte seam). (On the old code: every item a ranged GET, as many as a full shuffle, plus two
    header GETs and a HEAD per shard.)"""
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    sizes = _store(place, audio, encoder_file)
    assert len(sizes) >= 16
    third = sum(sizes) // 3
    ds = _dataset(place, audio, encoder_file, tmp_path / "tier", third)
    assert ds._layout.remote.reads_ranged()  # type: ignore[union-attr]  # auto, no order yet
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    live = Live(ds, encoder_file)
    loader = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=4,
                           shuffle="blocks", window=2, seed=1)  # fmt: skip
    orders = []
    for _ in range(2):
        seen = []
        with counted_requests(type(ObjectStore(BucketURL.parse(place.url)))) as sent:
            for padded, lengths, labels in loader:
                assert tier.used_bytes() <= third
                for row, n, i in zip(padded, lengths, labels, strict=True):
                    live.check(row, int(n), int(i))
                    seen.append(int(i))
            _drain(ds)
        assert sorted(seen) == list(range(len(ds)))
        assert (sent.ranged, sent.head) == (0, 0)
        assert sent.whole <= 1.1 * len(sizes), (sent, len(sizes))
        orders.append(seen)
    assert orders[0] != orders[1]


def test_block_sampler_reads_whole_shards_in_the_default_read_mode(
    place: Remote | S3, encoder_file: Path, tmp_path: Path
) -> None:
    """``DataLoader(ds, sampler=BlockSampler(ds))`` (no workers) tells the store its windows
    too: whole shards, each about once, no ranged GET, on every place."""
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    sizes = _store(place, audio, encoder_file)
    ds = _dataset(place, audio, encoder_file, tmp_path / "tier", sum(sizes) // 3)
    sampler = BlockSampler(ds, seed=3, window=2)
    live = Live(ds, encoder_file)
    seen = []
    with counted_requests(type(ObjectStore(BucketURL.parse(place.url)))) as sent:
        loader = DataLoader(ds, batch_size=None, sampler=sampler)
        for i, feature in zip(sampler, loader, strict=True):
            live.check(feature, len(feature), i)
            seen.append(i)
        _drain(ds)
    assert sorted(seen) == list(range(len(ds)))
    assert sent.ranged == 0
    assert sent.whole <= 1.1 * len(sizes)


def test_length_batch_sampler_in_blocks_reads_whole_shards_in_the_default_read_mode(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    """``LengthBatchSampler(shuffle="blocks")`` (r12.m3) tells the store its windows as
    ``FeatureLoader(batch_frames=..., shuffle="blocks")`` does: whole shards, each about
    once, no ranged GET, every item as the encoder gives it."""
    from featbake import LengthBatchSampler, pad_collate

    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    sizes = _store(s3, audio, encoder_file)
    ds = _dataset(s3, audio, encoder_file, tmp_path / "tier", sum(sizes) // 3)
    sampler = LengthBatchSampler(ds, 400, shuffle="blocks", window=2, seed=3)
    live = Live(ds, encoder_file)
    seen = []
    with counted_requests(type(ObjectStore(BucketURL.parse(s3.url)))) as sent:
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)
        for batch, (padded, lengths) in zip(sampler, loader, strict=True):
            for row, n, i in zip(padded, lengths, batch, strict=True):
                live.check(row, int(n), i)
            seen += batch
        _drain(ds)
    assert sorted(seen) == list(range(len(ds)))
    assert sent.ranged == 0
    assert sent.whole <= 1.1 * len(sizes)


def _drain(ds: CachedFeatureDataset) -> None:
    """Wait for the store's background fetches (a prefetch still running is counted)."""
    store = ds._layout.remote
    assert isinstance(store, BucketStore)
    deadline = time.monotonic() + 60
    while store.prefetches_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.prefetches_in_flight()


def test_the_next_windows_shards_are_fetched_ahead_of_their_first_read(
    place: Remote | S3, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each time the reads enter a window the store queues the current and next windows'
    missing shards on its prefetch threads. The test waits for those fetches where the store
    queued them (a hook, no timing): then every shard is downloaded by a prefetch thread before
    any read opens it, the reads download nothing, each shard once, and the tier stays within
    its budget (the windows passed make room)."""
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    sizes = _store(place, audio, encoder_file)
    third = sum(sizes) // 3
    assert 4 * max(sizes) <= third  # two windows of two shards fit, whatever their sizes
    ds = _dataset(place, audio, encoder_file, tmp_path / "tier", third)
    store = ds._layout.remote
    assert isinstance(store, BucketStore)
    events: list[tuple[str, str, str]] = []  # (what, shard, thread)
    lock = threading.Lock()
    plans: list[BlockPlan] = []

    def record(what: str) -> Callable[[str], None]:
        def note(name: str) -> None:
            with lock:
                events.append((what, name, threading.current_thread().name))

        return note

    downloaded, opened = record("download"), record("open")
    download, opened_was, enter = ObjectStore.download, BucketStore.opened, BucketStore._enter

    def counted(self: ObjectStore, name: str, dest: Path) -> int:
        if name.startswith("shards/"):
            downloaded(Path(name).name.removesuffix(".safetensors"))
        return download(self, name, dest)

    def opening(self: BucketStore, path: Path) -> None:
        opened(path.name.removesuffix(".safetensors"))
        opened_was(self, path)

    def entering(self: BucketStore, plan: BlockPlan, k: int) -> None:
        enter(self, plan, k)
        if not plans or plans[-1] is not plan:
            plans.append(plan)
        _drain(ds)  # the hook: this window's and the next one's fetches are done
        assert store.tier.used_bytes() <= third  # the passed windows made room

    monkeypatch.setattr(ObjectStore, "download", counted)
    monkeypatch.setattr(BucketStore, "opened", opening)
    monkeypatch.setattr(BucketStore, "_enter", entering)
    live = Live(ds, encoder_file)
    loader = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=4,
                           shuffle="blocks", window=2)  # fmt: skip
    for padded, lengths, labels in loader:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            live.check(row, int(n), int(i))
    (plan,) = plans
    assert plan.current == len(plan.windows) - 1  # the reads went through every window
    first: dict[str, int] = {}
    for k, (what, name, _) in enumerate(events):
        first.setdefault(f"{what} {name}", k)
    names = {n for w in plan.windows for n in w}
    assert len(names) == len(sizes)
    for name in names:
        assert first[f"download {name}"] < first[f"open {name}"], name
    downloads = [(n, t) for what, n, t in events if what == "download"]
    assert sorted(n for n, _ in downloads) == sorted(names)  # each shard once
    assert all(t.startswith("featbake-prefetch") for _, t in downloads)


def test_a_window_over_the_tier_is_said_once_and_read_as_before(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    audio = tmp_path / "audio"
    write_audio_folder(audio, 24, seconds=(0.5, 1.5), seed=4)
    sizes = _store(s3, audio, encoder_file)
    ds = _dataset(s3, audio, encoder_file, tmp_path / "tier", sum(sizes) // 3)
    loader = FeatureLoader(ds, batch_size=4, shuffle="blocks", window=len(sizes), seed=0)
    with pytest.warns(BlockWindowWarning, match="raise local_cache_size") as said:
        for _ in range(2):
            assert sum(len(n) for _, n in loader) == len(ds)
    assert len(said) == 1
    assert ds._layout.remote.reads_ranged()  # type: ignore[union-attr]  # as without the order


def test_the_default_window_fits_the_tier_so_each_shard_is_fetched_about_once(
    place: Remote | S3, encoder_file: Path, tmp_path: Path
) -> None:
    """A tier of about four shards (issue 42: 14 shards of ~1 MiB through a 4 MiB tier). The
    default window, 4 shards, did not fit the tier beside the next one: the store fetched
    windows it then evicted before their reads (148 shard GETs an epoch by ranges, 109 with
    whole reads, 27 with ``window=2``), and a read could wait on room only its own read
    would free. With no ``window`` given the window is now as many shards as two windows fit
    the tier: each shard about once an epoch, whole, counted at the byte seam."""
    audio = tmp_path / "audio"
    write_audio_folder(audio, 48, seconds=(0.5, 1.5), seed=4)
    sizes = _store(place, audio, encoder_file)
    assert len(sizes) >= 14
    budget = 4 * sum(sizes) // len(sizes)
    ds = _dataset(place, audio, encoder_file, tmp_path / "tier", budget)
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    live = Live(ds, encoder_file)
    loader = FeatureLoader(StackDataset(ds, torch.arange(len(ds))), batch_size=4,
                           shuffle="blocks", seed=1)  # fmt: skip
    for _ in range(2):
        seen = []
        with counted_requests(type(ObjectStore(BucketURL.parse(place.url)))) as gets:
            for padded, lengths, labels in loader:
                assert tier.used_bytes() <= budget
                for row, n, i in zip(padded, lengths, labels, strict=True):
                    live.check(row, int(n), int(i))
                    seen.append(int(i))
            _drain(ds)
        assert sorted(seen) == list(range(len(ds)))
        assert gets.ranged == 0, gets
        # About once each: how a read and the next window's prefetches interleave (a loaded
        # machine delays either) can make a read evict a prefetched shard of the next window,
        # fetched again when its turn comes; the defect this guards fetched each 5-10 times.
        assert gets.whole <= 1.5 * len(sizes), (gets, len(sizes))
