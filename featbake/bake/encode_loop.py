"""The encoding loop of a build: decoded items -> batches -> encoder -> writer thread.

Kept apart from :mod:`featbake.bake.pipeline` (which plans the build and owns its state): this
is the part that runs per item, and it sees the build's state only through :class:`BakeState`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from featbake.bake.compact import Compactor
from featbake.bake.finite import nonfinite_part
from featbake.bake.options import BakeOptions
from featbake.bake.padded import BatchRunner
from featbake.bake.report import BuildReport
from featbake.bake.writer_thread import WriterThread
from featbake.encode.inputs import Inputs
from featbake.errors import EncodeError, FeatbakeError, SourceError
from featbake.progress import Progress
from featbake.recipe import Recipe


class BakeState(Protocol):
    """What the loop reads and updates of one build (``_Bake`` in the pipeline)."""

    place: Inputs
    recipe: Recipe
    options: BakeOptions
    runner: BatchRunner
    report: BuildReport
    compactor: Compactor
    progress: Callable[[Progress], None] | None

    def skip(self, rel: str, reason: str, error: FeatbakeError) -> None: ...


@dataclass
class EncodeLoop:
    """The encoding loop: decoded items -> batches -> encoder -> writer, counting as it goes."""

    bake: BakeState
    writer: WriterThread
    keys: list[str]
    paths: list[str]
    done: int = 0

    def rel(self, i: int) -> str:
        return os.path.relpath(self.paths[i], self.bake.place.where)

    def fail(self, i: int, reason: str, exc: type[FeatbakeError]) -> None:
        self.done += 1
        self.bake.skip(self.rel(i), reason, exc(reason))

    def feed(
        self,
        items: Iterator[tuple[int, torch.Tensor | str]],
        batcher: BatchRunner,
        checkpoint: Callable[[], None],
    ) -> None:
        """Batch decoded items and encode each batch; a decode failure skips its item."""
        for i, item in items:
            checkpoint()
            if isinstance(item, str):
                self.fail(i, item, SourceError)
                continue
            for batch in batcher.add(tuple(item.shape), (i, item)):
                self.run(batch)
        for batch in batcher.flush():
            checkpoint()
            self.run(batch)

    def run(self, batch: list[tuple[int, torch.Tensor]]) -> None:
        """Encode one batch and queue its features; a failing batch is retried item by item."""
        try:
            results = self.bake.runner.encode([x for _, x in batch])
        except EncodeError as e:
            if len(batch) > 1:  # find the culprit: retry one by one
                for item in batch:
                    self.run([item])
                return
            self.fail(batch[0][0], f"{self.rel(batch[0][0])}: {e}", EncodeError)
            return
        for (i, _), parts in zip(batch, results, strict=True):
            bad = None if self.bake.options.allow_nonfinite else nonfinite_part(parts)
            if bad is not None:
                reason = (
                    f"{self.rel(i)}: the encoder returned NaN or infinite values in {bad} "
                    f"(stored as {self.bake.recipe.dtype}); not stored. Pass --allow-nonfinite "
                    "to store them anyway"
                )
                self.fail(i, reason, EncodeError)
                continue
            self.writer.put(self.keys[i], self.bake.compactor.store(self.keys[i], parts))
            self.bake.report.encoded += 1
            self.done += 1
        self.tick()

    def tick(self) -> None:
        """Report progress: items done of all, bytes sealed (what survives a SIGKILL) and
        bytes still pending in the writer's hands, items failed."""
        if self.bake.progress:
            done, total, failed = self.done, len(self.keys), len(self.bake.report.failed)
            sealed, pending = self.writer.bytes_written, self.writer.bytes_pending
            self.bake.progress(Progress("encode", done, total, sealed, failed, pending))
