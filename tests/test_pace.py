"""Padded batches only where they pay (issue 19, item 4): the guard's runs time the device.

Two stand-in encoders of the lengths protocol, each the real LengthsEncoder plus a sleep that
models where the time goes: on a CPU a batch costs its rows times its padded length (and more:
the larger working set), on a GPU a call costs about the same whatever its size. Under
``batching="auto"`` the first goes exact-shape after a few batches, the second stays padded;
both store what the encoder gives each clip alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from featbake.bake.batching import (
    DECIDE_AFTER,
    SLOWER_BY,
    WARMUP_BATCHES,
    BatchingMode,
    Pace,
    PaceTally,
)
from featbake.bake.pipeline import build
from featbake.encode.encoders import autocast_for
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import LengthsEncoder, write_audio_folder
from tests.helpers import rel_error, stored_features


def test_no_verdict_before_the_warm_up_and_the_counted_batches() -> None:
    tally = PaceTally()
    for _ in range(WARMUP_BATCHES + DECIDE_AFTER - 1):
        tally.add(9.0, 10, 0.1, 10)
        assert tally.verdict() is Pace.UNDECIDED
    tally.add(9.0, 10, 0.1, 10)
    assert tally.verdict() is Pace.ALONE_FASTER


def test_the_warm_up_batch_is_not_counted() -> None:
    tally = PaceTally()
    tally.add(100.0, 10, 0.01, 10)  # a first call that paid for lazy init
    for _ in range(DECIDE_AFTER):
        tally.add(1.0, 100, 0.5, 10)  # 10 ms per sample padded, 50 ms alone
    assert tally.ratio() == pytest.approx(0.2)
    assert tally.verdict() is Pace.PADDED_PAYS


@pytest.mark.parametrize(("ratio", "want"), [(SLOWER_BY * 0.99, Pace.PADDED_PAYS),
                                             (SLOWER_BY * 1.01, Pace.ALONE_FASTER)])  # fmt: skip
def test_padded_batches_lose_only_past_the_margin(ratio: float, want: Pace) -> None:
    tally = PaceTally()
    for _ in range(WARMUP_BATCHES + DECIDE_AFTER):
        tally.add(ratio, 1000, 1.0, 1000)
    assert tally.verdict() is want


class DeviceClock:
    """A modelled device's clock: seconds advance only by what the encoder's calls cost, so the
    pace verdict is the same on a quiet machine and a busy one (the build reads it through
    ``featbake.bake.batching.pace_clock``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedLengthsEncoder(LengthsEncoder):
    """LengthsEncoder whose calls cost modelled device time on ``clock``."""

    def __init__(self, clock: DeviceClock, per_call: float, per_padded_sample: float) -> None:
        super().__init__()
        self.clock = clock
        self.per_call = per_call
        self.per_padded_sample = per_padded_sample

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, padded = wav.shape
        batch_cost = 1.5 if rows > 1 else 1.0  # a CPU: batches cost more per sample
        self.clock.now += self.per_call + self.per_padded_sample * rows * padded * batch_cost
        return super().forward(wav, lengths)


@pytest.fixture
def device_clock(monkeypatch: pytest.MonkeyPatch) -> DeviceClock:
    clock = DeviceClock()
    monkeypatch.setattr("featbake.bake.batching.pace_clock", clock)
    return clock


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    root = tmp_path / "clips"
    write_audio_folder(root, 24, seconds=(0.3, 1.5), seed=13)
    return root


def assert_stores_each_clip_alone(cache: Path, root: str, clips: Path) -> None:
    module = LengthsEncoder()
    stored = stored_features(cache, root)
    assert len(stored) == 24
    for rel, parts in stored.items():
        x = source_for(Recipe()).load(clips / rel)
        with torch.inference_mode(), autocast_for(torch.device("cpu"), "fp32"):
            feats, n = module(x[None], torch.tensor([x.shape[-1]]))
        assert rel_error(parts[""], feats[0, : int(n[0])]) < 1e-4, rel


def test_a_device_where_batches_cost_per_sample_goes_exact_and_says_why(
    tmp_path: Path, clips: Path, device_clock: DeviceClock
) -> None:
    cpu_like = TimedLengthsEncoder(device_clock, per_call=0.0, per_padded_sample=2e-7)
    report = build(clips, cpu_like, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 24
    assert report.batching == BatchingMode.EXACT, report.batching_note
    assert "time per input sample of clips run alone" in report.batching_note
    assert "--batching padded keeps them" in report.batching_note
    assert_stores_each_clip_alone(tmp_path / "s", report.root, clips)
    forced = build(
        clips, cpu_like, cache=tmp_path / "p", workers=0, batch_size=4, batching="padded"
    )
    assert forced.batching == BatchingMode.PADDED  # asked for: never timed away


def test_a_device_where_a_call_costs_the_same_at_any_size_stays_padded(
    tmp_path: Path, clips: Path, device_clock: DeviceClock
) -> None:
    gpu_like = TimedLengthsEncoder(device_clock, per_call=0.02, per_padded_sample=0.0)
    report = build(clips, gpu_like, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 24
    assert report.batching == BatchingMode.PADDED, report.batching_note
    assert "checked, the first 3 and each padded unlike any before" in report.batching_note
    assert_stores_each_clip_alone(tmp_path / "s", report.root, clips)
