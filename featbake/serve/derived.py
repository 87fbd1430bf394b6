"""Misses served from a whole-output root: a part copied, not encoded (issue 32 item 2).

A store built without ``--output`` holds every part of each input's output (``pooled``,
``tokens``, ...). A dataset asking ``Recipe(output="pooled")`` of it used to miss on every item
and encode it again, in silence: ``output`` is part of the key. The part is the same tensor,
though (the same encoder on the same bytes with the same preprocessing and dtype), so a miss
first looks up the input's *whole-output key* and, when the store holds the part there, serves
and writes back a copy of it; ``featbake build --output`` does the same
(:mod:`featbake.bake.derive`). The input's digest comes from the hash cache (its stat
unchanged) or, when that does not say, from hashing the file: its bytes, never its decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from featbake.encode.fingerprints import file_fingerprint
from featbake.errors import FeatbakeError
from featbake.keys import feature_key
from featbake.recipe import Recipe
from featbake.serve.index import Index
from featbake.serve.reads import Reads
from featbake.serve.state import ProcessState
from featbake.store.catalog import FileStat
from featbake.store.catalog.rows import HashEntry
from featbake.store.features import Parts


def whole_output_fingerprint(recipe: Recipe) -> str | None:
    """The fingerprint of ``recipe`` without ``output``; None when nothing can be copied (the
    recipe stores the whole output, or quantises it: an int8 part has scales of its own)."""
    if recipe.output is None or recipe.scheme is not None:
        return None
    return recipe.replace(output=None).fingerprint()


def current_digest(cached: Mapping[str, HashEntry], path: str) -> str | None:
    """The SHA-256 of ``path`` now: from the hash cache while its stat is unchanged, else read
    (None when it cannot be read, or changes while it is)."""
    try:
        now = FileStat.of(path)
        entry = cached.get(path)
        if entry is not None and entry.stat == now:
            return entry.sha256
        sha = file_fingerprint(path)
        return sha if FileStat.of(path) == now else None
    except OSError:
        return None


def copied_parts(
    st: ProcessState,
    reads: Reads,
    index: Index,
    fps: tuple[str, str],
    recipe: Recipe,
    idx: Sequence[int],
) -> dict[int, Parts]:
    """item -> ``{"": part}`` for each of ``idx`` whose part the store holds under its
    whole-output key; ``fps`` is (encoder, recipe) fingerprint. Items whose file changed since
    the dataset was made (its digest no longer gives the item's key) are left to be encoded."""
    whole_fp = whole_output_fingerprint(recipe)
    if whole_fp is None or not idx:
        return {}
    part = str(recipe.output)
    paths = [index.path(i) for i in idx]
    with st.catalogs.scoped() as catalog:
        cached = catalog.cached_hashes(paths)
    out: dict[int, Parts] = {}
    for i, path in zip(idx, paths, strict=True):
        sha = current_digest(cached, path)
        if sha is None or feature_key(fps[0], fps[1], sha) != index.key(i):
            continue
        whole = reads.locate(st, feature_key(fps[0], whole_fp, sha))
        locs = [loc for loc in whole if loc.part == part]
        if not locs:
            continue
        try:
            value = reads.located_value(st, locs)
        except FeatbakeError:
            continue  # gone since, or damaged: encoded like any miss
        out[i] = {"": value[part]}
    return out
