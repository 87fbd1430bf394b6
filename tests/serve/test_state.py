"""Write-back and last-use timing with an injected clock (no sleeping), and write-back faults.

Every served feature is compared with running the encoder now (conftest.live_features).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import soundfile
import torch
from torch import nn

from featbake.bake.pipeline import build
from featbake.serve.cached_encoder import CachedEncoder
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.state import TOUCH_FLUSH_SECONDS, WRITEBACK_SECONDS
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.roots import RootSpec, read_root_file, root_file
from featbake.testing import TinyConvEncoder, make_tone
from featbake.upkeep.repair import verify
from tests.conftest import live_features

TOL = {"rtol": 1e-5, "atol": 1e-6}


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def shard_files(store: Path) -> set[Path]:
    return set((store / "shards").rglob("*.safetensors"))


def stored_keys(store: Path, keys: list[str]) -> set[str]:
    catalog = Catalog(Layout(store))
    try:
        return catalog.present_keys(keys)
    finally:
        catalog.close()


@pytest.fixture
def built_plus_one(audio_dir: Path, encoder_file: Path, store_dir: Path) -> Path:
    """The audio folder baked, then one new file added: a dataset over it has one miss."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    new = audio_dir / "zz_new.wav"
    soundfile.write(new, make_tone(0.6, seed=77), 16000)
    return new


def test_write_back_is_sealed_after_writeback_seconds_not_before(
    audio_dir, encoder_file, store_dir, built_plus_one
) -> None:
    clock = FakeClock()
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, clock=clock)
    miss = next(i for i in range(len(ds)) if ds.path(i) == str(built_plus_one))
    assert ds.stored() == len(ds) - 1
    before = shard_files(store_dir)
    torch.testing.assert_close(ds[miss], live_features(encoder_file, built_plus_one), **TOL)
    assert ds.cache_info().encoded == 1
    clock.advance(WRITEBACK_SECONDS - 0.5)
    hit = (miss + 1) % len(ds)
    torch.testing.assert_close(ds[hit], live_features(encoder_file, Path(ds.path(hit))), **TOL)
    assert shard_files(store_dir) == before  # younger than WRITEBACK_SECONDS: still pending
    assert not stored_keys(store_dir, [ds.key(miss)])
    clock.advance(1.0)
    ds[hit]  # a read past the age seals the pending shard and publishes it
    assert len(shard_files(store_dir) - before) == 1
    assert stored_keys(store_dir, [ds.key(miss)]) == {ds.key(miss)}
    assert ds.stored() == len(ds)  # the index points at the sealed shard
    torch.testing.assert_close(ds[miss], live_features(encoder_file, built_plus_one), **TOL)
    assert ds.cache_info().encoded == 1
    ds.close()


def test_last_use_is_flushed_after_touch_flush_seconds(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    catalog = Catalog(Layout(store_dir))
    catalog.conn.execute("UPDATE features SET last_used=0")

    def used() -> set[str]:
        rows = catalog.conn.execute("SELECT key FROM features WHERE last_used > 0").fetchall()
        return {k for (k,) in rows}

    clock = FakeClock()
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, clock=clock)
    want = {i: live_features(encoder_file, Path(ds.path(i))) for i in range(3)}
    for _ in range(300):  # past 256 reads: upkeep runs, but nothing is due yet
        for i in range(3):
            torch.testing.assert_close(ds[i], want[i], **TOL)
    assert not used()
    clock.advance(TOUCH_FLUSH_SECONDS)
    for _ in range(90):  # the next upkeep (every 256 reads) flushes the queue
        for i in range(3):
            ds[i]
    assert used() == {ds.key(i) for i in range(3)}
    catalog.close()
    ds.close()


