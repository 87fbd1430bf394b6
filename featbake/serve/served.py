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

No ``inf`` is served from finite features, and no cast rounds coarser than the codes: each item
and batch is checked against the dtype it is served in (:meth:`ScaleSpan.holds`, a look at one
scale a row) and refused in one line if it does not fit. Left to choose (``serve_dtype=None``),
a dataset serves the dtype its build found holds every value (:meth:`Served.for_index`): float16, or
float32 for features past float16's range (~1e7) or below its precision (~1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from featbake.errors import ConfigError
from featbake.keys import root_id
from featbake.quantize import SCALE_BYTES, ScaleSpan, Scheme, Unpacked, dequantize_unpacked, unpack
from featbake.recipe import STORED_DTYPES, Recipe
from featbake.serve.collate import PaddedBatch, alloc_batch
from featbake.serve.index import Index
from featbake.store.fidelity import SERVED, recorded_serve_dtype
from featbake.store.layout import Layout

#: Dtypes a quantised store may be served in.
SERVE_DTYPES = {name: STORED_DTYPES[name] for name in ("float32", "float16", "bfloat16")}


@dataclass(frozen=True)
class Served:
    """Dequantises stored items and batches of one scheme into one dtype."""

    scheme: Scheme
    dtype: torch.dtype
    chosen: bool = True  # the user named the dtype (else the default, or the build's record)

    def item(self, value: Any) -> Any:
        """An item (a packed tensor, or a dict of them) dequantised.

        Raises:
            ConfigError: the item holds values the served dtype cannot (see the module).
        """
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        return {name: self.tensor(t) for name, t in value.items()}

    def tensor(self, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One packed tensor dequantised (into ``out`` if given), its scales checked first."""
        parts = self.fitting(unpack(packed, self.scheme))
        return dequantize_unpacked(parts, self.scheme, self.dtype, out)

    def fitting(self, parts: Unpacked) -> Unpacked:
        """``parts``, once their row scales are checked to fit the served dtype.

        Raises:
            ConfigError: a value would be served as ``inf``, or rounded coarser than its codes.
        """
        if self.dtype == torch.float32:  # quantize caps every scale to float32's range
            return parts
        span = ScaleSpan.of(parts.scales)
        if span.holds(self.dtype, self.scheme):
            return parts
        name = str(self.dtype).removeprefix("torch.")
        default = "" if self.chosen else " (the default serve_dtype)"
        raise ConfigError(
            f"this {self.scheme.value} store holds {span.describe(self.scheme)}, which "
            f"{name}{default} cannot serve without an inf or a rounding coarser than its codes: "
            "pass serve_dtype='float32' (or 'bfloat16': the same range in half the bytes)"
        )

    def for_index(self, layout: Layout, index: Index) -> Served:
        """This, or float32 where the user named no dtype and the build of the root ``index``
        serves recorded that float16 cannot hold its values."""
        if self.chosen or index.data_dir is None:
            return self
        root = root_id(index.data_dir, index.spec.enc_label, index.spec.recipe_fp)
        if recorded_serve_dtype(layout, root) != "float32":
            return self
        return Served(self.scheme, SERVED["float32"], chosen=False)

    def batch(self, batch: PaddedBatch) -> PaddedBatch:
        """A padded batch of packed rows dequantised into a new padded batch (in shared memory
        inside a DataLoader worker, as the read path's own batch is)."""
        packed = batch.padded
        out = alloc_batch(
            torch.empty(0, dtype=self.dtype), (*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES)
        )
        self.tensor(packed, out)
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
    return Served(scheme, _serve_dtype(serve_dtype), chosen=serve_dtype is not None)


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
