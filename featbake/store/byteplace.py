"""Where an input's bytes live: a local path or an object URL, behind one interface.

Inputs (tar shards, table files, a manifest's rows, the kind ``--data`` names) ask a
:class:`BytePlace` (the byte seam) for their bytes, stats and listings: :func:`bytes_at` picks
the place of a path once, by its scheme, and callers ask it, never which it is. Each place
answers in its own way:

* :class:`LocalFiles`: a file's stat (size, mtime, inode, ctime), read by open and seek; a
  file's stat can stay the same over a rewrite within one timestamp tick (git's "racy" rule), and
  a file renamed over keeps no trace of the old version, so callers note the stat a listing was
  read at and check it again (:attr:`BytePlace.versioned` is False).
* :class:`Objects`: an object's stat is its (size, last change, ETag) as the store of its scheme
  maps it (:meth:`~featbake.store.objects.ObjectStore.file_stat`); every ranged GET's response
  carries it, so bytes and the version they are of come together without a HEAD, and the ETag
  changes with the bytes (:attr:`BytePlace.versioned` is True: never racy). A ``.tar.gz``
  object cannot be read by ranges: its stream is fetched in order by ranged GETs and
  decompressed as it comes (:func:`~featbake.store.containers.gzip_stream`), never held whole.

Both read a tar's members and a table file through the store's container readers
(:mod:`featbake.store.containers`), which take the place's ranged reads (:data:`Fetch`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple, TypeVar

from featbake.errors import ConfigError, SourceError, StoreError
from featbake.keys import sha256_file
from featbake.store.containers import (
    CARD_NAME,
    CARD_SUFFIXES,
    CONTAINER_SUFFIXES,
    TABLE_IGNORED_PREFIXES,
    Holder,
    Member,
    RangedObject,
    RangeRead,
    ReadBack,
    TableFile,
    file_kind,
    fits,
    folder_card,
    gzip_stream,
    is_gzip_tar,
    is_tar,
    list_members,
    member_digests,
    parquet_names,
    printable,
    ranged_member_digests,
    read_member,
    read_ranged_member,
    read_streamed_member,
    refuse_several_splits,
    stat_around,
    stat_or_none,
    streamed_member_digests,
    table_files,
)
from featbake.store.hash_cache import COARSE_RACY_FACTOR, RACY_NS, FileStat, HashRow
from featbake.store.objects import (
    CLIENT_CONNECTIONS,
    LIST_PAGE_KEYS,
    HashedObject,
    ListedPage,
    ObjectBytes,
    ObjectInfo,
    ObjectStore,
    object_stat,
)
from featbake.store.url import BucketURL, is_url
from featbake.threadpool import HASH_THREADS, OBJECT_THREADS, map_in_threads
from featbake.units import counted


def hidden_name(name: str, passed: tuple[str, ...] = (".",)) -> bool:
    """Whether a relative name has a hidden part (``.x/`` or ``.x``: one starting with one of
    ``passed``), passed over as a folder scan passes hidden files."""
    return any(part.startswith(passed) for part in name.split("/"))


def passed_over(name: str, passed: tuple[str, ...] = (".",)) -> bool:
    """Whether a relative name is one a folder of containers passes over: a hidden part (one
    starting with one of ``passed``: :func:`hidden_name`), or a folder whose name starts with
    ``__`` (``__MACOSX/``, ``__pycache__/``), which ``datasets`` leaves out of every split.

    Example:
        >>> passed_over("__MACOSX/a.tar"), passed_over(".x/a.tar"), passed_over("sub/__a.tar")
        (True, True, False)
    """
    return hidden_name(name, passed) or any(f.startswith("__") for f in name.split("/")[:-1])


def holds_only_names(names: Iterable[str], wanted: tuple[str, ...], also: tuple[str, ...]) -> bool:
    """Whether a folder whose visible files are ``names`` (relative; its top level's first,
    then those under it) is a container folder: its top level holds a file ending with
    ``wanted`` and none ending otherwise (but with ``also``), files of other kinds in its
    subfolders not read; a top level with no such file (nothing, or a ``README.md``) is judged
    by the files under it, any of another kind saying no. ``names`` is read only as far as the
    answer needs: the first top-level file of another kind says no, the first subfolder's file
    after a top level that said yes is not read.

    Example:
        >>> holds_only_names(["a.tar", "preview/x.wav"], (".tar",), ())
        True
        >>> holds_only_names(["README.md", "spk1/x.wav", "spk2/y.tar"], (".tar",), (".md",))
        False
    """
    found_top = found = False
    for name in names:
        nested = "/" in name
        if found_top and nested:
            return True  # the top level decided: its subfolders' other files are not inputs
        low = name.lower()
        if low.endswith(wanted):
            found, found_top = True, found_top or not nested
        elif not low.endswith(also):
            return False
    return found


def shard_names(where: str, names: Iterable[str], card: str | None = None) -> list[str]:
    """The tar shards among the names of a folder's files (or a bucket prefix's objects,
    relative to it), in name order: visible ones only (webdataset's shard lists are globs,
    which pass over hidden names; ``__name__/`` folders left out, as ``datasets`` leaves them:
    :func:`passed_over`), of one split as ``datasets`` reads them. The one rule of a local
    folder and a bucket prefix of shards.

    Raises:
        SourceError: the names say several splits, or one beside names of none
            (:func:`~featbake.store.containers.refuse_several_splits`).
    """
    kept = sorted(n for n in names if is_tar(n) and not passed_over(n))
    refuse_several_splits(where, kept, card)  # datasets reads such a folder as splits
    return kept


def refuse_tars_beside_files(where: str, top: Iterable[str]) -> None:
    """Refuse a folder (prefix) read as a folder of files whose top level holds tar shards
    beside files of other kinds (``top``: its visible top-level names): it is not a folder of
    shards (:func:`holds_only_names`), and reading its other files alone would leave the
    shards' samples out unsaid. A dataset card beside them (``README.md``, a ``.json``:
    :data:`~featbake.store.containers.CARD_SUFFIXES`) is no file of another kind, as the shard
    check takes it.

    Raises:
        SourceError: one line naming a shard and another file, and what to do.
    """
    names = sorted(top)
    tars = [n for n in names if is_tar(n)]
    others = [n for n in names if not is_tar(n) and not n.lower().endswith(CARD_SUFFIXES)]
    if tars and others:
        raise SourceError(
            f"{where} holds tar shards ({tars[0]}, {len(tars)} in all) beside other files "
            f"({others[0]}), so it is read neither as shards nor as a folder of files; keep "
            "only the shards at its top level (other files may sit in a subfolder), or name "
            "the shards with --data (a .tar, or a brace pattern such as shard-{000..009}.tar)"
        )


def expand_braces(pattern: str) -> list[str]:
    """The names a brace pattern stands for: ``{000..009}`` (zero-padded as written) and
    ``{a,b}``, as webdataset's shard lists (the ``braceexpand`` package) spell them.

    Example:
        >>> expand_braces("s-{08..10}-{a,b}.tar")
        ['s-08-a.tar', 's-08-b.tar', 's-09-a.tar', 's-09-b.tar', 's-10-a.tar', 's-10-b.tar']
    """
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end() :]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        lo, hi = span.groups()
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        choices = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    return [name for c in choices for name in expand_braces(head + c + tail)]


def resolved(path: str) -> str:
    """The absolute, symlink-free form of a local path, as the catalog stores it."""
    return str(Path(path).expanduser().resolve())


class Shards(NamedTuple):
    """The tar shards ``--data`` names: how messages name them, their folder, and the tars
    (None: every visible tar under the prefix ``where``, listed by the scan); and the notes
    of the folder's walk (folders it could not read: :func:`unread_note`)."""

    where: str
    folder: str
    tars: list[str] | None
    notes: tuple[str, ...] = ()


