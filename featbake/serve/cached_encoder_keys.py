"""What CachedEncoder keys are made of: row and id digests, and a watched module fingerprint.

Ids are keyed by their exact bytes (a tensor id by dtype, shape and every byte: ``str()`` of a
long tensor abbreviates it, so two different ids would share a key). The module's fingerprint
covers its architecture, code, plain attributes and every weight; :class:`ModuleWatch` notices
each way it can change after wrapping, cheaply, at every forward:

- weights replaced or updated through autograd-visible ops: version counters and data pointers;
- weights updated in place behind the version counters (``p.data.mul_(0.5)``, EMA teachers):
  a CRC-32 of every CPU tensor's bytes, or an on-device byte sum for accelerator tensors (one
  small copy to the host per step);
- a plain attribute set from outside (``teacher.scale = 0.5``): the attributes' digest. Changes
  the module makes to its own attributes while running (a call counter) are taken as
  bookkeeping: the digest is taken again after each run.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from typing import Any

import numpy as np
import torch
from torch import nn

from featbake.encode.identity import attribute_identity, module_identity
from featbake.errors import ConfigError
from featbake.keys import module_fingerprint
from featbake.store.shard_format import tensor_buffer

__all__ = ["ModuleWatch", "id_digest", "row_digest"]


def row_digest(row: torch.Tensor) -> str:
    """SHA-256 of one input row's dtype, shape and bytes (a copy to the host off the CPU)."""
    t = row.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256(f"row\0{t.dtype}\0{list(t.shape)}\0".encode())
    h.update(tensor_buffer(t))
    return h.hexdigest()


def id_digest(ident: Any) -> str:
    """SHA-256 of an id by its exact content and type (``"1"``, ``1`` and ``b"1"`` differ).

    Raises:
        ConfigError: the id is not a string, bytes, Python or numpy number, bool, None, path,
            tensor, numpy array (of numbers, strings or bytes), or a tuple or list of those.
    """
    h = hashlib.sha256(b"id\0")
    _feed(h, ident)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` to ``h`` unambiguously: a type tag, a length, then the content."""
    if isinstance(value, (tuple, list)):
        h.update(f"seq:{len(value)}\0".encode())
        for v in value:
            _feed(h, v)
        return
    tag, data = _tagged(value)
    h.update(f"{tag}:{len(data)}\0".encode())
    h.update(data)


def _tagged(value: Any) -> tuple[str, Any]:
    if isinstance(value, str):  # np.str_ too: the same string, the same key
        return "str", value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, (np.ndarray, np.generic)):
        # A numpy scalar (what iterating an array gives, ``np.int64(3)``) is a 0-d array, as
        # iterating a tensor gives 0-d tensors: keyed by dtype and bytes, never by its repr
        # (numpy 2 writes ``np.float64(3.0)`` where numpy 1 wrote ``3.0``).
        return _array_tagged(np.asarray(value))
    if value is None or isinstance(value, (bool, int, float)):
        return type(value).__name__, repr(value).encode()
    if isinstance(value, os.PathLike):
        return "path", os.fsencode(value)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return f"tensor:{t.dtype}:{list(t.shape)}", tensor_buffer(t)
    raise ConfigError(
        f"CachedEncoder cannot key an id of type {type(value).__module__}."
        f"{type(value).__qualname__} ({_short(value)}): ids must be strings, bytes, Python or "
        "numpy numbers, paths, torch tensors or numpy arrays, or tuples or lists of them, keyed "
        "by their exact content; pass e.g. str(id) or the id's number"
    )


def _array_tagged(a: np.ndarray) -> tuple[str, bytes]:
    """A numpy array (or scalar) keyed by dtype, shape and bytes; object arrays are refused."""
    if a.dtype.hasobject:
        raise ConfigError(
            f"CachedEncoder cannot key a numpy array of dtype {a.dtype} by its content (it holds "
            "Python objects); pass the ids as a list of strings or numbers"
        )
    a = np.ascontiguousarray(a)
    return f"ndarray:{a.dtype.str}:{list(a.shape)}", a.tobytes()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _weight_probe(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """A cheap digest of every tensor's bytes: CRC-32 on the CPU, a byte sum on a device."""
    out: list[int] = []
    on_device: list[torch.Tensor] = []
    for t in tensors:
        t = t.detach()
        if t.device.type == "cpu":
            out.append(zlib.crc32(tensor_buffer(t)))
        elif t.numel():
            b = t.contiguous().view(-1).view(torch.uint8)
            on_device.append(torch.stack([b.sum(dtype=torch.int64), b[::3].sum(dtype=torch.int64)]))
    if on_device:
        out.extend(torch.cat(on_device).tolist())  # one copy to the host for all of them
    return tuple(out)


class ModuleWatch:
    """The fingerprint of a wrapped module, recomputed whenever the module changed.

    Args:
        module: the module (frozen while caching applies).
        check_weights: digest weight bytes at every :meth:`fingerprint` call, to catch in-place
            updates that bypass version counters; False trusts version counters and data
            pointers alone (the caller promises never to write weights through ``.data``).
    """

    def __init__(self, module: nn.Module, *, check_weights: bool = True) -> None:
        self.module = module
        self.check_weights = check_weights
        self._fp: str | None = None
        self._seen: tuple[Any, ...] = ()
        self._attrs = ""

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def _state(self) -> tuple[Any, ...]:
        tensors = self._tensors()
        versions = tuple((t._version, t.data_ptr()) for t in tensors)
        probe = _weight_probe(tensors) if self.check_weights else ()
        return versions, probe, attribute_identity(self.module)

    def fingerprint(self) -> str:
        """The module's fingerprint now (identity and every weight), recomputed on change."""
        state = self._state()
        if self._fp is None or state[:2] != self._seen[:2] or state[2] != self._attrs:
            self._fp = module_fingerprint(self.module, module_identity(self.module))
            self._seen, self._attrs = state, state[2]
        return self._fp

    def ran(self) -> None:
        """The module just ran: attribute changes it made itself are bookkeeping, not a change."""
        self._attrs = attribute_identity(self.module)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fp"] = None  # fingerprinted again where it lands
        return state
