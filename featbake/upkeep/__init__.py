"""Upkeep of a store: ``featbake stats`` / ``roots``, ``featbake gc``, ``featbake verify``.

The modules, named for the command they serve:

- ``store_stats``: ``stats``, ``list_roots`` and ``drop_root`` (read the catalog's rows, never a
  shard; the catalog is opened read-write so that an older catalog is migrated first).
- ``gc`` (module ``gc``): plan -> commit -> sweep on any place (a directory, a bucket):
  ``plan_gc`` works out what to remove (a frozen :class:`GcPlan`, with the place's sweep),
  ``execute_gc`` commits the catalog's steps through the place (named crash points for the
  crash tests), then sweeps; ``gc`` runs both, as the CLI does.
- ``check`` -> ``repair``: ``scan_store`` finds, ``repair`` fixes, ``verify`` scans and, asked
  to, repairs, reading what the place names (``verify_named``: a bucket's own objects) and
  repairing where the place allows it.
- ``files``: what verify and repair share: quarantine, refusing a folder that is not a store,
  reading root manifests safely (listing a folder safely is ``featbake.store.files``').

A store is a :class:`featbake.store.layout.Layout` throughout; a path given by the caller
becomes one once, at the public function it is given to.

This module only re-exports the public names, so ``from featbake.upkeep import verify`` keeps
working. ``featbake.upkeep.gc``, ``featbake.upkeep.stats`` and ``featbake.upkeep.verify`` are
the functions; the modules ``gc`` and ``repair`` are reached by import statements
(``from featbake.upkeep.gc import GcOptions``).
"""

from __future__ import annotations

from featbake.store.files import LooseFile
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
from featbake.upkeep.gc import (
    CRASH_ENV,
    CRASH_POINTS,
    DEFAULT_COMPACT_BELOW,
    DEFAULT_GRACE_S,
    DEFAULT_RETENTION_S,
    DropReason,
    DropRoot,
    GcOptions,
    GcPlan,
    GcResult,
    execute_gc,
    gc,
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
    "DEFAULT_RETENTION_S",
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
    "gc",
    "list_roots",
    "plan_gc",
    "repair",
    "scan_store",
    "stats",
    "verify",
]
