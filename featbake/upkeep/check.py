"""What ``featbake verify`` reports: finding kinds, the catalog's state, per-shard checks, the
scan, the report, and the exit codes.

These are records and typed states only; ``verify_scan.py`` makes them and ``verify_repair.py``
acts on them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from featbake.errors import ConfigError, SourceError, StoreCorrupt, StoreError
from featbake.keys import sha256_file
from featbake.progress import GcProgress
from featbake.store.bucket import verify_scratch
from featbake.store.catalog import (
    Catalog,
    ShardRow,
    cannot_write,
    catalog_file_problems,
    feature_rows,
    hash_cache_rows,
    upgradable,
)
from featbake.store.containers import (
    Member,
    TableFile,
    cell_digests,
    container_cut,
    is_tar,
    list_members,
    member_digests,
    pyarrow_module,
    split_item_path,
    stored_cell_kind,
)
from featbake.store.files import FolderListing, holding, list_folder
from featbake.store.fragments import fragment_shard_names, read_fragment, sealed_fragments
from featbake.store.hash_cache import ENCODER_FP_PREFIX, FileStat, HashCacheRow
from featbake.store.layout import Layout, shard_name
from featbake.store.merge import unmerged_builds
from featbake.store.open import place_of
from featbake.store.place import Place
from featbake.store.roots import Root, root_file, roots_dir, tombstone_file
from featbake.store.shard import ST_ITEMSIZE, ShardEntry, ShardReader, TensorInfo, split_tensor_name
from featbake.threadpool import map_in_threads
from featbake.upkeep.files import existing_store, read_manifest, rebuild_interrupted

# == verify_findings ===============================================================================
VERIFY_CLEAN = 0
VERIFY_REPAIRED = 10
VERIFY_DAMAGED = 11


class FindingKind(StrEnum):
    """What verify noticed; repair dispatches on these (the value is what the CLI prints)."""

    CORRUPT_SHARD = "corrupt-shard"  # bytes fail the content name or a checksum
    NOT_A_FILE = "not-a-file"  # a symlink, FIFO or socket where shards live
    STRAY_FILE = "stray-file"  # a regular file under shards/ that is not a shard (a note)
    CATALOG = "catalog"  # missing, unreadable, or lacking a table: rebuilt
    MISSING_SHARD = "missing-shard"  # a row names a shard whose file is gone
    BAD_ROWS = "bad-rows"  # rows name tensors their shard does not hold
    DANGLING_ROWS = "dangling-rows"  # rows name no shard row
    ORPHAN_SHARD = "orphan-shard"  # a sound shard no row names (a note; repair indexes it)
    ROOT_DROPPING = "root-dropping"  # an interrupted drop (a note; gc finishes it)
    ROOT_FILE_MISSING = "root-file-missing"
    ROOT_FILE_STALE = "root-file-stale"
    ROOT_NOT_CATALOGED = "root-not-cataloged"
    ROOT_FILE_CORRUPT = "root-file-corrupt"
    HASH_CACHE = "hash-cache"  # a trusted hash-cache row whose file hashes to something else
    TMP_LEFTOVERS = "tmp-leftovers"  # a note; gc removes them after the grace period
    PARTS_WAITING = "parts-waiting"  # a note: a build in parts whose fragments wait for merge
    FRAGMENT = "fragment"  # a sealed fragment that cannot be read: a merge refuses it


@dataclass(frozen=True)
class Finding:
    """One thing verify noticed. ``damage`` findings make the store unclean; notes do not."""

    kind: FindingKind
    subject: str
    detail: str
    damage: bool


class CatalogState(StrEnum):
    """Whether the catalog can be used as is (else repair rebuilds it)."""

    OK = "ok"
    MISSING = "missing"
    UNUSABLE = "unusable"  # unreadable, damaged, an older schema, or lacking tables


class CatalogHealth(NamedTuple):
    """The catalog's state and, when it is not ok, why."""

    state: CatalogState
    detail: str = ""


