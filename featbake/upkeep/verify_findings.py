"""What ``featbake verify`` reports: finding kinds, the catalog's state, per-shard checks, the
scan, the report, and the exit codes.

These are records and typed states only; ``verify_scan.py`` makes them and ``verify_repair.py``
acts on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from featbake.store.layout import Layout
from featbake.store.writer import ShardEntry

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
