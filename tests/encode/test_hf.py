"""Hugging Face model folders: tiny models built from configs here and saved with save_pretrained.

The reference is always transformers itself, run now on one clip with the folder's own feature
extractor (``Wav2Vec2FeatureExtractor.from_pretrained``), never the store.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from featbake.encode.hf import WeightsMismatch, load_hf_folder, recipe_for_folder
from featbake.encode.images import decode_image
from featbake.encode.loaders import load_encoder
from featbake.encode.sources import source_for
from featbake.errors import ConfigError, EncoderLoadError
from featbake.image_recipe import Size
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder, write_image_folder
from tests.conftest import invoke
from tests.helpers import real_photos, rel_error, stored_features

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
    ctc: bool = False,
) -> Path:
    """A seeded tiny audio model and its feature extractor, saved as a real model folder
    (``ctc``: a wav2vec2 fine-tuned for CTC, its ``lm_head`` saved beside the base model)."""
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
        model = (transformers.Wav2Vec2ForCTC if ctc else transformers.Wav2Vec2Model)(config)
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
@pytest.mark.parametrize("layers", [(0, 2), (1,), (0,), "all"])  # (0,): r23, see _truncate
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


#: A fresh interpreter that rebuilds a folder through the command, then serves its first item
#: with ``on_miss="error"``: prints the build's report, the served feature, the modules loaded.
REBUILD_THEN_SERVE = """
import json, sys
from featbake.cli.main import main
from featbake.serve.dataset import CachedFeatureDataset
clips, folder, store = sys.argv[1:]
try:
    main(["build", "--encoder", folder, "--data", clips, "--cache", store, "--workers", "0",
          "--json"])
except SystemExit as e:
    assert not e.code, e.code
ds = CachedFeatureDataset(clips, folder, cache=store, on_miss="error")
served = {"path": ds.path(0), "feature": ds[0].tolist()}
heavy = sorted(m for m in ("transformers", "featbake.encode.hf") if m in sys.modules)
print(json.dumps({"served": served, "modules": heavy}))
"""


def test_a_rebuild_of_an_unchanged_folder_imports_no_transformers_and_keeps_its_key(
    tmp_path: Path, clips: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A no-op rebuild of a folder loaded its model (transformers' import and the model's load
    were most of the command's 9 s of CPU) only to fingerprint it again. The fingerprint is now
    remembered against every file of the folder and what builds its model; a change to either
    loads it again."""
    import importlib.metadata
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import featbake.encode.fingerprints as fingerprints
    import featbake.encode.hf as hf
    from featbake.store.catalog import Catalog
    from featbake.store.hash_cache import RACY_NS
    from featbake.store.layout import Layout

    # This process imported transformers (to save the model): it is taken for one that did not,
    # as the commands' processes are (fingerprints.transformers_as_installed).
    monkeypatch.setattr(fingerprints, "transformers_as_installed", lambda: True)
    folder, store = save_model(tmp_path / "m"), tmp_path / "s"
    with monkeypatch.context() as m:  # the clock of a folder saved a while before its build
        m.setattr(hf, "time", SimpleNamespace(time_ns=lambda: time.time_ns() + 3 * RACY_NS))
        first = build(clips, folder, cache=store, workers=0)
    assert first.encoded == 8

    ran = subprocess.run([sys.executable, "-c", REBUILD_THEN_SERVE, str(clips), str(folder),
                          str(store)], capture_output=True, text=True, check=True)  # fmt: skip
    lines = ran.stdout.strip().splitlines()
    again, seen = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert (again["encoded"], again["reused"]) == (0, 8), ran.stdout
    assert (again["root"], again["encoder_fp"]) == (first.root, first.encoder_fp)
    assert seen["modules"] == ["featbake.encode.hf"], seen["modules"]  # no transformers
    path = Path(seen["served"]["path"])
    want = reference(folder, path).last_hidden_state[0]
    assert rel_error(torch.tensor(seen["served"]["feature"]), want) < 1e-4

    def cached() -> str | None:
        with Catalog(Layout(store)) as cat:
            return fingerprints.cached_file_encoder_fp(cat, folder)

    assert cached() == first.encoder_fp
    with monkeypatch.context() as m:  # another transformers builds another model
        real = importlib.metadata.version
        m.setattr(
            importlib.metadata, "version", lambda n: "0.0" if n == "transformers" else real(n)
        )
        assert cached() is None
    with monkeypatch.context() as m:  # featbake's keying code changed
        code = tmp_path / "code"
        shutil.copytree(Path(hf.__file__).parent.parent, code,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        m.setattr(fingerprints, "_PACKAGE", code)
        assert cached() == first.encoder_fp  # the same code: the same state
        with (code / "keys.py").open("a") as f:
            f.write("\n")
        assert cached() is None
    (folder / "notes.txt").write_text("a file beside the model")
    assert cached() is None  # a new file in the folder
    (folder / "notes.txt").unlink()
    assert cached() == first.encoder_fp  # the same files again

    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    name = next(k for k in state if k.endswith("feature_projection.projection.weight"))
    state[name][0, 0] += 1e-3
    save_file(state, str(weights), metadata={"format": "pt"})
    changed = build(clips, folder, cache=store, workers=0)
    assert changed.encoded == 8 and changed.encoder_fp != first.encoder_fp
    assert changed.encoder_fp == load_encoder(folder).fingerprint


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


def test_a_checkpoint_fine_tuned_for_ctc_serves_its_base_models_features(
    tmp_path: Path, clips: Path
) -> None:
    """A wav2vec2 fine-tuned for CTC (``Wav2Vec2ForCTC``, the commonest speech checkpoint) is
    built through the CLI and served equal to transformers' own base model loaded from the
    folder now (its ``lm_head`` unused); the same folder whose config asks fewer layers than
    its weights hold is still refused by name. Before, the head's two weights were taken for a
    config mismatch: "2 unexpected (lm_head.bias, lm_head.weight) ... would fill the gaps with
    random values"."""
    folder = save_model(tmp_path / "ctc", ctc=True)
    res = invoke("build", "-e", folder, "-d", clips, "--cache", tmp_path / "s")
    assert res.returncode == 0, res.stderr
    ds = CachedFeatureDataset(clips, folder, cache=tmp_path / "s", on_miss="error")
    assert len(ds) == 8
    for i in range(len(ds)):
        want = reference(folder, clips / ds.item_id(i)).last_hidden_state[0]
        assert rel_error(ds[i], want) < 1e-3, ds.item_id(i)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatch, match=r"\d+ unexpected \(.*encoder\.layers\.") as err:
        load_encoder(folder)
    assert "lm_head" not in str(err.value)


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


