"""``featbake gc``, first half: work out what a run will remove, reading only (``--dry-run``).

The plan is frozen: ``gc.py`` carries it out step by step, re-checking under the write lock what
may have changed since (a build publishing a root, a late commit indexing an orphan).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from contextlib import closing
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from featbake.errors import ConfigError, StoreError
from featbake.store.catalog import Catalog, FeatureRef, Root, ShardRow, ShardUsage
from featbake.store.catalog import root_file as manifest_file
from featbake.store.catalog import roots_dir as manifests_dir
from featbake.store.fragments import fragment_shard_names
from featbake.store.layout import Layout
from featbake.store.open import StoreRef, open_catalog
from featbake.store.shard_format import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_ITEMS
from featbake.upkeep.files import LooseFile, list_folder, shard_files

#: Default grace period before gc removes a shard no row names, or a file left in ``tmp/``.
DEFAULT_GRACE_S = 3600.0


DEFAULT_COMPACT_BELOW = 0.5


HEADER_SLACK = 16  # bytes per tensor a rewritten header may grow by (longer offsets)


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


class DropReason(StrEnum):
    """Why gc drops a root; execution differs per reason (see ``gc.execute_gc``)."""

    INTERRUPTED = "an interrupted drop"  # a tombstone and no manifest file: finish the drop
    ASKED = "asked"  # named by the caller
    UNUSED = "unused"  # older than --older-than (re-checked when dropping: a build may win)


@dataclass(frozen=True)
class DropRoot:
    """A root gc drops, and why (``reason`` is the line ``gc --dry-run`` prints)."""

    name: str
    data: str
    encoder_label: str
    last_used: float
    items: int
    why: DropReason
    idle_days: float = 0.0

    @property
    def reason(self) -> str:
        if self.why is DropReason.UNUSED:
            return f"unused for {self.idle_days:.1f} days"
        return str(self.why)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["why"], d["reason"] = str(self.why), self.reason
        return d


@dataclass(frozen=True)
class GcPlan:
    """What one gc run will do, computed without changing anything.

    ``freed_bytes`` is the estimate ``--dry-run`` prints: whole shards deleted, the dead share of
    rewritten shards, orphan shard files and ``tmp/`` leftovers.
    """

    layout: Layout
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
            "store": str(self.layout.root),
            "roots_dropped": [d.to_json() for d in self.drop_roots],
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
    cache: StoreRef = None,
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
    if layout.remote is not None and not isinstance(cache, Layout):
        catalog.close()
        raise ConfigError(
            f"{layout.remote} is a bucket store: its gc publishes a new catalog version and "
            "sweeps objects; run featbake.upkeep.gc_bucket(...) or `featbake gc --cache URL`"
        )
    with closing(catalog):
        roots = catalog.roots()
        if opts.older_than is not None:  # a root a dataset reads is in use (features' last use)
            stale = now - opts.older_than
            roots = [catalog.with_reads(r) if r.last_used < stale else r for r in roots]
        drops = roots_to_drop(layout, roots, opts, now, set(drop))
        unreached, reached = _reach(catalog, roots, {d.name for d in drops}, opts)
        shard_rows = catalog.shard_rows()
        evict: list[FeatureRef] = []
        if opts.max_bytes is not None and reached is not None:
            evict = evictions(reached, _shards_of(reached, shard_rows), opts.max_bytes)
        fates = shard_fates(
            shard_rows,
            catalog.shard_usage(),
            removed_per_shard(unreached, evict),
            opts,
            _must_rewrite(opts, evict, shard_rows),
        )
        # Shards of sharded builds not merged yet are named by fragments, not rows: not garbage.
        # The catalog is read again after the fragments: a merge that folded a fragment in and
        # removed it meanwhile moved its shards into the catalog, where this second read finds
        # them.
        named = {s.name for s in shard_rows} | fragment_shard_names(layout)
        named |= {s.name for s in catalog.shard_rows()}
    loose = [f for name, f in shard_files(layout).items() if name not in named]
    orphans = [f for f in loose if now - f.mtime >= opts.grace]
    tmp = [f for f in list_folder(layout.tmp, "*").files if now - f.mtime >= opts.grace]
    return GcPlan(
        layout=layout,
        options=opts,
        now=now,
        drop_roots=tuple(drops),
        unreached=tuple(unreached),
        evict=tuple(evict),
        empty_shards=fates.empty,
        compact=fates.compact,
        compact_keep_bytes=fates.keep_bytes,
        orphan_shards=tuple(orphans),
        young_orphans=len(loose) - len(orphans),
        tmp_files=tuple(tmp),
        disk_bytes=sum(s.bytes for s in shard_rows) + sum(f.bytes for f in orphans),
    )


def roots_to_drop(
    layout: Layout, roots: list[Root], opts: GcOptions, now: float, asked: set[str]
) -> list[DropRoot]:
    """The roots this run drops: interrupted drops, those asked for, those unused too long."""
    pending = {p.name.removesuffix(".dropped") for p in manifests_dir(layout).glob("*.dropped")}
    out = []
    for r in roots:
        if r.name in pending and not manifest_file(layout, r.name).exists():
            why = DropReason.INTERRUPTED
        elif r.name in asked:
            why = DropReason.ASKED
        elif opts.older_than is not None and r.last_used < now - opts.older_than:
            why = DropReason.UNUSED
        else:
            continue
        idle = (now - r.last_used) / 86400
        out.append(DropRoot(r.name, r.data, r.encoder_label, r.last_used, r.items, why, idle))
    return out


@dataclass
class Removed:
    """Rows and bytes a plan takes out of one shard."""

    rows: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class ShardFates:
    """What happens to the shards: deleted whole, or rewritten keeping ``keep_bytes``."""

    empty: tuple[ShardRow, ...]
    compact: tuple[ShardRow, ...]
    keep_bytes: int


def removed_per_shard(unreached: list[FeatureRef], evict: list[FeatureRef]) -> dict[int, Removed]:
    """shard id -> the rows and bytes the plan takes out of it."""
    removed: dict[int, Removed] = defaultdict(Removed)
    for ref in [*unreached, *evict]:
        removed[ref.shard_id].rows += 1
        removed[ref.shard_id].nbytes += ref.nbytes
    return removed


def _must_rewrite(opts: GcOptions, evict: list[FeatureRef], shard_rows: list[ShardRow]) -> bool:
    """Whether every shard holding garbage is rewritten: under a byte budget that is exceeded
    (the budget is on disk bytes, so garbage left inside a shard still counts)."""
    return opts.max_bytes is not None and (
        bool(evict) or sum(s.bytes for s in shard_rows) > opts.max_bytes
    )


def _reach(
    catalog: Catalog, roots: list[Root], dropped: set[str], opts: GcOptions
) -> tuple[list[FeatureRef], list[FeatureRef] | None]:
    """(rows no kept root reaches, rows kept roots reach); the latter only when needed."""
    unreached = catalog.unreached_features()
    if not dropped and opts.max_bytes is None:
        return unreached, None
    # Rows only the dropped roots name are unreached too.
    kept = {k for r in roots if r.name not in dropped for _, k in catalog.root_items(r.name)}
    reached: list[FeatureRef] = []
    for ref in catalog.reached_features():
        (reached if ref.key in kept else unreached).append(ref)
    return unreached, reached


def shard_fates(
    shard_rows: list[ShardRow],
    usage: dict[int, ShardUsage],
    removed: dict[int, Removed],
    opts: GcOptions,
    force: bool,
) -> ShardFates:
    """Which shards go whole, which are rewritten (low occupancy, or small ones merged)."""
    empty, compact, keep_bytes = [], [], 0
    small: dict[tuple[str, str], list[ShardRow]] = defaultdict(list)
    for s in shard_rows:
        u, gone = usage.get(s.id), removed.get(s.id, Removed())
        rows = (u.rows if u else 0) - gone.rows
        live = (u.nbytes if u else 0) - gone.nbytes
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
    return ShardFates(tuple(empty), tuple(compact), keep_bytes)


def _shards_of(reached: list[FeatureRef], shard_rows: list[ShardRow]) -> dict[int, ShardRow]:
    """Shard rows by id, for eviction's costs.

    Raises:
        StoreError: a feature row names a shard the catalog has no row for (a damaged catalog:
            gc cannot weigh what it cannot find).
    """
    shards = {s.id: s for s in shard_rows}
    lost = sum(1 for ref in reached if ref.shard_id not in shards)
    if lost:
        raise StoreError(
            f"{lost} feature rows name a shard the catalog has no row for, so gc --max-bytes "
            "cannot weigh them; run `featbake verify --repair` first, then gc again"
        )
    return shards


def evictions(
    reached: list[FeatureRef], shards: dict[int, ShardRow], budget: int
) -> list[FeatureRef]:
    """The least recently used features to evict so the kept ones fit in ``budget`` bytes.

    Each kept tensor costs its bytes plus its shard's header share per tensor (and a little slack
    for the longer offsets of a rewritten header); every shard that loses anything is rewritten,
    so the kept costs are what stays on disk. A key's parts go together.
    """

    def cost(ref: FeatureRef) -> float:
        s = shards[ref.shard_id]
        return ref.nbytes + (s.bytes - s.data_bytes) / max(1, s.items) + HEADER_SLACK

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
