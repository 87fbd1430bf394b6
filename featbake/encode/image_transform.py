"""The image transform: a decoded Pillow image -> ``[C, H, W]`` float32 pixel values.

Each step reproduces transformers' PIL backend (``PilBackend._preprocess`` and
``image_transforms``) operation for operation, so a folder's features equal its own
processor's: resize with Pillow on uint8 pixels, centre crop (zero padded when the image is
smaller), rescale in float64 then float32, normalise in float32. The sizes come from the pure
arithmetic in :mod:`featbake.image_recipe`.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from featbake.image_recipe import ImageRecipe, Interpolation, Size, crop_box, resized_size

#: ``torch.nn.functional.interpolate`` modes for the ``antialias=False`` path.
_TORCH_MODES = {
    Interpolation.NEAREST: "nearest",
    Interpolation.BILINEAR: "bilinear",
    Interpolation.BICUBIC: "bicubic",
}


def transform(image: Image.Image, steps: ImageRecipe, *, hflip: bool = False) -> torch.Tensor:
    """Resize, crop, (flip,) rescale and normalise one image already in ``steps.mode``.

    ``hflip`` mirrors the image left to right first: the flipped view is exactly what the
    same transform makes of the mirrored picture (flipping after an off-centre crop of an odd
    margin would shift it by a pixel).

    Example:
        >>> img = Image.new("RGB", (640, 480))
        >>> transform(img, ImageRecipe()).shape
        torch.Size([3, 224, 224])
    """
    if hflip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = resize(image, steps)
    if steps.crop is not None:
        pixels = center_crop(pixels, steps.crop)
    values = normalize(rescale(pixels, steps.rescale), steps.mean, steps.std)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(values, -1, 0)))


def resize(image: Image.Image, steps: ImageRecipe) -> np.ndarray:
    """The resized image as ``[H, W, C]`` uint8 (Pillow's filters, or torch's without antialias)."""
    size = resized_size(image.height, image.width, steps.resize)
    if steps.antialias:
        if (image.height, image.width) != size:
            image = image.resize((size.width, size.height), resample=steps.interpolation.pil)
        return _hwc(np.asarray(image))
    return _torch_resize(_hwc(np.asarray(image)), size, steps.interpolation)


def _hwc(pixels: np.ndarray) -> np.ndarray:
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def _torch_resize(pixels: np.ndarray, size: Size, interpolation: Interpolation) -> np.ndarray:
    """Resize without antialiasing, rounded back to uint8 (torchvision's uint8 tensor path)."""
    if (pixels.shape[0], pixels.shape[1]) == size:
        return pixels
    mode = _TORCH_MODES[interpolation]
    # np.array copies: Pillow's buffer is read-only, which torch.from_numpy warns about.
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1)[None].float()
    corners = None if mode == "nearest" else False
    y = torch.nn.functional.interpolate(
        x, size=tuple(size), mode=mode, align_corners=corners, antialias=False
    )
    return y[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def center_crop(pixels: np.ndarray, crop: Size) -> np.ndarray:
    """The centre ``crop`` of ``[H, W, C]`` pixels, zero padded where the image is smaller."""
    height, width = pixels.shape[:2]
    box = crop_box(height, width, crop)
    if box.pad_top or box.pad_left or height < crop.height or width < crop.width:
        padded = np.zeros(
            (max(height, crop.height), max(width, crop.width), pixels.shape[2]), pixels.dtype
        )
        padded[box.pad_top : box.pad_top + height, box.pad_left : box.pad_left + width] = pixels
        pixels = padded
    return pixels[box.top : box.top + crop.height, box.left : box.left + crop.width]


def rescale(pixels: np.ndarray, factor: float | None) -> np.ndarray:
    """``pixels * factor`` computed in float64 and stored as float32 (transformers' order)."""
    if factor is None:
        return pixels.astype(np.float32)
    return (pixels.astype(np.float64) * factor).astype(np.float32)


def normalize(
    values: np.ndarray, mean: tuple[float, ...] | None, std: tuple[float, ...] | None
) -> np.ndarray:
    """``(values - mean) / std`` per channel, in float32 (channels last)."""
    if mean is None or std is None:
        return values
    return (values - np.array(mean, np.float32)) / np.array(std, np.float32)
