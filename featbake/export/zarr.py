"""``featbake export --format zarr``: a root's features out to a Zarr (v3) store.

The result is readable by zarr, xarray or dask without featbake. Per output part (the top-level
group for a single-output encoder, else one sub-group per part):

* variable length (first dimension differs between items): ``values [sum T, ...]`` with the items
  concatenated along the first axis, ``offsets [N + 1]`` (item ``i`` is
  ``values[offsets[i]:offsets[i + 1]]``) and ``lengths [N]``;
* fixed size: a dense ``values [N, ...]``;

and ``keys [N]``, ``paths [N]`` (relative to the root's data folder) at the top, in the
manifest's order; items not stored are left out and counted in ``missing``. Values are chunked
to ~8 MiB along the first axis, written to ``OUT.partial`` and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featbake.errors import ConfigError, StoreError
from featbake.progress import GcProgress
from featbake.store.catalog import QUANTISED, Catalog, Location, Root
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.store.open import StoreRef, open_catalog, resolve_root
from featbake.version import __version__

CHUNK_BYTES = 8 * 1024 * 1024
_READ_BATCH = 256
_NUMPY_DTYPE = {  # zarr has no bfloat16: BF16 is widened exactly to float32
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "float32", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: Dimension names (zarr v3 ``dimension_names``, which xarray.open_zarr needs): one per item
#: (keys, paths, lengths, dense values), one per item boundary (ragged offsets), one per
#: frame of the concatenated ragged values, and the trailing axes ("feature" the last).
ITEM, ITEM_EDGE, FRAME, FEATURE = "item", "item_edge", "frame", "feature"


def value_dims(ragged: bool, trailing: int) -> tuple[str, ...]:
    """Dimension names of a part's ``values``: (item|frame, [axis1, ...], feature).

    Example:
        >>> value_dims(True, 1), value_dims(False, 2), value_dims(False, 0)
        (('frame', 'feature'), ('item', 'axis1', 'feature'), ('item',))
    """
    lead = FRAME if ragged else ITEM
    middle = tuple(f"axis{i}" for i in range(1, trailing))
    return (lead, *middle, FEATURE) if trailing else (lead,)


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


def _rows_per_chunk(row_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def _is_replaceable_export(path: Path) -> bool:
    """An empty folder, or a Zarr v3 store (what an earlier or interrupted export left)."""
    return (path / "zarr.json").is_file() or not any(path.iterdir())


def check_destination(out: Path, store: Path, *, overwrite: bool) -> None:
    """Refuse an export destination that the export would have to delete wrongly.

    The export writes ``OUT.partial`` and renames it to ``OUT``, deleting what was there: so
    neither may be (inside) the store or hold it, a file, or a folder that is not a Zarr store.

    Raises:
        ConfigError: ``out`` is unsafe to write, with what to choose instead.

    Example:
        >>> check_destination(Path("f.zarr"), Path(".featbake"), overwrite=True)  # doctest: +SKIP
    """
    store_r = store.resolve()
    for path in (out, out.with_name(out.name + ".partial")):
        path_r = path.resolve()
        if path_r == store_r or store_r in path_r.parents or path_r in store_r.parents:
            raise ConfigError(
                f"{path} is, holds or lies inside the store {store}; export to a path outside it"
            )
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ConfigError(
                f"{path} is a file or a link, not a Zarr folder; remove it or choose another OUT"
            )
        if path.is_dir() and not _is_replaceable_export(path):
            raise ConfigError(
                f"{path} is a folder that is not a Zarr store; the export would delete its "
                "contents, so choose another OUT (or move that folder away)"
            )
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; choose another OUT or pass --overwrite")


def export_zarr(
    out: str | os.PathLike[str],
    *,
    cache: StoreRef = None,
    root: str | None = None,
    overwrite: bool = False,
    progress: Callable[[GcProgress], None] | None = None,
) -> ExportReport:
    """Write the features of one root to a Zarr v3 store at ``out``.

    Args:
        out: the directory to create (``something.zarr``).
        cache: the store.
        root: the root's name or a unique prefix; may be left out when the store has one root.
        overwrite: replace ``out`` if it exists.
        progress: called with ``GcProgress("export", items done, items)``.

    Raises:
        ConfigError: no such root, several roots and none chosen, ``out`` exists, or shapes that
            fit no layout.
        StoreCorrupt: a stored feature fails its checksum.

    Example:
        >>> export_zarr("feats.zarr", cache=".featbake")  # doctest: +SKIP
        >>> import zarr; g = zarr.open_group("feats.zarr", mode="r")  # doctest: +SKIP
        >>> g["values"][g["offsets"][0] : g["offsets"][1]]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    out = Path(out)
    src = _source(out, cache, root, overwrite)
    layouts = part_layouts(src)
    partial = out.with_name(out.name + ".partial")
    writers = _open_partial(partial, src, layouts)
    written = _copy_features(src, writers, progress)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    n = len(src.present)
    return ExportReport(
        str(out),
        src.root.name,
        n,
        len(src.manifest) - n,
        tuple(layouts),
        {p: "ragged" if lay.ragged else "dense" for p, lay in layouts.items()},
        written,
        time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class ExportSource:
    """What one export reads: the root, its manifest, and where its stored features are."""

    layout: Layout
    root: Root
    manifest: list[tuple[str, str]]  # (path, key) in manifest order
    present: list[tuple[str, str]]  # the items with a stored feature
    located: dict[str, list[Location]]


def _choose_root(catalog: Catalog, root: str | None) -> Root:
    roots = [resolve_root(catalog, root)] if root is not None else catalog.roots()
    if len(roots) != 1:
        names = ", ".join(r.name for r in roots) or "none"
        raise ConfigError(
            f"the store has {len(roots)} roots ({names}); choose one with --root NAME"
        )
    if (dtype := roots[0].recipe.get("dtype")) in QUANTISED:  # packed: codes + scale bytes
        raise ConfigError(
            f"root {roots[0].name} stores {dtype}, which zarr export does not dequantise yet; "
            "export a float16 build of the folder (featbake build --dtype float16)"
        )
    return roots[0]


def _source(out: Path, cache: StoreRef, root: str | None, overwrite: bool) -> ExportSource:
    layout, catalog = open_catalog(cache)
    try:
        check_destination(out, layout.root, overwrite=overwrite)
        chosen = _choose_root(catalog, root)
        manifest = [(p, k) for p, k in catalog.root_items(chosen.name)]
        located = catalog.locate_many([k for _, k in manifest])
    finally:
        catalog.close()
    present = [(p, k) for p, k in manifest if k in located]
    if not present:
        raise StoreError(
            f"root {chosen.name} has no stored features to export; run `featbake build` first"
        )
    return ExportSource(layout, chosen, manifest, present, located)


def part_layouts(src: ExportSource) -> dict[str, PartLayout]:
    """The layout of each output part, by part name (sorted).

    Raises:
        StoreError: some features lack a part.
        ConfigError: a part is stored in several dtypes, or its shapes fit no layout.
    """
    parts = sorted({loc.part for locs in src.located.values() for loc in locs})
    layouts = {}
    for part in parts:
        locs = [next((x for x in src.located[k] if x.part == part), None) for _, k in src.present]
        found = [loc for loc in locs if loc is not None]
        if len(found) != len(locs):
            raise StoreError(f"some features lack output {part!r}; rebuild root {src.root.name}")
        dtypes = {loc.dtype for loc in found}
        if len(dtypes) != 1:
            raise ConfigError(f"output {part!r} is stored in several dtypes: {sorted(dtypes)}")
        layouts[part] = plan_layout(part, dtypes.pop(), [loc.shape for loc in found])
    return layouts


def _open_partial(
    partial: Path, src: ExportSource, layouts: dict[str, PartLayout]
) -> dict[str, _PartWriter]:
    """Create ``OUT.partial`` with its attributes, keys and paths; a writer per part."""
    import zarr

    if partial.exists():
        shutil.rmtree(partial)
    group = zarr.open_group(str(partial), mode="w")
    chosen, n = src.root, len(src.present)
    group.attrs.update(
        {
            "featbake_version": __version__,
            "root": chosen.name,
            "data": chosen.data,
            "encoder": chosen.encoder_label,
            "encoder_fp": chosen.encoder_fp,
            "recipe_fp": chosen.recipe_fp,
            "recipe": json.loads(json.dumps(chosen.recipe)),
            "items": n,
            "missing": len(src.manifest) - n,
            "parts": list(layouts),
            "layouts": {p: "ragged" if lay.ragged else "dense" for p, lay in layouts.items()},
        }
    )
    str_chunk = min(n, 65536)
    for name, values in (("keys", [k for _, k in src.present]),
                         ("paths", [p for p, _ in src.present])):  # fmt: skip
        group.create_array(
            name, shape=(n,), chunks=(str_chunk,), dtype=str, dimension_names=(ITEM,)
        )[:] = np.array(values)
    return {
        part: _PartWriter(group if part == "" else group.create_group(part), lay, n)
        for part, lay in layouts.items()
    }


def _copy_features(
    src: ExportSource,
    writers: dict[str, _PartWriter],
    progress: Callable[[GcProgress], None] | None,
) -> int:
    """Read every present feature (checksummed) into the writers; returns the bytes written."""
    reader = FeatureReader(src.layout, verify="always")
    n, written = len(src.present), 0
    try:
        for start in range(0, n, _READ_BATCH):
            keys = [k for _, k in src.present[start : start + _READ_BATCH]]
            got = reader.get_many(keys)
            for key in keys:
                if key not in got:
                    raise StoreError(
                        f"feature {key} vanished during the export (gc ran, or its shard was "
                        "removed by hand); run the export again, after `featbake verify "
                        "--repair` if this persists"
                    )
                for part, t in got[key].items():
                    written += writers[part].add(t)
            if progress:
                progress(GcProgress("export", min(n, start + _READ_BATCH), n))
        for w in writers.values():
            w.flush()
    finally:
        reader.close()
    return written


class _PartWriter:
    """Appends items to a part's arrays, writing whole chunks at a time."""

    def __init__(self, group: Any, lay: PartLayout, n: int) -> None:
        self.lay = lay
        dtype = _NUMPY_DTYPE[lay.dtype]
        row_bytes = int(np.prod(lay.trailing, dtype=np.int64)) * np.dtype(dtype).itemsize
        self.dtype = dtype
        if lay.ragged:
            offsets = np.concatenate([[0], np.cumsum(lay.lengths, dtype=np.int64)])
            rows = int(offsets[-1])
            group.create_array(
                "offsets", shape=(n + 1,), chunks=(min(n + 1, 1 << 20),), dtype="int64",
                dimension_names=(ITEM_EDGE,),
            )[:] = offsets  # fmt: skip
            group.create_array(
                "lengths", shape=(n,), chunks=(min(n, 1 << 20),), dtype="int64",
                dimension_names=(ITEM,),
            )[:] = np.array(lay.lengths, dtype=np.int64)  # fmt: skip
            shape = (rows, *lay.trailing)
        else:
            rows = n
            shape = (n, *lay.trailing)
        self.chunk_rows = min(max(1, rows), _rows_per_chunk(row_bytes))
        self.values = group.create_array(
            "values", shape=shape, chunks=(self.chunk_rows, *shape[1:]), dtype=dtype,
            dimension_names=value_dims(lay.ragged, len(lay.trailing)),
        )  # fmt: skip
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.at = 0  # rows written

    def add(self, t: torch.Tensor) -> int:
        a = t.to(torch.float32).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        if not self.lay.ragged:
            a = a[None]
        self.buf.append(a)
        self.buffered += a.shape[0]
        if self.buffered >= self.chunk_rows:
            self._write(whole_chunks=True)
        return a.nbytes

    def _write(self, whole_chunks: bool) -> None:
        if not self.buf:
            return
        block = np.concatenate(self.buf, axis=0)
        take = (block.shape[0] // self.chunk_rows) * self.chunk_rows if whole_chunks else len(block)
        if take:
            self.values[self.at : self.at + take] = block[:take]
            self.at += take
        rest = block[take:]
        self.buf = [rest] if len(rest) else []
        self.buffered = len(rest)

    def flush(self) -> None:
        self._write(whole_chunks=False)
