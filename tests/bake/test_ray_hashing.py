"""Where a Ray build hashes its new inputs (featbake.bake.ray_engine: hash_site,
hash_rows_per_task, container_tasks, ClusterDigests) and the seams it plugs into
(``hash_inputs``'s ``digester``; ``hash_listed``'s container reader, for tar shards and table
files): pure, or over real files and a real catalog, without Ray. The Ray build itself is tested in
tests/bake/test_ray.py (one local Ray instance for that module)."""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.bake import ray_hashing
from featbake.bake.engine_wire import ENGINE_PROTOCOL, CarriedError
from featbake.bake.ray_engine import (
    CLUSTER_HASHING_FROM,
    HASH_TASKS_PER_CPU,
    LEAST_HASH_ROWS,
    MOST_HASH_ROWS,
    ClusterDigests,
    HashSite,
    container_tasks,
    containers_read_by_tasks,
    digest_batch,
    digested_by_tasks,
    hash_rows_per_task,
    hash_site,
    read_batch,
)
from featbake.encode.fingerprints import (
    ContainerAsk,
    ContainerDigested,
    DigestAsk,
    Digested,
    HeldBytes,
    digest_here,
    hash_inputs,
    read_here,
)
from featbake.encode.inputs import Folder, Inputs
from featbake.encode.sources import AudioSource
from featbake.encode.tables import CellReading, Table
from featbake.encode.webdataset import MemberReading, WebDataset
from featbake.recipe import Recipe
from featbake.store.byteplace import CHANGED_WHILE_READ, BytePlace, Digest, bytes_at
from featbake.store.catalog import Catalog
from featbake.store.claims import this_host
from featbake.store.hash_cache import FileStat, racy_window_ns
from featbake.store.layout import Layout
from tests.encode.test_containers import wav_bytes, write_audio_parquet, write_tar
from tests.helpers import rewrite_each


def test_few_new_inputs_are_hashed_on_the_driver_and_many_on_the_cluster() -> None:
    # Every count of new inputs against every threshold up to past the default, against the
    # rule written plainly: the cluster from the threshold on, never for nothing to hash.
    for cluster_from in range(0, CLUSTER_HASHING_FROM + 3):
        for uncached in range(0, CLUSTER_HASHING_FROM + 3):
            on_cluster = uncached >= cluster_from and uncached > 0
            want = HashSite.CLUSTER if on_cluster else HashSite.DRIVER
            assert hash_site(uncached, cluster_from) is want, (uncached, cluster_from)
    assert hash_site(CLUSTER_HASHING_FROM - 1) is HashSite.DRIVER
    assert hash_site(CLUSTER_HASHING_FROM) is HashSite.CLUSTER
    assert hash_site(10_000_000) is HashSite.CLUSTER


@settings(max_examples=500, deadline=None)
@given(inputs=st.integers(1, 10**9), cpus=st.integers(1, 100_000))
def test_hashing_tasks_are_sized_to_the_cluster_within_their_bounds(inputs: int, cpus: int) -> None:
    rows = hash_rows_per_task(inputs, cpus)
    assert LEAST_HASH_ROWS <= rows <= MOST_HASH_ROWS
    aim = cpus * HASH_TASKS_PER_CPU  # tasks an even split would make
    if LEAST_HASH_ROWS < rows < MOST_HASH_ROWS:  # the smallest size making no more tasks
        assert (rows - 1) * aim < inputs <= rows * aim
    elif rows == LEAST_HASH_ROWS:
        assert inputs <= LEAST_HASH_ROWS * aim
    else:
        assert inputs > (MOST_HASH_ROWS - 1) * aim
    assert hash_rows_per_task(inputs + 1, cpus) >= rows  # more inputs never make smaller tasks


