"""Which files the local tier evicts to admit a new one: least recently used first; pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from featbake.errors import ConfigError
from featbake.units import format_bytes


class TierFile(NamedTuple):
    """A file in the local tier: its name, size in bytes, last use (epoch seconds), and whether
    it may be evicted (a download in flight may not)."""

    name: str
    size: int
    used: float
    evictable: bool = True


def evictions(files: Sequence[TierFile], budget: int, incoming: int) -> list[TierFile]:
    """The files to delete, least recently used first, so ``incoming`` more bytes fit ``budget``.

    Raises:
        ConfigError: ``incoming`` cannot fit even with every evictable file gone (a budget
            smaller than a shard, or one filled by downloads in flight).

    Example:
        >>> old, new = TierFile("a", 60, 1.0), TierFile("b", 30, 2.0)
        >>> [f.name for f in evictions([new, old], budget=100, incoming=40)]
        ['a']
    """
    total = sum(f.size for f in files)
    over = total + incoming - budget
    if over <= 0:
        return []
    chosen: list[TierFile] = []
    for f in sorted((f for f in files if f.evictable), key=lambda f: (f.used, f.name)):
        chosen.append(f)
        over -= f.size
        if over <= 0:
            return chosen
    pinned = sum(f.size for f in files if not f.evictable)
    raise ConfigError(
        f"the local cache's budget ({format_bytes(budget)}) cannot hold a "
        f"{format_bytes(incoming)} shard beside {format_bytes(pinned)} being downloaded; "
        "raise local_cache_size (--local-cache-size, $FEATBAKE_LOCAL_CACHE_SIZE) to at least "
        "4x the largest shard, or build with smaller shards (--shard-size)"
    )
