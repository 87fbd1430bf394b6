"""``featbake gc``, second half: carry out a :class:`GcPlan` (``gc_plan.py``); safe to kill at
any point and to run again.

Order (each step commits before the next begins):

1. Drop roots: the manifest file becomes a tombstone, the rows go, the tombstone goes.
2. Delete feature rows no kept root reaches (re-checked in the DELETE itself, so a build that
   just published a root naming a key keeps it), then the evicted rows.
3. Shards left without rows: catalog row first, then the file.
4. Compaction: copy the live features of low-occupancy (and small) shards into fresh shards
   (sealed: tmp, fsync, rename), commit rows pointing at them, then delete the old rows and
   files. A reader holding the old location re-resolves the key once and finds the new one.
5. Shard files no row names and ``tmp/`` files, once older than the grace period.
6. Encoder rows nothing mentions any more.

The crash tests kill gc between steps at the named points of :data:`CRASH_POINTS`
(``FEATBAKE_TEST_CRASH_AT``), then check that a rerun finishes the job and loses nothing.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from featbake.errors import ShardMissing, StoreCorrupt
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog, ShardRow
from featbake.store.catalog import roots_dir as manifests_dir
from featbake.store.layout import Layout, fsync_dir, remove_file
from featbake.store.locks import shared_write_lock
from featbake.store.reader import ShardReader
from featbake.store.shard_format import tensor_name
from featbake.store.writer import SealedShard, ShardWriter
from featbake.upkeep.files import shard_name
from featbake.upkeep.gc_plan import DropReason, GcPlan

Tick = Callable[[str, int, int], None]

CRASH_ENV = "FEATBAKE_TEST_CRASH_AT"

#: The steps at which ``FEATBAKE_TEST_CRASH_AT`` kills gc, in the order gc reaches them.
CRASH_POINTS = (
    "drop-root-renamed",
    "drop-root-committed",
    "rows-deleted",
    "shard-rows-deleted",
    "shard-file-unlinked",
    "compact-sealed",
    "compact-committed",
    "compacted-rows-deleted",
    "compacted-file-unlinked",
    "orphan-unlinked",
)


def crash_point(step: str) -> None:
    """Test hook: die here, like ``kill -9``, if ``FEATBAKE_TEST_CRASH_AT`` names this step."""
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class GcResult:
    """What gc did. ``problems`` names shards it had to skip (run ``featbake verify``).

    Each step of a run returns its own GcResult; the run adds them up (``+``).
    """

    roots_dropped: list[str] = field(default_factory=list)
    rows_deleted: int = 0
    shards_deleted: int = 0
    shards_written: int = 0
    features_moved: int = 0
    orphans_removed: int = 0
    tmp_removed: int = 0
    bytes_freed: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __add__(self, other: GcResult) -> GcResult:
        return GcResult(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def execute_gc(plan: GcPlan, progress: Callable[[GcProgress], None] | None = None) -> GcResult:
    """Carry out a :class:`GcPlan`: the steps of the module docstring, in order; each commits
    before the next begins.

    The whole run holds the store's write lock shared (store/locks.py): ``verify --repair``
    does not run meanwhile (it would index a shard file gc is about to unlink).
    """
    t0 = time.perf_counter()
    layout = plan.layout

    def tick(phase: str, done: int, total: int) -> None:
        if progress:
            progress(GcProgress(phase, done, total))

    with shared_write_lock(layout), closing(Catalog(layout)) as catalog:
        result = _drop_roots(catalog, plan, tick)
        result += _delete_rows(catalog, plan, tick)
        result += _delete_empty_shards(layout, catalog, [s.id for s in plan.empty_shards], tick)
        if plan.compact:
            compaction = Compaction(catalog, plan).run(tick)
            result += compaction.as_result() + _delete_compacted(layout, catalog, compaction)
        result += _remove_loose_files(catalog, plan)
        tick("files", 1, 1)
        catalog.forget_unused_encoders()
    result.seconds = time.perf_counter() - t0
    return result


def _drop_roots(catalog: Catalog, plan: GcPlan, tick: Tick) -> GcResult:
    """Step 1: drop the plan's roots, then unlink tombstones of drops already committed."""
    cutoff = None if plan.options.older_than is None else plan.now - plan.options.older_than
    dropped = []
    for i, d in enumerate(plan.drop_roots):
        if d.why is DropReason.INTERRUPTED:
            ok = catalog.finish_drop(d.name)
        else:
            limit = cutoff if d.why is DropReason.UNUSED else None
            ok = catalog.drop_root(d.name, unused_before=limit, between=crash_point)
        if ok:
            dropped.append(d.name)
        tick("drop", i + 1, len(plan.drop_roots))
    # Tombstones of roots already gone (a crash after COMMIT) only need unlinking.
    for p in manifests_dir(plan.layout).glob("*.dropped"):
        if catalog.root(p.name.removesuffix(".dropped")) is None:
            remove_file(p)
    return GcResult(roots_dropped=dropped)


def _delete_rows(catalog: Catalog, plan: GcPlan, tick: Tick) -> GcResult:
    """Step 2: rows no kept root reaches (re-checked in the DELETE), then evicted rows."""
    if not (plan.unreached or plan.evict):
        return GcResult()
    rows = catalog.delete_features(plan.unreached, only_unreached=True)
    rows += catalog.delete_features(plan.evict, only_unreached=False)
    tick("rows", rows, len(plan.unreached) + len(plan.evict))
    crash_point("rows-deleted")
    return GcResult(rows_deleted=rows)


