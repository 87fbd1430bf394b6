"""UP_DOC"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError
from featbake.progress import GcProgress
from featbake.store.catalog import (
    Catalog,
    FeatureRef,
    Root,
    ShardRow,
    read_root_file,
    root_file,
    roots_dir,
    tombstone_file,
    write_root_file,
)
from featbake.store.fragments import fragment_shard_names
from featbake.store.layout import Layout, fsync_dir, remove_file
from featbake.store.open import open_catalog, resolve_root, store_layout
from featbake.store.reader import ShardReader
from featbake.store.shard_format import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_ITEMS, split_tensor_name
from featbake.store.writer import SealedShard, ShardEntry, ShardWriter

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


#: Default grace period before gc removes a shard no row names, or a file left in ``tmp/``.
DEFAULT_GRACE_S = 3600.0


DEFAULT_COMPACT_BELOW = 0.5


_HEADER_SLACK = 16  # bytes per tensor a rewritten header may grow by (longer offsets)


def _crash_point(step: str) -> None:
    """Test hook: die here, like ``kill -9``, if ``FEATBAKE_TEST_CRASH_AT`` names this step."""
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class LooseFile:
    """A file in the store that the catalog does not name (an orphan shard, a tmp leftover)."""

    path: str
    bytes: int
    mtime: float


def _loose_files(folder: Path, pattern: str) -> list[LooseFile]:
    out = []
    if folder.is_dir():
        for p in sorted(folder.glob(pattern)):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if p.is_file():
                out.append(LooseFile(str(p), st.st_size, st.st_mtime))
    return out


def _shard_files(layout: Layout) -> dict[str, LooseFile]:
    """shard name -> file, for every ``shards/ab/<name>.safetensors``."""
    return {
        Path(f.path).name.removesuffix(".safetensors"): f
        for f in _loose_files(layout.shards, "*/*.safetensors")
    }


# -- stats -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderStats:
    """What one encoder fingerprint holds in the store."""

    fp: str
    label: str
    kind: str
    features: int
    bytes: int
    shards: int
    first_seen: float
    last_used: float


@dataclass(frozen=True)
class RootStats:
    """One root: (data folder, encoder as named, recipe) and its current manifest."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    items: int
    missing: int
    created: float
    last_used: float

    @classmethod
    def of(cls, root: Root, missing: int) -> RootStats:
        """A root from the catalog with its count of items not stored."""
        return cls(
            root.name,
            root.data,
            root.encoder_label,
            root.encoder_fp,
            root.recipe_fp,
            root.recipe,
            root.items,
            missing,
            root.created,
            root.last_used,
        )


@dataclass(frozen=True)
class StoreStats:
    """A store at a glance; every number comes from the catalog (plus a listing of ``tmp/``).

    ``live`` features are those some root's manifest names; ``dead`` ones no root reaches (gc
    drops them). ``unreferenced_bytes`` are tensors inside shards that no catalog row names
    (duplicates, features gc dropped but whose shard it has not rewritten yet).
    """

    path: str
    features: int
    feature_bytes: int
    live_features: int
    live_bytes: int
    dead_features: int
    dead_bytes: int
    shards: int
    disk_bytes: int
    unreferenced_bytes: int
    tmp_files: int
    tmp_bytes: int
    catalog_bytes: int
    encoders: tuple[EncoderStats, ...]
    roots: tuple[RootStats, ...]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``featbake stats --json``)."""
        return asdict(self)


def _catalog_bytes(layout: Layout) -> int:
    return sum(
        p.stat().st_size for p in (layout.catalog, Path(f"{layout.catalog}-wal")) if p.exists()
    )


def stats(cache: str | os.PathLike[str] | None = None) -> StoreStats:
    """Report what a store holds, from its catalog alone (well under a second per million rows).

    Returns:
        A :class:`StoreStats`.

    Raises:
        StoreError: there is no store, or its catalog is missing or unreadable.

    Example:
        >>> s = stats(".featbake")  # doctest: +SKIP
        >>> s.live_bytes, s.dead_bytes  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    layout, catalog = open_catalog(cache)

    def in_thread(fn: Callable[[Catalog], Any]) -> Any:
        # sqlite connections belong to one thread: each query gets its own; SQLite runs them in
        # parallel (the module releases the GIL), which halves the wall time on a large store.
        own = Catalog(layout)
        try:
            return fn(own)
        finally:
            own.close()

    with ThreadPoolExecutor(2) as pool:
        totals_f = pool.submit(in_thread, lambda c: c.feature_totals())
        missing_f = pool.submit(in_thread, lambda c: c.missing_per_root())
        usage = catalog.shard_usage()
        shard_rows = catalog.shard_rows()
        enc_rows = catalog.encoder_rows()
        roots = catalog.roots()
        totals, missing = totals_f.result(), missing_f.result()
    catalog.close()

    per_enc: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
    for s in shard_rows:
        acc = per_enc[s.encoder_fp]
        u = usage.get(s.id)
        acc[2] += 1
        if u is not None:
            acc[0] += u.rows
            acc[1] += u.nbytes
            acc[3] = max(acc[3], u.last_used)
    known = {fp: (label, kind, first) for fp, label, kind, first, _ in enc_rows}
    encoders = []
    for fp in sorted(set(per_enc) | set(known), key=lambda f: known.get(f, ("", "", 0.0))[2]):
        label, kind, first = known.get(fp, ("(unknown)", "?", 0.0))
        rows, nbytes, shards, last = per_enc.get(fp, [0, 0, 0, 0.0])
        encoders.append(
            EncoderStats(fp, label, kind, int(rows), int(nbytes), int(shards), first, last)
        )
    root_stats = tuple(RootStats.of(r, missing.get(r.name, 0)) for r in roots)
    tmp = _loose_files(layout.tmp, "*")
    rows_bytes = sum(u.nbytes for u in usage.values())
    return StoreStats(
        path=str(layout.root),
        features=totals.features,
        feature_bytes=totals.nbytes,
        live_features=totals.live_features,
        live_bytes=totals.live_nbytes,
        dead_features=totals.features - totals.live_features,
        dead_bytes=totals.nbytes - totals.live_nbytes,
        shards=len(shard_rows),
        disk_bytes=sum(s.bytes for s in shard_rows),
        unreferenced_bytes=max(0, sum(s.data_bytes for s in shard_rows) - rows_bytes),
        tmp_files=len(tmp),
        tmp_bytes=sum(f.bytes for f in tmp),
        catalog_bytes=_catalog_bytes(layout),
        encoders=tuple(encoders),
        roots=root_stats,
        seconds=time.perf_counter() - t0,
    )


