"""The local disk tier: whole shards fetched from the bucket, checked, kept within a byte budget.

A shard is fetched into ``tmp/fetch/<name>.part`` (space reserved first, so the budget holds while
downloads are in flight), every tensor's CRC is checked, and it is renamed into
``shards/ab/<name>.safetensors``: the same place a local store keeps it, so every read after
that is the local store's read path (``pread`` + CRC), at the local store's speed. Processes of
one node share the tier: a ``.part`` file is ``flock``-ed while it downloads (a second process
wanting the same shard waits, then reads the first one's file; one killed mid-download leaves a
``.part`` nobody holds, which the next eviction deletes). Evicting is least recently used first,
by file time: a fetch or an open stamps it. A file evicted while a reader has it open stays
readable to that reader (POSIX unlink), so eviction never breaks a read in flight.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.keys import sha256_file
from featbake.store.files import (
    LockCall,
    Taken,
    fsync_dir,
    lock_taken,
    opened_lock,
    remove_file,
)
from featbake.store.layout import Layout, is_shard_name
from featbake.store.locks import locked
from featbake.store.shard import ShardReader, VerifyMode, damaged_object
from featbake.units import format_bytes


# == eviction ======================================================================================
# Which files the local tier evicts to admit a new one: least recently used first; pure.
class TierFile(NamedTuple):
    """A file in the local tier: its name, size in bytes, last use (epoch seconds), and whether
    it may be evicted (a download in flight may not)."""

    name: str
    size: int
    used: float
    evictable: bool = True


def evictions(
    files: Sequence[TierFile],
    budget: int,
    incoming: int,
    order: Callable[[TierFile], Any] = lambda f: (f.used, f.name),
) -> list[TierFile]:
    """The files to delete, least recently used first (or in ``order``), so ``incoming`` more
    bytes fit ``budget``.

    Raises:
        ConfigError: ``incoming`` cannot fit even with every evictable file gone (a budget
            smaller than a shard, or one filled by downloads in flight).

    Example:
        >>> old, new = TierFile("a", 60, 1.0), TierFile("b", 30, 2.0)
        >>> [f.name for f in evictions([new, old], budget=100, incoming=40)]
        ['a']
    """
    total = sum(f.size for f in files)
    over = total + incoming - budget
    if over <= 0:
        return []
    chosen: list[TierFile] = []
    for f in sorted((f for f in files if f.evictable), key=order):
        chosen.append(f)
        over -= f.size
        if over <= 0:
            return chosen
    pinned = sum(f.size for f in files if not f.evictable)
    raise ConfigError(
        f"the local cache's budget ({format_bytes(budget)}) cannot hold a "
        f"{format_bytes(incoming)} shard beside {format_bytes(pinned)} being downloaded; "
        "raise local_cache_size (--local-cache-size, $FEATBAKE_LOCAL_CACHE_SIZE) to at least "
        "4x the largest shard, or build with smaller shards (--shard-size)"
    )


def shard_of(f: TierFile) -> str:
    """The shard name of a tier file (``<name>.safetensors``, or ``<name>.part`` downloading).

    Example:
        >>> shard_of(TierFile("ab12.safetensors", 1, 0.0))
        'ab12'
    """
    return f.name.removesuffix(PART).removesuffix(".safetensors")


class Room(NamedTuple):
    """What a fetch asks of the tier: ``size`` bytes, evicting a shard named in ``keep`` only
    when nothing else makes room, waiting for downloads in flight to leave room or (``wait``
    False) failing at once.

    A prefetch (``wait`` False) never evicts what it is told to keep: it is a guess, and a
    kept shard is one the reads need soon. A read (``wait`` True) needs its shard now: when
    the kept shards fill the tier it evicts the least recently used of them rather than wait
    for room nobody will free (the kept shards are freed only once the reads move on, which
    this read blocks)."""

    size: int
    keep: frozenset[str] = frozenset()
    wait: bool = True

    def keeps(self, f: TierFile) -> bool:
        return bool(self.keep) and shard_of(f) in self.keep

    def doomed(self, files: Sequence[TierFile], budget: int) -> list[TierFile]:
        """The files to evict for this room (see the class docstring).

        Raises:
            ConfigError: no room, even with every file this room may evict gone.
        """
        kept = [f._replace(evictable=False) if self.keeps(f) else f for f in files]
        try:
            return evictions(kept, budget, self.size)
        except ConfigError:
            if not self.wait or not self.keep:
                raise
        # A read: every other file first, then the fewest kept shards, least recently used.
        return evictions(files, budget, self.size, order=lambda f: (self.keeps(f), f.used, f.name))


def window_fitting(sizes: Iterable[int], budget: int, most: int) -> int:
    """The most shards, up to ``most``, a window of a block order may hold so that two windows
    of the largest shards in ``sizes`` fit ``budget`` (a batch may straddle two windows, and the
    next window is fetched while the current one is read); 1 when not even two fit.

    A window that fits alone but not beside the next one leaves no room to fetch ahead: the
    reads then evict shards they still need (14 shards of ~1 MiB through a 4 MiB tier, the
    window 4 shards: 148 shard GETs an epoch).

    Example:
        >>> window_fitting([3, 3, 3, 3, 3, 3], budget=13, most=4)
        2
        >>> window_fitting([3, 3, 3], budget=100, most=4)
        4
    """
    big = sorted(sizes, reverse=True)
    for w in range(most, 1, -1):
        if sum(big[: 2 * w]) <= budget:
            return w
    return 1


# == tier ==========================================================================================
PART = ".part"

#: A shard written (or used) this recently is never evicted by :meth:`DiskTier.trim`.
TRIM_AGE_S = 600.0

#: Seconds a fetch waits for downloads in flight to leave room in the budget before it fails.
ROOM_WAIT_S = 300.0

#: Fetches of one shard whose bytes fail their checksums before the error is raised.
CHECKED_TRIES = 2


class DiskTier:
    """The shards of a bucket store kept on this node's disk (see the module docstring).

    Args:
        layout: the tier's directory, laid out as a local store.
        budget: the most bytes its shards (and downloads in flight) may take.
    """

    def __init__(self, layout: Layout, budget: int) -> None:
        self.layout = layout
        self.budget = budget
        self.fetched = 0  # shards this process downloaded (a second epoch that fits: none)
        self.fetched_bytes = 0

    @property
    def downloads(self) -> Path:
        """``tmp/fetch/``: shards being downloaded (``<name>.part``, flock-ed while they are)."""
        return self.layout.tmp / "fetch"

    def touch(self, path: Path) -> None:
        """Stamp ``path`` as just used (least recently used is evicted first)."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def fetch(
        self,
        name: str,
        size: int,
        download: Callable[[Path], int],
        where: str,
        evicted: Callable[[], None] | None = None,
        *,
        keep: Collection[str] = (),
        wait: bool = True,
    ) -> Path:
        """Shard ``name`` on this disk: fetched (``download`` writes a file) unless it is here.
        Shards named in ``keep`` (a block order's current and next windows) are evicted to make
        room for it only by a read that finds no other room (:class:`Room`); without ``wait``
        (a prefetch: the read fetches it later) never, and a fetch that finds no room fails at
        once instead of waiting for downloads in flight.

        Raises:
            FileNotFoundError: the bucket has no such shard (gc deleted it).
            StoreCorrupt: its bytes failed their checksums on :data:`CHECKED_TRIES` fetches.
            ConfigError: it cannot fit in the budget.
        """
        final = self.layout.shard_path(name)
        if final.is_file():
            self.touch(final)
            return final
        self.downloads.mkdir(parents=True, exist_ok=True)
        part = self.downloads / f"{name}{PART}"
        with _locked_current(part) as fd:
            if final.is_file():  # another process fetched it while we waited
                with contextlib.suppress(OSError):
                    os.unlink(part)
                return final
            try:
                room = Room(size, frozenset(keep), wait)
                self._download_checked(name, room, download, where, fd, part, evicted)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(part)  # its reserved space goes back to the budget at once
                raise
            os.fsync(fd)  # the bytes are on disk before the name says the shard is here
            final.parent.mkdir(parents=True, exist_ok=True)
            # Under the tier's lock: a count of its bytes (a reservation, used_bytes) lists the
            # downloads, then the shards; a rename between the two listings counted the shard
            # twice (a test saw 4 shards' bytes in a 2-shard tier that never held more than 2).
            with tier_locked(self.downloads / "tier.lock"):
                os.replace(part, final)
            fsync_dir(final.parent)
            self.fetched += 1
        return final

    def _download_checked(
        self,
        name: str,
        room: Room,
        download: Callable[[Path], int],
        where: str,
        fd: int,
        part: Path,
        evicted: Callable[[], None] | None,
    ) -> None:
        """Reserve ``room``, download into ``part`` and check its bytes' SHA-256 against
        ``name`` (the bytes it was named by: every tensor's CRC holds then), fetching once more
        on a mismatch; the CRCs say, at the last try, whether it is damaged or another's.

        Raises:
            StoreCorrupt: the bytes failed their checksums, or are another shard's (an object
                overwritten with another's sound bytes: kept, every read of it failed on this
                node even after the object was put right), on every try.
        """
        self._reserve(fd, part, room)
        if evicted:  # the caller closes what it held open of the evicted files
            evicted()
        for attempt in range(CHECKED_TRIES):
            self.fetched_bytes += download(part)
            named = sha256_file(part)  # a shard's name is its bytes' SHA-256
            if named == name:
                break  # its bytes as written, which every checksum in it was taken of
            if attempt < CHECKED_TRIES - 1:
                continue
            raise damaged_object(where, _why_misnamed(_failing_tensors(part), named))

    def _reserve(self, fd: int, part: Path, room: Room) -> None:
        """Evict what must go (a shard ``room`` keeps only as :meth:`Room.doomed` says) so
        ``room.size`` more bytes fit, then reserve them in ``part``.

        While downloads in flight (other workers') hold the room, wait for them: they end
        within a download's time, and a budget of a few shards serves any number of workers.
        Only a shard that cannot fit even in an empty tier is an error at once (and any that
        finds no room, without ``room.wait``).

        Raises:
            ConfigError: ``size`` exceeds the budget, or no room came in :data:`ROOM_WAIT_S`.
        """
        size = room.size
        deadline = time.monotonic() + ROOM_WAIT_S
        pause = 0.02
        while True:
            with tier_locked(self.downloads / "tier.lock"):
                try:
                    doomed = room.doomed(list(self._files(skip=part)), self.budget)
                except ConfigError:
                    if size > self.budget or not room.wait or time.monotonic() > deadline:
                        raise
                else:
                    for f in doomed:
                        remove_file(self._path_of(f.name))
                    with contextlib.suppress(OSError):
                        os.posix_fallocate(fd, 0, max(size, 1))
                    return
            time.sleep(pause)  # outside the lock: the downloads holding the room finish
            pause = min(pause * 2, 0.5)

    def trim(self, min_age: float = TRIM_AGE_S, uploaded: Collection[str] = ()) -> int:
        """Evict least recently used shards, none younger than ``min_age`` seconds unless this
        process ``uploaded`` them, until the tier fits its budget; the bytes freed.

        A build into a bucket writes its shards here first: once they are uploaded they are
        copies like any fetched shard, and a build bigger than this disk must not fill it.
        ``min_age`` spares a shard another process of the node has just written and not yet
        uploaded (it uploads within seconds of writing); this process's own uploads are copies
        at once, so a build leaves the tier within its budget.
        """
        self.downloads.mkdir(parents=True, exist_ok=True)
        with tier_locked(self.downloads / "tier.lock"):
            young = time.time() - min_age
            files = [
                f
                if f.used <= young or f.name.removesuffix(".safetensors") in uploaded
                else f._replace(evictable=False)
                for f in self._files(skip=Path())
            ]
            try:
                doomed = evictions(files, self.budget, 0)
            except ConfigError:  # downloads in flight hold the rest: evict what may go
                doomed = [f for f in files if f.evictable]
            return sum(remove_file(self._path_of(f.name)) for f in doomed)

    def _files(self, *, skip: Path) -> Iterator[TierFile]:
        """The tier's shards, and downloads in flight (not evictable; abandoned ones deleted)."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.downloads) as it:
            for e in it:
                if not e.name.endswith(PART) or e.path == os.fspath(skip):
                    continue
                if _abandoned(Path(e.path)):
                    remove_file(Path(e.path))
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    yield TierFile(e.name, st.st_size, st.st_mtime, evictable=False)
        with contextlib.suppress(FileNotFoundError), os.scandir(self.layout.shards) as dirs:
            for d in dirs:
                gone = (NotADirectoryError, FileNotFoundError)
                with contextlib.suppress(*gone), os.scandir(d) as it:
                    for e in it:
                        if not is_shard_name(e.name.removesuffix(".safetensors")):
                            continue  # not a shard: never followed, never evicted
                        with contextlib.suppress(FileNotFoundError):
                            st = e.stat()
                            yield TierFile(e.name, st.st_size, st.st_mtime)

    def _path_of(self, file_name: str) -> Path:
        return self.layout.shard_path(file_name.removesuffix(".safetensors"))

    def evict(self, names: Collection[str]) -> int:
        """Delete the shards ``names`` from the tier (those it holds); the bytes freed. A block
        order's windows the reads have moved past: their room goes to the next window."""
        if not names:
            return 0
        self.downloads.mkdir(parents=True, exist_ok=True)
        with tier_locked(self.downloads / "tier.lock"):
            return sum(remove_file(self.layout.shard_path(n)) for n in names)

    def fits_beside(self, keep: Collection[str], size: int) -> bool:
        """Whether ``size`` more bytes fit the budget beside the shards named in ``keep`` and
        the downloads in flight, once everything else were evicted."""
        held = sum(
            f.size for f in self._files(skip=Path()) if not f.evictable or shard_of(f) in keep
        )
        return held + size <= self.budget

    def has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the budget without evicting anything."""
        return self.used_bytes() + size <= self.budget

    def used_bytes(self) -> int:
        """Bytes the tier's shards and downloads in flight take now (counted under the tier's
        lock, so a download becoming a shard is counted once)."""
        self.downloads.mkdir(parents=True, exist_ok=True)
        with tier_locked(self.downloads / "tier.lock"):
            return sum(f.size for f in self._files(skip=Path()))


@contextlib.contextmanager
def tier_locked(path: Path) -> Iterator[int]:
    """:func:`~featbake.store.locks.locked` alone on a tier file; its descriptor.

    Raises:
        StoreError: the file cannot be created (the tier's disk is not writable).
    """
    with locked(path) as fd:
        if fd is None:
            raise StoreError(
                f"cannot write the local cache at {path.parent}; point local_cache "
                "(--local-cache, $FEATBAKE_LOCAL_CACHE) at a writable local disk"
            )
        yield fd


@contextlib.contextmanager
def _locked_current(part: Path) -> Iterator[int]:
    """Like :func:`tier_locked`, but the file locked is the one at ``part`` once the lock is held
    (a process that failed its download unlinks its ``.part``; a waiter that locked the
    unlinked file tries again on the path's new one)."""
    while True:
        with tier_locked(part) as fd:
            try:
                current = os.stat(part).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield fd
                return


def _abandoned(part: Path) -> bool:
    """True if no process holds ``part``'s lock: its download was killed."""
    try:  # the store's lock (files.lock_taken) needs it writable; a forked child closes it
        lock = opened_lock(part, os.O_RDWR)
    except OSError:
        return False
    try:  # the lock its download holds it by (tier_locked: store/locks.py's, a flock)
        if lock_taken(lock.fd, call=LockCall.FLOCK) is not Taken.TAKEN:
            return False  # held: a download in flight (or no locks: never judged abandoned)
    except OSError:
        return False
    else:
        # Not held now; a .part younger than a second may be about to be locked by its maker.
        return time.time() - os.fstat(lock.fd).st_mtime > 1.0
    finally:
        lock.close()


def _why_misnamed(failing: list[str], named: str) -> str:
    """Why a shard object whose bytes are not of its name (their SHA-256 is ``named``) is
    refused, given its ``failing`` tensors (:func:`_failing_tensors`)."""
    tries = f"on {CHECKED_TRIES} downloads"
    if failing == ["header"]:
        return f"not a readable shard {tries}: cut short or overwritten"
    if failing:
        return f"tensors {', '.join(failing[:3])} fail their checksums {tries}"
    return f"it holds the bytes of shard {named[:16]}..., not of its own name: overwritten"


def _failing_tensors(path: Path) -> list[str]:
    """Names of the tensors in the shard at ``path`` that fail their checksums ("header": the
    file is not a readable shard)."""
    try:
        with ShardReader(path, verify=VerifyMode.ALWAYS) as reader:
            return reader.verify_all()
    except StoreCorrupt:
        return ["header"]
