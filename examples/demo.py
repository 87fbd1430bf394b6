"""featbake's demo: bake a small encoder's features once, then serve them to a training loop.

Run with ``make demo`` (installs what is missing first) or ``python examples/demo.py``.
Everything is made here: 32 synthetic clips (some at 44.1 kHz, resampled to 16 kHz) and a tiny
TorchScript conv encoder. Nothing is downloaded.

Steps, each the command a user would run:
  1. featbake build --encoder examples/demo_encoder.pt --data examples/demo_data --cache ...
  2. the same again: nothing is recomputed
  3. featbake stats
  4. one DataLoader epoch over CachedFeatureDataset, checked against running the encoder now
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from featbake import CachedFeatureDataset, pad_collate
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import AudioSource
from featbake.recipe import Recipe
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder

HERE = Path(__file__).resolve().parent
DATA = HERE / "demo_data"
ENCODER = HERE / "demo_encoder.pt"
STORE = HERE / "demo_store"


def featbake(*args: str) -> None:
    """Run the featbake CLI as a user would, echoing the command."""
    cmd = [sys.executable, "-m", "featbake", *args]
    print(f"\n$ featbake {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=True)


def rel(p: Path) -> str:
    """``p`` relative to the working directory when it is inside it (shorter commands)."""
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p)


def main() -> None:
    if not DATA.exists():
        write_audio_folder(DATA / "speakerA", 16, seconds=(1.0, 3.0), seed=1)
        write_audio_folder(DATA / "speakerB", 16, seconds=(1.0, 3.0), sample_rate=44100, seed=2)
    if not ENCODER.exists():
        save_torchscript(TinyConvEncoder(), ENCODER)
    shutil.rmtree(STORE, ignore_errors=True)  # a fresh bake every time the demo runs

    common = ["--encoder", rel(ENCODER), "--data", rel(DATA), "--cache", rel(STORE)]
    featbake("build", *common)
    featbake("build", *common)  # again: every feature is reused, nothing is encoded
    featbake("stats", "--cache", rel(STORE))

    print("\n# one training epoch over the store", flush=True)
    ds = CachedFeatureDataset(
        DATA, encoder=ENCODER, cache=STORE, ram_cache="64MiB", on_miss="error"
    )
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=pad_collate)
    t0 = time.perf_counter()
    seen, dims = 0, set()
    for feats, lengths in loader:
        seen += len(lengths)
        dims.add(int(feats.shape[-1]))
    dt = time.perf_counter() - t0
    dim = ", ".join(map(str, sorted(dims)))
    print(f"served {seen} items in {dt * 1000:.0f} ms in batches of 8 (feature dim {dim})")

    # Served features equal running the encoder now on the same preprocessed audio.
    with torchscript_quietly():
        module = torch.jit.load(str(ENCODER))
    x = AudioSource(Recipe()).load(DATA / ds.path(0))
    with torch.inference_mode():
        live = module(x.unsqueeze(0))[0]
    assert torch.equal(ds[0], live), "served features differ from live encoding"
    print(f"item 0 ({rel(Path(ds.path(0)))}): served == live encoding, shape {tuple(live.shape)}")
    print(f"\nDone. The store is in {rel(STORE)}; try `featbake stats --cache {rel(STORE)}`.")


if __name__ == "__main__":
    main()
