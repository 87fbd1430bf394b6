"""An ``--output`` build reuses what a whole-output build of the same data already stored.

A store built without ``--output`` holds every part of each input's output (``hidden``,
``pooled``, ...). Building again with ``--output hidden`` used to encode everything once more:
the keys differ, because ``output`` is part of the recipe (it changes what is stored). The part
is the same tensor, though: the same encoder on the same bytes with the same preprocessing,
dtype and precision. So before encoding, each missing key's *whole-output key* (the same
recipe with ``output=None``) is looked up, and a stored part is copied under the new key
instead of running the encoder. Keys do not change, so every existing store reads as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from featbake.errors import FeatbakeError
from featbake.keys import feature_key
from featbake.recipe import Recipe
from featbake.store.features import FeatureReader, Parts
from featbake.store.layout import Layout
from featbake.store.rank_catalog import RankCatalog


def whole_output_keys(
    recipe: Recipe, encoder_fp: str, digests: Mapping[str, str]
) -> dict[str, str]:
    """key -> the key of the same input under the same recipe without ``output`` (pure).

    Empty when the recipe stores the whole output already.

    Example:
        >>> r = Recipe(output="hidden")
        >>> k = feature_key("e" * 64, r.fingerprint(), "d" * 64)
        >>> whole = whole_output_keys(r, "e" * 64, {k: "d" * 64})[k]
        >>> whole == feature_key("e" * 64, Recipe().fingerprint(), "d" * 64)
        True
    """
    if recipe.output is None:
        return {}
    whole_fp = recipe.replace(output=None).fingerprint()
    return {key: feature_key(encoder_fp, whole_fp, d) for key, d in digests.items()}


def reusable_parts(
    layout: Layout,
    recipe: Recipe,
    encoder_fp: str,
    digests: Mapping[str, str],
    catalog: object = None,
) -> dict[str, Parts]:
    """key -> ``{"": tensor}`` for each key (of an ``--output`` recipe) whose whole output's
    part the store holds; empty for a whole-output recipe, and in one part of a sharded build
    (``catalog`` a :class:`RankCatalog`), which never opens the catalog for writing."""
    if isinstance(catalog, RankCatalog) or recipe.output is None:
        return {}
    return stored_parts(layout, whole_output_keys(recipe, encoder_fp, digests), recipe.output)


def stored_parts(layout: Layout, whole: Mapping[str, str], part: str) -> dict[str, Parts]:
    """key -> ``{"": tensor}`` for each key whose whole output's ``part`` the store holds
    (read with its checksum checked); a store that cannot be read gives nothing to reuse."""
    if not whole or not layout.catalog.exists():
        return {}
    reader = FeatureReader(layout, verify="always")
    try:
        found = reader.get_many(sorted(set(whole.values())))
    except FeatbakeError:
        return {}  # the parts are simply encoded
    finally:
        reader.close()
    return {
        key: {"": found[w][part]}  # each part is read into a tensor of its own
        for key, w in whole.items()
        if w in found and part in found[w]
    }
