"""One item per step against the peers (issue 42 item 3): featbake against safetensors shards
read through ``safe_open`` (views of a private mmap of each shard), the same items in both.

The conditions are the ones a training script over precomputed features meets: fp16
``[T, 768]`` items of ~430 KB, a global shuffle, ``DataLoader(ds, batch_size=None)`` (one item
per step), ``num_workers`` 0 and 2, and a **fresh process per epoch** (a job restarted, or a
script run once per epoch): nothing is open or checked when the epoch starts, so featbake
checks every item's CRC on its read, once in that process, as it does for any first read. Each
step reads one element per 4 KiB page of its item (what a step at least does: a reader that
hands out views of a mapping pays its page faults there). Warm: the files of both readers in
the page cache; cold: dropped (``posix_fadvise(DONTNEED)``) before each epoch.

Each epoch runs in a new interpreter that builds its reader (not timed: the construction is
reported apart), then times the epoch; the readers alternate, and each cell reports the median
of its rounds. litdata's chunk-wise reader is not in this harness yet: a line says so.

Run: ``python benchmarks/bench_peers.py [--quick]`` (quick: 400 items, 3 rounds; full: 1,400
items, 3 rounds).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import (
    DIM,
    SafetensorsShards,
    identity_encoder,
    prepare_items,
    recipe,
    touch,
    warm_page_cache,
)

from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import drop_page_cache

WORK = Path(__file__).resolve().parent / "_work" / "peers"
BENCH = "peers"
DTYPE = "float16"
READERS = ("stshards", "featbake")
LABELS = {
    "stshards": "safetensors shards via safe_open (mmap'd views)",
    "featbake": "featbake CachedFeatureDataset",
}


def prepare(n: int) -> Path:
    """``n`` fp16 items as .npy files, baked into a featbake store and written as safetensors
    shards of up to 256 MiB in the same order; kept across runs (``benchmarks/_work/peers``)."""
    return prepare_items(WORK / f"{DTYPE}-n{n}", n, DTYPE, seed=7)


def make(reader: str, base: Path) -> Any:
    if reader == "stshards":
        index = [tuple(x) for x in json.loads((base / "index.json").read_text())]
        return SafetensorsShards(index)  # type: ignore[arg-type]
    return CachedFeatureDataset(
        base / "npy", identity_encoder(), cache=base / "store", recipe=recipe(DTYPE),
        on_miss="error",
    )  # fmt: skip


def one_epoch(reader: str, base: Path, workers: int, seed: int) -> dict[str, float]:
    """One epoch in this (fresh) process: seconds to build the reader, and to read the epoch."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    ds = make(reader, base)
    t1 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    for item in DataLoader(ds, batch_size=None, shuffle=True, num_workers=workers, generator=g):
        touch(item)
    return {"construct": t1 - t0, "epoch": time.perf_counter() - t1}


def run_fresh(reader: str, base: Path, workers: int, cold: bool, seed: int) -> dict[str, float]:
    """:func:`one_epoch` in a new interpreter (after dropping both stores' pages when cold)."""
    if cold:
        drop_page_cache(base / "store", base / "shards")
    else:  # both readers' files in the same page-cache state (see warm_page_cache)
        warm_page_cache(base / "store")
        warm_page_cache(base / "shards")
    code = (
        f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from pathlib import Path; import bench_peers as b; "
        f"print(json.dumps(b.one_epoch({reader!r}, Path({str(base)!r}), {workers}, {seed})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def litdata_missing() -> str:
    """Why litdata's column is not in the table (a line, as bench_bucket.py says it)."""
    try:
        import litdata  # noqa: F401
    except ImportError:
        return "litdata is not installed: its column is skipped"
    return "litdata's chunk-wise reader is not in this harness yet (bench_bucket.py reads it)"


def measure(base: Path, n: int, rounds: int, cells: list[tuple[bool, int]]) -> list[dict]:
    """Rows of every cell (cold, workers): items/s per reader and featbake / safe_open."""
    out = []
    for cold, workers in cells:
        rates: dict[str, list[float]] = {r: [] for r in READERS}
        construct: list[float] = []
        for k in range(rounds):
            for reader in READERS:
                got = run_fresh(reader, base, workers, cold, seed=k)
                rates[reader].append(n / got["epoch"])
                if reader == "featbake":
                    construct.append(got["construct"])
        med = {r: statistics.median(v) for r, v in rates.items()}
        cell = f"{'cold' if cold else 'warm'} w={workers}"
        ratio = med["featbake"] / med["stshards"]
        note = (
            f"{n} fp16 [T, {DIM}] items (~430 KB), DataLoader(batch_size=None, shuffle=True), a "
            f"fresh process per epoch, median of {rounds}; items/s median (min-max): "
            + "; ".join(
                f"{LABELS[r]} {med[r]:,.0f} ({min(v):,.0f}-{max(v):,.0f})" for r, v in rates.items()
            )
            + f"; featbake's construction {statistics.median(construct) * 1000:.0f} ms (not timed)"
        )
        metric = f"1 item/step, {cell}: featbake / safetensors shards (mmap'd views)"
        out.append(row(BENCH, metric, ratio, "x", ">= 1x", ratio >= 1.0, note))
    return out


def main(quick: bool = False, cells: list[tuple[bool, int]] | None = None) -> list[dict]:
    if not hasattr(os, "posix_fadvise"):
        return [row(BENCH, "peers", 0, "", note="skipped: no posix_fadvise here")]
    n, rounds = (400, 3) if quick else (1400, 3)
    base = prepare(n)
    todo = cells or [(False, 0), (False, 2), (True, 0), (True, 2)]
    rows = measure(base, n, rounds, todo)
    rows.append(row(BENCH, "litdata's chunk-wise reader", 0, "", note=litdata_missing()))
    return rows


if __name__ == "__main__":
    # python benchmarks/bench_peers.py [--quick] [--cells warm0,warm2,cold0,cold2]
    args = sys.argv[1:]
    chosen = None
    if "--cells" in args:
        names = args[args.index("--cells") + 1].split(",")
        chosen = [(c.startswith("cold"), int(c[-1])) for c in names]
    for r in main(quick="--quick" in args, cells=chosen):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})")
        print(f"    {r['note']}")
