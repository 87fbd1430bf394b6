"""Hugging Face vision folders end to end: tiny ViT, DINOv2 and CLIP-vision models built from
configs and saved with save_pretrained, beside their image processors.

The reference is transformers itself, run now on each image: the folder's own processor
(``AutoImageProcessor``) and model, on the picture featbake decodes; never the store.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from featbake.bake.pipeline import build
from featbake.encode.hf import recipe_for_folder
from featbake.encode.images import decode_image
from featbake.errors import ConfigError
from featbake.image_recipe import Size
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_image_folder
from tests.conftest import invoke
from tests.helpers import real_photos, rel_error

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
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
    patch = {"image_size": 32, "patch_size": 8}
    if kind == "vit":
        model: Any = transformers.ViTModel(
            transformers.ViTConfig(**TINY, **patch, intermediate_size=64)
        )
        proc = processor_class("ViT")(size={"height": 32, "width": 32}, resample=2)
    elif kind == "dinov2":
        model = transformers.Dinov2Model(transformers.Dinov2Config(**TINY, **patch, mlp_ratio=2))
        proc = processor_class("Bit")(
            size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, **IMAGENET
        )
    else:
        model = transformers.CLIPVisionModel(
            transformers.CLIPVisionConfig(**TINY, **patch, intermediate_size=64)
        )
        proc = processor_class("CLIP")(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    model.eval().save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=8)
def load_reference(folder: str) -> tuple[Any, Any]:
    """The folder's model and image processor, loaded by transformers (once per folder)."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoImageProcessor.from_pretrained(folder)


def reference(folder: Path, image_path: Path, recipe: Recipe) -> Any:
    """transformers' processor + model now, on the image as featbake decodes it."""
    model, proc = load_reference(str(folder))
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
    assert ds.recipe.source == "image" and len(ds) == GOOD + len(BAD)  # as for bad audio
    for i in range(len(ds)):
        if Path(ds.path(i)).name in BAD:
            continue
        parts = ds[i]
        want = reference(folder, Path(ds.path(i)), ds.recipe)
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
        hidden = reference(folder, Path(ds.path(i)), ds.recipe).hidden_states
        assert set(parts) == {"layer0", "layer1", "layer2"}
        for k in range(3):
            assert parts[f"layer{k}"].dtype == torch.float16
            assert rel_error(parts[f"layer{k}"].float(), hidden[k][0]) < 2e-3
    pooled = Recipe(output="pooled")
    build(images, folder, cache=tmp_path / "s", recipe=pooled, workers=0)
    one = CachedFeatureDataset(images, folder, cache=tmp_path / "s", recipe=pooled, on_miss="error")
    want = reference(folder, Path(one.path(0)), one.recipe).pooler_output[0]
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
        want = reference(folder, Path(ds.path(i)), ds.recipe)
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
        want = reference(folder, images / str(rel), recipe)
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
        want = reference(folder, Path(ds.path(i)), ds.recipe)
        assert rel_error(ds[i]["tokens"], want.last_hidden_state[0]) < 1e-5
        assert rel_error(ds[i]["pooled"], want.pooler_output[0]) < 1e-5
