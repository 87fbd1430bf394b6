"""The benchmarks stay runnable: every module imports, and the build bench's bare loop runs.

Speed itself is measured by `make bench`, never asserted here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as run.py does: dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("bench_*.py")))
def test_bench_module_imports_and_has_main(name: str) -> None:
    assert callable(_load(name).main)


def test_bare_loop_decodes_and_encodes_every_file(tmp_path: Path, encoder_file: Path) -> None:
    from featbake.testing import write_audio_folder

    write_audio_folder(tmp_path / "clips", 6, seconds=0.5)  # the bench's clips share one length
    seconds = _load("bench_build").bare_loop(tmp_path / "clips", encoder_file)
    assert seconds > 0


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files via /proc")
def test_bucket_bench_counts_a_deleted_file_while_it_is_open(tmp_path: Path) -> None:
    held_deleted = _load("bench_bucket").held_deleted
    shard = tmp_path / "ab" / "shard.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 4096)
    with shard.open("rb"):
        assert held_deleted(tmp_path) == 0  # not deleted: the tier's listing counts it
        shard.unlink()
        assert held_deleted(tmp_path) == 4096
    assert held_deleted(tmp_path) == 0


def test_bucket_bench_counts_a_first_builds_gets_of_its_inputs() -> None:
    """The read-once row counts what the server answered: one GET per object with the bytes
    hashed kept (1.0x the data's size), two without, none in a rebuild; a bucket parquet's
    requests per cell: the scan's one HEAD and ranged GETs, no LIST, a rebuild's one HEAD; a
    manifest's s3:// rows: one LIST of their folder, no HEAD (a HEAD each as before)."""
    pytest.importorskip("moto")
    rows = _load("bench_bucket").main_read_once(quick=True)
    assert [round(r["value"], 3) for r in rows[:2]] == [1.0, 2.0]
    assert len(rows) == 7 and rows[2]["value"] < rows[3]["value"]  # cells kept: fewer GETs
    for r in rows[2:4]:
        assert ", 1 HEAD for 16 cells" in r["note"] and "LIST" not in r["note"], r["note"]
        assert r["note"].endswith("a rebuild: 1 HEAD"), r["note"]
    assert rows[0]["note"].startswith("16 GETs") and rows[0]["note"].endswith("rebuild: 0 GETs")
    assert rows[1]["note"].startswith("32 GETs")
    # a manifest of the 16 objects as s3:// rows: its folder listed, a HEAD per row only as before
    assert [r["note"].split(" for ")[0] for r in rows[4:]] == [
        "1 LIST, 0 HEAD, 16 GET", "1 LIST, 0 HEAD, 0 GET", "0 LIST, 16 HEAD, 0 GET"
    ]  # fmt: skip
    assert rows[5]["ok"] is True


def test_peers_bench_readers_serve_the_same_items_once(tmp_path: Path) -> None:
    """Part peers compares readers of the same items: each reader (litdata's two where litdata is
    importable) yields every item once per epoch, equal in dtype, shape and bytes to its .npy."""
    import hashlib

    import numpy as np

    peers = _load("bench_peers")
    base = peers.prepare_items(tmp_path / "items", 6, "float16", seed=3)
    lit = peers.prepare_litdata(base, chunk_bytes=1 << 20) is not None
    assert lit == ((base / "litdata" / "index.json").exists())

    def key(dtype: str, shape: tuple[int, ...], data: bytes) -> str:
        return f"{dtype} {shape} {hashlib.sha256(data).hexdigest()}"

    arrays = [np.load(p) for p in sorted((base / "npy").glob("*.npy"))]
    want = sorted(key(str(a.dtype), a.shape, a.tobytes()) for a in arrays)
    for name in [r for r in peers.READERS if lit or r not in peers.LITDATA]:
        ds = peers.make(name, base, seed=1)
        got = [t.numpy() for t in peers.loader(name, ds, workers=0, seed=1)]
        assert sorted(key(str(a.dtype), a.shape, a.tobytes()) for a in got) == want, name


# -- issue 44's GPU record: bench_gpu.py's parts and benchmarks/gpu_record.sh ----------------------
#: The rows each part must give (its issue-44 item; the metric as bench_gpu.py names it).
ISSUE_44_ROWS = {
    "2": [
        "padded vs bare per-clip loop",
        "padded, each padded length warmed first (not timed) vs bare per-clip loop",
        "padded (default lengths) vs padded to exact lengths",
    ],
    "3": [
        "int8 batch copied + dequantised on the device / fp16 batch copied",
        "FeatureLoader(device) int8 packed / fp16",
        "FeatureLoader(device) int8 as fp16 / fp16",
    ],
    "4": ["FeatureLoader(device) / DataLoader w2"],
    "5": ["build --device / the user's loop"],
}


def test_gpu_bench_runs_every_issue_44_row_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's code runs without a GPU (`bench_gpu.py --device cpu --quick`, parts padded,
    int8, reads and build): every row of issue 44 items 2-5 comes with a finite value, its item,
    the issue's targets, and a note saying it ran on the CPU; no part failed."""
    import math

    gpu = _load("bench_gpu")
    monkeypatch.setattr(gpu, "WORK", tmp_path / "gpu")
    monkeypatch.setattr(sys.modules["bench_loader"], "WORK", tmp_path / "loader")
    rows = gpu.main(quick=True, device="cpu", parts=["padded", "int8", "reads", "build"])
    assert [r for r in rows if r["metric"].endswith(": failed")] == []
    for r in rows:
        assert math.isfinite(r["value"]), r
        assert r["note"].endswith("on the CPU (a smoke run: the value means nothing)"), r["note"]
    metrics = {item: [r["metric"] for r in rows if r["item"] == item] for item in ISSUE_44_ROWS}
    for item, want in ISSUE_44_ROWS.items():
        assert [m for m in want if m not in metrics[item]] == [], (item, metrics[item])
    target = {r["metric"]: r["target"] for r in rows}
    assert target["FeatureLoader(device) / DataLoader w2"] == ">= 5x"
    behind = [r for r in rows if r["metric"].endswith("FeatureLoader + step / max(read, step)")]
    assert len(behind) == 2 and {r["target"] for r in behind} == {"<= 1.2x"}, behind
    assert {r["ok"] for r in behind} <= {True, False}  # judged against the target, not left out


