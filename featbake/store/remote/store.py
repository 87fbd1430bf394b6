"""A store in a bucket, worked through a local tier: what every command and dataset opens.

:class:`BucketStore` is the :class:`~featbake.store.layout.RemotePlace` of the tier's
:class:`~featbake.store.layout.Layout`: the local store code runs unchanged on the tier (the
newest catalog version as ``catalog.sqlite``, read-only; fetched shards; fragments written
here first), and calls back here for what must reach the bucket or come from it:

- a shard missing from the tier is fetched whole into it (:class:`DiskTier`);
- a sealed fragment is uploaded after the shards it names (write first, publish second), so a
  build killed at any moment keeps every fragment it sealed, on any node;
- :meth:`sync_catalog` brings the newest published catalog version into the tier.

Merging and gc, which publish new versions, are in :mod:`featbake.store.remote.publish`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt
from featbake.store.catalog.connection import Access, open_sqlite
from featbake.store.fragments import fragments_dir, parse_name
from featbake.store.layout import (
    Layout,
    TierUsage,
    checked_shard_name,
    fsync_dir,
    is_shard_name,
)
from featbake.store.reader import ShardReader, VerifyMode
from featbake.store.remote.objects import Bucket
from featbake.store.remote.ranged import RangedShardReader
from featbake.store.remote.tier import DiskTier, locked
from featbake.store.remote.url import BucketURL
from featbake.store.remote.versions import (
    PREFIX,
    newest,
    newest_object,
    version_name,
    version_of,
)

SHARDS = "shards/"
#: ``whole``, ``ranged`` or ``auto``: how shards missing from the tier are read.
READS_ENV = "FEATBAKE_BUCKET_READS"
FRAGMENTS = "fragments/"


class PinnedVersion(NamedTuple):
    """The published catalog version a tier holds, and the ETag of the object it came from."""

    version: int
    etag: str


def shard_object(name: str) -> str:
    """The object name of shard ``name`` (the local store's relative path).

    Raises:
        StoreCorrupt: ``name`` is not a shard name.
    """
    return f"{SHARDS}{checked_shard_name(name)[:2]}/{name}.safetensors"


class BucketStore:
    """A bucket store and this node's tier of it (see the module docstring).

    Args:
        url: ``s3://bucket/prefix``.
        tier: the local tier's directory (``local_cache``).
        budget: the most bytes the tier's shards may take (``local_cache_size``).
    """

    def __init__(self, url: BucketURL, tier: Path, budget: int) -> None:
        self.url = url
        self.bucket = Bucket(url)
        self.layout = Layout(tier, remote=self)
        self.tier = DiskTier(self.layout, budget)
        self._sizes: dict[str, int] | None = None  # shard name -> bytes, listed once
        self._ranged: bool | None = None  # see reads_ranged
        self._fills_tier = False  # auto mode reading by ranges: shards that fit are kept
        self._uploaded: set[str] = set()  # shards this process uploaded: copies in the tier

    def __getstate__(self) -> dict:
        return {"url": self.url, "tier": self.layout.root, "budget": self.tier.budget}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["tier"], state["budget"])  # type: ignore[misc]

    def __str__(self) -> str:
        return str(self.url)

    # -- RemotePlace: shards ---------------------------------------------------------------------
    def _listed(self) -> dict[str, int]:
        """Shard name -> bytes in the bucket, listed once per process (merge's checks)."""
        return self._sizes if self._sizes is not None else self.shard_objects()

    def _size_of(self, name: str) -> int | None:
        """Shard ``name``'s size in the bucket (from the listing if one was made, else a HEAD:
        a reader fetching a few shards never lists the whole bucket)."""
        if self._sizes is not None and name in self._sizes:
            return self._sizes[name]
        info = self.bucket.head(shard_object(name))
        return None if info is None else info.size

    def fetch_shard(self, name: str, evicted: Callable[[], None] | None = None) -> Path | None:
        size = self._size_of(name)
        if size is None:
            # gc deleted it: bring in the newest version, through which the reader's lookup
            # of the feature runs again (a rebuild may have stored it in another shard).
            self.sync_catalog()
            return None
        obj = shard_object(name)
        try:
            return self.tier.fetch(
                name,
                size,
                lambda dest: self.bucket.download(obj, dest),
                self.bucket.where(obj),
                evicted,
            )
        except FileNotFoundError:
            return None

    def reads_ranged(self) -> bool:
        """Whether shards not in the tier are read by ranges rather than fetched whole.

        ``$FEATBAKE_BUCKET_READS`` says ``whole`` or ``ranged``; by default (``auto``) ranged
        once the shards the catalog names outweigh the tier's budget: fetching whole shards
        into a tier that cannot keep them downloads each many times over a shuffled epoch. In
        ``auto`` the tier still keeps whole the shards that fit its budget without evicting.
        """
        if self._ranged is None:
            mode = os.environ.get(READS_ENV, "auto")
            if mode not in ("auto", "whole", "ranged"):
                raise ConfigError(f"${READS_ENV} must be auto, whole or ranged, got {mode!r}")
            if mode == "auto":
                self._ranged = sum(catalog_shards(self.layout.catalog).values()) > self.tier.budget
                self._fills_tier = self._ranged
            else:
                self._ranged = mode == "ranged"
        return self._ranged

    def ranged_reader(self, name: str, path: Path, verify: VerifyMode | str) -> ShardReader | None:
        """A reader of shard ``name`` by ranged GETs, or None when it is fetched whole: always
        in ``whole`` mode, and in ``ranged`` mode while the tier has room for it without evicting
        (a tier smaller than the store keeps what fits, so repeated items hit it).

        Raises:
            ShardMissing: the bucket has no such shard (gc deleted it).
        """
        if not self.reads_ranged():
            return None
        size = self._size_of(name)
        if size is not None and self._fills_tier and self.tier.has_room(size):
            return None  # auto: the tier keeps what fits, so repeated reads of it hit the disk
        if size is None:
            self.sync_catalog()  # as fetch_shard: the reader looks the feature up again
            raise ShardMissing(f"shard {name} is gone from {self.url} (deleted by gc)")
        obj = shard_object(name)

        def get(start: int, length: int) -> bytes:
            try:
                return self.bucket.read_range(obj, start, length)
            except FileNotFoundError:
                raise ShardMissing(f"shard {name} is gone from {self.url}") from None

        return RangedShardReader(path, get, size, self.bucket.where(obj), verify)

    def has_shard(self, name: str) -> bool:
        return name in self._listed() or self._size_of(name) is not None

    def opened(self, path: Path) -> None:
        self.tier.touch(path)

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        for name in shards:
            if self._sizes is not None and name in self._sizes:
                continue
            path = self.layout.shard_path(name)
            if not path.is_file():
                if self.bucket.head(shard_object(name)) is not None:
                    continue  # evicted after another process uploaded the same bytes
                raise ShardMissing(
                    f"shard {name} left the local tier before its upload; it is written again"
                )
            self.bucket.upload(shard_object(name), path)  # content-named: same bytes if again
            if self._sizes is not None:
                self._sizes[name] = path.stat().st_size
        self.bucket.upload(f"{FRAGMENTS}{fragment.name}", fragment)
        self._uploaded.update(shards)
        if shards:  # uploaded: a build bigger than this disk must not fill it
            self.tier.trim(uploaded=self._uploaded)

    def tier_usage(self) -> TierUsage:
        return TierUsage(self.local_version(), self.tier.used_bytes(), self.tier.budget)

    def shard_objects(self) -> dict[str, int]:
        listed = {
            name: o.size
            for o in self.bucket.list(SHARDS)
            if is_shard_name(name := Path(o.name).name.removesuffix(".safetensors"))
        }
        self._sizes = dict(listed)
        return listed

    def download_shard(self, name: str, dest: Path) -> None:
        self.bucket.download(shard_object(name), dest)

    def shard_where(self, name: str) -> str:
        return self.bucket.where(shard_object(name))

    # -- catalog versions and fragments ---------------------------------------------------------
    @property
    def version_file(self) -> Path:
        """``<tier>/catalog.version``: which published version the tier's catalog is, and the
        ETag the bucket gave that version's object (JSON)."""
        return self.layout.root / "catalog.version"

    def _pinned(self) -> PinnedVersion | None:
        """The version and ETag the tier's catalog was downloaded as; None when the tier has no
        catalog, or only a number (a tier from before ETags were kept: fetched again)."""
        if not self.layout.catalog.is_file():
            return None
        try:
            raw = json.loads(self.version_file.read_text())
            pinned = PinnedVersion(int(raw["version"]), str(raw["etag"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return pinned if pinned.version > 0 and pinned.etag else None

    def local_version(self) -> int:
        """The version of the tier's ``catalog.sqlite`` (0: none, or none this tier can vouch
        for)."""
        pinned = self._pinned()
        return pinned.version if pinned else 0

    def published_version(self) -> int:
        """The newest version in the bucket (0: none published yet)."""
        return newest(o.name for o in self.bucket.list(PREFIX))

    def sync_catalog(self) -> int:
        """Bring the newest published catalog into the tier (if it is not there); its version.

        The tier's copy is trusted only when it is the bucket's newest version *as the bucket
        holds it*: the same number and the same ETag. A tier whose catalog went missing, or
        one from before the prefix was wiped and rebuilt (same number, other bytes), fetches
        again: every publish starts from the bucket's newest version, so a stale tier can
        never publish over everyone else's work. The tier's ``catalog.sqlite`` is replaced by
        rename: a process reading the older one keeps reading it until it reopens.
        """
        self.layout.ensure()
        self._mark_tier()
        # One download per node: the node's processes (DataLoader workers that all found a
        # shard gone) wait here, and the first one's catalog serves the rest.
        with locked(self.layout.tmp / "catalog.lock"):
            return self._sync_catalog_locked()

    def _sync_catalog_locked(self) -> int:
        newest_obj = newest_object(self.bucket.list(PREFIX))
        if newest_obj is None:
            if self.layout.catalog.exists() or self.version_file.exists():
                self._forget_catalog()  # the bucket was emptied: the tier's is not its catalog
            return 0
        want = PinnedVersion(version_of(newest_obj.name) or 0, newest_obj.etag)
        if self._pinned() == want:
            return want.version
        tmp = self.layout.tmp / f"catalog-v{want.version}.{os.getpid()}.download"
        try:
            try:
                self.bucket.download(newest_obj.name, tmp)
            except FileNotFoundError:
                return self._sync_catalog_locked()  # retired between the listing and the read
            check_catalog_file(tmp, self.bucket.where(newest_obj.name))
            self.install_catalog(tmp, want.version, want.etag)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return want.version

    def _mark_tier(self) -> None:
        """Write ``tier.json`` (the bucket's URL) once: a tier given as ``--cache`` is refused."""
        mark = self.layout.root / "tier.json"
        if not mark.exists():
            tmp = self.layout.tmp / f"tier.json.{os.getpid()}"
            tmp.write_text(json.dumps({"url": str(self.url)}))
            os.replace(tmp, mark)

    def _forget_catalog(self) -> None:
        """Drop the tier's catalog (its shards stay: content-named and checked, they are right
        for whatever store names them)."""
        with contextlib.suppress(OSError):
            self.version_file.unlink()
        self._unlink_catalog_files(("", "-wal", "-shm", "-journal"))

    def _unlink_catalog_files(self, suffixes: tuple[str, ...]) -> None:
        """Remove the tier's ``catalog.sqlite<suffix>`` files that exist."""
        for suffix in suffixes:
            with contextlib.suppress(OSError):
                os.unlink(f"{self.layout.catalog}{suffix}")

    def install_catalog(self, path: Path, version: int, etag: str | None = None) -> None:
        """Make ``path`` the tier's catalog, as published version ``version`` whose object has
        ``etag`` (asked of the bucket when not given: a version this process just published)."""
        if etag is None:
            info = self.bucket.head(version_name(version))
            etag = info.etag if info else ""
        self._unlink_catalog_files(("-wal", "-shm", "-journal"))
        os.replace(path, self.layout.catalog)
        tmp = self.layout.tmp / f"catalog.version.{os.getpid()}"
        tmp.write_text(json.dumps(PinnedVersion(version, etag)._asdict()))
        os.replace(tmp, self.version_file)
        fsync_dir(self.layout.root)

    def sync_fragments(self) -> int:
        """Download the bucket's fragments the tier lacks (other nodes' ranks); how many."""
        here = fragments_dir(self.layout)
        here.mkdir(parents=True, exist_ok=True)
        got = 0
        for o in self.bucket.list(FRAGMENTS):
            name = Path(o.name).name
            final = here / name
            if parse_name(final) is None or final.exists():
                continue
            tmp = self.layout.tmp / f"{name}.{os.getpid()}.download"
            self.bucket.download(o.name, tmp)
            os.replace(tmp, final)
            got += 1
        return got


def catalog_shards(catalog: Path) -> dict[str, int]:
    """The shards a catalog file names, with their bytes (none without the file): what gc,
    verify and the read mode of a bucket store ask of a catalog version.

    Raises:
        StoreCorrupt: it names something that is not a shard name (a damaged or planted
            version): gc then deletes nothing rather than trust the rest of it.
    """
    if not catalog.exists():
        return {}
    conn = open_sqlite(catalog, Access.IMMUTABLE)
    try:
        named = dict(conn.execute("SELECT name, bytes FROM shards"))
    finally:
        conn.close()
    for name in named:
        checked_shard_name(name)
    return named


def check_catalog_file(path: Path, where: str) -> None:
    """Raise unless ``path`` is a readable SQLite catalog (a published version downloaded from
    ``where``).

    Raises:
        StoreCorrupt: it is not: the message names the bucket object and what to do.
    """
    try:
        conn = open_sqlite(path, Access.IMMUTABLE)
        try:
            conn.execute("SELECT count(*) FROM shards").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise StoreCorrupt(
            f"the catalog version {where} is damaged ({e}); delete that object so the version "
            "before it serves again (`featbake verify --cache URL` then lists what it lacks), "
            "and rebuild what went missing"
        ) from None
