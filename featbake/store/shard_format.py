"""The shard format: tensor naming, dtypes, metadata, header bytes and checksums (pure)."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_NAME = "featbake-shard"


FORMAT_VERSION = "1"


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


def tensor_name(key: str, part: str = "") -> str:
    """The name of a feature's tensor inside a shard: ``key`` or ``key/part``."""
    return f"{key}/{part}" if part else key


def split_tensor_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`tensor_name`: ``(key, part)``."""
    key, _, part = name.partition("/")
    return key, part


def checksum(buf: Any) -> str:
    """CRC-32 of a buffer as 8 hex digits (corruption detection; keys use SHA-256)."""
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def tensor_buffer(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def shard_metadata(
    tensors: Mapping[str, torch.Tensor], encoder_fp: str, recipe_fp: str
) -> dict[str, str]:
    """The ``__metadata__`` of a shard: format, fingerprints and a CRC-32 per tensor."""
    sums = {name: checksum(tensor_buffer(t)) for name, t in sorted(tensors.items())}
    return {
        "checksums": json.dumps(sums, separators=(",", ":"), sort_keys=True),
        "encoder_fp": encoder_fp,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
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
