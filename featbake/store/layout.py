"""Where things live inside a store directory: the :class:`Layout` (a pure path object), and the
checks a name passes before it becomes a path or an object key.

The file primitives are :mod:`featbake.store.files`, the write lock :mod:`featbake.store.locks`,
shared-filesystem detection :mod:`featbake.store.filesystem`, and what a store's place does
(a directory or a bucket) :mod:`featbake.store.place`: a layout never asks its bucket anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.store.files import LooseFile, list_folder
from featbake.store.url import is_url

#: A shard's name: the SHA-256 of its bytes, in hex. Nothing else is ever followed to a path or
#: an object key, whatever a catalog, fragment or listing says.
_SHARD_NAME = re.compile(r"^[0-9a-f]{64}$")
#: A root's name as a file name: one path component, no leading dot.
_ROOT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,250}$")


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is a shard name (64 lowercase hex digits).

    Example:
        >>> is_shard_name("ab" * 32), is_shard_name("../../victim/model")
        (True, False)
    """
    return isinstance(name, str) and _SHARD_NAME.match(name) is not None


def checked_shard_name(name: str) -> str:
    """``name``, once it is a shard name.

    Raises:
        StoreCorrupt: it is not one: a catalog, fragment or listing naming it was damaged or
            planted, and nothing it names is opened, fetched or deleted.
    """
    if not is_shard_name(name):
        raise StoreCorrupt(
            f"{name[:100]!r} is not a shard name (64 hex digits): the catalog or fragment naming "
            "it is damaged or was tampered with; nothing it names is touched. Run `featbake "
            "verify` on the store"
        )
    return name


def checked_root_name(name: str) -> str:
    """``name``, once it can name a file in ``roots/`` (one path component, no leading dot).

    Raises:
        StoreCorrupt: it cannot (a damaged or planted catalog row or manifest).
    """
    if not (isinstance(name, str) and _ROOT_NAME.match(name) and ".." not in name):
        raise StoreCorrupt(
            f"{str(name)[:100]!r} is not a root name: the catalog or manifest naming it is "
            "damaged or was tampered with; nothing it names is touched. Run `featbake verify`"
        )
    return name


def shard_name(path: Path) -> str:
    """The shard name a ``shards/ab/<name>.safetensors`` path gives."""
    return path.name.removesuffix(".safetensors")


def shard_files(layout: Layout) -> dict[str, LooseFile]:
    """shard name -> file, for every regular ``shards/ab/<name>.safetensors``."""
    return {shard_name(f.path): f for f in list_folder(layout.shards, "*/*.safetensors").files}


class Remote(Protocol):
    """What the store's writers know of a bucket the layout is the local tier of: where a sealed
    fragment goes. The whole place (whether it holds a shard, how messages name it) is
    :func:`featbake.store.open.place_of`, a :class:`featbake.store.place.Place`; the layout
    itself never asks it anything."""

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        """Upload a sealed fragment after the shards it names."""
        ...


