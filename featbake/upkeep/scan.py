"""verify, first half: check every shard, the catalog against them, and the hash cache against
the input files (``hash_check``), changing nothing.

Whatever lies in the store folder (hostile headers, symlink loops, FIFOs, a catalog that lacks a
table) becomes a :class:`Finding`; the scan itself never fails on content.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

from featbake.errors import StoreError
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog
from featbake.store.catalog.upkeep_queries import catalog_file_problems
from featbake.store.layout import Layout
from featbake.store.open import store_layout
from featbake.upkeep.catalog_checks import check_catalog, check_root_files
from featbake.upkeep.files import FolderListing, LooseFile, list_folder, loose_files, require_store
from featbake.upkeep.findings import (
    CatalogHealth,
    CatalogState,
    Finding,
    FindingKind,
    HashMismatch,
    ShardCheck,
    VerifyScan,
)
from featbake.upkeep.hash_check import HashCheck, check_hash_cache, hash_findings
from featbake.upkeep.shard_check import check_shard


def catalog_health(layout: Layout) -> CatalogHealth:
    """Whether the catalog can be used as is; read-only until the file is known to be sound."""
    path = layout.catalog
    if not os.path.lexists(path):
        return CatalogHealth(CatalogState.MISSING, "missing")
    if not stat.S_ISREG(os.lstat(path).st_mode):
        return CatalogHealth(CatalogState.UNUSABLE, "not a regular file")
    problems = catalog_file_problems(path)
    if problems:
        return CatalogHealth(CatalogState.UNUSABLE, "; ".join(problems[:5]))
    cat = Catalog(layout)
    try:
        cat.conn  # noqa: B018  (an older schema version is refused here)
    except StoreError as e:
        return CatalogHealth(CatalogState.UNUSABLE, str(e))
    finally:
        cat.close()
    return CatalogHealth(CatalogState.OK)


def _check_files(
    files: tuple[LooseFile, ...],
    progress: Callable[[GcProgress], None] | None,
    reuse: dict[str, ShardCheck],
) -> tuple[dict[str, ShardCheck], int]:
    """name -> check of every shard file, and the bytes read (unchanged reused files are not)."""
    checks: dict[str, ShardCheck] = {}
    nbytes = 0
    for i, f in enumerate(sorted(files, key=lambda f: Path(f.path).name)):
        name = Path(f.path).name.removesuffix(".safetensors")
        old = reuse.get(f.path)
        if old is not None and old.bytes == f.bytes and old.mtime == f.mtime:
            checks[name] = old
        else:
            checks[name] = check_shard(Path(f.path))
            nbytes += f.bytes
        if progress:
            progress(GcProgress("verify", i + 1, len(files)))
    return checks, nbytes


def file_findings(layout: Layout, listing: FolderListing) -> list[Finding]:
    """Links, FIFOs and the like where shards live (damage), and stray regular files (notes)."""
    out = [
        Finding(
            FindingKind.NOT_A_FILE,
            p,
            "not a regular file (a link, FIFO, ...); --repair moves it to quarantine/",
            True,
        )
        for p in listing.special
    ]
    shard_paths = {f.path for f in listing.files} | set(listing.special)
    for sub in list_folder(layout.shards, "*").files:  # files directly under shards/
        out.append(Finding(FindingKind.STRAY_FILE, sub.path, "not a shard; left alone", False))
    for sub in list_folder(layout.shards, "*/*").files:
        if sub.path not in shard_paths:
            out.append(Finding(FindingKind.STRAY_FILE, sub.path, "not a shard; left alone", False))
    return out


def scan_store(
    cache: str | os.PathLike[str] | None = None,
    progress: Callable[[GcProgress], None] | None = None,
    *,
    reuse: dict[str, ShardCheck] | None = None,
    check_hashes: bool = True,
) -> VerifyScan:
    """Check every shard and the catalog against them; changes nothing.

    Args:
        cache: the store.
        progress: called with ``GcProgress("verify", shards done, shards)``.
        reuse: checks already made, by path; a file of unchanged size and mtime is not re-read.
        check_hashes: hash again the input files the hash cache vouches for (``hash_check``);
            off for the scan that follows a repair, which already re-derived the cache.

    Raises:
        StoreError: there is no store at ``cache`` (a folder that is not one is refused, never
            reported as a damaged store).
    """
    layout = store_layout(cache)
    require_store(layout)
    listing = list_folder(layout.shards, "*/*.safetensors")
    checks, nbytes = _check_files(listing.files, progress, reuse or {})
    findings = [
        Finding(FindingKind.CORRUPT_SHARD, c.path, c.problem, True)
        for c in checks.values()
        if not c.sound
    ]
    findings.extend(file_findings(layout, listing))
    health = catalog_health(layout)
    wrong_hashes: tuple[HashMismatch, ...] = ()
    if health.state is CatalogState.OK:
        try:
            findings.extend(check_catalog(layout, checks))
            hashes = check_hash_cache(layout, progress) if check_hashes else HashCheck((), 0, 0)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:  # what quick_check let through
            health = CatalogHealth(CatalogState.UNUSABLE, f"unreadable rows: {e}")
        else:
            findings.extend(hash_findings(hashes))
            wrong_hashes, nbytes = hashes.wrong, nbytes + hashes.bytes_read
    if health.state is not CatalogState.OK:
        findings.append(
            Finding(
                FindingKind.CATALOG,
                str(layout.catalog),
                f"{health.detail}; --repair rebuilds it",
                True,
            )
        )
    findings.extend(check_root_files(layout))
    tmp = loose_files(layout.tmp, "*")
    if tmp:
        findings.append(
            Finding(
                FindingKind.TMP_LEFTOVERS,
                str(layout.tmp),
                f"{len(tmp)} files ({sum(f.bytes for f in tmp)} bytes) left by interrupted "
                "writes; gc removes them after the grace period",
                False,
            )
        )
    return VerifyScan(
        str(layout.root), health, tuple(checks.values()), tuple(findings), nbytes, wrong_hashes
    )
