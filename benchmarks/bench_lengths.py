"""Batches by length (issue 30 item 2): ``FeatureLoader(ds, batch_frames=N)`` against
``FeatureLoader(ds, batch_size=B)`` on speech-like lengths.

Over one featbake store of fp16 ``[T, 256]`` items whose T is uniform over 0.5-15 s at 50 frames
per second (25-750 frames, as wav2vec-style encoders give), shuffled, page cache warm, measured
side by side in one run:

1. **Padding**: the fraction of each epoch's batched frames that are padding, for batches of
   ``B = 16`` items and for ``batch_frames = 16 x`` the mean length (the same frames per batch
   on average). The issue's target: >= 90% real frames with ``batch_frames``.
2. **Items/s**: read only, and behind a step whose cost follows the padded frames (a linear
   layer over every frame of the padded batch): padding costs the step, not the reads.

Run: ``python benchmarks/bench_lengths.py [--quick]``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import identity_encoder, recipe, warm_page_cache

from featbake.bake.pipeline import build
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import FeatureLoader

WORK = Path(__file__).resolve().parent / "_work" / "lengths"
DIM = 256
FRAMES_PER_S = 50
SECONDS = (0.5, 15.0)
BATCH = 16


def prepare(n: int) -> Path:
    """A store of ``n`` fp16 ``[T, 256]`` items, T over 0.5-15 s (kept across runs)."""
    base = WORK / f"n{n}"
    if not (base / "ready").exists():
        shutil.rmtree(base, ignore_errors=True)
        (base / "npy").mkdir(parents=True)
        rng = np.random.default_rng(7)
        lo, hi = (int(s * FRAMES_PER_S) for s in SECONDS)
        for i, t in enumerate(rng.integers(lo, hi + 1, size=n)):
            arr = rng.standard_normal((int(t), DIM), dtype=np.float32).astype("float16")
            np.save(base / "npy" / f"item{i:05d}.npy", arr)
        (base / "ready").touch()
    build(base / "npy", identity_encoder(), cache=base / "store", recipe=recipe("float16"))
    warm_page_cache(base / "store")
    return base


def make_step() -> Callable[[torch.Tensor], None]:
    """A step whose cost follows the padded frames: one linear layer over every frame."""
    layer = torch.nn.Linear(DIM, DIM)

    def step(padded: torch.Tensor) -> None:
        with torch.no_grad():
            layer(padded.float())

    return step


def epoch(loader: FeatureLoader, step: Callable[[torch.Tensor], None] | None) -> dict[str, Any]:
    """One epoch: seconds, items, real and batched frames."""
    real = batched = items = 0
    t0 = time.perf_counter()
    for padded, lengths in loader:
        if step is not None:
            step(padded)
        items += len(lengths)
        real += int(lengths.sum())
        batched += padded.shape[0] * padded.shape[1]
    return {"s": time.perf_counter() - t0, "items": items, "real": real, "batched": batched}


def main(quick: bool = False) -> list[dict]:
    torch.set_num_threads(2)
    n, epochs = (200, 1) if quick else (2000, 3)
    base = prepare(n)
    ds = CachedFeatureDataset(base / "npy", identity_encoder(), cache=base / "store",
                              recipe=recipe("float16"))  # fmt: skip
    mean = float(ds.placement().lengths.mean())
    frames = int(BATCH * mean)
    loaders = {
        f"batch_size={BATCH}": FeatureLoader(ds, BATCH, seed=0),
        f"batch_frames={frames}": FeatureLoader(ds, batch_frames=frames, seed=0),
    }
    best: dict[tuple[str, bool], dict[str, Any]] = {}
    for _ in range(epochs):  # interleaved, best of each: the machine is shared
        for name, loader in loaders.items():
            for with_step in (False, True):
                got = epoch(loader, make_step() if with_step else None)
                key = (name, with_step)
                if key not in best or got["s"] < best[key]["s"]:
                    best[key] = got
    rows = []
    note = f"{n} fp16 [T, {DIM}] items, T 0.5-15 s at {FRAMES_PER_S}/s, shuffled, warm"
    for name in loaders:
        got = best[(name, False)]
        real = got["real"] / got["batched"]
        ok = real >= 0.9 if "frames" in name else None
        rows.append(row("lengths", f"{name}: real frames", real, "", ">= 0.9" if ok is not None
                        else "", ok, note))  # fmt: skip
        for with_step in (False, True):
            got = best[(name, with_step)]
            what = "items/s behind a per-frame step" if with_step else "items/s read"
            rows.append(row("lengths", f"{name}: {what}", got["items"] / got["s"], "/s", "",
                            None, note))  # fmt: skip
    size, frame = (best[(name, True)] for name in loaders)
    ratio = (frame["items"] / frame["s"]) / (size["items"] / size["s"])
    rows.append(row("lengths", "batch_frames / batch_size items/s behind the step", ratio, "x",
                    "report", None, note))  # fmt: skip
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
