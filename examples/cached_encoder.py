"""A frozen encoder inside a bigger model, cached in-process with ``CachedEncoder``.

No bake step: wrap the frozen part of the model, pass each row's id (here its file path) to
``forward``, and the encoder runs only for rows it has not seen. The first epoch encodes and
writes the features to the store; later epochs, and later runs of the script, read them. The
trainable head is untouched. The script checks that the cached model's outputs equal the
uncached model's, and prints the time of each epoch and where the features came from.

Everything is made here (synthetic clips, a tiny conv encoder). Nothing is downloaded.

Run: ``python examples/cached_encoder.py [--clips 96] [--epochs 3] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from featbake import CachedEncoder, pad_collate
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import TinyConvEncoder, write_audio_folder


class Model(nn.Module):
    """A frozen encoder (cached) under a trainable head that pools frames into 4 scores."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, audio: torch.Tensor, ids: list[str] | None = None) -> torch.Tensor:
        if isinstance(self.encoder, CachedEncoder):
            feats = self.encoder(audio, ids=ids)
        else:
            feats = self.encoder(audio)
        return self.head(feats).mean(1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "cached_work")
    args = parser.parse_args(argv)
    data, store = args.work / "clips", args.work / "store"
    if not data.exists():
        write_audio_folder(data, args.clips, seconds=1.0, seed=9)
    shutil.rmtree(store, ignore_errors=True)  # start cold, so the first epoch shows the misses
    source = source_for(Recipe())
    paths = sorted(str(p) for p in data.rglob("*.wav"))
    clips = [source.load(p) for p in paths]

    frozen = TinyConvEncoder().eval().requires_grad_(False)
    model = Model(CachedEncoder(frozen, cache=store))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    epochs = []
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        before = dict(model.encoder.stats)
        for start in range(0, len(clips), 16):
            audio, _ = pad_collate(clips[start : start + 16])  # equal lengths here: no padding
            loss = model(audio, ids=paths[start : start + 16]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        stats = {k: v - before[k] for k, v in model.encoder.stats.items()}
        epochs.append({"seconds": time.perf_counter() - t0, **stats})
        print(f"epoch {epoch + 1}: {epochs[-1]['seconds']:.2f}s, {stats}")
    model.encoder.flush()  # seal what was written back, for the next run of this script

    # The cached model computes exactly what the same model without the cache computes.
    plain = Model(frozen)
    plain.head.load_state_dict(model.head.state_dict())
    audio, _ = pad_collate(clips[:8])
    with torch.no_grad():
        torch.testing.assert_close(model(audio, ids=paths[:8]), plain(audio))
    print("cached model == uncached model on the same batch")
    return epochs


if __name__ == "__main__":
    main()
