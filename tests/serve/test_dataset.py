"""CachedFeatureDataset against real builds, real shards, real workers and live encoding."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from torch.utils.data import DataLoader

from featbake.bake.pipeline import build
from featbake.encode.sources import check_input_files, scan_inputs
from featbake.errors import CacheMiss, ConfigError, SourceError
from featbake.recipe import Recipe
from featbake.serve.collate import PaddedBatch, pad_collate
from featbake.serve.dataset import CachedFeatureDataset, ram_budget_for_process
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, make_tone, save_torchscript, write_audio_folder
from tests.conftest import REPO, invoke, live_features
from tests.helpers import can_mount_privately, run_past_a_marker

TOL = {"rtol": 1e-5, "atol": 1e-6}  # the CPU kernels may round differently by batch size


def _live_all(encoder: Path, ds: CachedFeatureDataset, recipe: Recipe | None = None) -> list:
    return [live_features(encoder, Path(ds.path(i)), recipe) for i in range(len(ds))]


def _assert_close(got: object, want: object) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            _assert_close(got[k], want[k])
        return
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **(TOL if want.dtype == torch.float32 else {}))


def test_workers_shuffled_equal_live_encoding(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert len(ds) == 16 and ds.stored() == 16
    want = _live_all(encoder_file, ds)
    ds[0]  # the main process opens its own handles first: workers must not reuse them
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(3)).tolist()
    loader = DataLoader(ds, batch_size=4, sampler=order, num_workers=2, collate_fn=pad_collate)
    seen = []
    for b, (padded, lengths) in enumerate(loader):
        for j, n in enumerate(lengths.tolist()):
            i = order[b * 4 + j]
            seen.append(i)
            _assert_close(padded[j, :n], want[i])
            assert not padded[j, n:].any()  # padding is zeros
    assert sorted(seen) == list(range(len(ds)))
    # One item per step through workers too (no batching: __getitem__).
    loader1 = DataLoader(ds, batch_size=None, sampler=order, num_workers=2)
    for i, feat in zip(order, loader1, strict=True):
        _assert_close(feat, want[i])


def test_hits_open_no_audio_deleted_after_build(tmp_path, audio_dir, encoder_file, store_dir):
    time.sleep(1.1)  # a file changed within the second its hash is cached is hashed again (racy)
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    probe = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    want = {probe.path(i): f for i, f in enumerate(_live_all(encoder_file, probe))}
    shutil.rmtree(audio_dir)  # every raw input is gone: only the store can answer
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert len(ds) == 16
    for i in range(len(ds)):
        _assert_close(ds[i], want[ds.path(i)])
    for batch in DataLoader(ds, batch_size=5, num_workers=2, collate_fn=pad_collate):
        assert batch[0].shape[0] in (5, 1)
    assert ds._live.loaded is None  # the encoder was never loaded either
    assert ds.cache_info().encoded == 0


def test_changed_file_gets_new_key_and_is_encoded(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    before = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    target = Path(before.path(3))
    old_key = before.key(3)
    soundfile.write(target, make_tone(0.7, seed=999), 16000)  # new content, same name
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    assert ds.path(3) == str(target)
    assert ds.key(3) != old_key
    assert ds.stored() == 15
    _assert_close(ds[3], live_features(encoder_file, target))
    assert ds.cache_info().encoded == 1
    ds.flush()  # seals the write-back shard
    again = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert again.stored() == 16
    _assert_close(again[3], live_features(encoder_file, target))


def test_retrained_encoder_in_place_is_not_served(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    old = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    save_torchscript(TinyConvEncoder(seed=7), encoder_file)  # same path, new weights
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    assert ds.encoder_fingerprint != old.encoder_fingerprint
    assert ds.stored() == 0
    _assert_close(ds[0], live_features(encoder_file, Path(ds.path(0))))
    with pytest.raises(CacheMiss):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")[1]
    shutil.rmtree(audio_dir)
    # The manifest now names the new encoder's keys: old features can never stand in.
    fresh = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    with pytest.raises(SourceError, match=re.escape(Path(fresh.path(1)).name)):
        fresh[1]


def test_misses_encode_write_back_in_workers_and_hit_next_epoch(
    audio_dir, encoder_file, store_dir
) -> None:
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # no build ran
    assert ds.stored() == 0
    want = _live_all(encoder_file, ds)
    order = list(range(len(ds)))[::-1]
    loader = DataLoader(ds, batch_size=3, sampler=order, num_workers=2, collate_fn=list)
    got = [item for batch in loader for item in batch]
    for i, feat in zip(order, got, strict=True):
        _assert_close(feat, want[i])
    # The workers sealed their shards when they exited; the next epoch hits.
    shards = list((store_dir / "shards").rglob("*.safetensors"))
    assert len(shards) >= 2  # each worker wrote its own
    nxt = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    assert nxt.stored() == len(nxt)
    for feat, w in zip(DataLoader(nxt, batch_size=None, num_workers=2), want, strict=True):
        _assert_close(feat, w)


def test_miss_in_main_process_hits_after_flush(audio_dir, encoder_file, store_dir) -> None:
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(3)]
    first = ds.__getitems__([0, 1, 2])
    assert ds.cache_info().encoded == 3
    for got, w in zip(first, want, strict=True):
        _assert_close(got, w)
    ds.flush()
    assert ds.stored() == 3  # the index now points at the sealed shard
    second = ds.__getitems__([0, 1, 2])
    assert isinstance(second, PaddedBatch)  # stored items take the in-place batch path
    for got, w in zip(second, want, strict=True):
        _assert_close(got, w)
    assert ds.cache_info().encoded == 3


def test_on_miss_error_names_the_file_and_the_fix(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir / "fixed", encoder_file, cache=store_dir, workers=0)  # another folder
    shutil.rmtree(store_dir / "shards")
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    with pytest.raises(CacheMiss) as err:
        ds[2]
    assert ds.path(2) in str(err.value) and "featbake build" in str(err.value)
    assert not list((store_dir / "shards").rglob("*.safetensors"))


def test_ram_budget_holds_and_hits(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    sizes = [CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)[i].nbytes
             for i in range(16)]  # fmt: skip
    budget = sum(sorted(sizes)[:4])  # a quarter of the data, at most
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, ram_cache=budget)
    rng = np.random.default_rng(0)
    for _ in range(5):
        for i in rng.permutation(16).tolist():
            ds[i]
            assert ds.cache_info().bytes <= budget
    info = ds.cache_info()
    assert info.evictions > 0 and info.misses > 0
    # Repeated access to one item hits the RAM tier and serves a copy the caller owns.
    a = ds[5]
    hits = ds.cache_info().hits
    b = ds[5]
    assert ds.cache_info().hits == hits + 1
    assert b is not a and b.data_ptr() != a.data_ptr() and torch.equal(a, b)


def test_ram_tier_serves_batches_and_counts(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, ram_cache="64MiB")
    want = _live_all(encoder_file, ds)[:8]
    one = pad_collate(ds.__getitems__(list(range(8))))
    assert ds.cache_info().items == 8 and ds.cache_info().misses == 8
    two = pad_collate(ds.__getitems__(list(range(8))))
    assert ds.cache_info().hits == 8
    for padded, lengths in (one, two):  # from the shards, then from the RAM tier
        for j, w in enumerate(want):
            _assert_close(padded[j, : lengths[j]], w)
            assert not padded[j, lengths[j] :].any()


def _worker_budget(_: int) -> int:
    return ram_budget_for_process(1000)


def test_ram_budget_is_split_between_workers() -> None:
    assert ram_budget_for_process(1000) == 1000
    loader = DataLoader(range(4), batch_size=None, num_workers=2, collate_fn=_worker_budget)
    assert set(loader) == {500}


def test_multi_output_encoder_returns_dicts(audio_dir, multi_encoder_file, store_dir) -> None:
    build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, multi_encoder_file, cache=store_dir, on_miss="error")
    want = _live_all(multi_encoder_file, ds)
    for i in range(len(ds)):
        _assert_close(ds[i], want[i])
    batch = pad_collate(ds.__getitems__([0, 5, 9]))
    assert set(batch) == {"hidden", "pooled"}
    padded, lengths = batch["hidden"]
    _assert_close(padded[1, : lengths[1]], want[5]["hidden"])


def test_output_and_dtype_select_the_cli_keys(audio_dir, multi_encoder_file, store_dir) -> None:
    recipe = Recipe(output="hidden", dtype="float16", max_seconds=0.5)
    build(audio_dir, multi_encoder_file, cache=store_dir, recipe=recipe, workers=0)
    ds = CachedFeatureDataset(
        audio_dir,
        multi_encoder_file,
        cache=store_dir,
        output="hidden",
        dtype="float16",
        max_seconds=0.5,
        on_miss="error",
    )
    assert ds.stored() == len(ds)
    x = ds[0]
    assert x.dtype == torch.float16
    _assert_close(x, live_features(multi_encoder_file, Path(ds.path(0)), recipe))
    other = CachedFeatureDataset(audio_dir, multi_encoder_file, cache=store_dir, output="hidden")
    assert other.stored() == 0  # float32 is another recipe, hence other keys


def test_list_of_paths_in_given_order(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    paths = sorted(audio_dir.rglob("*.wav"), reverse=True)[:6]
    ds = CachedFeatureDataset([str(p) for p in paths], encoder_file, cache=store_dir,
                              on_miss="error")  # fmt: skip
    assert [ds.path(i) for i in range(6)] == [str(p.resolve()) for p in paths]
    for i, p in enumerate(paths):
        _assert_close(ds[i], live_features(encoder_file, p))
    assert ds[-1].shape == ds[5].shape
    with pytest.raises(IndexError):
        ds[6]


def test_unreadable_inputs_not_in_store_fail_at_construction(tmp_path, encoder_file) -> None:
    with pytest.raises(SourceError, match=r"missing\.wav"):
        CachedFeatureDataset([str(tmp_path / "missing.wav")], encoder_file, cache=tmp_path / "s")
    with pytest.raises(SourceError, match="no input files"):
        (tmp_path / "empty").mkdir()
        CachedFeatureDataset(tmp_path / "empty", encoder_file, cache=tmp_path / "s")
    with pytest.raises(ConfigError, match="on_miss"):
        CachedFeatureDataset(tmp_path / "empty", encoder_file, on_miss="skip")


def compact_with_gc(store_dir: Path) -> list[Path]:
    """Run featbake's gc so that it merges every (small) shard into a new one and deletes the
    old files, as it does on a live store. Returns the files it deleted."""
    from featbake.upkeep import GcOptions, execute_gc, plan_gc

    old = sorted((store_dir / "shards").rglob("*.safetensors"))
    assert len(old) >= 2, "build with shard_bytes=1 so there are small shards to merge"
    execute_gc(plan_gc(store_dir, GcOptions(grace=0, merge_small=True, shard_bytes=1 << 30)))
    new = sorted((store_dir / "shards").rglob("*.safetensors"))
    assert len(new) == 1 and not set(new) & set(old), "gc did not move the features"
    return old


def test_gc_moving_a_shard_is_followed(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = _live_all(encoder_file, ds)
    for i in range(len(ds)):  # the old locations are remembered and their files open
        _assert_close(ds[i], want[i])
    compact_with_gc(store_dir)  # gc compacts while this dataset still holds the old locations
    ds2 = pickle.loads(pickle.dumps(ds))  # a spawned worker's copy starts without handles
    for d in (ds, ds2):
        for i in range(len(d)):
            _assert_close(d[i], want[i])
    assert ds.cache_info().encoded == 0
    fresh = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    padded, lengths = pad_collate(fresh.__getitems__(list(range(len(fresh)))))
    for i, w in enumerate(want):
        _assert_close(padded[i, : lengths[i]], w)


def test_last_use_is_recorded_in_batches(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    cat = Catalog(Layout(store_dir))
    cat.conn.execute("UPDATE features SET last_used=0")
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    for i in range(5):
        ds[i]
    rows = dict(cat.conn.execute("SELECT key, last_used FROM features").fetchall())
    assert not any(rows.values())  # nothing written per read
    ds.flush()
    rows = dict(cat.conn.execute("SELECT key, last_used FROM features").fetchall())
    used = {ds.key(i) for i in range(5)}
    assert all(rows[k] > 0 for k in used)
    assert not any(v for k, v in rows.items() if k not in used)
    cat.close()


def test_corrupt_shard_is_reported_not_served(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    (shard,) = list((store_dir / "shards").rglob("*.safetensors"))
    blob = bytearray(shard.read_bytes())
    blob[-100] ^= 0xFF  # flip bits in the last tensor's data
    os.chmod(shard, 0o644)
    shard.write_bytes(bytes(blob))
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    from featbake.errors import StoreCorrupt

    with pytest.raises(StoreCorrupt, match="verify --repair"):
        for i in range(len(ds)):
            ds[i]
    with pytest.raises(StoreCorrupt):
        ds.__getitems__(list(range(len(ds))))


def test_root_published_for_unbuilt_folder(audio_dir, encoder_file, store_dir) -> None:
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    cat = Catalog(Layout(store_dir))
    (root,) = cat.roots()
    assert root.encoder_fp == ds.encoder_fingerprint
    items = cat.root_items(root.name)
    assert [k for _, k in items] == [ds.key(i) for i in range(len(ds))]
    assert json.loads(json.dumps(root.recipe)) == ds.recipe.as_dict()
    cat.close()


def test_dropped_dataset_still_saves_its_write_back(audio_dir, encoder_file, store_dir) -> None:
    import gc

    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    ds[0], ds[1]
    del ds
    gc.collect()  # the finalizer seals; it holds nothing that keeps the dataset alive
    again = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    assert again.stored() == 2


def test_workers_record_last_use_once(audio_dir, encoder_file, store_dir) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    cat = Catalog(Layout(store_dir))
    cat.conn.execute("UPDATE features SET last_used=0")
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=pad_collate)
    list(loader)  # workers record last use when they exit
    rows = dict(cat.conn.execute("SELECT key, last_used FROM features").fetchall())
    assert all(v > 0 for v in rows.values())
    cat.conn.execute("UPDATE features SET last_used=0")
    list(loader)  # new workers: the shared bitmap says these were recorded within the hour
    rows = dict(cat.conn.execute("SELECT key, last_used FROM features").fetchall())
    assert not any(rows.values())
    cat.close()


def test_labels_pair_by_path_with_stack_dataset(audio_dir, encoder_file, store_dir) -> None:
    from torch.utils.data import StackDataset

    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    label_of = {ds.path(i): i * 10 for i in range(len(ds))}  # e.g. read from a CSV by path
    train = StackDataset(ds, [label_of[ds.path(i)] for i in range(len(ds))])
    order = list(range(len(ds)))[::-1]
    loader = DataLoader(train, batch_size=4, sampler=order, num_workers=2, collate_fn=pad_collate)
    want = _live_all(encoder_file, ds)
    for b, (padded, lengths, labels) in enumerate(loader):
        for j, label in enumerate(labels.tolist()):
            i = order[b * 4 + j]
            assert label == i * 10
            _assert_close(padded[j, : lengths[j]], want[i])


def test_located_hit_path_follows_moves_and_closed_shards(audio_dir, encoder_file, store_dir):
    # Small shards and one open file at a time: every switch closes a shard, and its descriptor
    # number is reused by the next one, so a remembered location must never outlive its file.
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)
    old = list((store_dir / "shards").rglob("*.safetensors"))
    assert len(old) >= 3
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, on_miss="error", max_open_shards=1
    )
    want = _live_all(encoder_file, ds)
    n = len(ds)
    order = [i for k in range(3) for i in (list(range(n)) if k % 2 else list(range(n))[::-1])]
    for i in order:  # remembered locations, shards closed and reopened in between
        _assert_close(ds[i], want[i])
    wide = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    for _ in range(2):  # the second pass takes the located hit path throughout
        for i in order:
            _assert_close(wide[i], want[i])
    assert all(loc is not None for loc in wide._state.loc)
    padded, lengths = pad_collate(ds.__getitems__(order[:n]))
    for row, i in enumerate(order[:n]):
        _assert_close(padded[row, : lengths[row]], want[i])
    # gc compacts: the features move to a new shard and the old files are deleted.
    old_files = compact_with_gc(store_dir)
    assert set(old_files) == set(old)
    for i in order:
        _assert_close(ds[i], want[i])
    padded, lengths = pad_collate(ds.__getitems__(list(range(n))))
    for i in range(n):
        _assert_close(padded[i, : lengths[i]], want[i])
        assert not padded[i, lengths[i] :].any()
    assert ds.cache_info().encoded == 0
    for i in range(n):  # old files deleted while open: still the same bytes
        _assert_close(wide[i], want[i])


def test_reads_from_another_thread_relocate(audio_dir, encoder_file, store_dir) -> None:
    """A dataset used from a second thread looks items up with that thread's own connection."""
    import threading

    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = _live_all(encoder_file, ds)
    ds._index.shard[1] = -1  # forget where items are: reads must look them up in the catalog again
    ds._index.shard[2] = -1
    _assert_close(ds[1], want[1])  # the main thread opens the process state and its catalog
    got: list = []

    def other() -> None:
        try:
            got.append(ds[2])
        except Exception as e:  # surfaced to the assert below
            got.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    _assert_close(got[0], want[2])
    ds.close()


