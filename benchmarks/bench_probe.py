"""What int8 and fp8 storage does downstream (issue 21): a probe and a distillation, side by side.

No speech corpus can be downloaded here and none ships with the installed packages, so the task
is synthetic but not trivial: **frame-level vowel classification**. Each 1 s clip holds three
vowels (6 classes, formant-synthesised: a pulse train at 80-260 Hz with jitter, shaped by F1-F3
peaks scaled per "speaker" by 0.85-1.2, noise at 0-20 dB SNR); every wav2vec2 frame is labelled
with the vowel under its centre. The encoder is a wav2vec2-base-shaped model with **random
weights** (``Wav2Vec2Config()``, built from the config; nothing trained can be downloaded), so
absolute accuracy says little; what the rows compare is the *same* probe trained on the *same*
features stored as fp32, int8 and fp8 (``--layers all``, served as float32).

1. **Probe** (SUPERB style): a softmax-weighted sum of the 13 hidden states, then a linear layer,
   trained full-batch with Adam on the frames of 75% of the clips (same seed and init for every
   dtype); held-out frame accuracy. Target: int8 within 0.5 points of fp32.
2. **Distillation**: a small MLP student from 25 ms waveform frames to the last layer, trained on
   the stored targets of each dtype; its held-out MSE against the fp32 targets (what the teacher
   really outputs). Reported side by side.

Run: ``python benchmarks/bench_probe.py [--quick]``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from bench_compact import wav2vec2_base

from featbake.bake.pipeline import build
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset

WORK = Path(__file__).resolve().parent / "_work" / "probe"
RATE = 16_000
DTYPES = ("float32", "int8", "fp8")
#: (F1, F2, F3) in Hz of six vowels (Peterson and Barney's averages, rounded).
VOWELS = [(270, 2290, 3010), (530, 1840, 2480), (730, 1090, 2440), (570, 840, 2410),
          (300, 870, 2240), (440, 1020, 2240)]  # fmt: skip
HOP, WINDOW = 320, 400  # wav2vec2's frames: 20 ms hop, 25 ms receptive field


def vowel(rng: np.random.Generator, cls: int, n: int, f0: float, stretch: float) -> np.ndarray:
    """``n`` samples of vowel ``cls``: a jittered pulse train through three formant peaks."""
    period = RATE / f0
    source = np.zeros(n)
    t = 0.0
    while t < n:
        source[int(t)] = 1.0
        t += period * (1 + 0.03 * rng.standard_normal())
    spectrum = np.fft.rfft(source)
    freqs = np.fft.rfftfreq(n, 1 / RATE)
    envelope = np.zeros_like(freqs)
    for k, formant in enumerate(VOWELS[cls]):
        f = formant * stretch * (1 + 0.04 * rng.standard_normal())
        bandwidth = 60.0 + 40 * k
        envelope += (1.0 / (k + 1)) / (1 + ((freqs - f) / bandwidth) ** 2)
    wave = np.fft.irfft(spectrum * envelope, n)
    return wave / (np.abs(wave).max() + 1e-9)


def write_clips(folder: Path, n: int, seed: int = 11) -> dict[str, list[int]]:
    """``n`` clips of 1 s with three vowels each, and each clip's label per wav2vec2 frame."""
    labels_file = folder / "labels.json"
    if labels_file.exists():
        return json.loads(labels_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels: dict[str, list[int]] = {}
    frames = (RATE - WINDOW) // HOP + 1
    for i in range(n):
        f0, stretch = rng.uniform(80, 260), rng.uniform(0.85, 1.2)
        cuts = sorted(rng.integers(RATE // 5, RATE * 4 // 5, size=2))
        bounds = [0, int(cuts[0]), int(cuts[1]), RATE]
        classes = rng.integers(0, len(VOWELS), size=3)
        wave = np.concatenate(
            [
                vowel(rng, int(c), b - a, f0, stretch)
                for c, a, b in zip(classes, bounds, bounds[1:], strict=False)
            ]
        )
        snr_db = rng.uniform(0, 20)
        wave += rng.standard_normal(RATE) * np.sqrt(np.mean(wave**2) / 10 ** (snr_db / 10))
        name = f"clip{i:04d}.wav"
        soundfile.write(folder / name, (0.5 * wave / np.abs(wave).max()).astype(np.float32), RATE)
        centres = np.arange(frames) * HOP + WINDOW // 2
        labels[name] = [int(classes[np.searchsorted(bounds, c, side="right") - 1]) for c in centres]
    labels_file.write_text(json.dumps(labels))
    return labels


def features(clips: Path, folder: Path, dtype: str) -> tuple[list[str], torch.Tensor]:
    """Each clip's 13 hidden states stored in ``dtype``, served as float32: [clips, 13, T, D]."""
    store = WORK / "stores" / dtype
    recipe = Recipe(dtype=dtype, layers="all")
    report = build(clips, folder, cache=store, recipe=recipe, workers=0)
    assert report.ok, report.failed
    extra: dict[str, Any] = {"serve_dtype": "float32"} if dtype in ("int8", "fp8") else {}
    ds = CachedFeatureDataset(
        clips, folder, cache=store, dtype=dtype, layers="all", layer_view="stack",
        on_miss="error", **extra,
    )  # fmt: skip
    names = [Path(ds.path(i)).name for i in range(len(ds))]
    return names, torch.stack([ds[i].float() for i in range(len(ds))])


def frame_inputs(clips: Path, names: list[str], frames: int) -> torch.Tensor:
    """The distillation student's input: each frame's 25 ms of waveform, [clips, T, 400]."""
    out = []
    for name in names:
        wave = torch.from_numpy(soundfile.read(clips / name, dtype="float32")[0])
        out.append(wave.unfold(0, WINDOW, HOP)[:frames])
    return torch.stack(out)


class Probe(nn.Module):
    """SUPERB's weighted sum of hidden states, then a linear classifier."""

    def __init__(self, layers: int, dim: int, classes: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, L, D]
        mixed = torch.einsum("l,nld->nd", self.weights.softmax(0), x)
        return self.out(self.norm(mixed))


def train_probe(x: torch.Tensor, y: torch.Tensor, steps: int) -> Probe:
    """The probe trained full-batch on frames ``x [N, L, D]`` with labels ``y``."""
    torch.manual_seed(0)
    probe = Probe(x.shape[1], x.shape[2], len(VOWELS))
    opt = torch.optim.Adam(probe.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(probe(x), y).backward()
        opt.step()
    return probe


def distill(inputs: torch.Tensor, targets: torch.Tensor, steps: int) -> nn.Module:
    """A student MLP trained full-batch from waveform frames to ``targets``."""
    torch.manual_seed(0)
    student = nn.Sequential(
        nn.Linear(inputs.shape[1], 256), nn.GELU(), nn.Linear(256, targets.shape[1])
    )
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(student(inputs), targets).backward()
        opt.step()
    return student


def main(quick: bool = False) -> list[dict[str, Any]]:
    n = 40 if quick else 120
    clips = WORK / f"clips-n{n}"
    shutil.rmtree(WORK / "stores", ignore_errors=True)
    labels = write_clips(clips, n)
    folder = wav2vec2_base(WORK.parent / "compact" / "bytes")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    per_dtype: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for dtype in DTYPES:
        names, feats = features(clips, folder, dtype)
        per_dtype[dtype] = feats  # [clips, 13, T, D]
    frames = per_dtype["float32"].shape[2]
    y = torch.tensor([labels[name][:frames] for name in names]).reshape(-1)
    test_clip = torch.arange(n) % 4 == 0  # a quarter of the clips, never seen in training
    train = (~test_clip).repeat_interleave(frames)
    test = test_clip.repeat_interleave(frames)
    inputs = frame_inputs(clips, names, frames).reshape(-1, WINDOW)
    teacher = per_dtype["float32"][:, -1].reshape(-1, per_dtype["float32"].shape[-1])
    steps = 60 if quick else 300
    accuracy, loss = {}, {}
    for dtype in DTYPES:
        feats = per_dtype.pop(dtype)  # one dtype's frames in memory at a time
        x = feats.permute(0, 2, 1, 3).reshape(-1, feats.shape[1], feats.shape[3])  # [N, 13, D]
        del feats
        probe = train_probe(x[train], y[train], steps)
        with torch.no_grad():
            accuracy[dtype] = float((probe(x[test]).argmax(-1) == y[test]).float().mean()) * 100
        student = distill(inputs[train], x[train, -1], steps)
        with torch.no_grad():
            loss[dtype] = float(nn.functional.mse_loss(student(inputs[test]), teacher[test]))
    note = (
        f"synthetic vowels, {n} clips, {int(test.sum())} held-out frames; w2v2-base with random "
        "weights, --layers all"
    )
    rows = []
    for dtype in DTYPES:
        delta = accuracy[dtype] - accuracy["float32"]
        gate = dtype == "int8"
        rows.append(
            row(
                "probe",
                f"held-out frame accuracy, {dtype} features ({delta:+.2f} points vs fp32)",
                accuracy[dtype],
                "%",
                "int8 within 0.5 points of fp32" if gate else "",
                abs(delta) <= 0.5 if gate else None,
                note,
            )
        )
    for dtype in DTYPES:
        ratio = loss[dtype] / loss["float32"]
        rows.append(
            row(
                "probe",
                f"distillation, held-out MSE vs the fp32 teacher, trained on {dtype} "
                f"({ratio:.4f}x fp32)",
                loss[dtype],
                "MSE",
                note=note,
            )
        )
    assert math.isfinite(sum(loss.values()))
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.6g} {r['unit']} {r['target']} {r['note']}")
