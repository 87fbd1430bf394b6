"""verify, second half: make the catalog agree with the sound shards, quarantining damage.

Order (:func:`repair`), all under the store's exclusive write lock (store/locks.py), so no
writer seals a shard meanwhile; the scan is refreshed under the lock (unchanged files are not
re-read):

0. An intact shard under a wrong name (a swap, a rename cycle, a wrong folder) is renamed back
   to its content name (misnamed.py), and the store scanned again.
1. Intact tensors of a damaged shard are copied into a fresh shard, but only what can be proven:
   a format-2 checksum binds name, dtype, shape and bytes; a format-1 one the bytes only, so
   such a tensor is copied only where the catalog's row confirms its dtype and shape (else an
   edited header would be laundered into a fresh, sound-looking shard). When the fresh shard is
   byte-identical to the damaged file's content name (e.g. zeros appended to an intact shard),
   it now *is* that path: it is kept, never quarantined.
2. The catalog: rows pointing at damaged or missing shards, or naming tensors their shard lacks,
   are deleted; sound shards it lacks and salvaged ones are indexed; root manifests are brought
   in step. A missing or unusable catalog is instead rebuilt (rebuild.py).
3. The hash cache is re-derived, not trusted (``hash_check``): rows whose file hashes to
   something else are dropped and the manifest items keyed from them re-keyed; cached encoder
   fingerprints, which upkeep cannot check, are dropped (also on an otherwise clean store).
   Rows a rebuilt catalog carried over are checked here, as the scan could not.
4. Damaged shard files, things that are not regular files where shards live, and unreadable root
   manifests move to ``quarantine/``.
5. The store is scanned again (unchanged shards are not re-read) to tell "repaired" from
   "damage remains".
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
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog, FeatureRef, ShardRow
from featbake.store.layout import Layout
from featbake.store.locks import exclusive_write_lock
from featbake.store.open import store_layout
from featbake.store.reader import ShardReader
from featbake.store.shard_format import split_tensor_name, tensor_name
from featbake.store.writer import SealedShard, write_shard
from featbake.upkeep.catalog_checks import rows_naming_what_shards_lack, sound_headers
from featbake.upkeep.files import quarantine, require_store
from featbake.upkeep.findings import (
    CatalogState,
    FindingKind,
    RepairOutcome,
    ShardCheck,
    VerifyReport,
    VerifyScan,
    VerifyStatus,
)
from featbake.upkeep.hash_check import check_hash_cache, repair_hash_cache
from featbake.upkeep.misnamed import rename_back
from featbake.upkeep.rebuild import rebuild_catalog, sealed_from_check
from featbake.upkeep.roots_repair import repair_roots
from featbake.upkeep.scan import scan_store
from featbake.upkeep.shard_check import HOSTILE_HEADER_ERRORS

Progress = Callable[[GcProgress], None] | None


class Salvage(NamedTuple):
    """What repair copied out of one damaged shard, and how many tensors it could not prove."""

    shard: SealedShard | None
    unproven: int = 0


#: shard name -> tensor name -> (dtype, shape) as the catalog recorded them when it was sealed.
Vouched = dict[str, dict[str, tuple[str, tuple[int, ...]]]]


def catalog_vouches(layout: Layout, scan: VerifyScan, names: set[str]) -> Vouched:
    """What a usable catalog recorded for the tensors of the shards ``names`` (else nothing).

    A format-1 checksum covers a tensor's bytes only: the catalog's row is then the one record,
    independent of the damaged header, that can prove the tensor's dtype and shape.
    """
    if scan.catalog_state is not CatalogState.OK or not names:
        return {}
    out: Vouched = {}
    unreadable = (StoreError, sqlite3.DatabaseError, ValueError, TypeError, RecursionError)
    with contextlib.suppress(*unreadable), closing(Catalog(layout)) as cat:
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
    layout: Layout, scan: VerifyScan, bad: list[ShardCheck]
) -> tuple[list[SealedShard], RepairOutcome]:
    shards, out = [], RepairOutcome()
    vouched = catalog_vouches(layout, scan, {c.name for c in bad if c.intact})
    for c in bad:
        s = salvage(layout, c, vouched.get(c.name))
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


def _forget_unsound_shards(
    cat: Catalog, rows: dict[str, ShardRow], checks: dict[str, ShardCheck]
) -> RepairOutcome:
    doomed = [s.id for name, s in rows.items() if name not in checks or not checks[name].sound]
    if not doomed:
        return RepairOutcome()
    lost = cat.delete_rows_of_shards(doomed)
    line = f"forgot {len(doomed)} missing or damaged shards ({lost} feature rows)"
    return RepairOutcome([line], lost=lost)


def _delete_wrong_rows(
    cat: Catalog, rows: dict[str, ShardRow], checks: dict[str, ShardCheck]
) -> RepairOutcome:
    out = RepairOutcome()
    by_id = {s.id: s for s in rows.values()}
    wrong = [
        FeatureRef(key, part, sid, nbytes, 0.0)
        for key, part, sid, nbytes in rows_naming_what_shards_lack(
            cat, by_id, sound_headers(checks)
        )
    ]
    if wrong:
        out.lost += cat.delete_features(wrong, only_unreached=False)
        out.actions.append(f"deleted {len(wrong)} rows naming tensors their shard lacks")
    n = cat.delete_dangling_feature_rows()
    if n:
        out.lost += n
        out.actions.append(f"deleted {n} rows naming no shard")
    return out


def _index_shards(
    cat: Catalog,
    rows: dict[str, ShardRow],
    checks: dict[str, ShardCheck],
    salvaged: list[SealedShard],
) -> RepairOutcome:
    """Index sound shards the catalog lacks, and salvaged ones (first row wins)."""
    added = sum(
        cat.add_shard(sealed_from_check(c), now=c.mtime)
        for c in checks.values()
        if c.sound and c.name not in rows
    )
    back = sum(cat.add_shard(s) for s in salvaged)
    if not added + back:
        return RepairOutcome()
    line = f"indexed {added + back} feature rows from shards the catalog lacked"
    return RepairOutcome([line], recovered=back)


def repair_catalog(layout: Layout, scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Bring a usable catalog in step with the shards found and the root manifests."""
    with closing(Catalog(layout)) as cat:
        rows = {s.name: s for s in cat.shard_rows()}
        checks = {c.name: c for c in scan.shards}
        return (
            _forget_unsound_shards(cat, rows, checks)
            + _delete_wrong_rows(cat, rows, checks)
            + _index_shards(cat, rows, checks, salvaged)
            + repair_roots(layout, cat)
        )


