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

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import stat
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import google_crc32c
import numpy as np

from featbake.errors import ConfigError, ShardDamaged, ShardMissing, StoreCorrupt, StoreError
from featbake.native import kernels
from featbake.quantize import (
    SCALE_BYTES,
    PackedRows,
    ScaleSpan,
    dequantize_unpacked,
    unpack,
)
from featbake.store.files import fsync_dir, holding
from featbake.store.layout import Layout
from featbake.store.locks import shared_write_lock

# == shard_format ==================================================================================
FORMAT_NAME = "featbake-shard"


FORMAT_VERSION = "2"


#: Versions this featbake reads (and verifies); anything else was written by a newer featbake.
READABLE_VERSIONS = ("1", "2")


DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


#: safetensors parses the whole JSON header on open; bound it so tiny features do not make it huge.
DEFAULT_SHARD_ITEMS = 8192


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


#: Each stored dtype's safetensors name -> (its torch dtype's name, bytes per element): the one
#: table the torch dtype maps below are made from (on first use, so that reading headers and
#: checking bytes never loads torch).
ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


#: Bytes per element of each stored dtype (a header's shape must fit its byte range).
ST_ITEMSIZE: dict[str, int] = {st: size for st, (_, size) in ST_DTYPES.items()}

if TYPE_CHECKING:
    import torch

    #: torch dtype -> its safetensors name, and back (made on first use: :func:`torch_dtypes`).
    DTYPE_TO_ST: dict[torch.dtype, str]
    ST_TO_DTYPE: dict[str, torch.dtype]


class TorchDtypes(NamedTuple):
    """:data:`ST_DTYPES` as torch dtypes: ``to_st`` (torch -> safetensors name) and back."""

    to_st: dict[torch.dtype, str]
    from_st: dict[str, torch.dtype]


@functools.cache
def torch_dtypes() -> TorchDtypes:
    """The torch dtype maps of :data:`ST_DTYPES`, made once, when tensors are first written or
    read (``featbake stats``, ``roots``, ``gc`` and ``verify`` never ask for them)."""
    import torch

    to_st = {getattr(torch, name): st for st, (name, _) in ST_DTYPES.items()}
    return TorchDtypes(to_st, {v: k for k, v in to_st.items()})


def __getattr__(name: str) -> Any:
    """``DTYPE_TO_ST`` and ``ST_TO_DTYPE``, importable as before but made on first use (PEP
    562), so that importing this module does not load torch."""
    if name == "DTYPE_TO_ST":
        return torch_dtypes().to_st
    if name == "ST_TO_DTYPE":
        return torch_dtypes().from_st
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
#: Its address, for the compiled batch read (featbake/kernels.c), which calls it outside the GIL.
_EXTEND_ADDR: int | None = (
    ctypes.cast(_EXTEND_AT, ctypes.c_void_p).value  # type: ignore[arg-type]  # a CFuncPtr
    if _EXTEND_AT is not None
    else None
)


def crc32c(buf: Any, crc: int = 0) -> int:
    """CRC-32C of any contiguous buffer (``bytes``, a memoryview, a numpy array), extending ``crc``.

    Example:
        >>> f"{crc32c(b'123456789'):08x}"  # the standard check value
        'e3069283'
    """
    if isinstance(buf, bytes) or _EXTEND_AT is None:
        return int(google_crc32c.extend(crc, bytes(buf)))
    arr = np.frombuffer(buf, dtype=np.uint8)  # no copy; keeps the memory alive for the call
    return _crc32c_at(crc, arr.ctypes.data, arr.nbytes) if arr.nbytes else crc


