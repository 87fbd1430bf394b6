"""The image recipe: how a decoded picture becomes pixel values (pure, part of the key).

An :class:`ImageRecipe` names every step that changes the pixels a vision encoder sees:
colour mode, EXIF orientation, resize (shortest edge or exact size), interpolation,
antialiasing, centre crop, rescale and normalisation. It is hashed into the key through
:class:`featbake.recipe.Recipe`, so two transforms can never share stored features (linear-probe
caches keyed by a dataset and model name alone are the bug this avoids).

Defaults come from a Hugging Face folder's image processor settings, what its config leaves
out as the processor's class has it (:meth:`ImageRecipe.from_processor`,
:data:`PROCESSOR_DEFAULTS`), or are given as options. The steps run in the order
transformers' image processors run them: resize, centre crop, rescale, normalise
(``PilBackend._preprocess``); the arithmetic is here (:func:`resized_size`,
:func:`crop_box`) and the pixels are moved in :mod:`featbake.encode.images`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from featbake.errors import ConfigError

# == image_recipe ==================================================================================
#: Bump when featbake's image decoding or transform changes outputs for the same recipe.
IMAGE_VERSION = 1
#: transformers' default ``rescale_factor``: uint8 [0, 255] -> [0, 1].
RESCALE_255 = 1 / 255
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Image processors whose pipeline is exactly resize -> centre crop -> rescale -> normalise.
#: Others (ConvNeXT's ``crop_pct``, processors that pad or tile) transform differently, and
#: featbake refuses them rather than storing features under a transform it does not run.
PLAIN_PROCESSORS = frozenset(
    {
        "ViTImageProcessor",
        "CLIPImageProcessor",
        "BitImageProcessor",
        "SiglipImageProcessor",
        "DeiTImageProcessor",
        "Dinov2ImageProcessor",
    }
)


#: OpenAI CLIP's normalisation, CLIP's and BiT's processors' defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: transformers' ``IMAGENET_STANDARD_MEAN`` / ``_STD``.
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ProcessorDefaults:
    """What a plain processor's class does with a setting its config leaves out (or sets to
    null), as transformers' class does it: each such setting's value, and how it reads an int
    ``size`` (a square, or the shortest edge: its ``default_to_square``). Taking featbake's
    own defaults instead (bilinear, no crop, an int size as a square without a crop) gave a
    config that leaves them out other pixels than transformers' processor gives.
    ``tests/test_image_recipe.py`` checks the table against transformers itself."""

    size: Mapping[str, int]
    crop_size: Mapping[str, int] | None
    do_center_crop: bool
    resample: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    int_size_is_square: bool
    do_convert_rgb: bool

    def settings(self) -> dict[str, Any]:
        """The settings a config leaving them all out has."""
        out = {
            "size": dict(self.size),
            "do_center_crop": self.do_center_crop,
            "resample": self.resample,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_convert_rgb": self.do_convert_rgb,
        }
        return out | ({"crop_size": dict(self.crop_size)} if self.crop_size else {})


_SQUARE_224 = {"height": 224, "width": 224}
#: Each plain processor's class defaults (``Dinov2ImageProcessor`` is no transformers class:
#: its configs are read as given, an int size as before).
PROCESSOR_DEFAULTS: dict[str, ProcessorDefaults] = {
    "ViTImageProcessor": ProcessorDefaults(_SQUARE_224, None, False, 2, HALF, HALF, True, False),
    "CLIPImageProcessor": ProcessorDefaults(
        {"shortest_edge": 224}, _SQUARE_224, True, 3, CLIP_MEAN, CLIP_STD, False, True
    ),
    "BitImageProcessor": ProcessorDefaults(
        {"shortest_edge": 224}, _SQUARE_224, True, 3, CLIP_MEAN, CLIP_STD, False, True
    ),
    "SiglipImageProcessor": ProcessorDefaults(_SQUARE_224, None, False, 3, HALF, HALF, False, True),
    "DeiTImageProcessor": ProcessorDefaults(
        {"height": 256, "width": 256}, _SQUARE_224, True, 3, HALF, HALF, True, False
    ),
}


class Interpolation(StrEnum):
    """Resampling filters, by Pillow's names; the value is ``PIL.Image.Resampling``'s number."""

    NEAREST = "nearest"
    LANCZOS = "lanczos"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"

    @property
    def pil(self) -> int:
        """``PIL.Image.Resampling`` value (what ``preprocessor_config.json`` calls ``resample``)."""
        return list(Interpolation).index(self)

    @classmethod
    def parse(cls, value: object) -> Interpolation:
        """A name (``"bicubic"``) or Pillow number (``3``) -> Interpolation.

        Raises:
            ConfigError: neither.

        Example:
            >>> Interpolation.parse(3).value
            'bicubic'
        """
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(cls):
            return list(cls)[value]
        if isinstance(value, str) and value.lower() in {m.value for m in cls}:
            return cls(value.lower())
        names = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown interpolation {value!r}; choose one of {names}")


class ColourMode(StrEnum):
    """The colour mode images are converted to before the transform."""

    RGB = "RGB"
    GREY = "L"


class ResizeKind(StrEnum):
    """How ``resize`` reads its size."""

    SHORTEST_EDGE = "shortest_edge"  # the shorter side becomes ``height``, aspect kept
    EXACT = "exact"  # exactly ``height`` x ``width``
    NONE = "none"


class Size(NamedTuple):
    """A height and width in pixels."""

    height: int
    width: int


#: The classic ImageNet evaluation crop (resize the short side to 256, crop 224).
DEFAULT_CROP = Size(224, 224)


@dataclass(frozen=True)
class Resize:
    """A resize step: ``Resize(ResizeKind.SHORTEST_EDGE, 256)`` or ``Resize.exact(224, 224)``."""

    kind: ResizeKind = ResizeKind.SHORTEST_EDGE
    height: int = 256
    width: int = 0  # only for EXACT

    @classmethod
    def exact(cls, height: int, width: int) -> Resize:
        """Resize to exactly ``height`` x ``width``."""
        return cls(ResizeKind.EXACT, height, width)

    @classmethod
    def parse(cls, text: str) -> Resize:
        """``"256"`` (shortest edge), ``"224x224"`` (height x width) or ``"none"``.

        Raises:
            ConfigError: another spelling.

        Example:
            >>> Resize.parse("224x160")
            Resize(kind=<ResizeKind.EXACT: 'exact'>, height=224, width=160)
        """
        text = text.strip().lower()
        if text == "none":
            return cls(ResizeKind.NONE, 0, 0)
        size = parse_size(text, "--resize")
        if "x" in text:
            return cls.exact(size.height, size.width)
        return cls(ResizeKind.SHORTEST_EDGE, size.height)

    def describe(self) -> str:
        """``short 256``, ``224x224`` or ``none``."""
        if self.kind is ResizeKind.SHORTEST_EDGE:
            return f"short {self.height}"
        return f"{self.height}x{self.width}" if self.kind is ResizeKind.EXACT else "none"


def parse_size(text: str, option: str) -> Size:
    """``"224"`` -> 224x224, ``"224x160"`` -> height 224, width 160.

    Raises:
        ConfigError: not one or two positive whole numbers.
    """
    bits = text.strip().lower().split("x")
    try:
        numbers = [int(b) for b in bits]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers, default=0) < 1:
        raise ConfigError(
            f"{option} takes a size like 224 or 224x224 (height x width), got {text!r}"
        )
    return Size(numbers[0], numbers[-1])


def processor_kind(config: Mapping[str, Any]) -> str:
    """The image processor class a config names, as transformers finds it: its
    ``image_processor_type``, else its ``feature_extractor_type`` with ``FeatureExtractor``
    read as ``ImageProcessor`` (openai/clip-vit-*, google/vit-*, DeiT and DINO ship only that),
    less the ``Fast``/``Pil`` backend suffix.

    Example:
        >>> processor_kind({"feature_extractor_type": "CLIPFeatureExtractor"})
        'CLIPImageProcessor'
    """
    kind = config.get("image_processor_type") or str(
        config.get("feature_extractor_type") or ""
    ).replace("FeatureExtractor", "ImageProcessor")
    return str(kind).removesuffix("Fast").removesuffix("Pil")


def per_channel(value: Any) -> tuple[float, ...]:
    """A processor's ``image_mean`` or ``image_std`` per RGB channel: a list as it is, a
    number for each of the three (transformers broadcasts one over the channels).

    Example:
        >>> per_channel(0.5), per_channel([0.1, 0.2, 0.3])
        ((0.5, 0.5, 0.5), (0.1, 0.2, 0.3))
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    return tuple(value)


