"""``CachedEncoder``: the seed's interceptor, a module whose forward consults the cache first.

::

    forward(x, ids=None)
      -> per-row keys: sha256(encoder_fp | recipe_fp | sha256(id or the row's dtype, shape, bytes))
      -> device LRU -> RAM LRU -> the on-disk store (one catalog query per batch)
      -> the rows that missed every tier run through the wrapped encoder, in one batch
      -> results filled back into every tier (the store gets them in this process's own shards)

It is active only when the wrapped encoder is frozen (every parameter has ``requires_grad=False``
and the module is in eval mode) and ``enabled``; otherwise it runs the encoder untouched and warns
once. The encoder's fingerprint covers its architecture and every weight; it is recomputed when a
weight is modified in place (tensors' version counters change), so loading a new state dict into
the wrapped module can never serve features of the old one.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featbake.encode.encoders import is_frozen, module_identity
from featbake.errors import ConfigError, EncodeError
from featbake.keys import feature_key, module_fingerprint, recipe_fingerprint
from featbake.lru import ByteLRU, CacheInfo
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout, default_cache_dir
from featbake.store.writer import ShardWriter
from featbake.units import parse_bytes

__all__ = ["CachedEncoder"]

#: What sits between an input row and the stored output here: nothing but the module itself.
CACHED_ENCODER_RECIPE = {"kind": "cached-encoder", "version": 1}
WRITEBACK_BYTES = 64 * 1024 * 1024
WRITEBACK_SECONDS = 5.0
_TUPLE = "#"  # part-name prefix of tuple outputs, so they come back as tuples


def _split(result: Any, batch: int) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.Tensor):
        parts = {"": result}
    elif isinstance(result, Mapping):
        parts = {str(k): v for k, v in result.items()}
        if any(k.startswith(_TUPLE) or not k for k in parts):
            raise EncodeError("CachedEncoder needs dict outputs with non-empty names not led by #")
    elif isinstance(result, (tuple, list)):
        parts = {f"{_TUPLE}{i}": v for i, v in enumerate(result)}
    else:
        raise EncodeError(
            f"the encoder returned {type(result).__name__}; CachedEncoder caches a tensor, a "
            "tuple or a dict of tensors"
        )
    for name, v in parts.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise EncodeError(
                f"encoder output {name or 'tensor'} is {shape}, expected a leading batch "
                f"dimension of {batch}; CachedEncoder caches per-row outputs"
            )
    return parts


def _join(parts: Mapping[str, torch.Tensor]) -> Any:
    if list(parts) == [""]:
        return parts[""]
    if all(k.startswith(_TUPLE) for k in parts):
        return tuple(parts[k] for k in sorted(parts, key=lambda k: int(k[1:])))
    return dict(parts)


def _row_fp(row: torch.Tensor) -> str:
    t = row.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256(f"row\0{t.dtype}\0{list(t.shape)}\0".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _id_fp(ident: Any) -> str:
    return hashlib.sha256(f"id\0{ident}".encode()).hexdigest()


def cached_encoder_root(encoder_fp: str, recipe_fp: str) -> str:
    """The name of the root that keeps a CachedEncoder's stored features live for gc."""
    return f"cached-encoder-{encoder_fp[:12]}-{recipe_fp[:8]}"


class _Sink:
    """The write-back state: it never refers to the CachedEncoder, so the wrapper (and its model)
    can be collected; a finalizer on the wrapper seals this sink's pending shard."""

    def __init__(self, layout: Layout | None, label: str = "CachedEncoder") -> None:
        self.layout = layout
        self.label = label
        self.writer: ShardWriter | None = None
        self.catalog: Catalog | None = None
        self.first_pending = 0.0

    def publish(self, shard: Any) -> None:
        if self.catalog is None:
            self.catalog = Catalog(self.layout)  # type: ignore[arg-type]
        # The keys join this encoder's root *before* their rows exist, so a gc running between
        # the two transactions never sees the rows unreached. One root per (encoder, recipe):
        # `featbake roots drop` or `gc --older-than` retire it like any build's root.
        fp = shard.encoder_fp
        self.catalog.extend_root(
            cached_encoder_root(fp, shard.recipe_fp),
            data=f"cached-encoder:{fp[:12]}",
            encoder_label=self.label,
            encoder_fp=fp,
            recipe_fp=shard.recipe_fp,
            recipe=CACHED_ENCODER_RECIPE,
            keys=sorted({e.key for e in shard.entries}),
        )
        self.catalog.add_shard(shard)
        self.first_pending = 0.0

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.seal()
        except Exception as e:  # at exit there is no caller left to raise to
            warnings.warn(f"featbake: CachedEncoder could not seal its shard: {e}", stacklevel=1)


