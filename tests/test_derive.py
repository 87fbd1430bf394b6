"""An --output build reuses what a whole-output build stored (issue 18 item 5)."""

from __future__ import annotations

from pathlib import Path

import torch

from featbake.bake.pipeline import build
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from tests.conftest import live_features, run_cli


def test_output_h_after_a_whole_output_build_encodes_nothing_and_serves_live(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    whole = build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    assert whole.encoded == 16
    part = build(
        audio_dir, multi_encoder_file, cache=store_dir, workers=0,
        recipe=Recipe(output="hidden"),
    )  # fmt: skip
    assert (part.encoded, part.derived, part.reused) == (0, 16, 0)  # it used to encode 16
    again = build(audio_dir, multi_encoder_file, cache=store_dir, recipe=Recipe(output="hidden"))
    assert (again.encoded, again.derived, again.reused) == (0, 0, 16)
    ds = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, output="hidden", on_miss="error"
    )
    for i in range(len(ds)):
        want = live_features(multi_encoder_file, Path(ds.path(i)), Recipe(output="hidden"))
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-6)


def test_a_part_build_first_still_encodes_and_the_cli_says_what_it_copied(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    first = build(
        audio_dir, multi_encoder_file, cache=store_dir, workers=0, recipe=Recipe(output="pooled")
    )
    assert (first.encoded, first.derived) == (16, 0)  # nothing to copy from
    whole = build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    assert whole.encoded == 16  # a part cannot stand in for the whole output
    res = run_cli(
        "build", "-e", multi_encoder_file, "-d", audio_dir, "--cache", store_dir,
        "--output", "hidden",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "16 parts a whole-output build stored" in res.stdout
