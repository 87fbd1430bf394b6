"""A store in a bucket on a real server on loopback (moto; the tests of the store's behaviour
also on fake-gcs-server and Azurite, through ``place``): build, rebuild, serve, merge.

Every served feature is compared with running the encoder now.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader

from featbake import CachedFeatureDataset
from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from featbake.errors import StoreCorrupt
from featbake.quantize import Fidelity, Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.store.fidelity import read_fidelity
from featbake.store.objects import ObjectStore
from featbake.store.open import open_store
from featbake.store.ranged import RangedShardReader
from featbake.store.url import BucketURL
from featbake.store.versions import version_of
from featbake.testing import counted_requests
from tests.bake.test_batching import LittlePaddingLeaks, assert_serves_alone, clips
from tests.conftest import invoke, live_features
from tests.store.bucket.conftest import S3, Place, Remote


def bake(data: Path, encoder: Path, where: object, **kw: object):
    return build(data, encoder, cache=where, workers=0, shard_bytes=60_000, **kw)


def assert_dataset_is_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def test_a_build_into_a_bucket_publishes_shards_and_a_catalog_version(
    place: Remote | S3, audio_dir: Path, encoder_file: Path
) -> None:
    report = bake(audio_dir, encoder_file, place.url)
    assert report.encoded == 16 and report.merged
    objects = place.objects()
    assert [o for o in objects if o.startswith("catalog/")] == ["catalog/v000000001.sqlite"]
    assert any(o.startswith("shards/") for o in objects)
    assert not [o for o in objects if o.startswith("fragments/")]  # folded, then deleted


def test_a_rebuild_from_a_fresh_node_encodes_nothing(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    bake(audio_dir, encoder_file, place.url)
    other_node = open_store(place.url, local_cache=tmp_path / "other-node")
    report = bake(audio_dir, encoder_file, other_node)
    assert report.encoded == 0 and report.reused == 16
    versions = [version_of(o) for o in place.objects("catalog/")]
    assert versions == [1, 2]


@pytest.mark.parametrize(
    ("place", "context"), [("s3", "fork"), ("s3", "spawn"), ("gs", "fork"), ("az", "fork")],
    indirect=["place"],
)  # fmt: skip
def test_a_dataset_serves_a_bucket_store_through_workers(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, context: str
) -> None:
    bake(audio_dir, encoder_file, place.url)
    tier = tmp_path / f"tier-{context}"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tier, local_cache_size="1GiB",
        on_miss="error",
    )  # fmt: skip
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context=context, shuffle=False
    )
    got = list(loader)
    assert len(got) == len(ds) == 16
    for i, value in enumerate(got):
        torch.testing.assert_close(value, live_features(encoder_file, Path(ds.path(i))))
    assert list(tier.rglob("*.safetensors"))  # the shards came through the local tier


def test_a_second_epoch_that_fits_the_tier_downloads_nothing(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    bake(audio_dir, encoder_file, place.url)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "tier", on_miss="error"
    )
    assert_dataset_is_live(ds, encoder_file)
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    first = tier.fetched
    assert first > 0
    for i in range(len(ds)):
        ds[i]
    assert tier.fetched == first


def test_a_whole_shard_fetch_is_one_get_and_no_head(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The catalog holds each shard's size, so fetching a shard whole asks the server nothing
    else (a HEAD for the size per shard before): counted at the byte seam, on every place."""
    bake(audio_dir, encoder_file, place.url)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "tier", on_miss="error"
    )
    with counted_requests(type(ObjectStore(BucketURL.parse(place.url)))) as sent:
        assert_dataset_is_live(ds, encoder_file)
    gets = {name: n for name, n in sent.by_name.items() if name.startswith("shards/")}
    assert sorted(gets) == place.objects("shards/") and set(gets.values()) == {1}
    assert (sent.ranged, sent.head) == (0, 0)


# == test_bucket_cli ===============================================================================
# Every command takes a bucket URL: build, stats, roots, verify, export (real subprocesses
# against the loopback S3 server); exported features equal live encoding.