def test_forked_child_closes_the_parents_shard_fds(audio_dir, encoder_file, store_dir) -> None:
    """A forked worker closes its copies of the parent's open shard files before opening its own."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = _live_all(encoder_file, ds)
    for i in range(len(ds)):
        ds[i]
    fds = [r.fd for r in ds._state.open_readers.values()]
    assert fds
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            ok = all(torch.allclose(ds[i], want[i], **TOL) for i in range(len(ds)))
            shards = [str(p) for p in store_dir.rglob("*.safetensors")]
            open_now = [int(fd) for fd in os.listdir("/proc/self/fd")]
            still = [fd for fd in open_now if _fd_target(fd) in shards]
            os.write(w, json.dumps([ok, len(still), len(ds._state.open_readers)]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        ok, still, reopened = json.loads(f.read())
    os.waitpid(pid, 0)
    assert ok
    assert still == reopened  # the child's own readers, none of the parent's
    assert all(_fd_target(fd) for fd in fds)  # the parent's files stay open here
    ds.close()


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_file_rewritten_after_hashing_is_not_stored_under_its_old_key(
    tmp_path, encoder_file, store_dir
) -> None:
    """A miss re-checks the file it decoded against what was hashed: new bytes, no old key."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    soundfile.write(a / "x.wav", make_tone(1.0, seed=1), 16000)
    soundfile.write(a / "y.wav", make_tone(1.0, seed=3), 16000)
    shutil.copy(a / "x.wav", b / "x.wav")  # a backup with the same bytes: the same key
    ds = CachedFeatureDataset(a, encoder_file, cache=store_dir)
    old_key = ds.key(0)
    soundfile.write(a / "x.wav", make_tone(1.0, seed=2), 16000)  # regenerated mid-run
    with pytest.raises(SourceError, match="changed"):
        ds[0]
    os.utime(a / "y.wav")  # touched, same bytes: still encoded and served
    _assert_close(ds[1], live_features(encoder_file, a / "y.wav"))
    ds.close()
    assert not Catalog(Layout(store_dir)).present_keys([old_key])
    ds_b = CachedFeatureDataset(b, encoder_file, cache=store_dir)
    assert ds_b.key(0) == old_key
    _assert_close(ds_b[0], live_features(encoder_file, b / "x.wav"))


