"""What a dataset serves from an ``int8`` / ``fp8`` store: dequantised, or raw.

Every read path (located hits, the RAM tier, padded batches, misses) works on the stored form,
the packed tensor of :mod:`featbake.quantize` (the RAM tier so holds 4x the items float32
would); :class:`Served` turns it into what the user asked for at the dataset's exits:

* ``dequantize=True`` (the default): ``codes * scale`` in ``serve_dtype`` (float16 unless
  asked otherwise), shape ``[T, D]`` as a float store would serve it;
* ``dequantize=False``: the packed ``[T, D + 4]`` tensor as stored, to copy to the GPU as is
  (a quarter of float32's bytes) and dequantise there with :func:`featbake.quantize.dequantize`.
  :func:`~featbake.serve.collate.pad_collate` pads packed items with zero rows, whose scale is
  0, so a padded raw batch dequantises to zeros past each length (leave ``pad_value`` at 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from featbake.errors import ConfigError
from featbake.quantize import SCALE_BYTES, Scheme, dequantize
from featbake.recipe import STORED_DTYPES, Recipe
from featbake.serve.collate import PaddedBatch, alloc_batch

#: Dtypes a quantised store may be served in.
SERVE_DTYPES = {name: STORED_DTYPES[name] for name in ("float32", "float16", "bfloat16")}


@dataclass(frozen=True)
class Served:
    """Dequantises stored items and batches of one scheme into one dtype."""

    scheme: Scheme
    dtype: torch.dtype

    def item(self, value: Any) -> Any:
        """An item (a packed tensor, or a dict of them) dequantised."""
        if isinstance(value, torch.Tensor):
            return dequantize(value, self.scheme, self.dtype)
        return {name: dequantize(t, self.scheme, self.dtype) for name, t in value.items()}

    def batch(self, batch: PaddedBatch) -> PaddedBatch:
        """A padded batch of packed rows dequantised into a new padded batch (in shared memory
        inside a DataLoader worker, as the read path's own batch is)."""
        packed = batch.padded
        out = alloc_batch(
            torch.empty(0, dtype=self.dtype), (*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES)
        )
        dequantize(packed, self.scheme, self.dtype, out=out)
        return PaddedBatch.of(out, batch.lengths.tolist())


def served_for(
    recipe: Recipe, serve_dtype: str | torch.dtype | None, dequantize_items: bool
) -> Served | None:
    """How a dataset of ``recipe`` serves its items: None when as stored (float dtypes, or a
    quantised one with ``dequantize=False``).

    Raises:
        ConfigError: ``serve_dtype`` or ``dequantize=False`` for a float store, an unknown
            ``serve_dtype``, or both ``serve_dtype`` and ``dequantize=False``.

    Example:
        >>> served_for(Recipe(dtype="int8"), None, True).dtype
        torch.float16
    """
    scheme = recipe.scheme
    if scheme is None:
        if serve_dtype is not None or not dequantize_items:
            raise ConfigError(
                f"serve_dtype and dequantize=False apply to int8 and fp8 stores; this dataset "
                f"stores {recipe.dtype} (cast the items yourself, or build with --dtype int8)"
            )
        return None
    if not dequantize_items:
        if serve_dtype is not None:
            raise ConfigError(
                "dequantize=False serves the stored int8/fp8 tensors as they are; drop "
                "serve_dtype, or keep dequantize=True to serve that dtype"
            )
        return None
    return Served(scheme, _serve_dtype(serve_dtype))


def _serve_dtype(asked: str | torch.dtype | None) -> torch.dtype:
    if asked is None:
        return torch.float16
    if isinstance(asked, torch.dtype) and asked in SERVE_DTYPES.values():
        return asked
    if isinstance(asked, str) and asked in SERVE_DTYPES:
        return SERVE_DTYPES[asked]
    raise ConfigError(
        f"serve_dtype must be one of {', '.join(SERVE_DTYPES)}, got {asked!r} "
        "(e.g. serve_dtype='float32')"
    )