class VerifyStatus(StrEnum):
    """The outcome of ``featbake verify`` (exit codes 0, 10, 11)."""

    CLEAN = "clean"
    REPAIRED = "repaired"
    DAMAGED = "damaged"

    @property
    def exit_code(self) -> int:
        return {
            VerifyStatus.CLEAN: VERIFY_CLEAN,
            VerifyStatus.REPAIRED: VERIFY_REPAIRED,
        }.get(self, VERIFY_DAMAGED)


@dataclass(frozen=True)
class ShardCheck:
    """One shard file as verify found it."""

    name: str
    path: Path
    bytes: int
    mtime: float
    sound: bool
    problem: str
    encoder_fp: str
    recipe_fp: str
    entries: tuple[ShardEntry, ...]  # every tensor its header names
    intact: tuple[str, ...]  # well-formed tensors whose checksum holds (all when sound)
    failed: tuple[str, ...] = ()  # tensors whose header entry or checksum fails
    digest: str = ""  # SHA-256 of the file's bytes: its content name ("" if unreadable)


class HashMismatch(NamedTuple):
    """A hash-cache row a reader would trust, and what its file really hashes to."""

    path: str
    recorded: str
    actual: str


@dataclass(frozen=True)
class VerifyScan:
    """What verify found: per-shard checks, the catalog's state, and every finding."""

    layout: Layout
    catalog: CatalogHealth
    shards: tuple[ShardCheck, ...]
    findings: tuple[Finding, ...]
    bytes_checked: int
    wrong_hashes: tuple[HashMismatch, ...] = ()

    @property
    def damaged(self) -> bool:
        return any(f.damage for f in self.findings)

    def of_kind(self, kind: FindingKind) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind is kind]


@dataclass
class RepairOutcome:
    """What one repair step did: its action lines and the feature rows it lost or won back.

    Steps return one each; ``repair`` adds them up (``+``) into the :class:`VerifyReport`.
    """

    actions: list[str] = field(default_factory=list)
    lost: int = 0  # feature rows deleted
    recovered: int = 0  # rows indexed again from salvaged shards: not lost after all
    salvaged: int = 0  # features copied out of damaged shards

    def __add__(self, other: RepairOutcome) -> RepairOutcome:
        return RepairOutcome(
            self.actions + other.actions,
            self.lost + other.lost,
            self.recovered + other.recovered,
            self.salvaged + other.salvaged,
        )


@dataclass
class VerifyReport:
    """The outcome of ``featbake verify``: ``status`` is clean, repaired or damaged."""

    store: str
    status: VerifyStatus
    shards_checked: int
    bytes_checked: int
    findings: list[Finding]
    actions: list[str] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)
    features_lost: int = 0
    features_salvaged: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return VerifyStatus(self.status).exit_code

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


