"""``BlockSampler``: the block shuffle as a sampler for ``DataLoader``, and the rank and world
size that a sampler or loader takes from ``torch.distributed`` when not given."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from featbake.errors import ConfigError
from featbake.serve.read_ahead import placement_of
from featbake.serve.sampling import Order, Shuffle


class BlockSampler(Sampler[int]):
    """Indices in blocks of shards, for ``DataLoader`` users: what ``FeatureLoader(ds,
    shuffle="blocks")`` reads, as a sampler.

    Each epoch visits the shards in a new order (``seed`` and the epoch), ``window`` shards at a
    time, the items of each window shuffled together: a reader needs only ``window`` shards at
    once, so a bucket store's tier of a few shards serves the epoch fetching each about once.
    What it gives up against a full shuffle is in :mod:`featbake.serve.sampling`. Split over
    ranks as ``DistributedSampler`` (``num_replicas``, ``rank`` default from
    ``torch.distributed``; the first items repeated so every rank takes as many).

    Args:
        dataset: a :class:`~featbake.CachedFeatureDataset` (or one in a ``StackDataset`` or
            ``Subset``): its catalog says each item's shard, nothing is read.
        seed: the order's seed (the same on every rank).
        window: shards open at a time.
        num_replicas, rank: this process's share, as ``DistributedSampler``.
        drop_last: drop the items that do not divide evenly among ranks instead of repeating.

    Example:
        >>> sampler = BlockSampler(ds, seed=0, window=4)  # doctest: +SKIP
        >>> loader = DataLoader(ds, 32, sampler=sampler, collate_fn=pad_collate)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for padded, lengths in loader: ...
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int = 0,
        window: int = 4,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        placement = placement_of(dataset)
        if placement is None:
            raise ConfigError(
                "BlockSampler needs a CachedFeatureDataset (or one in a StackDataset or Subset), "
                "whose catalog knows each item's shard"
            )
        self._shards = placement.shards.tolist()
        rank, world = rank_and_world(rank, num_replicas)
        self._order = Order(len(dataset), 1, Shuffle.BLOCKS, seed, rank, world, drop_last,
                            window=window)  # fmt: skip
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s order next (call it before each epoch, as DistributedSampler)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        batches = self._order.batches(self.epoch, shards=self._shards)
        return iter([i for b in batches for i in b])

    def __len__(self) -> int:
        return self._order.item_plan(self.epoch).per_rank()


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank and world size given, else torch.distributed's, else the whole dataset."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if distributed():
        dist = torch.distributed
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    if rank is not None or world_size is not None:
        raise ConfigError(
            "give both rank and world_size (or neither, to take them from torch.distributed)"
        )
    return 0, 1


def distributed() -> bool:
    """True inside an initialised ``torch.distributed`` process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()
