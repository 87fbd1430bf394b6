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
              (store/fidelity.py's Measured sums and the bound), pooled by the merge
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
the end with its manifest slice. ``featbake merge`` (store/merge.py) folds a build's fragments
into the catalog once every rank's ``done`` fragment is there.

A ``serve`` fragment is what a dataset on a shared filesystem would have written to the catalog
(store/serving_fragments.py): a write-back shard, last-use times, or the hash rows and root
manifest it made at its start. Each stands alone (its own build id, rank 0 of 1) and is merged
as soon as it is sealed. Format 3 made a fragment a catalog; fragments of formats 1 and 2 (tables
of their own) are still read (store/fragment_legacy.py).
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
    FileStat,
    HashCacheRow,
    HashEntry,
    HashRow,
    Location,
    Measured,
    Root,
    RootItem,
    RootSpec,
    ServingStore,
    ShardFeature,
    columns,
    open_sqlite,
    write_fidelity,
    write_root_rows,
)
from featbake.store.layout import Layout, announce, detect, fsync_dir
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


def _open_sealed(path: Path) -> sqlite3.Connection:
    # immutable=1: the file never changes once sealed, so SQLite takes no lock (safe on NFS).
    return open_sqlite(path, Access.IMMUTABLE)


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
    for path in paths:
        try:
            conn = _open_sealed(path)
        except sqlite3.Error:
            continue  # merged and removed since the listing: its keys are in the catalog now
        try:
            keys.update(_keys_of(conn))
        except sqlite3.Error:
            continue  # unreadable: its keys are simply encoded again
        finally:
            conn.close()
    return keys


def fragment_shard_names(layout: Layout) -> set[str]:
    """Shards named by sealed fragments: not yet in the catalog, yet not garbage (for gc)."""
    names: set[str] = set()
    for frag in sealed_fragments(layout):
        try:
            conn = _open_sealed(frag.path)
        except sqlite3.Error:
            continue  # merged and removed since the listing: its shards are in the catalog now
        try:
            names.update(r[0] for r in conn.execute("SELECT name FROM shards"))
        except sqlite3.Error:
            continue
        finally:
            conn.close()
    return names


# == rank_catalog ==================================================================================
# What one rank of a sharded build uses in place of the catalog: read-only reads, fragment writes.
#
# It answers the calls the build pipeline makes on a :class:`Catalog` (hash cache, encoder, root
# manifest, present keys, sealed shards), but never writes ``catalog.sqlite``: reads go to a
# read-only connection (none at all while the store has no catalog yet, so ranks starting on a
# fresh store cannot race to create it), and everything the rank would have written is sealed into
# its fragments (store/fragments.py) for ``featbake merge``.
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


# == serving_fragments =============================================================================
# What a serving process uses in place of the catalog on a shared filesystem.
#
# On NFS, Lustre, GPFS, CIFS or FUSE (store/filesystem.py) the training processes of many nodes
# must not write one SQLite file. A dataset there reads the catalog read-only and seals what it
# would have written into ``serve`` fragments of its own (store/fragments.py), which
# ``featbake merge`` folds in:
#
# - each write-back shard, in a fragment sealed right after the shard (so gc keeps the shard, and
#   a process killed later loses nothing it sealed);
# - last-use times, one fragment per flush (serve/lastuse.py flushes every 10 minutes there);
# - what the dataset learned at its start: hash-cache rows, the encoder, and the root manifest
#   when the catalog's differs (so what it writes back is reachable, and kept by gc, once merged).
#
# Reads go to the catalog first, then to the ``serve`` fragments not merged yet, this process's
# and other processes' (re-listed at most once a second), so a feature one DataLoader worker or
# rank wrote back is read, not encoded again, by the others before any merge. Features of sharded
# builds not merged yet stay misses: their fragments can be large, and merge publishes them.
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
    def extend_root(self, spec: RootSpec, keys: Sequence[str], now: float | None = None) -> int:
        """Hold root ``spec.name`` grown by the ``keys`` it does not name yet (a CachedEncoder's
        write-back), for the next fragment: its items as the catalog (or this process's held
        manifest) has them, then the new keys. The merge publishes it unless a newer manifest of
        the root was published meanwhile; then keys appended on another host are left out of it,
        which only lets gc free their features (encoded again when next needed), never serves
        one wrong. Returns how many keys were added.
        """
        if self._root is not None and self._root[0].name == spec.name:
            held = [(i.path, i.key) for i in self._root[1]]
        else:
            held = [(i.path, i.key) for i in self.root_items(spec.name)]
        named = {k for _, k in held}
        new = [("", k) for k in dict.fromkeys(keys) if k not in named]
        if new:
            self.replace_root(spec, held + new, now)
        return len(new)

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
# Then the ``serve`` fragments of datasets on a shared filesystem (store/serving_fragments.py),
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

    def to_json(self) -> dict:
        return {
            "roots": self.roots,
            "fragments": self.fragments,
            "serving_fragments": self.serving_fragments,
            "shards": self.shards,
            "new_features": self.new_features,
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


def _is_complete(names: list[FragmentName]) -> bool:
    world = names[0].world
    done = {n.rank for n in names if n.kind is FragmentKind.DONE and n.world == world}
    return done == set(range(world))


def pending_builds(layout: Layout) -> list[PendingBuild]:
    """Builds with sealed fragments that cannot be merged yet (``roots``/``stats`` show them)."""
    out = []
    for bid, names in sorted(_by_build(layout).items()):
        if _is_complete(names):
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
    serving = serving_fragments(layout)
    if not complete and not serving:
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
    # bake/redo.py) sealed the new row in a later fragment, and the first row folded wins.
    for f in sorted(frags, key=lambda f: f.created, reverse=True):
        _add_shards(catalog, f, report)
    if between:
        between("rows")
    put_fragment_hashes(catalog, [h for f in frags for h in f.hashes])
    if between:
        between("hashes")


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
