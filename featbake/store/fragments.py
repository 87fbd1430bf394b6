"""Catalog fragments: what one rank of a sharded build sealed, in a catalog of its own.

A rank of ``featbake build --shard I/N`` (or under torchrun / a SLURM array) never writes the
shared ``catalog.sqlite``: many writers on one SQLite file is what breaks on NFS and Lustre, and
MosaicML streaming's maintainers refuse concurrent writes to a shared index for the same reason.
Each rank writes its shards, then a *fragment* naming them. A fragment is a catalog: the same
tables, written by the same :class:`Catalog` (opened on the fragment's own file), so a row has
one type and one writer wherever it lives (litdata and streaming likewise write each rank's
index in the global index's own format). Beside the catalog's tables a fragment holds:

```
fragments/<build>.r<rank>-of-<world>.<id>.<kind>.sqlite
    meta      the catalog's schema_version, and the fragment's own: format, format_version,
              kind, created, build id, rank, world, root, data, encoder, recipe; in a
              ``done`` fragment of an int8/fp8 build, ``fidelity``: what the rank measured
              (store/catalog.py's Measured sums and the bound), pooled by the merge
    uses      key, used   (kind "serve" only: last-use times, seconds since the epoch)
```

Its ``shards`` and ``features`` are the shards it sealed; ``roots``/``root_items`` its manifest
(``done``: this rank's slice, at the whole build's indices; ``serve``: a dataset's manifest, when
the catalog's differs); ``hash_cache`` the rows it computed, each with its recording time;
``encoders`` the encoder, when it was loaded.

A fragment is written to ``tmp/``, fsynced and renamed into ``fragments/`` (sealed by rename,
like a shard), and is never changed after: readers open it with ``immutable=1``, which takes
no lock, so it is safe on any filesystem. A rank seals a ``part`` fragment every few shards or
seconds (a rank killed mid-run keeps them: its rerun skips their keys) and a ``done`` fragment at
the end with its manifest slice. ``featbake merge`` (:func:`merge`, below) folds a build's fragments
into the catalog once every rank's ``done`` fragment is there.

A ``serve`` fragment is what a dataset on a shared filesystem would have written to the catalog
(a :class:`FragmentCatalog`): a write-back shard, last-use times, or the hash rows and root
manifest it made at its start. Each stands alone (its own build id, rank 0 of 1) and is merged
as soon as it is sealed. Format 3 made a fragment a catalog; fragments of formats 1 and 2 (tables
of their own) are still read (:func:`read_legacy_body`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple, TypeVar

from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.store.catalog import (
    Access,
    Catalog,
    Location,
    ServingStore,
    ShardFeature,
    columns,
    open_sqlite,
    write_root_rows,
)
from featbake.store.fidelity import Measured, write_fidelity
from featbake.store.hash_cache import HashCacheRow, HashEntry, HashRow
from featbake.store.layout import Layout, announce, detect, fsync_dir
from featbake.store.roots import Root, RootItem, RootSpec, read_undecodable
from featbake.store.shard import SealedShard, ShardEntry


# == fragment_legacy ===============================================================================
# Reading fragments of formats 1 and 2, written before a fragment was a catalog.
#
# They had tables of their own: ``shards(name, bytes, encoder_fp, recipe_fp)``, ``entries(shard,
# key, part, dtype, shape, nbytes)``, ``items(idx, path, key)``, ``hashes(path, size, mtime_ns,
# inode, sha256, ctime_ns, recorded_ns)`` and (format 2) ``uses(key, used)``. A store upgraded
# between a sharded build and its merge still merges them; nothing writes them any more.
class FragmentRows(NamedTuple):
    """What a fragment holds besides its meta, whatever its format."""

    shards: tuple[SealedShard, ...]
    items: tuple[tuple[int, str, str], ...]  # (idx, path, key)
    hashes: tuple[HashCacheRow, ...]
    uses: tuple[tuple[str, float], ...]  # (key, used)


def read_legacy_body(
    conn: sqlite3.Connection, layout: Layout, *, with_entries: bool
) -> FragmentRows:
    """The rows of a format 1 or 2 fragment (``conn`` open on it, read-only)."""
    entries: dict[str, list[ShardEntry]] = {}
    if with_entries:
        for shard, key, part, dtype, shape, nbytes in conn.execute(
            "SELECT shard, key, part, dtype, shape, nbytes FROM entries ORDER BY key, part"
        ):
            entries.setdefault(shard, []).append(
                ShardEntry(key, part, dtype, tuple(json.loads(shape)), nbytes)
            )
    shards = tuple(
        SealedShard(name, layout.shard_path(name), nbytes, efp, rfp, tuple(entries.get(name, ())))
        for name, nbytes, efp, rfp in conn.execute(
            "SELECT name, bytes, encoder_fp, recipe_fp FROM shards ORDER BY name"
        )
    )
    items = tuple(conn.execute("SELECT idx, path, key FROM items ORDER BY idx"))
    hashes = tuple(
        HashCacheRow(path, size, mtime, inode, ctime, sha, recorded)
        for path, size, mtime, inode, sha, ctime, recorded in conn.execute(
            "SELECT path, size, mtime_ns, inode, sha256, ctime_ns, recorded_ns FROM hashes"
        )
    )
    has_uses = conn.execute("SELECT 1 FROM sqlite_master WHERE name='uses'").fetchone()
    uses = tuple(conn.execute("SELECT key, used FROM uses ORDER BY key")) if has_uses else ()
    return FragmentRows(shards, items, hashes, uses)


# == fragments =====================================================================================
FRAGMENT_FORMAT = "featbake-fragment"
FRAGMENT_VERSION = 3  # 3: a catalog (2: tables of its own, and ``uses``; 1: without ``uses``)
SUFFIX = ".sqlite"

#: The one table a fragment has beyond the catalog's: last uses recorded by a serving process,
#: of features that may live in another fragment or in the catalog (merge folds them last).
USES_DDL = "CREATE TABLE IF NOT EXISTS uses (key TEXT PRIMARY KEY, used REAL NOT NULL)"


class FragmentKind(StrEnum):
    """``part``: shards sealed so far; ``done``: the rank finished (carries its manifest slice);
    ``serve``: what a serving process on a shared filesystem wrote (merged on its own)."""

    PART = "part"
    DONE = "done"
    SERVE = "serve"


class ManifestItem(NamedTuple):
    """One input of a root manifest, at its index in the whole build's sorted listing."""

    idx: int
    path: str
    key: str


