"""Padded length-sorted batches against exact-shape batching and a bare per-clip loop.

Variable-length clips (1-20 s, uniform) through a small transformer encoder that takes lengths
(:class:`featbake.testing.LengthsEncoder`: a strided conv front end at 50 frames/s and
transformer layers with a padding mask; 256 wide, 4 layers), three ways, side by side:

1. ``featbake.build`` with padded length-sorted batches (``--batch-size 16``,
   ``--batch-seconds 160``; the exactness guard's re-runs are counted in its time);
2. ``featbake.build`` with exact-shape batching: clips of different lengths never share a batch,
   so this is one clip per encoder call plus the bake's own work;
3. a bare loop: decode each clip and run the encoder on it alone, storing nothing (what a
   hand-written extraction script does at batch 1).

Reported as items/s and the ratios padded / bare and padded / exact, with what each arm ran:
the distinct input lengths the encoder saw (on a GPU each new one's first call costs ~55 ms of
kernel choice), the padded batches and the guard's runs alone. Two more padded builds: the same
with the padded lengths exact (on a GPU the default steps them, ``PadLengths.STEPPED``; on the
CPU both are exact) and with the guard off (the guard's share of the build).

One more padded build runs each padded length once before it is timed (a batch of zeros at every
length the build will pad to, with the rows a batch of that length holds): what warming the
lengths up would buy on a GPU, where each new length's first call costs a kernel choice. The
guard's runs are each clip's own length and stay cold; the warm-up's seconds are in the note.

``--model hf-base`` runs a wav2vec2-base-sized Hugging Face model (95M parameters, built from a
config, random weights) instead, for the GPU target (>= 2.5x batch 1); ``--device cuda
--precision bf16`` runs it there. ``--model hf-tiny`` is the same architecture 32 wide and 2
layers deep: the Hugging Face path in seconds on a CPU (``benchmarks/bench_gpu.py --device cpu``).

Run: ``python benchmarks/bench_padded.py [--quick] [--device cuda] [--precision bf16]
[--model small|hf-base|hf-tiny]``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from featbake.bake import batching as padded
from featbake.bake.pipeline import build
from featbake.device import synchronize
from featbake.encode import encoders
from featbake.encode.encoders import LoadedEncoder
from featbake.encode.loaders import load_encoder
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.encode.sources import scan, source_for
from featbake.recipe import Recipe
from featbake.testing import LengthsEncoder, save_torchscript, write_audio_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import row

BATCH = 16
BATCH_SECONDS = 160.0
WORKERS = 2


MODELS = ("small", "hf-base", "hf-tiny")


def wav2vec2_folder(folder: Path, tiny: bool = False) -> Path:
    """A wav2vec2 model folder with random weights, built from a config (no download): base-sized
    (95M parameters), or ``tiny`` (32 wide, 2 layers: seconds on a CPU). Layer-norm variant, so
    padding is exact and padded batches apply. Kept when ``folder`` already holds one."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    small: dict[str, Any] = {}
    if tiny:
        small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "intermediate_size": 64, "conv_dim": (32,) * 7,
                 "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2}  # fmt: skip
    torch.manual_seed(0)
    config = Wav2Vec2Config(feat_extract_norm="layer", do_stable_layer_norm=True, **small)
    Wav2Vec2Model(config).eval().save_pretrained(folder)
    Wav2Vec2FeatureExtractor(return_attention_mask=True, do_normalize=True).save_pretrained(folder)
    return folder


def make_encoder(work: Path, model: str) -> Path:
    """The encoder file or folder: the small lengths transformer, or wav2vec2 from a config."""
    if model in ("hf-base", "hf-tiny"):
        return wav2vec2_folder(work / model, tiny=model == "hf-tiny")
    return save_torchscript(LengthsEncoder(dim=256, layers=4), work / "lengths.pt")


