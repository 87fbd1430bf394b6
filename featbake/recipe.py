"""The recipe: everything between a raw file and its stored features.

A :class:`Recipe` is hashed into every key (see :mod:`featbake.keys`), so it must hold exactly the
options that change the output and nothing else: no batch size, worker count, device or path.
``featbake build`` and :class:`featbake.CachedFeatureDataset` build the same Recipe from the same
options, which is why a dataset finds what the CLI baked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from featbake.errors import ConfigError
from featbake.image_recipe import ImageRecipe
from featbake.keys import recipe_fingerprint
from featbake.quantize import Scheme, scheme_of

if TYPE_CHECKING:  # torch is loaded where a dtype is asked for: a recipe is read, checked and
    # keyed by processes that never make a tensor (a Ray task hashing a container's inputs)
    import torch

#: Bump when featbake's preprocessing changes in a way that changes outputs for the same options.
RECIPE_VERSION = 1
#: How a ``max_seconds`` crop is read (2: with the resampler's whole context), in its keys only.
CROP_VERSION = 2

#: The stored dtypes' names, as ``--dtype`` takes them.
STORED_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8")


@functools.cache
def stored_dtypes() -> dict[str, torch.dtype]:
    """Stored dtype name -> the dtype of the stored tensor. ``int8`` and ``fp8`` (e4m3) are
    stored packed, a float32 scale per row after its codes (see :mod:`featbake.quantize`).
    Made once (torch loaded then), read per batch; not to be changed.

    Example:
        >>> stored_dtypes()["float16"], stored_dtypes()["int8"]
        (torch.float16, torch.int8)
    """
    import torch

    return {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int8": Scheme.INT8.packed_dtype,
        "fp8": Scheme.FP8.packed_dtype,
    }


SOURCE_KINDS = ("audio", "npy", "image", "text")
#: Bump when featbake's text decoding or tokenising changes ids for the same text recipe.
TEXT_VERSION = 1
#: The highest rate audio hardware records (Hz); above it a typo allocates gigabytes per clip.
MAX_SAMPLE_RATE = 768_000
#: Autocast precisions for the encoder call (``fp32``: no autocast).
PRECISIONS = ("fp32", "bf16", "fp16")


def _is_number(value: object) -> bool:
    """An int or float, not a bool (``True`` is an int to Python, never a duration here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class TextRecipe:
    """How a text becomes token ids: the tokenizer and its options (part of the key).

    Built from a Hugging Face model folder by
    :func:`featbake.encode.hf.text_recipe_for_folder`, which hashes the tokenizer's files, so a
    different vocabulary, normaliser or special-token map gives other keys.

    Attributes:
        tokenizer: SHA-256 over the tokenizer's class and files (each file's name and bytes).
        max_length: tokens per text at most, special tokens included.
        truncate: cut a longer text to ``max_length`` tokens; ``False`` refuses it as a bad input.
        lowercase: lowercase the text before the tokenizer (for a cased tokenizer).
        special_tokens: add the tokenizer's special tokens (``[CLS] ... [SEP]``, ``</s>``).
        folder: where the tokenizer is loaded from; not in the key (the digest names it).
    """

    tokenizer: str
    max_length: int
    truncate: bool = True
    lowercase: bool = False
    special_tokens: bool = True
    folder: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        n = self.max_length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--max-tokens must be a whole number >= 1, got {n!r}")
        for name in ("truncate", "lowercase", "special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def key_fields(self) -> dict[str, Any]:
        """The fields that change token ids (not the folder, which is only where they are)."""
        return {
            "version": TEXT_VERSION,
            "tokenizer": self.tokenizer,
            "max_length": self.max_length,
            "truncate": self.truncate,
            "lowercase": self.lowercase,
            "special_tokens": self.special_tokens,
        }

    def replace(self, **changes: Any) -> TextRecipe:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def text_brief(fields: dict[str, Any]) -> str:
    """A stored text recipe's tokenizer in words, for ``featbake roots`` and ``stats``.

    Example:
        >>> text_brief({"tokenizer": "ab" * 32, "max_length": 77, "truncate": True,
        ...             "lowercase": True, "special_tokens": True})
        'tokenizer ababababababab max 77 tokens lowercase'
    """
    bits = [
        f"tokenizer {str(fields.get('tokenizer'))[:14]}",
        f"max {fields.get('max_length')} tokens",
    ]
    if fields.get("truncate") is False:
        bits.append("no-truncate")
    if fields.get("lowercase"):
        bits.append("lowercase")
    if fields.get("special_tokens") is False:
        bits.append("no-special-tokens")
    return " ".join(bits)


@dataclass(frozen=True)
class Recipe:
    """How a file becomes features.

    Attributes:
        source: ``"audio"`` (decode, mono mixdown, resample), ``"npy"`` (arrays as they are),
            ``"image"`` (decode, then :attr:`image`'s transform) or ``"text"`` (UTF-8, then
            :attr:`text`'s tokenizer to token ids).
        sample_rate: audio is resampled to this rate (Hz) before encoding.
        mono: mix all channels to one (``False`` keeps ``[C, T]`` for multi-channel encoders).
        max_seconds: crop audio to its first ``max_seconds`` seconds (``None``: whole file).
        output: which encoder output to store (a dict key or tuple index); ``None`` stores all.
        dtype: the stored dtype: ``float32``, ``float16``, ``bfloat16``, or ``int8`` / ``fp8``
            (quantised with a scale per row, about a quarter of float32's bytes; served
            dequantised, see :mod:`featbake.quantize`).
        precision: the encoder runs under autocast in ``bf16`` or ``fp16``, or plainly in
            ``fp32`` (the default). Outputs differ by precision, so it is part of the key.
        layers: hidden layers to store (``(0, 6, 12)``; each becomes the part ``"layer6"``), for
            encoders with hidden states (Hugging Face folders); ``None`` stores the output.
            ``"all"`` is resolved to ``0..num_hidden_layers`` when the model is known.
        normalize: zero-mean, unit-variance per clip before encoding (a Hugging Face
            ``preprocessor_config.json`` with ``do_normalize: true``).
        image: the image transform (source ``"image"`` only); ``None``: the encoder folder's
            image processor (see :func:`featbake.encode.hf.recipe_for_folder`), else
            :class:`ImageRecipe`'s defaults.
        text: the tokenizer and its options (source ``"text"`` only); ``None``: the encoder
            folder's tokenizer (see :func:`featbake.encode.hf.recipe_for_folder`).

    ``precision``, ``layers`` and ``normalize`` enter the key only when set away from their
    defaults, so the keys of recipes that do not use them stay what they were.

    Example:
        >>> Recipe(sample_rate=16000, dtype="float16").fingerprint()[:8]  # doctest: +SKIP
        '3f1c9a0e'
    """

    source: str = "audio"
    sample_rate: int = 16000
    mono: bool = True
    max_seconds: float | None = None
    output: str | None = None
    dtype: str = "float32"
    precision: str = "fp32"
    layers: tuple[int, ...] | str | None = None
    normalize: bool = False
    image: ImageRecipe | None = None
    text: TextRecipe | None = None

    def __post_init__(self) -> None:
        # Normalise numbers so that equal options give equal keys: canonical JSON writes 10 and
        # 10.0 differently, and the CLI passes floats where a library caller may pass ints.
        rate: object = self.sample_rate  # a float from the CLI, an int from a library caller
        if isinstance(rate, float) and rate.is_integer():
            object.__setattr__(self, "sample_rate", int(self.sample_rate))
        self._check_flags()
        if self.max_seconds is not None and _is_number(self.max_seconds):
            object.__setattr__(self, "max_seconds", float(self.max_seconds))
        self._check_output()
        if self.source not in SOURCE_KINDS:
            raise ConfigError(
                f"unknown source kind {self.source!r}; choose one of {', '.join(SOURCE_KINDS)}"
            )
        if self.dtype not in STORED_DTYPE_NAMES:
            raise ConfigError(
                f"unsupported stored dtype {self.dtype!r}; choose one of "
                f"{', '.join(STORED_DTYPE_NAMES)} (e.g. --dtype float16 or --dtype int8)"
            )
        self._check_numbers()
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        self._check_layers()
        if self.image is not None and not isinstance(self.image, ImageRecipe):
            raise ConfigError(
                f"image must be an ImageRecipe (featbake.image_recipe), got "
                f"{type(self.image).__name__}"
            )
        if self.text is not None and not isinstance(self.text, TextRecipe):
            raise ConfigError(
                f"text must be a TextRecipe (featbake.recipe), got {type(self.text).__name__}"
            )

    def _check_numbers(self) -> None:
        """Bound the numeric options before anything is allocated from them."""
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, int) or not 0 < rate <= MAX_SAMPLE_RATE:
            raise ConfigError(
                f"--sample-rate must be a whole number of Hz from 1 to {MAX_SAMPLE_RATE:,}, "
                f"got {rate!r}"
            )
        seconds = self.max_seconds
        if seconds is not None and (
            not _is_number(seconds) or not math.isfinite(seconds) or seconds <= 0
        ):
            raise ConfigError(
                f"--max-seconds must be a positive, finite number of seconds, got {seconds!r}; "
                "leave it out to keep whole files"
            )
        if seconds is not None and round(seconds * rate) < 1:  # every clip cropped to nothing
            raise ConfigError(
                f"--max-seconds {seconds!r} keeps no sample at {rate:,} Hz (one sample is "
                f"{1 / rate:.3g} s); crop to a longer time, or leave it out to keep whole files"
            )

    def _check_output(self) -> None:
        """Take a tuple index given as a number (``output=0``) as the CLI gives it (``"0"``):
        a store built with ``--output 0`` missed every item for a dataset given ``output=0``,
        saying to run the same build again. Anything else not a name is refused.

        Raises:
            ConfigError: ``output`` is neither a name, a whole number nor None.
        """
        output: Any = self.output
        if output is None or isinstance(output, str):
            return
        try:
            index = -1 if isinstance(output, bool) else operator.index(output)  # numpy's too
        except TypeError:
            index = -1
        if index < 0:
            raise ConfigError(
                f"output must name one output (a dict key, or a tuple index such as 0), got "
                f"{output!r}"
            )
        object.__setattr__(self, "output", str(index))

    def _check_flags(self) -> None:
        """``mono`` and ``normalize`` are True or False: ``mono=2`` must not make its own key."""
        for name in ("mono", "normalize"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")

    def _check_layers(self) -> None:
        if self.layers is None or self.layers == "all":  # "all": resolved against the model
            return
        given: tuple[object, ...] = tuple(self.layers)
        if not given or any(isinstance(k, bool) or not isinstance(k, int) for k in given):
            raise ConfigError(f"layers must be whole numbers, e.g. --layers 0,6,12; got {given!r}")
        layers = [k for k in given if isinstance(k, int)]
        if any(k < 0 for k in layers):
            raise ConfigError(f"layers count from 0 (the input to the first layer); got {layers}")
        # Sorted and unique: --layers 6,0 and --layers 0,6,6 store the same parts, so one key.
        object.__setattr__(self, "layers", tuple(sorted(set(layers))))

    @property
    def image_steps(self) -> ImageRecipe:
        """The image transform this recipe runs (:attr:`image`, or the defaults when unset)."""
        return self.image if self.image is not None else ImageRecipe()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the stored tensors (``int8``/``uint8`` packed for int8 and fp8)."""
        return stored_dtypes()[self.dtype]

    @property
    def scheme(self) -> Scheme | None:
        """The quantisation scheme of ``int8`` and ``fp8``; None for a float dtype."""
        return scheme_of(self.dtype)

    @property
    def encode_dtype(self) -> torch.dtype:
        """The float dtype encoder outputs are taken in before storing: the stored dtype, or
        float32 for a quantised one (quantised from float32, so the scale sees every bit)."""
        import torch

        return torch.float32 if self.scheme is not None else self.torch_dtype

    def encoded(self, value: torch.Tensor) -> torch.Tensor:
        """An encoder output part on the CPU as it is taken before storing: a float part in
        :attr:`encode_dtype`; an integer or bool part (lengths, a mask) as it is, its values
        exact (``float16`` held 32,792 as 32,800 and a mask as 1.0)."""
        if not (value.is_floating_point() or value.is_complex()):
            return value.detach().to("cpu")
        return value.detach().to("cpu", self.encode_dtype)

    def as_dict(self) -> dict[str, Any]:
        """The fields that define the output, with featbake's recipe version.

        Fields that do not apply to the source kind are left out, so they cannot split keys.
        """
        fields = {"version": RECIPE_VERSION, "source": self.source}
        fields["output"] = self.output
        fields["dtype"] = self.dtype
        if self.source == "audio":
            fields["sample_rate"] = self.sample_rate
            fields["mono"] = self.mono
            fields["max_seconds"] = self.max_seconds
            if self.max_seconds is not None:
                # A crop reads the resampler's whole context (sources.crop_margin): crops made
                # with 64 samples of it differ in their last samples, so they are keyed apart.
                fields["crop"] = CROP_VERSION
            if self.normalize:
                fields["normalize"] = True
        if self.source == "image":  # image steps join image keys only: audio keys stay
            fields["image"] = self.image_steps.key_fields()
        if self.source == "text":  # the tokenizer joins text keys only
            fields["text"] = None if self.text is None else self.text.key_fields()
        # Newer options join the key only when used: a recipe that leaves them at their
        # defaults keeps the key it had before they existed.
        if self.precision != "fp32":
            fields["precision"] = self.precision
        if self.layers is not None:
            fields["layers"] = self.layers if isinstance(self.layers, str) else list(self.layers)
        return fields

    def fingerprint(self) -> str:
        """SHA-256 of :meth:`as_dict` as canonical JSON."""
        return recipe_fingerprint(self.as_dict())

    def replace(self, **changes: Any) -> Recipe:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
