"""The CUDA paths, measured side by side on a GPU (issue 19; skipped without one).

1. **Build on the GPU**: ``featbake.build(device="cuda")`` of a wav2vec2-base-sized model
   (random weights, layer-norm variant so padded batches apply, fp16 autocast) against the loop
   a user writes: a DataLoader decoding on 4 workers, the model on each clip at batch 1 under
   the same autocast, each clip's features copied back to the host (storing nothing).
2. **Reads to the GPU**: items/s of ``FeatureLoader(device="cuda")`` (pinned on its reader
   thread, copied ``non_blocking``) against ``DataLoader(num_workers=2 and 8, pin_memory=True)``
   with the same copy, batches of 32 through ``pad_collate``, fp16 ``[T, 768]`` items.
3. **Reads hidden behind a GPU step**: a probe's training step on the GPU (``loss.item()`` every
   step, as a loop that logs its loss does, so the host waits for the GPU) sized to cost about
   what reading a batch costs. Epoch time with the loader against the larger of read-only and
   step-only. Target (issue 19): <= 1.1x.

Run: ``python benchmarks/bench_gpu.py [reads|build] [--quick]``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import hidden_rows, row
from bench_build import _PlainDecode
from bench_loader import BATCH, Probe, dataset, prepare

from featbake.bake.pipeline import build
from featbake.encode.sources import scan, source_for
from featbake.recipe import Recipe
from featbake.serve.collate import pad_collate
from featbake.serve.loader import FeatureLoader
from featbake.testing import write_audio_folder

WORK = Path(__file__).resolve().parent / "_work" / "gpu"
CUDA = torch.device("cuda")


def model_folder() -> Path:
    """A wav2vec2-base-sized model (95M parameters, random weights) whose padding is exact."""
    folder = WORK / "w2v2-base-ln"
    if not (folder / "config.json").exists():
        from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

        torch.manual_seed(0)
        config = Wav2Vec2Config(feat_extract_norm="layer", do_stable_layer_norm=True)
        Wav2Vec2Model(config).eval().save_pretrained(folder)
        Wav2Vec2FeatureExtractor(return_attention_mask=True, do_normalize=True).save_pretrained(
            folder
        )
    return folder


def bare_loop(clips: Path, folder: Path) -> float:
    """The user's loop: decode on 4 workers, one clip at a time through the model, to host."""
    from transformers import Wav2Vec2Model

    t0 = time.perf_counter()
    model = Wav2Vec2Model.from_pretrained(folder).eval().to(CUDA)
    source = source_for(Recipe())
    paths = [str(clips / p) for p in scan(clips, source.extensions)]
    loader = DataLoader(_PlainDecode(paths, source), batch_size=None, num_workers=4)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        for _, x in loader:
            x = x.to(CUDA, non_blocking=True)
            x = (x - x.mean()) / torch.sqrt(x.var() + 1e-7)
            model(x[None]).last_hidden_state[0].to(torch.float16).cpu()
    return time.perf_counter() - t0


def bench_build(quick: bool) -> list[dict]:
    n = 40 if quick else 400
    clips = WORK / f"clips-{n}"
    if not clips.exists():
        write_audio_folder(clips, n, seconds=(2.0, 8.0), seed=9)
    folder = model_folder()
    recipe = Recipe(precision="fp16", dtype="float16", normalize=True)
    bare_loop(clips, folder)  # warm: CUDA context, cuDNN/cuBLAS autotuning, page cache
    bare, built, report = [], [], None
    for _ in range(1 if quick else 3):
        bare.append(bare_loop(clips, folder))
        shutil.rmtree(WORK / "store", ignore_errors=True)
        t0 = time.perf_counter()
        report = build(clips, folder, cache=WORK / "store", recipe=recipe, device="cuda")
        built.append(time.perf_counter() - t0)
        assert report.ok and report.encoded == n, report.failed
    assert report is not None
    ratio = min(built) / min(bare)
    note = (
        f"{n} clips of 2-8 s, wav2vec2-base-sized (layer norm), fp16 autocast, GPU; build "
        f"{min(built):.2f} s ({report.batching.value} batches) vs the user's loop (batch 1, 4 "
        f"decode workers) {min(bare):.2f} s; best of {len(bare)}"
    )
    return [row("gpu", "build --device cuda / the user's loop", ratio, "x", "<= 1.0x",
                ratio <= 1.0, note)]  # fmt: skip


def to_cuda(loader: Iterable[Any]) -> Iterable[Any]:
    for padded, lengths in loader:
        yield padded.to(CUDA, non_blocking=True), lengths.to(CUDA, non_blocking=True)


