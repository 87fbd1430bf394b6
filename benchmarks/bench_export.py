"""``make bench`` part ``export``: each export format's rate against the store's own read rate.

The store is the loader benchmark's (random ``[T, 768]`` items baked from .npy files by an
identity encoder), fp16 and fp32. The read rate is every item read once in the root's order,
checksummed, by :func:`featbake.export.source.stream` (what each export reads); each format's
rate is the same bytes over its whole export, written to local disk. Target: each format at
least half the read rate (issue 41). A second ratio weighs each format against copying the
store's shard files (the write floor: the same bytes, nothing encoded). Rates are MB/s of
feature bytes, warm page cache.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _rows import row
from bench_loader import prepare

from featbake.export.parquet import export_parquet
from featbake.export.source import as_numpy, open_source, stream
from featbake.export.webdataset import export_webdataset
from featbake.export.zarr import export_zarr

WORK = Path(__file__).resolve().parent / "_work" / "export"


def read_rate(store: Path) -> tuple[float, int]:
    """MB/s of reading every item once through the exports' own reader; and the bytes."""
    t0 = time.perf_counter()
    total = 0
    src = open_source(store, None)
    for items in stream(src):
        total += sum(as_numpy(t).nbytes for item in items for t in item.parts.values())
    return total / (time.perf_counter() - t0) / 1e6, total


def copy_rate(store: Path) -> float:
    """MB/s of copying the store's shard files to local disk (the write floor of any export:
    the same bytes, no checksum, no format)."""
    out = WORK / "copy"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shards = sorted((store / "shards").glob("*/*.safetensors"))
    t0 = time.perf_counter()
    total = 0
    for i, shard in enumerate(shards):
        shutil.copyfile(shard, out / f"{i}.safetensors")
        total += shard.stat().st_size
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return total / seconds / 1e6


def main(quick: bool = False) -> list[dict]:
    n = 96 if quick else 1000
    rows = []
    for dtype in ("float16", "float32"):
        store = prepare(n, dtype) / "store"
        read_rate(store)  # warm
        read, nbytes = read_rate(store)
        copy = copy_rate(store)
        for name, export in (
            ("zarr", export_zarr),
            ("parquet", export_parquet),
            ("webdataset", export_webdataset),
        ):
            out = WORK / f"{dtype}.{name}"
            shutil.rmtree(out, ignore_errors=True)
            out.unlink(missing_ok=True) if out.is_file() else None
            t0 = time.perf_counter()
            export(out, cache=store, overwrite=True)
            rate = nbytes / (time.perf_counter() - t0) / 1e6
            rows.append(
                row(
                    "export",
                    f"{name} export vs reading the store, {dtype} [T, 768], {n} items",
                    rate / read,
                    "x",
                    ">= 0.5x",
                    rate / read >= 0.5,
                    note=f"read {read:,.0f} MB/s; {name} {rate:,.0f} MB/s",
                )
            )
            rows.append(
                row(
                    "export",
                    f"{name} export vs copying the shard files, {dtype}",
                    rate / copy,
                    "x",
                    "report",
                    note=f"copy {copy:,.0f} MB/s; {name} {rate:,.0f} MB/s",
                )
            )
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink()
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})  {r['note']}")
