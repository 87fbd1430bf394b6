"""One item per step against the peers (issue 42 item 3): featbake against safetensors shards
read through ``safe_open`` (views of a private mmap of each shard) and against litdata's
chunk-wise reader, the same items in all three.

The conditions are the ones a training script over precomputed features meets: fp16
``[T, 768]`` items of ~430 KB, a shuffled order, ``DataLoader(ds, batch_size=None)`` (one item
per step), ``num_workers`` 0 and 2, and a **fresh process per epoch** (a job restarted, or a
script run once per epoch): nothing is open or checked when the epoch starts, so featbake
checks every item's CRC on its read, once in that process, as it does for any first read. Each
step reads one element per 4 KiB page of its item (what a step at least does: a reader that
hands out views of a mapping pays its page faults there). Warm: the files of every reader
dropped from the page cache and read back once (the same page-cache state); cold: dropped
(``posix_fadvise(DONTNEED)``) before each epoch.

litdata (0.2.76): the items written once by its ``BinaryWriter`` (item i = the same fp16
tensor, chunks of up to 256 MiB like featbake's shards and the safetensors shards) into a
local directory, read by ``litdata.StreamingDataset(input_dir=that directory, shuffle=True,
seed=round)`` iterated by ``DataLoader(ds, batch_size=None, num_workers=w)``: its own shuffle,
because that is how litdata is meant to be read (its README: ``StreamingDataset(...,
shuffle=True)`` under its ``StreamingDataLoader`` or a plain ``DataLoader``), and because a
``StreamingDataset`` is an ``IterableDataset``, which a ``DataLoader``'s shuffled sampler cannot
drive. On a local disk that order is litdata's ``FullShuffle``: the chunks in a random order,
each chunk's items shuffled in blocks of 256 (``item_shuffle_window``), so its reads stay within
one chunk at a time where featbake's and safe_open's follow one global permutation. For the
record, the same dataset is also read by index (``ds[i]``, which litdata supports) in the
DataLoader's global shuffled order, the order the other two read (reported in the note, not
ratioed). A local ``input_dir`` is "POSIX-fast" in litdata: its chunks are mapped in place
(items are views of a shared read-only mmap) and nothing is copied to its cache directory; the
benchmark passes it a cache directory of its own, drops and warms it with the rest, and reports
its bytes after the epochs (0: nothing copied).

Each epoch runs in a new interpreter that builds its reader (not timed: the construction is
reported apart), then times the epoch and counts its items (every reader must yield each of the
``n`` items once); the readers alternate, and each cell reports the median of its rounds.
Without litdata importable (it is installed beside the venv: ``pip install --no-deps --target
DIR litdata lightning-utilities obstore``, then ``PYTHONPATH=DIR``, since its plain install
replaces torch), its columns are skipped with a line saying so.

Two more readers bound what a reader of owned, checked items can reach here: the same
safetensors shards read by one ``os.preadv`` per item into a new tensor (no check, nothing
above it), and that copy with its CRC-32C (:class:`_serve_readers.OwnedCopies`). Their rows
say how far an owned copy alone is from the views (the step touches a 512th of each item, so
the views pay page faults and nothing else) and how far featbake is from the bare copy and
check (its own layers, with the DataLoader's per-item cost the same for all).

Run: ``python benchmarks/bench_peers.py [--quick] [--cells warm0,warm2,cold0,cold2]`` (quick:
400 items, 3 rounds; full: 1,400 items, 3 rounds).
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
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import (
    DIM,
    OwnedCopies,
    SafetensorsShards,
    identity_encoder,
    prepare_items,
    prepare_litdata,
    recipe,
    touch,
    warm_page_cache,
)

from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import drop_page_cache

WORK = Path(__file__).resolve().parent / "_work" / "peers"
BENCH = "peers"
DTYPE = "float16"
READERS = ("stshards", "featbake", "copy", "copy-crc", "litdata", "litdata-index")
#: litdata's readers: its own shuffle (the row), and ds[i] in the DataLoader's order (the note).
LITDATA = ("litdata", "litdata-index")
LABELS = {
    "stshards": "safetensors shards via safe_open (mmap'd views)",
    "featbake": "featbake CachedFeatureDataset",
    "litdata": "litdata StreamingDataset(shuffle=True) (its chunk-wise order)",
    "litdata-index": "litdata ds[i] in the DataLoader's shuffled order",
    "copy": "an owned copy (one pread per item, no check)",
    "copy-crc": "an owned copy and its CRC-32C",
}
NO_LITDATA = (
    "litdata is not installed: its columns are skipped (pip install --no-deps --target DIR "
    "litdata lightning-utilities obstore, then PYTHONPATH=DIR: its plain install replaces torch)"
)


def prepare(n: int) -> tuple[Path, bool]:
    """``n`` fp16 items as .npy files, baked into a featbake store, written as safetensors
    shards of up to 256 MiB in the same order and (where litdata is importable: the bool) as a
    litdata optimized dataset in ``litdata/``; kept across runs (``benchmarks/_work/peers``)."""
    base = prepare_items(WORK / f"{DTYPE}-n{n}", n, DTYPE, seed=7)
    return base, prepare_litdata(base) is not None


class ByIndex(Dataset):
    """A litdata ``StreamingDataset`` read by index (item i is ``ds[i]``, its random access), so
    that the DataLoader's shuffled sampler orders it as it orders the other readers."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ds[i]


