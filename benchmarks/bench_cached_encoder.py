"""What CachedEncoder's per-step change detection costs (issue 11, item 4).

Each forward, CachedEncoder checks that the wrapped module did not change since its fingerprint
was taken: version counters and data pointers, plain attributes, and (``check_weights=True``, the
default) a CRC-32 of every CPU weight's bytes, which catches in-place updates through ``.data``
that bypass version counters. Measured here per forward, on small CPU models, against the bare
forward of the same model on one batch, and against ``check_weights=False``.

Run: ``python benchmarks/bench_cached_encoder.py [--quick]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _rows import row

from featbake.serve.cached_encoder import ModuleWatch
from featbake.testing import TinyConvEncoder, frozen


def _per_call_us(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e6


def _models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    mlp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))  # ~1.05M params
    return [
        ("TinyConvEncoder", frozen(TinyConvEncoder()), torch.randn(8, 8000)),
        ("MLP 1M params", frozen(mlp), torch.randn(8, 512)),
    ]


def main(quick: bool = False) -> list[dict]:
    repeat = 20 if quick else 200
    rows = []
    for name, model, x in _models():
        n = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            forward = _per_call_us(lambda m=model, x=x: m(x), repeat)
        for check in (True, False):
            watch = ModuleWatch(model, check_weights=check)
            cost = _per_call_us(watch.fingerprint, repeat)
            rows.append(
                row(
                    "cached_encoder",
                    f"change check per forward, {name} ({n:,} params), check_weights={check}",
                    cost,
                    "us",
                    note=f"bare forward of a batch of {x.shape[0]}: {forward:,.0f} us",
                )
            )
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:,.1f} {r['unit']}  ({r['note']})")
