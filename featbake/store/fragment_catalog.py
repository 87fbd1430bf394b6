"""The catalog of a writer that must not write ``catalog.sqlite``: it reads the catalog read-only
and seals everything it would have written into fragments of its own for ``featbake merge``.

- A rank of a sharded build, or any build into a bucket (``part`` given), records each sealed
  shard in a ``part`` fragment (shard file first, fragment second: in a directory at once, into
  a bucket in batches, see below), so a rank killed at any moment, by any signal (SIGKILL
  included), keeps every shard a fragment names: its rerun encodes only what no fragment of its
  build names. :meth:`FragmentCatalog.finish` seals the ``done``
  fragment with its manifest slice (at the whole build's indices), its hash rows and what an
  int8/fp8 rank measured. While the store has no catalog yet reads find nothing, so ranks
  starting on a fresh store never race to create it.
- A dataset or CachedEncoder on a shared filesystem (NFS, Lustre, GPFS, CIFS or FUSE: SQLite
  must not be written from many hosts) or on a bucket's tier (``part`` None) seals each
  write-back shard, and each flush of last uses, into a ``serve`` fragment at once (so gc keeps
  the shard, and a process killed later loses nothing it sealed), with what it learned
  meanwhile: hash rows, the encoder, and the root manifest when the catalog's differs (so what
  it writes back is reachable, and kept by gc, once merged). Its reads go to the catalog, then
  to the ``serve`` fragments not merged yet, this process's and others' (re-listed at most once
  a second), so a feature one DataLoader worker or rank wrote back is read, not encoded again,
  before any merge. Features of sharded builds not merged yet stay misses: merge publishes them.

Into a bucket a rank uploads each shard as it seals it, but the ``part`` fragment naming it
only in batches (:class:`Batching`): when the rows not named yet reach the rows its fragments
already name (so a rank of N shards uploads O(log N) fragments, not N, and each row once), or
when the oldest of them was sealed ``max_age_s`` ago, and always at ``finish``/``close``. A rank
killed meanwhile loses what it sealed since its last fragment (at most as many rows as it had
named, and at most ``max_age_s`` of sealing): its rerun encodes those inputs again, and gc sweeps
their shards, which nothing names, after the bucket's retention. A directory seals each fragment
at once as before: it is a file where it lasts, with nothing to upload.

Each seal writes its fragment with :func:`featbake.store.fragments.write_fragment`, which hands
it to the store's place while it still holds the file (``publish_fragment``: a bucket uploads it
after the shards it names, a directory holds it already); ``featbake merge`` folds it in
(:mod:`featbake.store.merge`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.store.catalog import Catalog, Location, ServingStore
from featbake.store.claims import ClaimFile
from featbake.store.fidelity import Measured
from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    ManifestItem,
    RootRecords,
    Use,
    build_id,
    fragment_keys,
    read_fragment,
    sealed_fragments,
    write_fragment,
)
from featbake.store.hash_cache import HashCacheRow, HashEntry, HashRow
from featbake.store.layout import Layout
from featbake.store.open import place_of
from featbake.store.place import holds_shard
from featbake.store.roots import Root, RootItem, RootSpec, read_held, read_undecodable
from featbake.store.shard import SealedShard

T = TypeVar("T")

#: Other processes' serve fragments are looked for at most this often (a listing per miss would
#: cost a metadata round trip on NFS for every item).
REFRESH_SECONDS = 1.0


def open_serving_catalog(layout: Layout, *, shared: bool | None = None) -> ServingStore:
    """The catalog a dataset or CachedEncoder reads and adds to, from any thread: the catalog
    itself, or where serving writes fragments (``shared``; default: what the store's place
    says, :meth:`~featbake.store.place.Place.serving_mode`) a :class:`FragmentCatalog`.

    Raises:
        ConfigError: ``$FEATBAKE_SHARED_FS`` holds something other than 1, 0 or auto.
    """
    shared = place_of(layout).serving_mode() if shared is None else shared
    return FragmentCatalog(layout) if shared else Catalog(layout)


@dataclass(frozen=True)
class RankPart:
    """The part of a build a :class:`FragmentCatalog` writes: rank ``rank`` of ``world``, and
    (relative path, bytes) of *every* input of the build in sorted order; every rank passes the
    same listing, so they agree on the build id and the manifest's indices."""

    rank: int
    world: int
    listing: Sequence[tuple[str, int]]