def make(reader: str, base: Path, seed: int) -> Any:
    """A new dataset of ``reader`` over the items in ``base`` (``seed``: litdata's shuffle)."""
    if reader in ("stshards", "copy", "copy-crc"):
        index = [tuple(x) for x in json.loads((base / "index.json").read_text())]
        if reader == "stshards":
            return SafetensorsShards(index)  # type: ignore[arg-type]
        return OwnedCopies(index, check=reader == "copy-crc")  # type: ignore[arg-type]
    if reader in LITDATA:
        from litdata import StreamingDataset

        ds = StreamingDataset(
            input_dir=str(base / "litdata"), cache_dir=str(base / "litdata-cache"),
            shuffle=reader == "litdata", seed=seed,
        )  # fmt: skip
        return ds if reader == "litdata" else ByIndex(ds)
    return CachedFeatureDataset(
        base / "npy", identity_encoder(), cache=base / "store", recipe=recipe(DTYPE),
        on_miss="error",
    )  # fmt: skip


def loader(reader: str, ds: Any, workers: int, seed: int) -> DataLoader:
    """One item per step; litdata's ``StreamingDataset`` shuffles itself (an IterableDataset),
    the rest are shuffled by the DataLoader's sampler (the same order for the same seed)."""
    if reader == "litdata":
        return DataLoader(ds, batch_size=None, num_workers=workers)
    g = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=None, shuffle=True, num_workers=workers, generator=g)


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_epoch(reader: str, base: Path, workers: int, seed: int) -> dict[str, float]:
    """One epoch in this (fresh) process: seconds to build the reader and to read the epoch, the
    items it yielded, and the bytes in litdata's cache directory after it."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if reader in LITDATA:  # imported before the clock, as featbake is
        import litdata  # noqa: F401
    t0 = time.perf_counter()
    ds = make(reader, base, seed)
    t1 = time.perf_counter()
    items = 0
    for item in loader(reader, ds, workers, seed):
        touch(item)
        items += 1
    t2 = time.perf_counter()
    cache = dir_bytes(base / "litdata-cache")
    return {"construct": t1 - t0, "epoch": t2 - t1, "items": items, "cache_bytes": cache}


def drop_chunks(folder: Path) -> None:
    """litdata's chunk files (``*.bin``) under ``folder`` out of the page cache, as
    ``drop_page_cache`` does for the shards (``*.safetensors``); their indexes stay."""
    for p in folder.rglob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def set_page_cache(base: Path, cold: bool) -> None:
    """Every reader's files in the same page-cache state: cold, their data files dropped (the
    shards, litdata's chunks, in its cache directory too); warm, all dropped and read back."""
    lit = [base / "litdata", base / "litdata-cache"]
    if cold:
        drop_page_cache(base / "store", base / "shards")
        for folder in lit:
            drop_chunks(folder)
        return
    for folder in [base / "store", base / "shards", *lit]:  # see warm_page_cache
        warm_page_cache(folder)


