"""``FeatureLoader`` against ``DataLoader`` with worker processes (issue 19, item 2).

Over one featbake store (``[T, 768]`` items, fp16 ~430 KB and fp32 ~600 KB, shuffled, batches
of 32 through ``pad_collate``, page cache warm), measured side by side in one run:

1. **Read rate**: items/s of ``FeatureLoader(ds, 32)`` against ``DataLoader(ds, 32,
   num_workers=2, persistent_workers=True, collate_fn=pad_collate)`` and against the same with
   ``num_workers=0``; a later epoch of datasets reused across epochs (the workers started).
   Targets (issue 42): >= 5x the DataLoader with 2 workers, >= 1x the one reading in-line.
   The loader's default reads a read-only loop's batches in the loop (``reads_on="auto"``,
   :mod:`featbake.pace`); ``reads_on="thread"`` (the reader thread throughout) is reported too.
2. **Reads hidden behind the step**: a small probe's training step (two linear layers over
   every frame, backward, SGD) that costs about as much as reading its batch. Epoch time of
   loader + step against the larger of read-only and step-only time. Target: <= 1.1x (with
   the step on every core, against read + step: no core is left to hide the reads on). With
   the step on 1 thread, FeatureLoader is measured again on the pure-Python read path
   (``featbake.native.fallback()``: the GIL taken once per row, not once per batch). Each
   row's note also gives the CPU seconds of every thread: on a machine shared with other work
   the wall-clock ratio follows the load, while CPU(loader + step) against CPU(read) +
   CPU(step) says what reading beside the step costs (page faults, contention).

Run: ``python benchmarks/bench_loader.py [--quick]``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import paired_hidden_rows, row
from _serve_readers import DIM, LENGTHS, identity_encoder, recipe, warm_page_cache

from featbake import native
from featbake.bake.pipeline import build
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import FeatureLoader

WORK = Path(__file__).resolve().parent / "_work" / "loader"
BATCH = 32


def prepare(n: int, dtype: str) -> Path:
    """A store of ``n`` random ``[T, 768]`` items baked from .npy files (kept across runs)."""
    base = WORK / f"{dtype}-n{n}"
    if not (base / "ready").exists():
        shutil.rmtree(base, ignore_errors=True)
        (base / "npy").mkdir(parents=True)
        rng = np.random.default_rng(3)
        lo, hi = LENGTHS[dtype]
        for i, t in enumerate(rng.integers(lo, hi, size=n)):
            arr = rng.standard_normal((int(t), DIM), dtype=np.float32).astype(dtype)
            np.save(base / "npy" / f"item{i:05d}.npy", arr)
        (base / "ready").touch()
    build(base / "npy", identity_encoder(), cache=base / "store", recipe=recipe(dtype), workers=0)
    warm_page_cache(base / "store")
    return base


def dataset(base: Path, dtype: str) -> CachedFeatureDataset:
    store, rec = base / "store", recipe(dtype)
    ds = CachedFeatureDataset(base / "npy", identity_encoder(), cache=store, recipe=rec)
    assert ds.stored() == len(ds)
    return ds


class Probe(nn.Module):
    """A frame-wise probe: 768 -> hidden -> 8 classes, mean-pooled over valid frames."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, 8))

    def forward(self, padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
        logits = self.net(padded.float()) * mask[..., None]
        return logits.sum(1) / lengths[:, None]


def make_step(hidden: int) -> Callable[[Any], None]:
    probe = Probe(hidden)
    opt = torch.optim.SGD(probe.parameters(), lr=1e-3)
    target = torch.zeros(BATCH, dtype=torch.long)

    def step(batch: Any) -> None:
        padded, lengths = batch
        loss = nn.functional.cross_entropy(probe(padded, lengths), target[: len(lengths)])
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def epoch_seconds(loader: Iterable[Any], step: Callable[[Any], None] | None = None) -> float:
    return epoch_times(loader, step)[0]


def epoch_times(
    loader: Iterable[Any], step: Callable[[Any], None] | None = None
) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of this process) of one epoch: on a machine shared
    with other work the CPU seconds say what the reads cost the step, where the wall does not."""
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in loader:
        if step is not None:
            step(batch)
    return time.perf_counter() - t0, time.process_time() - c0


def loaders(ds: CachedFeatureDataset) -> dict[str, Iterable[Any]]:
    """The readers compared, each reused across epochs (workers started once)."""
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "collate_fn": pad_collate}
    return {
        "FeatureLoader": FeatureLoader(ds, BATCH, seed=0),
        "DataLoader w2": DataLoader(ds, num_workers=2, persistent_workers=True, **kw),
        "DataLoader w0": DataLoader(ds, num_workers=0, **kw),
    }


def bench_rates(base: Path, dtype: str, epochs: int) -> list[dict]:
    ds = dataset(base, dtype)
    readers = loaders(ds)
    # The loader's default moves a read-only loop's reads into the loop (featbake.pace): the
    # reader thread's own rate is measured too.
    readers["FeatureLoader thread"] = FeatureLoader(ds, BATCH, seed=0, reads_on="thread")
    best = {name: float("inf") for name in readers}
    for _ in range(epochs + 1):  # the first epoch starts workers and opens shards: not counted
        for name, loader in readers.items():
            best[name] = min(best[name], epoch_seconds(loader))
    rates = {name: len(ds) / s for name, s in best.items()}
    note = (
        f"{len(ds)} items [T, {DIM}] {dtype}, shuffled, batches of {BATCH} (pad_collate), warm "
        f"page cache, 2 CPUs; best later epoch of {epochs}; items/s: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
    )
    ratio = rates["FeatureLoader"] / rates["DataLoader w2"]
    inline = rates["FeatureLoader"] / rates["DataLoader w0"]
    thread = rates["FeatureLoader thread"] / rates["DataLoader w0"]
    return [
        row("loader", f"{dtype}: FeatureLoader / DataLoader(num_workers=2)", ratio, "x", ">= 5x",
            ratio >= 5, note),
        row("loader", f"{dtype}: FeatureLoader / DataLoader(num_workers=0)", inline, "x",
            ">= 1x", inline >= 1, note),
        row("loader", f"{dtype}: FeatureLoader(reads_on='thread') / DataLoader(num_workers=0)",
            thread, "x", "report", note=note),
    ]  # fmt: skip


def bench_hidden(base: Path, dtype: str, epochs: int) -> list[dict]:
    """Loader + step against max(read-only, step-only), the step sized to cost about a read.

    Measured twice: the step on torch's 2 threads (every core: the reads can only take turns
    with it, so the floor is nearer read + step than max(read, step)), and on 1 thread, which
    leaves a core to the reader, as a CPU-only trainer would set ``torch.set_num_threads``.
    Each row is the median of paired rounds (:func:`paired_hidden_rows`): a read-only epoch, a
    step-only one and each loader with the step, one after the other.
    """
    ds = dataset(base, dtype)
    reader = FeatureLoader(ds, BATCH, seed=0)  # read-only epochs only (its pace: in the loop)
    epoch_seconds(reader)  # open and check every shard once
    read = sorted(epoch_seconds(reader) for _ in range(3))[1]
    batches = list(FeatureLoader(ds, BATCH, seed=1))
    rows = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        step, hidden = sized_step(batches, read)
        where = "step on every core" if threads == 2 else "step on 1 thread, a core free"
        setup = (
            f"{len(ds)} items {dtype}, batches of {BATCH}; probe 768->{hidden}->8 with backward "
            f"and SGD on {threads} torch thread(s), 2 CPUs"
        )
        readers = {k: v for k, v in loaders(ds).items() if k != "DataLoader w0"}
        for loader_ in readers.values():
            epoch_seconds(loader_, step)  # workers started, the loader's pace set by the step
        rounds = [paired_round(reader, batches, step, readers) for _ in range(epochs)]
        rows += paired_hidden_rows("loader", f"{dtype}, {where}", rounds, setup,
                                   core_free=threads == 1)  # fmt: skip
        if threads == 1:  # the Python read path (no compiled kernels): the GIL once per row
            with native.fallback():
                python = {"FeatureLoader": readers["FeatureLoader"]}
                rounds = [paired_round(reader, batches, step, python) for _ in range(epochs)]
            rows += paired_hidden_rows("loader", f"{dtype}, {where}, Python read path", rounds,
                                       setup)  # fmt: skip
    torch.set_num_threads(2)
    return rows


def sized_step(batches: list[Any], read: float) -> tuple[Callable[[Any], None], int]:
    """The probe's step, widened until a step-only epoch costs about a read-only one (or at
    4,096 wide); and its width."""
    hidden = 16
    while True:
        step = make_step(hidden)
        step(batches[0])  # warm: autograd and the optimizer's state
        if min(epoch_seconds(batches, step) for _ in range(2)) >= 0.8 * read or hidden >= 4096:
            return step, hidden
        hidden *= 2


def paired_round(
    reader: Iterable[Any],
    batches: list[Any],
    step: Callable[[Any], None],
    loaders_: dict[str, Iterable[Any]],
) -> dict[str, float]:
    """One round: a read-only epoch, a step-only epoch, then each loader with the step."""
    out = {"read": epoch_seconds(reader), "step": epoch_seconds(batches, step)}
    for name, loader_ in loaders_.items():
        out[name] = epoch_seconds(loader_, step)
    return out


def main(quick: bool = False) -> list[dict]:
    torch.set_num_threads(2)
    n, epochs = (96, 1) if quick else (1000, 5)
    rows = []
    for dtype in ("float16", "float32"):
        base = prepare(n, dtype)
        rows += bench_rates(base, dtype, epochs)
        rows += bench_hidden(base, dtype, epochs)
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
