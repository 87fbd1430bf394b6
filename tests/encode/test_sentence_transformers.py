"""sentence-transformers folders: ``sentence_embedding`` as ``SentenceTransformer.encode`` gives it.

Each folder is a tiny BERT built from a config (no download), wrapped in sentence-transformers'
own modules (Transformer, Pooling, Dense, Normalize) and written by ``SentenceTransformer.save``.
The reference is sentence-transformers itself: the folder loaded by ``SentenceTransformer`` and
``encode`` run now on each text, with no featbake code between them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors
import torch

from featbake.bake.pipeline import build
from featbake.encode.hf import SENTENCE_EMBEDDING
from featbake.encode.loaders import load_encoder
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from tests.conftest import run_cli
from tests.encode.test_text import TEXTS, save_bert

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

#: Absolute difference allowed against sentence-transformers' own embedding (fp32).
ATOL = 1e-5
#: Longer than the BERT's 64 positions: cut by both at the same token.
LONG_TEXT = " ".join(["the small dog sat on the big red mat"] * 9)
HIDDEN = 32  # save_bert's hidden size


def save_sentence_model(
    folder: Path,
    bert: Path,
    pooling: str | tuple[str, ...] = "mean",
    *,
    dense: int | None = None,
    normalize: bool = True,
    seed: int = 5,
    include_prompt: bool = True,
    **settings: Any,
) -> Path:
    """``SentenceTransformer(modules=[Transformer, Pooling, (Dense), (Normalize)]).save``;
    ``settings`` are the model's (``prompts``, ``default_prompt_name``, ``truncate_dim``)."""
    modes = (pooling,) if isinstance(pooling, str) else pooling
    parts: list[Any] = [
        modules.Transformer(str(bert)),
        modules.Pooling(HIDDEN, pooling_mode=pooling, include_prompt=include_prompt),
    ]
    if dense is not None:
        torch.manual_seed(seed)
        parts.append(modules.Dense(HIDDEN * len(modes), dense, activation_function=torch.nn.Tanh()))
    if normalize:
        parts.append(modules.Normalize())
    st.SentenceTransformer(modules=parts, device="cpu", **settings).save(str(folder))
    return folder


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2))


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bert(tmp_path_factory.mktemp("st-bert") / "bert")


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("st-texts")
    for i, text in enumerate(TEXTS):
        (root / f"text{i}.txt").write_text(text, encoding="utf-8")
    (root / "long.txt").write_text(LONG_TEXT, encoding="utf-8")
    return root


def sentence_transformers_now(folder: Path, texts: list[str]) -> torch.Tensor:
    """The folder loaded by sentence-transformers and ``encode`` run now."""
    model = st.SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=2)


def built_and_served(folder: Path, texts: Path, store: Path) -> CachedFeatureDataset:
    """``build`` into ``store`` (padded batches), then the store served, every item a hit."""
    report = build(texts, folder, cache=store, batching="padded", batch_size=4)
    assert report.encoded == len(TEXTS) + 1 and not report.failed
    return CachedFeatureDataset(texts, encoder=folder, cache=store, source="text", on_miss="error")


def assert_sentence_embeddings_equal(ds: CachedFeatureDataset, folder: Path) -> None:
    """Each served ``sentence_embedding`` equals ``SentenceTransformer.encode`` of its text."""
    said = [Path(ds.path(i)).read_text(encoding="utf-8") for i in range(len(ds))]
    want = sentence_transformers_now(folder, said)
    for i in range(len(ds)):
        got = ds[i]
        assert set(got) >= {"tokens", SENTENCE_EMBEDDING}, said[i]
        assert got[SENTENCE_EMBEDDING].shape == want[i].shape, said[i]
        torch.testing.assert_close(got[SENTENCE_EMBEDDING], want[i], atol=ATOL, rtol=0)


