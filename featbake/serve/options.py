"""The dataset's options: checked up front, and folded into the recipe that keys its items."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from featbake.errors import ConfigError
from featbake.recipe import Recipe

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