def test_gpu_bench_ray_row_skips_with_a_note_where_ray_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the GPU machine ray is not importable (its wheel does not travel): the Ray row is
    still there, NaN, its note saying why, and the part does not fail."""
    gpu = _load("bench_gpu")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (r,) = gpu.main(quick=True, device="cpu", parts=["ray"])
    assert r["item"] == "5" and r["metric"] == gpu.RAY_METRIC and r["value"] != r["value"]
    assert r["note"].startswith("skipped: ray is not importable here"), r["note"]


@pytest.mark.slow
def test_gpu_bench_ray_row_times_a_ray_build_where_ray_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ray is installed, part ray builds the same clips on a local Ray instance (one
    actor; gpus_per_worker=0 on the CPU) and on the plain path, and reports the ratio."""
    pytest.importorskip("ray.data")
    gpu = _load("bench_gpu")
    monkeypatch.setattr(gpu, "WORK", tmp_path / "gpu")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    (r,) = gpu.main(quick=True, device="cpu", parts=["ray"])
    assert r["value"] > 0 and "gpus_per_worker=0" in r["note"], r


def _record_plan() -> tuple[str, list[tuple[str, int, int, str]]]:
    """`gpu_record.sh --dry-run`: its first line and each step (name, limit, expected, command)."""
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_RECORD_")}
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_record.sh"), "--dry-run"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    pattern = re.compile(r"step (\S+) +limit +(\d+)s +expected +(\d+)s +(.*)")
    steps = [m.groups() for m in map(pattern.fullmatch, lines[1:]) if m]
    assert len(steps) == len(lines) - 1, done.stdout  # every line after the first is a step
    return lines[0], [(n, int(limit), int(exp), cmd.strip()) for n, limit, exp, cmd in steps]


#: Issue 44 item 1's test files by name (it adds every other test file that touches CUDA).
ISSUE_44_TESTS = [
    "tests/test_cuda.py", "tests/test_device.py", "tests/test_keys.py",
    "tests/bake/test_batching.py", "tests/bake/test_pipeline.py", "tests/bake/test_ranks.py",
    "tests/serve/test_prefetch.py", "tests/test_native.py", "tests/test_quantize.py",
    "tests/serve/test_cached_encoder.py",
]  # fmt: skip


