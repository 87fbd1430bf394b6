"""Builds beside small encoders, quiet and on a shared node (issue 19, items 1 and 4).

Three encoders whose own cost is small, so featbake's costs (decoding, hashing, keys, the
writer, the catalog) weigh as much as encoding:

- **FrameLSTM**: an LSTM cell stepped over 10 ms frames, as silero-vad runs its model chunk by
  chunk: per-op overhead, not arithmetic. More threads do not help it; on a busy node they
  hurt. Users set ``OMP_NUM_THREADS=1`` or ``torch.set_num_threads(1)`` for such models.
- **ConvStack**: a 32-channel wav2vec2-style conv front end (TorchScript, ~2 ms a clip).
- **A Hugging Face folder**: a small wav2vec2 (hidden 256, 4 layers, built from a config and
  saved with ``save_pretrained``); the user's loop runs its feature extractor and the model on
  each clip as transformers' docs do.

Each is measured side by side in one process, best of N, interleaved: ``featbake.build`` with
default options against the loop the user would write (decode in the loop, encode each clip,
store nothing), with torch's default threads and with the user's 1 thread, quiet and with two
busy processes (pure-Python spin loops) on the same cores beside both. For FrameLSTM also what
featbake did before it kept the user's setting: ``threads=`` every usable CPU.

Targets (issue 19): <= 1.10x quiet, <= 1.25x with two busy processes beside.

Run: ``python benchmarks/bench_threads.py [lstm|conv|hf ...] [--quick]``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from bench_build import ConvStack

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
    if encoder_path.is_dir():
        return hf_loop(data, encoder_path)
    t0 = time.perf_counter()
    with torchscript_quietly():
        enc = torch.jit.load(str(encoder_path)).eval()
    source = source_for(Recipe())
    with torch.inference_mode():
        for rel in scan(data, source.extensions):
            enc(source.load(str(data / rel)).unsqueeze(0))
    return time.perf_counter() - t0


def hf_loop(data: Path, folder: Path) -> float:
    """transformers' own loop: the folder's feature extractor and model, one clip at a time."""
    from transformers import AutoFeatureExtractor, AutoModel

    t0 = time.perf_counter()
    model = AutoModel.from_pretrained(folder).eval()
    extractor = AutoFeatureExtractor.from_pretrained(folder)
    source = source_for(Recipe())
    with torch.inference_mode():
        for rel in scan(data, source.extensions):
            wav = source.load(str(data / rel)).numpy()
            model(**extractor(wav, sampling_rate=16000, return_tensors="pt"))
    return time.perf_counter() - t0


def hf_folder(work: Path) -> Path:
    """A small wav2vec2 (hidden 256, 4 layers, layer norm: padded batches apply), saved."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    folder = work / "w2v2-small"
    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        conv_dim=(128,) * 7, feat_extract_norm="layer", do_stable_layer_norm=True,
    )  # fmt: skip
    Wav2Vec2Model(config).eval().save_pretrained(folder)
    Wav2Vec2FeatureExtractor(return_attention_mask=True).save_pretrained(folder)
    return folder


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


def featbake_seconds(
    data: Path, enc: Path, cache: Path, threads: int | None = None, batch_size: int = 16
) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    report = build(data, enc, cache=cache, batch_size=batch_size, threads=threads)
    seconds = time.perf_counter() - t0
    assert report.ok and report.encoded == report.files
    return seconds


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


@dataclass(frozen=True)
class Subject:
    """One encoder measured: how to make it, its clips, featbake's batch size, its label."""

    key: str
    label: str
    make: Callable[[Path], Path]
    clips: int
    seconds: tuple[float, float]
    batch_size: int
    #: (busy processes beside, the user's thread count) measured. torch's default count beside
    #: busy processes is left out: both sides slow down alike there (2-3x run to run).
    conditions: tuple[tuple[int, int | None], ...]
    forced: bool = False  # also measure threads forced to every CPU (before issue 19)


