"""verify's checks: one shard file, and the catalog and root manifests against the shards found.

A shard file is checked by its bytes against its content name, its header, and each tensor's
CRC. Its header is untrusted input here: its shape may not fit its byte range, its JSON may nest
200,000 arrays deep, its ``__metadata__`` may be a number. Each of those makes the shard unsound
(with the reason), never makes verify fail.

The catalog is checked against the sound shards (rows naming what a shard lacks, rows naming no
shard, shards no row names) and against ``roots/*.json`` (each root's manifest file).
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from featbake.errors import StoreCorrupt, StoreError
from featbake.keys import sha256_file
from featbake.store.catalog import Catalog, Root, ShardRow, root_file, roots_dir, tombstone_file
from featbake.store.catalog.upkeep_queries import feature_rows
from featbake.store.fragments import fragment_shard_names
from featbake.store.layout import Layout
from featbake.store.reader import ShardReader
from featbake.store.shard_format import ST_TO_DTYPE, TensorInfo, split_tensor_name
from featbake.store.writer import ShardEntry
from featbake.upkeep.files import read_manifest, shard_name
from featbake.upkeep.verify_findings import Finding, FindingKind, ShardCheck

Headers = dict[str, dict[str, ShardEntry]]  # sound shard name -> tensor name -> entry

#: What parsing a hostile header raises besides StoreError (json nesting, a non-dict metadata, ...).
HOSTILE_HEADER_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    RecursionError,
    RuntimeError,
    OverflowError,
)


def header_problem(info: TensorInfo, file_bytes: int) -> str | None:
    """Why a tensor's header entry cannot describe its bytes, or None if it can."""
    dtype = ST_TO_DTYPE.get(info.dtype) if isinstance(info.dtype, str) else None
    if dtype is None:
        return f"unknown dtype {info.dtype!r}"
    shape = info.shape
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"shape {list(shape)!r} is not a list of sizes"
    if not all(isinstance(x, int) for x in (info.begin, info.end)):
        return "its data offsets are not integers"
    if not 0 <= info.begin <= info.end <= file_bytes:
        return f"its data offsets [{info.begin}, {info.end}) lie outside the file"
    if math.prod(shape) * dtype.itemsize != info.end - info.begin:
        return f"shape {list(shape)} {info.dtype} does not fit its {info.end - info.begin} bytes"
    return None


def _unsound(path: Path, size: int, mtime: float, why: str) -> ShardCheck:
    return ShardCheck(shard_name(path), path, size, mtime, False, why, "", "", (), ())


def _open(path: Path, size: int, mtime: float) -> tuple[str, ShardReader] | ShardCheck:
    """(digest, open reader), or the unsound check saying why the file cannot be read."""
    try:
        digest = sha256_file(path)
        return digest, ShardReader(path, verify="never")
    except StoreError as e:  # ShardMissing: it vanished meanwhile; StoreCorrupt: a bad header
        return _unsound(path, size, mtime, str(e))
    except OSError as e:
        return _unsound(path, size, mtime, f"unreadable: {e.strerror or e}")
    except HOSTILE_HEADER_ERRORS as e:
        return _unsound(path, size, mtime, f"unreadable header ({type(e).__name__})")


def _inspect(
    reader: ShardReader, size: int, *, crcs: bool
) -> tuple[list[ShardEntry], list[str], list[str]]:
    """(entries of well-formed tensors, tensors that fail, why each fails).

    With ``crcs`` each tensor's checksum is read too (not needed when the file's SHA-256 already
    matches its content name).
    """
    entries, failed, why = [], [], []
    for tname, info in reader.tensors.items():
        problem = header_problem(info, size)
        if problem is None and crcs:
            try:
                reader.read(tname, verify="always")
            except StoreCorrupt:
                problem = "checksum mismatch"
        if problem is not None:
            failed.append(tname)
            why.append(f"tensor {tname}: {problem}")
            continue
        key, part = split_tensor_name(tname)
        entries.append(ShardEntry(key, part, info.dtype, info.shape, info.end - info.begin))
    return entries, failed, why


def _fingerprint(meta: dict, name: str) -> str:
    value = meta.get(name, "")
    return value if isinstance(value, str) else ""


def check_shard(path: Path) -> ShardCheck:
    """Check one shard file: its bytes against its content name, its header, each checksum.

    A shard is sound when its bytes hash to its name (in the right folder) and its header
    describes every tensor consistently; otherwise ``intact`` names the tensors that are still
    well-formed and pass their checksum (what repair may salvage).
    """
    name = shard_name(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        return _unsound(path, 0, 0.0, f"unreadable: {e.strerror or e}")
    if not stat.S_ISREG(st.st_mode):
        return _unsound(path, 0, 0.0, "not a regular file")
    opened = _open(path, st.st_size, st.st_mtime)
    if isinstance(opened, ShardCheck):
        return opened
    digest, reader = opened
    named_right = digest == name and path.parent.name == name[:2]
    with reader:
        try:
            entries, failed, why = _inspect(reader, st.st_size, crcs=not named_right)
        except HOSTILE_HEADER_ERRORS as e:
            return _unsound(path, st.st_size, st.st_mtime, f"unreadable header ({e!r:.200})")
        meta = reader.metadata
    sound = named_right and not failed
    if sound:
        problem = ""
    elif failed:
        problem = f"{len(failed)} of {len(reader.tensors)} tensors fail ({why[0]})"
    else:
        problem = "its bytes do not match its content name (damaged header or renamed)"
    return ShardCheck(
        name,
        path,
        st.st_size,
        st.st_mtime,
        sound,
        problem,
        _fingerprint(meta, "encoder_fp"),
        _fingerprint(meta, "recipe_fp"),
        tuple(entries),
        tuple(e.tensor for e in entries),
        tuple(failed),
        digest,
    )


# -- the catalog and root manifests against the shards ----------------------------------------
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
            str(c.path),
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
