"""What every ``featbake export`` format reads: one root's stored features, streamed in order.

An export chooses one root (by name or prefix; the only one where the store has one), lists its
manifest, locates each item's stored parts, and hands the formats runs of items in the root's
order, each part read with its checksum checked straight into a few reused buffers, the next
run read on a thread of its own while the format writes the one before (:class:`ReadAhead`),
so no format holds more than a few runs of features in memory. Output files reserve their
disk blocks ahead of the writes (:class:`OutputFile`). Items the store does not hold are left
out and counted.
The rows an item's inputs carry (a manifest's columns, a tar's ``.cls``) are read above this
layer, by whoever opens the inputs, and passed in as a :data:`RowsOf` callable: ``export/``
never imports ``encode/``.

Example:
    >>> chosen_parts(["layer0", "layer6", "layer12"], output=None, layers=[12, 0])
    ['layer12', 'layer0']
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import math
import os
import queue
import shutil
import threading
import time
import unicodedata
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from featbake.errors import ConfigError, ShardMissing, StoreError
from featbake.keys import feature_key
from featbake.progress import GcProgress
from featbake.store.catalog import Catalog, Location
from featbake.store.features import ShardHandles
from featbake.store.fidelity import QUANTISED
from featbake.store.files import Taken, is_same_file, lock_taken, opened_lock, write_all
from featbake.store.hash_cache import HashCache
from featbake.store.layout import Layout
from featbake.store.open import StoreRef, open_catalog, resolve_root
from featbake.store.place import remote_place
from featbake.store.roots import Root, published_at
from featbake.store.shard import Leases, ShardReader, VerifyMode, read_leased

if TYPE_CHECKING:  # torch (seconds of CPU) only where bfloat16 is widened or a tensor made: a
    import torch  # refusal (no such root, OUT exists, ...) or a float export imports none

#: Items read per catalog query and per batch handed to a format.
READ_BATCH = 256

#: The carried row of an item, by its path in the root's manifest ({} where it carries none;
#: None where the data lists no such item now: its row removed or renamed since the build).
RowsOf = Callable[[str], Mapping[str, Any] | None]

#: The digest each of some listed items' inputs has now (``paths``: item paths), read through
#: the hash cache (a file whose stat is unchanged since it was hashed is not read again) and
#: writing nothing to it; an item that cannot be read now is left out of the answer.
DigestsOf = Callable[[Sequence[str], HashCache], Mapping[str, str]]

#: The files each of some listed items whose inputs are gone now (``paths``: item paths) names
#: as its input (a manifest's whole-file row's file; a table's path-only cell's file at each
#: place it is looked for at), by which the hash cache may know what its build read: an item
#: whose key needs more than one file's bytes (a segment: its file's header is gone with it)
#: is left out of the answer.
GoneFilesOf = Callable[[Sequence[str]], Mapping[str, Sequence[str]]]

#: The "digest" :data:`DigestsOf` gives an item whose row the data lists and whose file reads
#: but holds no such input now (a segment past the end of a recording rewritten shorter): it
#: keys to no stored feature (a build keys none from it), so the item is changed.
NO_INPUT = ""


@dataclass(frozen=True)
class RootData:
    """A chosen root's data as it is now, opened as the build opened it: each item's carried
    row (:data:`RowsOf`) and its input's digest now (:data:`DigestsOf`, which
    :func:`checked_items` compares with the key the build stored its features under)."""

    row: RowsOf
    digests: DigestsOf
    #: every item the data lists now, by its path as a manifest names it (those the root
    #: lacks were added since the build: counted, never exported)
    listed: frozenset[str] = frozenset()
    #: the files gone items name now (:data:`GoneFilesOf`), each checked against the hash
    #: cache's last row of it (:func:`gone_keyed_otherwise`); None: gone items are unchecked
    gone_files: GoneFilesOf | None = None
    #: whether the files that define the data's rows (a manifest, a Kaldi folder's files, a
    #: table's files) changed after a time (the root's publishing): a gone item whose files
    #: the hash cache never knew may then name another file than its build read
    edited_since: Callable[[float], bool] | None = None


#: A chosen root's data now, or None where its inputs cannot be opened (export/ never opens
#: inputs itself: the CLI passes :func:`featbake.cli.upkeep`'s reader of the root's data).
RowsFor = Callable[[Root], RootData | None]

#: Where a format's progress goes: ``GcProgress("export", items done, items)``.
ProgressFn = Callable[[GcProgress], None]


class Compression(StrEnum):
    """How a format compresses the feature values it writes.

    Zarr's default is ``NONE``: an encoder's float features barely compress (their mantissas
    are noise), and zstd, zarr's own default, made zarr's writes 2-3x slower for files 8%
    smaller on the benchmark's features (and slows every read after). Parquet's default is
    ``SNAPPY``, pyarrow's own: it gives up at once on bytes it cannot shrink, so it cost
    nothing measurable. ``ZSTD`` (either format) is for files shipped over a network or kept
    long; webdataset writes plain tars.
    """

    NONE = "none"
    SNAPPY = "snappy"
    ZSTD = "zstd"


def compression_of(name: str) -> Compression:
    """The :class:`Compression` called ``name``.

    Raises:
        ConfigError: no such compression, naming those there are.

    Example:
        >>> compression_of("zstd")
        <Compression.ZSTD: 'zstd'>
    """
    try:
        return Compression(name)
    except ValueError:
        known = ", ".join(c.value for c in Compression)
        raise ConfigError(f"unknown compression {name!r}; choose one of {known}") from None


@dataclass(frozen=True)
class ExportSource:
    """What one export reads: the root, its manifest, and where its stored features are."""

    layout: Layout
    root: Root
    manifest: list[tuple[str, str]]  # (path, key) in manifest order
    present: list[tuple[str, str]]  # the items with a stored feature
    located: dict[str, list[Location]]
    parts: tuple[str, ...]  # the parts exported, in the order asked for (else sorted)
    #: stored items left out of ``present``: their inputs changed since the build
    changed: tuple[str, ...] = ()

    @property
    def missing(self) -> int:
        """Items of the manifest the store does not hold."""
        return len(self.manifest) - len(self.present) - len(self.changed)


@dataclass(frozen=True)
class ExportItem:
    """One exported item: its path in the manifest, its key and its parts' tensors."""

    path: str
    key: str
    parts: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PartLayout:
    """How one output part is laid out: ragged or dense, its shapes and dtype."""

    part: str
    dtype: str  # safetensors dtype as stored
    ragged: bool
    trailing: tuple[int, ...]  # shape after the first axis (ragged) or the whole item (dense)
    lengths: tuple[int, ...]  # first-axis length per item (ragged only)


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote."""

    out: str
    root: str
    items: int
    missing: int
    parts: tuple[str, ...]
    layouts: dict[str, str]
    bytes: int
    seconds: float
    #: Items whose row the data lists no more (removed or renamed since the build): their
    #: carried columns are exported empty (null). 0 where the rows carry no columns.
    unlisted: int = 0
    #: Stored items whose input changed since the build (its digest now does not give the
    #: item's key): left out, not counted in ``items``.
    changed: int = 0
    #: Exported items whose input cannot be read now (a file removed; every item where the
    #: data cannot be opened): exported as built, unchecked. Unlisted items are counted in
    #: ``unlisted`` alone.
    unchecked: int = 0
    #: Items the root's data lists now that its manifest lacks (added since the build, or
    #: never built): not exported, and counted.
    added: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_layout(part: str, dtype: str, shapes: Sequence[tuple[int, ...]]) -> PartLayout:
    """Decide ragged vs dense for one part from its items' shapes (pure).

    Raises:
        ConfigError: the items differ in more than their first dimension.

    Example:
        >>> plan_layout("", "F32", [(3, 4), (5, 4)]).ragged
        True
        >>> plan_layout("", "F32", [(8,), (8,)]).ragged
        False
    """
    first = shapes[0]
    if all(s == first for s in shapes):
        return PartLayout(part, dtype, False, tuple(first), ())
    if any(len(s) == 0 or len(s) != len(first) or s[1:] != first[1:] for s in shapes):
        raise ConfigError(
            f"cannot export output {part or 'features'!r}: items differ in more than their "
            "first dimension, so neither a dense nor a ragged array fits"
        )
    return PartLayout(part, dtype, True, tuple(first[1:]), tuple(s[0] for s in shapes))


def part_layouts(src: ExportSource) -> dict[str, PartLayout]:
    """The layout of each exported part, by part name.

    Raises:
        StoreError: some features lack a part.
        ConfigError: a part is stored in several dtypes, or its shapes fit no layout.
    """
    layouts = {}
    for part in src.parts:
        found = part_locations(src, part)
        dtypes = {loc.dtype for loc in found}
        if len(dtypes) != 1:
            raise ConfigError(f"output {part!r} is stored in several dtypes: {sorted(dtypes)}")
        layouts[part] = plan_layout(part, dtypes.pop(), [loc.shape for loc in found])
    return layouts


def choose_root(catalog: Catalog, root: str | None) -> Root:
    """The root to export: ``root`` by name or prefix, else the store's only root.

    Raises:
        ConfigError: no such root; several roots and none chosen (the message lists them);
            a root stored packed (int8/fp8), which no export dequantises yet.
    """
    roots = [resolve_root(catalog, root)] if root is not None else catalog.roots()
    if not roots:
        raise ConfigError(
            "the store has no root to export (none was built, or all were dropped); build one "
            "with `featbake build`, then export it"
        )
    if len(roots) != 1:
        names = ", ".join(r.name for r in roots)
        raise ConfigError(
            f"the store has {len(roots)} roots ({names}); choose one with --root NAME"
        )
    if (dtype := roots[0].recipe.get("dtype")) in QUANTISED:  # packed: codes + scale bytes
        raise ConfigError(
            f"root {roots[0].name} stores {dtype}, which export does not dequantise yet; "
            "export a float16 build of the folder (featbake build --dtype float16)"
        )
    return roots[0]


def chosen_parts(
    available: Sequence[str],
    *,
    output: str | None,
    layers: Sequence[int] | None,
    picked: str | None = None,
) -> list[str]:
    """The parts to export, from those stored (pure).

    ``output`` names one part; ``layers`` names hidden layers (parts ``layer<K>``), in the
    order given; neither: every part, sorted. ``picked``: the part a root built with
    ``--output`` holds (stored as its one unnamed part): ``output`` naming it exports that.

    Raises:
        ConfigError: a part or layer that is not stored, naming those that are.

    Example:
        >>> chosen_parts(["pooled", "tokens"], output="pooled", layers=None)
        ['pooled']
        >>> chosen_parts([""], output="hidden", layers=None, picked="hidden")
        ['']
    """
    have = sorted(available)
    if output is not None and layers:
        raise ConfigError("give --output or --layers, not both")
    wanted = [output] if output is not None else [f"layer{k}" for k in layers or ()]
    if not wanted:
        return have
    if have == [""] and picked is not None and wanted == [picked]:
        return have  # the one part the root was built to hold
    absent = [p for p in wanted if p not in have]
    if absent and have == [""]:  # one part, stored unnamed: no name to choose it by
        raise ConfigError(one_part_refusal(absent, picked, output is not None))
    if absent:
        stored = ", ".join(repr(p) for p in have) or "none"
        raise ConfigError(
            f"the root stores no part {', '.join(map(repr, absent))} (it stores {stored}); "
            "choose among those with --output or --layers"
        )
    return wanted


def one_part_refusal(absent: Sequence[str], picked: str | None, by_output: bool) -> str:
    """Why a root of one unnamed part has none of the parts ``absent`` asked for, and what to
    run: the part it was built to hold (``picked``, its ``--output``), or the encoder's one
    tensor (None).

    Example:
        >>> one_part_refusal(["pooled"], "hidden", True).split(": ")[0]
        "the root stores one part, 'hidden' (it was built with --output hidden), not 'pooled'"
    """
    asked = ", ".join(map(repr, absent))
    if picked is None:
        return (
            f"the root stores no part {asked}: its encoder returned one tensor, stored as one "
            "unnamed part; export it without --output and --layers"
        )
    option = (
        f"--output {absent[0]}"
        if by_output
        else "--layers " + ",".join(p.removeprefix("layer") for p in absent)
    )
    return (
        f"the root stores one part, {picked!r} (it was built with --output {picked}), not "
        f"{asked}: export it with --output {picked} (or without --output and --layers), or "
        f"build {asked} with `featbake build {option}` (the same --encoder and --data) and "
        "export that root with --root NAME"
    )


def open_source(
    cache: StoreRef,
    root: str | None,
    *,
    output: str | None = None,
    layers: Sequence[int] | None = None,
    check: Callable[[Layout, Sequence[DataSource]], None] | None = None,
) -> ExportSource:
    """The root to export and where its features are; ``check(layout, sources)`` runs first
    (a format's check of its destination against the store and every root's data).

    Raises:
        ConfigError: see :func:`choose_root` and :func:`chosen_parts`.
        StoreError: the root holds no stored features.
    """
    layout, catalog = open_catalog(cache)
    try:
        if check is not None:
            check(layout, [DataSource(r.name, r.data) for r in catalog.roots()])
        chosen = choose_root(catalog, root)
        manifest = [(p, k) for p, k in catalog.root_items(chosen.name)]
        located = catalog.locate_many([k for _, k in manifest])
    finally:
        catalog.close()
    present = [(p, k) for p, k in manifest if k in located]
    if not present:
        raise StoreError(
            f"root {chosen.name} has no stored features to export; run `featbake build` first"
        )
    stored = {loc.part for locs in located.values() for loc in locs}
    picked = chosen.recipe.get("output")
    parts = chosen_parts(sorted(stored), output=output, layers=layers, picked=picked)
    return ExportSource(layout, chosen, manifest, present, located, tuple(parts))


def part_locations(src: ExportSource, part: str) -> list[Location]:
    """Each present item's location of ``part``, in order.

    Raises:
        StoreError: some items lack the part (a partial rebuild): rebuild the root.
    """
    locs = [next((x for x in src.located[k] if x.part == part), None) for _, k in src.present]
    found = [loc for loc in locs if loc is not None]
    if len(found) != len(locs):
        raise StoreError(f"some features lack output {part!r}; rebuild root {src.root.name}")
    return found


@dataclass(frozen=True)
class LocatedItem:
    """One present item before its read: its place in the root's order (``at``), path, key
    and the location of each exported part (in :attr:`ExportSource.parts` order)."""

    at: int
    path: str
    key: str
    locations: tuple[Location, ...]


def vanished(key: str, layout: Layout) -> StoreError:
    """The error of an item the store lost while it was being exported: a directory's lost
    shard is dropped from its catalog by ``verify --repair``; a bucket has no repair, and a
    build encodes again what a missing shard object held."""
    if remote_place(layout) is None:
        return StoreError(
            f"feature {key} vanished during the export (gc ran, or its shard was removed by "
            "hand); run the export again, after `featbake verify --repair` if this persists"
        )
    return StoreError(
        f"feature {key} vanished during the export (gc ran, or its shard object was deleted); "
        "run the export again, and if this persists build again (a build encodes again what "
        "a missing shard held)"
    )


def located(
    src: ExportSource, progress: ProgressFn | None = None
) -> Generator[list[LocatedItem], None, None]:
    """The present items in the root's order, :data:`READ_BATCH` at a time, each located
    afresh (one catalog query a batch: gc may have moved a feature since the export began);
    progress is reported once a batch is done.

    Raises:
        StoreError: a feature vanished during the export (gc, or a shard removed by hand).
    """
    n = len(src.present)
    catalog = Catalog(src.layout)
    try:
        for start in range(0, n, READ_BATCH):
            batch = src.present[start : start + READ_BATCH]
            where = catalog.locate_many([k for _, k in batch])
            yield [
                LocatedItem(start + i, path, key, part_places(where.get(key), src, key))
                for i, (path, key) in enumerate(batch)
            ]
            if progress:
                progress(GcProgress("export", start + len(batch), n))
    finally:
        catalog.close()


def part_places(
    locations: Sequence[Location] | None, src: ExportSource, key: str
) -> tuple[Location, ...]:
    """The location of each of ``src.parts`` among an item's ``locations``, in order.

    Raises:
        StoreError: the item is gone (``locations`` None or empty) or lacks a part.
    """
    by_part = {loc.part: loc for loc in locations or ()}
    if not all(p in by_part for p in src.parts):
        raise vanished(key, src.layout)
    return tuple(by_part[p] for p in src.parts)


#: numpy's dtype of what an export writes for each stored dtype: bfloat16, which numpy, Arrow
#: and Zarr lack, widened exactly to float32; every other dtype as stored.
SERVED_NUMPY = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "float32", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def served_dtype(stored: str) -> np.dtype[Any]:
    """The numpy dtype an export writes a part stored as ``stored`` in (pure).

    Example:
        >>> served_dtype("BF16"), served_dtype("F16")
        (dtype('float32'), dtype('float16'))
    """
    return np.dtype(SERVED_NUMPY[stored])


def served_bytes(loc: Location) -> int:
    """The bytes an export writes for ``loc`` (bfloat16 twice its stored bytes)."""
    return loc.nbytes * 2 if loc.dtype == "BF16" else loc.nbytes


class Scratch:
    """One reused, growing buffer: each read of a format lands in the same memory (no fresh
    allocation, page faults or cache misses per item), valid until the buffer is next used."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """A C-ordered array of ``dtype`` and ``shape`` over the buffer (grown as needed)."""
        return self.arrays(dtype, [shape])[0]

    def arrays(self, dtype: np.dtype[Any], shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """C-ordered arrays of ``dtype`` and ``shapes`` one after another over the buffer."""
        sizes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape in shapes]
        if sum(sizes) > self.buf.nbytes:
            self.buf = np.empty(max(sum(sizes), 2 * self.buf.nbytes), dtype=np.uint8)
        out, at = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            out.append(self.buf[at : at + size].view(dtype).reshape(shape))
            at += size
        return out


class PartReads:
    """Reads stored parts straight into a format's memory, each checked against its checksum
    on every read (the compiled pread and CRC of the serving path, outside the GIL).

    A shard that vanished (gc compacted it since the batch was located) is looked up once
    more in the catalog; gone for good, the export stops (:func:`vanished`).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.handles = ShardHandles.of(layout, verify=VerifyMode.ALWAYS)
        self.catalog: Catalog | None = None  # opened on a first vanished shard
        self.widen = Scratch()  # bfloat16 bytes on their way to float32
        self.paths: dict[str, Path] = {}  # each shard's file, by name

    def read(self, loc: Location, dest: np.ndarray) -> None:
        """``loc``'s stored bytes into ``dest`` (contiguous, exactly ``loc.nbytes``), checked.

        Raises:
            StoreCorrupt: the bytes fail their checksum, or are cut short.
            StoreError: the feature vanished during the export.
        """
        raw = dest.reshape(-1).view(np.uint8)
        try:
            self._read_at(loc, raw)
        except ShardMissing:
            self.handles.forget(self.layout.shard_path(loc.shard))
            self.paths.clear()
            try:
                self._read_at(self._relocated(loc), raw)
            except ShardMissing:
                raise vanished(loc.key, self.layout) from None

    def read_part(self, loc: Location, into: Scratch) -> np.ndarray:
        """``loc`` as served (:func:`served_dtype`, its stored shape) in ``into``'s buffer."""
        out = into.array(served_dtype(loc.dtype), loc.shape)
        self.read_served(loc, out)
        return out

    def read_served(self, loc: Location, out: np.ndarray) -> None:
        """``loc`` as served into ``out`` (C-ordered, :func:`served_dtype`, its stored shape):
        its bytes as stored, or bfloat16 widened exactly to float32 on the way.

        Raises:
            StoreCorrupt: the bytes fail their checksum, or are cut short.
            StoreError: the feature vanished during the export.
        """
        if loc.dtype != "BF16":
            self.read(loc, out)
            return
        import torch

        raw = self.widen.array(np.dtype(np.int16), loc.shape)
        self.read(loc, raw)
        torch.from_numpy(out).copy_(torch.from_numpy(raw).view(torch.bfloat16))

    def read_all(self, locs: Sequence[Location], outs: Sequence[np.ndarray]) -> None:
        """Each of ``locs`` as served into its array of ``outs`` (see :meth:`read_served`):
        all in one compiled read (its preads and CRCs in one call outside the GIL), or one by
        one where a part is bfloat16 or a shard vanished (looked up again, as :meth:`read`).

        Raises:
            StoreCorrupt: the bytes fail their checksum, or are cut short.
            StoreError: a feature vanished during the export.
        """
        if all(loc.dtype != "BF16" for loc in locs):
            try:
                with Leases() as held:
                    read_leased([
                        self._shard(loc, held).span(loc.tensor, out.reshape(-1).view(np.uint8))
                        for loc, out in zip(locs, outs, strict=True)
                    ])  # fmt: skip
                return
            except ShardMissing:
                pass  # one by one below, each vanished shard looked up again
        for loc, out in zip(locs, outs, strict=True):
            self.read_served(loc, out)

    def read_group(
        self, items: Sequence[LocatedItem], parts: Sequence[str], buffers: Mapping[str, Scratch]
    ) -> ReadGroup:
        """``items``' ``parts`` read as served, each part's one after another in its buffer."""
        arrays = {}
        for i, part in enumerate(parts):
            locs = [item.locations[i] for item in items]
            dtype = served_dtype(locs[0].dtype)  # one dtype a part (part_layouts checks)
            arrays[part] = buffers[part].arrays(dtype, [loc.shape for loc in locs])
            self.read_all(locs, arrays[part])
        return ReadGroup(list(items), arrays, buffers)

    def _shard(self, loc: Location, held: Leases) -> ShardReader:
        path = self.paths.get(loc.shard)
        if path is None:
            path = self.paths[loc.shard] = self.layout.shard_path(loc.shard)
        return self.handles.lease(path, held)

    def _read_at(self, loc: Location, raw: np.ndarray) -> None:
        with Leases() as held:
            read_leased([self._shard(loc, held).span(loc.tensor, raw)])

    def _relocated(self, loc: Location) -> Location:
        if self.catalog is None:
            self.catalog = Catalog(self.layout)
        fresh = [x for x in self.catalog.locate(loc.key) if x.part == loc.part]
        if not fresh:
            raise vanished(loc.key, self.layout)
        return fresh[0]

    def close(self) -> None:
        self.handles.close()
        if self.catalog is not None:
            self.catalog.close()

    def __enter__(self) -> PartReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# == reading ahead ================================================================================
