"""Catalog fragments: the file a build rank or a serving process seals, a catalog of its own.

This module is the format: a fragment's name, writing one, reading one (any format), and what
sealed fragments name. :class:`~featbake.store.fragment_catalog.FragmentCatalog` decides what
goes into them; :mod:`featbake.store.merge` folds them into the catalog.

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
              (store/fidelity.py's Measured sums and the bound), pooled by the merge; in a
              ``done`` fragment, ``undecodable``: the keys the rank could not decode (JSON,
              key -> reason; absent in older fragments and where none failed: none recorded),
              whose union the merge records beside the root (store/roots.py); in a
              ``serve`` fragment carrying a table's root, ``held``: the rows its dataset kept
              in the root but did not serve (JSON, row -> key as built), recorded beside the
              root the merge publishes from it
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
the end with its manifest slice. ``featbake merge`` (:func:`featbake.store.merge.merge`) folds a
build's fragments into the catalog once every rank's ``done`` fragment is there.

A ``serve`` fragment is what a dataset on a shared filesystem would have written to the catalog
(a :class:`~featbake.store.fragment_catalog.FragmentCatalog`, which writes every kind through
:func:`write_fragment`): a write-back shard, last-use times, or the hash rows and root
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
    ShardFeature,
    columns,
    open_sqlite,
    write_root_rows,
)
from featbake.store.files import fsync_dir, holding
from featbake.store.hash_cache import HashCacheRow
from featbake.store.layout import Layout
from featbake.store.roots import RootSpec
from featbake.store.shard import SealedShard, ShardEntry

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


@dataclass(frozen=True)
class RootRecords:
    """What a fragment carrying a root manifest says of that root beyond its rows, as meta
    rows: in a rank's ``done`` fragment, what an int8/fp8 rank measured (``fidelity``: JSON,
    or "") and the inputs it could not decode (``undecodable``: (key, reason) pairs), so the
    merge records them for the whole root; in a dataset's ``serve`` fragment, the table rows
    it kept in the root but did not serve (``held``: (row, key as built) pairs), which the
    merge records beside the root it publishes (store/roots.py's held record)."""

    fidelity: str = ""
    undecodable: tuple[tuple[str, str], ...] = ()
    held: tuple[tuple[str, str], ...] = ()

    def meta(self) -> dict[str, str]:
        """The meta rows it writes (none for what is empty)."""
        out = {"fidelity": self.fidelity} if self.fidelity else {}
        if self.undecodable:
            out["undecodable"] = json.dumps(dict(self.undecodable), sort_keys=True)
        if self.held:
            out["held"] = json.dumps(dict(self.held), sort_keys=True)
        return out


def replaced_meta(keys: Iterable[str]) -> dict[str, str]:
    """The meta row of the keys a fragment replaces (none when it replaces none): keys whose
    rows its writer had stored (a failed padding check found them inexact) and stores again,
    in later fragments. A merge keeps none of their rows in a shard first recorded at or
    before this fragment, unless a later fragment names that shard again
    (:class:`featbake.store.merge.Replacements`)."""
    keys = sorted(set(keys))
    return {"replaced": json.dumps(keys)} if keys else {}


def replaced_of(meta: dict[str, str]) -> frozenset[str]:
    """The keys a fragment's meta says it replaces (:func:`replaced_meta`).

    Raises:
        ValueError: the row cannot be read: a fragment whose replaced rows are not known is
            not folded (a merge would keep rows known wrong).
    """
    keys = json.loads(meta.get("replaced") or "[]")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("its replaced keys are not a list of keys")
    return frozenset(keys)


class Replacing(NamedTuple):
    """What one sealed fragment says of keys stored again: when it was sealed, the keys it
    replaces (:func:`replaced_meta`) and the shards it names."""

    created: float
    replaced: frozenset[str]
    shards: frozenset[str]


def replacing_of(path: Path) -> Replacing | None:
    """What sealed fragment ``path`` says of keys stored again; None where it cannot be read
    (gone: merged since; or damaged: a merge reading it whole names it). A fragment of an
    older format replaces none."""

    def read(conn: sqlite3.Connection) -> Replacing | None:
        meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        try:
            created, replaced = float(meta["created"]), replaced_of(meta)
            legacy = int(meta.get("format_version", "0")) < 3
        except (KeyError, ValueError, TypeError):
            return None  # damaged: the merge reading it whole names it, or skips it
        if legacy:
            return Replacing(created, frozenset(), frozenset())
        return Replacing(created, replaced, frozenset(_shard_names(conn)))

    return _read_sealed(path, read)


def undecodable_of(meta: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The (key, reason) pairs a fragment's meta records; none where it records none (a
    fragment written before ranks recorded them) or cannot be read (they are then misses)."""
    return pairs_of(meta, "undecodable")


def held_of(meta: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The (row, key as built) pairs a ``serve`` fragment's meta records as kept back; none
    where it records none or cannot be read (its rows are then told by the table's status)."""
    return pairs_of(meta, "held")


def pairs_of(meta: dict[str, str], name: str) -> tuple[tuple[str, str], ...]:
    """Meta row ``name``'s JSON object as sorted (name, value) pairs; none where it is absent
    or not such an object."""
    try:
        found = json.loads(meta.get(name) or "{}")
    except ValueError:
        return ()
    if not isinstance(found, dict):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in found.items()))


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
    #: where the data's relative paths were taken from (:attr:`~featbake.store.roots.Root.workdir`)
    workdir: str = ""

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
            meta.get("workdir", ""),  # none in a fragment written before it was kept
        )

    @classmethod
    def of(cls, build: str, rank: int, world: int, spec: RootSpec, encoder_kind: str) -> BuildInfo:
        """The info of rank ``rank`` of ``world`` of build ``build`` of the root ``spec``."""
        return cls(
            build, rank, world, spec.name, spec.data, spec.encoder_label, encoder_kind,
            spec.encoder_fp, spec.recipe_fp, spec.recipe, spec.workdir,
        )  # fmt: skip

    @property
    def root_spec(self) -> RootSpec:
        """The root this build publishes."""
        return RootSpec(
            self.root, self.data, self.encoder_label, self.encoder_fp, self.recipe_fp, self.recipe,
            self.workdir,
        )  # fmt: skip


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
    undecodable: tuple[tuple[str, str], ...] = ()  # (key, reason) its rank could not decode
    replaced: frozenset[str] = frozenset()  # keys whose rows here and before are void
    held: tuple[tuple[str, str], ...] = ()  # (row, key as built) its dataset kept back


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
    """Every sealed fragment in the store, by file name (unsealed ones are still in tmp/).

    Raises:
        StoreError: ``fragments`` is there but cannot be listed (a file, a link to nothing,
            no permission): the fragments a merge waits for cannot be known.
    """
    folder = fragments_dir(layout)
    try:
        files = sorted(folder.iterdir())
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StoreError(
            f"cannot list the store's fragments at {folder} ({e.strerror or e}); it must be a "
            "folder the store's user can read: move what is there aside, then run this again"
        ) from e
    return [n for n in map(parse_name, files) if n is not None]


