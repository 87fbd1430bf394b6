"""Threads belong to the user (issue 19, item 1).

featbake used to set torch's thread count to the CPUs it could use for the whole build,
overriding ``OMP_NUM_THREADS=1``, the user's ``torch.set_num_threads(1)`` and an encoder
factory's own setting (silero-vad sets 1): on a node shared with other work, a many-small-ops
model then built several times slower than the user's own loop. Each test here records the
thread count the encoder itself sees while it encodes, and checks the features against
running the encoder now.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import featbake.bake.threads as writer_thread
from featbake.bake.pipeline import build
from featbake.bake.threads import HANDOFF_ITEMS, WriterThread
from featbake.encode.sources import AudioSource, source_for
from featbake.errors import ConfigError, StoreError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, ShardWriter
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.conftest import encoded_rows, invoke, run_cli
from tests.helpers import assert_store_consistent

PROBE = """\
import os
import torch
from featbake.testing import TinyConvEncoder


class ThreadProbe(TinyConvEncoder):
    '''TinyConvEncoder that appends the torch thread count it runs with to $THREADS_LOG.'''

    def forward(self, wav):
        with open(os.environ["THREADS_LOG"], "a") as log:
            log.write(f"{torch.get_num_threads()}\\n")
        return super().forward(wav)


def make():
    return ThreadProbe()


class InferenceProbe(TinyConvEncoder):
    '''TinyConvEncoder that appends 1 to $THREADS_LOG when its input is an inference tensor
    (autograd tracks none of its views), else 0.'''

    def forward(self, wav):
        with open(os.environ["THREADS_LOG"], "a") as log:
            log.write(f"{int(wav.is_inference())}\\n")
        return super().forward(wav)


def make_inference_probe():
    return InferenceProbe()


def make_single_threaded():
    # What silero-vad's loader does: the model's own code sets its thread count.
    torch.set_num_threads(1)
    return ThreadProbe()
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An import-path encoder package; yields the log of thread counts seen by forward()."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "thread_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(pkg))
    log = tmp_path / "threads.log"
    monkeypatch.setenv("THREADS_LOG", str(log))
    before = torch.get_num_threads()
    try:
        yield log
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    data = tmp_path / "audio"
    write_audio_folder(data, 4, seconds=0.3, seed=5)
    return data


def seen(log: Path) -> set[int]:
    """The thread counts the encoder ran with, each call one line."""
    return {int(x) for x in log.read_text().split()}


def assert_serves_live(data: Path, store: Path, encoder: str) -> None:
    """Every item served equals the encoder run now (loaded afresh from its import path)."""
    from thread_probe import make  # type: ignore[import-not-found]

    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    live = make().eval()
    for i in range(len(ds)):
        wav = source_for(Recipe()).load(ds.path(i))
        with torch.inference_mode():
            want = live(wav.unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], want)


def test_the_users_torch_thread_count_is_kept_during_and_after_a_build(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    report = build(clips, "thread_probe:make", cache=tmp_path / "s", workers=0)
    assert report.encoded == 4
    assert seen(probe) == {1}  # featbake used to raise it to the CPUs it may use
    assert torch.get_num_threads() == 1
    assert_serves_live(clips, tmp_path / "s", "thread_probe:make")


@pytest.mark.parametrize(("workers", "batch_size"), [(0, 1), (1, 1), (0, 4)])
def test_the_encoder_gets_inference_tensors_as_in_the_users_own_loop(
    probe: Path, clips: Path, tmp_path: Path, workers: int, batch_size: int
) -> None:
    """Inputs decoded on the decode thread or in a worker, alone or stacked, reach the encoder
    as inference tensors, as in a loop run inside ``inference_mode``: on a normal tensor the
    encoder's views pay autograd's tracking even there (a stepped LSTM cell ran 7% slower)."""
    report = build(
        clips, "thread_probe:make_inference_probe", cache=tmp_path / "s", workers=workers,
        batch_size=batch_size,
    )  # fmt: skip
    assert report.encoded == 4
    assert seen(probe) == {1}
    assert_serves_live(clips, tmp_path / "s", "thread_probe:make_inference_probe")


def test_threads_asked_for_are_used_while_encoding_then_the_users_count_is_back(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    build(clips, "thread_probe:make", cache=tmp_path / "s", workers=0, threads=3)
    assert seen(probe) == {3}
    assert torch.get_num_threads() == 1


def test_an_encoder_factorys_own_thread_count_is_kept(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(2)
    build(clips, "thread_probe:make_single_threaded", cache=tmp_path / "s", workers=0)
    assert seen(probe) == {1}


def test_a_dataset_encoding_misses_leaves_the_users_count_alone(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    ds = CachedFeatureDataset(clips, "thread_probe:make", cache=tmp_path / "s")
    assert ds.stored() == 0
    ds.__getitems__([0, 1])
    ds.flush()
    assert seen(probe) == {1} and torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, 10_000])
def test_threads_out_of_range_are_refused_before_any_work(
    probe: Path, clips: Path, tmp_path: Path, bad: object
) -> None:
    with pytest.raises(ConfigError, match="--threads must be a whole number from 1"):
        build(clips, "thread_probe:make", cache=tmp_path / "s", threads=bad)  # type: ignore[arg-type]
    assert not probe.exists()


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        ({"OMP_NUM_THREADS": "1"}, [], {1}),  # was raised to 2 on this 2-CPU machine
        ({"OMP_NUM_THREADS": "1"}, ["--threads", "2"], {2}),
        ({}, ["--threads", "1"], {1}),
    ],
)
def test_cli_build_keeps_omp_num_threads_and_takes_threads(
    probe: Path,
    clips: Path,
    tmp_path: Path,
    env: dict[str, str],
    args: list[str],
    expected: set[int],
) -> None:
    pythonpath = os.pathsep.join([str(Path(__file__).parents[2]), str(tmp_path / "pkgs")])
    res = run_cli(
        *["build", "-e", "thread_probe:make", "-d", clips, "--cache", tmp_path / "s"],
        *["--workers", "0", *args],
        env={**env, "PYTHONPATH": pythonpath, "THREADS_LOG": str(probe)},
    )
    assert res.returncode == 0, res.stderr
    assert seen(probe) == expected
    assert_serves_live(clips, tmp_path / "s", "thread_probe:make")


