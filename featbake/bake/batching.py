"""Batching plans for the bake (pure): which pending items go to the encoder together.

:class:`ShapeBatcher` groups inputs of equal shape (any encoder); :class:`LengthBatcher` sorts
inputs by length and cuts padded batches to a budget (encoders that take lengths).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from featbake.encode.encoders import EXACT_TOLERANCE, LoadedEncoder, relative_error
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.errors import ConfigError
from featbake.recipe import Recipe

# == pace ==========================================================================================
# Whether padded batches pay on this device (pure): their time per input sample against the
# same encoder's time per sample on an item run alone.
#
# On a GPU a padded batch of 16 clips costs little more than one clip (measured on an H200: a
# wav2vec2-base-sized build 2.35x faster than one clip at a time). On a CPU one clip of a model
# that size already keeps the cores busy: batching gains nothing there, and the padding and the
# larger working set cost (measured on 2 cores, a small wav2vec2 with the user's one thread:
# batches of 16 clips of 1-4 s took 1.6x the time of the clips one at a time). The exactness
# guard runs one item of every padded batch alone anyway, so each padded batch yields both
# rates for free; :class:`PaceTally` adds them up and says when the batches lose.
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


# == batching ======================================================================================
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


# == padded ========================================================================================
# The bake's batching mode: padded length-sorted batches, guarded, or exact-shape batches.
#
# :class:`BatchRunner` has :class:`~featbake.bake.batching.ShapeBatcher`'s ``add``/``flush`` and
# an ``encode`` for the batches they release, so the pipeline needs no branch per mode.
#
# Padded batching runs only for encoders that take lengths (:mod:`featbake.encode.encoders`). The
# exactness guard checks EVERY padded batch before any of its features is handed on to be
# sealed: it re-runs the batch's most padded item (the shortest, so the cheapest) alone, at the
# batch's precision, and compares within :data:`featbake.encode.encoders.EXACT_TOLERANCE`. An
# encoder whose output drifts with the amount of padding drifts most there; checking only the
# first batches missed encoders whose drift starts past a padding length only later, longer
# batches reach. If the check fails, that batch is re-encoded on exact shapes (nothing inexact is
# stored; every batch sealed before was checked itself) and the rest of the build batches exact
# shapes, with one line saying why; the items earlier padded batches sealed are encoded again
# alone and replace theirs (:mod:`featbake.bake.pipeline`): a check passed on a batch's most padded
# item does not prove its less padded ones. Keys never depend on the mode: it is not in the recipe.
#
# Under ``auto`` the guard's runs also time the device: when padded batches cost more per input
# sample than items run alone (a CPU, where one clip already keeps the cores busy), the build
# goes on in exact shapes, and says so (:mod:`featbake.bake.batching`).
#: The clock that times padded batches and the guard's runs for the pace verdict
#: (:mod:`featbake.bake.batching`). Tests put a modelled device clock here, so the verdict never
#: depends on how busy the machine running them is.
pace_clock: Callable[[], float] = time.perf_counter

#: Padded samples per batch when neither --batch-seconds nor a samples budget is given.
DEFAULT_BATCH_SECONDS = 160.0
#: Items of every padded batch re-run alone, most padded first (0 turns the guard off: only
#: ``benchmarks/bench_padded.py`` does, to measure what the guard costs).
GUARD_ITEMS = 1


class Batching(StrEnum):
    """The ``batching`` option: ``auto`` pads when the encoder takes lengths."""

    AUTO = "auto"
    PADDED = "padded"
    EXACT = "exact"


class BatchingMode(StrEnum):
    """The mode that ran (``BuildReport.batching``)."""

    PADDED = "padded"
    EXACT = "exact"


@dataclass(frozen=True)
class GuardCheck:
    """One item re-run alone: how far its padded-batch output was from that."""

    error: float
    length: int
    padded_to: int
    seconds: float  # the run alone


def initial_mode(
    encoder: LoadedEncoder, choice: Batching, source: str = "audio"
) -> tuple[BatchingMode, str]:
    """The mode a build starts in, with the reason for it (in the words of the ``source`` kind:
    images are resized to one size, so they batch by shape whatever the encoder takes).

    Raises:
        ConfigError: ``padded`` asked for an encoder that does not take lengths.
    """
    if choice is Batching.EXACT:
        return BatchingMode.EXACT, "exact-shape batching (--batching exact)"
    if source == "image" and choice is Batching.AUTO:
        return BatchingMode.EXACT, "images batched by shape (each is resized to the encoder's size)"
    if not encoder.takes_lengths:
        if choice is Batching.PADDED:
            raise ConfigError(
                f"--batching padded needs an encoder whose forward takes lengths "
                f"(forward(x, lengths) -> (features, out_lengths)); {encoder.label} does not"
            )
        return BatchingMode.EXACT, "exact-shape batching: the encoder takes no lengths"
    if encoder.unpaddable and choice is Batching.AUTO:
        return BatchingMode.EXACT, f"exact-shape batching: {encoder.unpaddable}"
    return BatchingMode.PADDED, "padded length-sorted batches"


def budget_samples(recipe: Recipe, batch_seconds: float | None, batch_samples: int | None) -> int:
    """The padded-samples budget per batch, from seconds (at the recipe's rate) or samples."""
    if batch_samples is not None:
        return int(batch_samples)
    seconds = DEFAULT_BATCH_SECONDS if batch_seconds is None else batch_seconds
    if seconds <= 0:
        raise ConfigError(f"--batch-seconds must be positive, got {seconds}")
    return max(1, round(seconds * recipe.sample_rate))


class BatchRunner:
    """Batches items for the encoder and encodes them, padded or on exact shapes.

    Args:
        encoder: the loaded encoder.
        recipe: the recipe (precision picks the guard's tolerance).
        batching: auto, padded or exact.
        batch_size: the cap on items per batch.
        budget: padded samples per batch (see :func:`budget_samples`).
    """

    def __init__(
        self,
        encoder: LoadedEncoder,
        recipe: Recipe,
        batching: Batching | str,
        batch_size: int,
        budget: int,
    ) -> None:
        self.encoder = encoder
        self.recipe = recipe
        choice = Batching(batching)
        self.mode, self.note = initial_mode(encoder, choice, recipe.source)
        self.pace = PaceTally() if choice is Batching.AUTO else None
        self.clock = pace_clock  # read at construction: tests inject a modelled device clock
        self.shapes = ShapeBatcher(batch_size)
        self.lengths = LengthBatcher(batch_size, budget)
        self.batch_size = batch_size
        self.tolerance = EXACT_TOLERANCE[recipe.precision]
        self.checks: list[GuardCheck] = []
        self.inexact = False  # a guard check failed: padding is known inexact for the encoder
        self.last_padded = False  # the last encode() returned a padded batch's outputs
        self._ready: list[list[Any]] = []  # batches released by a fall-back, not yet handed out

    # -- ShapeBatcher's interface ---------------------------------------------------------------
    def add(self, shape: tuple[int, ...], item: Any) -> list[list[Any]]:
        """Add an item; return the batches that are now ready (possibly none)."""
        ready, self._ready = self._ready, []
        if self.mode is BatchingMode.PADDED and len(shape) >= 1:
            batches = self.lengths.add(shape[-1], (shape, item))
            return ready + [[it for _, it in batch] for batch in batches]
        return ready + self.shapes.add(shape, item)

    def flush(self) -> list[list[Any]]:
        """Every remaining item, in batches."""
        ready, self._ready = self._ready, []
        padded = [[item for _, item in batch] for batch in self.lengths.flush()]
        return ready + padded + self.shapes.flush()

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, inputs: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """One dict of output parts per input; padded when the mode allows and shapes differ."""
        shapes = {tuple(x.shape) for x in inputs}
        self.last_padded = False
        if self.mode is BatchingMode.EXACT or len(shapes) == 1:
            return self.encode_exact(inputs)
        start = self.clock()
        results = encode_padded(self.encoder, inputs, self.recipe)  # on the host: synchronised
        seconds = self.clock() - start
        failed = self._guard(inputs, results)  # before anything of this batch is sealed
        if failed is not None:
            self._fall_back(failed)
            return self.encode_exact(inputs)
        self._weigh_pace(inputs, seconds)
        self.last_padded = True
        return results

    def encode_exact(self, inputs: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Inputs grouped by shape, each group (up to ``batch_size``) in one encoder call."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, x in enumerate(inputs):
            groups.setdefault(tuple(x.shape), []).append(i)
        out: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        for members in groups.values():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                for i, parts in zip(
                    chunk,
                    encode_batch(self.encoder, [inputs[i] for i in chunk], self.recipe),
                    strict=True,
                ):
                    out[i] = parts
        return out

    # -- the exactness guard ----------------------------------------------------------------------
    def _guard(
        self, inputs: Sequence[torch.Tensor], results: list[dict[str, torch.Tensor]]
    ) -> GuardCheck | None:
        """Re-run the most padded items alone; the first check over tolerance, or None."""
        if GUARD_ITEMS <= 0:
            return None
        padded_to = max(int(x.shape[-1]) for x in inputs)
        by_padding = sorted(range(len(inputs)), key=lambda i: int(inputs[i].shape[-1]))
        for i in by_padding[:GUARD_ITEMS]:
            start = self.clock()
            alone = encode_batch(self.encoder, [inputs[i]], self.recipe)[0]
            seconds = self.clock() - start
            error = max_part_error(results[i], alone)
            check = GuardCheck(error, int(inputs[i].shape[-1]), padded_to, seconds)
            self.checks.append(check)
            if error > self.tolerance.relative:
                return check
        if self.mode is BatchingMode.PADDED:  # the note says what was checked so far
            worst = max(c.error for c in self.checks)
            self.note = (
                f"padded length-sorted batches (every batch checked: its most padded item "
                f"against a run alone, {len(self.checks)} in all, max relative error "
                f"{worst:.1e} <= {self.tolerance.relative:g} for {self.recipe.precision})"
            )
        return None

    def _weigh_pace(self, inputs: Sequence[torch.Tensor], seconds: float) -> None:
        """Add this batch's timings (and its guard run's); go exact once batches lose."""
        if self.pace is None or not self.checks or self.pace.verdict() is not Pace.UNDECIDED:
            return
        last = self.checks[-1]
        samples = sum(int(x.shape[-1]) for x in inputs)
        # A padded batch's cost includes its guard run: exact shapes need none.
        self.pace.add(seconds + last.seconds, samples, last.seconds, last.length)
        if self.pace.verdict() is Pace.ALONE_FASTER:
            self._switch_to_exact(
                f"exact-shape batching: on {self.encoder.device.type} padded batches took "
                f"{self.pace.ratio():.2f}x the time per input sample of clips run alone "
                f"(measured over {self.pace.batches} batches; --batching padded keeps them)"
            )

    def _fall_back(self, failed: GuardCheck) -> None:
        """Switch to exact shapes after a failed check, saying why (the items of earlier padded
        batches are encoded again alone: bake/redo.py)."""
        self.inexact = True
        self._switch_to_exact(
            f"exact-shape batching: padded batches were not exact for this encoder (relative "
            f"error {failed.error:.1e} > {self.tolerance.relative:g} for "
            f"{self.recipe.precision}, a clip of {failed.length} samples padded to "
            f"{failed.padded_to})"
        )

    def _switch_to_exact(self, note: str) -> None:
        """Exact shapes from now on; items waiting for a padded batch move to the shape batcher."""
        self.mode = BatchingMode.EXACT
        self.note = note
        for batch in self.lengths.flush():
            for shape, item in batch:
                self._ready.extend(self.shapes.add(shape, item))


def max_part_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest :func:`relative_error` over the parts (inf when the parts differ)."""
    if set(got) != set(want):
        return float("inf")
    return max((relative_error(got[p], want[p]) for p in want), default=0.0)