def write_fragment(  # noqa: PLR0913  (a fragment's parts, and its publish while held)
    layout: Layout,
    info: BuildInfo,
    kind: FragmentKind,
    shards: Sequence[SealedShard],
    items: Sequence[ManifestItem] = (),
    hashes: Sequence[HashCacheRow] = (),
    uses: Sequence[Use] = (),
    records: RootRecords = RootRecords(),
    publish: Callable[[Path], None] | None = None,
    replaced: Iterable[str] = (),
) -> Path:
    """Write a fragment to tmp/, fsync it and rename it into fragments/ (which seals it); where
    the store's place keeps fragments elsewhere (a bucket), ``publish`` puts it there
    (:meth:`~featbake.store.place.Place.publish_fragment`) while this process still holds the
    file: a sealed fragment nobody holds and the bucket never had is one a process killed (or
    whose upload failed) left unsent, which the bucket's next sync adopts, never one still on
    its way up (:meth:`~featbake.store.bucket.BucketStore.sync_fragments`).

    Raises:
        ShardMissing: a shard's file vanished before it was named (the writer writes it again).
        StoreError: the store is not writable (or ``publish`` failed: its own error).
    """
    final = fragments_dir(layout) / (
        f"{info.build_id}.r{info.rank:05d}-of-{info.world:05d}.{uuid.uuid4().hex[:12]}."
        f"{kind.value}{SUFFIX}"
    )
    tmp = layout.tmp / f"fragment-{uuid.uuid4().hex}.part"
    with contextlib.ExitStack() as hold:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            extra = {"kind": kind.value, **records.meta(), **replaced_meta(replaced)}
            held = hold.enter_context(holding(tmp))  # held while written: no sweep takes it
            _fill(layout, tmp, info, extra, shards, items, hashes, uses)
            os.fsync(held.fd)  # the held descriptor: no second open of the file to close
            os.replace(tmp, final)  # the lock goes with the file: held until published
            fsync_dir(final.parent)
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, ShardMissing) or not isinstance(
                e, OSError | sqlite3.Error | StoreError
            ):
                raise
            raise StoreError(
                f"could not write the catalog fragment {final}: {e}; check that the cache "
                "directory is writable and has space"
            ) from e
        if publish is not None:
            publish(final)
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
    ``extra``: meta rows beyond the build's (its kind, a ``done`` fragment's record)."""
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
        fidelity, undecodable = meta.get("fidelity", ""), undecodable_of(meta)
        return Fragment(
            path, info, kind, created, body.shards, items, body.hashes, uses, version, fidelity,
            undecodable, replaced_of(meta), held_of(meta),
        )  # fmt: skip
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


def _named_keys_of(conn: sqlite3.Connection) -> list[str]:
    """The keys a sealed fragment stores tensors of or whose manifest names (any format): a
    part that found a key stored names it in its manifest alone."""
    has = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    items = "root_items" if "root_items" in has else "items"  # format 3, or formats 1 and 2
    named = (
        [r[0] for r in conn.execute(f"SELECT DISTINCT key FROM {items}")] if items in has else []
    )
    return [*_keys_of(conn), *named]


def fragment_named_keys(paths: Iterable[Path]) -> set[str]:
    """The keys these sealed fragments store or name in their manifests: what the builds
    waiting for a merge will publish, which gc must keep (a key a part reused is named in the
    fragment's manifest only, its rows being the catalog's)."""
    keys: set[str] = set()
    for path in paths:  # one not read: merged since (its keys in the catalog), or unreadable
        keys.update(_read_sealed(path, _named_keys_of) or ())
    return keys


def waiting_keys(layout: Layout) -> set[str]:
    """Keys sealed fragments store or name in their manifests: what merges not run yet will
    publish (builds in parts, and datasets on a shared filesystem, which publish their roots
    and write back in ``serve`` fragments), so gc keeps them and stats counts them live."""
    return fragment_named_keys(n.path for n in sealed_fragments(layout))


def fragment_shard_names(layout: Layout) -> set[str]:
    """Shards named by sealed fragments: not yet in the catalog, yet not garbage (for gc)."""
    names: set[str] = set()
    for frag in sealed_fragments(layout):  # one merged since the listing: in the catalog now
        names.update(_read_sealed(frag.path, _shard_names) or ())
    return names


def fragment_shards(path: Path) -> list[str] | None:
    """The shards sealed fragment ``path`` names; None where it cannot be read (gone, or
    damaged)."""
    return _read_sealed(path, _shard_names)


def _shard_names(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM shards")]


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
