"""A Hugging Face model folder's files as the recipe reads them, without torch or transformers.

What ``featbake build``'s options and a folder's processor settings or tokenizer make
of the recipe (:func:`image_steps_for`, :func:`text_steps_for`) is read from the folder's JSON
files, so a command refuses a wrong option, or names a missing encoder, before torch is
imported (seconds of CPU); torch reads only a ``pytorch_model.bin``'s dtypes, where a folder
has no safetensors weights. A tokenizer is loaded with transformers only for a text folder's
recipe (:func:`text_recipe_for_folder`). The models themselves are :mod:`featbake.encode.hf`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any

from featbake.errors import ConfigError, EncoderLoadError, first_line
from featbake.image_recipe import ImageRecipe, image_option
from featbake.keys import canonical_json, sha256_file, sha256_hex
from featbake.recipe import TextRecipe

PREPROCESSOR_FILE = "preprocessor_config.json"
#: A whole processor's settings as transformers 5 saves them (``processor.save_pretrained``),
#: each part in a section of its own; transformers reads a part there before
#: :data:`PREPROCESSOR_FILE`.
PROCESSOR_FILE = "processor_config.json"
#: The sections of :data:`PROCESSOR_FILE` an image processor's and an audio feature
#: extractor's settings are read from, in transformers' order.
IMAGE_PARTS = ("image_processor",)
AUDIO_PARTS = ("feature_extractor", "audio_processor")


@dataclass(frozen=True)
class ProcessorSettings:
    """One processor part's settings in a folder, and where they were read (for messages)."""

    values: dict[str, Any]
    where: str


def processor_settings(
    folder: str | os.PathLike[str], parts: tuple[str, ...]
) -> ProcessorSettings | None:
    """A processor part's settings as transformers reads them: the section of
    :data:`PROCESSOR_FILE` named by the first of ``parts`` it holds (a whole processor saved by
    transformers 5), else :data:`PREPROCESSOR_FILE`; None when the folder has neither. Reading
    only the second, a processor saved again with new settings kept serving the old file's.

    Raises:
        EncoderLoadError: a file exists but is not a JSON object (or its section is not one).
    """
    whole_path = Path(folder) / PROCESSOR_FILE
    whole = _settings_file(whole_path)
    for part in parts if whole is not None else ():
        if part in whole:  # type: ignore[operator]
            section = whole[part]  # type: ignore[index]
            where = f"{whole_path} ({part})"
            if not isinstance(section, dict):
                raise EncoderLoadError(
                    f"{where} holds a JSON {type(section).__name__}, not an object of settings; "
                    "save the processor again (processor.save_pretrained)"
                )
            return ProcessorSettings(section, where)
    path = Path(folder) / PREPROCESSOR_FILE
    legacy = _settings_file(path)
    return None if legacy is None else ProcessorSettings(legacy, str(path))


def _settings_file(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when there is no such file.

    Raises:
        EncoderLoadError: it cannot be read, or holds something else than an object.
    """
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EncoderLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise EncoderLoadError(
            f"{path} holds a JSON {type(raw).__name__}, not an object of settings; restore the "
            "file from the model's release"
        )
    return raw


#: A whole image-text model's settings of each tower (CLIP's, SigLIP's).
VISION_TOWER, TEXT_TOWER = "vision_config", "text_config"


def tower_config(config: dict[str, Any], tower: str = VISION_TOWER) -> dict[str, Any]:
    """The settings of the model featbake runs: a whole model's ``tower`` settings (its
    ``vision_config`` for images, its ``text_config`` for texts), else all, with transformers'
    standard names (:func:`standard_names`)."""
    found = config.get(tower)
    whole = isinstance(found, dict) and "num_hidden_layers" not in config
    return standard_names(found if whole else config)  # type: ignore[arg-type]


def standard_names(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each setting its model names its own way also under transformers'
    standard name, as the config's ``attribute_map`` reads it (GPT-2's ``n_positions`` as
    ``max_position_embeddings``, its ``n_layer`` and T5's ``num_layers`` as
    ``num_hidden_layers``): read by their standard names, GPT-2's limit was missed and every
    text past 512 tokens failed at its position table's end.

    Example:
        >>> standard_names({"model_type": "gpt2", "n_positions": 40})["max_position_embeddings"]
        40
    """
    try:
        from transformers import CONFIG_MAPPING

        aliases = dict(getattr(CONFIG_MAPPING[str(config.get("model_type"))], "attribute_map", {}))
    except (ImportError, KeyError):
        return config  # no transformers, or a model type it does not know: names as saved
    named = {std: config[own] for std, own in aliases.items() if own in config}
    return {**named, **config}


def image_processor_config(folder: str | os.PathLike[str]) -> ProcessorSettings | None:
    """The folder's image processor settings (:func:`processor_settings`), or None when it has
    no image processor.

    Raises:
        EncoderLoadError: a settings file exists but is not a JSON object.
    """
    found = processor_settings(folder, IMAGE_PARTS)
    if found is None:
        return None
    is_image = "image_processor_type" in found.values or "image_mean" in found.values
    return found if is_image else None


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
            f"{folder} has no image processor ({PROCESSOR_FILE} or {PREPROCESSOR_FILE} with "
            "image_processor_type); save one beside the model (processor.save_pretrained) or "
            "use --source image with the transform given as options"
        )
    steps = ImageRecipe.from_processor(config.values, where=config.where)
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
            f"image options ({', '.join(image_option(k) for k in sorted(changes))}) apply to image "
            "inputs; add --source image (a Hugging Face vision folder implies it)"
        )
    return ImageRecipe(**changes)


