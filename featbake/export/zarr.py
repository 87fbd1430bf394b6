"""``featbake export --format zarr``: a root's features out to a Zarr (v3) store.

The result is readable by zarr, xarray or dask without featbake. Per output part (the top-level
group for a single-output encoder, else one sub-group per part, named by the part or
``part_<name>`` where that would clash: the ``part_groups`` attribute, :func:`part_groups`):

* variable length (first dimension differs between items): ``values [sum T, ...]`` with the items
  concatenated along the first axis, ``offsets [N + 1]`` (item ``i`` is
  ``values[offsets[i]:offsets[i + 1]]``) and ``lengths [N]``;
* fixed size: a dense ``values [N, ...]``;

and ``keys [N]``, ``paths [N]`` (each item's id: its path relative to the root's data folder, a
manifest row's id) at the top, in the manifest's order, and under ``columns/`` (named by the
``columns`` attribute) one array per
column the items' rows carry (a manifest's labels, a tar's ``.cls``: int64 where every item has
a whole number, float64 where every value is a number, NaN where missing, else text, with JSON
for nested values; a name zarr cannot take, such as the unnamed index column of a CSV pandas
wrote, as ``row_<name>``, Parquet's rule for its own names). Items not stored are left out
and counted in ``missing``. Values are chunked to ~8 MiB along the first axis, uncompressed
unless ``compression="zstd"`` (see :class:`~featbake.export.source.Compression`), written to
``OUT.partial`` and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from featbake.errors import ConfigError
from featbake.export.source import (
    Compression,
    DataSource,
    ExportJob,
    ExportReport,
    ExportSource,
    OutputFile,
    PartLayout,
    ReadAhead,
    ReadGroup,
    carried_names,
    cell_text,
    check_free,
    compression_of,
    export_with,
    row_columns,
    served_dtype,
    utf8_name,
)
from featbake.version import __version__

CHUNK_BYTES = 8 * 1024 * 1024


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


def _rows_per_chunk(row_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def _replace_problem(path: Path, finished: bool) -> str | None:
    """Why the folder ``path`` may not be replaced by the export (None: it may). An empty
    folder may, and what an earlier export left: one a killed or stopped export began
    (``OUT.partial``) holds only Zarr's files (:func:`_zarr_file`), its top ``zarr.json``
    perhaps removed already; a finished one (OUT) is a Zarr v3 group whose attributes name
    ``featbake_version`` (another program's Zarr store is not replaced) and that holds no node,
    attribute or file the export did not write (:func:`_added_to_export`): an array of labels
    a user added beside the features was deleted by ``--overwrite`` without a word."""
    meta = path / "zarr.json"
    if not finished:
        if all(_zarr_file(rel) for rel in _files_beside_chunks(path)):
            return None
        return _not_exported(path)
    if not meta.is_file():
        return None if not any(path.iterdir()) else _not_exported(path)
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError):
        return _not_exported(path)
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(attributes, dict) or "featbake_version" not in attributes:
        return _not_exported(path)
    added = _added_to_export(path, attributes)
    if not added:
        return None
    return (
        f"{path} holds {', '.join(added[:3])}{' and more' if len(added) > 3 else ''}, which the "
        "export did not write; the export would delete them, so move them out first or "
        "choose another OUT"
    )


def _not_exported(path: Path) -> str:
    return (
        f"{path} is a folder that is not a Zarr store featbake exported; the export would "
        "delete its contents, so choose another OUT (or move that folder away)"
    )


#: The top group's attributes an export writes (:func:`_open_partial`).
EXPORT_ATTRIBUTES = frozenset({
    "featbake_version", "root", "data", "encoder", "encoder_fp", "recipe_fp", "recipe", "items",
    "missing", "parts", "part_groups", "layouts", "columns",
})  # fmt: skip

#: The arrays of a part's group.
PART_ARRAYS = frozenset({"values", "offsets", "lengths"})


def _added_to_export(path: Path, attributes: Mapping[str, Any]) -> list[str]:
    """What a finished export at ``path`` holds that the export did not write (by its
    ``attributes``: its parts, their groups and layouts): top attributes, nodes beside its own
    (a dense part has no ``offsets`` or ``lengths``), attributes of any other node (the export
    writes none there), and files that are not Zarr's (``columns/`` holds the root's own
    columns, any names)."""
    added = [f"attribute {name!r}" for name in attributes if name not in EXPORT_ATTRIBUTES]
    named = attributes.get("part_groups")
    if not isinstance(named, dict):  # an export before 2026-11-30: each part's group its name
        parts = attributes.get("parts")
        named = {str(p): str(p) for p in parts} if isinstance(parts, list) else {"": ""}
    layouts = attributes.get("layouts")
    layouts = layouts if isinstance(layouts, dict) else {}
    nested = {str(g).split("/")[0] for g in named.values() if "/" in str(g)}  # before part_groups
    groups = {str(g): _part_arrays(layouts.get(p)) for p, g in named.items() if "/" not in str(g)}
    top = {"zarr.json", *TOP_NAMES, *nested, *groups.pop("", ())}
    for child in sorted(path.iterdir()):
        if child.name in groups and child.is_dir():
            own = groups[child.name] | {"zarr.json"}
            added += [
                f"{child.name}/{c.name}" for c in sorted(child.iterdir()) if c.name not in own
            ]
        elif child.name not in top:
            added.append(child.name)
    columns = attributes.get("columns")  # an export before 2026-12-03: any names there
    if isinstance(columns, list) and (path / "columns").is_dir():
        own_columns = {*map(str, columns), "zarr.json"}
        added += [f"columns/{c.name}" for c in sorted((path / "columns").iterdir())
                  if c.name not in own_columns]  # fmt: skip
    named = set(added)  # what lies under a node named already is not named again
    for rel in sorted(_files_beside_chunks(path)):
        if any(p.as_posix() in named for p in (rel, *rel.parents)):
            continue
        if rel.name != "zarr.json":
            if not _zarr_file(rel):
                added.append(str(rel))
        elif rel.parent != Path(".") and _node_attributes(path / rel):
            added.append(f"the attributes of {rel.parent.as_posix()}")
    return added


def _files_beside_chunks(path: Path) -> Iterator[Path]:
    """Every file under ``path`` (relative to it) but those in a ``c`` folder: chunks, which
    are Zarr's own whatever their names, and the bulk of an export's files (one walk, none of
    them listed); a link to a folder as itself."""
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != "c"]
        here = Path(folder).relative_to(path)
        yield from (here / name for name in files)
        # a link to a folder is not walked into: named itself, never a Zarr file
        yield from (here / d for d in dirs if os.path.islink(os.path.join(folder, d)))


def _part_arrays(layout: object) -> frozenset[str]:
    """The arrays an export writes in a part's group, by its ``layouts`` attribute: a dense
    part's ``values`` alone (any of them where the layout is not said)."""
    return frozenset({"values"}) if layout == "dense" else PART_ARRAYS