class Use(NamedTuple):
    """A feature's last use, recorded by a serving process (seconds since the epoch)."""

    key: str
    used: float


@dataclass(frozen=True)
class BuildInfo:
    """What every fragment of one build says about it (the same in each rank's fragments)."""

    build_id: str
    rank: int
    world: int
    root: str
    data: str
    encoder_label: str
    encoder_kind: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict = field(compare=False)

    def to_meta(self) -> dict[str, str]:
        d = {k: str(getattr(self, k)) for k in self.__dataclass_fields__ if k != "recipe"}
        return {**d, "recipe": json.dumps(self.recipe, sort_keys=True)}

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> BuildInfo:
        return cls(
            meta["build_id"],
            int(meta["rank"]),
            int(meta["world"]),
            meta["root"],
            meta["data"],
            meta["encoder_label"],
            meta["encoder_kind"],
            meta["encoder_fp"],
            meta["recipe_fp"],
            json.loads(meta["recipe"]),
        )

    @classmethod
    def of(cls, build: str, rank: int, world: int, spec: RootSpec, encoder_kind: str) -> BuildInfo:
        """The info of rank ``rank`` of ``world`` of build ``build`` of the root ``spec``."""
        return cls(
            build, rank, world, spec.name, spec.data, spec.encoder_label, encoder_kind,
            spec.encoder_fp, spec.recipe_fp, spec.recipe,
        )  # fmt: skip

    @property
    def root_spec(self) -> RootSpec:
        """The root this build publishes."""
        return RootSpec(
            self.root, self.data, self.encoder_label, self.encoder_fp, self.recipe_fp, self.recipe
        )


@dataclass(frozen=True)
class FragmentName:
    """What a sealed fragment's file name says, without opening it."""

    path: Path
    build_id: str
    rank: int
    world: int
    kind: FragmentKind


@dataclass(frozen=True)
class Fragment:
    """A sealed fragment, read whole."""

    path: Path
    info: BuildInfo
    kind: FragmentKind
    created: float
    shards: tuple[SealedShard, ...]
    items: tuple[ManifestItem, ...]
    hashes: tuple[HashCacheRow, ...]
    uses: tuple[Use, ...] = ()
    format_version: int = FRAGMENT_VERSION
    fidelity: str = ""  # JSON: what an int8/fp8 rank measured (its done fragment), or ""


def build_id(root: str, encoder_fp: str, recipe_fp: str, world: int, listing: Iterable) -> str:
    """The id every rank of one build computes alike: root, encoder, recipe, N and the inputs.

    A rank killed and rerun gets the same id (its earlier fragments count); another N, another
    encoder or a changed listing is another build.
    """
    doc = [root, encoder_fp, recipe_fp, world, [list(x) for x in listing]]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fragments_dir(layout: Layout) -> Path:
    """``<store>/fragments``: sealed fragments waiting for ``featbake merge``."""
    return layout.root / "fragments"


def parse_name(path: Path) -> FragmentName | None:
    """The parts of ``<build>.r<rank>-of-<world>.<id>.<kind>.sqlite``; None for other files."""
    parts = path.name.split(".")
    if len(parts) != 5 or "." + parts[4] != SUFFIX or not parts[1].startswith("r"):
        return None
    rank, _, world = parts[1][1:].partition("-of-")
    kinds = {k.value: k for k in FragmentKind}
    if not (rank.isdigit() and world.isdigit() and parts[3] in kinds):
        return None
    return FragmentName(path, parts[0], int(rank), int(world), kinds[parts[3]])


def sealed_fragments(layout: Layout) -> list[FragmentName]:
    """Every sealed fragment in the store, by file name (unsealed ones are still in tmp/)."""
    try:
        files = sorted(fragments_dir(layout).iterdir())
    except FileNotFoundError:
        return []
    return [n for n in map(parse_name, files) if n is not None]


