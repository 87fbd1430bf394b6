"""Containers' bytes: a tar's members and a table's cells, read the one way the build (hashing,
decoding, a row's carried values) and ``verify`` (hashing a trusted hash-cache row again) both
read them. Bytes only: what the bytes decode to is the build's business (``encode/``).

**Tars** (webdataset shards, plain or gzip-compressed): :func:`list_members` lists a tar's
regular-file members once from their headers (name, data offset, size), data skipped by seeks;
:func:`member_digests` hashes members in tar order through one open file; :func:`read_member`
reads one member. A member no reader can take as stored contiguously at its offset carries its
``problem``, and every reader refuses it with that one line, reading none of its bytes:

* a **sparse** member (GNU ``tar -S``): its stored bytes are the file's data blocks only, so
  ``size`` bytes from its offset would run into the next member;
* a member whose declared **size runs past the end** of the tar (a truncated shard): reading it
  would allocate the declared size (a forged or torn header declaring 1 TiB), and the bytes are
  not there anyway.

A gzip-compressed tar (``.tar.gz``, ``.tgz``) is read as webdataset reads it, as one gzip stream:
its offsets count the decompressed bytes, and members are read in order by seeking forward in
the stream (hashing a shard decompresses it once). A tar in a bucket is read through
:class:`RangedObject`, a seekable file over a ranged-read function the caller gives (the
bucket's client stays with the caller).

**Tables** (parquet files, Arrow IPC streams as ``save_to_disk`` writes them): :class:`TableFile`
opens a data file once per process; :func:`cell_digests` hashes one column's cells a row group
at a time; :func:`cell_bytes` is the cell rule (an Audio/Image struct's ``bytes``, a binary
cell, a text cell's UTF-8); :meth:`TableFile.path_only` finds the struct cells that hold only a
path (:func:`path_only_cell`), whose file a local table reads instead (``featbake.encode.tables``).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import stat
import tarfile
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol, Self, TypeVar

from featbake.errors import ConfigError, SourceError, first_line
from featbake.process import PerProcess, ProcessLocal, ProcessLocalState
from featbake.store.hash_cache import FileStat
from featbake.units import counted

if TYPE_CHECKING:
    import pyarrow as pa

#: How many bytes a member is hashed by at a time (a large video member is never whole in memory).
CHUNK = 1 << 20
#: The endings of a gzip-compressed tar, read as one stream.
GZIP_TAR_SUFFIXES = (".tar.gz", ".tgz")
#: The endings of a tar shard.
TAR_SUFFIXES = (".tar", *GZIP_TAR_SUFFIXES)
#: Where a container's name ends and the item's inner name starts, in an item's full name.
CONTAINER_SUFFIXES = (*TAR_SUFFIXES, ".parquet", ".arrow")
#: The endings of the files a folder of containers (shards or parquet files) may hold beside
#: them: a dataset card (``README.md``) and its metadata (``dataset_infos.json``), as a Hub
#: snapshot has; none is an input, and none makes the folder a folder of other files.
CARD_SUFFIXES = (".md", ".json")

_T = TypeVar("_T")


def split_item_path(path: str) -> tuple[str, str]:
    """(container, inner name) of an item's full name, e.g. ``/d/a.tar:s1.jpg``.

    The container is cut at the first ``.tar:`` (``.tar.gz:``, ``.tgz:``), ``.parquet:`` or
    ``.arrow:``, so a member name may hold a colon.

    Raises:
        SourceError: ``path`` names no item inside a container.

    Example:
        >>> split_item_path("/data/shard-000.tar:images/0001.jpg")
        ('/data/shard-000.tar', 'images/0001.jpg')
    """
    cut = container_cut(path)
    if cut is None:
        raise SourceError(f"{path}: not the name of an item in a tar or a table")
    return path[:cut], path[cut + 1 :]


#: A container's ending and the colon after it, in any case (``SHARD.TAR:`` as ``shard.tar:``:
#: :func:`is_tar` and the tables' checks take a name in any case).
_CONTAINER_END = re.compile(
    "|".join(re.escape(s) + ":" for s in sorted(CONTAINER_SUFFIXES, key=len, reverse=True)),
    re.IGNORECASE,
)


def container_cut(path: str) -> int | None:
    """Where the container's name ends in an item's full name, or None (not an item's).

    Example:
        >>> container_cut("/d/SHARD.TAR:a.wav"), container_cut("/d/a.tar.gz:b:c.wav")
        (12, 11)
    """
    found = _CONTAINER_END.search(path)
    return None if found is None else found.end() - 1


def is_tar(path: str) -> bool:
    """Whether ``path`` names a tar shard (plain or gzip-compressed)."""
    return path.lower().endswith(TAR_SUFFIXES)


def is_gzip_tar(path: str) -> bool:
    """Whether ``path`` names a gzip-compressed tar (read as one stream, never by ranges)."""
    return path.lower().endswith(GZIP_TAR_SUFFIXES)


def stat_or_none(path: str | os.PathLike[str]) -> FileStat | None:
    """A local file's stat now, as the hash cache compares it, or None (gone, unreadable)."""
    try:
        return FileStat.of(path)
    except OSError:
        return None


def stat_around(path: str, read: Callable[[], _T]) -> tuple[_T, FileStat | None]:
    """``read()`` of the local file at ``path``, and the file's stat if it was the same before
    and after (None: renamed over or rewritten meanwhile): the version what was read is of."""
    before = stat_or_none(path)
    got = read()
    return got, before if stat_or_none(path) == before else None


def replaced_files(
    noted: Mapping[str, FileStat | None], files: Collection[str], why: Callable[[str], str]
) -> dict[str, str]:
    """file -> ``why(file)``, for each of ``files`` whose version was ``noted`` (its stat when
    it was read: :func:`stat_around`) and is not the file at its path any more."""
    return {f: why(f) for f in files if f in noted and stat_or_none(f) != noted[f]}


class ReadBack(NamedTuple):
    """What reading one container's items gave: item -> digest (or a 1-tuple: why not), and
    the container's stat as of the reading: a file's stat'ed after it, an object's the one
    every response that carried its bytes gave (no HEAD beside the GETs); None when it is gone,
    or the responses disagree (rewritten during the reading)."""

    digests: dict[str, str | tuple[str]]
    stat: FileStat | None


class Holder(Protocol):
    """Where a reader keeps the bytes it hashed, for the build to decode without reading them
    again (``encode.fingerprints.HeldBytes``): its bytes held, its budget, and keeping one."""

    @property
    def size(self) -> int: ...

    @property
    def budget(self) -> int: ...

    def keep(self, path: str, data: bytes) -> object: ...


def fits(held: Holder | None, size: int) -> bool:
    """Whether ``held`` takes ``size`` more bytes (within its budget)."""
    return held is not None and held.size + size <= held.budget


# == tars ==========================================================================================
def printable(rel: str) -> str:
    """``rel`` with bytes that are not UTF-8 written as ``\\xNN`` (safe to print and store): a
    file's or a tar member's name, which the OS and tarfile hand over with such bytes as
    surrogates.

    Example:
        >>> printable(b"caf\\xe9.wav".decode("utf-8", "surrogateescape"))
        'caf\\\\xe9.wav'
    """
    return os.fsencode(rel).decode("utf-8", "backslashreplace")


def not_utf8_member(tar: str, name: str) -> str:
    """Why a member whose name is not UTF-8 is not read (``name`` printable): it cannot be an
    item's id, nor be keyed in the catalog."""
    return (
        f"{tar}:{name}: the member's name is not valid UTF-8; rewrite the shard with UTF-8 "
        "names to include it"
    )


class Member(NamedTuple):
    """A tar member's name, where its data starts and how many bytes it holds; ``problem``:
    why no reader takes its bytes (sparse, runs past the tar's end), or "" (readable)."""

    name: str
    offset: int
    size: int
    problem: str = ""


def sparse_member(tar: str, name: str) -> str:
    """Why a sparse member (GNU ``tar -S``) is not read."""
    return (
        f"{tar}:{name}: a sparse member (GNU tar -S), whose stored bytes are not the file's; "
        "rewrite the shard without -S"
    )


def truncated(tar: str, member: Member, got: int) -> str:
    """Why a member the tar ends inside is not read (``got`` of its bytes are there)."""
    return (
        f"{tar}:{member.name}: truncated tar member ({max(got, 0)} of {member.size} bytes); "
        "rewrite or re-download the shard"
    )


def list_members(tar: str, fileobj: RangedObject | BinaryIO | None = None) -> list[Member]:
    """The regular-file members of ``tar``, in order, from their headers only (data skipped by
    seeks: listing a shard reads a 512-byte header per member); a tar in a bucket through
    ``fileobj`` (a :class:`RangedObject`, or a gzip tar's stream over one:
    :func:`gzip_stream`). Each member that cannot be read as stored carries its ``problem``
    (see the module's docstring).

    Raises:
        SourceError: the file cannot be opened or is not a tar.
    """
    if fileobj is None:
        refuse_irregular(tar)
    try:
        with open_tar(tar, fileobj) as tf:
            found = list(_headers(tf))
            end = _stream_end(tf.fileobj) if found else 0
    except FileNotFoundError as e:
        raise SourceError(f"{tar}: file not found") from e
    except (tarfile.TarError, OSError, EOFError, SourceError) as e:
        raise SourceError(f"{tar}: not a readable tar file ({e})") from e
    out: list[Member] = []
    for m in found:
        name = printable(m.name)
        if name != m.name:  # not UTF-8: named by its printable form from here on
            out.append(Member(name, m.offset_data, m.size, not_utf8_member(tar, name)))
            continue
        if m.sparse is not None:
            out.append(Member(m.name, m.offset_data, m.size, sparse_member(tar, m.name)))
            continue
        member = Member(m.name, m.offset_data, m.size)
        if member.offset + member.size > end:  # never read: its declared size is not there
            member = member._replace(problem=truncated(tar, member, end - member.offset))
        out.append(member)
    return out


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for messages."""
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")]
    kinds += [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    return next((name for test, name in kinds if test(mode)), "not a file")


def refuse_irregular(path: str) -> None:
    """Refuse a local container that is not a regular file before it is opened: a FIFO named
    like a shard or a table file blocks its ``open`` until a writer comes, which never does.
    A path that cannot be stat'ed is left to the open, which says why.

    Raises:
        SourceError: ``path`` is a FIFO, a folder, a socket or a device.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise SourceError(
            f"{path}: not a regular file ({file_kind(mode)}); only regular files are read: "
            "replace it with the file or remove it"
        )


def open_tar(tar: str, fileobj: RangedObject | BinaryIO | None = None) -> tarfile.TarFile:
    """``tar`` opened to read its headers: a file (a gzip one as its stream), or ``fileobj``."""
    if fileobj is not None:
        return tarfile.open(fileobj=fileobj, mode="r:", tarinfo=CheckedTarInfo)
    return tarfile.open(tar, mode="r:gz" if is_gzip_tar(tar) else "r:", tarinfo=CheckedTarInfo)


def _headers(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The regular-file members' headers, in order, up to the end (or where the tar ends inside
    a member: that member is the last, its size checked against the end by the caller); a
    damaged header raises (:class:`CheckedTarInfo`)."""
    while True:
        try:
            m = tf.next()
        except (tarfile.ReadError, EOFError):
            return
        if m is None:
            return
        if m.isreg():
            yield m


class DamagedHeader(tarfile.TarError):
    """A header past the tar's first is damaged or cut short (not tarfile's own ``ReadError``,
    which :func:`_headers` reads as the tar's end inside a member)."""


class CheckedTarInfo(tarfile.TarInfo):
    """Headers as tarfile reads them, but a damaged one past the first is an error: tarfile
    ends the archive there in silence (``TarFile.next`` returns None for a failed checksum or
    a header cut short at any offset but 0), and every member after it would be lost unsaid.
    A block of zeros (the end-of-archive marker) still ends it."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as e:
            # tarfile's own kinds (not in its stubs): a header cut short, or one whose
            # checksum or fields fail; a block of zeros (EOFHeaderError) or nothing ends it,
            # as do the zeros of an end marker cut short (a download cut in its last block).
            kind = type(e).__name__
            if not tarfile_.offset or kind not in ("TruncatedHeaderError", "InvalidHeaderError"):
                raise
            if kind == "TruncatedHeaderError" and not _block_at(tarfile_).strip(b"\0"):
                raise
            where = f"{tarfile_.offset:,}"
            why = (
                f"the tar is cut short inside the header at byte {where}"
                if kind == "TruncatedHeaderError"
                else f"the header at byte {where} is damaged: {e}"
            )
            raise DamagedHeader(f"{why}; rewrite or re-download the shard") from None


def _block_at(tf: tarfile.TarFile) -> bytes:
    """What is left of the header block at ``tf.offset`` (read again: only where a header
    was cut short, so a gzip stream's seek back is paid once, at its end)."""
    try:
        tf.fileobj.seek(tf.offset)
        return bytes(tf.fileobj.read(tarfile.BLOCKSIZE))
    except (OSError, EOFError, ValueError):
        return b"x"  # unreadable: not an end marker's zeros


def _stream_end(f: Any) -> int:
    """How many bytes the tar's stream holds: a file's size, a gzip stream's decompressed
    length (read to its end: a truncated stream ends where its bytes do)."""
    try:
        return int(f.seek(0, io.SEEK_END))
    except (OSError, ValueError, EOFError):  # a gzip stream: read to its end (or its cut)
        pass
    while True:
        try:
            if not f.read(CHUNK):
                return int(f.tell())
        except (EOFError, OSError, gzip.BadGzipFile):
            return int(f.tell())


def open_stream(tar: str) -> BinaryIO:
    """A local tar's bytes as its members' offsets count them: the file, or a gzip tar's
    decompressed stream (seeking forward decompresses up to there; backward starts again).

    Raises:
        OSError: the file cannot be opened.
    """
    if is_gzip_tar(tar):
        return gzip.open(tar, "rb")  # type: ignore[return-value]
    return open(tar, "rb")


class GzipStreams:
    """The decompressed streams of the gzip tars this process reads members from, each kept
    where its last read ended: members read in tar order (a build decoding them, a dataset's
    epoch in order) decompress a shard once, not once per member; a member before the position,
    or a file that is not the one opened any more (another stat), starts the stream again.
    At most :data:`KEPT` streams are kept open (the oldest closed first)."""

    KEPT = 8

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one reader of a stream at a time: its position is shared
        self.streams: dict[str, tuple[FileStat | None, BinaryIO]] = {}

    def read(self, tar: str, offset: int, size: int) -> bytes:
        """``size`` bytes of the decompressed stream of ``tar`` from ``offset`` (fewer at its
        end).

        Raises:
            OSError: the file cannot be read; EOFError: its stream is cut short.
        """
        with self.lock:
            now = stat_or_none(tar)
            held = self.streams.pop(tar, None)
            if held is not None and (held[0] != now or held[1].tell() > offset):
                held[1].close()
                held = None
            if held is None:
                held = (now, open_stream(tar))
            self.streams[tar] = held  # the newest last
            while len(self.streams) > self.KEPT:
                self.streams.pop(next(iter(self.streams)))[1].close()
            held[1].seek(offset)
            return held[1].read(size)

    def close(self) -> None:
        """Close every stream (a forked child's copies of its parent's)."""
        for _, f in self.streams.values():
            with contextlib.suppress(OSError):
                f.close()
        self.streams.clear()


#: This process's gzip tar streams (a forked child closes its copies and opens its own).
GZIP_STREAMS: PerProcess[GzipStreams] = PerProcess(GzipStreams, on_inherited=GzipStreams.close)


def read_member(tar: str, member: Member) -> bytes:
    """The bytes of one member of a local tar: a seek and a read, or, in a gzip tar, a read
    from where this process's stream of it is (:class:`GzipStreams`).

    Raises:
        SourceError: the member cannot be read (its problem), the tar cannot be read, or it
            ends inside the member (truncated).
    """
    if member.problem:
        raise SourceError(member.problem)
    try:
        if is_gzip_tar(tar):
            data = GZIP_STREAMS.get().read(tar, member.offset, member.size)
        else:
            with open(tar, "rb") as f:
                f.seek(member.offset)
                data = f.read(member.size)
    except (OSError, EOFError) as e:
        raise SourceError(f"{tar}:{member.name}: cannot read: {e}") from e
    if len(data) != member.size:
        raise SourceError(truncated(tar, member, len(data)))
    return data


def member_digests(tar: str, members: Sequence[Member], held: Holder | None = None) -> ReadBack:
    """member name -> SHA-256 of its bytes, or a 1-tuple: why not; and the local tar's stat as
    of the reading (see :class:`ReadBack`). One open file, members read in tar order (a gzip
    tar's stream decompressed once).

    With ``held``, a member that fits its budget is read whole and its bytes kept there (under
    ``tar:name``) for the build to decode; others are streamed in chunks.
    """
    try:
        f = open_stream(tar)
    except OSError as e:
        return ReadBack({m.name: (f"cannot read {tar}: {e.strerror}",) for m in members}, None)
    with f:
        out = stream_digests(tar, f, members, held)
    return ReadBack(out, stat_or_none(tar))  # stat'ed after the reading


def stream_digests(
    tar: str, f: BinaryIO, members: Sequence[Member], held: Holder | None = None
) -> dict[str, str | tuple[str]]:
    """member name -> SHA-256 of its bytes, or a 1-tuple: why not, read in tar order from the
    tar's stream ``f`` (a file, a gzip stream: seeking forward decompresses up to there)."""
    return {
        m.name: _member_digest(tar, f, m, held) for m in sorted(members, key=lambda m: m.offset)
    }


def _member_digest(tar: str, f: BinaryIO, m: Member, held: Holder | None) -> str | tuple[str]:
    """The digest of member ``m`` read from ``f`` (its bytes kept in ``held`` if they fit)."""
    if m.problem:
        return (m.problem,)
    try:
        f.seek(m.offset)
        if fits(held, m.size):
            data = f.read(m.size)
            if len(data) != m.size:
                return (truncated(tar, m, len(data)),)
            held.keep(f"{tar}:{m.name}", data)  # type: ignore[union-attr]
            return hashlib.sha256(data).hexdigest()
        sha, left = hashlib.sha256(), m.size
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            sha.update(chunk)
            left -= len(chunk)
    except (OSError, EOFError) as e:
        return (f"{tar}:{m.name}: cannot read: {e}",)
    return (truncated(tar, m, m.size - left),) if left else sha.hexdigest()


def listing_text(members: Sequence[Member]) -> str:
    """A tar's member listing as canonical JSON (what a bucket tar's hash-cache row holds)."""
    rows = [list(m) if m.problem else list(m[:3]) for m in members]
    return json.dumps(rows, separators=(",", ":"))


def listing_of(text: str) -> list[Member] | None:
    """The member listing a hash-cache row holds, or None (not one: read the tar again)."""
    try:
        rows = json.loads(text)
        return [Member(str(r[0]), int(r[1]), int(r[2]), str(r[3]) if r[3:] else "") for r in rows]
    except (ValueError, TypeError, IndexError, KeyError):
        return None


# -- tars in a bucket ------------------------------------------------------------------------------
#: Bytes one GET reads while listing a tar's headers (a header is 512 bytes).
HEADER_BLOCK = 1 << 16
#: Bytes one GET reads when the block before was skipped past after its first few KiB (a tar
#: of members larger than a block: each header read alone, not with 64 KiB of skipped data).
SMALL_BLOCK = 1 << 12
#: At most this many bytes of adjacent members are hashed from one ranged GET.
RUN_BYTES = 64 << 20


class RangeRead(NamedTuple):
    """The bytes of one ranged read of an object, and the object's stat as that one response
    gave it (size, last change, ETag)."""

    data: bytes
    stat: FileStat


#: (start, length) -> the bytes there (fewer at the object's end) and the object's stat.
#: Raises SourceError when the object is gone or cannot be read.
Fetch = Callable[[int, int], RangeRead]


def one_stat(seen: Collection[FileStat]) -> FileStat | None:
    """The stat every response that carried an object's bytes gave, or None (none read, or
    they disagree: the object was rewritten between two of them)."""
    return next(iter(seen)) if len(seen) == 1 else None


class RangedObject(io.RawIOBase):
    """An object in a bucket as a seekable read-only file, for ``tarfile`` to read headers and
    pyarrow a parquet file: a read outside the block held fetches :data:`HEADER_BLOCK` bytes
    (or more) from there by one ranged read, or :data:`SMALL_BLOCK` bytes when the reading skips
    forward past a block of which it used only the first :data:`SMALL_BLOCK` bytes (a tar of
    large members: its headers are a member apart, and 64 KiB a header fetched 1.7x the data
    to list and hash shards of ~90 KB members, 1.11x now). The stat of each response is kept
    (:meth:`stat`), so a reader knows which version of the object its bytes came from without
    a HEAD.

    Args:
        url: the object's name, for messages.
        size: its size in bytes; None: learned from the first response (each carries the
            object's size), so a reader that starts at its beginning needs no HEAD.
        fetch: reads a range of it (the caller's client: see :data:`Fetch`).
    """

    def __init__(self, url: str, size: int | None, fetch: Fetch) -> None:
        super().__init__()
        self.url, self.size, self.pos, self.fetch = url, size, 0, fetch
        self.block_at, self.block = 0, b""
        self.used = 0  # how far into the block held reads went
        self.seen: set[FileStat] = set()  # the stats of the responses read so far

    def stat(self) -> FileStat | None:
        """The object's stat as every byte read so far came with it (see :func:`one_stat`)."""
        return one_stat(self.seen)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END and self.size is None:
            self.fetch_at(0, SMALL_BLOCK)  # its size comes with the first response
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size or 0}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def fetch_at(self, start: int, length: int) -> None:
        """Hold ``length`` bytes from ``start`` (one ranged read), noting its response's stat
        (and the object's size, which it carries)."""
        fetched = self.fetch(start, length)
        self.seen.add(fetched.stat)
        if self.size is None:
            self.size = fetched.stat.size
        self.block_at, self.block, self.used = start, fetched.data, 0

    def readinto(self, buffer: Any) -> int:
        if self.size is None:
            self.fetch_at(self.pos, max(len(buffer), HEADER_BLOCK))
        assert self.size is not None  # known after the first response
        want = min(len(buffer), max(0, self.size - self.pos))
        if want == 0:
            return 0
        end = self.block_at + len(self.block)
        if not (self.block_at <= self.pos and self.pos + want <= end):
            sparse = self.block and self.used <= SMALL_BLOCK and self.pos >= end
            ahead = SMALL_BLOCK if sparse else HEADER_BLOCK
            self.fetch_at(self.pos, max(want, ahead))
        self.used = max(self.used, self.pos + want - self.block_at)
        got = self.block[self.pos - self.block_at : self.pos - self.block_at + want]
        buffer[: len(got)] = got
        self.pos += len(got)
        return len(got)


#: Bytes of a gzip tar object one ranged read fetches as its stream is decompressed, in order.
GZIP_BLOCK = 8 << 20


def gzip_stream(raw: RangedObject) -> BinaryIO:
    """The decompressed stream of the gzip tar object ``raw`` reads, fetched in order by
    ranged reads of :data:`GZIP_BLOCK` (webdataset reads a ``.tar.gz`` as one stream; it
    cannot be read by ranges, but it can be streamed): its offsets count the decompressed
    bytes, as a local gzip tar's do (:func:`open_stream`), and no more of the object is
    fetched than the reading needs, never all of it held."""
    return gzip.GzipFile(fileobj=io.BufferedReader(raw, GZIP_BLOCK), mode="rb")  # type: ignore[return-value]


def streamed_member_digests(
    url: str, members: Sequence[Member], raw: RangedObject, held: Holder | None = None
) -> ReadBack:
    """:func:`member_digests` of a gzip tar object, from one pass over its stream (through
    ``raw``, a :class:`RangedObject` of it), the tar's stat the one every response gave."""
    try:
        with gzip_stream(raw) as f:
            out = stream_digests(url, f, members, held)
    except SourceError as e:  # the object is gone, or cannot be read
        return ReadBack({m.name: (str(e),) for m in members}, None)
    return ReadBack(out, raw.stat())


def read_streamed_member(
    url: str, member: Member, raw: RangedObject
) -> tuple[bytes, FileStat | None]:
    """The bytes of one member of a gzip tar object, read from its stream up to the member's
    end (through ``raw``), with the tar's stat as the responses gave it.

    Raises:
        SourceError: the member cannot be read (its problem), the object is gone or not a
            gzip stream, or it ends inside the member.
    """
    if member.problem:
        raise SourceError(member.problem)
    try:
        with gzip_stream(raw) as f:
            f.seek(member.offset)
            data = f.read(member.size)
    except (OSError, EOFError) as e:
        raise SourceError(f"{url}:{member.name}: cannot read: {e}") from e
    if len(data) != member.size:
        raise SourceError(truncated(url, member, len(data)))
    return data, raw.stat()


def member_runs(members: Sequence[Member]) -> list[list[Member]]:
    """``members`` by offset, cut into runs of adjacent members (gaps of headers only) of at
    most :data:`RUN_BYTES` (a member larger than that is a run alone)."""
    runs: list[list[Member]] = []
    for m in sorted(members, key=lambda m: m.offset):
        if runs:
            run = runs[-1]
            near = m.offset - (run[-1].offset + run[-1].size) <= HEADER_BLOCK
            if near and m.offset + m.size - run[0].offset <= RUN_BYTES:
                run.append(m)
                continue
        runs.append([m])
    return runs


def ranged_member_digests(
    url: str, members: Sequence[Member], fetch: Fetch, held: Holder | None = None
) -> ReadBack:
    """:func:`member_digests` of a tar in a bucket: one ranged read per run of members, the
    tar's stat the one those responses gave (no HEAD after them)."""
    out: dict[str, str | tuple[str]] = {m.name: (m.problem,) for m in members if m.problem}
    seen: set[FileStat] = set()
    for run in member_runs([m for m in members if not m.problem]):
        start = run[0].offset
        try:
            one = fetch(start, run[-1].offset + run[-1].size - start)
        except SourceError as e:
            out.update({m.name: (str(e),) for m in run})
            continue
        seen.add(one.stat)
        for m in run:
            got = one.data[m.offset - start : m.offset - start + m.size]
            if len(got) != m.size:
                out[m.name] = (truncated(url, m, len(got)),)
                continue
            if fits(held, m.size):
                held.keep(f"{url}:{m.name}", got)  # type: ignore[union-attr]
            out[m.name] = hashlib.sha256(got).hexdigest()
    return ReadBack(out, one_stat(seen))


def read_ranged_member(url: str, member: Member, fetch: Fetch) -> RangeRead:
    """The bytes of one member of a tar in a bucket (one ranged read), with the tar's stat as
    that response gave it.

    Raises:
        SourceError: the member cannot be read (its problem), the object is gone, or it ends
            inside the member.
    """
    if member.problem:
        raise SourceError(member.problem)
    got = fetch(member.offset, member.size)
    if len(got.data) != member.size:
        raise SourceError(truncated(url, member, len(got.data)))
    return got


# == tables ========================================================================================
class CellKind(Enum):
    """What a column's cells hold, as far as encoding them goes."""

    STRUCT = "struct"  # {bytes, path}: the Hub's Audio and Image
    BINARY = "binary"
    TEXT = "text"  # a string column, for --source text: the cell's UTF-8 bytes
    OTHER = "other"


def pyarrow_module() -> Any:
    """pyarrow, or a one-line error saying how to install it.

    Raises:
        ConfigError: pyarrow is not installed.
    """
    try:
        import pyarrow
        import pyarrow.parquet  # the submodule: pyarrow.parquet.ParquetFile below
    except ImportError as e:
        raise ConfigError(
            f"parquet files and Hugging Face datasets need pyarrow ({e}); install it: "
            "pip install 'featbake[tables]'"
        ) from e
    return pyarrow


def cell_kind(kind: pa.DataType, text: bool = False) -> CellKind:
    """Whether cells of type ``kind`` hold bytes to encode, and how: with ``text`` (the source
    is text) a string column's and only those; else a binary column's or an Audio/Image struct's.
    """
    pa = pyarrow_module()
    if text:
        return CellKind.TEXT if is_string_type(kind) else CellKind.OTHER
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return CellKind.BINARY
    if pa.types.is_struct(kind):
        names = [kind.field(i).name for i in range(kind.num_fields)]
        if "bytes" in names:
            inner = kind.field(names.index("bytes")).type
            if pa.types.is_binary(inner) or pa.types.is_large_binary(inner):
                return CellKind.STRUCT
    return CellKind.OTHER


def is_string_type(kind: pa.DataType) -> bool:
    """Whether cells of type ``kind`` are read as Python strings: ``string``,
    ``large_string``, ``string_view`` (pyarrow 16 and later, what DuckDB and Polars write), or
    a dictionary of strings (what pandas writes for a ``category`` column); the last two were
    refused as "no column holds text", ``--column`` or not."""
    t = pyarrow_module().types
    if t.is_dictionary(kind):
        return is_string_type(kind.value_type)
    view = getattr(t, "is_string_view", None)
    return t.is_string(kind) or t.is_large_string(kind) or bool(view and view(kind))


def stored_cell_kind(kind: pa.DataType) -> CellKind:
    """What a column of type ``kind`` whose cells were hashed holds: a string column's cells
    were texts (only a text build hashes them), any other's as :func:`cell_kind` says."""
    text = cell_kind(kind, text=True)
    return text if text is CellKind.TEXT else cell_kind(kind)


#: The fields of an Audio/Image struct cell: its bytes, and the path of the file they are of.
PATH_CELL = ("bytes", "path")


def path_only_cell(cell: Any, kind: CellKind) -> str | None:
    """The path of a cell (a Python value) that holds a path and no bytes (``{"bytes": None,
    "path": "clips/a.wav"}``: what ``datasets`` writes for a local file it was not asked to
    embed), else None (pure).

    Example:
        >>> path_only_cell({"bytes": None, "path": "a.wav"}, CellKind.STRUCT)
        'a.wav'
        >>> path_only_cell({"bytes": b"RIFF", "path": "a.wav"}, CellKind.STRUCT) is None
        True
    """
    if (
        kind is not CellKind.STRUCT
        or not isinstance(cell, Mapping)
        or cell.get("bytes") is not None
    ):
        return None
    named = cell.get("path")
    return named if isinstance(named, str) and named else None


def cell_bytes(cell: Any, kind: CellKind) -> bytes | str:
    """The bytes of one cell (a Python value) as its digest is taken of them, or why it has
    none: the cell rule the build and verify share."""
    if cell is None:
        return "the cell is null"
    if kind is CellKind.TEXT:
        # The same bytes as a .txt file of this text: the same key. Arrow strings are UTF-8.
        return str(cell).encode("utf-8") if str(cell).strip() else "the cell's text is empty"
    if kind is CellKind.STRUCT:
        data = cell.get("bytes")
        if data is None:
            where = cell.get("path")
            if not where:
                return "the cell holds neither bytes nor a path"
            # A local table's path-only cell is read from its file before this rule (see
            # featbake.encode.tables); a bucket's table's is not.
            return (
                f"the cell holds no bytes, only the path {where!r}, and featbake reads the "
                "file a path names for a local table's cells only; embed the bytes "
                "(datasets' embed_table_storage) or build the files with a manifest"
            )
        return bytes(data)
    if kind is CellKind.OTHER:
        return "the column holds neither bytes nor an Audio/Image struct"
    return bytes(cell)


def table_files(where: str, listed: Callable[[str], Iterable[str]] = os.listdir) -> list[str]:
    """The data files of a local table, in the dataset's order (a folder's parquet files as
    ``listed`` names them relative to it: the byte seam's walk, subfolders too).

    Raises:
        SourceError: a DatasetDict folder (one split must be named), or a ``state.json`` that
            names no data file.
    """
    if os.path.isfile(where):
        return [where]
    if os.path.isfile(os.path.join(where, "dataset_dict.json")):
        try:
            with open(os.path.join(where, "dataset_dict.json")) as f:
                splits = list(json.load(f).get("splits", []))
        except (OSError, ValueError, AttributeError):
            splits = []
        named = ", ".join(os.path.join(where, s) for s in splits) or "one of its split folders"
        raise SourceError(
            f"{where} is a DatasetDict (several splits); pass one split as --data: {named}"
        )
    state = os.path.join(where, "state.json")
    if os.path.isfile(state):
        try:
            with open(state) as f:
                files = [d["filename"] for d in json.load(f)["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{state}: not a datasets state.json ({e})") from e
        if not files:
            raise SourceError(f"{state} names no data file")
        return [os.path.join(where, n) for n in files]
    everything = list(listed(where))
    names = parquet_names(everything)
    refuse_several_splits(where, names, folder_card(where, everything))
    return [os.path.join(where, n) for n in names]


#: The name starts a folder of parquet files' listing passes over: pyarrow's dataset discovery's
#: default ``ignore_prefixes``, so a writer's leftovers (Spark's ``_SUCCESS`` and
#: ``_committed_*``, ``_metadata``, a hidden ``.part-1.tmp.parquet`` being written, a ``.crc``)
#: are no rows, as they are none to ``pyarrow.dataset.dataset(folder)`` or ``pq.read_table``.
TABLE_IGNORED_PREFIXES = (".", "_")


def parquet_names(names: Iterable[str]) -> list[str]:
    """The parquet files among a folder's (or a bucket prefix's) names, in name order, those
    pyarrow passes over left out (:func:`left_out`): the one rule of a local folder and a
    prefix of a table's files.

    Example:
        >>> parquet_names(["b.parquet", "A.PARQUET", "_SUCCESS", "_tmp.parquet", "card.md"])
        ['A.PARQUET', 'b.parquet']
    """
    return sorted(n for n in names if n.lower().endswith(".parquet") and not left_out(n))


def left_out(name: str) -> bool:
    """Whether a folder of parquet files' listing passes over the file ``name`` (a name
    relative to the folder; any part of it counted), as pyarrow's discovery does (pure).

    Example:
        >>> left_out("_SUCCESS"), left_out(".part-1.tmp.parquet"), left_out("part-0.parquet")
        (True, True, False)
    """
    return any(part.startswith(TABLE_IGNORED_PREFIXES) for part in name.split("/"))


#: The split names ``datasets`` reads in a data file's name (its ``SPLIT_KEYWORDS``), in its order.
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
#: A keyword stands in a file's name between these characters (datasets' ``NON_WORDS_CHARS``).
_SPLIT_IN_NAME = {
    split: re.compile(rf"(?:^|[-._ 0-9])(?:{'|'.join(words)})[-._ 0-9]")
    for split, words in SPLIT_KEYWORDS.items()
}
#: A keyword names a folder when it stands between those characters or at the folder name's end
#: (datasets' ``KEYWORDS_IN_DIR_NAME_BASE_PATTERNS``: ``train/``, ``train-0/``, ``my_train/``).
_SPLIT_IN_FOLDER = {
    split: re.compile(rf"(?:^|[-._ 0-9])(?:{'|'.join(words)})(?:[-._ 0-9]|$)")
    for split, words in SPLIT_KEYWORDS.items()
}


#: ``datasets``' ``SPLIT_PATTERN_SHARDED`` (``data/{split}-[0-9]{5}-of-[0-9]{5}*.*``, relative to
#: the folder read), tried before every keyword: the Hub's shard names, whose split is any word
#: (``data/holdout-00000-of-00001.parquet``), not only a keyword.
_SPLIT_SHARDED = re.compile(r"data/([^/]+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")


#: Any keyword in a file's name: most names hold none, and are told so by one search.
_ANY_SPLIT_IN_NAME = re.compile(
    rf"(?:^|[-._ 0-9])(?:{'|'.join(w for ws in SPLIT_KEYWORDS.values() for w in ws)})[-._ 0-9]"
)


#: A keyword (or ``data/``, where the Hub's shard names sit) anywhere in a name: a folder whose
#: names hold none names no split, told by one search over them all (a 100,000-clip folder's
#: scan is not made slower by a loop over its names).
_ANY_KEYWORD = re.compile("|".join([w for ws in SPLIT_KEYWORDS.values() for w in ws] + ["data/"]))


def may_name_a_split(names: Sequence[str]) -> bool:
    """Whether any of ``names`` holds a split keyword or ``data/`` anywhere (pure): where none
    does, ``datasets`` reads them as one split (no need to judge each name)."""
    return _ANY_KEYWORD.search("\n".join(names)) is not None


def split_of(name: str, by_folder: bool = False) -> str | None:
    """The split a data file's name puts it in as ``datasets`` reads a folder (``load_dataset``
    of a Hub snapshot's ``data/``), or None (pure): by its file name, or (``by_folder``) by
    the folders of a name relative to the listed folder (a bucket prefix's ``train/x.tar``).

    Example:
        >>> split_of("train-00000-of-00002.parquet"), split_of("dev.parquet"), split_of("x.parquet")
        ('train', 'validation', None)
        >>> split_of("test/000.tar"), split_of("test/000.tar", by_folder=True)
        (None, 'test')
    """
    if by_folder:
        return folder_split(name.rpartition("/")[0])
    base = name.rpartition("/")[2]
    if not _ANY_SPLIT_IN_NAME.search(base):
        return None
    return next((s for s, named in _SPLIT_IN_NAME.items() if named.search(base)), None)


@functools.lru_cache(maxsize=4096)
def folder_split(folders: str) -> str | None:
    """The split the folders ``a/b`` of a name put it in (None: none), by ``datasets``' folder
    patterns (pure; kept per folder: a 100,000-file folder has few folders)."""
    parts = folders.split("/") if folders else []
    found = (s for s, named in _SPLIT_IN_FOLDER.items() if any(map(named.search, parts)))
    return next(found, None)


def sharded_split(name: str) -> str | None:
    """The split ``datasets``' shard-name pattern reads in a name relative to the folder
    (``data/holdout-00000-of-00001.parquet``: ``holdout``), or None where it does not match
    (pure).

    Example:
        >>> sharded_split("data/holdout-00000-of-00001.parquet"), sharded_split("holdout.parquet")
        ('holdout', None)
    """
    match = _SPLIT_SHARDED.fullmatch(name) if name.startswith("data/") else None
    return match.group(1) if match else None


class SplitBy(Enum):
    """Which of ``datasets``' patterns splits a folder's files, in the order it tries them."""

    SHARD_NAMES = "shard names"  # data/{split}-00000-of-00002.parquet
    FOLDERS = "folders"  # train/, my_train/, train-0/
    FILE_NAMES = "file names"  # train.parquet, data-train.tar


def split_by(names: Sequence[str]) -> SplitBy:
    """Which pattern ``datasets`` splits the files ``names`` by (pure): its shard names where any
    name matches them, else folders where any folder names a split, else file names."""
    if any(map(sharded_split, names)):
        return SplitBy.SHARD_NAMES
    if any(folder_split(n.rpartition("/")[0]) for n in names):
        return SplitBy.FOLDERS
    return SplitBy.FILE_NAMES


def splits_of(names: Sequence[str], how: SplitBy | None = None) -> dict[str | None, list[str]]:
    """split (None: none named) -> the names in it, as ``datasets`` splits a folder's files
    (pure): by its shard-name pattern where any name matches it (``data/holdout-00000-of-
    00001.parquet``: any word a split), else by their folders' names where any folder names a
    split, else by file name (``how``, when the caller knows it: :func:`split_by`); files the
    pattern used does not match are in no split.

    Example:
        >>> splits_of(["train/a.tar", "test/a.tar", "b.tar"])
        {'train': ['train/a.tar'], 'test': ['test/a.tar'], None: ['b.tar']}
        >>> splits_of(["data/holdout-00000-of-00001.tar", "data/x.tar"])
        {'holdout': ['data/holdout-00000-of-00001.tar'], None: ['data/x.tar']}
    """
    how = how or split_by(names)
    out: dict[str | None, list[str]] = {}
    for name in names:
        if how is SplitBy.SHARD_NAMES:
            split = sharded_split(name)
        else:
            split = split_of(name, by_folder=how is SplitBy.FOLDERS)
        out.setdefault(split, []).append(name)
    return out


def refuse_several_splits(where: str, names: Sequence[str], card: str | None = None) -> None:
    """Refuse a folder whose data files (parquet files, tar shards, a folder's audio, image or
    text files) ``datasets`` does not read as the one table (one set of shards, one folder of
    files) featbake reads them as: files that name several splits (``datasets`` reads a
    DatasetDict: the test rows would be served with the training ones), or files of one split
    beside files that name none (``load_dataset`` reads only the split's, ``train.parquet``,
    and leaves the others, ``extra.parquet``, out: featbake would serve rows the user's other
    loader never sees). A folder whose files name no split is one ``train`` split of them all
    to ``datasets``, as to featbake.

    The split of each name is ``datasets``' own rule (:func:`splits_of`); the folder's files
    only are judged, as they are what featbake reads (a bucket prefix's: every object under it,
    named relative to it, so ``train/`` beside ``test/`` is two splits there as well).

    ``card`` is the folder's ``README.md`` (None: it has none): ``datasets`` reads the splits
    its front matter's ``configs`` declare before any name (:func:`refuse_declared_splits`).

    Raises:
        SourceError: the files name two splits or more (each named with its file count), or
            one split beside files that name none (those named); the way out is said as the
            split is (one split's folder where folders name them). Or the card declares two
            splits or more in one config.
    """
    if card is not None:
        refuse_declared_splits(where, card)
    if not may_name_a_split(names):
        return  # one search over all names: a speaker folder's 100,000 clips name no split
    how = split_by(names)
    by_split = splits_of(names, how)
    named = [s for s in SPLIT_KEYWORDS if s in by_split]
    named += sorted(s for s in by_split if s is not None and s not in SPLIT_KEYWORDS)
    if not named or by_split.keys() == {named[0]}:
        return
    held = ", ".join(f"{split} ({counted(len(by_split[split]), 'file')})" for split in named)
    if len(named) > 1:
        raise SourceError(
            f"{where} holds the splits {held}, as datasets reads its {how.value}; pass one "
            f"split: {one_split_advice(where, how, by_split[named[0]])}"
            f"{every_file_advice(where, names)}"
        )
    others = by_split[None]
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    raise SourceError(
        f"{where} holds the split {held} and {counted(len(others), 'file')} that name no split "
        f"({shown}), which datasets leaves out of it; featbake would read them all as one; "
        f"pass one set alone: {one_split_advice(where, how, by_split[named[0]])}"
        f"{every_file_advice(where, names)}"
    )


def one_split_advice(where: str, how: SplitBy, first: Sequence[str]) -> str:
    """How to pass one split of a folder that holds several (pure): its folder where folders
    name the splits (``first``: a split's names, the first showing its folder), else its file,
    or its files moved into a folder of their own."""
    if how is SplitBy.FOLDERS:
        parts = first[0].split("/")[:-1]
        top = next(i for i in range(len(parts)) if folder_split("/".join(parts[: i + 1])))
        folder = "/".join([where.rstrip("/"), *parts[: top + 1]])
        return f"its folder as --data (such as {folder})"
    return "its file as --data, or its files moved into a folder of their own"


#: The dataset card ``load_dataset`` reads at the folder it is given (not above it): its YAML
#: front matter's ``configs`` may name each split's files (``data_files``).
CARD_NAME = "README.md"


def folder_card(where: str, names: Collection[str]) -> str | None:
    """The text of the local folder ``where``'s ``README.md`` where it has one that starts
    with YAML front matter (``---``), else None: the one file ``datasets`` reads a Hub
    snapshot's declared splits from. ``names``: the folder's listing, as its scan walked it
    (only a listed card is opened: a build opens nothing in a folder but what it lists)."""
    if CARD_NAME not in names:
        return None
    try:
        with open(os.path.join(where, CARD_NAME), encoding="utf-8", errors="replace") as f:
            first = f.readline()
            return first + f.read() if first.rstrip("\r\n") == "---" else None
    except OSError:  # none (or not a folder): nothing declared
        return None


def card_configs(card: str) -> dict[str, dict[str, list[str]]]:
    r"""config -> split -> its ``data_files`` paths, as the ``configs`` key of a dataset card's
    YAML front matter declares them, read as ``datasets`` reads it (pure): between a first line
    ``---`` and the next. Nothing for a card without front matter, without ``configs``, or
    whose YAML does not parse (the card is documentation: featbake reads only that key).

    Example:
        >>> card_configs("---\nconfigs:\n- config_name: a\n  data_files: x/*.parquet\n---\n")
        {'a': {'train': ['x/*.parquet']}}
    """
    lines = card.splitlines()
    if not lines or lines[0] != "---" or "---" not in lines[1:]:
        return {}
    block = "\n".join(lines[1 : lines[1:].index("---") + 1])
    if "configs" not in block:
        return {}
    import yaml  # only for a card that may declare configs

    try:
        meta = yaml.safe_load(block)
    except yaml.YAMLError:
        return {}
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not isinstance(configs, list):
        return {}
    return {
        str(c.get("config_name", "default")): declared_files(c.get("data_files"))
        for c in configs
        if isinstance(c, dict)
    }


def declared_files(data_files: object) -> dict[str, list[str]]:
    """split -> paths of one config's ``data_files`` in each form ``datasets`` takes (pure): a
    path or a list of them (the ``train`` split), a list of ``{split, path}`` entries (a path
    or a list), or a mapping of split to paths; nothing where none is declared."""
    if isinstance(data_files, dict):
        return {str(k): path_list(v) for k, v in data_files.items()}
    if not isinstance(data_files, list):
        return {} if data_files is None else {"train": path_list(data_files)}
    out: dict[str, list[str]] = {}
    for entry in data_files:
        if isinstance(entry, dict):
            split = str(entry.get("split", "train"))
            out.setdefault(split, []).extend(path_list(entry.get("path")))
        else:
            out.setdefault("train", []).extend(path_list(entry))
    return out


def path_list(value: object) -> list[str]:
    """A ``data_files`` path or list of paths as a list of strings (pure)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def refuse_declared_splits(where: str, card: str) -> None:
    """Refuse a folder whose dataset card (``card``: its ``README.md``) declares two splits
    or more in one config's ``data_files``: ``load_dataset(folder)`` reads a DatasetDict of
    them (the held-out rows apart), where featbake would read every file as one table.

    Raises:
        SourceError: one line naming the config, each split and its files, and what to pass.
    """
    for config, splits in card_configs(card).items():
        if len(splits) > 1:
            held = ", ".join(f"{s} ({', '.join(paths)})" for s, paths in splits.items())
            raise SourceError(
                f"{where}: its {CARD_NAME} declares the splits {held} (configs: {config}), as "
                "datasets reads the folder; pass one split's files as --data: its file, or its "
                "files moved into a folder of their own"
            )


def every_file_advice(where: str, names: Sequence[str]) -> str:
    """How to build every file of a folder of input files refused as splits as one dataset
    anyway (pure): a manifest naming them (a ``.csv`` with a ``path`` column, absolute paths or
    ``s3://`` URLs), with a one-line shell command that writes one for a local folder (a
    speaker or class folder named ``test`` is a split to ``datasets``, but may be all data);
    "" for tars and parquet files, which a manifest does not list."""
    if all(n.lower().endswith(CONTAINER_SUFFIXES) for n in names):
        return ""
    if "://" in where:
        return (
            "; or, to build every file as one dataset, pass a manifest (.csv with a path column) "
            "of their URLs as --data"
        )
    exts = sorted({os.path.splitext(n)[1].lower() for n in names if os.path.splitext(n)[1]})
    wanted = " -o ".join(f"-iname '*{e}'" for e in exts) or "-name '*'"
    wanted = f"\\( {wanted} \\)" if len(exts) > 1 else wanted
    # Hidden and __name__ folders below the folder are pruned by name (a folder inside
    # ~/.cache is still listed); each path is one quoted CSV field (a comma in a name).
    return (
        "; or, to build every file as one dataset, pass a manifest of them as --data: "
        f"{{ echo path; find {shlex.quote(where)} -mindepth 1 \\( -name '.*' -o -name '__*' "
        f'\\) -prune -o -type f {wanted} -print | sort | sed \'s/"/""/g; s/.*/"&"/\'; }} '
        "> all.csv, then --data all.csv"
    )


def schema_difference(a: pa.Schema, b: pa.Schema) -> str | None:
    """How the schema ``b`` differs from ``a`` as a table's rows see it (pure): the first
    column one has and the other lacks, or holds in a type whose values are others
    (:func:`types_agree`); None where they agree on every column's name and values' type.
    Metadata (``datasets``' ``huggingface`` features, a field's own) and column order are no
    difference, as pyarrow's dataset reads such files as one."""
    types_a = {f.name: f.type for f in a}
    types_b = {f.name: f.type for f in b}
    for name, held in types_a.items():
        if name not in types_b:
            return f"column {name!r} is in the first, not the second"
        if not types_agree(held, types_b[name]):
            return f"column {name!r} holds {held} in the first, {types_b[name]} in the second"
    extra = next((n for n in types_b if n not in types_a), None)
    return None if extra is None else f"column {extra!r} is in the second, not the first"


def types_agree(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether columns of the Arrow types ``a`` and ``b`` hold values of one kind, so rows
    read from either (each file by its own schema) serve the same Python values for the same
    data (pure): equal types; ``null`` (a column all None, as pandas writes an all-None chunk)
    beside any, the column then nullable; ``string`` beside ``large_string`` and ``binary``
    beside ``large_binary`` (pandas' and polars' writers); integers of any width (a label 3 is
    ``int`` read from either) and ``float32`` beside ``float64``; lists and structs of such.
    Not ``string`` beside an integer, nor an integer beside a float (3 is not 3.0): pyarrow's
    dataset would cast those, a guess featbake does not make."""
    pa = pyarrow_module()
    if a == b or pa.types.is_null(a) or pa.types.is_null(b):
        return True
    family_a, family_b = value_family(a), value_family(b)
    if family_a is not None or family_b is not None:
        return family_a == family_b
    if is_list_type(a) and is_list_type(b):
        return types_agree(a.value_type, b.value_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields_a = {a.field(i).name: a.field(i).type for i in range(a.num_fields)}
        fields_b = {b.field(i).name: b.field(i).type for i in range(b.num_fields)}
        return fields_a.keys() == fields_b.keys() and all(
            types_agree(t, fields_b[n]) for n, t in fields_a.items()
        )
    return False


def value_family(kind: pa.DataType) -> str | None:
    """The Python values a scalar Arrow type's cells are read as, where types differing in
    width or offsets only share them (pure): ``str``, ``bytes``, ``int``, ``float``; None for
    any other type (compared as itself)."""
    t = pyarrow_module().types
    if is_string_type(kind):
        return "str"
    if t.is_binary(kind) or t.is_large_binary(kind):
        return "bytes"
    if t.is_integer(kind):
        return "int"
    return "float" if t.is_float32(kind) or t.is_float64(kind) else None


def is_list_type(kind: pa.DataType) -> bool:
    """Whether ``kind`` is a list type whose cells read as Python lists (list, large_list)."""
    t = pyarrow_module().types
    return bool(t.is_list(kind) or t.is_large_list(kind))


def refuse_mixed_schemas(where: str, schemas: Sequence[tuple[str, pa.Schema]]) -> None:
    """Refuse a table whose files (``schemas``: each file's name and schema, in the table's
    order) do not hold the same columns of the same types: the encoded column read one way in
    one file and another (or missing) elsewhere, or rows carrying other labels file by file,
    are no one table. ``datasets`` and pyarrow's dataset cast every file to the first one's
    columns (a string label ``"3"`` read as 3, a missing one as None; bytes beside a struct
    refused by pyarrow): a guess featbake does not make, as served labels must be the data's.

    Raises:
        SourceError: one line naming the first file and the first that differs from it, and
            the difference.
    """
    if not schemas:
        return
    first, schema = schemas[0]
    for name, other in schemas[1:]:
        why = schema_difference(schema, other)
        if why is not None:
            raise SourceError(
                f"{where}: its files' columns differ ({first}, {name}: {why}), so they are no "
                "one table and featbake will not guess a cast; write them to one schema, or "
                "pass the files of one schema as --data (moved into a folder of their own)"
            )


#: (object URL, its size or None) -> the object as a seekable file (the caller's client); a
#: module-level function, so a :class:`TableFile` holding it pickles into workers.
OpenObject = Callable[[str, "int | None"], RangedObject]


class TableFile(ProcessLocalState):
    """One data file of a table, opened lazily in each process: a parquet file (read by row
    group) or an Arrow stream (memory-mapped, zero copy). A copy pickled or forked into a
    worker opens its own (:class:`~featbake.process.ProcessLocal`): never the parent's reader,
    whose Python file (a bucket's :class:`RangedObject`) a parent's thread may hold locked.

    Args:
        path: the file, or a parquet object's URL (then ``open_object`` opens it).
        open_object: how an object is opened (None: a local file only).
    """

    def __init__(
        self, path: str, open_object: OpenObject | None = None, headed: FileStat | None = None
    ) -> None:
        self.path = path
        self.parquet = not path.lower().endswith(".arrow")
        self.open_object = open_object
        #: an object's stat from the HEAD that found it (named as one object): the scan's
        #: listing takes it once, in place of a HEAD of its own
        self.headed = headed
        #: an object's schema from the hash cache, and its size (a bucket's parquet file)
        self.known_schema: pa.Schema | None = None
        self.size: int | None = None

    @property
    def remote(self) -> bool:
        return self.open_object is not None

    def _open_ranged(self) -> RangedObject:
        if self.open_object is None:
            raise SourceError(f"{self.path}: not a local file")
        return self.open_object(self.path, self.size)

    def _open_parquet(self) -> Any:
        # A bucket's file by ranged GETs: its footer, then each row group's column chunks.
        if self.remote:
            return pyarrow_module().parquet.ParquetFile(self._ranged)
        return self._open_local(pyarrow_module().parquet.ParquetFile)

    def _open_arrow(self) -> Any:
        pa = pyarrow_module()
        return self._open_local(lambda path: pa.ipc.open_stream(pa.memory_map(path)).read_all())

    def _open_local(self, opener: Callable[[str], Any]) -> Any:
        """``opener(path)``, noting the stat of the file it opened (the same before and after
        the open; None if the file was replaced meanwhile): the reader keeps that file, its
        footer read once, whatever is renamed over the path later (see :meth:`stat`)."""
        refuse_irregular(self.path)
        opened, self._opened = stat_around(self.path, lambda: opener(self.path))
        return opened

    #: a bucket's file as this process reads it (its responses' stats kept: see :meth:`stat`)
    _ranged: ProcessLocal[RangedObject] = ProcessLocal(_open_ranged)
    _pf: ProcessLocal[Any] = ProcessLocal(_open_parquet)
    _stream: ProcessLocal[Any] = ProcessLocal(_open_arrow)
    #: the row group read last: its first row, and the columns read of it
    _group: ProcessLocal[tuple[int, dict[str, Any]] | None] = ProcessLocal(lambda self: None)
    #: the stat of the local file this process's reader opened (None: none, or replaced then)
    _opened: ProcessLocal[FileStat | None] = ProcessLocal(lambda self: None)

    def stat(self) -> FileStat | None:
        """The file's stat as of what was read of it: a file's stat'ed now if it is the file
        this process's reader opened (else None: replaced or rewritten since, its bytes read
        here may be the old file's, through a footer read before); an object's the one every
        ranged GET this process made of it gave (no HEAD; None if they disagree)."""
        if not self.remote:
            now = stat_or_none(self.path)
            return now if now == self._opened else None
        return self._ranged.stat()

    def schema(self) -> pa.Schema:
        if self.known_schema is not None:
            return self.known_schema
        return self._pf.schema_arrow if self.parquet else self._stream.schema

    def rows(self) -> int:
        return self._pf.metadata.num_rows if self.parquet else self._stream.num_rows

    def column(self, name: str) -> Iterator[tuple[int, Any]]:
        """(first row, the column's chunk) for each row group (one chunk for an Arrow stream)."""
        if not self.parquet:
            yield 0, self._stream.column(name)
            return
        pf, first = self._pf, 0
        for g in range(pf.metadata.num_row_groups):
            yield first, pf.read_row_group(g, columns=[name]).column(name)
            first += pf.metadata.row_group(g).num_rows

    def cells(self, row: int, columns: Sequence[str]) -> dict[str, Any]:
        """The Python values of ``columns`` at ``row`` (its row group kept for the next rows)."""
        if not self.parquet:
            table = self._stream
            return {c: table.column(c)[row].as_py() for c in columns}
        pf, first = self._pf, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row < first + n:
                held = self._group
                if held is None or held[0] != first or not set(columns) <= set(held[1]):
                    group = pf.read_row_group(g, columns=list(columns))
                    held = self._group = (first, {c: group.column(c) for c in columns})
                return {c: held[1][c][row - first].as_py() for c in columns}
            first += n
        raise SourceError(f"{self.path}:{row}: no such row")

    def path_only(self, column: str, rows: Collection[int]) -> dict[int, str]:
        """row -> the path of each of ``rows`` whose ``column`` cell (an Audio/Image struct
        ``{bytes, path}``) holds a path and no bytes, as ``datasets``' ``to_parquet`` of local
        files writes it (see :func:`path_only_cell`). Read a row group at a time; a parquet
        row group whose statistics count no null ``bytes`` is not read (the Hub's files, every
        cell's bytes embedded), nor one holding none of ``rows``.

        Raises:
            OSError, ValueError, KeyError, TypeError, NotImplementedError: the column cannot be
                read (:data:`ARROW_READ_ERRORS`).
        """
        kind = self.schema().field(column).type
        pa = pyarrow_module()
        if not pa.types.is_struct(kind) or min(map(kind.get_field_index, PATH_CELL)) < 0:
            return {}
        import pyarrow.compute as pc

        out: dict[int, str] = {}
        rows = frozenset(rows)
        for first, chunk in self._may_hold_no_bytes(column, rows):
            nobytes = pc.and_(pc.is_valid(chunk), pc.is_null(pc.struct_field(chunk, "bytes")))
            paths = pc.struct_field(chunk, "path")
            for j in pc.indices_nonzero(pc.fill_null(nobytes, False)).to_pylist():
                named = paths[j].as_py() if first + j in rows else None
                if named:
                    out[first + j] = named
        return out

    def _may_hold_no_bytes(self, column: str, rows: Collection[int]) -> Iterator[tuple[int, Any]]:
        """(first row, the column's chunk) of each row group holding any of ``rows`` whose
        ``bytes`` may be null (the statistics say so, or there are none)."""
        if not self.parquet:
            yield 0, self._stream.column(column)
            return
        pf, first, wanted = self._pf, 0, sorted(rows)
        meta = pf.metadata
        leaf = f"{column}.bytes"
        at = next((i for i in range(meta.num_columns) if meta.schema.column(i).path == leaf), None)
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            start, first = first, first + group.num_rows
            i = bisect.bisect_left(wanted, start)
            if i == len(wanted) or wanted[i] >= first:
                continue  # none of the rows is in it
            st = None if at is None else group.column(at).statistics
            if st is not None and st.has_null_count and st.null_count == 0:
                continue
            yield start, pf.read_row_group(g, columns=[column]).column(column)


#: What reading a table file's column raises for a file that cannot be read (pyarrow's errors
#: subclass these: ArrowInvalid a ValueError, ArrowTypeError a TypeError, ArrowNotImplementedError
#: a NotImplementedError, ArrowIOError an OSError; a missing column a KeyError).
ARROW_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, NotImplementedError)


def cell_digests(
    f: TableFile,
    column: str,
    kind: CellKind,
    wanted: Mapping[int, str],
    held: Holder | None = None,
) -> ReadBack:
    """name -> SHA-256 of each wanted cell's bytes (``wanted``: row -> the name to give it), or
    a 1-tuple: why not, reading ``column`` one row group at a time (the file opened once); and
    the file's stat as of the reading (an object's from the GETs' responses: no HEAD). With
    ``held``, the cells' bytes are kept there under their names, for the build to decode."""
    out: dict[str, str | tuple[str]] = {}
    try:
        for first, chunk in f.column(column):
            for j in [r - first for r in wanted if first <= r < first + len(chunk)]:
                name = wanted[first + j]
                got = cell_bytes(chunk[j].as_py(), kind)
                if isinstance(got, str):
                    out[name] = (f"{f.path}:{first + j}: {got}",)
                    continue
                out[name] = hashlib.sha256(got).hexdigest()
                if held is not None:
                    held.keep(name, got)
    except ARROW_READ_ERRORS as e:
        why = f"{f.path}: cannot read column {column!r} ({first_line(e)})"
        return ReadBack({name: (why,) for name in wanted.values()}, None)
    return ReadBack(out, f.stat())
