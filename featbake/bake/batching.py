"""Batching plans for the bake (pure): which pending items go to the encoder together."""

from __future__ import annotations

from collections import OrderedDict
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