def write_fragment(
    layout: Layout,
    info: BuildInfo,
    kind: FragmentKind,
    shards: Sequence[SealedShard],
    items: Sequence[ManifestItem] = (),
    hashes: Sequence[HashCacheRow] = (),
    uses: Sequence[Use] = (),
    fidelity: str = "",
) -> Path:
    """Write a fragment to tmp/, fsync it and rename it into fragments/ (which seals it).

    Raises:
        ShardMissing: a shard's file vanished before it was named (the writer writes it again).
        StoreError: the store is not writable.
    """
    final = fragments_dir(layout) / (
        f"{info.build_id}.r{info.rank:05d}-of-{info.world:05d}.{uuid.uuid4().hex[:12]}."
        f"{kind.value}{SUFFIX}"
    )
    tmp = layout.tmp / f"fragment-{uuid.uuid4().hex}.part"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        layout.tmp.mkdir(parents=True, exist_ok=True)
        extra = {"kind": kind.value, **({"fidelity": fidelity} if fidelity else {})}
        _fill(layout, tmp, info, extra, shards, items, hashes, uses)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, ShardMissing) or not isinstance(e, OSError | sqlite3.Error | StoreError):
            raise
        raise StoreError(
            f"could not write the catalog fragment {final}: {e}; check that the cache directory "
            "is writable and has space"
        ) from e
    if layout.remote is not None:  # a bucket store: the shards, then the fragment naming them
        layout.remote.publish_fragment(final, [s.name for s in shards])
    return final


def _fill(
    layout: Layout,
    path: Path,
    info: BuildInfo,
    extra: dict[str, str],
    shards: Sequence[SealedShard],
    items: Sequence[ManifestItem],
    hashes: Sequence[HashCacheRow],
    uses: Sequence[Use],
) -> None:
    """Write the fragment's rows with the catalog's own writers (one file nobody sees yet);
    ``extra``: meta rows beyond the build's (its kind, an int8/fp8 rank's fidelity)."""
    created = time.time()
    meta = {
        "format": FRAGMENT_FORMAT,
        "format_version": str(FRAGMENT_VERSION),
        "created": repr(created),
        **info.to_meta(),
        **extra,
    }
    with Catalog(layout, fragment=path) as cat:
        with cat.transaction() as c:
            c.executemany("INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", meta.items())
            c.execute(USES_DDL)
            c.executemany("INSERT OR REPLACE INTO uses(key, used) VALUES (?, ?)", uses)
            if items:
                root = info.root_spec.root(len(items), created, created)
                pairs = [(i.path, i.key) for i in items]
                write_root_rows(c, root, pairs, indices=[i.idx for i in items])
        if info.encoder_kind:  # the encoder was loaded (a dataset may only know its fp)
            cat.put_encoder_row(
                info.encoder_fp, info.encoder_label, info.encoder_kind, created, created
            )
        for shard in shards:
            cat.add_shard(shard, now=created)
        cat.put_hash_rows(hashes)


T = TypeVar("T")


def _open_sealed(path: Path) -> sqlite3.Connection:
    # immutable=1: the file never changes once sealed, so SQLite takes no lock (safe on NFS).
    return open_sqlite(path, Access.IMMUTABLE)


def _read_sealed(path: Path, read: Callable[[sqlite3.Connection], T]) -> T | None:
    """``read`` over sealed fragment ``path``, or None where it cannot be: gone (merged and
    removed since the listing: what it held is in the catalog now) or unreadable (the merge
    names it); the connection closed either way."""
    try:
        conn = _open_sealed(path)
    except sqlite3.Error:
        return None
    try:
        return read(conn)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def read_fragment(path: Path, layout: Layout, *, with_entries: bool = True) -> Fragment:
    """Read a sealed fragment whole (``with_entries=False``: shard rows without their tensors).

    Raises:
        StoreCorrupt: not a readable featbake fragment (move it aside; rerun that rank).
    """
    try:
        with Catalog(layout, fragment=path, read_only=True) as cat:
            meta = dict(cat.conn.execute("SELECT name, value FROM meta").fetchall())
            if meta.get("format") != FRAGMENT_FORMAT:
                raise ValueError("not a featbake fragment")
            if int(meta["format_version"]) < 3:
                body = read_legacy_body(cat.conn, layout, with_entries=with_entries)
            else:
                body = _read_body(cat, layout, with_entries=with_entries)
        kind = FragmentKind(meta["kind"])
        info = BuildInfo.from_meta(meta)
        items = tuple(ManifestItem(*r) for r in body.items)
        uses = tuple(Use(*r) for r in body.uses)
        created, version = float(meta["created"]), int(meta["format_version"])
        fidelity = meta.get("fidelity", "")
        return Fragment(
            path, info, kind, created, body.shards, items, body.hashes, uses, version, fidelity
        )
    except (sqlite3.Error, StoreError, ValueError, KeyError) as e:
        raise StoreCorrupt(
            f"catalog fragment {path} is unreadable ({e}); move it aside and rerun that rank "
            "(`featbake build --shard I/N`): its shards are then written again"
        ) from e


