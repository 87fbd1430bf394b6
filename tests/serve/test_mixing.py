"""MixedDataset: proportions within sampling error, walks without repeats that go on across
epochs, and real stores mixed through DataLoader with every feature equal to the encoder now."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

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
