"""Tests for featbake.quantize: round-trip bounds per scheme, the packed layout, fidelity sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.errors import ConfigError, EncodeError
from featbake.quantize import (
    SCALE_BYTES,
    TINY,
    Fidelity,
    FidelityTally,
    Scheme,
    dequantize,
    packed_shape,
    quantize,
    scheme_of,
    unpack,
)

SCHEMES = list(Scheme)


@st.composite
def features(draw: st.DrawFn) -> torch.Tensor:
    """A float32 tensor of 1-3 dims whose rows have very different magnitudes (some zero)."""
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    d = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((*lead, d), generator=g, dtype=torch.float64)
    rows = x.reshape(math.prod(lead), d)
    for r in range(rows.shape[0]):
        kind = draw(st.sampled_from(["exp", "zero", "huge", "tiny", "outlier"]))
        if kind == "zero":
            rows[r] = 0
        elif kind == "huge":
            rows[r] *= 1e36  # near float32's largest (3.4e38)
        elif kind == "tiny":
            rows[r] *= 2.0**-110  # below TINY: stored as zeros
        elif kind == "outlier" and d:
            rows[r, draw(st.integers(0, d - 1))] = 1e4  # one huge dimension, as in SSL features
        else:
            rows[r] *= 2.0 ** draw(st.integers(-60, 60))
    return rows.reshape(x.shape).to(torch.float32)


def bound(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The largest error each element may have: half a code step at that row's scale."""
    absmax = x.abs().amax(-1, keepdim=True).double() if x.shape[-1] else x.double().sum(-1, True)
    scale = absmax / scheme.top
    if scheme is Scheme.INT8:
        step = scale * 0.5 * (1 + 1e-5)
    else:  # 3 mantissa bits: half an ulp is 2**-4 relative; subnormal steps are 2**-9 codes
        step = x.abs().double() * 2.0**-4 * (1 + 1e-5) + scale * 2.0**-10 * (1 + 1e-5)
    return torch.where(absmax < TINY, absmax, step)