def _quarantine_unreadable(layout: Layout, scan: VerifyScan) -> RepairOutcome:
    """Move aside what is not a shard or manifest at all, before the catalog is repaired (which
    then rewrites a lost manifest from the catalog at that very path)."""
    out = RepairOutcome()
    for f in [*scan.of_kind(FindingKind.NOT_A_FILE), *scan.of_kind(FindingKind.ROOT_FILE_CORRUPT)]:
        if os.path.lexists(f.subject):
            dest = quarantine(layout, Path(f.subject))
            out.actions.append(f"quarantined {f.subject} -> {dest}")
    return out


def _quarantine_damage(
    layout: Layout, scan: VerifyScan, salvaged: list[SealedShard]
) -> RepairOutcome:
    out = RepairOutcome()
    rewritten = {str(layout.shard_path(s.name)) for s in salvaged}
    for c in scan.shards:
        if c.sound:
            continue
        if c.path in rewritten:
            # Salvage wrote the intact content to this very path (os.replace): it is sound now.
            out.actions.append(f"rewrote {c.name} in place from its intact tensors")
            continue
        dest = quarantine(layout, Path(c.path))
        out.actions.append(f"quarantined {c.name} ({c.problem}) -> {dest}")
    return out


def repair_locked(scan: VerifyScan, progress: Progress = None) -> VerifyReport:
    """Repair, the caller holding the exclusive write lock and ``scan`` made under it."""
    t0 = time.perf_counter()
    layout = Layout(Path(scan.store))
    report = VerifyReport(
        scan.store, VerifyStatus.CLEAN, len(scan.shards), scan.bytes_checked, list(scan.findings)
    )
    if not scan.damaged:
        if scan.catalog_state is CatalogState.OK:  # what verify cannot check is not kept
            with closing(Catalog(layout)) as cat:
                report.actions = repair_hash_cache(layout, cat, ()).actions
        report.seconds = time.perf_counter() - t0
        return report
    layout.ensure()
    renamed = rename_back(layout, scan)
    if renamed.actions:  # those files are sound now, under their names: look at them again
        sound = {c.path: c for c in scan.shards if c.sound}
        scan = scan_store(layout.root, progress, reuse=sound)
    salvaged, done = _salvage_all(layout, scan, [c for c in scan.shards if not c.sound])
    done = renamed + done + _quarantine_unreadable(layout, scan)
    if scan.catalog_state is not CatalogState.OK:
        done += rebuild_catalog(layout, scan, salvaged)
        wrong = check_hash_cache(layout, progress).wrong  # rows the old catalog carried over
    else:
        done += repair_catalog(layout, scan, salvaged)
        wrong = scan.wrong_hashes
    with closing(Catalog(layout)) as cat:
        done += repair_hash_cache(layout, cat, wrong)
    done += _quarantine_damage(layout, scan, salvaged)
    sound = {c.path: c for c in scan.shards if c.sound}
    again = scan_store(layout.root, progress, reuse=sound, check_hashes=False)
    report.actions = done.actions
    report.features_lost = max(0, done.lost - done.recovered)
    report.features_salvaged = done.salvaged
    report.remaining = [f for f in again.findings if f.damage]
    report.status = VerifyStatus.DAMAGED if report.remaining else VerifyStatus.REPAIRED
    report.seconds = time.perf_counter() - t0
    return report