def epoch_seconds(batches: Iterable[Any], step: Callable[[Any], None] | None = None) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in batches:
        if step is not None:
            step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def readers(ds: Any) -> dict[str, Callable[[], Iterable[Any]]]:
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "collate_fn": pad_collate}
    kw.update(pin_memory=True, persistent_workers=True)
    loader = FeatureLoader(ds, BATCH, seed=0, device="cuda")
    w2 = DataLoader(ds, num_workers=2, **kw)
    w8 = DataLoader(ds, num_workers=8, **kw)
    return {
        "FeatureLoader": lambda: loader,
        "DataLoader w2": lambda: to_cuda(w2),
        "DataLoader w8": lambda: to_cuda(w8),
    }


def make_step(hidden: int) -> Callable[[Any], None]:
    probe = Probe(hidden).to(CUDA)
    opt = torch.optim.SGD(probe.parameters(), lr=1e-3)
    target = torch.zeros(BATCH, dtype=torch.long, device=CUDA)

    def step(batch: Any) -> None:
        padded, lengths = batch
        mask = torch.arange(padded.shape[1], device=CUDA)[None, :] < lengths[:, None]
        logits = (probe.net(padded.float()) * mask[..., None]).sum(1) / lengths[:, None]
        loss = nn.functional.cross_entropy(logits, target[: len(lengths)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()  # the host waits for the GPU, as a loop that logs its loss does

    return step


def bench_reads(quick: bool) -> list[dict]:
    n, epochs = (256, 1) if quick else (3000, 3)
    ds = dataset(prepare(n, "float16"), "float16")
    made = readers(ds)
    best = {name: float("inf") for name in made}
    for _ in range(epochs + 1):  # the first starts workers and opens every shard
        for name, make in made.items():
            best[name] = min(best[name], epoch_seconds(make()))
    rates = {name: len(ds) / s for name, s in best.items()}
    note = f"{len(ds)} items [T, 768] fp16 to the GPU, batches of {BATCH}; items/s: " + ", ".join(
        f"{k} {v:,.0f}" for k, v in rates.items()
    )
    rows = [
        row("gpu", f"FeatureLoader(device=cuda) / {name}", rates["FeatureLoader"] / rates[name],
            "x", ">= 3x" if name.endswith("w2") else "",
            rates["FeatureLoader"] / rates[name] >= 3 if name.endswith("w2") else None, note)
        for name in made if name != "FeatureLoader"
    ]  # fmt: skip
    read = best["FeatureLoader"]
    batches = [(p.to(CUDA), n_.to(CUDA)) for p, n_ in FeatureLoader(ds, BATCH, seed=1)]
    hidden, step_only = 256, 0.0
    while True:  # widen the probe until a step-only epoch costs about a read-only one
        step_only = step_seconds(batches, hidden)
        if step_only >= 0.8 * read or hidden >= 1 << 16:
            break
        hidden *= 2
    # Two steps: the narrowest that costs a read (its time is mostly the host launching
    # kernels, so it needs the CPU and the GIL as the reader does) and one 16x wider (the GPU's
    # time: the host waits in loss.item() with the GIL released).
    for width in (hidden, hidden * 16):
        step_only = step_seconds(batches, width)
        step = make_step(width)
        both = {name: min(epoch_seconds(make(), step) for _ in range(epochs))
                for name, make in made.items()}  # fmt: skip
        setup = (
            f"{len(ds)} items fp16, batches of {BATCH}; probe 768->{width}->8 on the GPU, "
            "backward, SGD, loss.item() each step"
        )
        rows += hidden_rows("gpu", f"GPU step 768->{width}", read, step_only, both, setup)
    return rows


def step_seconds(batches: list[Any], hidden: int) -> float:
    """A step-only epoch over batches already on the GPU, best of 2 (after a warm step)."""
    step = make_step(hidden)
    step(batches[0])  # warm: kernels, autograd, the optimizer's state
    return min(epoch_seconds(batches, step) for _ in range(2))


def main(quick: bool = False) -> list[dict]:
    if not torch.cuda.is_available():
        print("  bench_gpu: no CUDA device here; its rows need a GPU (docs/benchmarks.md)")
        return []
    torch.backends.cudnn.benchmark = False
    parts = [a for a in sys.argv[1:] if a in ("reads", "build")] or ["reads", "build"]
    return (bench_reads(quick) if "reads" in parts else []) + (
        bench_build(quick) if "build" in parts else []
    )


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
