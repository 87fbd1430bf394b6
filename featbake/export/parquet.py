"""``featbake export --format parquet``: a root's features as one Parquet file, one row per item.

Readable by pyarrow, pandas, DuckDB and ``datasets.load_dataset("parquet", data_files=OUT)``
without featbake. Columns, in this order:

* ``id``: the item's id (its path relative to the root's data folder, a manifest row's id);
* ``key``: its content key in the store;
* one column per exported part (``features`` for a single-output encoder, else the part's name:
  ``pooled``, ``tokens``, ``layer6``; ``part_<name>`` where it or its ``_shape`` would clash,
  regardless of case, with ``id``, ``key`` or another part's: :func:`part_columns`; the
  metadata's ``part_columns`` names each part's), in the stored dtype (bfloat16, which Arrow
  lacks, widened exactly to float32), nested to the item's rank: ``[T, D]`` is a list of
  fixed-size lists of D, so ``datasets`` gives it back as ``T`` rows of ``D`` values; and
  ``<part>_shape``, the shape;
* the columns the items' rows carry (a manifest's labels, a lhotse cut's ``text``), under their
  own names (``row_<name>`` where a name is taken above), null where an item lacks one.

Columns are snappy-compressed (pyarrow's default; ``compression="none"`` or ``"zstd"`` to
choose). The file is written one row group per 64 MiB of features or 256 items, whichever
comes first (no whole store in memory), to ``OUT.partial`` and renamed to ``OUT`` when
complete; its schema metadata names the root, the encoder and the recipe (``featbake`` key,
JSON).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from featbake.export.source import (
    RESERVED,
    Compression,
    DataSource,
    ExportJob,
    ExportReport,
    ExportSource,
    LocatedItem,
    PartLayout,
    ReadAhead,
    carried_names,
    cell_text,
    check_free,
    compression_of,
    export_with,
    json_value,
    row_columns,
    served_dtype,
    utf8_name,
    utf8_text,
)
from featbake.version import __version__


def part_column(part: str) -> str:
    """The column a part is written to.

    Example:
        >>> part_column(""), part_column("layer6")
        ('features', 'layer6')
    """
    return part or "features"


def part_columns(parts: Sequence[str]) -> dict[str, str]:
    """Each part's column in the file (pure): :func:`part_column`, or ``part_<name>`` where it
    or its ``_shape`` would be ``id``, ``key`` or another part's (names compared regardless of
    case, :func:`~featbake.export.source.carried_names`).

    Example:
        >>> part_columns(["pooled", "tokens"])
        {'pooled': 'pooled', 'tokens': 'tokens'}
        >>> part_columns(["Pooled", "id", "pooled"])
        {'Pooled': 'Pooled', 'id': 'part_id', 'pooled': 'part_pooled'}
        >>> part_columns(["x", "x_shape"])
        {'x': 'x', 'x_shape': 'part_x_shape'}
    """
    wanted = {part: part_column(part) for part in parts}
    named = carried_names(
        list(wanted.values()),
        RESERVED,
        usable=utf8_name,
        prefix="part_",
        occupies=lambda n: (n, n + "_shape"),
    )
    return {part: named[column] for part, column in wanted.items()}


def column_names(parts: Sequence[str], carried: Sequence[str]) -> dict[str, str]:
    """Each carried column's name in the file (pure): its own, or ``row_<name>`` where the
    export's own columns take it (:func:`~featbake.export.source.carried_names`, every
    format's rule).

    Example:
        >>> column_names(["pooled"], ["label", "key", "pooled_shape"])
        {'label': 'label', 'key': 'row_key', 'pooled_shape': 'row_pooled_shape'}
    """
    taken = set(RESERVED)
    for column in part_columns(parts).values():
        taken |= {column, column + "_shape"}
    return carried_names(carried, taken, usable=utf8_name)


def check_destination(
    out: Path, store: Path, *, overwrite: bool, sources: Sequence[DataSource] = ()
) -> None:
    """Refuse a destination the export would overwrite wrongly.

    Raises:
        ConfigError: ``out`` (or ``OUT.partial``) is in the store or the data a root was
            built from, a folder, a link or a file that is not Parquet, or exists without
            ``overwrite``.
    """
    check_free(out, store, overwrite=overwrite, unfit=_not_a_file, sources=sources)


def _not_a_file(path: Path, finished: bool) -> str | None:
    if path.is_symlink() or path.is_dir():
        return (
            f"{path} is a folder or a link, not a Parquet file; choose another OUT "
            "(a file name such as feats.parquet)"
        )
    if path.exists() and not _own_or_empty(path, finished):
        return (
            f"{path} is not a Parquet file featbake exported; the export would replace it, so "
            "choose another OUT (or remove that file yourself)"
        )
    return None


def _own_or_empty(path: Path, finished: bool) -> bool:
    """Whether ``path`` is empty, or a featbake export: a whole Parquet file by its schema's
    ``featbake`` metadata (another program's table is not replaced), and at ``OUT.partial``
    (``finished`` False) also one a killed export began: a ``PAR1`` start, no footer yet."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return False
    if head == b"":
        return True
    if head != b"PAR1":
        return False
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, ValueError):  # no footer (pyarrow's ArrowInvalid is a ValueError)
        return not finished
    return b"featbake" in metadata


