"""Fingerprints that read bytes: inputs (files, objects, and the items inside containers: tar
members, table cells), through the hash cache and the byte seam, and encoders (cached by file
stat).

Importing this module imports no torch: a Ray hashing task (bake/ray_hashing.py) runs
:func:`digest_here` in a worker process that needs no encoder, where torch's import alone costs
seconds of CPU. The encoder fingerprints below import :mod:`featbake.encode.encoders` (torch) on
first use; their callers have loaded an encoder, or are about to.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from featbake.keys import canonical_json, sha256_file, sha256_hex, unsaved_state_fingerprint
from featbake.progress import Progress
from featbake.store.byteplace import BytePlace, Digest, bytes_at
from featbake.store.containers import Holder, ReadBack
from featbake.store.hash_cache import (
    ENCODER_FP_PREFIX,
    FileStat,
    HashCache,
    HashRow,
    racy_window_ns,
)
from featbake.threadpool import map_in_threads
from featbake.version import __version__

if TYPE_CHECKING:
    from featbake.encode.encoders import LoadedEncoder

# == held ==========================================================================================
# Input bytes kept from hashing for decoding: a first build reads each input once.
#
# A first build hashed every input (for its key) and later decoded it from the file again: two
# reads of the data (issue 31 item 3). The bytes read for the digest are kept here, within a
# budget, and the decoder takes them (:class:`featbake.bake.threads.HeldSource`) instead of
# opening the file again. They are exactly the bytes the key was made from, so no file changed
# since can be stored under an old key; inputs past the budget are read twice, as before.
#: Bytes of inputs kept between hashing and decoding at most (inputs past it are read again).
HELD_BYTES = 256 << 20


class HeldBytes:
    """path -> the bytes hashed for its key, up to ``budget`` bytes in all (thread-safe).

    One bytes object may be kept under several paths (:meth:`share`: the segments of one
    object in a bucket); it is counted against the budget once, until its last path lets go.

    Example:
        >>> held = HeldBytes(budget=1 << 20)
        >>> held.keep("a.wav", b"abc"), held.take("a.wav"), held.take("a.wav")
        (True, b'abc', None)
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = HELD_BYTES if budget is None else budget
        self.size = 0
        self._data: dict[str, bytes] = {}
        self._users: dict[int, int] = {}  # id of a bytes object kept -> how many paths keep it
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def keep(self, path: str, data: bytes) -> bool:
        """Keep ``data``, the bytes just hashed for the input named ``path`` (a tar member, a
        table's cell, an object), if they fit in the budget; whether they were kept."""
        with self._lock:
            if self.size + len(data) > self.budget:
                return False
            self._put(path, data)
        return True

    def share(self, path: str, names: Collection[str]) -> None:
        """Keep the bytes kept for ``path`` under each of ``names`` instead (the rows that
        decode from one object), counted once; nothing if none were kept for ``path``."""
        with self._lock:
            data = self._data.get(path)
            if data is None:
                return
            for name in names:
                self._put(name, data)
            self._drop(path)

    def peek(self, path: str) -> bytes | None:
        """The bytes kept for ``path``, or None; still kept (a header read from them)."""
        with self._lock:
            return self._data.get(path)

    def take(self, path: str) -> bytes | None:
        """The bytes kept for ``path`` (given once, then dropped), or None."""
        with self._lock:
            data = self._data.get(path)
            if data is not None:
                self._drop(path)
            return data

    def keep_only(self, paths: Collection[str]) -> None:
        """Drop what was kept for inputs not in ``paths`` (stored already: never decoded)."""
        with self._lock:
            for path in [p for p in self._data if p not in paths]:
                self._drop(path)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._users.clear()
            self.size = 0

    def _put(self, path: str, data: bytes) -> None:
        """Keep ``data`` under ``path``, counting its bytes if no other path keeps it (the
        lock held)."""
        if path in self._data:
            self._drop(path)
        users = self._users.get(id(data), 0)
        if users == 0:
            self.size += len(data)
        self._users[id(data)] = users + 1
        self._data[path] = data

    def _drop(self, path: str) -> None:
        """Forget ``path``'s bytes, uncounting them when no other path keeps them (the lock
        held)."""
        data = self._data.pop(path)
        users = self._users.pop(id(data)) - 1
        if users:
            self._users[id(data)] = users
        else:
            self.size -= len(data)


