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


def hidden_rows(
    bench: str, what: str, read: float, step: float, both: dict[str, float], setup: str
) -> list[dict[str, Any]]:
    """Rows of epoch time with a training step over max(read-only, step-only), one per loader
    in ``both`` (seconds with the step); FeatureLoader's carries the target (<= 1.1x)."""
    floor = max(read, step)
    with_step = ", ".join(f"{k} {v:.2f} s" for k, v in both.items())
    note = (
        f"{setup}; read-only {read:.2f} s, step-only {step:.2f} s (read + step "
        f"{read + step:.2f} s), with the step: {with_step}"
    )
    return [
        row(bench, f"{what}: {name} + step / max(read, step)", s / floor, "x",
            "<= 1.1x" if name == "FeatureLoader" else "",
            s / floor <= 1.1 if name == "FeatureLoader" else None, note)
        for name, s in both.items()
    ]  # fmt: skip
