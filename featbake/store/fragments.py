"""Catalog fragments: what one rank of a sharded build sealed, in a small file of its own.

A rank of ``featbake build --shard I/N`` (or under torchrun / a SLURM array) never writes the
shared ``catalog.sqlite``: many writers on one SQLite file is what breaks on NFS and Lustre, and
MosaicML streaming's maintainers refuse concurrent writes to a shared index for the same reason.
Each rank writes its shards, then a *fragment* (a self-contained SQLite file) naming them:

```
fragments/<build>.r<rank>-of-<world>.<id>.<kind>.sqlite
    meta     format, version, build id, rank, world, root, encoder, recipe, created
    shards   name, bytes, encoder_fp, recipe_fp          (each sealed shard of this fragment)
    entries  shard, key, part, dtype, shape, nbytes      (each tensor in them)
    items    idx, path, key     ("done": this rank's slice of the root manifest; "serve": a
                                 dataset's whole manifest, when the catalog's differs)
    hashes   path, size, mtime_ns, inode, sha256, ctime_ns, recorded_ns
                                                         (hash-cache rows this rank computed)
    uses     key, used          (kind "serve" only: last-use times, seconds since the epoch)
```

A fragment is written to ``tmp/``, fsynced and renamed into ``fragments/`` (sealed by rename,
like a shard), and is never changed after: readers open it with ``immutable=1``, which takes
no lock, so it is safe on any filesystem. A rank seals a ``part`` fragment every few shards or
seconds (a rank killed mid-run keeps them: its rerun skips their keys) and a ``done`` fragment at
the end with its manifest slice. ``featbake merge`` (store/merge.py) folds a build's fragments
into the catalog once every rank's ``done`` fragment is there.

A ``serve`` fragment is what a dataset on a shared filesystem would have written to the catalog
(store/serving_fragments.py): a write-back shard, last-use times, or the hash rows and root
manifest it made at its start. Each stands alone (its own build id, rank 0 of 1) and is merged
as soon as it is sealed. Format 2 added the ``uses`` table and the ``serve`` kind; fragments of
format 1 are still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.catalog import FileStat
from featbake.store.layout import Layout, fsync_dir
from featbake.store.writer import SealedShard, ShardEntry

FRAGMENT_FORMAT = "featbake-fragment"
FRAGMENT_VERSION = 2
SUFFIX = ".sqlite"

_SCHEMA = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE shards (name TEXT PRIMARY KEY, bytes INTEGER, encoder_fp TEXT, recipe_fp TEXT)",
    "CREATE TABLE entries (shard TEXT, key TEXT, part TEXT, dtype TEXT, shape TEXT,"
    " nbytes INTEGER)",
    "CREATE TABLE items (idx INTEGER PRIMARY KEY, path TEXT, key TEXT)",
    "CREATE TABLE hashes (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, inode INTEGER,"
    " sha256 TEXT, ctime_ns INTEGER NOT NULL DEFAULT 0, recorded_ns INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE uses (key TEXT PRIMARY KEY, used REAL NOT NULL)",
)


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


class HashRow(NamedTuple):
    """A hash-cache row: the file ``path`` with ``stat`` hashed to ``sha256``.

    ``recorded_ns`` is when the stat was taken (0: unknown, so never trusted); the catalog's racy
    rule (:meth:`FileStat.racy`) applies to fragment rows as to its own.
    """

    path: str
    stat: FileStat
    sha256: str
    recorded_ns: int = 0


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
    hashes: tuple[HashRow, ...]
    uses: tuple[Use, ...] = ()


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
    hashes: Sequence[HashRow] = (),
    uses: Sequence[Use] = (),
) -> Path:
    """Write a fragment to tmp/, fsync it and rename it into fragments/ (which seals it).

    Raises:
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
        _fill(tmp, info, kind, shards, items, hashes, uses)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except (OSError, sqlite3.Error) as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(
            f"could not write the catalog fragment {final}: {e}; check that the cache directory "
            "is writable and has space"
        ) from e
    return final


