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
from typing import BinaryIO

from featbake.errors import StoreError
from featbake.process import fork_safe_lock, in_forked_child


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
# worker) closes this process's held descriptors (:func:`_close_held_in_child`): a child that
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


#: This process's live holds (path -> locked descriptor): a second hold of one path is refused
#: (its two descriptors would wait on each other), and a forked child closes them all.
_HELD: dict[Path, int] = {}
_HELD_GUARD = fork_safe_lock()  # never copied into a child held by a thread it lacks


def _close_held_in_child() -> None:
    """In a forked child: close the parent's held descriptors, so that the child never keeps a
    killed parent's leftover from the sweep (the lock follows the open file), and forget them
    (the child's copies of :func:`holding` blocks then leave the parent's files alone)."""
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


in_forked_child(_close_held_in_child)


def _registered(path: Path, fd: int) -> None:
    """Note ``fd`` as this process's hold of ``path``; refuses a second hold of it."""
    with _HELD_GUARD:
        _refuse_second(path)
        _HELD[path] = fd


def _refuse_second(path: Path) -> None:
    """Refuse a second hold of ``path`` in this process (the caller holds the guard)."""
    if path in _HELD:
        raise StoreError(
            f"{path} is already held by this process; a scratch name is used once: make a new "
            "one with a unique name"
        )


def _released(path: Path, fd: int) -> bool:
    """Forget this process's hold of ``path`` by ``fd``; whether it was this process's (not
    inherited by a fork: then its file is left to its owner)."""
    with _HELD_GUARD:
        if _HELD.get(path) != fd:
            return False
        del _HELD[path]
        return True


def _made(path: Path, folder: bool) -> int:
    """Make ``path`` (a file, or a folder with its lock file) if missing; the descriptor to
    lock, open read-write (made as the umask allows, so a group's gc can lock it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir(exist_ok=True)
    return os.open(lock_file_of(path, folder), os.O_RDWR | os.O_CREAT, 0o666)


def _locked_made(path: Path, folder: bool) -> int:
    """:func:`_made`, locked: made again while a sweep removed what it locked first."""
    while True:
        try:
            fd = _made(path, folder)
        except FileNotFoundError:
            continue  # a sweep removed the folder between its making and its lock file's
        try:
            lock_taken(fd, wait=True)  # a sweep holding it is removing it: made again below
            if is_same_file(lock_file_of(path, folder), fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def holding(path: Path, *, folder: bool = False) -> Iterator[Hold]:
    """Make the scratch file (or ``folder``) ``path`` in ``tmp/`` (a name of this process's
    alone), hold its lock for the block (see the section comment), then remove what is there
    under that name and let the lock go.

    Raises:
        OSError: it cannot be made.
        StoreError: this process holds ``path`` already (a name used twice).
    """
    with _HELD_GUARD:
        _refuse_second(path)  # its lock would wait on this process's own for ever
    fd = _locked_made(path, folder)
    try:
        _registered(path, fd)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield Hold(path, fd, folder)
    finally:
        if _released(path, fd):  # a forked child's copy leaves the parent's file alone
            _removed(path, folder)
            os.close(fd)


def _removed(path: Path, folder: bool) -> None:
    """Remove what is under ``path`` (the name is this process's alone: what is there is its
    own, made again, say), a file gone where it was published (renamed) or not."""
    with contextlib.suppress(OSError):
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