def _delete_shards_of(store_dir: Path, keys: list[str]) -> set[Path]:
    """Delete by hand the shard files that hold ``keys`` (the catalog still names them)."""
    catalog = Catalog(Layout(store_dir))
    try:
        paths = {Layout(store_dir).shard_path(loc.shard) for k in keys for loc in catalog.locate(k)}
    finally:
        catalog.close()
    for p in paths:
        p.unlink()
    return paths


def test_shard_deleted_by_hand_is_encoded_again(audio_dir, encoder_file, store_dir) -> None:
    """A lost shard (deleted by hand, a partial copy of the store): on_miss='encode' encodes
    its items again, in every read path; on_miss='error' says they are not in the store."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    want = _live_all(encoder_file, ds)
    lost = [3, 7]
    _delete_shards_of(store_dir, [ds.key(i) for i in lost])
    # Checked before any write-back is sealed: once one is, the items are stored again.
    strict = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    with pytest.raises(CacheMiss, match=re.escape(Path(strict.path(lost[0])).name)):
        for i in range(len(strict)):
            strict[i]
    for i in range(len(ds)):  # the index still names the deleted shards
        _assert_close(ds[i], want[i])
    assert ds.cache_info().encoded == len(lost)
    batch = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    got = batch.__getitems__(list(range(len(batch))))
    for i in range(len(batch)):
        _assert_close(got[i], want[i])
    loader = DataLoader(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir),
        batch_size=4,
        num_workers=2,
        collate_fn=pad_collate,
    )
    for b, (padded, lengths) in enumerate(loader):
        for j, n in enumerate(lengths.tolist()):
            _assert_close(padded[j, :n], want[b * 4 + j])


def test_lost_items_written_back_are_hits_for_the_next_dataset(
    audio_dir, encoder_file, store_dir
) -> None:
    """Issue 11, item 9: the write-back of items whose shard was lost repoints their rows, so
    the next dataset (and a rebuild) finds them; before, the rows still named the lost file
    (first row wins) and every new process encoded the items again."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    want = _live_all(encoder_file, ds)
    lost = [2, 5, 11]
    _delete_shards_of(store_dir, [ds.key(i) for i in lost])
    for i in range(len(ds)):
        _assert_close(ds[i], want[i])
    ds.flush()  # one write-back shard of three items: new content, not the lost files again
    assert ds.cache_info().encoded == len(lost)
    after = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    for i in range(len(after)):
        _assert_close(after[i], want[i])
    assert build(audio_dir, encoder_file, cache=store_dir, workers=0).encoded == 0
    from featbake.upkeep import verify

    assert verify(store_dir).status == "clean"


