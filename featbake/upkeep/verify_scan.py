"""``featbake verify``, first half: check every shard, the catalog against them, and the hash
cache against the input files, changing nothing.

Whatever lies in the store folder (hostile headers, symlink loops, FIFOs, a catalog that lacks a
table) becomes a :class:`Finding`; the scan itself never fails on content.

The hash cache is re-derived from the files themselves. A hash-cache row says "the file with
this (size, mtime, ctime, inode) hashes to this digest", and builds and datasets trust it to key
the file without reading it. Rows are derived data, so verify does not trust them either: every
row a reader would trust now (its file's stat still equals the row's and the row is not racy) is
checked by hashing the file again. A row whose digest differs (edited, or a file rewritten behind
a forged stat) is damage; repair drops it and re-keys the root manifest items that were keyed
from it (``verify_catalog.repair_hash_cache``). Rows caching an encoder's fingerprint cannot be
checked here: that would mean loading the encoder, which upkeep never does. Only regular files
are read, through a non-blocking open: a FIFO at a row's path never hangs the check, a symlink
loop or an unreadable file is skipped (a reader would hash it again anyway).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from featbake.errors import StoreError
from featbake.keys import sha256_file
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog, FileStat, HashCacheRow
from featbake.store.catalog.upkeep_queries import (
    ENCODER_FP_PREFIX,
    catalog_file_problems,
    hash_cache_rows,
)
from featbake.store.layout import Layout
from featbake.upkeep.files import FolderListing, existing_store, list_folder, shard_name
from featbake.upkeep.verify_checks import check_catalog, check_root_files, check_shard
from featbake.upkeep.verify_findings import (
    CatalogHealth,
    CatalogState,
    Finding,
    FindingKind,
    HashMismatch,
    ShardCheck,
    VerifyScan,
)

HASH_THREADS = 4  # hashlib releases the GIL: a few threads keep a disk (or an NFS mount) busy

Progress = Callable[[GcProgress], None] | None


def scan_store(
    store: Layout | str | os.PathLike[str] | None = None,
    progress: Progress = None,
    *,
    reuse: dict[Path, ShardCheck] | None = None,
    check_hashes: bool = True,
) -> VerifyScan:
    """Check every shard and the catalog against them; changes nothing.

    Args:
        store: the store (its :class:`Layout`, or its folder).
        progress: called with ``GcProgress("verify", shards done, shards)``.
        reuse: checks already made, by path; a file of unchanged size and mtime is not re-read.
        check_hashes: hash again the input files the hash cache vouches for; off for a scan
            whose result only tells "repaired" from "damage remains" (repair re-derived it).

    Raises:
        StoreError: there is no store at ``store`` (a folder that is not one is refused, never
            reported as a damaged store).
    """
    layout = existing_store(store)
    listing = list_folder(layout.shards, "*/*.safetensors")
    checks, nbytes = _check_files(listing, progress, reuse or {})
    findings = [
        Finding(FindingKind.CORRUPT_SHARD, str(c.path), c.problem, True)
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
        detail = f"{health.detail}; --repair rebuilds it"
        findings.append(Finding(FindingKind.CATALOG, str(layout.catalog), detail, True))
    findings.extend(check_root_files(layout))
    findings.extend(tmp_findings(layout))
    return VerifyScan(layout, health, tuple(checks.values()), tuple(findings), nbytes, wrong_hashes)


def _check_files(
    listing: FolderListing, progress: Progress, reuse: dict[Path, ShardCheck]
) -> tuple[dict[str, ShardCheck], int]:
    """name -> check of every shard file, and the bytes read (unchanged reused files are not)."""
    checks: dict[str, ShardCheck] = {}
    nbytes = 0
    files = sorted(listing.files, key=lambda f: f.path.name)
    for i, f in enumerate(files):
        old = reuse.get(f.path)
        if old is not None and old.bytes == f.bytes and old.mtime == f.mtime:
            checks[shard_name(f.path)] = old
        else:
            checks[shard_name(f.path)] = check_shard(f.path)
            nbytes += f.bytes
        if progress:
            progress(GcProgress("verify", i + 1, len(files)))
    return checks, nbytes


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


def file_findings(layout: Layout, listing: FolderListing) -> list[Finding]:
    """Links, FIFOs and the like where shards live (damage), and stray regular files (notes)."""
    out = [
        Finding(
            FindingKind.NOT_A_FILE,
            str(p),
            "not a regular file (a link, FIFO, ...); --repair moves it to quarantine/",
            True,
        )
        for p in listing.special
    ]
    shard_paths = {f.path for f in listing.files} | set(listing.special)
    strays = [
        *list_folder(layout.shards, "*").files,  # files directly under shards/
        *(f for f in list_folder(layout.shards, "*/*").files if f.path not in shard_paths),
    ]
    out.extend(
        Finding(FindingKind.STRAY_FILE, str(f.path), "not a shard; left alone", False)
        for f in strays
    )
    return out


def tmp_findings(layout: Layout) -> list[Finding]:
    """A note on files left in ``tmp/`` by interrupted writes (gc removes them)."""
    tmp = list_folder(layout.tmp, "*").files
    if not tmp:
        return []
    detail = (
        f"{len(tmp)} files ({sum(f.bytes for f in tmp)} bytes) left by interrupted writes; gc "
        "removes them after the grace period"
    )
    return [Finding(FindingKind.TMP_LEFTOVERS, str(layout.tmp), detail, False)]


# -- the hash cache, re-derived ----------------------------------------------------------------
class HashCheck(NamedTuple):
    """What the check found: rows whose digest is wrong, files read and their bytes."""

    wrong: tuple[HashMismatch, ...]
    files_read: int
    bytes_read: int


def _trusted_now(row: HashCacheRow) -> bool:
    """Whether a reader would trust ``row`` now: not racy, and its file's stat unchanged."""
    if not isinstance(row.path, str) or row.path.startswith(ENCODER_FP_PREFIX):
        return False
    try:
        entry = row.trusted()
        return entry is not None and FileStat.of(row.path) == entry.stat
    except (OSError, ValueError, TypeError):  # gone, a symlink loop, a NUL, hostile columns
        return False


