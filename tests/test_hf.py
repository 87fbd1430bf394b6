"""Hugging Face model folders: tiny models built from configs here and saved with save_pretrained.

The reference is always transformers itself, run now on one clip with the folder's own feature
extractor (``Wav2Vec2FeatureExtractor.from_pretrained``), never the store.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from featbake.encode.hf import WeightsMismatch, load_hf_folder, recipe_for_folder
from featbake.encode.loaders import load_encoder
from featbake.encode.sources import source_for
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder
from tests.conftest import invoke
from tests.helpers import rel_error, stored_features

transformers = pytest.importorskip("transformers")

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "conv_dim": (16, 16, 16),
    "conv_stride": (5, 2, 2),
    "conv_kernel": (10, 3, 3),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
}


def save_model(
    folder: Path,
    kind: str = "wav2vec2",
    *,
    norm: str = "layer",
    stable: bool = True,
    mask: bool = True,
    normalize: bool = True,
    rate: int = 16000,
) -> Path:
    """A seeded tiny audio model and its feature extractor, saved as a real model folder."""
    torch.manual_seed(0)
    if kind == "wavlm":
        config: Any = transformers.WavLMConfig(
            **TINY, feat_extract_norm=norm, do_stable_layer_norm=stable
        )
        model: Any = transformers.WavLMModel(config)
    else:
        config = transformers.Wav2Vec2Config(
            **TINY, feat_extract_norm=norm, do_stable_layer_norm=stable
        )
        model = transformers.Wav2Vec2Model(config)
    model.eval().save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(
        sampling_rate=rate, return_attention_mask=mask, do_normalize=normalize
    ).save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=4)
def load_reference(folder: str) -> tuple[Any, Any]:
    """The folder's model and feature extractor, loaded by transformers (once per folder)."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.Wav2Vec2FeatureExtractor.from_pretrained(folder)