# == fingerprints ==================================================================================
def file_fingerprint(path: str | os.PathLike[str] | int) -> str:
    """SHA-256 of a file's bytes (a path, or an open descriptor read from its position),
    streamed (never the whole file in memory)."""
    return sha256_file(path)


def resolve_path(path: str | os.PathLike[str]) -> str:
    """The absolute, symlink-free form of a path, as stored in the catalog."""
    return str(Path(path).expanduser().resolve())


# -- inputs ----------------------------------------------------------------------------------
# Reading and hashing the inputs the hash cache does not know is the one step of
# :func:`hash_inputs` that may run elsewhere: a :class:`Digester` is given them (one place's at a
# time) and returns each one's digest. The default reads them here, on a few threads; an engine's
# may read them on its cluster (:class:`featbake.bake.ray_engine.ClusterDigests`). Everything
# around it stays here: the stats the digests are checked against, the hash cache consulted and
# filled (with the racy rule's recording time), the failures, the progress.
@dataclass(frozen=True)
class DigestAsk:
    """One input to digest: its full name, the stat the hash cache was asked with (the read
    checks the bytes are that version's), and where to keep its bytes for decoding (None:
    streamed, kept nowhere)."""

    path: str
    stat: FileStat
    held: Holder | None = None


@dataclass(frozen=True)
class Digested:
    """What digesting one input gave: its digest and the stat it was read at, or why it
    cannot be read."""

    path: str
    got: Digest | str


class Digester(Protocol):
    """Digests inputs of one place the hash cache did not know (see the section comment)."""

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        """One :class:`Digested` for each of ``asks``, in any order, each as soon as it is
        done (the build's progress ticks with them); ``place.digest``'s answer for each."""
        ...


