"""The rule that moves a loader's reads between its thread and the training loop
(featbake.pace): pure, so checked over every pace, not timed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.pace import IN_LOOP_BELOW, ON_THREAD_ABOVE, PACE_BATCHES, Pace, ReadsOn, reads_in_loop

times = st.floats(min_value=1e-7, max_value=10.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(times, max_size=PACE_BATCHES - 1), reads=st.lists(times), now=st.booleans())
def test_nothing_moves_before_a_full_window_of_steps(
    steps: list[float], reads: list[float], now: bool
) -> None:
    assert reads_in_loop(steps, reads, now) is now
    assert reads_in_loop([1e-6] * PACE_BATCHES, [], now) is now  # no read known yet


@settings(max_examples=300, deadline=None)
@given(step=times, read=times)
def test_short_steps_read_in_the_loop_long_ones_on_the_thread_and_between_stays(
    step: float, read: float
) -> None:
    steps, reads = [step] * PACE_BATCHES, [read] * PACE_BATCHES
    to_loop, stay_in_loop = reads_in_loop(steps, reads, False), reads_in_loop(steps, reads, True)
    assert to_loop == (step * IN_LOOP_BELOW < read)
    assert stay_in_loop == (step * ON_THREAD_ABOVE <= read)
    assert not to_loop or stay_in_loop  # what moves into the loop stays there (hysteresis)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(times, min_size=PACE_BATCHES, max_size=3 * PACE_BATCHES),
    reads=st.lists(times, min_size=1, max_size=3 * PACE_BATCHES),
    now=st.booleans(),
    faster=st.floats(min_value=0.0, max_value=1.0),
)
def test_shorter_steps_never_move_reads_out_of_the_loop(
    steps: list[float], reads: list[float], now: bool, faster: float
) -> None:
    if reads_in_loop(steps, reads, now):
        assert reads_in_loop([s * faster for s in steps], reads, now)


def test_only_the_last_window_counts() -> None:
    old_short = [1e-6] * 50 + [1.0] * PACE_BATCHES  # long steps lately
    assert not reads_in_loop(old_short, [0.5], in_loop=True)
    assert reads_in_loop([1.0] * 50 + [1e-6] * PACE_BATCHES, [0.5] * 3, in_loop=False)


@pytest.mark.parametrize("fixed", [ReadsOn.THREAD, ReadsOn.LOOP])
def test_a_fixed_place_never_moves(fixed: ReadsOn) -> None:
    pace = Pace(fixed)
    for _ in range(2 * PACE_BATCHES):
        pace.stepped(1e-6 if fixed is ReadsOn.THREAD else 10.0)
        pace.read(1.0)
        assert pace.choose() is (fixed is ReadsOn.LOOP)


def test_an_auto_pace_moves_with_the_steps_it_is_told() -> None:
    pace = Pace()
    assert pace.choose() is False  # the thread first: nothing known
    for k in range(PACE_BATCHES):
        pace.read(0.01)
        pace.stepped(0.0001)
        assert pace.choose() is (k == PACE_BATCHES - 1)
    for _ in range(PACE_BATCHES // 2 + 1):  # steps now half a read: past the median, back
        pace.stepped(0.005)
    assert pace.choose() is False