def reference(folder: Path, audio: Path) -> Any:
    """transformers on one clip now: the model and the folder's own feature extractor."""
    model, extractor = load_reference(str(folder))
    wav = source_for(Recipe(sample_rate=extractor.sampling_rate)).load(audio).numpy()
    inputs = extractor(wav, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    with torch.inference_mode():
        return model(**inputs, output_hidden_states=True)


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    root = tmp_path / "clips"
    write_audio_folder(root, 8, seconds=(0.2, 1.5), seed=3)
    return root


@pytest.mark.parametrize("kind", ["wav2vec2", "wavlm"])
def test_a_padded_build_equals_transformers_run_on_each_clip(
    tmp_path: Path, clips: Path, kind: str
) -> None:
    folder = save_model(tmp_path / kind, kind)
    report = build(clips, folder, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 8
    assert report.batching == BatchingMode.PADDED, report.batching_note
    assert report.recipe_fp == Recipe(normalize=True).fingerprint()  # do_normalize went in
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        want = reference(folder, clips / rel).last_hidden_state[0]
        assert rel_error(parts[""], want) < 1e-4, rel


def test_a_group_norm_model_runs_on_exact_shapes_and_says_why(tmp_path: Path, clips: Path) -> None:
    folder = save_model(tmp_path / "group", norm="group", stable=False, mask=False)
    report = build(clips, folder, cache=tmp_path / "s", workers=0)
    assert report.batching == BatchingMode.EXACT
    assert "return_attention_mask=false" in report.batching_note
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        assert rel_error(parts[""], reference(folder, clips / rel).last_hidden_state[0]) < 1e-4
    # Forced to pad, the guard catches it, and still nothing inexact is stored.
    forced = build(clips, folder, cache=tmp_path / "f", workers=0, batching="padded")
    assert forced.batching == BatchingMode.EXACT and "not exact" in forced.batching_note
    for rel, parts in stored_features(tmp_path / "f", forced.root).items():
        assert rel_error(parts[""], reference(folder, clips / rel).last_hidden_state[0]) < 1e-4


@pytest.mark.parametrize("stable", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("layers", [(0, 2), (1,), "all"])
def test_layers_equal_output_hidden_states_of_the_full_model(
    tmp_path: Path, clips: Path, stable: bool, layers: Any
) -> None:
    folder = save_model(tmp_path / "m", stable=stable)
    report = build(clips, folder, cache=tmp_path / "s", recipe=Recipe(layers=layers), workers=0)
    assert report.ok and report.batching == BatchingMode.PADDED
    want_layers = (0, 1, 2, 3) if layers == "all" else layers
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        assert set(parts) == {f"layer{k}" for k in want_layers}
        hidden = reference(folder, clips / rel).hidden_states
        for k in want_layers:
            assert rel_error(parts[f"layer{k}"], hidden[k][0]) < 1e-4, (rel, k)


@pytest.mark.parametrize(("stable", "runs"), [(True, 2), (False, 1)])
def test_the_encoder_stops_at_the_last_layer_asked_for(
    tmp_path: Path, stable: bool, runs: int
) -> None:
    folder = save_model(tmp_path / "m", stable=stable)
    enc = load_hf_folder(folder, layers=(1,))
    # A pre-norm encoder runs one layer more: its final LayerNorm only touches the last state.
    assert len(enc.module.model.encoder.layers) == runs
    assert len(load_hf_folder(folder).module.model.encoder.layers) == 3


def test_the_fingerprint_covers_config_and_weights(tmp_path: Path) -> None:
    folder = save_model(tmp_path / "m")
    fp = load_encoder(folder).fingerprint
    assert load_encoder(folder).fingerprint == fp
    assert load_encoder(folder, layers=(1,)).fingerprint == fp  # the recipe tells layers apart

    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    name = next(k for k in state if k.endswith("feature_projection.projection.weight"))
    state[name][0, 0] += 1e-3
    save_file(state, str(weights), metadata={"format": "pt"})
    assert load_encoder(folder).fingerprint != fp

    other = save_model(tmp_path / "eps")
    config = json.loads((other / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    assert load_encoder(other).fingerprint not in (
        fp,
        load_encoder(save_model(tmp_path / "x")).fingerprint,
    )


def test_the_preprocessor_config_goes_into_the_recipe(tmp_path: Path) -> None:
    folder = save_model(tmp_path / "m", normalize=False, rate=8000)
    recipe = recipe_for_folder(folder, Recipe(layers="all"))
    assert recipe.sample_rate == 8000 and recipe.normalize is False
    assert recipe.layers == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="has 3 layers"):
        recipe_for_folder(folder, Recipe(layers=(7,)))


def test_the_dataset_serves_one_layer_several_or_a_stack(tmp_path: Path, clips: Path) -> None:
    folder = save_model(tmp_path / "m")
    build(clips, folder, cache=tmp_path / "s", recipe=Recipe(layers=(0, 2, 3)), workers=0)
    common: dict[str, Any] = {"cache": tmp_path / "s", "layers": (0, 2, 3), "on_miss": "error"}
    as_dict = CachedFeatureDataset(clips, folder, **common)
    one = CachedFeatureDataset(clips, folder, layer_view=2, **common)
    stack = CachedFeatureDataset(clips, folder, layer_view=[3, 0], **common)
    every = CachedFeatureDataset(clips, folder, layer_view="stack", **common)
    for i in range(len(as_dict)):
        hidden = reference(folder, Path(as_dict.path(i))).hidden_states
        assert set(as_dict[i]) == {"layer0", "layer2", "layer3"}
        assert rel_error(one[i], hidden[2][0]) < 1e-4
        assert stack[i].shape[0] == 2 and rel_error(stack[i][0], hidden[3][0]) < 1e-4
        assert torch.equal(every[i], torch.stack([as_dict[i][f"layer{k}"] for k in (0, 2, 3)]))
    batch = one.__getitems__([0, 1])
    assert all(torch.equal(a, b) for a, b in zip(batch, [one[0], one[1]], strict=True))
    with pytest.raises(ConfigError, match="layer 5 is not stored"):
        CachedFeatureDataset(clips, folder, layer_view=5, **common)[0]


def test_cli_builds_a_folder_with_layers_and_refuses_bad_ones(
    tmp_path: Path, clips: Path, encoder_file: Path
) -> None:
    folder = save_model(tmp_path / "m")
    base = ["build", "-d", clips, "--cache", tmp_path / "s", "--workers", "0"]
    res = invoke(*base, "-e", folder, "--layers", "2,0", "--precision", "bf16", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["batching"] == "padded" and report["encoded"] == 8
    res = invoke(*base, "-e", folder, "--layer", "9")
    assert res.returncode != 0 and "has 3 layers" in res.stderr
    assert "Traceback" not in res.stderr
    res = invoke(*base, "-e", encoder_file, "--layers", "1")
    assert res.returncode != 0 and "hidden states" in res.stderr


def test_audio_sample_padding_is_normalised_per_clip() -> None:
    """do_normalize uses the clip's own statistics, as the feature extractor does unpadded."""
    from featbake.encode.sources import zero_mean_unit_var

    x = np.random.default_rng(0).normal(3.0, 2.0, (1, 1000)).astype(np.float32)
    ours = zero_mean_unit_var(x)[0]
    theirs = transformers.Wav2Vec2FeatureExtractor.zero_mean_unit_var_norm([x[0]], None)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_stack_keeps_the_order_layers_asked_for_single_and_batched(
    tmp_path: Path, clips: Path
) -> None:
    """Issue 16 item 12: ``layers=[3, 1]`` with ``layer_view="stack"`` gave layers 1, 3 while
    ``layer_view=[3, 1]`` gave 3, 1. Both now keep the order asked for, item by item, through
    ``__getitems__`` and through a DataLoader with the RAM tier on."""
    from torch.utils.data import DataLoader

    folder = save_model(tmp_path / "m")
    build(clips, folder, cache=tmp_path / "s", recipe=Recipe(layers=(1, 3)), workers=0)
    common: dict[str, Any] = {"cache": tmp_path / "s", "layers": [3, 1], "on_miss": "error"}
    stack = CachedFeatureDataset(clips, folder, layer_view="stack", **common)
    listed = CachedFeatureDataset(clips, folder, layer_view=[3, 1], **common)
    cached = CachedFeatureDataset(clips, folder, layer_view="stack", ram_cache="64MiB", **common)
    want = []
    for i in range(len(stack)):
        hidden = reference(folder, Path(stack.path(i))).hidden_states
        want.append(torch.stack([hidden[3][0], hidden[1][0]]))
        for ds in (stack, listed, cached, cached):  # cached twice: from the store, then RAM
            assert ds[i].shape == want[i].shape and rel_error(ds[i], want[i]) < 1e-4
    for ds in (stack, listed, cached):
        for got, w in zip(ds.__getitems__([3, 0, 5]), [want[3], want[0], want[5]], strict=True):
            assert rel_error(got, w) < 1e-4
        loader = DataLoader(ds, batch_size=4, collate_fn=list)
        got = [item for batch in loader for item in batch]
        assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want, strict=True))
    all_layers = CachedFeatureDataset(
        clips, folder, cache=tmp_path / "s", recipe=Recipe(layers=(3, 1)), layer_view="stack"
    )  # a recipe's layers are sorted (one key): "stack" is then layer order
    assert rel_error(all_layers[0], want[0].flip(0)) < 1e-4


@pytest.mark.parametrize(("layers", "kind"), [(5, "missing"), (2, "unexpected")])
def test_weights_that_do_not_cover_the_config_are_refused_with_their_names(
    tmp_path: Path, clips: Path, layers: int, kind: str
) -> None:
    """A config asking for more (or fewer) layers than model.safetensors holds: no random init."""
    folder = save_model(tmp_path / "m")
    load_encoder(folder)  # the folder as saved loads
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatch, match=rf"\d+ {kind} \(.*encoder\.layers\.") as err:
        load_encoder(folder)
    assert "more" in str(err.value) and "num_hidden_layers" in str(err.value)
    res = invoke("build", "-e", folder, "-d", clips, "--cache", tmp_path / "s")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 4 and len(lines) == 1 and f"{kind} (" in lines[0], res.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"sampling_rate": "16k"}', "sampling_rate must be a whole number of Hz"),
        ('{"sampling_rate": null}', "sampling_rate must be a whole number of Hz"),
        ('{"sampling_rate": true}', "sampling_rate must be a whole number of Hz"),
        ("[16000]", "holds a JSON list"),
    ],
)
def test_a_preprocessor_config_that_is_not_settings_is_one_line(
    tmp_path: Path, clips: Path, text: str, needle: str
) -> None:
    folder = save_model(tmp_path / "m")
    (folder / "preprocessor_config.json").write_text(text)
    res = invoke("build", "-e", folder, "-d", clips, "--cache", tmp_path / "s")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 4 and len(lines) == 1 and needle in lines[0], res.stderr
    assert "internal error" not in res.stderr


