"""What builds and datasets call on a catalog, as Protocols: the catalog itself, or a stand-in.

Three objects answer these calls: :class:`~featbake.store.catalog.Catalog` (the store's own
``catalog.sqlite``), :class:`~featbake.store.rank_catalog.RankCatalog` (a rank of a sharded
build) and :class:`~featbake.store.serving_fragments.FragmentServingCatalog` (a dataset on a
shared filesystem). The stand-ins read the catalog read-only and seal what they would have
written into fragments, which are catalogs themselves (store/fragments.py). Typing the callers
against these Protocols, not a union of classes, is what lets mypy check that each stand-in
answers every call with the catalog's own signature.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from featbake.store.catalog import HashEntry, HashRow, Location, Root, RootItem, RootSpec
from featbake.store.writer import SealedShard


class CatalogWrites(Protocol):
    """What every writer adds: hash-cache rows, encoders, root manifests and sealed shards."""

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]: ...

    def put_hashes(
        self, rows: Iterable[HashRow | tuple], *, recorded_ns: int | None = None
    ) -> None: ...

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None: ...

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None: ...

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int: ...

    def close(self) -> None: ...


class BuildCatalog(CatalogWrites, Protocol):
    """What the build pipeline calls: also which keys are stored, and dropping its root."""

    def present_keys(self, keys: Sequence[str]) -> set[str]: ...

    def drop_root(self, name: str) -> bool: ...


class ServingStore(CatalogWrites, Protocol):
    """What serving calls: lookups, root manifests and last uses."""

    def root(self, name: str) -> Root | None: ...

    def root_items(self, name: str) -> list[RootItem]: ...

    def locate_many(self, keys: Sequence[str]) -> dict[str, list[Location]]: ...

    def locate(self, key: str) -> list[Location]: ...

    def touch(self, keys: Iterable[str], when: float | None = None) -> None: ...