def test_gpu_record_plans_the_issue_44_steps_inside_one_run() -> None:
    """The record's plan: the wheels, the kernels, the machine, then pytest -rf -v over issue 44's
    test files and every other that mentions CUDA, then each bench_gpu.py part on cuda (the build
    first: it has no record yet), then the
    summary; each step's limit covers its expected time, the expected times fit the budget and
    the budget fits the one `run` call the header documents (timeout_s 600, carry .whl)."""
    import re

    first, steps = _record_plan()
    parts = _load("bench_gpu").PARTS
    names = [s[0] for s in steps]
    benches = [n.removeprefix("bench-") for n in names[4:-1]]
    assert names == ["wheels", "kernels", "info", "tests", *[f"bench-{p}" for p in benches],
                     "summary"]  # fmt: skip
    assert sorted(benches) == sorted(parts) and benches[0] == "build"  # the row none has yet
    cmd = dict((s[0], s[3]) for s in steps)
    assert cmd["kernels"].endswith("setup.py build_ext --inplace")
    assert " -m pytest -rf -v " in cmd["tests"] and "--dist load " in cmd["tests"]
    planned = {w for w in cmd["tests"].split() if w.startswith("tests/")}
    touching = {
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
        if "cuda" in p.read_text().lower() and p.name != Path(__file__).name  # this file: no CUDA
    }  # fmt: skip
    assert planned == set(ISSUE_44_TESTS) | touching
    assert all((REPO / f).is_file() for f in planned)
    for p in parts:
        assert f"benchmarks/bench_gpu.py {p} --device cuda " in cmd[f"bench-{p}"]
        assert f"--json gpu-{p}.json" in cmd[f"bench-{p}"]
    budget = int(first.split("budget ")[1].split("s")[0])
    assert first.startswith("plan: device cuda,") and "quick=0" in first
    assert all(limit >= expected for _, limit, expected, _ in steps), steps
    assert sum(expected for _, _, expected, _ in steps) <= budget <= 600 - 45
    header = (BENCH / "gpu_record.sh").read_text().split("\nset -u")[0]
    assert "command:   bash benchmarks/gpu_record.sh" in header
    assert 'carry:     [".whl"]' in header and "timeout_s: 600" in header
    for name, limit, expected, _ in steps:  # the header's table says the same limits
        assert re.search(rf"^#   {name} +{limit} +{expected} ", header, re.M), name


def test_gpu_wheels_bring_each_dependency_the_gpu_machine_lacks() -> None:
    """`make gpu-wheels` names one version of each of featbake's dependencies that the GPU
    machine's image lacks, of the packages those need that it lacks too, and of torchdata (which
    tests/serve/test_loader.py imports unguarded); .whl/ is git-ignored."""
    import re
    import tomllib

    make = re.sub(r"\\\n\s*", " ", (REPO / "Makefile").read_text())  # lines joined
    pins = re.search(r"^GPU_WHEELS := (.*)$", make, re.M).group(1).split()
    names = [p.split("==")[0].lower() for p in pins]
    assert all("==" in p for p in pins) and len(names) == len(set(names)), pins
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in deps}
    on_the_image = {"torch", "safetensors", "numpy", "typer", "rich", "tqdm", "pyyaml"}  # KINDS.md
    assert needed - on_the_image <= set(names)
    # soundfile needs cffi, cffi pycparser; zarr numcodecs and donfig
    assert {"cffi", "pycparser", "numcodecs", "donfig", "torchdata"} <= set(names)
    assert ".whl/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_hunt_plugin_loads_and_reports_sixteen_cpus(tmp_path: Path) -> None:
    """`make hunt`'s plugin, loaded as the Makefile loads it, in a pytest run of its own: the
    test it runs sees 16 CPUs everywhere featbake asks and the collector's hunting threshold.
    featbake asks ``featbake.cpus.process_cpus`` (``featbake.device`` and every other module
    import it by name after the plugin patched it); the probe imports no torch."""
    import subprocess

    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import gc, os\n"
        "import sys\n"
        "import featbake.cpus\n"
        "from featbake.cpus import process_cpus\n"
        "def test_probe():\n"
        "    assert featbake.cpus.process_cpus() == 16 and os.cpu_count() == 16\n"
        "    assert process_cpus() == 16  # a module that imports it by name\n"
        "    assert 'torch' not in sys.modules\n"
        "    assert len(os.sched_getaffinity(0)) == 16\n"
        "    assert gc.get_threshold() == (60, 5, 5)\n"
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.hunt_plugin", "-n", "0"]
    args += ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(probe)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
