"""Typed records of the catalog's rows: every column read or written by name, never by position.

Records that callers used to receive as plain tuples (root items, encoder rows, feature rows of a
shard) are ``NamedTuple``s, so ``path, key = item`` and ``dict(items)`` keep working while new
code reads ``item.key``. Each record that maps a table row says which columns it reads
(:func:`columns`), so a ``SELECT`` is built from the record's fields, not typed twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from featbake.store.shard_format import tensor_name

#: A cached hash is "racy" when its file's mtime lies within this long of the moment the hash was
#: recorded: a write in that window can leave (size, mtime, ctime, inode) unchanged on file systems
#: with coarse timestamps (git's index has the same rule, with the same one-second margin).
RACY_NS = 1_000_000_000

#: Hash-cache ids under which encoder fingerprints are cached (``encoder-fp:file:PATH``, ...).
ENCODER_FP_PREFIX = "encoder-fp:"


def columns(record: type[Any]) -> str:
    """The comma-separated column list of a NamedTuple record (its fields, in order)."""
    return ", ".join(record._fields)


class FileStat(NamedTuple):
    """What the hash cache compares to say a file is unchanged since it was hashed.

    ``ctime_ns`` is there because no user tool can set it: ``cp -p`` (or unpacking an archive
    with fixed dates) over an existing file keeps its size, mtime and inode, but not its ctime.
    (A NamedTuple, not a dataclass: a million of them are made when a large folder is indexed.)
    """

    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int = 0

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileStat:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def racy(self, recorded_ns: int) -> bool:
        """True if a hash recorded at ``recorded_ns`` cannot vouch for this stat.

        A file modified within :data:`RACY_NS` of the recording (or "in the future", a clock
        skew) may have changed after it was read without its stat changing.
        """
        return self.mtime_ns > recorded_ns - RACY_NS or self.ctime_ns > recorded_ns - RACY_NS


class HashEntry(NamedTuple):
    """A trusted hash-cache entry: the file's stat when it was hashed, and its digest."""

    stat: FileStat
    sha256: str


class HashRow(NamedTuple):
    """One row to remember in the hash cache: ``path`` with ``stat`` hashed to ``sha256``."""

    path: str
    stat: FileStat
    sha256: str


class HashCache(Protocol):
    """The hash cache as builds and datasets use it: the catalog's, or that of a stand-in that
    writes fragments (a rank of a sharded build, a serving process on a shared filesystem)."""

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]: ...

    def put_hashes(self, rows: Iterable[HashRow], *, recorded_ns: int | None = None) -> None: ...


