"""The CUDA paths measured side by side on a GPU: issue 44's record (issue 19's rows before it).

Each part takes a ``device``: ``cuda`` is the record; ``--device cpu`` runs every part's code on
the CPU with small sizes, so the record's code is exercised without a GPU (those values mean
nothing: each row's note names its device). Under ``make bench`` (``benchmarks/run.py``) the part
runs only where CUDA is.

1. **padded** (issue 44 item 2): padded batches against one clip at a time, wav2vec2-base-sized
   (95M parameters, random weights from a config), bf16, 256 clips of 1-20 s: the code of
   ``bench_padded.py``, whose arms also time the build with each padded length warmed first, the
   padded lengths exact instead of stepped, and the guard off. Target: >= 2.5x.
2. **int8** (item 3): int8 ``[32, 200, 768]`` batches copied to the device and dequantised there
   (``featbake.quantize.dequantize``, one call a batch; one a row in the note) against fp16
   batches copied, each from pinned memory; then items/s of ``FeatureLoader(device=...)`` over
   an int8 store served packed (``dequantize=False``, dequantised on the device each batch) and
   served as fp16 (dequantised on the host), against the same items stored fp16. Reported.
3. **reads** (item 4): items/s of ``FeatureLoader(device=...)`` (pinned on its reader thread,
   copied ``non_blocking``) against ``DataLoader(num_workers=2 and 8, pin_memory=True)`` with
   the same copy, batches of 32 through ``pad_collate``, fp16 ``[T, 768]`` items (target: >= 5x
   the 2-worker one); then epoch time behind a probe's training step on the device
   (``loss.item()`` every step, as a loop that logs its loss does) against max(read-only,
   step-only), for the narrowest step that costs a read (its time mostly the host launching
   small kernels) and one 16 times wider (the device's time). Target: <= 1.2x.
4. **build** (item 5): ``featbake.build(device=...)`` of a wav2vec2-base-sized folder (fp16
   autocast, padded batches) against the loop a user writes: a DataLoader decoding on 4 workers,
   the model on each clip at batch 1 under the same autocast, each clip's features copied to
   the host (storing nothing). Target: <= 1.0x the time.
5. **ray** (item 5): a Ray build (``RayEngine(workers=1, gpus_per_worker=1)``, the API of
   ``build --engine ray --gpus-per-worker 1``) against the plain build on the same device, same
   clips, fresh stores; on the CPU ``gpus_per_worker=0``. Skipped, with a note, where ``ray`` is
   not importable (the GPU machine: its wheel is over what travels there; docs/benchmarks.md).

Every row carries ``item``, the issue-44 item it answers. A part that raises gives one row of
value NaN whose note holds the error (its traceback is printed), and the script exits 1.

Run: ``python benchmarks/bench_gpu.py [padded|int8|reads|build|ray ...] [--quick]
[--device cuda|cpu] [--json rows.json]``; the whole record, tests included, is
``benchmarks/gpu_record.sh``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_padded
from _rows import hidden_rows, row
from _serve_readers import identity_encoder
from bench_build import _PlainDecode
from bench_loader import BATCH, Probe, dataset, prepare

from featbake.bake.pipeline import build
from featbake.device import synchronize
from featbake.encode.sources import scan, source_for
from featbake.quantize import Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import FeatureLoader
from featbake.testing import write_audio_folder

WORK = Path(__file__).resolve().parent / "_work" / "gpu"
PARTS = ("padded", "int8", "reads", "build", "ray")
#: Issue 44's item each part answers.
ITEM = {"padded": "2", "int8": "3", "reads": "4", "build": "5", "ray": "5"}
#: FeatureLoader to the device against DataLoader(num_workers=2, pin_memory=True) (item 4).
READ_TARGET = 5.0
#: FeatureLoader behind a step against max(read-only, step-only) (item 4).
HIDDEN_TARGET = 1.2


@dataclass(frozen=True)
class Sizes:
    """How much each part runs: the record's sizes on a GPU, a smoke run's on a CPU."""

    build_clips: int  # part build: clips of 2-8 s
    build_rounds: int  # part build: best of
    read_items: int  # parts reads and int8: [T, 768] items
    read_epochs: int  # part reads: epochs timed (after one to start workers)
    max_hidden: int  # part reads: the widest probe tried
    copy_reps: int  # part int8: batches timed per arm
    model: str  # parts padded and build: bench_padded's model name
    padded_clips: int  # part padded: clips per arm (of 1-20 s; quick: 1-3 s)
    ray_clips: int  # part ray: clips of 2-8 s


#: The record on an H200 (all parts ~3-4 minutes); quick there; any device's smoke run.
FULL = Sizes(400, 3, 3000, 3, 1 << 16, 200, "hf-base", 256, 64)
QUICK = Sizes(40, 1, 256, 1, 1 << 16, 50, "hf-base", 8, 16)
CPU_QUICK = Sizes(3, 1, 32, 1, 512, 3, "hf-tiny", 2, 3)


def sizes_for(quick: bool, device: torch.device) -> Sizes:
    """The record's sizes, a quick run's on a GPU, or the smallest on a CPU."""
    if not quick:
        return FULL
    return QUICK if device.type == "cuda" else CPU_QUICK


def on(device: torch.device) -> str:
    """What a row's note says of where it ran."""
    if device.type == "cuda":
        return f"on {torch.cuda.get_device_name(device)}"
    return "on the CPU (a smoke run: the value means nothing)"