def test_an_encoder_decoder_audio_model_is_refused_up_front_in_one_line(
    tmp_path: Path, clips: Path
) -> None:
    """Moonshine takes ``input_values`` and reports no decoder need at load: it was admitted,
    every clip then failed with transformers' "specify exactly one of input_ids or
    inputs_embeds" and the summary blamed the options (exit 3)."""
    torch.manual_seed(0)
    config = transformers.MoonshineConfig(
        hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2, encoder_num_attention_heads=2,
        decoder_num_attention_heads=2, vocab_size=100,
    )  # fmt: skip
    folder = tmp_path / "moonshine"
    transformers.MoonshineModel(config).eval().save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(folder)
    res = invoke("build", "-e", folder, "-d", clips, "--cache", tmp_path / "s")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 4 and len(lines) == 1, res.stderr
    assert "encoder-decoder" in lines[0] and "MoonshineModel" in lines[0], res.stderr


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


# == test_hf_vision ================================================================================
# Hugging Face vision folders end to end: tiny ViT, DINOv2 and CLIP-vision models built from
# configs and saved with save_pretrained, beside their image processors.
#
# The reference is transformers itself, run now on each image: the folder's own processor
# (``AutoImageProcessor``) and model, on the picture featbake decodes; never the store.

TINY_VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
PATCH = {"image_size": 32, "patch_size": 8}
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
MODELS = ("vit", "dinov2", "clip")


def processor_class(kind: str) -> Any:
    """transformers' PIL-backend image processor (``...Pil`` in transformers 5)."""
    return getattr(transformers, f"{kind}ImageProcessorPil", None) or getattr(
        transformers, f"{kind}ImageProcessor"
    )


def save_vision_model(folder: Path, kind: str) -> Path:
    """A seeded tiny vision model and its image processor, saved as a real model folder."""
    torch.manual_seed(0)
    if kind == "vit":
        model: Any = transformers.ViTModel(
            transformers.ViTConfig(**TINY_VISION, **PATCH, intermediate_size=64)
        )
        proc = processor_class("ViT")(size={"height": 32, "width": 32}, resample=2)
    elif kind == "dinov2":
        model = transformers.Dinov2Model(
            transformers.Dinov2Config(**TINY_VISION, **PATCH, mlp_ratio=2)
        )
        proc = processor_class("Bit")(
            size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, **IMAGENET
        )
    else:
        model = transformers.CLIPVisionModel(
            transformers.CLIPVisionConfig(**TINY_VISION, **PATCH, intermediate_size=64)
        )
        proc = processor_class("CLIP")(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    model.eval().save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=8)
