"""Which objects of a bucket store gc may delete: pure, over listings and names.

A catalog version is retired once the version after it is older than the retention period: a
reader that opened it has had that long to finish its run. A shard object may go once no kept
version and no pending fragment names it, and it is itself older than the retention period (a
build uploads its shards before the fragment naming them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from featbake.store.remote.objects import ObjectInfo
from featbake.store.remote.versions import version_of

#: How long gc keeps what an older catalog version names (Delta Lake's VACUUM: 7 days).
DEFAULT_RETENTION_S = 7 * 86400.0


@dataclass(frozen=True)
class Sweep:
    """The objects a gc run deletes, and the unnamed shards it keeps for the retention period."""

    versions: tuple[ObjectInfo, ...]
    shards: tuple[ObjectInfo, ...]
    young_shards: int

    @property
    def bytes(self) -> int:
        return sum(o.size for o in (*self.versions, *self.shards))


def kept_versions(versions: Sequence[ObjectInfo], now: float, retention: float) -> list[int]:
    """The versions readers may still hold: the newest, and each whose successor is younger
    than ``retention``.

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


def sweep(
    versions: Sequence[ObjectInfo],
    shards: Iterable[ObjectInfo],
    named_by: Mapping[int, set[str]],
    pending: set[str],
    now: float,
    retention: float,
) -> Sweep:
    """What to delete, given the shard names each kept version holds (``named_by``, keyed by
    :func:`kept_versions`) and those pending fragments hold."""
    keep = set(named_by)
    old = tuple(o for o in versions if (n := version_of(o.name)) is not None and n not in keep)
    named = set(pending).union(*named_by.values()) if named_by else set(pending)
    unnamed = [o for o in shards if _shard_name(o.name) not in named]
    doomed = tuple(o for o in unnamed if now - o.modified >= retention)
    return Sweep(old, doomed, len(unnamed) - len(doomed))


def _shard_name(object_name: str) -> str:
    return object_name.rsplit("/", 1)[-1].removesuffix(".safetensors")
