"""``--source text``: captions through Hugging Face text folders (a BERT-style encoder with a real
WordPiece tokenizer, a CLIP text model with projection, a T5 encoder), each built from a config
and saved with save_pretrained beside its tokenizer.

The reference is transformers itself: the tokenizer called directly on the file's text and the
model run now, with no featbake code between them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.hf import HFTextEncoder, WeightsMismatch, recipe_for_encoder
from featbake.encode.hf_folders import text_recipe_for_folder, tokenizer_libraries
from featbake.encode.loaders import load_encoder
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.encode.sources import TextSource
from featbake.encode.texts import TextRows
from featbake.errors import CacheMiss, ConfigError, EncoderLoadError, SourceError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from tests.conftest import invoke
from tests.helpers import held_by_a_thread, rel_error

transformers = pytest.importorskip("transformers")

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "red",
    "blue",
    "big",
    "small",
    "and",
    "ran",
    ".",
    "photo",
    "of",
    "two",
]
TEXTS = [
    "The cat sat on the mat.",
    "a big red dog ran",
    "two small blue cats and a big dog sat on the red mat and the dog ran",
    "dog",
    "A photo of two cats.",
]
#: Relative error a padded batch may show against the same text alone (fp32: summation order).
TOLERANCE = 1e-5


class TextModel(NamedTuple):
    """A saved text folder and how to run it without featbake."""

    folder: Path
    kind: str  # bert, clip or t5
    max_length: int  # the recipe's default: the smaller of the tokenizer's and model's limits


def bert_tokenizer(where: Path, words: list[str]) -> Any:
    """A real WordPiece tokenizer from a vocab file written here (BERT's special tokens first)."""
    where.mkdir(parents=True)
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, "##s", "##ed"]
    (where / "vocab.txt").write_text("\n".join(pieces) + "\n")
    return transformers.BertTokenizer.from_pretrained(str(where))


