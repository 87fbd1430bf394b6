"""Repair of the root manifests against a usable catalog (both ways)."""

from __future__ import annotations

from featbake.errors import StoreCorrupt
from featbake.store.catalog import Catalog, root_file, roots_dir, tombstone_file, write_root_file
from featbake.store.layout import Layout
from featbake.upkeep.findings import RepairOutcome
from featbake.upkeep.manifests import read_manifest


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
