"""Parsing and formatting of human-friendly byte sizes and durations.

Options such as cache budgets ("2GiB") and retention windows ("30d") are given by
people in config files and on the command line, so they are parsed here once, with
errors that show a valid example instead of a bare traceback.
"""

from __future__ import annotations

import re
from fractions import Fraction

from featbake.errors import ConfigError

__all__ = ["format_bytes", "parse_bytes", "parse_duration"]

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_DURATION_UNITS: dict[str, float] = {
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
}

_NUMBER_UNIT = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")

_BYTES_HINT = "expected e.g. '2GiB', '256MiB', '512MB' or a plain integer such as 1048576"
_DURATION_HINT = "expected e.g. '30d', '12h', '15m', '90s' or '2w'"


def parse_bytes(value: str | int) -> int:
    """Parse a byte size such as ``"2GiB"`` into a number of bytes.

    Accepts a non-negative ``int``, or a string holding a number (decimals allowed)
    followed by an optional unit: ``B``, decimal ``KB``/``MB``/``GB``/``TB`` (powers of
    1000) or binary ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024). Units are
    case-insensitive and whitespace around the number and unit is ignored. A
    fractional result is rounded down to whole bytes.

    Args:
        value: The size to parse.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: If the value is negative, not a number, or has an unknown unit.

    Example:
        >>> parse_bytes("1.5 GB")
        1500000000
        >>> parse_bytes("256MiB")
        268435456
        >>> parse_bytes("2.01KB"), parse_bytes("0.5KiB"), parse_bytes("1.0005KB")
        (2010, 512, 1000)
    """
    # bool is an int subclass; accepting True as "1 byte" would hide a config mistake.
    if isinstance(value, bool):
        raise ConfigError(f"invalid byte size {value!r}: {_BYTES_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"invalid byte size {value!r}: must be >= 0; {_BYTES_HINT}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"invalid byte size {value!r}: {_BYTES_HINT}")
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ConfigError(f"invalid byte size {value!r}: {_BYTES_HINT}")
    unit = match["unit"].lower()
    if unit not in _BYTE_UNITS:
        raise ConfigError(
            f"invalid byte size {value!r}: unknown unit {match['unit']!r}; {_BYTES_HINT}"
        )
    num = match["num"]
    multiplier = _BYTE_UNITS[unit]
    # Exact arithmetic (a Fraction: no float, no decimal context of the caller's): "1000TiB"
    # and "2.01KB" (2,010, where a float product is 2,009.999...) are whole; a fraction of a
    # byte is dropped.
    return int(Fraction(num) * multiplier)


def format_bytes(n: int) -> str:
    """Format a byte count for humans using binary units.

    Values below 1 KiB are shown as whole bytes; larger values use the largest binary
    unit up to TiB that keeps the number >= 1, with at most two decimals and trailing
    zeros removed. Stopping at TiB keeps every output parseable by :func:`parse_bytes`.

    Args:
        n: The number of bytes (may be negative, e.g. for a difference).

    Returns:
        A string such as ``"512 B"`` or ``"1.5 GiB"``.

    Example:
        >>> format_bytes(1536 * 1024 * 1024)
        '1.5 GiB'
        >>> format_bytes(512)
        '512 B'
    """
    sign = "-" if n < 0 else ""
    size = abs(int(n))
    if size < 1024:
        return f"{sign}{size} B"
    value = float(size)
    unit = "B"
    # Capped at TiB so every output parses back with parse_bytes.
    for candidate in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        unit = candidate
        # Round before the comparison so 1023.999 MiB prints as "1 GiB", not "1024 MiB".
        if round(value, 2) < 1024.0 or candidate == "TiB":
            break
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{sign}{text} {unit}"


def parse_duration(value: str) -> float:
    """Parse a duration such as ``"30d"`` into seconds.

    Accepts a non-negative number (decimals allowed) followed by one of ``s``, ``m``
    (minutes), ``h``, ``d`` or ``w``; the unit is case-insensitive and whitespace is
    ignored. A bare number is rejected because its unit would be ambiguous.

    Args:
        value: The duration to parse.

    Returns:
        The duration in seconds.

    Raises:
        ConfigError: If the value is not a number followed by a known unit.

    Example:
        >>> parse_duration("12h")
        43200.0
        >>> parse_duration("1.5m")
        90.0
    """
    if not isinstance(value, str):
        raise ConfigError(f"invalid duration {value!r}: {_DURATION_HINT}")
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ConfigError(f"invalid duration {value!r}: {_DURATION_HINT}")
    unit = match["unit"].lower()
    if unit not in _DURATION_UNITS:
        detail = "missing unit" if not unit else f"unknown unit {match['unit']!r}"
        raise ConfigError(f"invalid duration {value!r}: {detail}; {_DURATION_HINT}")
    return float(match["num"]) * _DURATION_UNITS[unit]


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural where ``n`` is not 1 (a regular English plural: add "s"),
    with thousands separators: what a summary line says of a count.

    Example:
        >>> counted(1, "shard"), counted(2, "shard"), counted(1200, "feature")
        ('1 shard', '2 shards', '1,200 features')
    """
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
