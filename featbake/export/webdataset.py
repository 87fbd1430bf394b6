"""``featbake export --format webdataset``: a root's features as webdataset tar shards.

``OUT/`` holds ``shard-000000.tar``, ``shard-000001.tar``, ... (a new shard past
:data:`SHARD_BYTES`), readable by ``webdataset.WebDataset("OUT/shard-{000000..00000N}.tar")
.decode()`` and by plain ``tarfile``. One sample per item, in the root's order, keyed by its id
(see :func:`sample_key`), with the members

* ``<key>.npy`` (a single-output encoder) or ``<key>.<part>.npy`` per exported part (``pooled``,
  ``tokens``, ``layer6``; ``part_<name>`` where the name holds a ``/`` or is another part's
  regardless of case: :func:`part_extensions`): the feature in its stored dtype (bfloat16
  widened exactly to float32), as ``numpy.save`` writes it;
* ``<key>.json``: ``{"id": ..., "key": ...}`` and the columns the item's row carries (its
  labels; one named ``id`` or ``key`` as ``row_id``, ``row_key``, as in Parquet), so a loader
  needs nothing beside the shards.

A webdataset key ends at the first dot of a member's name, so an id's dots (``clip.wav``) and
any character outside ``[A-Za-z0-9_-/]`` become ``_``; the JSON keeps the id as it is. The
shards are written into ``OUT.partial/`` and the folder is renamed to ``OUT`` when complete.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featbake.export.source import (
    RESERVED,
    DataSource,
    ExportJob,
    ExportReport,
    LocatedItem,
    OutputFile,
    ReadAhead,
    carried_names,
    check_free,
    export_with,
    json_value,
    row_columns,
)

#: A shard is closed once it holds this many bytes (webdataset's advice: 100 MB to 1 GB).
SHARD_BYTES = 512 * 1024 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-/]")


def sample_key(item_id: str) -> str:
    """The webdataset key of an item id (pure): dots and unsafe characters as ``_``, no
    leading ``/`` and no empty path part, so the key is one sample and a relative member name.

    Example:
        >>> sample_key("sub/clip.wav"), sample_key("../a b.flac"), sample_key("/x//y")
        ('sub/clip_wav', '__/a_b_flac', 'x/y')
    """
    parts = [p for p in _UNSAFE.sub("_", item_id).split("/") if p]
    return "/".join(parts) or "_"


def unique_keys(ids: Sequence[str]) -> list[str]:
    """Each id's :func:`sample_key`, with ``-2``, ``-3`` ... added where two ids would share
    one (pure), regardless of case (``A.wav`` and ``a.wav``: one file where a shard is unpacked
    on macOS or Windows): every sample stays its own.

    Example:
        >>> unique_keys(["a.wav", "a_wav", "b", "A.wav"])
        ['a_wav', 'a_wav-2', 'b', 'A_wav-3']
    """
    seen: set[str] = set()
    keys = []
    for item_id in ids:
        base = key = sample_key(item_id)
        n = 2
        while key.casefold() in seen:
            key, n = f"{base}-{n}", n + 1
        seen.add(key.casefold())
        keys.append(key)
    return keys


def member_names(key: str, parts: Sequence[str]) -> dict[str, str]:
    """Each part's member name in a sample (pure): ``<key>.<part>.npy``, the part as
    :func:`part_extensions` names it.

    Example:
        >>> member_names("a", [""]), member_names("a", ["pooled", "tokens"])
        ({'': 'a.npy'}, {'pooled': 'a.pooled.npy', 'tokens': 'a.tokens.npy'})
    """
    return {p: f"{key}.{ext}" for p, ext in part_extensions(parts).items()}


def part_extensions(parts: Sequence[str]) -> dict[str, str]:
    """Each part's extension in a sample (pure): ``npy`` for a single-output encoder's one
    part, else ``<part>.npy``, or ``part_<name>.npy`` where the name holds a ``/`` or ``\\``
    (a member in a folder of its own: webdataset would read it as another sample) or is
    another part's regardless of case (one file where a tar is unpacked on macOS or Windows):
    :func:`~featbake.export.source.carried_names`.

    Example:
        >>> part_extensions(["Pooled", "pooled", "a/b"])
        {'Pooled': 'Pooled.npy', 'pooled': 'part_pooled.npy', 'a/b': 'part_a_b.npy'}
    """
    if list(parts) == [""]:
        return {"": "npy"}
    named = carried_names(parts, usable=_member_part, prefix="part_")
    return {p: f"{named[p]}.npy" for p in parts}


def _member_part(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name


def check_destination(
    out: Path, store: Path, *, overwrite: bool, sources: Sequence[DataSource] = ()
) -> None:
    """Refuse a destination the export would overwrite wrongly.

    Raises:
        ConfigError: ``out`` or ``OUT.partial`` is in the store or the data a root was built
            from (``sources``), a file or a link, a folder holding anything but tar shards, or
            exists without ``overwrite``.
    """
    check_free(out, store, overwrite=overwrite, unfit=_not_shards, sources=sources)


#: The name of every shard an export writes (``shard-000000.tar``, ...).
SHARD_NAME = re.compile(r"shard-\d{6}\.tar")


def _not_shards(path: Path, finished: bool) -> str | None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return f"{path} is a file or a link, not a folder of shards; choose another OUT"
    if path.is_dir() and not _own_shards(path, finished):
        return (
            f"{path} holds files other than the shards featbake exports; the export would "
            "delete them, so choose another OUT (or move that folder away)"
        )
    return None


def _own_shards(folder: Path, finished: bool) -> bool:
    """Whether ``folder`` holds only what an export writes: shards named ``shard-NNNNNN.tar``;
    a finished export's (OUT) first sample also has its ``.json`` member naming its ``id``
    and ``key`` (a folder of the user's own shards, under the same names, is not deleted). An
    empty folder is anyone's."""
    names = [f.name for f in folder.iterdir()]
    if not all(SHARD_NAME.fullmatch(n) for n in names):
        return False
    if not finished or not names:
        return True
    try:
        with tarfile.open(folder / min(names)) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    data = tar.extractfile(member)
                    doc = json.loads(data.read()) if data is not None else None
                    return isinstance(doc, dict) and {"id", "key"} <= doc.keys()
    except (OSError, tarfile.TarError, ValueError):
        return False
    return False


#: What a member's data is written from: byte strings and arrays, written one after another.
Chunks = Sequence[bytes | np.ndarray]


def _ustar_template() -> tuple[bytes, int]:
    """The header tarfile writes for a member named ``""`` of size 0 (mode 0644, mtime 0), with
    its checksum field blank; and that header's byte sum."""
    info = tarfile.TarInfo("")
    info.size, info.mode, info.mtime = 0, 0o644, 0
    head = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict"))
    head[148:156] = b" " * 8  # the checksum is summed over blanks in its own field
    return bytes(head), sum(head)


_USTAR, _USTAR_SUM = _ustar_template()
_ZERO_SIZE = b"%011o\0" % 0


def tar_header(name: str, size: int) -> bytes:
    """The header ``tarfile`` (``PAX_FORMAT``) writes before a regular member ``name`` of
    ``size`` bytes, mode 0644, mtime 0 (pure).

    A plain ustar block for an ASCII name of up to 100 characters and a size under 8 GiB,
    patched into tarfile's own header (name, size, checksum): ``TarInfo.tobuf`` cost more than
    a member's write. Any other name or size (a pax record first) through ``TarInfo.tobuf``.

    Example:
        >>> info = tarfile.TarInfo("a/b.npy"); info.size, info.mode, info.mtime = 9, 0o644, 0
        >>> tar_header("a/b.npy", 9) == info.tobuf(tarfile.PAX_FORMAT)
        True
    """
    raw = name.encode("ascii", "replace")
    if len(raw) > 100 or not name.isascii() or not 0 <= size < 8**11:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    digits = b"%011o\0" % size
    check = _USTAR_SUM + sum(raw) + sum(digits) - sum(_ZERO_SIZE)
    return b"".join((
        raw, _USTAR[len(raw) : 124], digits, _USTAR[136:148], b"%06o\0 " % check, _USTAR[156:]
    ))  # fmt: skip


class ShardWriter:
    """Writes samples as members of numbered tar shards, a new shard past ``limit`` bytes.

    The bytes are those ``tarfile.open(shard, "w", format=tarfile.PAX_FORMAT)`` writes
    (:func:`tar_header`, data padded to 512-byte blocks, two zero blocks and a 10 KiB record
    at the end), but a sample is one ``writev`` of its headers and each member's data straight
    from its array: ``tarfile.addfile`` copies data through a file object 16 KiB at a time,
    which cost more than the write itself.
    """

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.count, self.size = 0, 0
        self.file: OutputFile | None = None

    def add(self, members: Mapping[str, Chunks]) -> int:
        """Write one sample's members, in order, into the current shard; their data's bytes
        (headers and padding not counted)."""
        if self.file is None or self.size >= self.limit:
            self.close()
            self.file = OutputFile(self.folder / f"shard-{self.count:06d}.tar")  # SHARD_NAME
            self.count, self.size = self.count + 1, 0
        out: list[bytes | np.ndarray] = []
        data = 0
        for name, chunks in members.items():
            size = sum(_nbytes(c) for c in chunks)
            header = tar_header(name, size)
            out += (header, *chunks, _ZEROS[: -size % tarfile.BLOCKSIZE])
            self.size += len(header) + size + (-size % tarfile.BLOCKSIZE)
            data += size
        self.file.write(out)
        return data

    def close(self) -> None:
        """End the current shard as tarfile does: two zero blocks, then zeros to a record."""
        if self.file is not None:
            end = tarfile.NUL * (2 * tarfile.BLOCKSIZE)
            file, self.file = self.file, None
            with file:
                file.write([end + tarfile.NUL * (-(self.size + len(end)) % tarfile.RECORDSIZE)])


_ZEROS = bytes(tarfile.BLOCKSIZE)


@functools.lru_cache(maxsize=4096)
def npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """The header ``numpy.save`` writes before a C-ordered array of ``dtype`` and ``shape``
    (kept per dtype and shape: an export's items share a few)."""
    head = io.BytesIO()
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": shape}  # fmt: skip
    try:
        np.lib.format.write_array_header_1_0(head, fields)
    except ValueError:  # a header too long for version 1.0 (as numpy.save falls back)
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, fields)
    return head.getvalue()


