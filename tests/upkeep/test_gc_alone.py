"""Two gc runs on one store at once (two cron jobs; a user's gc beside a scheduled one).

Each planned, then carried its plan out, so the second executed a plan the first had made
stale: it warned that shards it meant to rewrite were gone and to run `verify --repair`, and
its evictions named rows the first had moved, so `--max-bytes` was missed (320,512 bytes left
on disk of a 200,000 budget). A gc now holds the store's gc lock from its plan to its sweep; a
second says once that it waits, then plans afresh. A shard gone since a plan was made (a gc on
another host whose lock does not reach this one) is passed over quietly.

The stores are real (a tiny encoder over real audio), the runs are ordered by events, never by
sleeps, and every item served is compared with running the encoder now.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.upkeep import GcOptions, execute_gc, gc, plan_gc, verify
from featbake.upkeep.gc import GcPlan, GcResult
from tests.conftest import REPO
from tests.helpers import Live, assert_serves, bake, change_every_other_clip, shard_files

#: What a gc that waits for another says (the one line's start).
WAITS = "another gc of"
#: Bounds on waiting for the other thread or process: a hang fails, a slow machine passes.
BOUND_S = 300.0


def store_with_garbage_in_every_shard(store: Path, audio: Path, encoder: Path) -> str:
    """A store built twice over ``audio``, every other clip changed between the builds: each
    shard of the first build then holds garbage beside live rows (a rewrite moves them).
    Returns the root's name."""
    bake(audio, encoder, store)
    change_every_other_clip(audio)
    return bake(audio, encoder, store).root


def disk_bytes(store: Path) -> int:
    return sum(shard_files(store).values())


def assert_no_empty_or_unnamed_shard(store: Path) -> None:
    """Every shard row names a file some feature row points into, and every shard file is
    named by a row: no shard written for nothing, none left behind."""
    with closing(Catalog(Layout(store))) as catalog:
        rows = catalog.shard_rows()
        used = catalog.shard_usage()
    assert [r.name for r in rows if r.id not in used] == []
    assert {p.stem for p in shard_files(store)} == {r.name for r in rows}


def assert_kept_items_equal_live(store: Path, root: str, audio: Path, encoder: Path) -> int:
    """Every item of ``root`` the store still serves equals the encoder run now; how many."""
    served = assert_serves(store, root, audio, encoder, Live(), allow_missing=True)
    assert served > 0
    return served


