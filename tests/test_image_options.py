"""Image options as the command line spells them (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.errors import ConfigError
from featbake.image_recipe import (
    IMAGE_OPTIONS,
    MAX_SIDE,
    ColourMode,
    ImageRecipe,
    Interpolation,
    Resize,
    Size,
    parse_image_options,
)
from featbake.testing import write_image_folder
from tests.conftest import invoke


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