# A format writes one run of items while the next is read on a thread of its own: the reads'
# preads and CRCs and the writes' copies into the page cache both run outside the GIL, so on
# two cores an export takes about the longer of the two rather than their sum. Each run is read
# into one of a few reused buffers, handed over once read and handed back once written.
@dataclass(frozen=True)
class ReadGroup:
    """A run of consecutive items, read: each part's arrays, by part, in item order, one after
    another in ``buffers`` (valid until the next run is asked for)."""

    items: list[LocatedItem]
    parts: dict[str, list[np.ndarray]]
    buffers: Mapping[str, Scratch]

    def flat(self, part: str) -> memoryview:
        """``part``'s bytes of every item, one after another (one span of its buffer)."""
        nbytes = sum(a.nbytes for a in self.parts[part])
        return self.buffers[part].buf[:nbytes].data

    @property
    def nbytes(self) -> int:
        """The items' served bytes, over all parts."""
        return sum(a.nbytes for arrays in self.parts.values() for a in arrays)


def groups_of(items: Sequence[LocatedItem], limit: int) -> list[list[LocatedItem]]:
    """``items`` in order, cut into runs of at most ``limit`` served bytes (one item at least).

    Example:
        >>> item = lambda n: LocatedItem(0, "p", "k", (Location("k", "", "s", "F32", (n,), 4 * n),))
        >>> [len(g) for g in groups_of([item(2), item(2), item(5), item(1)], 16)]
        [2, 1, 1]
        >>> [len(g) for g in groups_of([item(0), item(4), item(0)], 16)]  # an empty item first
        [3]
    """
    groups: list[list[LocatedItem]] = []
    size = 0
    for item in items:
        nbytes = sum(served_bytes(loc) for loc in item.locations)
        if not groups or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


