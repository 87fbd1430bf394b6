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

import os
from contextlib import closing
from pathlib import Path

from featbake.errors import StoreCorrupt
from featbake.keys import feature_key
from featbake.store.catalog import (
    Catalog,
    FeatureRef,
    OldCatalog,
    ShardRow,
    read_old_catalog,
    root_file,
    roots_dir,
    tombstone_file,
    write_root_file,
)
from featbake.store.catalog.upkeep_queries import ENCODER_FP_PREFIX
from featbake.store.layout import Layout, remove_file
from featbake.store.writer import SealedShard
from featbake.upkeep.files import quarantine, read_manifest
from featbake.upkeep.verify_checks import rows_naming_what_shards_lack, sound_headers
from featbake.upkeep.verify_findings import HashMismatch, RepairOutcome, ShardCheck, VerifyScan


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


def repair_catalog(scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Bring a usable catalog in step with the shards found and the root manifests."""
    layout = scan.layout
    with closing(Catalog(layout)) as cat:
        rows = {s.name: s for s in cat.shard_rows()}
        checks = {c.name: c for c in scan.shards}
        return (
            _forget_unsound_shards(cat, rows, checks)
            + _delete_wrong_rows(cat, rows, checks)
            + _index_shards(cat, rows, checks, salvaged)
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


def _set_aside_old_catalog(layout: Layout) -> tuple[OldCatalog, RepairOutcome]:
    """What the old catalog still yields; its files then move to quarantine/."""
    out = RepairOutcome()
    old = read_old_catalog(layout.catalog) if layout.catalog.is_file() else OldCatalog()
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{layout.catalog}{suffix}")
        if p.exists() or p.is_symlink():
            dest = quarantine(layout, p)
            out.actions.append(f"moved the old catalog file {p.name} to {dest}")
    return old, out


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
    old, out = _set_aside_old_catalog(layout)
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
    return out


# -- the hash cache, re-derived -----------------------------------------------------------------
def _rekey_manifests(layout: Layout, cat: Catalog, wrong: tuple[HashMismatch, ...]) -> int:
    """Re-key manifest items keyed from a wrong digest (file unchanged since: provably wrong)."""
    by_path = {m.path: m for m in wrong}
    changed = 0
    for root in cat.roots():
        items = [tuple(x) for x in cat.root_items(root.name)]
        new = []
        for rel, key in items:
            m = by_path.get(os.path.join(root.data, rel))
            if m is not None and key == feature_key(root.encoder_fp, root.recipe_fp, m.recorded):
                key = feature_key(root.encoder_fp, root.recipe_fp, m.actual)
                changed += 1
            new.append((rel, key))
        if new != items:
            cat.insert_root(root, new)
            write_root_file(layout, root, new)
    return changed


def repair_hash_cache(
    layout: Layout, cat: Catalog, wrong: tuple[HashMismatch, ...]
) -> RepairOutcome:
    """Drop wrong rows (re-keying the manifests built from them) and every cached encoder
    fingerprint (which upkeep cannot check)."""
    out = RepairOutcome()
    if wrong:
        rekeyed = _rekey_manifests(layout, cat, wrong)
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
