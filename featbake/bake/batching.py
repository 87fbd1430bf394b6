"""Batching plans for the bake (pure): which pending items go to the encoder together.

:class:`ShapeBatcher` groups inputs of equal shape (any encoder); :class:`LengthBatcher` sorts
inputs by length and cuts padded batches to a budget (encoders that take lengths).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from featbake.encode.encoders import EXACT_TOLERANCE, LoadedEncoder, relative_error
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.errors import ConfigError
from featbake.length_batches import greedy_batches
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


# == pad lengths ===================================================================================
# Padded lengths that repeat (pure). On a GPU the first call at a new input length costs ~55 ms
# (kernel selection; wav2vec2-base on an H200, measured): a batch padded to exactly its longest
# item runs a new length nearly every time, and paid it in every batch. Rounding the padded
# length up to one of 8 lengths per octave bounds the extra padding (under 1/8 of the longest
# item) while the lengths recur: a build runs at most 8 lengths an octave, however many batches.
# On a CPU a new length costs nothing extra, so the padding stays exact there.
#: Padded lengths per octave (a power of two): the extra padding is under 1/PAD_STEPS.
PAD_STEPS = 8


class PadLengths(enum.Enum):
    """What a padded batch is padded to."""

    EXACT = "exact"  # its longest item's length
    STEPPED = "stepped"  # that, rounded up to one of PAD_STEPS lengths per octave


#: The padded lengths of every audio build in this process; None picks them by the device
#: (:func:`pad_lengths_for`). Tests set STEPPED to run the stepped lengths on the CPU; only
#: ``benchmarks/bench_padded.py`` sets EXACT on a GPU, to measure what stepping saves.
PAD_LENGTHS: PadLengths | None = None


def pad_lengths_for(device_type: str, source: str = "audio") -> PadLengths:
    """Stepped lengths for audio on a GPU (``cuda``, whose new shapes cost a kernel choice),
    else exact.

    Other sources stay exact: text lengths are token counts, few and recurring already, and a
    text model's positions end at its own limit (CLIP's 77), which a stepped length could pass;
    arrays (``npy``) may be anything.
    """
    if source != "audio":
        return PadLengths.EXACT
    if PAD_LENGTHS is not None:
        return PAD_LENGTHS
    return PadLengths.STEPPED if device_type == "cuda" else PadLengths.EXACT


def stepped_length(longest: int, steps: int = PAD_STEPS) -> int:
    """``longest`` rounded up to one of ``steps`` lengths per octave (``steps`` a power of two).

    For ``longest`` in ``[2**e, 2**(e+1))`` the lengths are the multiples of ``2**e / steps``,
    so the result is under ``longest * (1 + 1/steps)`` and an octave holds ``steps`` of them.

    Example:
        >>> [stepped_length(n) for n in (7, 16, 17, 100, 16000, 16001)]
        [7, 16, 18, 104, 16384, 16384]
    """
    if steps < 1 or steps & (steps - 1):
        raise ValueError(f"steps must be a power of two, got {steps}")
    shift = longest.bit_length() - steps.bit_length()  # log2(2**e / steps)
    if shift <= 0:
        return longest
    step = 1 << shift
    return -(-longest // step) * step


def length_to_pad(pad_lengths: PadLengths) -> Callable[[int], int]:
    """The function from a batch's longest length to the length it is padded to."""
    return stepped_length if pad_lengths is PadLengths.STEPPED else int


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
        pad_to: a batch's padded length from its longest item's (see :func:`length_to_pad`).
    """

    def __init__(
        self,
        batch_size: int,
        budget: int,
        pool_items: int | None = None,
        pad_to: Callable[[int], int] = int,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        if budget < 1:
            raise ConfigError(f"the batch budget must be at least 1 sample, got {budget}")
        self.batch_size = batch_size
        self.budget = budget
        self.pad_to = pad_to
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
        plan = plan_by_length(self._lengths, self.batch_size, self.budget, self.pad_to)
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
        longest = self.pad_to(max(self._lengths[i] for i in batch))
        return len(batch) < self.batch_size and longest * (len(batch) + 1) <= self.budget


def plan_by_length(
    lengths: Sequence[int], batch_size: int, budget: int, pad_to: Callable[[int], int] = int
) -> list[list[int]]:
    """Indices sorted by length, cut greedily into batches of padded cost <= ``budget``.

    A batch's padded cost is ``rows * pad_to(longest)`` (``pad_to``: the length a batch is
    padded to, nondecreasing; the longest itself by default). Each batch holds at most
    ``batch_size`` items; an item whose padded length is over ``budget`` gets a batch of its
    own. Ties keep input order, so the plan is deterministic.

    Example:
        >>> plan_by_length([5, 1, 4, 2], batch_size=2, budget=100)
        [[1, 3], [2, 0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return greedy_batches(order, lengths, budget, batch_size, pad_to)


# == guard choice ==================================================================================
# Which padded batches the exactness guard checks (pure). Checking every batch cost half a GPU
# build (each check runs one clip alone: a new length, ~55 ms of kernel choice on an H200), and
# most checks proved nothing new: a batch padded less than one already checked, by samples and
# by fraction, tests what that one tested. The guard checks the first FIRST_CHECKED padded
# batches (the pace is timed from them), then a batch only when it is padded to a length no
# checked batch was (an encoder may choose its code path by its input's length: chunked
# attention past a length, say; stepped lengths recur, so this is a few checks an octave), or
# its most padded item is padded unlike any checked: by more samples or a larger fraction than
# any (an encoder whose output drifts with the padding drifts most there), or by under half the
# fewest samples checked (an encoder wrong only for a little padding: tests/bake/test_batching.py).
# Stepped, over 256 clips of 1-20 s in batches of 16, that is 11-14 checks of 24 batches, 18-22
# of 95 over 1024 clips; with exact lengths (a CPU) nearly every batch is a new length, so nearly
# every batch is checked, as before issue 31 item 5. Any failed
# check still sends the whole build to exact shapes and encodes every item padded before again
# alone (bake/pipeline.py), the unchecked batches' items included.
#: Padded batches checked whatever their padding: the pace's warm-up and counted batches.
FIRST_CHECKED = WARMUP_BATCHES + DECIDE_AFTER
#: A batch padded by fewer than the fewest samples checked over this is checked.
FEWER_BY = 2


@dataclass(frozen=True)
class Padding:
    """How a padded batch pads its most padded item (its shortest, the one the guard re-runs)."""

    samples: int  # padding added to that item
    padded_to: int  # the batch's padded length

    @classmethod
    def of(cls, lengths: Sequence[int], padded_to: int) -> Padding:
        """The padding of the shortest of ``lengths`` in a batch padded to ``padded_to``."""
        return cls(padded_to - min(lengths), padded_to)

    @property
    def fraction(self) -> float:
        """The share of that item's padded row that is padding."""
        return self.samples / self.padded_to if self.padded_to else 0.0


@dataclass
class GuardChoice:
    """The padded batches the guard checks, and the padding they covered (see above).

    Example:
        >>> choice = GuardChoice(first=1)
        >>> choice.wants(Padding(800, 16000)), choice.add(Padding(800, 16000))
        (True, None)
        >>> [choice.wants(Padding(n, 16000)) for n in (500, 900, 399)]
        [False, True, True]
        >>> choice.wants(Padding(500, 8000))  # a padded length not checked yet
        True
    """

    first: int = FIRST_CHECKED
    checked: int = 0
    most_samples: int = 0
    most_fraction: float = 0.0
    fewest_samples: int | None = None
    lengths: set[int] = field(default_factory=set)  # the padded lengths checked

    def wants(self, padding: Padding) -> bool:
        """Whether a batch of this padding is checked."""
        if self.checked < self.first or self.fewest_samples is None:
            return True
        return (
            padding.padded_to not in self.lengths
            or padding.samples > self.most_samples
            or padding.fraction > self.most_fraction
            or padding.samples * FEWER_BY < self.fewest_samples
        )

    def add(self, padding: Padding) -> None:
        """A batch of this padding was checked (and passed)."""
        self.checked += 1
        self.lengths.add(padding.padded_to)
        self.most_samples = max(self.most_samples, padding.samples)
        self.most_fraction = max(self.most_fraction, padding.fraction)
        fewest = self.fewest_samples
        self.fewest_samples = padding.samples if fewest is None else min(fewest, padding.samples)


# == padded ========================================================================================
# The bake's batching mode: padded length-sorted batches, guarded, or exact-shape batches.
#
# :class:`BatchRunner` has :class:`~featbake.bake.batching.ShapeBatcher`'s ``add``/``flush`` and
# an ``encode`` for the batches they release, so the pipeline needs no branch per mode.
#
# Padded batching runs only for encoders that take lengths (:mod:`featbake.encode.encoders`). The
# exactness guard checks the padded batches :class:`GuardChoice` picks (the first ones, then each
# padded unlike any checked) before any of that batch's features is handed on to be sealed: it
# re-runs the batch's most padded item (the shortest, so the cheapest) alone, at the batch's
# precision, and compares within :data:`featbake.encode.encoders.EXACT_TOLERANCE`. An encoder
# whose output drifts with the amount of padding drifts most there; checking only the first
# batches missed encoders whose drift starts past a padding length only later, longer batches
# reach (those are padded more than any checked, so they are checked). If the check fails, that
# batch is re-encoded on exact shapes (nothing inexact is stored) and the rest of the build
# batches exact shapes, with one line saying why; the items earlier padded batches sealed,
# checked or not, are encoded again alone and replace theirs (:mod:`featbake.bake.pipeline`): a
# check passed on a batch's most padded item does not prove its less padded ones. On a GPU the
# padded length is stepped (:func:`stepped_length`), so lengths recur. Keys never depend on the
# mode or the padded length: neither is in the recipe.
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
        self.pad_lengths = pad_lengths_for(encoder.device.type, recipe.source)
        self.pad_to = length_to_pad(self.pad_lengths)
        self.shapes = ShapeBatcher(batch_size)
        self.lengths = LengthBatcher(batch_size, budget, pad_to=self.pad_to)
        self.batch_size = batch_size
        self.tolerance = EXACT_TOLERANCE[recipe.precision]
        self.checks: list[GuardCheck] = []
        self.choice = GuardChoice()
        self.padded_lengths: set[int] = set()  # the lengths padded batches were padded to
        self.padded_batches = 0  # padded batches encoded (checked or not)
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
        lengths = [int(x.shape[-1]) for x in inputs]
        padded_to = self.pad_to(max(lengths))
        start = self.clock()
        results = encode_padded(self.encoder, inputs, self.recipe, pad_to=padded_to)  # synced
        seconds = self.clock() - start
        padding = Padding.of(lengths, padded_to)
        if GUARD_ITEMS > 0 and self.choice.wants(padding):
            failed = self._guard(inputs, results, padded_to)  # before any of it is sealed
            if failed is not None:
                self._fall_back(failed)
                return self.encode_exact(inputs)
            self.choice.add(padding)
            self._weigh_pace(inputs, seconds)
        self.padded_batches += 1
        self.padded_lengths.add(padded_to)
        if self.mode is BatchingMode.PADDED:
            self.note = self.padded_note()
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
        self, inputs: Sequence[torch.Tensor], results: list[dict[str, torch.Tensor]], padded_to: int
    ) -> GuardCheck | None:
        """Re-run the most padded items alone; the first check over tolerance, or None."""
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
        return None

    def padded_note(self) -> str:
        """What the padded batches so far were padded to and what the guard checked."""
        stepped = ", stepped" if self.pad_lengths is PadLengths.STEPPED else ""
        batches = f"{self.padded_batches} batches padded to {len(self.padded_lengths)} lengths"
        if not self.checks:
            return f"padded length-sorted batches ({batches}{stepped}; the guard is off)"
        worst = max(c.error for c in self.checks)
        return (
            f"padded length-sorted batches ({batches}{stepped}; {self.choice.checked} checked, "
            f"the first {self.choice.first} and each padded unlike any before: its most padded "
            f"item against a run alone, max relative error {worst:.1e} <= "
            f"{self.tolerance.relative:g} for {self.recipe.precision})"
        )

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
        batches are encoded again alone: bake/pipeline.py)."""
        self.inexact = True
        self._switch_to_exact(
            f"exact-shape batching: padded batches were not exact for this encoder (relative "
            f"error {failed.error:.1e} > {self.tolerance.relative:g} for "
            f"{self.recipe.precision}, a clip of {failed.length} samples padded to "
            f"{failed.padded_to})"
        )

    def padding_known_inexact(self) -> None:
        """An earlier run of this build found padded batches inexact for this encoder (its
        padding record says so): exact shapes from the first batch, saying why. Padding again
        would store rows known to be off until this run's end encoded them again alone (and a
        reader of the store meanwhile, or a merge after a kill, would take them)."""
        if self.mode is BatchingMode.PADDED:
            self.inexact = True
            self._switch_to_exact(
                "exact-shape batching: an earlier run of this build found padded batches not "
                "exact for this encoder (its padding record says so)"
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
