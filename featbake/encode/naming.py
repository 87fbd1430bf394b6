"""What the user names an encoder and its layers by, read without torch: ``--encoder`` (a file, a
Hugging Face folder or an import path) and ``--layers``.

A command checks these before it imports torch (seconds of CPU), so a mistyped path or layer
list is answered at once (:func:`featbake.bake.arguments.check_encoder_found`).
"""

from __future__ import annotations

import os

from featbake.errors import ConfigError, EncoderLoadError


def is_import_path(spec: str) -> bool:
    """``pkg.mod:factory`` (a colon, no path separator before it), and no file of that name.

    Example:
        >>> is_import_path("mypkg.models:build"), is_import_path("./ckpt.pt")
        (True, False)
    """
    mod, sep, attr = spec.partition(":")
    return bool(sep) and bool(attr) and not os.path.exists(spec) and "/" not in mod


def encoder_not_found(spec: str) -> EncoderLoadError:
    """The error for an encoder path that names nothing, with what ``--encoder`` takes."""
    return EncoderLoadError(
        f"encoder {spec} not found; give a TorchScript (.pt), torch.export (.pt2) file, a "
        "Hugging Face model folder (config.json + weights) or an import path like "
        "mypkg.models:build_encoder"
    )


#: ``--layers all``: every hidden state the model has.
ALL_LAYERS = "all"


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
