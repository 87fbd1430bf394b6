"""Serving speed and memory: ``DataLoader(CachedFeatureDataset)`` against the plain readers.

Every ratio is measured side by side in one run, on the same data, with a warm page cache and a
shuffled order, for fp32 ``[T, 768]`` items (~600 KB) and fp16 ones (~430 KB), each written as
one ``.npy``, ``torch.save`` and safetensors file per item, as safetensors shards read through
``safe_open`` (a view into an mmap) and as a featbake store (see ``_serve_readers.py``).

The reader matrix (part ``readers``) covers the conditions users meet, not only the kind ones:

* the FIRST epoch of a FRESH dataset object (nothing opened, nothing checked; page cache warm)
  and a LATER epoch of a dataset reused across epochs;
* one item per step and batches of 32 through ``pad_collate``; ``num_workers`` 0 and 2;
* each reader ISOLATED in its own process, and all readers SHARING one process (they share the
  allocator, whose state one reader's churn moves for the others).

Rows: items/s per reader, featbake / the best per-file reader (the targets) and featbake / the
best plain reader including safetensors shards. Then a RAM-tier epoch against indexing a list;
"epoch 2" (all cached) against live encoding with a 6-layer, 256-wide transformer over 80-dim
log-mel frames; private memory (USS) of the main process and 4 workers with
``ram_cache="256MiB"`` over a long shuffled run.

Run: ``python benchmarks/bench_serve.py [--quick] [--parts readers,ram,e2e,memory] [--items N]``
(``--items``: another data size, e.g. to smoke-test the full mode's code paths); the quick
mode (small data, one epoch per cell) finishes in under a minute and is a smoke check only.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import (
    CELLS,
    DTYPES,
    FLOOR,
    READERS,
    WORK,
    Cell,
    InMemory,
    InMemoryCopies,
    NpyFiles,
    Reader,
    featbake_ds,
    make_reader,
    prepare,
)

from featbake.bake.pipeline import build
from featbake.recipe import Recipe
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import LogMelTransformer

BENCH = "serve"


# -- timing -------------------------------------------------------------------------------------
def epoch_seconds(make_loader: Callable[[], Iterable[Any]]) -> float:
    loader = make_loader()
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def compare(
    loaders: dict[str, Callable[[], Iterable[Any]]], n_items: int, repeats: int
) -> dict[str, float]:
    """items/s of each loader: one warm-up epoch each, then ``repeats`` alternating rounds.

    The median epoch of each is reported: this shared 2-core machine has noisy neighbours, and
    a median of alternating rounds keeps a ratio stable where a best-of flatters whoever got
    the one quiet moment.
    """
    for make in loaders.values():
        epoch_seconds(make)
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, make in loaders.items():
            times[name].append(epoch_seconds(make))
    return {name: n_items / float(np.median(t)) for name, t in times.items()}


def _loader(ds: Dataset, **kw: Any) -> Callable[[], DataLoader]:
    def make() -> DataLoader:
        return DataLoader(ds, shuffle=True, **kw)

    return make


def _row(
    metric: str, value: float, unit: str, target: str = "", ok: bool | None = None, note: str = ""
) -> dict[str, Any]:
    return row(BENCH, metric, value, unit, target, ok, note)


# -- the reader matrix --------------------------------------------------------------------------
class ReaderState:
    """The readers of one process: data per dtype, and datasets reused for later epochs."""

    def __init__(self, data: dict[str, dict[str, Any]], spawned: bool) -> None:
        self.data = data
        self.spawned = spawned
        self.reused: dict[tuple[str, str], Dataset] = {}
        self.construct_s: list[float] = []  # featbake: fresh CachedFeatureDataset() times

    def dataset(self, reader: str, cell: Cell) -> Dataset:
        if cell.fresh:
            t0 = time.perf_counter()
            ds = make_reader(reader, self.data[cell.dtype])
            if reader == "featbake":
                self.construct_s.append(time.perf_counter() - t0)
            return ds
        key = (reader, cell.dtype)
        if key not in self.reused:
            ds = self.reused[key] = make_reader(reader, self.data[cell.dtype])
            epoch_seconds(_loader(ds, batch_size=None))  # it is a later epoch from now on
        return self.reused[key]

    def epoch(self, reader: str, cell: Cell) -> float:
        ds = self.dataset(reader, cell)
        secs = epoch_seconds(_loader(ds, **cell.loader_kwargs(self.spawned)))
        if cell.fresh and isinstance(ds, CachedFeatureDataset):
            ds.close()
        return secs

    def warm_up(self, reader: str) -> None:
        """One untimed epoch of a few items: imports and first-call costs, not the data."""
        for data in self.data.values():
            ds = make_reader(reader, data)
            idx = list(range(min(8, len(ds))))
            for kw in ({"batch_size": None}, {"batch_size": 4, "collate_fn": pad_collate}):
                for _ in DataLoader(ds, sampler=idx, **kw):
                    pass
            if isinstance(ds, CachedFeatureDataset):
                ds.close()


def _reader_server(reader: str, data: dict[str, dict[str, Any]], conn: Any) -> None:
    """One reader in its own process: runs an epoch of the cell sent, replies its seconds."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    state = ReaderState(data, spawned=True)
    state.warm_up(reader)
    while (cell := conn.recv()) is not None:
        conn.send(state.epoch(reader, cell))
    conn.send(state.construct_s)