def _node_attributes(meta: Path) -> bool:
    """Whether the node whose ``zarr.json`` is ``meta`` holds attributes (or cannot be read)."""
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(doc, dict) or bool(doc.get("attributes"))


def _zarr_file(rel: Path) -> bool:
    """Whether a file at ``rel`` inside a Zarr v3 store is one of Zarr's own: a node's
    ``zarr.json``, zarr's temporary file of one (``zarr.<hex>.partial``, left by a kill within
    its rename: a rerun refused its own export's leftover as another program's) or a chunk (a
    path through a ``c`` folder)."""
    name = rel.name
    temporary = name.startswith("zarr.") and name.endswith(".partial")
    return name == "zarr.json" or temporary or "c" in rel.parts[:-1]


def check_destination(
    out: Path, store: Path, *, overwrite: bool, sources: Sequence[DataSource] = ()
) -> None:
    """Refuse an export destination that the export would have to delete wrongly.

    The export writes ``OUT.partial`` and renames it to ``OUT``, deleting what was there: so
    neither may be (inside) the store or the data a root was built from (``sources``) or hold
    them, a file, or a folder that is not a Zarr store.

    Raises:
        ConfigError: ``out`` is unsafe to write, with what to choose instead.

    Example:
        >>> check_destination(Path("f.zarr"), Path(".featbake"), overwrite=True)  # doctest: +SKIP
    """
    check_free(out, store, overwrite=overwrite, unfit=_not_zarr, sources=sources)


def _not_zarr(path: Path, finished: bool) -> str | None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return f"{path} is a file or a link, not a Zarr folder; remove it or choose another OUT"
    return _replace_problem(path, finished) if path.is_dir() else None


#: Chunks of ``values`` written per call to zarr (over all parts): enough for its codec
#: pipeline to encode and store several at once, few enough to keep one block per part small.
CHUNKS_PER_WRITE = 8


