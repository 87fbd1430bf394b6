"""Shard files: the truth of a store.

A shard is a standard safetensors file holding many features, named by the SHA-256 of its own bytes
and never modified after it is sealed. Tensors are named ``<key>`` (one output) or
``<key>/<output>`` (several). The ``__metadata__`` holds the format version, the encoder and recipe
fingerprints, and a CRC-32 per tensor, because a shard cut short by a crash loads without error in
safetensors (its tail reads as zeros): only the checksums can tell.

Sealing order (crash-safe): write ``tmp/<random>.part`` -> fsync -> rename into
``shards/ab/<sha256>.safetensors`` -> fsync the directory. The catalog rows come after, so a crash
at any point leaves no row pointing at a missing or partial shard; a sealed shard that no row names
is harmless garbage that ``featbake gc`` removes after a grace period.

Reads use ``pread`` into a fresh tensor rather than mmap: memory stays private and bounded (mapped
pages of a long shuffled epoch would otherwise pile up in every worker's resident set).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError

FORMAT_NAME = "featbake-shard"
FORMAT_VERSION = "1"
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
#: safetensors parses the whole JSON header on open; bound it so tiny features do not make it huge.
DEFAULT_SHARD_ITEMS = 8192
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit

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


def _tensor_buffer(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Layout:
    """Where things live inside a cache directory."""

    root: Path

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.sqlite"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def shard_path(self, name: str) -> Path:
        """``shards/ab/<name>.safetensors`` for a shard named ``ab...``."""
        return self.shards / name[:2] / f"{name}.safetensors"

    def ensure(self) -> Layout:
        """Create the directories, or raise a StoreError that says why it could not."""
        try:
            for d in (self.root, self.shards, self.tmp):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the cache directory {self.root}: {e.strerror}; "
                "choose a writable place with --cache DIR or $FEATBAKE_CACHE"
            ) from e
        return self


def remove_file(path: Path) -> int:
    """Remove a file; its size in bytes, or 0 if it was already gone."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def default_cache_dir() -> Path:
    """``$FEATBAKE_CACHE`` if set, else ``./.featbake``."""
    return Path(os.environ.get("FEATBAKE_CACHE") or ".featbake")


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
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    _pending_bytes: int = field(default=0, init=False)
    sealed: list[SealedShard] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.target_bytes <= 0 or self.max_items <= 0:
            raise ConfigError(
                "shard size and item limit must be positive (e.g. --shard-size 256MiB)"
            )

    @property
    def pending_bytes(self) -> int:
        """Bytes added but not yet sealed."""
        return self._pending_bytes

    def add(self, key: str, parts: Mapping[str, torch.Tensor]) -> SealedShard | None:
        """Add one feature (its output parts); seal and return the shard if it is now full."""
        for part, t in parts.items():
            name = tensor_name(key, part)
            if name in self._tensors:
                continue  # the same input twice in one shard: first wins
            if t.dtype not in DTYPE_TO_ST:
                raise ConfigError(f"featbake cannot store dtype {t.dtype} (feature {name})")
            t = t.detach().to("cpu").contiguous()
            self._tensors[name] = t
            self._pending_bytes += t.numel() * t.element_size()
        if self._pending_bytes >= self.target_bytes or len(self._tensors) >= self.max_items:
            return self.seal()
        return None

    def seal(self) -> SealedShard | None:
        """Write what is pending as one shard (tmp, fsync, rename, fsync dir); None if empty."""
        if not self._tensors:
            return None
        tensors, self._tensors, self._pending_bytes = self._tensors, {}, 0
        for attempt in range(3):
            shard = write_shard(self.layout, tensors, self.encoder_fp, self.recipe_fp)
            try:
                if self.on_seal is not None:
                    self.on_seal(shard)
                break
            except ShardMissing:
                # gc removed a byte-identical shard (same content name, same path) between our
                # rename and our catalog commit; the commit refused it, so write it again.
                if attempt == 2:
                    raise
        self.sealed.append(shard)
        return shard

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.seal()


def shard_metadata(
    tensors: Mapping[str, torch.Tensor], encoder_fp: str, recipe_fp: str
) -> dict[str, str]:
    """The ``__metadata__`` of a shard: format, fingerprints and a CRC-32 per tensor."""
    sums = {name: checksum(_tensor_buffer(t)) for name, t in sorted(tensors.items())}
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


def write_shard(
    layout: Layout, tensors: Mapping[str, torch.Tensor], encoder_fp: str, recipe_fp: str
) -> SealedShard:
    """Serialise ``tensors`` as a safetensors shard and durably move it into place.

    The file is streamed tensor by tensor (no second copy of the shard in memory) and named by
    the SHA-256 of its bytes, computed on the way.

    Raises:
        StoreError: the disk is full or the store is not writable; no partial shard is left
            anywhere but ``tmp/`` (and not even there when cleanup succeeds).
    """
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    head, order = shard_header(tensors, shard_metadata(tensors, encoder_fp, recipe_fp))
    digest = hashlib.sha256(head)
    size = len(head)
    tmp = layout.tmp / f"{uuid.uuid4().hex}.part"
    try:
        layout.tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(head)
            for _, t in order:
                buf = _tensor_buffer(t)
                digest.update(buf)
                f.write(buf)
                size += len(buf)
            f.flush()
            os.fsync(f.fileno())
        name = digest.hexdigest()
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
            dtype=DTYPE_TO_ST[t.dtype],
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
        )
        for n, t in tensors.items()
    )
    return SealedShard(name, final, size, encoder_fp, recipe_fp, entries)


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in a shard file and what it should hash to."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int
    crc: str | None


