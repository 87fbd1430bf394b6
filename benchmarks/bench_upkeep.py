"""Upkeep on a large store: ``featbake stats`` and a no-op ``gc`` over 1,000,000 catalog rows.

The store is synthetic (rows only: shard rows name files that do not exist, which neither stats
nor a gc plan opens) and built fast with ``executemany`` in one transaction. Three roots reach
every feature, with overlap, so gc has nothing to do: what is timed is the scan that decides so.
Beside each time, the floor it is measured against: one bare full scan of the features table
(``SELECT count(*), sum(nbytes)``) on the same catalog, in the same run.

    python benchmarks/bench_upkeep.py [--quick]
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.units import format_bytes
from featbake.upkeep import GcOptions, execute_gc, plan_gc, stats

sys.path.insert(0, str(HERE))
from _rows import row

ROWS_PER_SHARD = 1000
FEATURE_BYTES = 50 * 64 * 2  # 50 frames x 64 dims in float16


def build_catalog(store: Path, n: int) -> float:
    """A catalog of ``n`` features in ``n / 1000`` shards, reached by three overlapping roots."""
    t0 = time.perf_counter()
    layout = Layout(store).ensure()
    cat = Catalog(layout)
    keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(n)]
    shards = (n + ROWS_PER_SHARD - 1) // ROWS_PER_SHARD
    now = time.time()
    enc = ["a" * 64, "b" * 64]
    with cat.transaction() as c:
        c.executemany(
            "INSERT INTO shards(id, name, bytes, items, encoder_fp, recipe_fp, created, data_bytes)"
            " VALUES (?,?,?,?,?,?,?,?)",
            [
                (
                    s + 1,
                    hashlib.sha256(b"shard%d" % s).hexdigest(),
                    ROWS_PER_SHARD * (FEATURE_BYTES + 150),
                    min(ROWS_PER_SHARD, n - s * ROWS_PER_SHARD),
                    enc[s % 2],
                    "c" * 64,
                    now,
                    min(ROWS_PER_SHARD, n - s * ROWS_PER_SHARD) * FEATURE_BYTES,
                )
                for s in range(shards)
            ],
        )
        c.executemany(
            "INSERT INTO features VALUES (?,?,?,?,?,?,?)",
            (
                (k, "", i // ROWS_PER_SHARD + 1, "F16", "[50,64]", FEATURE_BYTES, now - i)
                for i, k in enumerate(keys)
            ),
        )
        c.executemany(
            "INSERT INTO encoders VALUES (?,?,?,?,?)",
            [(e, f"encoder{i}.pt", "torchscript", now, now) for i, e in enumerate(enc)],
        )
        spans = [(0, n // 2), (2 * n // 5, n), (0, n // 10)]
        for r, (lo, hi) in enumerate(spans):
            c.execute(
                "INSERT INTO roots VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    f"r-{r:012d}",
                    f"/data/set{r}",
                    f"encoder{r % 2}.pt",
                    enc[r % 2],
                    "c" * 64,
                    '{"source":"audio"}',
                    hi - lo,
                    now,
                    now,
                ),
            )
            c.executemany(
                "INSERT INTO root_items VALUES (?,?,?,?)",
                ((f"r-{r:012d}", j, f"clips/{j:07d}.wav", keys[lo + j]) for j in range(hi - lo)),
            )
    cat.close()
    return time.perf_counter() - t0


def _best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _scan_floor(store: Path) -> float:
    cat = Catalog(Layout(store))
    t0 = time.perf_counter()
    cat.conn.execute("SELECT count(*), sum(nbytes) FROM features NOT INDEXED").fetchone()
    dt = time.perf_counter() - t0
    cat.close()
    return dt


def main(quick: bool = False) -> list[dict]:
    n = 100_000 if quick else 1_000_000
    work = HERE / "_work"
    work.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="upkeep-", dir=work))
    try:
        store = tmp / "store"
        build_s = build_catalog(store, n)
        size = sum(p.stat().st_size for p in store.glob("catalog.sqlite*"))
        stats(store)  # warm the page cache, as a second run by a user would be
        floor = statistics.median(_scan_floor(store) for _ in range(3))
        stats_s, s = _best(lambda: stats(store), 3)
        assert s.features == n and s.live_features == n, "synthetic store is not all live"

        def noop_gc() -> object:
            plan = plan_gc(store, GcOptions())
            assert plan.nothing_to_do, plan.summary()
            return execute_gc(plan)

        gc_s, _ = _best(noop_gc, 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    label = f"{n:,} features"
    return [
        row(
            "upkeep",
            f"stats, {label}",
            stats_s,
            "s",
            "< 1 s",
            stats_s < 1.0,
            f"{stats_s / floor:.1f}x one bare full scan ({floor:.3f} s)",
        ),
        row(
            "upkeep",
            f"no-op gc (plan + execute), {label}",
            gc_s,
            "s",
            "< 2 s",
            gc_s < 2.0,
            f"{gc_s / floor:.1f}x one bare full scan",
        ),
        row(
            "upkeep",
            f"catalog size, {label}",
            size / 1e6,
            "MB",
            "-",
            None,
            f"{format_bytes(size)}; {size / n:.0f} B per feature incl. 1.1 root items",
        ),
        row(
            "upkeep",
            f"building the synthetic catalog, {label}",
            build_s,
            "s",
            "-",
            None,
            "executemany in one transaction (setup, not featbake's speed)",
        ),
    ]


if __name__ == "__main__":
    from rich.console import Console
    from rich.table import Table

    rows = main(quick="--quick" in sys.argv)
    table = Table("metric", "value", "unit", "target", "ok", "note")
    for r in rows:
        ok = "" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        table.add_row(r["metric"], f"{r['value']:.3f}", r["unit"], r["target"], ok, r["note"])
    Console().print(table)
