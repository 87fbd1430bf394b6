"""The dataset's index: item -> (path, key, shard), built once in the process that makes it.

Where the keys come from. A folder that ``featbake build`` baked has a *root*: the manifest of
(relative path, key) that the build wrote for (folder, encoder as named, recipe). The dataset
finds it without loading the encoder (see :mod:`featbake.serve.misses` for the encoder's
fingerprint). Input files are looked up in the hash cache; a changed file is hashed again and
gets its new key (which then misses and is encoded), an input gone since the build (a file
deleted, a member no longer listed) keeps its manifest key and is still served from the store;
one still there that cannot be read as it is now is not (:func:`_as_built`). A Kaldi
folder's or a cut manifest's relative paths are read where the build read them (the root's
``workdir``) and a table's path-only cells' from there and beside the table, never from this
process's working directory where a folder is recorded; a dataset never moves the folder its
root records (:func:`recorded_workdir`). A table row whose clip is not found, in a table file
changed since the build (or a row a dataset kept back before), is served as built where the
file its cell names is the one the hash cache keys as built; else it is kept in the root but
not served, and recorded so (:func:`untied_rows`, :func:`held_back`, :func:`record_held`).
Without a root (no build ran, or a list of paths) the inputs are hashed once through the hash
cache.

Tables indexed by item live in numpy arrays rather than Python lists so that forked workers do
not copy them page by page as reference counts change.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from featbake.encode.fingerprints import hash_inputs
from featbake.encode.inputs import (
    Inputs,
    input_gone,
    inputs_at,
    keeps_order,
    read_as_built,
    workdir_of,
)
from featbake.encode.manifests import RowInputs
from featbake.encode.sources import check_input_files
from featbake.encode.tables import Table
from featbake.encode.webdataset import WebDataset
from featbake.errors import SourceError, first_few
from featbake.keys import feature_key, root_id, sha256_hex
from featbake.store.catalog import ServingStore
from featbake.store.containers import split_item_path
from featbake.store.hash_cache import FileStat
from featbake.store.roots import Root, RootSpec, published_at

__all__ = ["NO_STAT", "Index", "IndexSpec", "ItemPlacement", "build_index", "names_from_parent"]

#: The stat of an item whose key came from the root alone (its file gone or unreadable).
NO_STAT = FileStat(-1, -1, -1, -1)


@dataclass(frozen=True)
class IndexSpec:
    """What keys are derived from: the encoder and recipe, as fingerprinted and named."""

    enc_fp: str
    enc_label: str
    recipe_fp: str
    recipe: dict
    extensions: tuple[str, ...]

    def key(self, digest: str) -> str:
        return feature_key(self.enc_fp, self.recipe_fp, digest)


class ItemPlacement(NamedTuple):
    """Each item's length (its first dimension, -1 when not stored) and shard id (-1 when not
    stored), as the catalog held them when the index was built: what a loader plans an epoch
    from (batches by length, shards in blocks) without reading one feature."""

    lengths: np.ndarray
    shards: np.ndarray


class Index:
    """Item -> relative path, key and shard; the shard column follows gc moves and write-back.

    Attributes:
        spec: what the keys were derived from.
        keys: ``S64`` key per item.
        stats: ``[n, 4]`` int64: each input's (size, mtime_ns, inode, ctime_ns) when its key was
            hashed, -1 where the key came from the root alone (a file gone or unreadable);
            what ``revalidate=True`` compares a file's stat with.
        shard: shard id per item (an index into :attr:`shard_names`), -1 when not stored.
        parts: the output parts every item has (``("",)`` for one tensor), or None when they
            differ and each item's are looked up.
        data_dir: the resolved folder (or manifest), or None for a list of absolute paths.
        inputs: where the items come from (names each item's path and carried row), or None
            for a list of paths.
        root: the name of the root these items are (None for a list of paths).
    """

    def __init__(
        self,
        rel_paths: list[str],
        keys: list[str],
        data_dir: str | None,
        catalog: ServingStore,
        spec: IndexSpec,
        stats: Sequence[FileStat | None],
        inputs: Inputs | None = None,
        root: str | None = None,
    ) -> None:
        n = len(keys)
        self.spec = spec
        self.data_dir = data_dir
        self.inputs = inputs
        self.root = root
        self.stats = np.array([st or NO_STAT for st in stats], dtype=np.int64).reshape(n, 4)
        self.keys = np.array(keys, dtype="S64") if n else np.zeros(0, dtype="S64")
        blob = "\0".join(rel_paths).encode("utf-8", "surrogateescape")
        self.path_blob = np.frombuffer(blob, dtype=np.uint8).copy()
        ends = np.cumsum([len(p.encode("utf-8", "surrogateescape")) + 1 for p in rel_paths])
        self.path_end = (ends - 1).astype(np.int64)
        self.shard_names: list[str] = []
        self.sid_of: dict[str, int] = {}
        self.shard = np.full(n, -1, dtype=np.int32)
        self.length = np.full(n, -1, dtype=np.int64)
        self.parts = self._locate(keys, catalog)

    def _locate(self, keys: list[str], catalog: ServingStore) -> tuple[str, ...] | None:
        located = catalog.locate_many(sorted(set(keys)))
        parts: set[tuple[str, ...]] = set()
        for i, key in enumerate(keys):
            locs = located.get(key)
            if not locs or len({loc.shard for loc in locs}) != 1:
                continue  # a feature split over shards is not written by featbake: re-read it
            self.shard[i] = self.sid(locs[0].shard)
            self.length[i] = max(loc.shape[0] if loc.shape else 1 for loc in locs)
            parts.add(tuple(loc.part for loc in locs))
        # One encoder and recipe give every item the same outputs; anything else is looked up.
        return parts.pop() if len(parts) == 1 else None

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> str:
        return self.keys[i].decode()

    def position(self, i: int) -> int:
        """Item ``i`` as a position from 0 (negative counts from the end, as for a list).

        Raises:
            IndexError: ``i`` is out of range.
        """
        n = len(self.keys)
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for a dataset of {n} items")
        return j

    def rel(self, i: int) -> str:
        """Item ``i``'s name in its data: a relative path, a manifest row's id, or (a list of
        paths) the path itself."""
        start = int(self.path_end[i - 1]) + 1 if i else 0
        rel = self.path_blob[start : int(self.path_end[i])].tobytes()
        return rel.decode("utf-8", "surrogateescape")

    def path(self, i: int) -> str:
        """Item ``i``'s full name: its file, or where a manifest names it (``train.jsonl:12``)."""
        rel = self.rel(i)
        if self.inputs is not None:
            return self.inputs.path(rel)
        return os.path.join(self.data_dir, rel) if self.data_dir else rel

    def sid(self, shard: str) -> int:
        """The id of shard ``shard`` (named by content), new ids for shards seen first now."""
        sid = self.sid_of.get(shard)
        if sid is None:
            sid = self.sid_of[shard] = len(self.shard_names)
            self.shard_names.append(shard)
        return sid

    def stored(self) -> int:
        return int((self.shard >= 0).sum())

    def placement(self) -> ItemPlacement:
        """Each item's length and shard now (a copy: the index changes as items move)."""
        return ItemPlacement(self.length.copy(), self.shard.copy())

    def rekey(self, i: int, key: str, stat: FileStat, shard: str | None) -> None:
        """Item ``i``'s file now hashes to ``key`` (stat ``stat``), stored in ``shard`` or not."""
        self.keys[i] = key.encode()
        self.stats[i] = stat
        self.shard[i] = self.sid(shard) if shard is not None else -1


def build_index(
    data: object,
    spec: IndexSpec,
    catalog: ServingStore,
    *,
    publish: bool = True,
    new_root: bool = True,
    column: str | None = None,
) -> Index:
    """Index a folder (through its build's root) or a list of files, and publish its root.

    The root is published so that gc keeps what the dataset serves (and writes back) live, and
    the next start finds every key without hashing. With ``publish=False`` (a store this
    process cannot write) nothing is published: files the root does not name are indexed under
    their content keys all the same, and are misses unless the store holds them. With
    ``new_root=False`` (a dataset that refuses misses) only an existing root is refreshed: a
    dataset that serves nothing must not leave a root behind. ``column`` names a manifest's
    input column (see :func:`featbake.encode.inputs.inputs_at`).

    Raises:
        SourceError: no inputs, or inputs that are not in the store cannot be read.
        StoreError: ``data`` is a bucket URL that cannot be listed (credentials, no bucket).
    """
    if isinstance(data, (str, os.PathLike)):
        inputs = inputs_at(data, column, spec.recipe.get("source"))
        return _index_place(inputs, spec, catalog, publish, new_root, column)
    # The folder scan's own checks first: a FIFO or a device in the list would block the
    # first read forever. Absolute, each symlink kept as named (as a folder's files are): one
    # re-pointed since is read, and revalidated, where it points now, not at its old target.
    paths = [os.path.abspath(p) for p in check_input_files(data)]  # type: ignore[arg-type]
    stats: dict[str, FileStat] = {}
    digests, failed = hash_inputs(catalog, paths, stats=stats)
    raise_unreadable([p for p in paths if p in failed], failed)
    keys = [spec.key(digests[p]) for p in paths]
    # Published like a folder's root (named from the set of files), so gc keeps what this
    # list is served from and writes back, and `roots drop` / `gc --older-than` manage it.
    label = "paths:" + sha256_hex("\n".join(sorted(set(paths))).encode())[:16]
    if publish:
        _publish_root(catalog, spec, label, list(zip(paths, keys, strict=True)), new=new_root)
    return Index(paths, keys, None, catalog, spec, [stats[p] for p in paths])


def _index_place(
    inputs: Inputs,
    spec: IndexSpec,
    catalog: ServingStore,
    publish: bool,
    new_root: bool,
    column: str | None = None,
) -> Index:
    """The index of a folder's or a bucket prefix's inputs (a bucket's objects are named by
    URL; an unchanged listing reuses every digest from the hash cache, reading nothing)."""
    data_dir = inputs.where
    name = root_id(data_dir, spec.enc_label, spec.recipe_fp, column)
    root, manifest = _built_root(catalog, name, spec, inputs)
    if isinstance(inputs, (WebDataset, Table)):
        inputs.known = catalog  # a bucket's tars and tables: listings from the hash cache
    try:
        scanned = inputs.scan(spec.extensions).inputs
    except SourceError:
        if not manifest:
            raise
        scanned = []  # the inputs are gone, the features are not
    finally:
        if isinstance(inputs, (WebDataset, Table)):
            inputs.known = None  # the catalog is not pickled into workers with the inputs
    rel_paths = item_names(inputs, scanned, list(manifest))
    stats: dict[str, FileStat] = {}
    paths = [inputs.path(r) for r in scanned]
    digests, failed = inputs.hash(catalog, paths, stats=stats)
    keys: list[str] = []
    bad: list[str] = []
    hashed: list[FileStat | None] = []
    unhashed = [rel for rel in rel_paths if inputs.path(rel) not in digests]
    as_built = _as_built(inputs, unhashed, set(scanned), manifest, spec, catalog, name)
    for rel in rel_paths:
        path = inputs.path(rel)
        hashed.append(stats[path] if path in digests else None)
        if path in digests:
            keys.append(spec.key(digests[path]))
        elif isinstance(built := as_built[rel], AsBuilt):
            keys.append(built.key)  # gone since the build: its features as built
        else:
            failed[path] = built or failed.get(path, "cannot be read")
            bad.append(path)
            keys.append("")
    order = list(rel_paths)  # the root's items' order, rows held back among them
    kept = held_back(inputs, unhashed, as_built)
    rel_paths, keys, hashed = _without(kept, rel_paths, keys, hashed)
    if bad and keeps_order(inputs):  # a manifest's bad rows are left out, as the build skips them
        rel_paths, keys, hashed = _without_bad_rows(inputs, rel_paths, keys, hashed, failed)
    else:
        raise_unreadable(bad, failed)
    if root is not None and root.encoder_fp == spec.enc_fp:  # what its build could not decode
        rel_paths, keys, hashed = without_undecodable(
            rel_paths, keys, hashed, catalog.undecodable(name), catalog, inputs.where
        )
    if not keeps_order(inputs):
        warn_moved(inputs.where, rel_paths, keys, hashed)
    if publish:
        held = {r: manifest[r] for r in kept}
        record_held(catalog, name, inputs, held)  # before the root: never a moment unheld
        items = rooted_items(order, rel_paths, keys, held)
        workdir = recorded_workdir(inputs, root)
        _publish_root(catalog, spec, data_dir, items, name, new=new_root, workdir=workdir)
    return Index(rel_paths, keys, data_dir, catalog, spec, hashed, inputs, name)


def warn_moved(
    where: str, rel_paths: Sequence[str], keys: Sequence[str], hashed: Sequence[FileStat | None]
) -> None:
    """Warn once where files gone since the build (served as built) hold the bytes of files
    present now: renamed or moved, each is served twice an epoch (as the gone file's stored
    features and as the present one's), which nothing said."""
    present = {k: r for r, k, h in zip(rel_paths, keys, hashed, strict=True) if h is not None}
    moved = [
        (r, present[k])
        for r, k, h in zip(rel_paths, keys, hashed, strict=True)
        if h is None and k in present
    ]
    if not moved:
        return
    shown = first_few((f"{gone} (now {now})" for gone, now in moved[:5]), len(moved))
    warnings.warn(
        f"{len(moved)} file(s) of {where} gone since the build hold the bytes of files there "
        f"now (renamed or moved?), so each is served twice an epoch: {shown}; run "
        "`featbake build` again to serve the files there now only",
        stacklevel=4,
    )


def recorded_workdir(inputs: Inputs, root: Root | None) -> str:
    """The folder a dataset's root records its data's relative paths were taken from
    (:attr:`~featbake.store.roots.Root.workdir`): a table's build's, never moved by a dataset
    (only a build records where it read its clips: a dataset opened elsewhere while they were
    away must not have later runs read another folder's files of the same names); the
    folder found for a new root and for other kinds (:func:`workdir_of`)."""
    if isinstance(inputs, Table) and root is not None:
        return root.workdir
    return workdir_of(inputs)


def record_held(catalog: ServingStore, name: str, inputs: Inputs, held: Mapping[str, str]) -> None:
    """Record ``held`` (row -> key as built) as the table rows root ``name`` keeps but this
    dataset does not serve (``ServingStore.record_held``: beside the root, or carried with
    it by a fragment to every node's tier); nothing for other kinds."""
    if isinstance(inputs, Table):
        catalog.record_held(name, held)


def _without(
    rels: Collection[str], rel_paths: list[str], keys: list[str], hashed: list[FileStat | None]
) -> tuple[list[str], list[str], list[FileStat | None]]:
    """The items less those named in ``rels``."""
    if not rels:
        return rel_paths, keys, hashed
    left = [i for i, r in enumerate(rel_paths) if r not in rels]
    return [rel_paths[i] for i in left], [keys[i] for i in left], [hashed[i] for i in left]


def rooted_items(
    order: Sequence[str], rel_paths: Sequence[str], keys: Sequence[str], kept: Mapping[str, str]
) -> list[tuple[str, str]]:
    """The root's items: those served (``rel_paths`` and their ``keys``) and the rows ``kept``
    in the root but not served (row -> its key as built: :func:`held_back`), in ``order``."""
    if not kept:
        return list(zip(rel_paths, keys, strict=True))
    served = dict(zip(rel_paths, keys, strict=True))
    return [(r, served[r] if r in served else kept[r]) for r in order if r in served or r in kept]


class AsBuilt(NamedTuple):
    """An item served the features its root's build stored (its input gone since); not
    ``served``: a row that cannot be told to be the input they were made from, kept in the
    root (so ``gc`` keeps them) but not served (:func:`held_back`)."""

    key: str
    served: bool = True


def _as_built(
    inputs: Inputs,
    rels: Sequence[str],
    listed: Collection[str],
    manifest: Mapping[str, str],
    spec: IndexSpec,
    catalog: ServingStore,
    root: str,
) -> dict[str, AsBuilt | str]:
    """For each item of ``rels`` (which cannot be hashed now), the key its root's build stored
    (``manifest``) where it may be served as built: its input is gone since
    (:func:`~featbake.encode.inputs.input_gone`). Else why not (``""``: the hash's own reason).

    An input still there that cannot be read as its row now says is not the input those
    features were made from, nor is a row changed since the build to name another file that
    is gone: a whole-file row whose file the hash cache knew (one query for all of them: a
    million rows whose audio was deleted once baked) is checked to be keyed as its root says.
    A whole-file row the hash cache never knew is refused where the manifest changed since
    the root's build (a row edited to name a file not there yet). A segment's key needs its
    file's header: a gone file's segment rows are served as built unchecked. A table row
    whose path-only cell names a clip not found is served as built unless its table file
    changed since and the clip it names is not the one the hash cache keys as built: then it
    is kept in the root, not served (:func:`untied_rows`).
    """
    out: dict[str, AsBuilt | str] = {}
    whole: dict[str, str] = {}  # rel -> its gone file, a whole-file row's
    for rel in rels:
        built = manifest.get(rel)
        if built is None or not input_gone(inputs, rel, rel in listed):
            out[rel] = ""
            continue
        out[rel] = AsBuilt(built)
        item = inputs.items.get(rel) if isinstance(inputs, RowInputs) else None
        if item is not None and item.span is None and item.effects is None:
            whole[rel] = item.file
    if isinstance(inputs, Table):
        linked = [r for r, v in out.items() if isinstance(v, AsBuilt)]
        for rel in untied_rows(inputs, linked, manifest, spec, catalog, root):
            out[rel] = AsBuilt(manifest[rel], served=False)
    known = catalog.hash_rows(sorted(set(whole.values()))) if whole else {}
    edited = bool(whole) and rows_edited_since(inputs, root_written(catalog, root))
    for rel, file in whole.items():
        row = known.get(file)  # trusted or not: the file is gone
        if row is not None and spec.key(row.sha256) != manifest[rel]:
            out[rel] = (
                f"{file} is gone, and the stored features of {rel!r} are of another file "
                "(the row named another since its build)"
            )
        elif row is None and edited:
            out[rel] = (
                f"{file} is gone, never hashed here, and the manifest changed since the build: "
                f"the stored features of {rel!r} may be another file's (the row edited to name "
                "this one?); restore the file, or fix the row and run `featbake build`"
            )
    return out


def untied_rows(
    inputs: Table,
    rels: Sequence[str],
    manifest: Mapping[str, str],
    spec: IndexSpec,
    catalog: ServingStore,
    root: str,
) -> list[str]:
    """Of a table's rows ``rels`` whose path-only cells name a file not found now, those that
    cannot be told to be the inputs their stored features were made from: their table file
    changed since the root was written (:func:`table_files_changed`: a row may have been
    edited to name another file), or a dataset kept the row back before with the key the root
    still gives it (:func:`~featbake.store.roots.read_held`: the root published since, for
    another row's new key, is no build of this row), and no file the cell now names is one
    the hash cache keys as the root does (the clip its build hashed, by its own path: the
    same input, whatever happened to the table file's status, a ``touch`` or a ``cp``)."""
    if not rels:
        return []
    changed = table_files_changed(inputs, root_written(catalog, root))
    held = catalog.held(root)
    maybe = [
        r
        for r in rels
        if split_item_path(inputs.path(r))[0] in changed or held.get(r) == manifest[r]
    ]
    named = {rel: inputs.cell_files(rel) for rel in maybe}
    known = catalog.hash_rows(sorted({f for files in named.values() for f in files}))
    return [
        rel
        for rel, files in named.items()
        if not any(f in known and spec.key(known[f].sha256) == manifest[rel] for f in files)
    ]


def held_back(
    inputs: Inputs, rels: Sequence[str], as_built: Mapping[str, AsBuilt | str]
) -> set[str]:
    """The rows of ``rels`` kept in the root but not served (:func:`untied_rows`), after one
    warning naming (up to five of) them, the path each cell names, and what to do: their
    stored features are kept (the root keeps them, so ``gc`` does), not lost by a table file
    touched or copied; nor are they served, which a row edited to name another file would
    get wrong."""
    out = [r for r in rels if isinstance(b := as_built.get(r), AsBuilt) and not b.served]
    if not out:
        return set()
    named = inputs.cell_path if isinstance(inputs, Table) else (lambda rel: None)
    shown = first_few((f"{rel} names {named(rel)!r}" for rel in out[:5]), len(out))
    workdir = workdir_of(inputs)
    here = f" (relative to {workdir}, the build's working directory)" if workdir else ""
    warnings.warn(
        f"{len(out)} row(s) of {inputs.where} name clips not found, and their table file "
        f"changed since the build, so whether they are the clips built cannot be told: their "
        f"stored features are kept, not served: {shown}; to serve them, restore the "
        f"clips they name{here} or undo the edit; `featbake build` drops them",
        stacklevel=4,
    )
    return set(out)


def root_written(catalog: ServingStore, name: str) -> float | None:
    """When root ``name`` was last published (:func:`~featbake.store.roots.published_at`);
    None where there is no such root."""
    root = catalog.root(name)
    layout = getattr(catalog, "layout", None)  # a catalog's or a fragment writer's store
    return None if root is None else published_at(layout, root)


def table_files_changed(inputs: Inputs, when: float | None) -> set[str]:
    """The local files of a table whose status changed after ``when`` (its root's writing):
    by its change time as well as its modification time, which ``os.utime`` or ``cp -p`` set
    back; a row of one of them may name another file than its features were made from (a
    table's ids are positions). None where ``when`` is not known (served as built)."""
    if when is None or not isinstance(inputs, Table):
        return set()
    out = set()
    for f in inputs.files:
        try:
            st = os.stat(f.path)
        except OSError:
            continue  # a bucket's object, or gone: its rows are served as built
        if max(st.st_mtime, st.st_ctime) > when:
            out.add(f.path)
    return out


def rows_edited_since(inputs: Inputs, when: float | None) -> bool:
    """Whether the files that define ``inputs``' rows (a manifest, a Kaldi folder's files)
    changed after ``when``: a row whose file is gone may then name another file than the one
    its features were made from. False where ``when`` is not known (served as built)."""
    if when is None or not isinstance(inputs, RowInputs):
        return False
    origin = inputs.origin
    try:
        files = (
            [os.path.join(origin, n) for n in os.listdir(origin)]
            if os.path.isdir(origin)
            else [origin]
        )
        return any(os.stat(f).st_mtime > when for f in files if os.path.isfile(f))
    except OSError:
        return False


def _built_root(
    catalog: ServingStore, name: str, spec: IndexSpec, inputs: Inputs
) -> tuple[Root | None, dict[str, str]]:
    """The root named ``name`` (none if no build made it) and its items' keys by name (none
    unless it was built by this encoder). The inputs are told the folder its build took
    relative paths from, and read them from there (a table's path-only cells also beside it),
    not from here (:func:`~featbake.encode.inputs.read_as_built`)."""
    root = catalog.root(name)
    if root is None:
        return None, {}
    if root.workdir:
        read_as_built(inputs, root.workdir)
    built = root.encoder_fp == spec.enc_fp
    return root, dict(catalog.root_items(name)) if built else {}


def _without_bad_rows(
    inputs: Inputs,
    rel_paths: list[str],
    keys: list[str],
    hashed: list[FileStat | None],
    failed: Mapping[str, str],
) -> tuple[list[str], list[str], list[FileStat | None]]:
    """The items that have a key, after one warning naming (up to five of) the rows that do
    not (a missing file, a segment past the end of its recording): the dataset serves the
    manifest's good rows in order, as the build stored them, rather than none."""
    bad = [i for i, k in enumerate(keys) if not k]
    reasons = (f"{rel_paths[i]}: {failed.get(inputs.path(rel_paths[i]))}" for i in bad[:5])
    shown = first_few(reasons, len(bad))
    warnings.warn(
        f"{len(bad)} row(s) of {inputs.where} cannot be read as they are now and have no "
        "stored features of their input, so they "
        f"are not items of this dataset: {shown}; fix the rows to include them",
        stacklevel=4,
    )
    good = [i for i, k in enumerate(keys) if k]
    return [rel_paths[i] for i in good], [keys[i] for i in good], [hashed[i] for i in good]


def without_undecodable(
    rel_paths: list[str],
    keys: list[str],
    hashed: list[FileStat | None],
    failed: Mapping[str, str],
    catalog: ServingStore,
    where: str,
) -> tuple[list[str], list[str], list[FileStat | None]]:
    """The items less those whose key the build recorded as undecodable (``failed``: key ->
    the build's reason) and the store does not hold, after one warning naming (up to five of)
    them: the dataset leaves out what the build skipped, as the build did, rather than calling
    them misses that the build it advises skips again. A file fixed since has another key, which
    no record names: it is an item (a miss until the next build encodes it)."""
    named = [k for k in dict.fromkeys(keys) if k in failed]
    if not named:
        return rel_paths, keys, hashed
    stored = {k for k, locs in catalog.locate_many(named).items() if locs}
    left_out = set(named) - stored
    out = [i for i, k in enumerate(keys) if k in left_out]
    if not out:
        return rel_paths, keys, hashed
    shown = first_few((f"{rel_paths[i]} ({failed[keys[i]]})" for i in out[:5]), len(out))
    warnings.warn(
        f"{len(out)} input(s) of {where} could not be decoded or encoded when `featbake build` "
        f"ran, so they are not items of this dataset: {shown}; fix or replace them and run "
        "`featbake build` again to include them",
        stacklevel=4,
    )
    kept = [i for i, k in enumerate(keys) if k not in left_out]
    return [rel_paths[i] for i in kept], [keys[i] for i in kept], [hashed[i] for i in kept]


def item_names(inputs: Inputs, scanned: list[str], built: list[str]) -> list[str]:
    """The items a dataset serves: what the scan found, and what the build's root names.

    A folder's or a bucket's items are the sorted union (a file deleted since the build is
    still served from the store). A manifest's items are its rows in its order; the root's
    names stand in only when the manifest itself is gone (the root keeps the rows' order).
    """
    if keeps_order(inputs):
        return scanned or built
    return sorted(set(scanned) | set(built)) if built else scanned


def _publish_root(
    catalog: ServingStore,
    spec: IndexSpec,
    data: str,
    items: list[tuple[str, str]],
    name: str | None = None,
    *,
    new: bool = True,
    workdir: str = "",
) -> None:
    """Replace the root of ``data`` with ``items`` unless it already holds exactly them (or,
    ``new=False``, unless there is no such root yet); ``workdir``: where the data's relative
    paths were taken from (:attr:`~featbake.store.roots.Root.workdir`)."""
    name = name or root_id(data, spec.enc_label, spec.recipe_fp)
    root = catalog.root(name)
    if root is None and not new:
        return
    if (
        root is not None
        and root.encoder_fp == spec.enc_fp
        and [tuple(x) for x in catalog.root_items(name)] == items
    ):
        return
    published = RootSpec(
        name, data, spec.enc_label, spec.enc_fp, spec.recipe_fp, spec.recipe, workdir
    )
    catalog.replace_root(published, items)


def raise_unreadable(bad: Sequence[str], failed: Mapping[str, str]) -> None:
    """Raise a SourceError naming (up to five of) ``bad``, inputs neither readable nor stored."""
    if bad:
        shown = first_few((f"{p}: {failed.get(p, 'unreadable')}" for p in bad[:5]), len(bad))
        raise SourceError(
            f"{len(bad)} input(s) cannot be read as they are now and have no stored features "
            f"of their input: {shown}; "
            "fix or remove them, or run `featbake build` to see every failure"
        )


def names_from_parent(blob: np.ndarray, ends: np.ndarray) -> np.ndarray:
    r"""A list of files' NUL-joined paths (``blob``, each ending at ``ends``) with the folder
    above their common folder cut from each: ``/data/spk1/a.wav`` and ``/data/spk1/b.wav``
    give ``spk1/a.wav`` and ``spk1/b.wav``. The same files mounted under another folder give
    the same names, so long as the folder they share keeps its name; lists in two such folders
    (``spk1``, ``spk2``), and any two one-file lists of other files, give other names. Done
    on the bytes with numpy: a Python loop over a million paths took 9 s.

    Example:
        >>> blob = np.frombuffer(b"/d/s1/a.wav\0/d/s1/b.wav", dtype=np.uint8)
        >>> names_from_parent(blob, np.array([11, 23])).tobytes()
        b's1/a.wav\x00s1/b.wav'
    """
    if not len(ends):
        return blob
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    first = blob[: int(ends[0])]
    shared = 0  # bytes every path begins with
    while shared < min(len(first), int((ends - starts).min())):
        if not (blob[starts + shared] == first[shared]).all():
            break
        shared += 1
    slashes = np.flatnonzero(first[:shared] == ord("/"))
    cut = int(slashes[-2]) + 1 if len(slashes) > 1 else 0  # through the parent's "/"
    if not cut:
        return blob
    edges = np.zeros(len(blob) + 1, dtype=np.int8)
    edges[starts] += 1
    edges[starts + cut] -= 1
    return blob[np.cumsum(edges[:-1], dtype=np.int8) == 0]
