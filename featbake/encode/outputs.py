"""Encoder outputs: one naming rule for tensor, tuple and dict outputs; batched encoding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from featbake.encode.encoders import (
    PER_INPUT_PARTS,
    LoadedEncoder,
    autocast_for,
    pad_inputs,
    split_lengths_result,
    trim_rows,
)
from featbake.encode.naming import ALL_LAYERS
from featbake.errors import ConfigError, EncodeError
from featbake.quantize import quantize
from featbake.recipe import Recipe

# == layers ========================================================================================
# Layer selection: ``--layer K``, ``--layers 0,6,12``, ``--layers all``; part names; truncation.
#
# Each selected hidden layer is stored as its own part of the feature (tensor ``<key>/layer6``), so
# a weighted-sum probe reads all of them and a linear probe one, from the same bake. Layer 0 is
# the input to the first transformer layer (``hidden_states[0]`` in Hugging Face's numbering).
PART_PREFIX = "layer"


def resolve_layers(layers: tuple[int, ...] | str, num_layers: int) -> tuple[int, ...]:
    """Concrete layer indices for a model with ``num_layers`` transformer layers.

    ``all`` is ``0..num_layers`` (the input embedding plus every layer's output), so that keys
    name the layers stored, whatever spelling asked for them.

    Raises:
        ConfigError: a layer past the model's last.
    """
    if layers == ALL_LAYERS:
        return tuple(range(num_layers + 1))
    assert not isinstance(layers, str)
    if max(layers) > num_layers:
        raise ConfigError(
            f"layer {max(layers)} asked for, but the model has {num_layers} layers "
            f"(valid: 0..{num_layers}); fix --layers"
        )
    return tuple(layers)


def part_name(layer: int) -> str:
    """The stored part of one layer: ``layer6``."""
    return f"{PART_PREFIX}{layer}"


def layer_of_part(part: str) -> int | None:
    """``"layer6"`` -> 6; any other part name -> None."""
    digits = part[len(PART_PREFIX) :]
    return int(digits) if part.startswith(PART_PREFIX) and digits.isdigit() else None


def layers_to_run(layers: tuple[int, ...], num_layers: int, *, final_norm: bool) -> int:
    """How many transformer layers must run to produce ``hidden_states[k]`` for every k asked.

    Hugging Face's pre-norm ("stable layer norm") encoders apply a final LayerNorm to the last
    hidden state only; cut at layer K, ``hidden_states[K]`` would be normalised while the full
    model's is not. Those run one layer more (still far fewer than all when K is small).
    """
    last = max(layers)
    if last >= num_layers:
        return num_layers
    return min(num_layers, last + 1) if final_norm else last


# == outputs =======================================================================================
# -- naming ------------------------------------------------------------------------------------
def tuple_part(index: int) -> str:
    """The part name of a tuple output's ``index``-th element: ``"0"``, ``"1"``, ...

    The one naming rule for tuple outputs, in the store and in CachedEncoder alike (stored
    tensor names are ``key/0``, ``key/1``; changing it would orphan every stored tuple output).
    """
    return str(index)


def is_tuple_parts(names: Sequence[str]) -> bool:
    """True when ``names`` are exactly the parts of a tuple output (``"0"`` .. ``"n-1"``)."""
    return bool(names) and sorted(names) == sorted(tuple_part(i) for i in range(len(names)))


def name_outputs(result: Any) -> dict[str, Any]:
    """An encoder result by part name: ``{"": t}`` for one tensor, dict keys, or tuple indexes.

    Raises:
        EncodeError: the result is not a tensor, tuple or dict.
    """
    if isinstance(result, torch.Tensor):
        return {"": result}
    if isinstance(result, Mapping):
        return {str(k): v for k, v in result.items()}
    if isinstance(result, (tuple, list)):
        return {tuple_part(i): v for i, v in enumerate(result)}
    raise EncodeError(
        f"the encoder returned {type(result).__name__}; featbake stores a tensor, a tuple "
        "or a dict of tensors"
    )


def join_outputs(parts: Mapping[str, Any]) -> Any:
    """Inverse of :func:`name_outputs`: a tensor, a tuple (in index order) or a dict."""
    names = list(parts)
    if names == [""]:
        return parts[""]
    if is_tuple_parts(names):
        return tuple(parts[tuple_part(i)] for i in range(len(names)))
    return dict(parts)


# -- encoding ----------------------------------------------------------------------------------
def encode_batch(
    encoder: LoadedEncoder,
    inputs: Sequence[torch.Tensor],
    recipe: Recipe,
    *,
    own_rows: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Encode equal-shape inputs together; one dict of output parts per input, on the CPU.

    A lengths-protocol encoder gets every row's full length (and its outputs are trimmed to the
    lengths it reports), so exact-shape and padded batches store the same parts.
    ``own_rows=False``: a row the run made (an inference tensor) is a view of its batch, not a
    copy, for a caller that copies what it hands out and keeps the whole batch (a dataset's
    misses, each served as a copy and written back as it is).

    Raises:
        EncodeError: the encoder failed or returned outputs without a matching batch dimension.
    """
    if encoder.takes_lengths:
        return encode_padded(encoder, inputs, recipe)
    # One input is a view, not a copy: copying a clip of more than 32,768 samples is a parallel
    # region, which wakes torch's OpenMP threads; they then spin beside a many-small-ops
    # encoder's serial calls (a batch-1 build used 2.3x the CPU of the user's loop, issue 19).
    # Stacked in inference mode, a batch is an inference tensor, as a build's decoded inputs are
    # (featbake.bake.threads.DecodeDataset): no autograd tracking of the encoder's views of it.
    with torch.inference_mode():
        batch = inputs[0].unsqueeze(0) if len(inputs) == 1 else torch.stack(list(inputs))
    with autocast_for(encoder.device, recipe.precision):
        result = encoder.run(batch)
    named = split_outputs(result, recipe.output)
    out: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
    for part, value in named.items():
        if value.dim() == 0 or value.shape[0] != len(inputs):
            raise EncodeError(
                f"encoder output {part or 'tensor'} has shape {tuple(value.shape)}, expected a "
                f"leading batch dimension of {len(inputs)}"
            )
        value = recipe.encoded(value)
        # Own storage: a slice would pin the whole batch. Not an inference tensor: the module's
        # own (a buffer it returns), which it may change later.
        view = not own_rows and value.is_inference()
        for i in range(len(inputs)):
            out[i][part] = value[i] if view else value[i].clone()
    return out


def encode_padded(
    encoder: LoadedEncoder,
    inputs: Sequence[torch.Tensor],
    recipe: Recipe,
    pad_to: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Encode inputs of different lengths in one zero-padded batch (lengths protocol).

    The batch is built in pinned memory when the encoder runs on a GPU, so the copy to the
    device does not block; each row's outputs are cut to its own output length. ``pad_to``
    pads past the longest input (a length that recurs: ``featbake.bake.batching``).

    Raises:
        EncodeError: the encoder failed, does not take lengths, or broke the protocol.
    """
    if not encoder.takes_lengths:
        raise EncodeError(
            f"the encoder {encoder.label} does not take lengths; padded batches need "
            "forward(x, lengths) -> (features, out_lengths)"
        )
    batch = pad_inputs(inputs, pinned=encoder.device.type == "cuda", length=pad_to)
    with autocast_for(encoder.device, recipe.precision):
        result = encoder.run(batch.inputs, batch.lengths)
    features, out_lengths = split_lengths_result(result, len(inputs))
    named = split_outputs(features, recipe.output)
    whole = encoder.whole_parts | PER_INPUT_PARTS
    if recipe.output is not None:  # the one part kept is stored under ""
        whole = frozenset({""}) if recipe.output in whole else frozenset()
    return trim_rows(named, out_lengths, recipe.encoded, whole)


def split_outputs(result: Any, output: str | None) -> dict[str, torch.Tensor]:
    """Name an encoder's outputs: ``{"": t}`` for one tensor, else by dict key or tuple index.

    With ``output`` set, only that output is kept (stored under ``""``).

    Raises:
        EncodeError: the result is not a tensor, tuple or dict of tensors.
        ConfigError: the result has no output named ``output``.
    """
    named = name_outputs(result)
    if output is not None:
        if output not in named:
            choices = ", ".join(repr(k) for k in named if k) or "a single tensor"
            # The user's option, not this input's fault: a ConfigError stops the build.
            raise ConfigError(
                f"the encoder has no output {output!r}; it returns {choices}; fix --output"
            )
        named = {"": named[output]}
    bad = [k for k, v in named.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise EncodeError(
            f"encoder output {bad[0]!r} is not a tensor; pick a tensor output with --output"
        )
    return named


# -- finite ------------------------------------------------------------------------------------
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


def refuse_nonfinite(
    parts: Mapping[str, torch.Tensor], recipe: Recipe, item: str, anyway: str = ""
) -> None:
    """Refuse ``item``'s stored ``parts`` (:func:`stored_parts`) holding NaN or an infinity:
    the encoder's own, or finite values past the stored dtype's range (float16 ends at 65504),
    which the cast made infinite. For the paths that serve what they encode (a dataset's
    misses, ``CachedEncoder``): such a row is never served, kept or written back, as a build
    never stores it without ``--allow-nonfinite`` (``anyway`` says where that is).

    Raises:
        EncodeError: a part holds NaN or an infinity.
    """
    bad = nonfinite_part(dict(parts))
    if bad is None:
        return
    narrow = recipe.dtype in ("float16", "bfloat16")
    wider = (
        " (or store float32, if its values are finite past that dtype's range)" if narrow else ""
    )
    raise EncodeError(
        f"{item}: the encoder returned NaN or infinite values in {bad} (stored as "
        f"{recipe.dtype}); not served or stored. Fix the encoder{wider}{anyway}"
    )


def nonfinite_build_failure(item: str, bad: str, dtype: str) -> str:
    """A build's line for an item whose stored parts hold NaN or an infinity (``bad`` names
    the part), with what to do by the stored dtype: float16 ends at 65504, so a finite output
    past it is stored wider (``--allow-nonfinite`` there would store and serve ``inf``); int8
    and fp8 hold neither NaN nor infinity, so no option stores them.

    Example:
        >>> nonfinite_build_failure("a.wav", "its output", "int8").split(". ")[-1]
        'int8 holds neither NaN nor infinity: fix the encoder'
    """
    said = f"{item}: NaN or infinite values in {bad} as stored ({dtype}); not stored."
    if dtype == "float16":
        return (
            f"{said} Finite values past float16's range (65504) become infinite when cast: "
            "store them as --dtype bfloat16 or float32; if the encoder itself returned them, "
            "fix it, or pass --allow-nonfinite to store them as they are"
        )
    if dtype in ("int8", "fp8"):
        return f"{said} {dtype} holds neither NaN nor infinity: fix the encoder"
    return f"{said} The encoder returned them: fix it, or pass --allow-nonfinite to store them"


# -- storing -----------------------------------------------------------------------------------
def stored_parts(parts: Mapping[str, torch.Tensor], recipe: Recipe) -> dict[str, torch.Tensor]:
    """Output parts as the store holds them: in the stored float dtype, or packed for ``int8``
    / ``fp8``.

    The one step from encoder output to stored tensor, shared by the build, a dataset's misses
    and ``CachedEncoder``, so that every writer stores the same bytes for the same output.

    An integer or bool part (lengths, a mask) is stored as it is under a float dtype.

    Raises:
        EncodeError: a part holds NaN or an infinity and the dtype is quantised.
        ConfigError: a part is a scalar, or not a float, and the dtype is quantised.

    Example:
        >>> stored_parts({"": torch.ones(2, 3)}, Recipe(dtype="int8"))[""].shape
        torch.Size([2, 7])
    """
    scheme = recipe.scheme
    if scheme is None:  # a no-op in the build, whose outputs are already in this dtype
        return {name: recipe.encoded(value) for name, value in parts.items()}
    exact = [name for name, value in parts.items() if not value.is_floating_point()]
    if exact:
        value = parts[exact[0]]
        named = exact[0] or recipe.output or "tensor"  # one part picked: stored unnamed
        raise ConfigError(
            f"the encoder's output {named!r} holds {value.dtype} values, which "
            f"{recipe.dtype} storage cannot keep exact (it quantises floats only); store them "
            "with dtype float16 or float32 (--dtype / dtype=), or keep one float output "
            "(--output / output=)"
        )
    return {name: quantize(value, scheme) for name, value in parts.items()}
