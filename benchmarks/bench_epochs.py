"""Time per epoch, live encoding against featbake, first epoch's build included: docs/epochs.png.

The picture a newcomer needs: a training run that encodes live pays the encoder every epoch;
with featbake the first epoch pays it once (the build) plus a read, and every later epoch only
reads. Same data, same batches of 16, same encoder (a 6-layer, 256-wide transformer over 80-dim
log-mel frames, :class:`featbake.testing.LogMelTransformer`), on this machine's CPU.

Rows: each epoch's seconds for both, and the total over the run. ``make bench`` writes the
chart to ``docs/epochs.png`` (``--no-png`` skips it).

Run: ``python benchmarks/bench_epochs.py [--quick] [--no-png]``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import NpyFiles

from featbake.bake.pipeline import build
from featbake.recipe import Recipe
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import LogMelTransformer

PNG = ROOT / "docs" / "epochs.png"
BATCH = 16


def measure(work: Path, n: int, epochs: int) -> dict[str, list[float]]:
    """Seconds per epoch: live encoding, and featbake (epoch 1 = build + read)."""
    mels = work / "mels"
    mels.mkdir()
    rng = np.random.default_rng(2)
    for i, t in enumerate(rng.integers(200, 401, size=n)):
        np.save(mels / f"utt{i:05d}.npy", rng.standard_normal((t, 80), dtype=np.float32))
    encoder = LogMelTransformer().eval().requires_grad_(False)
    recipe = Recipe(source="npy", dtype="float16")
    live = DataLoader(NpyFiles(sorted(map(str, mels.glob("*.npy")))), BATCH, shuffle=True,
                      collate_fn=pad_collate)  # fmt: skip
    times: dict[str, list[float]] = {"live encoding": [], "featbake": []}
    for _ in range(epochs):
        t0 = time.perf_counter()
        with torch.inference_mode():
            for padded, _lengths in live:
                encoder(padded)
        times["live encoding"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    build(mels, encoder, cache=work / "store", recipe=recipe, batch_size=BATCH)
    build_seconds = time.perf_counter() - t0
    ds = CachedFeatureDataset(mels, encoder, cache=work / "store", recipe=recipe, on_miss="error")
    cached = DataLoader(ds, BATCH, shuffle=True, collate_fn=pad_collate)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for _batch in cached:
            pass
        times["featbake"].append(time.perf_counter() - t0 + (build_seconds if epoch == 0 else 0))
    return times


def draw(times: dict[str, list[float]], path: Path, caption: str) -> None:
    """A grouped bar chart of seconds per epoch, with Pillow (no plotting library needed)."""
    from PIL import Image, ImageDraw

    epochs = len(times["featbake"])
    width, height, left, bottom, top = 760, 380, 70, 60, 50
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    top_value = max(max(v) for v in times.values()) * 1.15
    plot_h = height - top - bottom
    group_w = (width - left - 20) / epochs
    colors = {"live encoding": (214, 96, 77), "featbake": (67, 147, 195)}
    d.text((left, 12), "seconds per epoch: live encoding vs featbake (epoch 1 includes the build)",
           fill="black")  # fmt: skip
    d.line((left, top, left, height - bottom), fill="black")
    d.line((left, height - bottom, width - 20, height - bottom), fill="black")
    for k in range(5):
        value = top_value * k / 4
        y = height - bottom - plot_h * k / 4
        d.line((left - 4, y, left, y), fill="black")
        d.text((8, y - 6), f"{value:6.2f} s", fill="black")
    for e in range(epochs):
        for j, (name, values) in enumerate(times.items()):
            x0 = left + e * group_w + 12 + j * (group_w - 24) / 2
            x1 = x0 + (group_w - 24) / 2 - 4
            y0 = height - bottom - plot_h * values[e] / top_value
            d.rectangle((x0, y0, x1, height - bottom), fill=colors[name])
            d.text((x0, y0 - 14), f"{values[e]:.2f}", fill="black")
        d.text((left + e * group_w + group_w / 2 - 20, height - bottom + 8), f"epoch {e + 1}",
               fill="black")  # fmt: skip
    for j, (name, color) in enumerate(colors.items()):
        x = left + 10 + j * 170
        d.rectangle((x, height - 24, x + 12, height - 12), fill=color)
        d.text((x + 18, height - 25), name, fill="black")
    d.text((left + 360, height - 25), caption, fill="gray")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def main(quick: bool = False, png: bool = True) -> list[dict]:
    torch.set_num_threads(2)
    n, epochs = (16, 2) if quick else (160, 5)
    with tempfile.TemporaryDirectory(prefix="featbake-bench-epochs-") as tmp:
        times = measure(Path(tmp), n, epochs)
    live, baked = times["live encoding"], times["featbake"]
    note = (
        f"{n} log-mel items (200-400 frames x 80), LogMelTransformer (6 layers, width 256), "
        f"batches of {BATCH}, CPU; seconds per epoch live: "
        + "/".join(f"{x:.2f}" for x in live)
        + "; featbake (epoch 1 = build + read): "
        + "/".join(f"{x:.2f}" for x in baked)
    )
    if png and not quick:
        draw(times, PNG, f"{n} items, {epochs} epochs, 2-core CPU")
    rows = [
        row("epochs", "first epoch: featbake (build + read) / live", baked[0] / live[0], "x",
            "report", None, note),
        row("epochs", "later epochs: live / featbake (mean)",
            float(np.mean(live[1:] or live)) / float(np.mean(baked[1:] or baked)), "x",
            "report", None, note),
        row("epochs", f"{epochs} epochs in all: live / featbake", sum(live) / sum(baked), "x",
            "report", None, note),
    ]  # fmt: skip
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv, png="--no-png" not in sys.argv):
        print(f"{r['metric']}: {r['value']:.2f}{r['unit']}  {r['note']}")
