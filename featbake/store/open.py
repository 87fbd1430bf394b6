"""Opening a store by its directory or bucket URL: the layout, and the catalog with a clear error.

A store that cannot be written here (a read-only mount, no write permission) opens read-only
(see ``featbake.store.catalog``): every command that only reads works on it. A
bucket store (``s3://bucket/prefix``) opens as its local tier, with the newest published
catalog brought into it (see :mod:`featbake.store.bucket`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import closing
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from featbake.errors import AwaitingMerge, ConfigError, StoreError
from featbake.store.bucket import TIER_MARK, VERSION_FILE, BucketStore
from featbake.store.catalog import READ_ONLY_ENV, Catalog, cannot_write, read_only_forced
from featbake.store.files import list_folder
from featbake.store.filesystem import announce, detect
from featbake.store.fragments import fragment_shard_names, sealed_fragments
from featbake.store.layout import Layout, layout_at, shard_files, shard_name
from featbake.store.locks import shared_write_lock
from featbake.store.merge import MergeReport, merge
from featbake.store.objects import ObjectStore
from featbake.store.place import (
    Change,
    Held,
    Place,
    Sweep,
    Swept,
    TierUsage,
    VerifyScope,
    held_folder,
    held_now,
    remote_place,
    removed_leftover,
    unnamed_past,
)
from featbake.store.roots import Root, roots_named
from featbake.store.url import BucketURL, is_url
from featbake.units import parse_bytes

T = TypeVar("T")

#: The local tier's default budget (litdata's ``max_cache_size`` defaults to 100 GB too).
DEFAULT_LOCAL_CACHE_SIZE = "100GiB"

# -- opening a store ---------------------------------------------------------------------------
#: A store as callers name it: its layout, its directory or bucket URL, or None for the default.
StoreRef = Layout | str | os.PathLike[str] | None


class Need(Enum):
    """What :func:`open_store` requires of the store it opens."""

    ANY = "any"  # a build or a dataset may create it
    WRITE = "write"  # a build: refused before anything is written where writes are not allowed
    STORE = "store"  # something of a store must be there (upkeep, merge)
    CATALOG = "catalog"  # a catalog to read (stats, gc, export)


def open_store(
    ref: StoreRef,
    *,
    need: Need = Need.ANY,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
) -> Layout:
    """The store at ``ref``, over its place: a directory, or a bucket seen through this node's
    local tier (``Layout.remote``). The one opener every command, the dataset, ``CachedEncoder``,
    export and the upkeep API use.

    Args:
        ref: a directory, ``s3://bucket/prefix``, a :class:`Layout` (kept as it is), or None
            (``$FEATBAKE_CACHE``, else ``./.featbake``).
        need: what must already be there (:class:`Need`).
        local_cache: a bucket store's local tier (default ``$FEATBAKE_LOCAL_CACHE``, else
            ``~/.cache/featbake/buckets``); each endpoint, bucket and prefix gets a folder in it.
        local_cache_size: the most bytes the tier's shards take (default
            ``$FEATBAKE_LOCAL_CACHE_SIZE``, else 100 GiB); least recently used shards go first.

    Raises:
        ConfigError: a URL featbake cannot open, a size it cannot read, or a bucket's tier
            folder given as a store.
        StoreError: the bucket cannot be read (no credentials, no bucket, denied access), or
            ``need`` is not met (the message says what to run).

    Example:
        >>> open_store("/data/features").root
        PosixPath('/data/features')
    """
    layout = _layout_of(ref, local_cache, local_cache_size)
    if need is Need.WRITE and read_only_forced():
        raise StoreError(
            f"the store {describe(layout)} is read-only here ({READ_ONLY_ENV}=1), and a build "
            f"writes to it; unset {READ_ONLY_ENV} to build (nothing was written)"
        )
    if need in (Need.STORE, Need.CATALOG) and layout.remote is None:
        _require_directory(layout)
    if need is Need.CATALOG:
        _require_catalog(layout)
    return layout


def _layout_of(
    ref: StoreRef,
    local_cache: str | os.PathLike[str] | None,
    local_cache_size: int | str | None,
) -> Layout:
    if isinstance(ref, Layout):
        return ref
    where = os.fspath(ref) if ref is not None else os.environ.get("FEATBAKE_CACHE", "")
    if not is_url(where):
        layout = layout_at(ref)
        _refuse_tier(layout)
        return layout
    url = BucketURL.parse(where)
    base = local_cache or os.environ.get("FEATBAKE_LOCAL_CACHE")
    tier = Path(base) if base else Path.home() / ".cache" / "featbake" / "buckets"
    if base:
        _refuse_tier_in_store(tier)
    size = local_cache_size or os.environ.get("FEATBAKE_LOCAL_CACHE_SIZE")
    budget = parse_bytes(size or DEFAULT_LOCAL_CACHE_SIZE)
    # endpoint, bucket, prefix: never a credential (an s3 endpoint's folder is as it was)
    folder = tier / ObjectStore(url).tier_folder() / url.bucket / url.prefix
    store = BucketStore(url, folder, budget)
    store.sync_catalog()
    return store.layout


def _refuse_tier(layout: Layout) -> None:
    """A bucket's local tier opened as a store of its own would fill a store nobody reads, and
    its next publish would name shards the bucket never got.

    Raises:
        ConfigError: ``layout`` is a tier (its mark, or the catalog.version file tiers keep).
    """
    if not is_tier_folder(layout.root):
        return
    mark = layout.root / TIER_MARK
    try:
        url = str(json.loads(mark.read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        url = "s3://bucket/prefix"
    raise ConfigError(
        f"{layout.root} is the local tier of the bucket store {url}, not a store of its own; "
        f"use --cache {url} (with --local-cache pointing above this folder)"
    )


def is_tier_folder(folder: Path) -> bool:
    """Whether ``folder`` is a bucket prefix's local tier: its mark, or the
    ``catalog.version`` file tiers keep (one made before the mark was)."""
    return (folder / TIER_MARK).is_file() or (folder / VERSION_FILE).is_file()


def _refuse_tier_in_store(tier: Path) -> None:
    """A bucket's tier inside a directory store would put its folders among the store's own
    (every listing of the store would hold them, and a repair or a move of the store takes
    them along); a tier is a folder of its own.

    Raises:
        ConfigError: ``tier`` (given: ``--local-cache``, ``$FEATBAKE_LOCAL_CACHE``) or a folder
            above it is a directory store (a catalog and its shards, and no tier's marks).
    """
    for folder in (tier.absolute(), *tier.absolute().parents):
        if not ((folder / "catalog.sqlite").is_file() and (folder / "shards").is_dir()):
            continue  # a store has both (another program's catalog.sqlite is no store)
        if is_tier_folder(folder):
            return  # a bucket prefix's own tier folder, above another prefix's: refused later
        raise ConfigError(
            f"the bucket's local cache {tier} (--local-cache) is inside the featbake store "
            f"{folder}; give it a folder of its own, outside any store (default "
            "~/.cache/featbake/buckets, or $FEATBAKE_LOCAL_CACHE)"
        )


def _require_directory(layout: Layout) -> None:
    if not layout.root.is_dir():
        raise StoreError(
            f"there is no featbake store at {layout.root}; point --cache (or $FEATBAKE_CACHE) at "
            "one, or create it with `featbake build`"
        )


def _require_catalog(layout: Layout) -> None:
    if layout.catalog.exists():
        return
    if sealed_fragments(layout):
        raise AwaitingMerge(
            f"the store {describe(layout)} holds only unmerged build fragments; run `featbake "
            "merge` once every part of the build is done"
        )
    refuse_lost_catalog(layout)
    if layout.remote is not None:
        raise StoreError(
            f"the store {describe(layout)} has no published catalog yet; build into it "
            "(`featbake build --cache URL`), or run `featbake merge --cache URL` after a build "
            "in parts"
        )
    if not layout.holds_anything_built():  # an empty folder, or what a failed build left
        raise StoreError(
            f"nothing is built in {layout.root} yet (no catalog.sqlite, shard files or root "
            "manifests); build into it with `featbake build --cache DIR`, or point --cache (or "
            "$FEATBAKE_CACHE) at a store"
        )
    raise StoreError(
        f"the store {layout.root} has no catalog.sqlite; run `featbake verify --repair` to "
        "rebuild it from the shards and root manifests"
    )


def refuse_lost_catalog(layout: Layout) -> None:
    """Refuse a bucket store whose catalog versions were deleted (it holds shard objects and
    no catalog version or fragment): every command says so, where a new store's words ("no
    published catalog yet") or a verify's ("clean", its shards orphans) would mislead.

    Raises:
        StoreError: the bucket lost its catalog, with what to do.
    """
    if layout.catalog.exists() or not isinstance(layout.remote, BucketStore):
        return
    if layout.remote.lost_its_catalog():
        raise StoreError(
            f"the store {describe(layout)} holds shard objects but no catalog version and no "
            "fragment: its catalog/ objects were deleted (restore them from a copy of the "
            "bucket, or build into it again: every input is encoded again), or a first build "
            "into it has not named its shards yet (retry in a minute)"
        )


def commit(layout: Layout, change: Callable[[Layout], Change[T]]) -> T:
    """Apply a catalog ``change`` where the store keeps its catalog (:meth:`Place.commit`):
    in place for a directory, as the next published version for a bucket. Upkeep writes its
    catalog changes through here, whatever the place.

    Raises:
        StoreError: the catalog or the bucket cannot be written.
    """
    return place_of(layout).commit(change)


def place_of(layout: Layout) -> Place:
    """Where the store ``layout`` lasts: its bucket (the layout is its tier), or the directory."""
    return remote_place(layout) or LocalPlace(layout)


def left_folders(tmp: Path) -> list[Held]:
    """The folders in a store's ``tmp/`` (verify's scratch, a killed repair's work), each
    weighed by :func:`~featbake.store.place.held_folder`: its bytes and the latest change of
    anything in it, so one still written to is young however old the folder itself is."""
    try:
        folders = sorted(p for p in tmp.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []  # no tmp/ yet
    return [h for h in map(held_folder, folders) if h is not None]


def tmp_leftovers(tmp: Path) -> list[Held]:
    """What a store directory's ``tmp/`` holds that its gc sweep weighs, of any age: each file,
    and each folder (:func:`left_folders`)."""
    files = [Held(str(f.path), f.bytes, f.mtime) for f in list_folder(tmp, "*").files]
    return files + left_folders(tmp)


class LocalPlace:
    """A store directory as a :class:`~featbake.store.place.Place`: its catalog is changed in
    place (the catalog's own transactions, under the write lock), its unnamed shard files and
    ``tmp/`` leftovers go once older than the grace period, and verify reads every file of it
    and repairs it. One process builds into the catalog itself, parts write fragments that
    :meth:`merge` folds in; its shards are read where they are (nothing to fetch or follow)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def __str__(self) -> str:
        return str(self.layout.root)

    def commit(self, change: Callable[[Layout], Change[T]]) -> T:
        outcome = change(self.layout)
        if outcome.changed and outcome.after_publish is not None:
            outcome.after_publish()
        return outcome.value

    def settle(self) -> None:
        return None  # readers' serving fragments wait for `featbake merge`

    def rewrites_shards(self) -> bool:
        return True

    def plan_sweep(self, now: float, grace: float, retention: float) -> Sweep:
        """Shard files nothing names and ``tmp/`` files, once older than ``grace``.

        Shards of sharded builds not merged yet are named by fragments, not rows: not garbage.
        The catalog is read again after the fragments: a merge that folded a fragment in and
        removed it meanwhile moved its shards into the catalog, where this second read finds
        them.
        """
        with closing(Catalog(self.layout)) as catalog:
            named = {s.name for s in catalog.shard_rows()} | fragment_shard_names(self.layout)
            named |= {s.name for s in catalog.shard_rows()}
        files = [Held(str(f.path), f.bytes, f.mtime) for f in shard_files(self.layout).values()]
        orphans, young = unnamed_past(files, lambda p: shard_name(Path(p)), named, now, grace)
        loose = [h for h in self.leftovers() if now - h.modified >= grace]
        return Sweep(tuple(orphans), tuple(loose), (), young)

    def leftovers(self) -> list[Held]:
        return [h for h in tmp_leftovers(self.layout.tmp) if not held_now(h)]

    def sweep(self, plan: Sweep, crash: Callable[[str], None]) -> Swept:
        """Unlink the plan's shard files (re-checked under the write lock: one indexed since
        the plan, by a late commit or ``verify --repair``, is no longer unnamed), then its
        ``tmp/`` files."""
        shards = freed = 0
        with shared_write_lock(self.layout), closing(Catalog(self.layout)) as catalog:
            for h in plan.shards:
                got = catalog.unlink_shard_file(shard_name(Path(h.name)), h.modified)
                if got:
                    shards, freed = shards + 1, freed + got
                    crash("orphan-unlinked")
        loose = [removed_leftover(h) for h in plan.loose]
        gone = [n for n in loose if n is not None]
        return Swept(shards, len(gone), 0, freed + sum(gone))

    def repair_refusal(self) -> str | None:
        return None

    def verify_scope(self) -> VerifyScope:
        return VerifyScope.FOLDER

    def tier_usage(self) -> TierUsage | None:
        return None  # a directory is read where it is

    def named_shards(self) -> dict[str, int]:
        with closing(Catalog(self.layout)) as catalog:
            return {s.name: s.bytes for s in catalog.shard_rows()}

    def shard_objects(self) -> dict[str, int]:
        return {name: f.bytes for name, f in shard_files(self.layout).items()}

    def download_shard(self, name: str, dest: Path) -> None:
        shutil.copyfile(self.layout.shard_path(name), dest)

    def shard_where(self, name: str) -> str:
        return str(self.layout.shard_path(name))

    def has_shard(self, name: str) -> bool:
        return self.layout.shard_path(name).is_file()

    def describe(self) -> str:
        return str(self.layout.root.absolute())

    def builds_in_fragments(self) -> bool:
        return False  # one process writes the catalog in place; parts write fragments

    def sync_fragments(self) -> int:
        return 0  # the directory holds its fragments already

    def sync_catalog(self) -> int:
        return 0  # the catalog is written in place: it is the newest

    def merge(self, abandon: AbstractSet[str] = frozenset()) -> MergeReport:
        return merge(self.layout, abandon=abandon)

    def serving_mode(self) -> bool:
        """Fragments on a shared filesystem only, where SQLite must not be written from many
        hosts; says so in one line (a :class:`~featbake.store.layout.SharedFilesystemWarning`),
        once per store per process.

        Raises:
            ConfigError: ``$FEATBAKE_SHARED_FS`` holds something other than 1, 0 or auto.
        """
        mode = detect(self.layout.root)
        if mode.shared:
            announce(
                f"serve:{self.layout.root}",
                f"the store {self.layout.root} is on a shared filesystem ({mode.reason}): "
                "datasets read its catalog read-only and record written-back features and "
                "last-use times in fragments/ until `featbake merge` folds them in (SQLite cannot "
                "be written safely from many hosts)",
            )
        return mode.shared

    def follow_blocks(self, windows: Sequence[Sequence[str]] | None) -> bool:
        return False  # shards are read where they are: nothing to fetch ahead

    def fetch_ahead(self, name: str) -> bool:
        return False

    def ahead_items(self) -> int:
        return 0  # the page cache reads ahead; the loader's own window suffices

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        return None  # sealed in the directory: there already

    def publish_shards(self, shards: Sequence[str]) -> None:
        return None  # written in the directory: there already

    def defers_fragments(self) -> bool:
        return False  # a fragment is a file where it lasts: one per seal costs no upload

    def publish_padding(self, record: Path) -> None:
        return None  # written in the directory: there already

    def retire_padding(self, record: Path) -> None:
        return None  # its file is the record

    def padding_texts(self, name: str, part: str | None = None) -> list[str] | None:
        return None  # every part's record is a file of the directory's roots/


def describe(layout: Layout) -> str:
    """How messages name a store: its directory, or its bucket URL, never the tier folder
    (:meth:`Place.describe`)."""
    return place_of(layout).describe()


def open_catalog(ref: StoreRef, *, reading: bool = False, **place: Any) -> tuple[Layout, Catalog]:
    """Layout and catalog of an existing store, without creating a catalog that is missing.

    The catalog is a context manager: ``with open_catalog(cache)[1] as catalog: ...``.
    ``place`` takes :func:`open_store`'s ``local_cache`` and ``local_cache_size``.
    ``reading``: the caller only reads (``stats``, ``roots``): where the disk has no room to
    open the catalog to write, it is opened read-only instead of refused.

    Raises:
        StoreError: no store, or its catalog is missing or unreadable (the message says to run
            ``featbake verify --repair``).
    """
    layout = open_store(ref, need=Need.CATALOG, **place)
    catalog = Catalog(layout)
    try:
        catalog.conn  # noqa: B018  (open now: a damaged catalog fails here, with its message)
    except StoreError as e:
        if not (reading and not catalog.read_only and cannot_write(e)):
            raise
        catalog = Catalog(layout, read_only=True)  # a full disk: read what is there
        catalog.conn  # noqa: B018
    return layout, catalog


def resolve_root(catalog: Catalog, name: str) -> Root:
    """The root called ``name`` or named by a unique prefix of it.

    Raises:
        ConfigError: no root, or several, match; a prefix too short to name one.
    """
    roots = catalog.roots()
    named = roots_named(name, (r.name for r in roots))
    if named is None:
        raise ConfigError(
            f"{name!r} is too short a prefix to name a root: give its name, or at least two "
            "characters past `r-` (`featbake roots` lists them)"
        )
    matches = [r for r in roots if r.name in named]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(r.name for r in roots) or "none"
    if not matches:
        raise ConfigError(f"no root is named {name!r}; the roots are: {names} (`featbake roots`)")
    raise ConfigError(
        f"{name!r} names several roots ({', '.join(r.name for r in matches)}); give more of it"
    )
