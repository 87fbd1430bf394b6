"""The shard format: tensor naming, dtypes, metadata, header bytes and checksums (pure).

Format versions differ only in the per-tensor checksum recorded in ``__metadata__["checksums"]``:

* ``"1"``: zlib CRC-32 of the tensor's bytes (about 7 GB/s; binds the bytes only).
* ``"2"``: CRC-32C of the tensor's canonical descriptor ``["name","DTYPE",[shape]]`` followed
  by its bytes (about 30 GB/s with SSE4.2; one pass over the bytes). A header edited so a
  tensor's dtype, shape or name reads differently with the same byte count fails the check, as
  a flipped data byte does.

Version 2 is written; both are read and verified.

Stored dtypes ``int8`` and ``fp8`` add no format version: their tensors are ordinary ``I8`` /
``U8`` tensors ``[..., D + 4]``, each row its D codes then its float32 scale (little-endian),
read back with :func:`featbake.quantize.dequantize` (the recipe, hashed into ``recipe_fp``, says
which scheme).
"""

from __future__ import annotations

import ctypes
import json
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import torch

FORMAT_NAME = "featbake-shard"


FORMAT_VERSION = "2"


#: Versions this featbake reads (and verifies); anything else was written by a newer featbake.
READABLE_VERSIONS = ("1", "2")


DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


#: safetensors parses the whole JSON header on open; bound it so tiny features do not make it huge.
DEFAULT_SHARD_ITEMS = 8192


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}


#: Bytes per element of each stored dtype (a header's shape must fit its byte range).
ST_ITEMSIZE: dict[str, int] = {
    v: torch.empty(0, dtype=k).element_size() for k, v in DTYPE_TO_ST.items()
}


def tensor_name(key: str, part: str = "") -> str:
    """The name of a feature's tensor inside a shard: ``key`` or ``key/part``."""
    return f"{key}/{part}" if part else key


def split_tensor_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`tensor_name`: ``(key, part)``."""
    key, _, part = name.partition("/")
    return key, part


def _crc32c_extend_at() -> Callable[[int, int, int], int] | None:
    """The C library's ``crc32c_extend(crc, address, count)``, or None where it is not exposed.

    ``google_crc32c.extend`` takes only immutable ``bytes`` (it parses its argument with ``y#``,
    which refuses numpy arrays, memoryviews and bytearrays), so checking a tensor through it
    would cost a copy as large as the read. The library it wraps exports the plain C function;
    calling it by address checks the tensor's own memory (ctypes releases the GIL meanwhile).
    """
    try:
        from google_crc32c import _crc32c

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_uint32
    return fn


_EXTEND_AT = _crc32c_extend_at()


def crc32c(buf: Any, crc: int = 0) -> int:
    """CRC-32C of any contiguous buffer (``bytes``, a memoryview, a numpy array), extending ``crc``.

    Example:
        >>> f"{crc32c(b'123456789'):08x}"  # the standard check value
        'e3069283'
    """
    if isinstance(buf, bytes) or _EXTEND_AT is None:
        return int(google_crc32c.extend(crc, bytes(buf)))
    arr = np.frombuffer(buf, dtype=np.uint8)  # no copy; keeps the memory alive for the call
    return int(_EXTEND_AT(crc, arr.ctypes.data, arr.nbytes)) if arr.nbytes else crc


def crc32c_tensor(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C of a CPU tensor's bytes in row-major order, extending ``crc``.

    A contiguous tensor is checked in place (no copy).
    """
    t = t.contiguous()
    if _EXTEND_AT is None:
        return crc32c(tensor_buffer(t), crc)
    nbytes = t.numel() * t.element_size()
    return int(_EXTEND_AT(crc, t.data_ptr(), nbytes)) if nbytes else crc


def checksum_v1(buf: Any) -> str:
    """Format 1's checksum: CRC-32 (zlib) of a buffer as 8 hex digits (bytes only)."""
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def tensor_descriptor(name: str, dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """The canonical bytes of what a tensor is: ``["name","DTYPE",[d0,d1,...]]`` (ASCII JSON).

    Made once per tensor a process first reads, so the usual case (names and dtypes of
    printable ASCII with nothing to escape) is formatted directly, 8x faster than
    ``json.dumps``, which gives the same bytes and still handles every other name.
    """
    if _plain(name) and _plain(dtype):
        return f'["{name}","{dtype}",[{",".join(map(str, map(int, shape)))}]]'.encode()
    return json.dumps([name, dtype, list(shape)], separators=(",", ":"), ensure_ascii=True).encode()


def _plain(text: str) -> bool:
    """True if JSON writes ``text`` as it is between its quotes (nothing escaped)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def checksum_v2(
    name: str, dtype: str, shape: tuple[int, ...] | list[int], data: torch.Tensor
) -> str:
    """Format 2's checksum: CRC-32C of the descriptor followed by the bytes, as 8 hex digits.

    ``data`` is the tensor's bytes as a contiguous CPU tensor (any dtype; its memory is read).
    """
    return f"{crc32c_tensor(data, crc32c(tensor_descriptor(name, dtype, shape))):08x}"


def tensor_checksum(version: str, name: str, t: torch.Tensor) -> str:
    """The checksum ``version`` records for tensor ``name`` holding ``t`` (contiguous, CPU)."""
    if version == "1":
        return checksum_v1(tensor_buffer(t))
    return checksum_v2(name, DTYPE_TO_ST[t.dtype], tuple(t.shape), t)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def shard_metadata(
    tensors: Mapping[str, torch.Tensor],
    encoder_fp: str,
    recipe_fp: str,
    version: str = FORMAT_VERSION,
) -> dict[str, str]:
    """The ``__metadata__`` of a shard: format, fingerprints and a checksum per tensor.

    ``version`` exists so tests can write the shards an older featbake wrote; featbake itself
    always writes :data:`FORMAT_VERSION`.
    """
    sums = {name: tensor_checksum(version, name, t) for name, t in sorted(tensors.items())}
    return {
        "checksums": json.dumps(sums, separators=(",", ":"), sort_keys=True),
        "encoder_fp": encoder_fp,
        "format": FORMAT_NAME,
        "format_version": version,
        "recipe_fp": recipe_fp,
    }


def shard_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The safetensors header of a shard (length prefix, JSON, space padding) and the data order.

    We write the header ourselves rather than call ``safetensors.torch.save``: that one emits
    ``__metadata__`` in Rust HashMap order, which differs from process to process, so equal
    features would give different bytes and different content names. Here the bytes are a pure
    function of the tensors: metadata keys sorted, tensors laid out as safetensors does (widest
    dtype first, then by name, so every tensor is aligned to its element size).
    """
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, t in order:
        end = offset + t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text, order


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in a shard file and what it should hash to."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int
    crc: str | None
