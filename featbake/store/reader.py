"""Reading sealed shards: the header parsed and checked once, then one read path for every tensor.

Every read, of one tensor or of a batch's rows, is a list of :class:`Span` (an open shard, a
file offset, the buffer the bytes go to, and the checksum to check or None) that
:func:`read_spans` reads with ``pread`` into caller-owned memory, never mmap, and checks with
the shard format's CRC; both release the GIL. The file and its header are checked by
:mod:`featbake.store.shard_header` before anything is read.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import torch

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.store.readahead import will_need
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
        """The open file descriptor (reads go through :meth:`read_span`; this is for inspection)."""
        return self._fd

    def cut_short(self, name: str) -> StoreCorrupt:
        """The error for a tensor whose bytes end before the header says."""
        return corrupt_shard(self.path, f"tensor {name} is cut short")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, *, verify: VerifyMode | str | None = None) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor (a copy; the file stays closed to writes).

        A batch of one: :meth:`read_span`, the step :func:`read_spans` takes per span, into a
        fresh buffer (called directly, so that one tensor pays no span list).

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
        self.read_span(info.begin, buf.numpy(), self._check(name, info) if check else None)
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

        ``out`` is a contiguous CPU tensor with exactly the tensor's byte size (e.g. a RAM-tier
        entry in its own mapping).

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
        dest = out.view(-1).view(torch.uint8).numpy()
        self.read_span(info.begin, dest, self._check(name, info) if verify else None)

    def span(self, name: str, dest: Any, *, verify: bool = True, tail: Any = None) -> Span:
        """Tensor ``name``'s :class:`Span` into ``dest``, to read with :func:`read_spans`.

        ``dest`` is a contiguous ``uint8`` numpy array of exactly the tensor's byte size (a
        slice of a batch's bytes); ``tail``, the padding after it in a batch row, is zeroed.
        Everything that builds the checksum's descriptor happens here, on the caller's thread;
        the read itself is a ``pread`` and a CRC, both outside the GIL, so a batch's rows read
        on several threads do not queue for it (see ``featbake.serve.row_pool``).

        Raises:
            StoreCorrupt: no such tensor (the read raises short reads and checksum mismatches).
            ConfigError: ``dest`` is not of the tensor's byte size.
        """
        info = self._info(name)
        if dest.nbytes != info.end - info.begin:
            raise ConfigError(
                f"a read of {name} needs {info.end - info.begin} bytes, got {dest.nbytes}"
            )
        return Span(self, info.begin, dest, tail, self._check(name, info) if verify else None)

    def _check(self, name: str, info: TensorInfo) -> SpanCheck:
        """How ``name``'s bytes are checked: format 1's CRC-32 of the bytes, or format 2's
        CRC-32C extending the CRC of the tensor's descriptor (name, dtype, shape)."""
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
        if n and self._read_bytes(begin, dest) != n:
            raise self.cut_short(check.name if check is not None else self._name_at(begin))
        if check is not None:
            if check.want is None or check.digest(dest, check.head) != check.want:
                raise corrupt_shard(self.path, f"checksum mismatch in tensor {check.name}")
            self._verified.add(check.name)

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
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def will_need(self, name: str) -> bool:
        """Start reading tensor ``name``'s bytes into the page cache, without waiting for them.

        A hint for a read coming soon (see :mod:`featbake.store.readahead`): nothing when the
        bytes are cached already, the shard holds no such tensor, or the platform cannot hint.
        True when reads were started.
        """
        info = self.tensors.get(name)
        if info is None:
            return False
        return will_need(self._fd, info.begin, info.end - info.begin)

    def _name_at(self, begin: int) -> str:
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
        with contextlib.suppress(OSError):
            os.close(self._fd)

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
    and its check (None: not checked on this read)."""

    reader: ShardReader
    begin: int
    dest: Any
    tail: Any
    check: SpanCheck | None


def read_spans(spans: Sequence[Span]) -> None:
    """Read (and check) each span into its buffer, zeroing its padding: the one read path.

    A single tensor is a batch of one; a batch's rows are runs of spans, one run per thread
    (``featbake.serve.row_pool``). Runs on any thread: it touches only the spans' buffers, the
    shards' read-only file descriptors and their verified sets.

    Raises:
        StoreCorrupt: a short read or a checksum mismatch (the spans after it are not read).
        StoreError: a read fails.
    """
    for reader, begin, dest, tail, check in spans:
        reader.read_span(begin, dest, check)
        if tail is not None and tail.nbytes:
            tail.fill(0)


def _hex(crc: str | None) -> int | None:
    """A header's hex checksum as a number; None (a mismatch) when absent or not hex."""
    try:
        return int(crc, 16) if crc is not None else None
    except ValueError:
        return None