SUBJECTS = (
    Subject(
        "lstm", "many small ops (FrameLSTM: LSTMCell 160->64 over 10 ms frames, TorchScript)",
        lambda w: save_torchscript(torch.jit.script(FrameLSTM()), w / "frame_lstm.pt"),
        300, (1.0, 3.0), BATCH, ((0, None), (0, 1), (2, 1)), forced=True,
    ),
    Subject(
        "conv", "small conv (ConvStack 32 channels, TorchScript, ~2 ms a clip)",
        lambda w: save_torchscript(ConvStack(channels=32), w / "conv.pt"),
        300, (1.0, 6.0), 16, ((0, None), (2, 1)),
    ),
    Subject(
        "hf", "Hugging Face folder (wav2vec2, hidden 256, 4 layers; featbake: padded batches)",
        hf_folder, 200, (1.0, 4.0), 16, ((0, None), (2, 1)),
    ),
)  # fmt: skip


def measure(work: Path, data: Path, enc: Path, subject: Subject, user: int | None, reps: int):
    """All seconds of the bare loop, featbake, and (``subject.forced``) the old forced count."""
    before = torch.get_num_threads()
    if user is not None:
        torch.set_num_threads(user)
    runs: dict[str, list[float]] = {"bare": [], "featbake": []}
    if subject.forced and user is not None:
        runs["forced"] = []
    try:
        for i in range(reps):  # interleaved, so drifting load hits every variant alike
            runs["bare"].append(bare_loop(data, enc))
            cache = work / f"t{i}"
            runs["featbake"].append(featbake_seconds(data, enc, cache, None, subject.batch_size))
            if "forced" in runs:
                forced = process_cpus()  # what featbake set before issue 19
                runs["forced"].append(
                    featbake_seconds(data, enc, work / f"f{i}", forced, subject.batch_size)
                )
    finally:
        torch.set_num_threads(before)
    return runs


def bench_subject(work: Path, subject: Subject, quick: bool) -> list[dict]:
    rows = []
    default_threads = torch.get_num_threads()
    enc = subject.make(work)
    for busy, user in subject.conditions:
        n, reps = (
            (24, 1) if quick else ((subject.clips * 2 // 5, 3) if busy else (subject.clips, 3))
        )
        data = work / f"{subject.key}-clips{n}"
        if not data.exists():
            write_audio_folder(data, n, seconds=subject.seconds, seed=31)
            bare_loop(data, enc)  # warm: page cache, lazy imports, thread pools
        with busy_neighbours(busy) if busy else contextlib.nullcontext():
            runs = measure(work, data, enc, subject, user, reps)
        best = {k: min(v) for k, v in runs.items()}
        where = f"{busy} busy processes beside" if busy else "quiet"
        threads = f"user's {user} thread" if user else f"torch's {default_threads}"
        target, limit = ("<= 1.25x", 1.25) if busy else ("<= 1.10x", 1.10)
        lo, hi = subject.seconds
        note = (
            f"{n} clips of {lo:g}-{hi:g} s, {subject.label}, featbake batch "
            f"{subject.batch_size}, user's loop one clip at a time, CPU, {process_cpus()} usable "
            f"CPUs, {where}; best of {reps}; all runs (s): "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in runs.items())
        )
        ratio = best["featbake"] / best["bare"]
        metric = f"{subject.key}, {where}, {threads}: build / the user's loop"
        rows.append(row("threads", metric, ratio, "x", target, ratio <= limit, note))
        if "forced" in best:
            metric = (
                f"{subject.key}, {where}: before issue 19 (threads forced to {process_cpus()}) "
                "/ the user's loop"
            )
            rows.append(row("threads", metric, best["forced"] / best["bare"], "x", "", None, note))
    return rows


def main(quick: bool = False) -> list[dict]:
    keys = [a for a in sys.argv[1:] if a in {s.key for s in SUBJECTS}]
    rows = []
    with tempfile.TemporaryDirectory(prefix="featbake-bench-threads-") as tmp:
        for subject in SUBJECTS:
            if not keys or subject.key in keys:
                rows += bench_subject(Path(tmp), subject, quick)
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
