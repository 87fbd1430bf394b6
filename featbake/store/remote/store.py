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
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from featbake.errors import ConfigError, ShardMissing
from featbake.store.fragments import fragments_dir, parse_name
from featbake.store.layout import Layout, fsync_dir
from featbake.store.reader import ShardReader, VerifyMode
from featbake.store.remote.objects import Bucket
from featbake.store.remote.ranged import RangedShardReader
from featbake.store.remote.tier import DiskTier
from featbake.store.remote.url import BucketURL
from featbake.store.remote.versions import PREFIX, newest, version_name

SHARDS = "shards/"
#: ``whole``, ``ranged`` or ``auto``: how shards missing from the tier are read.
READS_ENV = "FEATBAKE_BUCKET_READS"
FRAGMENTS = "fragments/"


def shard_object(name: str) -> str:
    """The object name of shard ``name`` (the local store's relative path)."""
    return f"{SHARDS}{name[:2]}/{name}.safetensors"


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

    def __getstate__(self) -> dict:
        return {"url": self.url, "tier": self.layout.root, "budget": self.tier.budget}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["tier"], state["budget"])  # type: ignore[misc]

    def __str__(self) -> str:
        return str(self.url)

    # -- RemotePlace: shards ---------------------------------------------------------------------
    def _listed(self) -> dict[str, int]:
        """Shard name -> bytes in the bucket, listed once per process (merge's checks)."""
        if self._sizes is None:
            self._sizes = {
                Path(o.name).name.removesuffix(".safetensors"): o.size
                for o in self.bucket.list(SHARDS)
            }
        return self._sizes

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
        into a tier that cannot keep them downloads each many times over a shuffled epoch.
        """
        if self._ranged is None:
            mode = os.environ.get(READS_ENV, "auto")
            if mode not in ("auto", "whole", "ranged"):
                raise ConfigError(f"${READS_ENV} must be auto, whole or ranged, got {mode!r}")
            if mode == "auto":
                self._ranged = sum(catalog_shards(self.layout.catalog).values()) > self.tier.budget
            else:
                self._ranged = mode == "ranged"
        return self._ranged

    def ranged_reader(self, name: str, path: Path, verify: VerifyMode | str) -> ShardReader | None:
        """A reader of shard ``name`` by ranged GETs, or None when shards are fetched whole.

        Raises:
            ShardMissing: the bucket has no such shard (gc deleted it).
        """
        if not self.reads_ranged():
            return None
        size = self._size_of(name)
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
        if shards:
            self.tier.trim()  # uploaded: a build bigger than this disk must not fill it

    # -- catalog versions and fragments ---------------------------------------------------------
    @property
    def version_file(self) -> Path:
        """``<tier>/catalog.version``: which published version the tier's catalog is."""
        return self.layout.root / "catalog.version"

    def local_version(self) -> int:
        """The version of the tier's ``catalog.sqlite`` (0: none)."""
        try:
            return int(self.version_file.read_text())
        except (OSError, ValueError):
            return 0

    def published_version(self) -> int:
        """The newest version in the bucket (0: none published yet)."""
        return newest(o.name for o in self.bucket.list(PREFIX))

    def sync_catalog(self) -> int:
        """Bring the newest published catalog into the tier (if it is not there); its version.

        The tier's ``catalog.sqlite`` is replaced by rename: a process reading the older one
        keeps reading it until it reopens.
        """
        self.layout.ensure()
        newest_v = self.published_version()
        if newest_v < self.local_version():
            self._forget_catalog()  # the bucket was emptied or replaced: the tier's is not its
        if newest_v == 0 or newest_v == self.local_version():
            return newest_v
        tmp = self.layout.tmp / f"catalog-v{newest_v}.{os.getpid()}.download"
        try:
            self.bucket.download(version_name(newest_v), tmp)
            self.install_catalog(tmp, newest_v)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return newest_v

    def _forget_catalog(self) -> None:
        """Drop the tier's catalog (its shards stay: content-named and checked, they are right
        for whatever store names them)."""
        self._unlink_catalog_files(("", "-wal", "-shm", "-journal"))
        with contextlib.suppress(OSError):
            self.version_file.unlink()

    def _unlink_catalog_files(self, suffixes: tuple[str, ...]) -> None:
        """Remove the tier's ``catalog.sqlite<suffix>`` files that exist."""
        for suffix in suffixes:
            with contextlib.suppress(OSError):
                os.unlink(f"{self.layout.catalog}{suffix}")

    def install_catalog(self, path: Path, version: int) -> None:
        """Make ``path`` the tier's catalog, as published version ``version``."""
        self._unlink_catalog_files(("-wal", "-shm", "-journal"))
        os.replace(path, self.layout.catalog)
        tmp = self.layout.tmp / f"catalog.version.{os.getpid()}"
        tmp.write_text(str(version))
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
    verify and the read mode of a bucket store ask of a catalog version."""
    if not catalog.exists():
        return {}
    conn = sqlite3.connect(f"file:{catalog}?immutable=1", uri=True)
    try:
        return dict(conn.execute("SELECT name, bytes FROM shards"))
    finally:
        conn.close()
