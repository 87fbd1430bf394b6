"""Reading one sealed shard: header parsed once, pread into owned memory, checksums checked."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path

import torch

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt, StoreError
from featbake.store.shard_format import (
    FORMAT_NAME,
    MAX_HEADER_BYTES,
    ST_TO_DTYPE,
    TensorInfo,
    checksum,
)


def corrupt_shard(path: Path, why: str) -> StoreCorrupt:
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
            raise corrupt_shard(self.path, "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise corrupt_shard(self.path, f"header length {n} does not fit a {size}-byte file")
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
            raise corrupt_shard(self.path, f"unreadable header: {e}") from e
        if meta.get("format") != FORMAT_NAME:
            raise corrupt_shard(self.path, "not a featbake shard (no featbake metadata)")
        if infos and max(i.end for i in infos.values()) > size:
            raise corrupt_shard(self.path, f"truncated: {size} bytes, header promises more")
        return meta, infos

    @property
    def fd(self) -> int:
        """The open file descriptor (for callers that pread located tensors themselves)."""
        return self._fd

    def cut_short(self, name: str) -> StoreCorrupt:
        """The error for a tensor whose bytes end before the header says."""
        return corrupt_shard(self.path, f"tensor {name} is cut short")

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
            raise corrupt_shard(self.path, f"unknown dtype {info.dtype}") from e
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
            raise corrupt_shard(self.path, f"tensor {name} is cut short")
        if verify:
            if info.crc is None or checksum(view) != info.crc:
                raise corrupt_shard(self.path, f"checksum mismatch in tensor {name}")
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