def test_the_commands_take_a_bucket_url(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    tier = ["--local-cache", tmp_path / "tier", "--local-cache-size", "50MiB"]
    built = invoke(
        "build", "-e", encoder_file, "-d", audio_dir, "--cache", place.url, *tier,
        "--workers", "0", "--shard-size", "60KB", "--json",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["encoded"] == 16
    assert list((tmp_path / "tier").rglob("catalog.sqlite"))  # the named tier was used

    stats = invoke(
        "stats",
        "--cache",
        place.url,
        "--json",
        env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "tier")},
    )
    assert stats.returncode == 0, stats.stderr
    held = json.loads(stats.stdout)
    assert held["path"] == place.url and held["features"] == 16
    assert held["tier"]["version"] == 1 and held["tier"]["budget"] == 100 << 30
    roots = invoke("roots", "--cache", place.url)
    assert roots.returncode == 0 and "r-" in roots.stdout, roots.stderr

    clean = invoke("verify", "--cache", place.url)
    assert clean.returncode == 0 and "verify: clean" in clean.stdout, clean.stderr

    out = tmp_path / "feats.zarr"
    exported = invoke("export", "--format", "zarr", out, "--cache", place.url)
    assert exported.returncode == 0, exported.stderr
    group = zarr.open_group(str(out), mode="r")
    paths = [str(p) for p in group["paths"][:]]
    offsets = group["offsets"][:]
    for i in (0, len(paths) - 1):
        got = torch.from_numpy(np.asarray(group["values"][offsets[i] : offsets[i + 1]]))
        torch.testing.assert_close(got, live_features(encoder_file, audio_dir / paths[i]))

    name = roots.stdout.split("r-", 1)[1].split()[0]
    dropped = invoke("roots", "drop", f"r-{name}", "--cache", place.url)
    assert dropped.returncode == 0, dropped.stderr
    assert len(place.objects("catalog/")) == 2  # the drop went out as the next version
    assert "r-" not in invoke("roots", "--cache", place.url).stdout

    shard = place.objects("shards/")[0]
    ObjectStore(BucketURL.parse(place.url)).delete([shard])
    damaged = invoke(
        "verify", "--cache", place.url, env={"FEATBAKE_LOCAL_CACHE": str(tmp_path / "v")}
    )
    assert damaged.returncode == 11, damaged.stderr
    assert "missing" in damaged.stdout and Path(shard).stem in damaged.stdout
    refused = invoke("verify", "--cache", place.url, "--repair")
    assert refused.returncode == 2 and "not built for a bucket" in refused.stderr


# == test_bucket_padded ============================================================================
# A build into a bucket writes fragments (a rank's catalog): when padding is found inexact in
# a later batch, the items sealed before are encoded again into later fragments, and the merge
# that publishes the version folds a build's newest fragments first, so their rows win.


def test_a_bucket_build_replaces_what_padded_batches_sealed_before_the_guard_failed(
    place: Place, tmp_path: Path
) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    report = build(data, module, cache=place.url, workers=0, batch_size=3, batching="padded")
    assert report.ok and report.merged and report.batching == BatchingMode.EXACT
    assert "items padded before were encoded again alone" in report.batching_note
    assert not place.objects("fragments/")
    assert_serves_alone(data, module, cache=place.url, local_cache=tmp_path / "reader")


# == test_compact_bucket ===========================================================================
# The first int8 build into a bucket store: its fidelity travels in its fragment, the merge
# that publishes the catalog version records it, and a fresh node serves every feature equal to
# the live output quantised (issue 28.6: it exited 5, "could not record the measured fidelity").


def test_a_first_int8_build_into_a_bucket_records_fidelity_and_serves_live(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    recipe = Recipe(dtype="int8")
    report = build(audio_dir, encoder_file, cache=place.url, recipe=recipe, batch_size=1, workers=0)
    assert report.ok and report.merged and report.fidelity is not None
    recorded = read_fidelity(open_store(place.url), report.root)
    assert recorded == Fidelity.from_json(report.fidelity)
    # Another node (a fresh tier) reads the same record: it travels with the catalog version.
    elsewhere = open_store(place.url, local_cache=tmp_path / "another-node")
    assert read_fidelity(elsewhere, report.root) == recorded
    assert not place.objects("fragments/")  # folded into the published version
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "reader",
        on_miss="error", dtype="int8",
    )  # fmt: skip
    for i in range(len(ds)):
        live = live_features(encoder_file, Path(ds.path(i)), Recipe())
        assert isinstance(live, torch.Tensor)
        want = dequantize(quantize(live, Scheme.INT8), Scheme.INT8, torch.float16)
        assert torch.equal(ds[i], want), i