def digest_here(place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
    """The default :class:`Digester`: ``asks`` read and hashed by this process, on
    ``place.readers`` threads, their bytes kept where each ask says."""

    def one(ask: DigestAsk) -> Digested:
        return Digested(ask.path, place.digest(ask.path, ask.stat, ask.held))

    return map_in_threads(one, asks, place.readers)


def hash_inputs(
    catalog: HashCache,
    paths: Sequence[str],
    progress: Callable[[Progress], None] | None = None,
    stats: dict[str, FileStat] | None = None,
    held: HeldBytes | None = None,
    hold: Collection[str] | None = None,
    known: Mapping[str, FileStat] | None = None,
    digester: Digester = digest_here,
) -> tuple[dict[str, str], dict[str, str]]:
    """SHA-256 of each input (a file, or an object in a bucket), reading only those whose stat
    the hash cache does not know; every input read through the place it is at
    (:func:`featbake.store.byteplace.bytes_at`), the one way files and objects are hashed.

    A cached digest is trusted only if the input's stat equals the one it was hashed with: a
    file's (size, mtime, ctime, inode), not changed within a second of that (a "racy" entry,
    see ``FileStat.racy``); an object's (size, last change, ETag), never racy.

    Args:
        catalog: whose hash cache to consult and fill.
        paths: the inputs to hash.
        progress: called as hashing advances.
        stats: if given, filled with path -> the FileStat each digest belongs to, so a later
            reader can tell whether the input changed since (see :class:`DecodeDataset`).
        held: if given, keeps the bytes of the inputs read, for a build to decode them from
            (see :mod:`featbake.encode.fingerprints`).
        hold: with ``held``, the only paths whose bytes it keeps (None: all of them); the
            others are hashed streamed (a recording whose segments are decoded by seeking).
        known: stats already known (a bucket prefix's listing): no request is made for them.
        digester: reads and hashes the inputs the hash cache does not know (default: here,
            :func:`digest_here`; an engine's reads them on its cluster).

    Returns:
        (path -> sha256, path -> reason for inputs that could not be read)
    """
    stats = {} if stats is None else stats
    stat_time = time.time_ns()  # before the stats: what a racy entry is measured against
    places = by_place(paths)
    failed = stat_inputs(places, known or {}, stats)
    cached = catalog.cached_hashes(list(stats))
    digests = {
        p: hit.sha256 for p, st in stats.items() if (hit := cached.get(p)) and hit.stat == st
    }
    done = len(digests)
    if progress:
        progress(Progress("hash", done, len(paths)))
    for place, group in places.items():
        asks = [
            DigestAsk(p, stats[p], held if hold is None or p in hold else None)
            for p in group
            if p in stats and p not in digests
        ]
        fresh: list[HashRow] = []
        try:
            for one in digester(place, asks):
                done += 1
                if isinstance(one.got, str):
                    failed[one.path] = one.got
                else:
                    stats[one.path], digests[one.path] = one.got
                    fresh.append(HashRow(one.path, *one.got))
                if progress and (done % 256 == 0 or done == len(paths)):
                    progress(Progress("hash", done, len(paths)))
        finally:  # what was hashed is kept however the rest ends (a task lost, Ctrl-C)
            catalog.put_hashes(fresh, recorded_ns=place.recorded_ns(fresh, stat_time))
    return digests, failed


def by_place(paths: Sequence[str]) -> dict[BytePlace, list[str]]:
    """``paths`` grouped by the place each is at (local files, objects), each group in order."""
    places: dict[BytePlace, list[str]] = {}
    for p in paths:
        places.setdefault(bytes_at(p), []).append(p)
    return places


def stat_inputs(
    places: Mapping[BytePlace, Sequence[str]],
    known: Mapping[str, FileStat],
    stats: dict[str, FileStat],
) -> dict[str, str]:
    """Fill ``stats`` with each input's stat (``known``'s, else its place's); the inputs that
    have none, with why."""
    failed: dict[str, str] = {}
    for place, group in places.items():
        asked = place.stats([p for p in group if p not in known])
        for p in group:
            st = known.get(p) or asked[p]
            if isinstance(st, str):
                failed[p] = st
            else:
                stats[p] = st
    return failed


# -- items in containers ----------------------------------------------------------------------
# A tar member or a table cell is keyed by the SHA-256 of its bytes, its hash-cache entry by its
# full name (a cell's also by its column) compared on its container's stat: a rebuild over
# unchanged containers reads no member or cell.
def container_stat(path: str) -> FileStat | None:
    """A container's stat: a file's, or an object's (size, last change, ETag) by one HEAD."""
    return bytes_at(path).stat(path)


class ItemRef(NamedTuple):
    """One item to hash: its full name, its hash-cache id, its container and where inside it."""

    path: str
    cache_id: str
    container: str
    where: int  # a table's row (0 for a tar member, found by its name)


# Reading the wanted items of the containers the hash cache does not know is the one step of
# :func:`hash_items` that may run elsewhere, as a :class:`Digester` reads a folder's files: a
# :class:`ContainerDigester` is given one :class:`ContainerAsk` per container, each holding a
# :class:`ContainerRead` (picklable: what reading that container needs, the members' offsets, a
# table's column and rows, and nothing else), and returns what each reading gave. The default
# reads them here, container after container (:func:`read_here`); an engine's may read them on
# its cluster (:class:`featbake.bake.ray_engine.ClusterDigests`). Everything around it stays
# with the caller: the containers' stats, the hash cache consulted and filled (with the racy
# rule's recording time), the stat each reading must have been at, the failures, the progress.
class ContainerRead(Protocol):
    """One container's wanted items read and hashed (a tar's members, a table file's cells):
    picklable, so any process that reaches the container may run it."""

    def __call__(self, held: Holder | None = None) -> ReadBack:
        """Each wanted item's digest (or a 1-tuple: why not) by its full name, and the
        container's stat as of the reading (:class:`ReadBack`); with ``held``, the items'
        bytes kept there for decoding."""
        ...


@dataclass(frozen=True)
class ContainerAsk:
    """One container to read: its name, its :class:`ContainerRead`, how many items it reads
    (what sizes an engine's tasks), and where to keep their bytes (None: kept nowhere)."""

    container: str
    read: ContainerRead
    items: int
    held: Holder | None = None


@dataclass(frozen=True)
class ContainerDigested:
    """What reading one container gave (:class:`ReadBack`)."""

    container: str
    got: ReadBack


class ContainerDigester(Protocol):
    """Reads the containers the hash cache did not know (see the section comment)."""

    def __call__(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        """One :class:`ContainerDigested` for each of ``asks``, in any order, each as soon as
        it is done (the build's progress ticks with them); ``ask.read``'s answer for each."""
        ...


def read_here(asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
    """The default :class:`ContainerDigester`: ``asks`` read by this process in order (a
    container's items in its order, one open file each), their bytes kept where each says."""
    for ask in asks:
        yield ContainerDigested(ask.container, ask.read(ask.held))


@runtime_checkable
class ReadsContainers(Protocol):
    """A :class:`Digester` that reads containers too (an engine's: its ``containers`` is the
    :class:`ContainerDigester` beside it)."""

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]: ...


def containers_of(digester: Digester) -> ContainerDigester:
    """How ``digester``'s reader reads containers: its own ``containers`` if it has one (an
    engine's cluster), else here (:func:`read_here`, as :func:`digest_here` reads files)."""
    return digester.containers if isinstance(digester, ReadsContainers) else read_here


#: container, the refs to read in it -> its reading (picklable: see :class:`ContainerRead`).
Readings = Callable[[str, list[ItemRef]], ContainerRead]


def hash_items(
    catalog: HashCache,
    refs: Sequence[ItemRef],
    reading: Readings,
    progress: Callable[[Progress], None] | None = None,
    stats: dict[str, FileStat] | None = None,
    stat_of: Callable[[str], FileStat | None] = container_stat,
    held: Holder | None = None,
    digester: ContainerDigester = read_here,
) -> tuple[dict[str, str], dict[str, str]]:
    """SHA-256 of each item, reading only the containers whose stat the hash cache does not know.

    ``reading(container, refs)`` is how the items of one container are read (a
    :class:`ContainerRead`), which ``digester`` runs (default: here, in order; an engine's may
    run them on its cluster): each gives every item's digest, or a 1-tuple with why the item
    cannot be read, with the container's stat as of the reading (:class:`ReadBack`): digests
    whose bytes came from another stat than the one looked up fail. ``stats`` is filled with
    each item's container stat, which decoding checks again. ``stat_of`` gives a container's
    stat before it is read (a bucket's tars: from the scan's listing, no request). ``held``
    keeps the items' bytes read here, for a build to decode.

    Returns:
        (path -> sha256, path -> reason for items that could not be read)
    """
    stats = {} if stats is None else stats
    stat_time = time.time_ns()  # before the stats: what a racy entry is measured against
    by_container: dict[str, list[ItemRef]] = {}
    for ref in refs:
        by_container.setdefault(ref.container, []).append(ref)
    seen = {c: stat_of(c) for c in by_container}
    digests, failed, todo = looked_up(catalog, refs, seen, stats)
    if progress:
        progress(Progress("hash", len(digests), len(refs)))
    asks = [ContainerAsk(c, reading(c, wanted), len(wanted), held) for c, wanted in todo.items()]
    fresh: list[HashRow] = []
    try:
        for done in digester(asks):
            wanted = todo.pop(done.container, [])
            fresh += took(done, wanted, seen[done.container], stats, digests, failed)
            if progress:
                progress(Progress("hash", len(digests) + len(failed), len(refs)))
    finally:  # what was hashed is kept however the rest ends (a task lost, Ctrl-C)
        places = {bytes_at(r.path) for r in fresh}  # an object's rows are never racy (an ETag)
        recorded = max((p.recorded_ns(fresh, stat_time) for p in places), default=stat_time)
        catalog.put_hashes(fresh, recorded_ns=recorded)
    failed.update({r.path: "not read" for wanted in todo.values() for r in wanted})
    return digests, failed


def looked_up(
    catalog: HashCache,
    refs: Sequence[ItemRef],
    seen: Mapping[str, FileStat | None],
    stats: dict[str, FileStat],
) -> tuple[dict[str, str], dict[str, str], dict[str, list[ItemRef]]]:
    """(path -> the digest the hash cache holds at its container's stat ``seen``, path -> why
    not (a container with no stat), container -> its refs to read), ``stats`` filled."""
    cached = catalog.cached_hashes([r.cache_id for r in refs])
    digests: dict[str, str] = {}
    failed: dict[str, str] = {}
    todo: dict[str, list[ItemRef]] = {}
    for ref in refs:
        st = seen[ref.container]
        if st is None:
            failed[ref.path] = f"cannot stat {ref.container}"
            continue
        stats[ref.path] = st
        hit = cached.get(ref.cache_id)
        if hit is not None and hit.stat == st:
            digests[ref.path] = hit.sha256
        else:
            todo.setdefault(ref.container, []).append(ref)
    return digests, failed, todo


def took(
    done: ContainerDigested,
    wanted: Sequence[ItemRef],
    seen: FileStat | None,
    stats: Mapping[str, FileStat],
    digests: dict[str, str],
    failed: dict[str, str],
) -> list[HashRow]:
    """The hash-cache rows of one container's reading, ``digests`` and ``failed`` filled: a
    reading at another stat than ``seen`` (the one looked up) fails every item it read."""
    changed = done.got.stat != seen
    fresh: list[HashRow] = []
    for ref in wanted:
        one = done.got.digests.get(ref.path, ("not read",))
        if changed and not isinstance(one, tuple):
            one = (f"{done.container} changed while featbake was reading it",)
        if isinstance(one, tuple):
            failed[ref.path] = one[0]
        else:
            digests[ref.path] = one
            fresh.append(HashRow(ref.cache_id, stats[ref.path], one))
    return fresh


class Listed(Protocol):
    """Container inputs (:class:`~featbake.encode.webdataset.WebDataset`,
    :class:`~featbake.encode.tables.Table`): the place of their containers, the stats their
    scan read (a bucket's listing, a parquet object's HEAD), and the listings it read and has
    not recorded yet (a bucket tar's members, a parquet object's rows)."""

    place: BytePlace
    listed: dict[str, FileStat]
    fresh: list[HashRow]


def hash_listed(
    inputs: Listed,
    catalog: HashCache,
    refs: Sequence[ItemRef],
    reading: Readings,
    progress: Callable[[Progress], None] | None,
    stats: dict[str, FileStat] | None,
    held: Holder | None = None,
    digester: ContainerDigester = read_here,
) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`hash_items` over ``inputs``' containers, with the stats their scan read (a
    bucket's: no request) or their place's, the containers the hash cache does not know read
    by ``digester`` (default: here), then recording the listings the scan read (a rebuild
    reads them from the hash cache)."""

    def stat_of(container: str) -> FileStat | None:
        return inputs.listed.get(container) or inputs.place.stat(container)

    try:
        return hash_items(catalog, refs, reading, progress, stats, stat_of, held, digester)
    finally:  # the listings are kept however the reading ends, as its digests are
        if inputs.fresh:
            recorded = inputs.place.recorded_ns(inputs.fresh, time.time_ns())
            catalog.put_hashes(inputs.fresh, recorded_ns=recorded)
            inputs.fresh = []


def encoder_cache_id(encoder: LoadedEncoder, weights: str | None) -> tuple[str, str] | None:
    """(hash-cache id, backing file) for an encoder whose fingerprint can be cached, else None.

    A TorchScript or .pt2 file holds its architecture and weights, so its fingerprint depends on
    the file alone. An import-path encoder's architecture lives in code, so its id includes the
    identity (its repr and code digest) beside the weights file, and what that file does not
    hold (:func:`~featbake.keys.unsaved_state_fingerprint`: buffers its factory computed,
    tensor attributes, the dtypes it made). A pickle's class lives in code
    too: its id includes the identity beside the file, under an ``encoder-fp:pickle:`` prefix
    that :func:`cached_file_encoder_fp` never looks up (a pickle cannot be vouched for unloaded).
    """
    from featbake.encode.encoders import PICKLE  # torch: not at import (see the module's doc)

    if weights is not None:
        unsaved = unsaved_state_fingerprint(encoder.module)
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(weights)}\n{unsaved}".encode())
        return f"{ENCODER_FP_PREFIX}import:{ident}", weights
    if encoder.kind == PICKLE and os.path.isfile(encoder.label):
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(encoder.label)}".encode())
        return f"{ENCODER_FP_PREFIX}pickle:{ident}", encoder.label
    if encoder.kind != "module" and os.path.isfile(encoder.label):
        return file_encoder_cache_id(encoder.label), encoder.label
    return None


#: The libraries whose code builds a folder's model (its class, its config's defaults, buffers it
#: computes at init) from the folder's files.
FOLDER_LIBRARIES = ("torch", "transformers")


class FolderState(NamedTuple):
    """A Hugging Face folder as its encoder's fingerprint depends on it, read without loading.

    ``cache_id`` names every top-level entry of the folder with its :class:`FileStat` (what
    ``from_pretrained`` reads from a local folder: config, weights, preprocessor), the versions
    of Python, torch and transformers, and the bytes of featbake's code
    (:func:`keying_code_digest`): while none of them changes, loading the folder gives the same
    module and so the same fingerprint. ``newest`` is the entry changed last (by the racy rule's
    reckoning): a fingerprint recorded too soon after it is not trusted (:meth:`FileStat.racy`).
    """

    cache_id: str
    newest: FileStat

    @classmethod
    def of(cls, folder: str | os.PathLike[str]) -> FolderState | None:
        """The folder's state now; None when it cannot be read or a library is missing (then
        nothing is cached for it, and the load says why)."""
        from importlib.metadata import PackageNotFoundError, version  # no library imported

        try:
            versions = [version(name) for name in FOLDER_LIBRARIES]
            code = keying_code_digest(_PACKAGE)
            where = resolve_path(folder)
            with os.scandir(where) as listing:
                entries = sorted((e.name, FileStat.of(e.path)) for e in listing)
        except (PackageNotFoundError, OSError):
            return None
        if not entries:
            return None
        newest = max((st for _, st in entries), key=_trusted_from)
        named = [sys.version, __version__, *versions, code,
                 [[name, *st] for name, st in entries]]  # fmt: skip
        return cls(f"{ENCODER_FP_PREFIX}hf:{where}:{sha256_hex(canonical_json(named))}", newest)


#: featbake's package folder (its code computes a folder's fingerprint).
_PACKAGE = Path(__file__).resolve().parent.parent


def keying_code_digest(package: Path) -> str:
    """The digest of every ``.py`` file of featbake's package (named by its path in it): the
    code a folder's load and fingerprint run (the adapter, the folder readings, the module's
    fingerprint and what those import) is somewhere in it, whichever module it moves to; a
    list of some would miss one the load runs. Kept per process while every file's stat is
    the same: a build reads it more than once, and hashing the package costs about 13 ms."""
    files = sorted(package.rglob("*.py"))
    stats = [FileStat.of(f) for f in files]
    listing = tuple(zip(map(str, files), stats, strict=True))
    kept = _CODE_DIGESTS.get(package)
    if kept is not None and kept[0] == listing:
        return kept[1]
    now = time.time_ns()
    code = hashlib.sha256()
    for path in files:
        code.update(f"{path.relative_to(package).as_posix()}\0{sha256_file(path)}\n".encode())
    if not any(st.racy(now) for st in stats):  # a file edited as it was read: hash it again
        _CODE_DIGESTS[package] = (listing, code.hexdigest())
    return code.hexdigest()


#: keying_code_digest's, by package folder: each file with its stat, and their digest.
_CODE_DIGESTS: dict[Path, tuple[tuple[tuple[str, FileStat], ...], str]] = {}


def transformers_as_installed() -> bool:
    """Whether this process's transformers is the installed one's code untouched, as far as
    featbake can tell: not imported yet. A process that imported it may have changed what a
    load builds (a class's ``__init__`` patched to add a buffer, a config's default) and its
    load's fingerprint would see it: a folder's fingerprint is then neither read from the hash
    cache (it is the one a load gives here) nor recorded (another process loads another one)."""
    return "transformers" not in sys.modules


def _trusted_from(st: FileStat) -> int:
    """The moment from which a hash recorded can vouch for a file of this stat."""
    return max(st.mtime_ns, st.ctime_ns) + racy_window_ns(st.mtime_ns, st.ctime_ns)


class CachedFingerprint(NamedTuple):
    """A file encoder's fingerprint found in the hash cache, and what it was found there for:
    the file's stat, or a Hugging Face folder's state (its :attr:`FolderState.cache_id`), as
    :func:`loaded_state` reads them of a loaded encoder."""

    fp: str
    state: FileStat | str


def cached_folder_encoder(
    catalog: HashCache, folder: str | os.PathLike[str]
) -> CachedFingerprint | None:
    """A Hugging Face folder's fingerprint without loading it (transformers never imported),
    if neither its files nor what builds its model changed since it was last loaded
    (:class:`FolderState`); else None."""
    if not transformers_as_installed():
        return None  # this process's load may differ from the one recorded: load it here
    state = FolderState.of(folder)
    if state is None:
        return None
    hit = catalog.cached_hashes([state.cache_id]).get(state.cache_id)
    if hit and hit.stat == state.newest:
        return CachedFingerprint(hit.sha256, state.cache_id)
    return None


def file_encoder_cache_id(path: str | os.PathLike[str]) -> str:
    """The hash-cache id under which a file encoder's fingerprint is remembered."""
    return f"{ENCODER_FP_PREFIX}file:{resolve_path(path)}"