class Calls:
    """The input shapes of every encoder call in a block (``LoadedEncoder.run`` wrapped)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def lengths(self) -> int:
        """Distinct input lengths run (padded batches and runs alone together)."""
        return len({shape[-1] for shape in self.shapes})

    def batches(self) -> int:
        """Calls of more than one row."""
        return sum(1 for shape in self.shapes if shape[0] > 1)

    def alone(self) -> int:
        """Calls of one row (in a padded build: the guard's runs, and batches of one clip)."""
        return sum(1 for shape in self.shapes if shape[0] == 1)

    def summary(self) -> str:
        return (
            f"{self.lengths()} distinct lengths run, {len(set(self.shapes))} shapes; "
            f"{self.batches()} batches, {self.alone()} runs of one clip"
        )


@contextlib.contextmanager
def recorded_calls() -> Iterator[Calls]:
    """Every ``LoadedEncoder.run`` in the block adds its batch's shape to the ``Calls``."""
    calls, run = Calls(), encoders.LoadedEncoder.run

    def recording(self: LoadedEncoder, batch: Any, lengths: Any = None) -> Any:
        calls.shapes.append(tuple(batch.shape))
        return run(self, batch, lengths)

    encoders.LoadedEncoder.run = recording  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        encoders.LoadedEncoder.run = run  # type: ignore[method-assign]


def bare_loop(data: Path, enc: LoadedEncoder, recipe: Recipe) -> float:
    """Seconds to decode and encode every clip alone (batch 1), storing nothing."""
    source = source_for(recipe)
    t0 = time.perf_counter()
    for rel in scan(data, source.extensions):
        encode_batch(enc, [source.load(data / rel)], recipe)
    synchronize(enc.device)
    return time.perf_counter() - t0


def timed_build(data: Path, encoder: Path, store: Path, recipe: Recipe, **kw: Any) -> tuple:
    t0 = time.perf_counter()
    report = build(data, encoder, cache=store, recipe=recipe, workers=WORKERS, **kw)
    return time.perf_counter() - t0, report


#: The arms, each on its own clips drawn alike (see :func:`run_arms`).
ARMS = ("padded", "padded-exact-lengths", "padded-warmed", "exact", "unguarded", "bare")


@dataclass
class Arms:
    """What each arm measured: seconds, the build reports and the encoder calls recorded."""

    n: int
    t_pad: float
    rep_pad: Any
    pad_calls: Calls
    t_exact_lengths: float
    exact_lengths_calls: Calls
    warmed: Warmed
    t_exact: float
    t_unguarded: float
    t_bare: float
    bare_calls: Calls


@dataclass
class Warmed:
    """The padded build timed after each of its padded lengths ran once (:func:`warm_lengths`)."""

    seconds: float  # the build alone
    warm_seconds: float  # the warm-up alone
    shapes: int  # shapes warmed
    calls: Calls  # the timed build's encoder calls


def main(
    quick: bool = False,
    device: str = "cpu",
    precision: str = "fp32",
    model: str = "small",
    clips: int | None = None,
) -> list[dict]:
    """Run the padded-batching benchmark; returns result rows (see ``benchmarks/run.py``).
    ``clips`` per arm: by default 8 quick, else 64 on a CPU and 256 on a GPU."""
    work = Path(tempfile.mkdtemp(prefix="featbake-bench-padded-"))
    try:
        n, seconds = (8, (1.0, 3.0)) if quick else (64 if device == "cpu" else 256, (1.0, 20.0))
        n = clips or n
        arms = run_arms(work, n, seconds, device, precision, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = f"{n} clips of {seconds[0]:g}-{seconds[1]:g} s, {model}, {device}, {precision}"
    return arm_rows(arms, what, device, model)


def run_arms(
    work: Path, n: int, seconds: tuple[float, float], device: str, precision: str, model: str
) -> Arms:
    """Every arm timed, one after another, each on its own clips."""
    # Each arm gets its own clips, drawn alike (other seeds): on a GPU a shape's first call
    # selects its kernels (~55 ms a new length for wav2vec2-base on an H200, measured), so an
    # arm that ran after another on the same clips would be spared that cost, as real data
    # never spares it (the bare loop ran last and was timed 3.8x faster than on new clips).
    data = {arm: work / arm for arm in ARMS}
    for seed, folder in enumerate(data.values(), start=9):
        write_audio_folder(folder, n, seconds=seconds, seed=seed)
    encoder = make_encoder(work, model)
    recipe = Recipe(precision=precision)
    common = {"batch_size": BATCH, "device": device, "batch_seconds": BATCH_SECONDS}
    # A throwaway build first: the process's one-time costs (CUDA context, cuDNN and kernel
    # loading) are billed to no side, as the bare loop's warm-up run does for it.
    write_audio_folder(work / "warm", min(4, n), seconds=(1.0, 3.0), seed=30)
    timed_build(work / "warm", encoder, work / "warm-store", recipe, **common)
    with recorded_calls() as pad_calls:
        t_pad, rep_pad = timed_build(
            data["padded"], encoder, work / "pad", recipe, batching="padded", **common
        )
    with recorded_calls() as exact_lengths_calls:
        t_exact_lengths = exact_lengths_build(
            data["padded-exact-lengths"], encoder, work / "pel-store", recipe, **common
        )
    warmed = warmed_build(data["padded-warmed"], encoder, work / "warmed-store", recipe, common)
    t_exact, rep_exact = timed_build(
        data["exact"], encoder, work / "exact-store", recipe, batching="exact", **common
    )
    t_unguarded = unguarded_build(
        data["unguarded"], encoder, work / "unguarded-store", recipe, **common
    )
    enc = load_encoder(encoder, device=device)
    bare_recipe = recipe.replace(normalize=model != "small")
    bare_loop(work / "warm", enc, bare_recipe)  # the process's first-call costs, as above
    with recorded_calls() as bare_calls:
        t_bare = bare_loop(data["bare"], enc, bare_recipe)
    assert rep_pad.encoded == n and rep_exact.encoded == n
    return Arms(n, t_pad, rep_pad, pad_calls, t_exact_lengths, exact_lengths_calls, warmed,
                t_exact, t_unguarded, t_bare, bare_calls)  # fmt: skip


def arm_rows(arms: Arms, what: str, device: str, model: str) -> list[dict]:
    """The rows of :func:`run_arms`' measures."""
    n, t_pad, t_bare, warmed = arms.n, arms.t_pad, arms.t_bare, arms.warmed
    on_gpu = device != "cpu" and model == "hf-base"
    target = ">= 2.5x (GPU, wav2vec2-base)" if device != "cpu" else "report (2-core CPU)"
    pad_calls = arms.pad_calls
    return [
        # A guard that finds padding inexact (fp32 on a GPU: 4e-4 > 1e-4) falls back to exact
        # shapes: the row says so rather than the run failing.
        row("padded", "padded batches, items/s", n / t_pad, "items/s",
            note=arms.rep_pad.batching_note),
        row("padded", "exact-shape batching, items/s", n / arms.t_exact, "items/s", note=what),
        row("padded", "bare per-clip loop, items/s", n / t_bare, "items/s", note=what),
        row("padded", "padded vs bare per-clip loop", t_bare / t_pad, "x", target=target,
            ok=(t_bare / t_pad >= 2.5) if on_gpu else None, note=what),
        row("padded", "padded, each padded length warmed first (not timed) vs bare per-clip loop",
            t_bare / warmed.seconds, "x", target=target,
            ok=(t_bare / warmed.seconds >= 2.5) if on_gpu else None,
            note=f"warm-up {warmed.warm_seconds:.2f} s ({warmed.shapes} shapes); with it "
            f"{t_bare / (warmed.seconds + warmed.warm_seconds):.2f}x the bare loop; "
            f"timed build: {warmed.calls.summary()}; {what}"),
        row("padded", "padded vs exact-shape batching", arms.t_exact / t_pad, "x", note=what),
        row("padded", "padded: distinct input lengths run (padded batches and guard runs)",
            pad_calls.lengths(), "lengths",
            note=f"{pad_calls.summary()}; bare loop: {arms.bare_calls.summary()}"),
        row("padded", "padded (default lengths) vs padded to exact lengths",
            arms.t_exact_lengths / t_pad, "x",
            target="report (the same build on the CPU)" if device == "cpu" else "report",
            note=f"padded to exact lengths: {arms.exact_lengths_calls.summary()}; {what}"),
        row("padded",
            "guard cost: padded build, the guard's chosen batches checked vs the guard off",
            100 * (t_pad / arms.t_unguarded - 1), "%",
            target="< 10% (the build-overhead target)", ok=t_pad / arms.t_unguarded - 1 < 0.10,
            note=f"{pad_calls.alone()} guard runs for {pad_calls.batches()} batches; {what}"),
    ]  # fmt: skip


def warm_shapes(data: Path, recipe: Recipe, device: str) -> list[tuple[int, int]]:
    """(rows, padded length) of a full batch at each length a padded build of ``data`` can pad
    to: the device's padded length (stepped on a GPU) of each clip's, since a batch is padded
    to its longest clip's; as many rows as the batch budget and ``BATCH`` allow there."""
    source = source_for(recipe)
    pad_to = padded.length_to_pad(padded.pad_lengths_for(torch.device(device).type))
    budget = padded.budget_samples(recipe, BATCH_SECONDS, None)
    lengths = sorted({pad_to(int(source.load(data / rel).shape[-1]))
                      for rel in scan(data, source.extensions)})  # fmt: skip
    return [(max(1, min(BATCH, budget // length)), length) for length in lengths]


def warm_lengths(
    encoder: Path, recipe: Recipe, device: str, shapes: list[tuple[int, int]]
) -> float:
    """Seconds to run one batch of noise of each shape through the encoder, loaded as a build
    loads it (the kernels chosen then are the process's, as the build's are)."""
    t0 = time.perf_counter()
    enc = load_encoder(encoder, device=device)
    generator = torch.Generator().manual_seed(0)
    for rows, length in shapes:
        inputs = [torch.randn(length - i, generator=generator) for i in range(rows)]
        encode_padded(enc, inputs, recipe, pad_to=length)
    synchronize(device)
    return time.perf_counter() - t0


def warmed_build(
    data: Path, encoder: Path, store: Path, recipe: Recipe, common: dict[str, Any]
) -> Warmed:
    """The padded build of ``data`` timed after :func:`warm_lengths` ran its padded lengths."""
    shapes = warm_shapes(data, recipe, str(common["device"]))
    warm = warm_lengths(encoder, recipe, str(common["device"]), shapes)
    with recorded_calls() as calls:
        seconds, _ = timed_build(data, encoder, store, recipe, batching="padded", **common)
    return Warmed(seconds, warm, len(shapes), calls)


def exact_lengths_build(data: Path, encoder: Path, store: Path, recipe: Recipe, **kw: Any) -> float:
    """Seconds of the same padded build with each batch padded to its longest clip exactly."""
    saved, padded.PAD_LENGTHS = padded.PAD_LENGTHS, padded.PadLengths.EXACT
    try:
        seconds, _ = timed_build(data, encoder, store, recipe, batching="padded", **kw)
    finally:
        padded.PAD_LENGTHS = saved
    return seconds


def unguarded_build(data: Path, encoder: Path, store: Path, recipe: Recipe, **kw: Any) -> float:
    """Seconds of the same padded build with the exactness guard switched off (bench only)."""
    saved, padded.GUARD_ITEMS = padded.GUARD_ITEMS, 0
    try:
        seconds, report = timed_build(data, encoder, store, recipe, batching="padded", **kw)
    finally:
        padded.GUARD_ITEMS = saved
    assert report.batching == "padded"
    return seconds


if __name__ == "__main__":
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--model", default="small", choices=MODELS)
    args = parser.parse_args()
    result = main(args.quick, args.device, args.precision, args.model)
    table = Table("metric", "value", "unit", "target", "ok", "note", show_lines=True)
    for r in result:
        table.add_row(
            r["metric"], f"{r['value']:.3g}", r["unit"], r["target"], str(r["ok"]), r["note"]
        )
    Console(width=200).print(table)
