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


def paired_hidden_rows(
    bench: str,
    what: str,
    rounds: list[dict[str, float]],
    setup: str,
    *,
    core_free: bool = True,
) -> list[dict[str, Any]]:
    """:func:`hidden_rows` from paired rounds: each round times a read-only epoch (``"read"``),
    a step-only one (``"step"``) and each loader with the step, one after the other, and its
    ratio is against that round's floor; a row is the median ratio, the range in its note.
    On a shared machine the load drifts between minutes: a ratio of two bests taken minutes
    apart moved by more than the target (0.5-1.9x for one checkout), a paired round does not.
    """
    import statistics

    floor_of = (
        (lambda r: max(r["read"], r["step"])) if core_free else (lambda r: r["read"] + r["step"])
    )
    against = "max(read, step)" if core_free else "(read + step)"
    names = [k for k in rounds[0] if k not in ("read", "step")]
    med = {k: statistics.median(r[k] for r in rounds) for k in ("read", "step", *names)}
    out = []
    for name in names:
        ratios = [r[name] / floor_of(r) for r in rounds]
        ratio = statistics.median(ratios)
        note = (
            f"{setup}; median of {len(rounds)} paired rounds, {min(ratios):.2f}-"
            f"{max(ratios):.2f}; medians: read-only {med['read']:.2f} s, step-only "
            f"{med['step']:.2f} s, {name} + step {med[name]:.2f} s"
        )
        target = "<= 1.1x" if name == "FeatureLoader" else ""
        ok = ratio <= 1.1 if name == "FeatureLoader" else None
        out.append(row(bench, f"{what}: {name} + step / {against}", ratio, "x", target, ok, note))
    return out
