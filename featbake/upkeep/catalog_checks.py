"""verify's checks of the catalog against the shards found, and of the root manifest files."""

from __future__ import annotations

from featbake.errors import StoreCorrupt
from featbake.store.catalog import Catalog, Root, ShardRow, root_file, roots_dir, tombstone_file
from featbake.store.catalog.upkeep_queries import feature_rows
from featbake.store.fragments import fragment_shard_names
from featbake.store.layout import Layout
from featbake.store.writer import ShardEntry
from featbake.upkeep.findings import Finding, FindingKind, ShardCheck
from featbake.upkeep.manifests import read_manifest

Headers = dict[str, dict[str, ShardEntry]]  # sound shard name -> tensor name -> entry


def sound_headers(checks: dict[str, ShardCheck]) -> Headers:
    """What each sound shard's header names, by shard name and tensor name."""
    return {name: {e.tensor: e for e in c.entries} for name, c in checks.items() if c.sound}


def rows_naming_what_shards_lack(
    cat: Catalog, rows: dict[int, ShardRow], headers: Headers
) -> list[tuple[str, str, int, int]]:
    """(key, part, shard id, nbytes) of rows whose sound shard lacks the tensor, or has it with
    another dtype or shape. Rows of missing or corrupt shards are reported per shard instead."""
    wrong = []
    for row in feature_rows(cat):
        s = rows.get(row.shard_id)
        if s is None or s.name not in headers:
            continue
        e = headers[s.name].get(row.tensor)
        if e is None or not row.matches(e.dtype, e.shape):
            wrong.append((row.key, row.part, row.shard_id, row.nbytes))
    return wrong


def _row_findings(layout: Layout, cat: Catalog, checks: dict[str, ShardCheck]) -> list[Finding]:
    rows = {s.id: s for s in cat.shard_rows()}
    out = [
        Finding(
            FindingKind.MISSING_SHARD, s.name, "the catalog names it but its file is gone", True
        )
        for s in rows.values()
        if s.name not in checks
    ]
    bad = len(rows_naming_what_shards_lack(cat, rows, sound_headers(checks)))
    if bad:
        detail = f"{bad} feature rows name tensors their shard does not hold"
        out.append(Finding(FindingKind.BAD_ROWS, str(layout.catalog), detail, True))
    dangling = cat.dangling_feature_rows()
    if dangling:
        detail = f"{dangling} feature rows name no shard"
        out.append(Finding(FindingKind.DANGLING_ROWS, str(layout.catalog), detail, True))
    # A sharded build's shards are named by its fragments until `featbake merge` runs.
    named = {s.name for s in rows.values()} | fragment_shard_names(layout)
    out.extend(
        Finding(
            FindingKind.ORPHAN_SHARD,
            c.path,
            "no catalog row names it (a build that had not committed yet, or a "
            "compaction's old copy); gc removes it after the grace period",
            False,
        )
        for name, c in checks.items()
        if name not in named and c.sound
    )
    return out


def _root_finding(layout: Layout, cat: Catalog, r: Root) -> Finding | None:
    f, t = root_file(layout, r.name), tombstone_file(layout, r.name)
    if not f.exists():
        if t.exists():
            return Finding(
                FindingKind.ROOT_DROPPING, r.name, "a drop was interrupted; gc finishes it", False
            )
        return Finding(FindingKind.ROOT_FILE_MISSING, r.name, "its manifest file is gone", True)
    try:
        froot, fitems = read_manifest(f)
    except StoreCorrupt:
        return None  # reported by check_root_files
    same_row = (froot.data, froot.encoder_label, froot.encoder_fp, froot.recipe_fp) == (
        r.data,
        r.encoder_label,
        r.encoder_fp,
        r.recipe_fp,
    )
    if fitems != [tuple(x) for x in cat.root_items(r.name)] or not same_row:
        return Finding(
            FindingKind.ROOT_FILE_STALE, r.name, "its manifest file differs from the catalog", True
        )
    return None


def check_catalog(layout: Layout, checks: dict[str, ShardCheck]) -> list[Finding]:
    """The catalog against the shard files (rows, orphans) and the root manifest files."""
    cat = Catalog(layout)
    try:
        out = _row_findings(layout, cat, checks)
        roots = cat.roots()
        out.extend(f for r in roots if (f := _root_finding(layout, cat, r)) is not None)
        names = {r.name for r in roots}
        out.extend(
            Finding(
                FindingKind.ROOT_NOT_CATALOGED, str(p), "a root manifest the catalog lacks", True
            )
            for p in sorted(roots_dir(layout).glob("*.json"))
            if p.stem not in names
        )
    finally:
        cat.close()
    return out


def check_root_files(layout: Layout) -> list[Finding]:
    """Every ``roots/*.json`` that cannot be read as a manifest."""
    out = []
    for p in sorted(roots_dir(layout).glob("*.json")):
        try:
            read_manifest(p)
        except StoreCorrupt as e:
            out.append(Finding(FindingKind.ROOT_FILE_CORRUPT, str(p), str(e), True))
    return out
