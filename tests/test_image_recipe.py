"""The image recipe (pure): fields, processor defaults, key fields, and the size arithmetic.

The size and crop arithmetic is checked against transformers' own functions over many sizes,
not against a copy of the rule.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from featbake.encode.images import transform
from featbake.errors import ConfigError
from featbake.image_recipe import (
    IMAGE_OPTIONS,
    MAX_SIDE,
    PROCESSOR_DEFAULTS,
    ColourMode,
    ImageRecipe,
    Interpolation,
    Resize,
    ResizeKind,
    Size,
    crop_box,
    describe_fields,
    parse_image_options,
    resized_size,
)
from featbake.recipe import Recipe
from featbake.testing import write_image_folder
from tests.conftest import invoke

image_transforms = pytest.importorskip("transformers.image_transforms")

VIT = {
    "image_processor_type": "ViTImageProcessor",
    "do_resize": True,
    "size": {"height": 224, "width": 224},
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
CLIP = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "do_center_crop": True,
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def test_processor_configs_become_recipes() -> None:
    vit = ImageRecipe.from_processor(VIT)
    assert vit.resize == Resize.exact(224, 224) and vit.crop is None
    assert vit.interpolation is Interpolation.BILINEAR and vit.mean == (0.5, 0.5, 0.5)
    clip = ImageRecipe.from_processor(CLIP)
    assert clip.resize == Resize(ResizeKind.SHORTEST_EDGE, 224) and clip.crop == Size(224, 224)
    assert clip.interpolation is Interpolation.BICUBIC and clip.rescale == pytest.approx(1 / 255)
    # An old-style int size: the shortest edge with a crop (CLIP), a square without (ViT).
    assert ImageRecipe.from_processor({**CLIP, "size": 256}).resize.kind is ResizeKind.SHORTEST_EDGE
    assert ImageRecipe.from_processor({**VIT, "size": 384}).resize == Resize.exact(384, 384)
    off = ImageRecipe.from_processor({**VIT, "do_normalize": False, "do_rescale": False})
    assert off.mean is None and off.std is None and off.rescale is None


@pytest.mark.parametrize(
    "config, words",
    [
        ({**VIT, "image_processor_type": "ConvNextImageProcessor"}, "does not reproduce"),
        ({**VIT, "do_pad": True}, "does not reproduce"),
        ({**VIT, "size": {"shortest_edge": 224, "longest_edge": 448}}, "--resize"),
        ({**VIT, "image_processor_type": "Dinov2ImageProcessor", "image_mean": None}, "mean"),
    ],
)
def test_processors_featbake_cannot_reproduce_are_refused(config: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ImageRecipe.from_processor(config)


#: Configs that leave settings out (or null), as a processor saved long ago or by hand does.
PARTIAL_CONFIGS = [
    {},
    {"size": 40},
    {"size": 40, "crop_size": 32},
    {"size": 40, "do_center_crop": False},
    {"size": {"height": 48, "width": 40}, "do_center_crop": False, "resample": None},
    {"size": {"height": 48, "width": 40}, "do_center_crop": False, "do_resize": None},
    {"image_mean": None, "image_std": None, "crop_size": {"height": 30, "width": 30}},
    {"image_mean": None, "do_normalize": False, "size": 36},
    {"do_center_crop": True, "crop_size": None, "size": 36},
    {"rescale_factor": None, "size": 36},
    {"do_normalize": False, "do_rescale": False, "size": 36},
    # A config's own default_to_square, which transformers reads from the file (featbake took
    # the class's: a ViT folder saying false made 40x40 pixels where transformers made 40x57).
    {"size": 40, "default_to_square": False, "do_center_crop": True, "crop_size": 32},
    {"size": 36, "default_to_square": True},
]


@pytest.mark.parametrize("kind", sorted(PROCESSOR_DEFAULTS))
def test_what_a_processor_config_leaves_out_is_what_transformers_class_gives(
    tmp_path: Path, kind: str
) -> None:
    """A config read by featbake transforms an image as the same processor, loaded by
    transformers, does: the class's defaults for what it leaves out, an int size as the class
    reads it. featbake took its own (bilinear, no crop, an int size as a square without a
    crop): a CLIP config without ``resample`` was resized bilinear, a BiT one without
    ``do_center_crop`` not cropped. A step that is on with a setting set to null is refused,
    as transformers' processor refuses it (featbake took the class's default: a null
    ``crop_size`` cropped to 224 x 224). A config's own ``default_to_square`` is read as
    transformers reads it."""
    transformers = pytest.importorskip("transformers")
    json = pytest.importorskip("json")
    pixels = np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    for i, partial in enumerate(PARTIAL_CONFIGS):
        config = {"image_processor_type": kind, **partial}
        folder = tmp_path / f"p{i}"
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text(json.dumps(config))
        resolved = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
        try:
            want = resolved(images=image, return_tensors="pt")["pixel_values"][0]
        except ValueError as e:
            assert "specified" in str(e), (kind, partial, e)
            with pytest.raises(ConfigError, match="null") as refused:
                ImageRecipe.from_processor(config)
            assert "\n" not in str(refused.value)
            continue
        steps = ImageRecipe.from_processor(config)
        assert torch.equal(transform(image, steps), want), (kind, partial)
        assert steps == ImageRecipe.from_processor(resolved.to_dict()), (kind, partial)


def test_every_step_is_in_the_key_and_audio_keys_do_not_see_it() -> None:
    base = Recipe(source="image", image=ImageRecipe.from_processor(CLIP))
    edits = {
        "resize": Resize(ResizeKind.SHORTEST_EDGE, 256),
        "interpolation": Interpolation.BILINEAR,
        "antialias": False,
        "crop": Size(196, 196),
        "rescale": 1 / 256,
        "mean": (0.5, 0.5, 0.5),
        "std": (0.25, 0.25, 0.25),
        "exif": False,
    }
    fps = {base.fingerprint()}
    for field, value in edits.items():
        fps.add(base.replace(image=base.image_steps.replace(**{field: value})).fingerprint())
    fps.add(
        base.replace(image=base.image_steps.replace(mode="L", mean=None, std=None)).fingerprint()
    )
    assert len(fps) == len(edits) + 2
    # An audio recipe ignores image steps entirely: its key is the one it always had.
    assert Recipe(image=ImageRecipe(crop=None)).fingerprint() == Recipe().fingerprint()
    assert "image" not in Recipe().as_dict()
    # Spellings of one transform share a key.
    a = ImageRecipe(interpolation="bicubic", mean=[0.5, 0.5, 0.5], std=(0.5, 0.5, 0.5))
    b = ImageRecipe(interpolation=3, mean=(0.5, 0.5, 0.5), std=[0.5] * 3)  # type: ignore[arg-type]
    assert (
        Recipe(source="image", image=a).fingerprint()
        == Recipe(source="image", image=b).fingerprint()
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mean": None}, "both --mean and --std"),
        ({"mean": (0.5, 0.5)}, "3 values"),
        ({"std": (0.5, 0.0, 0.5)}, "positive"),
        ({"rescale": float("nan")}, "--rescale"),
        ({"interpolation": "cubic"}, "unknown interpolation"),
        ({"antialias": False, "interpolation": "lanczos"}, "no lanczos"),
        ({"exif": 1}, "True or False"),
    ],
)
def test_bad_steps_are_refused_with_the_fix(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ImageRecipe(**kwargs)


def test_sizes_parse_and_describe() -> None:
    assert Resize.parse("256") == Resize(ResizeKind.SHORTEST_EDGE, 256)
    assert Resize.parse("224x160") == Resize.exact(224, 160)
    assert Resize.parse("none").kind is ResizeKind.NONE
    for bad in ("", "0", "x", "224x", "a", "1x2x3"):
        with pytest.raises(ConfigError, match="224x224"):
            Resize.parse(bad)
    steps = ImageRecipe.from_processor(CLIP).replace(antialias=False, exif=False)
    assert (
        steps.describe()
        == "short 224 bicubic no-antialias crop 224x224 rescale mean/std RGB no-exif"
    )
    assert describe_fields(steps.key_fields()) == steps.describe()


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 2000),
    width=st.integers(1, 2000),
    size=st.integers(1, 600),
)
def test_shortest_edge_matches_transformers(height: int, width: int, size: int) -> None:
    image = np.zeros((height, width, 1), np.uint8)
    want = image_transforms.get_resize_output_image_size(
        image, size, default_to_square=False, input_data_format="channels_last"
    )
    assert resized_size(height, width, Resize(ResizeKind.SHORTEST_EDGE, size)) == want


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 60),
    width=st.integers(1, 60),
    crop_h=st.integers(1, 60),
    crop_w=st.integers(1, 60),
)
def test_crop_box_matches_transformers_center_crop(
    height: int, width: int, crop_h: int, crop_w: int
) -> None:
    """Cropping an index image by the box gives exactly transformers' crop (padding included)."""
    from featbake.encode.images import center_crop

    image = (np.arange(height * width).reshape(height, width, 1) % 251 + 1).astype(np.uint8)
    want = image_transforms.center_crop(image, (crop_h, crop_w), input_data_format="channels_last")
    got = center_crop(image, Size(crop_h, crop_w))
    assert got.shape == want.shape and np.array_equal(got, want)
    box = crop_box(height, width, Size(crop_h, crop_w))
    assert box.top >= 0 and box.left >= 0


