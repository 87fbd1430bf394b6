"""Opening a store by its directory: the layout, and the catalog with a clear error.

A store that cannot be written here (a read-only mount, no write permission) opens read-only
(see ``featbake.store.catalog.connection``): every command that only reads works on it.
"""

from __future__ import annotations

import os

from featbake.errors import ConfigError, StoreError
from featbake.store.catalog import Catalog, Root
from featbake.store.fragments import sealed_fragments
from featbake.store.layout import Layout, layout_at

# -- opening a store ---------------------------------------------------------------------------
#: A store as callers name it: its layout, its directory, or None for the default store.
StoreRef = Layout | str | os.PathLike[str] | None


def store_layout(cache: StoreRef) -> Layout:
    """The layout of an existing store (a :class:`Layout` given stays as it is).

    Raises:
        StoreError: there is no store there.
    """
    layout = cache if isinstance(cache, Layout) else layout_at(cache)
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
