"""Distillation: train a student on a frozen teacher's baked features, not on a live teacher.

The usual loop runs the teacher on every batch of every epoch. With featbake the teacher runs
once (``featbake.build``) and each epoch reads its features from the store. This script trains
the same student both ways, from the same initialisation, on the same batches, and prints each
epoch's time and loss: the losses are equal (the baked features are the teacher's own output),
and the baked epochs skip the teacher's cost.

Everything is made here: synthetic clips, a teacher (a wider conv stack, saved as TorchScript,
as a real teacher checkpoint would be) and a small student. Nothing is downloaded.

Run: ``python examples/distill_student.py [--clips 160] [--epochs 3] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, StackDataset

import featbake
from featbake import CachedFeatureDataset, pad_collate
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import save_torchscript, write_audio_folder

HOP = 160  # 10 ms frames at 16 kHz, for teacher and student alike


class ConvStack(nn.Module):
    """``[B, T]`` audio -> ``[B, T // 160, dim]`` frames (teacher: wide, deep; student: small)."""

    def __init__(self, width: int, depth: int, dim: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Conv1d(1, width, HOP, HOP), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Conv1d(width, width, 3, padding=1), nn.GELU()]
        layers.append(nn.Conv1d(width, dim, 1))
        self.body = nn.Sequential(*layers)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.body(wav.unsqueeze(1)).transpose(1, 2)


class Audio(Dataset):
    """The clips the dataset lists, decoded as featbake decodes them (same paths, same order)."""

    def __init__(self, features: CachedFeatureDataset) -> None:
        self.paths = [features.path(i) for i in range(len(features))]
        self.source = source_for(Recipe())

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.source.load(self.paths[i])


def masked_mse(pred: torch.Tensor, target: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    frames = min(pred.shape[1], target.shape[1])
    mask = (torch.arange(frames)[None, :] < lengths[:, None]).unsqueeze(-1)
    diff = (pred[:, :frames] - target[:, :frames]) ** 2 * mask
    return diff.sum() / (mask.sum() * pred.shape[-1])


def train(batches: Callable[[], Iterable], target_of: Callable, epochs: int) -> list[tuple]:
    """Train a fresh student (seed 1); returns (seconds, mean loss) per epoch."""
    student = ConvStack(width=32, depth=1, seed=1)
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    out = []
    for _ in range(epochs):
        t0, losses = time.perf_counter(), []
        for batch in batches():
            audio, target, lengths = target_of(batch)
            loss = masked_mse(student(audio), target, lengths)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out.append((time.perf_counter() - t0, sum(losses) / len(losses)))
    return out


def main(argv: list[str] | None = None) -> dict[str, list[tuple]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "distill_work")
    args = parser.parse_args(argv)
    data, store = args.work / "clips", args.work / "store"
    if not data.exists():
        write_audio_folder(data, args.clips, seconds=(1.0, 3.0), seed=4)
    teacher_file = save_torchscript(ConvStack(width=256, depth=6).eval(), args.work / "teacher.pt")
    teacher = torch.jit.load(str(teacher_file)).eval()

    t0 = time.perf_counter()
    report = featbake.build(data, teacher_file, cache=store)
    bake_seconds = time.perf_counter() - t0
    ds = CachedFeatureDataset(data, teacher_file, cache=store, on_miss="error")
    pairs = StackDataset(Audio(ds), ds)  # (audio for the student, the teacher's features)

    def batches() -> Iterable:
        order = torch.Generator().manual_seed(0)  # the same batches for both runs
        return DataLoader(pairs, batch_size=16, shuffle=True, generator=order,
                          collate_fn=lambda b: b)  # fmt: skip

    def live(batch: list) -> tuple:  # the teacher runs on every clip, every epoch
        audio, lengths = pad_collate([a for a, _ in batch])
        with torch.inference_mode():
            target, _ = pad_collate([teacher(a.unsqueeze(0))[0] for a, _ in batch])
        return audio, target.clone(), lengths // HOP

    def baked(batch: list) -> tuple:  # the teacher's features, read from the store
        audio, _ = pad_collate([a for a, _ in batch])
        target, frames = pad_collate([f for _, f in batch])
        return audio, target, frames

    runs = {"live teacher": train(batches, live, args.epochs),
            "baked": train(batches, baked, args.epochs)}  # fmt: skip
    print(f"bake: {report.encoded} clips encoded, {report.reused} reused, {bake_seconds:.1f}s")
    for epoch in range(args.epochs):
        row = ", ".join(
            f"{name} {r[epoch][0]:.2f}s loss {r[epoch][1]:.6f}" for name, r in runs.items()
        )
        print(f"epoch {epoch + 1}: {row}")
    return runs


if __name__ == "__main__":
    main()
