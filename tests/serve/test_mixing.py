"""MixedDataset: proportions within sampling error, walks without repeats that go on across
epochs, and real stores mixed through DataLoader with every feature equal to the encoder now."""

from __future__ import annotations

import itertools
import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, StackDataset

from featbake.errors import ConfigError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.mixing import MixedDataset, MixPlan, mix_weights
from featbake.testing import write_audio_folder
from tests.helpers import Live, bake

# -- the plan (pure) --------------------------------------------------------------------------


def test_weights_default_to_lengths_and_bad_ones_are_refused() -> None:
    assert mix_weights([10, 30], None) == (0.25, 0.75)
    for bad in ([1.0], [-1.0, 2.0], [0.0, 0.0], [float("nan"), 1.0]):
        with pytest.raises(ConfigError):
            mix_weights([3, 3], bad)
    with pytest.raises(ConfigError, match="dataset 1 is empty"):
        mix_weights([3, 0], [1.0, 1.0])
    assert mix_weights([3, 0], [1.0, 0.0]) == (1.0, 0.0)


def test_weights_whose_sum_passes_a_floats_range_keep_their_proportions() -> None:
    """Each of ``[1e308, 1e308]`` is finite, their sum is not: every weight became 0 and the
    multinomial put every item of an epoch in the last dataset."""
    assert mix_weights([4, 4], [1e308, 1e308]) == (0.5, 0.5)
    assert mix_weights([4, 4, 4], [1.5e308, 1.5e308, 0.0]) == (0.5, 0.5, 0.0)
    plan = MixPlan((4, 4), mix_weights([4, 4], [1e308] * 2), 400, seed=0)
    counts = Counter(k for k, _ in plan.epoch(0))
    assert 150 < counts[0] < 250 and 150 < counts[1] < 250, counts


def test_a_mixture_of_what_it_cannot_draw_from_is_one_clear_error() -> None:
    """Each was a TypeError from inside the mixture, or a line naming ``epoch_items``, which
    the caller never gave."""
    some = StackDataset(torch.arange(3))
    for datasets, kw, match in (
        ([StackDataset(torch.arange(0))], {}, "every dataset of the mixture is empty"),
        ([some, some], {"weights": [None, 1]}, r"weights must be numbers; got \[None, 1\]"),
        ([some, some], {"weights": ["x", 1]}, "weights must be numbers"),
        ([some, 5], {}, r"dataset 1 of the mixture \(int\) has no len\(\)"),
    ):
        with pytest.raises(ConfigError, match=match):
            MixedDataset(datasets, **kw)


def test_proportions_over_10000_draws_are_within_sampling_error() -> None:
    weights = (0.6, 0.3, 0.1)
    plan = MixPlan((50, 2000, 7), weights, 10_000, seed=3)
    counts = Counter(k for k, _ in plan.epoch(0))
    for k, w in enumerate(weights):
        sd = (10_000 * w * (1 - w)) ** 0.5
        assert abs(counts[k] - 10_000 * w) < 4 * sd, (k, counts[k])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    items=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    epochs=st.integers(1, 4),
)
def test_each_dataset_walks_its_items_without_repeats_across_epochs(
    lengths: list[int], items: int, seed: int, epochs: int
) -> None:
    plan = MixPlan(tuple(lengths), mix_weights(lengths, None), items, seed)
    walks: dict[int, list[int]] = {k: [] for k in range(len(lengths))}
    for e in range(epochs):
        drawn = plan.epoch(e)
        assert len(drawn) == items
        assert drawn == MixPlan(tuple(lengths), plan.weights, items, seed).epoch(e)  # pure
        for k, j in drawn:
            assert 0 <= j < lengths[k]
            walks[k].append(j)
    for k, walk in walks.items():
        n = lengths[k]
        for lap in range(0, len(walk), n):  # every full lap is a permutation, a partial one
            chunk = walk[lap : lap + n]  # has no repeats
            assert len(set(chunk)) == len(chunk)
            if len(chunk) == n:
                assert sorted(chunk) == list(range(n))


def test_a_large_down_weighted_set_is_covered_across_epochs() -> None:
    plan = MixPlan((4, 100), (0.5, 0.5), 40, seed=1)
    seen = {j for e in range(10) for k, j in plan.epoch(e) if k == 1}
    assert seen == set(range(100))  # 10 epochs x ~20 draws walk all 100 in turn


# -- real stores --------------------------------------------------------------------------------