@dataclass(frozen=True)
class Parquet:
    """The Parquet format (see the module's doc): one file, one row group per
    :data:`ROW_GROUP_BYTES` of features or batch of items;
    ``compression`` of every column (snappy by default: see
    :class:`~featbake.export.source.Compression`)."""

    compression: Compression = Compression.SNAPPY
    check_destination = staticmethod(check_destination)

    def write(self, job: ExportJob) -> int:
        """One row group per :data:`ROW_GROUP_BYTES` of features (or per batch of items read),
        read ahead of pyarrow's write of the one before
        (:class:`~featbake.export.source.ReadAhead`), each item a one-row array over its own
        bytes in the read's buffer (no copy before pyarrow's own)."""
        import pyarrow.parquet as pq

        carried = _carried_table(job.src, job.rows)
        schema = _schema(job.src, job.layouts, carried)
        # Dictionaries and min/max statistics over feature values cost 2-5x the write and buy
        # nothing (random floats neither repeat nor prune): only id, key and rows get them.
        small = [f.name for f in schema if f.name in RESERVED or _carried(f, job.layouts)]
        written = 0
        with ReadAhead(job.src, ROW_GROUP_BYTES, job.progress, buffers=2) as runs, pq.ParquetWriter(
            str(job.partial), schema, use_dictionary=small, write_statistics=small,
            compression=str(self.compression),
        ) as writer:  # fmt: skip
            for run in runs:
                table = _batch_table(run.items, run.parts, job.layouts, carried)
                writer.write_table(table.cast(writer.schema))
                written += run.nbytes
        return written


#: Feature bytes a row group holds at most (and at most one batch of items, one at least):
#: a batch of long items (256 of [1500, 1024] float32 is 1.5 GB) stays out of memory.
ROW_GROUP_BYTES = 64 * 1024 * 1024


def export_parquet(
    out: str | os.PathLike[str], *, compression: str = Compression.SNAPPY, **options: Any
) -> ExportReport:
    """Write the features of one root to the Parquet file ``out`` (see the module's doc);
    ``compression`` of its columns (``"snappy"``, ``"none"``, ``"zstd"``); ``options`` are
    :func:`featbake.export.source.export_with`'s.

    Example:
        >>> export_parquet("feats.parquet", cache=".featbake")  # doctest: +SKIP
        >>> import datasets; ds = datasets.load_dataset("parquet", data_files="feats.parquet")
        ... # doctest: +SKIP
    """
    return export_with(Parquet(compression_of(compression)), out, **options)


def _carried_table(src: ExportSource, rows: Sequence[Mapping[str, Any]] | None) -> Any:
    """Every item's carried columns as one Arrow table (types inferred over all items, so each
    row group has the same schema), renamed clear of the export's own columns; None: none."""
    import pyarrow as pa

    if not rows:
        return None
    columns = row_columns(rows)
    if not columns:
        return None
    names = column_names(src.parts, list(columns))
    return pa.table({names[n]: _carried_array(vs) for n, vs in columns.items()})


def _carried_array(values: Sequence[Any]) -> Any:
    """One carried column as an Arrow array of the type Arrow infers; a column it cannot type
    (numbers and text, a whole number past int64) as text, each value as zarr writes a column
    that is not all numbers (:func:`~featbake.export.source.cell_text`), missing ones null."""
    import pyarrow as pa

    try:
        return pa.array([_plain(v) for v in values])
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([None if v is None else cell_text(v) for v in values], pa.string())


