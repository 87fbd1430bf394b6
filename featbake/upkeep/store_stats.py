"""``featbake stats`` and ``featbake roots``: what a store holds, from its catalog alone."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from featbake.errors import AwaitingMerge
from featbake.store.catalog import (
    Catalog,
    FeatureTotals,
    ShardRow,
    ShardUsage,
    refuse_wrong_kinds,
)
from featbake.store.fidelity import QUANTISED, read_fidelity
from featbake.store.layout import Layout
from featbake.store.open import (
    Need,
    StoreRef,
    commit,
    open_catalog,
    open_store,
    place_of,
    resolve_root,
)
from featbake.store.place import Change
from featbake.store.roots import Root
from featbake.upkeep.files import refuse_while_rebuild_pending
from featbake.upkeep.gc import kept_for_builds


@dataclass(frozen=True)
class EncoderStats:
    """What one encoder fingerprint holds in the store (``tensors``: stored tensors, one per
    feature and part, e.g. per layer; the store's summary counts features)."""

    fp: str
    label: str
    kind: str
    tensors: int
    bytes: int
    shards: int
    first_seen: float
    last_used: float


@dataclass(frozen=True)
class RootStats:
    """One root: (data folder, encoder as named, recipe) and its current manifest."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    items: int
    missing: int
    created: float
    last_used: float
    fidelity: dict[str, Any] | None = None  # int8/fp8: what the build measured (quantize.Fidelity)
    workdir: str = ""  # where the data's relative paths were taken from (Root.workdir)

    @classmethod
    def of(cls, root: Root, missing: int, layout: Layout | None = None) -> RootStats:
        """A root from the catalog with its count of items not stored, and (given the store's
        ``layout``) the fidelity its last quantised build recorded."""
        measured = None
        if layout is not None and root.recipe.get("dtype") in QUANTISED:
            measured = read_fidelity(layout, root.name)
        return cls(
            root.name,
            root.data,
            root.encoder_label,
            root.encoder_fp,
            root.recipe_fp,
            root.recipe,
            root.items,
            missing,
            root.created,
            root.last_used,
            measured.to_json() if measured is not None else None,
            root.workdir,
        )


@dataclass(frozen=True)
class TierStats:
    """A bucket store's local tier here: where, which catalog version, bytes held of budget."""

    path: str
    version: int
    bytes: int
    budget: int

    @classmethod
    def of(cls, layout: Layout) -> TierStats | None:
        """The tier ``layout`` is, or None where the place has none (a directory)."""
        usage = place_of(layout).tier_usage()
        if usage is None:
            return None
        return cls(str(layout.root), usage.version, usage.bytes, usage.budget)


@dataclass(frozen=True)
class StoreStats:
    """A store at a glance; every number comes from the catalog (plus a listing of ``tmp/``,
    and the keys sealed fragments name).

    ``features`` counts stored inputs (keys); ``tensors`` counts what they hold (one per
    part: an encoder storing 3 layers has 3 tensors a feature). ``live`` features are those
    some root's manifest names, or a fragment waiting for a merge (a build in parts, a dataset
    on a shared filesystem); ``dead`` ones are the rest, what gc drops. ``unreferenced_bytes``
    are tensors inside shards that no catalog row names (duplicates, features gc dropped but
    whose shard it has not rewritten yet). ``tmp_files`` counts the leftovers in ``tmp/`` that
    gc's sweep weighs, a folder as one (its bytes those of the files inside).
    """

    path: str
    features: int
    tensors: int
    feature_bytes: int
    live_features: int
    live_bytes: int
    dead_features: int
    dead_bytes: int
    shards: int
    disk_bytes: int
    unreferenced_bytes: int
    tmp_files: int
    tmp_bytes: int
    catalog_bytes: int
    encoders: tuple[EncoderStats, ...]
    roots: tuple[RootStats, ...]
    seconds: float
    tier: TierStats | None = None  # a bucket store's local tier on this node

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``featbake stats --json``)."""
        return asdict(self)


def _catalog_bytes(layout: Layout) -> int:
    return sum(
        p.stat().st_size for p in (layout.catalog, Path(f"{layout.catalog}-wal")) if p.exists()
    )


@dataclass
class _EncoderTally:
    """Running totals of one encoder's shards (rows, bytes, shards, last use)."""

    rows: int = 0
    nbytes: int = 0
    shards: int = 0
    last_used: float = 0.0