class Passed(NamedTuple):
    """A file a listing found and will not hand on as an input, and why (its name printable:
    bytes that are not UTF-8 written as ``\\xNN``)."""

    path: str
    reason: str


class Found(NamedTuple):
    """What listing a folder (a bucket prefix) of inputs found: their names relative to it,
    sorted; the files passed over, with why; and each input's stat as the listing gave it (an
    object's size, last change and ETag; ``{}`` for files, stat'ed when they are hashed); and
    the scan's notes, one line each (folders it could not read: :func:`unread_note`)."""

    inputs: list[str]
    skipped: list[Passed]
    listed: dict[str, FileStat]
    notes: tuple[str, ...] = ()


class Digest(NamedTuple):
    """The SHA-256 of an input's bytes, and the stat of the version they were read from."""

    stat: FileStat
    sha256: str


class Whole(NamedTuple):
    """An input's bytes read whole, and the stat of the version they are (None: a file that
    changed while it was read, or is gone since)."""

    data: bytes
    stat: FileStat | None


#: Why an input whose file was replaced or rewritten between its stat and its read fails.
CHANGED_WHILE_READ = (
    "changed while featbake was reading it (replaced or rewritten after it was stat'ed); "
    "rerun the build once it stops changing"
)


class BytePlace:
    """Where some bytes live (see the module's docstring): the operations every input kind
    reads through. Subclasses implement them; here they raise ``NotImplementedError``."""

    #: Whether a path's stat changes with its bytes (an object's ETag): such stats are never
    #: "racy", and what was read at one stat needs no check that the path was replaced since.
    versioned: ClassVar[bool] = False
    #: Whether reading bytes here means fetching them over the network (a request each): work
    #: that would read every input (a repair's re-digest) is not done for such a place.
    remote: ClassVar[bool] = False
    #: How many inputs are read at once to hash them (a file's read waits on its disk, an
    #: object's GET on its round trip).
    readers: ClassVar[int] = HASH_THREADS
    #: Whether a part of an input (a recording's segment) is decoded by seeking to it, reading
    #: nothing else (a file); else the input is read whole once and its parts decoded from
    #: those bytes (an object: one GET, not a request per segment).
    seeks: ClassVar[bool] = True

    # -- inputs one file (object) each ---------------------------------------------------------
    def inputs(self, where: str, extensions: Sequence[str]) -> Found:
        """The inputs under the folder (prefix) ``where`` whose names end with one of
        ``extensions`` (any case), sorted; hidden names (``.x``, ``.x/``) passed over unlisted.

        Raises:
            SourceError: there is no such folder, or it holds no such input.
            StoreError: the bucket cannot be listed (no credentials, no such bucket, denied).
        """
        raise NotImplementedError

    def folder(self, where: str) -> str:
        """The folder (prefix) ``where`` as roots and reports name it: a local folder absolute
        and symlink-free, a prefix as its URL without the trailing slash."""
        raise NotImplementedError

    def stats(self, paths: Sequence[str]) -> dict[str, FileStat | str]:
        """Each input's stat now, as the hash cache compares it, or why there is none (gone,
        unreadable), in as few requests as the place allows."""
        raise NotImplementedError

    def digest(self, path: str, expect: FileStat, held: Holder | None = None) -> Digest | str:
        """The SHA-256 of input ``path``'s bytes and the stat they were read at, or why they
        cannot be read; the bytes kept in ``held`` (under ``path``) when they fit its budget.

        ``expect`` is the stat the hash cache was asked with: a file read at another stat
        (replaced or rewritten since) gives :data:`CHANGED_WHILE_READ`, since its digest would
        be recorded under a stat that is not its own; an object's digest carries the stat of
        the response that carried its bytes (its ETag changes with them).
        """
        raise NotImplementedError

    def read(self, path: str) -> Whole:
        """Input ``path``'s bytes, whole, with the stat of the version they are.

        Raises:
            SourceError: it is gone or cannot be read.
        """
        raise NotImplementedError

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of input ``path`` from ``start`` (fewer at its end).

        Raises:
            SourceError: it is gone or cannot be read.
        """
        raise NotImplementedError

    def named(self, value: str, base: str) -> str:
        """The input a list's entry names (a manifest's cell): a local path relative to the
        folder ``base`` made absolute, or an object's URL as written.

        Raises:
            ConfigError: ``value`` is a URL featbake does not read, or a malformed one.
        """
        raise NotImplementedError

    def recorded_ns(self, rows: Sequence[HashRow], stat_time: int) -> int:
        """When hash rows of inputs here count as taken (``stat_time``: just before their
        stats were taken), for git's racy rule (``FileStat.racy``)."""
        raise NotImplementedError

    # -- containers ------------------------------------------------------------------------------

    def stat(self, path: str) -> FileStat | None:
        """``path``'s stat now, as the hash cache compares it, or None (gone, unreadable)."""
        raise NotImplementedError

    def tar_members(self, tar: str, size: int | None = None) -> list[Member]:
        """The regular-file members of ``tar`` from its headers (``size``: the object's, when
        a listing gave it, saving a HEAD).

        Raises:
            SourceError: it cannot be opened or read as a tar.
        """
        raise NotImplementedError

    def read_member(self, tar: str, member: Member) -> tuple[bytes, FileStat | None]:
        """The bytes of one member of ``tar``, and the tar's stat as of reading them.

        Raises:
            SourceError: the member cannot be read, or the tar ends inside it.
        """
        raise NotImplementedError

    def member_digests(
        self, tar: str, members: Sequence[Member], held: Holder | None = None
    ) -> ReadBack:
        """member name -> SHA-256 (or a 1-tuple: why not), and the tar's stat as of the
        reading; members that fit ``held``'s budget kept there."""
        raise NotImplementedError

    def holds_only(
        self,
        where: str,
        wanted: tuple[str, ...],
        also: tuple[str, ...] = (),
        passed: tuple[str, ...] = (".",),
    ) -> bool:
        """Whether the folder (prefix) ``where`` holds a visible file ending with ``wanted``,
        and no visible file ending otherwise (but with ``also``); False for no folder. A file
        whose name starts with one of ``passed`` is not visible (hidden ones; for a table's
        folder also ``_`` ones, as pyarrow passes over them)."""
        raise NotImplementedError

    def table_files(self, where: str, notes: list[str] | None = None) -> list[TableFile]:
        """The data files of the table at ``where``, in the dataset's order, each opened
        lazily where it is read; the walk's note (folders it could not read: :func:`unread_note`)
        added to ``notes``.

        Raises:
            SourceError: a DatasetDict folder, or a ``state.json`` naming no data file.
            ConfigError: a kind of table this place does not read in place.
        """
        raise NotImplementedError

    def is_table_folder(self, where: str) -> bool:
        """Whether ``where`` is a folder holding one table (``save_to_disk``'s, a DatasetDict's,
        or parquet files only)."""
        raise NotImplementedError

    def resolve(self, where: str) -> str:
        """``where`` as the catalog names it (a local path absolute and symlink-free)."""
        raise NotImplementedError

    def table_folder(self, where: str) -> str:
        """The folder a table's file names are relative to (the table's folder, or the one
        holding its single file)."""
        raise NotImplementedError

    def is_list_file(self, where: str, suffixes: tuple[str, ...]) -> bool:
        """Whether ``where`` names a list of inputs read whole here (a manifest, a lhotse cut
        list) ending with one of ``suffixes``: a local file's name; a bucket's object of such
        a name is no list (``where`` is then taken as a prefix of inputs)."""
        raise NotImplementedError

    def folder_has(self, where: str, name: str) -> bool:
        """Whether the folder ``where`` holds a file ``name`` (a Kaldi folder's ``wav.scp``);
        False for a bucket prefix (its Kaldi lists are not read in place)."""
        raise NotImplementedError

    def listed(self, folder: str) -> dict[str, ObjectInfo]:
        """The objects under the prefix ``folder`` by URL, with what one listing says of each
        (size, last change, ETag); {} for a local folder (its files are stat'ed as read).

        Raises:
            StoreError: the bucket cannot be listed (no credentials, no such bucket, denied).
        """
        raise NotImplementedError

    def shards(self, data: str) -> Shards:
        """The tar shards ``data`` names: a ``.tar``, a brace pattern, or a folder (prefix)."""
        raise NotImplementedError