class ReadAhead:
    """The present items in the root's order, as :class:`ReadGroup` runs of at most
    ``group_bytes``, read (checked) on a thread of its own into ``buffers`` reused buffers
    while the caller writes the run before; ``progress`` is told each run the caller is done
    with. A context manager: leaving it (an error while writing, an interrupt) stops the
    reading thread and waits for it.

    Example:
        >>> with ReadAhead(src, 4 << 20) as runs:  # doctest: +SKIP
        ...     for run in runs:
        ...         write(run.parts[""])
    """

    def __init__(
        self,
        src: ExportSource,
        group_bytes: int,
        progress: ProgressFn | None = None,
        buffers: int = 3,
    ) -> None:
        self.src, self.group_bytes, self.progress = src, group_bytes, progress
        self.free: queue.SimpleQueue[dict[str, Scratch] | None] = queue.SimpleQueue()
        self.full: queue.SimpleQueue[ReadGroup | BaseException | None] = queue.SimpleQueue()
        for _ in range(buffers):
            self.free.put({part: Scratch() for part in src.parts})
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="featbake-export-read", daemon=True)

    def __enter__(self) -> ReadAhead:
        self.thread.start()
        return self

    def __iter__(self) -> Iterator[ReadGroup]:
        """Each run once read; its buffers go back to the reader when the next is asked for.

        Raises:
            StoreCorrupt: a stored feature fails its checksum.
            StoreError: a feature vanished during the export.
        """
        done, total = 0, len(self.src.present)
        while (got := self.full.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            yield got
            self.free.put(dict(got.buffers))
            done += len(got.items)
            if self.progress:
                self.progress(GcProgress("export", done, total))

    def _read(self) -> None:
        """The reading thread: each run into a free buffer, until done or stopped."""
        try:
            # closed here, not by the garbage collector on another thread: its catalog's
            # connection belongs to this one
            with (
                PartReads(self.src.layout) as reads,
                contextlib.closing(located(self.src)) as batches,
            ):
                for batch in batches:
                    for items in groups_of(batch, self.group_bytes):
                        buffers = self.free.get()
                        if buffers is None or self.stop.is_set():
                            return
                        self.full.put(reads.read_group(items, self.src.parts, buffers))
            self.full.put(None)
        except BaseException as e:  # handed to the writing thread, which raises it
            self.full.put(e)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.free.put(None)  # wakes the reader if it waits for a buffer
        self.thread.join()


def stream(src: ExportSource, progress: ProgressFn | None = None) -> Iterator[list[ExportItem]]:
    """The present items in the root's order, :data:`READ_BATCH` at a time, each part read
    with its checksum checked into a tensor of its own; only the parts
    :attr:`ExportSource.parts` names. (The formats read through :class:`PartReads` into
    reused memory instead; this is for callers that keep the items.)

    Raises:
        StoreError: a feature vanished during the export (gc, or a shard removed by hand).
        StoreCorrupt: a stored feature fails its checksum.
    """
    import torch

    with PartReads(src.layout) as reads:
        for batch in located(src, progress):
            yield [
                ExportItem(item.path, item.key, {
                    p: torch.from_numpy(reads.read_part(loc, Scratch()))
                    if loc.dtype != "BF16" else _stored_tensor(reads, loc)
                    for p, loc in zip(src.parts, item.locations, strict=True)
                })
                for item in batch
            ]  # fmt: skip


def _stored_tensor(reads: PartReads, loc: Location) -> torch.Tensor:
    """A bfloat16 part as stored (callers of :func:`stream` widen it with :func:`as_numpy`)."""
    import torch

    t = torch.empty(loc.shape, dtype=torch.bfloat16)
    reads.read(loc, t.view(torch.int16).numpy())
    return t


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A stored tensor as numpy: bfloat16, which numpy, Arrow and Zarr lack, widened exactly to
    float32; every other dtype as stored."""
    import torch

    return t.to(torch.float32).numpy() if t.dtype == torch.bfloat16 else t.numpy()


# == output files ==================================================================================
#: Disk space an :class:`OutputFile` reserves ahead of its writes, a step at a time.
RESERVE_BYTES = 64 * 1024 * 1024


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``fallocate(fd, mode, offset, length)``, or None where libc lacks it
    (``os.posix_fallocate`` would emulate it by writing zeros where a filesystem refuses)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _fallocate()
_KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE: blocks reserved past the end, the file's size unchanged


def reserve(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of disk blocks at ``offset`` of ``fd`` without changing its size;
    False where the platform or filesystem cannot, or the disk has not that much room left
    (nothing reserved: the writes go on, and fail only where the bytes themselves do not fit).

    Writing into reserved blocks skips the filesystem's per-page block reservation: ext4 took
    the shard files' bytes into the page cache at 6.5-6.7 GB/s against 4.5-4.6 without
    (512 KiB writes, this machine).
    """
    if _FALLOCATE is None or nbytes <= 0:
        return False
    return _FALLOCATE(fd, _KEEP_SIZE, offset, nbytes) == 0


class OutputFile:
    """A file an export writes in order with ``writev``, its disk blocks reserved ahead of the
    writes (:func:`reserve`): ``expect`` bytes where the caller knows its size, else
    :data:`RESERVE_BYTES` at a time; on close, what was reserved past the end is given back."""

    def __init__(self, path: Path, expect: int = 0) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
        self.size = self.reserved = 0
        self.reserving = True
        self.expect = expect

    def write(self, chunks: Sequence[bytes | memoryview | np.ndarray]) -> None:
        """Write ``chunks`` one after another at the end of the file."""
        views = [_bytes_of(c) for c in chunks]
        nbytes = sum(v.nbytes for v in views)
        if self.reserving and self.size + nbytes > self.reserved:
            step = self.expect - self.reserved if self.expect else RESERVE_BYTES
            ahead = max(step, self.size + nbytes - self.reserved)
            self.reserving = reserve(self.fd, self.reserved, ahead)
            self.reserved += ahead
        write_all(self.fd, views)
        self.size += nbytes

    def close(self) -> None:
        """Give back the blocks reserved past the end, and close."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if self.reserved > self.size:
                os.ftruncate(fd, self.size)  # to its own size: frees the blocks past it
        finally:
            os.close(fd)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _bytes_of(chunk: bytes | memoryview | np.ndarray) -> memoryview:
    """A chunk's bytes as a flat view (no copy; an array C-ordered already)."""
    if isinstance(chunk, np.ndarray):
        return chunk.reshape(-1).view(np.uint8).data
    return memoryview(chunk).cast("B")


def checked_items(
    src: ExportSource, data: RootData, listed: Sequence[str]
) -> tuple[list[str], list[str]]:
    """The present items whose input changed since the build, and those whose input cannot be
    read now (the data lists them no more, or their files are gone or unreadable); ``listed``:
    the present items the data lists now (their rows read once, by :func:`matched_to`).

    Each item the data lists now has its input's digest now keyed as the build keyed it
    (:func:`featbake.keys.feature_key` of the root's encoder and recipe) and compared with its
    key. The digests come through the catalog's hash cache, as a build's do: an input whose
    stat is unchanged since it was hashed is not read again (a stat per file); one changed,
    or never hashed into this catalog, is read whole.

    An item whose input is gone (its file deleted) is exported as built unless the hash cache
    tells it is not the input its features were made from (:func:`gone_keyed_otherwise`: a row
    changed since the build to name another file, since deleted), as a dataset leaves such a
    row out (``featbake.serve.index``).
    """
    catalog = Catalog(src.layout)
    try:
        now = data.digests(listed, catalog)
        unread = [(p, k) for p, k in src.present if p not in now]
        still = set(listed)  # the unlisted ones have no row to name a file
        gone = [(p, k) for p, k in unread if p in still]
        otherwise = gone_keyed_otherwise(src.root, data, gone, catalog)
    finally:
        catalog.close()
    fps = (src.root.encoder_fp, src.root.recipe_fp)
    changed = [
        p for p, k in src.present if (p in now and feature_key(*fps, now[p]) != k) or p in otherwise
    ]
    return changed, [p for p, _ in unread if p not in otherwise]


def gone_keyed_otherwise(
    root: Root, data: RootData, items: Sequence[tuple[str, str]], catalog: Catalog
) -> set[str]:
    """Of ``items`` (path, key) whose inputs cannot be read now, those whose input is gone and
    whose row names files the hash cache knows, none of them keyed as the item is: the row
    names another file since the build (a manifest row rewritten to name a file deleted
    since), so its stored features are another input's. The hash cache's last row of a file
    is taken trusted or not (the file is gone: no stat of it now can disagree). An item whose
    files the hash cache never knew is one too where the files defining the rows changed
    since the root was published (:attr:`RootData.edited_since`: a row edited to name a file
    never copied), as a dataset leaves it out or keeps it back; else it stays unchecked
    (exported as built)."""
    if data.gone_files is None or not items:
        return set()
    named = data.gone_files([p for p, _ in items])
    known = catalog.hash_rows(sorted({f for files in named.values() for f in files}))
    fps = (root.encoder_fp, root.recipe_fp)
    unknown = [p for p, _ in items if named.get(p) and not any(f in known for f in named[p])]
    edited = bool(unknown) and data.edited_since is not None
    edited = edited and data.edited_since(published_at(catalog.layout, root))  # type: ignore[misc]
    out = set(unknown) if edited else set()
    for path, key in items:
        keys = {feature_key(*fps, known[f].sha256) for f in named.get(path, ()) if f in known}
        if keys and key not in keys:
            out.add(path)
    return out


@dataclass(frozen=True)
class Matched:
    """What the root's data now says of the items the store holds: the carried row of each
    item exported, in order (None: no rows to write), and the paths of the items the data no
    longer matches, one list per :class:`Drift`."""

    rows: list[Mapping[str, Any]] | None = None
    #: rows the data lists no more (left empty where no row carries a column: nothing of
    #: theirs is lost), their columns exported empty
    unlisted: list[str] = field(default_factory=list)
    #: inputs whose digest now does not give the item's key: left out
    changed: list[str] = field(default_factory=list)
    #: inputs that cannot be read now (and are not unlisted): exported as built
    unchecked: list[str] = field(default_factory=list)
    #: items the data lists now that the root's manifest lacks: not exported
    added: list[str] = field(default_factory=list)

    def drifts(self) -> list[tuple[Drift, list[str]]]:
        """Each :class:`Drift` with the paths of its items, in the order they are told."""
        return [(UNLISTED, self.unlisted), (CHANGED, self.changed), (UNCHECKED, self.unchecked)]


def matched_to(
    src: ExportSource, data: RootData | None, *, strict_rows: bool = False
) -> tuple[ExportSource, Matched]:
    """``src`` less the items whose inputs changed since the build (:func:`checked_items`),
    and what the data now says of its items (:class:`Matched`); ``src`` as it is, and no
    rows, where the data cannot be opened (``data`` None).

    Raises:
        ConfigError: under ``strict_rows``, some items the data does not match; or every
            stored item changed (nothing true is left to export).
    """
    if data is None:
        return src, Matched()
    found = [data.row(path) for path, _ in src.present]
    carried = [row or {} for row in found]
    listed = [p for (p, _), row in zip(src.present, found, strict=True) if row is not None]
    unlisted = [p for (p, _), row in zip(src.present, found, strict=True) if row is None]
    changed, unread = checked_items(src, data, listed)
    unlisted = unlisted if any(carried) else []
    counted = set(unlisted)
    added = sorted(data.listed - {path for path, _ in src.manifest})
    matched = Matched(carried, unlisted, changed, [p for p in unread if p not in counted], added)
    stored = len(src.present)
    for drift, paths in matched.drifts():
        if strict_rows and paths:
            raise drift.refusal(paths, stored, src.root)
    if strict_rows and added:
        raise ConfigError(
            f"{added_head(len(added), src.root.name)} ({_named(added)}); {REBUILD}, or drop "
            "--strict-rows to export the root as built"
        )
    if len(changed) == stored:
        head = CHANGED.head(stored, stored, src.root.name)
        raise ConfigError(f"{head}: nothing is left to export; {REBUILD}")
    gone = set(changed)
    kept = [i for i, (path, _) in enumerate(src.present) if path not in gone]
    src = replace(src, present=[src.present[i] for i in kept], changed=tuple(changed))
    return src, replace(matched, rows=[carried[i] for i in kept])


@dataclass(frozen=True)
class Drift:
    """One way the root's data now disagrees with what the build read, as every message of
    it says it: ``fact`` (after "2 of 4 items of root r-1"; ``{data}`` is where the data is),
    what an export does with such items (``default``), and what dropping ``--strict-rows``
    would do (``lenient``)."""

    fact: str
    default: str
    lenient: str

    def head(self, count: int, items: int, root: str, data: str = "its data") -> str:
        """``2 of 4 items of root r-1 <fact>`` (pure): the warning and the refusal both open
        with it.

        Example:
            >>> UNLISTED.head(1_200, 1_300, "r-1")
            '1,200 of 1,300 items of root r-1 have no row in its data now (removed or renamed since the build)'
        """  # noqa: E501
        return f"{count:,} of {items:,} items of root {root} {self.fact.format(data=data)}"

    def warning(self, count: int, items: int, root: str) -> str:
        """The one yellow line of an export that went on (pure)."""
        return (
            f"{self.head(count, items, root)}: {self.default}; {REBUILD}, or pass "
            "--strict-rows to refuse"
        )

    def refusal(self, paths: Sequence[str], items: int, root: Root) -> ConfigError:
        """The refusal of ``--strict-rows``, naming the first of ``paths``."""
        shown = _named(paths)
        head = self.head(len(paths), items, root.name, f"its data {root.data}")
        return ConfigError(f"{head} ({shown}); {REBUILD}, or drop --strict-rows to {self.lenient}")


def _named(paths: Sequence[str]) -> str:
    """The first three of ``paths``, quoted, then "..." where there are more (pure)."""
    return ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")


#: What every :class:`Drift` message says to do.
REBUILD = "rebuild the root (`featbake build`) to match the data"

UNLISTED = Drift(
    "have no row in {data} now (removed or renamed since the build)",
    "their columns are exported empty (null)",
    "export their columns empty",
)
CHANGED = Drift(
    "changed in {data} since the build (the bytes their features were computed from are not "
    "there now)",
    "they are left out",
    "leave them out",
)
UNCHECKED = Drift(
    "cannot be read from {data} now (their files removed or unreadable since the build), so "
    "whether they changed is unknown",
    "they are exported as built",
    "export them as built",
)


def drift_lines(report: ExportReport) -> list[str]:
    """The warnings of an export some of whose items the root's data no longer matches, one
    line per :class:`Drift`, each over the items the store holds (pure).

    Example:
        >>> report = ExportReport("f", "r-1", 3, 0, (), {}, 0, 0.0, changed=1, unchecked=2)
        >>> for line in drift_lines(report):
        ...     print(line.partition(" (")[0])
        1 of 4 items of root r-1 changed in its data since the build
        2 of 4 items of root r-1 cannot be read from its data now
    """
    counts = ((UNLISTED, report.unlisted), (CHANGED, report.changed),
              (UNCHECKED, report.unchecked))  # fmt: skip
    stored = report.items + report.changed
    lines = [drift.warning(n, stored, report.root) for drift, n in counts if n]
    if report.added:
        lines.append(
            f"{added_head(report.added, report.root)}: they are not exported; {REBUILD}, or "
            "pass --strict-rows to refuse"
        )
    return lines


def added_head(count: int, root: str) -> str:
    """``3 items its data lists now are not in root r-1 (...)`` (pure): the warning's and the
    refusal's opening.

    Example:
        >>> added_head(1, "r-1")
        '1 item its data lists now is not in root r-1 (added since the build, or never built)'
    """
    item, are = ("item", "is") if count == 1 else ("items", "are")
    return (
        f"{count:,} {item} its data lists now {are} not in root {root} (added since the build, "
        "or never built)"
    )


def row_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows as columns (pure): every key any row has, in first-seen order, with None where
    a row lacks it.

    Example:
        >>> row_columns([{"label": 1}, {"label": 2, "text": "hi"}])
        {'label': [1, 2], 'text': [None, 'hi']}
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return {name: [row.get(name) for row in rows] for name in names}


#: The fields every format gives an item itself (Parquet's columns, a webdataset sample's
#: JSON): a carried column of one of these names is renamed (:func:`carried_names`).
RESERVED = ("id", "key")


def any_name(name: str) -> bool:
    """Every name is usable (a Parquet column's, a JSON key's)."""
    return True


def folded(name: str) -> str:
    """``name`` as a case-insensitive, normalising filesystem (macOS, Windows) and a
    case-insensitive reader (DuckDB's columns) compare it (pure): NFC, case folded.

    Example:
        >>> folded("Label") == folded("label"), folded("cafe\u0301") == folded("caf\u00e9")
        (True, True)
    """
    return unicodedata.normalize("NFC", name).casefold()


def carried_names(
    carried: Sequence[str],
    taken: Iterable[str] = (),
    usable: Callable[[str], bool] = any_name,
    prefix: str = "row_",
    occupies: Callable[[str], Sequence[str]] = lambda name: (name,),
) -> dict[str, str]:
    """Each carried column's name in an export (pure), one rule for every format: its own,
    or ``row_<name>`` where the format's own fields (``taken``) hold it or the format cannot
    use it (not ``usable``: a zarr array's name, :func:`featbake.export.zarr.node_name`),
    ``/`` and ``\\`` in it as ``_``, ``row_`` put before it again while another column has
    that name: every column is written, each under a name of its own. A name the format
    cannot use even so (past a file name's 255 bytes, a NUL) is ``row_<its position>``.

    Names are compared as a case-insensitive, normalising filesystem compares them
    (:func:`folded`): of ``Label`` and ``label`` (or an NFC and an NFD ``café``), the first
    keeps its name and the second is ``row_label``, and ``ID`` is taken by ``id``; a column
    alone keeps its name whatever its case. The same rule names the parts (``prefix``
    ``part_``); a name that ``occupies`` several (a Parquet part's column and its ``_shape``)
    is kept only where each is free.

    Example:
        >>> carried_names(["label", "key", "row_key"], taken=RESERVED)
        {'label': 'label', 'key': 'row_row_key', 'row_key': 'row_key'}
        >>> carried_names(["", "a/b", "b"], usable=lambda n: bool(n) and "/" not in n)
        {'': 'row_', 'a/b': 'row_a_b', 'b': 'b'}
        >>> carried_names(["Label", "label", "ID"], taken=RESERVED)
        {'Label': 'Label', 'label': 'row_label', 'ID': 'row_ID'}
        >>> carried_names(["p", "p_shape"], prefix="part_", occupies=lambda n: (n, n + "_shape"))
        {'p': 'p', 'p_shape': 'part_p_shape'}
    """

    def free(name: str) -> set[str] | None:
        """The folded names ``name`` would hold, where each is free and usable; else None."""
        names = occupies(name)
        folds = {folded(n) for n in names}
        ok = usable(name) and len(folds) == len(names) and not folds & used
        return folds if ok else None

    used = {folded(n) for n in taken}
    kept: set[str] = set()
    for name in carried:  # first, every name that is free keeps it, in order
        if (folds := free(name)) is not None:
            used |= folds
            kept.add(name)
    names = {}
    for at, name in enumerate(carried):
        new = name
        if name not in kept:
            new = prefix + name.replace("/", "_").replace("\\", "_")
            if not usable(new):  # unusable whatever is put before it (too long): by position
                new = f"{prefix}{at}"
            while (folds := free(new)) is None:
                new = prefix + new
            used |= folds
        names[name] = new
    return names


def utf8_name(name: str) -> bool:
    """Whether ``name`` is text UTF-8 can hold (pure): not a JSON ``"\\ud800"`` escape's lone
    surrogate, which Arrow and zarr refuse.

    Example:
        >>> utf8_name("café"), utf8_name("\\ud800")
        (True, False)
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_text(text: str) -> str:
    """``text`` as UTF-8 can hold it (pure): a lone surrogate as its escape, the rest as it is.

    Example:
        >>> utf8_text("ok"), utf8_text("a\\ud800")
        ('ok', 'a\\\\ud800')
    """
    if utf8_name(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def cell_text(value: Any) -> str:
    """A carried value as text, where its column is not all numbers (pure): a string as it
    is, nothing (or NaN) as "", a date, time, decimal or bytes as :func:`json_value` writes
    it (no quotes), anything else as JSON (nested values, numbers among text).

    Example:
        >>> cell_text("19a"), cell_text(19), cell_text(None), cell_text({"k": [1]})
        ('19a', '19', '', '{"k": [1]}')
        >>> import datetime
        >>> cell_text(datetime.date(2024, 1, 2)), cell_text(bytes([0, 1])), cell_text(float("nan"))
        ('2024-01-02', '0001', '')
    """
    plain = json_value(value)
    if plain is None:
        return ""
    if isinstance(plain, str):
        return utf8_text(plain)
    return json.dumps(plain, sort_keys=True)


def json_value(value: Any) -> Any:
    """A carried value as JSON holds it (pure): NaN and infinities as null (JSON has no such
    number: a bare ``NaN`` is not JSON), dates and times in ISO 8601, decimals as their text,
    bytes as hex, numpy values as Python's, nested lists and dicts alike; other values that
    are not JSON's as their ``str``. Before, Zarr's text kept JSON's quotes and bytes were a
    Python ``repr``.

    Example:
        >>> json_value({"t": [float("inf"), 1.5], "b": bytes([255])})
        {'t': [None, 1.5], 'b': 'ff'}
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_value(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, np.generic):
        return json_value(value.item())
    return str(value)  # a Decimal, a UUID, ...


@dataclass(frozen=True)
class DataSource:
    """A data folder or file a root was built from: the root's name and its ``data``."""

    root: str
    data: str


def check_free(
    out: Path,
    store: Path,
    *,
    overwrite: bool,
    unfit: Callable[[Path, bool], str | None],
    sources: Sequence[DataSource] = (),
) -> None:
    """Refuse a destination the export would delete wrongly: ``out`` or ``OUT.partial`` in the
    store (or holding it), the data a root was built from (``sources``: the same, or inside
    it: its next scan would find the export), one the format says is not its own (``unfit``:
    why, or None; told whether the path is ``out``, which only a finished featbake export of
    the format may be, or ``OUT.partial``, which a killed one may have left), or ``out``
    existing without ``overwrite``.

    Raises:
        ConfigError: with what to choose instead.
    """
    for path, finished in ((out, True), (out.with_name(out.name + ".partial"), False)):
        if inside_store(path, store):
            raise ConfigError(
                f"{path} is, holds or lies inside the store {store}; export to a path outside it"
            )
        for source in sources:
            if "://" not in source.data and inside_store(path, Path(source.data)):
                raise ConfigError(
                    f"{path} is, holds or lies inside {source.data}, the data root "
                    f"{source.root} was built from; export to a path outside it"
                )
        if (why := unfit(path, finished)) is not None:
            raise ConfigError(why)
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; choose another OUT or pass --overwrite")


def inside_store(path: Path, store: Path) -> bool:
    """Whether ``path`` is, holds or lies inside the store folder ``store``."""
    path_r, store_r = path.resolve(), store.resolve()
    return path_r == store_r or store_r in path_r.parents or path_r in store_r.parents


@contextlib.contextmanager
def exporting_alone(out: Path) -> Iterator[None]:
    """Hold ``OUT.lock`` (an OFD lock) while exporting to ``out``, removed after.

    Two exports to one OUT at once each deleted the other's ``OUT.partial`` as a killed
    export's: both could say "exported" and leave an OUT no reader opens. The second is now
    refused in one line. A lock file removed by the export that held it while another process
    opened it is taken again by name (:func:`~featbake.store.files.is_same_file`).

    Raises:
        ConfigError: another export to ``out`` holds the lock.
    """
    path = out.with_name(out.name + ".lock")
    while True:
        lock = opened_lock(path, os.O_RDWR | os.O_CREAT)  # the one way a lock is opened
        if lock_taken(lock.fd) is Taken.HELD:
            lock.close()
            raise ConfigError(
                f"another export to {out} is running (it holds {path}); wait for it to end, "
                "or choose another OUT"
            )
        if is_same_file(path, lock.fd):
            break
        lock.close()  # the export that held it ended and removed it: take the one there now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        lock.close()


def publish(partial: Path, out: Path) -> None:
    """Move a finished ``partial`` file or folder to ``out``, replacing what was there: a
    killed export leaves only ``partial`` (replaced by the next run), never half an ``out``."""
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    os.replace(partial, out)


#: How many times a stopped export's partial folder is removed again while a library's own
#: threads finish the writes they had started (zarr's I/O loop), and the pause between.
DISCARD_TRIES, DISCARD_PAUSE_S = 20, 0.05


def discard(partial: Path) -> None:
    """Remove what an earlier, killed export left at ``partial``."""
    if partial.is_dir() and not partial.is_symlink():
        shutil.rmtree(partial)
    elif partial.exists() or partial.is_symlink():
        partial.unlink()


def discard_stopped(partial: Path) -> None:
    """Remove the partial output of this export, stopped (Ctrl-C, SIGTERM) or failed, never
    raising over what stopped it.

    A Ctrl-C lands in the main thread while zarr's own I/O thread still writes the chunks it
    was given: ``rmtree`` met files made behind it ("Directory not empty"), and that OSError
    replaced the interrupt (exit 5, "nothing was left there", the partial left behind). It is
    removed again a few times; what still stands is left for the next run, which replaces its
    own ``OUT.partial``."""
    for _ in range(DISCARD_TRIES):
        try:
            discard(partial)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(DISCARD_PAUSE_S)


# == the seam ======================================================================================
# Every format is one implementation of :class:`Format`; :func:`export_with` does the rest the
# same way for all of them (the root chosen, its destination checked, its parts laid out, a
# partial path written and renamed, the report).
@dataclass(frozen=True)
class ExportJob:
    """What a format writes: the root's items (``src``), each part's layout, the carried rows
    (None: none to write), and the partial path to write them to (nothing there yet)."""

    src: ExportSource
    layouts: dict[str, PartLayout]
    rows: Sequence[Mapping[str, Any]] | None
    partial: Path
    progress: ProgressFn | None


class Format(Protocol):
    """One export format: where it may write, and how it writes a job; the bytes written."""

    def check_destination(
        self, out: Path, store: Path, *, overwrite: bool, sources: Sequence[DataSource] = ()
    ) -> None: ...

    def write(self, job: ExportJob) -> int: ...


def export_with(  # noqa: PLR0913  (public API: one keyword per `featbake export` option)
    fmt: Format,
    out: str | os.PathLike[str],
    *,
    cache: StoreRef = None,
    root: str | None = None,
    overwrite: bool = False,
    output: str | None = None,
    layers: Sequence[int] | None = None,
    rows_for: RowsFor | None = None,
    progress: ProgressFn | None = None,
    strict_rows: bool = False,
) -> ExportReport:
    """Write the features of one root to ``out`` in the format ``fmt``.

    Args:
        fmt: the format (:class:`featbake.export.zarr.Zarr`, ``parquet.Parquet``,
            ``webdataset.WebDataset``).
        out: what to create (a folder or a file, as the format writes).
        cache: the store.
        root: the root's name or a unique prefix; may be left out when the store has one root.
        overwrite: replace ``out`` if it exists.
        output: export only this part (``--output``); layers: only these hidden layers.
        rows_for: the chosen root's data now (:class:`RootData`: each item's row and its
            input's digest; the CLI reads them from the root's inputs); None: no carried
            columns, and nothing checked. Items whose input changed since the build are left
            out (counted in ``changed``); those whose input cannot be read now are exported
            as built (``unchecked``), every item where the data cannot be opened.
        progress: called with ``GcProgress("export", items done, items)``.
        strict_rows: refuse (before writing anything) where the data lists no row for some
            items (removed or renamed since the build), some inputs changed since the build
            or cannot be read now, or the data cannot be read at all (``rows_for`` None):
            every :class:`Drift`.

    Raises:
        ConfigError: no such root, several roots and none chosen, ``out`` exists or is not the
            format's, shapes that fit no layout; every stored item's input changed since the
            build; under ``strict_rows``, items the data does not match.
        StoreCorrupt: a stored feature fails its checksum.
    """
    started = time.perf_counter()
    out = Path(out)
    if out.name in ("", ".", ".."):  # "." is the folder it names: checked as one
        out = Path(os.path.abspath(out))
    if not out.name:
        raise ConfigError(f"OUT {out} is the filesystem's root; give a path such as feats.zarr")
    if not out.parent.is_dir():  # no format makes it (zarr did: left behind a failed export)
        what = "is not a folder" if out.parent.exists() else "does not exist"
        raise ConfigError(
            f"the folder {out.parent} of OUT {what}; create it, or choose an OUT in a folder "
            "that exists"
        )
    with exporting_alone(out):
        return _export_alone(fmt, out, started, cache, root, overwrite, output, layers,
                             rows_for, progress, strict_rows)  # fmt: skip


def _export_alone(  # noqa: PLR0913  (export_with's arguments, passed on)
    fmt: Format,
    out: Path,
    started: float,
    cache: StoreRef,
    root: str | None,
    overwrite: bool,
    output: str | None,
    layers: Sequence[int] | None,
    rows_for: RowsFor | None,
    progress: ProgressFn | None,
    strict_rows: bool,
) -> ExportReport:
    """:func:`export_with`'s work, while it holds ``OUT.lock``."""
    src = open_source(
        cache, root, output=output, layers=layers,
        check=lambda layout, sources: fmt.check_destination(
            out, layout.root, overwrite=overwrite, sources=sources
        ),
    )  # fmt: skip
    data = rows_for(src.root) if rows_for is not None else None
    if strict_rows and data is None and rows_for is not None:
        raise ConfigError(
            f"the rows of root {src.root.name} cannot be read from its data {src.root.data}; "
            "drop --strict-rows to export keys and ids without them"
        )
    src, matched = matched_to(src, data, strict_rows=strict_rows)
    if data is None and rows_for is not None:  # the data cannot be opened: nothing checked
        matched = Matched(unchecked=[path for path, _ in src.present])
    layouts = part_layouts(src)
    rows = matched.rows
    partial = out.with_name(out.name + ".partial")
    discard(partial)
    try:
        written = fmt.write(ExportJob(src, layouts, rows, partial, progress))
    except BaseException:  # a failed or interrupted export leaves nothing (a killed one leaves
        discard_stopped(partial)  # OUT.partial, which the next run replaces)
        raise
    publish(partial, out)
    return ExportReport(
        str(out),
        src.root.name,
        len(src.present),
        src.missing,
        tuple(layouts),
        {p: "ragged" if lay.ragged else "dense" for p, lay in layouts.items()},
        written,
        time.perf_counter() - started,
        unlisted=len(matched.unlisted),
        changed=len(matched.changed),
        unchecked=len(matched.unchecked),
        added=len(matched.added),
    )