def _fill(
    path: Path,
    info: BuildInfo,
    kind: FragmentKind,
    shards: Sequence[SealedShard],
    items: Sequence[ManifestItem],
    hashes: Sequence[HashRow],
    uses: Sequence[Use] = (),
) -> None:
    # One writer, a file no one else sees until the rename: no journal is needed.
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("BEGIN")
        for stmt in _SCHEMA:
            conn.execute(stmt)
        meta = {
            "format": FRAGMENT_FORMAT,
            "format_version": str(FRAGMENT_VERSION),
            "kind": kind.value,
            "created": repr(time.time()),
            **info.to_meta(),
        }
        conn.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
        conn.executemany(
            "INSERT INTO shards VALUES (?, ?, ?, ?)",
            [(s.name, s.nbytes, s.encoder_fp, s.recipe_fp) for s in shards],
        )
        conn.executemany(
            "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
            [
                (s.name, e.key, e.part, e.dtype, json.dumps(list(e.shape)), e.nbytes)
                for s in shards
                for e in s.entries
            ],
        )
        conn.executemany("INSERT INTO items VALUES (?, ?, ?)", items)
        conn.executemany(
            "INSERT INTO hashes VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(h.path, *h.stat[:3], h.sha256, h.stat.ctime_ns, h.recorded_ns) for h in hashes],
        )
        conn.executemany("INSERT OR REPLACE INTO uses VALUES (?, ?)", uses)
        conn.execute("COMMIT")
    finally:
        conn.close()


def _open_sealed(path: Path) -> sqlite3.Connection:
    # immutable=1: the file never changes once sealed, so SQLite takes no lock (safe on NFS).
    uri = f"file:{quote(os.fspath(path))}?mode=ro&immutable=1"
    return sqlite3.connect(uri, uri=True)


def read_fragment(path: Path, layout: Layout, *, with_entries: bool = True) -> Fragment:
    """Read a sealed fragment whole (``with_entries=False``: shard rows without their tensors).

    Raises:
        StoreCorrupt: not a readable featbake fragment (move it aside; rerun that rank).
    """
    try:
        conn = _open_sealed(path)
        try:
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
            if meta.get("format") != FRAGMENT_FORMAT:
                raise ValueError("not a featbake fragment")
            entries: dict[str, list[ShardEntry]] = {}
            shapes: dict[str, tuple[int, ...]] = {}  # many features share a shape: parse it once
            if with_entries:
                # In key order: the merge then inserts into the catalog's key index in order.
                for shard, key, part, dtype, shape, nbytes in conn.execute(
                    "SELECT shard, key, part, dtype, shape, nbytes FROM entries ORDER BY key, part"
                ):
                    dims = shapes.get(shape) or shapes.setdefault(shape, tuple(json.loads(shape)))
                    entry = ShardEntry(key, part, dtype, dims, nbytes)
                    entries.setdefault(shard, []).append(entry)
            shards = tuple(
                SealedShard(name, layout.shard_path(name), nbytes, efp, rfp, tuple(entries[name]))
                if with_entries
                else SealedShard(name, layout.shard_path(name), nbytes, efp, rfp, ())
                for name, nbytes, efp, rfp in conn.execute("SELECT * FROM shards ORDER BY name")
            )
            items = tuple(
                ManifestItem(*r) for r in conn.execute("SELECT * FROM items ORDER BY idx")
            )
            hashes = tuple(
                HashRow(p, FileStat(size, mtime, inode, ctime), sha, recorded)
                for p, size, mtime, inode, sha, ctime, recorded in conn.execute(
                    "SELECT path, size, mtime_ns, inode, sha256, ctime_ns, recorded_ns FROM hashes"
                )
            )
            uses = _read_uses(conn)
        finally:
            conn.close()
        kind = FragmentKind(meta["kind"])
        created = float(meta["created"])
        return Fragment(path, BuildInfo.from_meta(meta), kind, created, shards, items, hashes, uses)
    except (sqlite3.Error, ValueError, KeyError) as e:
        raise StoreCorrupt(
            f"catalog fragment {path} is unreadable ({e}); move it aside and rerun that rank "
            "(`featbake build --shard I/N`): its shards are then written again"
        ) from e


def _read_uses(conn: sqlite3.Connection) -> tuple[Use, ...]:
    """The ``uses`` rows (none in a format 1 fragment, which has no such table)."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name='uses'").fetchone():
        return ()
    return tuple(Use(*r) for r in conn.execute("SELECT key, used FROM uses ORDER BY key"))


def fragment_keys(paths: Iterable[Path]) -> set[str]:
    """The keys with a stored tensor in these sealed fragments."""
    keys: set[str] = set()
    for path in paths:
        conn = _open_sealed(path)
        try:
            keys.update(r[0] for r in conn.execute("SELECT DISTINCT key FROM entries"))
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
