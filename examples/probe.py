"""A linear probe on a frozen encoder's baked features, with labels, on a CPU in seconds.

The pattern of a probing study: run the encoder over the dataset once (``featbake.build``),
then train a small head for many epochs on the stored features. Labels stay yours: pair the
dataset with them through ``torch.utils.data.StackDataset``; ``pad_collate`` then yields
``(features, lengths, labels)``.

Everything is made here: two classes of synthetic clips (low tones and high tones, 0.5-2 s,
with noise) and a tiny TorchScript conv encoder. Nothing is downloaded.

Run: ``python examples/probe.py [--clips 200] [--epochs 8] [--workers 2] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import soundfile
import torch
from torch import nn
from torch.utils.data import DataLoader, StackDataset

import featbake
from featbake import CachedFeatureDataset, pad_collate
from featbake.testing import TinyConvEncoder, save_torchscript

SAMPLE_RATE = 16000
CLASSES = {"low": (150.0, 300.0), "high": (1200.0, 2400.0)}  # tone frequency range per class


def write_clips(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` clips, half of each class, in ``folder/<class>/``: a tone plus noise."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        name = list(CLASSES)[i % 2]
        lo, hi = CLASSES[name]
        t = np.arange(int(SAMPLE_RATE * rng.uniform(0.5, 2.0))) / SAMPLE_RATE
        wave = 0.4 * np.sin(2 * np.pi * rng.uniform(lo, hi) * t) + 0.05 * rng.standard_normal(
            len(t)
        )
        (folder / name).mkdir(parents=True, exist_ok=True)
        soundfile.write(folder / name / f"clip{i:05d}.wav", wave.astype(np.float32), SAMPLE_RATE)


class Probe(nn.Module):
    """Mean-pool the valid frames, normalise, then one linear layer."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.linear = nn.Linear(dim, classes)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(feats.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
        pooled = (feats * mask).sum(1) / lengths[:, None]
        return self.linear(self.norm(pooled))


def main(argv: list[str] | None = None) -> float:
    """Bake, then train the probe; returns its accuracy on the training clips."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "probe_work")
    args = parser.parse_args(argv)
    data, store = args.work / "clips", args.work / "store"
    if not data.exists():
        write_clips(data, args.clips)
    encoder = save_torchscript(TinyConvEncoder(), args.work / "encoder.pt")

    t0 = time.perf_counter()
    report = featbake.build(data, encoder, cache=store)  # once; a rerun reuses everything
    print(
        f"baked {report.encoded} clips ({report.reused} reused) in {time.perf_counter() - t0:.1f}s"
    )

    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    labels = torch.tensor(
        [list(CLASSES).index(Path(ds.path(i)).parent.name) for i in range(len(ds))]
    )
    loader = DataLoader(
        StackDataset(ds, labels),
        batch_size=16,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # workers (and their RAM cache) last across epochs
        collate_fn=pad_collate,
    )
    torch.manual_seed(0)
    probe = Probe(ds[0].shape[-1], len(CLASSES))
    opt = torch.optim.Adam(probe.parameters(), lr=3e-2)
    accuracy = 0.0
    for epoch in range(args.epochs):
        t0, correct, seen = time.perf_counter(), 0, 0
        for feats, lengths, y in loader:
            logits = probe(feats, lengths)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
        accuracy = correct / seen
        print(
            f"epoch {epoch + 1}: loss {loss.item():.3f}, accuracy {accuracy:.2f}, "
            f"{time.perf_counter() - t0:.2f}s"
        )
    print(f"accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
