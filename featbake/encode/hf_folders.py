"""A Hugging Face model folder's files as the recipe reads them, without torch or transformers.

What ``featbake build``'s options and a folder's ``preprocessor_config.json`` or tokenizer make
of the recipe (:func:`image_steps_for`, :func:`text_steps_for`) is read from the folder's JSON
files, so a command refuses a wrong option, or names a missing encoder, before torch is
imported (seconds of CPU). A tokenizer is loaded with transformers only for a text folder's
recipe (:func:`text_recipe_for_folder`). The models themselves are :mod:`featbake.encode.hf`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from featbake.errors import ConfigError, EncoderLoadError, first_line
from featbake.image_recipe import ImageRecipe
from featbake.keys import canonical_json, sha256_file, sha256_hex
from featbake.recipe import TextRecipe

PREPROCESSOR_FILE = "preprocessor_config.json"


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


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
#: Tokens per text when neither the tokenizer nor the model states a limit.
DEFAULT_MAX_TOKENS = 512
#: Encoder-only classes of encoder-decoder families: ``AutoModel`` would build the decoder too,
#: whose weights a ``T5EncoderModel`` folder lacks.


def is_text_folder(folder: str | os.PathLike[str]) -> bool:
    """A model folder with a tokenizer and no preprocessor (audio and vision folders have one)."""
    path = Path(folder)
    has_tokenizer = any((path / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json"))
    return has_tokenizer and not (path / PREPROCESSOR_FILE).is_file()


def tokenizer_files_digest(folder: str | os.PathLike[str], tokenizer_class: str) -> str:
    """SHA-256 over the tokenizer's class and each of its files present (name and bytes)."""
    path = Path(folder)
    files = {n: sha256_file(path / n) for n in TOKENIZER_FILES if (path / n).is_file()}
    return sha256_hex(canonical_json({"class": tokenizer_class, "files": files}))


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """transformers' tokenizer of ``folder``, offline and quietly.

    Raises:
        EncoderLoadError: transformers is missing or cannot read the folder's tokenizer.
    """
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise EncoderLoadError(
            f"{folder} holds a Hugging Face tokenizer; install transformers: "
            "pip install 'featbake[hf]'"
        ) from e
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than max length": featbake says it
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise EncoderLoadError(
            f"transformers cannot load the tokenizer in {folder}: {first_line(e)}; save it "
            "beside the model (tokenizer.save_pretrained)"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)


def text_recipe_for_folder(folder: str | os.PathLike[str], **changes: Any) -> TextRecipe:
    """The tokenizer of a text folder as a :class:`TextRecipe`, with ``changes`` on top.

    ``max_length`` defaults to the smaller of the tokenizer's ``model_max_length`` and the
    model's ``max_position_embeddings`` (CLIP: 77, BERT: 512), so a long text is cut where the
    model would fail; :data:`DEFAULT_MAX_TOKENS` when neither states one (T5).

    Raises:
        EncoderLoadError: the folder has no tokenizer transformers can read.
        ConfigError: an option out of range.

    Example:
        >>> steps = text_recipe_for_folder("./bert-base", max_length=128)  # doctest: +SKIP
    """
    path = Path(folder).resolve()
    if not is_text_folder(path):
        raise EncoderLoadError(
            f"{folder} has no tokenizer (tokenizer_config.json or tokenizer.json); save one "
            "beside the model with tokenizer.save_pretrained"
        )
    tokenizer = load_tokenizer(path)
    limits = [int(getattr(tokenizer, "model_max_length", 0) or 0)]
    limits.append(int(tower_config(read_config(path)).get("max_position_embeddings", 0) or 0))
    known = [n for n in limits if 0 < n < 1_000_000]  # transformers' "no limit" is 1e30
    steps = TextRecipe(
        tokenizer=tokenizer_files_digest(path, type(tokenizer).__name__),
        max_length=min(known) if known else DEFAULT_MAX_TOKENS,
        folder=str(path),
    )
    return steps.replace(**changes) if changes else steps


#: ``featbake build``'s text options -> the :class:`TextRecipe` field each sets.
TEXT_OPTIONS = {
    "max_tokens": "max_length",
    "truncate": "truncate",
    "lowercase": "lowercase",
    "special_tokens": "special_tokens",
}


def text_steps_for(encoder: object, options: dict[str, Any]) -> TextRecipe | None:
    """The tokenizer with the text options given (by :data:`TEXT_OPTIONS` name; None: not
    given) on top of the encoder folder's; None when none was given (the recipe then takes the
    folder's tokenizer as it is).

    Raises:
        ConfigError: text options without a Hugging Face text folder to tokenize with.
    """
    changes = {TEXT_OPTIONS[k]: v for k, v in options.items() if v is not None}
    if not changes:
        return None
    folder = isinstance(encoder, (str, os.PathLike)) and os.path.isdir(encoder)
    if folder and is_text_folder(encoder):  # type: ignore[arg-type]
        return text_recipe_for_folder(encoder, **changes)  # type: ignore[arg-type]
    raise ConfigError(
        "text options (--max-tokens, --truncate, --lowercase, --special-tokens) need a Hugging "
        f"Face text model folder with its tokenizer as --encoder, not {encoder}"
    )


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EncoderLoadError(f"cannot read {folder}/config.json: {e}") from e
    if not isinstance(config, dict):
        raise EncoderLoadError(f"{folder}/config.json holds a JSON {type(config).__name__}")
    return config
