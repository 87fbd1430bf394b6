"""Rebuilding a catalog that is missing or unusable, from the shard headers and ``roots/*.json``.

Whatever the old catalog still yields (hash cache, last-use times, encoder labels, roots whose
manifest file is gone) is carried over; the old files move to ``quarantine/``.
"""

from __future__ import annotations

from pathlib import Path

from featbake.errors import StoreCorrupt
from featbake.store.catalog import (
    Catalog,
    OldCatalog,
    read_old_catalog,
    roots_dir,
    tombstone_file,
    write_root_file,
)
from featbake.store.layout import Layout, remove_file
from featbake.store.writer import SealedShard
from featbake.upkeep.files import quarantine
from featbake.upkeep.findings import RepairOutcome, ShardCheck, VerifyScan
from featbake.upkeep.manifests import read_manifest


def sealed_from_check(c: ShardCheck) -> SealedShard:
    """A sound shard found on disk, as the catalog records a freshly sealed one."""
    return SealedShard(c.name, Path(c.path), c.bytes, c.encoder_fp, c.recipe_fp, c.entries)


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


def rebuild_catalog(layout: Layout, scan: VerifyScan, salvaged: list[SealedShard]) -> RepairOutcome:
    """Replace the catalog with one built from the sound shards, salvaged ones and manifests."""
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