def load_vision_reference(folder: str) -> tuple[Any, Any]:
    """The folder's model and image processor, loaded by transformers (once per folder)."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoImageProcessor.from_pretrained(folder)


def vision_reference(folder: Path, image_path: Path, recipe: Recipe) -> Any:
    """transformers' processor + model now, on the image as featbake decodes it."""
    model, proc = load_vision_reference(str(folder))
    image = decode_image(image_path, recipe.image_steps)
    with torch.inference_mode():
        return model(**proc(images=image, return_tensors="pt"), output_hidden_states=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated photos of several sizes, the awkward files, and two bad ones."""
    root = tmp_path_factory.mktemp("images")
    write_image_folder(root, 4, size=(40, 56), seed=1)
    rng = np.random.default_rng(5)
    exif = Image.Exif()
    exif[0x0112] = 6
    noise = rng.integers(0, 256, (24, 50, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "rotated.jpg", exif=exif)
    Image.fromarray(noise).convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray(noise[..., 0]).save(root / "grey.png")
    Image.fromarray(noise[..., 0].astype(np.uint16) * 257).save(root / "deep.png")
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="JPEG")
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (root / "notes.jpg").write_text("not a picture\n")
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: save_vision_model(root / kind, kind) for kind in MODELS}


GOOD = 8  # files in `images` that decode
BAD = {"notes.jpg", "truncated.jpg"}


@pytest.mark.parametrize("kind", MODELS)
def test_served_features_equal_transformers_processor_and_model(
    tmp_path: Path, images: Path, folders: dict[str, Path], kind: str
) -> None:
    folder = folders[kind]
    report = build(images, folder, cache=tmp_path / "s", workers=0, batch_size=3)
    assert report.encoded == GOOD and {p for p, _ in report.failed} == BAD
    ds = CachedFeatureDataset(images, folder, cache=tmp_path / "s", on_miss="error")
    # what the build could not decode is left out, as for bad audio
    assert ds.recipe.source == "image" and len(ds) == GOOD
    for i in range(len(ds)):
        if Path(ds.path(i)).name in BAD:
            continue
        parts = ds[i]
        want = vision_reference(folder, Path(ds.path(i)), ds.recipe)
        assert set(parts) == {"pooled", "tokens"}
        assert parts["tokens"].shape == (17, 32)  # CLS + 4x4 patches
        assert rel_error(parts["tokens"], want.last_hidden_state[0]) < 1e-5, ds.path(i)
        assert rel_error(parts["pooled"], want.pooler_output[0]) < 1e-5, ds.path(i)


@pytest.mark.parametrize("kind", ["dinov2", "clip"])
def test_layers_and_one_output_are_parts_as_for_audio(
    tmp_path: Path, images: Path, folders: dict[str, Path], kind: str
) -> None:
    folder = folders[kind]
    recipe = Recipe(layers="all", dtype="float16")
    build(images, folder, cache=tmp_path / "s", recipe=recipe, workers=0)
    ds = CachedFeatureDataset(images, folder, cache=tmp_path / "s", recipe=recipe, on_miss="error")
    for i in range(3):
        parts = ds[i]
        hidden = vision_reference(folder, Path(ds.path(i)), ds.recipe).hidden_states
        assert set(parts) == {"layer0", "layer1", "layer2"}
        for k in range(3):
            assert parts[f"layer{k}"].dtype == torch.float16
            assert rel_error(parts[f"layer{k}"].float(), hidden[k][0]) < 2e-3
    pooled = Recipe(output="pooled")
    build(images, folder, cache=tmp_path / "s", recipe=pooled, workers=0)
    one = CachedFeatureDataset(images, folder, cache=tmp_path / "s", recipe=pooled, on_miss="error")
    want = vision_reference(folder, Path(one.path(0)), one.recipe).pooler_output[0]
    assert one[0].shape == (32,) and rel_error(one[0], want) < 1e-5


def test_an_edited_processor_changes_the_key(tmp_path: Path, folders: dict[str, Path]) -> None:
    folder = shutil.copytree(folders["clip"], tmp_path / "clip")
    before = recipe_for_folder(folder, Recipe())
    config_path = folder / "preprocessor_config.json"
    original = json.loads(config_path.read_text())
    edits = {
        "crop_size": {"height": 24, "width": 24},
        "size": {"shortest_edge": 36},
        "resample": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "do_center_crop": False,
    }
    seen = {before.fingerprint()}
    for field, value in edits.items():
        config_path.write_text(json.dumps({**original, field: value}))
        seen.add(recipe_for_folder(folder, Recipe()).fingerprint())
    assert len(seen) == len(edits) + 1
    # Options given by the caller win over the folder's processor, and are keyed as such.
    config_path.write_text(json.dumps(original))
    mine = Recipe(image=before.image_steps.replace(crop=Size(28, 28)))
    assert recipe_for_folder(folder, mine).image_steps.crop == (28, 28)


def test_a_processor_saved_whole_is_read_where_transformers_reads_it(
    tmp_path: Path, images: Path, folders: dict[str, Path]
) -> None:
    """transformers 5 saves a whole processor (``CLIPProcessor.save_pretrained``) to
    ``processor_config.json``, each part in a section, and reads an image processor there
    before ``preprocessor_config.json``. featbake read only the latter: re-saved with a new
    ``image_mean`` beside the old file, a folder kept its key, and its store served the
    features of the old normalisation. Now the key follows the section: the old features
    are not served (a miss), and what is encoded equals transformers' processor and model."""
    from featbake.errors import CacheMiss

    folder = shutil.copytree(folders["clip"], tmp_path / "clip")
    store = tmp_path / "s"
    build(images, folder, cache=store, workers=0)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    whole = {"image_processor": {**settings, "image_mean": [0.1, 0.2, 0.3]}}
    (folder / "processor_config.json").write_text(json.dumps(whole))
    resolved = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    assert list(resolved.image_mean) == [0.1, 0.2, 0.3]  # transformers' own order of files
    assert recipe_for_folder(folder, Recipe()).image_steps.mean == (0.1, 0.2, 0.3)
    stale = CachedFeatureDataset(images, folder, cache=store, on_miss="error")
    with pytest.raises(CacheMiss):
        stale[0]
    with pytest.warns(UserWarning, match=r"image\.mean=\[0\.48145466.* \[0\.1, 0\.2, 0\.3\]"):
        ds = CachedFeatureDataset(images, folder, cache=store)  # says what the store holds
    want = vision_reference(folder, Path(ds.path(0)), ds.recipe)
    assert rel_error(ds[0]["tokens"], want.last_hidden_state[0]) < 1e-5
    assert rel_error(ds[0]["pooled"], want.pooler_output[0]) < 1e-5


def test_a_feature_extractor_saved_whole_is_read_where_transformers_reads_it(
    tmp_path: Path,
) -> None:
    """The same order for an audio model's feature extractor: ``processor_config.json``'s
    ``feature_extractor`` section first (its sampling rate and normalisation are the
    recipe's), as ``AutoFeatureExtractor`` reads it; a section that is not settings is one
    line naming the file and the section."""
    folder = save_model(tmp_path / "m", normalize=True, rate=16000)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    whole = {"feature_extractor": {**settings, "sampling_rate": 8000, "do_normalize": False}}
    (folder / "processor_config.json").write_text(json.dumps(whole))
    resolved = transformers.AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
    recipe = recipe_for_folder(folder, Recipe())
    assert recipe.sample_rate == resolved.sampling_rate == 8000
    assert recipe.normalize is resolved.do_normalize is False
    (folder / "processor_config.json").write_text(json.dumps({"feature_extractor": [8000]}))
    with pytest.raises(EncoderLoadError, match=r"processor_config.json \(feature_extractor\)"):
        recipe_for_folder(folder, Recipe())


def test_a_processor_featbake_cannot_reproduce_is_refused(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    folder = shutil.copytree(folders["vit"], tmp_path / "vit")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "ConvNextImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="ConvNextImageProcessor"):
        recipe_for_folder(folder, Recipe())


def test_cli_builds_with_workers_and_options_and_roots_show_the_transform(
    tmp_path: Path, images: Path, folders: dict[str, Path]
) -> None:
    store = tmp_path / "s"
    base = ("build", "-d", images, "--cache", store, "--workers", "1", "--json")
    res = invoke(*base, "-e", folders["dinov2"])
    assert res.returncode == 3, res.stderr  # two bad files: skipped with their reasons
    report = json.loads(res.stdout)
    assert report["encoded"] == GOOD and len(report["failed"]) == 2
    res = invoke(*base, "-e", folders["dinov2"], "--crop", "24", "--interpolation", "bilinear")
    assert json.loads(res.stdout)["encoded"] == GOOD  # another transform: another key
    roots = invoke("roots", "--cache", store)
    assert roots.returncode == 0, roots.stderr
    assert "short 40 bicubic crop 32x32" in roots.stdout
    assert "short 40 bilinear crop 24x24" in roots.stdout
    ds = CachedFeatureDataset(
        images,
        folders["dinov2"],
        cache=store,
        on_miss="error",
        recipe=Recipe(
            image=recipe_for_folder(folders["dinov2"], Recipe()).image_steps.replace(
                crop=Size(24, 24), interpolation="bilinear"
            )
        ),
    )
    assert ds[0]["tokens"].shape == (10, 32)  # CLS + 3x3 patches of the 24 px crop
    bad = invoke(*base, "-e", folders["dinov2"], "--crop", "24x")
    assert bad.returncode == 2 and "224x224" in bad.stderr and "Traceback" not in bad.stderr


def test_a_miss_is_encoded_live_as_transformers_computes_it(
    tmp_path: Path, images: Path, folders: dict[str, Path]
) -> None:
    """Nothing built: each item is encoded on first read (and written back) like a build."""
    folder = folders["vit"]
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(images, folder, cache=tmp_path / "s", on_miss="encode")
    for i in range(len(ds)):
        if Path(ds.path(i)).name in BAD:
            continue
        want = vision_reference(folder, Path(ds.path(i)), ds.recipe)
        assert rel_error(ds[i]["tokens"], want.last_hidden_state[0]) < 1e-5


def test_an_image_root_exports_to_zarr_unchanged(
    tmp_path: Path, images: Path, folders: dict[str, Path]
) -> None:
    zarr = pytest.importorskip("zarr")
    from featbake.export.zarr import export_zarr

    folder = folders["dinov2"]
    report = build(images, folder, cache=tmp_path / "s", workers=0)
    out = export_zarr(tmp_path / "f.zarr", cache=tmp_path / "s", root=report.root[:8])
    assert out.layouts == {"pooled": "dense", "tokens": "dense"}
    group = zarr.open_group(str(tmp_path / "f.zarr"), mode="r")
    pooled, tokens = group["pooled/values"][:], group["tokens/values"][:]
    assert pooled.shape == (GOOD, 32) and tokens.shape == (GOOD, 17, 32)
    recipe = recipe_for_folder(folder, Recipe())
    for i, rel in enumerate(group["paths"][:]):
        want = vision_reference(folder, images / str(rel), recipe)
        assert rel_error(torch.from_numpy(pooled[i]), want.pooler_output[0]) < 1e-5
        assert rel_error(torch.from_numpy(tokens[i]), want.last_hidden_state[0]) < 1e-5


def test_real_photographs_equal_transformers_too(tmp_path: Path, folders: dict[str, Path]) -> None:
    """Photographs from a camera (progressive JPEG, EXIF and Photoshop blocks), where found."""
    photos = real_photos()
    if not photos:
        pytest.skip("no photographs on this machine (see PHOTO_GLOBS in tests/helpers.py)")
    data = tmp_path / "photos"
    data.mkdir()
    for i, photo in enumerate(photos):
        shutil.copy(photo, data / f"photo{i}{Path(photo).suffix}")
    folder = folders["clip"]
    report = build(data, folder, cache=tmp_path / "s", workers=0)
    assert report.ok and report.encoded == len(photos)
    ds = CachedFeatureDataset(data, folder, cache=tmp_path / "s", on_miss="error")
    for i in range(len(ds)):
        want = vision_reference(folder, Path(ds.path(i)), ds.recipe)
        assert rel_error(ds[i]["tokens"], want.last_hidden_state[0]) < 1e-5
        assert rel_error(ds[i]["pooled"], want.pooler_output[0]) < 1e-5


@pytest.mark.parametrize("kind", ["vit", "clip", "vit-converting"])
def test_an_rgb_png_with_a_transparency_key_is_read_as_the_processor_reads_it(
    tmp_path: Path, folders: dict[str, Path], kind: str
) -> None:
    """ViT's processor does not convert to RGB: it reads an RGB PNG's pixels as saved
    (``np.array``), its transparency key ignored; CLIP's converts, compositing the keyed
    pixels onto white, and so does ViT's with ``do_convert_rgb: true``. featbake composited
    for all three (ViT's tokens 0.31 off). The reference is the file opened by Pillow, as a
    user hands it to the processor, never featbake's decoding."""
    folder = folders[kind.removesuffix("-converting")]
    if kind.endswith("-converting"):
        folder = Path(shutil.copytree(folder, tmp_path / "converting"))
        config = json.loads((folder / "preprocessor_config.json").read_text())
        config["do_convert_rgb"] = True
        (folder / "preprocessor_config.json").write_text(json.dumps(config))
    root = tmp_path / "keyed"
    root.mkdir()
    pixels = np.random.default_rng(3).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    pixels[:20, :20] = (10, 20, 30)
    Image.fromarray(pixels).save(root / "keyed.png", transparency=(10, 20, 30))
    Image.fromarray(pixels).save(root / "plain.png")
    assert build(root, folder, cache=tmp_path / "s", workers=0).encoded == 2
    ds = CachedFeatureDataset(root, folder, cache=tmp_path / "s", on_miss="error")
    model, proc = load_vision_reference(str(folder))
    served = {}
    for i in range(len(ds)):
        with Image.open(ds.path(i)) as image, torch.inference_mode():
            want = model(**proc(images=image, return_tensors="pt")).last_hidden_state[0]
        served[Path(ds.path(i)).name] = ds[i]["tokens"]
        assert rel_error(ds[i]["tokens"], want) < 1e-5, (kind, ds.path(i))
    composited = not torch.allclose(served["keyed.png"], served["plain.png"])
    assert composited == (kind != "vit")


# == test_hf_vision_folders ========================================================================
# Vision folders as users download them: a ViT saved without its pooling layer (DINO, MAE) and
# a whole CLIP model (text and vision towers), each built from a config and saved with
# save_pretrained, beside its image processor.
#
# The reference is transformers itself, run now on each image as featbake decodes it.


def processor(kind: str, **kw: Any) -> Any:
    """transformers' PIL-backend image processor of ``kind`` made with ``kw``."""
    return processor_class(kind)(**kw)


def served_and_pixels(
    ds: CachedFeatureDataset, folder: Path
) -> Iterator[tuple[Any, torch.Tensor, str]]:
    """Each item ``ds`` serves, the pixels the folder's own image processor (transformers')
    makes of its image now, and its path: what a vision test compares with the model run
    now."""
    proc = transformers.AutoImageProcessor.from_pretrained(folder)
    for i in range(len(ds)):
        image = decode_image(Path(ds.path(i)), ds.recipe.image_steps)
        yield ds[i], proc(images=image, return_tensors="pt")["pixel_values"], ds.path(i)


@pytest.fixture(scope="module")
def vision_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_image_folder(root, 4, size=(40, 56), seed=3)
    return root


@pytest.fixture(scope="module")
def headless_vit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ViT saved as DINO and MAE checkpoints are: ``add_pooling_layer=False``."""
    folder = tmp_path_factory.mktemp("models") / "dino"
    torch.manual_seed(0)
    config = transformers.ViTConfig(**TINY_VISION, **PATCH, intermediate_size=64)
    transformers.ViTModel(config, add_pooling_layer=False).eval().save_pretrained(folder)
    processor("ViT", size={"height": 32, "width": 32}, resample=2).save_pretrained(folder)
    return folder


def served_tokens_equal_transformers(ds: CachedFeatureDataset, model: Any, folder: Path) -> None:
    for parts, pixels, path in served_and_pixels(ds, folder):
        with torch.inference_mode():
            want = model(pixel_values=pixels).last_hidden_state[0]
        assert rel_error(parts["tokens"], want) < 1e-5, path


def test_a_vit_saved_without_its_pooler_serves_its_tokens(
    tmp_path: Path, vision_images: Path, headless_vit: Path
) -> None:
    """Old main refused the folder: "2 missing (pooler.dense.bias, pooler.dense.weight)"."""
    report = build(vision_images, headless_vit, cache=tmp_path / "s", workers=0, batch_size=3)
    assert report.ok and report.encoded == 4
    ds = CachedFeatureDataset(vision_images, headless_vit, cache=tmp_path / "s", on_miss="error")
    assert set(ds[0]) == {"tokens"}  # no pooled part: its head would be random
    model = transformers.ViTModel.from_pretrained(headless_vit, add_pooling_layer=False).eval()
    served_tokens_equal_transformers(ds, model, headless_vit)


def test_asking_a_headless_vit_for_pooled_is_one_line(
    tmp_path: Path, vision_images: Path, headless_vit: Path
) -> None:
    with pytest.raises(ConfigError, match="without its pooling layer"):
        build(
            vision_images,
            headless_vit,
            cache=tmp_path / "s",
            recipe=Recipe(output="pooled"),
        )
    res = invoke("build", "-d", vision_images, "-e", headless_vit, "--cache", tmp_path / "c",
                  "--output", "pooled")  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--output tokens" in lines[0], res.stderr
    shards = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and "shards" in p.parts]
    assert not shards  # refused before any work


@pytest.mark.parametrize("whole", [False, True])
def test_a_siglip_without_its_pooling_head_serves_tokens_alone(
    tmp_path: Path, vision_images: Path, whole: bool
) -> None:
    """A SigLIP tower saved with ``vision_use_head=False`` gives no ``pooler_output`` (nor
    ``get_image_features``): its first row, a patch's token (SigLIP has no CLS), was served
    as ``pooled`` and ``image_embeds``. Its tokens alone are served now, and asking for the
    others is one line."""
    torch.manual_seed(0)
    vision = {**TINY_VISION, **PATCH, "intermediate_size": 64, "vision_use_head": False}
    if whole:
        text = {**TINY_VISION, "intermediate_size": 64, "vocab_size": 99}
        config = transformers.SiglipConfig(vision_config=vision, text_config=text)
        model: Any = transformers.SiglipModel(config)
    else:
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**vision))
    folder = tmp_path / "siglip"
    model.eval().save_pretrained(folder)
    processor("Siglip", size={"height": 32, "width": 32}).save_pretrained(folder)
    assert build(vision_images, folder, cache=tmp_path / "s", workers=0).encoded == 4
    ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / "s", on_miss="error")
    assert set(ds[0]) == {"tokens"}
    tower = model.vision_model if whole else model
    served_tokens_equal_transformers(ds, tower, folder)
    for part in ("pooled", "image_embeds") if whole else ("pooled",):
        with pytest.raises(ConfigError, match="vision_use_head=false") as refused:
            build(vision_images, folder, cache=tmp_path / "s", recipe=Recipe(output=part))
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("kind", ["bit", "swin"])
def test_a_model_of_stages_builds_and_refuses_layers_in_one_line(
    tmp_path: Path, vision_images: Path, kind: str
) -> None:
    """BiT and Swin configs count stages (``depths``), not ``num_hidden_layers``: every
    build of such a folder failed with ``internal error: KeyError: 'num_hidden_layers'``.
    It builds (tokens and pooled equal transformers' own), and ``--layers`` is one line."""
    torch.manual_seed(0)
    if kind == "bit":
        config: Any = transformers.BitConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck",
            num_groups=4, out_features=None, out_indices=None,
        )  # fmt: skip
        model: Any = transformers.BitModel(config)
        proc = processor("Bit", size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32})
    else:
        config = transformers.SwinConfig(
            image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
            window_size=4,
        )  # fmt: skip
        model = transformers.SwinModel(config)
        proc = processor("ViT", size={"height": 32, "width": 32}, resample=3)
    folder = tmp_path / kind
    model.eval().save_pretrained(folder)
    proc.save_pretrained(folder)
    assert build(vision_images, folder, cache=tmp_path / "s", workers=0).encoded == 4
    ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / "s", on_miss="error")
    reference = transformers.AutoModel.from_pretrained(folder).eval()
    for parts, pixels, path in served_and_pixels(ds, folder):
        with torch.inference_mode():
            want = reference(pixel_values=pixels)
        assert rel_error(parts["tokens"], want.last_hidden_state[0]) < 1e-5, path
        assert rel_error(parts["pooled"], want.pooler_output[0]) < 1e-5, path
    res = invoke("build", "-d", vision_images, "-e", folder, "--cache", tmp_path / "c",
                 "--layers", "1")  # fmt: skip
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "num_hidden_layers" in lines[0] and "internal error" not in lines[0], res.stderr


