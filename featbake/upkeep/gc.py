"""``featbake gc``, for any place (a directory, or a bucket through this node's tier): plan ->
commit -> sweep. :func:`gc` is the one entry point the CLI and the Python API call.

1. Plan (:func:`plan_gc`, reads only; ``--dry-run`` prints it): the catalog's part (roots to
   drop, rows to delete or evict, shards emptied or rewritten) and the place's sweep
   (:meth:`~featbake.store.place.Place.plan_sweep`: shards nothing names once older than the
   place's age, i.e. the grace period in a directory, the retention period in a bucket; tmp/
   leftovers; retired catalog versions). The plan is frozen.
2. Commit (:func:`execute_gc`, through :meth:`~featbake.store.place.Place.commit`: the
   catalog's transactions in a directory, the next published version in a bucket), each step
   committing before the next begins:

   a. Drop roots: the manifest file becomes a tombstone, the rows go, the tombstone goes.
   b. Delete feature rows no kept root reaches (re-checked in the DELETE itself, so a build
      that just published a root naming a key keeps it), then the evicted rows.
   c. Shards left without rows: catalog row first, then the file (where the place holds it:
      a bucket's objects wait for the sweep, readers of older versions may still use them).
   d. Compaction, where the place rewrites shards: copy the live features of low-occupancy
      (and small) shards into fresh shards (sealed: tmp, fsync, rename), commit rows pointing
      at them, then delete the old rows and files. A reader holding the old location
      re-resolves the key once and finds the new one.
   e. Encoder rows nothing mentions any more.
3. Sweep (:meth:`~featbake.store.place.Place.sweep`): the planned shards (re-checked where
   the place allows it), then leftovers, then retired catalog versions.

One gc at a time: a run holds the store's gc lock from its plan to its sweep (:func:`gc_alone`;
a bucket store's is in the node's local cache), and a second waits, then plans afresh.
``--dry-run`` reads only and takes no lock.

The crash tests kill gc between steps at the named points of :data:`CRASH_POINTS`
(``FEATBAKE_TEST_CRASH_AT``), then check that a rerun finishes the job and loses nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from contextlib import closing
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, NamedTuple

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError
from featbake.progress import GcProgress
from featbake.store.catalog import (
    Access,
    Catalog,
    FeatureRef,
    ShardFeature,
    ShardRow,
    ShardUsage,
    access_for,
    read_only_here,
    refuse_wrong_kinds,
)
from featbake.store.claims import claimed_keys, claims_closed
from featbake.store.files import fsync_dir, remove_file
from featbake.store.fragments import serving_uses, waiting_keys
from featbake.store.layout import Layout, checked_shard_name
from featbake.store.locks import alone, shared_write_lock
from featbake.store.merge import sealed_replacements
from featbake.store.open import Need, StoreRef, open_catalog, open_store, place_of
from featbake.store.place import Change, Held, Sweep
from featbake.store.roots import Root
from featbake.store.roots import root_file as manifest_file
from featbake.store.roots import roots_dir as manifests_dir
from featbake.store.shard import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_ITEMS,
    SealedShard,
    ShardReader,
    ShardWriter,
    tensor_name,
)
from featbake.upkeep.files import refuse_while_rebuild_pending
from featbake.upkeep.kept import Shortfall, shortfall

# == gc_plan =======================================================================================
# ``featbake gc``, first half: work out what a run will remove, reading only (``--dry-run``).
#
# The plan is frozen: ``gc.py`` carries it out step by step, re-checking under the write lock what
# may have changed since (a build publishing a root, a late commit indexing an orphan).
#: Default grace period before gc removes a shard no row names, or a file left in ``tmp/``.
DEFAULT_GRACE_S = 3600.0


DEFAULT_COMPACT_BELOW = 0.5

#: How long gc keeps what an older catalog version of a bucket store names, and shard objects
#: nothing names yet (Delta Lake's VACUUM: 7 days).
DEFAULT_RETENTION_S = 7 * 86400.0


HEADER_SLACK = 16  # bytes per tensor a rewritten header may grow by (longer offsets)


@dataclass(frozen=True)
class GcOptions:
    """What gc may remove.

    Attributes:
        older_than: drop roots neither built nor used for this many seconds.
        max_bytes: evict least-recently-used features (across roots) until the shards fit,
            passing over those builds not merged yet name (claims, sealed fragments).
        compact_below: rewrite a shard that holds garbage once its live share of bytes is under
            this fraction (0 never, 1 always).
        grace: leave shard files no row names, and ``tmp/`` files, alone until this old.
        retention: a bucket store keeps what catalog versions retired less than this long ago
            name, and shard objects nothing names until this old (the bucket's age for the
            sweep's one rule, as ``grace`` is a directory's), an hour at least
            (:data:`~featbake.store.versions.UPLOADED_UNNAMED_S`: a running build's).
        shard_bytes: target size of shards written by compaction.
        merge_small: also merge shards under a quarter of ``shard_bytes`` (two or more of one
            encoder and recipe), e.g. the small tail shards that many short builds leave.
    """

    older_than: float | None = None
    max_bytes: int | None = None
    compact_below: float = DEFAULT_COMPACT_BELOW
    grace: float = DEFAULT_GRACE_S
    retention: float = DEFAULT_RETENTION_S
    shard_bytes: int = DEFAULT_SHARD_BYTES
    max_items: int = DEFAULT_SHARD_ITEMS
    merge_small: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.compact_below <= 1.0:
            raise ConfigError(f"--compact-below must be in [0, 1], got {self.compact_below}")
        if self.grace < 0:
            raise ConfigError(f"--grace must not be negative (e.g. --grace 1h), got {self.grace}")
        if self.retention < 0:
            raise ConfigError(f"--retention must not be negative (e.g. 7d), got {self.retention}")
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
    """What one gc run will do, computed without changing anything: the catalog's part, and
    the place's ``sweep``.

    ``freed_bytes`` is the estimate ``--dry-run`` prints: whole shards deleted, the dead share of
    rewritten shards, and what the sweep deletes (unnamed shards, ``tmp/`` leftovers, retired
    catalog versions).
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
    sweep: Sweep
    disk_bytes: int
    #: why ``--max-bytes`` is left exceeded: features builds not merged yet hold (None: fits)
    shortfall: Shortfall | None = None

    @property
    def orphan_shards(self) -> tuple[Held, ...]:
        """Shards nothing names, past the place's age (the sweep deletes them)."""
        return self.sweep.shards

    @property
    def young_orphans(self) -> int:
        """Shards nothing names yet, younger than the place's age (kept)."""
        return self.sweep.young_shards

    @property
    def tmp_files(self) -> tuple[Held, ...]:
        return self.sweep.loose

    @property
    def freed_bytes(self) -> int:
        return (
            sum(s.bytes for s in self.empty_shards)
            + max(0, sum(s.bytes for s in self.compact) - self.compact_keep_bytes)
            + self.sweep.bytes
        )

    @property
    def changes_catalog(self) -> bool:
        """Whether the commit step has work (else the catalog stays as it is)."""
        return bool(
            self.drop_roots or self.unreached or self.evict or self.empty_shards or self.compact
        )

    @property
    def nothing_to_do(self) -> bool:
        return not self.changes_catalog and self.sweep.empty

    def unforeseen_bytes(self, stored: int) -> int:
        """How far ``stored`` shard bytes, measured once this plan ran, exceed ``--max-bytes``
        beyond what the plan foresaw (the features builds not merged yet hold, its
        ``shortfall``): written while it ran, or in a shard it skipped. 0 without a budget."""
        budget = self.options.max_bytes
        if budget is None:
            return 0
        foreseen = self.shortfall.over_bytes if self.shortfall is not None else 0
        return max(0, stored - budget - foreseen)

    def summary(self) -> dict[str, Any]:
        """Counts and bytes (``gc --json``; the full lists stay in the object)."""
        return {
            "store": str(place_of(self.layout)),
            "roots_dropped": [d.to_json() for d in self.drop_roots],
            "unreached_features": len({r.key for r in self.unreached}),
            "unreached_bytes": sum(r.nbytes for r in self.unreached),
            "evicted_features": len({r.key for r in self.evict}),
            "evicted_bytes": sum(r.nbytes for r in self.evict),
            "shards_deleted": len(self.empty_shards),
            "shards_rewritten": len(self.compact),
            "orphan_shards": len(self.sweep.shards),
            "orphan_shards_in_grace": self.sweep.young_shards,
            "tmp_files": len(self.sweep.loose),
            "old_versions": len(self.sweep.versions),
            "disk_bytes": self.disk_bytes,
            "freed_bytes": self.freed_bytes,
            "over_budget_bytes": 0,
            "kept_for_builds_bytes": 0,
            "kept_beside_bytes": 0,
            "kept_for": [],
        } | (self.shortfall.to_json() if self.shortfall else {})


def plan_gc(
    cache: StoreRef = None,
    options: GcOptions | None = None,
    *,
    now: float | None = None,
    drop: Iterable[str] = (),
) -> GcPlan:
    """Work out what gc would remove, on any place (reads only; ``featbake gc --dry-run``
    prints this).

    Args:
        cache: the store (a directory, a bucket URL, or its :class:`Layout`).
        options: thresholds and budgets (:class:`GcOptions`); a place that does not rewrite
            shards (a bucket) plans no compaction, and ``max_bytes`` evicts whole shards there
            (:func:`whole_shard_evictions`).
        now: the time "now" (tests pass one to age things without waiting).
        drop: names of roots to drop besides those ``older_than`` selects.

    Example:
        >>> plan = plan_gc(".featbake", GcOptions(max_bytes=200 * 2**30))  # doctest: +SKIP
        >>> plan.freed_bytes  # doctest: +SKIP
    """
    opts = options or GcOptions()
    now = time.time() if now is None else now
    layout = open_store(cache, need=Need.STORE)
    refuse_while_rebuild_pending(layout)  # a half-rebuilt catalog lacks roots: all unreached
    layout, catalog = open_catalog(layout)
    place = place_of(layout)
    rewrites = place.rewrites_shards()
    if not rewrites:
        opts = dataclasses.replace(opts, compact_below=0.0, merge_small=False)
    with closing(catalog):
        refuse_wrong_kinds(catalog)  # gc adds, compares and deletes by these values
        roots = catalog.roots()
        if opts.older_than is not None:  # a root a dataset reads is in use (features' last use)
            stale = now - opts.older_than
            uses = recorded_uses(layout)
            roots = [with_reads(catalog, r, uses) if r.last_used < stale else r for r in roots]
        drops = roots_to_drop(layout, roots, opts, now, set(drop))
        place.sync_fragments()  # a bucket's, here first: a dry run merges none in beforehand
        waiting = kept_for_builds(layout)  # what builds not merged yet name: kept, not evicted
        unreached, reached = _reach(catalog, roots, {d.name for d in drops}, opts, waiting)
        shard_rows = catalog.shard_rows()
        for row in shard_rows:  # a damaged or planted name: refused before any step commits
            checked_shard_name(row.name)
        evict: list[FeatureRef] = []
        short = None
        if opts.max_bytes is not None and reached is not None:
            shards = _shards_of(reached, shard_rows)
            evict, short = budget_evictions(
                layout, reached, shards, opts.max_bytes, waiting, whole=not rewrites
            )
        fates = shard_fates(
            shard_rows,
            catalog.shard_usage(),
            removed_per_shard(unreached, evict),
            opts,
            rewrites and _must_rewrite(opts, evict, shard_rows),
        )
    sweep = place.plan_sweep(now, opts.grace, opts.retention)
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
        sweep=sweep,
        disk_bytes=sum(s.bytes for s in shard_rows) + sum(h.size for h in sweep.shards),
        shortfall=short,
    )


