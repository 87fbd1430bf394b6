"""Image files: decode with Pillow, orient, convert the colour mode, then the recipe's transform.

:class:`ImageSource` is the third :class:`featbake.encode.sources.Source`: JPEG, PNG, WebP, BMP
and TIFF in, ``[C, H, W]`` float32 out. Decoding is defined here, once, because it changes
pixels before any transform does:

* the EXIF orientation tag is applied (a phone's portrait photo is stored landscape);
* 16-bit greyscale is scaled to 8 bits (``round(v / 257)``; Pillow's own conversion clips
  every value above 255 to white);
* transparency is composited onto white, as transformers' ``convert_to_rgb`` does, and the
  image converted to the recipe's colour mode (CMYK, palette and greyscale included).

A truncated file, a file that is not an image, or a decompression bomb raises
:class:`SourceError`, so the build skips it with the reason, as it does bad audio.
"""

from __future__ import annotations

import os
import warnings
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from featbake.encode.image_transform import transform
from featbake.errors import SourceError
from featbake.image_recipe import ColourMode, ImageRecipe
from featbake.recipe import Recipe

#: The extensions an image build reads (Pillow decodes each without plugins).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
#: Pillow's 16-bit and 32-bit integer greyscale modes (a 16-bit PNG opens as one of them).
_WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class ImageSource:
    """Image files -> the recipe's pixel values (``[3, H, W]`` float32 for RGB)."""

    kind = "image"
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.steps = recipe.image_steps

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Decode one file (or ``data``, its bytes) and run the transform.

        Raises:
            SourceError: missing, not an image, truncated, or too large to decode safely.
        """
        image = decode_image(path, self.steps, data)
        return transform(image, self.steps, hflip=self.steps.hflip)


def decode_image(
    path: str | os.PathLike[str], steps: ImageRecipe, data: BinaryIO | None = None
) -> Image.Image:
    """The image at ``path`` (or in ``data``, its bytes, named ``path``), fully decoded,
    oriented and in ``steps.mode``.

    This is the picture the transform starts from; a test runs transformers' processor on it
    to check that stored features equal the model's own preprocessing.

    Raises:
        SourceError: the file is missing or unreadable, not an image, truncated, or larger
            than Pillow's decompression-bomb limit.

    Example:
        >>> decode_image("cat.jpg", ImageRecipe()).mode  # doctest: +SKIP
        'RGB'
    """
    try:
        with warnings.catch_warnings():
            # Past MAX_IMAGE_PIXELS Pillow warns, past twice that it raises: refuse both.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(os.fspath(path) if data is None else data) as opened:
                opened.load()  # decode now: a truncated file fails here, not in the transform
                image = ImageOps.exif_transpose(opened) if steps.exif else opened.copy()
    except FileNotFoundError as e:
        raise SourceError(f"{path}: file not found") from e
    except UnidentifiedImageError as e:
        raise SourceError(f"{path}: not an image Pillow can read (wrong extension?)") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SourceError(f"{path}: too many pixels to decode safely ({e})") from e
    except (OSError, ValueError, SyntaxError) as e:
        raise SourceError(
            f"{path}: cannot decode the image ({_reason(e)}); is it truncated?"
        ) from e
    return to_mode(image, steps.mode, path)


def to_mode(image: Image.Image, mode: ColourMode, path: str | os.PathLike[str] = "") -> Image.Image:
    """``image`` in ``mode``: 16-bit scaled to 8, transparency composited onto white.

    Raises:
        SourceError: a floating-point image (mode ``F``): its range is unknown.

    Example:
        >>> to_mode(Image.new("LA", (2, 2)), ColourMode.RGB).getpixel((0, 0))
        (255, 255, 255)
    """
    if image.mode == "F":
        raise SourceError(
            f"{path}: a floating-point image has no known range; save it as 8 or 16 bit"
        )
    if image.mode in _WIDE_GREY:
        wide = np.asarray(image).astype(np.int64)
        image = Image.fromarray(((np.clip(wide, 0, 65535) + 128) // 257).astype(np.uint8), "L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return image if image.mode == mode.value else image.convert(mode.value)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
