"""verify's check of the hash cache: what it would trust is re-derived from the files themselves.

A hash-cache row says "the file with this (size, mtime, ctime, inode) hashes to this digest", and
builds and datasets trust it to key the file without reading it. Rows are derived data, so verify
does not trust them either: every row a reader would trust now (its file's stat still equals the
row's and the row is not racy) is checked by hashing the file again. A row whose digest differs
(edited, or a file rewritten behind a forged stat) is damage; repair drops it and re-keys the
root manifest items that were keyed from it (:func:`repair_hash_cache`).

Rows caching an encoder's fingerprint (``encoder-fp:...``) cannot be checked here: that would
mean loading the encoder, which upkeep never does. Repair drops them all; each is computed again
the next time a build or a dataset uses that encoder.

Only regular files are read, through a non-blocking open: a FIFO at a row's path never hangs the
check, a symlink loop or an unreadable file is skipped (a reader would hash it again anyway).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from featbake.keys import feature_key
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog, FileStat, HashCacheRow, write_root_file
from featbake.store.catalog.upkeep_queries import ENCODER_FP_PREFIX, hash_cache_rows
from featbake.store.layout import Layout
from featbake.upkeep.findings import Finding, FindingKind, HashMismatch, RepairOutcome

HASH_THREADS = 4  # hashlib releases the GIL: a few threads keep a disk (or an NFS mount) busy

Progress = Callable[[GcProgress], None] | None


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
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            return hashlib.file_digest(f, "sha256").hexdigest(), st.st_size
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