def recorded_uses(layout: Layout) -> dict[str, float]:
    """Last uses that serving processes sealed into fragments not merged yet (a store on a
    shared filesystem, or a bucket's, brought here first: a dry run folds nothing in)."""
    place_of(layout).sync_fragments()
    return serving_uses(layout)


def with_reads(catalog: Catalog, root: Root, uses: dict[str, float]) -> Root:
    """``root`` with ``last_used`` the later of its build and the last read of any of its
    features, in the catalog or in ``uses`` (:func:`recorded_uses`)."""
    root = catalog.with_reads(root)
    if not uses:
        return root
    read = max((uses.get(k, 0.0) for _, k in catalog.root_items(root.name)), default=0.0)
    return dataclasses.replace(root, last_used=max(root.last_used, read))


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
    catalog: Catalog, roots: list[Root], dropped: set[str], opts: GcOptions, waiting: set[str]
) -> tuple[list[FeatureRef], list[FeatureRef] | None]:
    """(rows no kept root reaches, rows kept roots reach); the latter only when needed.

    Rows of keys a sealed fragment stores or names count as reached: a build in parts not
    merged yet (a part killed before its end) had them folded in by a merge or a one-process
    build, or found them stored and reused them, and its rerun or merge publishes the manifest
    naming them; a dataset on a shared filesystem publishes its root in a ``serve`` fragment.
    Rows of keys a live claim names count as reached too: a build part still running that
    found them stored and reuses them (store/claims.py): ``waiting`` (:func:`kept_for_builds`).
    Those no root reaches yet are among the reached rows returned, so that ``--max-bytes``
    counts them (eviction passes over them).
    """
    unreached: list[FeatureRef] = []
    held: list[FeatureRef] = []
    for ref in catalog.unreached_features():
        (held if ref.key in waiting else unreached).append(ref)
    if not dropped and opts.max_bytes is None:
        return unreached, None
    # Rows only the dropped roots name are unreached too.
    kept = {k for r in roots if r.name not in dropped for _, k in catalog.root_items(r.name)}
    kept |= waiting
    reached: list[FeatureRef] = held  # on disk and kept: they count toward --max-bytes too
    for ref in catalog.reached_features():
        (reached if ref.key in kept else unreached).append(ref)
    return unreached, reached


