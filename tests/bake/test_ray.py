"""Builds on Ray Data (bake/ray_engine.py): one local Ray instance for the module, tiny inputs.

Each test checks the store a Ray build leaves against the encoder run now, and against what a
plain build finds in it: the keys are the same, so a plain rebuild encodes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import soundfile as sf
import torch

from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from featbake.encode import fingerprints
from featbake.encode.fingerprints import ContainerAsk, DigestAsk
from featbake.errors import BuildIncomplete, ConfigError
from featbake.progress import Progress
from featbake.store.byteplace import BytePlace
from featbake.store.catalog import Catalog
from featbake.store.hash_cache import FileStat
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader
from featbake.testing import (
    TinyConvEncoder,
    make_tone,
    save_torchscript,
    write_audio_folder,
)
from tests.bake.test_batching import (
    LittlePaddingLeaks,
    assert_serves_alone,
    interrupted_after_padded_batches,
)
from tests.bake.test_batching import clips as padding_clips
from tests.conftest import REPO, invoke, live_features, run_cli
from tests.helpers import assert_store_consistent, printed, stored_features, wait_past_racy

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
from featbake.bake.ray_engine import ClusterDigests, RayEngine  # noqa: E402  (needs ray)

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


class PoisonedEncoder(TinyConvEncoder):
    # Ends its process on any input of exactly 4,000 samples (a crash in native code).
    def forward(self, wav):
        if wav.shape[-1] == 4000:
            os._exit(1)
        return super().forward(wav)


def poisoned():
    return PoisonedEncoder()


class SlowEncoder(TinyConvEncoder):
    # A tenth of a second a call: a build long enough to be stopped part way.
    def forward(self, wav):
        time.sleep(0.1)
        return super().forward(wav)


def slow():
    return SlowEncoder()
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A local Ray instance (2 CPUs) for the module; its workers import featbake and the dying
    encoder. Returns the environment that points a featbake process at it.

    The workers inherit the environment this process had when it started the instance (as a
    node's workers inherit their node's), not a job's ``runtime_env``: a job with one cannot use
    the workers Ray starts ahead, nor those another job left idle, so each task and actor of
    each build waited for a process of its own to start and import Ray."""
    pkg = tmp_path_factory.mktemp("encpkg")
    (pkg / "dyingenc.py").write_text(DYING_ENCODER)
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{pkg}", "DIE_ONCE": str(pkg / "died")}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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
    # One actor: what several actors' parts merge into is the claims test's (two actors).
    proc = run_cli(*args, "--engine", "ray", "--workers", "1", env=ray_cluster)
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