def test_a_hit_never_fails_because_write_back_cannot(
    audio_dir, encoder_file, store_dir, built_plus_one
) -> None:
    """The store becomes unwritable while a write-back is pending (as a full disk does): reads
    of stored items go on, the failure is reported once as a warning, the pending is dropped."""
    clock = FakeClock()
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, clock=clock)
    miss = next(i for i in range(len(ds)) if ds.path(i) == str(built_plus_one))
    want_miss = live_features(encoder_file, built_plus_one)
    torch.testing.assert_close(ds[miss], want_miss, **TOL)  # pending write-back
    before = shard_files(store_dir)
    tmp = store_dir / "tmp"
    shutil.rmtree(tmp)
    tmp.write_bytes(b"")  # shards are written through tmp/: every write now fails
    clock.advance(WRITEBACK_SECONDS + 1)
    hits = [i for i in range(len(ds)) if i != miss]
    with pytest.warns(UserWarning, match="could not store written-back features") as record:
        for i in hits:
            torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))), **TOL)
    assert len([w for w in record if "could not store" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: no second warning
        torch.testing.assert_close(ds[miss], want_miss, **TOL)  # encoded again, not lost
        clock.advance(WRITEBACK_SECONDS + 1)
        for i in hits[:3]:
            ds[i]
        batch = ds.__getitems__(hits[:4])
        for row, i in enumerate(hits[:4]):
            want = live_features(encoder_file, Path(ds.path(i)))
            torch.testing.assert_close(batch[row], want, **TOL)
        assert ds.cache_info().encoded == 2
        ds.close()
    assert shard_files(store_dir) == before
    assert not stored_keys(store_dir, [ds.key(miss)])


def frozen(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def test_cached_encoder_write_back_ages_on_the_injected_clock(tmp_path) -> None:
    clock = FakeClock()
    enc = frozen(TinyConvEncoder())
    store = tmp_path / "store"
    ce = CachedEncoder(enc, cache=store, clock=clock)
    x = torch.stack([torch.from_numpy(make_tone(0.4, seed=s)[:, 0]) for s in range(3)])
    ids = ["a", "b", "c"]
    ce(x, ids=ids)
    clock.advance(WRITEBACK_SECONDS - 0.5)
    ce(x, ids=ids)  # RAM hits: the pending shard is not old enough yet
    assert not shard_files(store)
    clock.advance(1.0)
    ce(x, ids=ids)  # the next step seals it
    assert len(shard_files(store)) == 1
    fresh = CachedEncoder(enc, cache=store, ram_cache=0)
    torch.testing.assert_close(fresh(x, ids=ids), enc(x), **TOL)
    assert fresh.cache_info()["hits_store"] == 3


_FULL_DISK_CHILD = """
import resource, signal, sys, warnings
from pathlib import Path
import torch
from featbake.serve.dataset import CachedFeatureDataset
from tests.conftest import live_features

audio, encoder, store, new = map(Path, sys.argv[1:5])
now = [1000.0]
ds = CachedFeatureDataset(audio, encoder, cache=store, clock=lambda: now[0])
miss = next(i for i in range(len(ds)) if ds.path(i) == str(new))
want = {i: live_features(encoder, Path(ds.path(i))) for i in range(len(ds))}
torch.testing.assert_close(ds[miss], want[miss], rtol=1e-5, atol=1e-6)  # pending write-back
# From here on no file may grow past 4 KiB, as on a full disk (EFBIG instead of ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
now[0] += 60
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        for i in range(len(ds)):
            torch.testing.assert_close(ds[i], want[i], rtol=1e-5, atol=1e-6)
        now[0] += 60
    encoded = ds.cache_info().encoded
    ds.close()
print(sum("could not store" in str(w.message) for w in caught), encoded)
"""


def test_hits_go_on_when_files_cannot_grow(
    audio_dir, encoder_file, store_dir, built_plus_one
) -> None:
    """A real write failure (a file-size limit, as a full disk fails writes) while a write-back
    is pending: every read succeeds, one warning, the miss is encoded again instead."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    args = [str(p) for p in (audio_dir, encoder_file, store_dir, built_plus_one)]
    before = shard_files(store_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned, encoded = map(int, proc.stdout.split())
    assert warned == 1 and encoded >= 2  # the miss was encoded again after the drop
    assert shard_files(store_dir) == before


# -- issue 22 item 6: a CachedEncoder's root grows by what is sealed, not by its size -----------
def _extend(cat: Catalog, keys: list[str]) -> int:
    return cat.extend_root(
        RootSpec(
            "cached-encoder-x",
            data="cached-encoder:x",
            encoder_label="E",
            encoder_fp="e" * 64,
            recipe_fp="r" * 64,
            recipe={},
        ),
        keys,
    )


def _steps_to_extend(cat: Catalog, keys: list[str]) -> int:
    """SQLite virtual-machine steps (in units of 100) one extend_root takes: rows read count."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    cat.conn.set_progress_handler(count, 100)
    try:
        _extend(cat, keys)
    finally:
        cat.conn.set_progress_handler(None, 0)
    return steps[0]


def test_extending_a_root_costs_what_is_added_not_the_root(store_dir: Path) -> None:
    """The write-back of each sealed shard read every item of the root and rewrote its whole
    manifest file (fsync included) inside the write transaction: quadratic in the store. Now
    five keys added to a root of 6,000 cost what they cost on a root of 60, the manifest file
    is written once, and what was appended reads back (verify clean, repair rebuilds it)."""
    layout = Layout(store_dir).ensure()
    cat = Catalog(layout)
    _extend(cat, [f"{i:064x}" for i in range(60)])
    manifest = root_file(layout, "cached-encoder-x")
    written = manifest.stat()
    small = _steps_to_extend(cat, [f"a{i:063x}" for i in range(5)])
    for start in range(1000, 7000, 1000):  # the root grows by sealed shards of 1,000 keys
        assert _extend(cat, [f"{i:064x}" for i in range(start, start + 1000)]) == 1000
    large = _steps_to_extend(cat, [f"b{i:063x}" for i in range(5)])
    assert large < 3 * small + 5, (small, large)  # was ~100x: every item read per extend
    assert _extend(cat, [f"{i:064x}" for i in (5, 1005, 6999)]) == 0  # named already: nothing
    now = manifest.stat()
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)  # never rewritten
    items = [tuple(x) for x in cat.root_items("cached-encoder-x")]
    assert len(items) == 6070 and read_root_file(manifest)[1] == items
    cat.close()
    assert verify(store_dir).status == "clean"
    for suffix in ("", "-wal", "-shm"):  # the catalog lost: the manifest (and its tail) rebuild it
        Path(f"{layout.catalog}{suffix}").unlink(missing_ok=True)
    assert verify(store_dir, repair_damage=True).status in ("repaired", "clean")
    with Catalog(layout) as again:
        assert [tuple(x) for x in again.root_items("cached-encoder-x")] == items


def test_a_cached_encoder_root_stays_whole_across_sealed_shards(store_dir: Path) -> None:
    """Every shard CachedEncoder seals appends its keys; verify finds the root and the manifest
    in agreement, and a fresh wrapper serves every row from the store."""
    enc = TinyConvEncoder().eval().requires_grad_(False)
    ce = CachedEncoder(enc, cache=store_dir, ram_cache=0)
    x = torch.stack([torch.from_numpy(make_tone(0.3, seed=s)[:, 0]) for s in range(8)])
    for k in range(0, 8, 2):
        ce(x[k : k + 2], ids=[k, k + 1])
        ce.flush()  # one sealed shard per step
    with Catalog(Layout(store_dir)) as cat:
        root = next(r for r in cat.roots() if r.name.startswith("cached-encoder-"))
        assert len(cat.root_items(root.name)) == 8
    assert verify(store_dir).status == "clean"
    fresh = CachedEncoder(TinyConvEncoder().eval().requires_grad_(False), cache=store_dir)
    torch.testing.assert_close(fresh(x, ids=list(range(8))), enc(x))
    assert fresh.stats["hits_store"] == 8 and fresh.stats["encoded"] == 0
