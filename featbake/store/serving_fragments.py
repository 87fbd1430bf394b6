"""What a serving process uses in place of the catalog on a shared filesystem.

On NFS, Lustre, GPFS, CIFS or FUSE (store/filesystem.py) the training processes of many nodes
must not write one SQLite file. A dataset there reads the catalog read-only and seals what it
would have written into ``serve`` fragments of its own (store/fragments.py), which
``featbake merge`` folds in:

- each write-back shard, in a fragment sealed right after the shard (so gc keeps the shard, and
  a process killed later loses nothing it sealed);
- last-use times, one fragment per flush (serve/lastuse.py flushes every 10 minutes there);
- what the dataset learned at its start: hash-cache rows, the encoder, and the root manifest
  when the catalog's differs (so what it writes back is reachable, and kept by gc, once merged).

Reads go to the catalog first, then to the ``serve`` fragments not merged yet, this process's
and other processes' (re-listed at most once a second), so a feature one DataLoader worker or
rank wrote back is read, not encoded again, by the others before any merge. Features of sharded
builds not merged yet stay misses: their fragments can be large, and merge publishes them.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.store.catalog import (
    Catalog,
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    Root,
    RootItem,
    RootSpec,
)
from featbake.store.catalog_api import ServingStore
from featbake.store.filesystem import announce, detect
from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    ManifestItem,
    Use,
    read_fragment,
    sealed_fragments,
    write_fragment,
)
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard

T = TypeVar("T")

#: Other processes' serve fragments are looked for at most this often (a listing per miss would
#: cost a metadata round trip on NFS for every item).
REFRESH_SECONDS = 1.0


def serving_mode(layout: Layout) -> bool:
    """True when ``layout`` is on a shared filesystem or is a bucket's tier, where serving
    writes fragments.

    Says so in one line (a :class:`SharedFilesystemWarning`), once per store per process.

    Raises:
        ConfigError: ``$FEATBAKE_SHARED_FS`` holds something other than 1, 0 or auto.
    """
    if layout.remote is not None:  # a bucket store: its tier's catalog is a published version
        return True
    mode = detect(layout.root)
    if mode.shared:
        announce(
            f"serve:{layout.root}",
            f"the store {layout.root} is on a shared filesystem ({mode.reason}): datasets read "
            "its catalog read-only and record written-back features and last-use times in "
            "fragments/ until `featbake merge` folds them in (SQLite cannot be written safely "
            "from many hosts)",
        )
    return mode.shared


def open_serving_catalog(layout: Layout, *, shared: bool) -> ServingStore:
    """The catalog a dataset reads and adds to: itself, or on a shared filesystem its stand-in."""
    return FragmentServingCatalog(layout) if shared else Catalog(layout)


class FragmentServingCatalog:
    """A serving process's catalog on a shared filesystem: read-only, its writes in fragments.

    It answers the calls serving makes on a :class:`Catalog` (lookups, hash cache, roots, write-
    back shards, last use). Shards and last uses are sealed into a fragment at once; hash rows,
    the encoder and the root manifest wait for the next fragment or :meth:`close`. Like a
    catalog, one object belongs to one thread.

    Example:
        >>> cat = FragmentServingCatalog(layout)  # doctest: +SKIP
        >>> cat.locate_many(keys); cat.add_shard(sealed); cat.close()  # doctest: +SKIP
    """

    def __init__(self, layout: Layout, *, timeout: float = 60.0) -> None:
        self.layout = layout
        self.timeout = timeout
        self.serve_id = f"serve-{uuid.uuid4().hex[:16]}"  # this object's fragments' build id
        self._catalog: Catalog | None = None
        self._found: dict[str, list[Location]] = {}  # key -> its tensors in unmerged fragments
        self._seen: set[str] = set()  # fragment files already read
        self._listed = float("-inf")
        self._hashes: dict[str, HashCacheRow] = {}
        self._encoder: tuple[str, str, str] | None = None  # fp, label, kind
        self._root: tuple[Root, list[ManifestItem]] | None = None
        self._inode = 0  # the catalog file read: a bucket's tier replaces it by rename

    def _replaced(self) -> bool:
        """True if a bucket's tier renamed a newer catalog version over the one read here."""
        return self.layout.remote is not None and _inode(self.layout.catalog) != self._inode

    # -- reads: the catalog as it is (read-only), then unmerged serve fragments ----------------
    def _reader(self) -> Catalog | None:
        """The read-only catalog; None while there is none (a fresh store, before a merge).

        Raises:
            StoreError: the catalog was lost but root manifests remain (run verify --repair).
        """
        if self._catalog is not None and self._replaced():
            self._catalog.close()  # a bucket's tier holds a newer version now: read that one
            self._catalog = None
        if self._catalog is None:
            if not self.layout.catalog.exists():
                self.layout.refuse_fresh_catalog()
                return None
            self._catalog = Catalog(self.layout, timeout=self.timeout, read_only=True)
            self._inode = _inode(self.layout.catalog)
        return self._catalog

    def _read(self, query: Callable[[Catalog], T], default: T) -> T:
        """``query`` on the read-only catalog (``default`` while there is none).

        Raises:
            StoreError: SQLite refused to read it (the message says why and what to do).
        """
        catalog = self._reader()
        if catalog is None:
            return default
        try:
            return query(catalog)
        except sqlite3.DatabaseError as e:
            raise catalog.unreadable(e) from e

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        return self._read(lambda c: c.cached_hashes(paths), {})

    def root(self, name: str) -> Root | None:
        return self._read(lambda c: c.root(name), None)

    def root_items(self, name: str) -> list[RootItem]:
        return self._read(lambda c: c.root_items(name), [])

    def locate_many(self, keys: Sequence[str]) -> dict[str, list[Location]]:
        """key -> its tensors' locations: from the catalog, else from an unmerged fragment."""
        empty: dict[str, list[Location]] = {}
        out = self._read(lambda c: c.locate_many(keys), empty)
        if len(out) < len(set(keys)):
            self.refresh()
            found = self._found
            out.update({k: found[k] for k in keys if k not in out and k in found})
        return out

    def locate(self, key: str) -> list[Location]:
        return self.locate_many([key]).get(key, [])

    def refresh(self) -> None:
        """Read the ``serve`` fragments sealed since the last look (at most once a second)."""
        now = time.monotonic()
        if now - self._listed < REFRESH_SECONDS:
            return
        self._listed = now
        for name in sealed_fragments(self.layout):
            if name.kind is not FragmentKind.SERVE or name.path.name in self._seen:
                continue
            self._seen.add(name.path.name)
            try:
                fragment = read_fragment(name.path, self.layout)
            except StoreCorrupt:
                continue  # merged and removed since the listing (so in the catalog), or damaged
            for shard in fragment.shards:
                self._found_in(shard)

    def _found_in(self, shard: SealedShard) -> None:
        # In (key, part) order, as the catalog returns them; a key in several shards (two
        # processes wrote it) is read from the first seen, as its tensors must share a shard.
        for e in sorted(shard.entries, key=lambda e: (e.key, e.part)):
            locs = self._found.setdefault(e.key, [])
            if not locs or locs[0].shard == shard.name:
                locs.append(Location(e.key, e.part, shard.name, e.dtype, e.shape, e.nbytes))

    # -- writes: sealed into this process's fragments ----------------------------------------
    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Seal a fragment naming a write-back shard; returns its features (new or not).

        Raises:
            ShardMissing: the shard file vanished (gc removed a byte-identical copy): the
                writer seals it again.
            StoreError: the fragment could not be written.
        """
        self._seal([shard])
        if not self.layout.has_shard(shard.name):
            raise ShardMissing(f"shard {shard.name} vanished before its fragment was sealed")
        self._found_in(shard)
        return len(shard.entries)

    def touch(self, keys: Iterable[str], when: float | None = None) -> None:
        """Seal a fragment of last uses (callers batch these, as for the catalog)."""
        when = time.time() if when is None else when
        uses = [Use(k, when) for k in dict.fromkeys(keys)]
        if uses:
            self._seal((), uses)

    def put_hashes(
        self, rows: Iterable[HashRow | tuple], *, recorded_ns: int | None = None
    ) -> None:
        """Hold hash rows for the next fragment; racy ones are dropped (never trusted anyway)."""
        recorded = time.time_ns() if recorded_ns is None else recorded_ns
        for path, stat, sha in map(HashRow._make, rows):
            if not stat.racy(recorded):
                self._hashes[path] = HashCacheRow.of(path, stat, sha, recorded)

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None:
        self._encoder = (fp, label, kind)

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None:
        """Hold a root manifest for the next fragment (merge publishes it, unless a later
        build of that root was published meanwhile)."""
        now = time.time() if now is None else now
        self._root = (
            spec.root(len(items), now, now),
            [ManifestItem(i, p, k) for i, (p, k) in enumerate(items)],
        )

    def close(self) -> None:
        """Seal what is held (a hint: an unwritable store skips it) and close the catalog."""
        with contextlib.suppress(StoreError):
            self._seal()
        if self._catalog is not None:
            self._catalog.close()

    def _seal(self, shards: Sequence[SealedShard] = (), uses: Sequence[Use] = ()) -> None:
        if not (shards or uses or self._hashes or self._encoder or self._root):
            return
        root, items = self._root if self._root is not None else (None, [])
        fp, label, kind = self._encoder or ("", "", "")
        if root is not None:  # kind stays empty unless the encoder was recorded
            fp, label = root.encoder_fp, root.encoder_label
        info = BuildInfo(
            self.serve_id, 0, 1, root.name if root else "", root.data if root else "", label,
            kind, fp, root.recipe_fp if root else "", root.recipe if root else {},
        )  # fmt: skip
        hashes = list(self._hashes.values())
        write_fragment(self.layout, info, FragmentKind.SERVE, shards, items, hashes, uses)
        self._hashes, self._encoder, self._root = {}, None, None


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0
