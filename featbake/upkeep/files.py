"""The store folder as upkeep reads it: regular files only, never followed links.

Shared by stats, gc and verify: listing a folder (a FIFO or a symlink loop is listed, never
opened), moving a file to ``quarantine/``, refusing a folder that is not a store, and reading a
root manifest so that no content of its can crash upkeep.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.catalog import Root, RootItem, read_root_file
from featbake.store.layout import Layout
from featbake.store.open import Need, StoreRef, open_store


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


def shard_name(path: Path) -> str:
    """The shard name a ``shards/ab/<name>.safetensors`` path gives."""
    return path.name.removesuffix(".safetensors")


def shard_files(layout: Layout) -> dict[str, LooseFile]:
    """shard name -> file, for every regular ``shards/ab/<name>.safetensors``."""
    return {shard_name(f.path): f for f in list_folder(layout.shards, "*/*.safetensors").files}


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
        os.path.lexists(p) for p in (layout.catalog, layout.shards, layout.roots, layout.quarantine)
    )


def existing_store(store: StoreRef, **place: Any) -> Layout:
    """The layout of the store at ``store`` (a :class:`Layout` is taken as it is); ``place``
    takes :func:`~featbake.store.open.open_store`'s ``local_cache`` and ``local_cache_size``.

    Raises:
        StoreError: no folder there, or nothing of a store in it (``--cache`` pointing at the
            wrong place): verify would report it "damaged" and repair would turn someone's
            folder into a store.
    """
    layout = open_store(store, need=Need.STORE, **place)
    if layout.remote is None and not looks_like_store(layout):
        raise StoreError(
            f"{layout.root} is not a featbake store (no catalog.sqlite, shards/ or roots/); "
            "point --cache (or $FEATBAKE_CACHE) at a store"
        )
    return layout


def read_manifest(path: Path) -> tuple[Root, list[RootItem]]:
    """A root manifest file (``roots/*.json``), parsed.

    Raises:
        StoreCorrupt: it is not a readable manifest, including hostile JSON (a bare number,
            arrays nested too deep to parse) that ``read_root_file`` lets through.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would hang the read, a link lie
            raise StoreCorrupt(
                f"root manifest {path} is not a regular file; `featbake verify --repair` moves "
                "it to quarantine/"
            )
    except OSError as e:
        raise StoreCorrupt(f"root manifest {path} is unreadable ({e.strerror or e})") from e
    try:
        return read_root_file(path)
    except (RecursionError, AttributeError) as e:
        raise StoreCorrupt(
            f"root manifest {path} is unreadable ({type(e).__name__}); `featbake verify "
            "--repair` moves it to quarantine/"
        ) from e