@dataclass(frozen=True)
class Zarr:
    """The Zarr v3 format (see the module's doc); ``compression`` of the feature values
    (uncompressed by default: see :class:`~featbake.export.source.Compression`)."""

    compression: Compression = Compression.NONE
    check_destination = staticmethod(check_destination)

    def __post_init__(self) -> None:
        value_codecs(self.compression)  # snappy refused here, before anything is opened

    def write(self, job: ExportJob) -> int:
        """The values copied as their items are read ahead, while the arrays beside them
        (keys, paths, columns, offsets, lengths: small, but each a few zarr calls, 12 ms of
        the benchmark's 0.15 s) are written on a thread of their own."""
        # the first runs are read while zarr creates the store
        with ReadAhead(job.src, GROUP_BYTES, job.progress) as runs:
            top, groups, writers = _open_partial(
                job.partial, job.src, job.layouts, self.compression, job.rows
            )
            with ThreadPoolExecutor(1, thread_name_prefix="featbake-export-index") as pool:
                index = pool.submit(_write_index, top, groups, job.src, job.layouts, job.rows)
                written = _copy_features(runs, writers)
                index.result()
        return written


def value_codecs(compression: Compression) -> Any:
    """The ``compressors`` of a part's ``values``: none, or zstd as zarr's own default.

    Raises:
        ConfigError: a compression zarr does not offer (snappy).
    """
    import zarr.codecs

    if compression is Compression.SNAPPY:
        raise ConfigError("a zarr export compresses with none or zstd, not snappy; choose one")
    if compression is Compression.ZSTD:
        return zarr.codecs.ZstdCodec(level=0, checksum=False)
    return None


def export_zarr(
    out: str | os.PathLike[str], *, compression: str = Compression.NONE, **options: Any
) -> ExportReport:
    """Write the features of one root to a Zarr v3 store at ``out`` (a folder, e.g.
    ``feats.zarr``); ``compression`` of the values (``"none"``, ``"zstd"``); ``options`` are
    :func:`featbake.export.source.export_with`'s (``cache``, ``root``, ``overwrite``,
    ``output``, ``layers``, ``rows_for``, ``progress``).

    Raises:
        ConfigError: no such root, several roots and none chosen, ``out`` exists, or shapes that
            fit no layout.
        StoreCorrupt: a stored feature fails its checksum.

    Example:
        >>> export_zarr("feats.zarr", cache=".featbake")  # doctest: +SKIP
        >>> import zarr; g = zarr.open_group("feats.zarr", mode="r")  # doctest: +SKIP
        >>> g["values"][g["offsets"][0] : g["offsets"][1]]  # doctest: +SKIP
    """
    return export_with(Zarr(compression_of(compression)), out, **options)


