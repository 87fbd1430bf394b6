"""Sealing shards: tmp -> fsync -> rename -> fsync dir, named by the SHA-256 of their bytes."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featbake.errors import ConfigError, ShardMissing, StoreError
from featbake.store.layout import Layout, fsync_dir
from featbake.store.locks import shared_write_lock
from featbake.store.shard_format import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_ITEMS,
    DTYPE_TO_ST,
    shard_header,
    shard_metadata,
    split_tensor_name,
    tensor_buffer,
    tensor_name,
)


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
            if t.dtype not in DTYPE_TO_ST:
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
            # shard's file without the rows we are about to commit (store/locks.py).
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
                buf = tensor_buffer(t)
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
