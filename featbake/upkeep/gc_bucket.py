"""``featbake gc`` on a bucket store: the catalog's part as a new version, then a sweep.

1. The local gc (:func:`plan_gc` -> :func:`execute_gc`, unchanged) runs on a copy of the newest
   catalog version, which is published as the next version if it changed (drop roots, delete
   rows no kept root reaches, evict to ``max_bytes``). Shards are never rewritten on a bucket
   (compaction would download and upload every shard it touches): a shard whose rows all went
   is deleted by the sweep, a shard with some left stays whole.
2. The sweep (:mod:`featbake.upkeep.bucket_sweep`) deletes catalog versions retired for longer
   than the retention period, then shard objects no kept version and no pending fragment
   names, once older than the retention period. Readers hold the version they opened for the
   length of their run; a reader that still finds a shard gone (a run longer than the
   retention period) looks its features up in the newest version (a rebuild may hold them),
   else treats them as misses: encoded live, or an error with ``on_miss="error"``. Nothing
   the newest version names is ever deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

from featbake.errors import ConfigError
from featbake.store.fragments import fragment_shard_names
from featbake.store.layout import Layout
from featbake.store.remote.publish import Change, publish_next
from featbake.store.remote.store import SHARDS, BucketStore, catalog_shards
from featbake.store.remote.versions import PREFIX, version_name
from featbake.upkeep.bucket_sweep import DEFAULT_RETENTION_S, Sweep, kept_versions, sweep
from featbake.upkeep.gc import GcResult, execute_gc
from featbake.upkeep.gc_plan import GcOptions, GcPlan, plan_gc


@dataclass
class BucketGcResult:
    """What gc did to a bucket store: the catalog's part, and the objects swept."""

    catalog: GcResult = field(default_factory=GcResult)
    published: bool = False
    versions_deleted: int = 0
    shards_deleted: int = 0
    bytes_freed: int = 0
    young_shards: int = 0  # unnamed shard objects kept until they pass the retention period

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def gc_bucket(
    target: BucketStore | Layout,
    options: GcOptions | None = None,
    *,
    retention: float = DEFAULT_RETENTION_S,
    now: float | None = None,
    dry_run: bool = False,
) -> BucketGcResult:
    """Run gc on a bucket store (see the module docstring); with ``dry_run``, change nothing.

    Raises:
        StoreError: the bucket cannot be read or written.
    """
    store = target if isinstance(target, BucketStore) else bucket_of(target)
    now = time.time() if now is None else now
    opts = dataclasses.replace(options or GcOptions(), compact_below=0.0, merge_small=False)
    result = BucketGcResult()

    def collect(work: Layout) -> Change[GcPlan]:
        plan = plan_gc(work, opts, now=now)
        if dry_run or plan.nothing_to_do:
            result.catalog = planned_result(plan)  # what the run would do, said by a dry run
            return Change(plan, False)
        result.catalog = execute_gc(plan)
        return Change(plan, True)

    if store.local_version():
        plan = publish_next(store, collect)
        result.published = not dry_run and not plan.nothing_to_do
    planned = plan_sweep(store, now, retention)
    result.young_shards = planned.young_shards
    result.versions_deleted = len(planned.versions)
    result.shards_deleted = len(planned.shards)
    result.bytes_freed = planned.bytes
    if not dry_run:
        store.bucket.delete(o.name for o in (*planned.versions, *planned.shards))
    return result


def bucket_of(layout: Layout) -> BucketStore:
    """The bucket store ``layout`` is the tier of.

    Raises:
        ConfigError: ``layout`` is a local store.
    """
    if not isinstance(layout.remote, BucketStore):
        raise ConfigError(f"{layout.root} is not a bucket store; gc it with plan_gc/execute_gc")
    return layout.remote


def planned_result(plan: GcPlan) -> GcResult:
    """What executing ``plan`` would report (a dry run's numbers are the run's)."""
    s = plan.summary()
    return GcResult(
        roots_dropped=[d.name for d in plan.drop_roots],
        rows_deleted=int(s["unreached_features"]) + int(s["evicted_features"]),
    )


def plan_sweep(store: BucketStore, now: float, retention: float) -> Sweep:
    """The sweep: listings of the bucket, and the shard names of every kept version.

    The order is what makes it safe beside a merge: shards are listed first, then fragments,
    then catalog versions. A shard in the first listing is named by a fragment still pending
    or, once a merge folded that fragment, by a version published before the last listing; a
    shard uploaded after the first listing is not in it, so is never deleted.
    """
    shards = store.bucket.list(SHARDS)
    store.sync_fragments()
    pending = fragment_shard_names(store.layout)
    versions = store.bucket.list(PREFIX)
    keep = kept_versions(versions, now, retention)
    named_by = {n: _shard_names(store, n) for n in keep}
    return sweep(versions, shards, named_by, pending, now, retention)


def _shard_names(store: BucketStore, version: int) -> set[str]:
    """The shard names catalog version ``version`` holds (the tier's copy when it is that one)."""
    if version == store.local_version():
        return set(catalog_shards(store.layout.catalog))
    tmp = store.layout.tmp / f"gc-v{version}.sqlite"
    try:
        store.bucket.download(version_name(version), tmp)
        return set(catalog_shards(tmp))
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