# -- roots -------------------------------------------------------------------------------------
def list_roots(cache: str | os.PathLike[str] | None = None) -> list[RootStats]:
    """Every root with its item and missing counts, most recently built or used first."""
    _, catalog = open_catalog(cache)
    try:
        missing = catalog.missing_per_root()
        return [RootStats.of(r, missing.get(r.name, 0)) for r in catalog.roots()]
    finally:
        catalog.close()


def drop_root(cache: str | os.PathLike[str] | None, name: str) -> Root:
    """Drop a root (its manifest); its features stay until ``featbake gc`` frees them.

    Example:
        >>> drop_root(".featbake", "r-3f1c")  # doctest: +SKIP
    """
    _, catalog = open_catalog(cache)
    try:
        root = resolve_root(catalog, name)
        catalog.drop_root(root.name)
        return root
    finally:
        catalog.close()


# -- gc: plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GcOptions:
    """What gc may remove.

    Attributes:
        older_than: drop roots neither built nor used for this many seconds.
        max_bytes: evict least-recently-used features (across roots) until the shards fit.
        compact_below: rewrite a shard that holds garbage once its live share of bytes is under
            this fraction (0 never, 1 always).
        grace: leave shard files no row names, and ``tmp/`` files, alone until this old.
        shard_bytes: target size of shards written by compaction.
        merge_small: also merge shards under a quarter of ``shard_bytes`` (two or more of one
            encoder and recipe), e.g. the small tail shards that many short builds leave.
    """

    older_than: float | None = None
    max_bytes: int | None = None
    compact_below: float = DEFAULT_COMPACT_BELOW
    grace: float = DEFAULT_GRACE_S
    shard_bytes: int = DEFAULT_SHARD_BYTES
    max_items: int = DEFAULT_SHARD_ITEMS
    merge_small: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.compact_below <= 1.0:
            raise ConfigError(f"--compact-below must be in [0, 1], got {self.compact_below}")
        if self.grace < 0:
            raise ConfigError(f"--grace must not be negative (e.g. --grace 1h), got {self.grace}")
        if self.older_than is not None and self.older_than <= 0:
            raise ConfigError(f"--older-than must be positive (e.g. 30d), got {self.older_than}")
        if self.shard_bytes <= 0 or self.max_items <= 0:
            raise ConfigError("--shard-size must be positive (e.g. 256MiB)")


@dataclass(frozen=True)
class DropRoot:
    """A root gc drops, and why."""

    name: str
    data: str
    encoder_label: str
    last_used: float
    items: int
    reason: str


@dataclass(frozen=True)
class GcPlan:
    """What one gc run will do, computed without changing anything.

    ``freed_bytes`` is the estimate ``--dry-run`` prints: whole shards deleted, the dead share of
    rewritten shards, orphan shard files and ``tmp/`` leftovers.
    """

    store: str
    options: GcOptions
    now: float
    drop_roots: tuple[DropRoot, ...]
    unreached: tuple[FeatureRef, ...]
    evict: tuple[FeatureRef, ...]
    empty_shards: tuple[ShardRow, ...]
    compact: tuple[ShardRow, ...]
    compact_keep_bytes: int
    orphan_shards: tuple[LooseFile, ...]
    young_orphans: int
    tmp_files: tuple[LooseFile, ...]
    disk_bytes: int

    @property
    def freed_bytes(self) -> int:
        return (
            sum(s.bytes for s in self.empty_shards)
            + max(0, sum(s.bytes for s in self.compact) - self.compact_keep_bytes)
            + sum(f.bytes for f in self.orphan_shards)
            + sum(f.bytes for f in self.tmp_files)
        )

    @property
    def nothing_to_do(self) -> bool:
        return not (
            self.drop_roots
            or self.unreached
            or self.evict
            or self.empty_shards
            or self.compact
            or self.orphan_shards
            or self.tmp_files
        )

    def summary(self) -> dict[str, Any]:
        """Counts and bytes (``gc --json``; the full lists stay in the object)."""
        return {
            "store": self.store,
            "roots_dropped": [asdict(d) for d in self.drop_roots],
            "unreached_features": len({r.key for r in self.unreached}),
            "unreached_bytes": sum(r.nbytes for r in self.unreached),
            "evicted_features": len({r.key for r in self.evict}),
            "evicted_bytes": sum(r.nbytes for r in self.evict),
            "shards_deleted": len(self.empty_shards),
            "shards_rewritten": len(self.compact),
            "orphan_shards": len(self.orphan_shards),
            "orphan_shards_in_grace": self.young_orphans,
            "tmp_files": len(self.tmp_files),
            "disk_bytes": self.disk_bytes,
            "freed_bytes": self.freed_bytes,
        }