def cached_file_encoder(
    catalog: HashCache, path: str | os.PathLike[str]
) -> CachedFingerprint | None:
    """A file (or folder) encoder's fingerprint without loading it, if the file is unchanged
    since last time, with the stat it was found for.

    This lets a dataset map inputs to keys (and serve hits) without ever loading the encoder.
    Always None for a pickled module: its fingerprint depends on its class's source code too,
    which only loading it reveals (and the build never caches it under this file id).
    """
    if os.path.isdir(path):
        return cached_folder_encoder(catalog, path)
    from featbake.encode.encoders import PICKLE, detect_kind  # torch: see the module's doc

    if detect_kind(Path(path)) == PICKLE:
        return None  # also ignores file-id entries written before pickles were keyed by code
    ident = file_encoder_cache_id(path)
    hit = catalog.cached_hashes([ident]).get(ident)
    try:
        st = FileStat.of(path)
    except OSError:
        return None
    return CachedFingerprint(hit.sha256, st) if hit and hit.stat == st else None


def cached_file_encoder_fp(catalog: HashCache, path: str | os.PathLike[str]) -> str | None:
    """:func:`cached_file_encoder`'s fingerprint alone (None where nothing is cached)."""
    cached = cached_file_encoder(catalog, path)
    return None if cached is None else cached.fp