def test_an_int8_item_read_again_by_ranges_is_served_live(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The located hit path of an int8 store read by ranged GETs: the second read of an item
    (remembered where it lies) dequantises the bytes of a ranged GET, not a local file's (a
    ranged reader has none: the compiled read of its descriptor failed, 'Bad file descriptor')."""
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")
    recipe = Recipe(dtype="int8")
    assert build(
        audio_dir, encoder_file, cache=place.url, recipe=recipe, batch_size=1, workers=0
    ).ok
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier", on_miss="error", dtype="int8")
    for i in range(len(ds)):
        live = live_features(encoder_file, Path(ds.path(i)), Recipe())
        assert isinstance(live, torch.Tensor)
        want = dequantize(quantize(live, Scheme.INT8), Scheme.INT8, torch.float16)
        assert torch.equal(ds[i], want), i  # planned: read, then located
        assert torch.equal(ds[i], want), i  # the located hit path
    readers = ds._proc().handles.open_readers.values()
    assert readers and all(isinstance(r, RangedShardReader) for r in readers)


# == test_bucket_ranged ============================================================================
# A bucket store read by ranged GETs: when the tier cannot hold the store, each tensor's bytes
# come in one ranged GET (CRC-checked), nothing is fetched whole. Every item equals live.


def serve(
    place: Remote | S3, data: Path, encoder: Path, tier: Path, **kw: object
) -> CachedFeatureDataset:
    return CachedFeatureDataset(data, encoder, cache=place.url, local_cache=tier, **kw)


def test_a_tier_smaller_than_the_store_reads_items_by_ranges(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "tier"
    ds = serve(place, audio_dir, encoder_file, tier, local_cache_size="64KiB", on_miss="error")
    assert ds._layout.remote.reads_ranged()  # type: ignore[union-attr]
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    batch = ds.__getitems__([3, 0, 7])  # a batch's rows: spans read on several threads
    for i, got in zip([3, 0, 7], batch, strict=True):
        torch.testing.assert_close(got, live_features(encoder_file, Path(ds.path(i))))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))  # forked workers, own clients
    for i, value in enumerate(got):
        torch.testing.assert_close(value, live_features(encoder_file, Path(ds.path(i))))
    # The tier keeps the shard that fits (issue 32 item 8); the rest are read by ranges.
    kept = list(tier.rglob("*.safetensors"))
    assert len(kept) == 1 and sum(p.stat().st_size for p in kept) <= 64 << 10
    readers = ds._proc().handles.open_readers.values()
    assert readers and sum(isinstance(r, RangedShardReader) for r in readers) == len(readers) - 1


def test_a_damaged_span_is_read_twice_then_named(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    bucket = ObjectStore(BucketURL.parse(place.url))
    for obj in place.objects("shards/"):  # every shard's last tensor loses a byte
        local = tmp_path / "x"
        bucket.download(obj, local)
        data = bytearray(local.read_bytes())
        data[-3] ^= 0xFF
        local.write_bytes(bytes(data))
        bucket.upload(obj, local)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier", on_miss="error")
    twice = (
        rf"{place.url}/shards/\S+ is damaged in the bucket "
        r"\(checksum mismatch in tensor \w+, on two reads\)"
    )
    with pytest.raises(StoreCorrupt, match=twice) as refused:
        for i in range(len(ds)):
            ds[i]
    assert "verify --repair" not in str(refused.value)  # refused on a bucket


def test_feature_loader_starts_ranged_gets_ahead_and_yields_live_batches(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from featbake import FeatureLoader

    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")  # every shard by ranges
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier", local_cache_size="64KiB")
    started = ds.will_need(range(len(ds)))  # opens ranged readers, starts every item's GET
    assert started == len(ds)
    readers = list(ds._proc().handles.open_readers.values())
    assert all(isinstance(r, RangedShardReader) for r in readers)
    for i in range(len(ds)):  # each read takes its GET's bytes
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    assert all(not r._ahead for r in readers)  # every started GET was consumed
    loader = FeatureLoader(ds, batch_size=4, shuffle=False, read_ahead=8)
    rows = [p[:n] for padded, lengths in loader for p, n in zip(padded, lengths, strict=True)]
    assert len(rows) == len(ds)
    for i, row in enumerate(rows):  # in order: the loader's hints ran ahead of these reads
        torch.testing.assert_close(row, live_features(encoder_file, Path(ds.path(i))))


def test_a_shuffled_epoch_through_a_small_tier_asks_each_shard_once_by_ranges(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Issue 42 item 6: a ``shuffle=True`` epoch through a tier smaller than the store groups
    each shard's hinted items into one ranged GET (before: one GET per item, 13 here), and every
    row it serves equals the encoder run now."""
    from featbake import FeatureLoader

    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    shards = len(s3.objects("shards/"))
    ds = serve(s3, audio_dir, encoder_file, tmp_path / "tier", local_cache_size="64KiB")
    assert ds._layout.remote.reads_ranged()  # type: ignore[union-attr]
    loader = FeatureLoader(ds, batch_size=1, shuffle=True, seed=0)
    with counted_requests(type(ObjectStore(BucketURL.parse(s3.url)))) as sent:
        for epoch in range(2):
            sent.reset()
            rows = [padded[0][: lengths[0]] for padded, lengths in loader]
            order = [b[0] for b in loader._batches(epoch)[0]]
            assert sorted(order) == list(range(len(ds)))
            for i, row in zip(order, rows, strict=True):
                torch.testing.assert_close(row, live_features(encoder_file, Path(ds.path(i))))
    # The second epoch: headers read and the shard that fits kept; the items of every other
    # shard come by at most one ranged GET each.
    assert sent.whole == 0 and 0 < sent.ranged <= shards - 1 < len(ds) // 2
