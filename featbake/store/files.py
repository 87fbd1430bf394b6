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
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import BinaryIO


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
# verify's scratch, a download, a ``.part`` being written) it holds with ``flock`` for as long as
# it uses it: a folder by its own descriptor, a file by its own. gc's sweep takes a leftover only
# once it took that lock itself, without waiting (``removed_leftover`` in store/place.py), and
# keeps it locked while it removes it; the kernel drops a killed process's lock, so its leftover
# goes with the next sweep past the grace period. A maker checks, once it holds the lock, that
# the path is still the file or folder it locked (a sweep between its create and its lock took
# it: it makes it again), so it never works in something a sweep is removing.
#
# Where the filesystem has no locks (see store/locks.py: NFS without a lock daemon, Lustre without
# ``-o flock``), nothing is held, and the sweep decides by the grace period alone.
#: ``flock`` errors that mean "no locks on this filesystem", not "someone holds the lock" (EBADF:
#: NFS emulates ``flock`` with byte-range locks, which refuse an exclusive lock on a descriptor
#: opened read-only, as a folder's is).
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF)


class Taken(Enum):
    """What trying a file's lock without waiting found."""

    TAKEN = "taken"  # this process holds it now
    HELD = "held"  # a live process holds it
    NO_LOCKS = "no-locks"  # the filesystem has none: nothing is held


def lock_taken(fd: int, *, wait: bool = False) -> Taken:
    """Take the exclusive ``flock`` of descriptor ``fd`` (waiting for it when ``wait``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return Taken.HELD
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


@dataclass(frozen=True)
class Hold:
    """A scratch file or folder this process made and holds (:func:`holding`)."""

    path: Path
    fd: int

    def intact(self) -> bool:
        """Whether ``path`` is still what this process made (never swept and made again by
        another writer: decided by identity, not by a name being there)."""
        return is_same_file(self.path, self.fd)


def _made(path: Path, folder: bool) -> int:
    """Make ``path`` (a file, or a folder) if missing; its descriptor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir(exist_ok=True)
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def holding(path: Path, *, folder: bool = False) -> Iterator[Hold]:
    """Make the scratch file (or ``folder``) ``path`` in ``tmp/`` (a name of this process's
    alone), hold its lock for the block (see the section comment), then remove what is there
    under that name and let the lock go.

    Raises:
        OSError: it cannot be made.
    """
    while True:
        fd = _made(path, folder)
        try:
            lock_taken(fd, wait=True)  # a sweep holding it is removing it: made again below
            ours = is_same_file(path, fd)
        except BaseException:
            os.close(fd)
            raise
        if ours:
            break
        os.close(fd)
    try:
        yield Hold(path, fd)
    finally:
        try:  # the name is this process's alone: what is there is its own (made again, say)
            if folder:
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)  # gone where it was published (renamed)
        except OSError:
            pass
        finally:
            os.close(fd)
