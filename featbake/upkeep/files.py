"""The store folder as upkeep reads it: regular files only, never followed links.

Shared by verify and repair: moving a file to ``quarantine/``, refusing a folder that is not
a store, and reading a root manifest so that no content of its can crash upkeep. (Listing a
folder safely, ``list_folder``, is the store's: :mod:`featbake.store.files`.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.layout import Layout
from featbake.store.open import Need, StoreRef, open_store, place_of
from featbake.store.place import VerifyScope
from featbake.store.roots import Root, RootItem, read_root_file


def ensure_quarantine(layout: Layout) -> None:
    """Make ``quarantine/`` (repair checks it before it changes anything).

    Raises:
        StoreError: ``quarantine`` is there and not a folder.
    """
    try:
        layout.quarantine.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise StoreError(
            f"{layout.quarantine} is not a folder, so repair has nowhere to set damage aside; "
            "move it away, then run `featbake verify --repair` again"
        ) from e


def quarantine(layout: Layout, path: Path, name: str | None = None) -> Path:
    """Move ``path`` (a file, link or FIFO, or the folder of a rebuilt catalog's old files) into
    ``quarantine/`` under a free name (``name``, or its own, numbered if taken); returns it.

    Raises:
        StoreError: ``quarantine`` is there and not a folder (nothing is moved).
    """
    ensure_quarantine(layout)
    name = name or path.name
    dest = layout.quarantine / name
    n = 1
    while os.path.lexists(dest):
        dest = layout.quarantine / f"{name}.{n}"
        n += 1
    os.replace(path, dest)
    return dest


#: Where ``verify --repair`` keeps the old catalog's files while it builds a new one: first
#: moved into ``catalog.moving/`` (the database first, then its WAL and shared memory, which
#: keep their names there so SQLite still pairs them), which is renamed ``catalog.rebuilding/``
#: once all are in, and only then is the new catalog made. A rebuild killed midway finds the old
#: one there and reads again what only it knew (roots whose manifest file is gone, the hash
#: cache, last uses); gc refuses to run on a partial catalog meanwhile. The finished rebuild
#: renames the folder into ``quarantine/`` in one step.
MOVING, PENDING = "catalog.moving", "catalog.rebuilding"

#: The files of one SQLite catalog: the database, then its WAL and shared memory.
CATALOG_SUFFIXES = ("", "-wal", "-shm")


def rebuild_pending(layout: Layout) -> Path:
    """The folder holding the old catalog a rebuild set aside and has not finished replacing
    (see :data:`PENDING`); it exists only while a rebuild runs or after one was killed."""
    return layout.root / PENDING


def moving_aside(layout: Layout) -> Path:
    """The folder the old catalog's files move into before it becomes :func:`rebuild_pending`."""
    return layout.root / MOVING


def rebuild_interrupted(layout: Layout) -> bool:
    """Whether a ``verify --repair`` began to set the catalog aside and has not finished."""
    return any(os.path.lexists(p) for p in (moving_aside(layout), rebuild_pending(layout)))


def refuse_while_rebuild_pending(layout: Layout) -> None:
    """Refuse to change a store whose catalog a killed ``verify --repair`` left half rebuilt.

    Raises:
        StoreError: the old catalog still waits beside the partial one.
    """
    if rebuild_interrupted(layout):
        raise StoreError(
            f"a `featbake verify --repair` of {layout.root} was interrupted while it rebuilt the "
            "catalog, which lacks what only the old one knew; run `featbake verify --repair` "
            "again to finish it, then rerun this"
        )


def refuse_unmarked(layout: Layout) -> None:
    """Refuse a store folder that holds none of a store's files (``--cache`` pointing at the
    wrong place): verify, repair and merge would report on, or turn into a store, someone's
    folder.

    Raises:
        StoreError: it holds none, with what to do.
    """
    if not layout.holds_store_marks():
        raise StoreError(
            f"{layout.root} is not a featbake store (none of catalog.sqlite, shards/, roots/ or "
            "fragments/ is there); point --cache (or $FEATBAKE_CACHE) at the store"
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
    folder = place_of(layout).verify_scope() is VerifyScope.FOLDER  # else: objects elsewhere
    if folder:
        refuse_unmarked(layout)
    if folder and not layout.holds_anything_built():  # what a build that failed at once left
        raise StoreError(
            f"nothing is built in {layout.root} yet (no catalog.sqlite, shard files or root "
            "manifests): nothing to check or free; build into it with `featbake build`"
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
