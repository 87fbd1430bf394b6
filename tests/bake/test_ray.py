"""Builds on Ray Data (bake/ray_engine.py): one local Ray instance for the module, tiny inputs.

Each test checks the store a Ray build leaves against the encoder run now, and against what a
plain build finds in it: the keys are the same, so a plain rebuild encodes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder
from tests.conftest import REPO, invoke, live_features, run_cli
from tests.helpers import assert_store_consistent, stored_features

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
from featbake.bake.ray_engine import RayEngine  # noqa: E402  (after the skip: needs ray)

pytestmark = pytest.mark.slow

#: An import-path encoder (TinyConvEncoder's weights) whose process ends, as a preempted or
#: OOM-killed worker's does, on its second call once a part fragment is sealed in the store
#: named in ``$DIE_ONCE.store``: once per ``$DIE_ONCE`` marker (created atomically).
DYING_ENCODER = """
import glob
import os
import time

from featbake.testing import TinyConvEncoder

CALLS = []


def claimed(marker):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class DyingEncoder(TinyConvEncoder):
    def forward(self, wav):
        CALLS.append(1)
        marker = os.environ.get("DIE_ONCE")
        if marker and len(CALLS) == 2 and os.path.exists(marker + ".store") and claimed(marker):
            with open(marker + ".store") as f:
                sealed = os.path.join(f.read(), "fragments", "*.part.sqlite")
            deadline = time.monotonic() + 120
            while not glob.glob(sealed) and time.monotonic() < deadline:
                time.sleep(0.01)  # the writer seals the first item within milliseconds
            os._exit(1)
        return super().forward(wav)


