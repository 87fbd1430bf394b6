"""Tests for featbake.collate.pad_collate."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from featbake.errors import ConfigError
from featbake.serve.collate import PaddedBatch, pad_collate


def rand_feats(lengths: list[int], dims: tuple[int, ...] = (3,), seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, *dims, generator=g) for n in lengths]


@pytest.mark.parametrize("dims", [(), (3,), (2, 5)])
def test_matches_pad_sequence(dims: tuple[int, ...]) -> None:
    feats = rand_feats([3, 7, 1, 7, 0], dims)
    padded, lengths = pad_collate(feats)
    expected = pad_sequence(feats, batch_first=True, padding_value=0.0)
    assert torch.equal(padded, expected)
    assert lengths.dtype == torch.int64
    assert lengths.tolist() == [3, 7, 1, 7, 0]


def test_pad_value_fills_only_padding() -> None:
    feats = rand_feats([2, 4])
    padded, _ = pad_collate(feats, pad_value=-1.5)
    assert torch.equal(padded, pad_sequence(feats, batch_first=True, padding_value=-1.5))
    assert torch.all(padded[0, 2:] == -1.5)
    assert torch.equal(padded[1], feats[1])


def test_pad_to_multiple() -> None:
    feats = rand_feats([5, 9])
    padded, lengths = pad_collate(feats, pad_to_multiple=8, pad_value=7.0)
    assert padded.shape == (2, 16, 3)
    assert lengths.tolist() == [5, 9]
    assert torch.equal(padded[1, :9], feats[1])
    assert torch.all(padded[1, 9:] == 7.0)
    # Already a multiple: unchanged.
    assert pad_collate(rand_feats([8]), pad_to_multiple=8)[0].shape == (1, 8, 3)
    assert pad_collate(rand_feats([3]), pad_to_multiple=1)[0].shape == (1, 3, 3)


@pytest.mark.parametrize("bad", [0, -8, 2.0, True])
def test_pad_to_multiple_invalid(bad: object) -> None:
    with pytest.raises(ConfigError, match="pad_to_multiple"):
        pad_collate(rand_feats([2]), pad_to_multiple=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_dtypes_preserved(dtype: torch.dtype) -> None:
    feats = [torch.ones(n, 2).to(dtype) for n in (1, 3)]
    padded, _ = pad_collate(feats)
    assert padded.dtype == dtype
    assert torch.equal(padded, pad_sequence(feats, batch_first=True))


def test_non_contiguous_items() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    feats = [base[:, ::2], base[:2, 1::2]]  # strided views
    padded, _ = pad_collate(feats)
    assert torch.equal(padded, pad_sequence([f.contiguous() for f in feats], batch_first=True))


def test_dict_batch() -> None:
    hidden = rand_feats([2, 5], (4,), seed=1)
    frames = rand_feats([3, 1], (), seed=2)
    batch = [{"hidden": h, "frames": f} for h, f in zip(hidden, frames, strict=True)]
    out = pad_collate(batch, pad_value=-1.0)
    assert set(out) == {"hidden", "frames"}
    h_pad, h_len = out["hidden"]
    f_pad, f_len = out["frames"]
    assert torch.equal(h_pad, pad_sequence(hidden, batch_first=True, padding_value=-1.0))
    assert torch.equal(f_pad, pad_sequence(frames, batch_first=True, padding_value=-1.0))
    assert h_len.tolist() == [2, 5]
    assert f_len.tolist() == [3, 1]


def test_dict_batch_key_mismatch() -> None:
    batch = [{"a": torch.ones(1)}, {"b": torch.ones(1)}]
    with pytest.raises(ConfigError, match=r"item 1.*missing \['a'\].*extra \['b'\]"):
        pad_collate(batch)


def test_tuple_with_int_labels() -> None:
    feats = rand_feats([4, 2, 6])
    batch = [(f, i) for i, f in enumerate(feats)]
    padded, lengths, labels = pad_collate(batch)
    assert torch.equal(padded, pad_sequence(feats, batch_first=True))
    assert lengths.tolist() == [4, 2, 6]
    assert labels.tolist() == [0, 1, 2]
    assert labels.dtype == torch.int64


def test_list_items_with_several_extras() -> None:
    feats = rand_feats([1, 3])
    batch = [[f, torch.tensor([i, i]), f"id{i}", 0.5 * i] for i, f in enumerate(feats)]
    padded, _, targets, ids, weights = pad_collate(batch)
    assert padded.shape == (2, 3, 3)
    assert targets.tolist() == [[0, 0], [1, 1]]
    assert ids == ["id0", "id1"]
    assert weights.tolist() == [0.0, 0.5]


def test_tuple_with_dict_feature() -> None:
    feats = rand_feats([2, 3])
    batch = [({"h": f}, i) for i, f in enumerate(feats)]
    features, labels = pad_collate(batch)
    padded, lengths = features["h"]
    assert torch.equal(padded, pad_sequence(feats, batch_first=True))
    assert lengths.tolist() == [2, 3]
    assert labels.tolist() == [0, 1]


def test_keyword_stack_dataset_items_pad_features_and_collate_the_rest() -> None:
    """A keyword ``StackDataset(feats=ds, y=labels)`` gives dict items whose labels are no
    ``[T, ...]`` tensor: the label was taken for a feature part ("item 0['y'] must be a tensor
    of shape [T, D...]"), where the positional form worked. Features are padded (a tensor, or
    a multi-part dict), everything else goes through ``default_collate``."""
    from torch.utils.data import StackDataset

    feats = rand_feats([3, 1, 2])
    parts = [{"tokens": f, "pooled": f.mean(0, keepdim=True)} for f in feats]
    stacked = StackDataset(
        feats=feats, parts=parts, y=[7, 8, 9], name=["a", "b", "c"],
        weight=[torch.tensor(w) for w in (0.5, 1.0, 2.0)],
    )  # fmt: skip
    batch = next(iter(DataLoader(stacked, batch_size=3, collate_fn=pad_collate)))
    padded, lengths = batch["feats"]
    assert torch.equal(padded, pad_sequence(feats, batch_first=True))
    assert lengths.tolist() == [3, 1, 2]
    tokens, token_lengths = batch["parts"]["tokens"]
    assert torch.equal(tokens, padded) and token_lengths.tolist() == [3, 1, 2]
    assert batch["parts"]["pooled"][0].shape == (3, 1, 3)
    assert batch["y"].tolist() == [7, 8, 9] and batch["name"] == ["a", "b", "c"]
    assert batch["weight"].tolist() == [0.5, 1.0, 2.0]
    with pytest.raises(ConfigError, match=r"item 0\['y'\] cannot be batched"):
        pad_collate([{"h": torch.ones(2), "y": object()}, {"h": torch.ones(1), "y": object()}])


def test_empty_batch() -> None:
    with pytest.raises(ConfigError, match="empty batch"):
        pad_collate([])


def test_mixed_dtypes() -> None:
    with pytest.raises(ConfigError, match=r"item 1 .*dtype"):
        pad_collate([torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)])


def test_mismatched_trailing_dims_names_index() -> None:
    with pytest.raises(ConfigError, match=r"item 2 has shape \(2, 4\), expected \[T, 3\]"):
        pad_collate([torch.ones(2, 3), torch.ones(1, 3), torch.ones(2, 4)])


def test_mismatched_dims_in_dict_names_key() -> None:
    batch = [{"h": torch.ones(2, 3)}, {"h": torch.ones(2, 5)}]
    with pytest.raises(ConfigError, match=r"item 1\['h'\]"):
        pad_collate(batch)


def test_scalar_items_rejected() -> None:
    with pytest.raises(ConfigError, match=r"\[T, D...\]"):
        pad_collate([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ConfigError, match="item 1"):
        pad_collate([torch.ones(2), torch.tensor(2.0)])


def test_unsupported_items() -> None:
    with pytest.raises(ConfigError, match="cannot batch items of type int"):
        pad_collate([1, 2])
    with pytest.raises(ConfigError, match="first element"):
        pad_collate([(1, torch.ones(2))])
    with pytest.raises(ConfigError, match="item 1 is not a tuple/list of length 2"):
        pad_collate([(torch.ones(2), 1), (torch.ones(2),)])
    with pytest.raises(ConfigError, match="item 1 is a list, item 0 is a tensor"):
        pad_collate([torch.ones(2), [1.0]])


def test_not_in_shared_memory_in_main_process() -> None:
    padded, _ = pad_collate(rand_feats([2, 3]))
    assert not padded.is_shared()


class VarLenDataset(Dataset):
    """Deterministic random-length features with int labels."""

    def __init__(self, n: int = 23) -> None:
        g = torch.Generator().manual_seed(7)
        self.lengths = torch.randint(0, 12, (n,), generator=g).tolist()
        self.items = [torch.randn(t, 4, generator=g) for t in self.lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i], i


def _shared_flag_collate(batch: list) -> tuple:
    padded, lengths, labels = pad_collate(batch, pad_to_multiple=4, pad_value=-2.0)
    # Recorded in the worker: the pickler would move it to shared memory anyway later.
    return padded, lengths, labels, torch.tensor(padded.is_shared())


def test_dataloader_workers_match_single_process() -> None:
    ds = VarLenDataset()
    results = {}
    for workers in (0, 2):
        loader = DataLoader(ds, batch_size=5, num_workers=workers, collate_fn=_shared_flag_collate)
        results[workers] = list(loader)
    assert len(results[0]) == len(results[2]) == 5
    for single, multi in zip(results[0], results[2], strict=True):
        for a, b in zip(single[:3], multi[:3], strict=True):
            assert torch.equal(a, b)
        assert not single[3].item()
        assert multi[3].item()  # built directly in shared memory inside the worker
    # And against the naive reference.
    padded, lengths, labels, _ = results[2][0]
    feats = [ds.items[i] for i in range(5)]
    ref = pad_sequence(feats, batch_first=True, padding_value=-2.0)
    assert torch.equal(padded[:, : ref.shape[1]], ref)
    assert torch.all(padded[:, ref.shape[1] :] == -2.0)
    assert padded.shape[1] % 4 == 0
    assert lengths.tolist() == [t.shape[0] for t in feats]
    assert labels.tolist() == list(range(5))


# --- PaddedBatch: a batch the dataset already built in place ---------------------------------


def _prepadded() -> tuple[PaddedBatch, list[torch.Tensor]]:
    items = [torch.randn(n, 3) for n in (2, 5, 3)]
    padded = torch.zeros(3, 5, 3)
    for i, t in enumerate(items):
        padded[i, : len(t)] = t
    return PaddedBatch.of(padded, [len(t) for t in items]), items


def test_padded_batch_is_returned_without_copy() -> None:
    batch, items = _prepadded()
    padded, lengths = pad_collate(batch)
    assert padded is batch.padded
    assert lengths.tolist() == [2, 5, 3]
    ref, ref_len = pad_collate(list(items))
    assert torch.equal(padded, ref) and torch.equal(lengths, ref_len)


def test_padded_batch_with_other_options_is_copied_correctly() -> None:
    batch, items = _prepadded()
    padded, _ = pad_collate(batch, pad_to_multiple=4)
    assert padded.shape == (3, 8, 3) and padded is not batch.padded
    assert torch.equal(padded, pad_collate(list(items), pad_to_multiple=4)[0])
    padded, _ = pad_collate(batch, pad_value=-1.0)
    assert padded[0, 2:].eq(-1).all() and torch.equal(padded[1], items[1])
    padded, _ = pad_collate(batch, pad_to_multiple=5)  # already a multiple: no copy needed
    assert padded is batch.padded


def test_a_batch_built_whole_makes_its_item_views_only_when_asked() -> None:
    # FeatureLoader hands a dataset's padded batch straight to pad_collate, which never reads
    # its item views; making them cost 45-85 us a batch of 32.
    from featbake.serve.collate import batches_whole

    items = [torch.randn(n, 3) for n in (2, 5, 3)]
    padded = torch.zeros(3, 5, 3)
    for i, t in enumerate(items):
        padded[i, : len(t)] = t
    with batches_whole():
        batch = PaddedBatch.of(padded, [2, 5, 3])
    assert list(batch) == [] and batch.lengths.tolist() == [2, 5, 3]
    got, lengths = pad_collate(batch)
    assert got is padded and lengths.tolist() == [2, 5, 3] and list(batch) == []
    for kw in ({"pad_to_multiple": 4}, {"pad_value": -1.0}):  # padded again: from its items
        with batches_whole():
            again = PaddedBatch.of(padded, [2, 5, 3])
        want = pad_collate(list(items), **kw)  # type: ignore[arg-type]
        assert all(torch.equal(a, b) for a, b in zip(pad_collate(again, **kw), want, strict=True))
    views = batch.with_views()
    assert views is batch and batch.with_views() is batch and len(batch) == 3
    assert all(torch.equal(v, t) for v, t in zip(batch, items, strict=True))
    assert batch[1].data_ptr() == padded[1].data_ptr()  # views, not copies
    with pytest.raises(ConfigError, match="pad_to_multiple"):
        pad_collate(PaddedBatch.of(padded, [2, 5, 3]), pad_to_multiple=0)


def test_batch_pool_never_reuses_a_buffer_still_in_use() -> None:
    from featbake.serve.collate import BatchPool

    pool = BatchPool(keep=2, min_bytes=1024)
    a = pool.empty((64, 64), torch.float32)
    a.fill_(1.0)
    view = a[3:5]  # only a view survives: the buffer is still in use
    del a
    b = pool.empty((64, 64), torch.float32)
    b.fill_(2.0)
    assert torch.all(view == 1.0)
    assert pool.reused == 0 and pool.created == 2
    arr = b.numpy()  # a numpy array of the batch also holds it
    del b
    c = pool.empty((64, 64), torch.float32)
    c.fill_(3.0)
    assert torch.all(view == 1.0) and (arr == 2.0).all()
    del view, c
    d = pool.empty((60, 64), torch.float32)  # a slightly smaller batch reuses a free buffer
    assert pool.reused == 1
    d.fill_(4.0)
    assert (arr == 2.0).all()


def test_pad_collate_pooled_batches_are_fully_rewritten() -> None:
    # A reused buffer holds an old batch: padding must be written, not assumed zero.
    long = rand_feats([600, 600], dims=(512,), seed=1)
    first, _ = pad_collate(long)
    assert first.nbytes >= 1 << 20  # big enough for the pool
    del first
    from featbake.serve import collate

    reused = collate._pool.reused
    feats = rand_feats([300, 599], dims=(512,), seed=2)
    padded, lengths = pad_collate(feats)
    assert collate._pool.reused == reused + 1
    assert torch.equal(padded, pad_sequence(feats, batch_first=True))
    assert lengths.tolist() == [300, 599]


def test_batch_pool_hands_out_the_newest_free_buffer() -> None:
    # Newest first: batches are dropped in the order made, so that buffer was freed last, the
    # likeliest to be in the CPU's caches (oldest first, a loader's 8 buffers behind a loop
    # holding 2 each took the coldest: issue 31).
    from featbake.serve.collate import BatchPool

    pool = BatchPool(keep=4, min_bytes=1024)
    first = [pool.empty((64, 64), torch.float32) for _ in range(3)]
    ptrs = [t.data_ptr() for t in first]
    del first  # all three free, the last one handed out is the newest
    again = pool.empty((64, 64), torch.float32)
    assert again.data_ptr() == ptrs[2] and pool.reused == 1
    del again
    assert pool.empty((64, 64), torch.float32).data_ptr() == ptrs[2]
