"""Where a store lasts: the :class:`Place` protocol every caller above the layout goes through.

A store's place is a directory (:class:`featbake.store.open.LocalPlace`) or a bucket seen
through this node's local tier (:class:`featbake.store.bucket.BucketStore`);
:func:`featbake.store.open.place_of` gives a layout's. Builds, merge, datasets and
``CachedEncoder`` ask the place what to do (write fragments or the catalog, sync fragments,
merge, follow a block order, fetch a shard ahead) and never test which place it is; each
place answers with its own behaviour, a directory's mostly a no-op. :class:`RemotePlace` adds
the read path of a place whose shards are fetched into the tier (the shard readers' seam).

Kept apart from :mod:`featbake.store.layout` (a pure path object) so that neither the layout nor
the shard reader imports the other's module for a type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from featbake.store.layout import Change, Layout, Sweep, Swept, TierUsage, VerifyScope
from featbake.store.merge import MergeReport
from featbake.store.shard import ShardReader

T = TypeVar("T")


class Place(Protocol):
    """Where a store lasts, as every caller above the layout sees it (see the module doc):
    upkeep's catalog changes, sweeps and verify scope (one algorithm over either place, see
    ``featbake.store.layout``'s place section), and what builds, merge and serving ask."""

    def commit(self, change: Callable[[Layout], Change[T]]) -> T:
        """Apply a catalog change where the place keeps its catalog."""
        ...

    def settle(self) -> None:
        """Fold into the catalog what readers recorded elsewhere, and bring its newest state here
        (gc plans on it next)."""
        ...

    def rewrites_shards(self) -> bool:
        """Whether gc may rewrite shards here (compaction)."""
        ...

    def plan_sweep(self, now: float, grace: float, retention: float) -> Sweep:
        """What gc's sweep would delete now (:func:`~featbake.store.layout.unnamed_past` with
        the place's age)."""
        ...

    def sweep(self, plan: Sweep, crash: Callable[[str], None]) -> Swept:
        """Delete what ``plan`` names, re-checked where the place allows it; ``crash`` is
        called with the name of each step done (gc's crash points)."""
        ...

    def repair_refusal(self) -> str | None:
        """None where ``verify --repair`` runs here; else the one line that says why not and
        what to do instead."""
        ...

    def verify_scope(self) -> VerifyScope:
        """What verify reads here."""
        ...

    def tier_usage(self) -> TierUsage | None:
        """This node's tier of the place (its catalog version, bytes and budget), or None
        where the place has none (a directory)."""
        ...

    def named_shards(self) -> dict[str, int]:
        """The shards the store's catalog names, with their bytes."""
        ...

    def shard_objects(self) -> dict[str, int]:
        """Every shard the place holds (listed now, not a tier's copies): name -> bytes."""
        ...

    def download_shard(self, name: str, dest: Path) -> None:
        """The place's own bytes of shard ``name`` into file ``dest`` (never a tier's copy).

        Raises:
            FileNotFoundError: the place has no such shard.
        """
        ...

    def shard_where(self, name: str) -> str:
        """How messages name shard ``name`` (the file or object a user would delete)."""
        ...

    def builds_in_fragments(self) -> bool:
        """Whether every build here writes fragments and publishes them itself (a bucket: its
        tier holds a published catalog version, never written in place), rather than writing
        the catalog in place (a directory, one process)."""
        ...

    def sync_fragments(self) -> int:
        """Bring the place's sealed fragments here (a bucket's: other nodes' ranks, so a rerun
        skips what a killed run sealed); how many. A directory holds its own: 0."""
        ...

    def merge(self) -> MergeReport:
        """Fold the finished builds' fragments into the catalog: in place for a directory, as
        the next published version for a bucket."""
        ...

    def serving_mode(self) -> bool:
        """Whether datasets and ``CachedEncoder`` write fragments here rather than the catalog
        (a bucket, or a directory on a shared filesystem: see
        :meth:`featbake.store.open.LocalPlace.serving_mode`)."""
        ...

    def follow_blocks(self, windows: Sequence[Sequence[str]] | None) -> bool:
        """Tell the place the shards each window of a block order reads (None: stop); whether
        it follows them (a bucket fetches windows whole, the next one ahead; a directory has
        nothing to fetch)."""
        ...

    def fetch_ahead(self, name: str) -> bool:
        """Whether shard ``name`` is fetched whole before it can be opened (a bucket not reading
        by ranges); its fetch is then started in the background and the caller does not open
        it now (a hint never waits for a download). A directory: False."""
        ...

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        """Make a sealed fragment last where the place keeps them (a bucket: uploaded after the
        shards it names; a directory holds it already)."""
        ...


@runtime_checkable
class RemotePlace(Place, Protocol):
    """Where a store's shards and fragments last when the store is a bucket
    (:class:`featbake.store.bucket.BucketStore`); the layout is then its local tier."""

    def fetch_shard(self, name: str, evicted: Callable[[], None] | None = None) -> Path | None:
        """Shard ``name`` fetched into the local tier; None when the bucket has none.
        ``evicted`` is called once the tier evicted to make room, before the download."""
        ...

    def has_shard(self, name: str) -> bool:
        """Whether the store holds shard ``name`` (locally or in the bucket)."""
        ...

    def reads_ranged(self) -> bool:
        """Whether shards not in the tier are read by ranges (else fetched whole)."""
        ...

    def ranged_reader(self, name: str, path: Path, verify: str) -> ShardReader | None:
        """A reader of shard ``name`` by ranges, or None when shards are fetched whole."""
        ...

    def opened(self, path: Path) -> None:
        """A reader opened tier file ``path`` (its last use, for eviction)."""
        ...

    def prefetch(self, name: str) -> bool:
        """Start bringing shard ``name`` into the tier without waiting; whether it started."""
        ...

    def tier_usage(self) -> TierUsage:
        """This node's tier of the place: its catalog version and the bytes it holds."""
        ...


def remote_place(layout: Layout) -> RemotePlace | None:
    """The place ``layout`` reads its shards from when they are fetched into it (a bucket the
    layout is the tier of), else None (a directory's shards are read where they are)."""
    remote = layout.remote
    return remote if isinstance(remote, RemotePlace) else None
