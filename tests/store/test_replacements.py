"""Keys a build stores again (a failed padding check found them inexact): their old rows are
void wherever they were folded, and the rows stored after stand (store/merge.py
``Replacements``, docs/reliability.md row r22.4), through a merge killed mid-fold, a gc that
compacts the shards holding them, and a rebuild storing the same bytes again."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.store.catalog import Catalog
from featbake.store.fragment_catalog import FragmentCatalog, RankPart
from featbake.store.fragments import read_fragment, sealed_fragments
from featbake.store.layout import Layout
from featbake.store.merge import adopt_sealed_parts, merge
from featbake.store.roots import RootSpec
from featbake.store.shard import SealedShard, ShardReader, tensor_name, write_shard
from featbake.upkeep.gc import GcOptions, _commit_steps, gc, plan_gc
from tests.store.test_fragments import Killed

EFP, RFP = "e" * 64, "r" * 64
A, B, C = "a" * 64, "b" * 64, "c" * 64


def a_rank_that_stored_again(layout: Layout, *, finished: bool) -> SealedShard:
    """A rank of root r stores a and b padded; its check fails: it forgets both, stores a
    again alone (b's encode failed: a miss, never the padded row), and seals its ``done``
    fragment (``finished``) or is killed before it. Returns the padded shard."""
    rank = FragmentCatalog(layout, RankPart(0, 1, [("a.wav", 10), ("b.wav", 10)]))
    rank.record_encoder(EFP, "enc", "torchscript")
    rank.replace_root(RootSpec("r", "/d", "enc", EFP, RFP, {}), [("a.wav", A), ("b.wav", B)])
    padded = write_shard(layout, {A: torch.ones(3), B: torch.ones(3)}, EFP, RFP)
    rank.add_shard(padded)
    rank.forget_keys([A, B])
    rank.add_shard(write_shard(layout, {A: torch.full((3,), 2.0)}, EFP, RFP))
    if finished:
        rank.finish()
    rank.close()
    return padded


def shards_of(layout: Layout, key: str) -> list[str]:
    with Catalog(layout, read_only=True) as cat:
        return [loc.shard for loc in cat.locate(key)]


@pytest.mark.parametrize("step", ["rows", "hashes"])
def test_a_merge_killed_after_a_builds_rows_never_serves_a_row_it_replaced(
    tmp_path: Path, step: str
) -> None:
    """A merge killed once a build's rows (or hash rows) are committed, its root published.
    Before, the fold copied the padded row of b back and a drop in a transaction of its own
    deleted it after: killed between the two, the catalog served b padded until the next
    merge. Now the fold copies no void row."""
    layout = Layout(tmp_path / "store").ensure()
    a_rank_that_stored_again(layout, finished=True)

    def kill(at: str) -> None:
        if at == step:
            raise Killed(at)

    with pytest.raises(Killed):
        merge(layout, between=kill)
    with Catalog(layout, read_only=True) as cat:
        assert [i.key for i in cat.root_items("r")] == [A, B]
    assert shards_of(layout, B) == []
    merge(layout)
    assert shards_of(layout, B) == []
    assert len(shards_of(layout, A)) == 1


def killed_once_folded(monkeypatch: pytest.MonkeyPatch, shard: SealedShard) -> None:
    """Make :meth:`Catalog.add_fragment_shards` (one fragment's rows, committed) raise
    :class:`Killed` once it has folded the fragment naming ``shard``."""
    fold = Catalog.add_fragment_shards

    def then_killed(self: Catalog, *args: Any, **kwargs: Any) -> Any:
        out = fold(self, *args, **kwargs)
        if self.shard_id(shard.name) is not None:
            raise Killed(f"after the fold of {shard.name}")
        return out

    monkeypatch.setattr(Catalog, "add_fragment_shards", then_killed)


def adopted(layout: Layout) -> None:
    with Catalog(layout) as cat:
        adopt_sealed_parts(cat)


@pytest.mark.parametrize("how", ["merge", "adopt"])
def test_a_fold_of_a_waiting_build_killed_once_committed_holds_no_row_it_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The rank is killed before its end (its build waits); a merge (``fold_waiting``) or a
    one-process rebuild adopting its parts (``adopt_sealed_parts``) folds its fragments and is
    killed once the padded shard's rows are committed. Before, they were folded, then dropped
    in a transaction of their own: killed between, b's padded row was served. Now none is
    committed, and a run to the end holds a's row stored again and none of b."""
    layout = Layout(tmp_path / "store").ensure()
    padded = a_rank_that_stored_again(layout, finished=False)
    run: Callable[[Layout], object] = merge if how == "merge" else adopted
    with monkeypatch.context() as patched:
        killed_once_folded(patched, padded)
        with pytest.raises(Killed):
            run(layout)
    assert shards_of(layout, B) == []
    run(layout)
    assert shards_of(layout, B) == []
    assert len(shards_of(layout, A)) == 1


def replaced_then_stored_exactly(layout: Layout) -> SealedShard:
    """Root o's key c in a small shard of its own (an older root); part 0/2 of root w stores
    a padded, forgets it and is killed; root s then stores a exactly, in one process (its
    shard returned), and b in a shard of its own; merged."""
    with Catalog(layout) as cat:
        cat.record_encoder(EFP, "enc", "torchscript")
        cat.replace_root(RootSpec("o", "/o", "enc", EFP, RFP, {}), [("c.wav", C)], now=1000.0)
        cat.add_shard(write_shard(layout, {C: torch.zeros(3)}, EFP, RFP), now=1000.0)
    rank = FragmentCatalog(layout, RankPart(0, 2, [("a.wav", 10), ("z.wav", 10)]))
    rank.record_encoder(EFP, "enc", "torchscript")
    rank.replace_root(RootSpec("w", "/d", "enc", EFP, RFP, {}), [("a.wav", A)])
    rank.add_shard(write_shard(layout, {A: torch.ones(3)}, EFP, RFP))
    rank.forget_keys([A])
    rank.close()
    later = max(read_fragment(f.path, layout).created for f in sealed_fragments(layout)) + 1
    exact = write_shard(layout, {A: torch.full((3,), 2.0)}, EFP, RFP)
    with Catalog(layout) as cat:
        items = [("a.wav", A), ("b.wav", B)]
        cat.replace_root(RootSpec("s", "/s", "enc", EFP, RFP, {}), items, now=later)
        cat.add_shard(exact, now=later)
        cat.add_shard(write_shard(layout, {B: torch.full((3,), 5.0)}, EFP, RFP), now=later)
    merge(layout)
    return exact


def assert_serves_the_exact_row(layout: Layout) -> None:
    """The catalog's one row of a points at its exact features."""
    assert len(shards_of(layout, A)) == 1
    with Catalog(layout, read_only=True) as cat:
        (loc,) = cat.locate(A)
    with ShardReader(layout.shard_path(loc.shard)) as reader:
        assert torch.equal(reader.read(tensor_name(A, "")), torch.full((3,), 2.0))


def test_rows_stored_after_a_replacement_keep_their_age_through_compaction(
    tmp_path: Path,
) -> None:
    """Part 0/2 of root w stores a padded, forgets it and is killed; root s then stores a
    exactly, in one process; a gc merges the small shards (c's, of an older root, and a's
    exact one). Before, the compacted shard was recorded as old as the oldest it took rows
    from: a's exact row looked older than the replacement and the next merge dropped it (a
    miss for good once w is rebuilt; 9 good rows of 9 in an end-to-end run). Now compaction
    never mixes rows from either side of a replacement: a's exact row stays, c's too."""
    layout = Layout(tmp_path / "store").ensure()
    exact = replaced_then_stored_exactly(layout)
    assert shards_of(layout, A) == [exact.name]
    c_shard = shards_of(layout, C)
    assert gc(layout, GcOptions(merge_small=True, grace=0.0)).shards_written == 1  # a's and b's
    assert shards_of(layout, A) == shards_of(layout, B) != c_shard
    merge(layout)
    assert shards_of(layout, C) == c_shard  # alone in its era, every row live: left as it is
    assert_serves_the_exact_row(layout)
    again = gc(layout, GcOptions(merge_small=True, grace=0.0))  # settled: nothing to rewrite
    assert again.shards_written == 0 and shards_of(layout, C) == c_shard


def test_the_same_bytes_stored_again_after_a_replacement_are_kept(tmp_path: Path) -> None:
    """Part 0/2 of root w stores c alone (padded, yet exact by chance), forgets it and is
    killed. A one-process rebuild of w adopts the parts, then stores c again alone: the same
    bytes, so the same shard, whose catalog row was recorded before the replacement. Before,
    the shard kept its first recording's time (INSERT OR IGNORE), the merge dropped c's one
    row as void and retired the superseded parts: c was lost for good. Now a shard recorded
    again is as new as its latest recording."""
    layout = Layout(tmp_path / "store").ensure()
    spec = RootSpec("w", "/d", "enc", EFP, RFP, {})
    rank = FragmentCatalog(layout, RankPart(0, 2, [("c.wav", 10), ("z.wav", 10)]))
    rank.record_encoder(EFP, "enc", "torchscript")
    rank.replace_root(spec, [("c.wav", C)])
    first = write_shard(layout, {C: torch.zeros(3)}, EFP, RFP)
    rank.add_shard(first)
    rank.forget_keys([C])
    rank.close()
    later = max(read_fragment(f.path, layout).created for f in sealed_fragments(layout)) + 1
    with Catalog(layout) as cat:
        cat.record_encoder(EFP, "enc", "torchscript")
        adopt_sealed_parts(cat)
        again = write_shard(layout, {C: torch.zeros(3)}, EFP, RFP)
        assert again.name == first.name
        cat.add_shard(again, now=later)
        cat.replace_root(spec, [("c.wav", C)], now=later)
    merge(layout)
    assert shards_of(layout, C) == [first.name]
    assert list(sealed_fragments(layout)) == []  # the parts retired: the row stands alone
    merge(layout)
    assert shards_of(layout, C) == [first.name]


def test_a_compaction_on_a_copy_of_the_catalog_ages_by_the_stores_own_fragments(
    tmp_path: Path,
) -> None:
    """A bucket's gc compacts a copy of its newest catalog version (``work``), whose folder
    holds no fragments: the replacements are the store's own (its tier's, synced by the
    plan). Read from the copy, there were none, so the compacted shard took its oldest
    source's age and the next merge dropped a's exact row, as in the test above."""
    layout = Layout(tmp_path / "store").ensure()
    replaced_then_stored_exactly(layout)
    plan = plan_gc(layout, GcOptions(merge_small=True, grace=0.0))
    assert plan.compact
    work = Layout(tmp_path / "work").ensure()  # the copy: the catalog, no fragments
    shutil.copy2(layout.catalog, work.catalog)
    shutil.copytree(layout.shards, work.shards, dirs_exist_ok=True)
    _commit_steps(plan, work, lambda *_: None)
    shutil.copy2(work.catalog, layout.catalog)  # published: the store's catalog now
    shutil.copytree(work.shards, layout.shards, dirs_exist_ok=True)
    merge(layout)
    assert_serves_the_exact_row(layout)
