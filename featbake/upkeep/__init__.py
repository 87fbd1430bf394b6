"""Upkeep of a store: ``featbake stats`` / ``roots``, ``featbake gc``, ``featbake verify``.

The modules, named for the command they serve:

- ``store_stats``: ``stats``, ``list_roots`` and ``drop_root`` (read the catalog's rows, never a
  shard; the catalog is opened read-write so that an older catalog is migrated first).
- ``gc_plan`` -> ``gc``: ``plan_gc`` works out what to remove (a frozen :class:`GcPlan`),
  ``execute_gc`` carries it out step by step, with named crash points for the crash tests.
- ``verify_scan`` (over ``verify_checks``) -> ``verify_repair`` (over ``verify_catalog``):
  ``scan_store`` finds, ``repair`` fixes, ``verify`` scans and, asked to, repairs;
  ``verify_findings`` holds their typed records and states.
- ``gc_bucket`` and ``verify_bucket``: the same commands on a bucket store (``verify`` takes
  either kind of store and checks a bucket's own objects; ``plan_gc`` refuses a bucket URL).
- ``files``: what all three share: listing the store folder safely (regular files only),
  quarantine, refusing a folder that is not a store, reading root manifests safely.

A store is a :class:`featbake.store.layout.Layout` throughout; a path given by the caller
becomes one once, at the public function it is given to.

This module only re-exports the public names, so ``from featbake.upkeep import verify`` keeps
working. (No submodule is named like a function it re-exports: ``featbake.upkeep.stats`` and
``featbake.upkeep.verify`` are the functions, never shadowed modules.)
"""

from __future__ import annotations

from featbake.upkeep.check import (
    VERIFY_CLEAN,
    VERIFY_DAMAGED,
    VERIFY_REPAIRED,
    CatalogHealth,
    CatalogState,
    Finding,
    FindingKind,
    ShardCheck,
    VerifyReport,
    VerifyScan,
    VerifyStatus,
    check_shard,
    scan_store,
)
from featbake.upkeep.files import LooseFile
from featbake.upkeep.gc import (
    CRASH_ENV,
    CRASH_POINTS,
    DEFAULT_COMPACT_BELOW,
    DEFAULT_GRACE_S,
    BucketGcResult,
    DropReason,
    DropRoot,
    GcOptions,
    GcPlan,
    GcResult,
    execute_gc,
    gc_bucket,
    plan_gc,
)
from featbake.upkeep.repair import repair, verify
from featbake.upkeep.store_stats import (
    EncoderStats,
    RootStats,
    StoreStats,
    drop_root,
    list_roots,
    stats,
)

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "DEFAULT_COMPACT_BELOW",
    "DEFAULT_GRACE_S",
    "VERIFY_CLEAN",
    "VERIFY_DAMAGED",
    "VERIFY_REPAIRED",
    "BucketGcResult",
    "CatalogHealth",
    "CatalogState",
    "DropReason",
    "DropRoot",
    "EncoderStats",
    "Finding",
    "FindingKind",
    "GcOptions",
    "GcPlan",
    "GcResult",
    "LooseFile",
    "RootStats",
    "ShardCheck",
    "StoreStats",
    "VerifyReport",
    "VerifyScan",
    "VerifyStatus",
    "check_shard",
    "drop_root",
    "execute_gc",
    "gc_bucket",
    "list_roots",
    "plan_gc",
    "repair",
    "scan_store",
    "stats",
    "verify",
]