# -- padded (item 2) -------------------------------------------------------------------------------
def bench_padded_part(quick: bool, device: torch.device, sizes: Sizes) -> list[dict]:
    """bench_padded.py's arms on ``device``, bf16, with ``sizes.model`` (its rows, as item 2)."""
    rows = bench_padded.main(quick, device.type, "bf16", sizes.model, sizes.padded_clips)
    for r in rows:
        r["bench"] = "gpu"
        if not r["metric"].startswith("padded"):
            r["metric"] = f"padded arms: {r['metric']}"
        r["note"] = f"{r['note']}; {on(device)}".lstrip("; ")
    return rows


# -- int8 (item 3) ---------------------------------------------------------------------------------
def seconds_each(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls queued back to back, after one warm call."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / reps


def bench_copies(device: torch.device, sizes: Sizes) -> list[dict]:
    """Per batch: int8 copied and dequantised on the device (a call a batch, a call a row)
    against fp16 copied, each from pinned memory."""
    pinned = device.type == "cuda"
    x = torch.randn(BATCH, 200, 768, generator=torch.Generator().manual_seed(0))
    half = x.to(torch.float16).pin_memory() if pinned else x.to(torch.float16)
    packed = quantize(x, Scheme.INT8)
    packed = packed.pin_memory() if pinned else packed

    def int8_batch() -> torch.Tensor:
        return dequantize(packed.to(device, non_blocking=True), Scheme.INT8, torch.float16)

    def int8_rows() -> list[torch.Tensor]:
        on_device = packed.to(device, non_blocking=True)
        return [dequantize(r, Scheme.INT8, torch.float16) for r in on_device]

    fp16 = seconds_each(lambda: half.to(device, non_blocking=True), sizes.copy_reps, device)
    batch = seconds_each(int8_batch, sizes.copy_reps, device)
    rows_ = seconds_each(int8_rows, sizes.copy_reps, device)
    note = (
        f"[{BATCH}, 200, 768] per batch: fp16 copied {fp16 * 1e6:,.0f} us, int8 copied and "
        f"dequantised {batch * 1e6:,.0f} us (one call a batch), {rows_ * 1e6:,.0f} us (one a "
        f"row: {fp16 / rows_:.2f}x); mean of {sizes.copy_reps}; {on(device)}"
    )
    return [row("gpu", "int8 batch copied + dequantised on the device / fp16 batch copied",
                fp16 / batch, "x", "report", None, note)]  # fmt: skip


def int8_datasets(n: int) -> dict[str, CachedFeatureDataset]:
    """The same fp16 ``[T, 768]`` items stored fp16 and int8; the int8 served packed and as fp16."""
    base = prepare(n, "float16")
    rec = Recipe(source="npy", dtype="int8")
    store = base / "store-int8"
    build(base / "npy", identity_encoder(), cache=store, recipe=rec, workers=0)

    def int8(**kw: Any) -> CachedFeatureDataset:
        return CachedFeatureDataset(base / "npy", identity_encoder(), cache=store, recipe=rec, **kw)

    return {"fp16": dataset(base, "float16"), "int8 packed": int8(dequantize=False),
            "int8 as fp16": int8()}  # fmt: skip


def bench_int8_loader(device: torch.device, sizes: Sizes) -> list[dict]:
    """Items/s of FeatureLoader(device=...) over int8 (packed, dequantised on the device; and
    served as fp16) against fp16, interleaved epochs, best of three."""
    sets = int8_datasets(sizes.read_items)
    loaders = {name: FeatureLoader(ds, BATCH, seed=0, device=device) for name, ds in sets.items()}

    def epoch(name: str) -> float:
        if name != "int8 packed":
            return epoch_seconds(loaders[name], device)
        return epoch_seconds(loaders[name], device,
                             lambda b: dequantize(b[0], Scheme.INT8, torch.float16))  # fmt: skip

    best = {name: float("inf") for name in loaders}
    for _ in range(4):  # the first opens every shard and checks each item's CRC once
        for name in loaders:
            best[name] = min(best[name], epoch(name))
    rate = {name: sizes.read_items / s for name, s in best.items()}
    note = (
        f"{sizes.read_items} items [T, 768], batches of {BATCH} to the device; items/s: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in rate.items())
        + f"; best of 3 epochs; {on(device)}"
    )
    return [
        row("gpu", f"FeatureLoader(device) {name} / fp16", rate[name] / rate["fp16"], "x",
            "report", None, note)
        for name in ("int8 packed", "int8 as fp16")
    ]  # fmt: skip


# -- reads (item 4) --------------------------------------------------------------------------------
def to_device(loader: Iterable[Any], device: torch.device) -> Iterable[Any]:
    for padded, lengths in loader:
        yield padded.to(device, non_blocking=True), lengths.to(device, non_blocking=True)


def epoch_seconds(
    batches: Iterable[Any], device: torch.device, step: Callable[[Any], Any] | None = None
) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for batch in batches:
        if step is not None:
            step(batch)
    synchronize(device)
    return time.perf_counter() - t0


def readers(ds: Any, device: torch.device) -> dict[str, Callable[[], Iterable[Any]]]:
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "collate_fn": pad_collate}
    kw.update(pin_memory=device.type == "cuda", persistent_workers=True)
    loader = FeatureLoader(ds, BATCH, seed=0, device=device)
    w2 = DataLoader(ds, num_workers=2, **kw)
    w8 = DataLoader(ds, num_workers=8, **kw)
    return {
        "FeatureLoader": lambda: loader,
        "DataLoader w2": lambda: to_device(w2, device),
        "DataLoader w8": lambda: to_device(w8, device),
    }