# == served == sentence-transformers' encode =====================================================
def test_mean_pooling_and_normalize_equal_sentence_transformers(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "minilm-like", bert, "mean")
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert_sentence_embeddings_equal(ds, folder)
    norms = torch.stack([ds[i][SENTENCE_EMBEDDING] for i in range(len(ds))]).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert "pooled" in ds[0]  # BERT's pooler output is kept beside it


def legacy_layout(folder: Path, *modes: str) -> None:
    """Rewrite the folder as releases before 5 wrote it: a flag per pooling mode, and module
    types named ``sentence_transformers.models.Pooling``."""
    flags = {
        "cls": "pooling_mode_cls_token",
        "max": "pooling_mode_max_tokens",
        "mean": "pooling_mode_mean_tokens",
    }
    config = {"word_embedding_dimension": HIDDEN, **{f: m in modes for m, f in flags.items()}}
    write_json(folder / "1_Pooling" / "config.json", config)
    entries = json.loads((folder / "modules.json").read_text())
    for entry in entries:
        entry["type"] = "sentence_transformers.models." + entry["type"].rsplit(".", 1)[-1]
    write_json(folder / "modules.json", entries)


@pytest.mark.parametrize(
    ("layout", "modes"),
    [
        ("pooling_mode", ("cls", "max")),
        ("flags", ("cls", "max")),
        ("pooling_mode", ("lasttoken", "weightedmean", "mean_sqrt_len_tokens")),
    ],
)
def test_concatenated_pooling_modes_equal_sentence_transformers(
    layout: str, modes: tuple[str, ...], bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "modes", bert, modes, normalize=False)
    if layout == "flags":
        legacy_layout(folder, *modes)
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert ds[0][SENTENCE_EMBEDDING].shape == (len(modes) * HIDDEN,)
    assert_sentence_embeddings_equal(ds, folder)


def test_a_dense_layer_with_tanh_equals_sentence_transformers(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "dense", bert, ("mean", "max"), dense=16)
    config = json.loads((folder / "2_Dense" / "config.json").read_text())
    assert config["activation_function"] == "torch.nn.modules.activation.Tanh"
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert ds[0][SENTENCE_EMBEDDING].shape == (16,)
    assert_sentence_embeddings_equal(ds, folder)


def test_a_text_past_max_seq_length_is_cut_as_sentence_transformers_cuts_it(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    """``max_seq_length`` in sentence_bert_config.json (as releases before 5 wrote it) is the
    recipe's default ``max_length``: every text of more than 8 tokens is cut there."""
    folder = save_sentence_model(tmp_path / "short", bert, "mean")
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 8, "do_lower_case": False})
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert ds.recipe.text is not None and ds.recipe.text.max_length == 8
    assert max(ds[i]["tokens"].shape[0] for i in range(len(ds))) == 8
    assert_sentence_embeddings_equal(ds, folder)


def save_cased_bert(folder: Path) -> Path:
    """:func:`save_bert` with a cased tokenizer: its vocabulary is lowercase words, so "The"
    is an unknown token unless the text is lowercased first."""
    save_bert(folder)
    vocab = folder.parent / f"{folder.name}-vocab" / "vocab.txt"
    transformers.BertTokenizer(str(vocab), do_lower_case=False).save_pretrained(folder)
    return folder


def test_do_lower_case_lowercases_as_sentence_transformers(texts: Path, tmp_path: Path) -> None:
    cased = save_cased_bert(tmp_path / "cased-bert")
    folder = save_sentence_model(tmp_path / "lower", cased, "mean")
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 64, "do_lower_case": True})
    ds = built_and_served(folder, texts, tmp_path / "store")
    # The tokenizer lowercases, as sentence-transformers' does, not Python before it.
    assert ds.recipe.text is not None and not ds.recipe.text.lowercase
    assert_sentence_embeddings_equal(ds, folder)
    # Without it, "The cat sat on the mat." starts with an unknown token: another embedding.
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 64})
    first = TEXTS[0]
    assert not torch.allclose(
        sentence_transformers_now(folder, [first])[0], ds[0][SENTENCE_EMBEDDING], atol=1e-3
    )