def plan_gc(
    cache: str | os.PathLike[str] | None = None,
    options: GcOptions | None = None,
    *,
    now: float | None = None,
    drop: Iterable[str] = (),
) -> GcPlan:
    """Work out what gc would remove (reads only; ``featbake gc --dry-run`` prints this).

    Args:
        cache: the store.
        options: thresholds and budgets (:class:`GcOptions`).
        now: the time "now" (tests pass one to age things without waiting).
        drop: names of roots to drop besides those ``older_than`` selects.

    Example:
        >>> plan = plan_gc(".featbake", GcOptions(max_bytes=200 * 2**30))  # doctest: +SKIP
        >>> plan.freed_bytes  # doctest: +SKIP
    """
    opts = options or GcOptions()
    now = time.time() if now is None else now
    layout, catalog = open_catalog(cache)
    try:
        return _plan(layout, catalog, opts, now, set(drop))
    finally:
        catalog.close()


def _plan(layout: Layout, catalog: Catalog, opts: GcOptions, now: float, drop: set[str]) -> GcPlan:
    roots = catalog.roots()
    drops: list[DropRoot] = []
    pending = {p.name.removesuffix(".dropped") for p in roots_dir(layout).glob("*.dropped")}
    for r in roots:
        why = None
        if r.name in pending and not root_file(layout, r.name).exists():
            why = "an interrupted drop"
        elif r.name in drop:
            why = "asked"
        elif opts.older_than is not None and r.last_used < now - opts.older_than:
            why = f"unused for {(now - r.last_used) / 86400:.1f} days"
        if why:
            drops.append(DropRoot(r.name, r.data, r.encoder_label, r.last_used, r.items, why))
    dropped = {d.name for d in drops}

    # What no kept root reaches: rows no root names now, plus rows only the dropped roots name.
    unreached = catalog.unreached_features()
    reached: list[FeatureRef] | None = None
    if dropped or opts.max_bytes is not None:
        kept_keys = {
            k for r in roots if r.name not in dropped for _, k in catalog.root_items(r.name)
        }
        reached = []
        for ref in catalog.reached_features():
            (reached if ref.key in kept_keys else unreached).append(ref)

    shard_rows = catalog.shard_rows()
    usage = catalog.shard_usage()
    gone: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # shard -> [rows, bytes] removed
    for ref in unreached:
        gone[ref.shard_id][0] += 1
        gone[ref.shard_id][1] += ref.nbytes

    evict: list[FeatureRef] = []
    if opts.max_bytes is not None and reached is not None:
        evict = _evictions(reached, {s.id: s for s in shard_rows}, opts.max_bytes)
        for ref in evict:
            gone[ref.shard_id][0] += 1
            gone[ref.shard_id][1] += ref.nbytes

    # Under a byte budget every shard that holds garbage is rewritten: the budget is on disk bytes.
    force = opts.max_bytes is not None and (
        bool(evict) or sum(s.bytes for s in shard_rows) > opts.max_bytes
    )
    empty, compact, keep_bytes = [], [], 0
    small: dict[tuple[str, str], list[ShardRow]] = defaultdict(list)
    for s in shard_rows:
        u = usage.get(s.id)
        rows = (u.rows if u else 0) - gone[s.id][0]
        live = (u.nbytes if u else 0) - gone[s.id][1]
        if rows <= 0:
            empty.append(s)
            continue
        has_garbage = rows < s.items or live < s.data_bytes
        frac = live / s.data_bytes if s.data_bytes else 1.0
        if has_garbage and (frac < opts.compact_below or force):
            compact.append(s)
            keep_bytes += live
        elif opts.merge_small and s.bytes < opts.shard_bytes // 4:
            small[(s.encoder_fp, s.recipe_fp)].append(s)
    rewriting = {(s.encoder_fp, s.recipe_fp) for s in compact}
    for group, shards in small.items():
        # Merging one small shard alone would rewrite it unchanged: only merge two or more.
        if len(shards) >= 2 or group in rewriting:
            compact.extend(shards)
            keep_bytes += sum(usage[s.id].nbytes for s in shards)

    # Shards of sharded builds not merged yet are named by fragments, not rows: not garbage.
    named = {s.name for s in shard_rows} | fragment_shard_names(layout)
    orphans, young = [], 0
    for name, f in _shard_files(layout).items():
        if name in named:
            continue
        if now - f.mtime >= opts.grace:
            orphans.append(f)
        else:
            young += 1
    tmp = [f for f in _loose_files(layout.tmp, "*") if now - f.mtime >= opts.grace]
    return GcPlan(
        store=str(layout.root),
        options=opts,
        now=now,
        drop_roots=tuple(drops),
        unreached=tuple(unreached),
        evict=tuple(evict),
        empty_shards=tuple(empty),
        compact=tuple(compact),
        compact_keep_bytes=keep_bytes,
        orphan_shards=tuple(orphans),
        young_orphans=young,
        tmp_files=tuple(tmp),
        disk_bytes=sum(s.bytes for s in shard_rows) + sum(f.bytes for f in orphans),
    )


