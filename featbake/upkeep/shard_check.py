"""One shard file checked: its bytes against its content name, its header, each tensor's CRC.

A shard's header is untrusted input here: its shape may not fit its byte range, its JSON may nest
200,000 arrays deep, its ``__metadata__`` may be a number. Each of those makes the shard unsound
(with the reason), never makes verify fail.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from pathlib import Path

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.reader import ShardReader
from featbake.store.shard_format import ST_TO_DTYPE, TensorInfo, split_tensor_name
from featbake.store.writer import ShardEntry
from featbake.upkeep.findings import ShardCheck

#: What parsing a hostile header raises besides StoreError (json nesting, a non-dict metadata, ...).
HOSTILE_HEADER_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    RecursionError,
    RuntimeError,
    OverflowError,
)


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes, streamed."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def header_problem(info: TensorInfo, file_bytes: int) -> str | None:
    """Why a tensor's header entry cannot describe its bytes, or None if it can."""
    dtype = ST_TO_DTYPE.get(info.dtype) if isinstance(info.dtype, str) else None
    if dtype is None:
        return f"unknown dtype {info.dtype!r}"
    shape = info.shape
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"shape {list(shape)!r} is not a list of sizes"
    if not all(isinstance(x, int) for x in (info.begin, info.end)):
        return "its data offsets are not integers"
    if not 0 <= info.begin <= info.end <= file_bytes:
        return f"its data offsets [{info.begin}, {info.end}) lie outside the file"
    if math.prod(shape) * dtype.itemsize != info.end - info.begin:
        return f"shape {list(shape)} {info.dtype} does not fit its {info.end - info.begin} bytes"
    return None


def _unsound(path: Path, size: int, mtime: float, why: str) -> ShardCheck:
    name = path.name.removesuffix(".safetensors")
    return ShardCheck(name, str(path), size, mtime, False, why, "", "", (), ())


def _open(path: Path, size: int, mtime: float) -> tuple[str, ShardReader] | ShardCheck:
    """(digest, open reader), or the unsound check saying why the file cannot be read."""
    try:
        digest = sha256_file(path)
        return digest, ShardReader(path, verify="never")
    except StoreError as e:  # ShardMissing: it vanished meanwhile; StoreCorrupt: a bad header
        return _unsound(path, size, mtime, str(e))
    except OSError as e:
        return _unsound(path, size, mtime, f"unreadable: {e.strerror or e}")
    except HOSTILE_HEADER_ERRORS as e:
        return _unsound(path, size, mtime, f"unreadable header ({type(e).__name__})")


def _inspect(
    reader: ShardReader, size: int, *, crcs: bool
) -> tuple[list[ShardEntry], list[str], list[str]]:
    """(entries of well-formed tensors, tensors that fail, why each fails).

    With ``crcs`` each tensor's checksum is read too (not needed when the file's SHA-256 already
    matches its content name).
    """
    entries, failed, why = [], [], []
    for tname, info in reader.tensors.items():
        problem = header_problem(info, size)
        if problem is None and crcs:
            try:
                reader.read(tname, verify="always")
            except StoreCorrupt:
                problem = "checksum mismatch"
        if problem is not None:
            failed.append(tname)
            why.append(f"tensor {tname}: {problem}")
            continue
        key, part = split_tensor_name(tname)
        entries.append(ShardEntry(key, part, info.dtype, info.shape, info.end - info.begin))
    return entries, failed, why


def _fingerprint(meta: dict, name: str) -> str:
    value = meta.get(name, "")
    return value if isinstance(value, str) else ""


def check_shard(path: Path) -> ShardCheck:
    """Check one shard file: its bytes against its content name, its header, each checksum.

    A shard is sound when its bytes hash to its name (in the right folder) and its header
    describes every tensor consistently; otherwise ``intact`` names the tensors that are still
    well-formed and pass their checksum (what repair may salvage).
    """
    name = path.name.removesuffix(".safetensors")
    try:
        st = os.lstat(path)
    except OSError as e:
        return _unsound(path, 0, 0.0, f"unreadable: {e.strerror or e}")
    if not stat.S_ISREG(st.st_mode):
        return _unsound(path, 0, 0.0, "not a regular file")
    opened = _open(path, st.st_size, st.st_mtime)
    if isinstance(opened, ShardCheck):
        return opened
    digest, reader = opened
    named_right = digest == name and path.parent.name == name[:2]
    with reader:
        try:
            entries, failed, why = _inspect(reader, st.st_size, crcs=not named_right)
        except HOSTILE_HEADER_ERRORS as e:
            return _unsound(path, st.st_size, st.st_mtime, f"unreadable header ({e!r:.200})")
        meta = reader.metadata
    sound = named_right and not failed
    if sound:
        problem = ""
    elif failed:
        problem = f"{len(failed)} of {len(reader.tensors)} tensors fail ({why[0]})"
    else:
        problem = "its bytes do not match its content name (damaged header or renamed)"
    return ShardCheck(
        name,
        str(path),
        st.st_size,
        st.st_mtime,
        sound,
        problem,
        _fingerprint(meta, "encoder_fp"),
        _fingerprint(meta, "recipe_fp"),
        tuple(entries),
        tuple(e.tensor for e in entries),
        tuple(failed),
        digest,
    )