def kept_for_builds(layout: Layout, *, drop_stale: bool = False) -> set[str]:
    """Keys builds not merged yet will name, which gc keeps: those sealed fragments store or
    name (:func:`waiting_keys`), and those live claims of build parts still running name
    (judged by the store's file system clock, as their heartbeats are: a plan's ``now`` ages
    roots only); ``drop_stale``: stale claims are removed (:func:`claimed_keys`)."""
    return waiting_keys(layout) | claimed_keys(layout, drop_stale=drop_stale)


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
            keep_bytes += kept_bytes(s, rows, live)
        elif opts.merge_small and s.bytes < opts.shard_bytes // 4:
            small[(s.encoder_fp, s.recipe_fp)].append(s)
    rewriting = {(s.encoder_fp, s.recipe_fp) for s in compact}
    for group, shards in small.items():
        # Merging one small shard alone would rewrite it unchanged: only merge two or more.
        if len(shards) >= 2 or group in rewriting:
            compact.extend(shards)
            keep_bytes += sum(kept_bytes(s, usage[s.id].rows, usage[s.id].nbytes) for s in shards)
    return ShardFates(tuple(empty), tuple(compact), keep_bytes)


def kept_bytes(shard: ShardRow, rows: int, live: int) -> int:
    """What ``rows`` tensors of ``shard`` holding ``live`` data bytes take once rewritten: their
    bytes and their share of its header. Counting the data alone, ``gc --dry-run`` took every
    rewritten shard's header for garbage: small shards merged "would free about 313 KiB"
    where 1.5 KiB was freed. (What a merge saves of each header's fixed part, a few hundred
    bytes a shard, is left out: the estimate errs low.)

    Example:
        >>> shard = ShardRow(1, "a" * 64, 1_400, 1_000, 4, "e", "r", 0.0)  # 100 B of header each
        >>> kept_bytes(shard, 2, 500)
        700
    """
    header = (shard.bytes - shard.data_bytes) / max(1, shard.items)
    return live + round(rows * header)


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


