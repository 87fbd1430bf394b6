"""gc --older-than counts a dataset's reads as use of the root it reads (issue 28 item 7).

Serving records last use per feature (serve/state.py), never per root: a root built 40 days
ago and read every day since must not look 40 days idle.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import TinyConvEncoder, save_torchscript
from featbake.upkeep import GcOptions, execute_gc, plan_gc
from tests.helpers import Live, assert_serves, bake

DAY = 86400.0


def _built_days_ago(store: Path, root: str, days: float) -> None:
    """Make ``root`` look built, and last read, ``days`` ago (its row and its features)."""
    then = time.time() - days * DAY
    with sqlite3.connect(store / "catalog.sqlite") as c:
        c.execute("UPDATE roots SET last_used=? WHERE name=?", (then, root))
        c.execute(
            "UPDATE features SET last_used=? WHERE key IN "
            "(SELECT key FROM root_items WHERE root=?)",
            (then, root),
        )


def _read_everything(data: Path, encoder: Path, store: Path) -> None:
    """A training job's day: every item served, last uses flushed."""
    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    for i in range(len(ds)):
        ds[i]
    ds.close()


def test_a_root_read_today_is_kept_by_older_than(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    read = bake(audio_dir, encoder_file, store_dir)
    idle = bake(audio_dir, other, store_dir)
    for root in (read.root, idle.root):
        _built_days_ago(store_dir, root, 40)
    _read_everything(audio_dir, encoder_file, store_dir)

    plan = plan_gc(store_dir, GcOptions(older_than=DAY))
    assert [d.name for d in plan.drop_roots] == [idle.root]
    # Two days on, with no read since, the read root is idle too (time given, not waited).
    later = plan_gc(store_dir, GcOptions(older_than=DAY), now=time.time() + 2 * DAY)
    assert {d.name for d in later.drop_roots} == {read.root, idle.root}
    assert execute_gc(plan).roots_dropped == [idle.root]
    assert assert_serves(store_dir, read.root, audio_dir, encoder_file, Live()) == 16


def test_a_root_read_after_the_plan_is_not_dropped_by_it(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """The drop re-checks reads, as it re-checks builds: a job that started meanwhile wins."""
    read = bake(audio_dir, encoder_file, store_dir)
    _built_days_ago(store_dir, read.root, 40)
    plan = plan_gc(store_dir, GcOptions(older_than=DAY))
    assert [d.name for d in plan.drop_roots] == [read.root]
    _read_everything(audio_dir, encoder_file, store_dir)
    assert execute_gc(plan).roots_dropped == []
    assert assert_serves(store_dir, read.root, audio_dir, encoder_file, Live()) == 16