def files(folder: Path, count: int) -> list[str]:
    """``count`` files of random bytes, past the racy window (a rebuild may trust them)."""
    folder.mkdir()
    paths = []
    for i in range(count):
        p = folder / f"f{i:03d}.bin"
        p.write_bytes(os.urandom(100 + i))
        paths.append(str(p))
    newest = max(os.stat(p).st_ctime_ns for p in paths)
    past = newest + racy_window_ns(newest, newest) + 1
    while time.time_ns() <= past:  # a wait on the clock (the racy rule), not on load
        time.sleep((past - time.time_ns()) / 1e9 + 1e-3)
    return paths


class Elsewhere:
    """A digester standing for a cluster: it sees only what a task is sent (path and stat, no
    holder; a container's reading pickled), digests each ask with ``digest_here`` (reads each
    container with ``read_here``) as a task does, and returns them last first (tasks return in
    any order)."""

    def __init__(self) -> None:
        self.asked: list[DigestAsk] = []
        self.containers_asked: list[str] = []

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        self.asked += asks
        sent = [DigestAsk(a.path, a.stat) for a in asks]
        return reversed(list(digest_here(place, sent)))

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        """Each container's reading as a task gets it: pickled, with no holder."""
        self.containers_asked += [a.container for a in asks]
        sent = [pickle.loads(pickle.dumps(replace(a, held=None))) for a in asks]
        return reversed(list(read_here(sent)))


def test_a_digester_elsewhere_fills_the_hash_cache_so_a_rebuild_asks_it_nothing(
    tmp_path: Path,
) -> None:
    paths = files(tmp_path / "data", 5)
    gone = str(tmp_path / "data" / "gone.bin")  # fails at the stat, never asked for
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        elsewhere = Elsewhere()
        stats: dict[str, FileStat] = {}
        digests, failed = hash_inputs(cat, [*paths, gone], stats=stats, digester=elsewhere)
        assert [a.path for a in elsewhere.asked] == paths
        assert digests == {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}
        assert list(failed) == [gone] and "cannot stat" in failed[gone]
        assert stats == {p: FileStat.of(p) for p in paths}
        rows = cat.cached_hashes(paths)  # trusted rows: the racy rule holds for them
        assert {p: (rows[p].stat, rows[p].sha256) for p in paths} == {
            p: (stats[p], digests[p]) for p in paths
        }
        again = Elsewhere()
        assert hash_inputs(cat, paths, digester=again) == (digests, {})
        assert again.asked == []