def key_costs(reached: list[FeatureRef], shards: dict[int, ShardRow]) -> dict[str, float]:
    """key -> what its reached tensors cost on disk if kept: each tensor's bytes plus its
    shard's header share per tensor (and a little slack for the longer offsets of a rewritten
    header); every shard that loses anything is rewritten, so the kept costs are what stays."""
    costs: dict[str, float] = defaultdict(float)
    for ref in reached:
        s = shards[ref.shard_id]
        costs[ref.key] += ref.nbytes + (s.bytes - s.data_bytes) / max(1, s.items) + HEADER_SLACK
    return costs


def evictions(
    reached: list[FeatureRef],
    shards: dict[int, ShardRow],
    budget: int,
    kept: AbstractSet[str] = frozenset(),
) -> list[FeatureRef]:
    """The least recently used features to evict so the kept ones fit in ``budget`` bytes,
    passing over the keys in ``kept`` (what builds not merged yet name: :func:`kept_for_builds`;
    they count against the budget, and may leave it exceeded: :func:`over_budget` says why).

    Each key costs :func:`key_costs`; a key's parts go together.
    """
    costs = key_costs(reached, shards)
    by_key: dict[str, list[FeatureRef]] = defaultdict(list)
    for ref in reached:
        by_key[ref.key].append(ref)
    units = [
        Evictable((max(r.last_used for r in rows), key), costs[key], rows)
        for key, rows in by_key.items()
        if key not in kept
    ]
    return evicted_until_fits(units, sum(costs.values()), budget)


class Evictable(NamedTuple):
    """What ``--max-bytes`` evicts together (a key's parts, or a whole shard's rows): its
    order (least recently used first, then its name), what keeping it costs, and its rows."""

    order: tuple[float, str]
    cost: float
    rows: list[FeatureRef]


def evicted_until_fits(units: Iterable[Evictable], total: float, budget: int) -> list[FeatureRef]:
    """The rows of ``units``, least recently used first, taken until what is left of ``total``
    fits ``budget`` (pure: the one greedy rule of both kinds of eviction).

    Example:
        >>> old, new = Evictable((1.0, "a"), 60, []), Evictable((2.0, "b"), 60, [])
        >>> evicted_until_fits([new, old], 120, 100) == old.rows
        True
    """
    out: list[FeatureRef] = []
    for unit in sorted(units, key=lambda u: u.order):
        if total <= budget:
            break
        out.extend(unit.rows)
        total -= unit.cost
    return out


def budget_evictions(
    layout: Layout,
    reached: list[FeatureRef],
    shards: dict[int, ShardRow],
    budget: int,
    kept: AbstractSet[str],
    whole: bool,
) -> tuple[list[FeatureRef], Shortfall | None]:
    """The rows ``--max-bytes`` evicts, and why the store stays over ``budget`` after (None:
    it fits): by feature where shards are rewritten, by ``whole`` shards where they never are
    (a bucket store: only deleting a shard's object frees its bytes)."""
    if whole:
        evict = whole_shard_evictions(reached, shards, budget, kept)
        return evict, whole_shard_over_budget(layout, reached, shards, budget, evict, kept)
    evict = evictions(reached, shards, budget, kept)
    return evict, over_budget(layout, reached, shards, budget, evict, kept)


def _rows_by_shard(reached: list[FeatureRef]) -> dict[int, list[FeatureRef]]:
    """shard id -> the reached rows it holds."""
    rows: dict[int, list[FeatureRef]] = defaultdict(list)
    for ref in reached:
        rows[ref.shard_id].append(ref)
    return rows


def whole_shard_evictions(
    reached: list[FeatureRef],
    shards: dict[int, ShardRow],
    budget: int,
    kept: AbstractSet[str] = frozenset(),
) -> list[FeatureRef]:
    """The rows of the least recently used whole shards (by their latest use), evicted until
    the shards left fit ``budget``, where shards are never rewritten (a bucket store): there
    evicting part of a shard frees nothing and loses its features for nothing, so a row goes
    only with its whole shard, and a shard holding a key in ``kept`` stays (see
    :func:`evictions`; :func:`whole_shard_over_budget` says what that leaves)."""
    by_shard = _rows_by_shard(reached)
    units = [
        Evictable((max(r.last_used for r in rows), shards[i].name), shards[i].bytes, rows)
        for i, rows in by_shard.items()
        if not any(r.key in kept for r in rows)
    ]
    return evicted_until_fits(units, sum(shards[i].bytes for i in by_shard), budget)


