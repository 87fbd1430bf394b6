"""The block plan a bucket store follows while reads come in a block order: the shards each
window of an epoch reads, the window the reads are in, what to keep and what to evict (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


# What a bucket store follows while the reads come in a block order (``FeatureLoader(ds,
# shuffle="blocks")``, ``featbake.BlockSampler``): the shards each window of the epoch reads, in
# order; pure.
#
# Such an order needs only a window of shards at a time, and the tier is sized to hold two
# (docs/object_store.md), so the store reads whole shards (never ranges), fetches the next
# window's shards on a background thread while the current one is read, and evicts a window's
# shards once the reads have moved past it. The reads say where they are by opening shards: the
# first read of a shard of a later window moves the plan there.
class BlockWindowWarning(UserWarning):
    """A block order's window outweighs the local tier: the store reads as it would without
    the order (said once per store and process)."""


class BlockPlan:
    """The shards one rank's block-ordered epoch reads, window by window, the window the reads
    are in (``current``; -1 before the first) and the shards they have opened.

    A batch may straddle two windows, and its items are read on several threads: a shard of
    the window just passed may still be opened after a shard of the next one. So a window's
    shards are kept (:meth:`keep`) until read, and only those read are evicted (:meth:`passed`).

    Example:
        >>> plan = BlockPlan([["a", "b"], ["c"], ["d", "e"]])
        >>> plan.opened("a")  # the first read: window 0
        0
        >>> plan.current = 0
        >>> plan.opened("c"), plan.opened("a")
        (1, None)
        >>> plan.current = 1
        >>> plan.passed(1), plan.keep(1)  # "b" is not read yet: a batch may want it
        (['a'], ('c', 'd', 'e', 'b'))
        >>> padded = BlockPlan([["b"], ["a"], ["c"], ["b"]])  # the rank's padding: "b" again
        >>> padded.current = 0
        >>> padded.opened("b"), padded.opened("a")
        (None, 1)
        >>> padded.current = 2
        >>> padded.opened("b")  # read again at the end: the padding window's
        3
    """

    def __init__(self, windows: Sequence[Sequence[str]]) -> None:
        self.windows = [tuple(dict.fromkeys(w)) for w in windows]
        self.current = -1
        self.read: set[str] = set()
        self._at: dict[str, list[int]] = {}
        for k, w in enumerate(self.windows):
            for name in w:
                self._at.setdefault(name, []).append(k)

    def opened(self, name: str) -> int | None:
        """Note that a read opened shard ``name``; the window that moves the reads to, or None
        when it moves nothing (a shard of the current window, of one passed, or of none)."""
        self.read.add(name)
        at = self._at.get(name, ())
        if self.current in at:
            return None
        if any(k < self.current for k in at):
            # Read before and by a later window too (a rank's padding repeats the epoch's first
            # items at its end): the next window's when that window reads it (each padding
            # window entered in turn, and fetched ahead), else a passed window's late read
            # (moving on to a later window would leave the windows between unkept).
            return self.current + 1 if self.current + 1 in at else None
        return at[0] if at else None

    def keep(self, k: int) -> tuple[str, ...]:
        """What the tier holds while the reads are in window ``k``: the shards of window ``k``,
        then of window ``k + 1``, then those of window ``k - 1`` not read yet."""
        ahead = [n for w in self.windows[max(k, 0) : k + 2] for n in w]
        behind = [n for n in self.windows[k - 1] if n not in self.read] if k >= 1 else []
        return tuple(dict.fromkeys([*ahead, *behind]))

    def passed(self, k: int) -> list[str]:
        """Shards of the windows before ``k`` that were read and no window from ``k`` on
        reads again, the oldest window's first: the tier's room for what comes."""
        later = {n for w in self.windows[max(k, 0) :] for n in w}
        before = (n for w in self.windows[: max(k, 0)] for n in w)
        return list(dict.fromkeys(n for n in before if n in self.read and n not in later))


def windows_over(windows: Sequence[Sequence[str]], sizes: Mapping[str, int], budget: int) -> int:
    """How many of ``windows`` outweigh ``budget`` bytes (``sizes`` of their shards).

    Example:
        >>> windows_over([["a"], ["a", "b"]], {"a": 6, "b": 6}, budget=10)
        1
    """
    return sum(sum(sizes.get(n, 0) for n in set(w)) > budget for w in windows)