def build():
    return DyingEncoder()
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A local Ray instance (2 CPUs) for the module; its workers import featbake and the dying
    encoder. Returns the environment that points a featbake process at it."""
    pkg = tmp_path_factory.mktemp("encpkg")
    (pkg / "dyingenc.py").write_text(DYING_ENCODER)
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{pkg}", "DIE_ONCE": str(pkg / "died")}
    context = ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env}
    )
    try:
        yield {"RAY_ADDRESS": context.address_info["address"], "PYTHONPATH": env["PYTHONPATH"]}
    finally:
        ray.shutdown()


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    """Six clips of 0.2-0.6 s."""
    write_audio_folder(tmp_path / "audio", 6, seconds=(0.2, 0.6), seed=7)
    return tmp_path / "audio"


def assert_live(store: Path, root: str, data: Path, encoder: Path) -> int:
    """Every stored item of ``root`` equals the encoder run now; how many there are."""
    got = stored_features(store, root)
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder, data / rel))
    return len(got)


def entries_in_shards(store: Path) -> dict[str, int]:
    """key -> how many shard files on disk hold it (read from the files, not the catalog)."""
    counts: dict[str, int] = {}
    for path in (store / "shards").glob("*/*.safetensors"):
        with ShardReader(path) as reader:
            for name in reader.tensors:
                key = name.split("/")[0]
                counts[key] = counts.get(key, 0) + 1
    return counts


def test_cli_ray_build_stores_what_a_plain_build_finds(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--json"]
    proc = run_cli(*args, "--engine", "ray", "--workers", "2", env=ray_cluster)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["encoded"], report["failed"], report["merged"]) == (6, [], True)
    assert assert_live(store, report["root"], clips, encoder_file) == 6
    assert_store_consistent(store)
    assert not list((store / "fragments").glob("*.sqlite"))  # all merged
    again = invoke(*args)  # a plain build over the Ray build's store
    assert again.returncode == 0, again.stderr
    assert (json.loads(again.stdout)["encoded"], json.loads(again.stdout)["reused"]) == (0, 6)
    assert invoke("verify", "--cache", store).returncode == 0


def test_a_worker_killed_mid_build_loses_and_doubles_nothing(
    ray_cluster: dict[str, str], clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = Path(ray_cluster["PYTHONPATH"].split(os.pathsep)[-1])
    monkeypatch.syspath_prepend(str(pkg))
    store = tmp_path / "store"
    (pkg / "died.store").write_text(str(store))
    # One actor, one input per encoder call and a seal after every one: the actor dies on its
    # second call once its first item is sealed, Ray restarts it and runs the task again, and
    # the task skips that item.
    engine = RayEngine(workers=1, rows_per_task=3)
    report = build(clips, "dyingenc:build", cache=store, engine=engine, batch_size=1,
                   seal_every=1e-3)  # fmt: skip
    assert (pkg / "died").exists(), "no worker died: the test did not test a retry"
    assert (report.encoded, report.failed) == (6, [])
    counts = entries_in_shards(store)
    assert len(counts) == 6 and set(counts.values()) == {1}  # sealed once, never again
    with Catalog(Layout(store), read_only=True) as catalog:
        rows = catalog.conn.execute("SELECT COUNT(*), COUNT(DISTINCT key) FROM features")
        assert rows.fetchone() == (6, 6)
    assert_store_consistent(store)
    assert invoke("verify", "--cache", store).returncode == 0
    live_encoder = save_torchscript(TinyConvEncoder(), tmp_path / "same_weights.pt")
    assert assert_live(store, report.root, clips, live_encoder) == 6


def test_encode_over_read_binary_files_finds_a_folder_builds_keys(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    import featbake.ray

    store = tmp_path / "store"
    ds = ray.data.read_binary_files(str(clips), include_paths=True)
    report = featbake.ray.encode(
        ds, encoder=encoder_file, cache=store, column="bytes", id_column="path", workers=1
    )  # one actor: the read tasks need the other CPU
    assert (report.files, report.encoded, report.failed) == (6, 6, [])
    plain = build(clips, encoder_file, cache=store, workers=0)  # keys hashed from the files
    assert (plain.encoded, plain.reused) == (0, 6)
    assert assert_live(store, plain.root, clips, encoder_file) == 6
    with Catalog(Layout(store), read_only=True) as catalog:  # the Ray root names each file
        items = dict(catalog.root_items(report.root))
    assert {Path(p).name for p in items} == {p.name for p in clips.iterdir()}


def test_an_undecodable_input_is_a_skipped_input(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    (clips / "broken.wav").write_bytes(b"RIFF" + os.urandom(64))
    store = tmp_path / "store"
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--json"]
    result = invoke(*args, "--engine", "ray", "--workers", "1")
    assert result.returncode == 3, result.stderr
    report = json.loads(result.stdout)
    assert [f["path"] for f in report["failed"]] == ["broken.wav"]
    assert report["failed"][0]["cause"] == "data"
    assert report["encoded"] == 6
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr  # one line
    assert assert_live(store, report["root"], clips, encoder_file) == 6
    with Catalog(Layout(store), read_only=True) as catalog:  # a dataset leaves it out, as here
        assert list(catalog.undecodable(report["root"]).values()) == [report["failed"][0]["reason"]]
    # --strict: the actor raises, Ray does not retry an application error, and the build stops
    # with that input's own one line (SourceError's exit code), not Ray's wrapped traceback.
    strict = invoke(*args, "--engine", "ray", "--workers", "1", "--strict")
    assert strict.returncode == 8, strict.stderr
    lines = [line for line in strict.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "broken.wav" in lines[0] and "Ray" not in lines[0], strict.stderr


def test_cli_ray_build_starts_its_own_ray_while_it_hashes(
    clips: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No RAY_ADDRESS: the build starts a local Ray instance on a thread while it lists and
    # hashes the inputs. Ray kills the processes of a local instance when the thread that
    # started them ends, so that thread holds the session until the build is done: a thread
    # that only connected left the build without its cluster (the process ended abruptly).
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    store = tmp_path / "store"
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--json"]
    proc = run_cli(*args, "--engine", "ray", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["encoded"], report["failed"], report["merged"]) == (6, [], True)
    assert assert_live(store, report["root"], clips, encoder_file) == 6
    nothing_to_do = run_cli(*args, "--engine", "ray", "--workers", "1")  # Ray up, then stopped
    assert nothing_to_do.returncode == 0, nothing_to_do.stderr
    assert (
        json.loads(nothing_to_do.stdout)["encoded"],
        json.loads(nothing_to_do.stdout)["reused"],
    ) == (0, 6)


def test_a_local_ray_started_by_a_build_has_the_cpus_this_process_may_use() -> None:
    # Ray's own default counts the machine's CPUs; a build pinned to one CPU (taskset, a
    # cgroup quota) would start actors that fight over it. Its workers inherit the process's
    # environment (no runtime_env): what an import-path encoder on PYTHONPATH needs.
    script = (
        "import os\n"
        "from featbake.bake.ray_engine import ray_session\n"
        "with ray_session(None) as ray:\n"
        "    probe = ray.remote(lambda: os.environ.get('FEATBAKE_PROBE'))\n"
        "    print(int(ray.cluster_resources()['CPU']), ray.get(probe.remote()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_PROBE": "inherited"}
    env.pop("RAY_ADDRESS", None)
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, "-c", script],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "inherited"], proc.stdout