def repair(scan: VerifyScan, progress: Progress = None) -> VerifyReport:
    """Fix what ``scan`` found: the store's lock taken, the scan refreshed under it (files
    unchanged since are not read again), then the steps of the module docstring."""
    reuse = {c.path: c for c in scan.shards}
    return _repair_under_lock(Layout(Path(scan.store)), progress, reuse)


def _repair_under_lock(
    layout: Layout, progress: Progress, reuse: dict[str, ShardCheck] | None = None
) -> VerifyReport:
    with exclusive_write_lock(layout):
        return repair_locked(scan_store(layout.root, progress, reuse=reuse), progress)


def verify(
    cache: str | os.PathLike[str] | None = None,
    *,
    repair_damage: bool = False,
    progress: Progress = None,
) -> VerifyReport:
    """Check a store (and with ``repair_damage`` fix it); ``report.exit_code`` is 0, 10 or 11.

    Raises:
        StoreError: no store there, a folder that is not a store, or (with ``repair_damage``) a
            writer keeps sealing shards into it.

    Example:
        >>> report = verify(".featbake", repair_damage=True)  # doctest: +SKIP
        >>> report.status  # "clean", "repaired" or "damaged"  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    if repair_damage:
        layout = store_layout(cache)
        require_store(layout)
        return _repair_under_lock(layout, progress)
    scan = scan_store(cache, progress)
    report = VerifyReport(
        scan.store,
        VerifyStatus.DAMAGED if scan.damaged else VerifyStatus.CLEAN,
        len(scan.shards),
        scan.bytes_checked,
        list(scan.findings),
        remaining=[f for f in scan.findings if f.damage],
    )
    report.seconds = time.perf_counter() - t0
    return report
