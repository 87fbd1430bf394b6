"""Whether padded batches pay on this device (pure): their time per input sample against the
same encoder's time per sample on an item run alone.

On a GPU a padded batch of 16 clips costs little more than one clip (measured on an H200: a
wav2vec2-base-sized build 2.35x faster than one clip at a time). On a CPU one clip of a model
that size already keeps the cores busy: batching gains nothing there, and the padding and the
larger working set cost (measured on 2 cores, a small wav2vec2 with the user's one thread:
batches of 16 clips of 1-4 s took 1.6x the time of the clips one at a time). The exactness
guard runs one item of every padded batch alone anyway, so each padded batch yields both
rates for free; :class:`PaceTally` adds them up and says when the batches lose.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Padded batches not counted: the first calls pay for warm-up (lazy init, kernel choice).
WARMUP_BATCHES = 1
#: Counted batches before a verdict.
DECIDE_AFTER = 2
#: Padded batches lose when their time per sample is this much above running items alone.
SLOWER_BY = 1.10


class Pace(enum.Enum):
    """What the timings say so far."""

    UNDECIDED = "undecided"
    PADDED_PAYS = "padded pays"
    ALONE_FASTER = "alone faster"


@dataclass
class PaceTally:
    """Seconds and input samples of padded batches and of items run alone, warm-up excluded.

    ``padded_samples`` counts each item's own samples (not the padding): padding is a cost, as
    is the guard's run alone, which the caller adds to ``padded_seconds`` (exact shapes need no
    guard).

    Example:
        >>> tally = PaceTally()
        >>> for _ in range(3):  # 20 ms per sample padded, 10 ms alone
        ...     tally.add(2.0, 100, 0.5, 50)
        >>> tally.verdict(), round(tally.ratio(), 2)
        (<Pace.ALONE_FASTER: 'alone faster'>, 2.0)
    """

    padded_seconds: float = 0.0
    padded_samples: int = 0
    alone_seconds: float = 0.0
    alone_samples: int = 0
    batches: int = 0  # padded batches seen, warm-up included

    def add(
        self, padded_seconds: float, padded_samples: int, alone_seconds: float, alone_samples: int
    ) -> None:
        """One padded batch and its guard's item run alone."""
        self.batches += 1
        if self.batches <= WARMUP_BATCHES:
            return
        self.padded_seconds += padded_seconds
        self.padded_samples += padded_samples
        self.alone_seconds += alone_seconds
        self.alone_samples += alone_samples

    def ratio(self) -> float:
        """Padded batches' seconds per sample over alone's (nan before anything counted)."""
        if not self.padded_samples or not self.alone_samples or self.alone_seconds <= 0:
            return float("nan")
        padded = self.padded_seconds / self.padded_samples
        return padded / (self.alone_seconds / self.alone_samples)

    def verdict(self) -> Pace:
        """UNDECIDED until ``DECIDE_AFTER`` batches past the warm-up were counted."""
        if self.batches < WARMUP_BATCHES + DECIDE_AFTER:
            return Pace.UNDECIDED
        return Pace.ALONE_FASTER if self.ratio() > SLOWER_BY else Pace.PADDED_PAYS
