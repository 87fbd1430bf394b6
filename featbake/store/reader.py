"""Reading one sealed shard: header parsed and checked once, pread into owned memory, checksums.

Only regular files are shards: a FIFO, a directory or a device at a shard's path is refused
before anything is read from it (opening a FIFO for reading would block until a writer came).
Every header field is checked against the file before a tensor is handed out, so a hostile or
damaged header gives :class:`StoreCorrupt`, never another exception, a crash or a hang.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import stat
import struct
import zlib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError
from featbake.store.shard_format import (
    FORMAT_NAME,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
    ST_ITEMSIZE,
    ST_TO_DTYPE,
    TensorInfo,
    crc32c,
    tensor_descriptor,
)


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


class ShardReader:
    """Reads tensors out of one sealed shard; the header is parsed and checked once, on open.

    Each tensor's checksum is checked on its first read in this process
    (``verify=VerifyMode.FIRST``), on every read (``ALWAYS``) or never (``NEVER``). Format 2
    checksums bind the tensor's name, dtype and shape as well as its bytes; format 1 (written by
    featbake before 2) binds the bytes only, and is still read and verified.
    """

    def __init__(
        self, path: str | os.PathLike[str], verify: VerifyMode | str = VerifyMode.FIRST
    ) -> None:
        self.path = Path(path)
        self.verify = VerifyMode.parse(verify)
        self._fd = open_regular(self.path)
        try:
            self.metadata, self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise
        self.version = self.metadata["format_version"]
        self._verified: set[str] = set()

    def _read_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise corrupt_shard(self.path, "shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise corrupt_shard(self.path, f"header length {n} does not fit a {size}-byte file")
            raw = os.pread(self._fd, n, 8)
        except OSError as e:
            raise StoreError(f"cannot read shard {self.path}: {e.strerror or e}") from e
        if len(raw) != n:
            raise corrupt_shard(self.path, "the header is cut short")
        return parse_header(self.path, raw, 8 + n, size)

    @property
    def checksums_bind_header(self) -> bool:
        """Whether a passing checksum also proves the tensor's name, dtype and shape (format 2).

        A format-1 checksum covers the bytes only: a repair that copies tensors out of a damaged
        format-1 shard cannot tell an edited dtype or shape from the one written.
        """
        return self.version != "1"

    @property
    def fd(self) -> int:
        """The open file descriptor (for callers that pread located tensors themselves)."""
        return self._fd

    def cut_short(self, name: str) -> StoreCorrupt:
        """The error for a tensor whose bytes end before the header says."""
        return corrupt_shard(self.path, f"tensor {name} is cut short")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, *, verify: VerifyMode | str | None = None) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor (a copy; the file stays closed to writes).

        Raises:
            StoreCorrupt: the shard holds no such tensor, or its bytes fail their checksum.
            ConfigError: ``verify`` is not a :class:`VerifyMode`.
        """
        info = self._info(name)
        mode = self.verify if verify is None else verify
        if mode not in _MODES:
            mode = VerifyMode.parse(mode)
        check = mode == VerifyMode.ALWAYS or (
            mode == VerifyMode.FIRST and name not in self._verified
        )
        buf = torch.empty(info.end - info.begin, dtype=torch.uint8)
        self.read_job(name, buf.numpy(), verify=check)()  # the one read-and-check path
        return buf.view(ST_TO_DTYPE[info.dtype]).view(info.shape)

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
        self.read_job(name, out.view(-1).view(torch.uint8).numpy(), verify=verify)()

    def read_job(self, name: str, dest: Any, *, verify: bool = True) -> Callable[[], None]:
        """:meth:`read_into` as a job to run later, on any thread, with the least Python.

        ``dest`` is the destination as a contiguous ``uint8`` numpy array of exactly the
        tensor's byte size (a slice of a batch's bytes). Everything that builds the checksum's
        descriptor happens here; the job itself is a ``pread`` and (format 2) a CRC-32C, both
        outside the GIL, so a batch's rows read on several threads do not queue for it (see
        ``featbake.serve.row_pool``).

        Raises:
            StoreCorrupt: no such tensor (the job raises short reads and checksum mismatches).
            ConfigError: ``dest`` is not of the tensor's byte size.
        """
        info = self._info(name)
        if dest.nbytes != info.end - info.begin:
            raise ConfigError(
                f"read_job needs {info.end - info.begin} bytes for {name}, got {dest.nbytes}"
            )
        if not verify:
            return functools.partial(self._pread, name, info.begin, dest)
        if self.version == "1":
            return functools.partial(self._read_checked_v1, name, info, dest)
        head = crc32c(tensor_descriptor(name, info.dtype, info.shape))
        want = int(info.crc, 16) if info.crc is not None else None
        return functools.partial(self._read_checked, name, info.begin, dest, head, want)

    def _read_checked_v1(self, name: str, info: TensorInfo, dest: Any) -> None:
        """pread into ``dest`` and check format 1's CRC-32 (zlib)."""
        self._pread(name, info.begin, dest)
        if info.crc is None or f"{zlib.crc32(dest) & 0xFFFFFFFF:08x}" != info.crc:
            raise corrupt_shard(self.path, f"checksum mismatch in tensor {name}")
        self._verified.add(name)

    def _read_checked(self, name: str, begin: int, dest: Any, head: int, want: int | None) -> None:
        """pread into ``dest`` and check format 2's CRC-32C (``head``: the descriptor's)."""
        self._pread(name, begin, dest)
        if want is None or crc32c(dest, head) != want:
            raise corrupt_shard(self.path, f"checksum mismatch in tensor {name}")
        self._verified.add(name)

    def _pread(self, name: str, begin: int, dest: Any) -> None:
        """Read ``dest.nbytes`` bytes at ``begin`` into ``dest``, or raise."""
        if not dest.nbytes:
            return
        try:
            got = os.preadv(self._fd, (dest,), begin)
        except OSError as e:
            raise StoreError(f"cannot read shard {self.path}: {e.strerror or e}") from e
        if got != dest.nbytes:
            raise self.cut_short(name)

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
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
