"""Which items an epoch reads, in which order, on which rank (pure: no I/O, no threads).

:class:`~featbake.serve.loader.FeatureLoader` yields what ``DataLoader(ds,
sampler=DistributedSampler(ds, ...), batch_size=B, drop_last=...)`` yields, so a training
script can swap one for the other and see the same batches. This module is that sampler's rule,
written out so it can be checked against torch's own over many sizes:

- shuffled: ``torch.randperm(n)`` from a generator seeded with ``seed + epoch`` (every rank
  computes the same permutation), else ``0..n-1``;
- split over ``world`` ranks: without ``drop_last`` the order is padded by repeating its head
  until it divides evenly (every rank takes the same number of steps, as DDP needs); with it,
  the tail that does not divide is dropped; rank ``r`` takes every ``world``-th index from
  ``r``;
- batched: consecutive runs of ``batch_size``; the last, shorter one is kept unless
  ``drop_last``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from featbake.errors import ConfigError


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: its indices in order, cut into batches."""

    n: int
    batch_size: int
    shuffle: bool
    seed: int
    epoch: int
    rank: int = 0
    world: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ConfigError(f"batch_size must be a whole number from 1, got {self.batch_size!r}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be a whole number from 1, got {self.batch_size}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(
                f"rank {self.rank} of {self.world} ranks: rank must be from 0 to world_size - 1"
            )

    def indices(self) -> list[int]:
        """This rank's indices for the epoch, in reading order (DistributedSampler's rule)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.world == 1:
            return order
        total = self.per_rank() * self.world
        if total > len(order) and order:
            pad = total - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[:total][self.rank : total : self.world]

    def batches(self) -> list[list[int]]:
        """The indices cut into batches of ``batch_size`` (the last kept unless ``drop_last``)."""
        idx = self.indices()
        cut = [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        if self.drop_last and cut and len(cut[-1]) < self.batch_size:
            cut.pop()
        return cut

    def per_rank(self) -> int:
        """How many indices each rank reads (DistributedSampler's ``num_samples``)."""
        if self.world == 1:
            return self.n
        if self.drop_last and self.n % self.world:
            return math.ceil((self.n - self.world) / self.world)
        return math.ceil(self.n / self.world)

    def batch_count(self) -> int:
        """How many batches :meth:`batches` returns, without drawing the permutation."""
        per_rank = self.per_rank()
        if self.drop_last:
            return per_rank // self.batch_size
        return math.ceil(per_rank / self.batch_size)