def test_open_shards_are_evicted_least_recently_used(audio_dir, encoder_file, store_dir) -> None:
    """With room for two open shards, reading a, b, a, c closes b (least recently used), not a
    (the first opened), on every read path."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=1)  # a shard per item
    for get in ("item", "batch"):
        ds = CachedFeatureDataset(
            audio_dir, encoder_file, cache=store_dir, on_miss="error", max_open_shards=2
        )
        want = _live_all(encoder_file, ds)
        a, b, c = 0, 5, 9
        for i in (a, b, a, a, c):
            got = ds[i] if get == "item" else ds.__getitems__([i])[0]
            _assert_close(got, want[i])
        catalog = Catalog(Layout(store_dir))
        shard_of = {
            i: Layout(store_dir).shard_path(catalog.locate(ds.key(i))[0].shard) for i in (a, c)
        }
        catalog.close()
        assert set(ds._state.open_readers) == {shard_of[a], shard_of[c]}, get
        ds.close()


# == test_serve_inputs =============================================================================
# What a dataset is given and what it may do with the store: a list of paths gets the folder
# scan's checks, a read-only store is served without a write, and ``revalidate=True`` follows
# files rewritten after the dataset was made. Features are compared with running the encoder now.

LIST_OF_BAD_PATHS = textwrap.dedent(
    """
    import sys
    from featbake.errors import SourceError
    from featbake.serve.dataset import CachedFeatureDataset
    enc, store, *paths = sys.argv[1:]
    try:
        CachedFeatureDataset(paths, enc, cache=store)
    except SourceError as e:
        print("SourceError:", e)
    else:
        print("no error")
    """
)


def _construct_in_a_subprocess(tmp_path: Path, encoder: Path, paths: list[Path]) -> str:
    """Make a dataset of ``paths`` in a child process with a deadline (a FIFO would block the
    constructor forever: the deadline turns that into a failure, not a hung test run)."""
    script = tmp_path / "ds.py"
    script.write_text(LIST_OF_BAD_PATHS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, script, encoder, tmp_path / "store", *paths]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_list_with_a_fifo_or_a_symlink_loop_fails_at_once(tmp_path: Path, encoder_file) -> None:
    """Issue 16 item 8: ``CachedFeatureDataset([fifo, wav])`` blocked forever on the FIFO."""
    write_audio_folder(tmp_path / "a", 1, seconds=0.3)
    wav = tmp_path / "a" / "clip00000.wav"
    fifo, loop = tmp_path / "a" / "fifo.wav", tmp_path / "a" / "loop.wav"
    os.mkfifo(fifo)
    loop.symlink_to(loop.name)  # loop.wav -> loop.wav
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [fifo, wav, loop])
    assert out.startswith("SourceError: 2 of the 3 input files cannot be inputs"), out
    assert f"{fifo}: not a regular file (a FIFO)" in out
    assert f"{loop}: cannot stat: Too many levels of symbolic links" in out
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [wav, Path("/dev/zero")])
    assert "/dev/zero: not a regular file (a character device)" in out, out


def test_a_list_and_the_folder_scan_refuse_the_same_files_alike(tmp_path: Path) -> None:
    """One check for both: each bad file gets the same reason from the scan and from a list."""
    data = tmp_path / "a"
    write_audio_folder(data, 1, seconds=0.3)
    os.mkfifo(data / "fifo.wav")
    (data / "loop.wav").symlink_to("loop.wav")
    (data / "gone.wav").symlink_to("nowhere.wav")
    (data / "dir.wav").mkdir()
    (data / "dir.wav" / "inside.txt").write_text("x")
    skipped = {s.path: s.reason for s in scan_inputs(data, [".wav"]).skipped}
    assert sorted(skipped) == ["fifo.wav", "gone.wav", "loop.wav"]  # a folder is walked
    for name in ["fifo.wav", "gone.wav", "loop.wav", "dir.wav"]:
        with pytest.raises(SourceError) as refused:
            check_input_files([data / "clip00000.wav", data / name])
        assert str(refused.value).startswith("1 of the 2 input files cannot be inputs")
        if name in skipped:
            assert f"{data / name}: {skipped[name]};" in str(refused.value)
    with pytest.raises(SourceError, match="a folder"):
        check_input_files([data / "dir.wav"])
    with pytest.raises(SourceError, match="list of input files is empty"):
        check_input_files([])
    assert check_input_files([data / "clip00000.wav"]) == [str(data / "clip00000.wav")]


# -- issue 16 item 5: a read-only store with a new file in the data folder ---------------------
SERVE_READ_ONLY = textwrap.dedent(
    """
    import json, sys, warnings, torch
    from featbake.errors import CacheMiss
    from featbake.serve.dataset import CachedFeatureDataset
    store, data, enc, out = sys.argv[1:5]
    strict = CachedFeatureDataset(data, enc, cache=store, on_miss="error")
    new = [i for i in range(len(strict)) if "/new/" in strict.path(i)]
    feats, refused = {}, 0
    for i in range(len(strict)):
        try:
            feats[strict.path(i)] = strict[i]
        except CacheMiss:
            refused += 1
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        live = CachedFeatureDataset(data, enc, cache=store)  # on_miss="encode"
    got = {live.path(i): live[i] for i in range(len(live))}
    got.update({live.path(i): b for i, b in zip(new, live.__getitems__(new), strict=True)})
    live.close()
    torch.save({"strict": feats, "live": got}, out)
    print(json.dumps({"n": len(strict), "stored": strict.stored(), "refused": refused,
                      "new": len(new), "read_only": strict.read_only and live.read_only,
                      "warned": [str(w.message) for w in said]}))
    """
)


def _store_files(store: Path) -> dict[str, bytes]:
    """Every file of the store and its bytes, but what a ``mode=ro`` SQLite reader makes (the
    shared-memory index, an empty WAL): no content of the store."""
    files = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    return {
        name: data
        for name, data in files.items()
        if not name.endswith("-shm") and not (name.endswith("-wal") and not data)
    }


def _serve_read_only(tmp_path: Path, store: Path, audio_dir: Path, encoder: Path, how: str):
    """Build, add a file to the folder, serve it from ``store`` made read-only ``how``."""
    build(audio_dir, encoder, cache=store, workers=0)
    write_audio_folder(audio_dir / "new", 1, seconds=0.5, seed=77)  # not in the store
    before = _store_files(store)
    script, out = tmp_path / "serve_ro.py", tmp_path / "served.pt"
    script.write_text(SERVE_READ_ONLY)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, str(script), str(store), str(audio_dir), str(encoder), str(out)]
    if how == "mount":
        ro = tmp_path / "ro"
        ro.mkdir()
        shell = f'mount --bind {store} {ro} && mount -o remount,bind,ro {ro} && exec "$@"'
        run = ["unshare", "-m", "sh", "-c", shell, "sh", *run]
        run[run.index(str(store))] = str(ro)
    else:
        env["FEATBAKE_READ_ONLY"] = "1"
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _store_files(store) == before  # nothing published, written back or recorded
    assert not (store / "fragments").exists() or not any((store / "fragments").iterdir())
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)


@pytest.mark.parametrize(
    "how",
    [
        "env",
        pytest.param(
            "mount",
            marks=pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m (root)"),
        ),
    ],
)
def test_a_read_only_store_serves_what_it_holds_when_the_folder_grew(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path, how: str
) -> None:
    """Issue 16 item 5: the constructor published the grown folder's root and failed. Now the
    stored items are served, the new file is a miss under ``on_miss``, and no byte of the store
    changes, with $FEATBAKE_READ_ONLY=1 and on a real read-only mount."""
    said, served = _serve_read_only(tmp_path, store_dir, audio_dir, encoder_file, how)
    assert said["read_only"] and said["n"] == 17 and said["new"] == 1
    assert said["stored"] == 16 and said["refused"] == 1  # on_miss="error": a CacheMiss
    assert len(said["warned"]) == 1 and "read-only here, and 1 item(s)" in said["warned"][0]
    assert len(served["strict"]) == 16 and len(served["live"]) == 17
    for path, feat in served["live"].items():
        want = live_features(encoder_file, Path(path))
        torch.testing.assert_close(feat, want)
        if path in served["strict"]:
            torch.testing.assert_close(served["strict"][path], want)


# -- issue 16 item 11: a file rewritten after the dataset was made ------------------------------
def _rewrite(path: Path, source: Path) -> None:
    """Rewrite ``path`` in place with ``source``'s bytes, keeping its size and mtime (``cp -p``
    of a clip of equal length: only ctime tells)."""
    st = path.stat()
    path.write_bytes(source.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("ram_cache", [0, "16MiB"])
def test_revalidate_serves_a_rewritten_file_as_it_is_now(
    audio_dir: Path, encoder_file: Path, store_dir: Path, ram_cache: object
) -> None:
    """By default an item keeps the feature of its file as it was when the dataset was made
    (documented); with ``revalidate=True`` one stat per read notices the rewrite and the item is
    served as the file is now: a hit when the store holds the new bytes, else encoded live (or
    a CacheMiss under on_miss="error"), on the single-item and the batch paths alike."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    opts = {"cache": store_dir, "ram_cache": ram_cache}
    plain = CachedFeatureDataset(audio_dir, encoder_file, on_miss="error", **opts)
    fresh = CachedFeatureDataset(audio_dir, encoder_file, revalidate=True, **opts)
    strict = CachedFeatureDataset(audio_dir, encoder_file, revalidate=True, on_miss="error", **opts)
    fixed = [i for i in range(len(plain)) if "/fixed/" in plain.path(i)]  # four 1 s clips
    a, b, c = (Path(plain.path(i)) for i in fixed[:3])
    old = [live_features(encoder_file, p) for p in (a, b)]
    for ds in (plain, fresh, strict):
        ds.__getitems__(fixed)  # read (located, RAM tier) before the rewrite
        ds[fixed[0]], ds[fixed[1]]
    _rewrite(a, c)  # bytes the store holds (c's)
    soundfile.write(b, make_tone(1.0, seed=99), 16000)  # bytes nobody encoded
    now = [live_features(encoder_file, p) for p in (a, b)]
    assert not torch.equal(now[0], old[0]) and not torch.equal(now[1], old[1])
    for k, i in enumerate(fixed[:2]):  # the default: the folder as it was (documented)
        torch.testing.assert_close(plain[i], old[k])
    torch.testing.assert_close(fresh[fixed[0]], now[0])
    assert fresh.cache_info().encoded == 0  # a's new bytes are c's: a hit
    torch.testing.assert_close(fresh[fixed[1]], now[1])  # encoded live
    assert fresh.cache_info().encoded == 1
    for got, want in zip(fresh.__getitems__(fixed[:2]), now, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(strict.__getitems__(fixed[:1])[0], now[0])
    # b's new bytes were encoded (and written back) by `fresh` in this process: every reader
    # here reads them at once (issue 18 item 4). Bytes nobody encoded are a miss.
    torch.testing.assert_close(strict[fixed[1]], now[1])
    d = Path(plain.path(fixed[3]))
    strict[fixed[3]]  # read before the rewrite
    soundfile.write(d, make_tone(1.0, seed=98), 16000)
    with pytest.raises(CacheMiss, match=str(d)):
        strict[fixed[3]]
    assert fresh.key(fixed[0]) == fresh.key(fixed[2]) != plain.key(fixed[0])


# == test_layer_view ===============================================================================
# ``layer_view`` on a store without layer parts: one clear error on every read path.
#
# (The views themselves, over a real Hugging Face model's layers, are tested in test_hf.py.)

NO_LAYERS = "layer_view needs features stored per layer"


@pytest.mark.parametrize(("view", "ram_cache"), [(0, 0), ([0, 1], 0), ("stack", 0), (0, "8MiB")])
def test_a_view_of_a_store_without_layers_fails_every_read(
    audio_dir: Path, encoder_file: Path, store_dir: Path, view: object, ram_cache: object
) -> None:
    """Issue 22 item 6: the first ``ds[i]`` raised, the second returned ``[T, D]`` (the located
    hit path skipped the view), and batches ignored it (the padded path). Now every read
    raises, the RAM tier's hits too, and a dataset whose stored items tell raises in its
    constructor."""
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, layer_view=view, ram_cache=ram_cache
    )
    for _ in range(2):  # nothing stored: the misses encode, write back, then hit
        with pytest.raises(ConfigError, match=NO_LAYERS):
            ds[0]
        with pytest.raises(ConfigError, match=NO_LAYERS):
            ds.__getitems__([0, 1])
        ds.flush()
    for _ in range(3):  # stored, read once, then from the remembered location
        with pytest.raises(ConfigError, match=NO_LAYERS):
            ds[1]
    with pytest.raises(ConfigError, match=NO_LAYERS):
        ds.__getitems__([1, 0])
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with pytest.raises(ConfigError, match=NO_LAYERS):
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, layer_view=view)
    cached = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, ram_cache="8MiB")
    assert cached[0].dim() == 2  # without a view: the [T, D] tensor, as before


