"""Webdataset tar shards as a build's inputs (issue 29 item 3): each sample one item.

A :class:`WebDataset` is an :class:`featbake.encode.inputs.Inputs` behind the same seam as a
folder: the build and the dataset ask it for the items (in shard and tar order), each item's
full name, its digest through the hash cache, and a source that decodes it. An item is named
``<tar>:<member>`` (``/data/shard-000.tar:sample0001.jpg``), and its digest is the SHA-256 of
the member's bytes, so the same image as a file and as a tar member has the same key and is
stored once.

**Hash cache.** An item's entry is keyed by its full name and compared on its tar's stat (size,
mtime, inode, ctime), as a file's is: a rebuild over unchanged shards reads no member (their
headers are listed). Entries follow git's "racy" rule as files do (see ``FileStat.racy``).

**Decoding** reads the one member (a seek and a read in the tar) and hands the bytes to the
recipe's source; nothing is extracted to disk. The tar's stat must still be the one the
digest was taken with, or the item fails as a file changed mid-build does.

**Bad rows**: a truncated tar member (or one declaring more bytes than the tar holds), a sparse
member (GNU ``tar -S``), a sample without the asked member; each is one line naming the tar and
member, skipped, and the build exits 3.

The bytes are read by the store's one tar reader (``featbake.store.containers``, which
``verify`` reads them with too) through the byte seam (``featbake.store.byteplace``: a local
file, or an object by ranged GETs, a ``.tar.gz`` object whole); this module turns what they
read into samples, digests through the hash cache, and tensors.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple

from featbake.encode.fingerprints import (
    Digester,
    HeldBytes,
    ItemRef,
    containers_of,
    digest_here,
    hash_listed,
)
from featbake.encode.sources import ScanResult, SkippedInput, Source
from featbake.errors import SourceError
from featbake.progress import Progress
from featbake.store.byteplace import bytes_at, shard_names
from featbake.store.containers import (
    CARD_SUFFIXES,
    TAR_SUFFIXES,
    Holder,
    Member,
    ReadBack,
    is_tar,
    listing_of,
    listing_text,
    replaced_files,
    split_item_path,
    stat_around,
)
from featbake.store.hash_cache import FileStat, HashCache, HashRow
from featbake.store.objects import ObjectInfo, object_stat
from featbake.units import counted

if TYPE_CHECKING:
    import torch

# A webdataset shard is a plain tar; the members of one sample are consecutive and share a key:
# the member's name up to the first dot of its last path component (webdataset's
# ``base_plus_ext``: ``images/0001.seg.png`` is key ``images/0001``, extension ``seg.png``).
# Names without a dot, and webdataset's metadata members (a top-level ``__name__``, anything in a
# top-level ``__name__/`` folder: its ``skip_meta``), belong to no sample, as in webdataset. The
# member a build encodes is ``--column EXT`` (``jpg``, ``flac``) or, by default, the sample's
# first member whose last extension the recipe's source reads.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
#: The members webdataset's tar reader skips as metadata (``tar_file_iterator``'s ``skip_meta``).
_META = re.compile(r"__[^/]*__($|/)")


def key_and_extension(name: str) -> tuple[str, str] | None:
    """(sample key, extension in lower case) of a member's name, or None (no sample's).

    Example:
        >>> key_and_extension("images/0001.seg.PNG")
        ('images/0001', 'seg.png')
    """
    if _META.match(name):
        return None
    match = _KEY_EXT.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


@dataclass
class Sample:
    """One webdataset sample: its key, its tar, and its members by extension (in tar order)."""

    key: str
    tar: str
    members: dict[str, Member] = field(default_factory=dict)


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


class LeftOut(NamedTuple):
    """A member of a sample left out beside the member of its kind that is encoded: the
    sample, the member encoded and the one left out, each by its extension."""

    sample: Sample
    chosen: str
    other: str


def columns_held(sample: Sample, extensions: Sequence[str]) -> list[str]:
    """The ``--column`` values naming ``sample``'s members of the source's kind (``clean.wav``
    and ``noisy.wav`` for audio), in the sample's order: what a message offers where the member
    asked for is not there.

    Example:
        >>> s = Sample("k", "a.tar", {"clean.wav": None, "noisy.wav": None, "txt": None})
        >>> columns_held(s, [".wav", ".flac"])
        ['clean.wav', 'noisy.wav']
    """
    exts = {e.lower() for e in extensions}
    return [e for e in sample.members if f".{e.rsplit('.', 1)[-1]}".lower() in exts]


def offered_example(offered: Sequence[str]) -> str:
    """`` (e.g. --column clean.wav)`` for the first column offered; empty where none is."""
    return f" (e.g. --column {offered[0]})" if offered else ""


def same_kind_left_out(sample: Sample, chosen: Member) -> list[LeftOut]:
    """The members of ``sample`` of the chosen member's kind (its last extension) that the
    build leaves out. ``spk1.utt1.wav`` and ``spk1.utt2.wav`` (a folder of files tarred as it
    is) are one sample ``spk1`` to webdataset, whose key ends at the first dot of a name:
    encoding the first member alone, unsaid, lost the other utterance. A sample's members of
    other kinds (``0001.jpg`` and its mask ``0001.seg.png``) are carried, as webdataset samples
    are meant to hold them."""
    ext = next(e for e, m in sample.members.items() if m is chosen)
    last = ext.rsplit(".", 1)[-1]
    return [
        LeftOut(sample, ext, e)
        for e, m in sample.members.items()
        if m is not chosen and e.rsplit(".", 1)[-1] == last
    ]


def left_out_note(left: Sequence[LeftOut], picked: Sequence[tuple[Sample, str]] = ()) -> str:
    """The build's one note on the members left out beside one of their kind (none: ""): how
    many, an example, and the choices. Not a failure: nothing is wrong with those members,
    and a rerun would leave them out again; naming the member with ``--column`` settles it
    (``x.wav`` beside ``x.noisy.wav``: ``--column wav`` keeps the choice made, ``--column
    noisy.wav`` encodes the other). ``picked`` is each encoded sample with the extension of
    the member encoded: when samples picked apart (``c`` holds only ``.noisy.wav``), no
    ``--column`` keeps the build (``--column wav`` fails ``c``): :func:`picked_apart_choices`.

    Example:
        >>> wav, noisy = Member("x.wav", 512, 9), Member("x.noisy.wav", 1536, 9)
        >>> s = Sample("x", "s.tar", {"wav": wav, "noisy.wav": noisy})
        >>> left_out_note([LeftOut(s, "wav", "noisy.wav")]).split(":")[0]
        '1 sample member of the kind encoded left out (e.g. s.tar'
    """
    if not left:
        return ""
    first = left[0]
    kept, other = first.sample.members[first.chosen], first.sample.members[first.other]
    count = counted(len(left), "sample member")
    kinds = Counter(ext for _, ext in picked)
    choices = (
        picked_apart_choices(kinds, picked)
        if len(kinds) > 1
        else f"--column {first.chosen} keeps this choice, --column {first.other} encodes the "
        "other (or rename the files to keys without dots)"
    )
    return (
        f"{count} of the kind encoded left out (e.g. {first.sample.tar}:{other.name} beside "
        f"{kept.name}, sample {first.sample.key!r}): a webdataset key ends at the first dot of "
        f"a name, so they are one sample; {choices}"
    )


def picked_apart_choices(kinds: Counter[str], picked: Sequence[tuple[Sample, str]]) -> str:
    """The choices :func:`left_out_note` names when samples encoded members of several
    extensions (``kinds``: how many samples each): the counts, and a ``--column`` only for a
    member every sample holds (a ``--column`` fails each sample without its member).

    Example:
        >>> wav, noisy = Member("a.wav", 512, 9), Member("a.noisy.wav", 1536, 9)
        >>> a = Sample("a", "s.tar", {"wav": wav, "noisy.wav": noisy})
        >>> c = Sample("c", "s.tar", {"noisy.wav": Member("c.noisy.wav", 2560, 9)})
        >>> picked_apart_choices(Counter(["wav", "noisy.wav"]), [(a, "wav"), (c, "noisy.wav")])[:60]
        'with no --column each sample encoded its own first member of'
    """
    (top, n), *rest = kinds.most_common()
    counts = f"{counted(n, 'sample')} encoded from .{top}, " + ", ".join(
        f"{k} from .{e}" for e, k in rest
    )
    held = [e for e in kinds if all(e in s.members for s, _ in picked)]
    named = (
        f"--column {held[0]} encodes that member of every sample"
        if held
        else "no --column keeps every sample (a sample without the member named fails)"
    )
    return (
        f"with no --column each sample encoded its own first member of the kind ({counts}); "
        f"{named}, or rename the files to keys without dots"
    )


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
# A ``.tar.gz`` shard in a bucket cannot be read by ranges, but it can be streamed: its stream is
# fetched in order by ranged GETs (``featbake.store.containers.GZIP_BLOCK`` each) and
# decompressed as it comes, once to list it and once to hash it (a build decodes from the bytes
# hashed), and up to its member for each member a dataset decodes (listings and digests come
# from the hash cache by ETag, as a plain tar's do); never held whole in memory.

#: The hash-cache id prefix of a tar's member listing (the row's digest column is the listing).
LISTING_PREFIX = "tar-members:"


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
    folder or bucket prefix whose visible files are all ``.tar`` (one at least) but for a
    dataset card beside them (``README.md``, a ``.json``: a Hub snapshot's, as a table's
    folder takes them)."""
    return is_tar(where) or bytes_at(where).holds_only(where, TAR_SUFFIXES, CARD_SUFFIXES)


