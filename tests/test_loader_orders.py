"""FeatureLoader's orders beyond DistributedSampler's, on a real store (issue 30 items 2 and 3):
batches by length (``batch_frames``), planned from the catalog's lengths with no feature read, and
blocks of shards (``shuffle="blocks"``); every served feature checked against the encoder now."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from featbake import BlockSampler, CachedFeatureDataset, FeatureLoader, build, pad_collate
from featbake.errors import ConfigError
from featbake.testing import write_audio_folder
from tests.conftest import live_features


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


def test_batch_frames_refuse_an_item_over_budget_and_items_not_stored(
    mixed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    audio, enc, store = mixed
    ds = CachedFeatureDataset(audio, enc, cache=store, on_miss="error")
    with pytest.raises(ConfigError, match="more than batch_frames=100"):
        list(FeatureLoader(ds, batch_frames=100))
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
