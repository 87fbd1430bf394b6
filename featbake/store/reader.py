"""Reading one sealed shard: header parsed and checked once, pread into owned memory, checksums.

The file and its header are checked by :mod:`featbake.store.shard_header` before a tensor is
handed out.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import zlib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.store.shard_format import (
    MAX_HEADER_BYTES,
    ST_TO_DTYPE,
    TensorInfo,
    crc32c,
    tensor_descriptor,
)
from featbake.store.shard_header import corrupt_shard, open_regular, parse_header


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