def _evictions(
    reached: list[FeatureRef], shards: dict[int, ShardRow], budget: int
) -> list[FeatureRef]:
    """The least recently used features to evict so the kept ones fit in ``budget`` bytes.

    Each kept tensor costs its bytes plus its shard's header share per tensor (and a little slack
    for the longer offsets of a rewritten header); every shard that loses anything is rewritten,
    so the kept costs are what stays on disk. A key's parts go together.
    """

    def cost(ref: FeatureRef) -> float:
        s = shards[ref.shard_id]
        return ref.nbytes + (s.bytes - s.data_bytes) / max(1, s.items) + _HEADER_SLACK

    by_key: dict[str, list[FeatureRef]] = defaultdict(list)
    for ref in reached:
        by_key[ref.key].append(ref)
    total = sum(cost(r) for r in reached)
    order = sorted(by_key, key=lambda k: (max(r.last_used for r in by_key[k]), k))
    out: list[FeatureRef] = []
    for key in order:
        if total <= budget:
            break
        refs = by_key[key]
        out.extend(refs)
        total -= sum(cost(r) for r in refs)
    return out


@dataclass
class GcResult:
    """What gc did. ``problems`` names shards it had to skip (run ``featbake verify``)."""

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def execute_gc(plan: GcPlan, progress: Callable[[GcProgress], None] | None = None) -> GcResult:
    """Carry out a :class:`GcPlan`; safe to kill at any point and to run again.

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

    Returns:
        A :class:`GcResult`.
    """
    t0 = time.perf_counter()
    layout = Layout(Path(plan.store))
    catalog = Catalog(layout)
    result = GcResult()

    def tick(phase: str, done: int, total: int) -> None:
        if progress:
            progress(GcProgress(phase, done, total))

    try:
        cutoff = None if plan.options.older_than is None else plan.now - plan.options.older_than
        for i, d in enumerate(plan.drop_roots):
            if d.reason == "an interrupted drop":
                ok = catalog.finish_drop(d.name)
            else:
                limit = cutoff if d.reason.startswith("unused") else None
                ok = catalog.drop_root(d.name, unused_before=limit, between=_crash_point)
            if ok:
                result.roots_dropped.append(d.name)
            tick("drop", i + 1, len(plan.drop_roots))
        # Tombstones of roots already gone (a crash after COMMIT) only need unlinking.
        for p in roots_dir(layout).glob("*.dropped"):
            if catalog.root(p.name.removesuffix(".dropped")) is None:
                remove_file(p)

        if plan.unreached or plan.evict:
            result.rows_deleted += catalog.delete_features(plan.unreached, only_unreached=True)
            result.rows_deleted += catalog.delete_features(plan.evict, only_unreached=False)
            tick("rows", result.rows_deleted, len(plan.unreached) + len(plan.evict))
            _crash_point("rows-deleted")

        gone = catalog.delete_shards_if_empty(s.id for s in plan.empty_shards)
        if gone:
            _crash_point("shard-rows-deleted")
        for i, name in enumerate(gone):
            result.bytes_freed += catalog.unlink_shard_file(name)
            result.shards_deleted += 1
            _crash_point("shard-file-unlinked")
            tick("shards", i + 1, len(gone))
        for d in {layout.shard_path(n).parent for n in gone}:
            fsync_dir(d)

        if plan.compact:
            _compact(layout, catalog, plan, result, tick)

        for f in plan.orphan_shards:
            # Re-checked under the write lock: indexed since the plan (a late commit, verify
            # --repair) means it is no longer an orphan.
            freed = catalog.unlink_shard_file(Path(f.path).name.removesuffix(".safetensors"))
            if not freed:
                continue
            result.bytes_freed += freed
            result.orphans_removed += 1
            _crash_point("orphan-unlinked")
        for f in plan.tmp_files:
            result.bytes_freed += remove_file(Path(f.path))
            result.tmp_removed += 1
        tick("files", 1, 1)
        catalog.forget_unused_encoders()
    finally:
        catalog.close()
    result.seconds = time.perf_counter() - t0
    return result


def _compact(
    layout: Layout,
    catalog: Catalog,
    plan: GcPlan,
    result: GcResult,
    tick: Callable[[str, int, int], None],
) -> None:
    groups: dict[tuple[str, str], list[ShardRow]] = defaultdict(list)
    for s in plan.compact:
        groups[(s.encoder_fp, s.recipe_fp)].append(s)
    written: set[str] = set()
    emptied: list[int] = []
    for (enc_fp, rec_fp), shards in groups.items():
        _compact_group(layout, catalog, plan, enc_fp, rec_fp, shards, result, written, emptied)
        tick("compact", len(emptied), len(plan.compact))
    gone = catalog.delete_shards_if_empty(emptied)
    if gone:
        _crash_point("compacted-rows-deleted")
    for name in gone:
        if name in written:
            continue  # rewritten to identical bytes: the same file is the new shard
        result.bytes_freed += catalog.unlink_shard_file(name)
        result.shards_deleted += 1
        _crash_point("compacted-file-unlinked")
    for d in {layout.shard_path(n).parent for n in gone}:
        fsync_dir(d)


