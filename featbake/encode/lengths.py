"""The lengths protocol: ``forward(x, lengths) -> (features, out_lengths)``; pad and trim.

An encoder that takes a second argument named ``lengths`` (an int64 ``[B]`` tensor of each
row's valid samples) and returns ``(features, out_lengths)`` can run variable-length inputs in
one padded batch: featbake pads ``[B, T_max]`` with zeros on the right, and keeps
``features[i, :out_lengths[i]]`` of each row. ``features`` is a ``[B, T', ...]`` tensor or a dict
of them (e.g. one per hidden layer). TorchScript, ``.pt2`` and import-path encoders follow it by
their ``forward`` signature; Hugging Face folders follow it through :mod:`featbake.encode.hf`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from featbake.device import alloc_pinned
from featbake.errors import EncodeError

LENGTHS_ARG = "lengths"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def accepts_lengths(module: Any) -> bool:
    """True when ``module.forward``'s second positional argument is named ``lengths``.

    The name is the opt-in: an encoder whose second argument is a mask or anything else keeps
    one input per row of equal shape, as before.
    """
    forward = getattr(module, "forward", None)
    schema = getattr(forward, "schema", None)
    if schema is not None:  # a TorchScript method: arguments are (self, x, lengths, ...)
        names = [a.name for a in schema.arguments]
        return len(names) >= 3 and names[2] == LENGTHS_ARG
    try:
        params = inspect.signature(forward).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    return len(positional) >= 2 and positional[1] == LENGTHS_ARG


@dataclass(frozen=True)
class PaddedInputs:
    """Inputs zero-padded on the right to the longest, with each row's valid length."""

    inputs: torch.Tensor
    lengths: torch.Tensor

    @property
    def padded_samples(self) -> int:
        """Elements the encoder will see, padding included."""
        return int(self.inputs.numel())


def pad_inputs(inputs: Sequence[torch.Tensor], *, pinned: bool = False) -> PaddedInputs:
    """Stack inputs of different last-dimension lengths into one zero-padded batch.

    Args:
        inputs: tensors equal in every dimension but the last (time).
        pinned: build the batch in page-locked memory (for a non-blocking copy to a GPU).

    Raises:
        EncodeError: the inputs differ in a dimension other than time.
    """
    lead = {tuple(x.shape[:-1]) for x in inputs}
    if len(lead) != 1:
        raise EncodeError(f"cannot pad inputs that differ outside time: {sorted(lead)}")
    lengths = [int(x.shape[-1]) for x in inputs]
    shape = (len(inputs), *inputs[0].shape[:-1], max(lengths))
    dtype = inputs[0].dtype
    batch = alloc_pinned(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
    for row, (x, n) in enumerate(zip(inputs, lengths, strict=True)):
        batch[row, ..., :n] = x
        batch[row, ..., n:] = 0
    return PaddedInputs(batch, torch.tensor(lengths, dtype=torch.int64))


def split_lengths_result(result: Any, rows: int) -> tuple[Any, torch.Tensor]:
    """``(features, out_lengths)`` from a lengths-protocol encoder's return value.

    Raises:
        EncodeError: the result is not a pair, or ``out_lengths`` is not ``[rows]`` integers.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise EncodeError(
            "an encoder whose forward takes `lengths` must return (features, out_lengths); "
            f"it returned {type(result).__name__}"
        )
    features, out_lengths = result
    if not isinstance(out_lengths, torch.Tensor) or tuple(out_lengths.shape) != (rows,):
        shape = tuple(out_lengths.shape) if isinstance(out_lengths, torch.Tensor) else None
        raise EncodeError(
            f"out_lengths must be a [{rows}] tensor of frame counts, got "
            f"{type(out_lengths).__name__} {shape}"
        )
    return features, out_lengths.detach().to("cpu", torch.int64)


def trim_rows(
    named: Mapping[str, torch.Tensor], out_lengths: torch.Tensor, dtype: torch.dtype
) -> list[dict[str, torch.Tensor]]:
    """Each row's parts cut to its own output length, on the CPU in ``dtype``, own storage.

    Raises:
        EncodeError: a part is not ``[B, T', ...]`` or is shorter than an output length.
    """
    rows = int(out_lengths.shape[0])
    lengths = out_lengths.tolist()
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(rows)]
    for part, value in named.items():
        if value.dim() < 2 or value.shape[0] != rows or value.shape[1] < max(lengths):
            raise EncodeError(
                f"encoder output {part or 'tensor'} has shape {tuple(value.shape)}; the lengths "
                f"protocol needs [{rows}, T', ...] with T' >= {max(lengths)} (the out_lengths)"
            )
        value = value.detach().to("cpu", dtype)
        for i, n in enumerate(lengths):
            out[i][part] = value[i, :n].clone()  # own storage: a slice would pin the whole batch
    return out