def test_two_stores_mixed_through_a_dataloader_serve_what_the_encoder_gives_now(
    tmp_path: Path, encoder_file: Path
) -> None:
    live = Live()
    a, b = tmp_path / "a", tmp_path / "b"
    write_audio_folder(a, 6, seconds=(0.3, 0.8), seed=4)
    write_audio_folder(b, 3, seconds=(0.3, 0.8), seed=5)
    bake(a, encoder_file, tmp_path / "store_a")
    bake(b, encoder_file, tmp_path / "store_b")
    ds_a = CachedFeatureDataset(a, encoder_file, cache=tmp_path / "store_a", on_miss="error")
    ds_b = CachedFeatureDataset(b, encoder_file, cache=tmp_path / "store_b", on_miss="error")
    labels_b = StackDataset(ds_b, torch.arange(3))
    mixed = MixedDataset([ds_a, StackDataset(ds_a, torch.zeros(6))], seed=2)
    assert len(mixed) == 12 and mixed.weights == (0.5, 0.5)

    mixed = MixedDataset([ds_a, labels_b], weights=[1, 3], epoch_items=20, seed=2)
    loader = DataLoader(mixed, batch_size=4, collate_fn=list)
    for epoch in range(2):
        mixed.set_epoch(epoch)
        served = [item for batch in loader for item in batch]
        assert len(served) == 20
        for i, item in enumerate(served):
            k, j = mixed.locate(i)
            if k == 0:
                torch.testing.assert_close(item, live(encoder_file, a / ds_a.path(j)))
            else:
                feats, label = item
                assert int(label) == j
                torch.testing.assert_close(feats, live(encoder_file, b / ds_b.path(j)))
    # placement: lengths from each store's catalog, each store's shards kept apart
    placement = mixed.placement()
    for i in range(len(mixed)):
        k, j = mixed.locate(i)
        inner = (ds_a if k == 0 else ds_b).placement()
        assert placement.lengths[i] == inner.lengths[j]
    shards_a = {int(s) for i, s in enumerate(placement.shards) if mixed.locate(i)[0] == 0}
    shards_b = {int(s) for i, s in enumerate(placement.shards) if mixed.locate(i)[0] == 1}
    assert shards_a and shards_b and not shards_a & shards_b
    assert np.all(placement.lengths > 0)


# -- through FeatureLoader: the epoch forwarded, resumed exactly, another mixture refused -----
# Round four: FeatureLoader planned a MixedDataset's epoch e from the mixture's epoch 0 (it did
# not forward its epoch), so its batches were not the mixture's epoch and a resumed epoch was
# another; and a state saved over another mixture was taken. Each position's label is its
# index in the epoch: the item served there must be the encoder's output, now, on the file
# MixedDataset.locate names for that epoch.

MIX_KINDS = [
    {"batch_size": 3},
    {"batch_frames": 200},
    {"batch_size": 2, "shuffle": "blocks", "window": 1},
    {"batch_frames": 200, "shuffle": "blocks", "window": 2},
]


@pytest.fixture
def two_stores(tmp_path: Path, encoder_file: Path) -> tuple[Path, Path]:
    """Two audio folders (6 and 4 clips of 0.3-0.8 s), each baked into its own store of a few
    shards."""
    for name, n, seed in (("a", 6, 4), ("b", 4, 5)):
        write_audio_folder(tmp_path / name, n, seconds=(0.3, 0.8), seed=seed)
        bake(tmp_path / name, encoder_file, tmp_path / f"store_{name}", shard_bytes=4096)
    return tmp_path / "a", tmp_path / "b"


