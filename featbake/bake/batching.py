"""Batching plans for the bake (pure): which pending items go to the encoder together.

:class:`ShapeBatcher` groups inputs of equal shape (any encoder); :class:`LengthBatcher` sorts
inputs by length and cuts padded batches to a budget (encoders that take lengths).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from featbake.errors import ConfigError


# -- batching (pure) ---------------------------------------------------------------------------
class ShapeBatcher:
    """Groups items of equal shape into batches of up to ``batch_size``.

    Items of a shape seen rarely would wait forever; once more than ``max_pending`` items are
    held, the largest group is released as a (smaller) batch, so memory stays bounded.
    """

    def __init__(self, batch_size: int, max_pending: int | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.max_pending = max_pending or 4 * batch_size
        self._groups: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()
        self._pending = 0

    def add(self, shape: tuple[int, ...], item: Any) -> list[list[Any]]:
        """Add an item; return the batches that are now ready (possibly none)."""
        group = self._groups.setdefault(shape, [])
        group.append(item)
        self._pending += 1
        ready = []
        if len(group) >= self.batch_size:
            ready.append(self._take(shape))
        while self._pending > self.max_pending:
            largest = max(self._groups, key=lambda s: len(self._groups[s]))
            ready.append(self._take(largest))
        return ready

    def flush(self) -> list[list[Any]]:
        """Every remaining group as a batch."""
        return [self._take(s) for s in list(self._groups)]

    def _take(self, shape: tuple[int, ...]) -> list[Any]:
        group = self._groups.pop(shape)
        self._pending -= len(group)
        return group


class LengthBatcher:
    """Holds items, sorts them by length, and releases batches cut to a padded-samples budget.

    Sorting first is what makes padding cheap: neighbours in length order waste little on
    padding (Hugging Face's pipeline docs show unsorted padding making batch 64 five times
    slower than batch 1). Up to ``pool_items`` items or ``pool_samples`` samples are held; then
    every planned batch is released except the last one when it is small enough to grow, so
    memory stays bounded and a huge item (a 3-hour file) is released alone at once.

    Args:
        batch_size: the cap on items per batch.
        budget: padded samples per batch (``rows * longest``); an item longer than this runs alone.
        pool_items: items held before planning (default ``8 * batch_size``).
    """

    def __init__(self, batch_size: int, budget: int, pool_items: int | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        if budget < 1:
            raise ConfigError(f"the batch budget must be at least 1 sample, got {budget}")
        self.batch_size = batch_size
        self.budget = budget
        self.pool_items = pool_items or 8 * batch_size
        self.pool_samples = 4 * budget
        self._lengths: list[int] = []
        self._items: list[Any] = []

    @property
    def pending(self) -> int:
        """Items held, not yet released."""
        return len(self._items)

    def add(self, length: int, item: Any) -> list[list[Any]]:
        """Add an item of ``length`` samples; return the batches that are now ready."""
        self._lengths.append(length)
        self._items.append(item)
        if len(self._items) >= self.pool_items or sum(self._lengths) > self.pool_samples:
            return self._release(keep_last=True)
        return []

    def flush(self) -> list[list[Any]]:
        """Every held item, in batches."""
        return self._release(keep_last=False)

    def _release(self, *, keep_last: bool) -> list[list[Any]]:
        plan = plan_by_length(self._lengths, self.batch_size, self.budget)
        kept: list[int] = []
        if keep_last and plan and self._can_grow(plan[-1]):
            kept = plan.pop()
        batches = [[self._items[i] for i in batch] for batch in plan]
        self._lengths, self._items = (
            [self._lengths[i] for i in kept],
            [self._items[i] for i in kept],
        )
        return batches

    def _can_grow(self, batch: list[int]) -> bool:
        longest = max(self._lengths[i] for i in batch)
        return len(batch) < self.batch_size and longest * (len(batch) + 1) <= self.budget


def plan_by_length(lengths: Sequence[int], batch_size: int, budget: int) -> list[list[int]]:
    """Indices sorted by length, cut greedily into batches of padded cost <= ``budget``.

    A batch's padded cost is ``rows * longest``. Each batch holds at most ``batch_size`` items;
    an item longer than ``budget`` gets a batch of its own. Ties keep input order, so the plan is
    deterministic.

    Example:
        >>> plan_by_length([5, 1, 4, 2], batch_size=2, budget=100)
        [[1, 3], [2, 0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending: the item added is the batch's longest
        if current and (len(current) >= batch_size or lengths[i] * (len(current) + 1) > budget):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