class LostMidway(Elsewhere):
    """A cluster that returns ``first`` digests (files, or containers), then loses the rest (a
    node gone, Ctrl-C)."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.first = first

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        yield from list(super().__call__(place, asks))[: self.first]
        raise KeyboardInterrupt

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        yield from list(super().containers(asks))[::-1][: self.first]  # in the order asked
        raise KeyboardInterrupt


def test_what_a_cluster_hashed_before_it_failed_is_kept_and_not_asked_again(
    tmp_path: Path,
) -> None:
    paths = files(tmp_path / "data", 6)
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        with pytest.raises(KeyboardInterrupt):
            hash_inputs(cat, paths, digester=LostMidway(4))
        kept = cat.cached_hashes(paths)
        assert len(kept) == 4  # the 4 digests that came back, recorded however it ended
        again = Elsewhere()
        digests, _ = hash_inputs(cat, paths, digester=again)
        assert sorted(a.path for a in again.asked) == sorted(set(paths) - set(kept))
        assert digests == {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def test_a_file_rewritten_after_its_stat_fails_alike_here_and_elsewhere(tmp_path: Path) -> None:
    paths = files(tmp_path / "data", 2)
    stat = FileStat.of(paths[0])
    os.truncate(paths[0], stat.size + 2)  # rewritten after the build stat'ed it
    asks = [DigestAsk(paths[0], stat), DigestAsk(paths[1], FileStat.of(paths[1]))]
    here = {d.path: d.got for d in digest_here(bytes_at(paths[0]), asks)}
    there = {d.path: d.got for d in Elsewhere()(bytes_at(paths[0]), asks)}
    assert here == there and here[paths[0]] == CHANGED_WHILE_READ


def test_few_new_inputs_never_reach_ray(tmp_path: Path) -> None:
    # Under the threshold the driver hashes, keeping the bytes where asked (a plain build's
    # read-once): no connection is waited for, none made (the address reaches nothing).
    paths = files(tmp_path / "data", 3)
    digester = ClusterDigests("ray://127.0.0.1:9", cluster_from=4)
    held = HeldBytes()
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        digests, failed = hash_inputs(cat, paths, held=held, digester=digester)
    assert failed == {} and len(digests) == 3 and len(held) == 3


# == containers: tar shards and table files ========================================================
@settings(max_examples=500, deadline=None)
@given(items=st.lists(st.integers(1, 300), max_size=40), per_task=st.integers(1, 200))
def test_containers_go_to_tasks_whole_in_order_as_few_as_fit(
    items: list[int], per_task: int
) -> None:
    tasks = container_tasks(items, per_task)
    assert [i for task in tasks for i in task] == list(range(len(items)))  # each once, in order
    held = [sum(items[i] for i in task) for task in tasks]
    for task, n in zip(tasks, held, strict=True):
        assert len(task) >= 1 and (n <= per_task or len(task) == 1)  # over: one large container
    for n, after in zip(held, tasks[1:], strict=False):
        assert n + items[after[0]] > per_task  # a task ends only where the next would not fit


def torn_shard(path: Path, clips: list[bytes]) -> Path:
    """A shard of ``clips`` cut inside its last member's bytes (the scan lists it; hashing
    that member fails, naming it)."""
    write_tar(path, [(f"{path.stem}-{i}", {"wav": c}) for i, c in enumerate(clips)])
    whole = path.read_bytes()
    path.write_bytes(whole[: whole.find(clips[-1]) + len(clips[-1]) // 2])
    return path


def containers(tmp_path: Path) -> dict[str, tuple[Inputs, Path]]:
    """Two tar shards (the second torn) and two parquet files (the second with a null cell),
    each kind scanned, with the container whose items fail."""
    clips = [wav_bytes(0.2 + 0.05 * i, i) for i in range(6)]
    shards, table = tmp_path / "shards", tmp_path / "table"
    shards.mkdir()
    table.mkdir()
    write_tar(shards / "s0.tar", [(f"s0-{i}", {"wav": c}) for i, c in enumerate(clips[:3])])
    torn = torn_shard(shards / "s1.tar", clips[3:])
    write_audio_parquet(table / "a.parquet", clips[:3])
    nulled = write_audio_parquet(table / "b.parquet", [clips[3], None, clips[4]])
    return {"tar": (WebDataset(str(shards)), torn), "parquet": (Table(str(table)), nulled)}


def scanned_paths(inputs: Inputs) -> list[str]:
    return [inputs.path(r) for r in inputs.scan([".wav"]).inputs]


def test_containers_read_elsewhere_equal_reading_here_and_fill_the_hash_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each container's reading pickled as a task's argument is (no holder: nothing kept), run
    # by its copy (a table file opened afresh, a tar read at the offsets the scan listed), the
    # results last first: the same digests and failures as reading here, the hash cache
    # filled, so a second call asks only for the container of what failed (read again, as a
    # plain rebuild reads it).
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once
    for kind, (inputs, bad) in containers(tmp_path).items():
        paths = scanned_paths(inputs)
        with Catalog(Layout(tmp_path / f"here-{kind}").ensure()) as cat:
            here_stats: dict[str, FileStat] = {}
            want = inputs.hash(cat, paths, stats=here_stats)
        assert len(want[1]) == 1 and str(bad) in next(iter(want[1].values())), want[1]
        elsewhere = Elsewhere()
        with Catalog(Layout(tmp_path / f"there-{kind}").ensure()) as cat:
            stats: dict[str, FileStat] = {}
            got = inputs.hash(cat, paths, stats=stats, digester=elsewhere)
            assert (got, stats) == (want, here_stats), kind
            assert len(elsewhere.containers_asked) == 2 and str(bad) in elsewhere.containers_asked
            again = Elsewhere()
            assert inputs.hash(cat, paths, digester=again) == want
            assert again.containers_asked == [str(bad)], kind


def test_the_containers_a_cluster_read_before_it_failed_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once
    # The good container comes back, then the cluster is lost: its members are kept, and the
    # next call reads only the other (the one whose member fails, read again in any case).
    for kind, (inputs, bad) in containers(tmp_path).items():
        paths = scanned_paths(inputs)
        with Catalog(Layout(tmp_path / f"store-{kind}").ensure()) as cat:
            with pytest.raises(KeyboardInterrupt):
                inputs.hash(cat, paths, digester=LostMidway(1))
            again = Elsewhere()
            inputs.hash(cat, paths, digester=again)
            assert again.containers_asked == [str(bad)], kind


def test_the_cluster_threshold_counts_new_items_not_containers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under the threshold the driver reads the containers, keeping the bytes where asked (a
    # plain build's read-once), and Ray is never reached (the address reaches nothing); one
    # container holding as many new members as the threshold goes to the cluster.
    inputs, _ = containers(tmp_path)["tar"]
    paths = scanned_paths(inputs)  # 6 members in 2 shards
    sent: list[list[str]] = []

    def on_cluster(self: ClusterDigests, asks: Sequence[ContainerAsk], by_tasks: object) -> object:
        sent.append([a.container for a in asks])
        return read_here(asks)

    monkeypatch.setattr(ClusterDigests, "on_cluster", on_cluster)
    held = HeldBytes()
    with Catalog(Layout(tmp_path / "few").ensure()) as cat:
        few = ClusterDigests("ray://127.0.0.1:9", cluster_from=7)
        digests, failed = inputs.hash(cat, paths, held=held, digester=few)
    assert (len(digests), len(failed), len(held), sent) == (5, 1, 5, [])
    with Catalog(Layout(tmp_path / "many").ensure()) as cat:
        many = ClusterDigests("ray://127.0.0.1:9", cluster_from=6)
        assert inputs.hash(cat, paths, digester=many) == (digests, failed)
    assert sent == [sorted({p.split(".tar:")[0] + ".tar" for p in paths})]


def test_a_worker_takes_a_tables_cells_by_what_they_carry_and_refuses_a_file_it_lacks(
    tmp_path: Path,
) -> None:
    # A worker's Table never scanned: each cell's column and kind come with it. A cell whose
    # file this node does not list (a directory cache behind the driver's) is refused by name,
    # the others taken: its task goes on, that cell counted failed.
    inputs, _ = containers(tmp_path)["parquet"]
    paths = scanned_paths(inputs)
    carried = {p: inputs.carried(p) for p in paths}  # type: ignore[attr-defined]
    assert all(c is not None for c in carried.values())
    worker = Table(str(tmp_path / "table"))
    worker.files = [f for f in worker.files if f.path.endswith("a.parquet")]  # b not listed
    refused = worker.carry(carried)
    assert sorted(refused) == sorted(p for p in paths if "b.parquet" in p)
    assert all("not a file of the table" in why for why in refused.values())
    source = worker.source(AudioSource(Recipe()))
    for p in paths:
        if p not in refused:
            torch.testing.assert_close(source.load(p), inputs.source(AudioSource(Recipe())).load(p))


def test_a_table_file_renamed_over_after_its_scan_fails_its_cells_here_and_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The table is renamed over by a version with its rows reversed just after the build
    # checked it against its scan (the window between that check and the reading, made here
    # by passing the check): ids would be keyed to other rows' cells. Read here, the scan's
    # reader sees the file is not its own; read elsewhere (a fresh reader in a task), the
    # reading checks the file against the scan's stat. Both fail every cell, by name.
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "t"
    folder.mkdir()
    rows = [("cat", b"CAT"), ("dog", b"DOG"), ("eel", b"EEL")]

    def write(order: list[int]) -> None:
        table = pa.table({"id": [rows[i][0] for i in order],
                          "data": pa.array([rows[i][1] for i in order], pa.binary())})  # fmt: skip
        pq.write_table(table, folder / "a.tmp")
        os.replace(folder / "a.tmp", folder / "a.parquet")  # renamed over: a new file

    for where, digester in (("here", None), ("elsewhere", Elsewhere())):
        write([0, 1, 2])
        table = Table(str(folder), column="data")
        paths = scanned_paths(table)
        write([2, 1, 0])
        monkeypatch.setattr(table, "replaced", lambda files: {})  # past the check: the window
        kwargs = {} if digester is None else {"digester": digester}
        with Catalog(Layout(tmp_path / f"store-{where}").ensure()) as cat:
            digests, failed = table.hash(cat, paths, **kwargs)  # type: ignore[arg-type]
        assert digests == {} and sorted(failed) == sorted(paths), (where, digests)
        assert all("changed while featbake was reading it" in why for why in failed.values())


def test_what_a_hashing_task_did_before_its_error_reaches_the_driver_before_the_error() -> None:
    # A task whose third input raises a featbake error (a bucket refusing it, say) returns
    # the two digests it made and the error's line; the driver yields both digests (kept in the
    # hash cache by hash_inputs), then raises the error as its own class.
    from types import SimpleNamespace

    from featbake.bake.ray_engine import as_returned
    from featbake.bake.ray_hashing import hashed_batch
    from featbake.errors import StoreError

    def results() -> Iterator[str]:
        yield from ("a", "b")
        raise StoreError("s3://bucket/c.wav: access denied; check the role's s3:GetObject")

    batch = hashed_batch(results)
    line = "s3://bucket/c.wav: access denied; check the role's s3:GetObject"
    assert (batch.digested, batch.error) == (["a", "b"], CarriedError("StoreError", line))
    fake_ray = SimpleNamespace(
        wait=lambda pending, num_returns: (pending[:1], pending[1:]),
        get=lambda ref: ref,
        cancel=lambda ref: None,
        exceptions=SimpleNamespace(RayError=RuntimeError),
    )
    got: list[str] = []
    with pytest.raises(StoreError, match="access denied"):
        got.extend(as_returned(fake_ray, [batch]))
    assert got == ["a", "b"]


# == round nine: a hashing task on another node ===================================================
def moved(stat: FileStat, shift: tuple[str, ...]) -> FileStat:
    """``stat`` with its fields ``shift`` moved by one: the driver's stat of a file as another
    node's mount shows it (other inode numbers and ctimes), or of another version (size, mtime)."""
    return stat._replace(**{f: getattr(stat, f) + 1 for f in shift})


