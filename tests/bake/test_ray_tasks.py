"""How a Ray build sizes its tasks (featbake.bake.ray_engine.rows_per_task): pure, so checked
over every build size here, without Ray."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.bake.ray_engine import (
    MOST_ROWS_PER_TASK,
    ROWS_PER_TASK,
    TASKS_PER_WORKER,
    RayEngine,
    rows_per_task,
)


@settings(max_examples=500, deadline=None)
@given(inputs=st.integers(0, 10**9), workers=st.integers(1, 4096))
def test_tasks_are_sized_to_the_build_within_their_bounds(inputs: int, workers: int) -> None:
    rows = rows_per_task(inputs, workers)
    assert ROWS_PER_TASK <= rows <= MOST_ROWS_PER_TASK
    aim = workers * TASKS_PER_WORKER  # tasks an even split would make
    if rows == ROWS_PER_TASK:  # a small build: tasks of the least size, no more than aimed at
        assert inputs <= ROWS_PER_TASK * aim or ROWS_PER_TASK == MOST_ROWS_PER_TASK
    elif rows == MOST_ROWS_PER_TASK:  # a huge one: the largest tasks, more of them
        assert inputs > (MOST_ROWS_PER_TASK - 1) * aim
    else:  # the smallest size that makes no more than the tasks aimed at
        assert (rows - 1) * aim < inputs <= rows * aim
    assert rows_per_task(inputs + 1, workers) >= rows  # more inputs never make smaller tasks


def test_a_large_build_makes_a_thousand_tasks_not_a_hundred_and_fifty_thousand() -> None:
    assert rows_per_task(10_000_000, 8) == MOST_ROWS_PER_TASK
    assert -(-10_000_000 // rows_per_task(10_000_000, 8)) == 1221  # was 156,250 tasks of 64
    assert rows_per_task(256, 2) == ROWS_PER_TASK  # a small build keeps its small tasks
    assert rows_per_task(200_000, 2) == 3125  # 64 tasks: 32 an actor


@given(asked=st.integers(1, 10**6), inputs=st.integers(0, 10**7))
def test_an_asked_task_size_is_kept(asked: int, inputs: int) -> None:
    assert rows_per_task(inputs, 3, asked) == asked
    assert RayEngine(workers=3, rows_per_task=asked).rows_per_task == asked
