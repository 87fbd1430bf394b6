"""What the loader asks of its dataset, reached through ``StackDataset`` and ``Subset``: the
reads to start ahead of a batch (:class:`ReadAhead`, :func:`hint_of`) and each item's length
and shard (:func:`placement_of`), which plan epochs by length and by block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import StackDataset, Subset

from featbake.serve.index import ItemPlacement

#: Items whose reads are started ahead of the batch being read (measured on a cold store of
#: ~600 KB items: 16-64 in flight all gave about the disk's bandwidth; 1 gave half of it).
READ_AHEAD = 32
#: Items in a row found cached after which only every SAMPLE-th item is hinted (see ReadAhead).
WARM_STREAK = 256
SAMPLE = 8


class ReadAhead:
    """Which items to hint before each batch: those up to ``window`` past the batch's end.

    The batches are one rank's epoch in order; each item is hinted once, before its batch is
    read and at most ``window`` items ahead of that batch's end. ``hint`` returns
    how many reads it started. Once ``WARM_STREAK`` items in a row were all cached (a store in
    the page cache), only every ``SAMPLE``-th item is hinted, which is enough to notice the
    store going cold: the first sampled item that starts a read has the items skipped since the
    last sample hinted too, and ends the streak. (A hint per item made a warm epoch of one item
    per step 5-10% slower here.)
    """

    def __init__(
        self,
        batches: Sequence[Sequence[int]],
        window: int,
        hint: Callable[[list[int]], int] | None,
        streak: int = 0,
    ) -> None:
        self._flat = [i for idx in batches for i in idx] if hint is not None and window else []
        self._ends = list(itertools.accumulate(len(idx) for idx in batches))
        self._window = window
        self._chunk = max(1, window // 4)
        self._hint = hint
        self._done = 0  # items of the flat order hinted (or skipped as warm) so far
        self.streak = streak  # items in a row whose hints found them cached (an epoch's
        # last is the next one's first: a warm store is not probed item by item every epoch)
        self._skipped: list[int] = []  # items not hinted since the last sample (warm)

    def before(self, b: int) -> None:
        """Hint the items not hinted yet, up to ``window`` past the end of batch ``b``.

        Batch ``b``'s own items are always hinted by now; past them, hints wait until a
        quarter of the window is due, so one item per step makes one call per few items (each
        call's probe lets the training thread take the GIL, which it may then hold for a while).
        """
        if self._hint is None or not self._flat:
            return
        start, upto = self._done, min(len(self._flat), self._ends[b] + self._window)
        if upto - start < self._chunk and start >= self._ends[b]:
            return
        self._done = upto
        flat = self._flat
        if self.streak < WARM_STREAK:
            started = self._hint(flat[start:upto])
        else:
            self._skipped += [flat[p] for p in range(start, upto) if p % SAMPLE]
            sample = [flat[p] for p in range(start, upto) if not p % SAMPLE]
            if not sample:
                return
            started = self._hint(sample)
            if started:  # cold again: the items skipped since the last sample too
                self._hint(self._skipped)
            self._skipped = []
        self.streak = 0 if started else self.streak + upto - start


def hint_of(dataset: Any) -> Callable[[list[int]], int] | None:
    """The dataset's ``will_need``, or one that reaches it through ``StackDataset`` members
    (which all take the same index) or a ``Subset`` (which maps it); None when it has none."""
    hint = getattr(dataset, "will_need", None)
    if callable(hint):
        return hint
    if isinstance(dataset, Subset):
        inner = hint_of(dataset.dataset)
        if inner is None:
            return None
        mapping = dataset.indices
        return lambda idx: inner([mapping[i] for i in idx])
    if isinstance(dataset, StackDataset):
        members = dataset.datasets
        found = [hint_of(m) for m in (members.values() if isinstance(members, dict) else members)]
        hints = [h for h in found if h is not None]
        if hints:
            return lambda idx: sum(h(idx) for h in hints)
    return None


def placement_of(dataset: Any) -> ItemPlacement | None:
    """Each item's length and shard as the catalog holds them (no feature read), through
    ``StackDataset`` (its first member that knows) and ``Subset``; None when none knows."""
    placement = getattr(dataset, "placement", None)
    if callable(placement):
        found: ItemPlacement = placement()
        return found
    if isinstance(dataset, Subset):
        inner = placement_of(dataset.dataset)
        if inner is None:
            return None
        idx = np.asarray(dataset.indices, dtype=np.int64)
        return ItemPlacement(inner.lengths[idx], inner.shards[idx])
    if isinstance(dataset, StackDataset):
        members = dataset.datasets
        for m in members.values() if isinstance(members, dict) else members:
            if (inner := placement_of(m)) is not None:
                return inner
    return None