def loaded_state(encoder: LoadedEncoder) -> FileStat | str | None:
    """What the file or folder ``encoder`` was loaded from was before the load, as a cached
    fingerprint stands for it (:class:`CachedFingerprint`'s ``state``); None: not loaded from
    one, or changed during the load."""
    if encoder.folder_state is not None:
        return encoder.folder_state.cache_id
    return None if encoder.loaded_from is None else encoder.loaded_from.stat


def encoder_fingerprint(encoder: LoadedEncoder, catalog: HashCache, weights: str | None) -> str:
    """The encoder's fingerprint, cached in the hash cache against its file's stat.

    Hashing a large checkpoint's weights costs a full pass over them; an unchanged file (same
    size, mtime, ctime and inode, not changed within a second of hashing) reuses the last
    result, as input files do. The file's stat is the one taken before it was loaded
    (:attr:`LoadedEncoder.loaded_from`): a file changed since is another version, for which
    nothing is cached (the loaded module's own fingerprint is used).
    """
    if encoder.folder_state is not None and weights is None:
        return _folder_fingerprint(encoder, encoder.folder_state, catalog)
    cache = encoder_cache_id(encoder, weights)
    if cache is None:
        return encoder.fingerprint
    ident, backing = cache
    seen = encoder.loaded_from
    stat_time = time.time_ns() if seen is None else seen.taken_ns
    st = FileStat.of(backing)
    # The fingerprint is the loaded module's: it may stand for the file only if the file is
    # still the one loaded (a checkpoint renamed over during the load is another version).
    same = seen is None or seen.stat == st
    hit = catalog.cached_hashes([ident]).get(ident)
    if same and hit and hit.stat == st:
        encoder._fingerprint = hit.sha256
        return hit.sha256
    fp = encoder.fingerprint
    if same:
        catalog.put_hashes([HashRow(ident, st, fp)], recorded_ns=stat_time)
    return fp


def _folder_fingerprint(encoder: LoadedEncoder, state: FolderState, catalog: HashCache) -> str:
    """A Hugging Face folder's fingerprint, remembered against the folder's state before its
    load (:attr:`LoadedEncoder.folder_state`, set only when the load left it unchanged)."""
    fp = encoder.fingerprint
    hit = catalog.cached_hashes([state.cache_id]).get(state.cache_id)
    if not (hit and hit.stat == state.newest and hit.sha256 == fp):
        assert encoder.loaded_from is not None  # set with folder_state: when it was taken
        rows = [HashRow(state.cache_id, state.newest, fp)]
        catalog.put_hashes(rows, recorded_ns=encoder.loaded_from.taken_ns)
    return fp