@pytest.mark.parametrize("layout", ["top-level", "older"])
def test_cli_builds_sentence_embedding_alone(
    bert: Path, texts: Path, tmp_path: Path, layout: str
) -> None:
    """``featbake build --output sentence_embedding`` of a folder as sentence-transformers
    saves it (with a Dense module), and of one in the older layout (``0_Transformer/``), each
    served equal to ``SentenceTransformer.encode`` run now."""
    if layout == "older":
        folder = save_sentence_model(tmp_path / "old-cli", bert, "mean")
        older_layout(folder)
    else:
        folder = save_sentence_model(tmp_path / "cli", bert, "mean", dense=8)
    store = tmp_path / "store"
    result = run_cli(
        "build", "--encoder", folder, "--data", texts, "--cache", store, "--source", "text",
        "--output", SENTENCE_EMBEDDING, "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["encoded"] == len(TEXTS) + 1
    ds = CachedFeatureDataset(
        texts, encoder=folder, cache=store, on_miss="error",
        recipe=Recipe(source="text", output=SENTENCE_EMBEDDING),
    )  # fmt: skip
    said = [Path(ds.path(i)).read_text(encoding="utf-8") for i in range(len(ds))]
    want = sentence_transformers_now(folder, said)
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], want[i], atol=ATOL, rtol=0)


# == keys ==========================================================================================
def test_another_pooling_mode_or_dense_weights_give_other_keys(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    """The pooling config rewritten in place between two builds: the second misses every text
    and stores what sentence-transformers gives now. Dense weights of another seed give
    another fingerprint too."""
    folder = save_sentence_model(tmp_path / "pooling", bert, "mean")
    store = tmp_path / "store"
    built_and_served(folder, texts, store)
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    write_json(folder / "1_Pooling" / "config.json", {**config, "pooling_mode": "cls"})
    ds = built_and_served(folder, texts, store)  # other keys: every text encoded again
    assert_sentence_embeddings_equal(ds, folder)

    one = save_sentence_model(tmp_path / "dense-a", bert, "mean", dense=8, seed=1)
    other = save_sentence_model(tmp_path / "dense-b", bert, "mean", dense=8, seed=2)
    before = load_encoder(one).fingerprint
    weights = "2_Dense/model.safetensors"
    (one / weights).write_bytes((other / weights).read_bytes())  # the same folder, other weights
    assert load_encoder(one).fingerprint != before


# == what featbake does not run ====================================================================
def add_custom_module(folder: Path, kind: str) -> None:
    entries = json.loads((folder / "modules.json").read_text())
    path = f"{len(entries)}_Custom"
    (folder / path).mkdir()
    entries.append({"idx": len(entries), "name": str(len(entries)), "path": path, "type": kind})
    write_json(folder / "modules.json", entries)


@pytest.mark.parametrize(
    "kind", ["modeling_custom.CustomHead", "sentence_transformers.models.StaticEmbedding"]
)
def test_an_unknown_module_refuses_sentence_embedding_and_tokens_build(
    kind: str, bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "custom", bert, "mean")
    add_custom_module(folder, kind)
    asked = Recipe(source="text", output=SENTENCE_EMBEDDING)
    with pytest.raises(ConfigError) as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=asked)
    message = str(refused.value)
    assert kind in message and "\n" not in message and "--output tokens" in message
    report = build(texts, folder, cache=tmp_path / "store")
    assert report.encoded == len(TEXTS) + 1 and not report.failed
    ds = CachedFeatureDataset(
        texts, encoder=folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert SENTENCE_EMBEDDING not in ds[0] and ds[0]["tokens"].shape[-1] == HIDDEN


def test_an_activation_that_is_no_torch_module_is_refused_in_one_line(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "act", bert, "mean", dense=8)
    config = json.loads((folder / "2_Dense" / "config.json").read_text())
    write_json(folder / "2_Dense" / "config.json", {**config, "activation_function": "os.system"})
    with pytest.raises(ConfigError, match=r"os\.system") as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=Recipe(output=SENTENCE_EMBEDDING))
    assert "\n" not in str(refused.value)