class LocalFiles(BytePlace):
    """Files on this machine's file systems."""

    versioned = False

    def inputs(self, where: str, extensions: Sequence[str]) -> Found:
        # Hidden files and folders are skipped; symlinks are followed, each folder once (a link
        # back up the tree, ``link -> .``, must not repeat its files). Only regular files are
        # inputs (:func:`not_an_input`); a name that is not UTF-8 is passed over with why.
        root = Path(where)
        if root.is_file():  # a clip, or the encoder with the options swapped
            raise SourceError(
                f"{where} is a file, not a folder of inputs; as data give a folder (one clip: a "
                "folder holding it) or a list of inputs: a manifest (.jsonl, .csv, .tsv, NeMo "
                ".json), lhotse cuts, a .tar or a .parquet"
            )
        if not root.is_dir():
            raise SourceError(f"data folder {where} does not exist or is not a directory")
        exts = tuple(e.lower() for e in extensions)
        found: list[str] = []
        skipped: list[Passed] = []
        top: list[str] = []
        tars: list[str] = []  # in subfolders: no inputs here, and said so (nested_tars_note)
        unread: list[Unread] = []
        for rel_name, entry in walked(os.fspath(root), unread):
            if "/" not in rel_name:
                top.append(rel_name)
            if not entry.name.lower().endswith(exts):
                if "/" in rel_name and is_tar(rel_name) and not passed_over(rel_name):
                    tars.append(rel_name)
                continue
            why = not_an_input(rel_name, entry)
            if why is None:
                found.append(rel_name)
            else:
                skipped.append(Passed(printable(rel_name), why))
        refuse_tars_beside_files(where, top)
        if not found and not skipped:
            raise SourceError(
                f"no input files ({', '.join(sorted(exts))}) under {where}; "
                "check the folder, or pick the source kind with --source"
            )
        found.sort()
        # datasets reads train/ beside test/ as two splits, and those its README.md declares
        refuse_several_splits(where, found, folder_card(where, top))
        notes = (
            unread_note(where, unread),
            nested_tars_note(where, tars, exts),
            metadata_note(where, top),
        )
        return Found(found, skipped, {}, tuple(n for n in notes if n))

    def folder(self, where: str) -> str:
        return resolved(where)

    def stats(self, paths: Sequence[str]) -> dict[str, FileStat | str]:
        # Only regular files are read: a manifest's row may name a FIFO (whose open blocks
        # until a writer comes, which never does) or a folder; a folder's scan passed over them.
        out: dict[str, FileStat | str] = {}
        for p in paths:
            try:
                st = os.stat(p)
            except OSError as e:
                out[p] = f"cannot stat: {e.strerror}"
                continue
            if not stat.S_ISREG(st.st_mode):
                out[p] = not_regular(st.st_mode)
                continue
            out[p] = FileStat(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        return out

    def digest(self, path: str, expect: FileStat, held: Holder | None = None) -> Digest | str:
        # The stat of the file opened is compared before and after the read (not the path's:
        # a folder swapped for another version, whose files keep their stats, would pass a
        # path's stat taken after as well as git's index would).
        try:
            with open(path, "rb") as f:
                if FileStat.of(f.fileno()) != expect:
                    return CHANGED_WHILE_READ
                keep = fits(held, expect.size)
                if keep:
                    data = f.read()
                    sha = hashlib.sha256(data).hexdigest()
                else:  # streamed: a large file is never whole in memory
                    data, sha = b"", sha256_file(f.fileno())
                if FileStat.of(f.fileno()) != expect:
                    return CHANGED_WHILE_READ
        except OSError as e:
            return f"cannot read: {e.strerror}"
        if keep:
            held.keep(path, data)  # type: ignore[union-attr]
        return Digest(expect, sha)

    def read(self, path: str) -> Whole:
        def whole() -> bytes:
            with open(path, "rb") as f:
                return f.read()

        try:
            data, at = stat_around(path, whole)
        except OSError as e:
            raise SourceError(f"{path}: cannot read: {e.strerror}") from e
        return Whole(data, at)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(length)
        except OSError as e:
            raise SourceError(f"{path}: cannot read: {e.strerror}") from e

    def named(self, value: str, base: str) -> str:
        if "://" in value:
            raise ConfigError(
                f"{value}: featbake reads local paths and s3://, gs://, az:// URLs, not this scheme"
            )
        return os.path.normpath(os.path.join(base, os.path.expanduser(value)))

    def recorded_ns(self, rows: Sequence[HashRow], stat_time: int) -> int:
        return stat_time

    def stat(self, path: str) -> FileStat | None:
        return stat_or_none(path)

    def tar_members(self, tar: str, size: int | None = None) -> list[Member]:
        return list_members(tar)

    def read_member(self, tar: str, member: Member) -> tuple[bytes, FileStat | None]:
        return read_member(tar, member), stat_or_none(tar)  # stat'ed after the read

    def member_digests(
        self, tar: str, members: Sequence[Member], held: Holder | None = None
    ) -> ReadBack:
        return member_digests(tar, members, held)

    def holds_only(
        self,
        where: str,
        wanted: tuple[str, ...],
        also: tuple[str, ...] = (),
        passed: tuple[str, ...] = (".",),
    ) -> bool:
        # Asked of every ``--data`` folder: the folder's entries are read as they come
        # (unsorted), and the first file that says no ends it, so a million clips are not
        # listed to say no (holds_only_names); subfolders are entered only when the top level
        # holds no file of the kind.
        try:
            return holds_only_names(files_top_first(where, passed), wanted, also)
        except OSError:
            return False  # not a folder (or unreadable): the folder scan says why

    def table_files(self, where: str, notes: list[str] | None = None) -> list[TableFile]:
        unread: list[Unread] = []
        files = [TableFile(p) for p in table_files(where, lambda w: walked_names(w, unread))]
        if notes is not None and unread:
            notes.append(unread_note(where, unread))
        return files

    def is_table_folder(self, where: str) -> bool:
        if os.path.isfile(os.path.join(where, "dataset_dict.json")):
            return True
        if all(os.path.isfile(os.path.join(where, n)) for n in ("state.json", "dataset_info.json")):
            return True
        return self.holds_only(where, (".parquet",), CARD_SUFFIXES, TABLE_IGNORED_PREFIXES)

    def resolve(self, where: str) -> str:
        return resolved(where)

    def table_folder(self, where: str) -> str:
        return where if os.path.isdir(where) else os.path.dirname(where)

    def is_list_file(self, where: str, suffixes: tuple[str, ...]) -> bool:
        return where.lower().endswith(suffixes)

    def folder_has(self, where: str, name: str) -> bool:
        return os.path.isfile(os.path.join(where, name))

    def listed(self, folder: str) -> dict[str, ObjectInfo]:
        return {}

    def shards(self, data: str) -> Shards:
        folder, name = os.path.split(os.path.expanduser(data))
        if "{" in name:
            folder = resolved(folder or ".")
            return Shards(
                os.path.join(folder, name),
                folder,
                [os.path.join(folder, n) for n in expand_braces(name)],
            )
        if os.path.isdir(data):
            folder = resolved(data)
            unread: list[Unread] = []
            listing = walked_names(folder, unread)
            names = shard_names(folder, listing, folder_card(folder, listing))
            note = unread_note(folder, unread)
            tars = [os.path.join(folder, n) for n in names]
            return Shards(folder, folder, tars, (note,) if note else ())
        where = resolved(data)
        return Shards(where, os.path.dirname(where), [where])


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def dir_id(path: str | os.PathLike[str]) -> tuple[int, int]:
    """A folder's (device, inode): the folder scan walks each once."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def listing(
    folder: str, seen: set[tuple[int, int]], unread: list[Unread] | None = None
) -> tuple[list[os.DirEntry[str]], list[os.DirEntry[str]]]:
    """A folder's visible files, and its visible subfolders not walked yet (links followed).

    Read with ``os.scandir``, whose entries know their type without a ``stat`` call (a
    10,000-file rebuild spent a tenth of its time stat'ing each file twice). A folder is
    walked once by device and inode, so a link back up the tree (``link -> .``) cannot repeat
    its files. A folder that cannot be read is passed over, as ``os.walk`` does; one that
    could hold inputs (not ``lost+found`` nor a ``__name__`` folder: :func:`holds_no_inputs`)
    is added to ``unread``, which the scan says in one note (:func:`unread_note`), so its
    files are not left out unsaid.
    """
    try:
        with os.scandir(folder) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        if unread is not None and not holds_no_inputs(os.path.basename(folder)):
            unread.append(Unread(folder, e.strerror or str(e)))
        return [], []
    files, subfolders = [], []
    for entry in entries:
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if not is_dir:
            files.append(entry)
            continue
        try:
            ident = dir_id(entry.path)
        except OSError:
            continue  # a dangling or looping link: nothing to walk
        if ident not in seen:
            seen.add(ident)
            subfolders.append(entry)
    subfolders.reverse()  # popped last first: folders are walked in name order
    return files, subfolders


def files_top_first(where: str, passed: tuple[str, ...] = (".",)) -> Iterator[str]:
    """The names of the visible files under the folder ``where``, relative to it, as each
    folder lists them (unsorted, read lazily): the top level's first, then its subfolders'
    (links followed, each folder once; one whose name starts with one of ``passed`` or with
    ``__``, or that cannot be read, not entered). For checks that stop at the first name that
    says no (:func:`holds_only_names`): nothing is sorted, and no subfolder is stat'ed before
    the top level is read.

    Raises:
        OSError: ``where`` cannot be read as a folder.
    """
    seen: set[tuple[int, int]] = set()
    folders = [("", where)]  # (relative with a trailing slash, absolute), depth first
    while folders:
        rel, folder = folders.pop()
        try:
            ident = dir_id(folder)
            if ident in seen:
                continue  # a link back up the tree
            seen.add(ident)
            it = os.scandir(folder)
        except OSError:
            if not rel:
                raise
            continue
        below = []
        with it:
            for entry in it:
                if entry.name.startswith(passed):
                    continue
                if _is_dir(entry):
                    if not entry.name.startswith("__"):
                        below.append((f"{rel}{entry.name}/", entry.path))
                elif _is_file(entry):
                    yield rel + entry.name
        folders += reversed(below)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def walked(
    where: str, unread: list[Unread] | None = None
) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """(name relative to ``where``, entry) of each visible file under the folder ``where``,
    its subfolders walked depth first, each once (links followed, hidden names passed over:
    :func:`listing`; ``lost+found`` and ``__name__/`` folders not entered:
    :func:`holds_no_inputs`): the one walk of a folder's scan and of the shards and table
    files in it.
    The folders under ``where`` that cannot be read, and could hold inputs, are added to
    ``unread`` (one rule for audio, shard and table folders: :func:`unread_note`).

    Raises:
        OSError: ``where`` cannot be stat'ed (missing).
    """
    seen = {dir_id(where)}
    folders = [("", where)]  # (relative with a trailing slash, absolute)
    while folders:
        rel, folder = folders.pop()
        files, subfolders = listing(folder, seen, unread)
        # ``__name__/`` folders (``__MACOSX/``, ``__pycache__/``) are in no split to datasets
        # (in9.12): not entered, so a folder's inputs and split judgement pass over them
        folders += [(f"{rel}{e.name}/", e.path) for e in subfolders if not holds_no_inputs(e.name)]
        for entry in files:
            yield rel + entry.name, entry


def walked_names(where: str, unread: list[Unread] | None = None) -> list[str]:
    """The names of :func:`walked`'s files, relative to ``where``: the shards or table files
    of a folder (the folders that could not be read added to ``unread``)."""
    return [name for name, _ in walked(where, unread)]


class Unread(NamedTuple):
    """A folder a scan could not read (its path), and why (``Permission denied``)."""

    folder: str
    why: str


def holds_no_inputs(name: str) -> bool:
    """Whether a folder named ``name`` holds no inputs whether or not it can be read:
    ``lost+found`` (0700, root's, at every ext4 volume's root) and the ``__name__`` folders
    a folder of containers passes over (:func:`passed_over`). A shard or parquet folder at a
    volume's root must not fail on the first, nor a note name it.

    Example:
        >>> holds_no_inputs("lost+found"), holds_no_inputs("__MACOSX"), holds_no_inputs("spk2")
        (True, True, False)
    """
    return name == "lost+found" or name.startswith("__")


def unread_note(where: str, unread: Sequence[Unread]) -> str:
    """The scan's one note on the folders under ``where`` it could not read ("" for none):
    how many, the first and why, and what to do. A note, not a failure: the readable inputs
    build (a build that failed on any unreadable folder failed every shard folder at a
    volume's root, in9.13), and the note says what was left out rather than leaving it
    unsaid (in9.7).

    Example:
        >>> unread_note("/d", [Unread("/d/spk2", "Permission denied")]).split(";")[0]
        '1 folder under /d could not be read (/d/spk2: Permission denied)'
    """
    if not unread:
        return ""
    first = unread[0]
    count = counted(len(unread), "folder")
    return (
        f"{count} under {where} could not be read ({first.folder}: {first.why}); any inputs "
        "in them are left out of this build: fix their permissions and build again, or pass "
        "the readable folders as --data"
    )


def nested_tars_note(where: str, tars: Sequence[str], exts: Sequence[str]) -> str:
    """The scan's one note on the tar files in the subfolders of a folder (prefix) of input
    files ("" for none): a folder of files builds the files of its source's kind, so the tars'
    samples are not built; said with how many, the first, and how to build them, rather than
    left out unsaid (a tar at the top level is refused: :func:`refuse_tars_beside_files`).

    Example:
        >>> nested_tars_note("/d", ["sub/a.tar"], (".wav",)).split(";")[0]
        '1 tar file under /d is not read (sub/a.tar)'
    """
    if not tars:
        return ""
    first = sorted(tars)[0]
    count = counted(len(tars), "tar file")
    verb = "are" if len(tars) > 1 else "is"
    return (
        f"{count} under {where} {verb} not read ({first}); this build reads its "
        f"{', '.join(sorted(exts))} files only: to build the tars' samples, pass them as --data "
        "on their own (their folder, a .tar, or a brace pattern such as shard-{000..009}.tar)"
    )


#: The metadata files ``datasets``' folder builders (``audiofolder``, ``imagefolder``) read
#: beside a folder's files: their rows give the dataset's order and its columns.
METADATA_NAMES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")


def metadata_note(where: str, top: Iterable[str]) -> str:
    """The scan's note on a folder (prefix) of input files that holds a ``datasets`` metadata
    file at its top (``top``: its top-level names; "" for none): ``load_dataset("audiofolder")``
    serves the folder in that file's row order, with its columns, where a folder build serves
    its files in path order with none. Labels taken from ``datasets``' order and paired with
    the store's (``StackDataset``) would be paired with other items, of the same count, with
    no error; the note says how to build in the file's order.

    Example:
        >>> metadata_note("/d", ["a.wav", "metadata.csv"]).split(";")[0]
        '/d/metadata.csv orders the rows of load_dataset("audiofolder"/"imagefolder")'
        >>> metadata_note("/d", ["a.wav"])
        ''
    """
    names = sorted(n for n in top if n.lower() in METADATA_NAMES)
    if not names:
        return ""
    first = names[0]
    manifest = f"{where}/{first}"
    if first.lower().endswith(".parquet"):  # a table of cells, not a manifest of paths
        manifest = f"{where}/metadata.csv (written from it, the same columns)"
    return (
        f'{where}/{first} orders the rows of load_dataset("audiofolder"/"imagefolder"); this '
        "build serves the folder's files in path order (ds.path(i)), without its columns: to "
        f"serve its rows in its order, with its columns as ds.row(i), pass --data {manifest} "
        "--column file_name"
    )


def not_an_input(name: str, file: os.DirEntry[str] | str | os.PathLike[str]) -> str | None:
    """Why ``file`` cannot be an input, or None when it can: the one check of every input.

    The folder scan runs it on each entry it lists, a dataset on each path of a list it is
    given, so both refuse the same files for the same reasons: a name that is not UTF-8 (it
    cannot be keyed in the catalog), a missing file or a dangling link, a symlink loop, and
    anything but a regular file (a FIFO would block the first ``open`` forever, a device is not
    data, a folder is not a file). ``name`` is how the file is named in the catalog (relative
    to the data folder, or the path as given).
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "the file name is not valid UTF-8; rename it (e.g. with convmv) to include it"
    try:
        if isinstance(file, os.DirEntry):
            if file.is_file():  # no system call for a regular file (the directory says its type)
                return None
            mode = file.stat().st_mode
        else:
            mode = os.stat(file).st_mode  # follows links, as the scan does
            if stat.S_ISREG(mode):
                return None
    except FileNotFoundError:
        return "file not found (or a link to nothing)"
    except OSError as e:
        return f"cannot stat: {e.strerror}"  # ELOOP: a symlink loop
    return not_regular(mode)


def not_regular(mode: int) -> str:
    """Why a file of ``mode``, not a regular file, is no input (a folder scan's, a list's and a
    manifest row's one reason)."""
    return f"not a regular file ({file_kind(mode)}); only regular files are inputs"


_BUCKETS: dict[tuple[str, str], ObjectStore] = {}  # (scheme, bucket) -> its client, made lazily


def object_at(url: str) -> tuple[ObjectStore, str]:
    """(the store of object ``url``'s bucket, the object's key in it): one client per bucket,
    not per folder (making one costs ~0.1-0.2 s; a manifest's rows or a dataset's shards may
    span many folders).

    Example:
        >>> object_at("s3://team/shards/shard-000.tar")[1]
        'shards/shard-000.tar'
    """
    folder, name = url.rsplit("/", 1)
    where = BucketURL.parse(folder)
    return bucket_store(where), where.key(name)


def prefix_at(where: str) -> tuple[ObjectStore, str]:
    """(the store of prefix ``where``'s bucket, the prefix as its objects' keys start: with a
    trailing slash, or "" for the whole bucket): the bucket's one client, as :func:`object_at`.

    Example:
        >>> prefix_at("gs://team/audio/")[1]
        'audio/'
    """
    url = BucketURL.parse(where)
    return bucket_store(url), url.key("")


def bucket_card(bucket: ObjectStore, key: str, names: Collection[str]) -> str | None:
    """The text of the ``README.md`` at a prefix (``key``; ``names``: its objects' names
    relative to it, as listed) where the listing holds one, read by one GET: a Hub snapshot
    uploaded whole declares its splits there (see
    :func:`~featbake.store.containers.refuse_declared_splits`). None where none is listed."""
    if CARD_NAME not in names:
        return None
    try:
        return bucket.read(key + CARD_NAME).data.decode("utf-8", errors="replace")
    except FileNotFoundError:  # deleted since the listing: nothing declared now
        return None


def bucket_store(url: BucketURL) -> ObjectStore:
    """The object store of ``url``'s bucket (its scheme's: s3, gs, az), made once per bucket."""
    bucket = _BUCKETS.get((url.scheme, url.bucket))
    if bucket is None:
        bucket = ObjectStore(BucketURL(url.bucket, scheme=url.scheme))
        _BUCKETS[url.scheme, url.bucket] = bucket
    return bucket


_R = TypeVar("_R")


def read_object(bucket: ObjectStore, name: str) -> ObjectBytes | str:
    """Object ``name`` of ``bucket``, whole, or why it cannot be read (gone, or the bucket's
    one line)."""
    return object_or_why(lambda: bucket.read(name))


def hashed_object(bucket: ObjectStore, name: str) -> HashedObject | str:
    """Object ``name``'s SHA-256 streamed from one GET (:meth:`ObjectStore.hashed`), or why
    it cannot be read."""
    return object_or_why(lambda: bucket.hashed(name))


def object_or_why(read: Callable[[], _R]) -> _R | str:
    """``read()``, or why the object cannot be read (gone, or the bucket's one line)."""
    try:
        return read()
    except FileNotFoundError:
        return "object not found (deleted since the listing?)"
    except StoreError as e:
        return str(e)


def object_fetch(url: str) -> Callable[[int, int], RangeRead]:
    """Ranged reads of object ``url`` (one GET each) with the object's stat as each response
    gives it, for the store's container readers (see :data:`~featbake.store.containers.Fetch`).
    """
    bucket, name = object_at(url)

    def fetch(start: int, length: int) -> RangeRead:
        try:
            got = bucket.read_range_of(name, start, length)
        except FileNotFoundError:
            raise SourceError(f"{url}: object not found (deleted since the listing?)") from None
        except StoreError as e:
            raise SourceError(str(e)) from e
        return RangeRead(got.data, bucket.file_stat(got.info))

    return fetch


def object_head(url: str) -> ObjectInfo | None:
    """Object ``url``'s HEAD (None: there is none).

    Raises:
        StoreError: the bucket cannot be read (the store's one line).
    """
    bucket, name = object_at(url)
    return bucket.head(name)


def ranged_object(url: str, size: int | None = None) -> RangedObject:
    """The object ``url`` as a seekable file of ranged GETs (its size from a HEAD when not
    given).

    Raises:
        SourceError: there is no such object.
    """
    if size is None:
        info = object_head(url)
        if info is None:
            raise SourceError(f"{url}: object not found")
        size = info.size
    return RangedObject(url, size, object_fetch(url))


#: Why an object whose key holds an empty, ``.`` or ``..`` folder is no input.
UNNAMABLE_KEY = (
    "the object's key holds an empty, '.' or '..' folder ('a//b.wav'), which an input's path "
    "cannot name (it would read another object); rename the object to include it"
)


def unnamable_key(rel: str) -> bool:
    """Whether an object's key (relative to the prefix listed) holds an empty, ``.`` or ``..``
    folder: its URL read back as a path names another object (``audio/sub//x.wav`` is read as
    ``audio/sub/x.wav``), so it is passed over, never read as that other object's bytes.

    Example:
        >>> [unnamable_key(k) for k in ("a/b.wav", "a//b.wav", "./b.wav", "a/../b.wav")]
        [False, True, True, True]
    """
    return any(part in ("", ".", "..") for part in rel.split("/"))


class Objects(BytePlace):
    """Objects in a bucket, named by URL (``s3://``, ``gs://``, ``az://``): read by ranged GETs,
    each response carrying the object's stat."""

    versioned = True
    remote = True
    readers = OBJECT_THREADS
    seeks = False

    def inputs(self, where: str, extensions: Sequence[str]) -> Found:
        # One LIST of the prefix: each object's size, last change and ETag come with it, so a
        # rebuild of unchanged objects reads none of them (their digests are in the hash cache).
        exts = tuple(e.lower() for e in extensions)
        prefix = self.folder(where)
        bucket, key = prefix_at(prefix)
        listing = bucket.list(key)
        listed = {
            o.name[len(key) :]: bucket.file_stat(o)
            for o in listing
            if o.name.lower().endswith(exts) and not passed_over(o.name[len(key) :])
        }
        skipped = [Passed(n, UNNAMABLE_KEY) for n in sorted(listed) if unnamable_key(n)]
        for passed in skipped:
            del listed[passed.path]
        rels = [o.name[len(key) :] for o in listing]
        top = [n for n in rels if "/" not in n]
        refuse_tars_beside_files(prefix, [n for n in top if not hidden_name(n)])
        tars = [n for n in rels if "/" in n and is_tar(n) and not passed_over(n)]
        if not listed and skipped:
            raise SourceError(f"{prefix}/{skipped[0].path}: {skipped[0].reason}")
        if not listed:
            found = f"{len(listing)} objects, none of them" if listing else "no objects, so no"
            raise SourceError(
                f"{found} input files ({', '.join(sorted(exts))}) under {prefix}/; check "
                "the URL (the prefix, e.g. s3://bucket/audio/), or pick the source kind with "
                "--source"
            )
        names = sorted(listed)
        refuse_several_splits(prefix, names, bucket_card(bucket, key, rels))  # as a folder's
        notes = (nested_tars_note(prefix, tars, exts), metadata_note(prefix, top))
        return Found(names, skipped, listed, tuple(n for n in notes if n))

    def folder(self, where: str) -> str:
        return str(BucketURL.parse(where))

    def stats(self, paths: Sequence[str]) -> dict[str, FileStat | str]:
        # Per bucket, from LIST pages or HEADs, whichever takes fewer requests (stat_objects).
        buckets: dict[int, tuple[ObjectStore, dict[str, str]]] = {}
        for p in paths:
            bucket, name = object_at(p)
            buckets.setdefault(id(bucket), (bucket, {}))[1][name] = p
        out: dict[str, FileStat | str] = {}
        for bucket, urls in buckets.values():
            for name, info in stat_objects(bucket, list(urls)).items():
                out[urls[name]] = info if isinstance(info, str) else bucket.file_stat(info)
        return out

    def digest(self, path: str, expect: FileStat, held: Holder | None = None) -> Digest | str:
        # One GET: the digest is recorded against the ETag of the very response whose bytes
        # were hashed (not the listing's), so the pair cannot disagree. With nothing held,
        # hashed as it comes (a Ray hashing task runs 8 readers per CPU: whole objects in
        # memory, a 64-CPU node held some 512 of them at once).
        bucket, name = object_at(path)
        if held is None:
            hashed = hashed_object(bucket, name)
            if isinstance(hashed, str):
                return hashed
            return Digest(bucket.file_stat(hashed.info), hashed.sha256)
        got = read_object(bucket, name)
        if isinstance(got, str):
            return got
        if held is not None:
            held.keep(path, got.data)  # the very bytes hashed: decoded from there
        return Digest(bucket.file_stat(got.info), hashlib.sha256(got.data).hexdigest())

    def read(self, path: str) -> Whole:
        bucket, name = object_at(path)
        got = read_object(bucket, name)
        if isinstance(got, str):
            raise SourceError(f"{path}: {got}")
        return Whole(got.data, bucket.file_stat(got.info))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        bucket, name = object_at(path)
        try:
            return bucket.read_range(name, start, length)
        except FileNotFoundError:
            raise SourceError(f"{path}: object not found (deleted since the listing?)") from None
        except StoreError as e:
            raise SourceError(f"{path}: {e}") from e

    def named(self, value: str, base: str) -> str:
        BucketURL.parse(value.rpartition("/")[0])  # a malformed URL: its one line
        if unnamable_key(value.split("://", 1)[1].partition("/")[2]):
            raise ConfigError(f"{value}: {UNNAMABLE_KEY}")
        return value

    def recorded_ns(self, rows: Sequence[HashRow], stat_time: int) -> int:
        # An object's stat holds its ETag, which changes with its bytes: its rows are never
        # racy, so they count as taken a tick after the newest change they name.
        newest = max((r.stat.mtime_ns for r in rows), default=0)
        return max(time.time_ns(), newest + RACY_NS * COARSE_RACY_FACTOR + 1)  # whole seconds

    def stat(self, path: str) -> FileStat | None:
        bucket, name = object_at(path)
        try:
            info = bucket.head(name)
        except StoreError:
            return None
        return None if info is None else bucket.file_stat(info)

    def tar_members(self, tar: str, size: int | None = None) -> list[Member]:
        try:
            if not is_gzip_tar(tar):
                return list_members(tar, ranged_object(tar, size))
            return list_members(tar, gzip_stream(RangedObject(tar, size, object_fetch(tar))))
        except StoreError as e:
            raise SourceError(f"{tar}: not a readable tar file ({e})") from e

    def read_member(self, tar: str, member: Member) -> tuple[bytes, FileStat | None]:
        if is_gzip_tar(tar):  # streamed up to the member: a gzip stream has no ranges
            return read_streamed_member(tar, member, RangedObject(tar, None, object_fetch(tar)))
        got = read_ranged_member(tar, member, object_fetch(tar))
        return got.data, got.stat

    def member_digests(
        self, tar: str, members: Sequence[Member], held: Holder | None = None
    ) -> ReadBack:
        if is_gzip_tar(tar):  # one pass over its stream, fetched in order by ranges
            raw = RangedObject(tar, None, object_fetch(tar))
            return streamed_member_digests(tar, members, raw, held)
        return ranged_member_digests(tar, members, object_fetch(tar), held)

    def holds_only(
        self,
        where: str,
        wanted: tuple[str, ...],
        also: tuple[str, ...] = (),
        passed: tuple[str, ...] = (".",),
    ) -> bool:
        # Read page by page as the answer needs (holds_only_names): the top level first (a
        # listing with "/" as the delimiter, sub-prefixes rolled up), then, only when it holds
        # no object of the kind, the whole prefix. An audio prefix costs one page: its first
        # object says no. A name ending as a container file names one object, not a prefix: no
        # LIST to tell. A prefix that cannot be listed is no container: the scan says why.
        if where.lower().endswith(CONTAINER_SUFFIXES):
            return False
        try:
            bucket, key = prefix_at(where)
            top = listed_lazily(bucket, key, "/")
            below = (n for n in listed_lazily(bucket, key) if "/" in n)
            names = (n for n in itertools.chain(top, below) if not passed_over(n, passed))
            return holds_only_names(names, wanted, also)
        except (StoreError, ConfigError):
            return False

    def table_files(self, where: str, notes: list[str] | None = None) -> list[TableFile]:
        if where.lower().endswith(".parquet"):
            # One object, or the prefix Spark's ``df.write.parquet("s3://b/out.parquet")``
            # writes (``out.parquet/part-0.parquet``): the HEAD that tells them apart gives the
            # object's stat, so the scan's listing does not HEAD it again.
            info = object_head(where)
            if info is not None:
                return [TableFile(where, ranged_object, headed=object_stat(info))]
            return self.table_files(f"{where}/")
        if where.lower().endswith(".arrow"):
            raise ConfigError(
                f"Arrow files and Hugging Face datasets in a bucket ({where}) are not read in "
                "place yet; copy them to a local folder (e.g. with `aws s3 sync`) and pass that "
                "as --data"
            )
        # A prefix of parquet objects (is_table_folder): one LIST, the names under it read as a
        # local folder's are (pyarrow's ignored names passed over, one split), in name order.
        bucket, key = prefix_at(where)
        names = [o.name[len(key) :] for o in bucket.list(key)]
        kept = parquet_names(names)
        refuse_several_splits(where, kept, bucket_card(bucket, key, names))
        return [TableFile(f"{where}/{n}", ranged_object) for n in kept]

    def is_table_folder(self, where: str) -> bool:
        return self.holds_only(where, (".parquet",), CARD_SUFFIXES, TABLE_IGNORED_PREFIXES)

    def resolve(self, where: str) -> str:
        if where.lower().endswith(CONTAINER_SUFFIXES):
            return where  # one object
        return str(BucketURL.parse(where))  # a prefix, as messages and the catalog name it

    def table_folder(self, where: str) -> str:
        if where.lower().endswith(CONTAINER_SUFFIXES):
            return where.rsplit("/", 1)[0]
        return where  # a prefix of parquet objects: their names are relative to it

    def is_list_file(self, where: str, suffixes: tuple[str, ...]) -> bool:
        return False

    def folder_has(self, where: str, name: str) -> bool:
        return False

    def listed(self, folder: str) -> dict[str, ObjectInfo]:
        bucket, key = prefix_at(folder)
        return {bucket.where(o.name): o for o in bucket.list(key)}

    def shards(self, data: str) -> Shards:
        if not is_tar(data):  # a prefix of tars only: listed by the scan
            where = str(BucketURL.parse(data))
            return Shards(where, where, None)
        folder, name = data.rsplit("/", 1)
        return Shards(data, folder, [f"{folder}/{n}" for n in expand_braces(name)])


def listed_lazily(bucket: ObjectStore, key: str, delimiter: str = "") -> Iterator[str]:
    """The names of the objects under the prefix ``key`` (relative to it), a LIST page at a
    time as they are read: a check that stops at its first name makes one request. With
    ``delimiter`` ``"/"``, the prefix's top level only (its sub-prefixes rolled up).

    Raises:
        StoreError: the bucket cannot be listed.
    """
    after = ""
    while True:
        page = bucket.list_page(key, after, delimiter=delimiter)
        yield from (o.name[len(key) :] for o in page.objects)
        if not page.truncated or not page.last or page.last <= after:
            return
        # A page ending on a rolled-up sub-prefix (``a/b/``) goes on past all of its names.
        after = page.last + (LAST_CHARACTER if delimiter and page.last.endswith(delimiter) else "")


#: The code point that sorts last (as its UTF-8 bytes do): names after ``a/b/`` + it are past
#: every name under ``a/b/`` but one starting so (which a delimiter rolls up with them anyway).
LAST_CHARACTER = "\U0010ffff"


#: The places, one each: stateless (a bucket's clients are kept by :func:`object_at`).
LOCAL_FILES = LocalFiles()
OBJECTS = Objects()


def bytes_at(path: str) -> BytePlace:
    """The place ``path`` names: an object URL's bucket, else local files.

    Example:
        >>> bytes_at("s3://team/a.wav").versioned, bytes_at("/data/a.wav").versioned
        (True, False)
    """
    return OBJECTS if is_url(path) else LOCAL_FILES


# == object_stats ==================================================================================
# The stat of objects named one by one (a manifest's ``s3://`` rows), what the hash cache compares
# (:func:`object_stat`), in as few requests as a folder's layout allows, without knowing how many
# objects a folder holds.
#
# **Per folder** (the names' common folder), the choice is one LIST page per up to
# :data:`~featbake.store.objects.LIST_PAGE_KEYS` names (a page names each object's size, last
# change and ETag, as a HEAD does) or a HEAD per name. A folder whose rows name most of it is
# listed (a 100,000-row rebuild: 100 LISTs, not 100,000 HEADs); two rows in a folder of a million
# objects are two HEADs, not a thousand pages. The rule, a ski-rental one:
#
# * a folder with fewer than :data:`LIST_PAGE_HEADS` names is HEADed: one page could save no more
#   HEADs than its own price (AWS bills a LIST as 12.5 HEADs; a page of 1,000 entries is ~250 KB
#   of XML to move and parse, and the next page waits for it);
# * else it is listed page by page, each page from its names' longest common prefix (``a/clip0``,
#   not only ``a/``; ``/`` as the delimiter, so a sub-folder is one entry) and starting just
#   before the first name not yet settled (``StartAfter``: a stretch of the folder no row names
#   is jumped over, not paged through), and a name the page's range passed without showing is
#   HEADed (gone, most likely: its HEAD fails it as before);
# * listing stops, and the names left are HEADed, once the pages spent cost a page more (in HEADs,
#   at :data:`LIST_PAGE_HEADS` a page) than the HEADs they saved.
#
# **Worst case**, for a folder of ``n`` names: the listing stops before its pages cost two pages
# more than the HEADs they saved, so the requests are at most ``n + 1`` (a HEAD each: ``n``) and
# their price at most two pages over ``n`` HEADs; in the best case (the rows name the folder's
# objects) ``ceil(n / 1000)`` LISTs and no HEAD. A LIST the bucket refuses (a policy granting
# ``s3:GetObject`` without ``s3:ListBucket``) or that fails turns the bucket's names left to HEADs.
#
# The HEADs (of every folder) run :data:`HEAD_THREADS` at once, and the folders' listings as
# many, through the one pool every hashing loop uses (:func:`featbake.threadpool.map_in_threads`)
# and one client per bucket (boto3's clients are thread-safe; making one costs ~0.1 s, so not one
# per folder).

#: What one LIST page costs, counted in HEADs (see above): a folder with fewer names is HEADed.
LIST_PAGE_HEADS = 12
#: HEADs (and folder listings) in flight at once: each waits mostly on its round trip.
HEAD_THREADS = CLIENT_CONNECTIONS


def just_before(name: str) -> str:
    """A name that sorts before ``name`` with (almost) nothing between: its last character one
    lower (S3 sorts keys by their UTF-8 bytes, which is code-point order), or dropped where one
    lower is no character. Between the two lie only names that start with the result and go on
    (``a/clip7.wau...``): they cost their place in a page, and ``name`` itself sorts after it.

    Example:
        >>> just_before("a/clip7.wav")
        'a/clip7.wau'
    """
    if not name:
        return ""
    last = ord(name[-1]) - 1
    if last < 0 or 0xD800 <= last <= 0xDFFF:
        return name[:-1]
    return name[:-1] + chr(last)


def common_prefix(a: str, b: str) -> str:
    """The longest start ``a`` and ``b`` share, character by character (not by path part: a
    listing's prefix narrows to ``a/clip0``, not only ``a/``).

    Example:
        >>> common_prefix("a/clip0017.wav", "a/clip0423.wav")
        'a/clip0'
    """
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


@dataclass
class FolderListing:
    """One folder's names, settled by listing it page by page while that pays (see the
    section's comment): ``found`` from pages, ``passed`` (a page's range went past them and
    did not show them) and ``todo`` (not reached) left for HEADs.

    Args:
        bucket: the bucket, names relative to it.
        todo: the folder's names, sorted, none settled yet.
        refused: set once a listing of this bucket failed: no folder lists again.
    """

    bucket: ObjectStore
    todo: list[str]
    refused: threading.Event
    found: dict[str, ObjectInfo] = field(default_factory=dict)
    passed: list[str] = field(default_factory=list)
    pages: int = 0
    last: str = ""

    def pays(self) -> bool:
        """Whether to list one more page: names are left, listing is not refused, and the pages
        so far cost (in HEADs) less than a page more than the HEADs they saved."""
        spent = self.pages * LIST_PAGE_HEADS - len(self.found)
        return bool(self.todo) and not self.refused.is_set() and spent < LIST_PAGE_HEADS

    def run(self) -> FolderListing:
        """List pages while :meth:`pays`; itself, with what they settled."""
        if len(self.todo) < LIST_PAGE_HEADS:
            return self  # a page could not save its own price: all HEADs
        while self.pays():
            prefix = common_prefix(self.todo[0], self.todo[-1])  # sorted: theirs is all's
            after = max(self.last, just_before(self.todo[0]))
            try:
                page = self.bucket.list_page(prefix, after, keys=LIST_PAGE_KEYS, delimiter="/")
            except StoreError:
                self.refused.set()  # denied or failing: the names left are HEADed, as before
                return self
            self.pages += 1
            self.settle(page)
        return self

    def settle(self, page: ListedPage) -> None:
        """The names ``page`` covers (up to its last name, or all when nothing follows it):
        found where it shows them, passed where not."""
        shown = {o.name: o for o in page.objects}
        end = bisect.bisect_right(self.todo, page.last) if page.truncated else len(self.todo)
        for name in self.todo[:end]:
            if name in shown:
                self.found[name] = shown[name]
            else:
                self.passed.append(name)
        del self.todo[:end]
        self.last = max(self.last, page.last)

    @property
    def unsettled(self) -> list[str]:
        """The names a HEAD settles: passed by a page, or not reached."""
        return [*self.passed, *self.todo]


def head_or_why(bucket: ObjectStore, name: str) -> ObjectInfo | str:
    """Object ``name``'s HEAD, or why there is none (not found, or the bucket's one line)."""
    try:
        info = bucket.head(name)
    except StoreError as e:
        return str(e)
    return "object not found" if info is None else info


def stat_objects(bucket: ObjectStore, names: Sequence[str]) -> dict[str, ObjectInfo | str]:
    """Each named object's size, last change and ETag (from a LIST page or a HEAD: the same
    :func:`object_stat` either way), or why it cannot be read, in the fewest requests the
    section's rule finds (its comment states the worst case).

    Example:
        >>> stat_objects(ObjectStore(BucketURL.parse("s3://team")), ["a/x.wav"])  # doctest: +SKIP
        {'a/x.wav': ObjectInfo(name='a/x.wav', size=32044, modified=..., etag='9b2c...')}
    """
    folders: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        folders.setdefault(name.rpartition("/")[0], []).append(name)
    refused = threading.Event()
    listings = [FolderListing(bucket, group, refused) for group in folders.values()]
    out: dict[str, ObjectInfo | str] = {}
    heads: list[str] = []
    for done in map_in_threads(FolderListing.run, listings, HEAD_THREADS):
        out.update(done.found)
        heads += done.unsettled
    head = functools.partial(head_or_why, bucket)
    out.update(zip(heads, map_in_threads(head, heads, HEAD_THREADS), strict=True))
    return out
