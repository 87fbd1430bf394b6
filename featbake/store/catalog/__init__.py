"""The SQLite catalog: an index over the shards (features, shards, encoders, roots, hash cache).

Split by job: ``schema`` (tables, version, migrations), ``rows`` (typed records), ``connection``
(per-thread and per-process connections, read-only opening, the transaction helper),
``feature_rows`` (feature rows, hash cache, encoders), ``roots`` (root rows and ``roots/*.json``),
``maintenance`` (what stats, gc and verify need). Each job module has one class over the
connection (``FeatureRows``, ``RootRows``, ``UpkeepRows``); :class:`Catalog` combines the three;
``Catalog(layout, read_only=True)`` opens it ``mode=ro`` (stats, export, inspection, a store on
a read-only mount), where SQLite itself refuses every write.

Example:
    >>> with Catalog(Layout(Path(".featbake")).ensure()) as cat:  # doctest: +SKIP
    ...     cat.locate("3f...")
"""

from __future__ import annotations

from pathlib import Path

from featbake.store.catalog.connection import READ_ONLY_ENV, Access, CatalogConnection, Transaction
from featbake.store.catalog.feature_rows import FeatureRows
from featbake.store.catalog.maintenance import (
    OldCatalog,
    UpkeepRows,
    read_old_catalog,
)
from featbake.store.catalog.roots import (
    ROOT_FORMAT,
    ROOT_FORMAT_VERSION,
    RootRows,
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
    HashCache,
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    MovedRow,
    Root,
    RootItem,
    RootSpec,
    ShardFeature,
    ShardRow,
    ShardUsage,
)
from featbake.store.catalog.schema import SCHEMA_VERSION
from featbake.store.layout import Layout


class Catalog(UpkeepRows, RootRows, FeatureRows):
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
        fragment: Path | None = None,
    ) -> None:
        CatalogConnection.__init__(
            self, layout, timeout=timeout, read_only=read_only, rebuild=rebuild, fragment=fragment
        )


__all__ = [
    "ENCODER_FP_PREFIX",
    "READ_ONLY_ENV",
    "ROOT_FORMAT",
    "ROOT_FORMAT_VERSION",
    "SCHEMA_VERSION",
    "Access",
    "Catalog",
    "CatalogConnection",
    "EncoderRow",
    "FeatureRef",
    "FeatureRow",
    "FeatureTotals",
    "FileStat",
    "HashCache",
    "HashCacheRow",
    "HashEntry",
    "HashRow",
    "Location",
    "MovedRow",
    "OldCatalog",
    "Root",
    "RootItem",
    "RootSpec",
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
