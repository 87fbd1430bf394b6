"""Tests for featbake.units: byte sizes and durations."""

from __future__ import annotations

import decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from featbake.errors import ConfigError
from featbake.units import format_bytes, parse_bytes, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        ("512B", 512),
        ("1KB", 1000),
        ("1kib", 1024),
        ("256MiB", 256 * 1024**2),
        ("512MB", 512 * 1000**2),
        ("2GiB", 2 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("1.5 GiB", 1536 * 1024**2),
        ("  3 tib ", 3 * 1024**4),
        ("2TB", 2 * 1000**4),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1.0009KB", 1000),  # fractional bytes round down
    ],
)
def test_parse_bytes_valid(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_int_passthrough() -> None:
    assert parse_bytes(0) == 0
    assert parse_bytes(123) == 123


def test_parse_bytes_large_values_are_exact() -> None:
    assert parse_bytes("1000TiB") == 1000 * 1024**4


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "abc", "-1", "-1GiB", "1.2.3MB", "10 XB", "1e9", "GiB", "1 GiB extra", "1_000"],
)
def test_parse_bytes_invalid(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_bytes(bad)
    message = str(err.value)
    assert repr(bad) in message
    assert "2GiB" in message  # shows a valid example


@pytest.mark.parametrize("bad", [-1, True, 1.5, None])
def test_parse_bytes_invalid_non_str(bad: object) -> None:
    with pytest.raises(ConfigError, match="2GiB"):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        parse_bytes("nope")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (1536 * 1024**2, "1.5 GiB"),
        (256 * 1024**2, "256 MiB"),
        (1024**4, "1 TiB"),
        (1024**5, "1024 TiB"),  # capped at TiB so the output parses back
        (1024**3 - 1, "1 GiB"),  # rounding must not print "1024 MiB"
        (-2048, "-2 KiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@given(st.integers(min_value=0, max_value=1024**5))
def test_format_parse_round_trip_is_close(n: int) -> None:
    text = format_bytes(n).replace(" ", "")
    back = parse_bytes(text)
    # Two decimals of the chosen unit: relative error below 0.5% (exact below 1 KiB).
    if n < 1024:
        assert back == n
    else:
        assert abs(back - n) <= n * 0.005 + 1


@given(st.integers(min_value=0, max_value=2**40), st.sampled_from(["B", "KiB", "MiB", "GiB"]))
def test_parse_bytes_integer_units_exact(num: int, unit: str) -> None:
    factor = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
    assert parse_bytes(f"{num}{unit}") == num * factor
    assert parse_bytes(f"{num} {unit.upper()}") == num * factor


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", 90.0),
        ("15m", 900.0),
        ("12h", 43200.0),
        ("30d", 30 * 86400.0),
        ("2w", 2 * 604800.0),
        ("1.5m", 90.0),
        (" 2 H ", 7200.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration_valid(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "30", "-5m", "5y", "m", "1.2.3h", "5 minutes", "h5"])
def test_parse_duration_invalid(bad: str) -> None:
    with pytest.raises(ConfigError, match="30d"):
        parse_duration(bad)


def test_parse_duration_non_str() -> None:
    with pytest.raises(ConfigError):
        parse_duration(30)  # type: ignore[arg-type]


def test_parse_duration_missing_unit_message() -> None:
    with pytest.raises(ConfigError, match="missing unit"):
        parse_duration("30")


def test_a_decimal_size_is_the_whole_number_of_bytes_it_names() -> None:
    """``float("2.01") * 1000`` is 2009.999...: the floor of the float product lost a byte."""
    assert parse_bytes("2.01KB") == 2010
    assert parse_bytes("128.64KB") == 128_640
    assert parse_bytes("2.01GB") == 2_010_000_000
    assert parse_bytes("0.0015KB") == 1  # a fraction of a byte is dropped
    with decimal.localcontext() as ctx:  # a program's own decimal settings change nothing
        ctx.prec, ctx.traps[decimal.Inexact] = 6, True
        assert parse_bytes("3GiB") == 3 << 30 and parse_bytes("1000TiB") == 1000 << 40
