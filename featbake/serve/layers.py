"""Serving hidden layers: one layer, several, or a stacked ``[L, T, D]`` tensor per item.

A bake with ``--layers 0,6,12`` stores each layer as its own part (``layer0``, ``layer6``,
``layer12``) of one feature; a dataset item is then a dict of them. ``layer_view`` picks what a
training loop wants from that dict, after the item's one read: an ``int`` gives that layer's
``[T, D]`` tensor (a linear probe), a sequence gives a stacked ``[L, T, D]`` tensor in that order
(a SUPERB-style weighted sum), ``"stack"`` stacks every stored layer in layer order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from featbake.encode.layers import layer_of_part, part_name
from featbake.errors import ConfigError

STACK = "stack"

LayerView = int | Sequence[int] | str | None


def check_layer_view(view: LayerView) -> LayerView:
    """Validate a ``layer_view`` option once, at construction.

    Raises:
        ConfigError: not None, an int, a sequence of ints or ``"stack"``.
    """
    if view is None or view == STACK:
        return view
    if isinstance(view, (bool, str)):
        raise ConfigError(f"layer_view must be a layer, a list of layers or 'stack', got {view!r}")
    if isinstance(view, int):
        return view
    layers = tuple(view)
    if not layers or not all(isinstance(k, int) and not isinstance(k, bool) for k in layers):
        raise ConfigError(f"layer_view must list whole layer numbers, got {view!r}")
    return layers


def view_layers(item: Any, view: LayerView) -> Any:
    """``item`` (a dict of ``layerK`` parts) as ``view`` asks; unchanged when ``view`` is None.

    Raises:
        ConfigError: the item holds no such layer (name the layers the bake stored).
    """
    if view is None:
        return item
    if not isinstance(item, Mapping):
        raise ConfigError(
            "layer_view needs features stored per layer; bake with --layers (and pass the same "
            "layers= to the dataset)"
        )
    if view == STACK:
        stored = sorted((k, p) for p in item if (k := layer_of_part(p)) is not None)
        return torch.stack([item[p] for _, p in stored])
    if isinstance(view, int):
        return _layer(item, view)
    return torch.stack([_layer(item, k) for k in view])


def _layer(item: Mapping[str, torch.Tensor], k: int) -> torch.Tensor:
    name = part_name(k)
    if name not in item:
        stored = ", ".join(sorted(item)) or "none"
        raise ConfigError(f"layer {k} is not stored for this item (stored: {stored})")
    return item[name]
