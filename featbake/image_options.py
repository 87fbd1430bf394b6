"""Image options as the command line spells them -> :meth:`ImageRecipe.replace` changes (pure).

``featbake build --resize 256 --crop 224 --mean 0.5,0.5,0.5`` goes through
:func:`parse_image_options`; what is left out is decided by the encoder folder's processor or
:class:`~featbake.image_recipe.ImageRecipe`'s defaults.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from featbake.errors import ConfigError
from featbake.image_recipe import ColourMode, ImageRecipe, Interpolation, Resize, parse_size

#: The keyword of each image option (``featbake build --image-mode`` is ``image_mode``).
IMAGE_OPTIONS = (
    "resize",
    "crop",
    "interpolation",
    "antialias",
    "rescale",
    "mean",
    "std",
    "image_mode",
    "exif",
)


#: The largest side ``--resize`` and ``--crop`` take.
MAX_SIDE = 8192


def parse_image_options(  # noqa: PLR0913 - one keyword per command-line option
    *,
    resize: str | None = None,
    crop: str | None = None,
    interpolation: str | None = None,
    antialias: bool | None = None,
    rescale: str | None = None,
    mean: str | None = None,
    std: str | None = None,
    image_mode: str | None = None,
    exif: bool | None = None,
) -> dict[str, Any]:
    """The image steps given as command-line text, as :meth:`ImageRecipe.replace` changes.

    Options left at ``None`` are not in the result (the folder's processor, or the defaults,
    decide them). ``"none"`` turns a step off: ``--crop none``, ``--rescale none``, ``--mean
    none --std none``.

    Raises:
        ConfigError: a value that does not parse, naming the option and an example; a
            ``--resize`` or ``--crop`` side over :data:`MAX_SIDE`.

    Example:
        >>> parse_image_options(crop="224", mean="0.5,0.5,0.5")
        {'crop': Size(height=224, width=224), 'mean': (0.5, 0.5, 0.5)}
    """
    changes: dict[str, Any] = {}
    if resize is not None:
        changes["resize"] = Resize.parse(resize)
        _check_side(max(changes["resize"].height, changes["resize"].width), "--resize", resize)
    if crop is not None:
        changes["crop"] = None if _off(crop) else parse_size(crop, "--crop")
        _check_side(max(changes["crop"] or (0,)), "--crop", crop)
    if interpolation is not None:
        changes["interpolation"] = Interpolation.parse(interpolation)
    if rescale is not None:
        changes["rescale"] = None if _off(rescale) else _number(rescale, "--rescale")
    for name, text in (("mean", mean), ("std", std)):
        if text is not None:
            changes[name] = None if _off(text) else _numbers(text, f"--{name}")
    if image_mode is not None:
        changes["mode"] = _mode(image_mode)
    changes.update({k: v for k, v in (("antialias", antialias), ("exif", exif)) if v is not None})
    return changes


def _check_side(side: int, option: str, text: str) -> None:
    """Refuse a side no image should be resized or cropped to, before any work (each image
    would otherwise fail alone with a MemoryError, or the build be killed for its memory)."""
    if side > MAX_SIDE:
        raise ConfigError(
            f"{option} {text} is larger than featbake resizes to: at most {MAX_SIDE} pixels a "
            f"side (a {MAX_SIDE}x{MAX_SIDE} RGB input is already 768 MiB as float32)"
        )


def _off(text: str) -> bool:
    return text.strip().lower() == "none"


def _number(text: str, option: str) -> float:
    """``"0.5"`` or a fraction such as ``"1/255"``."""
    top, _, bottom = text.strip().partition("/")
    try:
        return float(top) / (float(bottom) if bottom else 1.0)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{option} takes a number such as 1/255 or 0.5, got {text!r}") from None


def _numbers(text: str, option: str) -> tuple[float, ...]:
    return tuple(_number(t, option) for t in text.split(",") if t.strip())


def _mode(text: str) -> ColourMode:
    spelled = {"rgb": ColourMode.RGB, "l": ColourMode.GREY, "grey": ColourMode.GREY}
    spelled["gray"] = ColourMode.GREY
    if text.strip().lower() not in spelled:
        raise ConfigError(f"--image-mode takes rgb or grey, got {text!r}")
    return spelled[text.strip().lower()]


class View(StrEnum):
    """A stored view of each image: the original, or the horizontally flipped picture."""

    ORIGINAL = "original"
    HFLIP = "hflip"


def parse_views(text: str | None) -> tuple[View, ...]:
    """``--views hflip`` -> (original, hflip): the original is always baked.

    Raises:
        ConfigError: an unknown view.

    Example:
        >>> [v.value for v in parse_views("hflip")]
        ['original', 'hflip']
    """
    names = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
    known = {v.value for v in View}
    if any(n not in known for n in names):
        raise ConfigError(f"--views takes hflip (the original is always stored), got {text!r}")
    return (View.ORIGINAL, *(View.HFLIP for n in dict.fromkeys(names) if n == View.HFLIP))


def view_steps(steps: ImageRecipe, view: View) -> ImageRecipe:
    """The image steps that bake ``view`` (its own key: ``hflip`` is a key field)."""
    return steps.replace(hflip=view is View.HFLIP)