def encoder_stats(
    shard_rows: list[ShardRow],
    usage: dict[int, ShardUsage],
    enc_rows: Sequence[tuple[str, str, str, float, float]],
) -> tuple[EncoderStats, ...]:
    """Per-encoder totals over the shards, oldest encoder first (unknown ones included)."""
    tallies: dict[str, _EncoderTally] = {}
    for s in shard_rows:
        t = tallies.setdefault(s.encoder_fp, _EncoderTally())
        u = usage.get(s.id)
        t.shards += 1
        if u is not None:
            t.rows += u.rows
            t.nbytes += u.nbytes
            t.last_used = max(t.last_used, u.last_used)
    known = {fp: (label, kind, first) for fp, label, kind, first, _ in enc_rows}
    out = []
    for fp in sorted(set(tallies) | set(known), key=lambda f: known.get(f, ("", "", 0.0))[2]):
        label, kind, first = known.get(fp, ("(unknown)", "?", 0.0))
        t = tallies.get(fp, _EncoderTally())
        out.append(EncoderStats(fp, label, kind, t.rows, t.nbytes, t.shards, first, t.last_used))
    return tuple(out)


def _in_own_catalog(layout: Layout, fn: Callable[[Catalog], Any], read_only: bool) -> Any:
    # sqlite connections belong to one thread: each query gets its own; SQLite runs them in
    # parallel (the module releases the GIL), which halves the wall time on a large store.
    # Opened as the caller's was (read-only where the disk had no room to open it to write).
    own = Catalog(layout, read_only=read_only)
    try:
        return fn(own)
    finally:
        own.close()


def _with_waiting(totals: FeatureTotals, catalog: Catalog) -> FeatureTotals:
    """``totals`` with the features no root reaches but builds not merged yet will name
    counted live (sealed fragments, and claims of parts still running): gc keeps them for the
    merge that publishes them (gc's own rule, :func:`kept_for_builds`, so "dead" is what gc
    frees)."""
    waiting = kept_for_builds(catalog.layout)
    if not waiting:
        return totals
    held = [r for r in catalog.unreached_features() if r.key in waiting]
    return dataclasses.replace(
        totals,
        live_features=totals.live_features + len({r.key for r in held}),
        live_nbytes=totals.live_nbytes + sum(r.nbytes for r in held),
    )


