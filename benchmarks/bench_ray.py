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

4. A first build's hash phase (the inputs not in the hash cache): ``hash_inputs`` on the driver
   (``digest_here``, 4 threads) against the same call with a Ray build's digester
   (``ClusterDigests``: Ray tasks, Ray up, 2 CPUs), each on a fresh catalog, alternating, the
   files in the page cache; and the input bytes the driver process read to hash them (counted
   at ``LocalFiles.digest`` in the driver: Ray's workers are other processes). On one 2-core
   node there is no cluster to spread over, so the time says what tasks cost here, not what a
   cluster gains; the bytes read by the driver are what moves off it. The same clips packed into
   8 tar shards are hashed the same two ways (``WebDataset.hash``: each shard's members read by
   one Ray task, or on the driver), their member bytes counted at ``LocalFiles.member_digests``.

    python benchmarks/bench_ray.py [--quick] [--hash-only]
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
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


def hash_phase(data: Path, shards: Path, tmp: Path, rounds: int) -> dict[str, dict[str, float]]:
    """Per case, median seconds of a first build's hashing on the driver and in Ray tasks, and
    the input bytes the driver read for each (see part 4 of the module's docstring): ``files``,
    the clips of ``data`` (``hash_inputs``); ``tar``, the same clips in the tar shards of
    ``shards`` (``WebDataset.hash``, its members counted at ``LocalFiles.member_digests``)."""
    import ray

    from featbake.bake.ray_engine import ClusterDigests
    from featbake.encode.fingerprints import digest_here, hash_inputs
    from featbake.encode.webdataset import WebDataset
    from featbake.store.byteplace import LocalFiles
    from featbake.store.catalog import Catalog
    from featbake.store.layout import Layout

    paths = sorted(str(p) for p in data.iterdir())
    tars = WebDataset(str(shards))
    members = [tars.path(r) for r in tars.scan([".wav"]).inputs]
    read = {(case, side): 0 for case in ("files", "tar") for side in ("driver", "cluster")}
    now = ["files", "driver"]
    real, real_members = LocalFiles.digest, LocalFiles.member_digests

    def counted(self: LocalFiles, path: str, expect: Any, held: Any = None) -> Any:
        read[now[0], now[1]] += expect.size  # a digest reads the whole file
        return real(self, path, expect, held)

    def counted_members(self: LocalFiles, tar: str, listed: Any, held: Any = None) -> Any:
        read[now[0], now[1]] += sum(m.size for m in listed)  # each member read whole
        return real_members(self, tar, listed, held)

    LocalFiles.digest = counted  # type: ignore[method-assign]
    LocalFiles.member_digests = counted_members  # type: ignore[method-assign]
    cases = {
        "files": lambda cat, digester: hash_inputs(cat, paths, digester=digester),
        "tar": lambda cat, digester: tars.hash(cat, members, digester=digester),
    }
    os.environ["PYTHONPATH"] = str(REPO)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    times = {key: [] for key in read}
    try:
        ray.get([ray.remote(lambda: 0).remote() for _ in range(2)])  # workers started
        digesters = {"driver": digest_here, "cluster": ClusterDigests(None, cluster_from=1)}
        for i in range(rounds):
            for (case, hashed), (side, digester) in itertools.product(
                cases.items(), digesters.items()
            ):
                now[:] = [case, side]
                with Catalog(Layout(tmp / f"hash-{case}-{side}{i}").ensure()) as cat:
                    t0 = time.perf_counter()
                    digests, failed = hashed(cat, digester)
                    times[case, side].append(time.perf_counter() - t0)
                assert len(digests) == len(paths) and not failed
    finally:
        ray.shutdown()
        LocalFiles.digest = real  # type: ignore[method-assign]
        LocalFiles.member_digests = real_members  # type: ignore[method-assign]
    return {
        case: {
            "driver_s": statistics.median(times[case, "driver"]),
            "cluster_s": statistics.median(times[case, "cluster"]),
            "driver_read": read[case, "driver"] / rounds,
            "cluster_read": read[case, "cluster"] / rounds,
            "bytes": sum(os.path.getsize(p) for p in paths),
        }
        for case in cases
    }


def hash_rows(files: int, secs: float, got: dict[str, float], rounds: int, what: str) -> list[dict]:
    """The rows of part 4 for one case (``what``: the inputs, as the rows name them)."""
    mb = got["bytes"] / 1e6
    return [
        row(
            "ray",
            f"first build's hash phase, Ray tasks vs driver, {files} x {secs:g} s clips{what}",
            got["cluster_s"] / got["driver_s"],
            "x",
            "report",
            None,
            f"driver {got['driver_s']:.2f} s, Ray tasks {got['cluster_s']:.2f} s ({mb:.0f} MB, "
            f"page cache, median of {rounds}); one 2-core node: no cluster to spread over",
        ),
        row(
            "ray",
            f"input bytes the driver read to hash a first build{what}, Ray tasks",
            got["cluster_read"],
            "B",
            "0",
            got["cluster_read"] == 0,
            f"hashed on the driver: {got['driver_read']:.0f} B (every input, {mb:.0f} MB)",
        ),
    ]


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


def hash_only(quick: bool = False) -> list[dict]:
    """Part 4 alone (a minute at most)."""
    work = HERE / "_work"
    work.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ray-hash-", dir=work))
    files, secs, rounds = (256, 2.0, 3) if quick else (512, 10.0, 3)
    try:
        data = tmp / "clips"
        write_audio_folder(data, files, seconds=secs, seed=5)
        got = hash_phase(data, tar_shards(data, tmp / "shards", TAR_SHARDS), tmp, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    in_tars = f" (in {TAR_SHARDS} tar shards)"
    return hash_rows(files, secs, got["files"], rounds, "") + hash_rows(
        files, secs, got["tar"], rounds, in_tars
    )


#: Tar shards the bench's clips are packed into for the tar case of part 4.
TAR_SHARDS = 8


def tar_shards(data: Path, folder: Path, shards: int) -> Path:
    """``data``'s files packed in order into ``shards`` plain tars in ``folder``."""
    folder.mkdir()
    files = sorted(data.iterdir())
    per = -(-len(files) // shards)
    for i in range(shards):
        with tarfile.open(folder / f"shard-{i:03d}.tar", "w") as tar:
            for f in files[i * per : (i + 1) * per]:
                tar.add(f, arcname=f.name)
    return folder


def main(quick: bool = False, hashing: bool = True) -> list[dict]:
    extra = hash_only(quick) if hashing else []
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
        *extra,
    ]


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for r in hash_only(quick) if "--hash-only" in sys.argv else main(quick):
        print(f"{r['metric']}: {r['value']:.3g}{r['unit']}  {r['note']}")
