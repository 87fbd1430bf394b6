"""The dataset's options: checked up front, and folded into the recipe that keys its items."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from featbake.errors import ConfigError, StoreError
from featbake.recipe import Recipe
from featbake.store.layout import Layout
from featbake.store.open import open_store

ON_MISS = ("encode", "error")
VERIFY = ("first", "always", "never")


def check_options(on_miss: str, verify: str, max_open_shards: int) -> None:
    """Raise ConfigError for a serving option outside its choices (a typo never passes)."""
    if on_miss not in ON_MISS:
        raise ConfigError(f"on_miss must be 'encode' or 'error', got {on_miss!r}")
    if verify not in VERIFY:
        raise ConfigError(f"verify must be 'first', 'always' or 'never', got {verify!r}")
    if max_open_shards < 1:
        raise ConfigError(f"max_open_shards must be at least 1, got {max_open_shards}")


def recipe_from(
    recipe: Recipe | None, options: Mapping[str, Any], layers: Sequence[int] | str | None
) -> Recipe:
    """``recipe`` (or the default) with every option that was given (not None) applied."""
    changes = {k: v for k, v in options.items() if v is not None}
    if layers is not None:
        changes["layers"] = tuple(layers) if isinstance(layers, (list, tuple)) else layers
    base = recipe or Recipe()
    return base.replace(**changes) if changes else base


def serving_layout(
    cache: str | os.PathLike[str] | None,
    on_miss: str,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
) -> Layout:
    """The store a dataset serves from; a missing one is an error or (encoding) said once.

    A mistyped ``cache=`` used to create an empty store silently and report every item "not
    in the store" (issue 18 item 6).

    Raises:
        StoreError: ``on_miss="error"`` and there is no store at ``cache``.
    """
    layout = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    if not layout.catalog.exists() and not layout.shards.exists():
        where = layout.remote or layout.root.absolute()
        if on_miss == "error":
            raise StoreError(
                f"there is no featbake store at {where}; check cache= (or $FEATBAKE_CACHE), "
                "or make it with `featbake build --cache` first"
            )
        warnings.warn(
            f"there is no featbake store at {where} yet: creating one, and every item is "
            "encoded live and written back (check cache= if you meant an existing store)",
            stacklevel=3,
        )
    return layout.ensure()
