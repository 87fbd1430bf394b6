"""FeatureReader: key -> tensors through the catalog, re-resolving once when gc moved a shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from featbake.errors import ShardMissing
from featbake.store.catalog import Catalog, Location
from featbake.store.handles import ShardHandles
from featbake.store.layout import Layout
from featbake.store.reader import VerifyMode


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
        self.handles = ShardHandles(max_open=max_open, verify=verify)

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
        """Read ``key`` from looked-up ``locations``; None when the store no longer has it.

        The one "a shard vanished" rule of every catalog-located read: gc may have moved the
        feature (compaction), so it is looked up once more; a feature gc dropped, or whose shard
        is gone although the catalog still names it (deleted by hand, a partial copy), is a
        miss, never an error on a read path. Corrupt bytes still raise :class:`StoreCorrupt`.
        """
        if not locations:
            return None
        try:
            return self._read(locations)
        except ShardMissing:
            for loc in locations:
                self.handles.forget(self.layout.shard_path(loc.shard))
        try:
            fresh = self.catalog.locate(key)
            return self._read(fresh) if fresh else None
        except ShardMissing:
            return None

    def _read(self, locations: list[Location]) -> dict[str, torch.Tensor]:
        return {
            loc.part: self.handles.get(self.layout.shard_path(loc.shard)).read(loc.tensor)
            for loc in locations
        }

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
