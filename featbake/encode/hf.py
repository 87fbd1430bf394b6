"""Hugging Face model folders: ``--encoder ./wavlm-base-plus`` (config.json + weights).

The folder is loaded with transformers (the optional extra ``featbake[hf]``), never from the
network. Its ``preprocessor_config.json`` decides the recipe's sample rate and normalisation
(:func:`recipe_for_folder`), and whether the model may see padded batches: a model whose
extractor says ``return_attention_mask: false`` (the group-norm wav2vec2/HuBERT-base variants)
"can not 100% correctly treat padded input", so featbake runs it on exact shapes and says why.
The module featbake runs follows the lengths protocol (:mod:`featbake.encode.encoders`): an
attention mask is built from the lengths, and output lengths come from the model's own
``_get_feat_extract_output_lengths``. Vision folders (an image processor, ``pixel_values`` in,
or a whole CLIP/SigLIP whose vision tower is run) are handled by :mod:`featbake.encode.hf`;
this module loads both.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from featbake.encode import fingerprints
from featbake.encode.encoders import LoadedEncoder, LoadedFrom, from_module
from featbake.encode.fingerprints import FolderState
from featbake.encode.hf_folders import (
    AUDIO_PARTS,
    PREPROCESSOR_FILE,
    TEXT_TOWER,
    VISION_TOWER,
    DenseLayer,
    LoadingArguments,
    Normalizing,
    PromptedTokenizer,
    SentenceModuleUnsupported,
    SentencePipeline,
    image_recipe_for_folder,
    is_sentence_folder,
    is_text_folder,
    is_vision_folder,
    load_tokenizer,
    loading_arguments,
    processor_settings,
    read_config,
    sentence_files_digest,
    sentence_pipeline,
    text_recipe_for_folder,
    tower_config,
    transformer_folder,
    transformer_subfolder,
)
from featbake.encode.outputs import layers_to_run, part_name, resolve_layers
from featbake.errors import ConfigError, EncoderLoadError, brief, first_line
from featbake.keys import module_fingerprint
from featbake.recipe import Recipe, TextRecipe

# == hf_vision =====================================================================================
# Hugging Face vision folders: ViT, DINOv2, CLIP/SigLIP vision towers (``pixel_values`` in).
#
# A vision folder is one whose ``preprocessor_config.json`` is an *image* processor. Its processor
# decides the recipe's image transform (:func:`image_recipe_for_folder`), with any option the
# user gives on top; its model runs behind :class:`HFVisionEncoder`, which names its outputs as
# parts so ``--output`` and ``--layers`` pick them as they do for audio:
#
# * ``pooled``: the model's ``pooler_output`` (ViT's tanh head on CLS, DINOv2's normalised CLS,
#   CLIP's post-layernorm CLS), or the CLS token when the model has no pooler: ``[D]``; a ViT
#   saved without its pooling layer (DINO, MAE) has no ``pooled`` (its head would be random);
# * ``tokens``: the last hidden state, CLS (and registers) first, then the patches: ``[N, D]``;
# * ``layer6`` ...: ``hidden_states[6]`` with ``--layers`` (0 is the patch embedding);
# * ``image_embeds``: for a whole CLIP or SigLIP folder (text and vision towers, as a download
#   gives), the image embedding ``get_image_features`` returns: CLIP's ``visual_projection`` of
#   ``pooled``, SigLIP's ``pooled`` itself. Only the vision tower is kept and run.
#
# timm and open_clip import torchvision, whose wheels do not load beside every torch build: run
# them through an import-path factory (``--encoder mypkg.vision:build --source image``) with the
# transform given as options.
POOLED = "pooled"
TOKENS = "tokens"
IMAGE_EMBEDS = "image_embeds"


class VisionTower(NamedTuple):
    """The part of a whole image-text model (CLIP, SigLIP) that encodes images."""

    model: Any  # the vision model: pixel_values in, hidden states and pooler_output out
    projection: Any  # CLIP's visual_projection, or None where the pooled output is the embedding


def vision_tower(model: Any) -> VisionTower | None:
    """The vision tower of a whole image-text model, or of a tower saved with its projection
    (``CLIPVisionModelWithProjection``: IP-Adapter's image encoder), or None for any other."""
    tower = getattr(model, "vision_model", None)
    projection = getattr(model, "visual_projection", None)
    if tower is None or not (hasattr(model, "get_image_features") or projection is not None):
        return None
    return VisionTower(tower, projection)


#: Vision classes whose folders featbake loads by their own class (``AutoModel`` builds the
#: tower alone, dropping the trained projection).
VISION_CLASSES = frozenset({"CLIPVisionModelWithProjection"})


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
        if not self.pooled:  # no pooling head: its tokens alone
            return {TOKENS: tokens}
        pooled = getattr(out, "pooler_output", None)
        # No pooler output (ViTMSN, ViTMAE): the CLS row, which their own heads read.
        parts = {POOLED: tokens[:, 0] if pooled is None else pooled, TOKENS: tokens}
        if self.embeds:
            project = self.projection
            parts[IMAGE_EMBEDS] = parts[POOLED] if project is None else project(parts[POOLED])
        return parts


# == hf_text =======================================================================================
# Hugging Face text folders: BERT-style encoders, the CLIP text tower, the T5 encoder
# (``input_ids`` in).
#
# A text folder holds a tokenizer (``tokenizer_config.json`` or ``tokenizer.json``) and no
# preprocessor (a wav2vec2 CTC folder holds both: it stays audio). Its tokenizer and options make
# the recipe's :class:`~featbake.recipe.TextRecipe` (:func:`text_recipe_for_folder`): the files'
# SHA-256 is in the key, so another vocabulary or normaliser never shares stored features. The
# model runs behind :class:`HFTextEncoder`, which follows the lengths protocol (a batch of token
# ids padded on the right, the attention mask built from the lengths), so texts of different
# lengths share a padded batch and the exactness guard checks it as it checks audio. Parts:
#
# * ``tokens``: the last hidden state ``[N, D]``, cut to the text's own tokens (no padding rows);
# * ``pooled``: the model's ``pooler_output`` where it has one (BERT's tanh head on [CLS], CLIP's
#   final-layernormed end-of-text token) ``[D]``; T5's encoder has none;
# * ``text_embeds``: CLIPTextModelWithProjection's projection of ``pooled`` ``[D']``;
# * ``sentence_embedding``: a sentence-transformers folder's (``modules.json``) embedding, as
#   ``SentenceTransformer.encode`` returns it: its pooling of ``tokens`` under the attention mask
#   (its default prompt is put before each text by the recipe's tokenizer, and its tokens left
#   out of the pooling where the pooling says ``include_prompt: false``), then its dense layers
#   and normalisation, then its ``truncate_dim`` (:class:`SentenceHead`) ``[D']``; the
#   transformer is read from ``0_Transformer/`` where the folder is of that older layout;
# * ``layer6`` ...: ``hidden_states[6]`` with ``--layers``.
TEXT_EMBEDS = "text_embeds"
SENTENCE_EMBEDDING = "sentence_embedding"
#: Files a tokenizer is read from; those present are hashed into the recipe.
ENCODER_ONLY = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
#: Model types whose text model pools its last position, padding included (SigLIP's: run on
#: texts padded to ``max_length`` without a mask), so a text's features depend on its padding:
#: refused (a batch padded and masked per batch gives other features than the model's users).
LAST_POSITION_TEXT = frozenset({"siglip", "siglip_text_model", "siglip2", "siglip2_text_model"})
#: Classes whose folders featbake loads by their own class (``AutoModel`` drops the projection).
TEXT_CLASSES = frozenset({"CLIPTextModelWithProjection", *ENCODER_ONLY.values()})


def _pool_cls(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The first pooled token's row: the first row (rows are padded on the right) where no
    prompt is left out, else the first after it; the first row where the mask holds none (a
    text all prompt), as sentence-transformers takes it."""
    first = mask.to(torch.int).argmax(dim=1)
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), first]


def _pool_max(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each dimension's largest value over the text's own tokens."""
    return tokens.masked_fill(~mask[:, :, None], float("-inf")).max(dim=1).values


def _token_sums(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the text's own token rows and how many they are (at least 1e-9)."""
    weights = mask[:, :, None].to(tokens.dtype)
    return (tokens * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)


def _pool_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the text's own token rows."""
    total, count = _token_sums(tokens, mask)
    return total / count


def _pool_mean_sqrt_len(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of the text's own token rows over the square root of their number."""
    total, count = _token_sums(tokens, mask)
    return total / count.sqrt()


def _pool_weighted_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the text's own token rows weighted by their position (1, 2, ...)."""
    positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=tokens.dtype)
    weights = mask.to(tokens.dtype)[:, :, None] * positions[None, :, None]
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _pool_last_token(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The text's last pooled token's row; zeros where the mask holds none (a text all prompt
    its pooling leaves out), as sentence-transformers gives."""
    width = tokens.shape[1]
    held, from_end = mask.flip(1).to(torch.int).max(dim=1)
    last = width - 1 - torch.where(held == 0, width - 1, from_end)
    rows = tokens[torch.arange(tokens.shape[0], device=tokens.device), last]
    return rows * held[:, None].to(tokens.dtype)


#: sentence-transformers' pooling modes, each over ``tokens [B, N, D]`` and ``mask [B, N]``.
POOLINGS = {
    "cls": _pool_cls,
    "max": _pool_max,
    "mean": _pool_mean,
    "mean_sqrt_len_tokens": _pool_mean_sqrt_len,
    "weightedmean": _pool_weighted_mean,
    "lasttoken": _pool_last_token,
}


class SentenceDense(nn.Module):
    """sentence-transformers' ``Dense``: ``activation(linear(x))``, plus ``x`` (projected where
    the sizes differ) with a residual; its weights load under the same names."""

    def __init__(self, layer: DenseLayer, activation: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        self.activation_function = activation  # sentence-transformers' name: a PReLU's weight
        self.use_residual = layer.residual
        if layer.residual and layer.in_features != layer.out_features:
            self.residual = nn.Linear(layer.in_features, layer.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation_function(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class SentenceNormalize(nn.Module):
    """sentence-transformers' ``Normalize``: each embedding over its L2 norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, p=2, dim=-1)


class SentenceHead(nn.Module):
    """A sentence-transformers folder's modules after its transformer: ``forward(tokens, mask)``
    pools the token rows by each mode (concatenated in order), then runs the dense layers and
    normalisation in turn, then keeps the first ``truncate_dim`` values, as
    ``SentenceTransformer.encode`` does.

    Args:
        skip: tokens at the start of each text the pooling leaves out (the default prompt's,
            with ``include_prompt: false``); the transformer still reads them.
        truncate_dim: values kept of each embedding (None: all), with no normalising after.
    """

    def __init__(
        self,
        pooling: tuple[str, ...],
        after: list[nn.Module],
        *,
        skip: int = 0,
        truncate_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.pooling = pooling
        self.after = nn.ModuleList(after)
        self.skip = skip
        self.truncate_dim = truncate_dim

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.skip:
            positions = torch.arange(mask.shape[1], device=mask.device)
            mask = mask & (positions >= self.skip)[None, :]
        x = torch.cat([POOLINGS[mode](tokens, mask) for mode in self.pooling], dim=-1)
        for module in self.after:
            x = module(x)
        return x if self.truncate_dim is None else x[..., : self.truncate_dim]


def sentence_head(folder: Path, pipeline: SentencePipeline) -> SentenceHead:
    """The torch modules of ``pipeline``, dense weights loaded from the folder, the prompt's
    tokens left out of the pooling where it says so (:func:`prompt_tokens_left_out`).

    Raises:
        SentenceModuleUnsupported: an activation that is no torch activation, or dense weights
            missing or not of the config's shapes.
    """
    after: list[nn.Module] = []
    for step in pipeline.after:
        if isinstance(step, Normalizing):
            after.append(SentenceNormalize())
            continue
        dense = SentenceDense(step, activation_module(step.activation, folder / step.folder))
        try:
            dense.load_state_dict(dense_weights(folder / step.folder))
        except RuntimeError as e:
            raise SentenceModuleUnsupported(
                f"the weights in {folder / step.folder} do not fit its config.json "
                f"({brief(e, 200)}); save the model again"
            ) from e
        after.append(dense.eval())
    skip = prompt_tokens_left_out(folder, pipeline)
    return SentenceHead(pipeline.pooling, after, skip=skip, truncate_dim=pipeline.truncate_dim)


def prompt_tokens_left_out(folder: Path, pipeline: SentencePipeline) -> int:
    """How many tokens at the start of each text the pooling leaves out: none unless the
    folder has a default prompt and its pooling says ``include_prompt: false``; then the
    prompt's, counted as sentence-transformers counts them: the prompt alone tokenised as a
    text is (special tokens, cut at the folder's ``max_length``), less a special token at its
    end (``[SEP]``), so ``[CLS]`` and the prompt's own tokens are left out.

    Raises:
        EncoderLoadError: the folder's tokenizer cannot be read.
    """
    if pipeline.include_prompt or not pipeline.prompt:
        return 0
    steps = text_recipe_for_folder(folder)
    tokenizer = load_tokenizer(folder)
    own = tokenizer.tokenizer if isinstance(tokenizer, PromptedTokenizer) else tokenizer
    ids = own(pipeline.prompt, truncation=True, max_length=steps.max_length)["input_ids"]
    special = set(getattr(own, "all_special_ids", ()) or ())
    return len(ids) - 1 if ids and ids[-1] in special else len(ids)


def activation_module(name: str, where: Path) -> nn.Module:
    """A dense layer's activation from its dotted name (``torch.nn.modules.activation.Tanh``),
    built without arguments as sentence-transformers does; torch's modules only (another name
    would import code a folder chose).

    Raises:
        SentenceModuleUnsupported: the name is no torch module class.
    """
    module_name, _, class_name = name.rpartition(".")
    found: Any = None
    if module_name == "torch.nn" or module_name.startswith("torch.nn."):
        try:
            found = getattr(importlib.import_module(module_name), class_name, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise SentenceModuleUnsupported(
            f"{where}/config.json names the activation {name!r}, which is no torch activation "
            "(torch.nn's, such as torch.nn.modules.activation.Tanh); ask for --output tokens"
        )
    return found()


#: A module's weights, as sentence-transformers saves them (safetensors first).
DENSE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A dense module's saved weights.

    Raises:
        SentenceModuleUnsupported: neither weights file is there, or it cannot be read.
    """
    found = next((folder / n for n in DENSE_WEIGHTS if (folder / n).is_file()), None)
    if found is None:
        raise SentenceModuleUnsupported(
            f"{folder} has no {' or '.join(DENSE_WEIGHTS)} for its Dense layer; save the model "
            "again (SentenceTransformer.save)"
        )
    try:
        if found.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(found))
        return dict(torch.load(found, map_location="cpu", weights_only=True))
    except Exception as e:
        raise SentenceModuleUnsupported(f"cannot read {found}: {first_line(e)}") from e


class HFTextEncoder(nn.Module):
    """A transformers text model behind ``forward(input_ids, lengths) -> (parts, lengths)``.

    Rows are padded on the right; positions past a row's length get the tokenizer's pad id and
    are masked out, as the tokenizer's own padding would give. ``parts``: ``tokens``
    ``[B, N, D]``, ``pooled`` ``[B, D]`` where the model pools, ``text_embeds`` for a CLIP text
    model with projection, ``sentence_embedding`` ``[B, D']`` where ``sentence`` is given (a
    sentence-transformers folder's head, pooling under the same mask); with ``layers``,
    ``{"layer6": hidden_states[6], ...}``.
    """

    def __init__(
        self,
        model: Any,
        layers: tuple[int, ...] | None,
        pad_id: int,
        projection: Any = None,
        sentence: SentenceHead | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        self.pad_id = pad_id
        self.projection = projection
        self.sentence = sentence

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[Any, torch.Tensor]:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        mask = positions[None, :] < lengths[:, None]
        ids = torch.where(mask, input_ids, torch.full_like(input_ids, self.pad_id))
        out = self.model(
            input_ids=ids,
            attention_mask=mask.to(torch.long),
            output_hidden_states=self.layers is not None,
        )
        if self.layers is not None:
            return {part_name(k): out.hidden_states[k] for k in self.layers}, lengths
        parts = {TOKENS: out.last_hidden_state}
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            parts[POOLED] = pooled
            if self.projection is not None:
                parts[TEXT_EMBEDS] = self.projection(pooled)
        if self.sentence is not None:
            parts[SENTENCE_EMBEDDING] = self.sentence(out.last_hidden_state, mask)
        return parts, lengths


def _load_text_model(
    folder: Path, loading: LoadingArguments | None = None
) -> Any:  # a transformers PreTrainedModel
    """The folder's text model; a head's weights pass (a BertForMaskedLM download: its
    ``cls.*`` head is unused, see :func:`without_head_weights`). A sentence-transformers
    folder's transformer is loaded as sentence-transformers loads it (``loading``): its config
    with the ``config_kwargs`` over it, the ``model_kwargs`` featbake passes on
    (:class:`~featbake.encode.hf_folders.LoadingArguments`); the config so made is the one
    :func:`folder_identity` keys."""
    loading = loading or LoadingArguments()
    config = read_config(folder)
    if config.get("model_type") in LAST_POSITION_TEXT:
        raise EncoderLoadError(
            f"{folder} holds a SigLIP text model ({config.get('model_type')}), which pools its "
            "last position with padding attended (it is run on texts padded to max_length, "
            "unmasked); featbake masks the padding of its batches, so it does not run it: "
            "encode its texts yourself (padding='max_length')"
        )
    name = class_name(config, TEXT_CLASSES, ENCODER_ONLY.get(str(config.get("model_type"))))
    kwargs: dict[str, Any] = dict(loading.model)
    if loading.config:
        kwargs["config"] = _config_with(folder, loading.config)
    model, info = _from_pretrained(folder, model_class=name, **kwargs)
    if only_pooler_missing(model, info):
        kwargs["add_pooling_layer"] = False
        model, info = _from_pretrained(folder, model_class=name, **kwargs)
    check_loading_info(folder, without_head_weights(model, info))
    if getattr(model, "main_input_name", None) != "input_ids":
        raise EncoderLoadError(
            f"{folder} holds a {type(model).__name__}, which does not take token ids; featbake "
            "runs BERT-style encoders, CLIP text models and T5 encoders from a text folder"
        )
    return model.eval()


def _config_with(folder: Path, overrides: dict[str, Any]) -> Any:
    """transformers' config of ``folder`` with ``overrides`` over it, as
    ``AutoConfig.from_pretrained(folder, **overrides)`` makes it (a sentence-transformers
    folder's ``config_kwargs``).

    Raises:
        EncoderLoadError: transformers cannot make it.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            str(folder), **overrides, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:
        raise EncoderLoadError(
            f"transformers cannot read the config in {folder} with the config_kwargs of its "
            f"sentence_bert_config.json: {first_line(e)}"
        ) from e


def _text_encoder(
    path: Path, layers: tuple[int, ...] | str | None, device: str | torch.device
) -> LoadedEncoder:
    """A text folder's model as a lengths-protocol encoder (its tokenizer is in the recipe); a
    sentence-transformers folder's transformer read where it is (:func:`transformer_folder`)
    and as sentence-transformers loads it (:func:`loading_arguments`)."""
    model = _load_text_model(transformer_folder(path), loading_arguments(path))
    chosen = (
        None if layers is None else resolve_layers(layers, _config_layers(path, model, TEXT_TOWER))
    )
    projection = getattr(model, "text_projection", None)
    runs = model.text_model if projection is not None else model  # CLIP: pooled, then project
    pad_id = getattr(model.config, "pad_token_id", None)
    head, refused = _sentence_head_of(path)
    wrapper = HFTextEncoder(runs, chosen, int(pad_id or 0), projection, head)
    identity = folder_identity(path, model, Preprocessor(), sentence=sentence_files_digest(path))
    enc = from_module(wrapper, label=str(path), kind=HF, identity=identity, device=device)
    enc._fingerprint = module_fingerprint(wrapper, identity)
    enc.whole_parts = frozenset({POOLED, TEXT_EMBEDS, SENTENCE_EMBEDDING})
    if refused is not None:
        enc.absent_outputs[SENTENCE_EMBEDDING] = refused
    if getattr(runs, "pooler", False) is None or ENCODER_ONLY.get(model.config.model_type):
        enc.absent_outputs[POOLED] = (
            f"{path} holds a {type(model).__name__}, which has no pooler output; ask for "
            f"--output {TOKENS} and pool the rows yourself"
        )
    return enc


def _sentence_head_of(path: Path) -> tuple[SentenceHead | None, str | None]:
    """A sentence-transformers folder's head, or why it gives no ``sentence_embedding`` (one
    line: its tokens still build); (None, None) for any other folder."""
    pipeline = sentence_pipeline(path)
    if pipeline is None:
        return None, None
    if pipeline.refused is not None:
        return None, pipeline.refused
    try:
        return sentence_head(path, pipeline), None
    except SentenceModuleUnsupported as e:
        return None, first_line(e)


# == hf ============================================================================================
HF = "hf"
#: Bump when the adapter below changes what it computes from the same folder.
ADAPTER_VERSION = 1


@dataclass(frozen=True)
class Preprocessor:
    """What ``preprocessor_config.json`` says about the model's input.

    Attributes:
        sampling_rate: the rate the model was trained at (Hz).
        do_normalize: zero-mean, unit-variance per clip before the model.
        return_attention_mask: the model takes an attention mask, so padding is exact.
    """

    sampling_rate: int = 16000
    do_normalize: bool = True
    return_attention_mask: bool = False

    @classmethod
    def of_folder(cls, folder: str | os.PathLike[str]) -> Preprocessor:
        """Read the folder's feature extractor settings as transformers does
        (:func:`~featbake.encode.hf_folders.processor_settings`); Wav2Vec2FeatureExtractor's
        defaults if none."""
        found = processor_settings(folder, AUDIO_PARTS)
        if found is None:
            return cls()
        raw, path = found.values, found.where
        return cls(
            sampling_rate=_sampling_rate(path, raw.get("sampling_rate", cls.sampling_rate)),
            do_normalize=bool(raw.get("do_normalize", cls.do_normalize)),
            return_attention_mask=bool(raw.get("return_attention_mask", False)),
        )


def _sampling_rate(path: str, value: object) -> int:
    """The config's ``sampling_rate`` as whole Hz; anything else names the file and the value."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EncoderLoadError(
            f"{path}: sampling_rate must be a whole number of Hz such as 16000, got {value!r}; "
            "fix the file (it decides the rate the model's input is resampled to)"
        )
    return value


def is_hf_folder(spec: str | os.PathLike[str]) -> bool:
    """A directory holding a ``config.json``, or a sentence-transformers folder whose
    transformer's subfolder holds one (``0_Transformer/``: :func:`transformer_folder`)."""
    return (transformer_folder(spec) / "config.json").is_file()


def recipe_for_folder(folder: str | os.PathLike[str], recipe: Recipe) -> Recipe:
    """``recipe`` with the folder's sample rate, normalisation and concrete layers.

    The model defines its input, so its preprocessor config wins over ``--sample-rate``;
    ``layers="all"`` becomes ``0..num_hidden_layers`` so keys name what is stored. A vision
    folder makes the recipe an image recipe (an audio recipe cannot feed it) with the folder's
    image transform, unless the recipe already holds one (``Recipe(image=...)``).
    """
    changes: dict[str, Any]
    if recipe.source in ("image", "npy") and is_text_folder(folder):
        raise ConfigError(
            f"{folder} is a text model (a tokenizer, no preprocessor); it encodes --source "
            f"text, not {recipe.source}"
        )
    if recipe.source == "text" or (recipe.source == "audio" and is_text_folder(folder)):
        changes = {"source": "text", "text": recipe.text or _folder_text_steps(folder)}
    elif is_vision_folder(folder):
        source = "image" if recipe.source == "audio" else recipe.source
        changes = {"source": source, "image": recipe.image or image_recipe_for_folder(folder)}
    else:
        pre = Preprocessor.of_folder(folder)
        changes = {"sample_rate": pre.sampling_rate, "normalize": pre.do_normalize}
    if recipe.layers is not None:
        tower = TEXT_TOWER if changes.get("source") == "text" else VISION_TOWER
        changes["layers"] = resolve_layers(recipe.layers, _num_layers(folder, tower))
    return recipe.replace(**changes)


def _folder_text_steps(folder: str | os.PathLike[str]) -> TextRecipe:
    """The folder's tokenizer for a text recipe; a folder without one is refused in words.

    Raises:
        ConfigError: ``--source text`` with a model folder that has no tokenizer.
    """
    if not is_text_folder(folder):
        raise ConfigError(
            f"--source text needs a text model folder with its tokenizer; {folder} has no "
            "tokenizer_config.json / tokenizer.json (or is an audio or vision folder)"
        )
    return text_recipe_for_folder(folder)


def recipe_for_encoder(spec: Any, recipe: Recipe) -> Recipe:
    """:func:`recipe_for_folder` when ``spec`` names a Hugging Face folder, else ``recipe``."""
    if isinstance(spec, (str, os.PathLike)) and is_hf_folder(spec):
        return recipe_for_folder(spec, recipe)
    return recipe


def check_recipe_supported(encoder: LoadedEncoder, recipe: Recipe) -> None:
    """Raise ConfigError when ``layers`` is asked of an encoder without hidden states, or
    ``output`` names one the encoder cannot give (its ``absent_outputs``)."""
    if recipe.output is not None and recipe.output in encoder.absent_outputs:
        raise ConfigError(encoder.absent_outputs[recipe.output])
    if recipe.layers is not None and encoder.kind != HF:
        raise ConfigError(
            f"--layers needs an encoder with hidden states (a Hugging Face model folder); "
            f"{encoder.label} is a {encoder.kind} encoder: return a dict of layers from its "
            "forward instead and pick them with --output"
        )
    if isinstance(recipe.layers, str):
        raise ConfigError("layers='all' must be resolved against the model (recipe_for_folder)")


def _config_layers(folder: Path, model: Any, tower: str = VISION_TOWER) -> int:
    """The number of layers ``--layers`` counts in a loaded model (:func:`layer_count` of its
    config), asked only where layers are."""
    return layer_count(folder, model.config.to_dict(), tower)


def _num_layers(folder: str | os.PathLike[str], tower: str) -> int:
    """The number of layers ``--layers`` counts in a folder's model (:func:`layer_count`),
    read from its config.json before the model is loaded."""
    return layer_count(folder, read_config(transformer_folder(folder)), tower)


def layer_count(folder: str | os.PathLike[str], config: dict[str, Any], tower: str) -> int:
    """The number of layers in ``config`` (of ``tower`` in a whole image-text model): its
    ``num_hidden_layers``, by whatever name the model gives it (GPT-2's ``n_layer``, T5's
    ``num_layers``).

    Raises:
        ConfigError: the config names none, or its model has stages (BiT's and Swin's
            ``depths``: their hidden states are no one layer's, each of its own shape).
    """
    settings = tower_config(config, tower)
    if "depths" in settings or "num_hidden_layers" not in settings:
        staged = " (its model has stages, not layers)" if "depths" in settings else ""
        raise ConfigError(
            f"{folder} has no num_hidden_layers in config.json{staged}; --layers needs it: "
            "leave --layers out"
        )
    return int(settings["num_hidden_layers"])


class HFSpeechEncoder(nn.Module):
    """A transformers audio model behind ``forward(x, lengths) -> (features, out_lengths)``.

    ``features`` is the last hidden state ``[B, T', D]``, or with ``layers`` a dict
    ``{"layer6": hidden_states[6], ...}``.
    """

    def __init__(self, model: Any, layers: tuple[int, ...] | None, use_mask: bool) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        self.use_mask = use_mask

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[Any, torch.Tensor]:
        mask = None
        if self.use_mask:
            positions = torch.arange(x.shape[-1], device=x.device)
            mask = (positions[None, :] < lengths[:, None]).to(torch.long)
        out = self.model(x, attention_mask=mask, output_hidden_states=self.layers is not None)
        out_lengths = self.model._get_feat_extract_output_lengths(lengths)
        if self.layers is None:
            return out.last_hidden_state, out_lengths
        return {part_name(k): out.hidden_states[k] for k in self.layers}, out_lengths


#: Weights of a pooling head, which ViT-style models build by default though DINO and MAE
#: checkpoints are saved without it (``ViTModel(config, add_pooling_layer=False)``).
POOLER_PREFIX = "pooler."


def class_name(config: dict[str, Any], own: frozenset[str], fallback: str | None = None) -> str:
    """The transformers class a folder's model is loaded as: the class its config names first
    (``architectures[0]``) where it is one of ``own`` (``AutoModel`` would build another: CLIP
    without its projection, T5 with its decoder), else ``fallback`` (T5's encoder, by its
    model type), else ``AutoModel``."""
    architectures = config.get("architectures") or []
    named = str(architectures[0]) if architectures else None
    if named is not None and named in own:
        return named
    return fallback or "AutoModel"


def _from_pretrained(
    folder: Path, model_class: str = "AutoModel", **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """transformers' model (as ``model_class``) and loading info for ``folder``, quietly and
    offline."""
    try:
        import transformers
    except ImportError as e:
        raise EncoderLoadError(
            f"{folder} is a Hugging Face model folder; install transformers: "
            "pip install 'featbake[hf]'"
        ) from e
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would break featbake's own output
    verbosity = hf_logging.get_verbosity()
    # transformers logs a multi-line load report for missing weights; featbake says it once.
    hf_logging.set_verbosity_error()
    try:
        model, info = getattr(transformers, model_class).from_pretrained(
            str(folder),
            local_files_only=True,
            dtype=torch.float32,
            output_loading_info=True,
            trust_remote_code=False,  # asked, transformers waited 15 s on a prompt first
            **kwargs,
        )
    except Exception as e:
        raise EncoderLoadError(
            own_code_refusal(folder)
            if "trust_remote_code" in str(e)
            else f"transformers cannot load {folder}: {brief(e)}"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, info


def own_code_refusal(folder: Path) -> str:
    """Why a folder whose model is its own code (``auto_map`` in its config.json, for a model
    type transformers does not hold) is not loaded: featbake never runs a folder's code, which
    its key would not cover."""
    return (
        f"{folder} holds a model of its own code (auto_map in config.json), which featbake "
        "does not run (its key could not cover that code); build the model in a module of "
        "your own and pass its import path as --encoder (mypkg.models:build_encoder)"
    )


def only_pooler_missing(model: Any, info: dict[str, Any]) -> bool:
    """The folder's weights lack only a pooling head the model can be built without."""
    missing = [str(n) for n in info.get("missing_keys") or ()]
    headless = "add_pooling_layer" in inspect.signature(type(model).__init__).parameters
    return headless and bool(missing) and all(n.startswith(POOLER_PREFIX) for n in missing)


def _load_model(folder: Path) -> Any:  # a transformers PreTrainedModel
    model_class = class_name(read_config(folder), VISION_CLASSES)
    model, info = _from_pretrained(folder, model_class)
    if only_pooler_missing(model, info):
        # Saved headless: load it so (no random head), and serve what the weights cover.
        model, info = _from_pretrained(folder, model_class, add_pooling_layer=False)
    check_loading_info(folder, without_head_weights(model, info))
    takes = getattr(model, "main_input_name", None)
    if takes not in ("input_values", "pixel_values") and vision_tower(model) is None:
        raise EncoderLoadError(
            f"{folder} holds a {type(model).__name__}, which takes neither raw audio "
            "(input_values) nor images (pixel_values); featbake runs wav2vec2-style audio "
            "encoders, ViT/DINOv2 models and CLIP/SigLIP models (whole or their vision "
            "tower) from a folder"
        )
    if takes == "input_values" and getattr(model.config, "is_encoder_decoder", False):
        raise EncoderLoadError(
            f"{folder} holds a {type(model).__name__}, an encoder-decoder model whose forward "
            "needs decoder inputs (Moonshine's); featbake runs wav2vec2-style audio encoders "
            "from a folder: wrap its encoder in a module of your own (an import path)"
        )
    if takes == "input_values" and not hasattr(model, "_get_feat_extract_output_lengths"):
        raise EncoderLoadError(f"{type(model).__name__} does not report its output lengths")
    return model.eval()


def _vision_encoder(
    path: Path,
    model: Any,
    pre: Preprocessor,
    layers: tuple[int, ...] | None,
    device: str | torch.device,
) -> LoadedEncoder:
    """A vision model as an exact-shape encoder (its image transform is in the recipe).

    A model loaded without its pooling head (a DINO or MAE ViT) gives no ``pooled`` output:
    its tokens are what the weights cover, and a CLS token under the pooler's name would be
    another feature than a ViT's ``pooler_output``. Of a whole CLIP or SigLIP model only the
    vision tower (and CLIP's projection) is kept: the text tower is freed with ``model``.
    """
    tower = vision_tower(model)
    runs = model if tower is None else tower.model
    headless = getattr(runs, "pooler", False) is None
    # SigLIP's tower without its attention-pooling head (vision_use_head=False) gives no
    # pooler_output: its first row, a patch's token, was served as `pooled` and `image_embeds`.
    unpooled = getattr(getattr(runs, "vision_model", runs), "use_head", True) is False
    projection = None if tower is None else tower.projection
    wrapper = HFVisionEncoder(
        runs,
        layers,
        pooled=not (headless or unpooled),
        embeds=tower is not None,
        projection=projection,
    )
    # Keyed apart from the stores that held a patch's token as its pooled part.
    identity = folder_identity(path, model, pre) + ("\npooled:none" if unpooled else "")
    enc = from_module(wrapper, label=str(path), kind=HF, identity=identity, device=device)
    enc._fingerprint = module_fingerprint(wrapper, identity)
    if headless:
        enc.absent_outputs[POOLED] = (
            f"{path} was saved without its pooling layer (add_pooling_layer=False, as DINO and "
            f"MAE checkpoints are), so it has no {POOLED!r} output; ask for --output {TOKENS} "
            "(its first row is the CLS token)"
        )
    if unpooled:
        for part in (POOLED, IMAGE_EMBEDS):
            enc.absent_outputs[part] = (
                f"{path} has no attention-pooling head (vision_use_head=false), so it has no "
                f"{part!r} output (a SigLIP token is a patch's, no CLS); ask for --output "
                f"{TOKENS} and pool the rows yourself"
            )
    return enc


class WeightsMismatch(EncoderLoadError):
    """A model folder's weights do not cover its config, or hold weights the config lacks.

    transformers fills missing weights with a random init and drops unexpected ones, with a
    log line at most: each load would then give new features under a new key.
    """


#: Names shown per kind of mismatch before "... and N more".
SHOWN_NAMES = 3


def without_head_weights(model: Any, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` less the unexpected weights of a task head the saved class had and the loaded
    base model lacks (Wav2Vec2ForCTC's ``lm_head``, BertForMaskedLM's ``cls``): featbake runs the
    base, so dropping them changes no feature. An unexpected weight inside the model (a layer
    the config lacks: ``encoder.layers.2``, with or without the ``wav2vec2.`` prefix) stays.
    Before, a fine-tuned audio or image checkpoint (a CTC model) was refused as weights that
    did not match their config."""
    own = {name.split(".")[0] for name in model.state_dict()}
    base = getattr(model, "base_model_prefix", "") or ""

    def inside(name: str) -> bool:
        return (name.removeprefix(f"{base}.") if base else name).split(".")[0] in own

    unexpected = [n for n in info.get("unexpected_keys") or () if inside(str(n))]
    return {**info, "unexpected_keys": unexpected}


def check_loading_info(folder: Path, info: dict[str, Any]) -> None:
    """Raise :class:`WeightsMismatch` when transformers reports missing, unexpected or
    mismatched weights for ``folder`` (its ``output_loading_info``)."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        names = sorted(str(n[0] if isinstance(n, tuple) else n) for n in info.get(kind) or ())
        if names:
            shown = ", ".join(names[:SHOWN_NAMES])
            more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
            problems.append(f"{len(names)} {kind.replace('_keys', '')} ({shown}{more})")
    if problems:
        raise WeightsMismatch(
            f"the weights in {folder} do not match its config.json: {'; '.join(problems)}. "
            "Loading would fill the gaps with random values, so every load would give other "
            "features; make config.json describe the saved model (e.g. num_hidden_layers) or "
            "save the model again with save_pretrained"
        )


def folder_identity(
    folder: Path, model: Any, pre: Preprocessor, *, sentence: str | None = None
) -> str:
    """Model class, full config and preprocessor, and the adapter version (weights come after);
    with ``sentence``, the digest of a sentence-transformers folder's own files
    (:func:`~featbake.encode.hf_folders.sentence_files_digest`: pooling, dense, normalise)."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    parts = [
        f"hf:{type(model).__module__}.{type(model).__qualname__}",
        f"adapter:{ADAPTER_VERSION}",
        f"config:{hashlib.sha256(config.encode()).hexdigest()}",
        f"preprocessor:{pre}",
    ]
    if sentence is not None:
        parts.append(f"sentence-transformers:{sentence}")
    return "\n".join(parts)


def _truncate(model: Any, layers: tuple[int, ...]) -> None:
    """Stop the encoder after the last layer asked for (it is this process's own copy)."""
    encoder: Any = getattr(model, "encoder", None)
    stack = getattr(encoder, "layers", None)
    if not isinstance(stack, nn.ModuleList):
        return  # an unknown layout: run every layer, select after
    final_norm = bool(getattr(model.config, "do_stable_layer_norm", False))
    # At least one: transformers 5 records hidden states as its layers run, so an empty stack
    # gives none back, not even ``hidden_states[0]`` (``--layers 0`` failed with IndexError).
    keep = max(1, layers_to_run(layers, len(stack), final_norm=final_norm))
    encoder.layers = stack[:keep]


def load_hf_folder(
    folder: str | os.PathLike[str],
    *,
    layers: tuple[int, ...] | str | None = None,
    device: str | torch.device = "cpu",
) -> LoadedEncoder:
    """Load a local Hugging Face audio model folder as a lengths-protocol encoder.

    The fingerprint covers the config, the preprocessor config and every weight of the *whole*
    model, taken before the layers past the last one asked for are dropped; so it is one
    fingerprint per folder, and the recipe's ``layers`` tells the bakes apart.

    Raises:
        EncoderLoadError: transformers is missing, or the folder is not an audio model.
        ConfigError: a layer past the model's last.
    """
    path = Path(folder).resolve()
    if not is_hf_folder(path):  # e.g. the data folder given as --encoder
        raise EncoderLoadError(
            f"{folder} is a folder without config.json, so no Hugging Face model folder; "
            "--encoder takes one (save_pretrained writes it), a TorchScript (.pt) or "
            "torch.export (.pt2) file, or an import path like mypkg.models:build_encoder"
        )
    taken = time.time_ns()  # before the stats: what a racy entry is measured against
    # Recorded only from a load of transformers as installed (imported by this load): one the
    # process may have patched first gives its own fingerprint, no other process's. Nor for a
    # sentence-transformers folder: its modules' files (1_Pooling/config.json, dense weights)
    # are in subfolders, whose stats do not change when a file in them is rewritten.
    remembered = fingerprints.transformers_as_installed() and not is_sentence_folder(path)
    before = FolderState.of(path) if remembered else None
    enc = _load_folder(path, layers, device)
    if before is not None and FolderState.of(path) == before:  # unchanged over the load
        enc.folder_state, enc.loaded_from = before, LoadedFrom(before.newest, taken)
    return enc


def _load_folder(
    path: Path, layers: tuple[int, ...] | str | None, device: str | torch.device
) -> LoadedEncoder:
    """:func:`load_hf_folder` of a folder holding a config (its fingerprint computed here)."""
    if is_text_folder(path):
        return _text_encoder(path, layers, device)
    sub = transformer_subfolder(path)
    if sub is not None:
        raise EncoderLoadError(
            f"{path} is a sentence-transformers folder whose transformer in {sub}/ has no "
            "tokenizer; featbake reads a transformer there for a text model only: save it "
            "again (SentenceTransformer(folder).save)"
        )
    model = _load_model(path)
    pre = Preprocessor.of_folder(path)
    if layers is not None:
        layers = resolve_layers(layers, _config_layers(path, model))
    if model.main_input_name == "pixel_values" or vision_tower(model) is not None:
        return _vision_encoder(path, model, pre, layers, device)
    wrapper = HFSpeechEncoder(model, layers, pre.return_attention_mask)
    identity = folder_identity(path, model, pre)
    fingerprint = module_fingerprint(wrapper, identity)
    if layers is not None:
        _truncate(model, layers)
    enc = from_module(wrapper, label=str(path), kind=HF, identity=identity, device=device)
    enc._fingerprint = fingerprint
    if not pre.return_attention_mask:
        enc.unpaddable = (
            f"{PREPROCESSOR_FILE} says return_attention_mask=false (a group-norm model that "
            "cannot treat padded input exactly)"
        )
    return enc
