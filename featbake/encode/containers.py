"""Inputs inside containers: webdataset tar shards, and tables (parquet files and Hugging Face
datasets saved to disk), each row or sample one item (issue 29 item 3).

Both are :class:`featbake.encode.inputs.Inputs` behind the same seam as a folder: the build and
the dataset ask them for the items (in the data's own order), each item's full name, its digest
through the hash cache, and a source that decodes it. An item is named ``<container>:<inner>``:
``/data/shard-000.tar:sample0001.jpg`` (a tar member) or ``/data/train.parquet:12`` (a table's row),
and its digest is the SHA-256 of the member's or the cell's bytes, so the same image as a file and
as a tar member (or a parquet cell) has the same key and is stored once.

**Hash cache.** An item's entry is keyed by its full name (a table's also by its column) and
compared on its container's stat (size, mtime, inode, ctime), as a file's is: a rebuild over
unchanged containers reads no member or cell (a tar's member headers are listed, a table's ids
read). Entries follow git's "racy" rule as files do (see ``FileStat.racy``).

**Decoding** reads the one member (a seek and a read in the tar) or the cell (its row group, kept
while the next rows are decoded) and hands the bytes to the recipe's source; nothing is extracted
to disk. The container's stat must still be the one the digest was taken with, or the item fails
as a file changed mid-build does.

**Bad rows**: a truncated tar member (or one declaring more bytes than the tar holds), a sparse
member (GNU ``tar -S``), a sample without the asked member, a null cell, a cell without bytes, a
table file whose column holds neither bytes nor an Audio/Image struct; each is one line naming
the container and member or row, skipped, and the build exits 3.

The bytes are read by the store's one reader per container (``featbake.store.containers``,
which ``verify`` reads them with too) through the byte seam (``featbake.store.byteplace``: a
local file, or an object by ranged GETs, a ``.tar.gz`` object whole); this module turns what
they read into items, digests through the hash cache, and tensors.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol

import torch

from featbake.encode.fingerprints import HeldBytes
from featbake.encode.objects import never_racy_ns
from featbake.encode.sources import ScanResult, SkippedInput, Source
from featbake.errors import SourceError
from featbake.progress import Progress
from featbake.store.byteplace import bytes_at, object_head
from featbake.store.byteplace import expand_braces as expand_braces
from featbake.store.byteplace import hidden_name as hidden_name
from featbake.store.byteplace import object_fetch as object_fetch
from featbake.store.byteplace import ranged_object as ranged_object
from featbake.store.containers import (
    TAR_SUFFIXES,
    CellKind,
    Member,
    ReadBack,
    TableFile,
    cell_bytes,
    cell_digests,
    cell_kind,
    is_tar,
    listing_of,
    listing_text,
    pyarrow_module,
    replaced_files,
    split_item_path,
    stat_around,
)
from featbake.store.hash_cache import FileStat, HashCache, HashRow
from featbake.store.objects import ObjectInfo, object_stat

if TYPE_CHECKING:
    import pyarrow as pa


def _stat_or_none(path: str) -> FileStat | None:
    """A container's stat: a file's, or an object's (size, last change, ETag) by one HEAD."""
    return bytes_at(path).stat(path)


# == hashing =======================================================================================
class ItemRef(NamedTuple):
    """One item to hash: its full name, its hash-cache id, its container and where inside it."""

    path: str
    cache_id: str
    container: str
    where: int  # a table's row (0 for a tar member, found by its name)


#: container, the refs to read in it -> what the reading gave (see :class:`ReadBack`).
ReadDigests = Callable[[str, list[ItemRef]], ReadBack]


def hash_items(
    catalog: HashCache,
    refs: Sequence[ItemRef],
    read: ReadDigests,
    progress: Callable[[Progress], None] | None = None,
    stats: dict[str, FileStat] | None = None,
    stat_of: Callable[[str], FileStat | None] = _stat_or_none,
) -> tuple[dict[str, str], dict[str, str]]:
    """SHA-256 of each item, reading only the containers whose stat the hash cache does not know.

    ``read(container, refs)`` reads the items of one container (in its order) and returns each
    digest, or a 1-tuple with why the item cannot be read, with the container's stat as of the
    reading (:class:`ReadBack`): digests whose bytes came from another stat than the one looked
    up fail. ``stats`` is filled with each item's container stat, which decoding checks again.
    ``stat_of`` gives a container's stat before it is read (a bucket's tars: from the scan's
    listing, no request).

    Returns:
        (path -> sha256, path -> reason for items that could not be read)
    """
    stats = {} if stats is None else stats
    failed: dict[str, str] = {}
    stat_time = time.time_ns()  # before the stats: what a racy entry is measured against
    by_container: dict[str, list[ItemRef]] = {}
    for ref in refs:
        by_container.setdefault(ref.container, []).append(ref)
    container_stat = {c: stat_of(c) for c in by_container}
    cached = catalog.cached_hashes([r.cache_id for r in refs])
    digests: dict[str, str] = {}
    todo: dict[str, list[ItemRef]] = {}
    for ref in refs:
        st = container_stat[ref.container]
        if st is None:
            failed[ref.path] = f"cannot stat {ref.container}"
            continue
        stats[ref.path] = st
        hit = cached.get(ref.cache_id)
        if hit is not None and hit.stat == st:
            digests[ref.path] = hit.sha256
        else:
            todo.setdefault(ref.container, []).append(ref)
    if progress:
        progress(Progress("hash", len(digests), len(refs)))
    fresh: list[HashRow] = []
    for container, wanted in todo.items():
        got = read(container, wanted)
        changed = got.stat != container_stat[container]
        for ref in wanted:
            one = got.digests.get(ref.path, ("not read",))
            if changed and not isinstance(one, tuple):
                one = (f"{container} changed while featbake was reading it",)
            if isinstance(one, tuple):
                failed[ref.path] = one[0]
            else:
                digests[ref.path] = one
                fresh.append(HashRow(ref.cache_id, stats[ref.path], one))
        if progress:
            progress(Progress("hash", len(digests) + len(failed), len(refs)))
    if any(bytes_at(r.path).versioned for r in fresh):  # never racy: an ETag (store/byteplace.py)
        stat_time = never_racy_ns(fresh)
    catalog.put_hashes(fresh, recorded_ns=stat_time)
    return digests, failed


