"""``MixedDataset``: several datasets drawn at set proportions, one map-style dataset per epoch.

Training on several corpora at once (speech sets of different sizes, images from several
sources) wants each batch drawn from dataset ``k`` with probability ``weights[k]``, an
up-weighted small set repeated evenly, and a down-weighted large one covered across epochs
rather than sampled with replacement (MosaicML streaming's ``Stream(proportion=...)``, litdata's
``CombinedStreamingDataset(datasets, weights)``). Here an epoch is a list of ``epoch_items``
(dataset, item) pairs, a pure function of ``(seed, epoch)`` and the datasets' lengths:

1. how many items each dataset gives this epoch: a multinomial draw of ``epoch_items`` over
   ``weights`` (seeded by ``(seed, epoch)``);
2. which position of the epoch each gives: a seeded permutation of those labels;
3. which of its items: dataset ``k`` walks a seeded permutation of its items without repeats,
   then a fresh permutation, and so on; its walk goes on across epochs (epoch ``e`` starts where
   the draws of epochs ``0 .. e-1`` left it), so over epochs every item is visited in turn.

Because an epoch is a function of its number, :class:`~featbake.serve.loader.FeatureLoader`'s
``state_dict`` resumes a mixed epoch exactly, and a ``DataLoader`` takes it as any map-style
dataset (call :meth:`MixedDataset.set_epoch` each epoch, as with ``DistributedSampler``).

Example:
    >>> plan = MixPlan(lengths=(3, 5), weights=(0.5, 0.5), epoch_items=8, seed=0)
    >>> sorted(k for k, _ in plan.epoch(0)).count(0) + sorted(k for k, _ in plan.epoch(0)).count(1)
    8
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from featbake.errors import ConfigError
from featbake.serve.index import ItemPlacement
from featbake.serve.sampling import seeded

#: The stream of draws a seed makes: counts, positions and each dataset's permutations apart.
_COUNTS, _POSITIONS, _ITEMS = 0, 1, 2


def mix_weights(lengths: Sequence[int], weights: Sequence[float] | None) -> tuple[float, ...]:
    """``weights`` checked and summing to 1; None: in proportion to ``lengths`` (pure).

    Raises:
        ConfigError: a count that does not match, a negative or non-finite weight, all zero, or
            a positive weight on an empty dataset.

    Example:
        >>> mix_weights([10, 30], None), mix_weights([5, 5], [1, 3])
        ((0.25, 0.75), (0.25, 0.75))
    """
    if weights is None:
        weights = [float(n) for n in lengths]
    if len(weights) != len(lengths):
        raise ConfigError(f"{len(lengths)} datasets but {len(weights)} weights; give one each")
    w = [_weight(x, weights) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ConfigError(f"weights must be finite, >= 0 and not all 0; got {list(weights)}")
    empty = [k for k, (n, x) in enumerate(zip(lengths, w, strict=True)) if n == 0 and x > 0]
    if empty:
        raise ConfigError(f"dataset {empty[0]} is empty but has weight {w[empty[0]]}; give it 0")
    total = sum(w)
    if math.isinf(total):  # each weight finite, their sum past a float's range: scale first
        top = max(w)
        w = [x / top for x in w]
        total = sum(w)
    return tuple(x / total for x in w)


def _weight(x: Any, weights: Sequence[Any]) -> float:
    """One weight as a float, or the ConfigError naming them all."""
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"weights must be numbers; got {list(weights)}") from None


@dataclass(frozen=True)
class MixPlan:
    """Which (dataset, item) each position of an epoch reads (pure; see the module's doc)."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]
    epoch_items: int
    seed: int
    _cursors: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def counts(self, epoch: int) -> np.ndarray:
        """How many items each dataset gives in ``epoch``."""
        rng = seeded(self.seed, _COUNTS, epoch)
        return rng.multinomial(self.epoch_items, self.weights)

    def cursors(self, epoch: int) -> np.ndarray:
        """How far each dataset's walk had gone when ``epoch`` starts (its draws before)."""
        known = [e for e in self._cursors if e <= epoch]
        start = max(known, default=0)
        at = self._cursors.get(start, np.zeros(len(self.lengths), dtype=np.int64))
        for e in range(start, epoch):
            at = at + self.counts(e)
        self._cursors[epoch] = at
        return at

    def epoch(self, epoch: int) -> list[tuple[int, int]]:
        """Every position of ``epoch`` as (dataset, item), in order."""
        counts = self.counts(epoch)
        labels = np.repeat(np.arange(len(self.lengths)), counts)
        order = seeded(self.seed, _POSITIONS, epoch).permutation(labels)
        cursor = self.cursors(epoch).copy()
        out = []
        for k in order.tolist():
            out.append((k, self.item(k, int(cursor[k]))))
            cursor[k] += 1
        return out

    def item(self, k: int, draw: int) -> int:
        """Dataset ``k``'s item at the ``draw``-th step of its walk."""
        n = self.lengths[k]
        return int(_walk(self.seed, k, n, draw // n)[draw % n])


@lru_cache(maxsize=16)
def _walk(seed: int, k: int, n: int, lap: int) -> np.ndarray:
    """Dataset ``k``'s ``lap``-th permutation of its ``n`` items."""
    return seeded(seed, _ITEMS, k, lap).permutation(n)


def _length(k: int, dataset: Any) -> int:
    """How many items dataset ``k`` of a mixture holds, or the ConfigError saying it is not a
    map-style dataset."""
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError(
            f"dataset {k} of the mixture ({type(dataset).__name__}) has no len(); "
            "MixedDataset draws from map-style datasets (CachedFeatureDataset, StackDataset...)"
        ) from None


class MixedDataset(Dataset):
    """Several map-style datasets drawn at set proportions (see the module's doc).

    Args:
        datasets: the datasets (``CachedFeatureDataset``s over any stores, roots or places,
            ``StackDataset``s with labels, or any map-style dataset).
        weights: each dataset's share of an epoch (any positive scale); default: in
            proportion to their lengths.
        epoch_items: items per epoch; default: the sum of the datasets' lengths.
        seed: the mixture's seed; the same seed and epoch give the same epoch everywhere.

    Example:
        >>> mixed = MixedDataset([speech_a, speech_b], weights=[0.7, 0.3])  # doctest: +SKIP
        >>> loader = FeatureLoader(mixed, batch_size=32, shuffle=False)  # doctest: +SKIP
        >>> k, j = mixed.locate(0)  # item 0 of this epoch is speech_{k}[j]  # doctest: +SKIP
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        epoch_items: int | None = None,
        seed: int = 0,
    ) -> None:
        if not datasets:
            raise ConfigError("MixedDataset needs at least one dataset")
        self.datasets = list(datasets)
        lengths = tuple(_length(k, d) for k, d in enumerate(self.datasets))
        if not any(lengths):
            raise ConfigError(f"every dataset of the mixture is empty ({len(lengths)} given)")
        items = sum(lengths) if epoch_items is None else epoch_items
        if isinstance(items, bool) or not isinstance(items, int) or items < 1:
            raise ConfigError(f"epoch_items must be a whole number from 1, got {epoch_items!r}")
        self.plan = MixPlan(lengths, mix_weights(lengths, weights), items, int(seed))
        # Shared memory, not an int: a persistent DataLoader worker's copy sees set_epoch (as
        # ViewsDataset's epoch); each copy draws the order of the epoch it reads there.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._drawn = 0
        self._order = self.plan.epoch(0)

    @property
    def epoch(self) -> int:
        """The epoch being read (the same in the main process and every worker)."""
        return int(self._epoch)

    @property
    def weights(self) -> tuple[float, ...]:
        """Each dataset's share of an epoch (summing to 1)."""
        return self.plan.weights

    def fingerprint(self) -> str:
        """A digest of what draws the epochs (each dataset's length, the weights, items per
        epoch, the seed, and a mixture inside it): a loader folds it into its state's
        fingerprint, so a state saved over another mixture is refused rather than resumed
        into other items."""
        from featbake.serve.loader import fingerprint_of

        inner = [fingerprint_of(d) for d in self.datasets]
        return self._digest(inner if any(inner) else [])  # plain datasets: as before

    def own_fingerprint(self) -> str:
        """:meth:`fingerprint` without the mixtures inside it: what a state saved before they
        were folded in (serve6.4 in docs/reliability.md) holds."""
        return self._digest([])

    def _digest(self, inner: list[str]) -> str:
        p = self.plan
        shape: list[Any] = [list(p.lengths), list(p.weights), p.epoch_items, p.seed]
        if inner:
            shape.append(inner)
        blob = json.dumps(shape, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def items_digest(self) -> str:
        """A digest of the datasets' items (see :func:`featbake.serve.loader.items_of`), ""
        when none of them says."""
        from featbake.serve.loader import items_of

        inner = [items_of(d) for d in self.datasets]
        if not any(inner):
            return ""
        return hashlib.sha256("\n".join(inner).encode()).hexdigest()[:16]

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` from now on, here and in every DataLoader worker (persistent
        ones included): a function of the seed and the epoch alone. The datasets mixed are
        told too (a ``ViewsDataset``'s coins, a mixture inside this one draw that epoch's)."""
        from featbake.serve.loader import set_epoch_of

        self._epoch.fill_(int(epoch))
        for d in self.datasets:
            set_epoch_of(d, epoch)

    def _current(self) -> list[tuple[int, int]]:
        """This epoch's order, drawn again where another process set a new epoch."""
        epoch = int(self._epoch)
        if epoch != self._drawn:
            self._order, self._drawn = self.plan.epoch(epoch), epoch
        return self._order

    def __len__(self) -> int:
        return self.plan.epoch_items

    def locate(self, i: int) -> tuple[int, int]:
        """Position ``i`` of this epoch as (dataset, item in it)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} items")
        return self._current()[i]

    def __getitem__(self, i: int) -> Any:
        k, j = self.locate(i)
        return self.datasets[k][j]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch, each dataset's items read together (its own batched read where it has one)."""
        located = [self.locate(i) for i in indices]
        out: list[Any] = [None] * len(located)
        for k in sorted({k for k, _ in located}):
            at = [n for n, (kk, _) in enumerate(located) if kk == k]
            items = [located[n][1] for n in at]
            ds = self.datasets[k]
            many = getattr(ds, "__getitems__", None)
            got = many(items) if callable(many) else [ds[j] for j in items]
            for n, value in zip(at, got, strict=True):
                out[n] = value
        return out

    def will_need(self, indices: Sequence[int]) -> int:
        """Start the reads of items ``indices`` in the datasets that can (see
        :meth:`CachedFeatureDataset.will_need`); the reads started."""
        started = 0
        by_k: dict[int, list[int]] = {}
        for i in indices:
            k, j = self.locate(i)
            by_k.setdefault(k, []).append(j)
        for k, items in by_k.items():
            hint = getattr(self.datasets[k], "will_need", None)
            if callable(hint):
                started += hint(items)
        return started

    def placement(self, epoch: int | None = None) -> ItemPlacement:
        """Each position's length and shard this epoch (or epoch ``epoch``, without drawing
        it: a loader plans the next epoch while the current one is read), from the datasets
        that know (else -1), each dataset's shard ids kept apart, so block orders group items
        per dataset."""
        from featbake.serve.loader import placement_of

        per = [placement_of(d, epoch) for d in self.datasets]  # a mixture inside: that epoch's
        offsets, at = [], 0
        for p in per:
            offsets.append(at)
            at += int(p.shards.max()) + 1 if p is not None and len(p.shards) else 0
        lengths = np.full(len(self), -1, dtype=np.int64)
        shards = np.full(len(self), -1, dtype=np.int64)
        now = self._current()
        order = now if epoch is None or epoch == self._drawn else self.plan.epoch(epoch)
        for i, (k, j) in enumerate(order):
            p = per[k]
            if p is not None:
                lengths[i] = p.lengths[j]
                shards[i] = p.shards[j] + offsets[k] if p.shards[j] >= 0 else -1
        return ItemPlacement(lengths, shards)