def make_step(hidden: int, device: torch.device) -> Callable[[Any], None]:
    probe = Probe(hidden).to(device)
    opt = torch.optim.SGD(probe.parameters(), lr=1e-3)
    target = torch.zeros(BATCH, dtype=torch.long, device=device)

    def step(batch: Any) -> None:
        padded, lengths = batch
        mask = torch.arange(padded.shape[1], device=device)[None, :] < lengths[:, None]
        logits = (probe.net(padded.float()) * mask[..., None]).sum(1) / lengths[:, None]
        loss = nn.functional.cross_entropy(logits, target[: len(lengths)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()  # the host waits for the device, as a loop that logs its loss does

    return step


def step_seconds(batches: list[Any], hidden: int, device: torch.device) -> float:
    """A step-only epoch over batches already on the device, best of 2 (after a warm step)."""
    step = make_step(hidden, device)
    step(batches[0])  # warm: kernels, autograd, the optimizer's state
    return min(epoch_seconds(batches, device, step) for _ in range(2))


def bench_reads(device: torch.device, sizes: Sizes) -> list[dict]:
    ds = dataset(prepare(sizes.read_items, "float16"), "float16")
    made = readers(ds, device)
    best = {name: float("inf") for name in made}
    for _ in range(sizes.read_epochs + 1):  # the first starts workers and opens every shard
        for name, make in made.items():
            best[name] = min(best[name], epoch_seconds(make(), device))
    rates = {name: len(ds) / s for name, s in best.items()}
    note = (
        f"{len(ds)} items [T, 768] fp16 to the device, batches of {BATCH}; items/s: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
        + f"; {on(device)}"
    )
    rows = [
        row("gpu", f"FeatureLoader(device) / {name}", rates["FeatureLoader"] / rates[name], "x",
            f">= {READ_TARGET:g}x" if name.endswith("w2") else "",
            rates["FeatureLoader"] / rates[name] >= READ_TARGET if name.endswith("w2") else None,
            note)
        for name in made if name != "FeatureLoader"
    ]  # fmt: skip
    return rows + hidden_part(ds, made, best["FeatureLoader"], device, sizes)


def hidden_part(
    ds: Any, made: dict[str, Callable[[], Iterable[Any]]], read: float, device: torch.device,
    sizes: Sizes,
) -> list[dict]:  # fmt: skip
    """Epochs behind a step: the narrowest probe whose step-only epoch costs about a read-only
    one (its time mostly the host launching kernels, so it needs the CPU and the GIL as the
    reader does) and one 16x wider (the device's time: the host waits in ``loss.item()`` with
    the GIL released)."""
    batches = [(p.to(device), n.to(device)) for p, n in FeatureLoader(ds, BATCH, seed=1)]
    hidden = 256
    while step_seconds(batches, hidden, device) < 0.8 * read and hidden < sizes.max_hidden:
        hidden *= 2
    rows: list[dict] = []
    for width in (hidden, hidden * 16 if device.type == "cuda" else hidden * 2):
        step_only = step_seconds(batches, width, device)
        step = make_step(width, device)
        both = {name: min(epoch_seconds(make(), device, step) for _ in range(sizes.read_epochs))
                for name, make in made.items()}  # fmt: skip
        setup = (
            f"{len(ds)} items fp16, batches of {BATCH}; probe 768->{width}->8, backward, SGD, "
            "loss.item() each step"
        )
        rows += hidden_rows("gpu", f"step 768->{width}", read, step_only, both, setup)
    for r in rows:  # issue 44's target for these rows: <= 1.2x (hidden_rows says 1.1x)
        r["note"] += f"; {on(device)}"
        if r["target"]:
            r["target"], r["ok"] = f"<= {HIDDEN_TARGET:g}x", r["value"] <= HIDDEN_TARGET
    return rows


# -- build (item 5) --------------------------------------------------------------------------------
def model_folder(sizes: Sizes) -> Path:
    """The wav2vec2 folder of ``sizes.model`` (random weights from a config), kept in WORK."""
    return bench_padded.wav2vec2_folder(WORK / f"w2v2-{sizes.model}-ln",
                                        tiny=sizes.model == "hf-tiny")  # fmt: skip


def bare_loop(clips: Path, folder: Path, device: torch.device) -> float:
    """The user's loop: decode on 4 workers, one clip at a time through the model, to host."""
    from transformers import Wav2Vec2Model

    t0 = time.perf_counter()
    model = Wav2Vec2Model.from_pretrained(folder).eval().to(device)
    source = source_for(Recipe())
    paths = [str(clips / p) for p in scan(clips, source.extensions)]
    loader = DataLoader(_PlainDecode(paths, source), batch_size=None, num_workers=4)
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.float16):
        for _, x in loader:
            x = x.to(device, non_blocking=True)
            x = (x - x.mean()) / torch.sqrt(x.var() + 1e-7)
            model(x[None]).last_hidden_state[0].to(torch.float16).cpu()
    synchronize(device)
    return time.perf_counter() - t0


def clips_folder(n: int, seed: int = 9) -> Path:
    clips = WORK / f"clips-{n}-{seed}"
    if not clips.exists():
        write_audio_folder(clips.with_suffix(".part"), n, seconds=(2.0, 8.0), seed=seed)
        clips.with_suffix(".part").rename(clips)
    return clips


def bench_build(device: torch.device, sizes: Sizes) -> list[dict]:
    n = sizes.build_clips
    clips, folder = clips_folder(n), model_folder(sizes)
    recipe = Recipe(precision="fp16", dtype="float16", normalize=True)
    bare_loop(clips, folder, device)  # warm: CUDA context, cuDNN/cuBLAS autotuning, page cache
    bare, built, report = [], [], None
    for _ in range(sizes.build_rounds):
        bare.append(bare_loop(clips, folder, device))
        shutil.rmtree(WORK / "store", ignore_errors=True)
        t0 = time.perf_counter()
        report = build(clips, folder, cache=WORK / "store", recipe=recipe, device=str(device))
        built.append(time.perf_counter() - t0)
        assert report.ok and report.encoded == n, report.failed
    assert report is not None
    ratio = min(built) / min(bare)
    note = (
        f"{n} clips of 2-8 s, wav2vec2 {sizes.model} (layer norm), fp16 autocast; build "
        f"{min(built):.2f} s ({report.batching} batches) vs the user's loop (batch 1, 4 "
        f"decode workers) {min(bare):.2f} s; best of {len(bare)}; {on(device)}"
    )
    return [row("gpu", "build --device / the user's loop", ratio, "x", "<= 1.0x",
                ratio <= 1.0, note)]  # fmt: skip


# -- ray (item 5) ----------------------------------------------------------------------------------
RAY_METRIC = "Ray build (1 actor, --gpus-per-worker) / plain build, same device"


def bench_ray(device: torch.device, sizes: Sizes) -> list[dict]:
    """A Ray build with a GPU per actor against the plain build (fresh stores, same clips)."""
    try:
        import ray

        from featbake.bake.ray_engine import RayEngine
    except ImportError as e:
        note = (
            f"skipped: ray is not importable here ({e}); on the GPU machine its wheel (79 MB) "
            "is over what travels there (64 MiB): docs/benchmarks.md"
        )
        return [row("gpu", RAY_METRIC, math.nan, "x", "report", None, note)]
    gpus = 1 if device.type == "cuda" else 0
    clips, folder = clips_folder(sizes.ray_clips, seed=5), model_folder(sizes)
    recipe = Recipe(precision="fp16", dtype="float16", normalize=True)
    # Actors import featbake as a `ray start` cluster's workers would, from PYTHONPATH.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = path
    ray.init(num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    times: dict[str, float] = {}
    try:
        for name, engine in (("plain", None), ("ray", RayEngine(workers=1, gpus_per_worker=gpus))):
            store = WORK / f"ray-store-{name}"
            shutil.rmtree(store, ignore_errors=True)
            t0 = time.perf_counter()
            report = build(clips, folder, cache=store, recipe=recipe, device=str(device),
                           engine=engine)  # fmt: skip
            times[name] = time.perf_counter() - t0
            assert report.ok and report.encoded == sizes.ray_clips, report.failed
    finally:
        ray.shutdown()
    note = (
        f"{sizes.ray_clips} clips of 2-8 s, wav2vec2 {sizes.model}, fp16 autocast; plain "
        f"{times['plain']:.2f} s, Ray {times['ray']:.2f} s (a local instance already up; its "
        f"actor started, the encoder loaded in it, the merge); gpus_per_worker={gpus}; "
        f"{on(device)}"
    )
    return [row("gpu", RAY_METRIC, times["ray"] / times["plain"], "x", "report", None, note)]


# -- the parts -------------------------------------------------------------------------------------
def run_part(part: str, quick: bool, device: torch.device, sizes: Sizes) -> list[dict]:
    """One part's rows, each tagged with its issue-44 item; a part that raised gives one row of
    value NaN whose note says what it raised (the traceback printed)."""
    runs: dict[str, Callable[[], list[dict]]] = {
        "padded": lambda: bench_padded_part(quick, device, sizes),
        "int8": lambda: bench_copies(device, sizes) + bench_int8_loader(device, sizes),
        "reads": lambda: bench_reads(device, sizes),
        "build": lambda: bench_build(device, sizes),
        "ray": lambda: bench_ray(device, sizes),
    }
    try:
        rows = runs[part]()
    except Exception as e:
        traceback.print_exc()
        err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        rows = [row("gpu", f"{part}: failed", math.nan, "", "", False, f"{err}; {on(device)}")]
    for r in rows:
        r["item"] = ITEM[part]
    return rows


def main(
    quick: bool = False, device: str | None = None, parts: list[str] | None = None
) -> list[dict]:
    """The parts' rows on ``device`` (default: CUDA, where there is none: no rows); ``parts``
    default to those named on the command line (``run.py gpu reads``), else all."""
    if device is None and not torch.cuda.is_available():
        print("  bench_gpu: no CUDA device here; its rows need a GPU (--device cpu: a smoke run)")
        return []
    dev = torch.device(device or "cuda")
    if parts is None:
        parts = [a for a in sys.argv[1:] if a in PARTS] or list(PARTS)
    torch.backends.cudnn.benchmark = False
    WORK.mkdir(parents=True, exist_ok=True)
    sizes = sizes_for(quick, dev)
    rows: list[dict] = []
    for part in parts:
        t0 = time.perf_counter()
        rows += run_part(part, quick, dev, sizes)
        print(
            f"  bench_gpu: part {part} on {dev} took {time.perf_counter() - t0:.1f} s", flush=True
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        ok = "" if r["ok"] is None else (" ok" if r["ok"] else " NOT MET")
        target = f" (target {r['target']}{ok})" if r["target"] else ""
        print(f"[44.{r['item']}] {r['metric']}: {r['value']:.3f}{r['unit']}{target}  {r['note']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--device", help="cuda (default, where there is one) or cpu")
    parser.add_argument("--json", type=Path, help="also write the rows here (JSON)")
    args = parser.parse_args()
    if set(args.parts) - set(PARTS):
        parser.error(f"parts are {', '.join(PARTS)}; got {' '.join(args.parts)}")
    result = main(args.quick, args.device, list(args.parts) or list(PARTS))
    print_rows(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(1 if any(r["metric"].endswith(": failed") for r in result) else 0)
