"""``CachedEncoder``: the seed's interceptor, a module whose forward consults the cache first.

::

    forward(x, ids=None)
      -> per-row keys: sha256(encoder_fp | recipe_fp | sha256(id or the row's dtype, shape, bytes))
      -> device LRU -> RAM LRU -> the on-disk store (one catalog query per batch)
      -> the rows that missed every tier run through the wrapped encoder, in one batch
      -> results filled back into every tier (the store gets them in this process's own shards)

It is active only when the wrapped encoder is frozen (every parameter has ``requires_grad=False``
and the module is in eval mode) and ``enabled``; otherwise it runs the encoder untouched and warns
once. The encoder's fingerprint covers its architecture, code, plain attributes and every
weight, and :class:`~featbake.serve.cached_encoder_keys.ModuleWatch` recomputes it whenever any
of them changed (a new state dict, an in-place EMA update through ``.data``, an attribute set after
wrapping), so a changed encoder never gets the old one's features. Features encoded here are
written back through the dataset's :class:`~featbake.serve.writeback.WriteBack` (one sealing
policy), and outputs are named by :mod:`featbake.encode.outputs`' one rule.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featbake.encode.encoders import is_frozen
from featbake.encode.outputs import is_tuple_parts, join_outputs, name_outputs, stored_parts
from featbake.errors import ConfigError, EncodeError
from featbake.keys import feature_key, recipe_fingerprint
from featbake.lru import ByteLRU, CacheInfo
from featbake.recipe import Recipe
from featbake.serve.cached_encoder_keys import ModuleWatch, id_digest, row_digest
from featbake.serve.served import Served, served_for
from featbake.serve.writeback import WriteBack, pending_in_process
from featbake.store.catalog import Catalog, RootSpec
from featbake.store.features import FeatureReader
from featbake.store.open import Need, open_store
from featbake.store.writer import SealedShard
from featbake.units import parse_bytes

__all__ = ["CachedEncoder"]

#: What sits between an input row and the stored output here: nothing but the module itself.
CACHED_ENCODER_RECIPE = {"kind": "cached-encoder", "version": 1}


def _split(result: Any, batch: int) -> dict[str, torch.Tensor]:
    """The encoder's per-row outputs by part name (the store's one naming rule)."""
    if isinstance(result, Mapping) and (
        is_tuple_parts([str(k) for k in result]) or any(not str(k) for k in result)
    ):
        raise EncodeError(
            "CachedEncoder needs dict outputs with non-empty names that are not all numbers "
            "(those name a tuple's elements); rename the outputs"
        )
    try:
        parts = name_outputs(result)
    except EncodeError as e:
        raise EncodeError(f"{e}; CachedEncoder caches a tensor, a tuple or a dict of them") from e
    for name, v in parts.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise EncodeError(
                f"encoder output {name or 'tensor'} is {shape}, expected a leading batch "
                f"dimension of {batch}; CachedEncoder caches per-row outputs"
            )
    return parts


def stored_dtype(
    dtype: str | None, serve_dtype: str | torch.dtype | None
) -> tuple[Recipe | None, Served | None]:
    """The recipe rows are stored by (None: as the encoder returns them), and how int8/fp8
    rows are served.

    Raises:
        ConfigError: an unknown dtype, or ``serve_dtype`` for a float (or no) dtype.
    """
    if dtype is None:
        if serve_dtype is not None:
            raise ConfigError("serve_dtype applies to dtype='int8' or 'fp8'; pass one of them")
        return None, None
    recipe = Recipe(dtype=dtype)
    return recipe, served_for(recipe, serve_dtype, True)


def cached_encoder_root(encoder_fp: str, recipe_fp: str) -> str:
    """The name of the root that keeps a CachedEncoder's stored features live for gc."""
    return f"cached-encoder-{encoder_fp[:12]}-{recipe_fp[:8]}"