def stats(cache: StoreRef = None) -> StoreStats:
    """Report what a store holds, from its catalog alone (well under a second per million rows).

    Returns:
        A :class:`StoreStats`.

    Raises:
        StoreError: there is no store, or its catalog is missing or unreadable.

    Example:
        >>> s = stats(".featbake")  # doctest: +SKIP
        >>> s.live_bytes, s.dead_bytes  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    try:
        layout, catalog = open_catalog(cache, reading=True)
    except AwaitingMerge:
        return _awaiting_stats(open_store(cache, need=Need.STORE), t0)
    try:
        return _stats(layout, catalog, t0)
    except (TypeError, ValueError):  # a value of the wrong kind: said in one line if so
        with closing(Catalog(layout, read_only=catalog.read_only)) as again:
            refuse_wrong_kinds(again)
        raise


def _stats(layout: Layout, catalog: Catalog, t0: float) -> StoreStats:
    """:func:`stats` over ``catalog`` (closed here), begun at ``t0``."""
    try:
        refuse_while_rebuild_pending(layout)  # a half-rebuilt catalog: not the store's numbers
        with ThreadPoolExecutor(2) as pool:
            ro = catalog.read_only
            totals_f = pool.submit(_in_own_catalog, layout, lambda c: c.feature_totals(), ro)
            missing_f = pool.submit(_in_own_catalog, layout, lambda c: c.missing_per_root(), ro)
            with catalog.snapshot():  # what is added up across them is of one moment
                usage = catalog.shard_usage()
                shard_rows = catalog.shard_rows()
                enc_rows = catalog.encoder_rows()
                roots = catalog.roots()
            totals, missing = totals_f.result(), missing_f.result()
            totals = _with_waiting(totals, catalog)
    finally:
        catalog.close()
    # What the place's gc sweep weighs, by its own rule (a directory: every file and folder of
    # tmp/; a tier: the folders killed changes and verifies leave, never tmp/fetch).
    tmp = place_of(layout).leftovers()
    rows_bytes = sum(u.nbytes for u in usage.values())
    return StoreStats(
        path=str(place_of(layout)),
        features=totals.features,
        tensors=sum(u.rows for u in usage.values()),
        feature_bytes=totals.nbytes,
        live_features=totals.live_features,
        live_bytes=totals.live_nbytes,
        dead_features=totals.features - totals.live_features,
        dead_bytes=totals.nbytes - totals.live_nbytes,
        shards=len(shard_rows),
        disk_bytes=sum(s.bytes for s in shard_rows),
        unreferenced_bytes=max(0, sum(s.data_bytes for s in shard_rows) - rows_bytes),
        tmp_files=len(tmp),
        tmp_bytes=sum(h.size for h in tmp),
        catalog_bytes=_catalog_bytes(layout),
        encoders=encoder_stats(shard_rows, usage, enc_rows),
        roots=tuple(RootStats.of(r, missing.get(r.name, 0), layout) for r in roots),
        seconds=time.perf_counter() - t0,
        tier=TierStats.of(layout),
    )


def _awaiting_stats(layout: Layout, t0: float) -> StoreStats:
    """:func:`stats` of a store holding only a build in parts waiting for its merge: nothing
    published (no catalog: every count 0), what gc's sweep would weigh in ``tmp/``; the build's
    parts are listed as pending (``featbake stats``)."""
    tmp = place_of(layout).leftovers()
    return StoreStats(
        path=str(place_of(layout)), features=0, tensors=0, feature_bytes=0, live_features=0,
        live_bytes=0, dead_features=0, dead_bytes=0, shards=0, disk_bytes=0,
        unreferenced_bytes=0, tmp_files=len(tmp), tmp_bytes=sum(h.size for h in tmp),
        catalog_bytes=0, encoders=(), roots=(), seconds=time.perf_counter() - t0,
        tier=TierStats.of(layout),
    )  # fmt: skip


def list_roots(cache: StoreRef = None) -> list[RootStats]:
    """Every root with its item and missing counts, most recently built or used first (none
    in a store holding only a build in parts waiting for its merge)."""
    try:
        layout, catalog = open_catalog(cache, reading=True)
    except AwaitingMerge:
        return []
    try:
        missing = catalog.missing_per_root()
        return [RootStats.of(r, missing.get(r.name, 0), layout) for r in catalog.roots()]
    finally:
        catalog.close()


def drop_root(cache: StoreRef, name: str) -> Root:
    """Drop a root (its manifest); its features stay until ``featbake gc`` frees them.

    Example:
        >>> drop_root(".featbake", "r-3f1c")  # doctest: +SKIP
    """
    layout, catalog = open_catalog(cache)  # an existing store with a readable catalog
    catalog.close()
    return commit(layout, lambda work: _dropped(work, name))


def _dropped(layout: Layout, name: str) -> Change[Root]:
    """Drop root ``name`` from ``layout``'s catalog (a bucket's work copy, or a local store)."""
    with Catalog(layout) as cat:
        root = resolve_root(cat, name)
        cat.drop_root(root.name)
        return Change(root, True)