def test_a_vision_model_without_a_pooler_output_serves_its_cls_row_as_pooled(
    tmp_path: Path, vision_images: Path
) -> None:
    """ViTMSN's output has no ``pooler_output``; its own heads read the CLS row. A form of
    r27.4 served its tokens alone under the key it always had, so a store built before served
    ``pooled`` where a build now refused it: the CLS row is ``pooled`` again, equal to the
    model run now, and its key names the same features."""
    torch.manual_seed(0)
    config = transformers.ViTMSNConfig(**TINY_VISION, **PATCH, intermediate_size=64)
    folder = tmp_path / "msn"
    transformers.ViTMSNModel(config).eval().save_pretrained(folder)
    processor("ViT", size={"height": 32, "width": 32}, resample=2).save_pretrained(folder)
    asked = Recipe(output="pooled")
    assert build(vision_images, folder, cache=tmp_path / "s", workers=0).encoded == 4
    assert build(vision_images, folder, cache=tmp_path / "s", recipe=asked).ok  # from the first
    ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / "s", on_miss="error")
    one = CachedFeatureDataset(
        vision_images, folder, cache=tmp_path / "s", recipe=asked, on_miss="error"
    )
    model = transformers.ViTMSNModel.from_pretrained(folder).eval()
    for i, (parts, pixels, path) in enumerate(served_and_pixels(ds, folder)):
        with torch.inference_mode():
            tokens = model(pixel_values=pixels).last_hidden_state[0]
        assert set(parts) == {"pooled", "tokens"}
        assert rel_error(parts["tokens"], tokens) < 1e-5, path
        assert rel_error(parts["pooled"], tokens[0]) < 1e-5, path
        assert rel_error(one[i], tokens[0]) < 1e-5, path