# Issue "Nothing wrong served, round four" item 11: a folder holding an input the build skipped
# (a corrupt wav) made a dataset with on_miss="error" raise CacheMiss for it, advising the build
# that skips it again. The build records what it could not decode; the dataset leaves it out.
def test_an_input_the_build_could_not_decode_is_left_out_until_it_is_fixed(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    store = tmp_path / "c"
    broken = audio_dir / "part0" / "broken.wav"
    broken.write_bytes(b"RIFF\x00\x00junk")
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", store, "--json"]
    res = invoke(*args)
    assert res.returncode == 3, res.stderr
    report = json.loads(res.stdout)
    assert [f["path"] for f in report["failed"]] == ["part0/broken.wav"]
    with pytest.warns(UserWarning) as caught:
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store, on_miss="error")
    said = [str(w.message) for w in caught if "could not be decoded" in str(w.message)]
    assert len(said) == 1 and "1 input(s)" in said[0] and "part0/broken.wav" in said[0], said
    assert len(ds) == 16 and ds.stored() == 16
    assert "part0/broken.wav" not in [ds.item_id(i) for i in range(len(ds))]
    for i in range(len(ds)):
        _assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    # Fixed (a valid clip in its place): another key, which the record does not name.
    write_audio_folder(tmp_path / "good", 1, seconds=0.5, seed=41)
    shutil.copyfile(next((tmp_path / "good").rglob("*.wav")), broken)
    fixed = invoke(*args)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["encoded"] == 1
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store, on_miss="error")
    ids = [ds.item_id(i) for i in range(len(ds))]
    assert len(ds) == 17 and ds.stored() == 17 and "part0/broken.wav" in ids
    j = ids.index("part0/broken.wav")
    _assert_close(ds[j], live_features(encoder_file, broken))