def older_layout(folder: Path) -> None:
    """Rewrite a saved folder in the layout older releases wrote: the transformer's config,
    weights, tokenizer and ``sentence_bert_config.json`` in ``0_Transformer/``, which
    ``modules.json`` names as its path; module types and the pooling config as they wrote them
    (:func:`legacy_layout`)."""
    legacy_layout(folder, "mean")
    sub = folder / "0_Transformer"
    sub.mkdir()
    top = {"modules.json", "config_sentence_transformers.json", "README.md", sub.name}
    for entry in list(folder.iterdir()):
        if entry.name not in top and not (entry.is_dir() and entry.name[0].isdigit()):
            entry.rename(sub / entry.name)
    entries = json.loads((folder / "modules.json").read_text())
    entries[0]["path"] = sub.name
    write_json(folder / "modules.json", entries)


def test_a_transformer_in_0_transformer_equals_sentence_transformers_and_is_keyed(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    """The older layout: built and served as sentence-transformers encodes it now; its
    transformer's settings, tokenizer and weights in the subfolder are in the key as a
    top-level transformer's are."""
    folder = save_sentence_model(tmp_path / "old", bert, "mean", dense=8)
    older_layout(folder)
    assert not (folder / "config.json").exists()
    assert (folder / "0_Transformer" / "sentence_bert_config.json").is_file()
    store = tmp_path / "store"
    ds = built_and_served(folder, texts, store)
    assert ds[0][SENTENCE_EMBEDDING].shape == (8,)
    assert_sentence_embeddings_equal(ds, folder)
    assert build(texts, folder, cache=store, batching="padded").encoded == 0  # its key kept

    # The subfolder's sentence_bert_config.json: another max_seq_length, other keys.
    settings = folder / "0_Transformer" / "sentence_bert_config.json"
    write_json(settings, {**json.loads(settings.read_text()), "max_seq_length": 8})
    ds = built_and_served(folder, texts, store)
    assert max(ds[i]["tokens"].shape[0] for i in range(len(ds))) == 8
    assert_sentence_embeddings_equal(ds, folder)

    # Its tokenizer: "the" unknown from now on.
    tokenizer = folder / "0_Transformer" / "tokenizer.json"
    saved = json.loads(tokenizer.read_text())
    saved["model"]["vocab"]["the-not"] = saved["model"]["vocab"].pop("the")
    write_json(tokenizer, saved)
    ds = built_and_served(folder, texts, store)
    assert_sentence_embeddings_equal(ds, folder)

    # Its weights: each moved a little.
    before = load_encoder(folder).fingerprint
    weights = folder / "0_Transformer" / "model.safetensors"
    moved = {k: v + 0.05 * torch.randn_like(v) for k, v in safetensors.load_file(weights).items()}
    safetensors.save_file(moved, weights)
    assert load_encoder(folder).fingerprint != before
    ds = built_and_served(folder, texts, store)
    assert_sentence_embeddings_equal(ds, folder)


# == prompts and truncate_dim ======================================================================
#: A prompt of the tiny vocabulary's words and two unknown ones: 6 tokens before each text.
PROMPT = "a photo of two queries: "
PROMPTS = {"query": PROMPT, "document": "", "other": "the "}


@pytest.mark.parametrize(
    ("modes", "include_prompt"),
    [
        (("mean",), True),
        (("mean", "max"), False),
        (("cls", "lasttoken"), False),
        (("weightedmean", "mean_sqrt_len_tokens"), False),
    ],
)
def test_a_default_prompt_is_put_before_each_text_as_encode_does(
    modes: tuple[str, ...], include_prompt: bool, bert: Path, texts: Path, tmp_path: Path
) -> None:
    """``default_prompt_name`` names a prompt: ``encode`` tokenises ``prompt + text`` (cut at
    the model's 64 positions with the prompt) and, with ``include_prompt: false``, pools the
    text's tokens alone."""
    folder = save_sentence_model(
        tmp_path / "prompted", bert, modes, include_prompt=include_prompt,
        prompts=PROMPTS, default_prompt_name="query",
    )  # fmt: skip
    ds = built_and_served(folder, texts, tmp_path / "store")
    dog = [Path(ds.path(i)).read_text() for i in range(len(ds))].index("dog")
    assert ds[dog]["tokens"].shape[0] == 9  # [CLS] a photo of two [UNK] [UNK] dog [SEP]
    assert_sentence_embeddings_equal(ds, folder)
    if not include_prompt:  # leaving the prompt out is what makes these equal
        model = st.SentenceTransformer(str(folder), device="cpu")
        model.set_pooling_include_prompt(True)
        pooled_whole = model.encode(["dog"], convert_to_tensor=True)[0]
        assert not torch.allclose(pooled_whole, ds[dog][SENTENCE_EMBEDDING], atol=1e-3)


def test_a_prompt_changed_between_build_and_serve_is_not_served_stale(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(
        tmp_path / "changed", bert, "mean", prompts=PROMPTS, default_prompt_name="query"
    )
    store = tmp_path / "store"
    built_and_served(folder, texts, store)
    settings = folder / "config_sentence_transformers.json"
    write_json(settings, {**json.loads(settings.read_text()), "default_prompt_name": "other"})
    with pytest.warns(UserWarning, match="6 of 6 items"):  # the prompt is in the key
        ds = CachedFeatureDataset(
            texts, encoder=folder, cache=store, source="text", on_miss="encode"
        )
    assert_sentence_embeddings_equal(ds, folder)
    assert_sentence_embeddings_equal(built_and_served(folder, texts, store), folder)


def test_prompts_without_a_default_change_nothing(bert: Path, texts: Path, tmp_path: Path) -> None:
    """``encode`` puts no prompt before a text where the folder names no default one: the
    folder keeps the keys it had without prompts, and its store serves it."""
    folder = save_sentence_model(tmp_path / "no-default", bert, "mean")
    store = tmp_path / "store"
    built_and_served(folder, texts, store)
    settings = folder / "config_sentence_transformers.json"
    write_json(settings, {**json.loads(settings.read_text()), "prompts": PROMPTS})
    assert build(texts, folder, cache=store, batching="padded").encoded == 0
    ds = CachedFeatureDataset(texts, encoder=folder, cache=store, source="text", on_miss="error")
    assert_sentence_embeddings_equal(ds, folder)


def test_a_prompt_is_lowercased_with_the_text_where_the_folder_lowercases(
    texts: Path, tmp_path: Path
) -> None:
    """``do_lower_case`` on a cased tokenizer: "The" of the prompt is "the" to encode too."""
    cased = save_cased_bert(tmp_path / "cased-bert")
    folder = save_sentence_model(
        tmp_path / "lower", cased, "mean", prompts={"query": "The Photo of "},
        default_prompt_name="query",
    )  # fmt: skip
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 64, "do_lower_case": True})
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert_sentence_embeddings_equal(ds, folder)