def moved_reading(ask: ContainerAsk, shift: tuple[str, ...]) -> ContainerAsk:
    """``ask`` as the driver sends it from a host that saw its container at a moved stat (the
    stat a tar was listed at, the one a table file's rows were scanned at)."""
    read = ask.read
    if isinstance(read, MemberReading):
        assert read.listed_at is not None
        return replace(ask, read=replace(read, listed_at=moved(read.listed_at, shift)), held=None)
    assert isinstance(read, CellReading) and read.cell.scanned is not None
    cell = replace(read.cell, scanned=moved(read.cell.scanned, shift))
    return replace(ask, read=replace(read, cell=cell), held=None)


class AskedOnly(Elsewhere):
    """A digester that keeps the container asks it is given and reads them here."""

    def __init__(self) -> None:
        super().__init__()
        self.asks: list[ContainerAsk] = []

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        self.asks += asks
        return read_here(asks)


ON_ANOTHER_NODE = [
    ("node-2", ("inode", "ctime_ns"), True),  # another node: its own inode numbers
    (None, ("inode", "ctime_ns"), False),  # the driver's host: an inode differing is a change
    ("node-2", ("mtime_ns",), False),  # another node: a file changed since its stat
    ("node-2", ("size",), False),
]


@pytest.mark.parametrize(("worker_host", "shift", "read"), ON_ANOTHER_NODE)
def test_a_hashing_task_on_another_node_compares_size_and_mtime_not_its_mounts_inodes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    worker_host: str | None,
    shift: tuple[str, ...],
    read: bool,
) -> None:
    """Round nine, engines: a Ray task hashing files checked each against the driver's stat
    whole, so a mount that shows another node other inode numbers failed every file hashed
    there. A task on another node now reads a file whose size and mtime are the driver's,
    checks the read by its own stat, and returns the driver's stat with the digest (what the
    driver records in the hash cache); on the driver's host the whole stat is compared."""
    folder = tmp_path / "data"
    folder.mkdir()
    paths = []
    for i in range(4):
        (folder / f"f{i}.bin").write_bytes(os.urandom(100 + i))
        paths.append(str(folder / f"f{i}.bin"))
    driver = this_host()
    stats = {p: moved(FileStat.of(p), shift) for p in paths}
    if worker_host is not None:  # the task's host; the driver's was named before
        monkeypatch.setattr(ray_hashing, "this_host", lambda: worker_host)
    batch = digest_batch([DigestAsk(p, stats[p]) for p in paths], driver, ENGINE_PROTOCOL)
    assert batch.error is None
    got = {d.path: d.got for d in batch.digested}
    sha = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}
    assert got == {p: Digest(stats[p], sha[p]) if read else CHANGED_WHILE_READ for p in paths}