def _compact_group(
    layout: Layout,
    catalog: Catalog,
    plan: GcPlan,
    enc_fp: str,
    rec_fp: str,
    shards: list[ShardRow],
    result: GcResult,
    written: set[str],
    emptied: list[int],
) -> None:
    """Copy the live features of ``shards`` (one encoder and recipe) into fresh shards."""
    pending: dict[tuple[str, str], int] = {}  # (key, part) -> old shard id, not yet sealed

    def commit(shard: SealedShard) -> None:
        _crash_point("compact-sealed")
        moved = [(e.key, e.part, pending.pop((e.key, e.part))) for e in shard.entries]
        result.features_moved += catalog.commit_moved(shard, moved)
        result.shards_written += 1
        result.bytes_freed -= shard.nbytes
        written.add(shard.name)
        _crash_point("compact-committed")

    with ShardWriter(
        layout,
        enc_fp,
        rec_fp,
        target_bytes=plan.options.shard_bytes,
        max_items=plan.options.max_items,
        on_seal=commit,
    ) as writer:
        for s in shards:
            try:
                parts = _read_live(layout, catalog, s)
            except (StoreCorrupt, ShardMissing) as e:
                result.problems.append(f"skipped shard {s.name}: {e}")
                continue
            for key, tensors in parts.items():
                for part in tensors:
                    pending[(key, part)] = s.id
                writer.add(key, tensors)
            emptied.append(s.id)


def _read_live(layout: Layout, catalog: Catalog, shard: ShardRow) -> dict[str, dict[str, Any]]:
    """The tensors of a shard that catalog rows still name, checksummed (never copy garbage)."""
    rows = catalog.features_of_shard(shard.id)
    out: dict[str, dict[str, Any]] = defaultdict(dict)
    with ShardReader(layout.shard_path(shard.name), verify="always") as reader:
        for key, part, _, _, _ in rows:
            out[key][part] = reader.read(key if not part else f"{key}/{part}")
    return out


# -- verify ------------------------------------------------------------------------------------
VERIFY_CLEAN = 0


VERIFY_REPAIRED = 10


VERIFY_DAMAGED = 11


@dataclass(frozen=True)
class Finding:
    """One thing verify noticed. ``damage`` findings make the store unclean; notes do not."""

    kind: str
    subject: str
    detail: str
    damage: bool


@dataclass(frozen=True)
class ShardCheck:
    """One shard file as verify found it."""

    name: str
    path: str
    bytes: int
    mtime: float
    sound: bool
    problem: str
    encoder_fp: str
    recipe_fp: str
    entries: tuple[ShardEntry, ...]  # every tensor its header names
    intact: tuple[str, ...]  # tensors whose checksum holds (all of them when sound)


@dataclass(frozen=True)
class VerifyScan:
    """What verify found: per-shard checks, the catalog's state, and every finding."""

    store: str
    catalog_state: str  # "ok", "missing", or why it cannot be used
    shards: tuple[ShardCheck, ...]
    findings: tuple[Finding, ...]
    bytes_checked: int

    @property
    def damaged(self) -> bool:
        return any(f.damage for f in self.findings)


@dataclass
class VerifyReport:
    """The outcome of ``featbake verify``: ``status`` is clean, repaired or damaged."""

    store: str
    status: str
    shards_checked: int
    bytes_checked: int
    findings: list[Finding]
    actions: list[str] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)
    features_lost: int = 0
    features_salvaged: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return {"clean": VERIFY_CLEAN, "repaired": VERIFY_REPAIRED}.get(self.status, VERIFY_DAMAGED)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()
        while chunk := f.read(1 << 20):
            h.update(chunk)
        return h.hexdigest()


def check_shard(path: Path) -> ShardCheck:
    """Check one shard file: its bytes against its content name, else each tensor's checksum."""
    name = path.name.removesuffix(".safetensors")
    st = path.stat()
    try:  # ShardMissing, a StoreError, means it vanished meanwhile: report it as unreadable
        digest = _sha256_file(path)
        reader = ShardReader(path, verify="never")
    except StoreError as e:
        return ShardCheck(name, str(path), st.st_size, st.st_mtime, False, str(e), "", "", (), ())
    except OSError as e:
        why = f"unreadable: {e.strerror or e}"
        return ShardCheck(name, str(path), st.st_size, st.st_mtime, False, why, "", "", (), ())
    with reader:
        entries = []
        for tname, info in reader.tensors.items():
            key, part = split_tensor_name(tname)
            entries.append(ShardEntry(key, part, info.dtype, info.shape, info.end - info.begin))
        meta = reader.metadata
        sound = digest == name and path.parent.name == name[:2]
        if sound:
            intact = tuple(reader.tensors)
            problem = ""
        else:
            bad = set(reader.verify_all())
            intact = tuple(t for t in reader.tensors if t not in bad)
            problem = (
                f"{len(bad)} of {len(reader.tensors)} tensors fail their checksum"
                if bad
                else "its bytes do not match its content name (damaged header or renamed)"
            )
    return ShardCheck(
        name,
        str(path),
        st.st_size,
        st.st_mtime,
        sound,
        problem,
        meta.get("encoder_fp", ""),
        meta.get("recipe_fp", ""),
        tuple(entries),
        intact,
    )


def _catalog_state(layout: Layout) -> str:
    if not layout.catalog.exists():
        return "missing"
    try:
        cat = Catalog(layout)
        (res,) = cat.conn.execute("PRAGMA quick_check").fetchone()
        cat.close()
    except StoreError as e:
        return str(e)
    except Exception as e:  # sqlite3.DatabaseError and kin: the file is not a usable catalog
        return f"unreadable: {e}"
    return "ok" if res == "ok" else f"damaged: {res}"