def test_a_clip_vision_tower_saved_with_its_projection_serves_image_embeds(
    tmp_path: Path, vision_images: Path
) -> None:
    """A ``CLIPVisionModelWithProjection`` folder (IP-Adapter's and Stable Diffusion's image
    encoders) was loaded as ``AutoModel`` builds it, its trained ``visual_projection``
    dropped without a word: no ``image_embeds``. It is loaded by its own class now, and each
    part equals that class run now."""
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        **TINY_VISION, **PATCH, intermediate_size=64, projection_dim=16
    )
    folder = tmp_path / "image-encoder"
    transformers.CLIPVisionModelWithProjection(config).eval().save_pretrained(folder)
    processor("CLIP", size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
              ).save_pretrained(folder)  # fmt: skip
    assert build(vision_images, folder, cache=tmp_path / "s", workers=0).encoded == 4
    ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / "s", on_miss="error")
    model = transformers.CLIPVisionModelWithProjection.from_pretrained(folder).eval()
    for got, pixels, path in served_and_pixels(ds, folder):
        with torch.inference_mode():
            want = model(pixel_values=pixels)
        assert set(got) == {"image_embeds", "pooled", "tokens"}
        assert rel_error(got["image_embeds"], want.image_embeds[0]) < 1e-5, path
        assert rel_error(got["tokens"], want.last_hidden_state[0]) < 1e-5, path