def test_int8_layers_are_served_dequantised_in_the_order_asked(tmp_path: Path, clips: Path) -> None:
    """--layers all with --dtype int8: each layer stored packed, served dequantised, stacked;
    within half a code step of the model's hidden states now (the build pads its batches)."""
    from featbake.quantize import Scheme, dequantize, quantize

    folder = save_model(tmp_path / "m")
    recipe = Recipe(layers=(0, 3), dtype="int8")
    report = build(clips, folder, cache=tmp_path / "s", recipe=recipe, workers=0)
    assert report.ok and report.fidelity is not None and report.fidelity["rel_rms"] < 0.01
    common: dict[str, Any] = {"cache": tmp_path / "s", "layers": (3, 0), "on_miss": "error"}
    stack = CachedFeatureDataset(clips, folder, dtype="int8", layer_view="stack", **common)
    raw = CachedFeatureDataset(clips, folder, dtype="int8", dequantize=False, **common)
    for i in range(len(stack)):
        hidden = reference(folder, Path(stack.path(i))).hidden_states
        got = stack[i]
        assert got.dtype == torch.float16 and got.shape[0] == 2
        stored = raw[i]
        for j, k in enumerate((3, 0)):
            assert torch.equal(got[j], dequantize(stored[f"layer{k}"], Scheme.INT8))
            want = hidden[k][0]
            step = want.abs().amax(-1, keepdim=True) / 127
            assert bool(((got[j].float() - want).abs() <= step * 0.6 + 1e-3).all())
            assert rel_error(dequantize(quantize(want, Scheme.INT8), Scheme.INT8), got[j]) < 0.01