def save_bert(folder: Path, words: list[str] = WORDS) -> Path:
    tokenizer = bert_tokenizer(folder.parent / f"{folder.name}-vocab", words)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def clip_tokenizer() -> Any:
    """A byte-pair tokenizer of CLIP's kind: letters, end-of-word letters and a few merges."""
    letters = list("abcdefghijklmnopqrstuvwxyz.")
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({c + "</w>": len(letters) + i for i, c in enumerate(letters)})
    merges = [("t", "h"), ("th", "e</w>"), ("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges)


def save_clip(folder: Path) -> Path:
    tokenizer = clip_tokenizer()
    torch.manual_seed(1)
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=24, projection_dim=16,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.CLIPTextModelWithProjection(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_t5(folder: Path) -> Path:
    """A T5 encoder with a unigram tokenizer built by the tokenizers library (no sentencepiece)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0 - 0.1 * i) for i, w in enumerate(WORDS)]
    pieces += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz.\u2581"]
    tokenizer = transformers.T5Tokenizer(vocab=pieces, extra_ids=0)
    torch.manual_seed(2)
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    transformers.T5EncoderModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: BERTweet's byte-pair merges of the words in :data:`BERTWEET_TEXT` (fastBPE's ``a b count``).
BERTWEET_MERGES = ["t h", "th e</w>", "c a", "ca t</w>", "d o", "do g</w>"]
BERTWEET_TEXT = "the cat the dog"


def save_bertweet(folder: Path, *, normalization: bool = False, positions: int = 130) -> Path:
    """A RoBERTa with BERTweet's tokenizer, whose files are ``vocab.txt`` and ``bpe.codes``
    (neither ``tokenizer.json`` nor ``merges.txt``): letters, end-of-word letters, a few words."""
    folder.mkdir(parents=True)
    letters = list("abcdefghijklmnopqrstuvwxyz.:_")
    pieces = [c + "@@" for c in letters] + letters + ["th@@", "the", "ca@@", "cat", "do@@", "dog"]
    (folder / "vocab.txt").write_text("".join(f"{p} 1\n" for p in pieces))
    (folder / "bpe.codes").write_text("".join(f"{m} 1\n" for m in BERTWEET_MERGES))
    tokenizer = transformers.BertweetTokenizer(
        str(folder / "vocab.txt"), str(folder / "bpe.codes"), normalization=normalization
    )
    tokenizer.save_pretrained(folder)
    torch.manual_seed(3)
    config = transformers.RobertaConfig(
        vocab_size=len(tokenizer) + 2, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.RobertaModel(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TextModel]:
    root = tmp_path_factory.mktemp("text-models")
    return {
        "bert": TextModel(save_bert(root / "bert"), "bert", 64),
        "clip": TextModel(save_clip(root / "clip"), "clip", 24),
        "t5": TextModel(save_t5(root / "t5"), "t5", 512),
    }


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("captions")
    for i, text in enumerate(TEXTS):
        (root / f"caption{i}.txt").write_text(text, encoding="utf-8")
    # Longer than CLIP's 24 positions: cut by the tokenizer, as the user's own call would.
    (root / "long.txt").write_text(" ".join(["the cat sat on the mat"] * 8), encoding="utf-8")
    return root


class Reference(NamedTuple):
    """transformers' own outputs for one text: the parts featbake serves."""

    ids: list[int]
    parts: dict[str, torch.Tensor]


def transformers_outputs(model: TextModel, text: str, **options: Any) -> Reference:
    """Tokenizer called directly, model run now: no featbake code."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model.folder))
    enc = tokenizer(text, truncation=True, max_length=model.max_length, return_tensors="pt")
    enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    with torch.inference_mode():
        if model.kind in ("bert", "roberta"):
            out = transformers.AutoModel.from_pretrained(str(model.folder)).eval()(**enc)
            parts = {"tokens": out.last_hidden_state[0], "pooled": out.pooler_output[0]}
        elif model.kind == "clip":
            net = transformers.CLIPTextModelWithProjection.from_pretrained(str(model.folder))
            out = net.eval()(**enc)
            pooled = net.text_model(**enc).pooler_output[0]
            parts = {"tokens": out.last_hidden_state[0], "pooled": pooled}
            parts["text_embeds"] = out.text_embeds[0]
        else:
            out = transformers.T5EncoderModel.from_pretrained(str(model.folder)).eval()(**enc)
            parts = {"tokens": out.last_hidden_state[0]}
    return Reference(enc["input_ids"][0].tolist(), parts)


def assert_served_equal(
    ds: CachedFeatureDataset, model: TextModel, bad: frozenset[str] = frozenset()
) -> None:
    """Every item but those named in ``bad`` equals transformers' outputs for its text."""
    for i in range(len(ds)):
        path = ds.path(i)
        if Path(path).name in bad:
            continue
        want = transformers_outputs(model, Path(path).read_text(encoding="utf-8"))
        got = ds[i]
        assert set(got) == set(want.parts), path
        # No padding rows: one row per token of this text alone.
        assert got["tokens"].shape[0] == len(want.ids), path
        for part, value in want.parts.items():
            assert rel_error(got[part], value) < TOLERANCE, (path, part)


# == served == transformers run now ================================================================
@pytest.mark.parametrize("kind", ["bert", "clip", "t5"])
def test_built_text_features_equal_transformers_run_now(
    kind: str, models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    model = models[kind]
    report = build(texts, model.folder, cache=tmp_path / "store", batching="padded")
    assert report.encoded == len(TEXTS) + 1 and not report.failed
    assert report.batching == "padded", report.batching_note
    ds = CachedFeatureDataset(
        texts, encoder=model.folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert ds.recipe.source == "text" and ds.recipe.text is not None
    assert ds.recipe.text.max_length == model.max_length
    assert_served_equal(ds, model)


def test_long_text_is_cut_to_the_models_positions(
    models: dict[str, TextModel], texts: Path
) -> None:
    clip = models["clip"]
    recipe = recipe_for_encoder(clip.folder, Recipe(source="text"))
    ids = TextSource(recipe).load(texts / "long.txt")
    assert ids.shape == (24,)  # the whole text is over 40 tokens; CLIP's table has 24 rows
    assert ids.tolist() == transformers_outputs(clip, (texts / "long.txt").read_text()).ids


def test_dataset_encodes_text_live_equal_to_transformers(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    """``CachedFeatureDataset(folder, encoder=bert_folder, cache=..., source="text")`` with
    nothing built: each miss is tokenised and encoded live, and written back."""
    bert = models["bert"]
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(
            texts, encoder=bert.folder, cache=tmp_path / "store", source="text"
        )
    assert_served_equal(ds, bert)
    again = CachedFeatureDataset(
        texts, encoder=bert.folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert_served_equal(again, bert)  # written back under the keys a build would use


# == padded batches ================================================================================
@pytest.mark.parametrize("kind", ["bert", "clip", "t5"])
def test_padded_text_batch_equals_each_text_alone(
    kind: str, models: dict[str, TextModel], texts: Path
) -> None:
    folder = models[kind].folder
    recipe = recipe_for_encoder(folder, Recipe(source="text"))
    source = TextSource(recipe)
    ids = [source.load(p) for p in sorted(texts.glob("*.txt"))]
    assert len({len(x) for x in ids}) > 2  # the batch really pads
    encoder = load_encoder(folder)
    padded = encode_padded(encoder, ids, recipe)
    for x, got in zip(ids, padded, strict=True):
        alone = encode_batch(encoder, [x], recipe)[0]
        assert got["tokens"].shape[0] == len(x)
        assert set(got) == set(alone)
        for part in alone:
            assert rel_error(got[part], alone[part]) < TOLERANCE, part


def test_padded_pooled_alone_with_output(models: dict[str, TextModel], texts: Path) -> None:
    """``--output pooled`` keeps each text's pooled vector whole in a padded batch (it has one
    row per text, not one per token)."""
    folder = models["bert"].folder
    recipe = recipe_for_encoder(folder, Recipe(source="text", output="pooled"))
    source = TextSource(recipe)
    ids = [source.load(p) for p in sorted(texts.glob("caption*.txt"))]
    encoder = load_encoder(folder)
    for x, got in zip(ids, encode_padded(encoder, ids, recipe), strict=True):
        assert got[""].shape == (32,)
        assert rel_error(got[""], encode_batch(encoder, [x], recipe)[0][""]) < TOLERANCE


def test_guard_falls_back_where_padding_changes_text_features(
    models: dict[str, TextModel], texts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text model run without its attention mask attends to the padding: the exactness guard
    sees it, the build goes on one text at a time, and every stored feature is the exact one."""

    def unmasked(self: HFTextEncoder, input_ids: torch.Tensor, lengths: torch.Tensor) -> Any:
        out = self.model(input_ids=input_ids)
        return {"tokens": out.last_hidden_state, "pooled": out.pooler_output}, lengths

    monkeypatch.setattr(HFTextEncoder, "forward", unmasked)
    bert = models["bert"]
    report = build(texts, bert.folder, cache=tmp_path / "store", batching="padded", batch_size=8)
    assert report.batching == "exact", report.batching_note
    assert "not exact" in report.batching_note
    ds = CachedFeatureDataset(
        texts, encoder=bert.folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert_served_equal(ds, bert)  # unmasked alone == masked alone: no padding to attend to


# == keys ==========================================================================================
def text_recipe_fp(folder: Path, **changes: Any) -> str:
    base = recipe_for_encoder(folder, Recipe(source="text"))
    assert base.text is not None
    return (
        base.replace(text=base.text.replace(**changes)).fingerprint()
        if changes
        else (base.fingerprint())
    )


@pytest.mark.parametrize(
    "change",
    [{"max_length": 8}, {"truncate": False}, {"lowercase": True}, {"special_tokens": False}],
)
def test_a_tokenizer_option_changes_the_key(
    change: dict[str, Any], models: dict[str, TextModel]
) -> None:
    folder = models["bert"].folder
    assert text_recipe_fp(folder, **change) != text_recipe_fp(folder)


def test_another_tokenizer_gives_other_keys_and_a_copy_the_same(
    models: dict[str, TextModel], tmp_path: Path
) -> None:
    bert = models["bert"].folder
    copy = tmp_path / "elsewhere" / "bert"
    shutil.copytree(bert, copy)
    assert text_recipe_fp(copy) == text_recipe_fp(bert)  # the path is not in the key
    # The same weights beside another vocabulary: another tokenizer, other keys.
    other = tmp_path / "other"
    shutil.copytree(bert, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["do_lower_case"] = False
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert text_recipe_fp(other) != text_recipe_fp(bert)


def test_a_changed_option_bakes_other_keys(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    bert = models["bert"].folder
    first = build(texts, bert, cache=tmp_path / "store")
    again = build(texts, bert, cache=tmp_path / "store")
    assert (first.encoded, again.encoded, again.reused) == (6, 0, 6)
    steps = recipe_for_encoder(bert, Recipe(source="text")).text
    assert steps is not None
    short = Recipe(source="text", text=steps.replace(max_length=4))
    assert build(texts, bert, cache=tmp_path / "store", recipe=short).encoded == 6


def test_a_tokenizer_changed_after_the_recipe_is_refused(
    models: dict[str, TextModel], tmp_path: Path
) -> None:
    folder = tmp_path / "bert"
    shutil.copytree(models["bert"].folder, folder)
    recipe = recipe_for_encoder(folder, Recipe(source="text"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    with pytest.raises(ConfigError, match="changed since"):
        TextSource(recipe)


def test_a_tokenizer_file_of_its_own_class_is_in_the_key(tmp_path: Path) -> None:
    """BERTweet's merges are in ``bpe.codes``, a file outside the list every tokenizer may
    read, so it was not in the key: edited after a build, the store kept serving the old
    merges' features (14 tokens where the tokenizer now gives 10) under the same keys. Now
    the class's own files are keyed: the store misses, and what is encoded is transformers'
    tokenizer and model run now. A README beside the model is not the tokenizer's and does
    not re-key."""
    folder = save_bertweet(tmp_path / "bertweet")
    bertweet = TextModel(folder, "roberta", 128)
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text(BERTWEET_TEXT)
    before = text_recipe_fp(folder)
    (folder / "README.md").write_text("a tiny BERTweet\n")
    assert text_recipe_fp(folder) == before
    build(data, folder, cache=tmp_path / "store", workers=0)
    built = transformers_outputs(bertweet, BERTWEET_TEXT).ids
    (folder / "bpe.codes").write_text("".join(f"{m} 1\n" for m in BERTWEET_MERGES[2:]))
    assert len(transformers_outputs(bertweet, BERTWEET_TEXT).ids) < len(built)  # fewer merges
    assert_missed_then_served_as_run_now(data, folder, tmp_path / "store", bertweet)


def assert_missed_then_served_as_run_now(
    data: Path, folder: Path, store: Path, model: TextModel
) -> None:
    """The store built before the tokenizer changed misses (``on_miss="error"``), and a
    dataset that encodes its misses says it holds another tokenizer's features and serves
    what transformers gives now."""
    stale = CachedFeatureDataset(data, encoder=folder, cache=store, source="text", on_miss="error")
    with pytest.raises(CacheMiss):
        stale[0]
    with pytest.warns(UserWarning):  # the store holds another tokenizer's features: said so
        ds = CachedFeatureDataset(data, encoder=folder, cache=store, source="text")
    assert_served_equal(ds, model)


def test_an_optional_library_a_tokenizer_runs_is_in_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BERTweet's tokenizer spells an emoji out (``demojize``) only where the ``emoji`` package
    is importable. The key named the tokenizer's class and files, not the code that runs them:
    a store built where ``emoji`` was missing served its features where it is installed,
    though the tokenizer now gives other ids. Now the libraries a tokenizer's module imports
    are keyed with their versions ("absent" where missing, as here at first): the store
    misses, and what is encoded is transformers run now, ``emoji`` and all."""
    if importlib.util.find_spec("emoji") is not None:
        pytest.skip("emoji is installed here; the test installs its own")
    text = "cat \U0001f600"
    folder = save_bertweet(tmp_path / "bertweet", normalization=True)
    bertweet = TextModel(folder, "roberta", 128)
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text(text)
    build(data, folder, cache=tmp_path / "store", workers=0)
    built = transformers_outputs(bertweet, text).ids
    runs = tokenizer_libraries(transformers.AutoTokenizer.from_pretrained(folder))
    assert runs["transformers"] == f"transformers=={transformers.__version__}"
    assert runs["emoji"] == "absent" and runs["tokenizers"].startswith("tokenizers==")
    lib = tmp_path / "lib" / "emoji"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(
        "def demojize(text, **options):\n"
        "    return text.replace('\\U0001f600', ':grinning_face:')\n"
    )
    monkeypatch.syspath_prepend(lib.parent)
    monkeypatch.setitem(sys.modules, "emoji", importlib.import_module("emoji"))  # undone after
    assert len(transformers_outputs(bertweet, text).ids) > len(built)  # spelled out now
    assert_missed_then_served_as_run_now(data, folder, tmp_path / "store", bertweet)


# == bad texts =====================================================================================
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"caf\xe9 au lait", "not UTF-8 text (byte 0xe9 at offset 3)"),
        (b"", "the text is empty"),
        (b" \n\t\n", "the text is empty"),
    ],
)
def test_a_bad_text_is_one_line(
    content: bytes, message: str, models: dict[str, TextModel], tmp_path: Path
) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    source = TextSource(recipe_for_encoder(models["bert"].folder, Recipe(source="text")))
    with pytest.raises(SourceError, match=re.escape(message)) as err:
        source.load(path)
    assert "\n" not in str(err.value)


def test_without_truncation_a_long_text_is_refused(
    models: dict[str, TextModel], texts: Path
) -> None:
    steps = recipe_for_encoder(models["clip"].folder, Recipe(source="text")).text
    assert steps is not None
    source = TextSource(Recipe(source="text", text=steps.replace(truncate=False)))
    with pytest.raises(SourceError, match=r"over max_length 24"):
        source.load(texts / "long.txt")
    assert source.load(texts / "caption0.txt").shape[0] < 24


def test_text_source_survives_pickling_to_a_worker(
    models: dict[str, TextModel], texts: Path
) -> None:
    source = TextSource(recipe_for_encoder(models["t5"].folder, Recipe(source="text")))
    moved = pickle.loads(pickle.dumps(source))
    path = texts / "caption2.txt"
    assert torch.equal(moved.load(path), source.load(path))


def test_a_child_forked_while_a_thread_tokenises_tokenises_with_its_own(
    models: dict[str, TextModel], texts: Path
) -> None:
    """A DataLoader worker forked while a thread of its parent held the tokenizer's lock (a
    build's decode thread, a dataset's miss) inherited the lock held, and hung on its first
    text. The tokenizer and its lock are per process: the child loads and locks its own."""
    source = TextSource(recipe_for_encoder(models["bert"].folder, Recipe(source="text")))
    path = texts / "caption1.txt"
    want = source.load(path)
    parents = id(source._tokenizer)
    with held_by_a_thread(source._lock):  # a thread inside the tokenizer's lock at the fork
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang fails the test instead of stalling it
            ok = torch.equal(source.load(path), want) and id(source._tokenizer) != parents
            os._exit(0 if ok else 3)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 0
    assert id(source._tokenizer) == parents and torch.equal(source.load(path), want)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_encode_texts_equal_to_transformers(
    models: dict[str, TextModel], texts: Path, tmp_path: Path, context: str
) -> None:
    """Misses tokenised and encoded in DataLoader workers, forked or spawned (the dataset
    pickled): each worker loads its own tokenizer."""
    from torch.utils.data import DataLoader

    bert = models["bert"]
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(
            texts, encoder=bert.folder, cache=tmp_path / "store", source="text"
        )
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=context)
    for i, got in enumerate(loader):
        want = transformers_outputs(bert, Path(ds.path(i)).read_text(encoding="utf-8"))
        assert set(got) == set(want.parts)
        for part, value in want.parts.items():
            assert rel_error(got[part], value) < TOLERANCE, (ds.path(i), part)


def test_source_text_without_a_tokenizer_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        TextSource(Recipe(source="text"))


# == the CLI =======================================================================================
def test_cli_builds_a_folder_of_texts_and_skips_bad_ones(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    data = tmp_path / "captions"
    shutil.copytree(texts, data)
    (data / "latin1.txt").write_bytes(b"na\xefve")
    (data / "blank.txt").write_text("\n")
    bert = models["bert"].folder
    store = tmp_path / "store"
    result = invoke(
        "build", "--encoder", bert, "--data", data, "--cache", store, "--source", "text"
    )
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("failed")]
    assert len(lines) == 2
    assert any("latin1.txt" in line and "not UTF-8" in line for line in lines)
    assert any("blank.txt" in line and "empty" in line for line in lines)
    ds = CachedFeatureDataset(data, encoder=bert, cache=store, source="text", on_miss="error")
    assert len(ds) == len(TEXTS) + 1  # latin1.txt and blank.txt, which failed, left out
    assert_served_equal(ds, models["bert"], bad=frozenset({"latin1.txt", "blank.txt"}))
    (data / "latin1.txt").unlink()
    (data / "blank.txt").unlink()
    short = invoke(
        "build", "--encoder", bert, "--data", data, "--cache", store, "--max-tokens", "4", "--json"
    )
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout)["encoded"] == len(TEXTS) + 1  # other keys: encoded again


# == texts named by a manifest =====================================================================
def write_captions(path: Path, extra: list[str] = ()) -> None:  # type: ignore[assignment]
    """A JSON-lines manifest: one caption per row with an id and a label, then ``extra`` lines."""
    rows = [json.dumps({"id": f"c{i}", "caption": t, "label": i}) for i, t in enumerate(TEXTS)]
    path.write_bytes(("\n".join([*rows, *extra]) + "\n").encode("utf-8", "surrogateescape"))


def assert_rows_served_equal(ds: CachedFeatureDataset, model: TextModel, texts: list[str]) -> None:
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        want = transformers_outputs(model, text)
        got = ds[i]
        assert got["tokens"].shape[0] == len(want.ids), text
        for part, value in want.parts.items():
            assert rel_error(got[part], value) < TOLERANCE, (text, part)


def test_manifest_column_texts_equal_transformers_and_bad_rows_are_skipped(
    models: dict[str, TextModel], tmp_path: Path
) -> None:
    manifest = tmp_path / "captions.jsonl"
    bad = [
        '{"id": "n", "caption": 7}',
        '{"id": "e", "caption": ""}',
        "{not json",
        '{"id": "m", "text": "no caption column"}',
        '{"id": "u", "caption": "caf\udce9"}',  # the byte 0xe9 alone: not UTF-8
    ]
    write_captions(manifest, bad)
    bert = models["bert"]
    report = build(manifest, bert.folder, cache=tmp_path / "store", column="caption")
    assert report.encoded == len(TEXTS)
    reasons = dict(report.failed)
    assert set(reasons) == {f"captions.jsonl:{n}" for n in range(6, 11)}, reasons
    assert "holds int 7, not text" in reasons["captions.jsonl:6"]
    assert "is empty" in reasons["captions.jsonl:7"]
    assert "malformed JSON" in reasons["captions.jsonl:8"]
    assert "no 'caption' column" in reasons["captions.jsonl:9"]
    assert "not UTF-8 text (byte 0xe9)" in reasons["captions.jsonl:10"]
    ds = CachedFeatureDataset(
        manifest, encoder=bert.folder, cache=tmp_path / "store", source="text",
        column="caption", on_miss="error",
    )  # fmt: skip
    assert [ds.item_id(i) for i in range(len(ds))] == [f"c{i}" for i in range(len(TEXTS))]
    assert [ds.row(i) for i in range(len(ds))] == [{"label": i} for i in range(len(TEXTS))]
    assert_rows_served_equal(ds, bert, TEXTS)


def test_csv_texts_are_served_live_in_the_manifests_order(
    models: dict[str, TextModel], tmp_path: Path
) -> None:
    manifest = tmp_path / "captions.csv"
    ordered = [TEXTS[3], TEXTS[0], 'a "red" dog, big', TEXTS[2]]
    lines = ["text,split"] + [
        '"' + t.replace('"', '""') + '",train' for t in ordered
    ]  # the default column for text: "text"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t5 = models["t5"]
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(manifest, encoder=t5.folder, cache=tmp_path / "s", source="text")
    assert [ds.row(i) for i in range(len(ds))] == [{"split": "train"}] * len(ordered)
    assert_rows_served_equal(ds, t5, ordered)


def test_a_manifest_text_and_the_same_text_in_a_file_share_a_key(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "captions.jsonl"
    write_captions(manifest)
    folder = tmp_path / "files"
    folder.mkdir()
    for i in range(len(TEXTS)):
        shutil.copy(texts / f"caption{i}.txt", folder)
    clip = models["clip"].folder
    first = build(manifest, clip, cache=tmp_path / "store", column="caption")
    assert first.encoded == len(TEXTS)
    again = build(folder, clip, cache=tmp_path / "store")
    assert (again.encoded, again.reused) == (0, len(TEXTS))  # SHA-256 of the same UTF-8 bytes


def test_cli_builds_a_manifests_texts(models: dict[str, TextModel], tmp_path: Path) -> None:
    manifest = tmp_path / "captions.jsonl"
    write_captions(manifest, ['{"id": "x", "caption": "  "}'])
    bert = models["bert"].folder
    store = tmp_path / "store"
    args = ["build", "--encoder", bert, "--data", manifest, "--cache", store]
    result = invoke(*args, "--source", "text", "--column", "caption")
    assert result.returncode == 3, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed")]
    assert failed == ["failed captions.jsonl:6: column 'caption' is empty"]
    ds = CachedFeatureDataset(
        manifest, encoder=bert, cache=store, source="text", column="caption", on_miss="error"
    )
    assert_rows_served_equal(ds, models["bert"], TEXTS)


def test_roots_show_each_text_roots_tokenizer_and_limit(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    """Two roots that differ only in ``--max-tokens`` must not look alike in ``featbake roots``."""
    bert = models["bert"].folder
    store = tmp_path / "store"
    build(texts, bert, cache=store)
    steps = recipe_for_encoder(bert, Recipe(source="text")).text
    assert steps is not None
    build(texts, bert, cache=store, recipe=Recipe(source="text", text=steps.replace(max_length=4)))
    shown = invoke("roots", "--cache", store)
    assert shown.returncode == 0, shown.stderr
    tokenizer = f"tokenizer {steps.tokenizer[:14]}"
    assert f"text float32 {tokenizer} max 64 tokens" in shown.stdout
    assert f"text float32 {tokenizer} max 4 tokens" in shown.stdout


def tokens_alone_equal_run_now(
    ds: CachedFeatureDataset, model: Any, folder: Path, max_length: int
) -> None:
    """Each text ``ds`` serves is ``tokens`` alone, equal to ``model`` run now on the folder's
    tokenizer's ids of it (cut at ``max_length``)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    for i in range(len(ds)):
        enc = tokenizer(Path(ds.path(i)).read_text(), truncation=True, max_length=max_length)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([enc["input_ids"]])).last_hidden_state[0]
        assert set(ds[i]) == {"tokens"}
        assert rel_error(ds[i]["tokens"], want) < TOLERANCE


def test_a_masked_lm_folder_serves_its_base_models_tokens(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    """A BERT download is a ``BertForMaskedLM`` (no pooler, an unused ``cls.*`` head): its base
    model is run, the head's weights dropped (nothing random), and only ``tokens`` served."""
    folder = tmp_path / "mlm"
    torch.manual_seed(3)
    config = transformers.BertConfig.from_pretrained(str(models["bert"].folder))
    transformers.BertForMaskedLM(config).eval().save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(models["bert"].folder)).save_pretrained(folder)
    build(texts, folder, cache=tmp_path / "store")
    ds = CachedFeatureDataset(
        texts, encoder=folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    base = transformers.BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    tokens_alone_equal_run_now(ds, base, folder, 64)
    # A layer its config lacks is not a head: refused by name (before, dropped in silence)
    config.num_hidden_layers -= 1
    config.save_pretrained(folder)
    with pytest.raises(WeightsMismatch, match=r"\d+ unexpected \(bert\.encoder\.layer\.|"
                       r"\d+ unexpected \(encoder\.layer\."):  # fmt: skip
        load_encoder(folder)


def test_every_layer_of_a_t5_encoder(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    t5 = models["t5"]
    build(texts, t5.folder, cache=tmp_path / "store", recipe=Recipe(layers="all"))
    ds = CachedFeatureDataset(
        texts, encoder=t5.folder, cache=tmp_path / "store", source="text", layers="all",
        on_miss="error",
    )  # fmt: skip
    model = transformers.T5EncoderModel.from_pretrained(str(t5.folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(t5.folder))
    for i in range(len(ds)):
        enc = tokenizer(Path(ds.path(i)).read_text(), return_tensors="pt")
        with torch.inference_mode():
            hidden = model(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
        assert set(ds[i]) == {"layer0", "layer1", "layer2"}
        for k in range(3):
            assert rel_error(ds[i][f"layer{k}"], hidden[k][0]) < TOLERANCE


def test_a_text_folder_for_images_is_refused_in_one_line(models: dict[str, TextModel]) -> None:
    with pytest.raises(ConfigError, match=r"is a text model .* not image"):
        recipe_for_encoder(models["bert"].folder, Recipe(source="image"))
    # No --source: a text folder implies text, as a vision folder implies image.
    assert recipe_for_encoder(models["bert"].folder, Recipe()).source == "text"


def test_a_text_miss_advises_the_column_and_text_options_and_they_build_it(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    """The miss advice named neither --column nor the tokenizer options: the command it gave
    built other keys (or refused the manifest), and the dataset kept missing."""
    import shlex

    bert = models["bert"]
    store = tmp_path / "store"
    build(texts, bert.folder, cache=store)  # a store, built with other options
    manifest = tmp_path / "captions.jsonl"
    write_captions(manifest)
    steps = recipe_for_encoder(bert.folder, Recipe(source="text")).text
    assert steps is not None
    short = Recipe(source="text", text=steps.replace(max_length=4, lowercase=True))
    ds = CachedFeatureDataset(
        manifest, bert.folder, cache=store, column="caption", recipe=short, on_miss="error"
    )
    with pytest.raises(CacheMiss) as err:
        ds[0]
    command = re.search(r"Run `([^`]*)`", str(err.value))
    assert command is not None, str(err.value)
    args = shlex.split(command.group(1))
    for option in ("--column caption", "--source text", "--max-tokens 4", "--lowercase"):
        assert option in command.group(1), command.group(1)
    assert args[:2] == ["featbake", "build"]
    result = invoke(*args[1:])
    assert result.returncode == 0, result.stderr
    served = CachedFeatureDataset(
        manifest, bert.folder, cache=store, column="caption", recipe=short, on_miss="error"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bert.folder))
    net = transformers.BertModel.from_pretrained(str(bert.folder)).eval()
    for i, text in enumerate(TEXTS):
        enc = tokenizer(text.lower(), truncation=True, max_length=4, return_tensors="pt")
        with torch.inference_mode():
            want = net(enc["input_ids"], attention_mask=enc["attention_mask"])
        assert rel_error(served[i]["tokens"], want.last_hidden_state[0]) < TOLERANCE


def test_a_parquet_string_column_is_text_keyed_as_the_same_txt_file(
    models: dict[str, TextModel], texts: Path, tmp_path: Path
) -> None:
    """``--source text --column caption`` over a parquet file: each cell's UTF-8 bytes are the
    text (a string column was 'neither bytes nor an Audio/Image struct' before), keyed as a
    ``.txt`` file of the same bytes; a null or empty cell is a bad row naming its row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    captions = [*TEXTS, None, "  "]
    table = pa.table(
        {
            "id": [f"c{i}" for i in range(len(captions))],
            "caption": pa.array(captions, pa.string()),
            "label": list(range(len(captions))),
        }
    )
    parquet = tmp_path / "captions.parquet"
    pq.write_table(table, parquet, row_group_size=3)
    bert = models["bert"]
    store = tmp_path / "store"
    result = invoke(
        "build", "--encoder", bert.folder, "--data", parquet, "--cache", store,
        "--source", "text", "--column", "caption",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    failed = sorted(line for line in result.stderr.splitlines() if line.startswith("failed"))
    assert failed == [
        f"failed c5: {parquet}:5: the cell is null",
        f"failed c6: {parquet}:6: the cell's text is empty",
    ], failed
    with pytest.warns(UserWarning, match="2 row"):  # the two bad rows are no items
        ds = CachedFeatureDataset(
            parquet, bert.folder, cache=store, source="text", column="caption", on_miss="error"
        )
    assert [ds.item_id(i) for i in range(len(ds))] == [f"c{i}" for i in range(len(TEXTS))]
    assert ds.row(2) == {"label": 2}
    for i, text in enumerate(TEXTS):
        want = transformers_outputs(bert, text)
        for part, value in want.parts.items():
            assert rel_error(ds[i][part], value) < TOLERANCE, (text, part)
    files = tmp_path / "files"
    files.mkdir()
    for i in range(len(TEXTS)):
        shutil.copy(texts / f"caption{i}.txt", files)
    again = build(files, bert.folder, cache=store)
    assert (again.encoded, again.reused) == (0, len(TEXTS))  # the same bytes: the same keys


def test_a_text_tsv_with_a_byte_order_mark_and_open_quotes_serves_every_row(
    models: dict[str, TextModel], tmp_path: Path
) -> None:
    """Round four items 4 and 14 for texts: a TSV saved with a byte-order mark, whose captions
    open quotes. Before, the mark named the first column "\\ufeffid" (every id lost to line
    numbers) and CSV quoting ran the first caption over the next rows (rows gone in silence);
    now each row is an item under its id, served equal to transformers run now."""
    captions = ['"A quoted caption, never closed', *TEXTS[:3], 'say "cheese"']
    lines = ["id\ttext\tlabel"] + [f"t{i}\t{c}\t{i}" for i, c in enumerate(captions)]
    manifest = tmp_path / "captions.tsv"
    manifest.write_bytes(b"\xef\xbb\xbf" + ("\r\n".join(lines) + "\r\n").encode("utf-8"))
    bert = models["bert"]
    report = build(manifest, bert.folder, cache=tmp_path / "store")
    assert not report.failed and report.encoded == len(captions)
    ds = CachedFeatureDataset(
        manifest, encoder=bert.folder, cache=tmp_path / "store", source="text", on_miss="error"
    )
    assert [ds.item_id(i) for i in range(len(ds))] == [f"t{i}" for i in range(len(captions))]
    assert [ds.row(i) for i in range(len(ds))] == [{"label": str(i)} for i in range(len(captions))]
    assert_rows_served_equal(ds, bert, captions)


def test_a_text_column_no_row_holds_is_one_error_before_any_work(tmp_path: Path) -> None:
    """Round four item 14 for texts: a typo'd ``--column`` was a bad row per row (exit 3); now
    it is one line naming the columns there are (exit 8, as a table's), for JSONL and TSV."""
    jsonl = tmp_path / "captions.jsonl"
    write_captions(jsonl)
    with pytest.raises(
        SourceError, match=r"no column 'captoin' in any row \(columns: id, caption, label\)"
    ):
        TextRows(str(jsonl), "captoin").scan([".txt"])
    tsv = tmp_path / "captions.tsv"
    tsv.write_text("id\tcaption\n" + "".join(f"c{i}\t{t}\n" for i, t in enumerate(TEXTS)))
    with pytest.raises(SourceError, match=r"no column 'text' in any row \(columns: id, caption\)"):
        TextRows(str(tsv)).scan([".txt"])  # the default column: text


def long_and_short_built(
    folder: Path, tmp_path: Path, long: str, short: str
) -> CachedFeatureDataset:
    """A long and a short text (``long.txt``, ``short.txt``) built with ``folder`` into a store,
    and served from the store alone."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "long.txt").write_text(long, encoding="utf-8")
    (texts / "short.txt").write_text(short, encoding="utf-8")
    report = build(texts, folder, cache=tmp_path / "store", workers=0)
    assert report.encoded == 2 and not report.failed, report.failed
    return CachedFeatureDataset(
        texts, encoder=folder, cache=tmp_path / "store", source="text", on_miss="error"
    )


def test_a_roberta_text_is_cut_where_its_positions_end_not_two_past(tmp_path: Path) -> None:
    """RoBERTa's positions start past its padding id: a table of ``max_position_embeddings``
    rows holds ``pad_token_id + 1`` fewer tokens (514 rows: 512). Taken whole, every text
    longer than the tokens it holds failed at the table's end (exit 3) instead of being cut,
    where the tokenizer states no limit of its own (BERTweet's; some Hub tokenizers). It is
    cut to what the model holds now, served equal to transformers; a larger --max-tokens is
    one line before any work."""
    folder = save_bertweet(tmp_path / "roberta", positions=14)  # pad 1: 12 tokens
    ds = long_and_short_built(folder, tmp_path, " ".join([BERTWEET_TEXT] * 5), BERTWEET_TEXT)
    assert ds.recipe.text is not None and ds.recipe.text.max_length == 12
    assert_served_equal(ds, TextModel(folder, "roberta", 12))
    with pytest.raises(ConfigError, match="past the 12 tokens"):
        text_recipe_for_folder(folder, max_length=13)


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_a_text_folder_whose_vocabulary_file_is_missing_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """Without ``vocab.txt`` (T5: ``spiece.model``) and ``tokenizer.json``, transformers builds
    a tokenizer of the special tokens alone from ``tokenizer_config.json`` (T5's with ``▁``
    too), without a word: every text was stored as ``[CLS] [UNK] ... [SEP]`` (exit 0).
    Refused in one line naming the files its class reads."""
    folder = (save_bert if kind == "bert" else save_t5)(tmp_path / kind)
    for name in ("vocab.txt", "spiece.model", "tokenizer.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(EncoderLoadError, match="has none of its vocabulary files"):
        text_recipe_for_folder(folder)


def test_a_tokenizer_saved_as_tokenizer_json_alone_is_taken(tmp_path: Path) -> None:
    """transformers 5 saves a GPT-2-style tokenizer as ``tokenizer.json`` alone, where its
    class names ``vocab.json`` and ``merges.txt``: the vocabulary check's first form refused
    it, with advice (save it again) that made the same folder. ``tokenizer.json`` holds the
    whole vocabulary: taken, tokenising as transformers does."""
    import json

    folder = save_byte_level_roberta(tmp_path / "roberta")
    for name in ("vocab.json", "merges.txt"):
        (folder / name).unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # names no tokenizer.json among its files
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert "tokenizer.json" not in transformers.GPT2Tokenizer.vocab_files_names.values()
    recipe = text_recipe_for_folder(folder)
    ids = TextSource(Recipe(source="text", text=recipe)).token_ids("the cat sat", "t")
    want = transformers.AutoTokenizer.from_pretrained(str(folder))("the cat sat")["input_ids"]
    assert ids.tolist() == want


def test_max_tokens_past_the_positions_is_refused_only_where_a_table_ends(
    tmp_path: Path,
) -> None:
    """A ``--max-tokens`` past an absolute position table is one line before any work; a
    model of relative positions (DeBERTa-v3's layout: ``relative_attention`` without
    ``position_biased_input``), whose ``max_position_embeddings`` only sizes its buckets,
    runs any length, and the option is taken, as it was before the refusal."""
    import json

    folder = save_bert(tmp_path / "bert")  # 64 positions
    with pytest.raises(ConfigError, match="past the 64 tokens"):
        text_recipe_for_folder(folder, max_length=100)
    config = json.loads((folder / "config.json").read_text())
    relative = {"relative_attention": True, "position_biased_input": False}
    (folder / "config.json").write_text(json.dumps({**config, **relative}))
    assert text_recipe_for_folder(folder, max_length=100).max_length == 100
    # BERT's relative_key still has its tables of 64 (transformers 5 adds the absolute one).
    (folder / "config.json").write_text(
        json.dumps({**config, "position_embedding_type": "relative_key"})
    )
    with pytest.raises(ConfigError, match="past the 64 tokens"):
        text_recipe_for_folder(folder, max_length=100)


def save_byte_level_roberta(folder: Path) -> Path:
    """A RoBERTa with a byte-level BPE tokenizer trained here (RoBERTa's and GPT-2's kind,
    which keeps every byte of a text, a ``\\r`` included)."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(TEXTS * 3, vocab_size=320, min_frequency=1, special_tokens=specials)
    folder.mkdir(parents=True)
    bpe.save_model(str(folder))
    tokenizer = transformers.RobertaTokenizerFast.from_pretrained(str(folder))
    assert len(tokenizer) > len(specials)  # its vocabulary read (vocab.json, merges.txt)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(5)
    config = transformers.RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=66, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.RobertaModel(config).eval().save_pretrained(folder)
    return folder


def test_a_crlf_text_is_tokenised_as_its_bytes_in_a_file_and_a_cell_alike(
    tmp_path: Path,
) -> None:
    """A text's key names its bytes, whatever holds them: a carriage return is tokenised as it
    is in a ``.txt`` file and in a parquet cell alike (a cell's loader, pyarrow or
    ``datasets``, keeps it), so the two share a key and its features, equal to transformers
    run on the decoded bytes. (Translating newlines in files alone, as ``open(path).read()``
    does, gave one key two meanings; the README says to convert CRLF files.)"""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = save_byte_level_roberta(tmp_path / "roberta")
    model = TextModel(folder, "roberta", 64)
    raw = [b"the cat sat\r\non the mat\r\n", b"a big red dog\rran"]
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, data in enumerate(raw):
        (texts / f"t{i}.txt").write_bytes(data)
    report = build(texts, folder, cache=tmp_path / "store", workers=0)
    assert report.encoded == 2 and not report.failed, report.failed
    parquet = tmp_path / "cells.parquet"
    pq.write_table(pa.table({"text": [d.decode("utf-8") for d in raw]}), parquet)
    cells = build(parquet, folder, cache=tmp_path / "store", recipe=Recipe(source="text"),
                  column="text")  # fmt: skip
    assert (cells.encoded, cells.reused) == (0, 2)  # the same bytes: the same keys
    ds = CachedFeatureDataset(
        parquet, folder, cache=tmp_path / "store", source="text", column="text", on_miss="error"
    )
    for i, data in enumerate(raw):
        want = transformers_outputs(model, data.decode("utf-8"))
        assert ds[i]["tokens"].shape[0] == len(want.ids)
        for part, value in want.parts.items():
            assert rel_error(ds[i][part], value) < TOLERANCE, (data, part)


@pytest.mark.parametrize("layout", ["string_view", "dictionary"])
def test_a_string_view_or_dictionary_text_column_is_text(
    models: dict[str, TextModel], tmp_path: Path, layout: str
) -> None:
    """A ``string_view`` column (pyarrow 16 on; DuckDB and Polars write them) and a
    dictionary of strings (pandas' ``category``) were refused as "no column holds text",
    ``--column`` or not. Both are read as the strings they hold, served equal to
    transformers run now on each."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    plain = pa.array(TEXTS, pa.string())
    column = plain.dictionary_encode() if layout == "dictionary" else plain.cast(pa.string_view())
    parquet = tmp_path / "captions.parquet"
    pq.write_table(pa.table({"text": column}), parquet)
    bert = models["bert"]
    recipe = Recipe(source="text")
    report = build(parquet, bert.folder, cache=tmp_path / "store", recipe=recipe, column="text")
    assert report.encoded == len(TEXTS) and not report.failed, report.failed
    ds = CachedFeatureDataset(
        parquet, bert.folder, cache=tmp_path / "store", source="text", column="text",
        on_miss="error",
    )  # fmt: skip
    for i, text in enumerate(TEXTS):
        want = transformers_outputs(bert, text)
        for part, value in want.parts.items():
            assert rel_error(ds[i][part], value) < TOLERANCE, (text, part)


def save_gpt2(folder: Path, positions: int) -> Path:
    """A GPT-2 (its limit is ``n_positions``, its layers ``n_layer``) with a byte-level BPE
    tokenizer trained here, stating no limit of its own."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 3, vocab_size=300, special_tokens=["<|endoftext|>"])
    folder.mkdir(parents=True)
    bpe.save_model(str(folder))
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(folder))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(6)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=positions,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    transformers.GPT2Model(config).eval().save_pretrained(folder)
    return folder


def test_a_gpt2_text_is_cut_at_its_n_positions(tmp_path: Path) -> None:
    """GPT-2 names its limit ``n_positions`` (``max_position_embeddings`` through its config's
    ``attribute_map``): read by the standard name alone, the limit was taken as 512, and every
    text past the model's positions failed with ``IndexError`` (exit 3) while a larger
    --max-tokens was taken. Cut where the model ends, served equal to transformers run now;
    --max-tokens past it and --layers count by its own names."""
    folder = save_gpt2(tmp_path / "gpt2", positions=12)
    ds = long_and_short_built(folder, tmp_path, " ".join(TEXTS), TEXTS[1])
    assert ds.recipe.text is not None and ds.recipe.text.max_length == 12
    model = transformers.GPT2Model.from_pretrained(str(folder)).eval()
    tokens_alone_equal_run_now(ds, model, folder, 12)
    lengths = {Path(ds.path(i)).name: ds[i]["tokens"].shape[0] for i in range(len(ds))}
    assert lengths["long.txt"] == 12 and lengths["short.txt"] < 12
    with pytest.raises(ConfigError, match="past the 12 tokens"):
        text_recipe_for_folder(folder, max_length=13)
    layered = recipe_for_encoder(folder, Recipe(source="text", layers="all"))
    assert layered.layers == (0, 1, 2)


def test_a_whole_clip_folders_text_recipe_reads_its_text_tower(tmp_path: Path) -> None:
    """A whole ``CLIPModel`` folder given a tokenizer encodes texts with its text tower: its
    limit and layers are the text config's (the vision config's were read: no limit, so a
    text past 24 tokens failed in the model; --layers counted the vision tower's 3 layers).
    Served equal to the text tower and projection run now."""
    tokenizer = clip_tokenizer()
    torch.manual_seed(7)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=24, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        image_size=16, patch_size=8,
    )  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    folder = tmp_path / "clip-whole"
    transformers.CLIPModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ds = long_and_short_built(folder, tmp_path, " ".join(["the cat sat on the mat"] * 8), TEXTS[0])
    assert ds.recipe.text is not None and ds.recipe.text.max_length == 24
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    for i in range(len(ds)):
        enc = tokenizer(Path(ds.path(i)).read_text(), truncation=True, max_length=24)
        with torch.inference_mode():
            out = model.text_model(input_ids=torch.tensor([enc["input_ids"]]))
            embeds = model.text_projection(out.pooler_output)
        got = ds[i]
        assert rel_error(got["tokens"], out.last_hidden_state[0]) < TOLERANCE
        assert rel_error(got["pooled"], out.pooler_output[0]) < TOLERANCE
        assert rel_error(got["text_embeds"], embeds[0]) < TOLERANCE
    layered = recipe_for_encoder(folder, Recipe(source="text", layers="all"))
    assert layered.layers == (0, 1, 2)


@pytest.mark.parametrize("whole", [False, True])
def test_a_siglip_text_model_is_refused_in_one_line(tmp_path: Path, whole: bool) -> None:
    """SigLIP's text model pools its last position, padding included (it is run on texts
    padded to ``max_length``, unmasked): featbake's batches are padded per batch and masked,
    so its features would not be the model's users'. A ``SiglipTextModel`` folder failed in
    one line of 11,000 characters listing every config class; a whole ``SiglipModel`` folder
    with a tokenizer failed on every batch. Both are refused at load in one line."""
    t5 = save_t5(tmp_path / "t5")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(t5))
    text = transformers.SiglipTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    if whole:
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=16, patch_size=8,
        )  # fmt: skip
        config = transformers.SiglipConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict()
        )
        model: Any = transformers.SiglipModel(config)
    else:
        model = transformers.SiglipTextModel(text)
    folder = tmp_path / "siglip"
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(EncoderLoadError, match="SigLIP text model") as caught:
        load_encoder(folder)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