@pytest.mark.parametrize(("worker_host", "shift", "read"), ON_ANOTHER_NODE)
def test_a_container_task_on_another_node_compares_size_and_mtime_not_its_mounts_inodes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    worker_host: str | None,
    shift: tuple[str, ...],
    read: bool,
) -> None:
    """Round nine, engines: a Ray task reading a tar shard's members or a table file's cells
    compared the container's stat after reading with the one the driver listed or scanned
    it at, whole: on another node's mount every container was "changed while featbake was
    reading it". A task on another node now takes a container whose size and mtime are the
    driver's as the version listed, checks its reading by its own stat, and returns the
    driver's stat (what the driver compares with the one it looked up); on the driver's host
    the whole stat is compared, and a size or mtime moved is refused anywhere."""
    for kind, (inputs, _) in containers(tmp_path).items():
        asked = AskedOnly()
        with Catalog(Layout(tmp_path / f"store-{kind}").ensure()) as cat:
            inputs.hash(cat, scanned_paths(inputs), digester=asked)
        want = {c.container: c.got for c in read_here(asked.asks)}
        sent = [moved_reading(a, shift) for a in asked.asks]
        listed = {a.container: moved(want[a.container].stat, shift) for a in asked.asks}
        with monkeypatch.context() as m:
            if worker_host is not None:
                m.setattr(ray_hashing, "this_host", lambda: worker_host)
            batch = read_batch(sent, this_host(), ENGINE_PROTOCOL)
        assert batch.error is None
        got = {c.container: c.got for c in batch.digested}
        assert {c: r.stat for c, r in got.items()} == {
            c: listed[c] if read else None for c in want
        }, kind
        assert {c: r.digests for c, r in got.items()} == {c: r.digests for c, r in want.items()}


