"""How a Ray build sizes its tasks (featbake.bake.ray_engine.rows_per_task): pure, so checked
over every build size here, without Ray; and what a hashing task's process imports (a fresh
interpreter given the task as Ray sends it: pickled by its module's name)."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.bake.engine_wire import ENGINE_PROTOCOL
from featbake.bake.ray_engine import (
    MOST_ROWS_PER_TASK,
    ROWS_PER_TASK,
    TASKS_PER_WORKER,
    RayEngine,
    digest_batch,
    read_batch,
    rows_per_task,
)
from featbake.encode.fingerprints import (
    ContainerAsk,
    ContainerDigested,
    DigestAsk,
    Digested,
    digest_here,
)
from featbake.store.byteplace import BytePlace, Digest
from featbake.store.catalog import Catalog
from featbake.store.claims import this_host
from featbake.store.hash_cache import FileStat
from featbake.store.layout import Layout
from tests.bake.test_ray_hashing import containers, scanned_paths
from tests.conftest import REPO


@settings(max_examples=500, deadline=None)
@given(inputs=st.integers(0, 10**9), workers=st.integers(1, 4096))
def test_tasks_are_sized_to_the_build_within_their_bounds(inputs: int, workers: int) -> None:
    rows = rows_per_task(inputs, workers)
    assert ROWS_PER_TASK <= rows <= MOST_ROWS_PER_TASK
    aim = workers * TASKS_PER_WORKER  # tasks an even split would make
    if rows == ROWS_PER_TASK:  # a small build: tasks of the least size, no more than aimed at
        assert inputs <= ROWS_PER_TASK * aim or ROWS_PER_TASK == MOST_ROWS_PER_TASK
    elif rows == MOST_ROWS_PER_TASK:  # a huge one: the largest tasks, more of them
        assert inputs > (MOST_ROWS_PER_TASK - 1) * aim
    else:  # the smallest size that makes no more than the tasks aimed at
        assert (rows - 1) * aim < inputs <= rows * aim
    assert rows_per_task(inputs + 1, workers) >= rows  # more inputs never make smaller tasks


def test_a_large_build_makes_a_thousand_tasks_not_a_hundred_and_fifty_thousand() -> None:
    assert rows_per_task(10_000_000, 8) == MOST_ROWS_PER_TASK
    assert -(-10_000_000 // rows_per_task(10_000_000, 8)) == 1221  # was 156,250 tasks of 64
    assert rows_per_task(256, 2) == ROWS_PER_TASK  # a small build keeps its small tasks
    assert rows_per_task(200_000, 2) == 3125  # 64 tasks: 32 an actor


@given(asked=st.integers(1, 10**6), inputs=st.integers(0, 10**7))
def test_an_asked_task_size_is_kept(asked: int, inputs: int) -> None:
    assert rows_per_task(inputs, 3, asked) == asked
    assert RayEngine(workers=3, rows_per_task=asked).rows_per_task == asked


#: A Ray worker's part, in a fresh interpreter: the task and its arguments unpickled from stdin
#: (importing the task's module, as a worker does before its first task), run, and its result
#: pickled to stdout with the heavy modules the process had imported by then.
RUN_A_TASK = """
import pickle, sys
task, args = pickle.loads(sys.stdin.buffer.read())
done = task(*args)
heavy = sorted(m for m in ("torch", "numpy", "featbake.bake.pipeline") if m in sys.modules)
sys.stdout.buffer.write(pickle.dumps((done, heavy)))
"""


def test_a_hashing_task_runs_in_a_process_that_imports_no_torch(tmp_path: Path) -> None:
    """Round fourteen, the suite's cost: a Ray task hashing files (``digest_batch``) was a
    function of bake/ray_engine.py, which Ray pickles by its module's name: each worker process
    imported that module, and with it torch and the build's pipeline (3-4 s of CPU a process
    here), to read and hash bytes. The task's module (bake/ray_hashing.py) and the byte hashing
    it runs (encode/fingerprints.py) now import no torch: the same digests, none of it loaded."""
    (tmp_path / "data").mkdir()
    paths = [str(tmp_path / "data" / f"f{i}.bin") for i in range(3)]
    for i, p in enumerate(paths):
        Path(p).write_bytes(os.urandom(1000 + i))
    asks = [DigestAsk(p, FileStat.of(p)) for p in paths]
    sent = pickle.dumps((digest_batch, (asks, this_host(), ENGINE_PROTOCOL)))
    assert b"featbake.bake.ray_hashing" in sent and b"ray_engine" not in sent  # by its name
    proc = subprocess.run(
        [sys.executable, "-c", RUN_A_TASK], input=sent, capture_output=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    done, heavy = pickle.loads(proc.stdout)
    assert heavy == []
    assert done.error is None
    want = {p: Digest(FileStat.of(p), hashlib.sha256(Path(p).read_bytes()).hexdigest())
            for p in paths}  # fmt: skip
    assert {d.path: d.got for d in done.digested} == want


class Sent:
    """A digester standing for a cluster that keeps what each container-hashing task would be
    sent (each reading, no holder) and reads it here."""

    def __init__(self) -> None:
        self.asks: list[ContainerAsk] = []

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        return digest_here(place, asks)

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        self.asks += [replace(a, held=None) for a in asks]
        return read_batch(list(self.asks[-len(asks) :]), this_host(), ENGINE_PROTOCOL).digested


def test_a_container_hashing_task_runs_in_a_process_that_imports_no_torch(
    tmp_path: Path,
) -> None:
    """Round fourteen, the suite's cost (r14s.2): a task reading tar shards' members or table
    files' cells unpickles their readings (``MemberReading``, ``CellReading``), whose modules
    (encode/webdataset.py, encode/tables.py, encode/sources.py and featbake/recipe.py under
    them) imported torch at their top. They load it now only where a tensor or a dtype is
    made: the task's process reads the same digests and failures (a torn member, a null cell)
    and never loads torch or the build's pipeline."""
    for kind, (inputs, bad) in containers(tmp_path).items():
        sent = Sent()
        with Catalog(Layout(tmp_path / f"store-{kind}").ensure()) as cat:
            inputs.hash(cat, scanned_paths(inputs), digester=sent)
        assert len(sent.asks) == 2, kind
        task = pickle.dumps((read_batch, (sent.asks, this_host(), ENGINE_PROTOCOL)))
        proc = subprocess.run(
            [sys.executable, "-c", RUN_A_TASK], input=task, capture_output=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
        done, heavy = pickle.loads(proc.stdout)
        assert "torch" not in heavy and "featbake.bake.pipeline" not in heavy, (kind, heavy)
        assert done.error is None
        want = read_batch(sent.asks, this_host(), ENGINE_PROTOCOL).digested  # read here
        assert done.digested == want, kind
        failed = [d for d in done.digested if any(len(g) == 1 for g in d.got.digests.values())]
        assert [d.container for d in failed] == [str(bad)], kind