def publish_with_root(label: str, catalog: Catalog, shard: SealedShard) -> None:
    """Commit a CachedEncoder shard: its keys join the encoder's root, then its rows.

    The keys join the root *before* their rows exist, so a gc running between the two
    transactions never sees the rows unreached. One root per (encoder, recipe): `featbake roots
    drop` or `gc --older-than` retire it like any build's root.
    """
    fp = shard.encoder_fp
    spec = RootSpec(
        cached_encoder_root(fp, shard.recipe_fp), f"cached-encoder:{fp[:12]}", label, fp,
        shard.recipe_fp, CACHED_ENCODER_RECIPE,
    )  # fmt: skip
    catalog.extend_root(spec, sorted({e.key for e in shard.entries}))
    catalog.add_shard(shard)


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
        check_weights: digest the weights' bytes at every forward, so in-place updates that
            bypass version counters (``p.data.mul_(0.5)``) are noticed; False trusts version
            counters alone (cheaper for a large model on the CPU).
        clock: monotonic seconds, for write-back ageing (tests pass a fake clock).
        dtype: store (and keep in RAM) outputs as ``featbake build --dtype`` does: a float
            dtype, or ``"int8"`` / ``"fp8"`` (a quarter of float32's bytes, so 4x the rows in
            the same ``ram_cache``). ``None`` (the default) keeps the encoder's own dtype and
            the keys it always had; each dtype has its own keys.
        serve_dtype: the dtype int8/fp8 rows are dequantised to (default ``"float16"``), on
            the output's device after the copy. A row encoded now is returned as a cached one
            will be (quantised, then dequantised), so hits and misses agree.

    Keys come from ``ids`` when given (one per row, e.g. a file path, an utterance id or an id
    tensor, keyed by its exact content: the caller promises that an id always names the same
    input), else from each row's
    dtype, shape and bytes (which costs a copy to the host for a CUDA input). Results equal
    calling the encoder directly, up to the batch-size-dependent rounding of its kernels, since
    misses are encoded as a smaller batch.

    Example:
        >>> teacher = CachedEncoder(frozen_teacher, cache=".featbake")  # doctest: +SKIP
        >>> feats = teacher(wav_batch, ids=utterance_ids)  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 - the public options, one keyword each (as the dataset)
        self,
        encoder: nn.Module,
        cache: str | Path | None = None,
        *,
        enabled: bool = True,
        ram_cache: int | str = "1GiB",
        device_cache: int | str = 0,
        store: bool = True,
        check_weights: bool = True,
        clock: Callable[[], float] = time.monotonic,
        dtype: str | None = None,
        serve_dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, nn.Module):
            raise ConfigError(f"CachedEncoder wraps an nn.Module, got {type(encoder).__name__}")
        self.encoder = encoder
        self.enabled = enabled
        self._ram: ByteLRU[str, Any] = ByteLRU(parse_bytes(ram_cache))
        self._dev: ByteLRU[str, Any] = ByteLRU(parse_bytes(device_cache))
        self._recipe, self._served = stored_dtype(dtype, serve_dtype)
        spec = CACHED_ENCODER_RECIPE if dtype is None else {**CACHED_ENCODER_RECIPE, "dtype": dtype}
        self._recipe_fp = recipe_fingerprint(spec)
        self._watch = ModuleWatch(encoder, check_weights=check_weights)
        self._clock = clock
        self._warned_for: tuple[str, ...] = ()  # what kept caching off when last said
        # LOCAL: it commits each sealed shard to its catalog in place (no bucket store).
        self._layout = open_store(cache, need=Need.LOCAL).ensure() if store else None
        self._reader: FeatureReader | None = None
        self._writeback = self._new_writeback()
        self.stats = {
            "hits_device": 0, "hits_ram": 0, "hits_store": 0, "hits_pending": 0, "encoded": 0
        }  # fmt: skip

    def _new_writeback(self) -> WriteBack | None:
        if self._layout is None:
            return None
        writeback = WriteBack(
            self._layout,
            self._recipe_fp,
            publish=partial(publish_with_root, type(self.encoder).__name__),
            clock=self._clock,
            what="CachedEncoder features",
        )
        weakref.finalize(self, writeback.close)  # the write-back never refers to the wrapper
        return writeback

    # -- state --------------------------------------------------------------------------------
    def active(self) -> bool:
        """True when caching applies: enabled, and the encoder is frozen."""
        return self.enabled and is_frozen(self.encoder)

    def fingerprint(self) -> str:
        """The wrapped encoder's fingerprint (recomputed whenever the encoder changed)."""
        return self._watch.fingerprint()

    def cache_info(self) -> dict[str, CacheInfo | int]:
        """Counters: RAM and device tiers, store hits, rows encoded."""
        return {"ram": self._ram.info(), "device": self._dev.info(), **self.stats}

    def flush(self) -> None:
        """Seal the write-back shard now (also done at exit and when the wrapper is collected)."""
        if self._writeback is not None:
            self._writeback.seal()

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: Sequence[Any] | None = None) -> Any:
        """``encoder(x)``, from the cache for the rows that were encoded before.

        Raises:
            ConfigError: ``ids`` does not have one entry per row, or an id of a type that has
                no exact content.
            EncodeError: the encoder's output has no per-row batch dimension.
        """
        why = self._stand_aside_reasons(x)
        if why != self._warned_for:
            # Said once per state, and again whenever what keeps it off changes: after .eval()
            # the parameters may still need freezing (issue 18 item 3).
            self._warned_for = why
            if why:
                warnings.warn(
                    f"CachedEncoder is running the encoder uncached: {'; '.join(why)}",
                    stacklevel=2,
                )
        if why:
            return self.encoder(x)
        batch = x.shape[0]
        if ids is not None and len(ids) != batch:
            raise ConfigError(f"CachedEncoder got {len(ids)} ids for a batch of {batch} rows")
        enc_fp = self.fingerprint()
        digests = [id_digest(i) for i in ids] if ids is not None else [row_digest(r) for r in x]
        keys = [feature_key(enc_fp, self._recipe_fp, d) for d in digests]
        rows, todo = self._lookup(keys)
        out_device: torch.device | None = None
        if todo:
            sub = x[todo] if len(todo) < batch else x
            with torch.no_grad():
                parts = _split(self.encoder(sub), len(todo))
            self._watch.ran()
            self.stats["encoded"] += len(todo)
            out_device = next(iter(parts.values())).device
            for r, j in enumerate(todo):
                row = {p: v[r] for p, v in parts.items()}
                if self._recipe is not None:  # stored as a build stores it (packed for int8)
                    row = stored_parts(row, self._recipe)
                rows[j] = row
                self._remember(keys[j], row, enc_fp)
        if self._writeback is not None:
            self._writeback.seal_if_due()
        return self._assemble(rows, keys, out_device, x.device)

    def _lookup(self, keys: list[str]) -> tuple[list[dict[str, torch.Tensor] | None], list[int]]:
        """Each row's cached parts (device, RAM, then store), and the rows found nowhere."""
        rows: list[dict[str, torch.Tensor] | None] = [None] * len(keys)
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
            found = self._from_store([keys[j] for j in todo])
            self.stats["hits_store"] += len(found)
            for j in todo:
                if keys[j] in found:
                    rows[j] = found[keys[j]]
                    if self._ram.max_bytes:
                        self._ram.put(keys[j], found[keys[j]])
            todo = [j for j in todo if rows[j] is None]
        if todo and self._writeback is not None:  # written back here or by another reader
            for j in todo:
                parts = pending_in_process(self._writeback, keys[j])
                rows[j] = dict(parts) if parts is not None else None
            self.stats["hits_pending"] += sum(rows[j] is not None for j in todo)
            todo = [j for j in todo if rows[j] is None]
        return rows, todo

    def _from_store(self, keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """What the store holds of ``keys``; a feature whose shard is gone is a miss."""
        return self._store_reader().get_many(keys)

    def _stand_aside_reasons(self, x: torch.Tensor) -> tuple[str, ...]:
        """Everything that keeps caching off for this call, each with its fix (none: on)."""
        reasons = []
        if not self.enabled:
            reasons.append("enabled=False")
        if self.encoder.training:
            reasons.append("the encoder is in training mode (call .eval() on it)")
        trainable = sum(p.requires_grad for p in self.encoder.parameters())
        if trainable:
            reasons.append(
                f"{trainable} encoder parameters require grad (call .requires_grad_(False) "
                "on it; .eval() alone does not)"
            )
        if x.requires_grad and torch.is_grad_enabled():
            reasons.append(
                "the input requires grad, and cached rows would not carry its gradient (pass a "
                "detached input, or run under torch.no_grad())"
            )
        return tuple(reasons)

    def _assemble(
        self,
        rows: list[dict[str, torch.Tensor] | None],
        keys: list[str],
        out_device: torch.device | None,
        in_device: torch.device,
    ) -> Any:
        device = out_device or (self._param_device() or in_device)
        names = list(rows[0])  # type: ignore[arg-type]
        stored = {  # as stored: packed for int8/fp8, which the device tier keeps as they are
            name: torch.stack([r[name].to(device, non_blocking=True) for r in rows])  # type: ignore[index]
            for name in names
        }
        if self._dev.max_bytes and device.type != "cpu":
            for j, key in enumerate(keys):
                if key not in self._dev:
                    self._dev.put(key, {n: stored[n][j] for n in names})
        served = self._served
        if served is None:
            return join_outputs(stored)
        return join_outputs({n: served.item(t) for n, t in stored.items()})  # after the copy

    def _param_device(self) -> torch.device | None:
        p = next(iter(self.encoder.parameters()), None)
        return p.device if p is not None else None

    def _remember(self, key: str, row: dict[str, torch.Tensor], enc_fp: str) -> None:
        host = {p: v.detach().to("cpu").clone() for p, v in row.items()}  # own storage
        if self._ram.max_bytes:
            self._ram.put(key, host)
        if self._writeback is not None:
            self._writeback.add(enc_fp, key, host)

    def _store_reader(self) -> FeatureReader:
        if self._reader is None:
            self._reader = FeatureReader(self._layout)  # type: ignore[arg-type]
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_writeback"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._writeback = self._new_writeback()
