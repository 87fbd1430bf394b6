"""The file primitives every store writer uses: publish a file whole, make a rename durable,
remove a file, list a folder without following what is not a regular file, hold a scratch file
or folder of ``tmp/`` for as long as it is used (:func:`holding`).

Kept apart from :mod:`featbake.store.layout` (where things live): these act on any path, inside a
store or not (a tier's marks, downloaded fragments, upkeep's sweeps).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import BinaryIO, TypeVar

from featbake.errors import StoreError
from featbake.process import forks_begun, forks_returned, in_forked_child


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the bytes written to the file at ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(final: Path, tmp_dir: Path) -> Path:
    """A unique name in ``tmp_dir`` (the store's ``tmp/``, same filesystem) to write ``final``
    under before it is published: this process's, never another's."""
    return tmp_dir / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.part"


def publish_file(
    final: Path, write: Callable[[Path], object], *, tmp_dir: Path, durable: bool = True
) -> None:
    """Write a file whole, then make it appear at ``final`` at once: ``write`` fills a unique
    temporary file in ``tmp_dir`` (same filesystem), which is fsynced (``durable``), renamed
    over ``final`` and its folder fsynced. A reader sees the old file or the new, never half of
    one; a crash leaves at most a temporary file (gc removes ``tmp/`` leftovers). The one
    write-then-publish of small store files (manifests, fidelity records, the tier's marks,
    downloaded fragments); shards and fragments being sealed have their own, streamed.

    Raises:
        OSError: the write or the rename failed (the temporary file is removed).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    with holding(temporary_path(final, tmp_dir)) as held:  # no sweep takes it while it is written
        tmp = held.path
        write(tmp)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)


#: The first bytes of a gzip stream, by which gzip (and lhotse, and featbake) tells one.
GZIP_MAGIC = b"\x1f\x8b"


def write_all(fd: int, views: Sequence[bytes | memoryview]) -> None:
    """Write ``views`` one after another at ``fd``, all of them: one ``writev``, and more where
    a write comes back short (a signal, a disk or quota filling up mid-write), so the rest is
    written on until it fails.

    Raises:
        OSError: a write failed (ENOSPC, EDQUOT, EIO), or wrote nothing.
    """
    left = [m for m in (memoryview(v).cast("B") for v in views) if m.nbytes]
    while left:
        done = os.writev(fd, left[:IOV_MAX])
        if done <= 0:
            raise OSError(errno.ENOSPC, "a write wrote nothing")
        while left and done >= left[0].nbytes:
            done -= left.pop(0).nbytes
        if done:
            left[0] = left[0][done:]


#: The most buffers one ``writev`` takes (Linux's ``UIO_MAXIOV``).
IOV_MAX = 1024


def gzip_compressed(f: BinaryIO) -> bool:
    """Whether the file ``f``, at its start, is a gzip stream (its first bytes); ``f`` is left
    at its start."""
    compressed = f.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    f.seek(0)
    return compressed


def remove_file(path: Path) -> int:
    """Remove a file; its size in bytes, or 0 if it was already gone."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


@dataclass(frozen=True)
class LooseFile:
    """A file in the store that the catalog does not name (an orphan shard, a tmp leftover)."""

    path: Path
    bytes: int
    mtime: float


@dataclass(frozen=True)
class FolderListing:
    """Regular files matching a pattern, and the other things found there (links, FIFOs)."""

    files: tuple[LooseFile, ...]
    special: tuple[Path, ...]  # paths that are not regular files: never read, never followed


def list_folder(folder: Path, pattern: str) -> FolderListing:
    """What matches ``pattern`` in ``folder``, by ``lstat`` (a symlink loop or a FIFO is listed
    as special, never opened: opening a FIFO would hang, following a loop would raise)."""
    files, special = [], []
    if folder.is_dir():
        for p in sorted(folder.glob(pattern)):
            try:
                st = os.lstat(p)
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISREG(st.st_mode):
                files.append(LooseFile(p, st.st_size, st.st_mtime))
            elif not stat.S_ISDIR(st.st_mode):
                special.append(p)
    return FolderListing(tuple(files), tuple(special))


# == held scratch ==================================================================================
# What a live process makes in a store's (or a tier's) ``tmp/`` (a change's catalog copy, a
# verify's scratch, a download, a ``.part`` being written) it holds locked for as long as it uses
# it: a file by its own descriptor, a folder by a lock file inside it (:data:`FOLDER_LOCK`: a
# folder's descriptor is read-only, and a write lock needs one open for writing). gc's sweep takes
# a leftover only once it took that lock itself, without waiting (``removed_leftover`` in
# store/place.py), and keeps it locked while it removes it; the kernel drops a killed process's
# lock, so its leftover goes with the next sweep past the grace period. A maker checks, once it
# holds the lock, that the path is still the file it locked (a sweep between its create and its
# lock took it: it makes it again), so it never works in something a sweep is removing.
#
# The lock is Linux's open-file-description lock (``F_OFD_SETLK``), ``flock`` elsewhere: both
# belong to the open file, not to the process, so a close of another descriptor of the same file
# (``open(tmp, "wb")`` in the maker) never drops it. ``flock`` would not do on NFS: the client
# emulates it with a process-owned whole-file POSIX lock, which any close drops and which refuses
# a write lock on a read-only descriptor; it carries OFD locks as locks owned by the open file.
# Every descriptor locked here is open for writing. A forked child (a fork-mode DataLoader
# worker) closes this process's lock descriptors (:func:`_close_locks_in_child`): a child that
# outlives a killed owner never keeps its leftover.
#
# Where the filesystem has no locks (see store/locks.py: NFS without a lock daemon, Lustre without
# ``-o flock``), nothing is held, and the sweep decides by the grace period alone.
#: Lock errors that mean "no locks on this filesystem", not "someone holds the lock": the one rule
#: (store/locks.py's write lock and the tier's locks take theirs through :func:`lock_taken` too).
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)

#: The lock file inside a held folder (what the folder's maker and gc's sweep lock).
FOLDER_LOCK = ".held"


class Taken(Enum):
    """What trying a file's lock found."""

    TAKEN = "taken"  # this process holds it now
    HELD = "held"  # a live process holds it
    NO_LOCKS = "no-locks"  # the filesystem has none: nothing is held


