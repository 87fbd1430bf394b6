"""Builds in parts: 2 torchrun ranks against 1 process, and `featbake merge` of 1,000,000 features.

1. The same build (a TinyConvEncoder over synthetic clips, ``--workers 0``, one thread per
   process) run by one process and by ``torchrun --nproc-per-node 2`` (which includes rank 0's
   merge), each on a fresh store, alternating; the ratio is the speed-up of 2 ranks. On this
   2-core machine shared with other jobs the ceiling is 2x.
2. ``featbake merge`` (the CLI, process start included) of the fragments of a 2-part build of
   1,000,000 features: 8,192-feature shards (their files exist, empty: merge never reads them),
   each part's manifest slice and one hash-cache row per input.

    python benchmarks/bench_ranks.py [--quick]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from featbake.store.fragments import (
    BuildInfo,
    FragmentKind,
    ManifestItem,
    write_fragment,
)
from featbake.store.hash_cache import FileStat, HashCacheRow
from featbake.store.layout import Layout
from featbake.store.shard import SealedShard, ShardEntry
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder

sys.path.insert(0, str(HERE))
from _rows import row

ITEMS_PER_SHARD = 8192


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - t0


def ranks_ratio(tmp: Path, clips: int, seconds: float, rounds: int) -> tuple[float, float]:
    """Median seconds of one process and of 2 torchrun ranks building the same folder."""
    data = tmp / "clips"
    write_audio_folder(data, clips, seconds=seconds, seed=3)
    encoder = save_torchscript(TinyConvEncoder(dim=256, hidden=256), tmp / "enc.pt")
    args = ["build", "-e", str(encoder), "-d", str(data), "--workers", "0", "--json"]
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2"]
    one, two = [], []
    for i in range(rounds):
        one.append(_timed([sys.executable, "-m", "featbake", *args, "--cache", str(tmp / f"a{i}")]))
        cache = ["--cache", str(tmp / f"b{i}")]
        two.append(_timed([*torchrun, "--standalone", "-m", "featbake", *args, *cache]))
    return statistics.median(one), statistics.median(two)


def synthetic_fragments(store: Path, n: int) -> None:
    """The fragments a 2-part build of ``n`` features leaves (one ``done`` fragment per part)."""
    layout = Layout(store).ensure()
    keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(n)]
    world, enc, rec = 2, "e" * 64, "r" * 64
    for rank in range(world):
        mine = range(rank, n, world)
        info = BuildInfo("b" * 32, rank, world, "r-bench", "/data", "enc.pt", "torchscript",
                         enc, rec, {"source": "audio"})  # fmt: skip
        shards = []
        idx = list(mine)
        for s in range(0, len(idx), ITEMS_PER_SHARD):
            chunk = idx[s : s + ITEMS_PER_SHARD]
            name = hashlib.sha256(b"shard%d" % chunk[0]).hexdigest()
            path = layout.shard_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            entries = tuple(ShardEntry(keys[i], "", "F16", (50, 64), 6400) for i in chunk)
            shards.append(SealedShard(name, path, len(chunk) * 6400, enc, rec, entries))
        items = [ManifestItem(i, f"clips/{i:07d}.wav", keys[i]) for i in mine]
        hashes = [
            HashCacheRow.of(f"/data/clips/{i:07d}.wav", FileStat(1000, i, i, i), keys[i], 0)
            for i in mine
        ]
        write_fragment(layout, info, FragmentKind.DONE, shards, items, hashes)


def main(quick: bool = False) -> list[dict]:
    work = HERE / "_work"
    work.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
    n = 100_000 if quick else 1_000_000
    try:
        clips, secs, rounds = (12, 1.0, 1) if quick else (96, 4.0, 3)
        one, two = ranks_ratio(tmp, clips, secs, rounds)
        store = tmp / "merge"
        t0 = time.perf_counter()
        synthetic_fragments(store, n)
        setup = time.perf_counter() - t0
        merge_s = _timed([sys.executable, "-m", "featbake", "merge", "--cache", str(store)])
        catalog = (store / "catalog.sqlite").stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [
        row(
            "ranks",
            f"2 torchrun ranks vs 1 process, {clips} x {secs:g} s clips (speed-up)",
            one / two,
            "x",
            "report (2 cores: <= 2x)",
            None,
            f"1 process {one:.2f} s, 2 ranks {two:.2f} s incl. merge; median of {rounds}",
        ),
        row(
            "ranks",
            f"featbake merge, fragments of {n:,} features",
            merge_s,
            "s",
            "report",
            None,
            f"2 parts, {n // ITEMS_PER_SHARD + 2} shards, manifest + hash rows; catalog "
            f"{catalog / 1e6:.0f} MB (writing the fragments took {setup:.1f} s)",
        ),
    ]


if __name__ == "__main__":
    from rich.console import Console
    from rich.table import Table

    rows = main(quick="--quick" in sys.argv)
    table = Table("metric", "value", "unit", "target", "note")
    for r in rows:
        table.add_row(r["metric"], f"{r['value']:.3f}", r["unit"], r["target"], r["note"])
    Console().print(table)
