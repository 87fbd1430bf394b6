"""Reading features by key through the catalog, and the one rule for a shard that vanished.

:func:`relocated` is that rule for every reader of stored features (the dataset,
``CachedEncoder`` and export): gc may have moved a feature since it was looked up, so it is
looked up once more; gone for good is a miss, never an error on a read path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from featbake.errors import ShardMissing
from featbake.store.catalog import Catalog, Location
from featbake.store.handles import ShardHandles
from featbake.store.layout import Layout
from featbake.store.reader import ShardReader, VerifyMode

V = TypeVar("V")

#: One key's stored tensors by output part ("" for a single tensor).
Parts = dict[str, torch.Tensor]


def read_locations(
    locations: Sequence[Location], open_shard: Callable[[str], ShardReader]
) -> dict[str, torch.Tensor]:
    """Each located part, read (and checked as its reader's mode says) by output part.

    ``open_shard`` gives the open reader of a shard named by content.

    Raises:
        ShardMissing: a shard the locations name is gone.
        StoreCorrupt: the bytes fail their checksum (never silent garbage).
    """
    return {loc.part: open_shard(loc.shard).read(loc.tensor) for loc in locations}


def relocated(
    key: str,
    locate: Callable[[str], list[Location]],
    read: Callable[[list[Location]], V],
) -> tuple[list[Location], V] | None:
    """``key`` looked up again and read where the store now puts it; None: a miss.

    The one "a shard vanished" rule of every read, called once a read found its shard gone
    (after dropping its handle): gc may have moved the feature (compaction commits the new
    location before it deletes the old file), so it is looked up once more with ``locate``
    and read with ``read``. A feature gc dropped, or whose shard is gone although the catalog
    still names it (deleted by hand, a partial copy of the store), is a miss, never an error
    on a read path. Corrupt bytes still raise :class:`StoreCorrupt`.
    """
    fresh = locate(key)
    if not fresh:
        return None
    try:
        return fresh, read(fresh)
    except ShardMissing:
        return None


class FeatureReader:
    """Reads stored features of one store; one instance per process (reconnects after fork).

    Example:
        >>> reader = FeatureReader(Layout(Path(".featbake")))  # doctest: +SKIP
        >>> reader.get(key)  # {"": tensor} or {"hidden": ..., "pooled": ...}  # doctest: +SKIP
    """

    def __init__(
        self, layout: Layout, *, max_open: int = 64, verify: VerifyMode | str = VerifyMode.FIRST
    ) -> None:
        self.layout = layout
        self.catalog = Catalog(layout)
        self.handles = ShardHandles(max_open=max_open, verify=verify, remote=layout.remote)

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored for ``key`` by output part, or None if the key is not stored.

        Raises:
            StoreCorrupt: the bytes fail their checksum (never silent garbage).
        """
        return self.get_located(key, self.catalog.locate(key))

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Like :meth:`get` for many keys in one catalog query; absent keys are left out."""
        located = self.catalog.locate_many(keys)
        out = {}
        for key in keys:
            got = self.get_located(key, located.get(key, []))
            if got is not None:
                out[key] = got
        return out

    def get_located(self, key: str, locations: list[Location]) -> dict[str, torch.Tensor] | None:
        """Read ``key`` from looked-up ``locations``; None when the store no longer has it
        (a shard that vanished is followed by :func:`relocated`).

        Raises:
            StoreCorrupt: the bytes fail their checksum.
        """
        if not locations:
            return None
        try:
            return self._read(locations)
        except ShardMissing:
            for loc in locations:
                self.handles.forget(self.layout.shard_path(loc.shard))
        got = relocated(key, self.catalog.locate, self._read)
        return got[1] if got is not None else None

    def _read(self, locations: Sequence[Location]) -> dict[str, torch.Tensor]:
        return read_locations(locations, self._open)

    def _open(self, shard: str) -> ShardReader:
        return self.handles.get(self.layout.shard_path(shard))

    def close(self) -> None:
        self.handles.close()
        self.catalog.close()

    def __getstate__(self) -> dict:
        # Handles and connections never cross a process boundary: the copy opens its own.
        return {
            "layout": self.layout,
            "max_open": self.handles.max_open,
            "verify": self.handles.verify,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layout"], max_open=state["max_open"], verify=state["verify"])  # type: ignore[misc]
