"""The one row format every benchmark returns (``benchmarks/run.py`` prints them as a table)."""

from __future__ import annotations

from typing import Any


def row(
    bench: str,
    metric: str,
    value: float,
    unit: str,
    target: str = "",
    ok: bool | None = None,
    note: str = "",
) -> dict[str, Any]:
    """A result: ``ok`` is None for numbers reported without a target."""
    return {
        "bench": bench,
        "metric": metric,
        "value": float(value),
        "unit": unit,
        "target": target,
        "ok": ok,
        "note": note,
    }