# == round nine: rewritten with its mtime kept before a task on another node reads it =============
class InlineRay:
    """What the hashing tasks use of Ray, each task run at once in this process as host
    ``host`` (its ``this_host``), after ``before`` (a rewrite between the driver's stats and
    the task's reads)."""

    def __init__(self, host: str, before: Callable[[], None]) -> None:
        self.host = host
        self.before = before
        self.exceptions = SimpleNamespace(RayError=RuntimeError)

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def remote(self, num_cpus: int) -> Callable[[Callable[..., Any]], Any]:
        return lambda task: SimpleNamespace(remote=lambda *args: self.run(task, *args))

    def run(self, task: Callable[..., Any], *args: Any) -> Any:
        self.before()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ray_hashing, "this_host", lambda: self.host)
            return task(*args)

    def wait(self, pending: list[Any], num_returns: int) -> tuple[list[Any], list[Any]]:
        return pending[:1], pending[1:]

    def get(self, ref: Any) -> Any:
        return ref

    def cancel(self, ref: Any) -> None:
        return None


class TasksOn:
    """A Ray build's digester (files and containers in tasks: :func:`digested_by_tasks`,
    :func:`containers_read_by_tasks`) over an :class:`InlineRay`."""

    def __init__(self, ray: InlineRay) -> None:
        self.ray = ray

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        return digested_by_tasks(self.ray, asks)

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        return containers_read_by_tasks(self.ray, asks)


