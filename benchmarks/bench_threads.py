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

Each is measured side by side in one process, interleaved: ``featbake.build`` with
default options against the loop the user would write (decode in the loop, encode each clip,
store nothing), with torch's default threads and with the user's 1 thread, quiet and with two
busy processes (pure-Python spin loops) on the same cores beside both. For FrameLSTM also what
featbake did before it kept the user's setting: ``threads=`` every usable CPU.

Targets (issue 19): <= 1.10x quiet, <= 1.25x with two busy processes beside.

Each condition runs its rounds side by side (the bare loop, then the build), and the row is the
median of the rounds' ratios, with their range in the note (a shared node's load drifts within
a run; a best-of picks each side's luckiest round).

Part ``waits`` measures how the encoder's idle OpenMP threads wait (the policy is read when torch
loads, so each way runs in a child process of its own): as they are, ``OMP_WAIT_POLICY=passive``,
a shorter spin (``GOMP_SPINCOUNT=10000``), and a build on 1 thread, each against the user's loop
with torch's default threads, quiet or (``--busy``) beside two busy processes.

Part ``trees`` runs the same build from other checkouts of featbake (``--before DIR``, e.g. an
unpacked ``git archive`` of the commit before a change), each in a child process of its own,
interleaved round by round with this tree's build and the user's loop: a change's before and
after, side by side in one run (``--clips N``, ``--rounds R``; torch's default threads, or
``--threads 1``: ``OMP_NUM_THREADS=1`` for every child, the user's loop too).

``--quiet`` leaves out the busy conditions. FrameLSTM's quiet rows also get one at 4x the
clips (labelled *realistic size*): the issue's row carries the build's fixed cost (the catalog,
the manifest, the one shard's fsync) over a loop of a fraction of a second.

Run: ``python benchmarks/bench_threads.py [lstm|conv|hf ...] [waits [--busy]] [--quiet] [--quick]``
or ``python benchmarks/bench_threads.py lstm trees --before DIR [--clips N] [--rounds R]``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
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
    #: (busy processes beside, the user's thread count: None is torch's default) measured.
    conditions: tuple[tuple[int, int | None], ...]
    forced: bool = False  # also measure threads forced to every CPU (before issue 19)
    #: Quiet with torch's threads, also at this many times the clips (0: not): a realistic size.
    scaled: int = 0


SUBJECTS = (
    Subject(
        "lstm", "many small ops (FrameLSTM: LSTMCell 160->64 over 10 ms frames, TorchScript)",
        lambda w: save_torchscript(torch.jit.script(FrameLSTM()), w / "frame_lstm.pt"),
        300, (1.0, 3.0), BATCH, ((0, None), (0, 1), (2, None), (2, 1)), forced=True, scaled=4,
    ),
    Subject(
        "conv", "small conv (ConvStack 32 channels, TorchScript, ~2 ms a clip)",
        lambda w: save_torchscript(ConvStack(channels=32), w / "conv.pt"),
        300, (1.0, 6.0), 16, ((0, None), (2, None), (2, 1)),
    ),
    Subject(
        "hf", "Hugging Face folder (wav2vec2, hidden 256, 4 layers; featbake: padded batches)",
        hf_folder, 200, (1.0, 4.0), 16, ((0, None), (2, None), (2, 1)),
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


def paired(runs: dict[str, list[float]], name: str) -> tuple[float, float, float]:
    """Median, lowest and highest of ``name``'s seconds over the bare loop's, round by round
    (each round ran both side by side: a round's load hits both alike).

    Example:
        >>> paired({"bare": [1.0, 2.0, 1.0], "featbake": [1.1, 2.0, 1.5]}, "featbake")
        (1.1, 1.0, 1.5)
    """
    ratios = [x / b for x, b in zip(runs[name], runs["bare"], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def conditions(subject: Subject, quick: bool, quiet: bool) -> list[tuple[int, int | None, int]]:
    """(busy processes beside, the user's threads, how many clips) for each row of ``subject``:
    busy ones left out with ``quiet``; the scaled quiet row (torch's threads) after the rest."""
    out = []
    for busy, user in subject.conditions:
        if busy and quiet:
            continue
        n = 24 if quick else (subject.clips * 2 // 5 if busy else subject.clips)
        out.append((busy, user, n))
    if subject.scaled:
        out.append((0, None, (24 if quick else subject.clips) * subject.scaled))
    return out


def bench_subject(work: Path, subject: Subject, quick: bool, quiet: bool = False) -> list[dict]:
    rows = []
    default_threads = torch.get_num_threads()
    enc = subject.make(work)
    for busy, user, n in conditions(subject, quick, quiet):
        reps = 1 if quick else (5 if busy else 3)
        data = work / f"{subject.key}-clips{n}"
        if not data.exists():
            write_audio_folder(data, n, seconds=subject.seconds, seed=31)
            bare_loop(data, enc)  # warm: page cache, lazy imports, thread pools
        load = os.getloadavg()[0]
        with busy_neighbours(busy) if busy else contextlib.nullcontext():
            runs = measure(work, data, enc, subject, user, reps)
        where = f"{busy} busy processes beside" if busy else "quiet"
        threads = f"user's {user} thread" if user else f"torch's {default_threads}"
        target, limit = ("<= 1.25x", 1.25) if busy else ("<= 1.10x", 1.10)
        lo, hi = subject.seconds
        ratio, low, high = paired(runs, "featbake")
        note = (
            f"{n} clips of {lo:g}-{hi:g} s, {subject.label}, featbake batch "
            f"{subject.batch_size}, user's loop one clip at a time, CPU, {process_cpus()} usable "
            f"CPUs, {where}, 1-min load {load:.1f} before; median of {reps} paired rounds, "
            f"range {low:.2f}-{high:.2f}x; all runs (s): "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in runs.items())
        )
        metric = f"{subject.key}, {where}, {threads}: build / the user's loop"
        if n > (24 if quick else subject.clips):
            metric = (
                f"{subject.key}, quiet, {threads}, realistic size ({n} clips, not the issue's row)"
                ": build / the user's loop"
            )
        rows.append(row("threads", metric, ratio, "x", target, ratio <= limit, note))
        if "forced" in runs:
            metric = (
                f"{subject.key}, {where}: before issue 19 (threads forced to {process_cpus()}) "
                "/ the user's loop"
            )
            rows.append(row("threads", metric, paired(runs, "forced")[0], "x", "", None, note))
    return rows


# -- how the encoder's idle threads wait, in processes of their own --------------------------
#: Ways a build's process may run, each in a child process of its own: OpenMP's wait policy is
#: read once, when torch loads its runtime, so it cannot change inside one process. The bare
#: loop runs in a child with the environment as it is (the user's).
WAYS: dict[str, tuple[dict[str, str], int | None]] = {
    "as is": ({}, None),
    "OMP_WAIT_POLICY=passive": ({"OMP_WAIT_POLICY": "passive"}, None),
    "GOMP_SPINCOUNT=10000": ({"GOMP_SPINCOUNT": "10000"}, None),
    "1 thread": ({}, 1),
}


class Arm:
    """A child process that runs the bare loop or a build on request (see :func:`serve`)."""

    def __init__(
        self, env: dict[str, str], data: Path, enc: Path, cache: Path, script: str = __file__
    ) -> None:
        # ``script``: this file as another checkout has it (its featbake is the one imported)
        self.proc = subprocess.Popen(
            [sys.executable, script, "--serve", str(data), str(enc), str(cache)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        assert self.ask("ready") == 0.0

    def ask(self, what: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def serve(data: Path, enc: Path, cache: Path) -> None:
    """The child's side of :class:`Arm`: ``bare`` or ``build THREADS BATCH`` -> seconds."""
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "ready":
            seconds = 0.0
        elif word == "bare":
            seconds = bare_loop(data, enc)
        else:
            threads = None if rest[0] == "-" else int(rest[0])
            seconds = featbake_seconds(data, enc, cache, threads, int(rest[1]))
        print(seconds, flush=True)


def warm(user: Arm, arms: dict[str, Arm], asks: dict[str, str]) -> None:
    """One untimed run of each arm's build and of the user's loop: page cache, lazy imports,
    thread pools."""
    for name, arm in arms.items():
        arm.ask(asks[name])
    user.ask("bare")


def interleaved(
    user: Arm, arms: dict[str, Arm], asks: dict[str, str], reps: int
) -> dict[str, list[float]]:
    """``reps`` paired rounds: the user's loop, then each arm's build (their order reversed
    every other round); each run's seconds by arm (``"bare"``: the user's loop). The arms are
    closed after."""
    runs: dict[str, list[float]] = {"bare": [], **{name: [] for name in arms}}
    for i in range(reps):
        runs["bare"].append(user.ask("bare"))
        for name in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            runs[name].append(arms[name].ask(asks[name]))
    for arm in [user, *arms.values()]:
        arm.close()
    return runs


def bench_waits(work: Path, subject: Subject, quick: bool, busy: int) -> list[dict]:
    """Each of :data:`WAYS` against the user's loop, in child processes, interleaved."""
    enc = subject.make(work)
    n, reps = (24, 1) if quick else (subject.clips * 2 // 5, 5)
    data = work / f"{subject.key}-waits{n}"
    write_audio_folder(data, n, seconds=subject.seconds, seed=31)
    user = Arm({}, data, enc, work / "bare-cache")
    arms = {way: Arm(env, data, enc, work / f"cache{i}") for i, (way, (env, _)) in
            enumerate(WAYS.items())}  # fmt: skip
    asks = {way: f"build {t or '-'} {subject.batch_size}" for way, (_, t) in WAYS.items()}
    warm(user, arms, asks)
    load = os.getloadavg()[0]
    with busy_neighbours(busy) if busy else contextlib.nullcontext():
        runs = interleaved(user, arms, asks, reps)
    where = f"{busy} busy processes beside" if busy else "quiet"
    rows = []
    for way in WAYS:
        ratio, low, high = paired(runs, way)
        note = (
            f"{n} clips, {subject.label}, torch's default threads, {where}, 1-min load "
            f"{load:.1f} before; median of {reps} paired rounds, range {low:.2f}-{high:.2f}x; "
            f"all runs (s): bare {_fmt(runs['bare'])}, build {_fmt(runs[way])}"
        )
        metric = f"{subject.key}, {where}, build with {way} / the user's loop"
        rows.append(row("threads", metric, ratio, "x", "", None, note))
    return rows


def option(name: str, default: str | None = None) -> str | None:
    """The value after ``name`` on the command line, else ``default``."""
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args[:-1] else default


def bench_trees(work: Path, subject: Subject, quick: bool) -> list[dict]:
    """This tree's build against each ``--before DIR``'s, and the user's loop, in child
    processes, interleaved (quiet; under ``chrt -f 10`` for figures to quote)."""
    trees = {"this tree": __file__}
    args = sys.argv[1:]
    for i, a in enumerate(args[:-1]):
        if a == "--before":
            trees[args[i + 1]] = str(Path(args[i + 1]) / "benchmarks" / Path(__file__).name)
    n = int(option("--clips", str(24 if quick else subject.clips * 2 // 5)) or 0)
    reps = 1 if quick else int(option("--rounds", "7") or 7)
    threads = option("--threads")  # the user's count, set as the user would: in the environment
    env = {} if threads is None else {"OMP_NUM_THREADS": threads}
    enc = subject.make(work)
    data = work / f"{subject.key}-trees{n}"
    write_audio_folder(data, n, seconds=subject.seconds, seed=31)
    user = Arm(env, data, enc, work / "bare-cache")
    arms = {t: Arm(env, data, enc, work / f"tree{i}", script) for i, (t, script) in
            enumerate(trees.items())}  # fmt: skip
    asks = {t: f"build - {subject.batch_size}" for t in trees}
    warm(user, arms, asks)
    load = os.getloadavg()[0]
    runs = interleaved(user, arms, asks, reps)
    lo, hi = subject.seconds
    where = f"user's {threads} thread" if threads else f"torch's {torch.get_num_threads()}"
    rows = []
    for t in trees:
        ratio, low, high = paired(runs, t)
        note = (
            f"{n} clips of {lo:g}-{hi:g} s, {subject.label}, quiet, {where}, 1-min load "
            f"{load:.1f} before; median of {reps} paired rounds, range {low:.2f}-{high:.2f}x; "
            f"all runs (s): bare {_fmt(runs['bare'])}, build {_fmt(runs[t])}"
        )
        metric = f"{subject.key}, quiet, {where}, {n} clips: build ({t}) / the user's loop"
        rows.append(row("threads", metric, ratio, "x", "", None, note))
    return rows


def main(quick: bool = False) -> list[dict]:
    keys = [a for a in sys.argv[1:] if a in {s.key for s in SUBJECTS}]
    busy = 2 if "--busy" in sys.argv else 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="featbake-bench-threads-") as tmp:
        for subject in SUBJECTS:
            if keys and subject.key not in keys:
                continue
            if "trees" in sys.argv:
                rows += bench_trees(Path(tmp), subject, quick)
            elif "waits" in sys.argv:
                rows += bench_waits(Path(tmp), subject, quick, busy)
            else:
                rows += bench_subject(Path(tmp), subject, quick, "--quiet" in sys.argv)
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(*map(Path, sys.argv[2:5]))
elif __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
