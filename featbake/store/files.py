"""The file primitives every store writer uses: publish a file whole, make a rename durable,
remove a file, list a folder without following what is not a regular file.

Kept apart from :mod:`featbake.store.layout` (where things live): these act on any path, inside a
store or not (a tier's marks, downloaded fragments, upkeep's sweeps).
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
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
    tmp_dir.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(final, tmp_dir)
    try:
        write(tmp)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
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
