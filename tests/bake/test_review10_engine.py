"""Review of cl9.16: a job pickled by a driver of the featbake before reads as this one's."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from featbake.bake.pipeline import EngineJob, PartEncoder, PartResult, ProgressFn, WorkItem, build
from featbake.errors import ConfigError

OTHER_FEATBAKE = r"runs another featbake than this node \(engine protocol 1, this node's \d+\)"


def as_the_featbake_before_pickled_it(job: EngineJob) -> EngineJob:
    """``job`` as a worker unpickles it from a driver of the featbake before: its state has no
    ``protocol`` (that featbake's ``EngineJob`` had no such field)."""
    state = {k: v for k, v in vars(job).items() if k != "protocol"}
    old = object.__new__(EngineJob)
    old.__dict__.update(state)
    landed = pickle.loads(pickle.dumps(old))
    assert "protocol" not in vars(landed)
    return landed


class DriverOfTheFeatbakeBefore:
    """An engine whose one worker is sent the job as the featbake before pickled it."""

    @contextlib.contextmanager
    def started(self) -> Iterator[DriverOfTheFeatbakeBefore]:
        yield self

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        return PartEncoder(as_the_featbake_before_pickled_it(job)).encode(items)


def test_a_worker_refuses_a_job_pickled_by_a_driver_of_the_featbake_before(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=OTHER_FEATBAKE):
        build(
            audio_dir,
            encoder_file,
            cache=tmp_path / "store",
            engine=DriverOfTheFeatbakeBefore(),  # type: ignore[arg-type]
        )
    assert not list((tmp_path / "store").rglob("*.safetensors"))
