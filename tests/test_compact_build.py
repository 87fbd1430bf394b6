"""``--dtype int8`` / ``fp8`` builds: stored bytes equal quantising the encoder's output now,
keys per dtype, fidelity measured and shown, bounds said, NaN refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.bake.stored import FIRST_ITEMS, SAMPLE_EVERY, sampled
from featbake.errors import ConfigError
from featbake.quantize import Fidelity, FidelityTally, Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.store.catalog import fidelity_file, read_fidelity
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder
from featbake.upkeep import drop_root, list_roots, stats
from tests.conftest import invoke, live_features
from tests.helpers import assert_store_consistent, root_keys, stored_features

FLOAT = Recipe()  # the encoder's float32 output, what int8 and fp8 are quantised from


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_stored_tensors_are_the_live_output_quantised(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, dtype: str
) -> None:
    scheme = Scheme(dtype)
    recipe = Recipe(dtype=dtype)
    # batch_size=1 runs the computation live encoding does: the packed bytes are equal.
    report = build(audio_dir, encoder_file, cache=tmp_path / "c", recipe=recipe, batch_size=1)
    assert report.encoded == 16 and report.ok
    stored = stored_features(tmp_path / "c", report.root)
    assert len(stored) == 16
    tally = FidelityTally()
    for rel, parts in stored.items():
        live = live_features(encoder_file, audio_dir / rel, FLOAT)
        assert isinstance(live, torch.Tensor)
        assert parts[""].dtype == scheme.packed_dtype
        assert torch.equal(parts[""], quantize(live, scheme)), rel
        tally.add(live, dequantize(parts[""], scheme, torch.float16))  # what is served
    # The build measured every item (16 < FIRST_ITEMS) against the same live output, as served.
    assert report.fidelity is not None
    measured = Fidelity.from_json(report.fidelity)
    assert measured.items == 16 and measured.served == "float16"
    assert measured.rel_rms == pytest.approx(tally.result().rel_rms, rel=1e-6)
    assert 0 < measured.rel_rms < (0.01 if dtype == "int8" else 0.04)
    assert_store_consistent(tmp_path / "c")


def test_int8_bytes_are_about_a_quarter_of_float32(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    sizes = {}
    for dtype in ("float32", "float16", "int8", "fp8"):
        r = build(audio_dir, encoder_file, cache=tmp_path / dtype, recipe=Recipe(dtype=dtype))
        sizes[dtype] = sum(t[""].nbytes for t in stored_features(tmp_path / dtype, r.root).values())
    # TinyConvEncoder has 64 dims: (64 + 4) / 256 bytes a frame; 768 dims give 772 / 3072.
    assert sizes["int8"] / sizes["float32"] == pytest.approx(68 / 256)
    assert sizes["fp8"] == sizes["int8"] and sizes["float16"] == sizes["float32"] // 2


def test_each_dtype_has_its_own_keys_and_root(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "c"
    reports = {
        d: build(audio_dir, encoder_file, cache=cache, recipe=Recipe(dtype=d), workers=0)
        for d in ("float16", "int8", "fp8")
    }
    assert len({r.root for r in reports.values()}) == 3
    keys = {d: set(root_keys(cache, r.root).values()) for d, r in reports.items()}
    assert not keys["int8"] & keys["fp8"] and not keys["int8"] & keys["float16"]
    again = build(audio_dir, encoder_file, cache=cache, recipe=Recipe(dtype="int8"), workers=0)
    assert (again.encoded, again.reused) == (0, 16)


def test_multi_output_parts_are_each_quantised(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path
) -> None:
    recipe = Recipe(dtype="int8")
    report = build(audio_dir, multi_encoder_file, cache=tmp_path / "c", recipe=recipe)
    assert report.ok
    for rel, parts in stored_features(tmp_path / "c", report.root).items():
        live = live_features(multi_encoder_file, audio_dir / rel, FLOAT)
        assert isinstance(live, dict) and set(parts) == set(live)
        for name, value in live.items():  # batched: within half a step, not bit for bit
            got = dequantize(parts[name], Scheme.INT8, torch.float32)
            step = value.abs().amax(-1, keepdim=True) / 127
            assert bool(((got - value).abs() <= step * 0.51 + 1e-6).all()), (rel, name)


def test_fidelity_is_recorded_with_the_root_and_shown_by_stats_and_roots(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "c"
    report = build(audio_dir, encoder_file, cache=cache, recipe=Recipe(dtype="fp8"), workers=0)
    plain = build(audio_dir, encoder_file, cache=cache, workers=0)
    recorded = read_fidelity(Layout(cache), report.root)
    assert recorded is not None and recorded.to_json() == report.fidelity
    assert plain.fidelity is None and not fidelity_file(Layout(cache), plain.root).exists()
    by_name = {r.name: r for r in list_roots(cache)}
    assert by_name[report.root].fidelity == report.fidelity
    assert by_name[plain.root].fidelity is None
    assert {r.name: r.fidelity for r in stats(cache).roots}[report.root] == report.fidelity
    shown = invoke("roots", "--cache", cache)
    assert shown.returncode == 0, shown.stderr
    assert f"{recorded.rel_rms:.2%} rel. RMS error" in shown.stdout
    as_json = json.loads(invoke("stats", "--cache", cache, "--json").stdout)
    assert {r["name"]: r["fidelity"] for r in as_json["roots"]}[report.root] == report.fidelity
    drop_root(cache, report.root)  # the record goes with its root
    assert not fidelity_file(Layout(cache), report.root).exists()


def test_a_build_over_the_error_bound_says_so(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    recipe = Recipe(dtype="fp8")
    quiet = build(audio_dir, encoder_file, cache=tmp_path / "a", recipe=recipe, workers=0)
    assert quiet.fidelity_warning == ""  # fp8 is ~2.4% on this encoder, under the 5% default
    loud = build(
        audio_dir, encoder_file, cache=tmp_path / "b", recipe=recipe, workers=0, max_error=0.01
    )
    assert "over the bound of 1.00%" in loud.fidelity_warning and loud.ok
    cli = invoke(
        "build", "--encoder", encoder_file, "--data", audio_dir, "--cache", tmp_path / "c",
        "--dtype", "fp8", "--max-error", "0.01",
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "over the bound of 1.00%" in cli.stderr and "fidelity" in cli.stdout


def test_bad_bounds_and_nonfinite_options_are_config_errors(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="--max-error"):
            build(audio_dir, encoder_file, cache=tmp_path / "c", max_error=bad)
    with pytest.raises(ConfigError, match="--allow-nonfinite cannot store NaN"):
        build(
            audio_dir,
            encoder_file,
            cache=tmp_path / "c",
            recipe=Recipe(dtype="int8"),
            allow_nonfinite=True,
        )


class _NanOnLong(TinyConvEncoder):
    """TinyConvEncoder, except that inputs over 1 s come out as NaN."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        return out * float("nan") if wav.shape[1] > 16000 else out


def test_nonfinite_features_are_refused_as_for_float_dtypes(
    tmp_path: Path, audio_dir: Path
) -> None:
    report = build(
        audio_dir, _NanOnLong(), cache=tmp_path / "c", recipe=Recipe(dtype="int8"), workers=0
    )
    assert report.failed and all("NaN or infinite values" in r for _, r in report.failed)
    assert len(stored_features(tmp_path / "c", report.root)) == 16 - len(report.failed)


def test_the_sample_is_the_first_items_then_one_key_in_sample_every() -> None:
    keys = [f"{i:08x}" + "0" * 56 for i in range(4096)]
    assert all(sampled(k, 0) for k in keys)  # the first items are all measured
    later = [k for k in keys if sampled(k, FIRST_ITEMS)]
    assert len(later) == len(keys) // SAMPLE_EVERY
