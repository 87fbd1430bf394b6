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
    bench: str,
    what: str,
    read: float,
    step: float,
    both: dict[str, float],
    setup: str,
    *,
    core_free: bool = True,
) -> list[dict[str, Any]]:
    """Rows of epoch time with a training step, one per loader in ``both`` (seconds with the
    step); FeatureLoader's carries the target (<= 1.1x).

    With a core free for the reads (``core_free``), they can hide behind the step: the floor is
    max(read-only, step-only). With the step on every core they can only take turns with it:
    the floor is read + step, and the target is met when reading beside the step costs no more
    than 10% beyond reading and stepping one after the other.
    """
    floor = max(read, step) if core_free else read + step
    against = "max(read, step)" if core_free else "(read + step)"
    with_step = ", ".join(f"{k} {v:.2f} s" for k, v in both.items())
    note = (
        f"{setup}; read-only {read:.2f} s, step-only {step:.2f} s (read + step "
        f"{read + step:.2f} s), with the step: {with_step}"
    )
    return [
        row(bench, f"{what}: {name} + step / {against}", s / floor, "x",
            "<= 1.1x" if name == "FeatureLoader" else "",
            s / floor <= 1.1 if name == "FeatureLoader" else None, note)
        for name, s in both.items()
    ]  # fmt: skip
