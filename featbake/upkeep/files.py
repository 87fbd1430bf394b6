"""The files of a store folder as upkeep sees them: regular files only, never followed links."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from featbake.errors import StoreError
from featbake.store.layout import Layout


@dataclass(frozen=True)
class LooseFile:
    """A file in the store that the catalog does not name (an orphan shard, a tmp leftover)."""

    path: str
    bytes: int
    mtime: float


@dataclass(frozen=True)
class FolderListing:
    """Regular files matching a pattern, and the other things found there (links, FIFOs)."""

    files: tuple[LooseFile, ...]
    special: tuple[str, ...]  # paths that are not regular files: never read, never followed


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
                files.append(LooseFile(str(p), st.st_size, st.st_mtime))
            elif not stat.S_ISDIR(st.st_mode):
                special.append(str(p))
    return FolderListing(tuple(files), tuple(special))


def loose_files(folder: Path, pattern: str) -> list[LooseFile]:
    """The regular files matching ``pattern`` in ``folder``."""
    return list(list_folder(folder, pattern).files)


def shard_files(layout: Layout) -> dict[str, LooseFile]:
    """shard name -> file, for every regular ``shards/ab/<name>.safetensors``."""
    return {
        Path(f.path).name.removesuffix(".safetensors"): f
        for f in loose_files(layout.shards, "*/*.safetensors")
    }


def quarantine(layout: Layout, path: Path) -> Path:
    """Move ``path`` (a file, link or FIFO) into ``quarantine/`` under a free name; returns it."""
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    dest = layout.quarantine / path.name
    n = 1
    while os.path.lexists(dest):
        dest = layout.quarantine / f"{path.name}.{n}"
        n += 1
    os.replace(path, dest)
    return dest


def looks_like_store(layout: Layout) -> bool:
    """Whether the folder holds anything of a store: a catalog, ``shards/`` or ``roots/``."""
    return any(
        os.path.lexists(p)
        for p in (layout.catalog, layout.shards, layout.root / "roots", layout.quarantine)
    )


def require_store(layout: Layout) -> None:
    """Refuse a folder that is not a featbake store (``--cache`` pointing at the wrong place).

    Raises:
        StoreError: nothing of a store is there; verify would report it "damaged" and repair
            would turn someone's folder into a store.
    """
    if not looks_like_store(layout):
        raise StoreError(
            f"{layout.root} is not a featbake store (no catalog.sqlite, shards/ or roots/); "
            "point --cache (or $FEATBAKE_CACHE) at a store"
        )
