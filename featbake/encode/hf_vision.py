"""Hugging Face vision folders: ViT, DINOv2, CLIP/SigLIP vision towers (``pixel_values`` in).

A vision folder is one whose ``preprocessor_config.json`` is an *image* processor. Its processor
decides the recipe's image transform (:func:`image_recipe_for_folder`), with any option the
user gives on top; its model runs behind :class:`HFVisionEncoder`, which names its outputs as
parts so ``--output`` and ``--layers`` pick them as they do for audio:

* ``pooled``: the model's ``pooler_output`` (ViT's tanh head on CLS, DINOv2's normalised CLS,
  CLIP's post-layernorm CLS), or the CLS token when the model has no pooler: ``[D]``; a ViT
  saved without its pooling layer (DINO, MAE) has no ``pooled`` (its head would be random);
* ``tokens``: the last hidden state, CLS (and registers) first, then the patches: ``[N, D]``;
* ``layer6`` ...: ``hidden_states[6]`` with ``--layers`` (0 is the patch embedding);
* ``image_embeds``: for a whole CLIP or SigLIP folder (text and vision towers, as a download
  gives), the image embedding ``get_image_features`` returns: CLIP's ``visual_projection`` of
  ``pooled``, SigLIP's ``pooled`` itself. Only the vision tower is kept and run.

timm and open_clip import torchvision, whose wheels do not load beside every torch build: run
them through an import-path factory (``--encoder mypkg.vision:build --source image``) with the
transform given as options.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from featbake.encode.layers import part_name
from featbake.errors import ConfigError, EncoderLoadError
from featbake.image_recipe import ImageRecipe

PREPROCESSOR_FILE = "preprocessor_config.json"
POOLED = "pooled"
TOKENS = "tokens"
IMAGE_EMBEDS = "image_embeds"


class VisionTower(NamedTuple):
    """The part of a whole image-text model (CLIP, SigLIP) that encodes images."""

    model: Any  # the vision model: pixel_values in, hidden states and pooler_output out
    projection: Any  # CLIP's visual_projection, or None where the pooled output is the embedding


def vision_tower(model: Any) -> VisionTower | None:
    """The vision tower of a whole image-text model, or None for any other model."""
    tower = getattr(model, "vision_model", None)
    if tower is None or not hasattr(model, "get_image_features"):
        return None
    return VisionTower(tower, getattr(model, "visual_projection", None))


def tower_config(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of the model featbake runs: a whole model's ``vision_config``, else all."""
    vision = config.get("vision_config")
    return vision if isinstance(vision, dict) and "num_hidden_layers" not in config else config


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
    ``pooled`` is False: a model loaded without its pooling head; and ``"image_embeds"`` when
    ``embeds`` is set: a whole CLIP/SigLIP's tower, projected by ``projection`` if any); with
    ``layers``: ``{"layer6": hidden_states[6], ...}``.
    """

    def __init__(
        self,
        model: Any,
        layers: tuple[int, ...] | None,
        pooled: bool = True,
        *,
        embeds: bool = False,
        projection: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        self.pooled = pooled
        self.embeds = embeds
        self.projection = projection

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(pixel_values=pixel_values, output_hidden_states=self.layers is not None)
        if self.layers is not None:
            return {part_name(k): out.hidden_states[k] for k in self.layers}
        tokens = out.last_hidden_state
        if not self.pooled:
            return {TOKENS: tokens}
        pooled = getattr(out, "pooler_output", None)
        parts = {POOLED: tokens[:, 0] if pooled is None else pooled, TOKENS: tokens}
        if self.embeds:
            project = self.projection
            parts[IMAGE_EMBEDS] = parts[POOLED] if project is None else project(parts[POOLED])
        return parts


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