def scan_store(
    cache: str | os.PathLike[str] | None = None,
    progress: Callable[[GcProgress], None] | None = None,
    *,
    reuse: dict[str, ShardCheck] | None = None,
) -> VerifyScan:
    """Check every shard and the catalog against them; changes nothing.

    Args:
        cache: the store.
        progress: called with ``GcProgress("verify", shards done, shards)``.
        reuse: checks already made, by path; a file of unchanged size and mtime is not re-read.
    """
    layout = store_layout(cache)
    files = _shard_files(layout)
    checks: dict[str, ShardCheck] = {}
    nbytes = 0
    for i, (name, f) in enumerate(sorted(files.items())):
        old = (reuse or {}).get(f.path)
        if old is not None and old.bytes == f.bytes and old.mtime == f.mtime:
            checks[name] = old
        else:
            checks[name] = check_shard(Path(f.path))
            nbytes += f.bytes
        if progress:
            progress(GcProgress("verify", i + 1, len(files)))
    findings = [
        Finding("corrupt-shard", c.path, c.problem, True) for c in checks.values() if not c.sound
    ]
    for p in layout.shards.rglob("*") if layout.shards.is_dir() else []:
        if p.is_file() and not p.name.endswith(".safetensors"):
            findings.append(Finding("stray-file", str(p), "not a shard; left alone", False))
    state = _catalog_state(layout)
    if state != "ok":
        findings.append(
            Finding("catalog", str(layout.catalog), f"{state}; --repair rebuilds it", True)
        )
    else:
        findings.extend(_check_catalog(layout, checks))
    findings.extend(_check_root_files(layout, state == "ok"))
    tmp = _loose_files(layout.tmp, "*")
    if tmp:
        findings.append(
            Finding(
                "tmp-leftovers",
                str(layout.tmp),
                f"{len(tmp)} files ({sum(f.bytes for f in tmp)} bytes) left by interrupted "
                "writes; gc removes them after the grace period",
                False,
            )
        )
    return VerifyScan(str(layout.root), state, tuple(checks.values()), tuple(findings), nbytes)


def _check_catalog(layout: Layout, checks: dict[str, ShardCheck]) -> list[Finding]:
    cat = Catalog(layout)
    out: list[Finding] = []
    try:
        rows = {s.id: s for s in cat.shard_rows()}
        headers = {name: {e.tensor: e for e in c.entries} for name, c in checks.items() if c.sound}
        for s in rows.values():
            c = checks.get(s.name)
            if c is None:
                out.append(
                    Finding(
                        "missing-shard", s.name, "the catalog names it but its file is gone", True
                    )
                )
        bad_rows = 0
        for key, part, sid, dtype, shape, _ in cat.all_feature_rows():
            s = rows.get(sid)
            if s is None or s.name not in headers:
                continue  # reported per shard (missing, corrupt) or as dangling below
            e = headers[s.name].get(key if not part else f"{key}/{part}")
            if e is None or e.dtype != dtype or list(e.shape) != json.loads(shape):
                bad_rows += 1
        if bad_rows:
            out.append(
                Finding(
                    "bad-rows",
                    str(layout.catalog),
                    f"{bad_rows} feature rows name tensors their shard does not hold",
                    True,
                )
            )
        dangling = cat.dangling_feature_rows()
        if dangling:
            out.append(
                Finding(
                    "dangling-rows",
                    str(layout.catalog),
                    f"{dangling} feature rows name no shard",
                    True,
                )
            )
        named = {s.name for s in rows.values()}
        for name, c in checks.items():
            if name not in named and c.sound:
                out.append(
                    Finding(
                        "orphan-shard",
                        c.path,
                        "no catalog row names it (a build that had not committed yet, or a "
                        "compaction's old copy); gc removes it after the grace period",
                        False,
                    )
                )
        for r in cat.roots():
            f, t = root_file(layout, r.name), tombstone_file(layout, r.name)
            if not f.exists():
                if t.exists():
                    out.append(
                        Finding(
                            "root-dropping", r.name, "a drop was interrupted; gc finishes it", False
                        )
                    )
                else:
                    out.append(
                        Finding("root-file-missing", r.name, "its manifest file is gone", True)
                    )
                continue
            try:
                froot, fitems = read_root_file(f)
            except StoreCorrupt:
                continue  # reported by _check_root_files
            if fitems != [tuple(x) for x in cat.root_items(r.name)] or (
                froot.data,
                froot.encoder_label,
                froot.encoder_fp,
                froot.recipe_fp,
            ) != (r.data, r.encoder_label, r.encoder_fp, r.recipe_fp):
                out.append(
                    Finding(
                        "root-file-stale",
                        r.name,
                        "its manifest file differs from the catalog",
                        True,
                    )
                )
        names = {r.name for r in cat.roots()}
        for p in sorted(roots_dir(layout).glob("*.json")):
            if p.stem not in names:
                out.append(
                    Finding("root-not-cataloged", str(p), "a root manifest the catalog lacks", True)
                )
    finally:
        cat.close()
    return out


def _check_root_files(layout: Layout, catalog_ok: bool) -> list[Finding]:
    out = []
    for p in sorted(roots_dir(layout).glob("*.json")):
        try:
            read_root_file(p)
        except StoreCorrupt as e:
            out.append(Finding("root-file-corrupt", str(p), str(e), True))
    return out


