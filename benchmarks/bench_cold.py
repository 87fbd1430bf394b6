"""Cold reads (issue 19, item 3): a store that is not in the page cache, featbake against
safetensors shards read through mmap (``safe_open``), the same features in both.

A store larger than RAM reads cold: every read waits for the disk. To measure that on a machine
whose RAM holds the data, the files of both readers are dropped from the page cache
(``posix_fadvise(DONTNEED)``, no privileges needed) before every timed epoch. Both read the same
shuffled order of ~600 KB fp32 ``[T, 768]`` items from ~256 MiB shards; every item is touched
(one element per 4 KiB page), so a reader that hands out views of a mapping pays its page faults.
featbake's dataset is reused across epochs (shards open, checksums checked), as in training; the
shards' ``safe_open`` handles are opened anew each epoch, since DONTNEED cannot drop pages that
are still mapped (memory pressure, which this stands in for, would).

Rows, each against the mmap'd shards read the same way (target >= 1x for the FeatureLoader):

* one item per step: ``FeatureLoader(ds, batch_size=1)`` against ``safe_open(...).get_tensor``
  in a loop; also a plain loop of ``ds[i]`` (nothing tells it the next items) and the loader
  with ``read_ahead=0`` (one read at a time: what it did before);
* batches of 32 through ``pad_collate``: ``FeatureLoader(ds, 32)`` against ``DataLoader`` over
  the shards (no workers).

Run: ``python benchmarks/bench_cold.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row
from _serve_readers import DIM, SafetensorsShards, identity_encoder, prepare_items, recipe, touch

from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import FeatureLoader
from featbake.testing import drop_page_cache

WORK = Path(__file__).resolve().parent / "_work" / "cold"
BENCH = "cold"
DTYPE = "float32"
BATCH = 32


def prepare(n: int) -> Path:
    """``n`` random items as .npy files, baked into a featbake store and written as safetensors
    shards of up to 256 MiB (featbake's shard size), in the same item order; kept across runs."""
    return prepare_items(WORK / f"{DTYPE}-n{n}", n, DTYPE, seed=5)


def first(items: list[Any]) -> Any:
    return items[0]


def readers(base: Path, order: list[int]) -> dict[str, Callable[[], None]]:
    """One epoch of each reader over ``order`` (``FeatureLoader`` epochs draw the same order)."""
    ds = CachedFeatureDataset(base / "npy", identity_encoder(), cache=base / "store",
                              recipe=recipe(DTYPE), on_miss="error")  # fmt: skip
    assert ds.stored() == len(ds), "the benchmark store is incomplete: delete benchmarks/_work"
    index = [tuple(x) for x in json.loads((base / "index.json").read_text())]

    def shards() -> SafetensorsShards:
        # Opened anew each epoch: a page still mapped is one DONTNEED cannot drop (memory
        # pressure would), so handles kept open would read warm whatever was dropped.
        return SafetensorsShards(index)  # type: ignore[arg-type]

    def loader(batch: int, read_ahead: int | None = None) -> Callable[[], None]:
        kw: dict[str, Any] = {} if read_ahead is None else {"read_ahead": read_ahead}
        collate = first if batch == 1 else pad_collate
        fl = FeatureLoader(ds, batch, seed=0, collate_fn=collate, **kw)

        def epoch() -> None:
            fl.set_epoch(0)  # the order of `order`
            for b in fl:
                touch(b if batch == 1 else b[0])

        return epoch

    def loop(make: Callable[[], Any]) -> Callable[[], None]:
        def epoch() -> None:
            items = make()
            for i in order:
                touch(items[i])

        return epoch

    def st_batches() -> None:
        for padded, _ in DataLoader(shards(), BATCH, sampler=order, collate_fn=pad_collate):
            touch(padded)

    return {
        "st 1": loop(shards),
        "fl 1": loader(1),
        "fl 1 ra0": loader(1, 0),
        "ds[i]": loop(lambda: ds),
        "st 32": st_batches,
        "fl 32": loader(BATCH),
        "fl 32 ra0": loader(BATCH, 0),
    }


def measure(base: Path, rounds: int) -> dict[str, list[float]]:
    """items/s of every reader, cold, ``rounds`` interleaved rounds after one warm-up each."""
    n = len(json.loads((base / "index.json").read_text()))
    g = torch.Generator()
    g.manual_seed(0)  # FeatureLoader's order for seed 0, epoch 0
    order: list[int] = torch.randperm(n, generator=g).tolist()
    runs = readers(base, order)
    for epoch in runs.values():  # open every shard, check every checksum
        epoch()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, epoch in runs.items():
            drop_page_cache(base / "store", base / "shards")
            t0 = time.perf_counter()
            epoch()
            rates[name].append(n / (time.perf_counter() - t0))
    return rates


LABELS = {
    "st 1": "safetensors shards, safe_open (mmap), 1 item/step",
    "fl 1": "FeatureLoader(batch_size=1)",
    "fl 1 ra0": "FeatureLoader(batch_size=1, read_ahead=0)",
    "ds[i]": "a loop of ds.__getitem__",
    "st 32": "safetensors shards, DataLoader batch 32 pad_collate",
    "fl 32": "FeatureLoader(batch_size=32)",
    "fl 32 ra0": "FeatureLoader(batch_size=32, read_ahead=0)",
}


def rows_of(rates: dict[str, list[float]], n: int, rounds: int) -> list[dict[str, Any]]:
    med = {k: statistics.median(v) for k, v in rates.items()}
    note = (
        f"{n} items [T, {DIM}] fp32 (~600 KB), shuffled, page cache dropped before each epoch "
        f"(posix_fadvise DONTNEED) for both stores; median of {rounds} interleaved rounds; "
        "items/s median (min-max): "
        + "; ".join(
            f"{LABELS[k]} {med[k]:,.0f} ({min(v):,.0f}-{max(v):,.0f})" for k, v in rates.items()
        )
    )
    out = []
    for name, base, target in (
        ("fl 1", "st 1", True),
        ("ds[i]", "st 1", False),
        ("fl 1 ra0", "st 1", False),
        ("fl 32", "st 32", True),
        ("fl 32 ra0", "st 32", False),
    ):
        ratio = med[name] / med[base]
        metric = f"cold: {LABELS[name]} / mmap'd shards"
        out.append(row(BENCH, metric, ratio, "x", ">= 1x" if target else "",
                       ratio >= 1 if target else None, note))  # fmt: skip
    return out


def main(quick: bool = False) -> list[dict[str, Any]]:
    if not hasattr(os, "posix_fadvise"):
        return [row(BENCH, "cold reads", 0, "", note="skipped: no posix_fadvise here")]
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    n, rounds = (96, 1) if quick else (1000, 5)
    base = prepare(n)
    return rows_of(measure(base, rounds), n, rounds)


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3f}{r['unit']} (target {r['target']})")
    print(r["note"])