def run_fresh(reader: str, base: Path, workers: int, cold: bool, seed: int) -> dict[str, float]:
    """:func:`one_epoch` in a new interpreter (after :func:`set_page_cache`)."""
    set_page_cache(base, cold)
    code = (
        f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from pathlib import Path; import bench_peers as b; "
        f"print(json.dumps(b.one_epoch({reader!r}, Path({str(base)!r}), {workers}, {seed})))"
    )
    # ROOT first; the caller's PYTHONPATH kept (litdata is installed beside the venv there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    n = len(json.loads((base / "index.json").read_text()))
    if got["items"] != n:
        raise RuntimeError(f"{reader} yielded {got['items']} items of {n}: the epochs differ")
    return got


def cell_note(n: int, rounds: int, rates: dict[str, list[float]], extra: dict[str, Any]) -> str:
    """The cell's setting and every reader's items/s, median (min-max)."""
    med = {r: statistics.median(v) for r, v in rates.items()}
    built = {r: statistics.median(v) * 1000 for r, v in extra["construct"].items()}
    note = (
        f"{n} fp16 [T, {DIM}] items (~430 KB), DataLoader(batch_size=None), a fresh process per "
        f"epoch, median of {rounds}; items/s median (min-max): "
        + "; ".join(
            f"{LABELS[r]} {med[r]:,.0f} ({min(v):,.0f}-{max(v):,.0f})" for r, v in rates.items()
        )
        + "; construction (not timed): "
        + ", ".join(f"{r} {ms:.0f} ms" for r, ms in built.items())
    )
    if "litdata" in rates:
        note += f"; litdata's cache dir after its epochs: {max(extra['cache_bytes'])} bytes"
    return note


def cell_rows(cell: str, rates: dict[str, list[float]], note: str) -> list[dict]:
    """featbake / safe_open, and featbake / litdata (its own shuffle) where it was read."""
    med = {r: statistics.median(v) for r, v in rates.items()}
    against = {"stshards": "safetensors shards (mmap'd views)"}
    if "litdata" in med:
        against["litdata"] = "litdata StreamingDataset(shuffle=True)"
    out = []
    for peer, label in against.items():
        ratio = med["featbake"] / med[peer]
        metric = f"1 item/step, {cell}: featbake / {label}"
        out.append(row(BENCH, metric, ratio, "x", ">= 1x", ratio >= 1.0, note))
    # The floor of an owned copy: what a reader handing out items of their own can reach at
    # best against the views, and how far featbake's layers are from a bare copy and check.
    floor = med["copy"] / med["stshards"]
    out.append(row(BENCH, f"1 item/step, {cell}: an owned copy (no check) / safe_open views",
                   floor, "x", "report", note=note))  # fmt: skip
    layers = med["featbake"] / med["copy-crc"]
    out.append(row(BENCH, f"1 item/step, {cell}: featbake / an owned copy and its CRC", layers,
                   "x", "report", note=note))  # fmt: skip
    return out


def measure(
    base: Path, n: int, rounds: int, cells: list[tuple[bool, int]], readers: list[str]
) -> list[dict]:
    """Rows of every cell (cold, workers): featbake / safe_open and featbake / litdata, with
    items/s of every reader in the note."""
    out = []
    for cold, workers in cells:
        rates: dict[str, list[float]] = {r: [] for r in readers}
        extra: dict[str, Any] = {"construct": {r: [] for r in readers}, "cache_bytes": [0]}
        for k in range(rounds):
            for reader in readers:
                got = run_fresh(reader, base, workers, cold, seed=k)
                rates[reader].append(n / got["epoch"])
                extra["construct"][reader].append(got["construct"])
                extra["cache_bytes"].append(got["cache_bytes"])
        cell = f"{'cold' if cold else 'warm'} w={workers}"
        out.extend(cell_rows(cell, rates, cell_note(n, rounds, rates, extra)))
    return out


def main(quick: bool = False, cells: list[tuple[bool, int]] | None = None) -> list[dict]:
    if not hasattr(os, "posix_fadvise"):
        return [row(BENCH, "peers", 0, "", note="skipped: no posix_fadvise here")]
    n, rounds = (400, 3) if quick else (1400, 3)
    base, lit = prepare(n)
    todo = cells or [(False, 0), (False, 2), (True, 0), (True, 2)]
    readers = [r for r in READERS if lit or r not in LITDATA]
    rows = measure(base, n, rounds, todo, readers)
    if not lit:
        rows.append(row(BENCH, "litdata StreamingDataset", 0, "", note=NO_LITDATA))
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