def said_waiting(monkeypatch: pytest.MonkeyPatch, heard: list[str], then: threading.Event) -> None:
    """Record every warning shown (any thread) whose text says a gc waits, and set ``then``."""

    def shown(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if WAITS in str(message):
            heard.append(str(message))
            then.set()

    monkeypatch.setattr(warnings, "showwarning", shown)


def in_thread(run: Callable[[], GcResult], results: list[GcResult], done: threading.Event):
    """A started thread running ``run``; its result appended, ``done`` set however it ends."""

    def body() -> None:
        try:
            results.append(run())
        finally:
            done.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_second_gc_waits_for_the_first_says_so_once_then_plans_afresh(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first gc rewrites every shard holding garbage; the second, asked for --max-bytes,
    starts once the first has planned. It waits (one line), plans after the first finished,
    and meets its budget: no warning, no shard written for nothing, every item kept served
    equal to the encoder now. Before, it planned beside the first and carried its plan out
    after it: "skipped shard ...: run `featbake verify --repair`" and the budget missed."""
    store = tmp_path / "store"
    root = store_with_garbage_in_every_shard(store, audio_dir, encoder_file)
    budget = int(disk_bytes(store) * 0.4)
    first_planned, second_moved, first_done = (threading.Event() for _ in range(3))
    heard: list[str] = []
    plans: list[GcPlan] = []  # the first's, then the second's
    firsts: list[GcResult] = []
    seconds: list[GcResult] = []

    def first_holds(plan: GcPlan) -> None:  # the first, planned: on until the second moved
        plans.append(plan)
        first_planned.set()
        assert second_moved.wait(BOUND_S)

    def second_plans(plan: GcPlan) -> None:  # the second, planned: after the first, or beside
        plans.append(plan)
        second_moved.set()
        assert first_done.wait(BOUND_S)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        said_waiting(monkeypatch, heard, second_moved)
        one = in_thread(
            lambda: gc(store, GcOptions(compact_below=1.0, grace=0.0), on_plan=first_holds),
            firsts,
            first_done,
        )
        assert first_planned.wait(BOUND_S)
        two = in_thread(
            lambda: gc(store, GcOptions(max_bytes=budget, grace=0.0), on_plan=second_plans),
            seconds,
            threading.Event(),
        )
        one.join(BOUND_S)
        two.join(BOUND_S)
    assert not one.is_alive() and not two.is_alive()
    assert len(heard) == 1 and "\n" not in heard[0], heard
    assert "then plans afresh" in heard[0]
    first_took = {s.name for s in (*plans[0].compact, *plans[0].empty_shards)}
    assert first_took and not first_took & {
        s.name for s in (*plans[1].compact, *plans[1].empty_shards)
    }
    assert firsts[0].shards_written >= 1  # the first did rewrite shards the second had seen
    assert firsts[0].problems == [] and seconds[0].problems == []
    assert all("repair" not in p for r in (*firsts, *seconds) for p in r.problems)
    assert disk_bytes(store) <= budget
    assert_no_empty_or_unnamed_shard(store)
    assert verify(store).status == "clean"
    assert_kept_items_equal_live(store, root, audio_dir, encoder_file)


#: A real `featbake gc` whose plan, once made, waits for a line on stdin (it says "planned" on
#: stderr first): the first of two runs, held mid-run by the test, never by a sleep.
HELD_GC = """
import importlib
import sys
from featbake.cli.main import main

gc_module = importlib.import_module("featbake.upkeep.gc")  # featbake.upkeep.gc is a function

planned = gc_module.plan_gc

def plan_then_wait(*args, **kwargs):
    plan = planned(*args, **kwargs)
    print("planned", file=sys.stderr, flush=True)
    sys.stdin.readline()
    return plan

gc_module.plan_gc = plan_then_wait
main(sys.argv[1:])
"""


def featbake_gc(*args: str, held: bool = False) -> subprocess.Popen[str]:
    """A `featbake gc` process (``held``: :data:`HELD_GC`), its output piped."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    head = [sys.executable, "-c", HELD_GC] if held else [sys.executable, "-m", "featbake"]
    return subprocess.Popen(
        [*head, "gc", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def lines_until(stream: Any, words: str) -> list[str]:
    """Lines read from ``stream`` up to the first holding ``words`` (or to its end)."""
    lines = []
    for line in iter(stream.readline, ""):
        lines.append(line)
        if words in line:
            break
    return lines


@pytest.mark.slow
def test_two_featbake_gc_processes_at_once_take_turns_and_the_second_says_so_in_one_line(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """Two `featbake gc` processes: the first held once it has planned, the second started
    then. The second prints one line saying it waits, and goes on once the first is let go;
    both exit 0, neither warns, and the budget is met."""
    store = tmp_path / "store"
    root = store_with_garbage_in_every_shard(store, audio_dir, encoder_file)
    budget = int(disk_bytes(store) * 0.4)
    common = ("--cache", str(store), "--grace", "0s")
    first = featbake_gc(*common, "--compact-below", "1", held=True)
    second = None
    try:
        assert first.stderr is not None and first.stdin is not None
        assert "planned" in "".join(lines_until(first.stderr, "planned"))
        second = featbake_gc(*common, "--max-bytes", str(budget))
        assert second.stderr is not None
        before = lines_until(second.stderr, WAITS)  # the line, or its whole output if none
        first.stdin.write("go\n")
        first.stdin.flush()
        out1, err1 = first.communicate(timeout=BOUND_S)
        out2, err2 = second.communicate(timeout=BOUND_S)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    said = [line for line in [*before, *err2.splitlines()] if WAITS in line]
    assert len(said) == 1, (before, err2)
    assert said[0].startswith(f"featbake: another gc of {store} is running; this one waits")
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    for err in (err1, "".join(before) + err2):
        assert "warning" not in err and "repair" not in err, err
    assert "gc: dropped" in out1 and "gc: dropped" in out2, (out1, out2)
    assert disk_bytes(store) <= budget
    assert_no_empty_or_unnamed_shard(store)
    assert verify(store).status == "clean"
    assert_kept_items_equal_live(store, root, audio_dir, encoder_file)


def test_a_shard_gone_between_the_plan_and_its_execution_is_passed_over_quietly(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """A plan made, then another gc rewrites and removes the shards it names (a gc on another
    host of a shared filesystem whose locks do not span hosts; a plan carried out later
    through the Python API), then the plan carried out: the shards it meant to rewrite are
    passed over and counted, with no problem named and no advice to repair; nothing is
    written for nothing and every item is served equal to the encoder now. Before: "skipped
    shard ...: run `featbake verify --repair` if this persists"."""
    store = tmp_path / "store"
    root = store_with_garbage_in_every_shard(store, audio_dir, encoder_file)
    stale = plan_gc(store, GcOptions(compact_below=1.0, grace=0.0))
    assert stale.compact
    other = gc(store, GcOptions(compact_below=1.0, grace=0.0))
    assert other.shards_written >= 1 and other.problems == []
    names = {s.name for s in stale.compact}
    assert not names & {p.stem for p in shard_files(store)}  # every planned shard is gone

    done = execute_gc(stale)
    assert done.problems == [], done.problems
    assert done.to_json().get("shards_passed_over") == len(stale.compact)
    assert done.shards_written == 0
    assert_no_empty_or_unnamed_shard(store)
    assert verify(store).status == "clean"
    assert_kept_items_equal_live(store, root, audio_dir, encoder_file)


def test_a_shard_file_deleted_by_hand_while_its_rows_remain_still_names_the_problem(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """The quiet pass-over is only for shards the catalog no longer has: a shard the catalog
    still names whose file is gone is damage, and gc still says so (and how to repair it)."""
    store = tmp_path / "store"
    store_with_garbage_in_every_shard(store, audio_dir, encoder_file)
    plan = plan_gc(store, GcOptions(compact_below=1.0, grace=0.0))
    lost = plan.compact[0]
    Layout(store).shard_path(lost.name).unlink()
    done = execute_gc(plan)
    assert len(done.problems) == 1 and lost.name in done.problems[0]
    assert "verify --repair" in done.problems[0]
    assert done.to_json().get("shards_passed_over", 0) == 0