@dataclass(frozen=True)
class Layout:
    """Where things live inside a cache directory.

    A pure path object: ``remote`` is set when the store is a bucket (this directory is then
    its local tier, see :mod:`featbake.store.bucket`) and is carried, never asked: what the
    store holds and how it is named are its place's answers (:mod:`featbake.store.place`).
    """

    root: Path
    remote: Remote | None = field(default=None, compare=False, repr=False)

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.sqlite"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def roots(self) -> Path:
        """``<store>/roots``: a JSON manifest per root, so roots survive the loss of the catalog."""
        return self.root / "roots"

    def has_root_manifests(self) -> bool:
        """True if ``roots/`` holds a manifest: a catalog existed (they are written with it)."""
        try:
            with os.scandir(self.roots) as it:
                return any(e.name.endswith(".json") for e in it)
        except OSError:
            return False

    def holds_anything_built(self) -> bool:
        """True if a build left anything here to read or rebuild from: a catalog, a file under
        ``shards/``, a root manifest, or ``quarantine/``. A build that failed before its first
        shard (no input files) leaves empty ``shards/`` and ``tmp/``: nothing to repair."""
        return os.path.lexists(self.catalog) or self.holds_what_a_catalog_names()

    def holds_what_a_catalog_names(self) -> bool:
        """True if the store holds what only a catalog's rows name, and ``verify --repair``
        rebuilds them from: a file under ``shards/``, a root manifest, or ``quarantine/``. A
        catalog without tables beside them was emptied, not new (:class:`Catalog` refuses to
        start it over)."""
        if os.path.lexists(self.quarantine) or self.has_root_manifests():
            return True
        return any(files for _, _, files in os.walk(self.shards))

    def refuse_fresh_catalog(self, *, allow: bool = False) -> None:
        """Raise instead of starting a new, empty catalog beside the surviving root manifests.

        Root manifests are written only together with catalog rows, so manifests without a
        catalog mean it was deleted or lost: a fresh one would re-encode everything and leave
        the intact shards orphaned. ``verify --repair`` rebuilds it from the shards
        (``allow=True`` is how it says so).

        Raises:
            StoreError: the catalog is missing but root manifests are not.
        """
        if not allow and not self.catalog.exists() and self.has_root_manifests():
            raise StoreError(
                f"the store {self.root} has root manifests (roots/*.json) but no catalog.sqlite "
                "(deleted or lost); run `featbake verify --repair` to rebuild it from them, "
                "then run this again (a new, empty catalog would re-encode everything; to start "
                "over, delete the store folder)"
            )

    def _entries(self) -> list[str] | None:
        """The names in the store's folder, sorted; None where it cannot be listed (not there
        yet, or unreadable)."""
        try:
            with os.scandir(self.root) as it:
                return sorted(e.name for e in it)
        except OSError:
            return None

    def holds_store_marks(self) -> bool:
        """Whether the folder holds any of what only a store holds (:data:`STORE_MARKS`): a
        command that reads or tidies a store (merge, verify) refuses a folder that does not,
        as ``--cache`` pointing at the wrong place."""
        return bool(STORE_MARKS.intersection(self._entries() or ()))

    def refuse_foreign_folder(self) -> None:
        """Refuse to make a store in a folder that holds files and no store (see :meth:`ensure`).

        Raises:
            ConfigError: it does, naming one of its entries.
        """
        if self.remote is not None:
            return  # a bucket's tier folder: featbake's own
        entries = self._entries()  # None: made below, or unreadable (said where it is made)
        if not entries or STORE_MARKS.intersection(entries):
            return
        raise ConfigError(
            f"{self.root} holds files of its own ({entries[0]!r}, ...) and no featbake store; "
            "give an empty or new folder for the store (--cache DIR), so nothing there is ever "
            "taken for the store's own (gc empties a store's tmp/)"
        )

    def shard_path(self, name: str) -> Path:
        """``shards/ab/<name>.safetensors`` for a shard named ``ab...``.

        Raises:
            StoreCorrupt: ``name`` is not a shard name (:func:`checked_shard_name`).
        """
        checked_shard_name(name)
        return self.shards / name[:2] / f"{name}.safetensors"

    def ensure(self) -> Layout:
        """Create the directories, or raise a StoreError that says why it could not.

        Raises:
            ConfigError: the folder exists, holds files, and none of a store's (a folder of
                the user's given as ``--cache``, or ``--cache ""`` read as the current one):
                a store there would take the user's ``tmp/`` for its own, which gc empties.
        """
        self.refuse_foreign_folder()
        try:
            for d in (self.root, self.shards, self.tmp):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            where = (
                "--local-cache DIR or $FEATBAKE_LOCAL_CACHE (this node's tier of the bucket)"
                if self.remote is not None
                else "--cache DIR or $FEATBAKE_CACHE"
            )
            raise StoreError(
                f"cannot create the cache directory {self.root}: {e.strerror}; "
                f"choose a writable place with {where}"
            ) from e
        return self


#: What only a store folder holds (any one of them: a store of any age, a build killed before
#: its first shard, a catalog lost beside its shards).
STORE_MARKS = frozenset(
    {"catalog.sqlite", "shards", "roots", "fragments", "claims", "quarantine", "write.lock"}
)


def layout_at(cache: str | os.PathLike[str] | None) -> Layout:
    """The layout of the store in directory ``cache`` (``$FEATBAKE_CACHE``, else ``./.featbake``,
    for None); nothing is created.

    Raises:
        ConfigError: ``cache`` is blank, or a URL (``s3://...``): bucket stores are opened by
            :func:`featbake.store.open.open_store`, and a URL read as a path would make a local
            folder named ``s3:``.

    Example:
        >>> layout_at("/data/features").root
        PosixPath('/data/features')
    """
    where = os.fspath(cache) if cache is not None else os.environ.get("FEATBAKE_CACHE")
    where = where or ".featbake"
    if not where.strip():  # " ": a folder no listing shows (FEATBAKE_CACHE=" " made one)
        raise ConfigError(
            f"the store path {where!r} is blank ($FEATBAKE_CACHE or --cache); give a folder"
        )
    if is_url(where):
        raise ConfigError(
            f"{where!r} is a bucket URL, and this needs a store directory; pass a directory, or "
            "open the bucket store with featbake.store.open.open_store (CachedEncoder, "
            "CachedFeatureDataset and the featbake commands take --cache s3://... as it is)"
        )
    return Layout(Path(where))
