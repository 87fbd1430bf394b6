"""Vision folders as users download them: a ViT saved without its pooling layer (DINO, MAE) and
a whole CLIP model (text and vision towers), each built from a config and saved with
save_pretrained, beside its image processor.

The reference is transformers itself, run now on each image as featbake decodes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.images import decode_image
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_image_folder
from tests.conftest import invoke
from tests.helpers import rel_error

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
PATCH = {"image_size": 32, "patch_size": 8}


def processor(kind: str, **kw: Any) -> Any:
    """transformers' PIL-backend image processor (``...Pil`` in transformers 5)."""
    cls = getattr(transformers, f"{kind}ImageProcessorPil", None)
    return (cls or getattr(transformers, f"{kind}ImageProcessor"))(**kw)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_image_folder(root, 4, size=(40, 56), seed=3)
    return root


@pytest.fixture(scope="module")
def headless_vit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ViT saved as DINO and MAE checkpoints are: ``add_pooling_layer=False``."""
    folder = tmp_path_factory.mktemp("models") / "dino"
    torch.manual_seed(0)
    config = transformers.ViTConfig(**TINY, **PATCH, intermediate_size=64)
    transformers.ViTModel(config, add_pooling_layer=False).eval().save_pretrained(folder)
    processor("ViT", size={"height": 32, "width": 32}, resample=2).save_pretrained(folder)
    return folder


def served_tokens_equal_transformers(ds: CachedFeatureDataset, model: Any, proc: Any) -> None:
    for i in range(len(ds)):
        image = decode_image(Path(ds.path(i)), ds.recipe.image_steps)
        with torch.inference_mode():
            want = model(**proc(images=image, return_tensors="pt")).last_hidden_state[0]
        assert rel_error(ds[i]["tokens"], want) < 1e-5, ds.path(i)


def test_a_vit_saved_without_its_pooler_serves_its_tokens(
    tmp_path: Path, images: Path, headless_vit: Path
) -> None:
    """Old main refused the folder: "2 missing (pooler.dense.bias, pooler.dense.weight)"."""
    report = build(images, headless_vit, cache=tmp_path / "s", workers=0, batch_size=3)
    assert report.ok and report.encoded == 4
    ds = CachedFeatureDataset(images, headless_vit, cache=tmp_path / "s", on_miss="error")
    assert set(ds[0]) == {"tokens"}  # no pooled part: its head would be random
    model = transformers.ViTModel.from_pretrained(headless_vit, add_pooling_layer=False).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(headless_vit)
    served_tokens_equal_transformers(ds, model, proc)


def test_asking_a_headless_vit_for_pooled_is_one_line(
    tmp_path: Path, images: Path, headless_vit: Path
) -> None:
    with pytest.raises(ConfigError, match="without its pooling layer"):
        build(images, headless_vit, cache=tmp_path / "s", recipe=Recipe(output="pooled"))
    res = invoke("build", "-d", images, "-e", headless_vit, "--cache", tmp_path / "c",
                  "--output", "pooled")  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--output tokens" in lines[0], res.stderr
    shards = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and "shards" in p.parts]
    assert not shards  # refused before any work


def save_whole_model(folder: Path, kind: str) -> Path:
    """A whole image-text model (both towers), saved as a download gives it."""
    torch.manual_seed(0)
    vision = {**TINY, **PATCH, "intermediate_size": 64}
    text = {**TINY, "intermediate_size": 64, "vocab_size": 99}
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
    tmp_path: Path, images: Path, kind: str
) -> None:
    """Old main refused the folder ("save its vision_model alone")."""
    folder = save_whole_model(tmp_path / kind, kind)
    report = build(images, folder, cache=tmp_path / "s", workers=0, batch_size=3)
    assert report.ok and report.encoded == 4
    ds = CachedFeatureDataset(images, folder, cache=tmp_path / "s", on_miss="error")
    model = transformers.AutoModel.from_pretrained(folder).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(folder)
    width = 16 if kind == "clip" else 32  # CLIP projects to projection_dim; SigLIP does not
    for i in range(len(ds)):
        image = decode_image(Path(ds.path(i)), ds.recipe.image_steps)
        pixels = proc(images=image, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            tower = model.vision_model(pixel_values=pixels)
            embeds = image_features(model, pixels)[0]
        parts = ds[i]
        assert set(parts) == {"pooled", "tokens", "image_embeds"}
        assert rel_error(parts["tokens"], tower.last_hidden_state[0]) < 1e-5, ds.path(i)
        assert rel_error(parts["pooled"], tower.pooler_output[0]) < 1e-5, ds.path(i)
        assert parts["image_embeds"].shape == (width,)
        assert rel_error(parts["image_embeds"], embeds) < 1e-5, ds.path(i)


def test_image_embeds_alone_and_layers_from_a_whole_clip_folder(
    tmp_path: Path, images: Path
) -> None:
    folder = save_whole_model(tmp_path / "clip", "clip")
    res = invoke("build", "-d", images, "-e", folder, "--cache", tmp_path / "s",
                  "--output", "image_embeds", "--workers", "0")  # fmt: skip
    assert res.returncode == 0, res.stderr
    one = Recipe(output="image_embeds")
    ds = CachedFeatureDataset(images, folder, cache=tmp_path / "s", recipe=one, on_miss="error")
    layers = Recipe(layers="all")
    store = tmp_path / "s"
    build(images, folder, cache=store, recipe=layers, workers=0)
    deep = CachedFeatureDataset(images, folder, cache=store, recipe=layers, on_miss="error")
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
