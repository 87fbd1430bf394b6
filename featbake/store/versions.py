"""A bucket store's published catalog versions, ``catalog/v<N>.sqlite``: their names, the newest,
those readers may still hold, and what gc's sweep of a bucket deletes (pure).

Publishing the next version (create-only) is :func:`featbake.store.bucket.publish_next`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from featbake.store.objects import ObjectInfo
from featbake.store.place import Held, Sweep, unnamed_past


# The names of a bucket store's published catalogs, ``catalog/v<N>.sqlite``; pure.
#
# A catalog in a bucket is never written in place: ``featbake merge`` publishes each new state as
# the next version, created only if absent (``If-None-Match: *``), so two merges never both win
# and a reader opens the newest *complete* version (an S3 object appears whole or not at all).
class _Named(Protocol):
    @property
    def name(self) -> str: ...


ObjectLike = TypeVar("ObjectLike", bound=_Named)

PREFIX = "catalog/"
#: Nine digits or more: a store past version 999,999,999 keeps working (``newest`` compares
#: numbers, never names).
_NAME = re.compile(r"^catalog/v(\d{9,18})\.sqlite$")


def version_name(n: int) -> str:
    """The object name of catalog version ``n``.

    Example:
        >>> version_name(12)
        'catalog/v000000012.sqlite'
    """
    return f"{PREFIX}v{n:09d}.sqlite"


def version_of(name: str) -> int | None:
    """The version an object name holds; None for anything else under ``catalog/``."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def newest_object(objects: Iterable[ObjectLike]) -> ObjectLike | None:
    """The object of the highest version among ``objects`` (None: none is published yet)."""
    best: tuple[int, ObjectLike] | None = None
    for o in objects:
        v = version_of(o.name)
        if v is not None and (best is None or v > best[0]):
            best = (v, o)
    return best[1] if best else None


def newest(names: Iterable[str]) -> int:
    """The highest version among ``names`` (0: none is published yet).

    Example:
        >>> newest(["catalog/v000000002.sqlite", "catalog/v000000010.sqlite", "catalog/x"])
        10
    """
    return max((v for v in map(version_of, names) if v is not None), default=0)


def kept_versions(versions: Sequence[ObjectInfo], now: float, retention: float) -> list[int]:
    """The versions readers may still hold: the newest, and each whose successor is younger
    than ``retention`` (a reader that opened a version has had that long to finish its run).

    Example:
        >>> v = [ObjectInfo(f"catalog/v00000000{n}.sqlite", 1, t, "") for n, t in
        ...      [(1, 0.0), (2, 50.0), (3, 90.0)]]
        >>> kept_versions(v, now=100.0, retention=20.0)
        [2, 3]
    """
    numbered = sorted((n, o.modified) for o in versions if (n := version_of(o.name)) is not None)
    kept = []
    for (n, _), successor in zip(numbered, [*numbered[1:], None], strict=True):
        if successor is None or now - successor[1] < retention:
            kept.append(n)
    return kept


#: How long a shard object nothing names is kept whatever ``--retention``: a build into a
#: bucket uploads each shard as it is sealed and names it in a fragment later, in batches (at
#: the next shard once the oldest unnamed one is 30 s old), so a young unnamed shard may be a
#: running build's (``gc --retention 0s`` beside a build deleted half its shards, and the
#: build reported every item stored). The directory's default grace is as long.
UPLOADED_UNNAMED_S = 3600.0


def sweep(
    versions: Sequence[ObjectInfo],
    shards: Iterable[ObjectInfo],
    named_by: Mapping[int, set[str]],
    pending: set[str],
    now: float,
    retention: float,
) -> Sweep:
    """What gc's sweep deletes from a bucket, given the shard names each kept version holds
    (``named_by``, keyed by :func:`kept_versions`) and those pending fragments hold: retired
    versions, and shard objects nothing names once older than ``retention`` and
    :data:`UPLOADED_UNNAMED_S` (:func:`~featbake.store.place.unnamed_past`).

    Example:
        >>> young = ObjectInfo("shards/" + "a" * 64 + ".safetensors", 1, 3000.0, "")
        >>> old = ObjectInfo("shards/" + "b" * 64 + ".safetensors", 1, 0.0, "")
        >>> planned = sweep([], [young, old], {}, set(), now=4000.0, retention=0.0)
        >>> [h.name[7:8] for h in planned.shards], planned.young_shards
        (['b'], 1)
    """
    old = tuple(
        Held(o.name, o.size, o.modified)
        for o in versions
        if (n := version_of(o.name)) is not None and n not in named_by
    )
    named = set(pending).union(*named_by.values())
    held = [Held(o.name, o.size, o.modified, o.etag) for o in shards]
    age = max(retention, UPLOADED_UNNAMED_S)
    doomed, young = unnamed_past(held, _object_shard, named, now, age)
    return Sweep(
        tuple(doomed), (), old, young, age="retention period (an hour at least)", versioned=True
    )


def _object_shard(object_name: str) -> str:
    return object_name.rsplit("/", 1)[-1].removesuffix(".safetensors")