# -- verify: repair ------------------------------------------------------------------------------
def _quarantine(layout: Layout, path: Path) -> Path:
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    dest = layout.quarantine / path.name
    n = 1
    while dest.exists():
        dest = layout.quarantine / f"{path.name}.{n}"
        n += 1
    os.replace(path, dest)
    return dest


def _sealed_from_check(c: ShardCheck) -> SealedShard:
    return SealedShard(c.name, Path(c.path), c.bytes, c.encoder_fp, c.recipe_fp, c.entries)


def _salvage(layout: Layout, c: ShardCheck) -> SealedShard | None:
    """Copy the tensors of a damaged shard that pass their checksum into a fresh shard."""
    if not c.intact or not c.encoder_fp:
        return None
    tensors = {}
    with ShardReader(c.path, verify="always") as reader:
        for t in c.intact:
            with contextlib.suppress(StoreCorrupt):
                tensors[t] = reader.read(t)
    # A key is kept only whole: serving some outputs of a multi-output feature would be wrong.
    broken = {e.key for e in c.entries if e.tensor not in tensors}
    tensors = {t: v for t, v in tensors.items() if split_tensor_name(t)[0] not in broken}
    if not tensors:
        return None
    from featbake.store.writer import write_shard

    return write_shard(layout, tensors, c.encoder_fp, c.recipe_fp)


def repair(scan: VerifyScan, progress: Callable[[GcProgress], None] | None = None) -> VerifyReport:
    """Make the catalog agree with the sound shards, quarantining what is corrupt.

    Order: intact tensors of a damaged shard are first copied into a fresh shard; then catalog
    rows pointing at damaged or missing shards are deleted; then the damaged files move to
    ``quarantine/``. A missing or unusable catalog is moved to ``quarantine/`` and rebuilt from the
    shard headers and the root manifests in ``roots/`` (hash cache, last-use times and encoder
    labels are carried over from the old catalog where it can still be read). Afterwards the
    store is scanned again (unchanged shards are not re-read) to tell "repaired" from "damage
    remains".
    """
    t0 = time.perf_counter()
    layout = Layout(Path(scan.store))
    report = VerifyReport(
        scan.store, "clean", len(scan.shards), scan.bytes_checked, list(scan.findings)
    )
    if not scan.damaged:
        report.seconds = time.perf_counter() - t0
        return report
    layout.ensure()
    salvaged: list[SealedShard] = []
    bad = [c for c in scan.shards if not c.sound]
    for c in bad:
        s = _salvage(layout, c)
        if s is not None:
            salvaged.append(s)
            report.features_salvaged += len({e.key for e in s.entries})
            report.actions.append(f"salvaged {len(s.entries)} intact tensors of {c.name}")
    if scan.catalog_state != "ok":
        _rebuild_catalog(layout, scan, salvaged, report)
    else:
        _repair_catalog(layout, scan, salvaged, report)
    for c in bad:
        dest = _quarantine(layout, Path(c.path))
        report.actions.append(f"quarantined {c.name} ({c.problem}) -> {dest}")
    for f in scan.findings:
        if f.kind == "root-file-corrupt" and Path(f.subject).exists():
            dest = _quarantine(layout, Path(f.subject))
            report.actions.append(f"quarantined root manifest {f.subject} -> {dest}")
    again = scan_store(layout.root, progress, reuse={c.path: c for c in scan.shards if c.sound})
    report.remaining = [f for f in again.findings if f.damage]
    report.status = "damaged" if report.remaining else "repaired"
    report.seconds = time.perf_counter() - t0
    return report


def _repair_catalog(
    layout: Layout, scan: VerifyScan, salvaged: list[SealedShard], report: VerifyReport
) -> None:
    cat = Catalog(layout)
    try:
        rows = {s.name: s for s in cat.shard_rows()}
        checks = {c.name: c for c in scan.shards}
        doomed = [s.id for name, s in rows.items() if name not in checks or not checks[name].sound]
        if doomed:
            lost = cat.delete_rows_of_shards(doomed)
            report.features_lost += lost
            report.actions.append(
                f"forgot {len(doomed)} missing or damaged shards ({lost} feature rows)"
            )
        # Rows naming tensors their shard lacks.
        headers = {n: {e.tensor: e for e in c.entries} for n, c in checks.items() if c.sound}
        by_id = {s.id: s for s in rows.values()}
        wrong = []
        for key, part, sid, dtype, shape, nbytes in cat.all_feature_rows():
            s = by_id.get(sid)
            if s is None or s.name not in headers:
                continue
            e = headers[s.name].get(key if not part else f"{key}/{part}")
            if e is None or e.dtype != dtype or list(e.shape) != json.loads(shape):
                wrong.append(FeatureRef(key, part, sid, nbytes, 0.0))
        if wrong:
            report.features_lost += cat.delete_features(wrong, only_unreached=False)
            report.actions.append(f"deleted {len(wrong)} rows naming tensors their shard lacks")
        n = cat.delete_dangling_feature_rows()
        if n:
            report.actions.append(f"deleted {n} rows naming no shard")
            report.features_lost += n
        # Sound shards the catalog lacks, and salvaged ones: index them (first row wins).
        added = 0
        for c in checks.values():
            if c.sound and c.name not in rows:
                added += cat.add_shard(_sealed_from_check(c), now=c.mtime)
        for s in salvaged:
            back = cat.add_shard(s)
            added += back
            report.features_lost = max(0, report.features_lost - back)  # salvaged: not lost
        if added:
            report.actions.append(f"indexed {added} feature rows from shards the catalog lacked")
        _repair_roots(layout, cat, report)
    finally:
        cat.close()


