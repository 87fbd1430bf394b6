"""What an encoder's failure or bad output says to the user: one line, with the real cause."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from featbake.errors import EncodeError

__all__ = ["error_cause", "first_line", "refuse_complex"]


def refuse_complex(result: Any, label: str) -> None:
    """Raise EncodeError if any output tensor is complex (storing would drop its imaginary part).

    Raises:
        EncodeError: naming the output and its dtype.
    """
    if isinstance(result, torch.Tensor):
        named: Any = {"": result}
    elif isinstance(result, Mapping):
        named = result
    elif isinstance(result, (tuple, list)):
        named = dict(enumerate(result))
    else:
        return
    for name, value in named.items():
        if isinstance(value, torch.Tensor) and value.is_complex():
            output = f"output {name!r}" if name != "" else "output"
            raise EncodeError(
                f"the encoder {label} returned a complex {output} ({value.dtype}); featbake "
                "stores real tensors: return .real/.imag or torch.view_as_real(x) instead"
            )


#: TorchScript's generic first line; the cause is at the end of its message.
_TORCHSCRIPT_PREFIX = "The following operation failed in the TorchScript interpreter"


def error_cause(e: BaseException) -> str:
    """One line that says why ``e`` happened: the type and message of the real cause.

    A TorchScript error's first line is always the same sentence and its last line holds the
    raised exception (``builtins.ValueError: ...``); a ``KeyError``'s message alone is a bare key.
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith(_TORCHSCRIPT_PREFIX):
        cause = lines[-1]
        return cause.removeprefix("builtins.")
    text = lines[0] if lines else ""
    if isinstance(e, (RuntimeError, ValueError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