def crc32c_tensor(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C of a CPU tensor's bytes in row-major order, extending ``crc``.

    A contiguous tensor is checked in place (no copy).
    """
    t = t.contiguous()
    if _EXTEND_AT is None:
        return crc32c(tensor_buffer(t), crc)
    nbytes = t.numel() * t.element_size()
    return _crc32c_at(crc, t.data_ptr(), nbytes) if nbytes else crc


def _crc32c_at(crc: int, at: int, nbytes: int) -> int:
    """CRC-32C of ``nbytes`` at address ``at``: through the compiled kernels where they are
    built (carry-less multiplication on AVX-512 cores, ~2x google_crc32c's loop on an item just
    read, and outside the GIL from 64 KiB), else google_crc32c's C function."""
    native = kernels()
    if native is not None and _EXTEND_ADDR is not None:
        return int(native.crc32c(crc, at, nbytes, _EXTEND_ADDR))
    assert _EXTEND_AT is not None
    return int(_EXTEND_AT(crc, at, nbytes))


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
    return checksum_v2(name, torch_dtypes().to_st[t.dtype], tuple(t.shape), t)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    import torch

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
            "dtype": torch_dtypes().to_st[t.dtype],
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


@dataclass(frozen=True)
class ShardHeader:
    """A shard's header, checked against its file: its metadata, the tensors whose bytes lie
    in the file, and the tensors it names whose bytes run past the file's end (``cut``: only
    ever non-empty where a cut shard was asked for, see :func:`parse_header`)."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    cut: tuple[str, ...] = ()


# == shard_header ==================================================================================
# A shard's file and header, checked before anything is read: only a regular file, every field
# against the file.
#
# Only regular files are shards: a FIFO, a directory or a device at a shard's path is refused
# before anything is read from it (opening a FIFO for reading would block until a writer came).
# Every header field is checked against the file before a tensor is handed out, so a hostile or
# damaged header gives :class:`StoreCorrupt`, never another exception, a crash or a hang.
def corrupt_shard(path: Path, why: str) -> ShardDamaged:
    """The error for a damaged shard file of a directory store (or a tier's copy)."""
    return ShardDamaged(
        f"shard {path} is damaged ({why}); run `featbake verify --repair` to quarantine it, "
        "then `featbake build` to recompute what it held",
        why,
    )


def damaged_object(where: str, why: str) -> ShardDamaged:
    """The error for a damaged shard object in a bucket (``where``: its URL), fetched whole or
    read by ranges: a bucket has no ``verify --repair``; a build encodes again what a deleted
    object held."""
    return ShardDamaged(
        f"{where} is damaged in the bucket ({why}): nothing of it is served; delete it, then "
        "build again (a build encodes again what a missing shard held)",
        why,
    )


def unfinite_scale(name: str) -> str:
    """Why an int8/fp8 tensor with a row whose scale is NaN or infinite is damaged: quantize
    never writes one (read with ``verify="never"``, or a damage its checksum missed); it is
    refused on every read path, never served as NaN or inf."""
    return f"tensor {name} has a row scale that is not finite"


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
    path: Path, raw: bytes, base: int, size: int, *, cut_ok: bool = False
) -> ShardHeader:
    """The metadata and tensor table of a shard whose JSON header is ``raw``.

    ``base`` is the file offset where data starts and ``size`` the file's size: every tensor's
    byte range must lie inside the data, and its dtype and shape must fill that range exactly.

    ``cut_ok`` is for repair's salvage alone: a file cut short (a disk that filled mid-copy,
    an interrupted rsync) then parses, its table holding only the tensors whose bytes end at
    or before the file's end and ``cut`` naming the others. Every other reader refuses it, so
    a cut shard is never served before repair.

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
        name: tensor_info(path, name, entry, base, size, sums.get(name), cut_ok=cut_ok)
        for name, entry in header.items()
    }
    return _within(meta, infos, size) if cut_ok else ShardHeader(meta, infos)


def _within(meta: dict[str, str], infos: dict[str, TensorInfo], size: int) -> ShardHeader:
    """The header of a file of ``size`` bytes that may be cut short: the tensors whose bytes
    all lie in it, and the names of those whose bytes run past its end."""
    whole = {name: info for name, info in infos.items() if info.end <= size}
    return ShardHeader(meta, whole, tuple(sorted(name for name in infos if name not in whole)))


def _checksums(path: Path, text: str) -> dict[str, str]:
    try:
        sums = json.loads(text)
    except (ValueError, RecursionError):
        raise corrupt_shard(path, "unreadable checksums in the metadata") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise corrupt_shard(path, "unreadable checksums in the metadata")
    return sums


def tensor_info(
    path: Path,
    name: str,
    entry: Any,
    base: int,
    size: int,
    crc: str | None,
    *,
    cut_ok: bool = False,
) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape that fills its byte range in the file
    (with ``cut_ok``, a range that may run past the file's end: :func:`parse_header`).

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
    if base + end > size and not cut_ok:
        raise corrupt_shard(path, f"truncated: {size} bytes, header promises more")
    if nbytes != end - begin:
        raise corrupt_shard(path, f"tensor {name!r}: shape {shape} does not fit its byte range")
    return TensorInfo(dtype, tuple(shape), base + begin, base + end, crc)


# == writer ========================================================================================
# Sealing shards: tmp -> fsync -> rename -> fsync dir, named by the SHA-256 of their bytes.
@dataclass(frozen=True)
class ShardEntry:
    """One tensor in a sealed shard, as the catalog records it."""

    key: str
    part: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def tensor(self) -> str:
        return tensor_name(self.key, self.part)


@dataclass(frozen=True)
class SealedShard:
    """A shard that is durably in place: its content name, path, size and entries."""

    name: str
    path: Path
    nbytes: int
    encoder_fp: str
    recipe_fp: str
    entries: tuple[ShardEntry, ...]


@dataclass
class ShardWriter:
    """Collects features and seals them into immutable shards of about ``target_bytes``.

    A shard is also sealed once its first feature has waited ``seal_seconds`` (checked on each
    :meth:`add`, and by a caller that polls :meth:`due`): a process killed with SIGKILL loses
    only what it added since the last seal, not a whole 256 MiB shard (issue 32 item 1).

    A context manager: what was added is sealed on exit, also when the block raised (an
    interrupted build keeps what it encoded). ``on_seal`` is called with each sealed shard, which
    is where the caller commits catalog rows.

    Example:
        >>> layout = Layout(root).ensure()  # doctest: +SKIP
        >>> with ShardWriter(layout, enc_fp, recipe_fp, on_seal=catalog.add_shard) as w:
        ...     w.add(key, {"": features})  # doctest: +SKIP
    """

    layout: Layout
    encoder_fp: str
    recipe_fp: str
    target_bytes: int = DEFAULT_SHARD_BYTES
    max_items: int = DEFAULT_SHARD_ITEMS
    on_seal: Any = None
    seal_seconds: float = math.inf
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    _pending_bytes: int = field(default=0, init=False)
    _first_added: float = field(default=0.0, init=False)  # monotonic time of the oldest pending
    sealed: list[SealedShard] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.target_bytes <= 0 or self.max_items <= 0:
            raise ConfigError(
                "shard size and item limit must be positive (e.g. --shard-size 256MiB)"
            )
        if not self.seal_seconds > 0:
            raise ConfigError(f"--seal-every must be positive seconds, got {self.seal_seconds!r}")

    @property
    def pending_bytes(self) -> int:
        """Bytes added but not yet sealed."""
        return self._pending_bytes

    def due(self, now: float | None = None) -> bool:
        """True when something is pending and the oldest of it has waited ``seal_seconds``."""
        if not self._tensors:
            return False
        return (time.monotonic() if now is None else now) - self._first_added >= self.seal_seconds

    @property
    def oldest_pending(self) -> float | None:
        """When (``time.monotonic()``) the oldest feature not yet sealed was added; None if none."""
        return self._first_added if self._tensors else None

    def add(self, key: str, parts: Mapping[str, torch.Tensor]) -> SealedShard | None:
        """Add one feature (its output parts); seal and return the shard if it is now full,
        or if its oldest feature has waited ``seal_seconds``."""
        if not self._tensors:
            self._first_added = time.monotonic()
        for part, t in parts.items():
            name = tensor_name(key, part)
            if name in self._tensors:
                continue  # the same input twice in one shard: first wins
            if t.dtype not in torch_dtypes().to_st:
                raise ConfigError(f"featbake cannot store dtype {t.dtype} (feature {name})")
            t = t.detach().to("cpu").contiguous()
            self._tensors[name] = t
            self._pending_bytes += t.numel() * t.element_size()
        full = self._pending_bytes >= self.target_bytes or len(self._tensors) >= self.max_items
        if full or self.due():
            return self.seal()
        return None

    def seal(self) -> SealedShard | None:
        """Write what is pending as one shard (tmp, fsync, rename, fsync dir); None if empty."""
        if not self._tensors:
            return None
        tensors, self._tensors, self._pending_bytes = self._tensors, {}, 0
        for attempt in range(3):
            # Shared with other writers, exclusive of `verify --repair`: it must never see this
            # shard's file without the rows we are about to commit (store/layout.py).
            with shared_write_lock(self.layout):
                shard = write_shard(self.layout, tensors, self.encoder_fp, self.recipe_fp)
                try:
                    if self.on_seal is not None:
                        self.on_seal(shard)
                    break
                except ShardMissing:
                    # gc removed a byte-identical shard (same content name, same path) between
                    # our rename and our catalog commit; the commit refused it: write it again.
                    if attempt == 2:
                        raise
        self.sealed.append(shard)
        return shard

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.seal()


#: A shard of at least this many bytes is hashed on a thread of its own while its file is
#: written and fsynced (both release the GIL): a build's last shard is sealed while it waits,
#: and the wait is on the slower of the two, not their sum (issue 42 item 4). Below it, the
#: thread would cost more than the hash.
DIGEST_BESIDE_BYTES = 1 << 20


def sha256_hex(bufs: Sequence[Any]) -> str:
    """SHA-256 of ``bufs`` one after the other, as hex."""
    digest = hashlib.sha256()
    for buf in bufs:
        digest.update(buf)
    return digest.hexdigest()


@contextlib.contextmanager
def digest_beside(bufs: Sequence[Any], size: int) -> Iterator[Callable[[], str]]:
    """The block runs while ``bufs``' SHA-256 is computed beside it (on a thread, for
    :data:`DIGEST_BESIDE_BYTES` or more); it gets a function that returns the hex digest once
    it is done. The thread is joined on the way out, also when the block raises; where no
    thread may start (the interpreter exiting), the digest is computed when asked."""
    if size < DIGEST_BESIDE_BYTES:
        yield lambda: sha256_hex(bufs)
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="featbake-shard-digest")
    try:
        future = pool.submit(sha256_hex, bufs)
    except RuntimeError:
        # At interpreter exit (a dataset's write-back sealed by its exit hook) no new thread
        # is started: the digest is computed here, after the write. It was the error, and
        # every written-back feature of the run's last seal was lost.
        pool.shutdown()
        yield lambda: sha256_hex(bufs)
        return
    with pool:
        yield future.result


def write_shard(
    layout: Layout, tensors: Mapping[str, torch.Tensor], encoder_fp: str, recipe_fp: str
) -> SealedShard:
    """Serialise ``tensors`` as a safetensors shard and durably move it into place.

    The file is streamed tensor by tensor (no second copy of the shard in memory) and named by
    the SHA-256 of its bytes, computed beside the write and fsync (:func:`digest_beside`).

    Raises:
        StoreError: the disk is full or the store is not writable; no partial shard is left
            anywhere but ``tmp/`` (and not even there when cleanup succeeds).
    """
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    head, order = shard_header(tensors, shard_metadata(tensors, encoder_fp, recipe_fp))
    bufs: list[bytes | memoryview] = [head, *(tensor_buffer(t) for _, t in order)]
    size = sum(len(b) for b in bufs)
    tmp = layout.tmp / f"{uuid.uuid4().hex}.part"
    try:
        # held while it is written: no gc's sweep takes it (store/files.py: holding)
        with holding(tmp) as held, digest_beside(bufs, size) as digest:
            with open(held.fd, "wb", closefd=False) as f:  # through the held descriptor
                for buf in bufs:
                    f.write(buf)
                f.flush()
                os.fsync(f.fileno())
            name = digest()
            final = layout.shard_path(name)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        hint = (
            "the disk is full: free space or move the store with --cache DIR"
            if e.errno == errno.ENOSPC
            else "check that the cache directory is writable"
        )
        raise StoreError(
            f"could not write a shard under {layout.root}: {e.strerror or e}; {hint}. "
            "Everything sealed before this is intact; rerun to continue."
        ) from e
    entries = tuple(
        ShardEntry(
            *split_tensor_name(n),
            dtype=torch_dtypes().to_st[t.dtype],
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
        )
        for n, t in tensors.items()
    )
    return SealedShard(name, final, size, encoder_fp, recipe_fp, entries)


# == readahead =====================================================================================
# Asking the kernel to start reading a byte range of a shard, without waiting for it.
#
# A cold read (a store larger than the page cache) waits for the disk once per ``pread``; one
# read at a time, a shuffled epoch of ~600 KB items ran at about half the disk's bandwidth here.
# Reads a loader knows it will make soon can be started now with ``posix_fadvise(WILLNEED)``:
# the kernel queues them and returns, so many are in flight while the caller reads (and checks)
# the one it needs, and each later ``pread`` finds its pages in the cache.
#
# A hint costs a system call even when the pages are cached already (~11 us for 700 KB here, a
# cost a warm epoch would pay for nothing), so a one-byte ``pread`` with ``RWF_NOWAIT`` (~1 us,
# never waits for the disk) first asks whether a page inside the range is cached, and a cached
# range is left alone. Where the platform has neither call (macOS has no ``posix_fadvise``),
# nothing is hinted and reads are as before.
#: The page size the probe aligns to; a wrong guess only makes the probe less precise.
_PAGE = 4096
_FADVISE = getattr(os, "posix_fadvise", None)
_WILLNEED: int = getattr(os, "POSIX_FADV_WILLNEED", 3)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: The probe's byte: its value is never looked at, so threads may share it.
_PROBE = bytearray(1)


def can_hint() -> bool:
    """Whether :func:`will_need` can start reads on this platform."""
    return _FADVISE is not None


def cached(fd: int, begin: int, nbytes: int) -> bool | None:
    """Whether a page inside ``[begin, begin + nbytes)`` is in the page cache (never waits).

    The page probed lies in the range's middle, away from its ends, whose pages a neighbouring
    tensor that was read may share. None when the platform cannot tell without waiting.
    """
    if _NOWAIT is None or nbytes <= 0:
        return None
    mid = begin + nbytes // 2
    probe = max(begin, mid - mid % _PAGE)
    try:
        return os.preadv(fd, [_PROBE], probe, _NOWAIT) == 1
    except BlockingIOError:  # EAGAIN: reading it would have waited for the disk
        return False
    except OSError:  # EOPNOTSUPP (a filesystem without RWF_NOWAIT), a closed fd: cannot tell
        return None


def will_need(fd: int, begin: int, nbytes: int) -> bool:
    """Start reading ``nbytes`` at ``begin`` into the page cache, unless they are there already.

    A hint: it never raises for a file that cannot be read ahead (the read that follows
    reports any real error) and returns at once; the kernel reads in the background.

    Args:
        fd: an open, readable file descriptor.
        begin: the first byte.
        nbytes: how many bytes.

    Returns:
        True when reads were started (the range was not cached, or the platform cannot tell).

    Example:
        >>> fd = os.open(path, os.O_RDONLY)  # doctest: +SKIP
        >>> will_need(fd, 4096, 600_000)  # doctest: +SKIP
        True
    """
    if _FADVISE is None or nbytes <= 0 or cached(fd, begin, nbytes):
        return False
    try:
        _FADVISE(fd, begin, nbytes, _WILLNEED)
    except OSError:  # a descriptor closed meanwhile, a filesystem that refuses hints
        return False
    return True


# == reader ========================================================================================
# Reading sealed shards: the header parsed and checked once, then one read path for every tensor.
#
# Every read, of one tensor or of a batch's rows, is a list of :class:`Span` (an open shard, a
# file offset, the buffer the bytes go to, and the checksum to check or None) that
# :func:`read_spans` reads with ``pread`` into caller-owned memory, never mmap, and checks with
# the shard format's CRC; both release the GIL. The file and its header are checked by
# :mod:`featbake.store.shard` before anything is read.
class VerifyMode(StrEnum):
    """When a tensor's checksum is checked: on its first read in a process, always, or never."""

    FIRST = "first"
    ALWAYS = "always"
    NEVER = "never"

    @classmethod
    def parse(cls, value: VerifyMode | str) -> VerifyMode:
        """``value`` as a mode; anything else is a :class:`ConfigError` (never a silent "never")."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"verify must be 'first', 'always' or 'never', got {value!r}"
            ) from None


_MODES = frozenset(VerifyMode)


# -- leases -----------------------------------------------------------------------------------
# A reader's file descriptor is used outside the GIL (a pread, the compiled batch read), often
# on another thread than the one that evicts the reader from a process's open shards. Closing it
# there at once let such a read use a closed descriptor ("Bad file descriptor") or, once the
# number was reused by the next open, another shard's bytes at the same offset (another item's
# features served). So every use of the descriptor holds a lease (:meth:`ShardReader.acquire`,
# :class:`Leases`), an eviction only retires the reader (:meth:`ShardReader.retire`), and the
# last lease released closes it.
class ReaderState(Enum):
    """Where a reader is in its life: open, retired (closed when its last user is done), closed."""

    OPEN = "open"
    RETIRING = "retiring"
    CLOSED = "closed"


_OPEN, _RETIRING, _CLOSED = ReaderState.OPEN, ReaderState.RETIRING, ReaderState.CLOSED


class ReaderClosed(StoreError):
    """A read was asked of a reader that is closed (evicted, or closed by its owner, before it
    was leased). Serving paths lease a reader when they look it up, so they never see this."""


class Leases:
    """The readers one read holds: each taken with :meth:`take`, all released on exit.

    Example:
        >>> with Leases() as held:  # doctest: +SKIP
        ...     reader = handles.lease(path, held)
        ...     read_spans([reader.span(name, dest)])
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: list[ShardReader] = []

    def take(self, reader: ShardReader) -> bool:
        """Lease ``reader`` until this block ends (once: a batch's rows share their shards);
        False (nothing held) when it is closed."""
        if reader in self.held:  # by identity; a batch holds a few shards
            return True
        if not reader.acquire():
            return False
        self.held.append(reader)
        return True

    def require(self, reader: ShardReader) -> None:
        """Lease ``reader`` until this block ends.

        Raises:
            ReaderClosed: it is closed.
        """
        if not self.take(reader):
            raise reader.closed_error()

    def __enter__(self) -> Leases:
        return self

    def __exit__(self, *exc: object) -> None:
        held, self.held = self.held, []
        for reader in reversed(held):
            reader.release()


