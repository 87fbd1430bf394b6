"""The build's engine seam (``build(..., engine=...)``) with an engine of the user's own that
runs each task in this process: one written before engines could hash (no ``digester``) still
builds, its inputs hashed here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from featbake.bake.pipeline import (
    EngineJob,
    PartEncoder,
    PartResult,
    ProgressFn,
    WorkItem,
    build,
)
from tests.conftest import live_features
from tests.helpers import stored_features


class InProcess:
    """An engine that encodes its work items here, in one task, through the worker every
    engine's tasks run (:class:`PartEncoder`); it has no ``digester``."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []

    @contextlib.contextmanager
    def started(self) -> Iterator[InProcess]:
        yield self

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        self.items += items
        return PartEncoder(job).encode(items)


def test_an_engine_without_a_digester_hashes_here_and_builds(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    engine = InProcess()
    report = build(audio_dir, encoder_file, cache=tmp_path / "store", engine=engine)  # type: ignore[arg-type]
    assert (report.failed, report.encoded, len(engine.items)) == ([], 16, 16)
    got = stored_features(tmp_path / "store", report.root)
    assert len(got) == 16
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel))