def test_truncate_dim_keeps_the_first_values_as_encode_does(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "matryoshka", bert, "mean", truncate_dim=12)
    assert json.loads((folder / "config_sentence_transformers.json").read_text())[
        "truncate_dim"
    ] == 12  # fmt: skip
    ds = built_and_served(folder, texts, tmp_path / "store")
    assert ds[0][SENTENCE_EMBEDDING].shape == (12,)
    assert_sentence_embeddings_equal(ds, folder)


def test_a_default_prompt_naming_no_prompt_is_refused_in_one_line_and_tokens_build(
    bert: Path, texts: Path, tmp_path: Path
) -> None:
    folder = save_sentence_model(tmp_path / "unnamed", bert, "mean", prompts=PROMPTS)
    settings = folder / "config_sentence_transformers.json"
    write_json(settings, {**json.loads(settings.read_text()), "default_prompt_name": "passage"})
    with pytest.raises(ValueError, match="passage"):
        st.SentenceTransformer(str(folder), device="cpu")  # sentence-transformers refuses it
    asked = Recipe(source="text", output=SENTENCE_EMBEDDING)
    with pytest.raises(ConfigError, match="'passage'") as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=asked)
    assert "\n" not in str(refused.value)
    report = build(texts, folder, cache=tmp_path / "store")
    assert report.encoded == len(TEXTS) + 1 and not report.failed