class ShardReader:
    """Reads tensors out of one sealed shard; the header is parsed and checked once, on open.

    Each tensor's checksum is checked on its first read in this process
    (``verify=VerifyMode.FIRST``), on every read (``ALWAYS``) or never (``NEVER``). Format 2
    checksums bind the tensor's name, dtype and shape as well as its bytes; format 1 (written by
    featbake before 2) binds the bytes only, and is still read and verified.

    Thread-safe for reads: each use of the file descriptor holds a lease (see ``Leases``), and
    :meth:`retire` (an eviction) closes the file only once the last lease is released.
    """

    # Class defaults for a subclass that opens no file (a bucket's ranged reader sets up its
    # own state and never calls this __init__): its counts then live on the instance at first
    # use, guarded by this shared lock.
    _state = ReaderState.OPEN
    _users = 0
    _guard = threading.Lock()
    #: Whether the shard's bytes are a local file descriptor the compiled read can take (a
    #: bucket's ranged reader reads them over HTTP and says False).
    reads_descriptor: ClassVar[bool] = True

    #: Tensors the header names whose bytes run past the end of a file cut short (opened with
    #: ``cut_ok``; otherwise a cut file is refused and this stays empty).
    cut: tuple[str, ...] = ()

    def __init__(
        self,
        path: str | os.PathLike[str],
        verify: VerifyMode | str = VerifyMode.FIRST,
        *,
        cut_ok: bool = False,
    ) -> None:
        """Open the shard at ``path`` and check its header against the file.

        ``cut_ok`` is for repair's salvage alone (see :func:`parse_header`): a file cut short
        opens, holding only the tensors wholly before the cut (each still checked when read),
        and :attr:`cut` names the rest. Without it such a file is :class:`StoreCorrupt`.
        """
        self.path = Path(path)
        self.verify = VerifyMode.parse(verify)
        self._fd = open_regular(self.path)
        try:
            header = self._read_header(cut_ok=cut_ok)
        except BaseException:
            os.close(self._fd)
            raise
        self.metadata, self.tensors, self.cut = header.metadata, header.tensors, header.cut
        self.version = self.metadata["format_version"]
        self._verified: set[str] = set()
        self._guard = threading.Lock()

    # -- lifetime -------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Count one more user of the descriptor; False (nothing counted) once it is closed.
        A retired reader is still leased: it reads the file it opened until its last user."""
        with self._guard:
            if self._state is _CLOSED:
                return False
            self._users += 1
        return True

    def release(self) -> None:
        """One user is done; the last one closes a retired reader."""
        with self._guard:
            self._users -= 1
            if self._users or self._state is not _RETIRING:
                return
            self._state = _CLOSED  # under the lock: no lease is taken from here on
        self.close()

    def retire(self) -> None:
        """Close the file once no read uses it: now, or when the last lease is released (an
        eviction from a process's open shards, which another thread may be reading)."""
        with self._guard:
            if self._state is not _OPEN:
                return
            if self._users:
                self._state = _RETIRING
                return
            self._state = _CLOSED  # under the lock: no lease is taken from here on
        self.close()

    @property
    def state(self) -> ReaderState:
        """Open, retiring (closed when its last lease is released) or closed."""
        return self._state

    def closed_error(self) -> ReaderClosed:
        """The error of a read asked of this reader once closed."""
        return ReaderClosed(
            f"the reader of shard {self.path} was closed before this read (evicted from the "
            "open shards by another thread); read it through ShardHandles.lease, which keeps "
            "it open until the read is done"
        )

    def _read_header(self, *, cut_ok: bool = False) -> ShardHeader:
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise self.damaged("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise self.damaged(f"header length {n} does not fit a {size}-byte file")
            raw = os.pread(self._fd, n, 8)
        except OSError as e:
            raise StoreError(f"cannot read shard {self.path}: {e.strerror or e}") from e
        if len(raw) != n:
            raise self.damaged("the header is cut short")
        return parse_header(self.path, raw, 8 + n, size, cut_ok=cut_ok)

    @property
    def checksums_bind_header(self) -> bool:
        """Whether a passing checksum also proves the tensor's name, dtype and shape (format 2).

        A format-1 checksum covers the bytes only: a repair that copies tensors out of a damaged
        format-1 shard cannot tell an edited dtype or shape from the one written.
        """
        return self.version != "1"

    @property
    def fd(self) -> int:
        """The open file descriptor (reads go through :meth:`read_span`; this is for inspection)."""
        return self._fd

    def cut_short(self, name: str) -> StoreCorrupt:
        """The error for a tensor whose bytes end before the header says."""
        return self.damaged(f"tensor {name} is cut short")

    def damaged(self, why: str) -> ShardDamaged:
        """The error for this shard's damage, naming where it lies and the fix there (a
        directory's: ``verify --repair``; a bucket's reader says its own)."""
        return corrupt_shard(self.path, why)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, *, verify: VerifyMode | str | None = None) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor (a copy; the file stays closed to writes).

        Its bytes are :meth:`read_bytes`' (into the tensor's memory), viewed as its dtype and
        shape.

        Raises:
            StoreCorrupt: the shard holds no such tensor, or its bytes fail their checksum.
            ConfigError: ``verify`` is not a :class:`VerifyMode`.
        """
        import torch

        info = self.info(name)
        buf = torch.empty(info.end - info.begin, dtype=torch.uint8)
        self.read_bytes(name, verify=verify, out=buf.numpy())
        return buf.view(torch_dtypes().from_st[info.dtype]).view(info.shape)

    def read_bytes(
        self, name: str, *, verify: VerifyMode | str | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The bytes of tensor ``name`` in ``out`` (a ``uint8`` array of their size) or a fresh
        array, checked as ``verify`` says: ``featbake verify`` checks a shard so, without torch.

        A batch of one: :meth:`read_span`, the step :func:`read_spans` takes per span, into a
        fresh buffer (called directly, so that one tensor pays no span list).

        Raises:
            StoreCorrupt: the shard holds no such tensor, or its bytes fail their checksum.
            ConfigError: ``verify`` is not a :class:`VerifyMode`.
        """
        info = self.info(name)
        mode = self.verify if verify is None else verify
        if mode not in _MODES:
            mode = VerifyMode.parse(mode)
        check = mode == VerifyMode.ALWAYS or (
            mode == VerifyMode.FIRST and name not in self._verified
        )
        buf = np.empty(info.end - info.begin, dtype=np.uint8) if out is None else out
        self.read_span(info.begin, buf, self.check_of(name, info) if check else None)
        return buf

    def info(self, name: str) -> TensorInfo:
        """Where tensor ``name`` lies in this shard, and its checksum.

        Raises:
            StoreCorrupt: the shard holds no such tensor (the catalog says it does).
        """
        info = self.tensors.get(name)
        if info is None:
            raise self.lacking(name)
        return info

    def lacking(self, name: str) -> StoreCorrupt:
        """The error for a tensor the catalog names in this shard and its header lacks: a
        directory's catalog is rebuilt from its shards (a bucket's reader says its own)."""
        return StoreCorrupt(
            f"shard {self.path} holds no tensor {name} although the catalog says so; "
            "run `featbake verify --repair` to rebuild the catalog from the shards"
        )

    def read_into(self, name: str, out: torch.Tensor, *, verify: bool = True) -> None:
        """Read tensor ``name``'s bytes straight into ``out`` (no intermediate buffer).

        ``out`` is a contiguous CPU tensor with exactly the tensor's byte size (e.g. a RAM-tier
        entry in its own mapping).

        Raises:
            StoreCorrupt: no such tensor, a short read, or (with ``verify``) a checksum mismatch.
            ConfigError: ``out`` is not a contiguous CPU tensor of the tensor's byte size.
        """
        import torch

        info = self.info(name)
        nbytes = info.end - info.begin
        if out.device.type != "cpu" or not out.is_contiguous() or out.nbytes != nbytes:
            raise ConfigError(
                f"read_into needs a contiguous CPU tensor of {nbytes} bytes for {name}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        dest = out.view(-1).view(torch.uint8).numpy()
        self.read_span(info.begin, dest, self.check_of(name, info) if verify else None)

    def span(
        self,
        name: str,
        dest: Any,
        *,
        verify: bool = True,
        tail: Any = None,
        packed: PackedRows | None = None,
    ) -> Span:
        """Tensor ``name``'s :class:`Span` into ``dest``, to read with :func:`read_spans`.

        ``dest`` is a contiguous ``uint8`` numpy array of exactly the tensor's byte size (a
        slice of a batch's bytes), or with ``packed`` of the byte size its rows have served
        (dequantised as they are read); ``tail``, the padding after it in a batch row, is
        zeroed. Everything that builds the checksum's descriptor happens here, on the caller's
        thread; the read itself is a ``pread`` and a CRC, both outside the GIL, so a batch's
        rows read on several threads do not queue for it (see ``featbake.serve.reads``).

        Raises:
            StoreCorrupt: no such tensor (the read raises short reads and checksum mismatches).
            ConfigError: ``dest`` is not of the tensor's byte size.
        """
        info = self.info(name)
        want = info.end - info.begin
        if packed is not None:  # the served bytes of its rows
            want = want // (packed.width + SCALE_BYTES) * packed.width * packed.dtype.itemsize
        if dest.nbytes != want:
            raise ConfigError(f"a read of {name} needs {want} bytes, got {dest.nbytes}")
        return Span(self, info.begin, dest, tail, self.check_of(name, info) if verify else None)

    def check_of(self, name: str, info: TensorInfo) -> SpanCheck:
        """How tensor ``name`` (``info``, from :attr:`tensors`) is checked: format 1's CRC-32
        of the bytes, or format 2's CRC-32C extending the CRC of the tensor's descriptor
        (name, dtype, shape)."""
        want = _hex(info.crc)
        if self.version == "1":
            return SpanCheck(name, zlib.crc32, 0, want)
        return SpanCheck(
            name, crc32c, crc32c(tensor_descriptor(name, info.dtype, info.shape)), want
        )

    def read_span(self, begin: int, dest: Any, check: SpanCheck | None = None) -> None:
        """The one ``pread`` (and check) of every read: ``dest.nbytes`` bytes at ``begin``.

        :func:`read_spans` calls it per span; the dataset's located hit path calls it directly
        (``check`` None: the item was checked before) so that a hit pays no list or tuple.

        Raises:
            StoreCorrupt: a short read, or the bytes fail ``check``.
            StoreError: the read fails.
        """
        n = dest.nbytes
        if n:
            if not self.acquire():
                raise self.closed_error()
            try:
                got = self._read_bytes(begin, dest)
            finally:
                self.release()
            if got != n:
                raise self.cut_short(check.name if check is not None else self.name_at(begin))
        if check is not None:
            if check.want is None or check.digest(dest, check.head) != check.want:
                raise self.damaged(f"checksum mismatch in tensor {check.name}")
            self._verified.add(check.name)

    def read_packed_span(self, begin: int, out: torch.Tensor, packed: PackedRows) -> ScaleSpan:
        """The one read of a located packed item (checked before): its rows at ``begin`` read
        and dequantised into ``out`` (contiguous, ``[..., packed.width]`` of ``packed.dtype``),
        in one call of the compiled kernels where built (a local shard's: a bucket's ranged
        reader reads by its own :meth:`read_span`, see :func:`native_readable`); the span of
        its row scales.

        What :meth:`read_span` is to a stored item, for one served dequantised: the dataset's
        hit path pays no span list (measured one ``[200, 768]`` int8 item per step: a pread
        then a dequantise 0.84-0.89x fp16's read).

        Raises:
            StoreCorrupt: a short read.
            StoreError: the read fails.
        """
        import torch

        rows = out.numel() // packed.width if packed.width else 0
        native = kernels()
        if native is None or not self.reads_descriptor:  # a bucket's ranged reader: no fd
            dest = out.reshape(-1).view(torch.uint8).numpy()
            return _read_packed(self, begin, dest, None, packed)
        scheme, code, width = packed.kernel_codes()
        stored = rows * (width + SCALE_BYTES)
        if not self.acquire():  # the descriptor stays open for the whole kernel call
            raise self.closed_error()
        try:
            span = (self._fd, begin, stored, out.data_ptr(), 0, 0, 0, -1)
            failed, low, high = native.read_rows([span], 0, scheme, code, width, 1)
        finally:
            self.release()
        if failed is not None:
            dest = out.reshape(-1).view(torch.uint8).numpy()
            raise _read_failure(Span(self, begin, dest, None, None), failed[1], failed[2])
        return ScaleSpan(low, high)

    def _read_bytes(self, begin: int, dest: Any) -> int:
        """Read ``dest.nbytes`` bytes at ``begin`` into ``dest``; how many came.

        Raises:
            StoreError: the read fails.
        """
        try:
            return os.preadv(self._fd, (dest,), begin)
        except OSError as e:
            raise StoreError(f"cannot read shard {self.path}: {e.strerror or e}") from e

    def unlinked(self) -> bool:
        """True once the file read here was deleted (its space is freed when this closes)."""
        if not self.acquire():
            return True
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True
        finally:
            self.release()

    def will_need(self, name: str) -> bool:
        """Start reading tensor ``name``'s bytes into the page cache, without waiting for them.

        A hint for a read coming soon (see :mod:`featbake.store.shard`): nothing when the
        bytes are cached already, the shard holds no such tensor, or the platform cannot hint.
        True when reads were started.
        """
        info = self.tensors.get(name)
        if info is None or not self.acquire():
            return False
        try:
            return will_need(self._fd, info.begin, info.end - info.begin)
        finally:
            self.release()

    def name_at(self, begin: int) -> str:
        """The name of the tensor whose bytes start at ``begin`` (for an error message)."""
        return next((n for n, info in self.tensors.items() if info.begin == begin), f"@{begin}")

    def verify_all(self) -> list[str]:
        """Names of tensors whose bytes fail their checksum (empty when the shard is sound)."""
        bad = []
        for name in self.tensors:
            try:
                self.read(name, verify=VerifyMode.ALWAYS)
            except StoreCorrupt:
                bad.append(name)
        return bad

    def close(self) -> None:
        """Close the file now, whoever else holds a lease (the owner's close: an evicting
        process retires instead). Once only: the number may belong to another file after."""
        self._state = _CLOSED
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SpanCheck(NamedTuple):
    """How one tensor's bytes are checked: its name (for errors and the verified set), its
    format's digest (format 1: CRC-32 of the bytes; 2: CRC-32C extending ``head``, the CRC of
    the tensor's name, dtype and shape) and the value the header promises (None: it promises
    none, which fails)."""

    name: str
    digest: Callable[[Any, int], int]
    head: int
    want: int | None


class Span(NamedTuple):
    """One stored tensor's read: its open shard, the file offset of its bytes, where they go
    (``dest``: exactly its bytes; ``tail``: a batch row's padding after them, zeroed, or None)
    and its check (None: not checked on this read).

    ``at``, when not 0, is ``dest``'s address with ``tail`` right after it (a padded batch's
    row, whose caller knows the batch's address): the compiled read then takes no numpy
    ``ctypes`` of either (~1 us each, two per row of every batch).
    """

    reader: ShardReader
    begin: int
    dest: Any
    tail: Any
    check: SpanCheck | None
    at: int = 0


def read_spans(
    spans: Sequence[Span], packed: PackedRows | None = None, threads: int = 1
) -> ScaleSpan:
    """Read (and check) each span into its buffer, zeroing its padding: the one read path.

    A single tensor is a batch of one; a batch's rows are runs of spans, one run per thread
    (``featbake.serve.reads``). Runs on any thread: it touches only the spans' buffers, the
    shards' read-only file descriptors and their verified sets. Where the compiled kernels are
    built (:mod:`featbake.native`) the whole run is one call that holds the GIL once: its
    preads, CRC-32C checks, dequantising and padding all run outside it (the Python path,
    which gives the same bytes, takes the GIL back after each row's read and check).

    Args:
        spans: the reads. With ``packed``, each span's ``dest`` is where its rows go *served*
            (``rows * packed.width`` values of ``packed.dtype``); the stored bytes read are
            ``rows * (packed.width + 4)``.
        packed: the rows are packed int8/fp8, dequantised as they are read (one pass through
            a cache-sized buffer, no packed batch in between); None: bytes copied as stored.
        threads: with the compiled kernels, the spans are read on this many threads (contiguous
            runs; threads the kernel starts, all within the one release of the GIL). The
            Python path reads on the calling thread (``featbake.serve.reads`` runs it on its
            pool instead).

    Returns:
        The span of the row scales dequantised (:class:`~featbake.quantize.ScaleSpan`; empty
        without ``packed``): whether the served dtype holds them is the caller's to check.

    Raises:
        StoreCorrupt: a short read or a checksum mismatch (the spans after it are not read).
        StoreError: a read fails.
    """
    if packed is not None and not packed.width:
        raise ConfigError("packed rows of no values cannot be served dequantised")
    with Leases() as held:  # every descriptor open for the whole read (see ReaderState)
        for reader in {span.reader for span in spans}:
            held.require(reader)
        return read_leased(spans, packed, threads)


def read_leased(
    spans: Sequence[Span], packed: PackedRows | None = None, threads: int = 1
) -> ScaleSpan:
    """:func:`read_spans` where the caller holds a lease on every span's reader already (a
    dataset's item, whose plan leased its readers): the same reads, no leases taken again.

    Raises:
        StoreCorrupt: a short read or a checksum mismatch.
        StoreError: a read fails.
    """
    native = kernels()
    if native is not None and (
        native_readable(spans[0]) if len(spans) == 1 else all(map(native_readable, spans))
    ):
        return _read_native(native, spans, packed, threads)
    got = ScaleSpan()
    for reader, begin, dest, tail, check, _ in spans:
        if packed is None:
            reader.read_span(begin, dest, check)
        else:
            got = got.merged(_read_packed(reader, begin, dest, check, packed))
        if tail is not None and tail.nbytes:
            tail.fill(0)
    return got


def native_readable(span: Span) -> bool:
    """Whether the compiled read can take ``span`` (when the kernels are built): a local shard
    (a bucket's ranged reader reads over HTTP) and a format-2 check (CRC-32C, whose C function
    google_crc32c exposes) that promises a value, or none."""
    check = span.check
    if not span.reader.reads_descriptor:
        return False
    return check is None or (
        _EXTEND_ADDR is not None and check.digest is crc32c and check.want is not None
    )


def _read_packed(
    reader: ShardReader, begin: int, dest: Any, check: SpanCheck | None, packed: PackedRows
) -> ScaleSpan:
    """The Python path of one packed span: read into a buffer, check, dequantise into dest."""
    import torch

    rows = dest.nbytes // (packed.width * packed.dtype.itemsize)
    if not rows:  # an item of no rows: its (empty) read checked, nothing to dequantise (torch
        reader.read_span(begin, dest, check)  # views no empty array of stride 0 as float16)
        return ScaleSpan()
    raw = torch.empty((rows, packed.width + SCALE_BYTES), dtype=packed.scheme.packed_dtype)
    reader.read_span(begin, raw.view(-1).view(torch.uint8).numpy(), check)
    parts = unpack(raw, packed.scheme)
    out = torch.from_numpy(dest).view(packed.dtype).view(rows, packed.width)
    dequantize_unpacked(parts, packed.scheme, packed.dtype, out)
    span = ScaleSpan.of(parts.scales)
    if span.damaged:
        raise reader.damaged(
            unfinite_scale(check.name if check is not None else reader.name_at(begin))
        )
    return span


def _read_native(
    native: Any, spans: Sequence[Span], packed: PackedRows | None, threads: int
) -> ScaleSpan:
    """:func:`read_spans` as one call of the compiled kernels (see its docstring)."""
    rows: list[tuple[int, int, int, int, int, int, int, int]] = []
    item = packed.dtype.itemsize * packed.width if packed is not None else 0
    for reader, begin, dest, tail, check, at in spans:
        n = dest.nbytes if packed is None else dest.nbytes // item * (packed.width + SCALE_BYTES)
        tail_bytes = tail.nbytes if tail is not None else 0
        if not at:
            at = dest.ctypes.data
            tail_at = tail.ctypes.data if tail_bytes else 0
        else:
            tail_at = at + dest.nbytes if tail_bytes else 0
        rows.append((
            reader._fd, begin, n, at, tail_at, tail_bytes,
            check.head if check is not None else 0,
            check.want if check is not None and check.want is not None else -1,
        ))  # fmt: skip
    scheme, out, width = (-1, 0, 0) if packed is None else packed.kernel_codes()
    failed, low, high = native.read_rows(rows, _EXTEND_ADDR or 0, scheme, out, width, threads)
    done = len(spans) if failed is None else failed[0]
    for span in spans[:done]:
        if span.check is not None:
            span.reader._verified.add(span.check.name)
    if failed is not None:
        raise _read_failure(spans[failed[0]], failed[1], failed[2])
    return ScaleSpan(low, high) if packed is not None else ScaleSpan()


def _read_failure(span: Span, kind: int, err: int) -> StoreError:
    """The error the Python path raises for a span the compiled read could not read."""
    reader, check = span.reader, span.check
    name = check.name if check is not None else reader.name_at(span.begin)
    if kind == 1:
        return reader.cut_short(name)
    if kind == 2:
        return reader.damaged(f"checksum mismatch in tensor {name}")
    if kind == 4:
        return reader.damaged(unfinite_scale(name))
    return StoreError(f"cannot read shard {reader.path}: {os.strerror(err)}")


def _hex(crc: str | None) -> int | None:
    """A header's hex checksum as a number; None (a mismatch) when absent or not hex."""
    try:
        return int(crc, 16) if crc is not None else None
    except ValueError:
        return None
