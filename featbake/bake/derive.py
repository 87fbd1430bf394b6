"""A build reuses what the store holds of the same inputs under a recipe it can be derived from.

A store built without ``--output`` holds every part of each input's output (``hidden``,
``pooled``, ...). Building again with ``--output hidden`` used to encode everything once more:
the keys differ, because ``output`` is part of the recipe (it changes what is stored). The part
is the same tensor, though: the same encoder on the same bytes with the same preprocessing,
dtype and precision. Likewise ``--dtype float16``, ``bfloat16``, ``int8`` or ``fp8`` after a
``float32`` build (issue 32 item 3): the stored float32 tensor *is* the encoder's output, so
casting or quantising it gives the bytes a build of that dtype stores, without the encoder.

So before encoding, each missing key is looked up under the recipes it can be derived from
(:func:`source_recipes`, best first), and what the store holds is read, one chunk of keys at a
time, and copied or converted under the new key. Keys do not change, so every existing store
reads as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from featbake.errors import FeatbakeError
from featbake.keys import feature_key
from featbake.recipe import Recipe
from featbake.store.catalog import BuildCatalog, Location
from featbake.store.features import FeatureReader, Parts
from featbake.store.layout import Layout

#: Keys read from the store at once while deriving (features in memory at a time).
CHUNK_KEYS = 256


@dataclass(frozen=True)
class Derivation:
    """How a recipe's feature is made from a stored one.

    Attributes:
        recipe: the stored feature's recipe.
        part: the one part to take (an ``--output`` from a whole output), or None for all.
        convert: the stored feature is float32 and is cast or quantised to the new dtype.
    """

    recipe: Recipe
    part: str | None
    convert: bool


@dataclass(frozen=True)
class StoredSource:
    """A missing key's stored source: the key to read and how to derive from it."""

    key: str
    how: Derivation


def source_recipes(recipe: Recipe) -> list[Derivation]:
    """The recipes a feature of ``recipe`` can be derived from, best first (pure): the same
    dtype's whole output (a copy), then float32 (a conversion), then float32's whole output.

    Example:
        >>> [(d.recipe.dtype, d.part, d.convert) for d in source_recipes(Recipe(dtype="int8"))]
        [('float32', None, True)]
        >>> len(source_recipes(Recipe(output="hidden", dtype="float16"))), source_recipes(Recipe())
        (3, [])
    """
    out = []
    if recipe.output is not None:
        out.append(Derivation(recipe.replace(output=None), recipe.output, False))
    if recipe.dtype != "float32":
        as_f32 = recipe.replace(dtype="float32")
        out.append(Derivation(as_f32, None, True))
        if recipe.output is not None:
            out.append(Derivation(as_f32.replace(output=None), recipe.output, True))
    return out


def derivation_plan(
    layout: Layout,
    recipe: Recipe,
    encoder_fp: str,
    digests: Mapping[str, str],
    catalog: BuildCatalog | None = None,
) -> dict[str, StoredSource]:
    """key -> its stored source, for each key (input digest in ``digests``) the store holds
    under a recipe it derives from, with the part it needs. Empty for a recipe nothing derives
    to; a store that cannot be read gives nothing to reuse. A build that writes fragments (a
    part of a sharded build, any build into a bucket: ``catalog`` a ``FragmentCatalog``) reads
    the catalog read-only: it never writes it (a bucket's is a published version)."""
    ways = source_recipes(recipe)
    if not ways or not digests or not layout.catalog.exists():
        return {}
    plan: dict[str, StoredSource] = {}
    reader = FeatureReader(layout, verify="always", read_only=_fragments(catalog))
    try:
        for how in ways:
            fp = how.recipe.fingerprint()
            left = {k: feature_key(encoder_fp, fp, d) for k, d in digests.items() if k not in plan}
            found = reader.catalog.locate_many(sorted(set(left.values())))
            for key, source in left.items():
                if _holds(found.get(source, []), how.part):
                    plan[key] = StoredSource(source, how)
    except FeatbakeError:
        return {}  # the features are simply encoded
    finally:
        reader.close()
    return plan


def _fragments(catalog: BuildCatalog | None) -> bool:
    """Whether the build writes fragments (its catalog is never opened for writing)."""
    return catalog is not None and catalog.fragmented


def _holds(locations: list[Location], part: str | None) -> bool:
    return bool(locations) and (part is None or any(loc.part == part for loc in locations))


def stored_sources(
    layout: Layout, plan: Mapping[str, StoredSource], catalog: BuildCatalog | None = None
) -> Iterator[tuple[str, StoredSource, Parts | None]]:
    """(key, source, the source's parts as stored, or None when they could not be read) for
    each key of ``plan``, read :data:`CHUNK_KEYS` at a time with their checksums checked."""
    if not plan:
        return
    keys = list(plan)
    reader = FeatureReader(layout, verify="always", read_only=_fragments(catalog))
    try:
        for start in range(0, len(keys), CHUNK_KEYS):
            chunk = keys[start : start + CHUNK_KEYS]
            try:
                found = reader.get_many(sorted({plan[k].key for k in chunk}))
            except FeatbakeError:
                found = {}  # damaged since the plan: these are encoded
            for key in chunk:
                source = plan[key]
                parts = found.get(source.key)
                part = source.how.part
                if parts is not None and part is not None:
                    parts = {"": parts[part]} if part in parts else None
                yield key, source, parts
    finally:
        reader.close()
