"""``featbake verify --repair``: the catalog brought in step with the shards, or rebuilt.

A usable catalog is repaired (:func:`repair_catalog`): rows pointing at damaged or missing shards,
or naming tensors their shard lacks, are deleted; sound shards it lacks and salvaged ones are
indexed; root manifest files and catalog roots are brought in step both ways. A missing or
unusable catalog is rebuilt (:func:`rebuild_catalog`) from the shard headers and
``roots/*.json``; whatever the old catalog still yields (hash cache, last-use times, encoder
labels, roots whose manifest file is gone) is carried over, and its files move to
``quarantine/``. Either way the hash cache is then re-derived (:func:`repair_hash_cache`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.keys import feature_key, sha256_file
from featbake.progress import GcProgress
from featbake.store.byteplace import bytes_at
from featbake.store.catalog import Catalog, FeatureRef, ShardRow, damaged_file
from featbake.store.files import fsync_dir, remove_file
from featbake.store.hash_cache import ENCODER_FP_PREFIX
from featbake.store.layout import Layout
from featbake.store.locks import exclusive_write_lock
from featbake.store.old_catalog import OldCatalog, read_old_catalog
from featbake.store.open import StoreRef, place_of, refuse_lost_catalog
from featbake.store.place import VerifyScope
from featbake.store.roots import root_file, roots_dir, tombstone_file, write_root_file
from featbake.store.shard import (
    SealedShard,
    ShardReader,
    split_tensor_name,
    tensor_name,
    write_shard,
)
from featbake.upkeep.check import (
    HOSTILE_HEADER_ERRORS,
    CatalogState,
    FindingKind,
    HashMismatch,
    RepairOutcome,
    ShardCheck,
    VerifyReport,
    VerifyScan,
    VerifyStatus,
    check_hash_cache,
    rows_naming_what_shards_lack,
    scan_store,
    sound_headers,
    verify_named,
)
from featbake.upkeep.files import (
    CATALOG_SUFFIXES,
    ensure_quarantine,
    existing_store,
    moving_aside,
    quarantine,
    read_manifest,
    rebuild_pending,
)

if TYPE_CHECKING:
    import torch


# == verify_catalog ================================================================================
# -- a usable catalog, repaired -----------------------------------------------------------------
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
) -> tuple[RepairOutcome, set[str]]:
    """Delete the rows naming tensors their shard lacks (or has with another dtype or shape)
    and the rows naming no shard; what was done, and the keys of the deleted rows."""
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
    return out, {ref.key for ref in wrong}


def _index_shards(
    cat: Catalog,
    rows: dict[str, ShardRow],
    checks: dict[str, ShardCheck],
    salvaged: list[SealedShard],
    deleted: set[str],
) -> RepairOutcome:
    """Index sound shards the catalog lacks, and salvaged ones (first row wins); and index
    again the sound shards it lists whose headers hold a key of a row just deleted
    (``deleted``: one row's ``shape``, ``dtype`` or shard edited), so a feature a sound shard
    holds is not lost for want of a right row (the rows it has stay: insert or ignore)."""
    added = sum(
        cat.add_shard(sealed_from_check(c), now=c.mtime)
        for c in checks.values()
        if c.sound and c.name not in rows
    )
    again = sum(
        cat.add_shard(sealed_from_check(c), now=c.mtime)
        for c in checks.values()
        if c.sound and c.name in rows and any(e.key in deleted for e in c.entries)
    )
    back = sum(cat.add_shard(s) for s in salvaged)
    lines = []
    if added + back:
        lines.append(f"indexed {added + back} feature rows from shards the catalog lacked")
    if again:
        lines.append(f"indexed again {again} feature rows the deleted rows named wrongly")
    return RepairOutcome(lines, recovered=back + again)


def repair_catalog(scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Bring a usable catalog in step with the shards found and the root manifests."""
    layout = scan.layout
    with closing(Catalog(layout)) as cat:
        rows = {s.name: s for s in cat.shard_rows()}
        checks = {c.name: c for c in scan.shards}
        forgot = _forget_unsound_shards(cat, rows, checks)
        wrong, deleted = _delete_wrong_rows(cat, rows, checks)
        return (
            forgot
            + wrong
            + _index_shards(cat, rows, checks, salvaged, deleted)
            + repair_roots(layout, cat)
        )


def _rewrite_stale_manifests(layout: Layout, cat: Catalog) -> tuple[set[str], RepairOutcome]:
    """Rewrite each root's manifest file that differs from its catalog rows."""
    out, names = RepairOutcome(), set()
    for r in cat.roots():
        names.add(r.name)
        f, t = root_file(layout, r.name), tombstone_file(layout, r.name)
        items = [tuple(x) for x in cat.root_items(r.name)]
        if not f.exists() and t.exists():
            continue  # an interrupted drop: gc finishes it
        try:
            same = f.exists() and read_manifest(f)[1] == items
        except StoreCorrupt:
            same = False
        if not same:
            write_root_file(layout, r, items)  # type: ignore[arg-type]
            out.actions.append(f"rewrote the manifest file of root {r.name} from the catalog")
    return names, out


def repair_roots(layout: Layout, cat: Catalog) -> RepairOutcome:
    """Rewrite manifest files that differ from the catalog; restore roots only files name.

    The comparison runs inside a write transaction: a build publishes a root (rows, and the
    file written before its COMMIT) under the same lock, so repair never sees the new file with
    the old rows and "repairs" the file back to the old manifest.
    """
    with cat.transaction():
        names, out = _rewrite_stale_manifests(layout, cat)
    for p in sorted(roots_dir(layout).glob("*.json")):
        if p.stem in names:
            continue
        try:
            root, items = read_manifest(p)
        except StoreCorrupt:
            continue  # quarantined by the caller
        cat.insert_root(root, items)
        out.actions.append(f"restored root {root.name} from its manifest file")
    return out


# -- a missing or unusable catalog, rebuilt ------------------------------------------------------
def sealed_from_check(c: ShardCheck) -> SealedShard:
    """A sound shard found on disk, as the catalog records a freshly sealed one."""
    return SealedShard(c.name, c.path, c.bytes, c.encoder_fp, c.recipe_fp, c.entries)


def _set_aside_old_catalog(layout: Layout) -> OldCatalog:
    """What the old catalog still yields, its files set aside in :func:`rebuild_pending` until
    the new one is whole (:func:`_retire_old_catalog`); the store's path is then free.

    A rebuild killed before is finished with what it set aside: one killed while it moved the
    old files moves the rest (no new catalog was begun); one killed after leaves its partial
    catalog at the store's path, which goes.
    """
    pending, moving = rebuild_pending(layout), moving_aside(layout)
    if pending.is_dir():
        _remove_catalog(layout.catalog)
    else:
        fresh = not moving.is_dir()
        moving.mkdir(exist_ok=True)
        old = read_old_catalog(layout.catalog) if fresh and layout.catalog.is_file() else None
        for suffix in CATALOG_SUFFIXES:  # the database first: alone, its WAL is not opened
            p = Path(f"{layout.catalog}{suffix}")
            if p.exists() or p.is_symlink():
                os.replace(p, moving / p.name)
        fsync_dir(moving)
        os.replace(moving, pending)
        fsync_dir(layout.root)
        if old is not None:
            return old
    db = pending / layout.catalog.name
    return read_old_catalog(db) if db.is_file() else OldCatalog()


def _remove_catalog(path: Path) -> None:
    for suffix in CATALOG_SUFFIXES:
        remove_file(Path(f"{path}{suffix}"))


def _retire_old_catalog(layout: Layout) -> RepairOutcome:
    """The new catalog is whole: the folder of the old one's files moves into ``quarantine/``
    in one rename (until then, a rebuild is pending)."""
    pending = rebuild_pending(layout)
    names = sorted(p.name for p in pending.iterdir())
    if not names:  # there was no old catalog to keep
        pending.rmdir()
        return RepairOutcome()
    dest = quarantine(layout, pending, "catalog")
    fsync_dir(layout.root)
    return RepairOutcome([f"moved the old catalog file {n} to {dest / n}" for n in names])


def _restore_roots(layout: Layout, cat: Catalog, old: OldCatalog) -> set[str]:
    """Roots from their manifest files, then those only the old catalog still knew."""
    restored = set()
    for p in sorted(roots_dir(layout).glob("*.json")):
        try:
            root, items = read_manifest(p)
        except StoreCorrupt:
            continue  # quarantined by repair
        cat.insert_root(root, items)
        restored.add(root.name)
    for root, items in old.roots:
        if root.name not in restored and not tombstone_file(layout, root.name).exists():
            cat.insert_root(root, items)
            write_root_file(layout, root, items)
            restored.add(root.name)
    for p in roots_dir(layout).glob("*.dropped"):
        if p.name.removesuffix(".dropped") not in restored:
            remove_file(p)
    return restored


def _restore_encoders(cat: Catalog, scan: VerifyScan, old: OldCatalog) -> None:
    for e in old.encoders:
        cat.put_encoder_row(e.fp, e.label, e.kind, e.first_seen, e.last_used)
    for r in cat.roots():
        cat.put_encoder_row(r.encoder_fp, r.encoder_label, "unknown", r.created, r.last_used)
    for c in scan.shards:
        if c.sound:
            cat.put_encoder_row(c.encoder_fp, "(unknown: rebuilt)", "unknown", c.mtime, c.mtime)


def rebuild_catalog(scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Replace the catalog with one built from the sound shards, salvaged ones and manifests."""
    layout = scan.layout
    old, out = _set_aside_old_catalog(layout), RepairOutcome()
    cat = Catalog(layout, rebuild=True)  # a new catalog beside the surviving root manifests
    try:
        rows = sum(cat.add_shard(sealed_from_check(c), now=c.mtime) for c in scan.shards if c.sound)
        rows += sum(cat.add_shard(s) for s in salvaged)
        out.actions.append(f"rebuilt the catalog: {rows} feature rows from the shard headers")
        if old.last_used:
            cat.set_last_used(old.last_used)
        if old.hash_rows:
            cat.restore_hashes(old.hash_rows)
        restored = _restore_roots(layout, cat, old)
        if restored:
            out.actions.append(f"restored {len(restored)} roots from their manifest files")
        _restore_encoders(cat, scan, old)
    finally:
        cat.close()
    return out + _retire_old_catalog(layout)


# -- the hash cache, re-derived -----------------------------------------------------------------
#: (a root's data, its source kind, the hash cache, row id -> its right digest, the folder the
#: data's relative paths were taken from: the root's ``workdir``) -> item id -> (its digest
#: now, its right digest): how a manifest's, tar's or table's items come by their digests,
#: which upkeep cannot read (it imports no encode code); the CLI passes
#: :func:`featbake.encode.inputs.redigested`.
Redigest = Callable[[str, str, Catalog, Mapping[str, str], str], Mapping[str, tuple[str, str]]]


def _rekey_manifests(
    layout: Layout,
    cat: Catalog,
    wrong: tuple[HashMismatch, ...],
    redigest: Redigest | None = None,
) -> int:
    """Re-key root items keyed from a wrong digest (file unchanged since: provably wrong): a
    folder's item by its file's row, any other local data's through ``redigest``."""
    by_path = {m.path: m for m in wrong}
    actual = {m.path: m.actual for m in wrong}
    changed = 0
    for root in cat.roots():
        items = [tuple(x) for x in cat.root_items(root.name)]
        source = str(root.recipe.get("source", "audio"))
        local = not bytes_at(root.data).remote  # a bucket's objects: each would be downloaded
        digests = (
            redigest(root.data, source, cat, actual, root.workdir) if redigest and local else {}
        )
        new = []
        for rel, key in items:
            m = by_path.get(os.path.join(root.data, rel))
            was, right = (m.recorded, m.actual) if m else digests.get(rel, ("", ""))
            if was and key == feature_key(root.encoder_fp, root.recipe_fp, was):
                key = feature_key(root.encoder_fp, root.recipe_fp, right)
                changed += 1
            new.append((rel, key))
        if new != items:
            cat.insert_root(root, new)
            write_root_file(layout, root, new)
    return changed


def repair_hash_cache(
    layout: Layout,
    cat: Catalog,
    wrong: tuple[HashMismatch, ...],
    redigest: Redigest | None = None,
) -> RepairOutcome:
    """Drop wrong rows (re-keying the manifests built from them, see :data:`Redigest`) and every
    cached encoder fingerprint (which upkeep cannot check)."""
    out = RepairOutcome()
    if wrong:
        rekeyed = _rekey_manifests(layout, cat, wrong, redigest)
        cat.delete_hash_rows([(m.path, m.recorded) for m in wrong])
        out.actions.append(
            f"dropped {len(wrong)} wrong hash-cache rows (each file is hashed again on next use)"
        )
        if rekeyed:
            out.actions.append(f"re-keyed {rekeyed} manifest items built from those rows")
    dropped = cat.drop_hash_rows_with_prefix(ENCODER_FP_PREFIX)
    if dropped:
        out.actions.append(
            f"dropped {dropped} cached encoder fingerprints (verify cannot check them without "
            "loading the encoders; each is computed again on next use)"
        )
    return out


# == verify_repair =================================================================================
# ``featbake verify``, second half: make the catalog agree with the sound shards, quarantining
# damage; and :func:`verify` itself (a scan, and with ``repair_damage`` a repair).
#
# Order (:func:`repair`), all under the store's exclusive write lock (store/layout.py), so no
# writer seals a shard meanwhile; the scan is refreshed under the lock (unchanged files are not
# re-read):
#
# 0. An intact shard under a wrong name is renamed back to its content name (below), and the store
#    scanned again.
# 1. Intact tensors of a damaged shard are copied into a fresh shard, but only what can be proven:
#    a format-2 checksum binds name, dtype, shape and bytes; a format-1 one the bytes only, so
#    such a tensor is copied only where the catalog's row confirms its dtype and shape (else an
#    edited header would be laundered into a fresh, sound-looking shard). When the fresh shard is
#    byte-identical to the damaged file's content name (e.g. zeros appended to an intact shard),
#    it now *is* that path: it is kept, never quarantined.
# 2. The catalog: rows pointing at damaged or missing shards, or naming tensors their shard lacks,
#    are deleted; sound shards it lacks and salvaged ones are indexed; root manifests are brought
#    in step. A missing or unusable catalog is instead rebuilt (verify_catalog.py).
# 3. The hash cache is re-derived, not trusted: rows whose file hashes to something else are
#    dropped and the manifest items keyed from them re-keyed; cached encoder fingerprints, which
#    upkeep cannot check, are dropped (also on an otherwise clean store). Rows a rebuilt catalog
#    carried over are checked here, as the scan could not.
# 4. Damaged shard files, things that are not regular files where shards live, and unreadable root
#    manifests move to ``quarantine/``.
# 5. The store is scanned again (unchanged shards are not re-read) to tell "repaired" from
#    "damage remains".
#
# Step 0, why: a shard's name is the SHA-256 of its bytes, so a file whose every tensor is intact
# but whose name is not its digest was renamed, not damaged: two shard files whose names were
# swapped, a rename cycle, a copy under a name nobody uses, or a file moved into the wrong folder.
# Treated like damage (salvaged into a fresh shard, the file quarantined), the first fresh shard of
# a swap landed on the path of the other file, not salvaged yet, and that file's features were
# lost. A file is renamed only when its true name is wanted: the catalog names that shard, or
# another shard file sits under that name (a swap or cycle). Anything else (zeros appended to a
# shard, say, whose digest names no shard) keeps the salvage path, which rewrites the clean shard.
# Renames go through a staging name beside the destination, so a cycle never overwrites a file
# that is still to be moved; a crash between the two steps leaves the staged file for the next
# ``verify --repair`` to report and quarantine, never to delete.
Progress = Callable[[GcProgress], None] | None

STAGING_SUFFIX = ".renaming"


def verify(
    cache: StoreRef = None,
    *,
    repair_damage: bool = False,
    progress: Progress = None,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
    redigest: Redigest | None = None,
) -> VerifyReport:
    """Check a store (and with ``repair_damage`` fix it); ``report.exit_code`` is 0, 10 or 11.

    ``redigest`` (the CLI passes :func:`featbake.encode.inputs.redigested`) lets the repair
    re-key the items of manifest, tar and table roots built from a wrong hash-cache row, as it
    re-keys a folder's; without it only a folder's are (the next build re-keys the others).

    Verify reads what the store's place names (:meth:`~featbake.store.place.Place.verify_scope`):
    a directory's every file, catalog, roots and hash cache; a bucket's own objects of every
    shard its catalog names, from any node, whatever this node's tier holds. Repair runs where
    the place allows it, and is refused in one line elsewhere (a bucket).

    Raises:
        ConfigError: ``repair_damage`` where the place refuses repair.
        StoreError: no store there, a folder that is not a store, or (with ``repair_damage``) a
            writer keeps sealing shards into it.

    Example:
        >>> report = verify(".featbake", repair_damage=True)  # doctest: +SKIP
        >>> report.status  # "clean", "repaired" or "damaged"  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    layout = existing_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    place = place_of(layout)
    refusal = place.repair_refusal()
    if repair_damage and refusal is not None:
        raise ConfigError(refusal)
    if place.verify_scope() is VerifyScope.NAMED_SHARDS:
        refuse_lost_catalog(layout)  # else every shard an orphan of a "clean" store
        return verify_named(layout, progress)
    if repair_damage:
        return repair(layout, progress, redigest)
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


def repair(
    scan: VerifyScan | Layout, progress: Progress = None, redigest: Redigest | None = None
) -> VerifyReport:
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
        return repair_locked(scan_store(layout, progress, reuse=reuse), progress, redigest)


def repair_locked(
    scan: VerifyScan, progress: Progress = None, redigest: Redigest | None = None
) -> VerifyReport:
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
    ensure_quarantine(layout)  # before any change: damage must have somewhere to go
    renamed = rename_back(scan)
    if renamed.actions:  # those files are sound now, under their names: look at them again
        sound = {c.path: c for c in scan.shards if c.sound}
        scan = scan_store(layout, progress, reuse=sound)
    salvaged, done = _salvage_all(scan, [c for c in scan.shards if not c.sound])
    done = renamed + done + _quarantine_unreadable(scan)
    in_step, wrong = _catalog_in_step(scan, salvaged, progress)
    done += in_step
    with closing(Catalog(layout)) as cat:
        done += repair_hash_cache(layout, cat, wrong, redigest)
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


def _catalog_in_step(
    scan: VerifyScan, salvaged: list[SealedShard], progress: Progress
) -> tuple[RepairOutcome, tuple[HashMismatch, ...]]:
    """The catalog repaired where it is usable, else rebuilt from the shards; and the
    hash-cache rows found wrong.

    ``quick_check`` does not compare an index with its table, so a usable catalog may still
    hold a damaged page that only a write meets (SQLite: "database disk image is malformed"):
    that catalog is rebuilt too, never left half repaired.
    """
    if scan.catalog.state is CatalogState.OK:
        try:
            return repair_catalog(scan, salvaged), scan.wrong_hashes
        except (sqlite3.DatabaseError, StoreError) as e:
            if not damaged_file(e):
                raise
    # the hash cache's rows the old catalog carried over are checked anew
    return rebuild_catalog(scan, salvaged), check_hash_cache(scan.layout, progress).wrong


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
@dataclass(frozen=True)
class Salvage:
    """What repair copied out of one damaged shard, how many tensors it could not prove, and
    how many lay past the end of a shard cut short (lost: a build computes them again)."""

    shard: SealedShard | None
    unproven: int = 0
    cut: int = 0


@dataclass(frozen=True)
class Copied:
    """The tensors read out of one damaged shard that passed their checksum (``tensors``), the
    names of those that could not be copied (``lost``: failed, unproven, unreadable or past a
    cut; a key missing any of its tensors is dropped whole) and the shard's fingerprints."""

    tensors: dict[str, torch.Tensor]
    lost: frozenset[str]
    unproven: int
    cut: int
    encoder_fp: str
    recipe_fp: str


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


def _candidates(c: ShardCheck, reader: ShardReader) -> list[str]:
    """The tensors repair tries to copy out of ``c``: those the scan found intact; for a file
    the scan could not open because it is cut short, every tensor wholly before the cut (the
    reader, opened with ``cut_ok``, holds just those). Nothing for a file that opens whole now
    although the scan could not open it: it changed since, and nothing about it is proven."""
    if c.entries:
        return list(c.intact)
    return list(reader.tensors) if reader.cut else []


def _copy(c: ShardCheck, reader: ShardReader, vouched: dict) -> Copied:
    """Read every tensor of ``c`` that repair may copy, each checked against its checksum."""
    named = _candidates(c, reader)
    proven = _provable(reader, named, vouched)
    tensors = {}
    for t in proven:
        with contextlib.suppress(StoreCorrupt):
            tensors[t] = reader.read(t)
    meta = reader.metadata
    return Copied(
        tensors,
        frozenset((*c.failed, *reader.cut, *(set(named) - set(tensors)))),
        len(named) - len(proven),
        len(reader.cut),
        meta.get("encoder_fp", ""),
        meta.get("recipe_fp", ""),
    )


def salvage(layout: Layout, c: ShardCheck, vouched: dict | None = None) -> Salvage:
    """Copy the tensors of a damaged shard that pass their checksum into a fresh shard.

    A key is kept only whole: serving some outputs of a multi-output feature would be wrong.
    Nothing is copied that cannot be proven: a format-1 tensor (bytes-only checksum) only where
    ``vouched`` (the catalog's record, see :func:`catalog_vouches`) gives its dtype and shape.
    A file cut short (a disk that filled mid-copy, an interrupted rsync) gives up only the
    tensors whose bytes run past its end: it is read with ``cut_ok``, here and nowhere else.
    """
    if c.entries and (not c.intact or not c.encoder_fp):
        return Salvage(None)
    try:
        with ShardReader(c.path, verify="always", cut_ok=True) as reader:
            copied = _copy(c, reader, vouched or {})
    except (StoreError, OSError, *HOSTILE_HEADER_ERRORS):
        return Salvage(None)  # changed since the scan: nothing provable to copy
    broken = {split_tensor_name(t)[0] for t in copied.lost}
    kept = {t: v for t, v in copied.tensors.items() if split_tensor_name(t)[0] not in broken}
    if not kept or not copied.encoder_fp:
        return Salvage(None, copied.unproven, copied.cut)
    sealed = write_shard(layout, kept, copied.encoder_fp, copied.recipe_fp)
    return Salvage(sealed, copied.unproven, copied.cut)


def _salvage_all(
    scan: VerifyScan, bad: list[ShardCheck]
) -> tuple[list[SealedShard], RepairOutcome]:
    """The fresh shards salvage wrote from the damaged shards ``bad``, and what it did."""
    shards, out = [], RepairOutcome()
    vouched = catalog_vouches(scan, {c.name for c in bad})
    for c in bad:
        s = salvage(scan.layout, c, vouched.get(c.name))
        if s.unproven:
            out.actions.append(
                f"did not salvage {s.unproven} tensors of {c.name}: its format-1 checksums cover "
                "the bytes only, and the catalog cannot prove their dtype and shape"
            )
        if s.cut:
            out.actions.append(
                f"shard {c.name} is cut short: {s.cut} tensors past its end are lost; "
                "`featbake build` computes them again"
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
    unreadable = (FindingKind.NOT_A_FILE, FindingKind.ROOT_FILE_CORRUPT, FindingKind.FRAGMENT)
    for f in [f for kind in unreadable for f in scan.of_kind(kind)]:
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
