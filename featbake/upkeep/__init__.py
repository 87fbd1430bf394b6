"""Upkeep of a store: stats and roots, gc (plan, then execute), verify (scan, then repair).

The parts, each a module here:

- ``store_stats``: ``featbake stats`` and ``featbake roots`` (read the catalog's rows, never a
  shard; the catalog is opened read-write so that an older catalog is migrated first).
- ``gc_plan`` / ``gc_execute``: ``plan_gc`` works out what to remove, ``execute_gc`` does it.
- ``scan`` (with ``shard_check`` and ``catalog_checks``) / ``verify_repair`` (with ``rebuild``
  and ``roots_repair``): ``scan_store`` finds, ``repair`` fixes, ``verify`` does
  both; ``findings`` holds their typed records and states.
- ``files``, ``manifests``, ``crash``: listing the store folder safely (regular files only),
  reading root manifests safely, and the kill points the crash tests use.

This module only re-exports the public names, so ``from featbake.upkeep import verify`` keeps
working. (No submodule is named like a function it re-exports: ``featbake.upkeep.stats`` and
``featbake.upkeep.verify`` are the functions, never shadowed modules.)
"""

from __future__ import annotations

from featbake.upkeep.crash import CRASH_ENV, CRASH_POINTS
from featbake.upkeep.files import LooseFile
from featbake.upkeep.findings import (
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
)
from featbake.upkeep.gc_execute import GcResult, execute_gc
from featbake.upkeep.gc_plan import (
    DEFAULT_COMPACT_BELOW,
    DEFAULT_GRACE_S,
    DropReason,
    DropRoot,
    GcOptions,
    GcPlan,
    plan_gc,
)
from featbake.upkeep.scan import scan_store
from featbake.upkeep.shard_check import check_shard
from featbake.upkeep.store_stats import (
    EncoderStats,
    RootStats,
    StoreStats,
    drop_root,
    list_roots,
    stats,
)
from featbake.upkeep.verify_repair import repair, verify

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "DEFAULT_COMPACT_BELOW",
    "DEFAULT_GRACE_S",
    "VERIFY_CLEAN",
    "VERIFY_DAMAGED",
    "VERIFY_REPAIRED",
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
    "list_roots",
    "plan_gc",
    "repair",
    "scan_store",
    "stats",
    "verify",
]
