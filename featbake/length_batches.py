"""Items cut into batches by length under a padded budget: the one greedy rule the build's
padded batches (``bake/batching.py``) and the loaders' ``batch_frames`` (``serve/sampling.py``)
both plan with (pure).

A batch's padded cost is its item count times the padded length of its longest item; items are
taken in the order given (the callers sort them by length, the loaders with noise so that each
epoch's batches differ), and a batch ends where the next item would take it over ``budget`` or
past ``max_items``. An item over ``budget`` on its own is a batch of its own.

Example:
    >>> greedy_batches([1, 3, 2, 0], [5, 1, 4, 2], budget=8)
    [[1, 3], [2], [0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def greedy_batches(
    order: Iterable[int],
    lengths: Sequence[int],
    budget: int,
    max_items: int | None = None,
    pad_to: Callable[[int], int] = int,
) -> list[list[int]]:
    """``order``'s items (indices into ``lengths``) in consecutive batches whose padded cost,
    ``len(batch) * pad_to(longest)``, is at most ``budget`` and whose size is at most
    ``max_items`` (None: no cap); ``pad_to`` is nondecreasing (the length a batch is padded to).

    Example:
        >>> greedy_batches(range(4), [1, 2, 3, 9], budget=6, max_items=2)
        [[0, 1], [2], [3]]
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        padded = max(longest, pad_to(int(lengths[i])))
        full = max_items is not None and len(batch) >= max_items
        if batch and (full or (len(batch) + 1) * padded > budget):
            batches.append(batch)
            batch, padded = [], pad_to(int(lengths[i]))
        batch.append(i)
        longest = padded
    if batch:
        batches.append(batch)
    return batches
