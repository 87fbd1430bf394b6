"""A build on Ray (issue 40): 2 actors against a plain build of the same inputs, on one node.

1. The same folder (bench_build's ConvStack, a wav2vec2-style conv extractor, over synthetic
   clips: encoding dominates, as with a real encoder) built by ``featbake.build`` in this
   process with its defaults and by ``featbake.build(..., engine=RayEngine(workers=2))`` on a
   local Ray instance (2 CPUs, its workers inheriting ``PYTHONPATH`` as after ``ray start``)
   started beforehand, as a cluster is (``RAY_ADDRESS``); each on a
   fresh store, alternating. The Ray build's time includes starting its actors (each loads the
   encoder) and the driver's merge: the engine's overhead on one node. Each actor runs torch
   on one thread (Ray's ``OMP_NUM_THREADS`` for a 1-CPU actor), the plain build on torch's
   own count (2 here). Target: <= 1.25x the plain build.
2. The same Ray build from the CLI with nothing started (``featbake build --engine ray``: the
   local Ray instance is started and stopped by the build), against the plain CLI build:
   reported, no target (Ray's start is a fixed cost of seconds).
3. Requests to a bucket store per input (moto on loopback, its access log counted as part
   ``bucket`` counts it): a plain build and a Ray build (2 actors) of the same clips into a
   fresh prefix each. The Ray build's extra requests are its actors' fragments (one per task)
   and each actor's look for the fragments of its build before a task (a LIST, and a GET of
   each fragment it had not seen: what lets a task run again skip what a dead actor sealed).

    python benchmarks/bench_ray.py [--quick]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from featbake.bake.pipeline import build
from featbake.testing import save_torchscript, write_audio_folder

sys.path.insert(0, str(HERE))
from _rows import row
from bench_build import ConvStack

TARGET = 1.25


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def in_process(tmp: Path, data: Path, encoder: Path, rounds: int) -> tuple[float, float]:
    """Median seconds of a plain build and of a Ray build (2 actors) of ``data``."""
    import ray

    from featbake.bake.ray_engine import RayEngine

    # As a `ray start` cluster with PYTHONPATH set: the workers inherit this process's
    # environment, no runtime_env (a job's runtime_env keeps its actors off the workers Ray
    # starts ahead, about 0.6 s more per actor).
    os.environ["PYTHONPATH"] = str(REPO)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    plain, on_ray = [], []
    try:
        for i in range(rounds):
            t0 = time.perf_counter()
            build(data, encoder, cache=tmp / f"plain{i}")
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            report = build(data, encoder, cache=tmp / f"ray{i}", engine=RayEngine(workers=2))
            on_ray.append(time.perf_counter() - t0)
            assert report.encoded == len(list(data.iterdir())), report
    finally:
        ray.shutdown()
    return statistics.median(plain), statistics.median(on_ray)


def bucket_requests(tmp: Path, data: Path, encoder: Path) -> tuple[Any, Any]:
    """Requests moto answered for a plain build and for a Ray build (2 actors) of ``data``,
    each into a fresh prefix (``bench_bucket.Requests``)."""
    import ray
    from bench_bucket import BUCKET, ServerLog, s3_server

    from featbake.bake.ray_engine import RayEngine
    from featbake.store.open import open_store

    log = ServerLog(tmp / "moto.log")
    counted = []
    with s3_server(log.path):  # the AWS environment is set before Ray starts: actors inherit it
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
        try:
            for prefix, engine in (
                ("plain", None),
                ("ray", RayEngine(workers=2, rows_per_task=16)),
            ):
                store = open_store(f"s3://{BUCKET}/{prefix}", local_cache=tmp / f"tier-{prefix}")
                mark = log.mark()
                build(data, encoder, cache=store, engine=engine)
                counted.append(log.since(mark, prefix))
        finally:
            ray.shutdown()
    return counted[0], counted[1]


def cli(tmp: Path, data: Path, encoder: Path) -> tuple[float, float]:
    """Seconds of the plain CLI build and of ``--engine ray`` starting its own Ray."""
    times = []
    for name, extra in (("plain", []), ("ray", ["--engine", "ray", "--workers", "2"])):
        cmd = [sys.executable, "-m", "featbake", "build", "-e", str(encoder), "-d", str(data),
               "--cache", str(tmp / f"cli-{name}"), *extra]  # fmt: skip
        env = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def main(quick: bool = False) -> list[dict]:
    work = HERE / "_work"
    work.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir=work))
    clips, secs, rounds = (40, 8.0, 1) if quick else (256, 10.0, 1)
    try:
        data = tmp / "clips"
        write_audio_folder(data, clips, seconds=secs, seed=3)
        encoder = save_torchscript(ConvStack(), tmp / "enc.pt")
        plain, on_ray = in_process(tmp, data, encoder, rounds)
        cli_plain, cli_ray = cli(tmp, data, encoder)
        few = tmp / "few"  # 64 clips: 4 tasks of 16 on the 2 actors
        write_audio_folder(few, 64, seconds=1.0, seed=4)
        req_plain, req_ray = bucket_requests(tmp, few, encoder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    per_input = (req_ray.gets + req_ray.other) / 64
    return [
        row(
            "ray",
            "requests to a bucket store per input, Ray build (2 actors, 16 inputs a task)",
            per_input,
            "req",
            "report",
            None,
            f"Ray: {req_ray.text()}; plain: {req_plain.text()}, "
            f"{(req_plain.gets + req_plain.other) / 64:.3g} per input; 64 clips, moto's log",
        ),
        row(
            "ray",
            f"Ray build (2 actors) vs plain build, {clips} x {secs:g} s clips, Ray up",
            on_ray / plain,
            "x",
            f"<= {TARGET}x",
            on_ray / plain <= TARGET,
            f"plain {plain:.2f} s, Ray {on_ray:.2f} s (actors started, encoder loaded in each, "
            f"merge); median of {rounds}; 2 CPUs",
        ),
        row(
            "ray",
            "featbake build --engine ray vs plain, CLI, Ray started by the build",
            cli_ray / cli_plain,
            "x",
            "report",
            None,
            f"plain {cli_plain:.2f} s, --engine ray {cli_ray:.2f} s (a local Ray instance "
            "started and stopped)",
        ),
    ]


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:.3g}{r['unit']}  {r['note']}")