def save_whole_model(folder: Path, kind: str) -> Path:
    """A whole image-text model (both towers), saved as a download gives it."""
    torch.manual_seed(0)
    vision = {**TINY_VISION, **PATCH, "intermediate_size": 64}
    text = {**TINY_VISION, "intermediate_size": 64, "vocab_size": 99}
    if kind == "clip":
        config = transformers.CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)
        model: Any = transformers.CLIPModel(config)
        proc = processor("CLIP", size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        model = transformers.SiglipModel(
            transformers.SiglipConfig(vision_config=vision, text_config=text)
        )
        proc = processor("Siglip", size={"height": 32, "width": 32})
    model.eval().save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


def image_features(model: Any, pixels: torch.Tensor) -> torch.Tensor:
    """``get_image_features`` as this transformers gives it (a tensor, or an output in 5.x)."""
    out = model.get_image_features(pixel_values=pixels)
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_a_whole_clip_or_siglip_folder_serves_its_vision_tower_and_image_embeds(
    tmp_path: Path, vision_images: Path, kind: str
) -> None:
    """Old main refused the folder ("save its vision_model alone")."""
    folder = save_whole_model(tmp_path / kind, kind)
    report = build(vision_images, folder, cache=tmp_path / "s", workers=0, batch_size=3)
    assert report.ok and report.encoded == 4
    ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / "s", on_miss="error")
    width = 16 if kind == "clip" else 32  # CLIP projects to projection_dim; SigLIP does not
    served_tower_equals_transformers(ds, folder, width)


