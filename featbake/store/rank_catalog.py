"""What one rank of a sharded build uses in place of the catalog: read-only reads, fragment writes.

It answers the calls the build pipeline makes on a :class:`Catalog` (hash cache, encoder, root
manifest, present keys, sealed shards), but never writes ``catalog.sqlite``: reads go to a
read-only connection (none at all while the store has no catalog yet, so ranks starting on a
fresh store cannot race to create it), and everything the rank would have written is sealed into
its fragments (store/fragments.py) for ``featbake merge``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence

from featbake.errors import StoreError
from featbake.store.catalog import Catalog, FileStat, HashCacheRow, HashEntry, RootSpec
from featbake.store.fidelity import Measured
from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    ManifestItem,
    build_id,
    fragment_keys,
    sealed_fragments,
    write_fragment,
)
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard


class RankCatalog:
    """A rank's stand-in for the catalog: the same calls, but writes go to its own fragments.

    Args:
        layout: the store.
        rank, world: this rank and the number of ranks.
        listing: (relative path, bytes) of *every* input of the build, in sorted order; every
            rank passes the same one, so they agree on the build id and manifest indices.

    Each sealed shard is recorded in a ``part`` fragment as soon as it is sealed (shard file
    first, fragment second), so a rank killed at any moment, by any signal (SIGKILL included),
    keeps every shard it sealed: its rerun encodes only what no fragment names.

    Example:
        >>> cat = RankCatalog(layout, 1, 4, listing)  # doctest: +SKIP
        >>> cat.replace_root(spec, my_items)  # doctest: +SKIP
        >>> cat.add_shard(sealed); cat.finish()  # doctest: +SKIP
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        world: int,
        listing: Sequence[tuple[str, int]],
    ) -> None:
        self.layout = layout
        self.rank, self.world = rank, world
        self.listing = listing
        self.info: BuildInfo | None = None
        self.fragments: list[str] = []
        self._index = {rel: i for i, (rel, _) in enumerate(listing)}
        self._catalog = Catalog(layout, read_only=True) if layout.catalog.exists() else None
        self._encoder = ("", "")
        self._items: list[ManifestItem] = []
        self._hashes: dict[str, HashCacheRow] = {}
        self._pending: list[SealedShard] = []
        self._fidelity = ""  # what an int8/fp8 rank measured, for its done fragment
        self._lock = threading.Lock()

    # -- reads: the catalog as it is (read-only), plus this build's own sealed fragments ------
    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        out = self._catalog.cached_hashes(paths) if self._catalog else {}
        for p in paths:
            h = self._hashes.get(p)
            entry = h.trusted() if h is not None else None
            if entry is not None:
                out[p] = entry
        return out

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """Keys in the catalog or in a fragment this build already sealed (a rerun's skip)."""
        found = self._catalog.present_keys(keys) if self._catalog else set()
        if self.info is not None:
            bid = self.info.build_id
            mine = [f.path for f in sealed_fragments(self.layout) if f.build_id == bid]
            found |= fragment_keys(mine) & set(keys)
        return found

    # -- writes: buffered, then sealed into fragments ----------------------------------------
    def put_hashes(
        self, rows: Iterable[tuple[str, FileStat, str]], *, recorded_ns: int | None = None
    ) -> None:
        """Hold hash rows for the ``done`` fragment (``recorded_ns``: when the stats were taken)."""
        recorded = time.time_ns() if recorded_ns is None else recorded_ns
        for p, st, sha in rows:
            self._hashes[p] = HashCacheRow.of(p, st, sha, recorded)

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None:
        self._encoder = (label, kind)

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None:
        """Hold this rank's slice of the manifest for its ``done`` fragment (merge publishes)."""
        bid = build_id(spec.name, spec.encoder_fp, spec.recipe_fp, self.world, self.listing)
        self.info = BuildInfo.of(bid, self.rank, self.world, spec, self._encoder[1])
        self._items = [ManifestItem(self._index[p], p, k) for p, k in items]

    def drop_root(self, name: str) -> bool:
        """The build stopped on a config error: publish nothing."""
        self.info = None
        return True

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Called by the writer thread per sealed shard: recorded in a ``part`` fragment now."""
        with self._lock:
            self._pending.append(shard)
            self._seal(FragmentKind.PART)
        return len(shard.entries)

    def flush(self) -> None:
        """Seal what is pending into a ``part`` fragment (the writer thread stopping)."""
        with self._lock:
            if self._pending:
                self._seal(FragmentKind.PART)

    def hold_fidelity(self, measured: Measured, bound: float | None) -> None:
        """Hold what this rank measured of an int8/fp8 build for its ``done`` fragment: the
        merge pools every rank's sums into the root's record (store/fidelity.py)."""
        self._fidelity = json.dumps({"measured": measured.to_json(), "bound": bound})

    def finish(self) -> str | None:
        """Seal the ``done`` fragment: the rest, the manifest slice, the hash rows. Its path."""
        if self.info is None:
            return None
        with self._lock:
            return self._seal(FragmentKind.DONE)

    def _seal(self, kind: FragmentKind) -> str:
        if self.info is None:  # the writer never starts before replace_root
            raise StoreError("a shard was sealed before the build's manifest was known (a bug)")
        done = kind is FragmentKind.DONE
        path = write_fragment(
            self.layout,
            self.info,
            kind,
            self._pending,
            self._items if done else (),
            list(self._hashes.values()) if done else (),
            fidelity=self._fidelity if done else "",
        )
        self._pending = []
        self.fragments.append(path.name)
        return path.name

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