# == loading arguments =============================================================================
def edit_settings(folder: Path, **changes: Any) -> None:
    """``changes`` written over the transformer's ``sentence_bert_config.json``."""
    settings = folder / "sentence_bert_config.json"
    write_json(settings, {**json.loads(settings.read_text()), **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"processor_kwargs": {"model_max_length": 8}, "max_seq_length": 32},  # its own wins
        {"tokenizer_args": {"model_max_length": 10, "truncation_side": "left"}},
        {"tokenizer_args": {"do_lower_case": False}},  # "The" is unknown to a cased tokenizer
        {"config_kwargs": {"layer_norm_eps": 0.5}},
        {"config_args": {"hidden_act": "relu"}},
        {"model_kwargs": {"attn_implementation": "eager", "add_pooling_layer": False}},
    ],
    ids=["model_max_length", "truncation_side", "do_lower_case", "layer_norm_eps", "hidden_act",
         "attn_implementation"],
)  # fmt: skip
def test_loading_arguments_are_honoured_as_sentence_transformers_loads_and_keyed(
    changes: dict[str, Any], bert: Path, texts: Path, tmp_path: Path
) -> None:
    """The transformer's settings pass arguments to transformers' loading (the model's, the
    tokenizer's, the config's; older names too): featbake loads with them as
    sentence-transformers does, and a store built before they were set misses every text."""
    folder = save_sentence_model(tmp_path / "loading", bert, "mean")
    store = tmp_path / "store"
    built_and_served(folder, texts, store)
    edit_settings(folder, **changes)
    ds = built_and_served(folder, texts, store)  # other keys: every text encoded again
    assert_sentence_embeddings_equal(ds, folder)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_args": {"torch_dtype": "bfloat16"}}, "bfloat16"),
        ({"config_kwargs": {"dtype": "float16"}}, "float16"),
        ({"model_kwargs": {"quantization_config": {"load_in_8bit": True}}}, "quantization_config"),
        ({"model_kwargs": {"attn_implementation": "flash_attention_2"}}, "flash_attention_2"),
        ({"processor_kwargs": {"padding_side": "left"}}, "padding_side"),
        ({"config_kwargs": []}, "config_kwargs"),
    ],
)
def test_loading_arguments_featbake_does_not_reproduce_refuse_sentence_embedding(
    changes: dict[str, Any], named: str, bert: Path, texts: Path, tmp_path: Path
) -> None:
    """Another dtype than float32 (sentence-transformers encodes in it), quantisation, flash
    attention (run unpadded), left padding (other positions): ``sentence_embedding`` is
    refused in one line naming the argument, and the folder's tokens still build."""
    folder = save_sentence_model(tmp_path / "refused", bert, "mean")
    edit_settings(folder, **changes)
    asked = Recipe(source="text", output=SENTENCE_EMBEDDING)
    with pytest.raises(ConfigError, match=named) as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=asked)
    assert "\n" not in str(refused.value) and "--output tokens" in str(refused.value)
    report = build(texts, folder, cache=tmp_path / "store")
    assert report.encoded == len(TEXTS) + 1 and not report.failed