def served_tower_equals_transformers(ds: CachedFeatureDataset, folder: Path, width: int) -> None:
    """Each image ``ds`` serves equals the whole model's vision tower and image embeddings, run
    now by transformers with the folder's own image processor."""
    model = transformers.AutoModel.from_pretrained(folder).eval()
    for parts, pixels, path in served_and_pixels(ds, folder):
        with torch.inference_mode():
            tower = model.vision_model(pixel_values=pixels)
            embeds = image_features(model, pixels)[0]
        assert set(parts) == {"pooled", "tokens", "image_embeds"}
        assert rel_error(parts["tokens"], tower.last_hidden_state[0]) < 1e-5, path
        assert rel_error(parts["pooled"], tower.pooler_output[0]) < 1e-5, path
        assert parts["image_embeds"].shape == (width,)
        assert rel_error(parts["image_embeds"], embeds) < 1e-5, path


def save_whole_processor(folder: Path, whole: Any) -> Path:
    """``folder`` as transformers 5 saves a whole processor (``whole``, its tokenizer with it):
    the processor's parts in ``processor_config.json`` beside the tokenizer's files, and no
    ``preprocessor_config.json``."""
    (folder / "preprocessor_config.json").unlink()
    whole.save_pretrained(folder)
    if (folder / "preprocessor_config.json").exists():
        pytest.skip("this transformers saves a processor's parts in preprocessor_config.json")
    assert (folder / "processor_config.json").is_file() and (folder / "tokenizer_config.json")
    return folder


