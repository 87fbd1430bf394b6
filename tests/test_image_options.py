"""Image options as the command line spells them (pure)."""

from __future__ import annotations

import pytest

from featbake.errors import ConfigError
from featbake.image_options import IMAGE_OPTIONS, parse_image_options
from featbake.image_recipe import ColourMode, ImageRecipe, Interpolation, Resize, Size


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
    ],
)
def test_bad_option_values_name_the_option(option: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_image_options(**{option: value})