def _plain(value: Any) -> Any:
    """A carried value Arrow can type across rows: nested values as JSON text."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(json_value(value), sort_keys=True)
    return utf8_text(value) if isinstance(value, str) else value


def _carried(field: Any, layouts: Mapping[str, PartLayout]) -> bool:
    """Whether a schema field is a carried row column (not a part or its shape)."""
    columns = part_columns(list(layouts)).values()
    ours = set(columns) | {c + "_shape" for c in columns}
    return field.name not in ours


def _arrow_type(lay: PartLayout) -> Any:
    """A part's column type: its dtype nested to the item's rank (pure)."""
    import pyarrow as pa

    dtype = pa.from_numpy_dtype(served_dtype(lay.dtype))
    for size in reversed(lay.trailing):
        # An axis of length 0 is a list of variable size (all empty): Arrow refuses a fixed
        # size of 0, and Parquet cannot read one back. The shape column holds the true shape.
        dtype = pa.list_(dtype, size) if size else pa.list_(dtype)
    return pa.list_(dtype) if lay.ragged else dtype


def _schema(src: ExportSource, layouts: Mapping[str, PartLayout], carried: Any) -> Any:
    import pyarrow as pa

    fields = [pa.field("id", pa.string()), pa.field("key", pa.string())]
    columns = part_columns(list(layouts))
    for part, lay in layouts.items():
        fields.append(pa.field(columns[part], _arrow_type(lay)))
        fields.append(pa.field(columns[part] + "_shape", pa.list_(pa.int64())))
    if carried is not None:
        fields.extend(carried.schema)
    meta = {
        "featbake_version": __version__,
        "root": src.root.name,
        "data": src.root.data,
        "encoder": src.root.encoder_label,
        "encoder_fp": src.root.encoder_fp,
        "recipe_fp": src.root.recipe_fp,
        "recipe": src.root.recipe,
        "parts": list(layouts),
        "part_columns": columns,
    }
    return pa.schema(fields, metadata={"featbake": json.dumps(meta, sort_keys=True)})


def _part_array(arrays: Sequence[np.ndarray], lay: PartLayout) -> Any:
    """One part of a batch as a column of its type, one chunk per item over the item's own
    buffer: concatenating the batch first cost a copy of every byte (and its page faults), and
    pyarrow writes a chunked column as fast as one array."""
    import pyarrow as pa

    return pa.chunked_array([_item_array(a, lay) for a in arrays], _arrow_type(lay))


def _item_array(array: np.ndarray, lay: PartLayout) -> Any:
    """One item as a one-row Arrow array of its part's type (its data not copied)."""
    import pyarrow as pa

    values: Any = pa.array(array.reshape(-1))
    shape = array.shape
    for axis in reversed(range(len(shape) - len(lay.trailing), len(shape))):
        if shape[axis]:
            values = pa.FixedSizeListArray.from_arrays(values, shape[axis])
        else:  # as many empty lists as the axes before it hold (see _arrow_type)
            empty = np.zeros(math.prod(shape[:axis]) + 1, np.int32)
            values = pa.ListArray.from_arrays(pa.array(empty), values)
    if not lay.ragged:
        return values
    return pa.ListArray.from_arrays(pa.array([0, array.shape[0]], pa.int32()), values)


def _batch_table(
    items: Sequence[LocatedItem],
    arrays: Mapping[str, Sequence[np.ndarray]],
    layouts: Mapping[str, PartLayout],
    carried: Any,
) -> Any:
    """One row group: the items' ids, keys, parts (``arrays``, by part) and shapes, and their
    rows of the carried columns."""
    import pyarrow as pa

    columns: dict[str, Any] = {
        "id": pa.array([item.path for item in items], pa.string()),
        "key": pa.array([item.key for item in items], pa.string()),
    }
    named = part_columns(list(layouts))
    for part, lay in layouts.items():
        columns[named[part]] = _part_array(arrays[part], lay)
        columns[named[part] + "_shape"] = pa.array(
            [list(a.shape) for a in arrays[part]], pa.list_(pa.int64())
        )
    table = pa.table(columns)
    if carried is not None:
        part_of = carried.slice(items[0].at, len(items))  # the items are consecutive
        for name in part_of.column_names:
            table = table.append_column(name, part_of.column(name))
    return table