def whole_shard_over_budget(
    layout: Layout,
    reached: list[FeatureRef],
    shards: dict[int, ShardRow],
    budget: int,
    evict: list[FeatureRef],
    kept: AbstractSet[str],
) -> Shortfall | None:
    """:func:`over_budget` where shards are never rewritten: each shard left weighs its whole
    object (shared among its keys), and the bytes beside the kept features in their shards
    (other features, dead rows), which only a rewrite would free, are said too."""
    gone = {r.shard_id for r in evict}
    left = {i: rows for i, rows in _rows_by_shard(reached).items() if i not in gone}
    costs: dict[str, float] = defaultdict(float)
    for i, rows in left.items():
        keys = {r.key for r in rows}
        for key in keys:
            costs[key] += shards[i].bytes / len(keys)
    short = shortfall(layout, budget, costs, frozenset(kept))
    if short is None:
        return None
    pinned = sum(shards[i].bytes for i, rows in left.items() if any(r.key in kept for r in rows))
    return dataclasses.replace(short, beside_bytes=max(0, pinned - short.kept_bytes))


def over_budget(
    layout: Layout,
    reached: list[FeatureRef],
    shards: dict[int, ShardRow],
    budget: int,
    evict: list[FeatureRef],
    kept: AbstractSet[str],
) -> Shortfall | None:
    """Why the kept features stay over ``budget`` once ``evict`` goes: the keys builds not
    merged yet hold (``kept``), and who holds them; None when they fit or nothing kept is the
    cause."""
    gone = {r.key for r in evict}
    left = {k: c for k, c in key_costs(reached, shards).items() if k not in gone}
    return shortfall(layout, budget, left, frozenset(kept))


