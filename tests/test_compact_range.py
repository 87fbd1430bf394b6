"""int8 / fp8 stores whose values float16 cannot hold (features ~1e7, or ~1e-6): the build
measures fidelity on what is served (after the cast), records the dtype that holds the values,
datasets serve that dtype by default, and no ``inf`` (or a rounding coarser than the codes) is
ever served: float16 asked for such a store is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from featbake.bake.pipeline import build
from featbake.errors import ConfigError
from featbake.quantize import (
    Fidelity,
    FidelityTally,
    ScaleSpan,
    Scheme,
    dequantize,
    quantize,
    unpack,
)
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import read_fidelity, recorded_serve_dtype
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, save_torchscript
from tests.conftest import live_features

FLOAT = Recipe()


class Scaled(nn.Module):
    """TinyConvEncoder's frames times ``k`` (its own output is ~0.1)."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.enc = TinyConvEncoder()
        self.k = k

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.enc(wav) * self.k


def _live(encoder: Path, ds: CachedFeatureDataset) -> list[torch.Tensor]:
    out = []
    for i in range(len(ds)):
        live = live_features(encoder, Path(ds.path(i)), FLOAT)
        assert isinstance(live, torch.Tensor)
        out.append(live)
    return out


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("k", [1e8, 1e-5])
def test_values_float16_cannot_hold_are_served_as_float32_and_measured_so(
    tmp_path: Path, audio_dir: Path, dtype: str, k: float
) -> None:
    scheme = Scheme(dtype)
    encoder = save_torchscript(Scaled(k), tmp_path / "scaled.pt")
    store = tmp_path / "store"
    report = build(audio_dir, encoder, cache=store, recipe=Recipe(dtype=dtype), batch_size=1)
    assert report.ok and report.fidelity is not None
    measured = Fidelity.from_json(report.fidelity)
    assert measured.served == "float32"
    assert "float16" in report.fidelity_warning and "float32" in report.fidelity_warning
    assert recorded_serve_dtype(Layout(store), report.root) == "float32"

    ds = CachedFeatureDataset(audio_dir, encoder, cache=store, dtype=dtype, on_miss="error")
    live = _live(encoder, ds)
    tally = FidelityTally()
    for i in range(len(ds)):
        got = ds[i]
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all()), i
        want = dequantize(quantize(live[i], scheme), scheme, torch.float32)
        assert torch.equal(got, want), i
        tally.add(live[i], got)
    # The build's line is the error of what is served (every item measured: 16 < 64).
    assert measured.items == 16
    assert measured.rel_rms == pytest.approx(tally.result().rel_rms, rel=1e-6)
    assert measured.rel_rms < (0.01 if dtype == "int8" else 0.04)
    batch = ds.__getitems__([0, 5, 9])
    assert batch.padded.dtype == torch.float32 and bool(torch.isfinite(batch.padded).all())

    # float16 named explicitly would serve inf (or lose the values' precision): refused.
    f16 = CachedFeatureDataset(
        audio_dir, encoder, cache=store, dtype=dtype, on_miss="error", serve_dtype="float16"
    )
    with pytest.raises(ConfigError, match="serve_dtype='float32'"):
        f16[0]
    with pytest.raises(ConfigError, match="float16"):
        f16.__getitems__([0, 1])
    # bfloat16 holds float32's range: served, finite, and as close as its 8 bits allow.
    bf16 = CachedFeatureDataset(
        audio_dir, encoder, cache=store, dtype=dtype, on_miss="error", serve_dtype="bfloat16"
    )
    got = bf16[3]
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got.float()).all())
    want32 = dequantize(quantize(live[3], scheme), scheme, torch.float32)
    assert torch.equal(got, want32.to(torch.bfloat16))


def test_values_float16_holds_are_measured_as_float16(tmp_path: Path, audio_dir: Path) -> None:
    encoder = save_torchscript(Scaled(1.0), tmp_path / "plain.pt")
    store = tmp_path / "store"
    report = build(audio_dir, encoder, cache=store, recipe=Recipe(dtype="int8"), batch_size=1)
    assert report.fidelity is not None and report.fidelity_warning == ""
    measured = Fidelity.from_json(report.fidelity)
    assert measured.served == "float16"
    fidelity = read_fidelity(Layout(store), report.root)
    assert fidelity is not None and fidelity.served == "float16"
    ds = CachedFeatureDataset(audio_dir, encoder, cache=store, dtype="int8", on_miss="error")
    tally = FidelityTally()
    for i, live in enumerate(_live(encoder, ds)):
        got = ds[i]
        assert got.dtype == torch.float16
        tally.add(live, got)
    assert measured.rel_rms == pytest.approx(tally.result().rel_rms, rel=1e-6)


def _added_error(scheme: Scheme, dtype: torch.dtype, magnitude: float) -> tuple[float, bool]:
    """What the cast to ``dtype`` adds to the codes' own error (a ratio), and if all is finite."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 64, generator=g, dtype=torch.float64)
    x = (x / x.abs().amax(-1, keepdim=True) * magnitude).float()
    packed = quantize(x, scheme)
    exact = dequantize(packed, scheme, torch.float32).double()
    got = dequantize(packed, scheme, dtype).double()
    own = float((exact - x.double()).norm())
    return float((got - exact).norm()) / own, bool(torch.isfinite(got).all())


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("magnitude", [1e-9, 1e-7, 1e-6, 1e-3, 1.0, 6e4, 1e5, 1e30, 3e38])
def test_holds_agrees_with_casting(scheme: Scheme, dtype: torch.dtype, magnitude: float) -> None:
    """``ScaleSpan.holds`` says yes exactly where the cast serves every value finite and adds
    no more error than it adds at magnitude 1 (bfloat16's 8 bits cost the same everywhere)."""
    added, finite = _added_error(scheme, dtype, magnitude)
    at_unit, _ = _added_error(scheme, dtype, 1.0)
    fine = finite and added <= max(0.1, 2 * at_unit)
    packed = quantize(torch.full((1, 4), magnitude), scheme)
    assert ScaleSpan.of(unpack(packed, scheme).scales).holds(dtype, scheme) is fine
