"""Layer selection: ``--layer K``, ``--layers 0,6,12``, ``--layers all``; part names; truncation.

Each selected hidden layer is stored as its own part of the feature (tensor ``<key>/layer6``), so
a weighted-sum probe reads all of them and a linear probe one, from the same bake. Layer 0 is
the input to the first transformer layer (``hidden_states[0]`` in Hugging Face's numbering).
"""

from __future__ import annotations

from featbake.errors import ConfigError

ALL_LAYERS = "all"
PART_PREFIX = "layer"


def parse_layers(text: str) -> tuple[int, ...] | str:
    """``"6"`` -> ``(6,)``, ``"0,6,12"`` -> ``(0, 6, 12)``, ``"all"`` -> ``"all"``.

    Raises:
        ConfigError: not a comma-separated list of whole numbers or ``all``.

    Example:
        >>> parse_layers("12,0,6")
        (0, 6, 12)
    """
    text = text.strip()
    if text.lower() == ALL_LAYERS:
        return ALL_LAYERS
    try:
        layers = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        layers = ()
    if not layers or min(layers) < 0:
        raise ConfigError(f"--layers takes whole numbers >= 0 like 0,6,12 or 'all', got {text!r}")
    return layers


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