# == test_writer_thread ============================================================================
# The build's writer thread (bake/threads.py): features are handed over in batches, and
# every one put is sealed, readable and in the catalog after ``close``; an error in the thread
# reaches the caller.

EFP, RFP = "e" * 64, "r" * 64


def _features(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"{i:064x}": torch.randn(5 + i % 7, 16, generator=g) for i in range(n)}


@pytest.mark.parametrize("n", [1, HANDOFF_ITEMS - 1, HANDOFF_ITEMS, 3 * HANDOFF_ITEMS + 5])
def test_every_feature_put_is_sealed_and_in_the_catalog(
    tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_SECONDS", 3600)  # batches by count only
    layout = Layout(tmp_path / "store").ensure()
    features = _features(n)
    writer = WriterThread(layout, EFP, RFP, shard_bytes=4096)  # several shards from 32 items
    put = 0
    for key, t in features.items():
        writer.put(key, {"": t})
        put += t.nbytes
        if n < HANDOFF_ITEMS:  # nothing handed over yet, and counted as pending (not sealed)
            assert writer.bytes_pending == put and writer.bytes_written == 0
    writer.close()
    assert writer.new_rows == n
    with Catalog(layout) as catalog:
        for key, t in features.items():
            (loc,) = catalog.locate(key)
            with ShardReader(layout.shard_path(loc.shard)) as reader:
                torch.testing.assert_close(reader.read(key, verify="always"), t, rtol=0, atol=0)


def test_a_slow_encoders_features_are_written_as_they_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_SECONDS", 0.05)
    layout = Layout(tmp_path / "store").ensure()
    writer = WriterThread(layout, EFP, RFP, shard_bytes=1)  # a shard per feature
    for i, (key, t) in enumerate(_features(3).items()):
        time.sleep(0.06)  # an encoder slower than the hand-off bound
        writer.put(key, {"": t})
        deadline = time.monotonic() + 10
        while writer.shards < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.shards == i + 1  # sealed before the next one was encoded
    writer.close()


def test_a_failure_in_the_thread_reaches_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_ITEMS", 2)
    writer = WriterThread(Layout(tmp_path / "store").ensure(), EFP, RFP, shard_bytes=1 << 20)
    writer.put("a" * 64, {"": torch.zeros(3, dtype=torch.complex64)})  # no safetensors dtype
    with pytest.raises(ConfigError, match="cannot store dtype"):
        for i in range(500):  # handed over at the second put; raised by a put after the thread
            writer.put(f"{i:064x}", {"": torch.zeros(3)})
            time.sleep(0.01)
    with pytest.raises(ConfigError, match="cannot store dtype"):
        writer.close()  # and again at close, which waits for the thread


class _FlushRefused(Catalog):
    """A build's catalog whose last fragment's upload is refused (an endpoint that stopped
    taking writes)."""

    def flush(self) -> None:
        raise StoreError("cannot reach http://127.0.0.1:9 for s3://b/f/fragments/x; check it")


def test_a_failure_recording_the_last_seal_reaches_the_caller_not_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread records what it sealed in its ``finally``; a failure there escaped the
    thread: ``Exception in thread featbake-writer: Traceback ...`` (20 lines) before the
    build's one line. It is now the error the caller's ``close`` raises."""
    escaped: list[object] = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    layout = Layout(tmp_path / "store").ensure()
    writer = WriterThread(layout, EFP, RFP, shard_bytes=1 << 20, sink=_FlushRefused(layout))
    writer.put("a" * 64, {"": torch.ones(4)})
    with pytest.raises(StoreError, match="cannot reach"):
        writer.close()
    assert escaped == []


# == test_seal_on_time =============================================================================
# Issue 32 item 1: shards are sealed on time as well as on size, so SIGKILL keeps what was
# encoded up to ``--seal-every`` ago. With the default 256 MiB shard size nothing used to be
# sealed before the end of a build: a build killed after 51 s of encoding reran from zero.

EFP, RFP = "e" * 64, "r" * 64


def test_the_writer_thread_seals_a_small_shard_once_it_waited_seal_seconds(
    tmp_path: Path,
) -> None:
    layout = Layout(tmp_path / "store").ensure()
    writer = WriterThread(layout, EFP, RFP, shard_bytes=1 << 30, seal_seconds=0.2)
    try:
        writer.put("a" * 64, {"": torch.ones(4, 8)})
        writer.put("b" * 64, {"": torch.zeros(4, 8)})
        assert writer.bytes_pending > 0 and writer.bytes_written == 0
        deadline = time.monotonic() + 20
        # Nothing more is put: the thread seals on its own, far below the 1 GiB shard size.
        while writer.shards == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.shards == 1 and writer.new_rows == 2
    finally:
        writer.close()
    assert writer.shards == 1  # close had nothing left to seal


def test_shard_writer_seal_seconds_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--seal-every must be positive"):
        ShardWriter(Layout(tmp_path), EFP, RFP, seal_seconds=0)
    bad = invoke("build", "-e", "x:y", "-d", tmp_path, "--seal-every", "nan")
    assert bad.returncode != 0 and "--seal-every" in bad.stderr


def _sealed(cache: Path) -> tuple[int, int]:
    """(feature rows, shards) in the catalog: what a SIGKILL cannot take back."""
    if not (cache / "catalog.sqlite").exists():
        return 0, 0
    conn = sqlite3.connect(cache / "catalog.sqlite", timeout=30)
    try:
        rows = conn.execute("SELECT COUNT(*) FROM features").fetchone()[0]
        shards = conn.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
        return rows, shards
    except sqlite3.OperationalError:
        return 0, 0  # schema not created yet
    finally:
        conn.close()


@pytest.mark.slow
def test_sigkill_keeps_what_was_sealed_on_time_and_the_rerun_encodes_only_the_rest(
    tmp_path: Path, counting_encoder: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "audio"
    n = 40
    write_audio_folder(data, n, seconds=0.3, seed=61)
    cache = tmp_path / "c"
    # The default shard size (256 MiB): only sealing on time seals anything before the end.
    args = ["build", "-e", "countenc:build", "-d", data, "--cache", cache]
    args += ["--batch-size", "1", "--workers", "0", "--seal-every", "0.5"]
    env = {**os.environ, **counting_encoder, "COUNT_DELAY": "0.1", "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featbake", *map(str, args)], stdout=log, stderr=log, env=env
        )
        deadline = time.monotonic() + 120
        while _sealed(cache)[1] < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # what preemption and the OOM killer send
        proc.wait(60)
    assert proc.returncode != 0, (tmp_path / "first.log").read_text()  # killed, not finished
    sealed, shards = _sealed(cache)
    first_run = len(encoded_rows(counting_encoder))
    assert shards >= 3 and 0 < sealed < n <= first_run + n - sealed
    rerun = run_cli(*args, "--json", env={**counting_encoder})
    assert rerun.returncode == 0, rerun.stderr
    assert f'"reused": {sealed}' in rerun.stdout and f'"encoded": {n - sealed}' in rerun.stdout
    # The encoder ran on exactly what was not sealed: what a kill kept is not encoded again.
    assert len(encoded_rows(counting_encoder)) - first_run == n - sealed
    assert_store_consistent(cache)
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[-1])
    ds = CachedFeatureDataset(data, "countenc:build", cache=cache, on_miss="error")
    src, enc = AudioSource(Recipe()), TinyConvEncoder().eval()
    assert len(ds) == n
    for i in range(n):
        with torch.no_grad():
            live = enc(src.load(Path(ds.path(i))).unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], live, rtol=1e-5, atol=1e-6)


# Issue "Nothing wrong served, round four" item 12: a decode worker killed (the OOM killer) put a
# traceback from torch's DataLoader shutdown under the one line, on a busy machine. The error
# kept the loader's iterator alive (its traceback held torch's frames), so its workers were
# shut down later, in ``__del__``, where torch's SIGCHLD handler raised about the dead worker
# still registered. The workers are now shut down (and unregistered) before the error leaves
# ``decoded_items``, with torch's handler off until then.
def test_a_killed_decode_worker_is_reported_after_every_worker_is_shut_down(
    tmp_path: Path,
) -> None:
    import multiprocessing

    from featbake.bake.threads import decoded_items
    from featbake.errors import SourceError

    paths = write_audio_folder(tmp_path / "audio", 40, seconds=0.3, seed=51)
    source = AudioSource(Recipe())
    items = decoded_items([str(p) for p in paths], source, 2, [None] * len(paths))
    with pytest.raises(SourceError, match="a decode worker died") as err:
        for n, _ in enumerate(items):
            if n == 0:
                workers = multiprocessing.active_children()
                assert workers, "no decode worker runs"
                os.kill(workers[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
    # The error is still held (as the CLI holds it while it prints its line): its workers are
    # gone all the same, the dead one reaped, none left for a finalizer to shut down later.
    assert err.value is not None
    assert multiprocessing.active_children() == []
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