class Listed(Protocol):
    """Container inputs whose containers may be bucket objects (:class:`WebDataset`,
    :class:`Table`): their scan's stats, and the listings it read and has not recorded yet."""

    @property
    def remote(self) -> bool: ...

    listed: dict[str, FileStat]
    fresh: list[HashRow]


def hash_listed(
    inputs: Listed,
    catalog: HashCache,
    refs: Sequence[ItemRef],
    read: ReadDigests,
    progress: Callable[[Progress], None] | None,
    stats: dict[str, FileStat] | None,
) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`hash_items` over ``inputs``' containers: in a bucket with the stats its scan
    listed (no request), then recording the listings the scan read (a rebuild reads them from
    the hash cache)."""
    if not inputs.remote:
        return hash_items(catalog, refs, read, progress, stats)
    got = hash_items(catalog, refs, read, progress, stats, inputs.listed.get)
    if inputs.fresh:
        catalog.put_hashes(inputs.fresh, recorded_ns=never_racy_ns(inputs.fresh))
        inputs.fresh = []
    return got


# == webdataset ====================================================================================
# A webdataset shard is a plain tar; the members of one sample are consecutive and share a key:
# the member's name up to the first dot of its last path component (webdataset's
# ``base_plus_ext``: ``images/0001.seg.png`` is key ``images/0001``, extension ``seg.png``).
# Names without a dot, and top-level ``__name__`` metadata members, belong to no sample, as in
# webdataset. The member a build encodes is ``--column EXT`` (``jpg``, ``flac``) or, by default,
# the sample's first member whose last extension the recipe's source reads.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")


def key_and_extension(name: str) -> tuple[str, str] | None:
    """(sample key, extension in lower case) of a member's name, or None (no sample's).

    Example:
        >>> key_and_extension("images/0001.seg.PNG")
        ('images/0001', 'seg.png')
    """
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    match = _KEY_EXT.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


@dataclass
class Sample:
    """One webdataset sample: its key, its tar, and its members by extension (in tar order)."""

    key: str
    tar: str
    members: dict[str, Member] = field(default_factory=dict)


def list_members(tar: str, size: int | None = None) -> list[Member]:
    """The regular-file members of ``tar``, in order, from their headers only (see
    :func:`featbake.store.containers.list_members`); a tar in a bucket by ranged GETs of
    :data:`~featbake.store.containers.HEADER_BLOCK` bytes (see :meth:`BytePlace.tar_members
    <featbake.store.byteplace.BytePlace.tar_members>`).

    Raises:
        SourceError: the file cannot be opened or is not a tar.
    """
    return bytes_at(tar).tar_members(tar, size)


def samples_of(tar: str, members: Sequence[Member]) -> tuple[list[Sample], list[SkippedInput]]:
    """The samples of one tar (consecutive members sharing a key), and members set aside (a
    second member with the same extension in one sample)."""
    samples: list[Sample] = []
    skipped: list[SkippedInput] = []
    for m in members:
        split = key_and_extension(m.name)
        if split is None:
            continue
        key, ext = split
        if not samples or samples[-1].key != key:
            samples.append(Sample(key, tar))
        held = samples[-1].members
        if ext in held:
            skipped.append(SkippedInput(f"{tar}:{m.name}", f"a second .{ext} member of {key}"))
            continue
        held[ext] = m
    return samples, skipped


def unreadable_carried(sample: Sample, chosen: Member) -> list[SkippedInput]:
    """One line for each carried member of ``sample`` that no reader takes (sparse, past the
    tar's end): named at the scan, as ``row()`` names it when asked (the chosen member's own
    problem fails it when it is hashed)."""
    return [
        SkippedInput(f"{sample.tar}:{m.name}", m.problem.removeprefix(f"{sample.tar}:{m.name}: "))
        for m in sample.members.values()
        if m.problem and m is not chosen
    ]


def read_member(tar: str, member: Member) -> bytes:
    """The bytes of one member: a file's by a seek and a read, an object's by one ranged GET.

    Raises:
        SourceError: the member cannot be read (sparse, past the tar's end), the tar cannot be
            read, or it ends inside the member (truncated).
    """
    return bytes_at(tar).read_member(tar, member)[0]


def read_member_checked(tar: str, member: Member) -> tuple[bytes, FileStat | None]:
    """The bytes of one member and its tar's stat as of reading them (None: a file gone): an
    object's from the ranged GET that carried the bytes (one request, no HEAD beside it), a
    file's stat'ed after the read.

    Raises:
        SourceError: the member cannot be read, or the tar ends inside it (truncated).
    """
    return bytes_at(tar).read_member(tar, member)


def member_digests(tar: str, members: list[Member], held: HeldBytes | None = None) -> ReadBack:
    """member name -> SHA-256 of its bytes (in tar order), or a 1-tuple: why not; and the
    tar's stat as of the reading (see :class:`ReadBack`): a file's through one open file, an
    object's by one ranged GET per run of adjacent members.

    With ``held``, a member that fits its budget is read whole and its bytes kept there for the
    build to decode (a first build reads each member once); others are streamed in chunks.
    """
    return bytes_at(tar).member_digests(tar, members, held)


# -- tars in a bucket ------------------------------------------------------------------------------
# ``--data 's3://b/shards/shard-{000..009}.tar'``: the shards are listed with one LIST of their
# folder, and each is read in place by ranged GETs, never downloaded whole:
#
# * its **member listing** (names, data offsets, sizes) from its headers, read through
#   :class:`RangedObject` (one GET per :data:`HEADER_BLOCK`, so small members' headers come
#   many per GET), and cached in the store's hash cache under ``tar-members:<url>``, compared on
#   the object's (size, last change, ETag) as bucket inputs' digests are (encode/objects.py): the
#   row's digest column holds the listing as canonical JSON. A rebuild over unchanged shards reads
#   the listing from there, and the members' digests too: it reads nothing beyond the LIST.
# * each **member** to hash by one ranged GET per run of members of at most :data:`RUN_BYTES`
#   (a sample's members are adjacent), to decode by one ranged GET of its bytes.
#
# A shard rewritten since it was listed has another ETag: its listing and digests are read again.
# A member decoded is checked against the shard's stat as the ranged GET of its bytes gives it (a
# ranged response's ETag, Last-Modified and Content-Range total are the object's): one request
# per member, no HEAD; a local member is checked by its tar's stat. Hashing is checked the same
# way: the digests of a shard stand only if every ranged GET that carried their bytes gave the
# stat the listing gave (:class:`ReadBack`), so a first build makes LISTs and GETs, no HEAD. A
# bucket's parquet file is read likewise (:class:`RangedObject` keeps its responses' stats): one
# HEAD at the scan for its stat (a single file is not listed), none for its hash or its cells.
#
# A ``.tar.gz`` shard in a bucket cannot be read by ranges: it is read whole (one GET) and
# decompressed in memory to list it, again to hash it (a build decodes from the bytes hashed),
# and once per member a dataset decodes (listings and digests come from the hash cache by ETag,
# as a plain tar's do; see ``featbake.store.byteplace.gzip_object_fetch``).

#: The hash-cache id prefix of a tar's member listing (the row's digest column is the listing).
LISTING_PREFIX = "tar-members:"
#: The same for a bucket's parquet file: its schema and row ids (see :meth:`Table._listing`).
TABLE_PREFIX = "table-rows:"


def carried_value(ext: str, data: bytes) -> Any:
    """A carried member as a Python value: ``.txt`` str, ``.cls`` int, ``.json`` decoded, others
    the bytes (also a ``.cls``/``.json``/``.txt`` that does not decode as such)."""
    last = ext.rsplit(".", 1)[-1]
    try:
        if last == "txt":
            return data.decode("utf-8")
        if last == "cls":
            return int(data.decode("utf-8").strip())
        if last == "json":
            return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return data
    return data


def is_webdataset(where: str) -> bool:
    """Whether ``--data`` names webdataset shards: a ``.tar`` (file, URL or brace pattern), or a
    folder or bucket prefix whose visible files are all ``.tar`` (one at least)."""
    return is_tar(where) or bytes_at(where).holds_only(where, TAR_SUFFIXES)


class WebDataset:
    """Webdataset tar shards as a build's inputs (an ``Inputs``): each sample one item, named by
    its key, in shard and tar order.

    Args:
        data: a ``.tar``, a folder of ``.tar`` files, a brace pattern ``shard-{000..009}.tar``,
            or a bucket prefix holding only ``.tar`` objects (``s3://bucket/shards/``).
        column: the extension of the member to encode (``jpg``); None: the sample's first member
            of the source's kind.
    """

    def __init__(self, data: str, column: str | None = None) -> None:
        self.column = column.lower().lstrip(".") if column else None
        #: a tar in a bucket -> its stat from the scan's listing (see "tars in a bucket")
        self.listed: dict[str, FileStat] = {}
        #: the store's hash cache, where the scan looks up tars' member listings (set by the
        #: build or the dataset for the scan), and the listings read to be recorded there
        self.known: HashCache | None = None
        self.fresh: list[HashRow] = []
        self.place = bytes_at(data)
        self.where, self.folder, tars = self.place.shards(data)
        #: a bucket prefix of tars only: its shards are the scan's listing's ``.tar`` objects
        self.prefix = tars is None
        self.tars = tars or []
        self.samples: dict[str, Sample] = {}  # key -> sample, in the data's order
        self.chosen: dict[str, Member] = {}  # key -> the member encoded
        self.index = MemberIndex()  # full name -> member, for hashing and decoding

    @property
    def stat_tells_change(self) -> bool:
        return False  # an item's stat is its shard's: revalidate cannot stat a member

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The samples of every shard, in order, and what is set aside (with why).

        Raises:
            SourceError: no shard holds a sample with the member to encode, or two samples
                share a key.
        """
        self.samples, self.chosen = {}, {}  # a scan starts afresh
        self.index.listed.clear()  # in place: a source made before the scan reads through it
        self.index.at.clear()
        skipped: list[SkippedInput] = []
        seen: dict[str, str] = {}
        objects = self._list_objects()
        if self.prefix:
            self.tars = sorted(
                url
                for url in objects
                if is_tar(url) and not hidden_name(url[len(self.folder) + 1 :])
            )
        for tar in self.tars:
            try:
                samples, odd = samples_of(tar, self._members(tar, objects))
            except SourceError as e:
                skipped.append(SkippedInput(os.path.relpath(tar, self.folder), str(e)))
                continue
            skipped += odd
            for sample in samples:
                self._add(sample, extensions, seen, skipped)
        if not self.chosen:
            wanted = f".{self.column}" if self.column else ", ".join(extensions)
            shown = "; ".join(f"{s.path}: {s.reason}" for s in skipped[:3])
            raise SourceError(
                f"no sample with a member to encode ({wanted}) in {self.where}"
                + (f" ({shown})" if shown else "")
                + "; name the member with --column (e.g. --column jpg) or pick --source"
            )
        return ScanResult(list(self.chosen), skipped)

    @property
    def remote(self) -> bool:
        """Whether the shards are objects in a bucket (their stats are versions: see
        :attr:`featbake.store.byteplace.BytePlace.versioned`)."""
        return self.place.versioned

    def _list_objects(self) -> dict[str, ObjectInfo]:
        """The objects of the shards' folder in a bucket, by URL (one LIST); {} for files.

        Raises:
            StoreError: the bucket cannot be listed (no credentials, no such bucket, denied).
        """
        return self.place.listed(self.folder)

    def _members(self, tar: str, objects: dict[str, ObjectInfo]) -> list[Member]:
        """The members of ``tar``: a file's from its headers; an object's from the hash cache
        when its (size, last change, ETag) is the one listed there, else from its headers
        (recorded by :meth:`hash`).

        Raises:
            SourceError: the tar is missing or cannot be read as a tar.
        """
        if not self.remote:
            return self.index.listing(tar)
        info = objects.get(tar)
        if info is None:
            raise SourceError(f"{tar}: object not found")
        st = self.listed[tar] = object_stat(info)
        cache_id = LISTING_PREFIX + tar
        hit = self.known.cached_hashes([cache_id]).get(cache_id) if self.known else None
        if hit is not None and hit.stat == st and (members := listing_of(hit.sha256)):
            return members
        members = list_members(tar, info.size)
        self.fresh.append(HashRow(cache_id, st, listing_text(members)))
        return members

    def _add(
        self,
        sample: Sample,
        extensions: Sequence[str],
        seen: dict[str, str],
        skipped: list[SkippedInput],
    ) -> None:
        member = self.pick(sample, extensions)
        first = next(iter(sample.members.values()))
        if member is None:
            has = ", ".join(f".{e}" for e in sample.members)
            wanted = f"a .{self.column} member" if self.column else "a member of the source's kind"
            skipped.append(SkippedInput(sample.key, f"{sample.tar}: no {wanted} (it has {has})"))
            return
        if sample.key in seen:
            raise SourceError(
                f"two samples have the key {sample.key!r}: {seen[sample.key]} and "
                f"{sample.tar}:{first.name}; webdataset keys must be unique (rename one)"
            )
        seen[sample.key] = f"{sample.tar}:{first.name}"
        skipped.extend(unreadable_carried(sample, member))
        self.samples[sample.key] = sample
        self.chosen[sample.key] = member
        self.index.listed[f"{sample.tar}:{member.name}"] = member

    def pick(self, sample: Sample, extensions: Sequence[str]) -> Member | None:
        """The member of ``sample`` to encode, or None."""
        if self.column is not None:
            return sample.members.get(self.column)
        exts = {e.lower() for e in extensions}
        kinds = ((f".{e.rsplit('.', 1)[-1]}", m) for e, m in sample.members.items())
        return next((m for last, m in kinds if last in exts), None)

    def path(self, rel: str) -> str:
        """``shard.tar:member`` of sample ``rel``; ``<where>#<rel>`` for a sample no scan found
        (a root names it, its shard is gone: its feature is served from the store)."""
        if rel not in self.chosen:
            return f"{self.where}#{rel}"
        return f"{self.samples[rel].tar}:{self.chosen[rel].name}"

    def rel(self, path: str) -> str:
        name = split_item_path(path)[1]
        split = key_and_extension(name)
        return split[0] if split else name

    def size(self, rel: str) -> int:
        member = self.chosen.get(rel)
        return member.size if member else 0

    def row(self, rel: str) -> dict[str, Any]:
        """The sample's other members, decoded (see :func:`carried_value`), by extension.

        A local tar's members are read at the offsets its listing gave, so they stand only
        while the tar is the version listed (checked after the reads: a dataset asks for a
        row long after its scan, and a shard renamed over since holds other bytes there).

        Raises:
            SourceError: a member cannot be read (its tar is truncated there), or the tar was
                replaced since its members were listed.
        """
        if rel not in self.chosen:
            raise SourceError(f"{self.where}: no sample {rel!r} (its shard is gone or changed)")
        sample, chosen = self.samples[rel], self.chosen[rel]
        carried = {
            ext: read_member(sample.tar, m) for ext, m in sample.members.items() if m is not chosen
        }
        if self.index.replaced([sample.tar]):  # a local tar's version as listed (see ``at``)
            raise SourceError(f"{self.path(rel)}: {replaced_since_listed(sample.tar)}")
        return {ext: carried_value(ext, data) for ext, data in carried.items()}

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each member, reading only shards whose stat the hash cache does not know
        (see :func:`hash_items`); ``held`` keeps the bytes read, for the build to decode."""
        tars = {p: split_item_path(p)[0] for p in paths}
        replaced = self.index.replaced(set(tars.values()))
        refs = [ItemRef(p, p, tar, 0) for p, tar in tars.items() if tar not in replaced]

        def read(tar: str, wanted: list[ItemRef]) -> ReadBack:
            return self._read(tar, wanted, held)

        digests, failed = hash_listed(self, catalog, refs, read, progress, stats)
        failed.update({p: replaced[tar] for p, tar in tars.items() if tar in replaced})
        return digests, failed

    def _read(self, tar: str, refs: list[ItemRef], held: HeldBytes | None) -> ReadBack:
        try:
            members = [self.index.member(r.path)[1] for r in refs]
        except SourceError as e:
            return ReadBack({r.path: (str(e),) for r in refs}, None)
        got = member_digests(tar, members, held)
        # A local tar's members were read at the offsets listed: their digests stand only if
        # the tar is still the version listed (one renamed over it since reads other bytes).
        listed = got.stat == self.index.at.get(tar) or bytes_at(tar).versioned
        by_ref = zip(refs, members, strict=True)
        return ReadBack(
            {r.path: got.digests.get(m.name, ("not read",)) for r, m in by_ref},
            got.stat if listed else None,
        )

    def source(self, inner: Source) -> Source:
        return MemberSource(inner, self.index)


class MemberIndex:
    """Full name (``shard.tar:name``) -> member: what a scan found, and the members of any other
    tar named, found by listing that tar once (a dataset's worker, or a process that did not
    scan)."""

    def __init__(self, listed: dict[str, Member] | None = None) -> None:
        self.listed = dict(listed or {})
        #: a local tar -> its stat when its members were listed here (None: it changed while
        #: listed): the version their offsets are of, which hashing checks (see ``_read``)
        self.at: dict[str, FileStat | None] = {}

    def listing(self, tar: str) -> list[Member]:
        """:func:`list_members` of ``tar``, a local tar's stat as listed noted in :attr:`at`.

        Raises:
            SourceError: the file cannot be opened or is not a tar.
        """
        place = bytes_at(tar)
        if place.versioned:  # an object's version: the scan's listing stat, checked by hashing
            return place.tar_members(tar)
        members, self.at[tar] = stat_around(tar, lambda: place.tar_members(tar))
        return members

    def replaced(self, tars: Collection[str]) -> dict[str, str]:
        """tar -> why, for each local tar of ``tars`` listed here that is not the version
        listed any more (renamed over, or rewritten, since): its members' offsets are another
        file's, so no digest the hash cache holds for the file now may be decoded at them (a
        folder swapped back to a version hashed before keeps its files' stats)."""
        return replaced_files(self.at, tars, replaced_since_listed)

    def member(self, path: str) -> tuple[str, Member]:
        """(tar, member) of the item named ``path``.

        Raises:
            SourceError: the tar has no such member (or cannot be read).
        """
        tar = split_item_path(path)[0]
        found = self.listed.get(path)
        if found is None:
            for m in self.listing(tar):
                self.listed.setdefault(f"{tar}:{m.name}", m)
            found = self.listed.get(path)
        if found is None:
            raise SourceError(f"{path}: no such member in {tar} (rewritten since?)")
        return tar, found


def replaced_since_listed(tar: str) -> str:
    """Why a member of a local tar renamed over (or rewritten) after its listing fails."""
    return (
        f"{tar} was replaced since its members were listed (renamed over, or rewritten): "
        "its members' offsets are the other version's; rerun the build"
    )


class MemberSource:
    """The recipe's source over tar members: each read with a seek and decoded from its bytes
    (members found through a :class:`MemberIndex`)."""

    def __init__(self, inner: Source, index: MemberIndex | None = None) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.extensions = inner.extensions
        self.index = index or MemberIndex()

    def read(self, path: str) -> bytes:
        return read_member(*self.index.member(path))

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read member ``path`` (``shard.tar:name``) and decode its bytes.

        Raises:
            SourceError: it cannot be read (truncated, gone) or decoded.
        """
        name = os.fspath(path)
        return self.inner.load(name, io.BytesIO(self.read(name)) if data is None else data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode member ``path`` if its tar still has the stat its digest was taken at.

        Raises:
            SourceError: the tar changed since it was hashed, or the member cannot be decoded.
        """
        tar, member = self.index.member(path)
        if not bytes_at(tar).versioned and self.index.at.get(tar) != stat:
            raise SourceError(f"{path}: {replaced_since_listed(tar)}")
        data, now = read_member_checked(tar, member)
        if stat is None or now != stat:
            raise SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        return self.inner.load(path, io.BytesIO(data))


# == tables ========================================================================================
# Parquet files (one, or a folder of them) and Hugging Face datasets saved with
# ``save_to_disk`` (a folder of Arrow IPC *stream* files ``data-*.arrow`` listed in ``state.json``,
# beside ``dataset_info.json``), read with pyarrow, never through the ``datasets`` package. Each row
# is an item; ``--column`` names the cell to encode: an Audio or Image column (a struct of
# ``bytes`` and ``path``, as the Hub stores them) or a binary column. An item's id is its ``id``
# column when the table has one, else ``<file>:<row>``; its other columns are carried.
def hf_feature_types(schema: pa.Schema) -> dict[str, str]:
    """column -> the ``datasets`` feature type (``Audio``, ``Image``, ``Value``) recorded in the
    schema's ``huggingface`` metadata (written by ``datasets`` and the Hub), where there is one."""
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(meta)["info"]["features"] if meta else {}
    except (ValueError, KeyError, TypeError):
        return {}
    if not isinstance(features, dict):
        return {}
    return {k: v.get("_type", "") for k, v in features.items() if isinstance(v, dict)}


def is_table(where: str) -> bool:
    """Whether ``--data`` names a table: a ``.parquet`` file, a ``save_to_disk`` folder (or a
    DatasetDict's, refused with its splits named), or a folder of parquet files only."""
    if where.lower().endswith((".parquet", ".arrow")):
        return True
    return bytes_at(where).is_table_folder(where)


class Row(NamedTuple):
    """Where an item of a table lives: its file (index into the table's files) and row."""

    file: int
    row: int


class Table:
    """A table's rows as a build's inputs (an ``Inputs``): see the section's comment.

    Args:
        data: a ``.parquet`` file, a folder of them, or a folder ``save_to_disk`` wrote.
        column: the column to encode; None: the first Audio/Image (by the source's kind) or
            bytes column.
    """

    def __init__(self, data: str, column: str | None = None) -> None:
        pyarrow_module()
        #: a bucket's parquet file -> its stat, and the listings to record (see :meth:`_listing`)
        self.listed: dict[str, FileStat] = {}
        self.known: HashCache | None = None
        self.fresh: list[HashRow] = []
        self.place = bytes_at(data)
        self.where = self.place.resolve(data)
        self.folder = self.place.table_folder(self.where)
        self.files = self.place.table_files(self.where)
        self.column = column
        self.kinds: list[CellKind] = []  # per file
        self.text = False  # the source is text: the column holds strings (set by the scan)
        self.items: dict[str, Row] = {}  # id -> where, in the table's order
        self.positions: dict[str, int] = {}  # file path -> its index (see file_index)
        #: a local file -> its stat when the scan read its rows (None: it changed meanwhile):
        #: the version each id's row is of, which hashing and decoding check (carried into
        #: decode workers, which open the file afresh: see :meth:`replaced`)
        self.scanned: dict[str, FileStat | None] = {}

    @property
    def stat_tells_change(self) -> bool:
        return False  # an item's stat is its file's: revalidate cannot stat a row

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The rows of every file, in order, with ids; rows that cannot be items are set aside.

        Raises:
            SourceError: no file has the column (or a column of bytes to choose), or two rows
                share an id.
        """
        listings = [self._listing(f) for f in self.files]
        self.scanned = {f.path: f.stat() for f in self.files if not f.remote}
        schemas = [schema for schema, _ in listings]
        self.text = ".txt" in extensions  # the text source's: each cell is a text
        self.column = self.column or self.default_column(schemas, extensions)
        self.kinds = [
            cell_kind(s.field(self.column).type, self.text)
            if self.column in s.names
            else CellKind.OTHER
            for s in schemas
        ]
        if all(k is CellKind.OTHER for k in self.kinds):
            raise SourceError(self.no_column(schemas))
        skipped: list[SkippedInput] = []
        seen: dict[str, str] = {}
        self.items = {}  # a scan starts afresh
        for i, (f, (schema, ids)) in enumerate(zip(self.files, listings, strict=True)):
            why = self._unusable(schema, self.kinds[i])
            for row, ident in enumerate(ids):
                name = f"{f.path}:{row}"
                if why is not None:
                    skipped.append(SkippedInput(f"{self.rel_file(f)}:{row}", why))
                elif ident in seen:
                    raise SourceError(
                        f"two rows have the id {ident!r}: {seen[ident]} and {name}; ids must be "
                        "unique (fix the id column, or drop it to name rows <file>:<row>)"
                    )
                else:
                    seen[ident] = name
                    self.items[ident] = Row(i, row)
        return ScanResult(list(self.items), skipped)

    @property
    def remote(self) -> bool:
        """Whether the table is a parquet file in a bucket."""
        return self.place.versioned

    def _listing(self, f: TableFile) -> tuple[pa.Schema, list[str]]:
        """(schema, each row's id) of one file: an object's from the hash cache when its (size,
        last change, ETag) is the one recorded there (a row ``table-rows:<url>``: the schema
        as Arrow IPC in base64 and the ids, as JSON), else read (footer and ``id`` column, by
        ranged GETs) and recorded by :meth:`hash`.

        Raises:
            SourceError: the file (object) is missing or not a readable table file.
        """
        if not self.remote:
            schema = self._schema(f)
            return schema, self._ids(f, schema)
        info = object_head(f.path)
        if info is None:
            raise SourceError(f"{f.path}: object not found; check --data")
        st = self.listed[f.path] = object_stat(info)
        f.size, pa = info.size, pyarrow_module()
        cache_id = TABLE_PREFIX + f.path
        hit = self.known.cached_hashes([cache_id]).get(cache_id) if self.known else None
        if hit is not None and hit.stat == st:
            try:
                held = json.loads(hit.sha256)
                raw = base64.b64decode(held["schema"])
                f.known_schema = pa.ipc.read_schema(pa.py_buffer(raw))
                return f.known_schema, [str(i) for i in held["ids"]]
            except (ValueError, KeyError, TypeError):
                pass  # not a listing: read the file again
        schema = self._schema(f)
        ids = self._ids(f, schema)
        if f.stat() != st:  # the footer and ids came from another version than the HEAD's
            raise SourceError(f"{f.path}: changed while featbake was reading it; rerun the build")
        text = base64.b64encode(schema.serialize().to_pybytes()).decode()
        self.fresh.append(HashRow(cache_id, st, json.dumps({"schema": text, "ids": ids})))
        return schema, ids

    def _schema(self, f: TableFile) -> pa.Schema:
        try:
            return f.schema()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise SourceError(f"{f.path}: not a readable parquet or arrow file ({e})") from e

    def rel_file(self, f: TableFile) -> str:
        return os.path.relpath(f.path, self.folder)

    def _ids(self, f: TableFile, schema: pa.Schema) -> list[str]:
        """Each row's id: its ``id`` cell as text, else ``<file>:<row>``."""
        if "id" not in schema.names:
            return [f"{self.rel_file(f)}:{row}" for row in range(f.rows())]
        values = [v for _, chunk in f.column("id") for v in chunk.to_pylist()]
        return [
            f"{self.rel_file(f)}:{row}" if v is None else str(v) for row, v in enumerate(values)
        ]

    def _unusable(self, schema: pa.Schema, kind: CellKind) -> str | None:
        if self.column not in schema.names:
            return f"no column {self.column!r} in this file (it has {', '.join(schema.names)})"
        if kind is CellKind.OTHER:
            held = schema.field(self.column).type
            if self.text:
                return f"column {self.column!r} holds {held}, not text (a string column)"
            return (
                f"column {self.column!r} holds {held}, neither bytes nor an Audio/Image struct "
                "({bytes, path})"
            )
        return None

    def default_column(self, schemas: Sequence[pa.Schema], extensions: Sequence[str]) -> str:
        """The column to encode when none is named: the first whose Hugging Face feature type
        is the source's (Audio for audio, Image for image), else the first of bytes.

        Raises:
            SourceError: no column holds bytes: name one with --column.
        """
        schema = schemas[0] if schemas else None
        if schema is None:
            raise SourceError(f"{self.where}: no data file (parquet or arrow) found")
        wanted = "Image" if ".jpg" in extensions else "Audio"
        typed = hf_feature_types(schema)
        media = [
            n
            for n in schema.names
            if cell_kind(schema.field(n).type, self.text) is not CellKind.OTHER
        ]
        for name in media:
            if typed.get(name) == wanted or (self.text and name == "text"):
                return name
        if media:
            return media[0]
        raise SourceError(self.no_column(schemas))

    def no_column(self, schemas: Sequence[pa.Schema]) -> str:
        """Why the table has nothing to encode: the asked column is missing or holds no bytes
        in any file, or (none asked) no column holds bytes."""
        names = sorted({n for s in schemas for n in s.names})
        listed = f"(columns: {', '.join(names)})"
        held = "text (a string column)" if self.text else "bytes or an Audio/Image struct"
        if self.column is None:
            what = f"no column of {self.where} holds {held} {listed}"
        elif self.column not in names:
            what = f"{self.where} has no column {self.column!r} {listed}"
        elif self.text:
            what = f"column {self.column!r} of {self.where} holds no {held} {listed}"
        else:
            what = (
                f"column {self.column!r} of {self.where} holds neither bytes nor an Audio/Image "
                f"struct ({{bytes, path}}) in any file {listed}"
            )
        return f"{what}; name the column to encode with --column"

    def path(self, rel: str) -> str:
        """``file:row`` of item ``rel``; ``<where>#<rel>`` for a row no scan found (a root names
        it, its file is gone: its feature is served from the store)."""
        at = self.items.get(rel)
        return f"{self.where}#{rel}" if at is None else f"{self.files[at.file].path}:{at.row}"

    def size(self, rel: str) -> int:
        return 0  # not known before the cell is read

    def row(self, rel: str) -> dict[str, Any]:
        """The row's other columns as Python values (its ``id`` and encoded column left out).

        They are read through the reader the scan opened, so a local file's stand only while
        the file is still that version (checked after the read: a dataset asks for a row long
        after its scan, and an Arrow file rewritten in place shows its new bytes at the old
        offsets).

        Raises:
            SourceError: the row is unknown, or its file was replaced since its rows were read.
        """
        at = self.items.get(rel)
        if at is None:
            raise SourceError(f"{self.where}: no row {rel!r} (its file is gone or changed)")
        f = self.files[at.file]
        names = [n for n in f.schema().names if n not in (self.column, "id")]
        values = f.cells(at.row, names) if names else {}
        if not f.remote and (f.stat() is None or self.replaced([f.path])):
            raise SourceError(f"{self.path(rel)}: {replaced_since_scan(f.path)}")
        return values

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each cell, reading only files whose stat the hash cache does not know
        (see :func:`hash_items`); a row's entry is keyed by its name and the column. ``held``
        keeps the cells' bytes, for the build to decode."""
        files = {p: split_item_path(p) for p in paths}
        replaced = self.replaced({file for file, _ in files.values()})
        refs = [
            ItemRef(p, f"{p}:{self.column}", file, int(row))
            for p, (file, row) in files.items()
            if file not in replaced
        ]

        def read(file: str, wanted: list[ItemRef]) -> ReadBack:
            return self._read(file, wanted, held)

        digests, failed = hash_listed(self, catalog, refs, read, progress, stats)
        failed.update({p: replaced[file] for p, (file, _) in files.items() if file in replaced})
        return digests, failed

    def replaced(self, files: Collection[str]) -> dict[str, str]:
        """file -> why, for each local file of ``files`` the scan read that is not that
        version any more (renamed over, or rewritten, since): the ids' rows are the other
        version's, so no digest the hash cache holds for the file now may stand for them (a
        folder swapped back to a version hashed before keeps its files' stats)."""
        return replaced_files(self.scanned, files, replaced_since_scan)

    def _read(self, file: str, refs: list[ItemRef], held: HeldBytes | None) -> ReadBack:
        """The digests of ``refs``' cells in ``file``, one row group at a time, and the file's
        stat as of the reading (an object's from the GETs' responses: no HEAD)."""
        index = self.file_index(file)
        f, kind = self.files[index], self.kinds[index]
        return cell_digests(f, str(self.column), kind, {r.where: r.path for r in refs}, held)

    def source(self, inner: Source) -> Source:
        return CellSource(inner, self)

    def file_index(self, file: str) -> int:
        """The index of the data file ``file`` among the table's (after its scan).

        Raises:
            SourceError: ``file`` is not one of the table's files.
        """
        if not self.positions:
            self.positions = {f.path: i for i, f in enumerate(self.files)}
        found = self.positions.get(file)
        if found is None or found >= len(self.kinds):
            raise SourceError(f"{file}: not a scanned file of the table {self.where}")
        return found


def replaced_since_scan(file: str) -> str:
    """Why a row of a local table file renamed over (or rewritten) after the scan fails."""
    return (
        f"{file} was replaced since its rows were read (renamed over, or rewritten): each "
        "id's row is the other version's; rerun the build"
    )


class CellSource:
    """The recipe's source over a table's cells: each read from its row group (kept while the
    next rows are decoded) and decoded from its bytes.

    It reads through its :class:`Table`, whose column and files its scan settles (a build
    makes the source before it scans); pickled with it into decode workers, where each file is
    opened again.
    """

    def __init__(self, inner: Source, table: Table) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.extensions = inner.extensions
        self.table = table

    def read(self, path: str) -> bytes:
        """The bytes of the cell named ``path`` (``file:row``).

        Raises:
            SourceError: the file or row cannot be read, or the cell holds no bytes.
        """
        return self._cell(path, self.file_of(path))

    def file_of(self, path: str) -> TableFile:
        """The data file of the cell named ``path``.

        Raises:
            SourceError: it is not one of the table's scanned files.
        """
        return self.table.files[self.table.file_index(split_item_path(path)[0])]

    def _cell(self, path: str, f: TableFile) -> bytes:
        row = split_item_path(path)[1]
        column = str(self.table.column)
        kind = self.table.kinds[self.table.file_index(f.path)]
        try:
            cell = f.cells(int(row), [column])[column]
        except (OSError, ValueError, KeyError) as e:
            raise SourceError(f"{path}: cannot read column {column!r} ({e})") from e
        got = cell_bytes(cell, kind)
        if isinstance(got, str):
            raise SourceError(f"{path}: {got}")
        return got

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read cell ``path`` and decode its bytes.

        Raises:
            SourceError: it cannot be read or decoded.
        """
        name = os.fspath(path)
        return self.inner.load(name, io.BytesIO(self.read(name)) if data is None else data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode cell ``path`` if its bytes came from its file as it was when its digest was
        taken: a file stat'ed after the read, an object by the stat the ranged GETs that
        carried them gave (:meth:`TableFile.stat`; no HEAD).

        Raises:
            SourceError: the file changed since it was hashed, or the cell cannot be decoded.
        """
        changed = SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        f = self.file_of(path)
        if f.path in self.table.scanned and self.table.scanned[f.path] != stat:
            raise SourceError(f"{path}: {replaced_since_scan(f.path)}")
        try:
            data = self._cell(path, f)
        except SourceError:
            # A file rewritten since its scan may not parse at all (its footer moved): say so.
            if (now := f.stat()) is not None and now != stat:
                raise changed from None
            raise
        if stat is None or f.stat() != stat:
            raise changed
        return self.inner.load(path, io.BytesIO(data))


def webdataset_at(data: str, column: str | None = None) -> WebDataset:
    """The webdataset shards at ``data`` (see :class:`WebDataset`)."""
    return WebDataset(data, column)


def table_at(data: str, column: str | None = None) -> Table:
    """The table at ``data`` (see :class:`Table`)."""
    return Table(data, column)
