"""Where a loader reads its next batches: on a thread of its own, or in the training loop.

A reader thread hides a batch's read behind the training step, but every batch it hands over
costs a wake-up of the training thread and turns on the GIL between the two. When the loop's
step is short next to a read (a loop that only reads: statistics over the features, an
evaluation pass over cached logits, a benchmark), there is nothing to hide the read behind and
the hand-over is all that is left: read-only, batches of 32 fp16 ``[T, 768]`` items on 2 CPUs,
reading in the loop's thread ran 1.12-1.25x ``DataLoader(num_workers=0)`` where the reader
thread ran 0.91-0.99x. :class:`Pace` keeps the last few step and read times and says where the
next batches are read; :func:`reads_in_loop` is the rule, pure and tested on its own.

Hysteresis keeps a loop near the edge from flapping: reads move into the loop when its median
step is under an eighth of the median read (reading in the loop then costs under an eighth more
than a read, while the hand-over costs more), and back to the thread once it passes a quarter.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Sequence
from enum import Enum

#: Batches a pace is judged over (the last steps and reads); no change before that many steps.
PACE_BATCHES = 8
#: Reads move into the loop when the median step is under 1/IN_LOOP_BELOW of the median read...
IN_LOOP_BELOW = 8
#: ...and back to the thread when it is over 1/ON_THREAD_ABOVE of it.
ON_THREAD_ABOVE = 4


class ReadsOn(Enum):
    """Where a loader reads its batches: ``"auto"`` by the loop's pace, ``"thread"`` always on
    its reader thread, ``"loop"`` always in the training loop's thread when it asks."""

    AUTO = "auto"
    THREAD = "thread"
    LOOP = "loop"


def reads_in_loop(steps: Sequence[float], reads: Sequence[float], in_loop: bool) -> bool:
    """Whether the next batches are read in the loop's thread, given the last ``steps`` (the
    loop's time between two batches, seconds) and ``reads`` (a batch's read), and whether they
    are now. Unchanged until :data:`PACE_BATCHES` steps and one read are known.

    Example:
        >>> reads_in_loop([0.0001] * 8, [0.002] * 8, in_loop=False)  # steps of 1/20 of a read
        True
        >>> reads_in_loop([0.001] * 8, [0.002] * 8, in_loop=True)  # steps of half a read
        False
    """
    if len(steps) < PACE_BATCHES or not reads:
        return in_loop
    step, read = statistics.median(steps[-PACE_BATCHES:]), statistics.median(reads[-PACE_BATCHES:])
    if in_loop:
        return step * ON_THREAD_ABOVE <= read
    return step * IN_LOOP_BELOW < read


class Pace:
    """The loop's recent steps and the batches' recent reads, and where the next batches are
    read. Steps are noted by the loop's thread, reads by whichever thread read the batch."""

    def __init__(self, reads_on: ReadsOn = ReadsOn.AUTO) -> None:
        self.reads_on = reads_on
        self.in_loop = reads_on is ReadsOn.LOOP
        self._steps: deque[float] = deque(maxlen=PACE_BATCHES)
        self._reads: deque[float] = deque(maxlen=PACE_BATCHES)
        self._lock = threading.Lock()  # a reader thread notes reads while the loop judges

    def stepped(self, seconds: float) -> None:
        """Note one step of the loop: the time from a batch handed out to the next asked for."""
        self._steps.append(seconds)

    def read(self, seconds: float) -> None:
        """Note one batch's read (its items, hints and collate)."""
        with self._lock:
            self._reads.append(seconds)

    def choose(self) -> bool:
        """Whether the next batches are read in the loop (:func:`reads_in_loop`; fixed unless
        ``reads_on`` is ``AUTO``)."""
        if self.reads_on is ReadsOn.AUTO:
            with self._lock:
                reads = list(self._reads)
            self.in_loop = reads_in_loop(list(self._steps), reads, self.in_loop)
        return self.in_loop


__all__ = ["IN_LOOP_BELOW", "ON_THREAD_ABOVE", "PACE_BATCHES", "Pace", "ReadsOn", "reads_in_loop"]