@dataclass(frozen=True)
class Batching:
    """When a rank into a bucket uploads its next ``part`` fragment (see the module docstring):
    once the rows not named yet reach ``growth`` times the rows already named, or the oldest of
    them was sealed ``max_age_s`` ago by ``clock`` (a test's own clock: no sleeps)."""

    growth: float = 1.0
    max_age_s: float = 30.0
    clock: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class SealContents:
    """What one seal of a :class:`FragmentCatalog` writes, taken under its lock: ``shards``
    pending (by name), those of them a batched rank uploaded already (``shipped``), ``uses``,
    and what a ``done`` or ``serve`` fragment carries (the held manifest, encoder and hash rows;
    ``carries``), each as it was when taken."""

    info: BuildInfo
    shards: dict[str, SealedShard]
    shipped: frozenset[str]
    uses: tuple[Use, ...]
    spec: RootSpec | None
    items: list[ManifestItem]
    encoder: tuple[str, str, str] | None
    hashes: dict[str, HashCacheRow]
    records: RootRecords
    carries: bool
    replaced: frozenset[str] = frozenset()


class FragmentCatalog:
    """A stand-in for the catalog that reads it read-only and seals its writes into fragments
    (see the module docstring): a build rank's ``part`` and ``done`` fragments, or a serving
    process's ``serve`` fragments.

    It answers the calls a build and serving make on a :class:`Catalog`, with the catalog's own
    signatures. Thread-safe: ``_lock`` guards what it holds and has read, only for moments;
    ``_seal_lock`` makes its seals one at a time, in order. A seal takes what it writes under
    ``_lock`` and writes (and, into a bucket, uploads) its fragment outside it, so a read in
    another thread (a serving loader's read thread) never waits for a seal. Its read-only
    catalog keeps one connection per thread.

    Args:
        layout: the store.
        part: the build rank this writes for; None for a serving process.
        timeout: how long reads wait for a locked catalog (seconds).
        batching: when a rank into a bucket uploads its next ``part`` fragment.

    Example:
        >>> cat = FragmentCatalog(layout, RankPart(1, 4, listing))  # doctest: +SKIP
        >>> cat.replace_root(spec, my_items); cat.add_shard(sealed); cat.finish()  # doctest: +SKIP
        >>> served = FragmentCatalog(layout)  # doctest: +SKIP
        >>> served.locate_many(keys); served.add_shard(sealed); served.close()  # doctest: +SKIP
    """

    fragmented = True

    def __init__(
        self,
        layout: Layout,
        part: RankPart | None = None,
        *,
        timeout: float = 60.0,
        batching: Batching | None = None,
    ):
        self.layout = layout
        self.place = place_of(layout)
        self.part = part
        self.timeout = timeout
        self.serve_id = f"serve-{uuid.uuid4().hex[:16]}"  # a serving process's build id
        self.fragments: list[str] = []  # the names of the fragments sealed
        self._index = {rel: i for i, (rel, _) in enumerate(part.listing)} if part else {}
        self._build = self.serve_id  # a rank's build id, once its manifest is known
        self._catalog: Catalog | None = None
        self._inode = 0  # the catalog file read: a bucket's tier replaces it by rename
        self._found: dict[str, list[Location]] = {}  # key -> its tensors in serve fragments
        self._seen: set[str] = set()  # serve fragments already read
        self._indexed: set[str] = set()  # shards whose tensors ``_found`` holds
        self._listed = float("-inf")
        # Held for the next fragment that carries them (``done`` or ``serve``):
        self._spec: RootSpec | None = None
        self._items: list[ManifestItem] = []
        self._encoder: tuple[str, str, str] | None = None  # fp, label, kind
        self._hashes: dict[str, HashCacheRow] = {}
        self._fidelity = ""  # what an int8/fp8 rank measured
        self._undecodable: dict[str, str] = {}  # key -> reason: inputs this rank could not decode
        self._held: dict[str, dict[str, str]] = {}  # root -> table rows a dataset kept back
        self._pending: dict[str, SealedShard] = {}  # sealed shards no fragment names yet
        self._replacing: set[str] = set()  # keys forgotten, for the next fragment to say so
        # A rank into a bucket: its fragments' batching, the pending shards already uploaded,
        # when the oldest pending one was sealed, and the rows its fragments name so far.
        self.batching = batching or Batching()
        self._batched = part is not None and self.place.defers_fragments()
        self._shipped: set[str] = set()
        self._oldest: float | None = None
        self._named_rows = 0
        # A root's manifest as this process last sealed it (merged or not): what extend_root
        # grows next, beside the catalog's, so a later fragment never publishes it without them.
        self._sealed_roots: dict[str, list[ManifestItem]] = {}
        # A rank's claim on the keys it looks up, until its ``done`` fragment names them; a
        # serving process's on the keys of a root manifest it holds, until the ``serve``
        # fragment carrying it is sealed (a store in a directory: gc there reads it; see
        # store/claims.py).
        self.claim: ClaimFile | None = None
        # A rank into a bucket: the keys it found in the catalog version it read, checked again
        # in the newest before its ``done`` fragment names them (a gc may have published one).
        self._relied: set[str] = set()
        if layout.remote is None:
            owner = self.serve_id if part is None else f"part {part.rank}/{part.world}"
            self.claim = ClaimFile(layout, owner)
        # A serving process's claim is written and let go under this lock, so a seal never
        # lets go of keys another thread claimed for a root it is about to hold.
        self._claim_lock = threading.Lock()
        # Lock order: ``_seal_lock``, then ``_lock``; a seal is never started with ``_lock`` held.
        self._lock = threading.RLock()
        # Re-entrant: a seal that runs code sealing this catalog again on its own thread (a
        # finalizer's flush run by a garbage collection during the write) writes a second
        # fragment naming the same shards (the merge adds a shard once), never waits for itself.
        self._seal_lock = threading.RLock()

    @property
    def kind(self) -> FragmentKind:
        """The kind of fragment a sealed shard goes into (a rank's last one is ``done``)."""
        return FragmentKind.SERVE if self.part is None else FragmentKind.PART

    # -- reads: the catalog as it is (read-only), then fragments not merged yet --------------
    def _replaced(self) -> bool:
        """True if a newer catalog version was renamed over the one read here: only where the
        place's builds publish fragments, as its catalog here is a published version (a
        bucket's tier); a directory's catalog is written in place, not replaced by versions."""
        return self.place.builds_in_fragments() and _inode(self.layout.catalog) != self._inode

    def _reader(self) -> Catalog | None:
        """The read-only catalog; None while there is none (a fresh store, before a merge).

        Raises:
            StoreError: a reader's catalog was lost but root manifests remain (run verify
                --repair).
        """
        with self._lock:
            catalog = self._catalog
            if catalog is not None and self._replaced():
                catalog.close()  # a bucket's tier holds a newer version now: read that one
                self._catalog = None
            if self._catalog is None:
                if not self.layout.catalog.exists():
                    if self.part is None:  # a build's merge makes the catalog, and says so
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
        """The catalog's trusted hash rows of ``paths``, and those held here."""
        none: dict[str, HashEntry] = {}
        out = self._read(lambda c: c.cached_hashes(paths), none)
        for p in paths:
            h = self._hashes.get(p)
            entry = h.trusted() if h is not None else None
            if entry is not None:
                out[p] = entry
        return out

    def hash_rows(self, paths: Sequence[str]) -> dict[str, HashCacheRow]:
        """The catalog's hash rows of ``paths`` as stored, trusted or not, and those held here."""
        none: dict[str, HashCacheRow] = {}
        out = self._read(lambda c: c.hash_rows(paths), none)
        return out | {p: self._hashes[p] for p in paths if p in self._hashes}

    def others_commits(self) -> int | None:
        """The read-only catalog's count of commits by others (None while there is none: a
        caller asks again); a catalog replaced by a newer version reads anew (see
        :meth:`Catalog.others_commits`)."""
        return self._read(lambda c: c.others_commits(), None)

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """Keys in the catalog or in a sealed fragment this process may build on: a rank's, in
        any build's (a part killed before its end, rerun in another number of parts: the merge
        folds every build's shards, so this build's manifest finds them); a serving
        process's, in its own. A rank claims the keys first (store/claims.py): gc keeps what
        it finds until its ``done`` fragment names them."""
        if self.claim is not None and self.part is not None:
            self.claim.cover(keys)
        nothing: set[str] = set()
        found = self._read(lambda c: c.present_keys(keys), nothing)
        if self.part is not None and self.claim is None:
            with self._lock:
                self._relied |= found
        names = sealed_fragments(self.layout)
        if self.part is None:
            sealed = [f.path for f in names if f.build_id == self._build]
        else:
            sealed = [f.path for f in names if f.kind is not FragmentKind.SERVE]
        return found | (fragment_keys(sealed) & set(keys))

    def root(self, name: str) -> Root | None:
        return self._read(lambda c: c.root(name), None)

    def root_items(self, name: str) -> list[RootItem]:
        return self._read(lambda c: c.root_items(name), [])

    def undecodable(self, root: str) -> dict[str, str]:
        """The keys ``root``'s last build could not decode (see store/roots.py)."""
        return read_undecodable(self.layout, root)

    def held(self, root: str) -> dict[str, str]:
        """The table rows of ``root`` kept back: as this process recorded them
        (:meth:`record_held`), else as the catalog version brought them (store/roots.py)."""
        with self._lock:
            mine = self._held.get(root)
        return dict(mine) if mine is not None else read_held(self.layout, root)

    def locate_many(self, keys: Sequence[str]) -> dict[str, list[Location]]:
        """key -> its tensors' locations: from the catalog, else from a serve fragment."""
        empty: dict[str, list[Location]] = {}
        out = self._read(lambda c: c.locate_many(keys), empty)
        if len(out) < len(set(keys)):
            self.refresh()
            with self._lock:  # never a key half added by another thread's add_shard or refresh
                found = self._found
                out.update({k: list(found[k]) for k in keys if k not in out and k in found})
        return out

    def locate(self, key: str) -> list[Location]:
        return self.locate_many([key]).get(key, [])

    def refresh(self) -> None:
        """Read the ``serve`` fragments sealed since the last look (at most once a second)."""
        with self._lock:
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
        # Once per shard: a refresh may read this process's own fragment between its rename
        # and the seal recording it (the seal writes outside the lock).
        if shard.name in self._indexed:
            return
        self._indexed.add(shard.name)
        for e in sorted(shard.entries, key=lambda e: (e.key, e.part)):
            locs = self._found.setdefault(e.key, [])
            if not locs or locs[0].shard == shard.name:
                locs.append(Location(e.key, e.part, shard.name, e.dtype, e.shape, e.nbytes))

    # -- writes: held, then sealed into fragments --------------------------------------------
    def put_hashes(
        self, rows: Iterable[HashRow | tuple], *, recorded_ns: int | None = None
    ) -> None:
        """Hold hash rows (``recorded_ns``: when their stats were taken) for the next fragment
        that carries them. A serving process drops racy ones (never trusted, and not worth a
        fragment of their own); a rank keeps them, as the catalog does."""
        recorded = time.time_ns() if recorded_ns is None else recorded_ns
        with self._lock:
            for path, stat, sha in map(HashRow._make, rows):
                if self.part is not None or not stat.racy(recorded):
                    self._hashes[path] = HashCacheRow.of(path, stat, sha, recorded)

    def record_encoder(self, fp: str, label: str, kind: str, now: float | None = None) -> None:
        with self._lock:
            self._encoder = (fp, label, kind)

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None:
        """Hold a root manifest for the next fragment that carries it: a rank's slice at the
        whole build's indices (its ``done`` fragment), or a dataset's whole manifest (merge
        publishes it unless a later build of that root was published meanwhile).

        A serving process claims the manifest's keys first (store/claims.py), so gc keeps
        those it looks up next and finds stored until the fragment naming them is sealed (a
        dataset publishes its root before it locates its items). A claim that cannot be
        written does not stop serving (a root a dataset publishes is a hint): its lookups run
        unclaimed, so no root is held (not even one held before: it is replaced), and the
        seal leaves out any held until the claim is let go (:meth:`_drop_root_if_claim_lapsed`).
        """
        if self.part is not None or self.claim is None:
            return self._hold_root(spec, items)
        with self._claim_lock:
            try:
                self.claim.cover([k for _, k in items])
            except StoreError:  # nothing keeps what its lookups find: no root of them is held
                with self._lock:  # (a seal's claim check may have run already)
                    self._spec, self._items = None, []
                return None
            self._hold_root(spec, items)
        return None

    def _hold_root(self, spec: RootSpec, items: Sequence[tuple[str, str]]) -> None:
        """Hold ``spec``'s manifest ``items`` (see :meth:`replace_root`)."""
        with self._lock:
            self._spec = spec
            if self.part is None:
                self._items = [ManifestItem(i, p, k) for i, (p, k) in enumerate(items)]
                return
            self._items = [ManifestItem(self._index[p], p, k) for p, k in items]
            world, listing = self.part.world, self.part.listing
            self._build = build_id(spec.name, spec.encoder_fp, spec.recipe_fp, world, listing)

    def extend_root(self, spec: RootSpec, keys: Sequence[str], now: float | None = None) -> int:
        """Hold root ``spec.name`` grown by the ``keys`` it does not name yet (a CachedEncoder's
        write-back), for the next fragment: its items as the catalog (or this process's held
        manifest) has them, with those this process sealed before (not merged yet, or merged
        under a newer manifest), then the new keys. The merge publishes it unless a newer
        manifest of the root was published meanwhile; then keys appended on another host are
        left out of it, which only lets gc free their features (encoded again when next
        needed), never serves one wrong. Returns how many keys were added.
        """
        with self._lock:
            if self._spec is not None and self._spec.name == spec.name:
                held = [(i.path, i.key) for i in self._items]
            else:  # the catalog's items, then those this process sealed that it lacks yet
                held = [(i.path, i.key) for i in self.root_items(spec.name)]
                named = {k for _, k in held}
                sealed = self._sealed_roots.get(spec.name, [])
                held += [(i.path, i.key) for i in sealed if i.key not in named]
            named = {k for _, k in held}
            new = [("", k) for k in dict.fromkeys(keys) if k not in named]
            if new:  # unclaimed: the catalog's root or this process's fragments name them
                self._hold_root(spec, held + new)
            return len(new)

    def drop_root(self, name: str) -> bool:
        """The build stopped on a config error: publish no manifest."""
        with self._lock:
            self._spec, self._items = None, []
        return True

    def forget_keys(self, keys: Sequence[str]) -> int:
        """Void the rows of ``keys`` stored so far (a failed padding check found them inexact;
        they are stored again next): a fragment is sealed now, naming the shards pending and
        saying it replaces ``keys`` (:func:`featbake.store.fragments.replaced_meta`), so the
        merge drops their rows from the catalog, folds none from that fragment or an older
        one, and keeps the rows sealed after. Before, it deleted nothing and relied on the
        merge folding the newest fragment first: rows a published catalog version already held
        (a merge folding this build's fragments while it waited) won, and a padded row pending
        beside its replacement in one fragment was folded or not by its shard's name.
        Returns 0: nothing is deleted here.

        Raises:
            StoreError: the fragment could not be written (nothing is encoded again then).
        """
        if keys:
            with self._lock:
                self._replacing.update(keys)
            self._seal(self.kind)
        return 0

    def record_fidelity(self, root: str, measured: Measured, bound: float | None) -> None:
        """Hold what this rank measured of an int8/fp8 build for its ``done`` fragment: the
        merge pools every rank's sums into the root's record (store/fidelity.py)."""
        self._fidelity = json.dumps({"measured": measured.to_json(), "bound": bound})

    def record_undecodable(self, root: str, failed: dict[str, str]) -> None:
        """Hold the keys this rank could not decode (key -> reason) for its ``done`` fragment: a
        part sees only its own failures, so the merge records their union beside the root
        (store/merge.py), and a dataset leaves them out as a plain build's does."""
        with self._lock:
            self._undecodable = dict(failed)

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Seal a fragment naming a shard just sealed; returns its features (new or not).

        Raises:
            ShardMissing: the shard file vanished (gc removed a byte-identical copy): the
                writer seals it again.
            StoreError: the fragment could not be written (a rank's next seal names it).
        """
        with self._lock:
            self._pending[shard.name] = shard
        if self._batched:
            self._ship(shard)
            if not self._due():
                return len(shard.entries)  # named by a later fragment (module docstring)
        self._seal(self.kind)  # (another thread's seal, waiting too, may name it first)
        if not holds_shard(self.layout, shard.name):
            raise ShardMissing(f"shard {shard.name} vanished before its fragment was sealed")
        return len(shard.entries)

    def _ship(self, shard: SealedShard) -> None:
        """Upload a rank's sealed shard now, its fragment later (a bucket's tier must not fill).

        Raises:
            ShardMissing: the shard left the tier before its upload (the writer rewrites it).
        """
        try:
            self.place.publish_shards([shard.name])
        except ShardMissing:
            with self._lock:
                self._let_go({shard.name: shard})
            raise
        with self._lock:
            self._shipped.add(shard.name)
            if self._oldest is None:
                self._oldest = self.batching.clock()

    def _due(self) -> bool:
        """Whether a rank's pending shards are worth a fragment now (:class:`Batching`)."""
        with self._lock:
            rows = sum(len(s.entries) for s in self._pending.values())
            oldest = self._oldest
        if rows >= self.batching.growth * self._named_rows:
            return True
        return oldest is not None and self.batching.clock() - oldest >= self.batching.max_age_s

    def touch(self, keys: Iterable[str], when: float | None = None) -> None:
        """Seal a fragment of last uses (callers batch these, as for the catalog)."""
        when = time.time() if when is None else when
        uses = [Use(k, when) for k in dict.fromkeys(keys)]
        if uses:
            self._seal(self.kind, uses)

    def flush(self) -> None:
        """Seal what is pending (a rank's writer thread stopping; a serving process's held
        hash rows, encoder and manifest)."""
        self._seal(self.kind)

    def finish(self) -> str | None:
        """Seal a rank's ``done`` fragment: the rest, the manifest slice, the hash rows, what it
        measured and the keys it could not decode. Its name; None when the build published no
        manifest. The rank's claim goes once the fragment names its keys.

        Raises:
            StoreError: the rank's claim lapsed (it was stopped too long: run it again), or the
                fragment could not be written.
        """
        if self.claim is None:
            self._check_still_stored()
            return self._seal(FragmentKind.DONE)
        self.claim.check_held()
        name = self._seal(FragmentKind.DONE)
        self.claim.release()
        return name

    def _check_still_stored(self) -> None:
        """A rank into a bucket (no claim reaches a gc on another node): the keys it found
        stored, looked up again in the newest catalog version before its ``done`` fragment
        names them.

        Raises:
            StoreError: a gc published a version without some of them while the rank ran.
        """
        with self._lock:
            relied = sorted(self._relied)
        if not relied or self.place.sync_catalog() == 0:
            return
        nothing: set[str] = set()
        gone = set(relied) - self._read(lambda c: c.present_keys(relied), nothing)
        if gone:
            raise StoreError(
                f"a gc deleted {len(gone)} stored features this build part reused while it ran "
                "(the store's newest catalog lacks them); run this part again: it encodes them"
            )

    def close(self) -> None:
        """Seal what is held (a hint: an unwritable store skips it) and close the catalog."""
        with contextlib.suppress(StoreError):
            self.flush()
        if self.claim is not None:
            self.claim.release()
        if self._catalog is not None:
            self._catalog.close()

    def _seal(self, kind: FragmentKind, uses: Sequence[Use] = ()) -> str | None:
        """Write the one fragment of ``kind``: the pending shards, ``uses``, and (``done``,
        ``serve``) what is held; None when there is nothing to seal (``done``: no manifest).

        What it writes is taken under ``_lock`` and written outside it, one seal at a time; it
        is let go only once written, so a failed seal leaves it all to the next one, and what
        other threads add meanwhile is the next seal's.
        """
        with self._seal_lock:
            if self.part is None:
                self._drop_root_if_claim_lapsed()
            with self._lock:
                taken = self._take(kind, uses)
            if taken is None:
                return None
            shards = list(taken.shards.values())
            unsent = [s.name for s in shards if s.name not in taken.shipped]
            try:
                # Where the place keeps fragments elsewhere (a bucket): the shards, then the
                # fragment naming them, while the file is held; a directory holds it already.
                # (A batched rank's shards are uploaded already: only the fragment goes now.)
                path = write_fragment(
                    self.layout, taken.info, kind, shards, taken.items,
                    list(taken.hashes.values()), taken.uses, taken.records,
                    publish=lambda p: self.place.publish_fragment(p, unsent),
                    replaced=taken.replaced,
                )  # fmt: skip
            except ShardMissing:  # never named again by every later seal: the writer rewrites it
                gone = {n for n in taken.shards if not holds_shard(self.layout, n)}
                with self._lock:
                    self._let_go({n: taken.shards[n] for n in gone})
                raise
            with self._lock:
                self._sealed(taken, path)
            if taken.spec is not None and self.part is None:
                self._let_go_claim()
            return path.name

    def _drop_root_if_claim_lapsed(self) -> None:
        """A serving process stopped longer than a claim holds (store/claims.py) between its
        lookups and this seal, or whose claim could not be written (the claim, its keys or its
        line in ``claims/index``: its lookups ran unclaimed): a gc may have deleted
        features the held root manifest names, so that root is not published (a root a
        dataset publishes is a hint: serving goes on, its misses encoded as ever) and the
        claim is let go; the shards, last uses and hash rows are sealed as before."""
        if self.claim is None:
            return
        with self._claim_lock:
            try:
                self.claim.check_held()
            except StoreError:
                with self._lock:
                    self._spec, self._items = None, []
                self.claim.release()

    def _let_go_claim(self) -> None:
        """A serving process's claim goes once no root manifest is held: the sealed ``serve``
        fragment names its keys now (gc keeps what sealed fragments name)."""
        if self.claim is None:
            return
        with self._claim_lock, self._lock:
            if self._spec is None:
                self.claim.release()

    def _take(self, kind: FragmentKind, uses: Sequence[Use]) -> SealContents | None:
        """What a seal of ``kind`` writes now (``_lock`` held); None when nothing is to seal."""
        carries = kind is not FragmentKind.PART
        held = carries and bool(self._hashes or self._encoder or self._spec)
        if kind is FragmentKind.DONE and self._spec is None:
            return None  # the build published no manifest: no ``done`` fragment
        if kind is not FragmentKind.DONE and not (self._pending or uses or held or self._replacing):
            return None
        return SealContents(
            info=self._info(),
            shards=dict(self._pending),
            shipped=frozenset(self._shipped),
            uses=tuple(uses),
            spec=self._spec if carries else None,
            items=self._items if carries else [],
            encoder=self._encoder if carries else None,
            hashes=dict(self._hashes) if carries else {},
            records=self._records(kind),
            carries=carries,
            replaced=frozenset(self._replacing),
        )

    def _records(self, kind: FragmentKind) -> RootRecords:
        """What a fragment of ``kind`` records of its root beyond its rows (``_lock`` held): a
        rank's ``done`` fragment, what it measured and could not decode; a ``serve`` one
        carrying a manifest, the rows its dataset kept back (:meth:`record_held`)."""
        if kind is FragmentKind.DONE:
            return RootRecords(self._fidelity, tuple(sorted(self._undecodable.items())))
        if kind is FragmentKind.SERVE and self._spec is not None:
            return RootRecords(held=tuple(sorted(self._held.get(self._spec.name, {}).items())))
        return RootRecords()

    def record_held(self, name: str, rows: Mapping[str, str]) -> None:
        """Record ``rows`` (row -> key as built) as the table rows root ``name`` keeps but a
        dataset does not serve: carried by the ``serve`` fragment that carries the root's
        manifest, and recorded beside the root its merge publishes, so every node's tier
        gets them with the catalog version (:data:`~featbake.store.roots.CARRIED_RECORDS`)."""
        with self._lock:
            self._held[name] = dict(rows)

    def _sealed(self, taken: SealContents, path: Path) -> None:
        """Let go of what the fragment at ``path`` holds (``_lock`` held); what was added or
        replaced since it was taken stays held for the next seal."""
        self._let_go(taken.shards)
        self._replacing -= taken.replaced
        self._shipped -= taken.shards.keys()
        self._named_rows += sum(len(s.entries) for s in taken.shards.values())
        self._oldest = self.batching.clock() if self._pending else None
        self._seen.add(path.name)  # its shards are known here: refresh reads it not again
        if self.part is None:  # read back before any merge (a rank's, by present_keys)
            for shard in taken.shards.values():
                self._found_in(shard)
        if taken.carries and taken.spec is not None:
            self._sealed_roots[taken.spec.name] = taken.items
        if taken.carries:  # sealed once: a fragment stands alone
            self._hashes = {p: r for p, r in self._hashes.items() if taken.hashes.get(p) != r}
            if self._encoder == taken.encoder:
                self._encoder = None
            if self._spec is taken.spec and self._items is taken.items:
                self._spec, self._items = None, []
        self.fragments.append(path.name)

    def _let_go(self, shards: dict[str, SealedShard]) -> None:
        """No longer hold ``shards`` pending (``_lock`` held), unless one was added again since."""
        for name, shard in shards.items():
            if self._pending.get(name) is shard:
                del self._pending[name]

    def _info(self) -> BuildInfo:
        """What the next fragment says of its build (a serving process's: rank 0 of 1)."""
        fp, label, kind = self._encoder or ("", "", "")
        if self.part is None:  # the manifest held, or none: the encoder alone
            spec = self._spec or RootSpec("", "", label, fp, "", {})
            return BuildInfo.of(self._build, 0, 1, spec, kind)
        if self._spec is None:  # the writer never starts before replace_root
            raise StoreError("a shard was sealed before the build's manifest was known (a bug)")
        return BuildInfo.of(self._build, self.part.rank, self.part.world, self._spec, kind)


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0