def _read_body(cat: Catalog, layout: Layout, *, with_entries: bool) -> FragmentRows:
    """A format 3 fragment's rows, read with the catalog's own queries."""
    shapes: dict[str, tuple[int, ...]] = {}  # many tensors share a shape: parse each once

    def entry(f: ShardFeature) -> ShardEntry:
        shape = shapes.get(f.shape) or shapes.setdefault(f.shape, tuple(json.loads(f.shape)))
        return ShardEntry(f.key, f.part, f.dtype, shape, f.nbytes)

    shards = tuple(
        SealedShard(
            row.name,
            layout.shard_path(row.name),
            row.bytes,
            row.encoder_fp,
            row.recipe_fp,
            tuple(map(entry, cat.features_of_shard(row.id))) if with_entries else (),
        )
        for row in cat.shard_rows()
    )
    conn = cat.conn
    items = tuple(conn.execute("SELECT idx, path, key FROM root_items ORDER BY idx"))
    hashes = tuple(
        HashCacheRow._make(r)
        for r in conn.execute(f"SELECT {columns(HashCacheRow)} FROM hash_cache ORDER BY path")
    )
    uses = tuple(conn.execute("SELECT key, used FROM uses ORDER BY key"))
    return FragmentRows(shards, items, hashes, uses)


def _keys_of(conn: sqlite3.Connection) -> list[str]:
    """The keys a sealed fragment stores tensors of (any format)."""
    has = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    table = "features" if "features" in has else "entries"  # format 3, or formats 1 and 2
    return [r[0] for r in conn.execute(f"SELECT DISTINCT key FROM {table}")]


def fragment_keys(paths: Iterable[Path]) -> set[str]:
    """The keys with a stored tensor in these sealed fragments."""
    keys: set[str] = set()
    for path in paths:  # one not read: its keys are in the catalog, or simply encoded again
        keys.update(_read_sealed(path, _keys_of) or ())
    return keys


def fragment_shard_names(layout: Layout) -> set[str]:
    """Shards named by sealed fragments: not yet in the catalog, yet not garbage (for gc)."""
    names: set[str] = set()
    for frag in sealed_fragments(layout):  # one merged since the listing: in the catalog now
        names.update(_read_sealed(frag.path, _shard_names) or ())
    return names


