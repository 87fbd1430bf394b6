"""``has_nonfinite``: the per-item NaN/inf check of the build, against ``torch.isfinite``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.encode.outputs import has_nonfinite, nonfinite_part

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 6e-8, 65504.0, 3e38, 1e300]


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    values=st.lists(
        st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True)),
        min_size=1,
        max_size=40,
    ),
    transpose=st.booleans(),
)
def test_has_nonfinite_agrees_with_torch_isfinite(
    dtype: torch.dtype, values: list[float], transpose: bool
) -> None:
    x = torch.tensor(values, dtype=torch.float64).to(dtype)  # out-of-range values become inf
    if transpose and len(values) % 2 == 0:
        x = x.view(2, -1).t()  # a strided view, as a part sliced out of a batch may be
    assert has_nonfinite(x) == (not bool(torch.isfinite(x).all()))


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_largest_and_smallest_finite_values_pass(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0], dtype=dtype)
    assert not has_nonfinite(x)
    assert has_nonfinite(torch.cat([x, torch.tensor([math.nan], dtype=dtype)]))


def test_integer_parts_are_never_nonfinite_and_the_bad_part_is_named() -> None:
    assert not has_nonfinite(torch.arange(5))
    parts = {"a": torch.zeros(3), "b": torch.tensor([1.0, math.inf])}
    assert nonfinite_part(parts) == "output 'b'"
    assert nonfinite_part({"": torch.tensor([math.nan])}) == "its output"
    assert nonfinite_part({"a": torch.zeros(3)}) is None
