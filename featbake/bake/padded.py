"""The bake's batching mode: padded length-sorted batches, guarded, or exact-shape batches.

:class:`BatchRunner` has :class:`~featbake.bake.batching.ShapeBatcher`'s ``add``/``flush`` and
an ``encode`` for the batches they release, so the pipeline needs no branch per mode.

Padded batching runs only for encoders that take lengths (:mod:`featbake.encode.lengths`). The
exactness guard checks EVERY padded batch before any of its features is handed on to be
sealed: it re-runs the batch's most padded item (the shortest, so the cheapest) alone, at the
batch's precision, and compares within :data:`featbake.encode.precision.EXACT_TOLERANCE`. An
encoder whose output drifts with the amount of padding drifts most there; checking only the
first batches missed encoders whose drift starts past a padding length only later, longer
batches reach. If the check fails, that batch is re-encoded on exact shapes (nothing inexact is
stored; every batch sealed before was checked itself) and the rest of the build batches exact
shapes, with one line saying why; the items earlier padded batches sealed are encoded again
alone and replace theirs (:mod:`featbake.bake.redo`): a check passed on a batch's most padded
item does not prove its less padded ones. Keys never depend on the mode: it is not in the recipe.

Under ``auto`` the guard's runs also time the device: when padded batches cost more per input
sample than items run alone (a CPU, where one clip already keeps the cores busy), the build
goes on in exact shapes, and says so (:mod:`featbake.bake.pace`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from featbake.bake.batching import LengthBatcher, ShapeBatcher
from featbake.bake.pace import Pace, PaceTally
from featbake.encode.encoders import LoadedEncoder
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.encode.precision import EXACT_TOLERANCE, relative_error
from featbake.errors import ConfigError
from featbake.recipe import Recipe

#: The clock that times padded batches and the guard's runs for the pace verdict
#: (:mod:`featbake.bake.pace`). Tests put a modelled device clock here, so the verdict never
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


def initial_mode(encoder: LoadedEncoder, choice: Batching) -> tuple[BatchingMode, str]:
    """The mode a build starts in, with the reason for it.

    Raises:
        ConfigError: ``padded`` asked for an encoder that does not take lengths.
    """
    if choice is Batching.EXACT:
        return BatchingMode.EXACT, "exact-shape batching (--batching exact)"
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
        self.mode, self.note = initial_mode(encoder, choice)
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