def _repair_roots(layout: Layout, cat: Catalog, report: VerifyReport) -> None:
    names = set()
    for r in cat.roots():
        names.add(r.name)
        f, t = root_file(layout, r.name), tombstone_file(layout, r.name)
        items = [tuple(x) for x in cat.root_items(r.name)]
        if not f.exists() and t.exists():
            continue  # an interrupted drop: gc finishes it
        try:
            same = f.exists() and read_root_file(f)[1] == items
        except StoreCorrupt:
            same = False
        if not same:
            write_root_file(layout, r, items)  # type: ignore[arg-type]
            report.actions.append(f"rewrote the manifest file of root {r.name} from the catalog")
    for p in sorted(roots_dir(layout).glob("*.json")):
        if p.stem in names:
            continue
        try:
            root, items = read_root_file(p)
        except StoreCorrupt:
            continue  # quarantined by the caller
        cat.insert_root(root, items)
        report.actions.append(f"restored root {root.name} from its manifest file")


def _rebuild_catalog(
    layout: Layout, scan: VerifyScan, salvaged: list[SealedShard], report: VerifyReport
) -> None:
    old = _read_old_catalog(layout.catalog) if layout.catalog.exists() else {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{layout.catalog}{suffix}")
        if p.exists():
            dest = _quarantine(layout, p)
            report.actions.append(f"moved the old catalog file {p.name} to {dest}")
    cat = Catalog(layout)
    try:
        rows = 0
        for c in scan.shards:
            if c.sound:
                rows += cat.add_shard(_sealed_from_check(c), now=c.mtime)
        for s in salvaged:
            rows += cat.add_shard(s)
        report.actions.append(f"rebuilt the catalog: {rows} feature rows from the shard headers")
        if old.get("last_used"):
            cat.set_last_used(old["last_used"])
        if old.get("hash_cache"):
            with cat.transaction() as c:
                c.executemany(
                    "INSERT OR IGNORE INTO hash_cache VALUES (?,?,?,?,?)", old["hash_cache"]
                )
        restored = set()
        for p in sorted(roots_dir(layout).glob("*.json")):
            try:
                root, items = read_root_file(p)
            except StoreCorrupt:
                continue
            cat.insert_root(root, items)
            restored.add(root.name)
        for root, items in old.get("roots", []):
            if root.name not in restored and not tombstone_file(layout, root.name).exists():
                cat.insert_root(root, items)
                write_root_file(layout, root, items)
                restored.add(root.name)
        for p in roots_dir(layout).glob("*.dropped"):
            if p.name.removesuffix(".dropped") not in restored:
                remove_file(p)
        if restored:
            report.actions.append(f"restored {len(restored)} roots from their manifest files")
        for fp, label, kind, first, last in old.get("encoders", []):
            cat.put_encoder_row(fp, label, kind, first, last)
        for r in cat.roots():
            cat.put_encoder_row(r.encoder_fp, r.encoder_label, "unknown", r.created, r.last_used)
        for c in scan.shards:
            if c.sound:
                cat.put_encoder_row(c.encoder_fp, "(unknown: rebuilt)", "unknown", c.mtime, c.mtime)
    finally:
        cat.close()


def _read_old_catalog(path: Path) -> dict[str, Any]:
    """Whatever can still be read from a catalog that cannot be used as is (any schema)."""
    import sqlite3

    out: dict[str, Any] = {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return out
    try:
        for name, sql in (
            ("last_used", "SELECT key, max(last_used) FROM features GROUP BY key"),
            ("hash_cache", "SELECT path, size, mtime_ns, inode, sha256 FROM hash_cache"),
            ("encoders", "SELECT fp, label, kind, first_seen, last_used FROM encoders"),
        ):
            with contextlib.suppress(sqlite3.Error):
                out[name] = conn.execute(sql).fetchall()
        with contextlib.suppress(sqlite3.Error, ValueError):
            roots = []
            for row in conn.execute("SELECT * FROM roots").fetchall():
                name, data, label, efp, rfp, recipe, _, created, last = row
                items = conn.execute(
                    "SELECT path, key FROM root_items WHERE root=? ORDER BY idx", (name,)
                ).fetchall()
                roots.append(
                    (
                        Root(
                            name,
                            data,
                            label,
                            efp,
                            rfp,
                            json.loads(recipe),
                            len(items),
                            created,
                            last,
                        ),
                        items,
                    )
                )
            out["roots"] = roots
    finally:
        conn.close()
    return out


def verify(
    cache: str | os.PathLike[str] | None = None,
    *,
    repair_damage: bool = False,
    progress: Callable[[GcProgress], None] | None = None,
) -> VerifyReport:
    """Check a store (and with ``repair_damage`` fix it); ``report.exit_code`` is 0, 10 or 11.

    Example:
        >>> report = verify(".featbake", repair_damage=True)  # doctest: +SKIP
        >>> report.status  # "clean", "repaired" or "damaged"  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    scan = scan_store(cache, progress)
    if repair_damage:
        return repair(scan, progress)
    report = VerifyReport(
        scan.store,
        "damaged" if scan.damaged else "clean",
        len(scan.shards),
        scan.bytes_checked,
        list(scan.findings),
        remaining=[f for f in scan.findings if f.damage],
    )
    report.seconds = time.perf_counter() - t0
    return report