class CachedEncoder(nn.Module):
    """Wrap a frozen encoder so each input row is encoded once, ever.

    Args:
        encoder: the module to wrap; called as ``encoder(x)`` on a batch ``[B, ...]`` that
            returns a tensor ``[B, ...]``, a tuple or a dict of them.
        cache: the store directory (default ``$FEATBAKE_CACHE`` or ``./.featbake``); ``None``
            with ``store=False`` keeps everything in memory.
        enabled: turn caching off without unwrapping.
        ram_cache: byte budget of the host-memory tier (0 disables it).
        device_cache: byte budget of a tier on the outputs' device, for CUDA encoders (0: none).
        store: use (and write back to) the on-disk store.

    Keys come from ``ids`` when given (one hashable per row, e.g. a file path or an utterance
    id: the caller promises that an id always names the same input), else from each row's
    dtype, shape and bytes (which costs a copy to the host for a CUDA input). Results equal
    calling the encoder directly, up to the batch-size-dependent rounding of its kernels, since
    misses are encoded as a smaller batch.

    Example:
        >>> teacher = CachedEncoder(frozen_teacher, cache=".featbake")  # doctest: +SKIP
        >>> feats = teacher(wav_batch, ids=utterance_ids)  # doctest: +SKIP
    """

    def __init__(
        self,
        encoder: nn.Module,
        cache: str | Path | None = None,
        *,
        enabled: bool = True,
        ram_cache: int | str = "1GiB",
        device_cache: int | str = 0,
        store: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, nn.Module):
            raise ConfigError(f"CachedEncoder wraps an nn.Module, got {type(encoder).__name__}")
        self.encoder = encoder
        self.enabled = enabled
        self._ram = ByteLRU(parse_bytes(ram_cache))
        self._dev = ByteLRU(parse_bytes(device_cache))
        self._recipe_fp = recipe_fingerprint(CACHED_ENCODER_RECIPE)
        self._identity = module_identity(encoder)  # as from_module: class, repr and code
        self._fp: str | None = None
        self._versions: tuple[int, ...] = ()
        self._warned = False
        self._lock = threading.Lock()
        self._layout = (
            Layout(Path(cache) if cache is not None else default_cache_dir()).ensure()
            if store
            else None
        )
        self._reader: FeatureReader | None = None
        self._sink = _Sink(self._layout, type(encoder).__name__)
        self.stats = {"hits_device": 0, "hits_ram": 0, "hits_store": 0, "encoded": 0}
        weakref.finalize(self, self._sink.close)

    # -- state --------------------------------------------------------------------------------
    def active(self) -> bool:
        """True when caching applies: enabled, and the encoder is frozen."""
        return self.enabled and is_frozen(self.encoder)

    def fingerprint(self) -> str:
        """The wrapped encoder's fingerprint (recomputed after in-place weight changes)."""
        tensors = [*self.encoder.parameters(), *self.encoder.buffers()]
        versions = tuple(t._version for t in tensors) + tuple(t.data_ptr() for t in tensors)
        if self._fp is None or versions != self._versions:
            self._fp = module_fingerprint(self.encoder, self._identity)
            self._versions = versions
        return self._fp

    def cache_info(self) -> dict[str, CacheInfo | int]:
        """Counters: RAM and device tiers, store hits, rows encoded."""
        return {"ram": self._ram.info(), "device": self._dev.info(), **self.stats}

    def flush(self) -> None:
        """Seal the write-back shard now (also done at exit and when the wrapper is collected)."""
        with self._lock:
            if self._sink.writer is not None:
                self._sink.writer.seal()
            self._sink.first_pending = 0.0

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: Sequence[Any] | None = None) -> Any:
        """``encoder(x)``, from the cache for the rows that were encoded before.

        Raises:
            ConfigError: ``ids`` does not have one entry per row.
            EncodeError: the encoder's output has no per-row batch dimension.
        """
        why = self._stand_aside_reason(x)
        if why is not None:
            if not self._warned:
                warnings.warn(f"CachedEncoder is running the encoder uncached: {why}", stacklevel=2)
                self._warned = True
            return self.encoder(x)
        batch = x.shape[0]
        if ids is not None and len(ids) != batch:
            raise ConfigError(f"CachedEncoder got {len(ids)} ids for a batch of {batch} rows")
        enc_fp = self.fingerprint()
        fps = [_id_fp(i) for i in ids] if ids is not None else [_row_fp(r) for r in x]
        keys = [feature_key(enc_fp, self._recipe_fp, fp) for fp in fps]
        rows: list[dict[str, torch.Tensor] | None] = [None] * batch
        out_device: torch.device | None = None
        todo: list[int] = []
        for j, key in enumerate(keys):
            got = self._dev.get(key) if self._dev.max_bytes else None
            if got is not None:
                self.stats["hits_device"] += 1
            elif self._ram.max_bytes and (got := self._ram.get(key)) is not None:
                self.stats["hits_ram"] += 1
            else:
                todo.append(j)
            rows[j] = got
        if todo and self._layout is not None:
            found = self._store_reader().get_many([keys[j] for j in todo])
            self.stats["hits_store"] += len(found)
            for j in todo:
                if keys[j] in found:
                    rows[j] = found[keys[j]]
                    if self._ram.max_bytes:
                        self._ram.put(keys[j], found[keys[j]])
            todo = [j for j in todo if rows[j] is None]
        if todo:
            sub = x[todo] if len(todo) < batch else x
            with torch.no_grad():
                parts = _split(self.encoder(sub), len(todo))
            self.stats["encoded"] += len(todo)
            out_device = next(iter(parts.values())).device
            for r, j in enumerate(todo):
                row = {p: v[r] for p, v in parts.items()}
                rows[j] = row
                self._remember(keys[j], row, enc_fp)
        return self._assemble(rows, keys, out_device, x.device)

    def _stand_aside_reason(self, x: torch.Tensor) -> str | None:
        if not self.enabled:
            return "enabled=False"
        if self.encoder.training:
            return "the encoder is in training mode (call .eval() on it to freeze it)"
        if any(p.requires_grad for p in self.encoder.parameters()):
            return "some encoder parameters require grad (freeze them with requires_grad_(False))"
        if x.requires_grad and torch.is_grad_enabled():
            return "the input requires grad, and cached rows would not carry its gradient"
        return None

    def _assemble(
        self,
        rows: list[dict[str, torch.Tensor] | None],
        keys: list[str],
        out_device: torch.device | None,
        in_device: torch.device,
    ) -> Any:
        device = out_device or (self._param_device() or in_device)
        names = list(rows[0])  # type: ignore[arg-type]
        out = {}
        for name in names:
            values = [r[name] for r in rows]  # type: ignore[index]
            out[name] = torch.stack([v.to(device, non_blocking=True) for v in values])
        if self._dev.max_bytes and device.type != "cpu":
            for j, key in enumerate(keys):
                if key not in self._dev:
                    self._dev.put(key, {n: out[n][j] for n in names})
        return _join(out)

    def _param_device(self) -> torch.device | None:
        p = next(iter(self.encoder.parameters()), None)
        return p.device if p is not None else None

    def _remember(self, key: str, row: dict[str, torch.Tensor], enc_fp: str) -> None:
        host = {p: v.detach().to("cpu").clone() for p, v in row.items()}  # own storage
        if self._ram.max_bytes:
            self._ram.put(key, host)
        if self._layout is None:
            return
        sink = self._sink
        with self._lock:
            if sink.writer is None or sink.writer.encoder_fp != enc_fp:
                if sink.writer is not None:
                    sink.writer.seal()
                sink.writer = ShardWriter(
                    self._layout,
                    enc_fp,
                    self._recipe_fp,
                    target_bytes=WRITEBACK_BYTES,
                    on_seal=sink.publish,
                )
            if not sink.first_pending:
                sink.first_pending = time.monotonic()
            sink.writer.add(key, host)
            if time.monotonic() - sink.first_pending >= WRITEBACK_SECONDS:
                sink.writer.seal()

    def _store_reader(self) -> FeatureReader:
        if self._reader is None:
            self._reader = FeatureReader(self._layout)  # type: ignore[arg-type]
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_sink"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._sink = _Sink(self._layout, type(self.encoder).__name__)
        weakref.finalize(self, self._sink.close)
