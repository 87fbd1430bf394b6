"""Builds with a many-small-ops encoder, quiet and on a shared node (issue 19, item 1).

A model of many small ops (here an LSTM cell stepped over 10 ms frames, as silero-vad runs its
model chunk by chunk) spends its time in per-op overhead, not in arithmetic: more threads do
not help it, and on a node where other processes are busy they hurt. Users set
``OMP_NUM_THREADS=1`` or ``torch.set_num_threads(1)`` for such models. Measured side by side
in one process, best of N, interleaved:

- ``featbake.build`` with default options against the bare loop the user would write
  (decode in the loop, encode each clip, store nothing), both with torch's default
  threads, and both with the user's 1 thread;
- the same with two busy processes (pure-Python spin loops) on the same cores beside both;
- for reference, what featbake did before it kept the user's setting: ``threads=`` every usable
  CPU while the user had set 1.

Targets (issue 19): <= 1.10x quiet, <= 1.25x with two busy processes beside.

Run: ``python benchmarks/bench_threads.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row

from featbake.bake.pipeline import build
from featbake.device import process_cpus
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import scan, source_for
from featbake.recipe import Recipe
from featbake.testing import save_torchscript, write_audio_folder

#: Samples per step: 10 ms at 16 kHz.
FRAME = 160
#: One clip per call, as silero-vad's own loop runs its model.
BATCH = 1


class FrameLSTM(nn.Module):
    """An LSTM cell stepped over 10 ms frames: ~100 small ops per second of audio."""

    def __init__(self, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = hidden
        self.frame = FRAME
        self.cell = nn.LSTMCell(FRAME, hidden)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        step = self.frame
        frames = wav[:, : wav.shape[1] // step * step].reshape(wav.shape[0], -1, step)
        h = torch.zeros(wav.shape[0], self.hidden)
        c = torch.zeros(wav.shape[0], self.hidden)
        out = []
        for t in range(frames.shape[1]):
            h, c = self.cell(frames[:, t], (h, c))
            out.append(h)
        return torch.stack(out, dim=1)


def bare_loop(data: Path, encoder_path: Path) -> float:
    """What the user writes: decode each file and run the encoder on it; store nothing."""
    t0 = time.perf_counter()
    with torchscript_quietly():
        enc = torch.jit.load(str(encoder_path)).eval()
    source = source_for(Recipe())
    with torch.inference_mode():
        for rel in scan(data, source.extensions):
            enc(source.load(str(data / rel)).unsqueeze(0))
    return time.perf_counter() - t0


@contextlib.contextmanager
def busy_neighbours(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPUs beside the block (the same load for both sides)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # let them get scheduled
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def featbake_seconds(data: Path, enc: Path, cache: Path, threads: int | None = None) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    report = build(data, enc, cache=cache, batch_size=BATCH, threads=threads)
    seconds = time.perf_counter() - t0
    assert report.ok and report.encoded == report.files
    return seconds


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def measure(work: Path, data: Path, enc: Path, user_threads: int | None, reps: int) -> dict:
    """Best seconds of the bare loop, featbake, and (user_threads set) the old forced count."""
    before = torch.get_num_threads()
    if user_threads is not None:
        torch.set_num_threads(user_threads)
    runs: dict[str, list[float]] = {"bare": [], "featbake": []}
    if user_threads is not None:
        runs["forced"] = []
    try:
        for i in range(reps):  # interleaved, so drifting load hits every variant alike
            runs["bare"].append(bare_loop(data, enc))
            runs["featbake"].append(featbake_seconds(data, enc, work / f"t{i}"))
            if "forced" in runs:
                forced = process_cpus()  # what featbake set before issue 19
                runs["forced"].append(featbake_seconds(data, enc, work / f"f{i}", forced))
    finally:
        torch.set_num_threads(before)
    return runs


#: (busy processes beside, the user's thread count) measured; torch's default count beside busy
#: processes is left out: both sides slow down alike there (2-3x run to run), it tells nothing.
CONDITIONS = ((0, None), (0, 1), (2, 1))


def main(quick: bool = False) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="featbake-bench-threads-") as tmp:
        work = Path(tmp)
        default_threads = torch.get_num_threads()
        enc = save_torchscript(torch.jit.script(FrameLSTM()), work / "frame_lstm.pt")
        for busy, user in CONDITIONS:
            n, reps = (24, 1) if quick else ((120, 2) if busy else (300, 3))
            data = work / f"clips{n}"
            if not data.exists():
                write_audio_folder(data, n, seconds=(1.0, 3.0), seed=31)
                bare_loop(data, enc)  # warm: page cache, lazy imports, thread pools
            with busy_neighbours(busy) if busy else contextlib.nullcontext():
                runs = measure(work, data, enc, user, reps)
            best = {k: min(v) for k, v in runs.items()}
            where = f"{busy} busy processes beside" if busy else "quiet"
            threads = f"user's {user} thread" if user else f"torch's {default_threads}"
            target, limit = ("<= 1.25x", 1.25) if busy else ("<= 1.10x", 1.10)
            note = (
                f"{n} clips of 1-3 s, FrameLSTM (LSTMCell 160->64 stepped over 10 ms frames, "
                f"TorchScript), batch {BATCH}, CPU, {process_cpus()} usable CPUs, {where}; "
                f"best of {reps}; all runs (s): "
                + ", ".join(f"{k} {_fmt(v)}" for k, v in runs.items())
            )
            ratio = best["featbake"] / best["bare"]
            metric = f"many small ops, {where}, {threads}: build / bare loop"
            rows.append(row("threads", metric, ratio, "x", target, ratio <= limit, note))
            if "forced" in best:
                metric = (
                    f"many small ops, {where}: before issue 19 (threads forced to "
                    f"{process_cpus()}) / bare loop"
                )
                rows.append(
                    row("threads", metric, best["forced"] / best["bare"], "x", "", None, note)
                )
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