def _delete_empty_shards(
    layout: Layout, catalog: Catalog, shard_ids: list[int], tick: Tick
) -> GcResult:
    """Step 3: shards left without rows: the catalog row first, then the file."""
    out = GcResult()
    gone = catalog.delete_shards_if_empty(shard_ids)
    if gone:
        crash_point("shard-rows-deleted")
    for i, name in enumerate(gone):
        out.bytes_freed += catalog.unlink_shard_file(name)
        out.shards_deleted += 1
        crash_point("shard-file-unlinked")
        tick("shards", i + 1, len(gone))
    for d in {layout.shard_path(n).parent for n in gone}:
        fsync_dir(d)
    return out


def _remove_loose_files(catalog: Catalog, plan: GcPlan) -> GcResult:
    """Step 5: shard files no row names and ``tmp/`` files, past the grace period."""
    out = GcResult()
    for f in plan.orphan_shards:
        # Re-checked under the write lock: indexed since the plan (a late commit, verify
        # --repair) means it is no longer an orphan.
        freed = catalog.unlink_shard_file(shard_name(f.path))
        if not freed:
            continue
        out.bytes_freed += freed
        out.orphans_removed += 1
        crash_point("orphan-unlinked")
    for f in plan.tmp_files:
        out.bytes_freed += remove_file(f.path)
        out.tmp_removed += 1
    return out


@dataclass
class CompactionResult:
    """What compaction wrote and which old shards it emptied."""

    written: set[str] = field(default_factory=set)  # names of the shards it sealed
    emptied: list[int] = field(default_factory=list)  # ids of shards whose rows all moved
    shards_written: int = 0
    features_moved: int = 0
    bytes_written: int = 0
    problems: list[str] = field(default_factory=list)

    def as_result(self) -> GcResult:
        """Its share of the run's result (the bytes it wrote count against those freed)."""
        return GcResult(
            shards_written=self.shards_written,
            features_moved=self.features_moved,
            bytes_freed=-self.bytes_written,
            problems=list(self.problems),
        )


def _delete_compacted(layout: Layout, catalog: Catalog, c: CompactionResult) -> GcResult:
    """Step 4, end: the rows and files of the shards compaction emptied."""
    out = GcResult()
    gone = catalog.delete_shards_if_empty(c.emptied)
    if gone:
        crash_point("compacted-rows-deleted")
    for name in gone:
        if name in c.written:
            continue  # rewritten to identical bytes: the same file is the new shard
        out.bytes_freed += catalog.unlink_shard_file(name)
        out.shards_deleted += 1
        crash_point("compacted-file-unlinked")
    for d in {layout.shard_path(n).parent for n in gone}:
        fsync_dir(d)
    return out


class Compaction:
    """Copies the live features of the plan's ``compact`` shards into fresh shards.

    One writer per (encoder, recipe) group; each sealed shard's rows are committed (moved from
    their old shard) as it seals, so an interrupted compaction leaves every row pointing at a
    whole shard.
    """

    def __init__(self, catalog: Catalog, plan: GcPlan) -> None:
        self.layout, self.catalog, self.plan = plan.layout, catalog, plan
        self.out = CompactionResult()
        self._pending: dict[tuple[str, str], int] = {}  # (key, part) -> old shard id

    def run(self, tick: Tick) -> CompactionResult:
        """Compact every group; returns what was written and emptied."""
        groups: dict[tuple[str, str], list[ShardRow]] = defaultdict(list)
        for s in self.plan.compact:
            groups[(s.encoder_fp, s.recipe_fp)].append(s)
        for (enc_fp, rec_fp), shards in groups.items():
            self._group(enc_fp, rec_fp, shards)
            tick("compact", len(self.out.emptied), len(self.plan.compact))
        return self.out

    def _commit(self, shard: SealedShard) -> None:
        crash_point("compact-sealed")
        moved = [(e.key, e.part, self._pending.pop((e.key, e.part))) for e in shard.entries]
        self.out.features_moved += self.catalog.commit_moved(shard, moved)
        self.out.shards_written += 1
        self.out.bytes_written += shard.nbytes
        self.out.written.add(shard.name)
        crash_point("compact-committed")

    def _group(self, enc_fp: str, rec_fp: str, shards: list[ShardRow]) -> None:
        opts = self.plan.options
        with ShardWriter(
            self.layout,
            enc_fp,
            rec_fp,
            target_bytes=opts.shard_bytes,
            max_items=opts.max_items,
            on_seal=self._commit,
        ) as writer:
            for s in shards:
                try:
                    parts = self._read_live(s)
                except (StoreCorrupt, ShardMissing) as e:
                    self.out.problems.append(f"skipped shard {s.name}: {e}")
                    continue
                for key, tensors in parts.items():
                    for part in tensors:
                        self._pending[(key, part)] = s.id
                    writer.add(key, tensors)
                self.out.emptied.append(s.id)

    def _read_live(self, shard: ShardRow) -> dict[str, dict[str, Any]]:
        """The tensors of a shard that rows still name, checksummed (never copy garbage)."""
        rows = self.catalog.features_of_shard(shard.id)
        out: dict[str, dict[str, Any]] = defaultdict(dict)
        with ShardReader(self.layout.shard_path(shard.name), verify="always") as reader:
            for key, part, _, _, _ in rows:
                out[key][part] = reader.read(tensor_name(key, part))
        return out