#: Whether this platform has open-file-description locks (Linux 3.15+, 64-bit ``struct flock``).
_OFD = hasattr(fcntl, "F_OFD_SETLK") and struct.calcsize("P") == 8 and sys.platform == "linux"


def _ofd_lock(fd: int, *, shared: bool, wait: bool) -> None:
    """An OFD lock of ``fd``'s first byte (``struct flock``: type, whence, start 0, length 1,
    pid 0 as OFD locks require); raises as ``fcntl`` does. Not the whole file: SQLite takes
    its own POSIX locks on a held catalog copy (at 1 GiB), which a whole-file lock would
    refuse ("database is locked"); every holder and the sweep lock this same byte."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    packed = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, packed)


class LockCall(Enum):
    """Which kernel lock :func:`lock_taken` takes.

    ``OFD`` for what a live process holds in ``tmp/`` (see above); ``FLOCK`` for the store's
    named lock files (``write.lock``, ``claims.lock``, the tier's locks: store/locks.py), as
    every featbake before took them. Linux's ``flock`` and OFD locks do not see each other on
    a local disk, so a named lock taken any other way would not exclude a process of an earlier
    featbake still running on the store (a build's writer beside a new ``verify --repair``);
    held scratch is new, and no earlier featbake locks it.
    """

    OFD = "ofd"
    FLOCK = "flock"


def lock_call(fd: int, *, shared: bool, wait: bool, call: LockCall = LockCall.OFD) -> None:
    """The kernel's lock ``call`` on ``fd``: an OFD lock where the platform has them
    (``flock`` where not, or where this kernel refuses the command: EINVAL), or ``flock``;
    raises :class:`BlockingIOError` (or EACCES) when held and not ``wait``."""
    if _OFD and call is LockCall.OFD:
        try:
            return _ofd_lock(fd, shared=shared, wait=wait)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    fcntl.flock(fd, op if wait else op | fcntl.LOCK_NB)


def lock_taken(
    fd: int, *, wait: bool = False, shared: bool = False, call: LockCall = LockCall.OFD
) -> Taken:
    """Take the lock of descriptor ``fd`` (open for writing), alone or ``shared``, waiting for
    it when ``wait``: the one lock primitive of the store (held scratch, the write lock, the
    tier's locks; ``call``: :class:`LockCall`)."""
    try:
        lock_call(fd, shared=shared, wait=wait, call=call)
    except (BlockingIOError, PermissionError):
        return Taken.HELD  # EAGAIN, or EACCES as POSIX locks may say it
    except OSError as e:
        if e.errno in NO_LOCKS:
            return Taken.NO_LOCKS
        raise
    return Taken.TAKEN


def is_same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) is the file or folder open as ``fd`` now."""
    try:
        st, held = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev)


def lock_file_of(path: Path, folder: bool) -> Path:
    """The file whose lock holds ``path``: itself, or a ``folder``'s :data:`FOLDER_LOCK`."""
    return path / FOLDER_LOCK if folder else path


@dataclass(frozen=True)
class Hold:
    """A scratch file or folder this process made and holds (:func:`holding`); ``fd`` is the
    locked descriptor (the file's own, open read-write: write through it; a folder's lock
    file's)."""

    path: Path
    fd: int
    folder: bool = False

    def intact(self) -> bool:
        """Whether ``path`` is still what this process made (never swept and made again by
        another writer: decided by identity, not by a name being there)."""
        return is_same_file(lock_file_of(self.path, self.folder), self.fd)


# == descriptors a lock is taken through ===================================================
# Every descriptor this process takes a file lock through (a hold's, a named lock's of
# store/locks.py, the sweep's and ``held_now``'s in store/place.py, the tier's check of a
# download) is opened by :func:`opened_lock` and listed in one registry, :data:`_LOCKS`, until
# :meth:`LockFile.close`. A forked child (a fork-mode DataLoader worker) closes every one at the
# fork (:func:`_close_locks_in_child`): ``flock`` and OFD locks belong to the open file, which
# the child's copies share, so a child that outlives the lock's owner, or only its block, would
# keep the lock for as long as it lives (a killed owner's leftover kept from the sweep, the
# next ``tier_locked`` waiting on the child).
#
# No lock guards the registry. Each update is one dict operation (atomic under the GIL), and
# nothing between two of them waits on anything: so nothing that runs Python in this thread
# meanwhile (a garbage collection running a ``CachedEncoder``'s write-back finalizer, whose seal
# takes the write lock through :func:`opened_lock`; a signal handler) finds a lock its own
# thread holds and waits on it for ever, and an open or close of one file that hangs (a hard
# NFS mount whose server is gone) keeps no other hold, and no fork, waiting. A guard held
# across ``fork`` would give both defects, and making it re-entrant would not do: the nested
# seal would then wait on the write lock under the guard, which another thread of this process
# may hold while it waits on the guard. What the guard was for, that no child is forked with an
# unlisted copy of an open file its parent locks, is kept by the order of the steps instead:
#
# - open: the file is opened, then listed; where a fork began after the open began and before
#   the listing ended (``forks_begun`` now beyond ``forks_returned`` before: featbake.process),
#   a child may have an unlisted copy of that open file, so it is never locked: the file is
#   opened again, a new open file (:func:`_reopened`), listed the same way, and the first
#   closed. Such a child keeps at most a descriptor never locked, until it exits.
# - close: the descriptor is first pointed at ``/dev/null`` (``dup2``: the open file, and so
#   its lock, let go in one step while the number stays taken, so no other open reuses it while
#   it is listed), then unlisted, then closed: a child forked in between has ``/dev/null``.


@dataclass(eq=False)
class LockFile:
    """A descriptor this process takes a file's lock through (:func:`opened_lock`), closed by
    a forked child; ``held``: the file's identity (``st_dev``, ``st_ino``) where it is a
    :func:`holding`'s (a second hold of one file is refused)."""

    fd: int
    held: tuple[int, int] | None = None

    def own(self) -> bool:
        """Whether this process opened it (not a forked child's copy, closed at the fork)."""
        return _LOCKS.get(self.fd) is self

    def close(self) -> bool:
        """Close it (letting go of its lock) where it is this process's; whether it was (a
        forked child's copy of a block leaves the parent's lock alone). The order is the
        section comment's: never a copy of a locked open file unlisted, never a number reused
        while listed."""
        if not self.own():
            return False
        os.dup2(_NOWHERE, self.fd, inheritable=False)  # the open file and its lock let go
        if self.held is not None:
            _unlisted(_HELD, self.held, self)
        _unlisted(_LOCKS, self.fd, self)
        os.close(self.fd)  # /dev/null's copy: never hangs
        return True


#: This process's lock descriptors (fd -> its :class:`LockFile`): the one registry a forked
#: child closes.
_LOCKS: dict[int, LockFile] = {}
#: The files this process holds (:func:`holding`; identity -> its :class:`LockFile`).
_HELD: dict[tuple[int, int], LockFile] = {}
#: What a closed lock descriptor points at until it is unlisted (opened once, never locked).
_NOWHERE = os.open(os.devnull, os.O_RDONLY)


_K = TypeVar("_K")


def _unlisted(registry: dict[_K, LockFile], key: _K, lock: LockFile) -> None:
    """Remove ``registry[key]`` where it is ``lock`` (no other's entry: between the check and
    the removal nothing can list another under ``key`` while ``lock`` is listed there)."""
    if registry.get(key) is lock:
        registry.pop(key, None)


def _close_locks_in_child() -> None:
    """In a forked child: close the parent's lock descriptors, so that the child never keeps
    a lock its parent lets go of or a killed parent's leftover from the sweep (the lock
    follows the open file), and forget them (the child's copies of a lock's block then leave
    the parent's files alone). One removal at a time: a finalizer run meanwhile may change
    the registry."""
    while True:
        try:
            fd, _ = _LOCKS.popitem()
        except KeyError:
            break
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


in_forked_child(_close_locks_in_child)


def opened_lock(
    path: str | Path, flags: int, *, dir_fd: int | None = None, hold: bool = False
) -> LockFile:
    """``os.open(path, flags, 0o666, dir_fd=dir_fd)`` listed as a lock descriptor (see the
    section comment): the one way a descriptor a lock is taken through is opened. ``hold``:
    a :func:`holding`'s, refused where this process holds that file already (by identity,
    however ``path`` is spelled: a relative path, a link).

    Raises:
        OSError: as ``os.open``.
        StoreError: ``hold``, and this process holds the file already.
    """
    lock = _listed(path, flags, dir_fd)
    if hold:
        try:
            lock.held = _identity(lock.fd)
        except BaseException:
            lock.close()
            raise
        if _HELD.setdefault(lock.held, lock) is not lock:  # one operation: never two listed
            lock.close()  # leaves the other's entry (``_unlisted``)
            raise StoreError(
                f"{path} is already held by this process; a scratch name is used once: make a "
                "new one with a unique name"
            )
    return lock


def _listed(path: str | Path, flags: int, dir_fd: int | None) -> LockFile:
    """``path`` opened and listed, an open file no forked child has an unlisted copy of:
    opened again while a fork fell between an open and its listing (the section comment)."""
    returned = forks_returned()
    lock = LockFile(os.open(path, flags, 0o666, dir_fd=dir_fd))  # no lock held: it may hang
    _LOCKS[lock.fd] = lock
    while forks_begun() != returned:
        returned = forks_returned()
        try:
            again = LockFile(_reopened(lock.fd, path, flags, dir_fd))
        finally:
            lock.close()  # never locked: a child's copy of it holds nothing
        _LOCKS[again.fd] = again
        lock = again
    return lock


#: Where Linux lists this process's descriptors; opening one opens its file anew.
_PROC_FDS = Path("/proc/self/fd")


def _reopened(fd: int, path: str | Path, flags: int, dir_fd: int | None) -> int:
    """A new open file of the file open as ``fd`` (not a copy of ``fd``'s): through
    ``/proc/self/fd`` (Linux: the very file, even one removed meanwhile), else by ``path``,
    checked to be the same file.

    Raises:
        FileNotFoundError: opened by ``path``, which names another file now (a sweep took it:
            as if it had gone before the first open).
        OSError: as ``os.open``.
    """
    again = flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_NOFOLLOW)
    if _PROC_FDS.is_dir():
        return os.open(_PROC_FDS / str(fd), again)
    new = os.open(path, again | (flags & os.O_NOFOLLOW), dir_fd=dir_fd)
    if _identity(new) != _identity(fd):
        os.close(new)
        raise FileNotFoundError(errno.ENOENT, "replaced while it was opened", str(path))
    return new


def _identity(fd: int) -> tuple[int, int]:
    """The file open as ``fd``: its device and inode."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _made(path: Path, folder: bool) -> LockFile:
    """Make ``path`` (a file, or a folder with its lock file) if missing; the descriptor to
    lock, open read-write (made as the umask allows, so a group's gc can lock it).

    Raises:
        StoreError: this process holds it already (its lock would wait on its own for ever).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir(exist_ok=True)
    return opened_lock(lock_file_of(path, folder), os.O_RDWR | os.O_CREAT, hold=True)


def _locked_made(path: Path, folder: bool) -> LockFile:
    """:func:`_made`, locked: made again while a sweep removed what it locked first."""
    while True:
        try:
            lock = _made(path, folder)
        except FileNotFoundError:
            continue  # a sweep removed the folder between its making and its lock file's
        try:
            lock_taken(lock.fd, wait=True)  # a sweep holding it is removing it: made again
            if is_same_file(lock_file_of(path, folder), lock.fd):
                return lock
        except BaseException:
            lock.close()
            raise
        lock.close()


@contextlib.contextmanager
def holding(path: Path, *, folder: bool = False) -> Iterator[Hold]:
    """Make the scratch file (or ``folder``) ``path`` in ``tmp/`` (a name of this process's
    alone), hold its lock for the block (see the section comment), then remove what is there
    under that name and let the lock go.

    Raises:
        OSError: it cannot be made.
        StoreError: this process holds ``path`` already (a name used twice).
    """
    lock = _locked_made(path, folder)
    try:
        yield Hold(path, lock.fd, folder)
    finally:
        if lock.own():  # a forked child's copy leaves the parent's file alone
            _removed(path, folder)
            lock.close()


def _removed(path: Path, folder: bool) -> None:
    """Remove what is under ``path`` (the name is this process's alone: what is there is its
    own, made again, say), a file gone where it was published (renamed) or not."""
    with contextlib.suppress(OSError):
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