class WebDataset:
    """Webdataset tar shards as a build's inputs (an ``Inputs``): each sample one item, named by
    its key, in shard and tar order.

    Args:
        data: a ``.tar``, a folder of ``.tar`` files, a brace pattern ``shard-{000..009}.tar``,
            or a bucket prefix holding only ``.tar`` objects (``s3://bucket/shards/``).
        column: the extension of the member to encode (``jpg``); None: the sample's first member
            of the source's kind.
    """

    #: Each shard the hash cache does not know may be read by any process (an engine's task),
    #: by the scan's listing: ``hash``'s ``digester`` (see ``inputs.digested_anywhere``).
    hashed_anywhere: ClassVar[bool] = True

    def __init__(self, data: str, column: str | None = None) -> None:
        self.column = column.lower().lstrip(".") if column else None
        #: a tar in a bucket -> its stat from the scan's listing (see "tars in a bucket")
        self.listed: dict[str, FileStat] = {}
        #: the store's hash cache, where the scan looks up tars' member listings (set by the
        #: build or the dataset for the scan), and the listings read to be recorded there
        self.known: HashCache | None = None
        self.fresh: list[HashRow] = []
        self.place = bytes_at(data)
        self.where, self.folder, tars, walk_notes = self.place.shards(data)
        #: the notes of the shards' folder's walk (folders it could not read)
        self.walk_notes = walk_notes
        #: a bucket prefix of tars only: its shards are the scan's listing's ``.tar`` objects
        self.prefix = tars is None
        self.tars = tars or []
        self.samples: dict[str, Sample] = {}  # key -> sample, in the data's order
        self.chosen: dict[str, Member] = {}  # key -> the member encoded
        self.index = MemberIndex()  # full name -> member, for hashing and decoding
        #: members the scan left out beside one of their kind that is encoded (its one note)
        self.left_out: list[LeftOut] = []
        #: the ``--column`` values the first sample without the member to encode holds (what
        #: the scan's messages offer instead; set by the scan)
        self.offered: list[str] = []

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
        self.left_out, self.offered = [], []
        objects = self._list_objects()
        if self.prefix:  # the one rule of a local folder's shards, on the names under the prefix
            names = shard_names(self.where, (url[len(self.folder) + 1 :] for url in objects))
            self.tars = [f"{self.folder}/{name}" for name in names]
        unread: list[str] = []
        for tar in self.tars:
            try:
                samples, odd = samples_of(tar, self._members(tar, objects))
            except SourceError as e:
                skipped.append(SkippedInput(os.path.relpath(tar, self.folder), str(e)))
                unread.append(str(e))
                continue
            skipped += odd
            for sample in samples:
                self._add(sample, extensions, seen, skipped)
        if unread and len(unread) == len(self.tars):  # no shard read: that is the error
            more = f" (and {len(unread) - 1} more shards unreadable)" if len(unread) > 1 else ""
            raise SourceError(f"{unread[0]}{more}")
        if not self.chosen:
            wanted = f".{self.column}" if self.column else ", ".join(extensions)
            shown = "; ".join(f"{s.path}: {s.reason}" for s in skipped[:3])
            raise SourceError(
                f"no sample with a member to encode ({wanted}) in {self.where}"
                + (f" ({shown})" if shown else "")
                + f"; name a member the samples hold with --column{offered_example(self.offered)} "
                "or pick --source"
            )
        note = left_out_note(self.left_out, self.picked() if self.left_out else ())
        return ScanResult(list(self.chosen), skipped, self.walk_notes + ((note,) if note else ()))

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
        members = self.place.tar_members(tar, info.size)
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
            wanted = f"member .{self.column}" if self.column else "member of the source's kind"
            held = columns_held(sample, extensions)
            self.offered = self.offered or held
            offer = f"; {' or '.join(f'--column {e}' for e in held[:3])} names one" if held else ""
            why = f"{sample.tar}: no {wanted} (it has {has}{offer})"
            skipped.append(SkippedInput(sample.key, why))
            return
        if sample.key in seen:
            raise SourceError(
                f"two samples have the key {sample.key!r}: {seen[sample.key]} and "
                f"{sample.tar}:{first.name}; an id names one item, so keys must be unique: "
                "rename one sample's members (its key is a member's name up to the first dot "
                "of its last part), or build each set of shards as its own --data"
            )
        seen[sample.key] = f"{sample.tar}:{first.name}"
        skipped.extend(unreadable_carried(sample, member))
        if self.column is None:  # a member the user did not name: none may be left out unsaid
            self.left_out += same_kind_left_out(sample, member)
        self.samples[sample.key] = sample
        self.chosen[sample.key] = member
        self.index.listed[f"{sample.tar}:{member.name}"] = member

    def picked(self) -> list[tuple[Sample, str]]:
        """Each encoded sample with the extension of the member encoded (the scan's choice)."""
        return [
            (s, next(e for e, m in s.members.items() if m is self.chosen[key]))
            for key, s in self.samples.items()
        ]

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
            ext: self.place.read_member(sample.tar, m)[0]
            for ext, m in sample.members.items()
            if m is not chosen
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
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each member, reading only shards whose stat the hash cache does not know
        (see :func:`hash_items`); ``held`` keeps the bytes read, for the build to decode. The
        shards to read are read by ``digester``'s container reader (default: here, shard after
        shard; an engine's: on its cluster, each shard's :class:`MemberReading`)."""
        tars = {p: split_item_path(p)[0] for p in paths}
        replaced = self.index.replaced(set(tars.values()))
        refs = [ItemRef(p, p, tar, 0) for p, tar in tars.items() if tar not in replaced]
        digests, failed = hash_listed(
            self, catalog, refs, self.reading, progress, stats, held, containers_of(digester)
        )
        failed.update({p: replaced[tar] for p, tar in tars.items() if tar in replaced})
        return digests, failed

    def reading(self, tar: str, refs: list[ItemRef]) -> MemberReading:
        """How ``refs``' members of ``tar`` are read for their digests, by any process: their
        offsets as the scan listed them, and the stat ``tar`` was listed at."""
        names = tuple(r.path for r in refs)
        try:
            members = tuple(self.index.member(r.path)[1] for r in refs)
        except SourceError as e:
            return MemberReading(tar, names, (), None, str(e))
        return MemberReading(tar, names, members, self.index.at.get(tar))

    def source(self, inner: Source) -> Source:
        return MemberSource(inner, self.index)


class MemberIndex:
    """Full name (``shard.tar:name``) -> member: what a scan found, and the members of any other
    tar named, found by listing that tar once (a dataset's worker, or a process that did not
    scan)."""

    def __init__(self, listed: dict[str, Member] | None = None) -> None:
        self.listed = dict(listed or {})
        #: a local tar -> its stat when its members were listed here (None: it changed while
        #: listed): the version their offsets are of, which hashing checks (:class:`MemberReading`)
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


@dataclass(frozen=True)
class MemberReading:
    """One tar's wanted members read for their digests (a
    :class:`~featbake.encode.fingerprints.ContainerRead`): picklable, the members' names,
    offsets and sizes as the scan listed them and the stat a local tar was listed at, so a
    process that never listed the tar (an engine's task) reads them as the build would.

    ``names``: each member's full name (``tar:member``), in step with ``members``; ``problem``:
    why none can be read (a member the listing lacks), each then failing with it.
    """

    tar: str
    names: tuple[str, ...]
    members: tuple[Member, ...]
    listed_at: FileStat | None
    problem: str = ""

    def __call__(self, held: Holder | None = None) -> ReadBack:
        """The members' digests by full name, and the tar's stat as of the reading: None if a
        local tar is not the version listed (its offsets are another file's)."""
        if self.problem:
            return ReadBack({n: (self.problem,) for n in self.names}, None)
        place = bytes_at(self.tar)
        got = place.member_digests(self.tar, self.members, held)
        # A local tar's members were read at the offsets listed: their digests stand only if
        # the tar is still the version listed (one renamed over it since reads other bytes).
        listed = got.stat == self.listed_at or place.versioned
        by_name = zip(self.names, self.members, strict=True)
        return ReadBack(
            {n: got.digests.get(m.name, ("not read",)) for n, m in by_name},
            got.stat if listed else None,
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
        tar, member = self.index.member(path)
        return bytes_at(tar).read_member(tar, member)[0]

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
        data, now = bytes_at(tar).read_member(tar, member)
        if stat is None or now != stat:
            raise SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        return self.inner.load(path, io.BytesIO(data))


def webdataset_at(data: str, column: str | None = None) -> WebDataset:
    """The webdataset shards at ``data`` (see :class:`WebDataset`)."""
    return WebDataset(data, column)