def test_a_whole_clip_saved_with_its_processor_and_tokenizer_serves_its_images(
    tmp_path: Path, vision_images: Path
) -> None:
    """``CLIPProcessor.save_pretrained`` (transformers 5) writes the image processor into
    ``processor_config.json`` beside the tokenizer's files, and no ``preprocessor_config.json``.
    featbake looked for the latter alone and took the folder for a text model: an image build
    was refused ("is a text model"), and a default build looked for .txt files. Now the
    folder is a vision folder, and what it serves equals transformers run now."""
    from tests.encode.test_text import clip_tokenizer

    folder = save_whole_model(tmp_path / "clip", "clip")
    image_processor = transformers.AutoImageProcessor.from_pretrained(folder)
    tokenizer = clip_tokenizer()
    save_whole_processor(folder, transformers.CLIPProcessor(image_processor, tokenizer))
    for source in ("image", "audio"):  # asked for, and the default
        report = build(
            vision_images, folder, cache=tmp_path / source, workers=0, recipe=Recipe(source=source)
        )
        assert report.ok and report.encoded == 4, source
        ds = CachedFeatureDataset(vision_images, folder, cache=tmp_path / source, on_miss="error")
        assert ds.recipe.source == "image"
        served_tower_equals_transformers(ds, folder, width=16)


def test_an_audio_model_saved_with_its_processor_and_tokenizer_serves_its_clips(
    tmp_path: Path, clips: Path
) -> None:
    """The same for ``Wav2Vec2Processor.save_pretrained``: its feature extractor in
    ``processor_config.json`` beside a CTC tokenizer. The folder was taken for a text model
    (the build looked for .txt files); now its clips are served as transformers gives them."""
    folder = save_model(tmp_path / "w2v")
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, "a": 5}))
    extractor = transformers.Wav2Vec2FeatureExtractor.from_pretrained(folder)
    tokenizer = transformers.Wav2Vec2CTCTokenizer(str(vocab))
    save_whole_processor(folder, transformers.Wav2Vec2Processor(extractor, tokenizer))
    report = build(clips, folder, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 8
    ds = CachedFeatureDataset(clips, folder, cache=tmp_path / "s", on_miss="error")
    for i in range(len(ds)):
        want = reference(folder, Path(ds.path(i))).last_hidden_state[0]
        assert rel_error(ds[i], want) < 1e-4, ds.path(i)


def test_image_embeds_alone_and_layers_from_a_whole_clip_folder(
    tmp_path: Path, vision_images: Path
) -> None:
    folder = save_whole_model(tmp_path / "clip", "clip")
    res = invoke("build", "-d", vision_images, "-e", folder, "--cache", tmp_path / "s",
                  "--output", "image_embeds", "--workers", "0")  # fmt: skip
    assert res.returncode == 0, res.stderr
    one = Recipe(output="image_embeds")
    ds = CachedFeatureDataset(
        vision_images, folder, cache=tmp_path / "s", recipe=one, on_miss="error"
    )
    layers = Recipe(layers="all")
    store = tmp_path / "s"
    build(vision_images, folder, cache=store, recipe=layers, workers=0)
    deep = CachedFeatureDataset(vision_images, folder, cache=store, recipe=layers, on_miss="error")
    model = transformers.AutoModel.from_pretrained(folder).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(folder)
    for i in range(len(ds)):
        image = decode_image(Path(ds.path(i)), ds.recipe.image_steps)
        pixels = proc(images=image, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            hidden = model.vision_model(pixel_values=pixels, output_hidden_states=True)
            want = image_features(model, pixels)[0]
        assert ds[i].shape == (16,) and rel_error(ds[i], want) < 1e-5
        assert set(deep[i]) == {"layer0", "layer1", "layer2"}
        for k in range(3):
            assert rel_error(deep[i][f"layer{k}"], hidden.hidden_states[k][0]) < 1e-5