def _corrupt(path: Path, why: str) -> StoreCorrupt:
    return StoreCorrupt(
        f"shard {path} is damaged ({why}); run `featbake verify --repair` to quarantine it, "
        "then `featbake build` to recompute what it held"
    )


class ShardReader:
    """Reads tensors out of one sealed shard; the header is parsed once, on open.

    Each tensor's CRC-32 is checked on its first read in this process (``verify="first"``), on
    every read (``"always"``) or never (``"never"``).
    """

    def __init__(self, path: str | os.PathLike[str], verify: str = "first") -> None:
        self.path = Path(path)
        self.verify = verify
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise ShardMissing(
                f"shard {self.path} is gone (removed by gc or by hand); "
                "run `featbake verify --repair` if this persists"
            ) from e
        except OSError as e:
            raise StoreError(f"cannot open shard {self.path}: {e.strerror}") from e
        try:
            self.metadata, self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise
        self._verified: set[str] = set()

    def _read_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise _corrupt(self.path, "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise _corrupt(self.path, f"header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
            meta = header.pop("__metadata__", None) or {}
            sums = json.loads(meta.get("checksums", "{}"))
            base = 8 + n
            infos = {}
            for name, h in header.items():
                b, e = h["data_offsets"]
                infos[name] = TensorInfo(
                    h["dtype"], tuple(h["shape"]), base + b, base + e, sums.get(name)
                )
        except (ValueError, KeyError, TypeError) as e:
            raise _corrupt(self.path, f"unreadable header: {e}") from e
        if meta.get("format") != FORMAT_NAME:
            raise _corrupt(self.path, "not a featbake shard (no featbake metadata)")
        if infos and max(i.end for i in infos.values()) > size:
            raise _corrupt(self.path, f"truncated: {size} bytes, header promises more")
        return meta, infos

    @property
    def fd(self) -> int:
        """The open file descriptor (for callers that pread located tensors themselves)."""
        return self._fd

    def cut_short(self, name: str) -> StoreCorrupt:
        """The error for a tensor whose bytes end before the header says."""
        return _corrupt(self.path, f"tensor {name} is cut short")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, *, verify: str | None = None) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor (a copy; the file stays closed to writes).

        Raises:
            StoreCorrupt: the shard holds no such tensor, or its bytes fail their checksum.
        """
        info = self._info(name)
        try:
            dtype = ST_TO_DTYPE[info.dtype]
        except KeyError as e:
            raise _corrupt(self.path, f"unknown dtype {info.dtype}") from e
        buf = torch.empty(info.end - info.begin, dtype=torch.uint8)
        mode = verify or self.verify
        check = mode == "always" or (mode == "first" and name not in self._verified)
        self.read_into(name, buf, verify=check)
        return buf.view(dtype).reshape(info.shape)

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise StoreCorrupt(
                f"shard {self.path} holds no tensor {name} although the catalog says so; "
                "run `featbake verify --repair` to rebuild the catalog from the shards"
            )
        return info

    def read_into(self, name: str, out: torch.Tensor, *, verify: bool = True) -> None:
        """Read tensor ``name``'s bytes straight into ``out`` (no intermediate buffer).

        This is how a batch is assembled in place: ``out`` is a contiguous CPU slice of the
        destination (e.g. one row of a padded batch in shared memory) with exactly the tensor's
        byte size.

        Raises:
            StoreCorrupt: no such tensor, a short read, or (with ``verify``) a checksum mismatch.
            ConfigError: ``out`` is not a contiguous CPU tensor of the tensor's byte size.
        """
        info = self._info(name)
        nbytes = info.end - info.begin
        if out.device.type != "cpu" or not out.is_contiguous() or out.nbytes != nbytes:
            raise ConfigError(
                f"read_into needs a contiguous CPU tensor of {nbytes} bytes for {name}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not nbytes:
            return
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        if os.preadv(self._fd, [view], info.begin) != nbytes:
            raise _corrupt(self.path, f"tensor {name} is cut short")
        if verify:
            if info.crc is None or checksum(view) != info.crc:
                raise _corrupt(self.path, f"checksum mismatch in tensor {name}")
            self._verified.add(name)

    def verify_all(self) -> list[str]:
        """Names of tensors whose bytes fail their checksum (empty when the shard is sound)."""
        bad = []
        for name in self.tensors:
            try:
                self.read(name, verify="always")
            except StoreCorrupt:
                bad.append(name)
        return bad

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardHandles:
    """A per-process cache of open :class:`ShardReader` objects, bounded in open files.

    After ``fork`` (DataLoader workers) the child drops its parent's handles and opens its own.
    """

    def __init__(self, max_open: int = 64, verify: str = "first") -> None:
        self.max_open = max_open
        self.verify = verify
        self._readers: OrderedDict[Path, ShardReader] = OrderedDict()
        self._pid = os.getpid()

    def get(self, path: Path) -> ShardReader:
        """An open reader for ``path``, opening (and evicting the least recent) as needed."""
        if self._pid != os.getpid():
            # The parent's readers are its bookkeeping, but the fds are this process's own
            # copies: close them, or each forked worker keeps up to max_open files open.
            for r in self._readers.values():
                r.close()
            self._readers = OrderedDict()
            self._pid = os.getpid()
        reader = self._readers.get(path)
        if reader is not None:
            self._readers.move_to_end(path)
            return reader
        reader = ShardReader(path, verify=self.verify)
        self._readers[path] = reader
        while len(self._readers) > self.max_open:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def forget(self, path: Path) -> None:
        """Close and drop the handle of a shard that moved or vanished."""
        reader = self._readers.pop(path, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        while self._readers:
            _, r = self._readers.popitem()
            r.close()

    def __iter__(self) -> Iterator[Path]:
        return iter(self._readers)
