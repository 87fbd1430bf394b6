"""Round twelve review, mixing and elastic resume: the gaps it found (r12.m1-m4), fixed.

Real stores built by the real code, real tiny encoders; what is served is checked against the
encoder run now on the file the mixture names for the epoch.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import StackDataset

from featbake.errors import ConfigError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder
from tests.helpers import Live, bake
from tests.serve.test_mixing import _mixture
from tests.store.bucket.conftest import S3


def test_a_block_sampler_state_over_another_mixture_is_refused(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """``FeatureLoader`` and ``LengthBatchSampler`` fold the dataset's ``fingerprint()`` (a
    mixture's lengths, weights, epoch_items and seed) into their state (r4.m1) and refuse a
    state saved over another mixture; ``BlockSampler`` makes its ``Order`` without
    ``source=fingerprint_of(dataset)``, and a mixture's ``items_digest`` covers only the
    datasets' items. So a ``BlockSampler`` state saved part way through epoch 1 of a mixture
    weighted 1:2 is loaded by a sampler over the same stores weighted 2:1: the positions it
    skips and the ones it yields are those of the first mixture's plan (the state's
    placement), read through the second mixture's draw: against the uninterrupted epoch, 3
    items are read more often than it reads them (one it does not read at all) and 3 less
    often, each served the features of the file the second mixture names."""
    from featbake import BlockSampler

    first = _mixture(two_stores, encoder_file, [1.0, 2.0])
    sampler = BlockSampler(first, seed=0, window=1)
    sampler.set_epoch(1)
    head = list(itertools.islice(iter(sampler), 5))
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state["yielded"] == 5 and len(head) == 5

    other = _mixture(two_stores, encoder_file, [2.0, 1.0])  # the same stores, another mixture
    again = BlockSampler(other, seed=0, window=1)
    with pytest.raises(ConfigError, match="another order") as refused:
        again.load_state_dict(state)
    assert "\n" not in str(refused.value)


#: The fingerprint a BlockSampler over 14 positions with ``window=1`` saved before the mixture
#: was folded into it (0b2b44f): the options alone.
OLD_BLOCK_FINGERPRINT = "5bd92c24f0fccacc"


def test_a_block_sampler_state_saved_before_the_mixture_was_folded_in_resumes_over_it(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """A state an earlier featbake saved (its fingerprint the options alone) over the same
    mixture resumes part way through an epoch: the rest is the uninterrupted epoch's (the
    mixture draws the blocks its plan holds). Over another mixture it is refused in one line
    saying to load it with 'yielded' 0; so loaded, it reads that mixture's epoch afresh. A
    state saved at an epoch's start (after ``set_epoch``, before ``iter``) reads that epoch as
    the uninterrupted sampler does, planned from the items the epoch draws."""
    from featbake import BlockSampler

    def sampler(weights: list[float]) -> BlockSampler:
        return BlockSampler(_mixture(two_stores, encoder_file, weights), seed=0, window=1)

    def epoch_1(s: BlockSampler) -> list[int]:
        s.set_epoch(1)
        return list(s)

    want = epoch_1(sampler([1.0, 2.0]))
    first = sampler([1.0, 2.0])
    list(first)
    first.set_epoch(1)
    at_start = json.loads(json.dumps(first.state_dict()))
    head = list(itertools.islice(iter(first), 5))
    within = {**json.loads(json.dumps(first.state_dict())), "fingerprint": OLD_BLOCK_FINGERPRINT}
    assert within["yielded"] == 5 and head == want[:5]

    again = sampler([1.0, 2.0])
    again.load_state_dict(at_start)
    assert list(again) == want
    resumed = sampler([1.0, 2.0])
    resumed.load_state_dict(within)
    assert head + list(resumed) == want
    with pytest.raises(ConfigError, match="'yielded' 0") as refused:
        sampler([2.0, 1.0]).load_state_dict(within)
    assert "\n" not in str(refused.value)
    other = sampler([2.0, 1.0])
    other.load_state_dict({**within, "yielded": 0})
    assert list(other) == epoch_1(sampler([2.0, 1.0]))


# -- resume of a block order over a bucket store, on a node whose tier is another size ----------
# The default ``window`` of a block order over a bucket store is what two windows of the
# dataset's largest shards fit in the node's tier (``window_for`` -> ``block_window`` ->
# ``window_fitting``); the window is in the state's fingerprint, the state does not carry it.


def test_a_block_order_over_a_bucket_resumes_on_a_node_with_another_tier_size(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    """``FeatureLoader(ds, batch_size=4, shuffle="blocks", seed=1)`` over a bucket store, no
    ``window`` given: on a node whose ``local_cache_size`` holds about four shards the window
    is 1 or 2 shards, on one that holds the whole store it is 4. Epoch 0 stopped after 2
    batches on the first node is resumed by the same loader, the same arguments, on the
    second (another world size on other machines, or the same job after its tier was
    resized): ``Resume.load`` compares the fingerprints, whose ``window`` differ, and refuses
    the state telling the user to make the loader with the arguments of the saved run, which
    they did. Wanted: the rest of the epoch read, each item once, as the encoder gives it."""
    from featbake import FeatureLoader
    from featbake.store.objects import ObjectStore
    from featbake.store.url import BucketURL

    audio = tmp_path / "audio"
    write_audio_folder(audio, 24, seconds=(0.5, 1.5), seed=4)
    bake(audio, encoder_file, s3.url, shard_bytes=30_000)
    sizes = [o.size for o in ObjectStore(BucketURL.parse(s3.url)).list("shards/")]
    assert len(sizes) >= 8

    def loader(tier: str, budget: int) -> tuple[FeatureLoader, CachedFeatureDataset]:
        ds = CachedFeatureDataset(
            audio, encoder_file, cache=s3.url, local_cache=tmp_path / tier,
            local_cache_size=budget, on_miss="error",
        )  # fmt: skip
        labelled = StackDataset(ds, torch.arange(len(ds)))
        return FeatureLoader(labelled, batch_size=4, shuffle="blocks", seed=1), ds

    small, ds = loader("tier-small", 4 * sum(sizes) // len(sizes))
    big, _ = loader("tier-big", 100 * sum(sizes))
    assert small._order.window < big._order.window == 4  # the tiers' default windows

    head = list(itertools.islice(iter(small), 2))
    state = json.loads(json.dumps(small.state_dict()))
    big.load_state_dict(state)
    rest = list(big)
    seen = [int(i) for *_, labels in head + rest for i in labels]
    assert sorted(seen) == list(range(len(ds)))
    live = Live()
    for padded, lengths, labels in head + rest:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            want = live(encoder_file, Path(ds.path(int(i))))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


def test_a_block_sampler_over_a_bucket_resumes_on_a_node_with_another_tier_size(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    """``BlockSampler`` with no ``window`` carries its window in its state as the loader does
    (r12.m2): over a bucket store, a state saved where the tier fits a window of 1 or 2
    shards is resumed where it fits 4, the rest of the epoch the uninterrupted sampler's and
    each item served as the encoder gives it; a window given that is not the state's is
    still refused."""
    from featbake import BlockSampler
    from featbake.store.objects import ObjectStore
    from featbake.store.url import BucketURL

    audio = tmp_path / "audio"
    write_audio_folder(audio, 16, seconds=(0.5, 1.5), seed=6)
    bake(audio, encoder_file, s3.url, shard_bytes=30_000)
    sizes = [o.size for o in ObjectStore(BucketURL.parse(s3.url)).list("shards/")]

    def sampler(tier: str, budget: int, window: int | None = None) -> BlockSampler:
        ds = CachedFeatureDataset(
            audio, encoder_file, cache=s3.url, local_cache=tmp_path / tier,
            local_cache_size=budget, on_miss="error",
        )  # fmt: skip
        return BlockSampler(ds, seed=2, window=window)

    small = sampler("tier-small", 4 * sum(sizes) // len(sizes))
    big = sampler("tier-big", 100 * sum(sizes))
    assert small._order.window < big._order.window == 4
    want = list(sampler("tier-small", 4 * sum(sizes) // len(sizes)))
    head = list(itertools.islice(iter(small), 5))
    state = json.loads(json.dumps(small.state_dict()))
    with pytest.raises(ConfigError, match="another order"):
        sampler("tier-big", 100 * sum(sizes), window=4).load_state_dict(state)
    big.load_state_dict(state)
    rest = list(big)
    assert head + rest == want
    ds = big._dataset
    live = Live()
    for i in rest:
        torch.testing.assert_close(ds[i], live(encoder_file, Path(ds.path(i))))


def test_a_length_batch_sampler_given_blocks_yields_the_loaders_batches_or_refuses(
    encoder_file: Path, tmp_path: Path
) -> None:
    """``LengthBatchSampler`` is documented as what ``FeatureLoader(ds, batch_frames=...)``
    reads, as lists of indices; ``FeatureLoader`` takes ``shuffle="blocks"`` (by length within
    blocks, for a bucket store's tier), and ``LengthBatchSampler.__init__`` reads its
    ``shuffle`` through ``shuffle_of(bool(shuffle))``, so ``"blocks"`` becomes ``True``: the
    batches are drawn across every shard (a bucket store's tier fetches shards over and over)
    and a state saved by the loader in that order is refused by the sampler. Wanted: the
    loader's batches, or one line refusing the value."""
    from featbake import FeatureLoader, LengthBatchSampler

    write_audio_folder(tmp_path / "a", 16, seconds=(0.3, 1.2), seed=4)
    bake(tmp_path / "a", encoder_file, tmp_path / "store", shard_bytes=4096)
    ds = CachedFeatureDataset(
        tmp_path / "a", encoder_file, cache=tmp_path / "store", on_miss="error"
    )
    labelled = StackDataset(ds, torch.arange(len(ds)))
    loader = FeatureLoader(labelled, batch_frames=300, shuffle="blocks", window=4, seed=1)
    want = [[int(i) for i in labels] for *_, labels in loader]
    assert sorted(i for b in want for i in b) == list(range(len(ds)))
    try:
        sampler = LengthBatchSampler(ds, 300, shuffle="blocks", seed=1)  # type: ignore[arg-type]
    except ConfigError as refused:
        assert "\n" not in str(refused) and "blocks" in str(refused)
        return
    got = list(sampler)
    assert got == want, f"the sampler's batches {got} are not the loader's {want}"


def test_a_length_batch_sampler_in_blocks_resumes_a_loaders_state_and_the_loader_its(
    encoder_file: Path, tmp_path: Path
) -> None:
    """``LengthBatchSampler(shuffle="blocks")`` and ``FeatureLoader(batch_frames=...,
    shuffle="blocks")`` share their states as they do for the other orders: the loader
    stopped after 2 batches is resumed by the sampler with the rest of the loader's batches,
    and the sampler's state part way through the next epoch by a loader, whose batches are
    the encoder's features of the items the sampler names."""
    from featbake import FeatureLoader, LengthBatchSampler

    write_audio_folder(tmp_path / "a", 16, seconds=(0.3, 1.2), seed=4)
    bake(tmp_path / "a", encoder_file, tmp_path / "store", shard_bytes=4096)
    ds = CachedFeatureDataset(
        tmp_path / "a", encoder_file, cache=tmp_path / "store", on_miss="error"
    )
    labelled = StackDataset(ds, torch.arange(len(ds)))

    def loader() -> FeatureLoader:
        return FeatureLoader(labelled, batch_frames=300, shuffle="blocks", window=2, seed=1)

    def sampler() -> LengthBatchSampler:
        return LengthBatchSampler(labelled, 300, shuffle="blocks", window=2, seed=1)

    whole = [[int(i) for i in labels] for *_, labels in loader()]
    stopped = loader()
    it = iter(stopped)
    head = [[int(i) for i in labels] for *_, labels in itertools.islice(it, 2)]
    resumed = sampler()
    resumed.load_state_dict(json.loads(json.dumps(stopped.state_dict())))
    assert head + list(resumed) == whole

    later = sampler()
    later.set_epoch(1)
    epoch_1 = list(later)
    later = sampler()
    later.set_epoch(1)
    first = next(iter(later))
    again = loader()
    again.load_state_dict(json.loads(json.dumps(later.state_dict())))
    live = Live()
    rest = list(again)
    assert [first] + [[int(i) for i in labels] for *_, labels in rest] == epoch_1
    for padded, lengths, labels in rest:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            torch.testing.assert_close(row[:n], live(encoder_file, Path(ds.path(int(i)))))