def npy_chunks(array: np.ndarray) -> list[bytes | np.ndarray]:
    """An array as the bytes ``numpy.save`` writes, without copying its data: the ``.npy``
    header, then the (C-ordered) array itself.

    Example:
        >>> import io; buf = io.BytesIO(); a = np.arange(3.0); np.save(buf, a)
        >>> b"".join(bytes(c) for c in npy_chunks(a)) == buf.getvalue()
        True
        >>> npy_chunks(np.float32(2.5))[1].shape  # a per-item scalar stays 0-d, as np.save keeps it
        ()
    """
    array = np.asarray(array, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
    return [npy_header(array.dtype, array.shape), array]


def _meta(item: LocatedItem, row: Mapping[str, Any], names: Mapping[str, str]) -> bytes:
    """A sample's JSON member: its id, key and row, the row's columns under ``names``
    (:func:`~featbake.export.source.carried_names`: clear of ``id`` and ``key``)."""
    carried = {names[k]: json_value(v) for k, v in row.items()}  # JSON's own values only
    return json.dumps({**carried, "id": item.path, "key": item.key}, sort_keys=True).encode()


class WebDataset:
    """The webdataset format (see the module's doc): tar shards in a folder."""

    check_destination = staticmethod(check_destination)

    def write(self, job: ExportJob) -> int:
        """Each run of samples read ahead (:class:`~featbake.export.source.ReadAhead`) and
        each sample written with its headers in one ``writev``: an item's bytes are copied
        twice, store to buffer (checked there) and buffer to shard."""
        parts = list(job.src.parts)
        keys = unique_keys([path for path, _ in job.src.present])
        exts = part_extensions(parts)
        renamed = carried_names(list(row_columns(job.rows or [])), RESERVED)
        job.partial.mkdir()
        shards = ShardWriter(job.partial, SHARD_BYTES)
        written = 0
        with ReadAhead(job.src, GROUP_BYTES, job.progress) as runs:
            try:
                for run in runs:
                    for j, item in enumerate(run.items):
                        key = keys[item.at]
                        members: dict[str, Chunks] = {
                            f"{key}.{exts[p]}": npy_chunks(run.parts[p][j]) for p in parts
                        }
                        row = job.rows[item.at] if job.rows is not None else {}
                        members[f"{key}.json"] = [_meta(item, row, renamed)]
                        written += shards.add(members)
            finally:
                shards.close()
        return written


#: Bytes of samples read ahead at a time (three such buffers: within the L3 cache here).
GROUP_BYTES = 4 * 1024 * 1024


def _nbytes(chunk: bytes | np.ndarray) -> int:
    return chunk.nbytes if isinstance(chunk, np.ndarray) else len(chunk)


def export_webdataset(out: str | os.PathLike[str], **options: Any) -> ExportReport:
    """Write the features of one root as webdataset shards in the folder ``out`` (see the
    module's doc); ``options`` are :func:`featbake.export.source.export_with`'s.

    Example:
        >>> export_webdataset("feats-wds", cache=".featbake")  # doctest: +SKIP
        >>> import webdataset as wds  # doctest: +SKIP
        >>> next(iter(wds.WebDataset("feats-wds/shard-000000.tar").decode()))  # doctest: +SKIP
    """
    return export_with(WebDataset(), out, **options)