# == test_image_options ============================================================================
# Image options as the command line spells them (pure).


def test_options_parse_to_recipe_changes() -> None:
    changes = parse_image_options(
        resize="224x224",
        crop="none",
        interpolation="BICUBIC",
        antialias=False,
        rescale="1/255",
        mean="0.5,0.5,0.5",
        std="0.25, 0.25, 0.25",
        image_mode="rgb",
        exif=False,
    )
    assert set(changes) == {"mode" if k == "image_mode" else k for k in IMAGE_OPTIONS}
    steps = ImageRecipe().replace(**changes)
    assert steps.resize == Resize.exact(224, 224) and steps.crop is None
    assert steps.interpolation is Interpolation.BICUBIC and steps.rescale == 1 / 255
    assert steps.std == (0.25, 0.25, 0.25) and steps.mode is ColourMode.RGB
    assert not steps.antialias and not steps.exif
    assert parse_image_options() == {}  # nothing given: the folder or the defaults decide
    assert parse_image_options(crop="224x160")["crop"] == Size(224, 160)
    off = parse_image_options(rescale="none", mean="none", std="none", image_mode="grey")
    assert off == {"rescale": None, "mean": None, "std": None, "mode": ColourMode.GREY}


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("crop", "big", "--crop takes a size"),
        ("resize", "-3", "--resize takes a size"),
        ("rescale", "1/0", "--rescale takes a number"),
        ("mean", "a,b,c", "--mean takes a number"),
        ("image_mode", "cmyk", "rgb or grey"),
        ("interpolation", "spline", "unknown interpolation"),
        ("resize", "99999x99999", f"at most {MAX_SIDE} pixels a side"),
        ("resize", "99999", f"at most {MAX_SIDE} pixels a side"),
        ("crop", "224x9000", f"at most {MAX_SIDE} pixels a side"),
    ],
)
def test_bad_option_values_name_the_option(option: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_image_options(**{option: value})


@pytest.mark.parametrize("mean", ["nan,0,0", "0,inf,0", "-inf,0,0"])
def test_a_mean_that_is_not_finite_is_refused(mean: str) -> None:
    with pytest.raises(ConfigError, match="--mean values must be finite"):
        ImageRecipe().replace(**parse_image_options(mean=mean))


@pytest.mark.parametrize(
    "options, needle",
    [
        (("--mean", "nan,0,0"), "--mean values must be finite"),  # was: internal ValueError
        (("--mean", "inf,0,0", "--std", "1,1,1"), "--mean values must be finite"),
        (("--resize", "99999x99999"), "at most 8192 pixels a side"),  # was: MemoryError per image
    ],
)
def test_absurd_image_options_are_one_line_and_exit_2_before_any_work(
    tmp_path: Path, encoder_file: Path, options: tuple[str, ...], needle: str
) -> None:
    write_image_folder(tmp_path / "images", 2)
    res = invoke("build", "-e", encoder_file, "-d", tmp_path / "images", "--source", "image",
                  "--cache", tmp_path / "c", *options, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "internal error" not in lines[0], lines
    assert "hash:" not in res.stderr  # refused before any input was read


def test_a_config_naming_only_its_feature_extractor_is_read_as_transformers_reads_it(
    tmp_path: Path,
) -> None:
    """openai/clip-vit-*, google/vit-*, DeiT and DINO ship ``feature_extractor_type`` and no
    ``image_processor_type``: refused as an untyped processor, with advice no option could
    follow. transformers reads ``CLIPFeatureExtractor`` as ``CLIPImageProcessor``; so does
    featbake now, to the recipe transformers' resolved settings give."""
    transformers = pytest.importorskip("transformers")
    import json

    legacy = {k: v for k, v in CLIP.items() if k != "image_processor_type"}
    legacy |= {"feature_extractor_type": "CLIPFeatureExtractor", "size": 32, "crop_size": 32}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(legacy))
    resolved = transformers.AutoImageProcessor.from_pretrained(tmp_path, local_files_only=True)
    got = ImageRecipe.from_processor(legacy)
    assert got == ImageRecipe.from_processor(resolved.to_dict())
    assert got.resize == Resize(ResizeKind.SHORTEST_EDGE, 32) and got.crop == Size(32, 32)


def test_a_scalar_mean_and_null_flags_are_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """A scalar ``image_mean``/``image_std`` (broadcast over the channels by transformers) was
    an internal error (``tuple(0.5)``); a ``do_*`` flag set to null, off for transformers
    (``if do_center_crop:``), took the class's default (cropped, normalised)."""
    transformers = pytest.importorskip("transformers")
    import json

    scalar = ImageRecipe.from_processor({**VIT, "image_mean": 0.5, "image_std": 0.25})
    assert scalar.mean == (0.5, 0.5, 0.5) and scalar.std == (0.25, 0.25, 0.25)
    nulls = {**CLIP, "size": 40, "do_center_crop": None, "do_normalize": None}
    off = ImageRecipe.from_processor(nulls)
    assert off.crop is None and off.mean is None and off.std is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(nulls))
    proc = transformers.AutoImageProcessor.from_pretrained(tmp_path, local_files_only=True)
    image = write_image_folder(tmp_path / "img", 1, size=(56, 40))[0]
    from PIL import Image

    from featbake.encode.sources import source_for

    want = proc(images=Image.open(image).convert("RGB"), return_tensors="np")["pixel_values"][0]
    got = source_for(Recipe(source="image", image=off)).load(image).numpy()
    assert got.shape == want.shape  # not cropped to 32x32 on either side
    assert np.abs(got - want).max() < 1e-5