def _open_partial(
    partial: Path,
    src: ExportSource,
    layouts: dict[str, PartLayout],
    compression: Compression,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any], dict[str, _PartWriter]]:
    """Create ``OUT.partial`` with its attributes and each part's group and ``values``; the
    root group, and each part's group and values writer, by part. The ``columns`` attribute
    names the arrays ``columns/`` will hold (``rows``' columns), so that ``--overwrite`` can
    tell an array a user added there from the export's own (:func:`_added_to_export`)."""
    import zarr

    if partial.exists():
        shutil.rmtree(partial)
    # v3 whatever ZARR_DEFAULT_ZARR_FORMAT says: dimension names and the chunk files written
    # here (plain_chunks) are v3's
    group = zarr.open_group(str(partial), mode="w", zarr_format=3)
    chosen, n = src.root, len(src.present)
    group.update_attributes(  # at once: attrs.update rewrote zarr.json once per key
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
            "part_groups": part_groups(list(layouts)),
            "layouts": {p: "ragged" if lay.ragged else "dense" for p, lay in layouts.items()},
            "columns": column_nodes(rows or ()),
        }
    )
    named = part_groups(list(layouts))
    groups = {part: group if part == "" else group.create_group(named[part]) for part in layouts}
    codecs, per_write = value_codecs(compression), max(1, CHUNKS_PER_WRITE // len(layouts))
    writers: dict[str, _PartWriter] = {}
    try:
        for part, lay in layouts.items():
            writers[part] = _PartWriter(groups[part], lay, n, codecs, per_write)
    except BaseException:  # a full disk at the second part: the first's chunk file is open
        for writer in writers.values():
            writer.close()
        raise
    return group, groups, writers


def _write_index(
    top: Any,
    groups: Mapping[str, Any],
    src: ExportSource,
    layouts: Mapping[str, PartLayout],
    rows: Sequence[Mapping[str, Any]] | None,
) -> None:
    """The arrays beside the values: ``keys``, ``paths`` and ``columns/`` at the top, each
    ragged part's ``offsets`` and ``lengths``."""
    n = len(src.present)
    for name, values in (("keys", [k for _, k in src.present]),
                         ("paths", [p for p, _ in src.present])):  # fmt: skip
        top.create_array(
            name, shape=(n,), chunks=(min(n, 65536),), dtype=str, dimension_names=(ITEM,)
        )[:] = np.array(values)
    if rows is not None:
        _write_columns(top, rows)
    for part, lay in layouts.items():
        if not lay.ragged:
            continue
        groups[part].create_array(
            "offsets", shape=(n + 1,), chunks=(min(n + 1, 1 << 20),), dtype="int64",
            dimension_names=(ITEM_EDGE,),
        )[:] = np.concatenate([[0], np.cumsum(lay.lengths, dtype=np.int64)])  # fmt: skip
        groups[part].create_array(
            "lengths", shape=(n,), chunks=(min(n, 1 << 20),), dtype="int64",
            dimension_names=(ITEM,),
        )[:] = np.array(lay.lengths, dtype=np.int64)  # fmt: skip


def column_nodes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of the arrays :func:`_write_columns` writes under ``columns/`` for ``rows``
    (pure).

    Example:
        >>> column_nodes([{"label": 1}, {"a/b": 2}]), column_nodes([])
        (['label', 'row_a_b'], [])
    """
    names = dict.fromkeys(name for row in rows for name in row)
    return list(carried_names(list(names), usable=node_name).values())


def _write_columns(group: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """The rows' columns under ``columns/``, one array per column (see the module's doc), a
    name zarr cannot take as ``row_<name>`` (:func:`node_name`)."""
    columns = row_columns(rows)
    if not columns:
        return
    sub = group.create_group("columns")
    n = len(rows)
    names = carried_names(list(columns), usable=node_name)
    for name, values in columns.items():
        array = column_array(values)
        sub.create_array(
            names[name], shape=(n,), chunks=(min(max(n, 1), 65536),), dtype=array.dtype
            if array.dtype != object else str, dimension_names=(ITEM,),
        )[:] = array  # fmt: skip


#: The top group's own arrays and groups, beside the parts' groups.
TOP_NAMES = ("keys", "paths", "columns")


def part_groups(parts: Sequence[str]) -> dict[str, str]:
    """Each part's group (pure): the top group for a single-output encoder's one part (``""``),
    else the part's name, or ``part_<name>`` where it is the top group's own (``keys``,
    ``paths``, ``columns``), another part's regardless of case (:func:`~featbake.export.
    source.carried_names`), or a name zarr cannot take (:func:`node_name`: ``a/b`` as
    ``part_a_b``). The store's ``part_groups`` attribute names each part's.

    Example:
        >>> part_groups([""]), part_groups(["pooled", "tokens"])
        ({'': ''}, {'pooled': 'pooled', 'tokens': 'tokens'})
        >>> part_groups(["Pooled", "pooled", "keys", "a/b"])
        {'Pooled': 'Pooled', 'pooled': 'part_pooled', 'keys': 'part_keys', 'a/b': 'part_a_b'}
    """
    if list(parts) == [""]:
        return {"": ""}
    return carried_names(parts, TOP_NAMES, usable=node_name, prefix="part_")


def node_name(name: str) -> bool:
    """Whether a carried column's name can name its array under ``columns/`` (pure): not
    empty (the group itself: a CSV written by pandas with its index), no ``/`` or ``\\`` (a
    path) or NUL, not ``.``, ``..`` or the group's own ``zarr.json``, UTF-8 (no lone
    surrogate) of at most :data:`NAME_BYTES` bytes (a file name's most).

    Example:
        >>> node_name("label"), node_name(""), node_name("a/b"), node_name("zarr.json")
        (True, False, False, False)
    """
    return (
        name not in ("", ".", "..", "zarr.json")
        and not any(c in name for c in "/\\\0")
        and utf8_name(name)
        and len(name.encode("utf-8")) <= NAME_BYTES
    )


#: The bytes of a file name (ext4's, APFS's, NTFS's 255 UTF-16 units at least this).
NAME_BYTES = 255


def column_array(values: Sequence[Any]) -> np.ndarray:
    """A column's values as one typed array (pure), each exact, as Parquet types the column
    (``parquet._carried_array``): int64 where each is a whole number within int64, float64
    where each is a number or missing (NaN) and each whole number is a float64 exactly, else
    text (missing: "", nested values as JSON): so a uint64 hash past 2**63-1, a whole number
    past uint64, or 2**60+1 beside a missing value is written as text, never rounded.

    Example:
        >>> column_array([1, 2]).dtype, column_array([1, None]).tolist()[1], column_array(["a", 2])
        (dtype('int64'), nan, array(['a', '2'], dtype=object))
        >>> column_array([2**64 - 1, 7]).tolist(), column_array([2**60 + 1, None]).tolist()
        (['18446744073709551615', '7'], ['1152921504606846977', ''])
    """
    numbers = [v for v in values if v is not None]
    whole = all(_whole(v) and _INT64[0] <= v <= _INT64[1] for v in numbers)
    if numbers and whole and len(numbers) == len(values):
        return np.array(values, dtype=np.int64)
    if numbers and all(_exact_float(v) for v in numbers):
        return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    return np.array([cell_text(v) for v in values], dtype=object)


_INT64 = (-(2**63), 2**63 - 1)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _exact_float(value: Any) -> bool:
    """Whether ``value`` is a float, or a whole number float64 holds exactly (Arrow's test)."""
    if isinstance(value, float):
        return True
    return _whole(value) and -(2**53) <= value <= 2**53


def _copy_features(runs: ReadAhead, writers: dict[str, _PartWriter]) -> int:
    """Each run of items read ahead into its parts' writers; the bytes written."""
    written = 0
    try:
        for run in runs:
            for part, writer in writers.items():
                writer.add_run(run, part)
            written += run.nbytes
        for w in writers.values():
            w.flush()
    finally:
        for w in writers.values():
            w.close()
    return written


#: Bytes of items read ahead at a time (three such buffers: within the L3 cache here).
GROUP_BYTES = 4 * 1024 * 1024


class _PartWriter:
    """One part's ``values``, appended item by item, through :class:`ChunkFiles` where its
    chunks are plain bytes (no compressor), else through :class:`_Blocks` (zarr's own codec
    pipeline)."""

    def __init__(
        self, group: Any, lay: PartLayout, n: int, compressors: Any, chunks_per_write: int
    ) -> None:
        self.lay = lay
        dtype = served_dtype(lay.dtype)
        row_bytes = int(np.prod(lay.trailing, dtype=np.int64)) * dtype.itemsize
        rows = int(np.sum(lay.lengths, dtype=np.int64)) if lay.ragged else n
        shape = (rows, *lay.trailing)
        chunk_rows = min(max(1, rows), _rows_per_chunk(row_bytes))
        values = group.create_array(
            "values", shape=shape, chunks=(chunk_rows, *shape[1:]), dtype=dtype,
            dimension_names=value_dims(lay.ragged, len(lay.trailing)), compressors=compressors,
        )  # fmt: skip
        self.out: ChunkFiles | _Blocks = (
            ChunkFiles(values, chunk_rows * row_bytes)
            if plain_chunks(values)
            else _Blocks(values, chunk_rows, chunks_per_write)
        )

    def add_run(self, run: ReadGroup, part: str) -> None:
        """Append a run's items of ``part`` (an item's rows; a dense item is one row)."""
        if isinstance(self.out, ChunkFiles):  # the run's bytes at once: one write a chunk
            self.out.add(run.flat(part))
            return
        for a in run.parts[part]:
            self.out.add(a if self.lay.ragged else a[None])

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        """Close the values' open files (after :meth:`flush`, or midway on an error)."""
        if isinstance(self.out, ChunkFiles):
            self.out.close()


def plain_chunks(values: Any) -> bool:
    """Whether zarr stores ``values``' chunks as their plain little-endian bytes, zero-filled
    past the array's end: one ``bytes`` codec, no filter or compressor, a fill value of 0, a
    local folder (what an uncompressed export creates)."""
    import zarr.codecs
    from zarr.storage import LocalStore

    codecs = values.metadata.codecs
    return (
        isinstance(values.store_path.store, LocalStore)
        and len(codecs) == 1
        and isinstance(codecs[0], zarr.codecs.BytesCodec)
        and (codecs[0].endian is None or codecs[0].endian.value == sys.byteorder)
        and sys.byteorder == "little"
        and not np.any(np.asarray(values.metadata.fill_value))
    )


class ChunkFiles:
    """Writes an uncompressed array's chunk files itself, in order: the items' bytes one after
    another, a new file every ``chunk_bytes``, the last padded with zeros (its fill value) to
    a whole chunk, as zarr stores an edge chunk.

    zarr's own write copies each chunk through its codec pipeline and buffers before the file
    (zarr alone wrote the benchmark's array at 1.3-2.8 GB/s, against the page cache's 4-6);
    an uncompressed chunk is the array's bytes, so they go from the read's buffer to the file.
    Each next chunk's folder and file are created on a thread of their own while the current
    one is written: a ``mkdir`` and an ``open`` took 0.3-0.6 ms each here, a sixth of the
    export's time for a float32 array of 75 chunks.
    """

    def __init__(self, values: Any, chunk_bytes: int) -> None:
        self.values, self.chunk_bytes = values, chunk_bytes
        self.root = Path(values.store_path.store.root) / values.path
        self.trailing = (0,) * (values.ndim - 1)
        self.count = -(-values.shape[0] // values.chunks[0]) if values.shape[0] else 0
        self.index, self.filled = 0, 0
        self.file: OutputFile | None = None
        self.opener = ThreadPoolExecutor(1, thread_name_prefix="featbake-export-open")
        self.next: Future[OutputFile] | None = self._open_ahead(0)

    def add(self, data: memoryview) -> None:
        """Append ``data``, rows' bytes, to the values."""
        while data.nbytes:
            if self.file is None:
                self.file = self._take()
            take = min(data.nbytes, self.chunk_bytes - self.filled)
            self.file.write([data[:take]])
            self.filled, data = self.filled + take, data[take:]
            if self.filled == self.chunk_bytes:
                self._close()

    def flush(self) -> None:
        """Pad the last chunk to its whole size and close it."""
        if self.file is not None:
            self.file.write([bytes(self.chunk_bytes - self.filled)])
            self._close()

    def close(self) -> None:
        """Close what is open (the chunk being written, the next one opened ahead) and the
        opening thread: after :meth:`flush`, or when the export stops midway."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.next is not None:
            with contextlib.suppress(OSError):
                self.next.result().close()
            self.next = None
        self.opener.shutdown()

    def _open_ahead(self, index: int) -> Future[OutputFile] | None:
        return self.opener.submit(self._open, index) if index < self.count else None

    def _take(self) -> OutputFile:
        """The file of chunk ``index`` (opened ahead), and the next one's opening started."""
        if self.next is None:
            raise ConfigError(f"{self.root} holds {self.count} chunks; more bytes came")
        file = self.next.result()
        self.next = self._open_ahead(self.index + 1)
        return file

    def _open(self, index: int) -> OutputFile:
        path = self.root / self.values.metadata.encode_chunk_key((index, *self.trailing))
        path.parent.mkdir(parents=True, exist_ok=True)
        return OutputFile(path, expect=self.chunk_bytes)

    def _close(self) -> None:
        assert self.file is not None
        self.file.close()
        self.file, self.filled, self.index = None, 0, self.index + 1


class _Blocks:
    """Appends rows to a compressed ``values``, copying them into one reused block of
    ``chunks_per_write`` whole chunks and writing the block once full: zarr encodes and stores
    the chunks of one write concurrently, and a block written one chunk at a time kept it
    serial."""

    def __init__(self, values: Any, chunk_rows: int, chunks_per_write: int) -> None:
        self.values = values
        rows = values.shape[0]
        block_rows = min(max(1, rows), chunk_rows * chunks_per_write)
        self.block = np.empty((block_rows, *values.shape[1:]), dtype=values.dtype)
        self.filled = 0  # rows in the block
        self.at = 0  # rows written

    def add(self, a: np.ndarray) -> None:
        """Copy rows into the block (writing each block that fills)."""
        start = 0
        while start < len(a):
            take = min(len(a) - start, len(self.block) - self.filled)
            self.block[self.filled : self.filled + take] = a[start : start + take]
            self.filled, start = self.filled + take, start + take
            if self.filled == len(self.block):
                self.flush()

    def flush(self) -> None:
        """Write the rows in the block (whole chunks, but for the array's last)."""
        if self.filled:
            self.values[self.at : self.at + self.filled] = self.block[: self.filled]
            self.at, self.filled = self.at + self.filled, 0
