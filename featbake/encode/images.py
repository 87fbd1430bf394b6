"""Image files: decode with Pillow, orient, convert the colour mode, then the recipe's transform.

:class:`ImageSource` is the third :class:`featbake.encode.sources.Source`: JPEG, PNG, WebP, BMP
and TIFF in, ``[C, H, W]`` float32 out. Decoding is defined here, once, because it changes
pixels before any transform does:

* the EXIF orientation tag is applied (a phone's portrait photo is stored landscape);
* 16-bit greyscale is scaled to 8 bits (``round(v / 257)``; Pillow's own conversion clips
  every value above 255 to white);
* transparency is composited onto white, as transformers' ``convert_to_rgb`` does, and the
  image converted to the recipe's colour mode (CMYK, palette and greyscale included); where
  the recipe's processor does not convert to RGB (``ImageRecipe.composite`` false: ViT's,
  DeiT's), an image already in that mode is taken as saved, its transparency key ignored.

A truncated file, a file that is not an image, or a decompression bomb raises
:class:`SourceError`, so the build skips it with the reason, as it does bad audio.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import ExifTags, Image, UnidentifiedImageError

from featbake.errors import SourceError, last_line
from featbake.image_recipe import (
    ColourMode,
    ImageRecipe,
    Interpolation,
    Size,
    crop_box,
    resized_size,
)
from featbake.recipe import Recipe

# == image_transform ===============================================================================
# The image transform: a decoded Pillow image -> ``[C, H, W]`` float32 pixel values.
#
# Each step reproduces transformers' PIL backend (``PilBackend._preprocess`` and
# ``image_transforms``) operation for operation, so a folder's features equal its own
# processor's: resize with Pillow on uint8 pixels, centre crop (zero padded when the image is
# smaller), rescale in float64 then float32, normalise in float32. The sizes come from the pure
# arithmetic in :mod:`featbake.image_recipe`.
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


# == images ========================================================================================
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
            SourceError: missing, not an image, truncated, or too large to decode or to
                resize safely.
        """
        image = decode_image(path, self.steps, data)
        refuse_large_resize(path, image, self.steps)
        return transform(image, self.steps, hflip=self.steps.hflip)


def refuse_large_resize(
    path: str | os.PathLike[str], image: Image.Image, steps: ImageRecipe
) -> None:
    """Refuse an image whose resize would make more pixels than Pillow's decompression-bomb
    limit: a thin strip (a 60 KB PNG of 1 x 20,000 pixels) resized to a shortest edge of 256
    is 256 x 5,120,000 before its crop, 13 GB of memory for one small file.

    Raises:
        SourceError: the resized image is too large.
    """
    size = resized_size(image.height, image.width, steps.resize)
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and size.height * size.width > limit:
        raise SourceError(
            f"{path}: resizing its {image.width}x{image.height} pixels to "
            f"{size.width}x{size.height} makes more than {limit:,} pixels, too many to resize "
            "safely; crop it nearer to square"
        )


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
                unknown = unknown_range(opened)
                image = oriented(opened) if steps.exif else opened.copy()
    except FileNotFoundError as e:
        raise SourceError(f"{path}: file not found") from e
    except UnidentifiedImageError as e:
        raise SourceError(f"{path}: not an image Pillow can read (wrong extension?)") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SourceError(f"{path}: too many pixels to decode safely ({e})") from e
    except (OSError, ValueError, SyntaxError, struct.error) as e:
        raise SourceError(
            f"{path}: cannot decode the image ({last_line(e)}); is it truncated?"
        ) from e
    if unknown:
        raise SourceError(f"{path}: {unknown} has no known range; save it as 8 or 16 bit")
    return to_mode(image, steps.mode, path, composite=steps.composite)


#: The transpose that shows an image as its EXIF orientation tag (2-8) says it is seen.
_ORIENTATIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def oriented(image: Image.Image) -> Image.Image:
    """A copy of ``image`` turned as its EXIF orientation tag says: the pixels of Pillow's
    ``ImageOps.exif_transpose`` (transformers' ``load_image``), without its rewrite of the EXIF
    block, which fails on a malformed tag elsewhere in it (a text ImageWidth: ``struct.error``,
    and the file was skipped for "required argument is not an integer")."""
    method = _ORIENTATIONS.get(image.getexif().get(ExifTags.Base.Orientation, 1))
    return image.transpose(method) if method is not None else image.copy()


def unknown_range(image: Image.Image) -> str | None:
    """What ``image`` is where its pixels have no range featbake can scale to 8 bits (None
    where they have one). Pillow opens a 16-bit PNG or PGM as mode ``I`` (older Pillows) or
    ``I;16``, and an int32, uint32 or signed int16 TIFF as ``I`` too: only unsigned 16-bit
    sources are scaled (by 1/257); the others were, and served nearly black (an int32 TIFF of
    pixels 0..255 became 0..1).

    Example:
        >>> unknown_range(Image.new("I", (1, 1))), unknown_range(Image.new("I;16", (1, 1)))
        ('a 32-bit integer image', None)
    """
    if image.mode != "I" or image.format in ("PNG", "PPM"):
        return None  # PNG and PGM have no 32-bit or signed greyscale: I is their 16 bits
    tags = getattr(image, "tag_v2", None)
    if image.format == "TIFF" and tags is not None:
        bits, sample = _tag(tags, 258, 0), _tag(tags, 339, 1)  # BitsPerSample, SampleFormat
        if bits == 16 and sample == 1:
            return None
        kind = "a signed" if sample == 2 else "an unsigned"
        return f"{kind} {bits}-bit integer image"
    return "a 32-bit integer image"


def _tag(tags: Any, number: int, default: int) -> Any:
    """A TIFF tag's first value (one per sample, all alike for a one-band image)."""
    value = tags.get(number, default)
    return value[0] if isinstance(value, tuple) else value


#: Modes of three 8-bit bands other than RGB: a processor that does not convert to RGB reads
#: their bands as RGB's (``np.array(image)``).
_THREE_BANDS = frozenset({"YCbCr", "LAB", "HSV"})


def _eight_bit(image: Image.Image, *, keyed: bool) -> Image.Image:
    """A 16-bit greyscale ``image`` scaled to 8 bits (``round(v / 257)``); where ``keyed``, its
    transparency key's pixels composited onto white (white: the key is a 16-bit value, which
    no 8-bit key could tell apart from its neighbours; it was dropped, and they stayed grey)."""
    wide = np.asarray(image).astype(np.int64)
    eight = ((np.clip(wide, 0, 65535) + 128) // 257).astype(np.uint8)
    key = image.info.get("transparency")
    if keyed and isinstance(key, int) and not isinstance(key, bool):
        eight[wide == key] = 255
    return Image.fromarray(eight, "L")


def to_mode(
    image: Image.Image,
    mode: ColourMode,
    path: str | os.PathLike[str] = "",
    *,
    composite: bool = True,
) -> Image.Image:
    """``image`` in ``mode``: 16-bit scaled to 8, transparency composited onto white; without
    ``composite``, an image already in ``mode`` as it is (its transparency key ignored) and a
    YCbCr, LAB or HSV one's bands taken as RGB's, as ``np.array`` reads them: a processor
    that does not convert to RGB.

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
        image = _eight_bit(image, keyed=composite or mode is not ColourMode.GREY)
    if image.mode == mode.value and not composite:
        return image
    if not composite and mode is ColourMode.RGB and image.mode in _THREE_BANDS:
        # np.array reads its three bands as they are, as if they were RGB (no conversion).
        return Image.fromarray(np.asarray(image), "RGB")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return image if image.mode == mode.value else image.convert(mode.value)