def test_a_model_saved_in_bfloat16_is_refused_until_its_settings_ask_for_float32(
    texts: Path, tmp_path: Path
) -> None:
    """transformers 5 loads a model in the dtype its config.json names: sentence-transformers
    encodes a bfloat16 folder in bfloat16, featbake in float32, so its ``sentence_embedding``
    is refused; ``model_kwargs: {"dtype": "float32"}`` makes both encode in float32."""
    bert = save_bert(tmp_path / "bert")
    half = tmp_path / "bert-bf16"
    transformers.AutoModel.from_pretrained(str(bert), dtype=torch.bfloat16).save_pretrained(half)
    transformers.AutoTokenizer.from_pretrained(str(bert)).save_pretrained(half)
    folder = save_sentence_model(tmp_path / "half", half, "mean")
    if st.SentenceTransformer(str(folder), device="cpu").dtype != torch.bfloat16:
        pytest.skip("this transformers loads a model in float32 whatever its config says")
    asked = Recipe(source="text", output=SENTENCE_EMBEDDING)
    with pytest.raises(ConfigError, match="bfloat16") as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=asked)
    assert "\n" not in str(refused.value)
    edit_settings(folder, model_kwargs={"dtype": "float32"})
    assert_sentence_embeddings_equal(built_and_served(folder, texts, tmp_path / "store"), folder)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_bin_only_model_saved_in_half_with_no_dtype_set_is_refused(
    dtype: torch.dtype, texts: Path, tmp_path: Path
) -> None:
    """A folder whose weights are a ``pytorch_model.bin`` alone and whose config names no
    dtype: transformers 5 takes the dtype from that file's tensors, so sentence-transformers
    encodes a float16 one in float16 (featbake, reading safetensors headers alone, took it
    for float32: its ``sentence_embedding`` served float32 values); a float32 one builds and
    equals sentence-transformers."""
    bert = save_bert(tmp_path / "bert")
    if dtype != torch.float32:
        half = tmp_path / "bert-half"
        transformers.AutoModel.from_pretrained(str(bert), dtype=dtype).save_pretrained(half)
        transformers.AutoTokenizer.from_pretrained(str(bert)).save_pretrained(half)
        bert = half
    folder = save_sentence_model(tmp_path / "bin", bert, "mean")
    # transformers 5 saves safetensors alone: the weights pickled by hand, the dtype unsaid
    weights = folder / "model.safetensors"
    torch.save(safetensors.load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    config = json.loads((folder / "config.json").read_text())
    write_json(folder / "config.json", {k: v for k, v in config.items() if "dtype" not in k})
    loaded = st.SentenceTransformer(str(folder), device="cpu").dtype
    if loaded != dtype:
        pytest.skip("this transformers loads a model in float32 whatever its weights are")
    if dtype == torch.float32:
        served = built_and_served(folder, texts, tmp_path / "store")
        assert_sentence_embeddings_equal(served, folder)
        return
    asked = Recipe(source="text", output=SENTENCE_EMBEDDING)
    with pytest.raises(ConfigError, match="float16 \\(its weights\\)") as refused:
        build(texts, folder, cache=tmp_path / "store", recipe=asked)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("container", ["safetensors", "bin"])
@pytest.mark.parametrize("half", ["first", "later"])
def test_mixed_dtype_weights_take_the_dtype_transformers_loads(
    tmp_path: Path, container: str, half: str
) -> None:
    """transformers' "auto" takes the first floating tensor's dtype of the first weights
    file (safetensors lists its tensors by name; a ``.bin`` in its saved order). featbake
    read a safetensors file as "any dtype but float32", so a float32 file holding some
    float16 tensors was refused for ``sentence_embedding`` though both load it in float32;
    both containers follow transformers' rule now, checked against transformers run now."""
    from featbake.encode.hf_folders import weights_dtype

    bert = save_bert(tmp_path / "bert")
    state = safetensors.load_file(bert / "model.safetensors")
    first = sorted(state)[0]  # embeddings.*: first by name and in saved order alike
    halved = [first] if half == "first" else [n for n in state if n.startswith("pooler.")]
    assert halved and next(iter(state)) == first
    mixed = {n: t.half() if n in halved else t for n, t in state.items()}
    (bert / "model.safetensors").unlink()
    if container == "safetensors":
        safetensors.save_file(mixed, bert / "model.safetensors")
    else:
        torch.save(mixed, bert / "pytorch_model.bin")
    config = json.loads((bert / "config.json").read_text())
    write_json(bert / "config.json", {k: v for k, v in config.items() if "dtype" not in k})
    loaded = transformers.AutoModel.from_pretrained(str(bert)).dtype
    if loaded == torch.float32 and half == "first":
        pytest.skip("this transformers loads a model in float32 whatever its weights are")
    assert loaded == (torch.float16 if half == "first" else torch.float32)
    assert weights_dtype(bert) == (None if loaded == torch.float32 else "float16")


@pytest.mark.parametrize("layout", ["single beside shards", "index states a dtype"])
def test_a_sharded_folders_dtype_is_read_where_transformers_reads_it(
    tmp_path: Path, layout: str
) -> None:
    """transformers reads ``model.safetensors`` before ``model.safetensors.index.json``, and a
    sharded folder's dtype from its index's ``metadata.dtype`` where it states one: featbake
    read the index first and never its metadata (a float32 single file beside float16 shards
    was refused for ``sentence_embedding``; float32 shards stated float16 were taken for
    float32). Checked against transformers' own load."""
    from featbake.encode.hf_folders import weights_dtype

    bert = save_bert(tmp_path / "bert")
    state = safetensors.load_file(bert / "model.safetensors")
    names = sorted(state)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    half = layout == "single beside shards"
    index = {"metadata": {} if half else {"dtype": "float16"}, "weight_map": {}}
    for i, part in enumerate(halves):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: state[n].half() if half else state[n] for n in part}
        safetensors.save_file(tensors, bert / shard)
        index["weight_map"].update(dict.fromkeys(part, shard))
    write_json(bert / "model.safetensors.index.json", index)
    if not half:
        (bert / "model.safetensors").unlink()  # the shards alone
    config = json.loads((bert / "config.json").read_text())
    write_json(bert / "config.json", {k: v for k, v in config.items() if "dtype" not in k})
    loaded = transformers.AutoModel.from_pretrained(str(bert)).dtype
    if loaded == torch.float32 and not half:
        pytest.skip("this transformers loads a model in float32 whatever its index says")
    assert loaded == (torch.float32 if half else torch.float16)
    assert weights_dtype(bert) == (None if half else "float16")


