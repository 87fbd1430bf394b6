"""The SQLite catalog: an index over the shards (features, shards, encoders, roots, hash cache).

Split by job: ``schema`` (tables, version, migrations), ``rows`` (typed records), ``connection``
(per-thread and per-process connections, read-only opening, the transaction helper),
``features`` (feature rows, hash cache, encoders), ``roots`` (root rows and ``roots/*.json``),
``maintenance`` (what stats, gc and verify need). Three views combine them:

- :class:`Catalog`: everything (builds, gc, verify --repair).
- :class:`ServingCatalog`: reads and additive writes (write-back shards, roots, hashes, last use)
  but no method that deletes a row or a file: what a dataset or ``CachedEncoder`` needs.
- :class:`CatalogReader`: reads only, opened read-only (``mode=ro``): stats, export, inspection.

Example:
    >>> with Catalog(Layout(Path(".featbake")).ensure()) as cat:  # doctest: +SKIP
    ...     cat.locate("3f...")
"""

from __future__ import annotations

from featbake.store.catalog.connection import READ_ONLY_ENV, Access, CatalogConnection, Transaction
from featbake.store.catalog.features import FeatureReads, FeatureWrites
from featbake.store.catalog.maintenance import (
    Maintenance,
    MaintenanceReads,
    OldCatalog,
    read_old_catalog,
)
from featbake.store.catalog.roots import (
    ROOT_FORMAT,
    ROOT_FORMAT_VERSION,
    RootDrops,
    RootReads,
    RootWrites,
    read_root_file,
    root_file,
    root_payload,
    roots_dir,
    tombstone_file,
    write_root_file,
)
from featbake.store.catalog.rows import (
    ENCODER_FP_PREFIX,
    EncoderRow,
    FeatureRef,
    FeatureRow,
    FeatureTotals,
    FileStat,
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    MovedRow,
    Root,
    RootItem,
    ShardFeature,
    ShardRow,
    ShardUsage,
)
from featbake.store.catalog.schema import SCHEMA_VERSION
from featbake.store.layout import Layout


class CatalogReader(MaintenanceReads, RootReads, FeatureReads):
    """A read-only view of a catalog: lookups, roots, hash cache, store-wide reads.

    It is opened with ``mode=ro`` (``immutable=1`` where the directory is not writable), so it
    also reads a store on a read-only mount, and it has no method that writes.
    """

    def __init__(self, layout: Layout, *, timeout: float = 60.0) -> None:
        super().__init__(layout, timeout=timeout, read_only=True)


class ServingCatalog(RootWrites, FeatureWrites, RootReads, FeatureReads):
    """What serving needs: lookups plus additive writes (write-back, roots, hashes, last use).

    No method deletes a feature, a shard, a root or a file; gc and repair use :class:`Catalog`.
    """


class Catalog(Maintenance, RootDrops, ServingCatalog, CatalogReader):
    """A store's ``catalog.sqlite``, every operation (one connection per thread and process).

    Example:
        >>> with Catalog(Layout(Path(".featbake")).ensure()) as cat:  # doctest: +SKIP
        ...     cat.locate("3f...")
    """

    def __init__(
        self,
        layout: Layout,
        *,
        timeout: float = 60.0,
        read_only: bool = False,
        rebuild: bool = False,
    ) -> None:
        CatalogConnection.__init__(
            self, layout, timeout=timeout, read_only=read_only, rebuild=rebuild
        )

    def serving(self) -> ServingCatalog:
        """A view of the same store that cannot delete (for a dataset or CachedEncoder)."""
        return ServingCatalog(self.layout, timeout=self.timeout, read_only=self.read_only)


__all__ = [
    "ENCODER_FP_PREFIX",
    "READ_ONLY_ENV",
    "ROOT_FORMAT",
    "ROOT_FORMAT_VERSION",
    "SCHEMA_VERSION",
    "Access",
    "Catalog",
    "CatalogConnection",
    "CatalogReader",
    "EncoderRow",
    "FeatureRef",
    "FeatureRow",
    "FeatureTotals",
    "FileStat",
    "HashCacheRow",
    "HashEntry",
    "HashRow",
    "Location",
    "MovedRow",
    "OldCatalog",
    "Root",
    "RootItem",
    "ServingCatalog",
    "ShardFeature",
    "ShardRow",
    "ShardUsage",
    "Transaction",
    "read_old_catalog",
    "read_root_file",
    "root_file",
    "root_payload",
    "roots_dir",
    "tombstone_file",
    "write_root_file",
]