def test_a_tar_rewritten_with_its_mtime_kept_before_a_task_on_another_node_reads_it(
    tmp_path: Path,
) -> None:
    """Round nine, engines (corrects cl9.6): a hashing task on another node took a tar whose
    size and mtime were the driver's as the version the driver listed, so a shard rewritten in
    place with its members reordered and its mtime kept was read at the driver's member
    offsets: each member got another's digest (its key and the root's manifest another clip's
    features) though the driver's own host refuses it by its ctime. The driver now vouches
    for what a task read by its own stat of the container after the task returned."""
    clips = {f"c{i}": wav_bytes(0.5, seed=i) for i in range(4)}
    (tmp_path / "d").mkdir()
    tar = write_tar(tmp_path / "d" / "s.tar", [(n, {"wav": c}) for n, c in clips.items()])
    order = ["c1", "c0", "c3", "c2"]  # the same members, same sizes, each pair swapped
    again = write_tar(tmp_path / "again.tar", [(n, {"wav": clips[n]}) for n in order])
    inputs = WebDataset(str(tmp_path / "d"))
    paths = scanned_paths(inputs)
    ray = InlineRay("node-2", lambda: rewrite_each({tar: again.read_bytes()}))
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        digests, failed = inputs.hash(cat, paths, digester=TasksOn(ray))
        sha = {
            p: hashlib.sha256(clips[p.rsplit(":", 1)[1].split(".")[0]]).hexdigest() for p in paths
        }
        assert {p: d for p, d in digests.items() if d != sha[p]} == {}
        assert sorted(failed) == sorted(paths)
        assert all("changed while featbake was reading it" in why for why in failed.values())
        again_listed = WebDataset(str(tmp_path / "d"))  # a later build: read again, each right
        assert again_listed.hash(cat, scanned_paths(again_listed))[0] == sha


def test_a_file_rewritten_with_its_mtime_kept_before_a_task_on_another_node_fails_as_here(
    tmp_path: Path,
) -> None:
    """Round nine, engines: a file rewritten in place with its mtime kept after the driver's
    stat and before a hashing task on another node reads it comes back changed, as it does
    from a task on the driver's host (its ctime moved there): no digest is recorded at a stat
    the driver took of other bytes, and a later build hashes the bytes there now."""
    (tmp_path / "data").mkdir()
    paths = [str(tmp_path / "data" / f"f{i}.bin") for i in range(3)]
    for p in paths:
        Path(p).write_bytes(os.urandom(1000))
    other = {Path(p): os.urandom(1000) for p in paths}
    ray = InlineRay("node-2", lambda: rewrite_each(other))
    inputs = Folder(tmp_path / "data")
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        digests, failed = inputs.hash(cat, paths, digester=TasksOn(ray))
        assert (digests, sorted(failed)) == ({}, sorted(paths))
        assert set(failed.values()) == {CHANGED_WHILE_READ}
        now = {str(p): hashlib.sha256(b).hexdigest() for p, b in other.items()}
        assert inputs.hash(cat, paths)[0] == now