@contextlib.contextmanager
def _servers(readers: list[Reader], data: dict[str, dict[str, Any]], quick: bool):
    """A process per reader; yields reader name -> connection, and the construct times.

    Spawned, so each reader starts from a fresh interpreter and allocator, in quick mode too: a
    forked child whose parent already ran torch's OpenMP pool (the build benchmarks run first)
    hangs in its first parallel copy (GNU OpenMP is not fork-safe).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    for r in readers:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_reader_server, args=(r.name, data, child), daemon=False)
        proc.start()
        procs.append(proc)
        conns[r.name] = parent
    construct: list[float] = []
    try:
        yield conns, construct
    finally:
        for name, conn in conns.items():
            with contextlib.suppress(OSError, EOFError):
                conn.send(None)
                got = conn.recv()
                if name == "featbake":
                    construct.extend(got)
        for proc in procs:
            proc.join(timeout=60)


def cells(quick: bool) -> list[Cell]:
    """Every cell; the quick mode leaves out fp32 with workers (forking dominates its time)."""
    return [c for c in CELLS if not (quick and c.workers and c.dtype == "float32")]


def shared_cells(quick: bool) -> list[Cell]:
    """The cells run with all readers in one process; quick: without workers only."""
    return [c for c in cells(quick) if not (quick and c.workers)]


def _measure(
    run: Callable[[str, Cell], float],
    readers: list[Reader],
    n: int,
    todo: list[Cell],
    quick: bool,
) -> dict[Cell, dict[str, float]]:
    """items/s per cell and reader: the median of some epochs, alternating the readers."""
    repeats = 1 if quick else 5
    rates = {}
    for cell in todo:
        times: dict[str, list[float]] = {r.name: [] for r in readers}
        for _ in range(repeats):
            for r in readers:
                times[r.name].append(run(r.name, cell))
        rates[cell] = {name: n / float(np.median(t)) for name, t in times.items()}
    return rates


def _ratio_rows(placement: str, cell: Cell, rates: dict[str, float]) -> list[dict[str, Any]]:
    label = f"{cell.label} [{placement}]"
    rows = [
        _row(f"{label}: {r.label}", rates[r.name], "items/s")
        for r in (*READERS, FLOOR)
        if r.name in rates
    ]
    per_file = max((r for r in READERS if r.per_file), key=lambda r: rates[r.name])
    plain = max((r for r in READERS if r.name != "featbake"), key=lambda r: rates[r.name])
    fb = rates["featbake"]
    ratio = fb / rates[per_file.name]
    rows.append(
        _row(
            f"{label}: featbake / best per-file reader",
            ratio,
            "x",
            f">= {cell.target}x",
            ratio >= cell.target,
            f"best per-file reader here: {per_file.label}",
        )
    )
    rows.append(
        _row(
            f"{label}: featbake / best plain reader",
            fb / rates[plain.name],
            "x",
            "report",
            None,
            f"best plain reader here: {plain.label}",
        )
    )
    return rows


def bench_readers(data: dict[str, dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """The reader matrix, isolated (a process per reader) and shared (all in this process)."""
    n = len(data[DTYPES[0]]["npy"])
    readers = list(READERS) if quick else [*READERS, FLOOR]
    rows = []
    with _servers(readers, data, quick) as (conns, construct):

        def remote(reader: str, cell: Cell) -> float:
            conns[reader].send(cell)
            return conns[reader].recv()

        isolated = _measure(remote, readers, n, cells(quick), quick)
    shared_state = ReaderState(data, spawned=False)
    for r in READERS:
        shared_state.warm_up(r.name)
    shared = _measure(shared_state.epoch, list(READERS), n, shared_cells(quick), quick)
    for placement, rates in (("isolated", isolated), ("shared process", shared)):
        for cell, cell_rates in rates.items():
            rows += _ratio_rows(placement, cell, cell_rates)
    times = construct + shared_state.construct_s
    if times:
        rows.append(
            _row(
                "featbake: CachedFeatureDataset() construction (not in the epoch times)",
                float(np.median(times)) * 1000,
                "ms",
                note=f"median of {len(times)} fresh datasets of {n} items",
            )
        )
    return rows


def bench_ram_tier(data: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    """A RAM-tier epoch (fp16 items, all cached) against indexing a list of the same tensors,
    handing out a copy of each (as a hit does: the caller's own) and the tensors themselves."""
    n = len(data["npy"])
    fb = featbake_ds(data, ram_cache="4GiB")
    for i in range(n):  # fill the RAM tier
        fb[i]
    tensors = [fb[i] for i in range(n)]
    loaders = {
        "list": _loader(InMemory(tensors), batch_size=None),
        "list, copies": _loader(InMemoryCopies(tensors), batch_size=None),
        "featbake RAM tier": _loader(fb, batch_size=None),
    }
    rates = compare(loaders, n, 3 if quick else 5)
    info = fb.cache_info()
    ratio = rates["list, copies"] / rates["featbake RAM tier"]
    return [
        _row("RAM-tier epoch: list of tensors", rates["list"], "items/s"),
        _row("RAM-tier epoch: list of tensors, a copy of each", rates["list, copies"], "items/s"),
        _row(
            "RAM-tier epoch: featbake",
            rates["featbake RAM tier"],
            "items/s",
            note=f"RAM hits {info.hits}, misses {info.misses}",
        ),
        _row(
            "RAM-tier epoch: slowdown vs list of copies",
            ratio,
            "x",
            "<= 2x",
            ratio <= 2.0,
            "1 item/step, workers=0; a hit serves a copy the caller owns, as the list does",
        ),
        _row(
            "RAM-tier epoch: slowdown vs list of the tensors themselves",
            rates["list"] / rates["featbake RAM tier"],
            "x",
            note="the list hands out its own tensors (an in-place edit changes later reads)",
        ),
    ]


def bench_end_to_end(quick: bool) -> list[dict[str, Any]]:
    """Epoch 2 (all cached) against live encoding with a mid-size encoder, batches of 16."""
    n = 16 if quick else 160
    base = WORK / f"e2e{n}"
    mel_dir, store = base / "mels", base / "store"
    encoder = LogMelTransformer().eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    recipe = Recipe(source="npy", dtype="float16")
    if not (base / "ready").exists():
        shutil.rmtree(base, ignore_errors=True)
        mel_dir.mkdir(parents=True)
        rng = np.random.default_rng(2)
        for i, t in enumerate(rng.integers(200, 401, size=n)):
            np.save(mel_dir / f"utt{i:05d}.npy", rng.standard_normal((t, 80), dtype=np.float32))
        (base / "ready").write_text("ok")
    # Always: a no-op when the store is complete, and a fresh bake when featbake's fingerprint
    # definition changed since the data was made (old keys then simply miss).
    build(mel_dir, encoder, cache=store, recipe=recipe, workers=0, batch_size=16)
    mel_paths = sorted(str(p) for p in mel_dir.glob("*.npy"))
    live = DataLoader(NpyFiles(mel_paths), batch_size=16, shuffle=True, collate_fn=pad_collate)

    def live_epoch() -> None:
        with torch.inference_mode():
            for padded, _ in live:
                encoder(padded)

    ds = CachedFeatureDataset(mel_dir, encoder, cache=store, recipe=recipe, on_miss="error")
    cached = DataLoader(ds, batch_size=16, shuffle=True, collate_fn=pad_collate)
    t0 = time.perf_counter()
    live_epoch()
    t_live = time.perf_counter() - t0
    t_cached = min(epoch_seconds(lambda: cached) for _ in range(5))
    return [
        _row(
            "end to end: live encoding epoch",
            n / t_live,
            "items/s",
            note="LogMelTransformer (6 layers, width 256) on the CPU, batches of 16",
        ),
        _row("end to end: featbake epoch 2 (all cached)", n / t_cached, "items/s"),
        _row("end to end: epoch-2 speedup", t_live / t_cached, "x", "report", None),
    ]


# -- memory ---------------------------------------------------------------------------------------
def _uss_tree(pid: int) -> tuple[int, int]:
    """(USS of the process and its children, number of processes)."""
    import psutil

    proc = psutil.Process(pid)
    total, count = 0, 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().uss
            count += 1
        except psutil.Error:
            pass
    return total, count


def _run_memory(data: dict[str, Any], ram_cache: str, epochs: int) -> list[tuple[int, int]]:
    ds = featbake_ds(data, ram_cache=ram_cache)
    loader = DataLoader(
        ds,
        batch_size=32,
        shuffle=True,
        num_workers=4,
        collate_fn=pad_collate,
        persistent_workers=True,
    )
    peaks: list[tuple[int, int]] = []
    stop = threading.Event()
    peak = [0, 0]

    def sample() -> None:
        while not stop.is_set():
            uss, count = _uss_tree(os.getpid())
            if uss > peak[0]:
                peak[:] = [uss, count]
            time.sleep(0.05)

    for _ in range(epochs):
        peak[:] = [0, 0]
        stop.clear()
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        for _batch in loader:
            pass
        stop.set()
        t.join()
        peaks.append((peak[0], peak[1]))
    del loader
    gc.collect()
    return peaks


def _memory_in_fresh_process(n: int, ram_cache: str, epochs: int) -> list[int]:
    """Peaks of one run, measured in a new interpreter.

    Forked workers inherit the parent's heap: memory the earlier benchmarks freed but glibc kept
    would be copied page by page as workers reuse it, and read as growth. A fresh process
    measures the dataset alone, as a training script that builds its loader early would see it.
    """
    import subprocess

    code = (
        f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import bench_serve as b; "
        f"d = b.prepare({n}, 'float16'); "
        f"print(json.dumps([c for c, _ in b._run_memory(d, {ram_cache!r}, {epochs})]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(data: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    epochs = 3 if quick else 6
    n = len(data["npy"])
    budget = 256 * 1024 * 1024
    base = _memory_in_fresh_process(n, "0", epochs)
    cached = _memory_in_fresh_process(n, "256MiB", epochs)
    mib = 1024 * 1024
    overhead = max(base)
    peak = max(cached)
    growth = cached[-1] - cached[1 if len(cached) > 2 else 0]
    feature_bytes = sum(os.path.getsize(p) - 128 for p in data["npy"])
    return [
        _row(
            "memory: USS main+4 workers, ram_cache=0 (fixed overhead)",
            overhead / mib,
            "MiB",
            note=f"peak over {epochs} shuffled epochs, batches of 32, persistent workers",
        ),
        _row(
            "memory: USS main+4 workers, ram_cache=256MiB",
            peak / mib,
            "MiB",
            f"<= overhead + 256 MiB = {(overhead + budget) / mib:.0f}",
            peak <= overhead + budget,
            f"features total {feature_bytes / mib:.0f} MiB; per-epoch peaks "
            + ", ".join(f"{c / mib:.0f}" for c in cached),
        ),
        _row(
            "memory: growth from epoch 2 to the last",
            growth / mib,
            "MiB",
            "~0 (no leak)" if not quick else "report",
            growth < 32 * mib if not quick else None,
            "quick: the data fits the budget, so the tier is still filling" if quick else "",
        ),
    ]


PARTS = ("readers", "ram", "e2e", "memory")
QUICK_ITEMS = 48


def main(
    quick: bool = False, parts: Iterable[str] = PARTS, items: int | None = None
) -> list[dict[str, Any]]:
    """Run the serving benchmarks (all ``PARTS`` by default); returns the rows."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    n = items or (QUICK_ITEMS if quick else 1400)
    data = {dtype: prepare(n, dtype) for dtype in DTYPES}
    parts = set(parts)
    rows = []
    if "readers" in parts:
        rows += bench_readers(data, quick)
    if "ram" in parts:
        rows += bench_ram_tier(data["float16"], quick)
    if "e2e" in parts:
        rows += bench_end_to_end(quick)
    if "memory" in parts:
        rows += bench_memory(data["float16"], quick)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["metric"]) for r in rows)
    for r in rows:
        ok = "" if r["ok"] is None else ("ok" if r["ok"] else "MISS")
        print(
            f"{r['metric']:<{width}}  {r['value']:>10.2f} {r['unit']:<8} {r['target']:<24} "
            f"{ok:<4} {r['note']}"
        )


def _print_ratios(rows: list[dict[str, Any]]) -> None:
    """The featbake / best reader ratios alone, one line per cell, after the full table."""
    print("\nfeatbake / best per-file reader (target) | featbake / best plain reader")
    ratios: dict[str, dict[str, float]] = {}
    marks: dict[str, str] = {}
    for r in rows:
        cell, _, what = r["metric"].rpartition(": featbake / best ")
        if cell:
            ratios.setdefault(cell, {})[what] = r["value"]
            if r["ok"] is not None:
                marks[cell] = f"{r['target']:<8} {'ok' if r['ok'] else 'MISS'}"
    width = max((len(c) for c in ratios), default=0)
    for cell, got in ratios.items():
        print(
            f"{cell:<{width}}  {got.get('per-file reader', 0):6.2f}x {marks.get(cell, ''):<13} "
            f"{got.get('plain reader', 0):6.2f}x"
        )


if __name__ == "__main__":
    # python benchmarks/bench_serve.py [--quick] [--parts readers,ram,e2e,memory] [--items N]
    args = sys.argv[1:]
    chosen = args[args.index("--parts") + 1].split(",") if "--parts" in args else PARTS
    items = int(args[args.index("--items") + 1]) if "--items" in args else None
    results = main(quick="--quick" in args, parts=chosen, items=items)
    _print(results)
    _print_ratios(results)
