"""``featbake export --format webdataset``: a root's features as webdataset tar shards.

``OUT/`` holds ``shard-000000.tar``, ``shard-000001.tar``, ... (a new shard past
:data:`SHARD_BYTES`), readable by ``webdataset.WebDataset("OUT/shard-{000000..00000N}.tar")
.decode()`` and by plain ``tarfile``. One sample per item, in the root's order, keyed by its id
(see :func:`sample_key`), with the members

* ``<key>.npy`` (a single-output encoder) or ``<key>.<part>.npy`` per exported part (``pooled``,
  ``tokens``, ``layer6``): the feature in its stored dtype (bfloat16 widened exactly to
  float32), as ``numpy.save`` writes it;
* ``<key>.json``: ``{"id": ..., "key": ...}`` and the columns the item's row carries (its
  labels), so a loader needs nothing beside the shards.

A webdataset key ends at the first dot of a member's name, so an id's dots (``clip.wav``) and
any character outside ``[A-Za-z0-9_-/]`` become ``_``; the JSON keeps the id as it is. The
shards are written into ``OUT.partial/`` and the folder is renamed to ``OUT`` when complete.
"""

from __future__ import annotations

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
    ExportItem,
    ExportJob,
    ExportReport,
    as_numpy,
    check_free,
    export_with,
    stream,
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
    one (pure): every sample stays its own.

    Example:
        >>> unique_keys(["a.wav", "a_wav", "b"])
        ['a_wav', 'a_wav-2', 'b']
    """
    seen: set[str] = set()
    keys = []
    for item_id in ids:
        base = key = sample_key(item_id)
        n = 2
        while key in seen:
            key, n = f"{base}-{n}", n + 1
        seen.add(key)
        keys.append(key)
    return keys


def member_names(key: str, parts: Sequence[str]) -> dict[str, str]:
    """Each part's member name in a sample (pure).

    Example:
        >>> member_names("a", [""]), member_names("a", ["pooled", "tokens"])
        ({'': 'a.npy'}, {'pooled': 'a.pooled.npy', 'tokens': 'a.tokens.npy'})
    """
    if list(parts) == [""]:
        return {"": f"{key}.npy"}
    return {p: f"{key}.{p or 'features'}.npy" for p in parts}


def check_destination(out: Path, store: Path, *, overwrite: bool) -> None:
    """Refuse a destination the export would overwrite wrongly.

    Raises:
        ConfigError: ``out`` or ``OUT.partial`` is in the store, a file or a link, a folder
            holding anything but tar shards, or exists without ``overwrite``.
    """
    check_free(out, store, overwrite=overwrite, unfit=_not_shards)


def _not_shards(path: Path) -> str | None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return f"{path} is a file or a link, not a folder of shards; choose another OUT"
    if path.is_dir() and any(not f.name.endswith(".tar") for f in path.iterdir()):
        return (
            f"{path} holds files other than tar shards; the export would delete them, so "
            "choose another OUT (or move that folder away)"
        )
    return None


class _ShardWriter:
    """Writes samples into numbered tar shards, starting a new one past ``limit`` bytes."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.count, self.size = 0, 0
        self.tar: tarfile.TarFile | None = None

    def add(self, members: Mapping[str, bytes]) -> None:
        if self.tar is None or self.size >= self.limit:
            self.close()
            shard = self.folder / f"shard-{self.count:06d}.tar"
            # closed by close(): one shard is open at a time, across add() calls
            self.tar = tarfile.open(shard, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
            self.count, self.size = self.count + 1, 0
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            self.tar.addfile(info, io.BytesIO(data))
            self.size += len(data) + 512

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _sample(
    item: ExportItem, key: str, names: Mapping[str, str], row: Mapping[str, Any]
) -> dict[str, bytes]:
    """One sample's members: each part as ``.npy``, then the JSON of its id, key and row."""
    members = {names[p]: _npy(as_numpy(t)) for p, t in item.parts.items()}
    meta = {**row, "id": item.path, "key": item.key}
    members[f"{key}.json"] = json.dumps(meta, sort_keys=True, default=str).encode()
    return members


class WebDataset:
    """The webdataset format (see the module's doc): tar shards in a folder."""

    check_destination = staticmethod(check_destination)

    def write(self, job: ExportJob) -> int:
        keys = unique_keys([path for path, _ in job.src.present])
        job.partial.mkdir()
        shards = _ShardWriter(job.partial, SHARD_BYTES)
        written, at = 0, 0
        try:
            for items in stream(job.src, job.progress):
                for item in items:
                    names = member_names(keys[at], list(job.src.parts))
                    row = job.rows[at] if job.rows is not None else {}
                    members = _sample(item, keys[at], names, row)
                    shards.add(members)
                    written += sum(len(b) for b in members.values())
                    at += 1
        finally:
            shards.close()
        return written


def export_webdataset(out: str | os.PathLike[str], **options: Any) -> ExportReport:
    """Write the features of one root as webdataset shards in the folder ``out`` (see the
    module's doc); ``options`` are :func:`featbake.export.source.export_with`'s.

    Example:
        >>> export_webdataset("feats-wds", cache=".featbake")  # doctest: +SKIP
        >>> import webdataset as wds  # doctest: +SKIP
        >>> next(iter(wds.WebDataset("feats-wds/shard-000000.tar").decode()))  # doctest: +SKIP
    """
    return export_with(WebDataset(), out, **options)