#: A Greek word ending in a capital sigma, which lowercases to a final sigma in Python alone.
GREEK_WORD = "\u039f\u0394\u039f\u03a3"
#: Its stem and its sigma as the tokenizer lowercases them (a word-piece each), and the whole
#: word with the final sigma ``str.lower`` gives.
GREEK_PIECES = ["\u03bf\u03b4\u03bf", "##\u03c3", "\u03bf\u03b4\u03bf\u03c2"]


def test_do_lower_case_lowercases_in_the_tokenizer_as_sentence_transformers(
    tmp_path: Path,
) -> None:
    """sentence-transformers lowercases in the tokenizer's normaliser, after special tokens
    are split off, a character at a time: "[MASK]" stays the mask token and a final capital
    sigma the plain small sigma; ``str.lower`` first gave "[mask]" (no special token) and the
    final sigma (another word of the vocabulary)."""
    cased = tmp_path / "cased-bert"
    save_bert(cased, words=["the", "a", "cat", "sat", *GREEK_PIECES])
    vocab = cased.parent / f"{cased.name}-vocab" / "vocab.txt"
    transformers.BertTokenizer(str(vocab), do_lower_case=False).save_pretrained(cased)
    folder = save_sentence_model(tmp_path / "lower", cased, "mean", include_prompt=False,
                                 prompts={"query": "A "}, default_prompt_name="query")  # fmt: skip
    edit_settings(folder, do_lower_case=True)
    root = tmp_path / "texts"
    root.mkdir()
    for i, text in enumerate(["the [MASK] sat", f"THE {GREEK_WORD}", "The cat sat"]):
        (root / f"text{i}.txt").write_text(text, encoding="utf-8")
    build(root, folder, cache=tmp_path / "store", batching="padded", batch_size=4)
    ds = CachedFeatureDataset(
        root, encoder=folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert_sentence_embeddings_equal(ds, folder)