class HashCacheRow(NamedTuple):
    """A ``hash_cache`` row as stored (``ctime_ns`` and ``recorded_ns`` are 0 in old rows)."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int
    sha256: str
    recorded_ns: int

    @classmethod
    def of(cls, path: str, stat: FileStat, sha256: str, recorded_ns: int) -> HashCacheRow:
        """The row: ``path`` with ``stat`` hashed to ``sha256``, stat taken at ``recorded_ns``."""
        return cls(path, stat.size, stat.mtime_ns, stat.inode, stat.ctime_ns, sha256, recorded_ns)

    @property
    def stat(self) -> FileStat:
        return FileStat(self.size, self.mtime_ns, self.inode, self.ctime_ns)

    def trusted(self) -> HashEntry | None:
        """The entry, or None if it is racy or predates ctime (then the file is hashed again)."""
        return trusted_entry(self)


def trusted_entry(row: tuple) -> HashEntry | None:
    """:meth:`HashCacheRow.trusted` of a raw row (the loop of a large folder's lookup)."""
    _, size, mtime, inode, ctime, sha, recorded = row
    if recorded <= 0 or ctime <= 0 or max(mtime, ctime) > recorded - RACY_NS:
        return None
    return HashEntry(FileStat(size, mtime, inode, ctime), sha)


@dataclass(frozen=True)
class Location:
    """Where one tensor of a feature lives."""

    key: str
    part: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def tensor(self) -> str:
        return tensor_name(self.key, self.part)


class RootItem(NamedTuple):
    """One item of a root's manifest: the input's path (relative to the data folder) and key."""

    path: str
    key: str


@dataclass(frozen=True)
class RootSpec:
    """What a root is a build of: its name, data folder, encoder and recipe (a ``roots`` row
    without its counts and times). Every writer of roots takes one."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict

    def root(self, items: int, created: float, last_used: float) -> Root:
        """The ``roots`` row of this spec with ``items`` items."""
        return Root(
            self.name, self.data, self.encoder_label, self.encoder_fp, self.recipe_fp,
            self.recipe, items, created, last_used,
        )  # fmt: skip


@dataclass(frozen=True)
class Root:
    """A named manifest: the keys one build of (data, encoder, recipe) produced, in file order."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    items: int
    created: float
    last_used: float

    #: The ``roots`` table's columns, in the order :meth:`row` gives them.
    COLUMNS = (
        "name",
        "data",
        "encoder_label",
        "encoder_fp",
        "recipe_fp",
        "recipe",
        "items",
        "created",
        "last_used",
    )

    def row(self) -> tuple[Any, ...]:
        """The values of :attr:`COLUMNS` (the recipe as canonical JSON)."""
        return (
            self.name,
            self.data,
            self.encoder_label,
            self.encoder_fp,
            self.recipe_fp,
            json.dumps(self.recipe, sort_keys=True),
            self.items,
            self.created,
            self.last_used,
        )

    @classmethod
    def from_row(cls, values: Any) -> Root:
        """A root from the values of a ``SELECT`` of :attr:`COLUMNS`, matched by name."""
        row = dict(zip(cls.COLUMNS, values, strict=True))
        return cls(
            name=row["name"],
            data=row["data"],
            encoder_label=row["encoder_label"],
            encoder_fp=row["encoder_fp"],
            recipe_fp=row["recipe_fp"],
            recipe=json.loads(row["recipe"]),
            items=row["items"],
            created=row["created"],
            last_used=row["last_used"],
        )


class EncoderRow(NamedTuple):
    """An encoder the store has seen, and how the user named it."""

    fp: str
    label: str
    kind: str
    first_seen: float
    last_used: float


@dataclass(frozen=True)
class ShardRow:
    """A shard as the catalog records it."""

    id: int
    name: str
    bytes: int
    data_bytes: int
    items: int
    encoder_fp: str
    recipe_fp: str
    created: float

    COLUMNS = ("id", "name", "bytes", "data_bytes", "items", "encoder_fp", "recipe_fp", "created")


@dataclass(frozen=True)
class ShardUsage:
    """The feature rows that point into one shard."""

    rows: int
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class FeatureTotals:
    """Counts over distinct keys: all stored, and those some root reaches."""

    features: int
    nbytes: int
    live_features: int
    live_nbytes: int


@dataclass(frozen=True)
class FeatureRef:
    """One feature row, exactly (gc deletes by (key, part, shard) so a moved row is spared)."""

    key: str
    part: str
    shard_id: int
    nbytes: int
    last_used: float

    COLUMNS = ("key", "part", "shard_id", "nbytes", "last_used")


class ShardFeature(NamedTuple):
    """A feature row as seen from its shard (``shape`` is the stored JSON list)."""

    key: str
    part: str
    dtype: str
    shape: str
    nbytes: int


class FeatureRow(NamedTuple):
    """A whole ``features`` row (``shape`` is the stored JSON list), as verify compares it with
    its shard's header."""

    key: str
    part: str
    shard_id: int
    dtype: str
    shape: str
    nbytes: int

    @property
    def tensor(self) -> str:
        return tensor_name(self.key, self.part)

    def matches(self, dtype: str, shape: tuple[int, ...]) -> bool:
        """Whether the header's dtype and shape are what this row records."""
        try:
            return self.dtype == dtype and json.loads(self.shape) == list(shape)
        except (ValueError, RecursionError):
            return False


class MovedRow(NamedTuple):
    """A feature row compaction moves: it is repointed only if it still names ``old_shard_id``."""

    key: str
    part: str
    old_shard_id: int