#: The files any tokenizer may be read from in a folder (transformers' ``from_pretrained`` looks
#: for them whatever the class); a class's own vocabulary files come on top
#: (:func:`tokenizer_file_names`).
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
    """A model folder with a tokenizer and no preprocessor (audio and vision folders have one).

    A preprocessor is found where transformers reads it (:func:`processor_settings`): a whole
    processor saved by transformers 5 (``CLIPProcessor``, ``Wav2Vec2Processor``) writes its
    image or audio part into :data:`PROCESSOR_FILE` beside the tokenizer, with no
    :data:`PREPROCESSOR_FILE`; looking for the latter alone took such a CLIP folder for a text
    model and refused its images. A sentence-transformers folder's tokenizer is looked for
    beside its transformer (:func:`transformer_folder`: ``0_Transformer/`` in the older layout).

    Raises:
        EncoderLoadError: a processor settings file exists but is not a JSON object.
    """
    path = transformer_folder(folder)
    has_tokenizer = any((path / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json"))
    return has_tokenizer and processor_settings(path, IMAGE_PARTS + AUDIO_PARTS) is None


def tokenizer_file_names(tokenizer: Any) -> list[str]:
    """The files ``tokenizer``'s class is read from in a folder, as transformers resolves them:
    :data:`TOKENIZER_FILES` and the class's ``vocab_files_names`` (BERTweet's ``bpe.codes``,
    DeBERTa's ``spm.model``, ProphetNet's ``prophetnet.tokenizer``). The fixed list alone left
    such a file out of the key: edited, it kept the key, and the store served the old tokens'
    features. Other files of the folder (a README, the weights) are not read by the tokenizer,
    so editing them does not re-key its texts."""
    return sorted(vocabulary_file_names(tokenizer).union(TOKENIZER_FILES))


def vocabulary_file_names(tokenizer: Any) -> set[str]:
    """The files ``tokenizer``'s class reads its vocabulary from (its ``vocab_files_names``:
    ``vocab.txt``, ``spiece.model``, BERTweet's ``bpe.codes``), plain names only."""
    own = getattr(tokenizer, "vocab_files_names", None) or {}
    return {n for n in own.values() if isinstance(n, str) and n == Path(n).name}


#: The libraries whose code tokenises with any Hugging Face tokenizer: transformers' classes
#: and tokenizers' fast backend (which most of them run).
TOKENIZER_LIBRARIES = ("transformers", "tokenizers")


def tokenizer_libraries(tokenizer: Any) -> dict[str, str]:
    """The libraries whose code makes ``tokenizer``'s ids, each with its version
    (:func:`featbake.encode.identity.library_versions`): :data:`TOKENIZER_LIBRARIES` and those
    its class's module imports (BERTweet's ``emoji``, BioGPT's ``sacremoses``), "absent" where
    one cannot be imported. BERTweet turns emoji into words only when ``emoji`` is importable,
    and a key without it served a store built without ``emoji`` where it was installed.

    This is the rule an import-path encoder's libraries are keyed by, with its price: an
    upgrade of transformers or tokenizers (or installing an optional library a tokenizer
    uses) re-keys the texts, and they are encoded again, as features of other code may be.
    """
    # transformers imported torch when the tokenizer was loaded: identity's import costs nothing
    from featbake.encode.identity import imported_libraries, library_versions

    return library_versions({*TOKENIZER_LIBRARIES, *imported_libraries(type(tokenizer))})


def tokenizer_digest(folder: str | os.PathLike[str], tokenizer: Any) -> str:
    """SHA-256 over ``tokenizer``'s class, each of its files present in ``folder`` (name and
    bytes; :func:`tokenizer_file_names`), the libraries it runs (:func:`tokenizer_libraries`)
    and, for a :class:`PromptedTokenizer`, the prompt it prepends and how sentence-transformers
    loads it (its ``processor_kwargs``, its lowercasing), each only where set (a tokenizer
    without them keeps the digest it had)."""
    path = transformer_folder(folder)
    own = tokenizer.tokenizer if isinstance(tokenizer, PromptedTokenizer) else tokenizer
    names = tokenizer_file_names(own)
    files = {n: sha256_file(path / n) for n in names if (path / n).is_file()}
    libraries = tokenizer_libraries(own)
    read = {"class": type(own).__name__, "files": files, "libs": libraries}
    if isinstance(tokenizer, PromptedTokenizer):
        if tokenizer.prompt:
            read["prompt"] = tokenizer.prompt
        if tokenizer.loading:
            read["loading"] = tokenizer.loading
    return sha256_hex(canonical_json(read))


class PromptedTokenizer:
    """A sentence-transformers folder's tokenizer as ``SentenceTransformer`` loads and calls
    it: loaded with the folder's ``processor_kwargs`` and lowercasing in its normaliser where
    the folder says ``do_lower_case`` (:func:`load_tokenizer`), and putting its default prompt
    before each text (``prompt + text``, then one call of the tokenizer, so the prompt's tokens
    count towards ``max_length``). Anything else is the tokenizer's own.

    Attributes:
        tokenizer: transformers' tokenizer of the folder, loaded so.
        prompt: the text put before each text ("": none).
        loading: how it was loaded, for its digest: ``processor_kwargs`` and ``do_lower_case``,
            each only where the folder sets it.
    """

    def __init__(self, tokenizer: Any, prompt: str, loading: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.loading = loading or {}

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return self.tokenizer(self.prompt + text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("tokenizer", "prompt", "loading"):  # not set yet (unpickling): not the inner's
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """transformers' tokenizer of ``folder``, offline and quietly; a sentence-transformers
    folder's is read beside its transformer (:func:`transformer_folder`) as
    ``SentenceTransformer`` loads it: with the ``processor_kwargs`` of its settings
    (:func:`loading_arguments`), lowercasing in its normaliser where they say ``do_lower_case``
    (:func:`lowercase_as_sentence_transformers`), and its default prompt put before each text
    (a :class:`PromptedTokenizer`: :func:`prompt_before_texts`).

    Raises:
        EncoderLoadError: transformers is missing or cannot read the folder's tokenizer.
    """
    loading = loading_arguments(folder)
    tokenizer = folder_tokenizer(transformer_folder(folder), **loading.processor)
    read: dict[str, Any] = {"processor_kwargs": loading.processor} if loading.processor else {}
    if loading.do_lower_case:
        lowercase_as_sentence_transformers(tokenizer)
        read["do_lower_case"] = True
    prompt = prompt_before_texts(folder)
    return PromptedTokenizer(tokenizer, prompt, read) if prompt or read else tokenizer


def lowercase_as_sentence_transformers(tokenizer: Any) -> None:
    """Make ``tokenizer`` lowercase each text as sentence-transformers' ``do_lower_case`` does:
    a fast tokenizer gets tokenizers' ``Lowercase`` before its normaliser (none where it holds
    one), so special tokens are split off first and each character is lowercased alone; a slow
    one its ``do_lower_case``. ``str.lower`` before the tokenizer was another text: "[MASK]"
    became "[mask]", no special token, and a word-final capital sigma another letter (its
    final form) than the tokenizer makes of it."""
    if not getattr(tokenizer, "is_fast", False):
        try:
            tokenizer.do_lower_case = True
        except AttributeError:
            tokenizer.basic_tokenizer.do_lower_case = True
        return
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence

    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    sequence = isinstance(normalizer, NormalizerSequence)  # iterable, as typed it is not
    steps = list(normalizer) if sequence else [normalizer]
    if any(isinstance(n, Lowercase) for n in steps):
        return
    backend.normalizer = NormalizerSequence([Lowercase(), *(n for n in steps if n is not None)])


def folder_tokenizer(folder: Path, **kwargs: Any) -> Any:
    """transformers' tokenizer of the folder holding it, offline and quietly; ``kwargs`` are
    ``from_pretrained``'s (a sentence-transformers folder's ``processor_kwargs``).

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
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), **kwargs, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:
        raise EncoderLoadError(
            f"transformers cannot load the tokenizer in {folder}: {first_line(e)}; save it "
            "beside the model (tokenizer.save_pretrained)"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)
    refuse_an_empty_vocabulary(tokenizer, folder)
    return tokenizer


def refuse_an_empty_vocabulary(tokenizer: Any, folder: str | os.PathLike[str]) -> None:
    """Refuse a tokenizer that holds nothing but its special tokens: transformers builds one
    from ``tokenizer_config.json`` alone where the vocabulary file (``tokenizer.json``,
    ``vocab.txt``, ``vocab.json``, a ``.model``) is missing, without a word, and every text
    then tokenised to ``[CLS] [UNK] ... [SEP]`` and was stored.

    Raises:
        EncoderLoadError: one line naming the folder and what to save beside the model.
    """
    names = sorted(vocabulary_file_names(tokenizer))
    # tokenizer.json holds a whole vocabulary whatever the class names (transformers 5 saves a
    # GPT-2 tokenizer as tokenizer.json alone, its class naming vocab.json and merges.txt).
    held = [*names, "tokenizer.json"]
    if names and not any((Path(folder) / n).is_file() for n in held):
        raise EncoderLoadError(
            f"the tokenizer in {folder} ({type(tokenizer).__name__}) has none of its "
            f"vocabulary files ({', '.join(names)}): transformers built it of its special "
            "tokens alone; save the tokenizer beside the model again (tokenizer.save_pretrained)"
        )
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    try:
        words = [t for t in tokenizer.get_vocab() if t not in specials]
    except (AttributeError, NotImplementedError):
        return  # a tokenizer that cannot list its vocabulary: taken as it is
    if not words:
        raise EncoderLoadError(
            f"the tokenizer in {folder} holds only its {len(specials)} special tokens: its "
            "vocabulary file (tokenizer.json, vocab.txt, vocab.json or a .model) is missing; "
            "save the tokenizer beside the model again (tokenizer.save_pretrained)"
        )


def text_recipe_for_folder(folder: str | os.PathLike[str], **changes: Any) -> TextRecipe:
    """The tokenizer of a text folder as a :class:`TextRecipe`, with ``changes`` on top.

    ``max_length`` defaults to the smaller of the tokenizer's ``model_max_length`` and the
    model's ``max_position_embeddings`` (CLIP: 77, BERT: 512), so a long text is cut where the
    model would fail; :data:`DEFAULT_MAX_TOKENS` when neither states one (T5). A
    sentence-transformers folder's ``max_seq_length`` stands for the tokenizer's limit (unless
    its ``processor_kwargs`` set ``model_max_length``), its ``config_kwargs`` override the
    model's settings, and its ``do_lower_case`` is the tokenizer's own lowercasing (not
    ``lowercase``, which lowercases in Python first), as ``SentenceTransformer.encode``
    tokenises (:func:`sentence_pipeline`); its default prompt is put before each text by the
    tokenizer, and both are in its digest (:class:`PromptedTokenizer`).

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
    overrides = loading_arguments(path).config
    config = tower_config({**read_config(transformer_folder(path)), **overrides}, TEXT_TOWER)
    positions = token_positions(config)
    sentence = sentence_pipeline(path) or SentencePipeline()
    stated = sentence.max_seq_length or int(getattr(tokenizer, "model_max_length", 0) or 0)
    known = [n for n in (stated, positions) if 0 < n < 1_000_000]  # "no limit" is 1e30
    steps = TextRecipe(
        tokenizer=tokenizer_digest(path, tokenizer),
        max_length=min(known) if known else DEFAULT_MAX_TOKENS,
        folder=str(path),
    )
    asked = changes.get("max_length")
    if isinstance(asked, int) and 0 < positions < asked and absolute_positions(config):
        raise ConfigError(
            f"--max-tokens {asked} is past the {positions} tokens the model in {folder} has "
            f"positions for; give at most {positions}"
        )
    return steps.replace(**changes) if changes else steps


#: Model types whose position ids start past the padding id (RoBERTa's
#: ``create_position_ids_from_input_ids``: ``padding_idx + 1`` onwards), so their table's
#: first ``pad_token_id + 1`` rows are no token's.
PADDING_OFFSET_POSITIONS = frozenset(
    {
        "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "longformer",
        "data2vec-text", "esm", "ibert", "roberta-prelayernorm", "markuplm", "luke", "xmod",
    }
)  # fmt: skip


def absolute_positions(config: Mapping[str, Any]) -> bool:
    """Whether the model has a table of positions whose end no text may pass (BERT's,
    RoBERTa's, CLIP's; BERT's ``relative_key`` too, whose distance table is sized by it and
    whose transformers 5 embeddings add the absolute one still): not a rotary scheme (ESM-2),
    nor DeBERTa's relative attention without position-biased input, which run any length
    (``max_position_embeddings`` only sizes their buckets).

    Example:
        >>> absolute_positions({"model_type": "bert"}), absolute_positions(
        ...     {"model_type": "deberta-v2", "relative_attention": True,
        ...      "position_biased_input": False})
        (True, False)
    """
    if config.get("position_embedding_type") == "rotary":
        return False  # ESM-2's: no table (BERT's relative_key still adds its absolute one)
    return not (config.get("relative_attention") and not config.get("position_biased_input", True))


def token_positions(config: Mapping[str, Any]) -> int:
    """How many tokens the model's position table holds (0: it states none):
    ``max_position_embeddings``, less ``pad_token_id + 1`` for a model whose positions start
    past the padding id (RoBERTa's 514 rows hold 512 tokens; taken whole, every text of 513
    tokens or more failed at the table's end instead of being cut).

    Example:
        >>> token_positions({"model_type": "roberta", "max_position_embeddings": 514,
        ...                  "pad_token_id": 1}), token_positions({"max_position_embeddings": 512})
        (512, 512)
    """
    rows = int(config.get("max_position_embeddings", 0) or 0)
    if rows <= 0 or config.get("model_type") not in PADDING_OFFSET_POSITIONS:
        return rows
    return max(0, rows - int(config.get("pad_token_id", 1) or 0) - 1)


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


# == sentence-transformers folders =================================================================
# What ``SentenceTransformer.save(folder)`` writes beside the transformer's own files:
# ``modules.json`` names the modules run in turn (the transformer, a pooling, dense layers, a
# normalisation), each in its folder (``1_Pooling/config.json``, ``2_Dense/config.json`` and its
# weights), ``sentence_bert_config.json`` the transformer's settings (``max_seq_length``,
# ``do_lower_case`` as older releases write them) and ``config_sentence_transformers.json`` the
# model's (its prompts, the default one, ``truncate_dim``). Older releases saved the
# transformer in a subfolder (``0_Transformer/``, named by its ``path`` in ``modules.json``), its
# settings file with it; later ones at the folder's top. featbake reads them as
# sentence-transformers does, so ``sentence_embedding`` is what ``SentenceTransformer.encode``
# returns.
ST_MODULES_FILE = "modules.json"
#: The transformer's settings file, and the names older releases gave it, in the order
#: sentence-transformers looks for them.
ST_CONFIG_FILES = (
    "sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
    "sentence_camembert_config.json", "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json",
)  # fmt: skip
ST_MODEL_FILE = "config_sentence_transformers.json"
#: The modules featbake runs, by class name (``modules.json`` spells them
#: ``sentence_transformers.models.Pooling`` or ``sentence_transformers.<package>.pooling.Pooling``).
ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
#: The ``pooling_mode_*`` flags of a pooling config, in the order sentence-transformers
#: concatenates the modes they turn on.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = frozenset(POOLING_FLAGS.values())
#: Transformer settings whose other values change what the sentence embedding is made of (a
#: task head, another output, tokenizer arguments), with the value featbake reproduces.
ST_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "transformer_task": "feature-extraction",
    "module_output_name": "token_embeddings",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "processing_kwargs": {},
}
#: The embedding the pooling, dense and normalising modules read and write.
ST_EMBEDDING_KEY = "sentence_embedding"
#: The loading arguments a transformer's settings may carry (sentence-transformers passes them
#: to transformers' ``from_pretrained`` of the model, the tokenizer and the config), each with
#: the older name it reads as it (the older one wins where a file holds both, as there).
ST_LOADING_KWARGS = {
    "model_kwargs": "model_args",
    "processor_kwargs": "tokenizer_args",
    "config_kwargs": "config_args",
}
#: Loading arguments sentence-transformers sets itself on each load, over a file's values.
ST_HUB_KWARGS = frozenset(
    {"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"}
)
#: ``model_kwargs`` featbake passes on to transformers as sentence-transformers does.
ST_PASSED_MODEL_KWARGS = frozenset({"attn_implementation", "add_pooling_layer"})
#: ``model_kwargs`` that place the model or its weights, which change no value computed.
ST_PLACEMENT_KWARGS = frozenset(
    {"device_map", "low_cpu_mem_usage", "max_memory", "offload_folder", "offload_buffers"}
)
#: The attention implementations featbake runs as asked (others, such as flash attention,
#: make sentence-transformers run unpadded texts: another computation).
ST_ATTENTION = ("eager", "sdpa")
#: The names of the dtype float32 a setting may hold (None: torch's default, float32).
FLOAT32_NAMES = (None, "float32", "torch.float32")


class SentenceModuleUnsupported(ConfigError):
    """A sentence-transformers folder holds a module or setting featbake does not reproduce, so
    it gives no ``sentence_embedding`` (its tokens still build)."""


@dataclass(frozen=True)
class DenseLayer:
    """A ``Dense`` module: ``activation(linear(x))`` (plus ``x``, projected if its size
    differs, with ``residual``).

    Attributes:
        folder: the module's folder in the model folder (its config and weights).
        activation: the dotted name of a torch activation class (``torch.nn.Tanh``'s own).
    """

    folder: str
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "torch.nn.modules.activation.Tanh"
    residual: bool = False


@dataclass(frozen=True)
class Normalizing:
    """A ``Normalize`` module: the embedding divided by its L2 norm."""


@dataclass(frozen=True)
class SentencePipeline:
    """What a sentence-transformers folder computes after its transformer, and its settings.

    Attributes:
        pooling: the pooling modes, in the order their vectors are concatenated.
        after: the dense layers and normalisation applied to the pooled vector, in turn.
        max_seq_length: tokens per text sentence-transformers keeps (None: the tokenizer's).
        do_lower_case: sentence-transformers lowercases each text, in its tokenizer's
            normaliser (:func:`lowercase_as_sentence_transformers`).
        prompt: the default prompt put before each text, as the tokenizer is given it ("": none).
        include_prompt: the pooling reads the prompt's tokens too (``include_prompt`` of the
            pooling config); False leaves them out.
        truncate_dim: ``encode`` keeps the embedding's first so many values (None: all).
        refused: why featbake gives no ``sentence_embedding`` for the folder (one line), or None.
    """

    pooling: tuple[str, ...] = ("mean",)
    after: tuple[DenseLayer | Normalizing, ...] = ()
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompt: str = ""
    include_prompt: bool = True
    truncate_dim: int | None = None
    refused: str | None = None


@dataclass(frozen=True)
class LoadingArguments:
    """How sentence-transformers loads a folder's transformer, as featbake loads it too (the
    arguments featbake does not reproduce refuse its ``sentence_embedding``:
    :func:`sentence_pipeline`).

    Attributes:
        model: ``model_kwargs`` passed to the model's ``from_pretrained``
            (:data:`ST_PASSED_MODEL_KWARGS`).
        processor: ``processor_kwargs``, the tokenizer's ``from_pretrained`` arguments.
        config: ``config_kwargs``, values over the model's ``config.json``.
        do_lower_case: the tokenizer lowercases each text (the settings' ``do_lower_case``).
    """

    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    processor: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    do_lower_case: bool = False


@dataclass(frozen=True)
class ModelSettings:
    """What ``config_sentence_transformers.json`` sets that ``encode`` applies by default.

    Attributes:
        prompt: the default prompt (``prompts[default_prompt_name]``), "" where none is named.
        truncate_dim: the embedding's first so many values are kept (None: all).
    """

    prompt: str = ""
    truncate_dim: int | None = None


def is_sentence_folder(folder: str | os.PathLike[str]) -> bool:
    """A folder ``SentenceTransformer.save`` wrote (it holds ``modules.json``)."""
    return (Path(folder) / ST_MODULES_FILE).is_file()


def sentence_pipeline(folder: str | os.PathLike[str]) -> SentencePipeline | None:
    """The folder's sentence-transformers modules and settings, None for another folder.

    Never raises for what it cannot reproduce (an unknown module, a prompt naming none of the
    prompts, a broken file): the reason is the pipeline's ``refused``, so the folder still gives
    its tokens.
    """
    path = Path(folder)
    if not is_sentence_folder(path):
        return None
    settings = SentencePipeline()
    try:
        config, where = _transformer_config(transformer_folder(path))
        settings = _transformer_settings(config, where)
        _refuse_other_transformer_settings(config, where)
        _refuse_other_loading(transformer_folder(path), config, where)
        model = model_settings(path)
        settings = dataclasses.replace(
            settings, prompt=model.prompt, truncate_dim=model.truncate_dim
        )
        return _modules_after_transformer(path, settings)
    except (ConfigError, EncoderLoadError) as e:
        return dataclasses.replace(settings, refused=first_line(e))


def prompt_before_texts(folder: str | os.PathLike[str]) -> str:
    """The default prompt ``SentenceTransformer.encode`` puts before each text of a
    sentence-transformers folder, as it is (where the folder lowercases, its tokenizer
    lowercases prompt and text alike: :func:`load_tokenizer`); "" for another folder, one
    naming no default prompt, or one whose settings sentence-transformers would not load (its
    ``sentence_embedding`` is refused, :func:`sentence_pipeline`)."""
    path = Path(folder)
    if not is_sentence_folder(path):
        return ""
    try:
        return model_settings(path).prompt
    except (ConfigError, EncoderLoadError):
        return ""


def loading_arguments(folder: str | os.PathLike[str]) -> LoadingArguments:
    """How sentence-transformers loads the transformer of a sentence-transformers folder, as
    far as featbake reproduces it (:class:`LoadingArguments`); none for another folder, or
    where its settings cannot be read (its ``sentence_embedding`` is then refused). Never
    raises."""
    path = Path(folder)
    if not is_sentence_folder(path):
        return LoadingArguments()
    try:
        config, where = _transformer_config(transformer_folder(path))
        found = _loading_kwargs(config, where)
    except (ConfigError, EncoderLoadError):
        return LoadingArguments()
    model = {k: v for k, v in found["model_kwargs"].items() if k in ST_PASSED_MODEL_KWARGS}
    if model.get("attn_implementation", ST_ATTENTION[0]) not in ST_ATTENTION:
        del model["attn_implementation"]  # refused: the model runs as featbake's default
    return LoadingArguments(
        model=model,
        processor=found["processor_kwargs"],
        config=found["config_kwargs"],
        do_lower_case=bool(config.get("do_lower_case")),  # any true value, as there
    )


def _loading_kwargs(config: Mapping[str, Any], where: Path) -> dict[str, dict[str, Any]]:
    """The settings' ``model_kwargs``, ``processor_kwargs`` and ``config_kwargs`` as
    sentence-transformers reads them: the older names (``model_args`` ...) taken for the new
    ones, the hub's arguments (:data:`ST_HUB_KWARGS`, which it sets itself) left out; {} where
    one is not set.

    Raises:
        SentenceModuleUnsupported: one is no JSON object (sentence-transformers fails on it).
    """
    found: dict[str, dict[str, Any]] = {}
    for name, older in ST_LOADING_KWARGS.items():
        said = older if older in config else name
        value = config.get(said)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise SentenceModuleUnsupported(
                f"{where}: {said} must be an object of arguments, got {value!r}; fix the file, "
                "or ask for --output tokens"
            )
        found[name] = {k: v for k, v in value.items() if k not in ST_HUB_KWARGS}
    return found


def _refuse_other_loading(folder: Path, config: Mapping[str, Any], where: Path) -> None:
    """Raise where the transformer's settings load it otherwise than featbake can: a
    ``model_kwargs`` argument featbake does not pass on (quantisation, kernels, another
    class's arguments), an attention implementation other than :data:`ST_ATTENTION`, a
    ``padding_side`` other than right (featbake pads on the right), or a dtype other than
    float32 (:func:`sentence_transformers_dtype`: featbake runs the model in float32).

    Raises:
        SentenceModuleUnsupported: one line naming the file, the argument and what to do.
    """
    found = _loading_kwargs(config, where)
    model, processor = found["model_kwargs"], found["processor_kwargs"]
    known = ST_PASSED_MODEL_KWARGS | ST_PLACEMENT_KWARGS | {"dtype", "torch_dtype"}
    for key in model:
        if key not in known:
            raise SentenceModuleUnsupported(
                f"{where} passes {key}={model[key]!r} in model_kwargs, which featbake does not "
                f"reproduce for {ST_EMBEDDING_KEY!r}; remove it there, or ask for --output tokens"
            )
    attention = model.get("attn_implementation", ST_ATTENTION[0])
    if attention not in ST_ATTENTION:
        raise SentenceModuleUnsupported(
            f"{where} asks for attn_implementation {attention!r} in model_kwargs; featbake runs "
            f"{' or '.join(ST_ATTENTION)} only: set one there, or ask for --output tokens"
        )
    if processor.get("padding_side", "right") != "right":
        raise SentenceModuleUnsupported(
            f"{where} pads on the {processor['padding_side']!r} in processor_kwargs, where "
            f"featbake pads on the right (positions differ); remove padding_side there, or ask "
            "for --output tokens"
        )
    dtype, said = sentence_transformers_dtype(folder, found)
    if dtype not in FLOAT32_NAMES:
        raise SentenceModuleUnsupported(
            f"sentence-transformers loads the model in {folder} in {dtype} ({said}), featbake "
            f'runs it in float32; set "model_kwargs": {{"dtype": "float32"}} in {where} '
            "to encode it in float32 with both, or ask for --output tokens"
        )


def sentence_transformers_dtype(
    folder: Path, found: Mapping[str, Mapping[str, Any]]
) -> tuple[str | None, str]:
    """The dtype sentence-transformers loads the transformer in ``folder`` in (None: float32,
    torch's default), and where it is said: ``model_kwargs``' ``dtype`` (or ``torch_dtype``);
    where there is none or it is "auto" under transformers 5 (whose default "auto" is), the
    config's (``config_kwargs`` over ``config.json``), else the weights' own
    (:func:`weights_dtype`). A folder of bfloat16 weights, or whose config.json says float16,
    is encoded in that dtype by sentence-transformers, not in featbake's float32."""
    model, overrides = found.get("model_kwargs", {}), found.get("config_kwargs", {})
    asked = model.get("dtype") if model.get("dtype") is not None else model.get("torch_dtype")
    if asked != "auto" and (asked is not None or not _transformers_loads_auto()):
        return _dtype_name(asked), "model_kwargs"
    for source, values in (("config_kwargs", overrides), ("config.json", _config_or_none(folder))):
        for key in ("dtype", "torch_dtype"):
            if values.get(key) not in (None, "auto"):
                return _dtype_name(values[key]), source
    return weights_dtype(folder), "its weights"


def _dtype_name(value: Any) -> str | None:
    """A dtype setting as torch names it ("float16" for "torch.float16")."""
    return None if value is None else str(value).removeprefix("torch.")


def _config_or_none(folder: Path) -> dict[str, Any]:
    """The folder's config.json ({} where it cannot be read: the model's load says why)."""
    try:
        return read_config(folder)
    except EncoderLoadError:
        return {}


def _transformers_loads_auto() -> bool:
    """Whether the installed transformers loads a model in its saved dtype by default (5 and
    later: ``dtype="auto"``); before, in float32. Unknown: taken as it does."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0]) >= 5
    except (PackageNotFoundError, ValueError):
        return True


#: safetensors' names of floating dtypes, as torch names them.
SAFETENSORS_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def weights_dtype(folder: Path) -> str | None:
    """The dtype transformers' "auto" takes from a folder's weights, by its rule: a sharded
    folder's index's stated ``metadata.dtype``, else (``get_state_dict_dtype``) the first
    floating tensor's (float8 passed over) of the first weights file it reads
    (:func:`first_weights_file`), in that file's order (safetensors lists its tensors by name;
    a ``pytorch_model.bin`` in its saved order, read on the meta device: no weight is read);
    None where that is float32 or none can be read. A float32 file holding some float16
    tensors loads in float32, whichever file holds it."""
    found = first_weights_file(folder)
    if found is None:
        return None
    kind = found.stated
    if kind is None:
        safetensors = found.path.suffix == ".safetensors"
        kind = (_safetensors_first_float if safetensors else _pickled_first_float)(found.path)
    return None if kind in (None, "float32") else kind


@dataclass(frozen=True)
class WeightsFile:
    """The weights file transformers reads a folder's dtype from, and the dtype its index
    states (a sharded folder's ``metadata.dtype``; None where it states none)."""

    path: Path
    stated: str | None = None


#: The weights files transformers looks for, in its order: each single file before its index.
WEIGHTS_FILES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


def first_weights_file(folder: Path) -> WeightsFile | None:
    """The weights file transformers reads a dtype from, as it picks one: ``model.safetensors``,
    else the first (by name) of the files ``model.safetensors.index.json`` names, else the same
    for ``pytorch_model.bin``; None where there is none."""
    for single, index in WEIGHTS_FILES:
        if (folder / single).is_file():
            return WeightsFile(folder / single)
        try:
            raw = json.loads((folder / index).read_text())
            names = sorted({str(n) for n in raw["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if names and (folder / names[0]).is_file():
            meta = raw.get("metadata")
            stated = meta.get("dtype") if isinstance(meta, dict) else None
            return WeightsFile(folder / names[0], _dtype_name(stated))
    return None


def _safetensors_first_float(path: Path) -> str | None:
    """The dtype of the first floating tensor (by name, as safetensors lists them) in a
    safetensors file's header; None where it has none or cannot be read."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else {}
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        if isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_FLOATS:
            return SAFETENSORS_FLOATS[entry["dtype"]]
    return None


def _pickled_first_float(path: Path) -> str | None:
    """The dtype of the first floating tensor of a ``pytorch_model.bin`` file, loaded as
    transformers loads it for that (``weights_only``, on the meta device); None where there
    is none or it cannot be read (the model's load says why)."""
    import torch  # only where a folder has no safetensors weights

    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except Exception:  # an unreadable file is the model's load to report
        return None
    tensors = state.values() if isinstance(state, dict) else ()
    found = next(
        (
            t
            for t in tensors
            if isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and not str(t.dtype).startswith(("torch.float8_", "torch.float4_"))
        ),
        None,
    )
    return None if found is None else str(found.dtype).removeprefix("torch.")


def _transformer_config(folder: Path) -> tuple[dict[str, Any], Path]:
    """The transformer's settings file ({} where it has none) and its path (for messages)."""
    found = next((folder / n for n in ST_CONFIG_FILES if (folder / n).is_file()), None)
    if found is None:
        return {}, folder / ST_CONFIG_FILES[0]
    return _settings_file(found) or {}, found


def _transformer_settings(config: Mapping[str, Any], where: Path) -> SentencePipeline:
    """``max_seq_length`` and ``do_lower_case`` of the transformer's settings (older releases
    write them; newer ones keep the length in the tokenizer's ``model_max_length``). Where its
    ``processor_kwargs`` set ``model_max_length``, sentence-transformers leaves
    ``max_seq_length`` out: the tokenizer's (loaded with it) is the length.

    Raises:
        SentenceModuleUnsupported: ``max_seq_length`` is not a whole number.
    """
    length = config.get("max_seq_length")
    try:
        processor = _loading_kwargs(config, where)["processor_kwargs"]
    except SentenceModuleUnsupported:
        processor = {}  # refused, with its reason (sentence_pipeline)
    if "model_max_length" in processor:
        length = None
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise SentenceModuleUnsupported(
            f"{where}: max_seq_length must be a whole number of tokens, got {length!r}"
        )
    return SentencePipeline(max_seq_length=length, do_lower_case=bool(config.get("do_lower_case")))


def _refuse_other_transformer_settings(config: Mapping[str, Any], where: Path) -> None:
    """Raise where a setting of :data:`ST_TRANSFORMER_DEFAULTS` has another value.

    Raises:
        SentenceModuleUnsupported: one line naming the file and the setting.
    """
    for key, default in ST_TRANSFORMER_DEFAULTS.items():
        if config.get(key, default) not in (default, None):
            raise SentenceModuleUnsupported(
                f"{where} sets {key} to {config[key]!r}, which featbake does not reproduce for "
                f"{ST_EMBEDDING_KEY!r}; ask for --output tokens"
            )


#: The prompts a SentenceTransformer holds before its saved ones are read (empty: no prompt).
ST_BUILT_IN_PROMPTS = {"query": "", "document": ""}


def model_settings(folder: Path) -> ModelSettings:
    """The default prompt and ``truncate_dim`` ``encode`` applies, read as sentence-transformers
    reads ``config_sentence_transformers.json``: the saved prompts on top of its own ``query``
    and ``document`` (a prompt of null is ""), the default prompt the one its name picks.

    Raises:
        SentenceModuleUnsupported: the folder is no sentence embedder (a sparse encoder, a
            cross-encoder), its default prompt names none of its prompts (sentence-transformers
            refuses to load it), a prompt is no text, or ``truncate_dim`` no whole number >= 1.
    """
    where = folder / ST_MODEL_FILE
    model = _settings_file(where) or {}
    kind = model.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise SentenceModuleUnsupported(
            f"{folder} is a sentence-transformers {kind}, not a SentenceTransformer; ask for "
            "--output tokens"
        )
    return ModelSettings(
        prompt=_default_prompt(model, where), truncate_dim=_truncate_dim(model, where)
    )


def _default_prompt(model: Mapping[str, Any], where: Path) -> str:
    """The prompt ``default_prompt_name`` names among the folder's prompts ("" for none).

    Raises:
        SentenceModuleUnsupported: it names no prompt there, or the prompt is no text.
    """
    saved = model.get("prompts") or {}
    if not isinstance(saved, dict):
        raise SentenceModuleUnsupported(
            f"{where}: prompts must be an object of names and texts, got {saved!r}; ask for "
            "--output tokens"
        )
    prompts = {**ST_BUILT_IN_PROMPTS, **{k: "" if v is None else v for k, v in saved.items()}}
    name = model.get("default_prompt_name")
    if name is None:
        return ""
    if name not in prompts:
        raise SentenceModuleUnsupported(
            f"{where} names the default prompt {name!r}, which is none of its prompts "
            f"({', '.join(map(repr, prompts))}); sentence-transformers does not load it: fix "
            "default_prompt_name"
        )
    prompt = prompts[name]
    if not isinstance(prompt, str):
        raise SentenceModuleUnsupported(
            f"{where}: the prompt {name!r} must be text, got {prompt!r}; fix the file"
        )
    return prompt


def _truncate_dim(model: Mapping[str, Any], where: Path) -> int | None:
    """``truncate_dim`` of the folder's settings (None where unset).

    Raises:
        SentenceModuleUnsupported: it is no whole number >= 1.
    """
    dim = model.get("truncate_dim")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
        raise SentenceModuleUnsupported(
            f"{where}: truncate_dim must be a whole number of values >= 1, got {dim!r}; fix "
            "the file"
        )
    return dim


def st_modules(folder: Path) -> list[dict[str, Any]]:
    """``modules.json``'s entries (each with ``type`` and ``path``), in the order they run.

    Raises:
        EncoderLoadError: the file cannot be read or is not a list of such entries.
    """
    where = folder / ST_MODULES_FILE
    try:
        entries = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise EncoderLoadError(f"cannot read {where}: {e}") from e
    good = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("type"), str) for e in entries
    )
    if not good or not entries:
        raise EncoderLoadError(
            f"{where} is not a list of modules with their type; save the model again "
            "(SentenceTransformer.save)"
        )
    return entries


def st_module_name(entry: Mapping[str, Any]) -> str | None:
    """The module's class name where featbake runs it (:data:`ST_MODULES`), else None."""
    kind = str(entry["type"])
    name = kind.rsplit(".", 1)[-1]
    return name if kind.startswith("sentence_transformers.") and name in ST_MODULES else None


def transformer_subfolder(folder: str | os.PathLike[str]) -> str | None:
    """The subfolder of a sentence-transformers folder its transformer is saved in
    (``0_Transformer``, as older releases wrote it), None where it is at the top or the
    folder is no such folder. A path sentence-transformers refuses (absolute, or with ``..``)
    is none either: the folder is then read as any other."""
    path = Path(folder)
    if not is_sentence_folder(path):
        return None
    try:
        first = st_modules(path)[0]
    except EncoderLoadError:
        return None
    sub = first.get("path")
    if st_module_name(first) != "Transformer" or not isinstance(sub, str):
        return None
    parts = PureWindowsPath(sub)
    if parts.anchor or ".." in parts.parts:
        return None
    return None if Path(sub) == Path(".") else Path(sub).as_posix()


def transformer_folder(folder: str | os.PathLike[str]) -> Path:
    """Where a model folder's transformer (its config, weights and tokenizer) is read: the
    subfolder a sentence-transformers folder of the older layout names
    (:func:`transformer_subfolder`), else the folder itself."""
    sub = transformer_subfolder(folder)
    return Path(folder) if sub is None else Path(folder) / sub


def _modules_after_transformer(folder: Path, settings: SentencePipeline) -> SentencePipeline:
    """``settings`` with the pooling, dense and normalising modules ``modules.json`` lists.

    Raises:
        SentenceModuleUnsupported: a module featbake does not run, or not in the order it runs
            them (the transformer, one pooling, then dense and normalise).
    """
    entries = st_modules(folder)
    names = [st_module_name(e) for e in entries]
    for entry, name in zip(entries, names, strict=True):
        if name is None:
            raise SentenceModuleUnsupported(
                f"{folder / ST_MODULES_FILE} lists the module {entry['type']}, which featbake "
                f"does not run, so it gives no {ST_EMBEDDING_KEY!r}; ask for --output tokens"
            )
    after_pooling = all(n in ("Dense", "Normalize") for n in names[2:])
    if names[:2] != ["Transformer", "Pooling"] or not after_pooling:
        raise SentenceModuleUnsupported(
            f"{folder / ST_MODULES_FILE} runs {' -> '.join(map(str, names))}; featbake computes "
            f"{ST_EMBEDDING_KEY!r} for a transformer, one pooling, then dense and normalise "
            "modules; ask for --output tokens"
        )
    pooling_config = _module_config(folder, entries[1])
    pooling = pooling_modes(pooling_config)
    include_prompt = pooling_config.get("include_prompt", True) is not False
    after = tuple(_after_pooling(folder, e) for e in entries[2:])
    return dataclasses.replace(
        settings, pooling=pooling, include_prompt=include_prompt, after=after
    )


def _module_config(folder: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` in a module's folder ({} where it has none)."""
    return _settings_file(folder / str(entry.get("path") or "") / "config.json") or {}


def pooling_modes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """A pooling config's modes in concatenation order: its ``pooling_mode`` (one or a list, as
    sentence-transformers 5.4 and later write it), else its ``pooling_mode_*`` flags in
    :data:`POOLING_FLAGS`' order; ``mean`` where none is set, as sentence-transformers does.

    Example:
        >>> pooling_modes({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True})
        ('cls', 'mean')
    """
    mode = config.get("pooling_mode")
    if mode is None:
        flagged = tuple(m for flag, m in POOLING_FLAGS.items() if config.get(flag) is True)
        return flagged or ("mean",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else ()
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise SentenceModuleUnsupported(
            f"pooling_mode {mode!r} is none of {', '.join(sorted(POOLING_MODES))}; ask for "
            "--output tokens"
        )
    return modes


def _after_pooling(folder: Path, entry: Mapping[str, Any]) -> DenseLayer | Normalizing:
    """A dense or normalising module, which must read and write the sentence embedding.

    Raises:
        SentenceModuleUnsupported: it reads or writes another feature (the token embeddings).
    """
    config = _module_config(folder, entry)
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, ST_EMBEDDING_KEY) not in (ST_EMBEDDING_KEY, None):
            raise SentenceModuleUnsupported(
                f"{folder / str(entry['path'])} works on {config[key]!r}, not on "
                f"{ST_EMBEDDING_KEY!r}; featbake does not reproduce it: ask for --output tokens"
            )
    if st_module_name(entry) == "Normalize":
        return Normalizing()
    try:
        return DenseLayer(
            folder=str(entry["path"]),
            in_features=int(config["in_features"]),
            out_features=int(config["out_features"]),
            bias=bool(config.get("bias", True)),
            activation=str(config.get("activation_function") or DenseLayer.activation),
            residual=bool(config.get("use_residual", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SentenceModuleUnsupported(
            f"{folder / str(entry.get('path'))}/config.json lacks a whole {e} for its Dense "
            "layer; save the model again (SentenceTransformer.save)"
        ) from e


def sentence_files_digest(folder: str | os.PathLike[str]) -> str | None:
    """SHA-256 over the sentence-transformers files of a folder (name and bytes): modules.json,
    the transformer's settings (beside it: ``0_Transformer/sentence_bert_config.json`` in the
    older layout) and every file in each other module's folder (a pooling's config, a dense
    layer's config and weights), so another pooling mode or other dense weights give other
    keys; and the default prompt and ``truncate_dim`` ``encode`` applies, where the folder
    sets them (:func:`model_settings`; not the whole settings file, which names the library
    versions it was saved with, so a folder setting neither keeps its key). The transformer's
    own files are the model's and tokenizer's keys. None for a folder without modules.json."""
    path = Path(folder)
    if not is_sentence_folder(path):
        return None
    top, transformer = path.resolve(), transformer_folder(path)
    sub = transformer_subfolder(path)
    named = {ST_MODULES_FILE: path / ST_MODULES_FILE}
    named.update({n if sub is None else f"{sub}/{n}": transformer / n for n in ST_CONFIG_FILES})
    files = {name: sha256_file(f) for name, f in named.items() if f.is_file()}
    try:
        entries = st_modules(path)
    except EncoderLoadError:
        entries = []  # its refusal says why; the file itself is hashed above
    for entry in entries:
        folder_of = (path / str(entry.get("path") or "")).resolve()
        if top in folder_of.parents and folder_of.is_dir() and folder_of != transformer.resolve():
            for f in sorted(p for p in folder_of.rglob("*") if p.is_file()):
                files[f.relative_to(top).as_posix()] = sha256_file(f)
    return sha256_hex(canonical_json({**files, **_applied_settings(path)}))


def _applied_settings(folder: Path) -> dict[str, Any]:
    """The settings ``encode`` applies that the digest holds, each only where the folder sets
    it: ``default_prompt`` and ``truncate_dim`` (none where they cannot be read: the
    ``sentence_embedding`` is then refused)."""
    try:
        model = model_settings(folder)
    except (ConfigError, EncoderLoadError):
        return {}
    read: dict[str, Any] = {}
    if model.prompt:
        read[f"{ST_MODEL_FILE}:default_prompt"] = model.prompt
    if model.truncate_dim is not None:
        read[f"{ST_MODEL_FILE}:truncate_dim"] = model.truncate_dim
    return read