@settings(max_examples=300, deadline=None)
@given(x=features(), scheme=st.sampled_from(SCHEMES))
def test_round_trip_within_half_a_step(x: torch.Tensor, scheme: Scheme) -> None:
    packed = quantize(x, scheme)
    assert packed.dtype == scheme.packed_dtype
    assert tuple(packed.shape) == packed_shape(tuple(x.shape))
    back = dequantize(packed, scheme, torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    assert bool((err <= bound(x, scheme) * (1 + 1e-6) + 1e-45).all())


@settings(max_examples=100, deadline=None)
@given(x=features(), scheme=st.sampled_from(SCHEMES))
def test_dequantize_is_codes_times_scales(x: torch.Tensor, scheme: Scheme) -> None:
    """The served value is exactly the stored codes times the stored scales (float32 maths),
    whatever path computes it (the CPU table for fp8, a cast elsewhere)."""
    codes, scales = unpack(quantize(x, scheme), scheme)
    naive = codes.to(torch.float32) * scales.unsqueeze(-1)
    assert torch.equal(dequantize(quantize(x, scheme), scheme, torch.float32), naive)
    half = dequantize(quantize(x, scheme), scheme, torch.float16)
    assert torch.equal(half, naive.to(torch.float16))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dim", [768, 6])
def test_scales_are_a_view_of_aligned_rows_and_a_copy_otherwise(scheme: Scheme, dim: int) -> None:
    """Aligned packed rows (D a multiple of 4, as in a store) give their scales without a copy;
    an unaligned tensor (odd D, or a slice at an odd byte offset) still unpacks, by a copy."""
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(dim))
    packed = quantize(x, scheme)
    want = torch.tensor([float(r.abs().max()) / scheme.top for r in x], dtype=torch.float32)
    scales = unpack(packed, scheme).scales
    torch.testing.assert_close(scales, want, rtol=1e-6, atol=0)
    shares = scales.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert shares is (dim % 4 == 0)
    buf = torch.zeros(packed.numel() + 1, dtype=packed.dtype)
    buf[1:] = packed.reshape(-1)  # the same rows at an odd offset
    odd = buf[1:].view(packed.shape)
    assert torch.equal(unpack(odd, scheme).scales, scales)
    assert torch.equal(
        dequantize(odd, scheme, torch.float32), dequantize(packed, scheme, torch.float32)
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_and_tiny_rows_are_stored_as_zero(scheme: Scheme) -> None:
    x = torch.tensor([[0.0, 0.0], [1e-35, -1e-35], [3.0, -1.5]])
    packed = quantize(x, scheme)
    _codes, scales = unpack(packed, scheme)
    assert scales.tolist()[:2] == [0.0, 0.0]
    assert dequantize(packed, scheme, torch.float32)[:2].abs().sum() == 0
    assert scales[2].item() == pytest.approx(3.0 / scheme.top)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_largest_float32_rows_survive(scheme: Scheme) -> None:
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big / 2, 1.0]])
    back = dequantize(quantize(x, scheme), scheme, torch.float32)
    assert torch.isfinite(back).all()
    assert back[0, 0].item() == pytest.approx(big, rel=1e-6)
    assert back[0, 1].item() == pytest.approx(-big / 2, rel=2.0**-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_padded_rows_of_a_batch_dequantise_to_zero(scheme: Scheme) -> None:
    """A padded batch is zero bytes past each item's length: scale 0.0, so 0.0 served."""
    item = quantize(torch.randn(3, 8), scheme)
    batch = torch.zeros((2, 5, 8 + SCALE_BYTES), dtype=scheme.packed_dtype)
    batch[0, :3] = item
    out = dequantize(batch, scheme, torch.float16)
    assert out.shape == (2, 5, 8)
    assert torch.equal(out[0, :3], dequantize(item, scheme, torch.float16))
    assert out[0, 3:].abs().sum() == 0 and out[1].abs().sum() == 0


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_is_refused(scheme: Scheme, bad: float) -> None:
    with pytest.raises(EncodeError, match="NaN or infinite"):
        quantize(torch.tensor([[1.0, bad]]), scheme)


def test_scalar_and_wrong_packed_are_refused() -> None:
    with pytest.raises(ConfigError, match="scalar"):
        quantize(torch.tensor(1.0), Scheme.INT8)
    with pytest.raises(ConfigError, match="packed int8"):
        unpack(torch.zeros(3, 8), Scheme.INT8)
    with pytest.raises(ConfigError, match="packed fp8"):
        unpack(quantize(torch.ones(2, 3), Scheme.INT8), Scheme.FP8)
    with pytest.raises(ConfigError, match="D \\+ 4"):
        unpack(torch.zeros(3, 2, dtype=torch.int8), Scheme.INT8)


def test_fp8_decoding_matches_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    packed = torch.cat([codes, torch.tensor([1.0]).view(torch.uint8)])  # one row, scale 1
    table = dequantize(packed, Scheme.FP8, torch.float32)
    cast = codes.view(torch.float8_e4m3fn).to(torch.float32)
    keep = ~cast.isnan()  # 0x7F and 0xFF: NaN, never written (codes are clamped to +-448)
    assert int(keep.sum()) == 254
    assert torch.equal(table[keep], cast[keep])


def test_packed_layout_is_codes_then_little_endian_float32_scale() -> None:
    packed = quantize(torch.tensor([[254.0, -127.0]]), Scheme.INT8)
    raw = packed.numpy().tobytes()
    assert list(np.frombuffer(raw[:2], np.int8)) == [127, -64]
    assert np.frombuffer(raw[2:], "<f4")[0] == np.float32(2.0)


def test_int8_is_a_quarter_of_float32_bytes_for_768_dims() -> None:
    x = torch.randn(50, 768)
    assert quantize(x, Scheme.INT8).nbytes / x.nbytes == pytest.approx(772 / 3072)


def test_scheme_of() -> None:
    assert scheme_of("int8") is Scheme.INT8 and scheme_of("fp8") is Scheme.FP8
    assert scheme_of("float16") is None and scheme_of("bfloat16") is None


# -- fidelity ----------------------------------------------------------------------------------
def naive_fidelity(pairs: list[tuple[np.ndarray, np.ndarray]]) -> Fidelity:
    err = sum(float(((a - b) ** 2).sum()) for a, b in pairs)
    ref = sum(float((a**2).sum()) for a, _ in pairs)
    worst = max(math.sqrt(((a - b) ** 2).sum() / (a**2).sum()) for a, b in pairs)
    cosines = [
        float(r @ s / (np.linalg.norm(r) * np.linalg.norm(s)))
        for a, b in pairs
        for r, s in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, a.shape[-1]), strict=True)
        if np.linalg.norm(r) > 0
    ]
    return Fidelity(len(pairs), math.sqrt(err / ref), worst, float(np.mean(cosines)), min(cosines))


@settings(max_examples=50, deadline=None)
@given(seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=5))
def test_tally_matches_a_naive_computation(seeds: list[int]) -> None:
    tally, pairs = FidelityTally(), []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(seed % 7 + 1, 16, generator=g) * (seed % 5 + 1)
        x[0] = 0 if seed % 3 == 0 else x[0]  # a zero row has no cosine
        if not x.abs().sum():
            x[-1, 0] = 1.0
        y = dequantize(quantize(x, Scheme.FP8), Scheme.FP8, torch.float32)
        tally.add(x, y)
        pairs.append((x.double().numpy(), y.double().numpy()))
    got, want = tally.result(), naive_fidelity(pairs)
    assert got.items == want.items
    for field in ("rel_rms", "worst_rel_rms", "mean_cosine", "min_cosine"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9, abs=1e-12)
    assert Fidelity.from_json(got.to_json()) == got


def test_measured_error_orders_the_schemes() -> None:
    """On Gaussian frames int8 (7 bits) beats e4m3 (3 mantissa bits); both are far from zero."""
    x = torch.randn(200, 768, generator=torch.Generator().manual_seed(0))
    result = {}
    for scheme in SCHEMES:
        tally = FidelityTally()
        tally.add(x, dequantize(quantize(x, scheme), scheme, torch.float32))
        result[scheme] = tally.result()
    assert 0.002 < result[Scheme.INT8].rel_rms < 0.01 < result[Scheme.FP8].rel_rms < 0.05
    assert result[Scheme.INT8].mean_cosine > 0.9999 and result[Scheme.FP8].mean_cosine > 0.999
