"""The local disk tier on its own (no server): real shards written by the store's writer stand
in for the bucket, and ``download`` copies them, counting calls."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from featbake.errors import ConfigError, StoreCorrupt
from featbake.store.features import ShardHandles
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, write_shard
from featbake.store.tier import DiskTier, tier_locked


class Source:
    """Sealed shards in a directory, "downloaded" by copying; ``corrupt`` flips a byte of the
    next N copies."""

    def __init__(self, root: Path, n: int) -> None:
        self.layout = Layout(root).ensure()
        self.names = []
        for i in range(n):
            t = torch.full((50, 16), float(i))
            self.names.append(write_shard(self.layout, {f"k{i}": t}, "enc", "rec").name)
        self.calls = 0
        self.corrupt = 0
        self._lock = threading.Lock()

    def size(self, name: str) -> int:
        return self.layout.shard_path(name).stat().st_size

    def download(self, name: str):
        def run(dest: Path) -> int:
            with self._lock:
                self.calls += 1
                spoil = self.corrupt > 0
                self.corrupt -= spoil
            time.sleep(0.05)  # long enough for another thread to come asking
            # Into the file as it is, as the bucket's download writes: its space is reserved
            # (copyfile truncated it, so a reservation beside it saw room the tier lacked).
            data = self.layout.shard_path(name).read_bytes()
            with open(dest, "r+b" if dest.exists() else "wb") as f:
                f.write(data)
                f.truncate(len(data))
            if spoil:
                with open(dest, "r+b") as f:
                    f.seek(-4, os.SEEK_END)
                    f.write(b"\xff\xff\xff\xff")
            return dest.stat().st_size

        return run

    def fetch(self, tier: DiskTier, name: str) -> Path:
        return tier.fetch(name, self.size(name), self.download(name), f"s3://b/{name}")


@pytest.fixture
def source(tmp_path: Path) -> Source:
    return Source(tmp_path / "bucket", 4)


def test_a_shard_is_fetched_once_and_read_as_written(source: Source, tmp_path: Path) -> None:
    tier = DiskTier(Layout(tmp_path / "tier"), budget=10 << 20)
    name = source.names[2]
    path = source.fetch(tier, name)
    assert source.fetch(tier, name) == path and source.calls == 1
    with ShardReader(path) as reader:
        torch.testing.assert_close(reader.read("k2"), torch.full((50, 16), 2.0))


def test_threads_wanting_one_shard_download_it_once(source: Source, tmp_path: Path) -> None:
    tier = DiskTier(Layout(tmp_path / "tier"), budget=10 << 20)
    got: list[Path] = []
    threads = [
        threading.Thread(target=lambda: got.append(source.fetch(tier, source.names[0])))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert source.calls == 1 and len(set(got)) == 1 and len(got) == 4


def test_the_least_recently_used_shard_is_evicted_and_the_budget_holds(
    source: Source, tmp_path: Path
) -> None:
    size = max(source.size(n) for n in source.names)
    tier = DiskTier(Layout(tmp_path / "tier"), budget=2 * size)
    a, b, c, _ = source.names
    pa = source.fetch(tier, a)
    time.sleep(0.02)
    pb = source.fetch(tier, b)
    time.sleep(0.02)
    tier.touch(pa)  # a is used again: b is now the least recent
    source.fetch(tier, c)
    assert pa.exists() and not pb.exists() and tier.used_bytes() <= 2 * size
    with pytest.raises(ConfigError, match="cannot hold"):
        DiskTier(Layout(tmp_path / "small"), budget=size - 1).fetch(
            a, size, source.download(a), "s3://b/a"
        )


def test_a_bad_download_is_fetched_again_and_twice_bad_is_an_error(
    source: Source, tmp_path: Path
) -> None:
    tier = DiskTier(Layout(tmp_path / "tier"), budget=10 << 20)
    source.corrupt = 1
    path = source.fetch(tier, source.names[1])
    assert source.calls == 2 and ShardReader(path).verify_all() == []
    source.corrupt = 2
    with pytest.raises(
        StoreCorrupt, match=r"s3://b/.* is damaged in the bucket \(tensors .* fail their checksums"
    ):
        source.fetch(tier, source.names[3])
    assert not tier.layout.shard_path(source.names[3]).exists()
    assert not list(tier.downloads.glob("*.part"))  # nothing reserved is left behind


def test_an_abandoned_download_is_cleared_from_the_budget(source: Source, tmp_path: Path) -> None:
    size = max(source.size(n) for n in source.names)
    tier = DiskTier(Layout(tmp_path / "tier"), budget=2 * size)
    tier.downloads.mkdir(parents=True)
    left = tier.downloads / "deadbeef.part"  # a process killed mid-download, nobody holds it
    with open(left, "wb") as f:
        f.truncate(2 * size)
    old = time.time() - 60
    os.utime(left, (old, old))
    source.fetch(tier, source.names[0])
    assert not left.exists()


def test_a_download_in_flight_is_not_taken_for_abandoned(source: Source, tmp_path: Path) -> None:
    """A ``.part`` a live download holds (the store's one lock primitive, an OFD lock on Linux)
    is in flight however old it looks: the check that clears abandoned ones takes the same
    lock (a ``flock`` there would not see an OFD lock), so it stays."""
    tier = DiskTier(Layout(tmp_path / "tier"), budget=10 << 20)
    tier.downloads.mkdir(parents=True)
    held = tier.downloads / "deadbeef.part"
    with tier_locked(held):
        old = time.time() - 60
        os.utime(held, (old, old))
        source.fetch(tier, source.names[0])
        assert held.exists()


def test_trim_evicts_what_is_over_budget_but_spares_young_shards(
    source: Source, tmp_path: Path
) -> None:
    size = max(source.size(n) for n in source.names)
    tier = DiskTier(Layout(tmp_path / "tier"), budget=10 * size)
    paths = [source.fetch(tier, n) for n in source.names]  # 4 shards
    old = time.time() - 3600
    for i, p in enumerate(paths[:3]):
        os.utime(p, (old + i, old + i))  # three old ones, oldest first; the last is new
    tier.budget = 2 * size
    assert tier.trim() > 0
    assert [p.exists() for p in paths] == [False, False, True, True]
    tier.budget = 0
    tier.trim()
    assert [p.exists() for p in paths] == [False, False, False, True]  # the young one stays


class TierPlace:
    """The bucket side of a tier as the store's readers see it (``RemotePlace``), over
    :class:`Source` instead of a server."""

    def __init__(self, source: Source, tier: DiskTier) -> None:
        self.source = source
        self.tier = tier

    def fetch_shard(self, name: str, evicted=None) -> Path:
        return self.tier.fetch(
            name, self.source.size(name), self.source.download(name), name, evicted
        )

    def ranged_reader(self, name: str, path: Path, verify: str) -> None:
        return None

    def opened(self, path: Path) -> None:
        self.tier.touch(path)


def test_workers_wait_for_room_and_refetch_what_others_evicted(tmp_path: Path) -> None:
    """Eight threads, each with its own handles (as DataLoader workers), read eight shards
    through a tier with room for two: a fetch waits while downloads in flight hold the room,
    and a shard another reader evicted between its fetch and its open is fetched again (issue
    28 item 9, issue 27): no read fails, every tensor is right, the budget holds."""
    source = Source(tmp_path / "bucket", 8)
    size = max(source.size(n) for n in source.names)
    tier = DiskTier(Layout(tmp_path / "tier"), budget=2 * size)
    place = TierPlace(source, tier)
    errors: list[BaseException] = []
    peak = [0]

    def read(i: int) -> None:
        handles = ShardHandles(remote=place)  # type: ignore[arg-type]
        try:
            reader = handles.get(tier.layout.shard_path(source.names[i]))
            peak[0] = max(peak[0], tier.used_bytes())
            torch.testing.assert_close(reader.read(f"k{i}"), torch.full((50, 16), float(i)))
        except BaseException as e:
            errors.append(e)
        finally:
            handles.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert source.calls >= 8 and peak[0] <= 2 * size


def test_a_fetch_never_evicts_what_it_is_told_to_keep(source: Source, tmp_path: Path) -> None:
    """A block order's current and next windows stay in the tier: a fetch evicts around them
    (least recently used among the rest), and one that finds no room beside them fails at
    once without ``wait`` (a prefetch gives up; the read fetches later)."""
    size = source.size(source.names[0])
    tier = DiskTier(Layout(tmp_path / "tier"), budget=3 * size + size // 2)
    a, b, c, d = source.names[:4]
    for name in (a, b, c):
        source.fetch(tier, name)
    assert tier.fits_beside({a, b}, size) and not tier.fits_beside({a, b, c}, size)
    keep = {a, b}  # a is the least recently used, c is not kept: c goes
    tier.fetch(d, size, source.download(d), d, keep=keep)
    held = {n for n in source.names if tier.layout.shard_path(n).is_file()}
    assert held == {a, b, d}
    with pytest.raises(ConfigError):
        tier.fetch(c, size, source.download(c), c, keep={a, b, d}, wait=False)
    assert tier.evict([a, b, c]) == 2 * size
    assert tier.used_bytes() == size


def test_a_read_evicts_a_kept_shard_rather_than_wait_for_room_nobody_frees(
    source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards a block order keeps fill the tier and the read wants one more (a batch
    straddling into a window the plan has not moved to yet): it evicts the least recently
    used kept shard, where before it waited for room (``ROOM_WAIT_S``, 300 s) that only its
    own read, by moving the plan on, could free, then failed."""
    from featbake.store import tier as tier_module

    monkeypatch.setattr(tier_module, "ROOM_WAIT_S", 0.0)  # the old wait ends at once
    size = max(source.size(n) for n in source.names)
    tier = DiskTier(Layout(tmp_path / "tier"), budget=2 * size)
    a, b, c = source.names[:3]
    for name in (a, b):
        source.fetch(tier, name)
    with pytest.raises(ConfigError):  # a prefetch still never evicts what is kept
        tier.fetch(c, size, source.download(c), c, keep={a, b}, wait=False)
    path = tier.fetch(c, size, source.download(c), c, keep={a, b})
    with ShardReader(path) as reader:
        torch.testing.assert_close(reader.read("k2"), torch.full((50, 16), 2.0))
    assert {n for n in (a, b, c) if tier.layout.shard_path(n).is_file()} == {b, c}
    assert tier.used_bytes() <= tier.budget


def test_a_read_short_of_room_evicts_every_other_file_before_a_kept_shard() -> None:
    """A read (``wait``) whose kept shards fill the tier: before, it fell back to plain LRU
    over every file, evicting both kept shards and leaving the one nobody keeps; now the
    others go first, then the fewest kept shards, least recently used."""
    from featbake.store.tier import Room, TierFile

    files = [
        TierFile("k1.safetensors", 10, 0.0),
        TierFile("k2.safetensors", 10, 1.0),
        TierFile("n.safetensors", 15, 5.0),
    ]
    room = Room(20, keep=frozenset({"k1", "k2"}), wait=True)
    assert [f.name for f in room.doomed(files, budget=35)] == ["n.safetensors", "k1.safetensors"]
    with pytest.raises(ConfigError):  # a prefetch never evicts what it is told to keep
        Room(20, keep=frozenset({"k1", "k2"}), wait=False).doomed(files, budget=35)