# == gc ============================================================================================
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
    """What gc did, on any place. ``problems`` names shards it had to skip (run ``featbake
    verify``).

    ``shards_deleted`` counts every shard file or object deleted, ``orphans_removed`` those of
    them the sweep took (nothing named them); ``young_shards`` are unnamed shards kept until
    they pass the place's age; ``versions_deleted`` retired catalog versions (a bucket);
    ``published``: the catalog changed (in a bucket: a new version); ``shards_passed_over``:
    shards the plan rewrites that another gc had already rewritten or removed when this one
    came to them (a plan carried out later through :func:`execute_gc`, or a gc on another host
    of a shared filesystem whose locks do not span hosts; nothing is wrong, so no problem is
    named). Each step of a run returns its own GcResult; the run adds them up (``+``).
    """

    roots_dropped: list[str] = field(default_factory=list)
    rows_deleted: int = 0
    shards_deleted: int = 0
    shards_written: int = 0
    features_moved: int = 0
    orphans_removed: int = 0
    tmp_removed: int = 0
    versions_deleted: int = 0
    young_shards: int = 0
    bytes_freed: int = 0
    published: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    shards_passed_over: int = 0
    #: a ``--max-bytes`` run's plans: 2 where the first left the store over the budget
    #: (:func:`gc`)
    passes: int = 0
    #: a ``--max-bytes`` run's shard bytes measured once it ended (None: no budget asked)
    stored_bytes: int | None = None

    def __add__(self, other: GcResult) -> GcResult:
        """Two steps' or passes' results together: what each did, summed (``young_shards``
        too: one step sweeps); ``problems`` each said once; ``stored_bytes``, the later's where
        it says."""
        summed = [f.name for f in fields(self) if f.name not in _NOT_SUMMED]
        added = {name: getattr(self, name) + getattr(other, name) for name in summed}
        stored = self.stored_bytes if other.stored_bytes is None else other.stored_bytes
        return GcResult(
            **added,
            published=self.published or other.published,
            problems=list(dict.fromkeys(self.problems + other.problems)),
            stored_bytes=stored,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: :class:`GcResult` fields its ``+`` does not sum.
_NOT_SUMMED = ("published", "problems", "stored_bytes")


def gc(
    cache: StoreRef = None,
    options: GcOptions | None = None,
    *,
    now: float | None = None,
    drop: Iterable[str] = (),
    dry_run: bool = False,
    progress: Callable[[GcProgress], None] | None = None,
    on_plan: Callable[[GcPlan], None] | None = None,
    **place: Any,
) -> GcResult:
    """Run gc on the store at ``cache``, whatever its place: plan -> commit -> sweep (see the
    module docstring). ``featbake gc`` calls this. A run holds the store's gc lock from its plan
    to its sweep (:func:`gc_alone`): a second gc waits, saying so once, then plans afresh.

    Args:
        cache: a directory, ``s3://bucket/prefix``, or a store's :class:`Layout`.
        options: thresholds, budgets and ages (:class:`GcOptions`).
        now: the time "now" (tests pass one to age things without waiting).
        drop: names of roots to drop besides those ``older_than`` selects.
        dry_run: plan only; the result says what the run would do. It neither takes the gc
            lock nor waits for a gc that holds it: it shows the store as it is now.
        progress: called with :class:`GcProgress` of each step.
        on_plan: called with the frozen plan before anything changes (the CLI prints it).
        place: :func:`open_store`'s ``local_cache`` and ``local_cache_size`` (a bucket
            store's tier).

    Raises:
        StoreError: no store there, or its catalog or bucket cannot be read or written.

    Example:
        >>> gc("s3://team/features", GcOptions(older_than=30 * 86400))  # doctest: +SKIP
    """
    layout = open_store(cache, need=Need.STORE, **place)
    if dry_run:  # reads only: it neither waits for a gc that runs nor holds one up
        return planned_result(_shown_plan(layout, options, now, drop, on_plan))
    if layout.remote is None and access_for(layout) is not Access.READ_WRITE:
        raise read_only_here(layout)  # before the plan is shown as if it would run
    # One gc at a time: a second, planning beside the first, carried out a plan the first had
    # made stale (shards gone: "run verify --repair"; evictions of rows moved meanwhile: the
    # budget missed). It waits, then plans what is left.
    with gc_alone(layout):
        place_of(layout).settle()
        plan = _shown_plan(layout, options, now, drop, on_plan)
        result = execute_gc(plan, progress)
        if plan.options.max_bytes is None:
            return result
        # The budget measured, not just planned: features written while the run went (a build
        # or merge beside it, the newer version a lost bucket race ran its steps on) can leave
        # the store over it. Once, gc plans afresh from what is there now.
        stored = stored_bytes(layout)
        if plan.unforeseen_bytes(stored):
            place_of(layout).settle()
            again = execute_gc(_shown_plan(layout, options, now, drop, on_plan), progress)
            # The unnamed shards kept are the store's now: the second sweep's count alone.
            result = dataclasses.replace(result, young_shards=0) + again + GcResult(passes=1)
            stored = stored_bytes(layout)
        return result + GcResult(passes=1, stored_bytes=stored)


def stored_bytes(layout: Layout) -> int:
    """The bytes of the shards the store's catalog names now (what ``--max-bytes`` bounds)."""
    layout, catalog = open_catalog(layout, reading=True)
    with closing(catalog):
        return sum(s.bytes for s in catalog.shard_rows())


def _shown_plan(
    layout: Layout,
    options: GcOptions | None,
    now: float | None,
    drop: Iterable[str],
    on_plan: Callable[[GcPlan], None] | None,
) -> GcPlan:
    """The plan made now (:func:`plan_gc`), handed to ``on_plan`` (the CLI prints it)."""
    plan = plan_gc(layout, options, now=now, drop=drop)
    if on_plan is not None:
        on_plan(plan)
    return plan


#: ``<store>/gc.lock`` (a bucket store's: in the node's local cache): held by a gc for its run.
GC_LOCK = "gc.lock"


class GcWaitWarning(UserWarning):
    """A gc waits for another gc of the same store (:func:`gc_alone`)."""


def gc_alone(layout: Layout) -> contextlib.AbstractContextManager[None]:
    """Hold the store's gc lock for a whole run; where another gc holds it, say once that this
    one waits for it, then wait (:func:`~featbake.store.locks.alone`).

    A directory store's lock is ``<store>/gc.lock``. A bucket store's is in this node's local
    cache (``layout.root``): gc runs on one node take turns, and gc runs on two nodes race to
    publish the next catalog version as two merges do (the loser runs its steps again on the
    newer version, each re-checking what it deletes)."""
    where = str(place_of(layout))
    if layout.remote is not None:
        where += f" on this node (local cache {layout.root})"
    return alone(
        layout.root / GC_LOCK,
        f"another gc of {where} is running; this one waits for it to finish, then plans afresh",
        GcWaitWarning,
    )


def planned_result(plan: GcPlan) -> GcResult:
    """What executing ``plan`` would report (a dry run's numbers are the run's)."""
    s = plan.summary()
    return GcResult(
        roots_dropped=[d.name for d in plan.drop_roots],
        rows_deleted=int(s["unreached_features"]) + int(s["evicted_features"]),
        shards_deleted=len(plan.sweep.shards),
        orphans_removed=len(plan.sweep.shards),
        tmp_removed=len(plan.sweep.loose),
        versions_deleted=len(plan.sweep.versions),
        young_shards=plan.sweep.young_shards,
        bytes_freed=plan.freed_bytes,
        published=plan.changes_catalog,
    )


def execute_gc(plan: GcPlan, progress: Callable[[GcProgress], None] | None = None) -> GcResult:
    """Carry out a :class:`GcPlan` on its place: the catalog's steps committed through the
    place, then the sweep (the module docstring's order).

    In a directory the steps hold the store's write lock shared (store/layout.py):
    ``verify --repair`` does not run meanwhile (it would index a shard file gc is about to
    unlink). In a bucket they run on a copy of the newest version, published as the next one
    (a race lost to another publisher runs them again on the newer version: each step
    re-checks what it deletes).
    """
    t0 = time.perf_counter()
    place = place_of(plan.layout)

    def tick(phase: str, done: int, total: int) -> None:
        if progress:
            progress(GcProgress(phase, done, total))

    def change(work: Layout) -> Change[GcResult]:
        return Change(_commit_steps(plan, work, tick), plan.changes_catalog)

    result = place.commit(change)
    result.published = plan.changes_catalog
    swept = place.sweep(plan.sweep, crash_point)
    result += GcResult(
        shards_deleted=swept.shards,
        orphans_removed=swept.shards,
        tmp_removed=swept.loose,
        versions_deleted=swept.versions,
        young_shards=plan.sweep.young_shards,
        bytes_freed=swept.bytes,
    )
    tick("files", 1, 1)
    result.seconds = time.perf_counter() - t0
    return result


def _commit_steps(plan: GcPlan, work: Layout, tick: Tick) -> GcResult:
    """The catalog's steps, on ``work``: the store's own layout, or a copy of a bucket's
    newest version."""
    with shared_write_lock(work), closing(Catalog(work)) as catalog:
        result = _drop_roots(catalog, plan, work, tick)
        result += _delete_rows(catalog, plan, tick)
        result += _delete_empty_shards(work, catalog, [s.id for s in plan.empty_shards], tick)
        if plan.compact:
            compaction = Compaction(catalog, plan, work).run(tick)
            result += compaction.as_result() + _delete_compacted(work, catalog, compaction)
        catalog.forget_unused_encoders()
    return result


def _drop_roots(catalog: Catalog, plan: GcPlan, work: Layout, tick: Tick) -> GcResult:
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
    for p in manifests_dir(work).glob("*.dropped"):
        if catalog.root(p.name.removesuffix(".dropped")) is None:
            remove_file(p)
    return GcResult(roots_dropped=dropped)


def _delete_rows(catalog: Catalog, plan: GcPlan, tick: Tick) -> GcResult:
    """Step 2: rows no kept root reaches (re-checked in the DELETE), then evicted rows; both
    re-checked against the fragments sealed and the claims written since the plan (a build
    not merged yet names them: an evicted one would be a root's feature gone once merged)."""
    if not (plan.unreached or plan.evict):
        return GcResult()
    # No claim is written from this last look at them until the DELETEs have committed: a
    # build part claiming a key meanwhile looks it up after the commit and finds it gone.
    with claims_closed(plan.layout):
        waiting = _still_waiting(plan)
        unreached = [r for r in plan.unreached if r.key not in waiting]
        rows = catalog.delete_features(unreached, only_unreached=True)
        evict = [r for r in plan.evict if r.key not in waiting]
        rows += catalog.delete_features(evict, only_unreached=False)
    tick("rows", rows, len(plan.unreached) + len(plan.evict))
    crash_point("rows-deleted")
    return GcResult(rows_deleted=rows)


def _still_waiting(plan: GcPlan) -> set[str]:
    """Keys builds not merged yet will name, looked at again just before the DELETE: those the
    store's sealed fragments store or name (a bucket's brought in first: parts may have
    uploaded theirs since the plan; the copy of a version gc works on holds none), and those
    its live claims name (stale ones removed: a killed build pins nothing)."""
    place_of(plan.layout).sync_fragments()
    return kept_for_builds(plan.layout, drop_stale=True)


def _delete_empty_shards(
    layout: Layout, catalog: Catalog, shard_ids: list[int], tick: Tick
) -> GcResult:
    """Step 3: shards left without rows: the catalog row first, then the file."""
    out = GcResult()
    gone = catalog.delete_shards_if_empty(shard_ids)
    if gone:
        crash_point("shard-rows-deleted")
    for i, name in enumerate(gone):
        freed = catalog.unlink_shard_file(name)  # 0 where the place keeps no file (a bucket)
        out.bytes_freed += freed
        out.shards_deleted += int(freed > 0)
        crash_point("shard-file-unlinked")
        tick("shards", i + 1, len(gone))
    for d in {layout.shard_path(n).parent for n in gone}:
        fsync_dir(d)
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
    passed_over: int = 0  # planned shards another gc rewrote or removed since the plan

    def as_result(self) -> GcResult:
        """Its share of the run's result (the bytes it wrote count against those freed)."""
        return GcResult(
            shards_written=self.shards_written,
            features_moved=self.features_moved,
            bytes_freed=-self.bytes_written,
            problems=list(self.problems),
            shards_passed_over=self.passed_over,
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

    One writer per (encoder, recipe, era) group; each sealed shard's rows are committed (moved
    from their old shard) as it seals, so an interrupted compaction leaves every row pointing
    at a whole shard.

    A row's shard's age (when it was last recorded or named, :meth:`VoidRows.age_of`) says
    whether a replacement of its key voids it (store/merge.py ``Replacements``), so a new
    shard must keep its rows' ages: it holds the rows of one era only (shards whose ages fall
    between the same two replacement times the sealed fragments name now) and takes the oldest
    age of the shards they come from. Against every replacement gc knows of, each row is then
    void exactly as before; a void row never looks newer. Before, a new shard mixed eras at
    the oldest age: rows stored after a waiting part replaced their key, compacted with an
    older root's, looked older than the replacement and the next merge dropped them (9 good
    rows of 9 in one run). Not chosen: drop the void rows first, then take the newest age. A
    replacing fragment's time is taken before its file appears, so one sealed while gc reads
    the fragments may be older than a shard compacted: a void row would then look new and be
    served. With eras such a replacement can only make a good row look old: a miss, encoded
    again. A shard alone in its era with every row live is left as it is (rewritten, it was
    the same bytes again at every run while the replacement waited).
    """

    def __init__(self, catalog: Catalog, plan: GcPlan, work: Layout) -> None:
        self.layout, self.catalog, self.plan = work, catalog, plan
        self.out = CompactionResult()
        self._pending: dict[tuple[str, str], int] = {}  # (key, part) -> old shard id
        self._ages: dict[int, float] = {}  # old shard id -> its age (VoidRows.age_of)

    def run(self, tick: Tick) -> CompactionResult:
        """Compact every group; returns what was written and emptied."""
        groups: dict[tuple[str, str, int], list[ShardRow]] = defaultdict(list)
        for s, era in self._eras().items():
            groups[(s.encoder_fp, s.recipe_fp, era)].append(s)
        for (enc_fp, rec_fp, _), shards in groups.items():
            if len(shards) == 1 and self._all_live(shards[0]):
                # Alone in its era (a replacement waits) with nothing to drop: rewritten, it
                # would be the same bytes again, at every gc run while the replacement waits.
                continue
            self._group(enc_fp, rec_fp, shards)
            tick("compact", len(self.out.emptied), len(self.plan.compact))
        return self.out

    def _all_live(self, shard: ShardRow) -> bool:
        """Whether every tensor of ``shard`` still has its row."""
        rows = self._rows_still_planned(shard)
        return rows is not None and len(rows) == shard.items

    def _eras(self) -> dict[ShardRow, int]:
        """The planned shards still as planned, each with its era: how many replacement times
        the sealed fragments name now come before its age (noted in ``_ages``). Those rewritten
        or removed since the plan are passed over."""
        # The store's own fragments (a bucket's, synced into its tier by the plan), not the
        # work copy's: a bucket's gc compacts a copy of its newest version, which holds none.
        void = sealed_replacements(self.plan.layout).rows
        times = sorted(set(void.at.values()))
        eras: dict[ShardRow, int] = {}
        for s in self.plan.compact:
            now = self._still_planned(s)
            if now is None:
                self.out.passed_over += 1  # another gc rewrote or removed it: no problem
                continue
            self._ages[s.id] = void.age_of(now.name, now.created)
            eras[s] = bisect.bisect_left(times, self._ages[s.id])
        return eras

    def _commit(self, shard: SealedShard) -> None:
        crash_point("compact-sealed")
        moved = [(e.key, e.part, self._pending.pop((e.key, e.part))) for e in shard.entries]
        age = min(self._ages[old] for _, _, old in moved)  # a void row never looks newer
        n = self.catalog.commit_moved(shard, moved, age)
        if n == 0:  # every row moved or went meanwhile: the new shard would hold only garbage
            self._forget(shard.name)
            return
        self.out.features_moved += n
        self.out.shards_written += 1
        self.out.bytes_written += shard.nbytes
        self.out.written.add(shard.name)
        crash_point("compact-committed")

    def _forget(self, name: str) -> None:
        """Remove a shard this compaction sealed that no row came to name: its catalog row,
        then its file (each only while nothing names it: a byte-identical shard sealed by
        another writer under the same name keeps both)."""
        sid = self.catalog.shard_id(name)
        if sid is not None and self.catalog.delete_shards_if_empty([sid]):
            self.catalog.unlink_shard_file(name)

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
                rows = self._rows_still_planned(s)
                if rows is None:
                    self.out.passed_over += 1  # rewritten or removed since the plan: no problem
                    continue
                if not rows:  # every row went since the plan: deleted as empty, nothing written
                    self.out.emptied.append(s.id)
                    continue
                try:
                    parts = self._read_live(s, rows)
                except (StoreCorrupt, ShardMissing) as e:
                    self.out.problems.append(f"skipped shard {s.name}: {e}")
                    continue
                for key, tensors in parts.items():
                    for part in tensors:
                        self._pending[(key, part)] = s.id
                    writer.add(key, tensors)
                self.out.emptied.append(s.id)

    def _still_planned(self, shard: ShardRow) -> ShardRow | None:
        """The catalog's row of ``shard`` now; None where the catalog no longer has the shard
        the plan named (another gc rewrote or removed it since: its id may even name a newer
        shard by now, ids being reused)."""
        now = self.catalog.shard_row(shard.id)
        return None if now is None or now.name != shard.name else now

    def _rows_still_planned(self, shard: ShardRow) -> list[ShardFeature] | None:
        """The rows pointing into ``shard`` now; None where the shard is no longer the one the
        plan named (:meth:`_still_planned`)."""
        if self._still_planned(shard) is None:
            return None
        return self.catalog.features_of_shard(shard.id)

    def _read_live(self, shard: ShardRow, rows: list[ShardFeature]) -> dict[str, dict[str, Any]]:
        """The tensors of ``rows`` (those still in ``shard``), checksummed (never copy garbage)."""
        out: dict[str, dict[str, Any]] = defaultdict(dict)
        with ShardReader(self.layout.shard_path(shard.name), verify="always") as reader:
            for key, part, _, _, _ in rows:
                out[key][part] = reader.read(tensor_name(key, part))
        return out
