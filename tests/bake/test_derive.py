"""An --output build reuses what a whole-output build stored (issue 18 item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.sources import AudioSource
from featbake.errors import SourceError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.fidelity import read_fidelity
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder
from tests.conftest import encoded_rows, invoke, live_features


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
    assert first.batching and first.batching_note  # how it batched what it encoded
    whole = build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    assert whole.encoded == 16  # a part cannot stand in for the whole output
    res = invoke(
        "build", "-e", multi_encoder_file, "-d", audio_dir, "--cache", store_dir,
        "--output", "hidden",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "16 parts a whole-output build stored" in res.stdout
    # It encoded nothing, so it batched nothing: it printed a `batching` line all the same.
    assert "batching" not in res.stdout, res.stdout
    converted = build(
        audio_dir, multi_encoder_file, cache=store_dir, workers=0, recipe=Recipe(dtype="float16")
    )
    assert (converted.encoded, converted.converted) == (0, 16)
    assert (converted.batching, converted.batching_note) == ("", "")


# -- issue 32 item 3: --dtype after a float32 build is a conversion, not an encoding ----------
def _json_report(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _served(data: Path, store: Path, dtype: str, pkg: str) -> CachedFeatureDataset:
    sys.path.insert(0, pkg)
    try:
        return CachedFeatureDataset(
            data, "countenc:build", cache=store, recipe=Recipe(dtype=dtype), on_miss="error",
            serve_dtype="float32" if dtype == "int8" else None,
        )  # fmt: skip
    finally:
        sys.path.remove(pkg)


def test_a_dtype_build_after_float32_converts_the_store_and_encodes_nothing(
    tmp_path: Path, audio_dir: Path, counting_encoder: dict[str, str]
) -> None:
    store, fresh = tmp_path / "store", tmp_path / "fresh"
    base = ["build", "-e", "countenc:build", "-d", audio_dir, "--workers", "0", "--json"]
    first = _json_report(invoke(*base, "--cache", store, env=counting_encoder))
    assert first["encoded"] == 16
    calls = len(encoded_rows(counting_encoder))
    pkg = counting_encoder["PYTHONPATH"].split(os.pathsep)[-1]
    src, enc = AudioSource(Recipe()), TinyConvEncoder().eval()
    for dtype, tol in (("float16", 1e-3), ("int8", None)):
        report = _json_report(
            invoke(*base, "--cache", store, "--dtype", dtype, env=counting_encoder)
        )
        # It used to run the encoder on all 16 inputs again.
        assert (report["encoded"], report["converted"], report["reused"]) == (0, 16, 0)
        assert len(encoded_rows(counting_encoder)) == calls  # the encoder never ran
        ds = _served(audio_dir, store, dtype, pkg)
        for i in range(len(ds)):
            with torch.no_grad():
                live = enc(src.load(Path(ds.path(i))).unsqueeze(0))[0]
            got = ds[i]
            if tol is not None:  # float16: the encoder's output rounded to float16
                assert got.dtype == torch.float16
                torch.testing.assert_close(got.float(), live.half().float(), rtol=tol, atol=tol)
            else:  # int8: within its quantisation error of the encoder's output
                assert (got - live).norm() / live.norm() < 0.02
    # The int8 conversion stores what an int8 build encodes, and records the same fidelity.
    built = _json_report(invoke(*base, "--cache", fresh, "--dtype", "int8", env=counting_encoder))
    assert built["encoded"] == 16
    assert report["fidelity"]["items"] == built["fidelity"]["items"] == 16
    assert abs(report["fidelity"]["rel_rms"] - built["fidelity"]["rel_rms"]) < 1e-6
    assert read_fidelity(Layout(store), report["root"]) is not None  # `featbake roots` shows it
    converted = _served(audio_dir, store, "int8", pkg)
    encoded = _served(audio_dir, fresh, "int8", pkg)
    for i in range(len(converted)):
        torch.testing.assert_close(converted[i], encoded[i], rtol=0, atol=1e-6)


# == test_serve_copied =============================================================================
# Issue 32 item 2 in the library: a dataset asking one output of a store built with the whole
# output copies each part (encodes nothing), and a dataset that will encode live what the store
# holds under other options says so once, naming the option.


def test_one_output_of_a_whole_output_store_is_copied_not_encoded(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    assert build(audio_dir, multi_encoder_file, cache=store_dir, workers=0).encoded == 16
    recipe = Recipe(output="pooled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copying is not live encoding: nothing to warn of
        ds = CachedFeatureDataset(audio_dir, multi_encoder_file, cache=store_dir, recipe=recipe)
    assert ds.stored() == 0  # not under this recipe's keys: each item is a miss...
    for i in range(len(ds)):
        want = live_features(multi_encoder_file, Path(ds.path(i)), recipe)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-6)
    assert ds.cache_info().encoded == 0  # ...copied from the whole output, never encoded
    ds.flush()
    again = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, recipe=recipe, on_miss="error"
    )
    assert again.stored() == 16  # written back under its own keys: plain hits from now on
    for i in range(len(again)):
        want = live_features(multi_encoder_file, Path(again.path(i)), recipe)
        torch.testing.assert_close(again[i], want, rtol=1e-5, atol=1e-6)


def test_a_file_changed_since_the_dataset_was_made_is_not_copied(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, recipe=Recipe(output="pooled")
    )
    victim = Path(ds.path(0))
    victim.write_bytes(victim.read_bytes()[:-64])  # rewritten after its key was hashed
    with pytest.raises(SourceError, match="changed since this dataset was created"):
        ds[0]  # neither copied under the old bytes' key nor encoded from the new bytes


def test_live_encoding_of_data_stored_under_other_options_warns_once_naming_them(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with pytest.warns(UserWarning) as said:
        ds = CachedFeatureDataset(
            audio_dir, encoder_file, cache=store_dir, recipe=Recipe(sample_rate=8000)
        )
    texts = [str(w.message) for w in said if "featbake:" in str(w.message)]
    assert len(texts) == 1, texts
    assert "16 of 16 items" in texts[0] and "will be encoded live" in texts[0]
    assert "sample_rate=16000 in the store, 8000 asked" in texts[0]
    assert ds.stored() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the store's own options: nothing to say
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)


class _PastFloat16(torch.nn.Module):
    """Two outputs: frames past float16's range (~1e8) and their small mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 16, 400, stride=160)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x.unsqueeze(1)).transpose(1, 2)
        return y * 1e8, y.mean(1)


