"""Where a Ray build hashes its new inputs (featbake.bake.ray_engine: hash_site,
hash_rows_per_task, ClusterDigests) and the seam it plugs into (``hash_inputs``'s ``digester``):
pure, or over real files and a real catalog, without Ray. The Ray build itself is tested in
tests/bake/test_ray.py (one local Ray instance for that module)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.bake.ray_engine import (
    CLUSTER_HASHING_FROM,
    HASH_TASKS_PER_CPU,
    LEAST_HASH_ROWS,
    MOST_HASH_ROWS,
    ClusterDigests,
    HashSite,
    hash_rows_per_task,
    hash_site,
)
from featbake.encode.fingerprints import (
    DigestAsk,
    Digested,
    HeldBytes,
    digest_here,
    hash_inputs,
)
from featbake.store.byteplace import CHANGED_WHILE_READ, BytePlace, bytes_at
from featbake.store.catalog import Catalog
from featbake.store.hash_cache import FileStat, racy_window_ns
from featbake.store.layout import Layout


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
    holder), digests each ask with ``digest_here`` as a task does, and returns them last first
    (tasks return in any order)."""

    def __init__(self) -> None:
        self.asked: list[DigestAsk] = []

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        self.asked += asks
        sent = [DigestAsk(a.path, a.stat) for a in asks]
        return reversed(list(digest_here(place, sent)))


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