def _sha256_of_regular_file(path: str) -> tuple[str, int] | None:
    """(SHA-256, bytes) of ``path`` if it is a regular file that can be read, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb", buffering=0):  # closes fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            return sha256_file(fd), st.st_size
        except OSError:
            return None


def check_hash_cache(layout: Layout, progress: Progress = None) -> HashCheck:
    """Hash again every file whose hash-cache row a reader would trust now; report mismatches.

    Raises:
        StoreError: the catalog cannot be opened (callers check its health first).
    """
    with contextlib.closing(Catalog(layout)) as cat:
        rows = [r for r in hash_cache_rows(cat) if _trusted_now(r)]
    wrong: list[HashMismatch] = []
    files = nbytes = 0
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        results = pool.map(lambda r: (r, _sha256_of_regular_file(r.path)), rows)
        for done, (row, got) in enumerate(results, 1):
            if got is not None:
                files += 1
                nbytes += got[1]
                if got[0] != row.sha256:
                    wrong.append(HashMismatch(row.path, row.sha256, got[0]))
            if progress:
                progress(GcProgress("inputs", done, len(rows)))
    return HashCheck(tuple(wrong), files, nbytes)


def hash_findings(check: HashCheck) -> list[Finding]:
    """One damage finding per wrong row."""
    return [
        Finding(
            FindingKind.HASH_CACHE,
            m.path,
            f"the hash cache says it hashes to {m.recorded[:12]}... but its bytes hash to "
            f"{m.actual[:12]}... (an edited row): a build or dataset would key it as another "
            "file; --repair drops the row and re-keys the manifests built from it",
            True,
        )
        for m in check.wrong
    ]
