"""Hugging Face vision folders: ViT, DINOv2, CLIP/SigLIP vision towers (``pixel_values`` in).

A vision folder is one whose ``preprocessor_config.json`` is an *image* processor. Its processor
decides the recipe's image transform (:func:`image_recipe_for_folder`), with any option the
user gives on top; its model runs behind :class:`HFVisionEncoder`, which names its outputs as
parts so ``--output`` and ``--layers`` pick them as they do for audio:

* ``pooled``: the model's ``pooler_output`` (ViT's tanh head on CLS, DINOv2's normalised CLS,
  CLIP's post-layernorm CLS), or the CLS token when the model has no pooler: ``[D]``; a ViT
  saved without its pooling layer (DINO, MAE) has no ``pooled`` (its head would be random);
* ``tokens``: the last hidden state, CLS (and registers) first, then the patches: ``[N, D]``;
* ``layer6`` ...: ``hidden_states[6]`` with ``--layers`` (0 is the patch embedding).

timm and open_clip import torchvision, whose wheels do not load beside every torch build: run
them through an import-path factory (``--encoder mypkg.vision:build --source image``) with the
transform given as options.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featbake.encode.layers import part_name
from featbake.errors import ConfigError, EncoderLoadError
from featbake.image_recipe import ImageRecipe

PREPROCESSOR_FILE = "preprocessor_config.json"
POOLED = "pooled"
TOKENS = "tokens"


def image_processor_config(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The folder's image processor settings, or None when it has no image processor.

    Raises:
        EncoderLoadError: the file exists but is not a JSON object.
    """
    path = Path(folder) / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EncoderLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise EncoderLoadError(f"{path} holds a JSON {type(raw).__name__}, not settings")
    is_image = "image_processor_type" in raw or "image_mean" in raw
    return raw if is_image else None


def is_vision_folder(folder: str | os.PathLike[str]) -> bool:
    """A model folder whose preprocessor is an image processor."""
    return image_processor_config(folder) is not None


def image_recipe_for_folder(folder: str | os.PathLike[str], **changes: Any) -> ImageRecipe:
    """The image transform of a vision folder's processor, with ``changes`` on top.

    This is how ``featbake build --encoder ./dinov2-small --crop 196`` combines the folder's
    defaults with an option; a library caller passes the result as ``Recipe(image=...)``.

    Raises:
        EncoderLoadError: the folder has no image processor.
        ConfigError: the processor is one featbake does not reproduce exactly.

    Example:
        >>> steps = image_recipe_for_folder("./dinov2-small", crop=None)  # doctest: +SKIP
    """
    config = image_processor_config(folder)
    if config is None:
        raise EncoderLoadError(
            f"{folder} has no image processor ({PREPROCESSOR_FILE} with image_processor_type); "
            "save one beside the model (processor.save_pretrained) or use --source image with "
            "the transform given as options"
        )
    steps = ImageRecipe.from_processor(config, where=str(Path(folder) / PREPROCESSOR_FILE))
    return steps.replace(**changes) if changes else steps


class HFVisionEncoder(nn.Module):
    """A transformers vision model behind ``forward(pixel_values) -> {part: tensor}``.

    Without ``layers``: ``{"pooled": [B, D], "tokens": [B, N, D]}`` (``tokens`` alone when
    ``pooled`` is False: a model loaded without its pooling head); with ``layers``:
    ``{"layer6": hidden_states[6], ...}``.
    """

    def __init__(self, model: Any, layers: tuple[int, ...] | None, pooled: bool = True) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        self.pooled = pooled

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(pixel_values=pixel_values, output_hidden_states=self.layers is not None)
        if self.layers is not None:
            return {part_name(k): out.hidden_states[k] for k in self.layers}
        tokens = out.last_hidden_state
        if not self.pooled:
            return {TOKENS: tokens}
        pooled = getattr(out, "pooler_output", None)
        return {POOLED: tokens[:, 0] if pooled is None else pooled, TOKENS: tokens}


def image_steps_for(encoder: object, source: str, changes: dict[str, Any]) -> ImageRecipe | None:
    """The image transform options ask for: the encoder folder's processor (or the defaults)
    with ``changes`` on top; None when no option was given (the recipe then takes the folder's
    processor or the defaults itself).

    Raises:
        ConfigError: image options for an audio or npy build.

    Example:
        >>> image_steps_for("./dinov2-small", "audio", {"crop": None})  # doctest: +SKIP
    """
    if not changes:
        return None
    folder = isinstance(encoder, (str, os.PathLike)) and os.path.isdir(encoder)
    if folder and is_vision_folder(encoder):  # type: ignore[arg-type]
        return image_recipe_for_folder(encoder, **changes)  # type: ignore[arg-type]
    if source != "image":
        raise ConfigError(
            f"image options ({', '.join('--' + k for k in sorted(changes))}) apply to image "
            "inputs; add --source image (a Hugging Face vision folder implies it)"
        )
    return ImageRecipe(**changes)