# == verify_checks =================================================================================
# verify's checks: one shard file, and the catalog and root manifests against the shards found.
#
# A shard file is checked by its bytes against its content name, its header, and each tensor's
# CRC. Its header is untrusted input here: its shape may not fit its byte range, its JSON may nest
# 200,000 arrays deep, its ``__metadata__`` may be a number. Each of those makes the shard unsound
# (with the reason), never makes verify fail.
#
# The catalog is checked against the sound shards (rows naming what a shard lacks, rows naming no
# shard, shards no row names) and against ``roots/*.json`` (each root's manifest file).
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
    itemsize = ST_ITEMSIZE.get(info.dtype) if isinstance(info.dtype, str) else None
    if itemsize is None:
        return f"unknown dtype {info.dtype!r}"
    shape = info.shape
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"shape {list(shape)!r} is not a list of sizes"
    if not all(isinstance(x, int) for x in (info.begin, info.end)):
        return "its data offsets are not integers"
    if not 0 <= info.begin <= info.end <= file_bytes:
        return f"its data offsets [{info.begin}, {info.end}) lie outside the file"
    if math.prod(shape) * itemsize != info.end - info.begin:
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
                reader.read_bytes(tname, verify="always")
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
    same_row = (
        froot.data,
        froot.encoder_label,
        froot.encoder_fp,
        froot.recipe_fp,
        froot.workdir,
    ) == (
        r.data,
        r.encoder_label,
        r.encoder_fp,
        r.recipe_fp,
        r.workdir,
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


# == verify_scan ===================================================================================
# ``featbake verify``, first half: check every shard, the catalog against them, and the hash
# cache against the input files, changing nothing.
#
# Whatever lies in the store folder (hostile headers, symlink loops, FIFOs, a catalog that lacks a
# table) becomes a :class:`Finding`; the scan itself never fails on content.
#
# The hash cache is re-derived from the files themselves. A hash-cache row says "the file with
# this (size, mtime, ctime, inode) hashes to this digest", and builds and datasets trust it to key
# the file without reading it. Rows are derived data, so verify does not trust them either: every
# row a reader would trust now (its file's stat still equals the row's and the row is not racy) is
# checked by hashing the file again. A row whose digest differs (edited, or a file rewritten behind
# a forged stat) is damage; repair drops it and re-keys the root manifest items that were keyed
# from it (``verify_catalog.repair_hash_cache``). Rows caching an encoder's fingerprint cannot be
# checked here: that would mean loading the encoder, which upkeep never does. Only regular files
# are read, through a non-blocking open: a FIFO at a row's path never hangs the check, a symlink
# loop or an unreadable file is skipped (a reader would hash it again anyway).
#
# Rows of items inside containers and manifests (issue 29), per kind:
# - ``shard.tar:member`` (a tar member, ``.tar.gz`` too): checked. Its tar's stat must be the
#   row's; the tar is listed once for all its rows and its members hashed in order, by the
#   build's own reader (``store/containers.py``): linear in the members, however many rows.
# - ``file.parquet:row:column`` / ``.arrow:row:column`` (a table cell): checked where pyarrow is
#   installed. The file's stat must be the row's; the file is opened once for all its rows,
#   each column read a row group at a time, and the cell's bytes (an Audio/Image struct's
#   ``bytes``, a binary cell, a string's UTF-8: the build's cell rule) are hashed.
# - a manifest's rows and segments: their rows are their files' (a recording's digest, from which
#   a segment's is derived), checked as any file; a manifest's texts have no row (never cached).
# - ``s3://`` objects (bucket inputs, a manifest's bucket rows, members and cells of tars and
#   parquet files in a bucket): not checked, as that means downloading every object of the data;
#   each row is keyed by its object's ETag.
# - ``tar-members:`` and ``table-rows:`` rows (a bucket tar's member listing, a bucket parquet
#   file's schema and ids: no digests): not checked; the scan reads them again when the object's
#   ETag changes.

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
        except (sqlite3.DatabaseError, UnicodeDecodeError, StoreCorrupt) as e:  # quick_check's
            health = CatalogHealth(CatalogState.UNUSABLE, f"unreadable rows: {e}")  # blind spots
        else:
            findings.extend(hash_findings(hashes))
            wrong_hashes, nbytes = hashes.wrong, nbytes + hashes.bytes_read
    waiting = waiting_findings(layout)
    if health.state is not CatalogState.OK and not _made_by_merge(layout, health, waiting):
        detail = f"{health.detail}; --repair rebuilds it"
        findings.append(Finding(FindingKind.CATALOG, str(layout.catalog), detail, True))
    findings.extend(waiting)
    findings.extend(fragment_findings(layout, set(checks)))
    findings.extend(check_root_files(layout))
    findings.extend(tmp_findings(layout))
    return VerifyScan(layout, health, tuple(checks.values()), tuple(findings), nbytes, wrong_hashes)


def waiting_findings(layout: Layout) -> list[Finding]:
    """A note per build whose parts sealed fragments not merged yet (a part killed, preempted
    or still running): what they sealed is kept and reused, nothing is damaged."""
    return [
        Finding(
            FindingKind.PARTS_WAITING,
            b.root,
            f"{len(b.ranks_done)} of {b.world} parts done, {b.fragments} fragments sealed "
            "and kept (a rerun reuses them); run `featbake merge` or rerun the build",
            False,
        )
        for b in unmerged_builds(layout)
    ]


def fragment_findings(layout: Layout, listed: set[str]) -> list[Finding]:
    """Sealed fragments a merge cannot read, and shards readable ones name whose file is gone
    (``listed``: the shard files the scan found). Both are damage: a merge refuses the first,
    and skips the second's features, which are then lost until a build encodes them again.

    A fragment merged and removed since the listing is skipped, and a named shard missing from
    the listing is missing only if it is still no file and still named once every fragment is
    read (a part seals its shard before the fragment naming it)."""
    out, named = [], {}
    for frag in sealed_fragments(layout):
        try:
            shards = read_fragment(frag.path, layout, with_entries=False).shards
        except StoreCorrupt as e:
            if frag.path.exists():
                out.append(Finding(FindingKind.FRAGMENT, str(frag.path), str(e), True))
            continue
        named.update({s.name: frag.path.name for s in shards})
    gone = {n for n in named if n not in listed and not layout.shard_path(n).is_file()}
    if gone:
        gone &= fragment_shard_names(layout)
    out.extend(
        Finding(
            FindingKind.MISSING_SHARD,
            name,
            f"sealed fragment {named[name]} names it but its file is gone, so its features "
            "are lost; after `featbake merge` the next `featbake build` of that data encodes "
            "them again",
            True,
        )
        for name in sorted(gone)
        if not layout.shard_path(name).is_file()
    )
    return out


def _made_by_merge(layout: Layout, health: CatalogHealth, waiting: list[Finding]) -> bool:
    """True when the catalog is missing only because no merge has made it yet: parts sealed
    fragments, and no root manifest says a catalog existed."""
    if health.state is not CatalogState.MISSING or not waiting:
        return False
    return not any(roots_dir(layout).glob("*.json"))


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
    if rebuild_interrupted(layout):
        return CatalogHealth(
            CatalogState.UNUSABLE, "a rebuild by `featbake verify --repair` was interrupted"
        )
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
        if cannot_write(e):  # a full or failing disk, a hot journal read-only: sound, not rebuilt
            raise
        if cat.read_only and upgradable(path):  # an older catalog, sound: upgraded where writable
            raise
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
    """A note on what interrupted writes left in ``tmp/``, counted by the rule stats and gc's
    sweep count it by (:meth:`~featbake.store.place.Place.leftovers`: a folder as one, with
    the bytes inside it)."""
    left = place_of(layout).leftovers()
    if not left:
        return []
    detail = (
        f"{len(left)} leftovers ({sum(h.size for h in left)} bytes) left by interrupted writes; "
        "gc removes them after the grace period"
    )
    return [Finding(FindingKind.TMP_LEFTOVERS, str(layout.tmp), detail, False)]


# -- the hash cache, re-derived ----------------------------------------------------------------
class HashCheck(NamedTuple):
    """What the check found: rows whose digest is wrong, files read and their bytes."""

    wrong: tuple[HashMismatch, ...]
    files_read: int
    bytes_read: int


def container_item(path: str) -> tuple[str, str] | None:
    """(container, inner name) of a row naming an item inside a local tar or table, else None
    (a file, or a URL: see the section's comment).

    Example:
        >>> container_item("/d/shard.tar:images/1.jpg")
        ('/d/shard.tar', 'images/1.jpg')
    """
    if "://" in path or os.path.lexists(path):
        return None
    cut = container_cut(path)
    return None if cut is None else (path[:cut], path[cut + 1 :])


def _stat_file(path: str) -> str:
    """The file whose stat a row was recorded with: the item's container, or the file."""
    inside = container_item(path)
    return inside[0] if inside else path


def _trusted_now(row: HashCacheRow) -> bool:
    """Whether a reader would trust ``row`` now: not racy, and its file's stat unchanged."""
    if not isinstance(row.path, str) or row.path.startswith(ENCODER_FP_PREFIX):
        return False
    try:
        entry = row.trusted()
        return entry is not None and FileStat.of(_stat_file(row.path)) == entry.stat
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


class RowGroup(NamedTuple):
    """Trusted rows checked together: one file's row (``container`` None), or every row naming
    an item of one local tar or table (its container opened and listed once for all of them)."""

    container: str | None
    rows: list[HashCacheRow]


#: A row and what its input hashes to now: (SHA-256, bytes), or None (not read: skipped).
RowCheck = tuple[HashCacheRow, "tuple[str, int] | None"]


def row_groups(rows: list[HashCacheRow]) -> list[RowGroup]:
    """``rows`` as groups to check: each file's row alone, each container's rows together."""
    files: list[RowGroup] = []
    inside: dict[str, list[HashCacheRow]] = {}
    for row in rows:
        item = container_item(row.path)
        if item is None:
            files.append(RowGroup(None, [row]))
        else:
            inside.setdefault(item[0], []).append(row)
    return files + [RowGroup(c, group) for c, group in inside.items()]


def check_group(group: RowGroup) -> list[RowCheck]:
    """What each row of ``group`` hashes to now, through the build's own readers: a
    container's items read in order from one open of it (linear in its items)."""
    if group.container is None:
        return [(r, _sha256_of_regular_file(r.path)) for r in group.rows]
    if is_tar(group.container):
        got = _member_checks(group.container, group.rows)
    else:
        got = _cell_checks(group.container, group.rows)
    return [(r, got.get(r.path)) for r in group.rows]


def _member_checks(tar: str, rows: list[HashCacheRow]) -> dict[str, tuple[str, int]]:
    """row path -> (SHA-256, bytes) of the members ``rows`` name: the tar listed once, its
    members hashed in tar order (a member listed twice: its first, as the build reads it).
    Members that cannot be read are left out (a reader hashes them again)."""
    try:
        listed: dict[str, Member] = {}
        for m in list_members(tar):
            listed.setdefault(m.name, m)
    except SourceError:
        return {}
    named = {r.path: listed.get(split_item_path(r.path)[1]) for r in rows}
    digests = member_digests(tar, [m for m in named.values() if m is not None]).digests
    out: dict[str, tuple[str, int]] = {}
    for path, member in named.items():
        if member is not None and isinstance(sha := digests.get(member.name), str):
            out[path] = (sha, member.size)
    return out


class CellSizes:
    """A :class:`~featbake.store.containers.Holder` that keeps no bytes, only how many each
    cell read had (what the check reports as read)."""

    size = 0
    budget = 1 << 62

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def keep(self, path: str, data: bytes) -> None:
        self.sizes[path] = len(data)


def _cell_checks(table: str, rows: list[HashCacheRow]) -> dict[str, tuple[str, int]]:
    """row path -> (SHA-256, bytes) of the cells ``rows`` name (``file:row:column``): the file
    opened once, each column read a row group at a time, under the build's cell rule. Cells
    that cannot be read are left out; so is everything without pyarrow (a reader of the table
    has it, and hashes it again)."""
    columns: dict[str, dict[int, str]] = {}
    for r in rows:
        row, _, column = split_item_path(r.path)[1].partition(":")
        if row.isdigit():
            columns.setdefault(column, {})[int(row)] = r.path
    try:
        pyarrow_module()
    except ConfigError:
        return {}
    f, sizes = TableFile(table), CellSizes()
    out: dict[str, tuple[str, int]] = {}
    for column, wanted in columns.items():
        try:
            kind = stored_cell_kind(f.schema().field(column).type)
        except (OSError, ValueError, KeyError):
            continue
        got = cell_digests(f, column, kind, wanted, sizes).digests
        for path, sha in got.items():
            if isinstance(sha, str):
                out[path] = (sha, sizes.sizes[path])
    return out


def check_hash_cache(layout: Layout, progress: Progress = None) -> HashCheck:
    """Hash again every file whose hash-cache row a reader would trust now; report mismatches.

    Raises:
        StoreError: the catalog cannot be opened (callers check its health first).
    """
    with contextlib.closing(Catalog(layout)) as cat:
        rows = [r for r in hash_cache_rows(cat) if _trusted_now(r)]
    wrong: list[HashMismatch] = []
    files = nbytes = done = 0
    for checked in map_in_threads(check_group, row_groups(rows)):
        for row, got in checked:
            if got is not None:
                files += 1
                nbytes += got[1]
                if got[0] != row.sha256:
                    wrong.append(HashMismatch(row.path, row.sha256, got[0]))
        done += len(checked)
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


# == verify_named ==================================================================================
# ``featbake verify`` where the place's catalog names what to check (a bucket store, from any
# node): the place's own bytes of every shard the catalog names.
#
# Each shard must be held by the place, and its bytes must hash to its name and pass their header
# and checksums. Each is brought through the place into a scratch folder of this verify's own in
# the tier's ``tmp/`` (one at a time, deleted after its check; a second verify on the node has
# its own), never read from a tier's copy: a tier holding a good copy of a shard says nothing
# about the object other nodes fetch. Shards no catalog names are a note (gc deletes
# them once older than the place's age). Where the place refuses repair, the report names each
# damaged or missing shard and what to do (delete it, build again: a build encodes what a missing
# shard held).
def verify_named(layout: Layout, progress: Progress = None) -> VerifyReport:
    """Check the place's bytes of every shard the catalog names (see the section comment).

    Raises:
        StoreError: the place cannot be read.
    """
    place = place_of(layout)
    t0 = time.perf_counter()
    named = place.named_shards()
    listed = place.shard_objects()
    report = VerifyReport(str(place), VerifyStatus.CLEAN, 0, 0, tmp_findings(layout))
    with holding(verify_scratch(layout.tmp), folder=True) as scratch:  # no sweep takes it
        for i, name in enumerate(sorted(named)):
            finding = _check_held(place, scratch.path, name, name in listed)
            if finding is None:
                report.shards_checked += 1
                report.bytes_checked += listed[name]
            else:
                report.findings.append(finding)
            if progress:
                progress(GcProgress("verify", i + 1, len(named)))
    unnamed = sorted(set(listed) - set(named))
    if unnamed:
        report.findings.append(
            Finding(
                FindingKind.ORPHAN_SHARD,
                f"{len(unnamed)} shard objects",
                "no catalog version names them; gc deletes them once older than --retention "
                "(--grace in a directory)",
                False,
            )
        )
    report.remaining = [f for f in report.findings if f.damage]
    report.status = VerifyStatus.DAMAGED if report.remaining else VerifyStatus.CLEAN
    report.seconds = time.perf_counter() - t0
    return report


def _brought_in(place: Place, name: str, path: Path) -> bool:
    """Whether the place's shard ``name`` is now in scratch file ``path``; False where the
    place holds no such shard (asked of the place, never told by the scratch: a download that
    failed because the scratch went, on a disk without locks, is tried once more)."""
    for last in (False, True):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            place.download_shard(name, path)
            return True
        except FileNotFoundError:
            if last or not place.has_shard(name):
                return False
    return False


def _checked(path: Path) -> ShardCheck | None:
    """The check of the shard brought into scratch file ``path`` (removed after it); None where
    the file went before its check (a sweep on a disk without locks: bring it in again)."""
    try:
        check = check_shard(path)
        if not check.sound and not os.path.lexists(path):
            return None
        return check
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _brought_and_checked(place: Place, name: str, path: Path) -> ShardCheck | None:
    """The check of the place's shard ``name`` brought into scratch file ``path``; None where
    the place no longer holds it. A copy gone before its check is brought in again.

    Raises:
        StoreError: the copy went twice (a gc sweeping this node's ``tmp/`` over and over, on
            a disk without locks): nothing is said of the shard.
    """
    for _ in range(2):
        if not _brought_in(place, name, path):
            return None
        check = _checked(path)
        if check is not None:
            return check
    raise StoreError(
        f"verify's copy of shard {name} in {path.parent.parent} was removed twice before it was "
        "checked (a gc on this node, on a disk without locks?); run verify again"
    )


def _check_held(place: Place, scratch: Path, name: str, listed: bool) -> Finding | None:
    """The finding for the place's shard ``name`` (None when it is sound)."""
    where = place.shard_where(name)
    if not listed:
        return Finding(
            FindingKind.MISSING_SHARD,
            where,
            "the catalog names it, the store holds no such shard (object); build again to "
            "encode what it held",
            True,
        )
    check = _brought_and_checked(place, name, scratch / name[:2] / f"{name}.safetensors")
    if check is None:
        return Finding(FindingKind.MISSING_SHARD, where, "deleted while verify ran", True)
    if check.sound:
        return None
    return Finding(
        FindingKind.CORRUPT_SHARD,
        where,
        f"{check.problem}; delete this object, then build again (a build encodes what it held)",
        True,
    )
