"""Where a store lasts: the :class:`Place` protocol every caller above the layout goes through.

A store's place is a directory (:class:`featbake.store.open.LocalPlace`) or a bucket seen
through this node's local tier (:class:`featbake.store.bucket.BucketStore`);
:func:`featbake.store.open.place_of` gives a layout's. Builds, merge, datasets and
``CachedEncoder`` ask the place what to do (write fragments or the catalog, sync fragments,
merge, follow a block order, fetch a shard ahead) and never test which place it is; each
place answers with its own behaviour, a directory's mostly a no-op. :class:`RemotePlace` adds
the read path of a place whose shards are fetched into the tier (the shard readers' seam).

Kept apart from :mod:`featbake.store.layout` (a pure path object, which asks its place nothing)
and importing nothing of the store but the layout and the file primitives when it runs (its
types of a merge report and a shard reader are for type checkers only): the catalog and the
fragments ask :func:`holds_shard` here, below :func:`featbake.store.open.place_of`. Beside
:class:`Held` are the steps both places' sweeps take over a ``tmp/`` leftover
(:func:`held_folder`, :func:`removed_leftover`: only what no live process holds).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from featbake.errors import ShardDamaged
from featbake.store.files import (
    FOLDER_LOCK,
    LockFile,
    Taken,
    is_same_file,
    lock_taken,
    opened_lock,
)
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, corrupt_shard, damaged_object

if TYPE_CHECKING:
    from featbake.store.merge import MergeReport

# == records =======================================================================================
# Where a store's shards, fragments and catalog last: a local directory
# (:class:`featbake.store.open.LocalPlace`), or a bucket seen through this node's tier
# (:class:`featbake.store.bucket.BucketStore`), both a :class:`Place`.
# Upkeep runs one algorithm over either: gc plans, commits its catalog change through
# ``Place.commit``, then sweeps what the place holds that nothing names (:func:`unnamed_past`,
# one rule with the place's age); verify reads what the place names; repair runs where the
# place allows it.
T = TypeVar("T")


class TierUsage(NamedTuple):
    """A node's tier of a bucket store: which catalog version it holds, its bytes and budget."""

    version: int
    bytes: int
    budget: int


@dataclass
class Change(Generic[T]):
    """What a catalog change made of its copy: its report, whether the catalog changed (else
    nothing is published), and what to do once the change is committed."""

    value: T
    changed: bool
    after_publish: Callable[[], None] | None = None


class Held(NamedTuple):
    """Something a place holds that gc may sweep: how the place names it (a file's path, an
    object's name), its bytes, its last change (epoch s), and, for an object, its version tag
    as listed (the ETag, the generation: ``""`` for a file), which the sweep deletes only while
    it is still that version (another node may have put the same content-named bytes again)."""

    name: str
    size: int
    modified: float
    version: str = ""


def held_folder(folder: Path) -> Held | None:
    """A folder as gc's sweep weighs it: its path, the bytes of its files, and its latest
    change (its own or a file's); None where it went meanwhile or is not a folder."""
    try:
        if not folder.is_dir() or folder.is_symlink():
            return None
        size, latest = 0, folder.stat().st_mtime
        for path in folder.rglob("*"):
            st = path.lstat()
            size += st.st_size if path.is_file() else 0
            latest = max(latest, st.st_mtime)
    except OSError:
        return None
    return Held(str(folder), size, latest)


#: ``tmp/swept-<name>.<id>``: a leftover folder an older gc's sweep renamed aside to remove it
#: (one a killed sweep left is a leftover of its own, weighed like the others).
SWEPT_PREFIX = "swept-"


@dataclass
class _Opened:
    """A leftover as the sweep opened it: ``fd`` the file or folder itself (weighed, its
    identity checked), ``lock`` the descriptor its maker locks (the file's own, open
    read-write as a write lock needs; a folder's lock file; closed by a forked child:
    :func:`~featbake.store.files.opened_lock`), None where there is none;
    ``shared``: ``lock`` is open read-only (another user's file), so it is tried shared, which
    a maker's lock refuses as well."""

    fd: int
    lock: LockFile | None
    folder: bool
    shared: bool = False

    def close(self) -> None:
        """Close both descriptors (letting go of a lock taken through ``lock``)."""
        os.close(self.fd)
        if self.lock is not None:
            self.lock.close()