def _shard_names(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM shards")]


# == fragment_catalog ==============================================================================
# The catalog of a writer that must not write ``catalog.sqlite``: it reads the catalog read-only
# and seals everything it would have written into fragments of its own for ``featbake merge``.
#
# - A rank of a sharded build, or any build into a bucket (``part`` given), records each sealed
#   shard in a ``part`` fragment at once (shard file first, fragment second), so a rank killed at
#   any moment, by any signal (SIGKILL included), keeps every shard it sealed: its rerun encodes
#   only what no fragment of its build names. :meth:`FragmentCatalog.finish` seals the ``done``
#   fragment with its manifest slice (at the whole build's indices), its hash rows and what an
#   int8/fp8 rank measured. While the store has no catalog yet reads find nothing, so ranks
#   starting on a fresh store never race to create it.
# - A dataset or CachedEncoder on a shared filesystem (NFS, Lustre, GPFS, CIFS or FUSE: SQLite
#   must not be written from many hosts) or on a bucket's tier (``part`` None) seals each
#   write-back shard, and each flush of last uses, into a ``serve`` fragment at once (so gc keeps
#   the shard, and a process killed later loses nothing it sealed), with what it learned
#   meanwhile: hash rows, the encoder, and the root manifest when the catalog's differs (so what
#   it writes back is reachable, and kept by gc, once merged). Its reads go to the catalog, then
#   to the ``serve`` fragments not merged yet, this process's and others' (re-listed at most once
#   a second), so a feature one DataLoader worker or rank wrote back is read, not encoded again,
#   before any merge. Features of sharded builds not merged yet stay misses: merge publishes them.

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
    if layout.remote is not None:  # a bucket's tier: its catalog is a published version
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


def open_serving_catalog(layout: Layout, *, shared: bool | None = None) -> ServingStore:
    """The catalog a dataset or CachedEncoder reads and adds to, from any thread: the catalog
    itself, or where serving writes fragments (``shared``; default :func:`serving_mode`) a
    :class:`FragmentCatalog`."""
    shared = serving_mode(layout) if shared is None else shared
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
class SealContents:
    """What one seal of a :class:`FragmentCatalog` writes, taken under its lock: ``shards``
    pending (by name), ``uses``, and what a ``done`` or ``serve`` fragment carries (the held
    manifest, encoder and hash rows; ``carries``), each as it was when taken."""

    info: BuildInfo
    shards: dict[str, SealedShard]
    uses: tuple[Use, ...]
    spec: RootSpec | None
    items: list[ManifestItem]
    encoder: tuple[str, str, str] | None
    hashes: dict[str, HashCacheRow]
    fidelity: str
    carries: bool


class FragmentCatalog:
    """A stand-in for the catalog that reads it read-only and seals its writes into fragments
    (see the section comment): a build rank's ``part`` and ``done`` fragments, or a serving
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

    Example:
        >>> cat = FragmentCatalog(layout, RankPart(1, 4, listing))  # doctest: +SKIP
        >>> cat.replace_root(spec, my_items); cat.add_shard(sealed); cat.finish()  # doctest: +SKIP
        >>> served = FragmentCatalog(layout)  # doctest: +SKIP
        >>> served.locate_many(keys); served.add_shard(sealed); served.close()  # doctest: +SKIP
    """

    fragmented = True

    def __init__(self, layout: Layout, part: RankPart | None = None, *, timeout: float = 60.0):
        self.layout = layout
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
        self._pending: dict[str, SealedShard] = {}  # sealed shards no fragment names yet
        # A root's manifest as this process last sealed it (merged or not): what extend_root
        # grows next, beside the catalog's, so a later fragment never publishes it without them.
        self._sealed_roots: dict[str, list[ManifestItem]] = {}
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
        """True if a bucket's tier renamed a newer catalog version over the one read here."""
        return self.layout.remote is not None and _inode(self.layout.catalog) != self._inode

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

    def present_keys(self, keys: Sequence[str]) -> set[str]:
        """Keys in the catalog or in a sealed fragment this process may build on: a rank's, in
        any build's (a part killed before its end, rerun in another number of parts: the merge
        folds every build's shards, so this build's manifest finds them); a serving
        process's, in its own."""
        nothing: set[str] = set()
        found = self._read(lambda c: c.present_keys(keys), nothing)
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
        """The keys ``root``'s last build could not decode (see store/catalog.py)."""
        return read_undecodable(self.layout, root)

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
        publishes it unless a later build of that root was published meanwhile)."""
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
            if new:
                self.replace_root(spec, held + new, now)
            return len(new)

    def drop_root(self, name: str) -> bool:
        """The build stopped on a config error: publish no manifest."""
        with self._lock:
            self._spec, self._items = None, []
        return True

    def forget_keys(self, keys: Sequence[str]) -> int:
        """Nothing to delete: a build's rows replace earlier ones at its merge, which folds a
        build's newest fragments first (features encoded again after a failed padding check
        win over the padded ones sealed before). Returns 0."""
        return 0

    def record_fidelity(self, root: str, measured: Measured, bound: float | None) -> None:
        """Hold what this rank measured of an int8/fp8 build for its ``done`` fragment: the
        merge pools every rank's sums into the root's record (store/catalog.py)."""
        self._fidelity = json.dumps({"measured": measured.to_json(), "bound": bound})

    def record_undecodable(self, root: str, failed: dict[str, str]) -> None:
        """Nothing: a part sees only its own failures, so a build through fragments (in parts,
        or into a bucket store) records none; its datasets call those inputs misses, as before."""

    def add_shard(self, shard: SealedShard, now: float | None = None) -> int:
        """Seal a fragment naming a shard just sealed; returns its features (new or not).

        Raises:
            ShardMissing: the shard file vanished (gc removed a byte-identical copy): the
                writer seals it again.
            StoreError: the fragment could not be written (a rank's next seal names it).
        """
        with self._lock:
            self._pending[shard.name] = shard
        self._seal(self.kind)  # (another thread's seal, waiting too, may name it first)
        if not self.layout.has_shard(shard.name):
            raise ShardMissing(f"shard {shard.name} vanished before its fragment was sealed")
        return len(shard.entries)

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
        """Seal a rank's ``done`` fragment: the rest, the manifest slice, the hash rows and what
        it measured. Its name; None when the build published no manifest."""
        return self._seal(FragmentKind.DONE)

    def close(self) -> None:
        """Seal what is held (a hint: an unwritable store skips it) and close the catalog."""
        with contextlib.suppress(StoreError):
            self.flush()
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
            with self._lock:
                taken = self._take(kind, uses)
            if taken is None:
                return None
            try:
                path = write_fragment(
                    self.layout, taken.info, kind, list(taken.shards.values()), taken.items,
                    list(taken.hashes.values()), taken.uses, taken.fidelity,
                )  # fmt: skip
            except ShardMissing:  # never named again by every later seal: the writer rewrites it
                gone = {n for n in taken.shards if not self.layout.has_shard(n)}
                with self._lock:
                    self._let_go({n: taken.shards[n] for n in gone})
                raise
            with self._lock:
                self._sealed(taken, path)
            return path.name

    def _take(self, kind: FragmentKind, uses: Sequence[Use]) -> SealContents | None:
        """What a seal of ``kind`` writes now (``_lock`` held); None when nothing is to seal."""
        carries = kind is not FragmentKind.PART
        held = carries and bool(self._hashes or self._encoder or self._spec)
        if kind is FragmentKind.DONE and self._spec is None:
            return None  # the build published no manifest: no ``done`` fragment
        if kind is not FragmentKind.DONE and not (self._pending or uses or held):
            return None
        return SealContents(
            info=self._info(),
            shards=dict(self._pending),
            uses=tuple(uses),
            spec=self._spec if carries else None,
            items=self._items if carries else [],
            encoder=self._encoder if carries else None,
            hashes=dict(self._hashes) if carries else {},
            fidelity=self._fidelity if kind is FragmentKind.DONE else "",
            carries=carries,
        )

    def _sealed(self, taken: SealContents, path: Path) -> None:
        """Let go of what the fragment at ``path`` holds (``_lock`` held); what was added or
        replaced since it was taken stays held for the next seal."""
        self._let_go(taken.shards)
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


# == merge =========================================================================================
# ``featbake merge``: fold sealed catalog fragments into the catalog.
#
# A build is merged once the ``done`` fragment of each of its N ranks is sealed (before that its
# root manifest would be partial, and readers map dataset index -> key through it). Per build,
# in this order:
#
# 1. the encoder row, then the whole root manifest (every rank's slice, by index) in one
#    transaction, so gc never sees the build's features unreached;
# 2. each shard's rows (one short transaction per shard; first row wins, as in a build);
# 3. the hash-cache rows;
# 4. only then the fragment files are unlinked.
#
# Then the builds not finished (a part killed, preempted, or still running): their shards'
# rows only (:func:`fold_waiting`; their manifests wait for every rank), so a rerun in any shape
# finds what they sealed, and gc keeps those rows while their fragments wait. A build whose root
# was published again after its last fragment (a rerun of the same data, encoder and recipe in
# another shape, or in one process) is retired: its fragments are unlinked.
#
# Then the ``serve`` fragments of datasets on a shared filesystem,
# each on its own, oldest first: its encoder, its root manifest (unless the catalog's root is
# newer),
# its write-back shard's rows and its hash rows; then every last use they recorded (a feature's last
# use only moves forward); then they are unlinked.
#
# Every step is idempotent: rows are inserted with the fragment's own timestamps and ``INSERT OR
# IGNORE``, so a merge killed anywhere leaves fragments that the next merge folds again to the
# same catalog, and a second merge with nothing new changes nothing. It is safe while ranks still
# run: it reads only sealed fragments and leaves builds with a rank missing alone (listed as
# pending). Only this one process writes the catalog, which is what a shared filesystem needs.
@dataclass(frozen=True)
class PendingBuild:
    """A build some of whose ranks have not sealed their ``done`` fragment yet."""

    build_id: str
    root: str
    world: int
    ranks_done: tuple[int, ...]
    fragments: int

    def describe(self) -> str:
        return (
            f"root {self.root}: {len(self.ranks_done)} of {self.world} ranks done "
            f"({self.fragments} fragments sealed, not merged yet)"
        )


@dataclass
class MergeReport:
    """What a merge folded in, and what it left waiting."""

    roots: list[str] = field(default_factory=list)
    fragments: int = 0
    serving_fragments: int = 0
    shards: int = 0
    new_features: int = 0
    missing_shards: list[str] = field(default_factory=list)
    pending: list[PendingBuild] = field(default_factory=list)
    #: fragments left unmerged because they cannot be read (``skip_damaged``): file names
    damaged: list[str] = field(default_factory=list)
    #: shards sealed by builds not finished (a part killed, or still running), in the catalog
    waiting_shards: int = 0
    #: roots whose unfinished build was retired: a later build of the root was published
    superseded: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "roots": self.roots,
            "fragments": self.fragments,
            "serving_fragments": self.serving_fragments,
            "shards": self.shards,
            "new_features": self.new_features,
            "waiting_shards": self.waiting_shards,
            "superseded": self.superseded,
            "missing_shards": self.missing_shards,
            "pending": [p.__dict__ | {"ranks_done": list(p.ranks_done)} for p in self.pending],
        }


def _by_build(layout: Layout) -> dict[str, list[FragmentName]]:
    """Build fragments by build id (``serve`` fragments are merged on their own)."""
    builds: dict[str, list[FragmentName]] = {}
    for name in sealed_fragments(layout):
        if name.kind is not FragmentKind.SERVE:
            builds.setdefault(name.build_id, []).append(name)
    return builds


def serving_fragments(layout: Layout) -> list[FragmentName]:
    """The sealed ``serve`` fragments: what datasets on a shared filesystem wrote, unmerged."""
    return [n for n in sealed_fragments(layout) if n.kind is FragmentKind.SERVE]


def serving_uses(layout: Layout) -> dict[str, float]:
    """key -> its latest last use that sealed ``serve`` fragments record, not merged yet.

    gc counts them: a dataset on a shared filesystem or a bucket store records its reads there,
    and a root read today is in use before any merge folds them into the catalog.
    """
    latest: dict[str, float] = {}
    for name in serving_fragments(layout):  # one merged since the listing: in the catalog now
        for key, used in _read_sealed(name.path, _uses) or ():
            latest[key] = max(used, latest.get(key, used))
    return latest


def _uses(conn: sqlite3.Connection) -> list[tuple[str, float]]:
    return conn.execute("SELECT key, used FROM uses").fetchall()


def _is_complete(names: list[FragmentName]) -> bool:
    world = names[0].world
    done = {n.rank for n in names if n.kind is FragmentKind.DONE and n.world == world}
    return done == set(range(world))


def pending_builds(layout: Layout) -> list[PendingBuild]:
    """Builds with sealed fragments that cannot be merged yet (``roots``/``stats`` show them)."""
    return unmerged_builds(layout, complete=False)


def unmerged_builds(layout: Layout, *, complete: bool = True) -> list[PendingBuild]:
    """Builds with sealed fragments (``verify`` notes them): every one, or (``complete``
    False) those some rank has not finished yet."""
    out = []
    for bid, names in sorted(_by_build(layout).items()):
        if _is_complete(names) and not complete:
            continue
        try:
            root = read_fragment(names[0].path, layout, with_entries=False).info.root
        except StoreCorrupt:
            root = f"(unreadable fragment {names[0].path.name})"
        done = sorted({n.rank for n in names if n.kind is FragmentKind.DONE})
        out.append(PendingBuild(bid, root, names[0].world, tuple(done), len(names)))
    return out


def merge(
    layout: Layout, *, between: Callable[[str], None] | None = None, skip_damaged: bool = False
) -> MergeReport:
    """Fold every complete build's sealed fragments into the catalog; see the module docstring.

    ``between`` is a test hook called after each step (``root``, ``rows``, ``hashes``). With
    ``skip_damaged`` (a bucket store, where one damaged object must not block every node's
    builds) a build with an unreadable fragment is left unmerged and named in
    ``report.damaged``; everything else merges.

    Raises:
        StoreCorrupt: a fragment is unreadable (the message says to move it aside), unless
            ``skip_damaged``.
        StoreError: the catalog cannot be written.

    Example:
        >>> report = merge(Layout(Path(".featbake")))  # doctest: +SKIP
        >>> report.roots, [p.describe() for p in report.pending]  # doctest: +SKIP
    """
    report = MergeReport()
    builds = _by_build(layout)
    complete = {b: n for b, n in builds.items() if _is_complete(n)}
    waiting = {b: n for b, n in builds.items() if b not in complete}
    serving = serving_fragments(layout)
    if not builds and not serving:
        if layout.catalog.exists() and Path(f"{layout.catalog}-journal").exists():
            # Left by a writer killed mid-transaction (a merge, on a shared filesystem): readers
            # open the catalog read-only and cannot roll it back; a read-write read does.
            with Catalog(layout) as catalog:
                catalog.roots()
        report.pending = pending_builds(layout)
        return report
    catalog = Catalog(layout)
    # A merge inserts up to millions of rows into key-ordered indexes: a big page cache keeps
    # those inserts from re-reading the same B-tree pages (this connection only, freed at close).
    catalog.conn.execute("PRAGMA cache_size=-262144")
    try:
        frags = _readable(complete, layout, report if skip_damaged else None)
        # Oldest build first, so a newer build of the same root publishes its manifest last.
        for bid in sorted(frags, key=lambda b: max(f.created for f in frags[b])):
            _fold_build(catalog, frags[bid], report, between)
            for f in frags[bid]:
                with contextlib.suppress(FileNotFoundError):
                    f.path.unlink()
            fsync_dir(fragments_dir(layout))
            report.fragments += len(frags[bid])
        fold_waiting(catalog, waiting, report)
        if serving:
            _fold_serving(catalog, _readable_serving(serving, layout, skip_damaged, report), report)
    finally:
        catalog.close()
    report.pending = pending_builds(layout)
    return report


def _fold_build(
    catalog: Catalog,
    frags: list[Fragment],
    report: MergeReport,
    between: Callable[[str], None] | None,
) -> None:
    done: dict[int, Fragment] = {}
    for f in frags:  # a rank run twice before a merge: its newest manifest slice counts
        rank = f.info.rank
        if f.kind is FragmentKind.DONE and (rank not in done or f.created > done[rank].created):
            done[rank] = f
    info = done[0].info
    when = max(f.created for f in done.values())
    catalog.record_encoder(info.encoder_fp, info.encoder_label, info.encoder_kind, now=when)
    current = catalog.root(info.root)
    if current is None or current.last_used <= when:  # a later build of this root wins
        items = sorted(item for f in done.values() for item in f.items)
        _publish_root(catalog, info, items, when)
        report.roots.append(info.root)
        _record_fidelity(catalog.layout, info.root, list(done.values()))
    if between:
        between("root")
    # Newest first: a rank that stored a feature again (padding found inexact later, see
    # bake/pipeline.py) sealed the new row in a later fragment, and the first row folded wins.
    for f in sorted(frags, key=lambda f: f.created, reverse=True):
        _add_shards(catalog, f, report)
    if between:
        between("rows")
    put_fragment_hashes(catalog, [h for f in frags for h in f.hashes])
    if between:
        between("hashes")


def fold_waiting(
    catalog: Catalog, waiting: dict[str, list[FragmentName]], report: MergeReport
) -> None:
    """Fold the shards' rows of builds not finished yet (``waiting``: build id -> its sealed
    fragments) into the catalog, and retire each such build a later build of its root
    superseded. A build with an unreadable fragment is left as it is (``pending`` names it)."""
    for names in waiting.values():
        try:
            frags = [_read(n.path, catalog.layout) for n in names]
        except StoreCorrupt:
            continue
        folded = MergeReport()
        for f in frags:
            _add_shards(catalog, f, folded)
        report.waiting_shards += folded.shards
        report.new_features += folded.new_features
        report.missing_shards += folded.missing_shards
        if _superseded(catalog, frags):
            for f in frags:
                with contextlib.suppress(FileNotFoundError):
                    f.path.unlink()
            fsync_dir(fragments_dir(catalog.layout))
            report.superseded.append(frags[0].info.root)
            report.fragments += len(frags)


def _superseded(catalog: Catalog, frags: Sequence[Fragment]) -> bool:
    """True when the catalog's root of these fragments' build (same encoder and recipe) was
    published after the last of them was sealed: its manifest names what they would."""
    info = frags[0].info
    root = catalog.root(info.root)
    return (
        root is not None
        and (root.encoder_fp, root.recipe_fp) == (info.encoder_fp, info.recipe_fp)
        and root.last_used >= max(f.created for f in frags)
    )


def adopt_sealed_parts(catalog: Catalog) -> int:
    """Add to ``catalog`` the shards every sealed build fragment names (finished or not); the
    number of feature rows new to it.

    A build in one process writes the catalog itself: before it looks for what is stored, the
    shards a part killed before its end sealed (or parts not merged yet) are its too, so it
    encodes none of them again. Manifests are left to ``featbake merge``; a fragment merged
    (and removed) meanwhile is skipped, its rows are in the catalog already.
    """
    adopted = MergeReport()
    for name in sealed_fragments(catalog.layout):
        if name.kind is FragmentKind.SERVE or not name.path.exists():
            continue
        try:
            _add_shards(catalog, _read(name.path, catalog.layout), adopted)
        except (StoreCorrupt, sqlite3.Error):
            continue  # unreadable, or merged meanwhile: its keys are encoded or in the catalog
    return adopted.new_features


def _record_fidelity(layout: Layout, root: str, done: Sequence[Fragment]) -> None:
    """Pool what the ranks of an int8/fp8 build measured and record it beside the root (no
    record when none measured anything: the root's earlier one stands)."""
    pooled: Measured | None = None
    bound: float | None = None
    for f in done:
        if not f.fidelity:
            continue
        try:
            doc = json.loads(f.fidelity)
            part, bound = Measured.from_json(doc["measured"]), doc["bound"]
        except (ValueError, KeyError, TypeError):
            continue  # an unreadable record loses a sample, never the features
        pooled = part if pooled is None else pooled.merged(part)
    if pooled is not None:
        write_fidelity(layout, root, pooled, bound)


def _add_shards(catalog: Catalog, f: Fragment, report: MergeReport) -> None:
    """Add a fragment's shards and their rows to the catalog (first row wins, as in a build)."""
    if f.format_version >= 3:  # a catalog: its rows are copied through ATTACH
        added = catalog.add_fragment_shards(f.path)
        report.new_features += added.features
        report.shards += added.shards
        report.missing_shards += added.missing
        return
    for shard in read_fragment(f.path, catalog.layout).shards:  # formats 1 and 2
        try:
            report.new_features += catalog.add_shard(shard, now=f.created)
            report.shards += 1
        except ShardMissing:
            report.missing_shards.append(shard.name)


def _publish_root(
    catalog: Catalog, info: BuildInfo, items: Sequence[ManifestItem], now: float
) -> None:
    """Replace the root a fragment's ``info`` names with ``items`` (path, key), used at ``now``."""
    catalog.replace_root(info.root_spec, [(i.path, i.key) for i in items], now=now)


def _readable(
    complete: dict[str, list[FragmentName]], layout: Layout, damaged: MergeReport | None
) -> dict[str, list[Fragment]]:
    """Each complete build's fragments, read; a build with an unreadable one is left out and
    named in ``damaged.damaged`` (raised when ``damaged`` is None)."""
    out: dict[str, list[Fragment]] = {}
    for build_id, names in complete.items():
        try:
            out[build_id] = [_read(n.path, layout) for n in names]
        except StoreCorrupt:
            if damaged is None:
                raise
            damaged.damaged.extend(n.path.name for n in names if not _is_readable(n, layout))
    return out


def _readable_serving(
    names: list[FragmentName], layout: Layout, skip_damaged: bool, report: MergeReport
) -> list[Fragment]:
    out = []
    for n in names:
        try:
            out.append(_read_serving(n.path, layout))
        except StoreCorrupt:
            if not skip_damaged:
                raise
            report.damaged.append(n.path.name)
    return out


def _is_readable(name: FragmentName, layout: Layout) -> bool:
    try:
        _read(name.path, layout)
    except StoreCorrupt:
        return False
    return True


def _read(path: Path, layout: Layout) -> Fragment:
    """A fragment's meta, manifest, hash rows and uses (its feature rows are copied SQL-side)."""
    return read_fragment(path, layout, with_entries=False)


def _read_serving(path: Path, layout: Layout) -> Fragment:
    """A ``serve`` fragment, read whole.

    Raises:
        StoreCorrupt: it is unreadable (the message says what moving it aside loses).
    """
    try:
        return _read(path, layout)
    except StoreCorrupt as e:
        raise StoreCorrupt(
            f"serving fragment {path} is unreadable ({e.__cause__}); move it aside and merge "
            "again: the features it names are encoded again when next needed"
        ) from e


def _fold_serving(catalog: Catalog, frags: list[Fragment], report: MergeReport) -> None:
    """Fold ``serve`` fragments, oldest first, then their last uses; then unlink them."""
    frags.sort(key=lambda f: f.created)
    for f in frags:
        info = f.info
        if info.encoder_kind:  # the dataset had to load the encoder to fingerprint it
            catalog.record_encoder(
                info.encoder_fp, info.encoder_label, info.encoder_kind, now=f.created
            )
        current = catalog.root(info.root) if f.items else None
        if f.items and (current is None or current.last_used <= f.created):
            _publish_root(catalog, info, f.items, f.created)
            if info.root not in report.roots:
                report.roots.append(info.root)
        _add_shards(catalog, f, report)
        put_fragment_hashes(catalog, list(f.hashes))
    # After every shard's rows: a use may name a feature another fragment wrote back.
    catalog.record_uses(u for f in frags for u in f.uses)
    for f in frags:
        with contextlib.suppress(FileNotFoundError):
            f.path.unlink()
    fsync_dir(fragments_dir(catalog.layout))
    report.fragments += len(frags)
    report.serving_fragments += len(frags)


def put_fragment_hashes(catalog: Catalog, rows: list[HashCacheRow]) -> None:
    """Fold fragment hash rows into the catalog, each with the time its stat was taken."""
    # A row recorded at an unknown time is left out: its file is simply hashed again.
    catalog.put_hash_rows(h for h in rows if h.recorded_ns > 0)
