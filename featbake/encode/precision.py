"""Encoder precision: autocast around the encoder call, and what "exact" means per dtype.

``--precision`` is part of the recipe (bf16 features are not fp32 features), so keys differ by
precision. The tolerance table is what the bake's exactness guard allows between an item run in
a padded batch and the same item run alone; it is a relative error against the largest magnitude
of the item's own output (``max|a - b| / max|b|``), per part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Tolerance(NamedTuple):
    """How far a padded-batch output may be from the same input run alone."""

    relative: float
    why: str


#: precision -> the tolerance of the exactness guard. fp32 differs only by summation order
#: (a batched matmul picks other kernels than a single row); bf16 keeps 8 mantissa bits
#: (eps 2^-8 = 3.9e-3) and fp16 11 (eps 9.8e-4), and a dozen layers compound a few ulps each.
EXACT_TOLERANCE: dict[str, Tolerance] = {
    "fp32": Tolerance(1e-4, "summation order only; a padding leak is orders of magnitude larger"),
    "fp16": Tolerance(1e-2, "about 10 ulps of fp16 (eps 9.8e-4) through the layers"),
    "bf16": Tolerance(5e-2, "about 12 ulps of bf16 (eps 3.9e-3) through the layers"),
}


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """``torch.autocast`` for ``precision`` on ``device``; a no-op for ``fp32``.

    Autocast (not ``module.half()``) keeps weights, norms and softmax in fp32 where torch's
    autocast lists say so, which is how mixed-precision inference is usually run. bf16 and fp16
    autocast both run on the CPU too, so every path works without a GPU.

    TorchScript's own autocast pass is off inside: scripted code then runs through the
    dispatcher's autocast, as eager code does (same dtypes, same outputs on the CPU). The pass
    crashed the process (a segfault, torch 2.11 on an H200) on a scripted ``nn.TransformerEncoder``
    under CUDA autocast, bf16 and fp16 alike; without it the same module ran.
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return _autocast(device.type, dtype)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    set_jit_autocast = getattr(torch._C, "_jit_set_autocast_mode", None)
    jit_before = set_jit_autocast(False) if set_jit_autocast is not None else None
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    finally:
        if set_jit_autocast is not None:
            set_jit_autocast(jit_before)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64 (inf when the shapes differ)."""
    if got.shape != want.shape:
        return float("inf")
    a, b = got.double(), want.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff
