"""``featbake verify``, second half: make the catalog agree with the sound shards, quarantining
damage; and :func:`verify` itself (a scan, and with ``repair_damage`` a repair).

Order (:func:`repair`), all under the store's exclusive write lock (store/locks.py), so no
writer seals a shard meanwhile; the scan is refreshed under the lock (unchanged files are not
re-read):

0. An intact shard under a wrong name is renamed back to its content name (below), and the store
   scanned again.
1. Intact tensors of a damaged shard are copied into a fresh shard, but only what can be proven:
   a format-2 checksum binds name, dtype, shape and bytes; a format-1 one the bytes only, so
   such a tensor is copied only where the catalog's row confirms its dtype and shape (else an
   edited header would be laundered into a fresh, sound-looking shard). When the fresh shard is
   byte-identical to the damaged file's content name (e.g. zeros appended to an intact shard),
   it now *is* that path: it is kept, never quarantined.
2. The catalog: rows pointing at damaged or missing shards, or naming tensors their shard lacks,
   are deleted; sound shards it lacks and salvaged ones are indexed; root manifests are brought
   in step. A missing or unusable catalog is instead rebuilt (verify_catalog.py).
3. The hash cache is re-derived, not trusted: rows whose file hashes to something else are
   dropped and the manifest items keyed from them re-keyed; cached encoder fingerprints, which
   upkeep cannot check, are dropped (also on an otherwise clean store). Rows a rebuilt catalog
   carried over are checked here, as the scan could not.
4. Damaged shard files, things that are not regular files where shards live, and unreadable root
   manifests move to ``quarantine/``.
5. The store is scanned again (unchanged shards are not re-read) to tell "repaired" from
   "damage remains".

Step 0, why: a shard's name is the SHA-256 of its bytes, so a file whose every tensor is intact
but whose name is not its digest was renamed, not damaged: two shard files whose names were
swapped, a rename cycle, a copy under a name nobody uses, or a file moved into the wrong folder.
Treated like damage (salvaged into a fresh shard, the file quarantined), the first fresh shard of
a swap landed on the path of the other file, not salvaged yet, and that file's features were
lost. A file is renamed only when its true name is wanted: the catalog names that shard, or
another shard file sits under that name (a swap or cycle). Anything else (zeros appended to a
shard, say, whose digest names no shard) keeps the salvage path, which rewrites the clean shard.
Renames go through a staging name beside the destination, so a cycle never overwrites a file
that is still to be moved; a crash between the two steps leaves the staged file for the next
``verify --repair`` to report and quarantine, never to delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import NamedTuple

from featbake.errors import StoreCorrupt, StoreError
from featbake.keys import sha256_file
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.locks import exclusive_write_lock
from featbake.store.open import StoreRef
from featbake.store.reader import ShardReader
from featbake.store.shard_format import split_tensor_name, tensor_name
from featbake.store.writer import SealedShard, write_shard
from featbake.upkeep.files import existing_store, quarantine
from featbake.upkeep.verify_bucket import refuse_bucket_repair, verify_bucket
from featbake.upkeep.verify_catalog import rebuild_catalog, repair_catalog, repair_hash_cache
from featbake.upkeep.verify_checks import HOSTILE_HEADER_ERRORS
from featbake.upkeep.verify_findings import (
    CatalogState,
    FindingKind,
    RepairOutcome,
    ShardCheck,
    VerifyReport,
    VerifyScan,
    VerifyStatus,
)
from featbake.upkeep.verify_scan import check_hash_cache, scan_store

Progress = Callable[[GcProgress], None] | None

STAGING_SUFFIX = ".renaming"


def verify(
    cache: StoreRef = None,
    *,
    repair_damage: bool = False,
    progress: Progress = None,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
) -> VerifyReport:
    """Check a store (and with ``repair_damage`` fix it); ``report.exit_code`` is 0, 10 or 11.

    A bucket store (``s3://...``) is checked object by object, from any node, whatever this
    node's tier holds (:mod:`featbake.upkeep.verify_bucket`); it is never repaired.

    Raises:
        ConfigError: ``repair_damage`` on a bucket store.
        StoreError: no store there, a folder that is not a store, or (with ``repair_damage``) a
            writer keeps sealing shards into it.

    Example:
        >>> report = verify(".featbake", repair_damage=True)  # doctest: +SKIP
        >>> report.status  # "clean", "repaired" or "damaged"  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    layout = existing_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    if layout.remote is not None:
        if repair_damage:
            refuse_bucket_repair(layout)
        return verify_bucket(layout, progress)
    if repair_damage:
        return repair(layout, progress)
    scan = scan_store(layout, progress)
    report = VerifyReport(
        str(layout.root),
        VerifyStatus.DAMAGED if scan.damaged else VerifyStatus.CLEAN,
        len(scan.shards),
        scan.bytes_checked,
        list(scan.findings),
        remaining=[f for f in scan.findings if f.damage],
    )
    report.seconds = time.perf_counter() - t0
    return report


def repair(scan: VerifyScan | Layout, progress: Progress = None) -> VerifyReport:
    """Fix what a scan finds: the steps of the module docstring, in order.

    Args:
        scan: a scan already made (its files unchanged since are not read again), or the
            store's layout. Either way the store is scanned again under the lock.
        progress: called with ``GcProgress`` of each phase.

    Raises:
        StoreError: a writer keeps sealing shards into the store (the lock is refused).
    """
    layout = scan.layout if isinstance(scan, VerifyScan) else scan
    reuse = {c.path: c for c in scan.shards} if isinstance(scan, VerifyScan) else {}
    with exclusive_write_lock(layout):
        return repair_locked(scan_store(layout, progress, reuse=reuse), progress)


def repair_locked(scan: VerifyScan, progress: Progress = None) -> VerifyReport:
    """Repair, the caller holding the exclusive write lock and ``scan`` made under it."""
    t0 = time.perf_counter()
    layout = scan.layout
    report = VerifyReport(
        str(layout.root),
        VerifyStatus.CLEAN,
        len(scan.shards),
        scan.bytes_checked,
        list(scan.findings),
    )
    if not scan.damaged:
        if scan.catalog.state is CatalogState.OK:  # what verify cannot check is not kept
            with closing(Catalog(layout)) as cat:
                report.actions = repair_hash_cache(layout, cat, ()).actions
        report.seconds = time.perf_counter() - t0
        return report
    layout.ensure()
    renamed = rename_back(scan)
    if renamed.actions:  # those files are sound now, under their names: look at them again
        sound = {c.path: c for c in scan.shards if c.sound}
        scan = scan_store(layout, progress, reuse=sound)
    salvaged, done = _salvage_all(scan, [c for c in scan.shards if not c.sound])
    done = renamed + done + _quarantine_unreadable(scan)
    if scan.catalog.state is not CatalogState.OK:
        done += rebuild_catalog(scan, salvaged)
        wrong = check_hash_cache(layout, progress).wrong  # rows the old catalog carried over
    else:
        done += repair_catalog(scan, salvaged)
        wrong = scan.wrong_hashes
    with closing(Catalog(layout)) as cat:
        done += repair_hash_cache(layout, cat, wrong)
    done += _quarantine_damage(scan, salvaged)
    sound = {c.path: c for c in scan.shards if c.sound}
    again = scan_store(layout, progress, reuse=sound, check_hashes=False)
    report.actions = done.actions
    report.features_lost = max(0, done.lost - done.recovered)
    report.features_salvaged = done.salvaged
    report.remaining = [f for f in again.findings if f.damage]
    report.status = VerifyStatus.DAMAGED if report.remaining else VerifyStatus.REPAIRED
    report.seconds = time.perf_counter() - t0
    return report


# -- 0: intact shards under wrong names renamed back -------------------------------------------
def wanted_names(scan: VerifyScan) -> set[str]:
    """Shard names someone expects to find: the catalog's shard rows and every file's name."""
    names = {c.name for c in scan.shards}
    if scan.catalog.state is CatalogState.OK:
        try:
            with closing(Catalog(scan.layout, read_only=True)) as cat:
                names.update(s.name for s in cat.shard_rows())
        except (StoreError, sqlite3.Error):
            pass  # an unreadable catalog: the files' own names still tell swaps and cycles
    return names


def misnamed_intact(scan: VerifyScan) -> list[ShardCheck]:
    """Checks whose only fault is the file's name or folder, and whose true name is wanted."""
    wanted = wanted_names(scan)
    return [
        c
        for c in scan.shards
        if not c.sound
        and c.digest
        and not c.failed
        and c.entries
        and c.digest in wanted
        and c.path != scan.layout.shard_path(c.digest)
    ]


def rename_back(scan: VerifyScan) -> RepairOutcome:
    """Give every misnamed intact shard its content name; what was done, as repair actions."""
    layout, checks = scan.layout, misnamed_intact(scan)
    staged: list[tuple[ShardCheck, Path]] = []
    for c in checks:  # first every file out of the way, so a cycle overwrites nothing
        dest = layout.shard_path(c.digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = dest.with_name(f".{dest.name}.{os.getpid()}.{len(staged)}{STAGING_SUFFIX}")
        os.replace(c.path, stage)
        staged.append((c, stage))
    out = RepairOutcome()
    for c, stage in staged:
        dest = layout.shard_path(c.digest)
        if _holds(dest, c.digest):
            os.unlink(stage)  # the same bytes are already there under their name
            out.actions.append(f"removed {c.path}: a second copy of shard {c.digest}")
            continue
        if os.path.lexists(dest):
            moved = quarantine(layout, dest)
            out.actions.append(f"quarantined {dest} (not the bytes its name promises) -> {moved}")
        os.replace(stage, dest)
        out.actions.append(f"renamed {c.path} back to its content name {c.digest}")
    return out


def _holds(path: Path, digest: str) -> bool:
    """Whether ``path`` is a regular file whose bytes hash to ``digest``."""
    try:
        return path.is_file() and not path.is_symlink() and sha256_file(path) == digest
    except OSError:
        return False


# -- 1: intact tensors of damaged shards salvaged -----------------------------------------------
class Salvage(NamedTuple):
    """What repair copied out of one damaged shard, and how many tensors it could not prove."""

    shard: SealedShard | None
    unproven: int = 0


#: shard name -> tensor name -> (dtype, shape) as the catalog recorded them when it was sealed.
Vouched = dict[str, dict[str, tuple[str, tuple[int, ...]]]]


def catalog_vouches(scan: VerifyScan, names: set[str]) -> Vouched:
    """What a usable catalog recorded for the tensors of the shards ``names`` (else nothing).

    A format-1 checksum covers a tensor's bytes only: the catalog's row is then the one record,
    independent of the damaged header, that can prove the tensor's dtype and shape.
    """
    if scan.catalog.state is not CatalogState.OK or not names:
        return {}
    out: Vouched = {}
    unreadable = (StoreError, sqlite3.DatabaseError, ValueError, TypeError, RecursionError)
    with contextlib.suppress(*unreadable), closing(Catalog(scan.layout)) as cat:
        for row in cat.shard_rows():
            if row.name in names:
                out[row.name] = {
                    tensor_name(f.key, f.part): (f.dtype, tuple(json.loads(f.shape)))
                    for f in cat.features_of_shard(row.id)
                }
    return out


def _provable(reader: ShardReader, tensors: list[str], vouched: dict) -> list[str]:
    """The tensors whose passing checksum proves what they are (name, dtype, shape)."""
    if reader.checksums_bind_header:
        return tensors
    return [
        t
        for t in tensors
        if vouched.get(t) == (reader.tensors[t].dtype, tuple(reader.tensors[t].shape))
    ]


def salvage(layout: Layout, c: ShardCheck, vouched: dict | None = None) -> Salvage:
    """Copy the tensors of a damaged shard that pass their checksum into a fresh shard.

    A key is kept only whole: serving some outputs of a multi-output feature would be wrong.
    Nothing is copied that cannot be proven: a format-1 tensor (bytes-only checksum) only where
    ``vouched`` (the catalog's record, see :func:`catalog_vouches`) gives its dtype and shape.
    """
    if not c.intact or not c.encoder_fp:
        return Salvage(None)
    tensors = {}
    try:
        with ShardReader(c.path, verify="always") as reader:
            proven = _provable(reader, list(c.intact), vouched or {})
            for t in proven:
                with contextlib.suppress(StoreCorrupt):
                    tensors[t] = reader.read(t)
    except (StoreError, OSError, *HOSTILE_HEADER_ERRORS):
        return Salvage(None)  # changed since the scan: nothing provable to copy
    unproven = len(c.intact) - len(proven)
    broken = {split_tensor_name(t)[0] for t in (*c.failed, *(set(c.intact) - set(tensors)))}
    tensors = {t: v for t, v in tensors.items() if split_tensor_name(t)[0] not in broken}
    if not tensors:
        return Salvage(None, unproven)
    return Salvage(write_shard(layout, tensors, c.encoder_fp, c.recipe_fp), unproven)


def _salvage_all(
    scan: VerifyScan, bad: list[ShardCheck]
) -> tuple[list[SealedShard], RepairOutcome]:
    """The fresh shards salvage wrote from the damaged shards ``bad``, and what it did."""
    shards, out = [], RepairOutcome()
    vouched = catalog_vouches(scan, {c.name for c in bad if c.intact})
    for c in bad:
        s = salvage(scan.layout, c, vouched.get(c.name))
        if s.unproven:
            out.actions.append(
                f"did not salvage {s.unproven} tensors of {c.name}: its format-1 checksums cover "
                "the bytes only, and the catalog cannot prove their dtype and shape"
            )
        if s.shard is not None:
            shards.append(s.shard)
            out.salvaged += len({e.key for e in s.shard.entries})
            out.actions.append(f"salvaged {len(s.shard.entries)} intact tensors of {c.name}")
    return shards, out


# -- 4: quarantine -----------------------------------------------------------------------------
def _quarantine_unreadable(scan: VerifyScan) -> RepairOutcome:
    """Move aside what is not a shard or manifest at all, before the catalog is repaired (which
    then rewrites a lost manifest from the catalog at that very path)."""
    out = RepairOutcome()
    for f in [*scan.of_kind(FindingKind.NOT_A_FILE), *scan.of_kind(FindingKind.ROOT_FILE_CORRUPT)]:
        if os.path.lexists(f.subject):
            dest = quarantine(scan.layout, Path(f.subject))
            out.actions.append(f"quarantined {f.subject} -> {dest}")
    return out


def _quarantine_damage(scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Move every damaged shard file to ``quarantine/``, unless salvage rewrote it in place."""
    layout, out = scan.layout, RepairOutcome()
    rewritten = {layout.shard_path(s.name) for s in salvaged}
    for c in scan.shards:
        if c.sound:
            continue
        if c.path in rewritten:
            # Salvage wrote the intact content to this very path (os.replace): it is sound now.
            out.actions.append(f"rewrote {c.name} in place from its intact tensors")
            continue
        dest = quarantine(layout, c.path)
        out.actions.append(f"quarantined {c.name} ({c.problem}) -> {dest}")
    return out