@dataclass(frozen=True)
class ImageRecipe:
    """Every step between a decoded image and the encoder's ``[C, H, W]`` float32 input.

    Attributes:
        resize: shortest edge (aspect kept, the long side truncated as transformers does),
            exact size, or none.
        interpolation: the resampling filter.
        antialias: filter when shrinking (Pillow always does); ``False`` resamples with
            ``torch.nn.functional.interpolate(antialias=False)``, as old torchvision tensors did.
        crop: centre crop to this size after the resize (``None``: no crop); an image smaller
            than the crop is padded with zeros, as transformers does.
        rescale: multiply pixel values by this (``1/255``); ``None`` keeps 0..255.
        mean, std: per-channel normalisation after the rescale; ``None`` skips it.
        mode: colour mode images are converted to (transparency composited onto white).
        composite: transparency is composited onto white even where an image is already in
            ``mode`` (transformers' ``convert_to_rgb``); ``False`` takes such an image's
            pixels as saved, its transparency ignored, as a processor that does not convert
            to RGB (``do_convert_rgb`` false or unset: ViT's, DeiT's) reads them
            (``np.array(image)``), and a YCbCr, LAB or HSV image's bands as RGB's, as it does.
            An image in another mode is converted either way (such a processor raises on it).
        exif: apply the EXIF orientation tag before anything else.
        hflip: this recipe is the horizontally flipped *view*: the image is mirrored before
            the transform (``--views hflip`` bakes it beside the original, under its own key).

    Example:
        >>> ImageRecipe(crop=Size(224, 224)).describe()
        'short 256 bilinear crop 224x224 rescale mean/std RGB'
    """

    resize: Resize = Resize()
    interpolation: Interpolation = Interpolation.BILINEAR
    antialias: bool = True
    crop: Size | None = DEFAULT_CROP
    rescale: float | None = RESCALE_255
    mean: tuple[float, ...] | None = IMAGENET_MEAN
    std: tuple[float, ...] | None = IMAGENET_STD
    mode: ColourMode = ColourMode.RGB
    exif: bool = True
    hflip: bool = False
    composite: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "interpolation", Interpolation.parse(self.interpolation))
        set_(self, "mode", ColourMode(self.mode))
        if self.crop is not None:
            set_(self, "crop", Size(*self.crop))
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, tuple(float(v) for v in value))
        if self.rescale is not None:  # 1 and 1.0 one key, as the command line gives 1.0
            set_(self, "rescale", float(self.rescale))
        self._check()

    def _check(self) -> None:
        channels = 3 if self.mode is ColourMode.RGB else 1
        if (self.mean is None) != (self.std is None):
            raise ConfigError("give both --mean and --std, or neither (no normalisation)")
        if self.mean is not None and self.std is not None:
            if len(self.mean) != channels or len(self.std) != channels:
                raise ConfigError(
                    f"--mean and --std need {channels} values for mode {self.mode.value}, "
                    f"got {len(self.mean)} and {len(self.std)}"
                )
            if not all(math.isfinite(v) for v in self.mean):  # NaN would also break the key
                raise ConfigError(f"--mean values must be finite numbers, got {self.mean}")
            if not all(math.isfinite(v) and v > 0 for v in self.std):
                raise ConfigError(f"--std values must be positive, got {self.std}")
        if self.rescale is not None and not (math.isfinite(self.rescale) and self.rescale > 0):
            raise ConfigError(
                f"--rescale must be a positive number such as 1/255, got {self.rescale}"
            )
        for flag in ("antialias", "exif", "hflip", "composite"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not self.antialias and self.interpolation not in ANTIALIAS_OFF_FILTERS:
            raise ConfigError(
                f"--no-antialias resamples with torch, which has no {self.interpolation.value} "
                "filter; use nearest, bilinear or bicubic"
            )

    @classmethod
    def from_processor(
        cls, config: Mapping[str, Any], where: str = "the image processor"
    ) -> ImageRecipe:
        """The recipe a transformers image processor config describes.

        Raises:
            ConfigError: a processor featbake does not reproduce exactly (a type outside
                :data:`PLAIN_PROCESSORS`, padding, ``longest_edge``), or missing values.

        Example:
            >>> ImageRecipe.from_processor({"image_processor_type": "ViTImageProcessor",
            ...     "size": {"height": 224, "width": 224}, "resample": 2,
            ...     "image_mean": [0.5] * 3, "image_std": [0.5] * 3}).describe()
            '224x224 bilinear rescale mean/std RGB transparency-as-saved'
        """
        kind = processor_kind(config)
        if kind not in PLAIN_PROCESSORS or config.get("do_pad"):
            raise ConfigError(
                f"{where} is a {kind or 'untyped'} processor, whose transform featbake does not "
                f"reproduce (it runs {', '.join(sorted(PLAIN_PROCESSORS))}); give the transform "
                "with --resize/--crop/--mean/--std and a TorchScript or import-path encoder"
            )
        # A do_* flag set to null is off, as transformers reads it (``if do_center_crop:``).
        config = {k: False if v is None and k.startswith("do_") else v for k, v in config.items()}
        defaults = PROCESSOR_DEFAULTS.get(kind)
        _refuse_null_settings(config, defaults, where)
        if defaults is not None:  # what the class does with a setting left out, or null
            given = {k: v for k, v in config.items() if v is not None}
            config = defaults.settings() | given
        square = _int_size_is_square(config, defaults)
        crop = config.get("crop_size") if config.get("do_center_crop", False) else None
        mean, std = config.get("image_mean"), config.get("image_std")
        normalize = bool(config.get("do_normalize", True))
        if normalize and (mean is None or std is None):
            raise ConfigError(f"{where} sets do_normalize but not image_mean and image_std")
        return cls(
            resize=_processor_resize(config, where, square),
            interpolation=Interpolation.parse(config.get("resample", Interpolation.BILINEAR.pil)),
            crop=_processor_size(crop, where, "crop_size") if crop is not None else None,
            rescale=float(config.get("rescale_factor", RESCALE_255))
            if config.get("do_rescale", True)
            else None,
            mean=per_channel(mean) if normalize and mean is not None else None,
            std=per_channel(std) if normalize and std is not None else None,
            composite=bool(config.get("do_convert_rgb", True)),
        )

    def key_fields(self) -> dict[str, Any]:
        """The canonical fields that enter the key (floats as they are, enums by value)."""
        return {
            "version": IMAGE_VERSION,
            "resize": [self.resize.kind.value, self.resize.height, self.resize.width],
            "interpolation": self.interpolation.value,
            "antialias": self.antialias,
            "crop": list(self.crop) if self.crop is not None else None,
            "rescale": self.rescale,
            "mean": list(self.mean) if self.mean is not None else None,
            "std": list(self.std) if self.std is not None else None,
            "mode": self.mode.value,
            "exif": self.exif,
            # Only the flipped view says so: the original's fields stay as they were.
            **({"hflip": True} if self.hflip else {}),
            # Only a recipe that leaves transparency as saved says so (keys kept otherwise).
            **({"composite": False} if not self.composite else {}),
        }

    def describe(self) -> str:
        """One line for ``featbake roots``: ``short 256 bicubic crop 224x224 rescale ...``."""
        return describe_fields(self.key_fields())

    def replace(self, **changes: Any) -> ImageRecipe:
        """A copy with some steps changed (the CLI's options over a folder's defaults)."""
        return dataclasses.replace(self, **changes)


#: The filters ``torch.nn.functional.interpolate`` has (the ``antialias=False`` path).
ANTIALIAS_OFF_FILTERS = (Interpolation.NEAREST, Interpolation.BILINEAR, Interpolation.BICUBIC)


def describe_fields(fields: Mapping[str, Any]) -> str:
    """:meth:`ImageRecipe.describe` from the stored key fields (as ``featbake roots`` has them)."""
    kind, height, width = fields.get("resize") or ("none", 0, 0)
    bits = [Resize(ResizeKind(kind), height, width).describe(), str(fields.get("interpolation"))]
    if fields.get("antialias") is False:
        bits.append("no-antialias")
    if fields.get("crop"):
        bits.append("crop {}x{}".format(*fields["crop"]))
    if fields.get("rescale") is not None:
        bits.append("rescale")
    if fields.get("mean") is not None:
        bits.append("mean/std")
    bits.append(str(fields.get("mode")))
    if fields.get("exif") is False:
        bits.append("no-exif")
    if fields.get("hflip"):
        bits.append("hflip")
    if fields.get("composite") is False:
        bits.append("transparency-as-saved")
    return " ".join(bits)


#: The settings each step of a processor needs, by the flag that turns the step on and its
#: default where the class has none of its own.
_STEP_SETTINGS = (
    ("do_resize", True, ("size", "resample")),
    ("do_center_crop", False, ("crop_size",)),
    ("do_rescale", True, ("rescale_factor",)),
    ("do_normalize", True, ("image_mean", "image_std")),
)


def _refuse_null_settings(
    config: Mapping[str, Any], defaults: ProcessorDefaults | None, where: str
) -> None:
    """Raise where a step that is on has a setting set to null: transformers' processor raises
    on it ("`crop_size` must be specified if `do_center_crop` is `True`"), where taking the
    class's default made features of a transform the folder's processor never runs.

    Raises:
        ConfigError: such a setting, named with its step.
    """
    for flag, default, names in _STEP_SETTINGS:
        if flag == "do_center_crop" and defaults is not None:
            default = defaults.do_center_crop
        nulls = [n for n in names if n in config and config[n] is None]
        if config.get(flag, default) and nulls:
            raise ConfigError(
                f"{where} sets {' and '.join(nulls)} to null with {flag} on, which transformers' "
                f"processor refuses; give {'them' if len(nulls) > 1 else 'it'} a value, or set "
                f"{flag} to false"
            )


def _int_size_is_square(
    config: Mapping[str, Any], defaults: ProcessorDefaults | None
) -> bool | None:
    """Whether the processor reads an int ``size`` as a square: the config's own
    ``default_to_square`` where it sets one (transformers reads it from the file: a ViT
    folder saying false resized to the shortest edge, where featbake made a square), else its
    class's; None where neither is known."""
    own = config.get("default_to_square")
    if isinstance(own, bool):
        return own
    return None if defaults is None else defaults.int_size_is_square


def _processor_resize(config: Mapping[str, Any], where: str, square: bool | None) -> Resize:
    """The resize of a processor's config; ``square``: whether its class reads an int ``size``
    as a square (transformers' ``default_to_square``), None where it is not known (then a
    processor with a centre crop is read as CLIP-like, the shortest edge, and one without as
    ViT-like, a square)."""
    if not config.get("do_resize", True):
        return Resize(ResizeKind.NONE, 0, 0)
    size = config.get("size")
    if isinstance(size, int) and not isinstance(size, bool):
        if square is None:
            square = not config.get("do_center_crop", False)
        return Resize.exact(size, size) if square else Resize(ResizeKind.SHORTEST_EDGE, size)
    if isinstance(size, Mapping) and set(size) == {"shortest_edge"}:
        return Resize(ResizeKind.SHORTEST_EDGE, int(size["shortest_edge"]))
    exact = _processor_size(size, where, "size")
    return Resize.exact(exact.height, exact.width)


def _processor_size(value: object, where: str, name: str) -> Size:
    if isinstance(value, int) and not isinstance(value, bool):
        return Size(value, value)
    if isinstance(value, Mapping) and set(value) == {"height", "width"}:
        return Size(int(value["height"]), int(value["width"]))
    raise ConfigError(
        f"{where}: {name} {value!r} is not a size featbake reproduces ({{'height', 'width'}} or "
        "{'shortest_edge'}); give the transform with --resize and --crop"
    )


def resized_size(height: int, width: int, resize: Resize) -> Size:
    """The size an image of ``height`` x ``width`` is resized to (transformers' arithmetic).

    Shortest edge: the short side becomes ``resize.height`` and the long side
    ``int(size * long / short)`` (truncated, as ``get_resize_output_image_size`` does).

    Example:
        >>> resized_size(480, 640, Resize(ResizeKind.SHORTEST_EDGE, 256))
        Size(height=256, width=341)
    """
    if resize.kind is ResizeKind.NONE:
        return Size(height, width)
    if resize.kind is ResizeKind.EXACT:
        return Size(resize.height, resize.width)
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize.height, int(resize.height * long / short)
    return Size(new_long, new_short) if width <= height else Size(new_short, new_long)


class CropBox(NamedTuple):
    """Where a centre crop cuts, in the image padded to at least the crop size."""

    pad_top: int
    pad_left: int
    top: int
    left: int


def crop_box(height: int, width: int, crop: Size) -> CropBox:
    """The centre crop of ``crop`` from a ``height`` x ``width`` image (transformers' rule).

    ``top = (height - crop) // 2``; an image smaller than the crop is first padded with zeros,
    ``ceil(missing / 2)`` before it.

    Example:
        >>> crop_box(256, 341, Size(224, 224))
        CropBox(pad_top=0, pad_left=0, top=16, left=58)
    """
    pad_top = math.ceil(max(0, crop.height - height) / 2)
    pad_left = math.ceil(max(0, crop.width - width) / 2)
    top = (height - crop.height) // 2 + pad_top
    left = (width - crop.width) // 2 + pad_left
    return CropBox(pad_top, pad_left, max(0, top), max(0, left))


# == image_options =================================================================================
# Image options as the command line spells them -> :meth:`ImageRecipe.replace` changes (pure).
#
# ``featbake build --resize 256 --crop 224 --mean 0.5,0.5,0.5`` goes through
# :func:`parse_image_options`; what is left out is decided by the encoder folder's processor or
# :class:`~featbake.image_recipe.ImageRecipe`'s defaults.
#: The keyword of each image option (``featbake build --image-mode`` is ``image_mode``).
def image_option(field: str) -> str:
    """The ``featbake build`` option of an image recipe's field (pure).

    Example:
        >>> image_option("mode"), image_option("crop")
        ('--image-mode', '--crop')
    """
    return "--" + {"mode": "image-mode"}.get(field, field).replace("_", "-")


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


def image_options(fields: Mapping[str, Any]) -> list[str]:
    """The `featbake build` options that give the image steps stored as ``fields``
    (:meth:`ImageRecipe.key_fields`) whatever the encoder's processor says, each step spelled
    (what :func:`parse_image_options` reads back). Transparency left as saved has no option:
    it is the folder's processor's own, which a build with its folder gives too.

    Example:
        >>> image_options(ImageRecipe(crop=Size(128, 96)).key_fields())[:4]
        ['--resize 256', '--crop 128x96', '--interpolation bilinear', '--antialias']
    """
    kind, height, width = fields.get("resize") or ("none", 0, 0)
    resize = {"shortest_edge": f"{height}", "exact": f"{height}x{width}"}.get(kind, "none")
    crop = fields.get("crop")
    out = [
        f"--resize {resize}",
        "--crop {}x{}".format(*crop) if crop else "--crop none",
        f"--interpolation {fields.get('interpolation', Interpolation.BILINEAR.value)}",
        "--antialias" if fields.get("antialias", True) else "--no-antialias",
        f"--rescale {fields['rescale']!r}"
        if fields.get("rescale") is not None
        else "--rescale none",
    ]
    for name in ("mean", "std"):
        values = fields.get(name)
        out.append(f"--{name} {','.join(map(repr, values))}" if values else f"--{name} none")
    out.append(
        "--image-mode grey" if fields.get("mode") == ColourMode.GREY.value else "--image-mode rgb"
    )
    out.append("--exif" if fields.get("exif", True) else "--no-exif")
    if fields.get("hflip"):
        out.append("--views hflip")
    return out


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
