"""Opening a store by its directory or bucket URL: the layout, and the catalog with a clear error.

A store that cannot be written here (a read-only mount, no write permission) opens read-only
(see ``featbake.store.catalog.connection``): every command that only reads works on it. A
bucket store (``s3://bucket/prefix``) opens as its local tier, with the newest published
catalog brought into it (see :mod:`featbake.store.remote`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from featbake.errors import ConfigError, StoreError
from featbake.store.catalog import Catalog, Root
from featbake.store.fragments import sealed_fragments
from featbake.store.layout import Layout, layout_at
from featbake.store.remote.store import BucketStore
from featbake.store.remote.url import BucketURL, is_url
from featbake.units import parse_bytes

#: The local tier's default budget (litdata's ``max_cache_size`` defaults to 100 GB too).
DEFAULT_LOCAL_CACHE_SIZE = "100GiB"

# -- opening a store ---------------------------------------------------------------------------
#: A store as callers name it: its layout, its directory, or None for the default store.
StoreRef = Layout | str | os.PathLike[str] | None


def store_at(
    cache: StoreRef,
    *,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
) -> Layout:
    """The layout of the store at ``cache``: a directory, or a bucket's local tier.

    Args:
        cache: a directory, ``s3://bucket/prefix``, a :class:`Layout` (kept as it is), or None
            (``$FEATBAKE_CACHE``, else ``./.featbake``).
        local_cache: a bucket store's local tier (default ``$FEATBAKE_LOCAL_CACHE``, else
            ``~/.cache/featbake/buckets``); each endpoint, bucket and prefix gets a folder in it.
        local_cache_size: the most bytes the tier's shards take (default
            ``$FEATBAKE_LOCAL_CACHE_SIZE``, else 100 GiB); least recently used shards go first.

    Raises:
        ConfigError: a URL featbake cannot open, or a size it cannot read.
        StoreError: the bucket cannot be read (no credentials, no bucket, denied access).

    Example:
        >>> store_at("/data/features").root
        PosixPath('/data/features')
    """
    if isinstance(cache, Layout):
        return cache
    where = os.fspath(cache) if cache is not None else os.environ.get("FEATBAKE_CACHE", "")
    if not is_url(where):
        return layout_at(cache)
    url = BucketURL.parse(where)
    base = local_cache or os.environ.get("FEATBAKE_LOCAL_CACHE")
    tier = Path(base) if base else Path.home() / ".cache" / "featbake" / "buckets"
    size = local_cache_size or os.environ.get("FEATBAKE_LOCAL_CACHE_SIZE")
    budget = parse_bytes(size or DEFAULT_LOCAL_CACHE_SIZE)
    store = BucketStore(url, tier / _endpoint_folder() / url.bucket / url.prefix, budget)
    store.sync_catalog()
    return store.layout


def _endpoint_folder() -> str:
    """The tier's folder for this endpoint: two servers with a bucket of one name (a MinIO and
    AWS, a test server) must not share a tier's catalog."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return "aws"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", endpoint.split("://", 1)[-1]).strip("_") or "endpoint"


def bucket_store(url: str) -> BucketStore:
    """The bucket store at ``url`` (its newest catalog version in this node's tier).

    Raises:
        ConfigError: ``url`` is not an ``s3://`` URL.
        StoreError: the bucket cannot be read.
    """
    store = store_at(url).remote
    if not isinstance(store, BucketStore):
        raise ConfigError(f"{url!r} is not a bucket store; write s3://bucket/prefix")
    return store


def describe(layout: Layout) -> str:
    """How messages name a store: its directory, or its bucket URL."""
    return str(layout.remote) if layout.remote is not None else str(layout.root)


def store_layout(cache: StoreRef) -> Layout:
    """The layout of an existing store (a :class:`Layout` given stays as it is).

    Raises:
        StoreError: there is no store there.
    """
    layout = store_at(cache)
    if layout.remote is not None:
        return layout
    if not layout.root.is_dir():
        raise StoreError(
            f"there is no featbake store at {layout.root}; point --cache (or $FEATBAKE_CACHE) at "
            "one, or create it with `featbake build`"
        )
    return layout


def open_catalog(cache: StoreRef) -> tuple[Layout, Catalog]:
    """Layout and catalog of an existing store, without creating a catalog that is missing.

    The catalog is a context manager: ``with open_catalog(cache)[1] as catalog: ...``.

    Raises:
        StoreError: no store, or its catalog is missing or unreadable (the message says to run
            ``featbake verify --repair``).
    """
    layout = existing_catalog_layout(cache)
    catalog = Catalog(layout)
    catalog.conn  # noqa: B018  (open now: a damaged catalog fails here, with its message)
    return layout, catalog


def existing_catalog_layout(cache: StoreRef) -> Layout:
    """The layout of an existing store that has a catalog.

    Raises:
        StoreError: no store, or no catalog.sqlite in it.
    """
    layout = store_layout(cache)
    if not layout.catalog.exists() and sealed_fragments(layout):
        raise StoreError(
            f"the store {layout.root} holds only unmerged build fragments; run `featbake merge` "
            "once every part of the build is done"
        )
    if not layout.catalog.exists() and layout.remote is not None:
        raise StoreError(
            f"the store {describe(layout)} has no published catalog yet; build into it "
            "(`featbake build --cache URL`), or run `featbake merge --cache URL` after a build "
            "in parts"
        )
    if not layout.catalog.exists():
        raise StoreError(
            f"the store {layout.root} has no catalog.sqlite; run `featbake verify --repair` to "
            "rebuild it from the shards and root manifests"
        )
    return layout


def resolve_root(catalog: Catalog, name: str) -> Root:
    """The root called ``name`` or named by a unique prefix of it.

    Raises:
        ConfigError: no root, or several, match.
    """
    roots = catalog.roots()
    exact = [r for r in roots if r.name == name]
    matches = exact or [r for r in roots if r.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(r.name for r in roots) or "none"
    if not matches:
        raise ConfigError(f"no root is named {name!r}; the roots are: {names} (`featbake roots`)")
    raise ConfigError(
        f"{name!r} names several roots ({', '.join(r.name for r in matches)}); give more of it"
    )
