"""gc's over-budget note (up10.5, up10.6): what it tells a user to run works when pasted; and
``--max-bytes`` measured once a run has ended, not just planned (r22.2): features written while
gc ran have it plan once more, and what is still over is said."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.filesystem import SharedFilesystemWarning
from featbake.store.layout import Layout
from featbake.store.shard import write_shard
from featbake.testing import write_audio_folder
from featbake.units import format_bytes
from featbake.upkeep import GcOptions, drop_root, gc, verify
from featbake.upkeep.gc import GcPlan
from tests.conftest import invoke
from tests.helpers import Live, assert_serves, bake, shard_files


def test_the_merge_the_over_budget_note_names_merges_the_store_gc_ran_on(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    assert ds.stored() == 16
    ds.close()
    monkeypatch.undo()
    monkeypatch.delenv("FEATBAKE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    (note,) = [line for line in r.stderr.splitlines() if "over --max-bytes" in line]
    command = re.search(r"run `(featbake merge[^`]*)`", note)
    assert command is not None, note
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pasted = invoke(*command.group(1).split()[1:], cwd=elsewhere)
    assert pasted.returncode == 0, pasted.stderr
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert "over --max-bytes" not in r.stderr, r.stderr


def disk_bytes(store: Path) -> int:
    return sum(shard_files(store).values())


def built_beside(
    tmp_path: Path, encoder: Path, store: Path, folders: int
) -> tuple[list[Path], Callable[[], None]]:
    """``folders`` folders of 6 clips each, and a call that builds the next into ``store``
    (a build beside gc, in the gap between its plan and its steps)."""
    made = [tmp_path / f"beside{i}" for i in range(folders)]
    for i, folder in enumerate(made):
        write_audio_folder(folder, 6, seconds=(0.5, 1.0), seed=50 + i)
    left = list(made)

    def build_next() -> None:
        if left:
            bake(left.pop(0), encoder, store)

    return made, build_next


def assert_all_served_equal_live(store: Path, encoder: Path, folders: list[Path]) -> None:
    """Every root of ``folders`` is served, what the store still holds equal to the encoder
    run now; the store is clean."""
    assert verify(store).status == "clean"
    for folder in folders:
        root = bake(folder, encoder, store).root  # its root, kept items reused
        assert assert_serves(store, root, folder, encoder, Live(), allow_missing=True) > 0


def test_a_budget_left_exceeded_by_a_build_while_gc_ran_is_planned_again_and_met(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """``gc --max-bytes`` plans to fit; a build writes 6 more clips' features before its
    steps run. Before, the run ended over the budget (measured, not planned) and said
    nothing. Now it measures the shards once done, plans once more and fits; what is kept is
    served equal to the encoder now. A young unnamed shard file (kept, within --grace) is
    counted once, as the store holds it after, not once per pass."""
    store = tmp_path / "store"
    bake(audio_dir, encoder_file, store)
    budget = disk_bytes(store) // 2
    young = write_shard(Layout(store), {"y" * 64: torch.ones(4)}, "e" * 64, "r" * 64)
    folders, build_next = built_beside(tmp_path, encoder_file, store, 1)
    plans: list[GcPlan] = []

    def build_after_the_first_plan(plan: GcPlan) -> None:
        plans.append(plan)
        if len(plans) == 1:
            build_next()

    result = gc(store, GcOptions(max_bytes=budget), on_plan=build_after_the_first_plan)
    named = disk_bytes(store) - young.nbytes
    assert named <= budget, (named, budget)
    assert (result.passes, len(plans), result.stored_bytes) == (2, 2, named)
    assert plans[1].evict and result.problems == []
    assert result.young_shards == plans[1].young_orphans == 1
    assert_all_served_equal_live(store, encoder_file, [audio_dir, *folders])


def test_featbake_gc_still_over_budget_after_planning_again_says_so_in_one_line(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`featbake gc --max-bytes` whose steps each follow a build beside it (6 clips' features
    written before each): it notes once that it plans again, then warns in one line that the
    store is still over the budget and to run gc again, exit 0. Run again with ``--json``,
    one more build before its first pass: its second pass fits, given as ``replanned``, the
    result saying ``passes`` 2 and the ``stored_bytes`` measured. Run once more, alone: no
    note, no warning."""
    store = tmp_path / "store"
    bake(audio_dir, encoder_file, store)
    budget = disk_bytes(store) // 2
    common = ("gc", "--cache", store, "--max-bytes", str(budget), "--grace", "0s")
    folders, build_next = built_beside(tmp_path, encoder_file, store, 3)
    gc_module = importlib.import_module("featbake.upkeep.gc")  # featbake.upkeep.gc: a function
    execute = gc_module.execute_gc

    def built_first(*args: object, **kwargs: object) -> object:
        build_next()
        return execute(*args, **kwargs)

    monkeypatch.setattr(gc_module, "execute_gc", built_first)
    ran = invoke(*common)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stderr.splitlines()
    assert [line for line in lines if "plans again" in line] == [
        "note: the store was still over --max-bytes once gc had run (features written "
        "meanwhile); it plans again from what is there now"
    ], ran.stderr
    (warned,) = [line for line in lines if line.startswith("warning:")]
    assert f"after gc, over --max-bytes {format_bytes(budget)}:" in warned, warned
    assert warned.endswith("run gc again") and disk_bytes(store) > budget
    shown = json.loads(invoke(*common, "--json").stdout)  # one build, before its first pass
    assert (shown["result"]["passes"], shown["result"]["stored_bytes"]) == (2, disk_bytes(store))
    assert shown["replanned"]["evicted_features"] > 0 and disk_bytes(store) <= budget
    monkeypatch.setattr(gc_module, "execute_gc", execute)
    again = invoke(*common)
    said = [line for line in again.stderr.splitlines() if line.startswith(("warning", "note"))]
    assert again.returncode == 0 and said == [], again.stderr
    assert disk_bytes(store) <= budget
    assert_all_served_equal_live(store, encoder_file, [audio_dir, *folders])