#: How the sweep opens what it locks: a link not followed, a FIFO never waited on.
_LOCK_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK


def _opened(path: Path) -> _Opened | None:
    """The file or folder at ``path`` opened (a link not followed, a FIFO never waited on);
    None where it went meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | _LOCK_FLAGS)
    except OSError:
        return None
    folder = stat.S_ISDIR(os.fstat(fd).st_mode)
    where, dir_fd = (FOLDER_LOCK, fd) if folder else (str(path), None)
    lock, shared = _lock_of(where, dir_fd)
    return _Opened(fd, lock, folder, shared)


def _lock_of(where: str, dir_fd: int | None) -> tuple[LockFile | None, bool]:
    """The descriptor to lock ``where`` through, and whether it is open read-only (not this
    user's to write: tried shared); (None, False) where there is none."""
    try:
        return opened_lock(where, _LOCK_FLAGS | os.O_RDWR, dir_fd=dir_fd), False
    except PermissionError:
        with contextlib.suppress(OSError):
            return opened_lock(where, _LOCK_FLAGS | os.O_RDONLY, dir_fd=dir_fd), True
    except OSError:
        pass
    return None, False


def _lock_made(opened: _Opened) -> None:
    """Give a folder the sweep found without its lock file (an earlier featbake's, one a
    killed sweep half removed, or one whose maker is between its ``mkdir`` and its lock
    file's making) one the sweep makes itself, for ``opened`` to lock: a maker about to make
    its own opens this one, waits on the sweep's lock and, finding the folder gone, makes it
    again; it never works in a folder the sweep judged by age alone. A lock file its maker
    made meanwhile is opened as any; none where neither can be (another user's folder, not
    this user's to write: judged by age alone)."""
    make = _LOCK_FLAGS | os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        opened.lock = opened_lock(FOLDER_LOCK, make, dir_fd=opened.fd)
    except FileExistsError:
        opened.lock, opened.shared = _lock_of(FOLDER_LOCK, opened.fd)
    except OSError:
        pass


def _lock_state(opened: _Opened) -> Taken:
    """Whether a live process holds the leftover ``opened`` (its lock taken now, without
    waiting, when not). A folder without a lock file holds none (its maker never locked it);
    a file whose lock cannot be tried is counted as held."""
    if opened.lock is None:
        return Taken.NO_LOCKS if opened.folder else Taken.HELD
    if not opened.folder and not _same_file_fds(opened.fd, opened.lock.fd):
        return Taken.HELD  # replaced between the two opens: weighed next time
    return lock_taken(opened.lock.fd, shared=opened.shared)


def _same_file_fds(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` are open on one file."""
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


def held_now(leftover: Held) -> bool:
    """Whether a live process holds ``leftover`` now (its lock tried without waiting, as the
    sweep does, and let go): what stats, verify's note and gc's plan leave out of the
    leftovers, as the sweep keeps it."""
    opened = _opened(Path(leftover.name))
    if opened is None:
        return False
    try:
        return _lock_state(opened) is Taken.HELD
    except OSError:
        return False
    finally:
        opened.close()


def _weighed(path: Path, fd: int) -> Held | None:
    """``path`` weighed again (:func:`held_folder` for a folder; a file by its descriptor)."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        return held_folder(path)
    return Held(str(path), st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None


def removed_leftover(planned: Held) -> int | None:
    """Remove a ``tmp/`` leftover gc's sweep planned; the bytes freed, None where it was kept.

    The sweep takes only what it can lock itself, without waiting (the file's lock, or its
    folder's lock file's: :func:`featbake.store.files.holding`), and holds that lock while it
    weighs it again and removes it: a live process holds what it uses for its whole life, so its
    scratch is kept however old it looks, and one killed dropped its lock, so its leftover goes.
    Kept too:
    one changed since the plan (weighed again under the lock: a writer that holds no lock, a
    filesystem without locks), and one gone or taken by another gc meanwhile (not counted: only
    what this sweep removed is). A maker that was about to lock what the sweep removes finds it
    gone once it has the lock, and makes it again.
    """
    path = Path(planned.name)
    opened = _opened(path)
    if opened is None:
        return None  # gone meanwhile (another gc took it)
    try:
        now = _locked_and_weighed(path, opened, planned)
        if now is None:
            return None
        if opened.folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
        return now.size
    except OSError:
        return None
    finally:
        opened.close()


def _locked_and_weighed(path: Path, opened: _Opened, planned: Held) -> Held | None:
    """``path`` weighed again under the sweep's lock (taken through ``opened``), or None
    where it is kept: a live process holds it, another sweep took it, or it changed since
    the plan. A folder found without its lock file is weighed first, then locked through one
    the sweep makes (:func:`_lock_made`: its own lock file changes the folder, which is not
    a change since the plan)."""
    first = None
    if opened.folder and opened.lock is None:
        first = _weighed(path, opened.fd)
        if first is None or first.modified > planned.modified:
            return None  # changed since the plan: in use
        _lock_made(opened)
    if _lock_state(opened) is Taken.HELD or not is_same_file(path, opened.fd):
        return None  # a live process holds it, or another sweep took it
    now = first if first is not None else _weighed(path, opened.fd)
    if now is None or now.modified > planned.modified:
        return None  # changed since the plan: in use
    return now


@dataclass(frozen=True)
class Sweep:
    """What gc's sweep deletes from a place, in this order: unnamed shards past the place's
    age, leftovers of interrupted writes, catalog versions retired for longer than the age; and
    how many unnamed shards are still younger (kept).

    ``age`` names the period ("grace period" for a directory, "retention period" for a
    bucket); ``versioned``: the place keeps numbered catalog versions."""

    shards: tuple[Held, ...] = ()
    loose: tuple[Held, ...] = ()
    versions: tuple[Held, ...] = ()
    young_shards: int = 0
    age: str = "grace period"
    versioned: bool = False

    @property
    def bytes(self) -> int:
        return sum(h.size for h in (*self.shards, *self.loose, *self.versions))

    @property
    def empty(self) -> bool:
        return not (self.shards or self.loose or self.versions)


class Swept(NamedTuple):
    """What a sweep deleted: shards, leftovers, catalog versions, and their bytes."""

    shards: int = 0
    loose: int = 0
    versions: int = 0
    bytes: int = 0


def unnamed_past(
    held: Iterable[Held],
    shard: Callable[[str], str],
    named: AbstractSet[str],
    now: float,
    age: float,
) -> tuple[list[Held], int]:
    """gc's one rule for a place's shards: one that no kept catalog (version) and no pending
    fragment names goes once older than ``age``: the grace period in a directory, the retention
    period in a bucket (a build writes a shard before anything names it). ``shard`` turns a
    held name into its shard name. Returns (what goes, how many unnamed ones are younger).

    Example:
        >>> held = [Held("a", 1, 0.0), Held("b", 1, 90.0), Held("c", 1, 0.0)]
        >>> unnamed_past(held, str, {"c"}, now=100.0, age=50.0)
        ([Held(name='a', size=1, modified=0.0, version='')], 1)
    """
    unnamed = [h for h in held if shard(h.name) not in named]
    doomed = [h for h in unnamed if now - h.modified >= age]
    return doomed, len(unnamed) - len(doomed)


class VerifyScope(StrEnum):
    """What ``featbake verify`` reads of a place."""

    FOLDER = "folder"  # every file of the store folder, its catalog, roots and hash cache
    NAMED_SHARDS = "named-shards"  # the place's own bytes of every shard the catalog names


# == protocols =====================================================================================


class Place(Protocol):
    """Where a store lasts, as every caller above the layout sees it (see the module doc):
    upkeep's catalog changes, sweeps and verify scope (one algorithm over either place, see
    the records section above), and what builds, merge and serving ask.

    A root's records (``roots/<name>.undecodable``: ``featbake.store.roots.CARRIED_RECORDS``)
    last with its published state, which each place keeps its own way: a directory in its
    ``roots/``; a bucket inside each catalog version it publishes, installed into a tier with
    the version and given to the next change to start from (:func:`featbake.store.bucket.
    publish_next`). Callers read and write them in the layout's ``roots/`` and never ask where
    they last."""

    def commit(self, change: Callable[[Layout], Change[T]]) -> T:
        """Apply a catalog change where the place keeps its catalog."""
        ...

    def settle(self) -> None:
        """Fold into the catalog what readers recorded elsewhere, and bring its newest state here
        (gc plans on it next)."""
        ...

    def rewrites_shards(self) -> bool:
        """Whether gc may rewrite shards here (compaction)."""
        ...

    def plan_sweep(self, now: float, grace: float, retention: float) -> Sweep:
        """What gc's sweep would delete now (:func:`unnamed_past` with
        the place's age)."""
        ...

    def leftovers(self) -> list[Held]:
        """What the place's ``tmp/`` holds that gc's sweep takes once untouched for the grace
        period, of any age: the one rule :meth:`plan_sweep`, stats and verify's note count
        leftovers by."""
        ...

    def sweep(self, plan: Sweep, crash: Callable[[str], None]) -> Swept:
        """Delete what ``plan`` names, re-checked where the place allows it; ``crash`` is
        called with the name of each step done (gc's crash points)."""
        ...

    def repair_refusal(self) -> str | None:
        """None where ``verify --repair`` runs here; else the one line that says why not and
        what to do instead."""
        ...

    def verify_scope(self) -> VerifyScope:
        """What verify reads here."""
        ...

    def tier_usage(self) -> TierUsage | None:
        """This node's tier of the place (its catalog version, bytes and budget), or None
        where the place has none (a directory)."""
        ...

    def named_shards(self) -> dict[str, int]:
        """The shards the store's catalog names, with their bytes."""
        ...

    def shard_objects(self) -> dict[str, int]:
        """Every shard the place holds (listed now, not a tier's copies): name -> bytes."""
        ...

    def download_shard(self, name: str, dest: Path) -> None:
        """The place's own bytes of shard ``name`` into file ``dest`` (never a tier's copy).

        Raises:
            FileNotFoundError: the place has no such shard.
        """
        ...

    def shard_where(self, name: str) -> str:
        """How messages name shard ``name`` (the file or object a user would delete)."""
        ...

    def has_shard(self, name: str) -> bool:
        """Whether the place holds shard ``name`` (a directory: its file; a bucket: its object,
        never a tier's copy; :func:`holds_shard` asks the tier first)."""
        ...

    def describe(self) -> str:
        """How messages name the store: its directory, or its bucket URL (never the tier
        folder)."""
        ...

    def builds_in_fragments(self) -> bool:
        """Whether every build here writes fragments and publishes them itself (a bucket: its
        tier holds a published catalog version, never written in place), rather than writing
        the catalog in place (a directory, one process)."""
        ...

    def sync_fragments(self) -> int:
        """Bring the place's sealed fragments here (a bucket's: other nodes' ranks, so a rerun
        skips what a killed run sealed); how many. A directory holds its own: 0."""
        ...

    def sync_catalog(self) -> int:
        """Bring the place's newest catalog here (a bucket's newest published version, when a
        merge or gc published one since); its version. A directory's is written in place: 0."""
        ...

    def merge(self, abandon: AbstractSet[str] = frozenset()) -> MergeReport:
        """Fold the finished builds' fragments into the catalog: in place for a directory, as
        the next published version for a bucket; the unfinished builds of the roots in
        ``abandon`` are retired (:func:`featbake.store.merge.merge`)."""
        ...

    def serving_mode(self) -> bool:
        """Whether datasets and ``CachedEncoder`` write fragments here rather than the catalog
        (a bucket, or a directory on a shared filesystem: see
        :meth:`featbake.store.open.LocalPlace.serving_mode`)."""
        ...

    def follow_blocks(self, windows: Sequence[Sequence[str]] | None) -> bool:
        """Tell the place the shards each window of a block order reads (None: stop); whether
        it follows them (a bucket fetches windows whole, the next one ahead; a directory has
        nothing to fetch)."""
        ...

    def fetch_ahead(self, name: str) -> bool:
        """Whether shard ``name`` is fetched whole before it can be opened (a bucket not reading
        by ranges); its fetch is then started in the background and the caller does not open
        it now (a hint never waits for a download). A directory: False."""
        ...

    def ahead_items(self) -> int:
        """How many items a loader should hint ahead of its reads at least (a bucket read by
        ranges: as many as the tier's budget holds, so each shard's hinted items go in one
        GET); 0: no advice (a directory)."""
        ...

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        """Make a sealed fragment last where the place keeps them (a bucket: uploaded after the
        shards it names; a directory holds it already)."""
        ...

    def publish_shards(self, shards: Sequence[str]) -> None:
        """Make sealed shards last where the place keeps them before any fragment names them (a
        bucket: uploaded now, so a build bigger than the tier never fills it while their
        fragment waits; a directory holds them already)."""
        ...

    def defers_fragments(self) -> bool:
        """Whether a build's ``part`` fragments are worth batching: each costs an upload (a
        bucket), not just a file already where it lasts (a directory: False)."""
        ...

    def publish_padding(self, record: Path) -> None:
        """Make a build part's padding record (``roots/<name>.<part>.padding``, just written
        in the layout; :class:`featbake.store.roots.PaddingRecord`) last where a rerun on any
        node reads it (a bucket: uploaded; a directory holds it already)."""
        ...

    def retire_padding(self, record: Path) -> None:
        """That part came to its end: its record goes where :meth:`publish_padding` put it
        (the layout's own copy is the caller's)."""
        ...

    def padding_texts(self, name: str, part: str | None = None) -> list[str] | None:
        """The padding records of root ``name`` (of its part ``part`` alone, if given) the
        place keeps beside the layout's files, as text: a bucket's objects, whichever node
        wrote them (read, never copied over the tier's files, which another process on this
        node may be writing). None for a directory: the layout's files are the records."""
        ...


@runtime_checkable
class RemotePlace(Place, Protocol):
    """Where a store's shards and fragments last when the store is a bucket
    (:class:`featbake.store.bucket.BucketStore`); the layout is then its local tier."""

    def fetch_shard(self, name: str, evicted: Callable[[], None] | None = None) -> Path | None:
        """Shard ``name`` fetched into the local tier; None when the bucket has none.
        ``evicted`` is called once the tier evicted to make room, before the download."""
        ...

    def reads_ranged(self) -> bool:
        """Whether shards not in the tier are read by ranges (else fetched whole)."""
        ...

    def ranged_reader(self, name: str, path: Path, verify: str) -> ShardReader | None:
        """A reader of shard ``name`` by ranges, or None when shards are fetched whole."""
        ...

    def opened(self, path: Path) -> None:
        """A reader opened tier file ``path`` (its last use, for eviction)."""
        ...

    def prefetch(self, name: str) -> bool:
        """Start bringing shard ``name`` into the tier without waiting; whether it started."""
        ...

    def tier_usage(self) -> TierUsage:
        """This node's tier of the place: its catalog version and the bytes it holds."""
        ...


def remote_place(layout: Layout) -> RemotePlace | None:
    """The place ``layout`` reads its shards from when they are fetched into it (a bucket the
    layout is the tier of), else None (a directory's shards are read where they are)."""
    remote = layout.remote
    if remote is None:  # a directory: no protocol check (~50 us on 3.11, per read-ahead hint)
        return None
    return remote if isinstance(remote, RemotePlace) else None


def damaged_shard(layout: Layout, name: str, why: str) -> ShardDamaged:
    """The error for shard ``name`` of ``layout``'s store found damaged (``why``) where no
    reader of it is at hand (a reader says its own place: :meth:`ShardReader.damaged`): a
    directory's file and ``verify --repair``, or a bucket's object and the bucket's fix (it
    has no repair), never the tier's path, where nothing may lie."""
    remote = remote_place(layout)
    if remote is None:
        return corrupt_shard(layout.shard_path(name), why)
    return damaged_object(remote.shard_where(name), why)


def place_holds_shard(layout: Layout, name: str) -> bool:
    """Whether the place itself holds shard ``name``: a directory's file, a bucket's object,
    never a tier's copy. A tier's copy outlives an object deleted by hand (as ``featbake
    verify`` says to do with a damaged one) or by a gc on another node: what decides that a
    key is stored, and so is not encoded again, must ask the bucket (a listing, once per
    process, then a HEAD for a name it lacks)."""
    remote = remote_place(layout)
    return remote.has_shard(name) if remote is not None else layout.shard_path(name).is_file()


def holds_shard(layout: Layout, name: str) -> bool:
    """Whether the store holds shard ``name``: its file in ``layout`` (a directory's shard, a
    tier's copy), else, where ``layout`` is a bucket's tier, the bucket's object (asked only
    then). What the catalog and the fragments check before they name a shard."""
    if layout.shard_path(name).is_file():
        return True
    remote = remote_place(layout)
    return remote is not None and remote.has_shard(name)
