"""Serving hidden layers: one layer, several, or a stacked ``[L, T, D]`` tensor per item.

A bake with ``--layers 0,6,12`` stores each layer as its own part (``layer0``, ``layer6``,
``layer12``) of one feature; a dataset item is then a dict of them. ``layer_view`` picks what a
training loop wants from that dict, after the item's one read: an ``int`` gives that layer's
``[T, D]`` tensor (a linear probe), a sequence gives a stacked ``[L, T, D]`` tensor in that order
(a SUPERB-style weighted sum), ``"stack"`` stacks the layers in the order ``layers=`` asked for
them (``layers=[3, 1]``: layer 3, then layer 1, as ``layer_view=[3, 1]`` does), or every stored
layer in layer order when ``layers`` named none (``"all"``, or a recipe's sorted layers).

The view is applied on every read path (one item, a batch, the RAM tier), and a view the store
cannot give (no layer parts, a layer not stored) is a :class:`ConfigError` at every read, or
from the dataset's constructor when the stored items already tell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from featbake.encode.layers import layer_of_part, part_name
from featbake.errors import ConfigError

STACK = "stack"

LayerView = int | Sequence[int] | str | None

_NO_LAYERS = (
    "layer_view needs features stored per layer, and these are stored as one tensor; bake with "
    "--layers (and pass the same layers= to the dataset), or drop layer_view"
)


def check_layer_view(view: LayerView, asked: Sequence[int] | str | None = None) -> LayerView:
    """Validate a ``layer_view`` option once, at construction; ``"stack"`` becomes the layers
    in the order ``asked`` (the dataset's ``layers=``) when that lists them.

    Raises:
        ConfigError: not None, an int, a sequence of ints or ``"stack"``.
    """
    if view == STACK and asked is not None and not isinstance(asked, str):
        view = tuple(dict.fromkeys(asked))  # the order asked for; a repeat once
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


def check_stored_parts(view: LayerView, parts: Sequence[str] | None) -> None:
    """Raise now what :func:`view_layers` would raise on every item stored with ``parts``.

    Raises:
        ConfigError: the stored items have no layer parts, or not a layer ``view`` asks for.
    """
    if view is None or parts is None:
        return  # no view, or items differ (each is checked when read)
    view_layers({p: torch.empty(0) for p in parts if p} if parts != ("",) else None, view)


def view_layers(item: Any, view: LayerView) -> Any:
    """``item`` (a dict of ``layerK`` parts) as ``view`` asks; unchanged when ``view`` is None.

    Raises:
        ConfigError: the item holds no such layer (name the layers the bake stored).
    """
    if view is None:
        return item
    if not isinstance(item, Mapping):
        raise ConfigError(_NO_LAYERS)
    if isinstance(view, str):  # STACK, the one string check_layer_view lets through
        stored = sorted((k, p) for p in item if (k := layer_of_part(p)) is not None)
        if not stored:
            raise ConfigError(_NO_LAYERS)
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
