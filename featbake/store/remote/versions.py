"""The names of a bucket store's published catalogs, ``catalog/v<N>.sqlite``; pure.

A catalog in a bucket is never written in place: ``featbake merge`` publishes each new state as
the next version, created only if absent (``If-None-Match: *``), so two merges never both win
and a reader opens the newest *complete* version (an S3 object appears whole or not at all).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol, TypeVar


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
