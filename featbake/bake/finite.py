"""The build's check that an encoder's output holds no NaN or infinity, once per stored item."""

from __future__ import annotations

import numpy as np
import torch


def nonfinite_part(parts: dict[str, torch.Tensor]) -> str | None:
    """The name of the first output part holding NaN or +-inf ("output" for a lone tensor)."""
    for name, value in parts.items():
        if has_nonfinite(value):
            return f"output {name!r}" if name else "its output"
    return None


#: The exponent bits of the 16-bit floats: all set means inf or NaN.
_EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}


def has_nonfinite(value: torch.Tensor) -> bool:
    """Whether a tensor holds NaN or +-inf; checked once per stored item, so kept cheap.

    On the CPU through numpy without a temporary bool tensor (~4x faster than
    ``torch.isfinite(x).all()`` at [150, 768] fp32), and for 16-bit floats by their exponent
    bits (numpy's float16 ``isfinite`` is slower than torch's, and it has no bfloat16).
    """
    if not value.is_floating_point():
        return False
    if value.device.type != "cpu":
        return not bool(torch.isfinite(value).all())
    mask = _EXPONENT_MASK.get(value.dtype)
    if mask is not None:
        bits = value.view(torch.int16).numpy()
        return bool(np.any(np.bitwise_and(bits, mask) == mask))
    return not bool(np.isfinite(value.numpy()).all())