def _mixture(folders: tuple[Path, Path], encoder: Path, weights: list[float]) -> MixedDataset:
    """A new MixedDataset over new datasets of the two stores (as a restarted run makes)."""
    sets = [
        CachedFeatureDataset(f, encoder, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in folders
    ]
    return MixedDataset(sets, weights=weights, epoch_items=14, seed=3)


def _positions(batches: list) -> list[int]:
    return [int(i) for *_, labels in batches for i in labels]


def _assert_epoch_live(
    batches: list, mixed: MixedDataset, epoch: int, encoder: Path, folders: tuple[Path, Path]
) -> None:
    live = Live()
    mixed.set_epoch(epoch)
    for padded, lengths, labels in batches:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            k, j = mixed.locate(int(i))
            want = live(encoder, folders[k] / mixed.datasets[k].path(j))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", MIX_KINDS)
def test_a_mixed_epoch_through_feature_loader_resumes_exactly_as_the_encoder_gives_it(
    two_stores: tuple[Path, Path], encoder_file: Path, kw: dict
) -> None:
    from featbake import FeatureLoader

    def loader(weights: list[float] = [1.0, 2.0]) -> FeatureLoader:  # noqa: B006
        mixed = _mixture(two_stores, encoder_file, weights)
        return FeatureLoader(StackDataset(mixed, torch.arange(len(mixed))), seed=5, **kw)

    whole = loader()
    epochs = [list(whole) for _ in range(2)]
    probe = _mixture(two_stores, encoder_file, [1.0, 2.0])
    for epoch, batches in enumerate(epochs):
        assert sorted(_positions(batches)) == list(range(14))
        _assert_epoch_live(batches, probe, epoch, encoder_file, two_stores)
    for stop in (1, len(epochs[1]) // 2):
        first = loader()
        list(first)
        head = list(itertools.islice(first, stop))  # epoch 1, preempted after `stop` batches
        state = json.loads(json.dumps(first.state_dict()))
        again = loader()
        again.load_state_dict(state)
        rest = list(again)
        assert _positions(head + rest) == _positions(epochs[1])
        for got, want in zip(head + rest, epochs[1], strict=True):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="another order") as refused:
        loader([2.0, 1.0]).load_state_dict(state)
    assert "\n" not in str(refused.value) and "MixedDataset" in str(refused.value)


@pytest.mark.parametrize("kw", [{"batch_size": 2}, {"batch_frames": 120}])
def test_a_mixed_epoch_saved_over_two_ranks_resumes_over_three_each_position_once(
    two_stores: tuple[Path, Path], encoder_file: Path, kw: dict
) -> None:
    """Round four: a mixture's epoch stopped on 2 ranks and resumed on 3 (each over a new
    MixedDataset) reads each of its positions once, as the encoder gives them."""
    from featbake import FeatureLoader

    def ranks(world: int, state: dict | None, stop: int | None) -> tuple[list, dict]:
        batches, saved = [], {}
        for r in range(world):
            mixed = _mixture(two_stores, encoder_file, [1.0, 2.0])
            labelled = StackDataset(mixed, torch.arange(len(mixed)))
            loader = FeatureLoader(
                labelled, seed=5, rank=r, world_size=world, even_batches=False, **kw
            )
            if state is not None:
                loader.load_state_dict(state)
            loader.set_epoch(1)
            batches += list(itertools.islice(loader, stop))
            saved = saved or json.loads(json.dumps(loader.state_dict()))  # rank 0's
        return batches, saved

    first, state = ranks(2, None, 1)
    rest, _ = ranks(3, state, None)
    assert sorted(_positions(first + rest)) == list(range(14))
    probe = _mixture(two_stores, encoder_file, [1.0, 2.0])
    _assert_epoch_live(first + rest, probe, 1, encoder_file, two_stores)


def test_persistent_dataloader_workers_read_the_epoch_the_main_process_set() -> None:
    """``set_epoch`` in the main process reaches persistent DataLoader workers (the epoch is in
    shared memory, as ViewsDataset's): each epoch's items are that epoch's draw. Before, the
    workers' copies kept the epoch they were forked with and served epoch 0's order again."""
    small, large = [f"a{j}" for j in range(5)], [f"b{j}" for j in range(9)]
    mixed = MixedDataset([small, large], weights=[1, 1], epoch_items=12, seed=4)
    loader = DataLoader(
        mixed, batch_size=4, num_workers=1, persistent_workers=True, collate_fn=list
    )
    seen = []
    for epoch in range(3):
        mixed.set_epoch(epoch)
        got = [x for batch in loader for x in batch]
        want = [(small, large)[k][j] for k, j in (mixed.locate(i) for i in range(12))]
        assert got == want, epoch
        seen.append(got)
    assert seen[0] != seen[1] != seen[2]


def test_a_mixture_tells_the_datasets_it_mixes_the_epoch(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """``MixedDataset.set_epoch`` set its own epoch only: a mixture inside it (or a
    ``ViewsDataset``'s coins) drew epoch 0 in every epoch, so the inner mixture's walk never went
    on (items 4 and 5 of its set in every epoch, the other 4 never). It tells them now: every
    position serves what the plans of that epoch name, equal to the encoder run now, and a state
    over an inner mixture of another seed is refused."""
    from featbake import FeatureLoader

    a, b = (
        CachedFeatureDataset(f, encoder_file, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in two_stores
    )

    def mixture(seed: int = 1) -> tuple[MixedDataset, MixedDataset]:
        inner = MixedDataset([a], epoch_items=2, seed=seed)
        return inner, MixedDataset([inner, b], weights=[1, 1], epoch_items=6, seed=2)

    inner, outer = mixture()
    loader = FeatureLoader(StackDataset(outer, torch.arange(6)), batch_size=3, seed=5)
    live = Live()
    drawn = set()
    for epoch in range(3):
        batches = list(loader)
        assert sorted(_positions(batches)) == list(range(6))
        for padded, lengths, labels in batches:
            for row, n, i in zip(padded, lengths, labels, strict=True):
                k, j = outer.plan.epoch(epoch)[int(i)]
                if k == 0:
                    j = inner.plan.epoch(epoch)[j][1]
                    drawn.add(j)
                path = Path((a, b)[k].path(j))
                torch.testing.assert_close(row[:n], live(encoder_file, path))
    assert len(drawn) > 2  # the inner walk went on (epoch 0 draws two of its items)
    state = loader.state_dict()
    other = FeatureLoader(StackDataset(mixture(seed=9)[1], torch.arange(6)), batch_size=3)
    with pytest.raises(ConfigError, match="another order"):
        other.load_state_dict(state)


def test_a_loader_over_a_concatenation_tells_the_mixture_in_it_the_epoch(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """``FeatureLoader(ConcatDataset([mixture, other]))``: the loader's epoch did not reach the
    mixture through the ConcatDataset, which drew its epoch 0 in every epoch; nor did its
    fingerprint reach the state (a mixture of another seed resumed). Both do now."""
    from torch.utils.data import ConcatDataset

    from featbake import FeatureLoader

    a, b = (
        CachedFeatureDataset(f, encoder_file, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in two_stores
    )

    def joined(seed: int) -> tuple[MixedDataset, ConcatDataset]:
        mixed = MixedDataset([a], epoch_items=3, seed=seed)
        return mixed, ConcatDataset([mixed, b])

    mixed, both = joined(1)
    loader = FeatureLoader(both, batch_size=7, shuffle=False)
    live = Live()
    for epoch in range(3):
        ((padded, lengths),) = list(loader)
        want = [a.path(j) for _, j in mixed.plan.epoch(epoch)] + [b.path(j) for j in range(4)]
        for row, n, path in zip(padded, lengths, want, strict=True):
            torch.testing.assert_close(row[:n], live(encoder_file, Path(path)))
    state = loader.state_dict()
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(joined(9)[1], batch_size=7, shuffle=False).load_state_dict(state)


def test_a_wrapper_of_a_mixture_without_set_epoch_is_warned_of_and_with_one_reads_each_epoch(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """``FeatureLoader(Labelled(mixed))``, a dataset of the user's own holding the mixture:
    the loader's epochs never reached it, so every epoch read epoch 0's draw (a down-weighted
    dataset never read past it), without a word. A warning now says what to add (not a
    refusal: a wrapper may set its mixture's epochs itself); with that ``set_epoch``, each
    epoch reads the mixture's own draw."""
    from torch.utils.data import Dataset

    from featbake import FeatureLoader

    a, b = (
        CachedFeatureDataset(f, encoder_file, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in two_stores
    )
    mixed = MixedDataset([a, b], weights=[0.5, 0.5], epoch_items=4, seed=0)

    class Labelled(Dataset):
        def __init__(self, mixed: MixedDataset) -> None:
            self.mixed = mixed

        def __len__(self) -> int:
            return len(self.mixed)

        def __getitem__(self, i: int) -> Any:
            return self.mixed[i]

    class Passing(Labelled):
        def set_epoch(self, epoch: int) -> None:
            self.mixed.set_epoch(epoch)

    from featbake.serve.loader import HiddenDrawsWarning

    with pytest.warns(HiddenDrawsWarning, match=r"Labelled holds a MixedDataset \(mixed\) and "
                      r"has no set_epoch.*self\.mixed\.set_epoch\(epoch\)"):  # fmt: skip
        FeatureLoader(Labelled(mixed), batch_size=4, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HiddenDrawsWarning)  # a wrapper passing it on: no word
        loader = FeatureLoader(Passing(mixed), batch_size=4, shuffle=False)
    live, draws = Live(), set()
    for epoch in range(3):
        loader.set_epoch(epoch)
        ((padded, lengths),) = list(loader)
        plan = mixed.plan.epoch(epoch)
        draws.add(tuple(plan))
        for row, n, (k, j) in zip(padded, lengths, plan, strict=True):
            torch.testing.assert_close(row[:n], live(encoder_file, Path((a, b)[k].path(j))))
    assert len(draws) > 1


#: The fingerprints states saved before a mixture inside a ConcatDataset or a mixture was
#: folded in (6d12c8e) hold for the loaders of the test below: they depend on the options and
#: the datasets' lengths alone (6 and 4 items, 3 of the 6 an epoch), not on the clips.
OLD_FINGERPRINTS = {"concat": "b57d73fb54caf015", "nested": "24adfa92a6095948"}


def test_a_state_saved_before_inner_mixtures_were_fingerprinted_is_taken_at_an_epochs_start(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """States over ``ConcatDataset([mixture, set])`` or a mixture of a mixture saved before
    the inner mixture was folded into the fingerprint were refused even at an epoch's start,
    telling the user to make the loader with the arguments of the saved run, which they had.
    They are taken in epoch 0 and at an epoch's start (reading that epoch's draws); part way
    through a later epoch (then the inner mixture drew its epoch 0) they are refused in one
    line that says so and how to read the epoch afresh."""
    from torch.utils.data import ConcatDataset

    from featbake import FeatureLoader

    a, b = (
        CachedFeatureDataset(f, encoder_file, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in two_stores
    )

    def loader(kind: str) -> tuple[FeatureLoader, MixedDataset]:
        inner = MixedDataset([a], epoch_items=3, seed=1)
        data = ConcatDataset([inner, b]) if kind == "concat" else MixedDataset([inner, b], seed=2)
        return FeatureLoader(data, batch_size=2, shuffle=False, seed=0), inner

    live = Live()
    starts = {}
    for kind, old in OLD_FINGERPRINTS.items():
        saved, _ = loader(kind)
        list(saved)
        it = iter(saved)
        next(it)
        within = {**saved.state_dict(), "fingerprint": old}
        del within["items"]  # kept since
        start = starts[kind] = {**within, "position": 0}
        first = {**within, "epoch": 0}
        resumed, inner = loader(kind)
        resumed.load_state_dict(start)
        lengths = [int(n) for _, ns in resumed for n in ns]
        assert len(lengths) == 7 and resumed.epoch == 2
        resumed.load_state_dict(first)  # part way through epoch 0: the draws were the same
        with pytest.raises(ConfigError, match=r"part way through epoch 1.*'position' 0") as e:
            loader(kind)[0].load_state_dict(within)
        assert "\n" not in str(e.value)
    resumed, inner = loader("concat")
    resumed.load_state_dict(starts["concat"])  # epoch 1 afresh: the inner epoch-1 draw
    rows = [(row, n) for padded, ns in resumed for row, n in zip(padded, ns, strict=True)]
    want = [a.path(j) for _, j in inner.plan.epoch(1)] + [b.path(j) for j in range(4)]
    for (row, n), path in zip(rows, want, strict=True):
        torch.testing.assert_close(row[:n], live(encoder_file, Path(path)))


def test_a_block_sampler_tells_the_mixture_it_samples_the_epoch(
    two_stores: tuple[Path, Path], encoder_file: Path
) -> None:
    """``BlockSampler.set_epoch`` kept the epoch to itself: a mixture it sampled drew its
    epoch 0 in every epoch (``LengthBatchSampler`` and ``FeatureLoader`` told it). It tells
    the mixture now, and each epoch's blocks are those of the items that epoch draws."""
    from featbake import BlockSampler

    a, b = (
        CachedFeatureDataset(f, encoder_file, cache=f.parent / f"store_{f.name}", on_miss="error")
        for f in two_stores
    )
    mixed = MixedDataset([a, b], epoch_items=5, seed=1)
    sampler = BlockSampler(mixed, seed=0, window=1)
    loader = DataLoader(mixed, batch_size=5, sampler=sampler, collate_fn=list)
    live = Live()
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(5))
        shards = mixed.placement(epoch).shards
        seen = [int(shards[i]) for i in order]
        assert seen == sorted(seen, key=seen.index)  # this epoch's shards, one at a time
        (items,) = list(loader)
        drawn = mixed.plan.epoch(epoch)
        for i, item in zip(order, items, strict=True):
            k, j = drawn[i]
            torch.testing.assert_close(item, live(encoder_file, Path((a, b)[k].path(j))))