def test_an_int8_output_copied_from_an_int8_whole_output_build_is_served_as_a_fresh_one(
    tmp_path: Path,
) -> None:
    """``--output 0 --dtype int8`` over a store holding the whole output in int8 copies the
    packed rows, and recorded no span of their scales: a dataset served the copied root as
    float16 and refused every item (values up to 5e7), where a fresh build of the recipe is
    served as float32. The copies' scales are recorded now: the same serve dtype, warning and
    values as the fresh build (its error is measured where rows are encoded, not copied)."""
    from featbake.testing import write_audio_folder

    write_audio_folder(tmp_path / "audio", 4, seconds=(0.5, 1.5), seed=1)
    encoder = _PastFloat16().eval().requires_grad_(False)
    whole, one = Recipe(dtype="int8"), Recipe(dtype="int8", output="0")
    copied, fresh = tmp_path / "copied", tmp_path / "fresh"
    build(tmp_path / "audio", encoder, cache=copied, recipe=whole, workers=0)
    derived = build(tmp_path / "audio", encoder, cache=copied, recipe=one, workers=0)
    made = build(tmp_path / "audio", encoder, cache=fresh, recipe=one, workers=0)
    assert (derived.encoded, derived.derived, made.encoded) == (0, 4, 4)
    assert "as float32 by default" in derived.fidelity_warning
    assert derived.fidelity_warning == made.fidelity_warning
    for store in (copied, fresh):
        ds = CachedFeatureDataset(tmp_path / "audio", encoder, cache=store, recipe=one,
                                  on_miss="error")  # fmt: skip
        for i in range(len(ds)):
            with torch.inference_mode():
                want = encoder(AudioSource(Recipe()).load(ds.path(i)).unsqueeze(0))[0][0]
            got = ds[i]
            assert got.dtype == torch.float32 and torch.isfinite(got).all()
            assert float((got - want).norm() / want.norm()) < 0.02