#: A process that served a dataset (one miss pending in its write-back), dropped it inside a
#: reference cycle, and then repairs the store: the collector runs the dataset's finalizer at an
#: allocation inside repair's exclusive write lock (forced here where repair scans the store).
_COLLECTED_UNDER_REPAIR = """
import gc, importlib, sys
from pathlib import Path
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import Layout

repair_module = importlib.import_module("featbake.upkeep.repair")  # the package names a function
audio, encoder, store = map(Path, sys.argv[1:4])
ds = CachedFeatureDataset(audio, encoder, cache=store)
ds[0]  # a miss: encoded, its write-back pending
gc.disable()
ds.cycle = [ds]
del ds
scan = repair_module.scan_store

def collecting_scan(*args, **kwargs):
    gc.collect()  # what any allocation under the lock may do
    return scan(*args, **kwargs)

repair_module.scan_store = collecting_scan
print("repairing", flush=True)
repair_module.repair(Layout(store))
print("repaired", flush=True)
"""


def test_repair_in_a_process_that_dropped_a_dataset_does_not_hang(
    audio_dir, encoder_file, store_dir
) -> None:
    """``flock`` locks belong to an open file, not a process: the finalizer's shared lock on
    write.lock (a new descriptor) waits for repair's exclusive one on the same thread, with no
    timeout, so ``repair()`` (``featbake verify --repair`` run from Python) never returns.
    Now the finalizer hands its seal to the sealing thread, which the child's exit drains: the
    dropped dataset's miss is in the store once the child has ended."""
    args = [sys.executable, "-c", _COLLECTED_UNDER_REPAIR, audio_dir, encoder_file, store_dir]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert run_past_a_marker([str(a) for a in args], "repairing", env) == "repaired"
    again = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    _assert_close(again[0], live_features(encoder_file, Path(again.path(0))))


def test_a_file_renamed_since_the_build_is_said_to_be_served_twice(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A file renamed after the build is served under both names (the gone one's features are
    kept, as for any file gone since the build): each epoch read it twice, and nothing said so.
    A warning names it; a build again serves the files there now only. A copy (both there) is
    two items, as it is, without a word."""
    import warnings

    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    clips = sorted(audio_dir.rglob("*.wav"))
    shutil.copy(clips[0], audio_dir / "copy.wav")
    clips[1].rename(audio_dir / "renamed.wav")
    with pytest.warns(UserWarning, match=r"1 file\(s\) of .* gone since the build") as said:
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    (line,) = [str(w.message) for w in said if "gone since the build" in str(w.message)]
    rel = clips[1].relative_to(audio_dir).as_posix()
    assert f"{rel} (now renamed.wav)" in line and "copy.wav" not in line, line
    assert len(ds) == len(clips) + 2
    for i in range(len(ds)):
        path = Path(ds.path(i))
        live = live_features(encoder_file, path if path.exists() else audio_dir / "renamed.wav")
        torch.testing.assert_close(ds[i], live)
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
    assert len(ds) == len(clips) + 1