def test_a_ray_build_stopped_by_sigterm_says_one_line_and_keeps_what_was_sealed(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM (SLURM, Kubernetes, docker) to a Ray build: Ray's crash handler, installed by
    ``ray.init`` in the build's process, printed a native stack dump ("*** SIGTERM received
    ...", "PC: @ ...") above the build's one ``stopped`` line. Only that line is printed, and
    a rerun encodes only what was not sealed."""
    data = tmp_path / "audio"
    write_audio_folder(data, 40, seconds=0.3, seed=21)
    store = tmp_path / "store"
    args = ["build", "-e", "dyingenc:slow", "-d", data, "--cache", store, "--engine", "ray",
            "--workers", "1", "--batch-size", "1", "--seal-every", "0.001"]  # fmt: skip
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        env = {**os.environ, **ray_cluster, "COLUMNS": "200"}
        env.pop("FEATBAKE_DEBUG", None)
        proc = subprocess.Popen([sys.executable, "-m", "featbake", *map(str, args)],
                                stdout=out, stderr=out, env=env)  # fmt: skip
        try:
            sealed = store / "fragments"
            while proc.poll() is None and not list(sealed.glob("*.part.sqlite")):
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log.read_text()
    assert proc.returncode == 143, output
    assert "stopped: stopped by SIGTERM" in output, output
    assert "SIGTERM received" not in output and "PC: @" not in output, output
    again = invoke(*args[:-8], "--json", env={"PYTHONPATH": ray_cluster["PYTHONPATH"]})
    report = json.loads(again.stdout)
    assert report["reused"] > 0 and report["reused"] + report["encoded"] == 40, report
    live_encoder = save_torchscript(TinyConvEncoder(), tmp_path / "same_weights.pt")
    assert assert_live(store, report["root"], data, live_encoder) == 40


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


def test_an_input_that_ends_every_actor_encoding_it_ends_the_build_in_one_line(
    ray_cluster: dict[str, str], clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray Data restarts a dead actor and tries its task again for ever by default: a build
    with one such input never ended (15 actor processes in 90 s). The task is tried 3 times,
    then the build says so in one line; what was sealed is kept."""
    monkeypatch.syspath_prepend(ray_cluster["PYTHONPATH"].split(os.pathsep)[-1])
    sf.write(clips / "poison.wav", make_tone(0.25, seed=5), 16000)  # 4,000 samples
    engine = RayEngine(workers=1)
    with pytest.raises(BuildIncomplete, match="encoding the inputs failed 3 times"):
        build(clips, "dyingenc:poisoned", cache=tmp_path / "store", engine=engine, batch_size=1)


def test_encode_holds_each_rows_bytes_apart_and_fails_every_row_of_bad_bytes(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Two rows of one id held their bytes under that id: the second row's bytes were
    encoded under the first's key (another clip's features stored for it). Two ids of one
    undecodable input: only the first was named failed, and the encode ended saying a gc had
    deleted the second's features. Now the id is refused in one line (what was encoded kept:
    each key its own bytes' features), and both bad rows fail."""
    import featbake.ray

    store, wavs = tmp_path / "store", sorted(clips.iterdir())
    twice = [{"id": "x", "bytes": w.read_bytes()} for w in wavs[:2]]
    with pytest.raises(ConfigError, match="the id 'x' of column 'id' names inputs of different"):
        featbake.ray.encode(ray.data.from_items(twice), encoder=encoder_file, cache=store,
                            column="bytes", id_column="id", workers=1)  # fmt: skip
    bad = b"RIFF" + bytes(64)
    rows = [{"id": w.name, "bytes": w.read_bytes()} for w in wavs]
    rows += [{"id": "bad_a.wav", "bytes": bad}, {"id": "bad_b.wav", "bytes": bad}]
    report = featbake.ray.encode(ray.data.from_items(rows), encoder=encoder_file, cache=store,
                                 column="bytes", id_column="id", workers=1)  # fmt: skip
    assert sorted(name for name, _ in report.failed) == ["bad_a.wav", "bad_b.wav"]
    assert (report.encoded, report.reused) == (4, 2)  # the first two were kept from before
    assert assert_live(store, report.root, clips, encoder_file) == 6


def test_a_padding_check_failing_in_a_later_task_has_every_padded_item_encoded_alone(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    """Each task encoded again alone only what it had padded itself: with the check failing
    in a later task, 21 of 67 items kept features of padded batches (the plain build redoes
    all it padded). The driver now has every item stored padded encoded again alone by the
    workers once a check failed on any of them."""
    data, module = padding_clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder = save_torchscript(module, tmp_path / "leaky.pt")
    report = build(data, encoder, cache=tmp_path / "store", batch_size=3, batching="padded",
                   engine=RayEngine(workers=1, rows_per_task=3))  # fmt: skip
    assert "encoded again alone" in report.batching_note, report.batching_note
    assert_serves_alone(data, module, encoder, cache=tmp_path / "store")


def test_a_ray_rerun_encodes_again_alone_what_a_stopped_build_stored_padded(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    """A build stopped before its late batch failed the padding check left 9 items stored
    padded; a rerun on Ray, whose worker's check failed, had only what its own tasks padded
    encoded again. The driver reads the stopped build's record and has those 9 encoded again
    alone by the workers too."""
    data, module = padding_clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    interrupted_after_padded_batches(data, encoder, store)
    report = build(data, encoder, cache=store, batch_size=3, batching="padded",
                   engine=RayEngine(workers=1, rows_per_task=3))  # fmt: skip
    assert report.reused == 9 and "encoded again alone" in report.batching_note, report
    assert_serves_alone(data, module, encoder, cache=store)


def test_a_ray_driver_stopped_after_a_workers_padding_check_failed_leaves_that_recorded(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    """A padded build on Ray, whose last task's check failed, stopped (Ctrl-C) as that task's
    result arrived, before the driver had the other tasks' padded items encoded again: its
    record says a check failed, so a plain rerun encodes them again alone, and every item is
    served equal to the encoder run on it alone. Before, the driver recorded the failure only
    once every task had returned: the record said none had failed, and the rerun, with
    nothing to encode, kept what the other tasks stored padded."""
    data, module = padding_clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"

    def stop(p: Progress) -> None:
        if p.phase == "encode" and p.done >= 12:  # every task returned, none redone yet
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(data, encoder, cache=store, batch_size=3, batching="padded", progress=stop,
              engine=RayEngine(workers=1, rows_per_task=3))  # fmt: skip
    report = build(data, encoder, cache=store, workers=0, batch_size=3, batching="padded")
    assert report.ok and "earlier run of this build found padded" in report.batching_note, report
    assert_serves_alone(data, module, encoder, cache=store)
    # The same on Ray: the record says a check failed, so its workers never pad.
    interrupted_after_padded_batches(data, encoder, tmp_path / "second", at=12)
    report = build(data, encoder, cache=tmp_path / "second", batch_size=3, batching="padded",
                   engine=RayEngine(workers=1, rows_per_task=3))  # fmt: skip
    assert report.ok and report.batching == BatchingMode.EXACT, report
    assert "encoded again alone" not in report.batching_note, report
    assert_serves_alone(data, module, encoder, cache=tmp_path / "second")


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
    # Nothing to do: no Ray is started or connected to (a local instance's start and stop
    # are seconds of a no-op rebuild). The address given is a socket of the test's, which
    # would see any connection to it (featbake's check of the port, or ray.init's).
    with socket.create_server(("", 0)) as listener:  # every interface: Ray dials the node's
        listener.setblocking(False)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        nothing_to_do = run_cli(*args, "--engine", "ray", "--workers", "1",
                                "--ray-address", address)  # fmt: skip
        assert nothing_to_do.returncode == 0, nothing_to_do.stderr
        with pytest.raises(BlockingIOError):  # nobody dialled it
            listener.accept()
    assert (
        json.loads(nothing_to_do.stdout)["encoded"],
        json.loads(nothing_to_do.stdout)["reused"],
    ) == (0, 6)


def closed_address() -> str:
    """``127.0.0.1:port`` where nothing listens (a port the kernel gave, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_ray_address_nothing_answers_at_is_one_line_at_once_and_loses_nothing(
    clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    # ray.init retries such an address for about 13 minutes before it raises; the build
    # tries the port first. The first build finds 6 new inputs: Ray is needed, and refused.
    store = tmp_path / "store"
    address = closed_address()
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--json"]
    # A process of its own: this one may hold the module's Ray session, which a build uses.
    proc = run_cli(*args, "--engine", "ray", "--workers", "1", "--ray-address", address)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Ray did not connect to '{address}'" in errors[0], errors[0]
    assert "nothing answers at" in errors[0] and "--ray-address" in errors[0], errors[0]
    plain = invoke(*args)  # nothing was published: a plain build encodes all 6
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["encoded"] == 6


@pytest.mark.parametrize("address", ["local", "auto", "ray://head:10001", "head:port", ":80"])
def test_only_a_host_and_port_is_dialled_before_ray_init(address: str) -> None:
    from featbake.bake.ray_engine import nothing_answers

    assert nothing_answers(ray, address) is None  # Ray's own to read: no connect tried


def test_a_name_that_does_not_resolve_answers_nothing() -> None:
    from featbake.bake.ray_engine import nothing_answers

    why = nothing_answers(ray, "no-such-host.invalid:6379")  # .invalid never resolves
    assert why is not None and why.startswith("nothing answers at no-such-host.invalid:6379")


def test_an_address_of_another_cluster_than_the_processs_ray_session_is_refused(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    # This process's Ray is initialised (the module's instance). A build given --ray-address
    # of another cluster used that session and encoded on it; now one line, exit 2, nothing
    # published. The session's own address (as given, and as localhost) is the same cluster.
    from featbake.bake.ray_engine import another_cluster

    own = ray_cluster["RAY_ADDRESS"]
    port = own.rpartition(":")[2]
    assert another_cluster(ray, own) is None
    assert another_cluster(ray, f"localhost:{port}") is None
    assert another_cluster(ray, None) is None and another_cluster(ray, "auto") is None
    store = tmp_path / "store"
    address = closed_address()
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--json"]
    r = invoke(*args, "--engine", "ray", "--workers", "1", "--ray-address", address)
    assert r.returncode == 2, printed(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, printed(r)
    assert "already initialised in this process" in errors[0], errors[0]
    assert f"({address})" in errors[0] and "ray.shutdown()" in errors[0], errors[0]
    plain = invoke(*args)  # nothing was published: a plain build encodes all 6
    assert plain.returncode == 0 and json.loads(plain.stdout)["encoded"] == 6, printed(plain)


def test_a_ray_build_of_inputs_the_hash_cache_knows_connects_to_encode(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # A plain build filled the hash cache: a Ray build with other weights hashes nothing new,
    # so Ray is first asked for by the encoding, and the features are those weights' own.
    store = tmp_path / "store"
    wait_past_racy(clips)  # else the rebuild hashes every input again, by the racy rule
    build(clips, encoder_file, cache=store, workers=0)
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    asked = asked_of_the_digester(monkeypatch)
    report = build(clips, other, cache=store, engine=RayEngine(workers=1))
    assert (asked, report.encoded, report.reused, report.failed) == ([], 6, 0, [])
    assert assert_live(store, report.root, clips, other) == 6


def test_a_local_ray_started_by_a_build_has_the_cpus_this_process_may_use() -> None:
    # Ray's own default counts the machine's CPUs; a build pinned to one CPU (taskset, a
    # cgroup quota) would start actors that fight over it. Its workers inherit the process's
    # environment (no runtime_env): what an import-path encoder on PYTHONPATH needs. Ray's
    # crash handler is kept out of the session's ray.init, and only of it (later ray.init
    # calls in the process install it as before).
    script = (
        "import os\n"
        "from ray._private import ray_constants\n"
        "from featbake.bake.ray_engine import ray_session\n"
        "with ray_session(None) as ray:\n"
        "    probe = ray.remote(lambda: os.environ.get('FEATBAKE_PROBE'))\n"
        "    print(int(ray.cluster_resources()['CPU']), ray.get(probe.remote()))\n"
        "print(ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_PROBE": "inherited"}
    env.pop("RAY_ADDRESS", None)
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, "-c", script],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "inherited", "False"], proc.stdout


#: Folders whose files this process's opens are recorded (see :func:`opens_under`).
WATCHED: list[str] = []
OPENED: list[str] = []
HOOKED: list[bool] = []


def _record_open(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and WATCHED and isinstance(args[0], (str, os.PathLike)):
        path = os.fspath(args[0])
        if isinstance(path, str) and path.startswith(tuple(WATCHED)):
            OPENED.append(path)


@contextlib.contextmanager
def opens_under(folder: Path) -> Iterator[list[str]]:
    """The files under ``folder`` this process opens meanwhile (Python's ``open`` audit
    event: ``open()``, ``os.open``, ``io.open``; an audit hook cannot be removed, so one is
    added once and records only while a folder is watched)."""
    if not HOOKED:
        sys.addaudithook(_record_open)
        HOOKED.append(True)
    WATCHED[:] = [str(folder), str(folder.resolve())]
    OPENED.clear()
    try:
        yield OPENED
    finally:
        WATCHED.clear()


def rewritten_after_its_stat(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """Each build's hashing finds ``victim`` rewritten (two bytes longer) after it stat'ed it,
    as a file written by another program during the build is: whoever reads it for its digest
    reads another version than the one stat'ed, and the input fails with why."""
    real = fingerprints.stat_inputs

    def stat_then_rewrite(*args: object) -> dict[str, str]:
        failed = real(*args)  # type: ignore[arg-type]
        if victim.exists():  # no open: the audit hook stays quiet
            os.truncate(victim, victim.stat().st_size + 2)
        return failed

    monkeypatch.setattr(fingerprints, "stat_inputs", stat_then_rewrite)


def asked_of_the_digester(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The inputs a Ray build's digester is asked for (those the hash cache did not know)."""
    asked: list[str] = []
    real = ClusterDigests.__call__

    def counted(self: ClusterDigests, place: BytePlace, asks: Sequence[DigestAsk]) -> object:
        asked.extend(a.path for a in asks)
        return real(self, place, asks)

    monkeypatch.setattr(ClusterDigests, "__call__", counted)
    return asked


def root_keys(store: Path, root: str) -> dict[str, str]:
    with Catalog(Layout(store), read_only=True) as catalog:
        return dict(catalog.root_items(root))


def test_a_ray_build_of_a_manifest_hashes_the_files_its_rows_name_on_the_cluster(
    ray_cluster: dict[str, str],
    clips: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A JSONL manifest: a row per clip whole, and two segments of one of them. Each file is
    # read and hashed once, by a Ray task; the driver opens none (a segmented file's audio
    # header, for the bounds, is read by libsndfile, not through Python). Keys equal a plain
    # build's, and each whole-file row is the encoder run now on its file.
    names = sorted(p.name for p in clips.iterdir())
    rows = [{"id": n, "path": str(clips / n)} for n in names]
    rows += [{"id": f"seg{i}", "path": str(clips / names[0]), "start": i * 0.05,
              "end": i * 0.05 + 0.1} for i in range(2)]  # fmt: skip
    manifest = tmp_path / "rows.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wait_past_racy(clips)
    local = build(manifest, encoder_file, cache=tmp_path / "local", workers=0)
    asked = asked_of_the_digester(monkeypatch)
    store = tmp_path / "store"
    engine = RayEngine(workers=1, cluster_hashing_from=1)
    with opens_under(clips) as opened:
        report = build(manifest, encoder_file, cache=store, engine=engine)
    assert opened == [], "the driver read inputs"
    assert sorted(asked) == sorted(str(clips / n) for n in names)  # each file once
    assert (report.failed, report.encoded, local.encoded) == ([], 8, 8)
    keys = root_keys(store, report.root)
    assert keys == root_keys(tmp_path / "local", local.root)
    got = stored_features(store, report.root)
    for n in names:
        torch.testing.assert_close(got[n][""], live_features(encoder_file, clips / n))
    assert_store_consistent(store)


def container_folder(container: str, clips: Path, folder: Path) -> tuple[Path, list[Path]]:
    """A folder of two containers of ``clips`` and the clips a build stores, in order: parquet
    files (``b.parquet``'s column chunks overwritten, its footer whole: the scan reads it, no
    cell can be read) or tar shards (``shard-001.tar`` cut inside its last member)."""
    import pyarrow.parquet as pq

    from tests.encode.test_containers import write_audio_parquet

    files = sorted(clips.iterdir())
    folder.mkdir()
    if container == "parquet":
        write_audio_parquet(folder / "a.parquet", [f.read_bytes() for f in files[:4]])
        bad = write_audio_parquet(folder / "b.parquet", [f.read_bytes() for f in files[4:]])
        chunk = pq.ParquetFile(bad).metadata.row_group(0).column(0)
        data = bytearray(bad.read_bytes())
        start = chunk.dictionary_page_offset or chunk.data_page_offset  # the chunk's first page
        end = start + chunk.total_compressed_size // 2
        data[start + 20 : end] = b"\xff" * (end - start - 20)
        bad.write_bytes(bytes(data))
        return folder, files[:4]
    for name, part in (("shard-000.tar", files[:4]), ("shard-001.tar", files[4:])):
        with tarfile.open(folder / name, "w") as tar:
            for f in part:
                tar.add(f, arcname=f.name)
    torn = folder / "shard-001.tar"
    whole = torn.read_bytes()
    last = files[-1].read_bytes()
    torn.write_bytes(whole[: whole.find(last) + len(last) // 2])  # inside the last clip
    return folder, files[:-1]


def container_reads_here(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The containers whose members or cells this process reads for their digests (a local
    tar's member digests, a table file's cell digests: pyarrow opens files in C++, out of the
    audit hook's sight). Ray's workers are other processes, unpatched."""
    from featbake.encode import tables
    from featbake.store.byteplace import LocalFiles

    read: list[str] = []
    members, cells = LocalFiles.member_digests, tables.cell_digests

    def tar_read(self: LocalFiles, tar: str, *args: Any) -> Any:
        read.append(tar)
        return members(self, tar, *args)

    def table_read(f: Any, *args: Any) -> Any:
        read.append(f.path)
        return cells(f, *args)

    monkeypatch.setattr(LocalFiles, "member_digests", tar_read)
    monkeypatch.setattr(tables, "cell_digests", table_read)
    return read


def containers_asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The containers a Ray build's container reader is asked for (those holding members or
    cells the hash cache did not know)."""
    asked: list[str] = []
    real = ClusterDigests.containers

    def counted(self: ClusterDigests, asks: Sequence[ContainerAsk]) -> Any:
        asked.extend(a.container for a in asks)
        return real(self, asks)

    monkeypatch.setattr(ClusterDigests, "containers", counted)
    return asked


@pytest.mark.parametrize("container", ["parquet", "tar"])
def test_a_ray_build_of_a_table_or_a_tar_hashes_its_containers_on_the_cluster(
    ray_cluster: dict[str, str],
    clips: Path,
    encoder_file: Path,
    tmp_path: Path,
    container: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two parquet files or two tar shards, new to the hash cache: Ray tasks read their cells
    # or members (by what the driver's scan found: the column and kind, the member offsets),
    # the driver reads none. A torn member and a file whose cells cannot be read fail, named,
    # as a plain build names them. The workers decode each cell by what came with it (a table
    # build failed every row on Ray before: "not a scanned file of the table").
    data, good = container_folder(container, clips, tmp_path / "data")
    wait_past_racy(data)  # else a rebuild hashes every member again, by the racy rule
    local = build(data, encoder_file, cache=tmp_path / "local", workers=0)
    read_here = container_reads_here(monkeypatch)
    asked = containers_asked(monkeypatch)
    store = tmp_path / "store"
    engine = RayEngine(workers=1, cluster_hashing_from=1)
    report = build(data, encoder_file, cache=store, engine=engine)
    assert read_here == [], "the driver read containers to hash them"
    assert sorted(asked) == sorted(str(p) for p in data.iterdir())
    assert report.failed and sorted(report.failed) == sorted(local.failed)
    assert (report.encoded, local.encoded) == (len(good), len(good))
    assert root_keys(store, report.root) == root_keys(tmp_path / "local", local.root)
    got = stored_features(store, report.root)
    assert len(got) == len(good)
    for (_, parts), f in zip(sorted(got.items()), good, strict=True):  # rows in file order
        torch.testing.assert_close(parts[""], live_features(encoder_file, f))
    assert_store_consistent(store)
    # The driver filled the hash cache from what the tasks returned: a rebuild asks only for
    # the container of what failed (read again, as a plain rebuild reads it), and reads none.
    asked.clear()
    again = build(data, encoder_file, cache=store, engine=engine)
    bad = {p for p in map(str, data.iterdir()) if p.endswith(("b.parquet", "shard-001.tar"))}
    assert (set(asked), read_here, again.encoded, again.reused) == (bad, [], 0, len(good))


def test_a_ray_rebuild_from_another_directory_encodes_a_row_whose_clip_only_it_holds(
    ray_cluster: dict[str, str], encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A table of path-only cells built from its project, then rebuilt on Ray from another
    # directory that holds a new row's clip (the other rows' clips are where the first build
    # read them): the workers look where the driver looked, in its order, and encode every
    # row as a plain build does. Before, they looked in the first build's directory alone and
    # failed the new row ("names no file").
    from tests.encode.test_tables_audio_paths import (
        PathTable,
        clip_tensor,
        encoder_now,
        only_path,
        run_now,
        write_clip,
        write_path_parquet,
    )

    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    build(t.table, encoder_file, cache=store, workers=0, column="audio")
    job = tmp_path / "job"
    new = write_clip(job / "clips" / "new.wav", 77)
    cells = [c for i, c in enumerate(t.cells()) if i not in (3, 5)]
    write_path_parquet(t.table, [*cells, only_path("clips/new.wav")])
    monkeypatch.chdir(job)
    report = build(t.table, encoder_file, cache=store, engine=RayEngine(workers=1), column="audio")
    assert (report.encoded, report.reused, report.failed) == (1, 4, [])
    module = encoder_now(encoder_file)
    stored = stored_features(store, report.root)
    for n, clip in enumerate([t.files[0], t.files[1], t.files[2], t.files[4], new]):
        assert torch.equal(stored[f"train.parquet:{n}"][""], run_now(module, clip_tensor(clip)))


def test_a_ray_build_of_a_manifests_texts_equals_transformers_run_now(
    ray_cluster: dict[str, str], tmp_path: Path
) -> None:
    # Each row's text travels with it to the worker, which never parsed the manifest (every
    # row failed there before: "not a row of the manifest now").
    from featbake import CachedFeatureDataset
    from tests.encode.test_text import (
        TEXTS,
        TextModel,
        assert_rows_served_equal,
        save_bert,
        write_captions,
    )

    bert = TextModel(save_bert(tmp_path / "bert"), "bert", 64)
    manifest = tmp_path / "captions.jsonl"
    write_captions(manifest)
    store = tmp_path / "store"
    report = build(
        manifest, bert.folder, cache=store, column="caption", engine=RayEngine(workers=1)
    )
    assert (report.failed, report.encoded) == ([], len(TEXTS))
    ds = CachedFeatureDataset(
        manifest, encoder=bert.folder, cache=store, source="text", column="caption",
        on_miss="error",
    )  # fmt: skip
    assert_rows_served_equal(ds, bert, TEXTS)


def test_a_ray_build_hashes_its_new_inputs_on_the_cluster_and_the_driver_reads_none(
    ray_cluster: dict[str, str],
    clips: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A first build: no input is in the hash cache. Two more inputs fail, each as a plain
    # build says: a link to nothing (at the scan) and a file rewritten after its stat (read by
    # a Ray task, which finds another version than the driver stat'ed).
    os.symlink(tmp_path / "nowhere.wav", clips / "dangling.wav")
    write_audio_folder(tmp_path / "more", 1, seconds=0.3, seed=9)
    victim = clips / "changed.wav"
    os.replace(next((tmp_path / "more").iterdir()), victim)
    wait_past_racy(clips)  # else a rebuild hashes every input again, by the racy rule
    rewritten_after_its_stat(monkeypatch, victim)
    local = build(clips, encoder_file, cache=tmp_path / "local", workers=0)
    asked = asked_of_the_digester(monkeypatch)
    store = tmp_path / "store"
    engine = RayEngine(workers=1, cluster_hashing_from=1)  # 7 to hash: on the cluster
    with opens_under(clips) as opened:
        report = build(clips, encoder_file, cache=store, engine=engine)
    assert opened == [], "the driver read inputs"
    assert sorted(asked) == sorted(str(p) for p in clips.iterdir() if p.name != "dangling.wav")
    assert sorted(report.failed) == sorted(local.failed)
    assert {name for name, _ in report.failed} == {"changed.wav", "dangling.wav"}
    assert (report.encoded, local.encoded) == (6, 6)
    assert root_keys(store, report.root) == root_keys(tmp_path / "local", local.root)
    assert assert_live(store, report.root, clips, encoder_file) == 6
    assert_store_consistent(store)
    # The driver filled the hash cache from what the tasks returned: each input's digest of
    # its bytes, at its stat. A rebuild (the rewritten file gone) reads nothing.
    victim.unlink()
    good = sorted(p for p in clips.iterdir() if p.name != "dangling.wav")
    with Catalog(Layout(store), read_only=True) as catalog:
        cached = catalog.cached_hashes([str(p) for p in good])
    assert {p: (cached[str(p)].stat, cached[str(p)].sha256) for p in good} == {
        p: (FileStat.of(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in good
    }
    asked.clear()
    with opens_under(clips) as opened:
        again = build(clips, encoder_file, cache=store, engine=engine)
    assert (asked, opened, again.encoded, again.reused) == ([], [], 0, 6)


def _dies() -> None:
    os._exit(3)  # the worker process ends, as one the kernel's OOM killer took


def _raises() -> None:
    raise ValueError("not featbake's\nsecond line")


@pytest.mark.parametrize("task", [_dies, _raises])
def test_a_hashing_task_ray_cannot_finish_is_one_line_and_cancels_the_rest(
    ray_cluster: dict[str, str], task: object
) -> None:
    from featbake.bake.ray_engine import as_returned
    from featbake.errors import BuildIncomplete

    task.__module__ = "__main__"  # type: ignore[attr-defined]  # sent by value, not imported
    bad = ray.remote(max_retries=0)(task).remote()
    with pytest.raises(BuildIncomplete) as raised:
        list(as_returned(ray, [bad]))
    message = str(raised.value)
    assert "\n" not in message and "rerun the build" in message, message
    assert ("ValueError: not featbake's" in message) == (task is _raises), message


def test_encode_that_a_gc_raced_says_so_and_its_rerun_encodes_what_went(
    ray_cluster: dict[str, str],
    clips: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round eight, upkeep: ``featbake.ray.encode`` over files whose features a dropped root
    left stored. Its actors find all 6 stored and reuse them; an eager gc runs once every
    task has returned, before the driver seals the root's ``done`` fragment. Before, nothing
    claimed or looked again at what the actors found: gc deleted the 6 rows and the merge
    published a root with all 6 missing, saying nothing."""
    import featbake.ray
    from featbake.bake import ray_engine
    from featbake.errors import StoreError
    from featbake.upkeep import GcOptions, drop_root, execute_gc, plan_gc

    store = tmp_path / "store"
    drop_root(store, build(clips, encoder_file, cache=store, workers=0).root)
    publish = ray_engine._publish
    deleted: list[int] = []

    def gc_then_publish(*args: Any) -> None:
        if not deleted:
            eager = GcOptions(grace=0.0, retention=0.0)
            deleted.append(execute_gc(plan_gc(store, eager)).rows_deleted)
        publish(*args)

    monkeypatch.setattr(ray_engine, "_publish", gc_then_publish)
    ds = ray.data.read_binary_files(str(clips), include_paths=True)
    args = {"encoder": encoder_file, "cache": store, "column": "bytes", "id_column": "path"}
    with pytest.raises(StoreError, match="run it again: it encodes them") as raised:
        featbake.ray.encode(ds, **args, workers=1)
    assert deleted == [6] and "\n" not in str(raised.value)
    again = featbake.ray.encode(ds, **args, workers=1)
    assert (again.encoded, again.failed) == (6, [])
    assert len(stored_features(store, again.root)) == 6
    plain = build(clips, encoder_file, cache=store, workers=0)
    assert (plain.encoded, plain.reused) == (0, 6)
    assert assert_live(store, plain.root, clips, encoder_file) == 6


def test_a_ray_build_leaves_no_claim_and_a_gc_after_it_frees_a_dropped_root(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round nine, claims: one review read that each actor's :class:`PartEncoder` claims the
    keys of every task (``FragmentCatalog.present_keys`` -> ``claim.cover``) and lets the
    claim go only when the actor exits, pinning them for up to ``STALE_AFTER_S`` after the
    build (for ever while actors live); another, that only the driver claims. Settled here
    against Ray: three of the six clips' features are stored beforehand (a root dropped), so
    the driver reuses them and the actors encode the rest. Once the build returns (this Ray
    and its workers still up) no claim is left naming any key, and a gc right after the
    build's root is dropped deletes all six rows: nothing pins them."""
    from featbake.store.claims import claims_dir, read_claims
    from featbake.upkeep import GcOptions, drop_root, execute_gc, plan_gc

    store = tmp_path / "store"
    half = tmp_path / "half"
    half.mkdir()
    for clip in sorted(clips.iterdir())[:3]:
        (half / clip.name).write_bytes(clip.read_bytes())
    drop_root(store, build(half, encoder_file, cache=store, workers=0).root)
    report = build(clips, encoder_file, cache=store, engine=RayEngine(workers=2, rows_per_task=1))
    assert (report.encoded, report.reused, report.failed) == (3, 3, [])
    assert read_claims(Layout(store)) == []  # the driver's claim went with its done fragment
    assert list(claims_dir(Layout(store)).glob("*.claim")) == []
    # Every claim written is logged in the index until a gc: one, the driver's; no actor's.
    assert len(set((claims_dir(Layout(store)) / "index").read_text().split())) == 1
    drop_root(store, report.root)
    assert execute_gc(plan_gc(store, GcOptions(grace=0.0, retention=0.0))).rows_deleted == 6


def test_a_json_build_whose_actors_die_prints_only_json_on_stdout(
    ray_cluster: dict[str, str], clips: Path, tmp_path: Path
) -> None:
    """Ray prints a dead worker's notice (``(raylet) A worker died ...``) to the driver's
    stdout: ``--json``'s stdout held lines no JSON reader takes. They now go to stderr, and a
    build that ends in an error prints nothing to stdout."""
    sf.write(clips / "poison.wav", make_tone(0.25, seed=5), 16000)  # ends every actor
    args = ["-e", "dyingenc:poisoned", "-d", clips, "--cache", tmp_path / "store"]
    proc = run_cli("build", *args, "--engine", "ray", "--workers", "1", "--batch-size", "1",
                   "--json", env=ray_cluster)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "A worker died" in proc.stderr and "encoding the inputs failed 3 times" in proc.stderr
    assert proc.stdout == ""  # a failed build prints no report


def test_workers_asking_gpus_no_node_has_are_refused_before_anything_waits(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Round 21: ``--gpus-per-worker 1`` on a Ray instance without GPUs printed the hashing's
    progress and then waited for ever (Ray Data waits for a GPU the instance will never
    have; its warnings are quieted). A cluster this process started is refused in one line
    before anything is mapped; one connected to (an autoscaler may add GPU nodes) is warned
    of. The module's instance, started here, has 2 CPUs and no GPU."""
    import featbake.ray
    from featbake.bake import ray_engine

    store = tmp_path / "store"
    ds = ray.data.read_binary_files(str(clips), include_paths=True)
    asks_a_gpu = RayEngine(workers=1, gpus_per_worker=1)
    with pytest.raises(ConfigError, match="fit no node"):  # refused before mapping: no wait
        asks_a_gpu.on_actors(ray, ds, ray_engine.BytesActor, (None, "bytes", None), 1)
    with pytest.raises(ConfigError) as raised:
        featbake.ray.encode(ds, encoder=encoder_file, cache=store, column="bytes", workers=1,
                            num_gpus=1)  # fmt: skip
    line = str(raised.value)
    assert "\n" not in line and "1 GPU each (1 workers" in line, line
    assert "it has 0 GPUs in all, at most 0 on a node (and 2 CPUs)" in line, line
    with pytest.raises(ConfigError, match="fit no node of the Ray cluster"):
        build(clips, encoder_file, cache=store, engine=RayEngine(workers=1, gpus_per_worker=0.5))
    monkeypatch.setattr(ray_engine, "started_here", lambda ray: False)  # as if connected to it
    with pytest.warns(UserWarning, match="waits for the cluster to add such a node"):
        asks_a_gpu.on_actors(ray, ds, ray_engine.BytesActor, (None, "bytes", None), 1)
    RayEngine(workers=8).check_placeable(ray)  # more workers than CPUs: those that fit run all


def test_cli_ray_build_asking_gpus_of_its_local_ray_without_any_is_one_line(
    clips: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The build starts its own local instance (no RAY_ADDRESS): it has no GPU, and never will.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    store = tmp_path / "store"
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--engine", "ray"]
    proc = run_cli(*args, "--workers", "1", "--gpus-per-worker", "1", timeout=240)
    assert proc.returncode == 2, printed(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, printed(proc)
    assert "1 GPU each (1 workers" in errors[0] and "it has 0 GPUs" in errors[0], errors[0]
    plain = invoke("build", "-e", encoder_file, "-d", clips, "--cache", store, "--json")
    assert plain.returncode == 0 and json.loads(plain.stdout)["encoded"] == 6, printed(plain)


def _no_such_column(batch: dict[str, Any]) -> dict[str, Any]:
    return {"result": batch["no_such_column"]}  # a KeyError: not featbake's


def test_encode_given_a_column_the_dataset_lacks_or_a_file_gone_says_so_in_one_line(
    ray_cluster: dict[str, str], clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round 21: a mistyped column or id_column came back as Ray's traceback of 23 lines in
    colour (a KeyError in each actor), and a file of ``read_binary_files`` deleted before the
    encode as one of 55 lines. The names are checked against the dataset's schema first; any
    other error of a task is one featbake line naming what the task raised."""
    import featbake.ray
    from featbake.bake.ray_engine import _results

    args = {"encoder": encoder_file, "cache": tmp_path / "store", "workers": 1}
    ds = ray.data.read_binary_files(str(clips), include_paths=True)
    for typo, line in [
        ({"column": "byte"}, "column='byte' is not a column of the dataset (its columns: bytes, "),
        ({"id_column": "paths"}, "id_column='paths' is not a column of the dataset"),
    ]:
        with pytest.raises(ConfigError) as raised:
            featbake.ray.encode(ds, **{"column": "bytes", "id_column": "path", **typo, **args})
        assert str(raised.value).startswith(line) and "\n" not in str(raised.value), raised.value
    gone = sorted(clips.iterdir())[1]
    gone.unlink()  # after the dataset listed it
    with pytest.raises(BuildIncomplete) as lost:
        featbake.ray.encode(ds, column="bytes", id_column="path", **args)
    message = str(lost.value)
    assert "\n" not in message and "\x1b" not in message, message
    assert "failed (FileNotFoundError: " in message and gone.name in message, message
    _no_such_column.__module__ = "__main__"  # sent by value, not imported
    mapped = ray.data.from_items([{"x": 1}]).map_batches(_no_such_column)
    with pytest.raises(BuildIncomplete, match=r"failed \(KeyError: 'no_such_column'\); what"):
        list(_results(mapped))


def test_cli_ray_build_whose_ray_temp_folder_cannot_be_made_is_one_line(
    clips: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 21: a local Ray that could not make its session folder ($RAY_TMPDIR a file, a
    read-only /tmp) ended the build in "internal error: NotADirectoryError ... please report
    it", exit 1. Now the build's own line: the folder, and that RAY_TMPDIR chooses it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    not_a_folder = tmp_path / "afile"
    not_a_folder.write_text("x")
    store = tmp_path / "store"
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", store, "--engine", "ray"]
    proc = run_cli(*args, "--workers", "1", env={"RAY_TMPDIR": str(not_a_folder)})
    assert proc.returncode == 2, printed(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, printed(proc)
    assert f"temp folder {not_a_folder / 'ray'} (Not a directory)" in errors[0], errors[0]
    assert "set RAY_TMPDIR to a writable folder" in errors[0], errors[0]
