"""gc's sweep beside a build on another node that puts a shard object again.

gc planned to delete a content-named shard nothing named (its root dropped, past the retention
period). Another node, building the same inputs with the same encoder, put the same bytes under
the same name and published a fragment naming them, after gc's listing and before its delete.
gc's delete is conditional on the version it listed (gs: the generation, az: the ETag), so the
other node's object stays, and the store serves what the encoder computes now.

The interleaving is driven at the byte seam: the other node's whole build runs inside gc's
delete call, before its request is sent. s3 is not driven here: its general-purpose buckets
condition a delete on the ETag alone, which the same bytes keep, and its HEAD's last change is
whole seconds (see ``test_objects.py``: what its check keeps and what it cannot see)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.store.bucket import catalog_shards
from featbake.store.objects import ObjectInfo, ObjectStore
from featbake.store.open import open_store
from featbake.upkeep import GcOptions, gc
from featbake.upkeep.check import verify_named
from tests.conftest import live_features
from tests.store.bucket.conftest import Place, bucket_store
from tests.store.bucket.test_objects import deletes_conditionally

HOUR = 3600.0
SHARD_BYTES = 60_000


def before_first_shard_delete(bucket: ObjectStore, step: Callable[[], None]) -> None:
    """Run ``step`` once inside ``bucket``'s first delete that names a shard object, before
    its request is sent (the instance's own ``delete``, wrapped)."""
    real = bucket.delete
    ran: list[bool] = []

    def delete(objects: Iterable[str | ObjectInfo]) -> list[str]:
        batch = list(objects)
        names = [o if isinstance(o, str) else o.name for o in batch]
        if not ran and any(n.startswith("shards/") for n in names):
            ran.append(True)
            step()
        return real(batch)

    bucket.delete = delete  # type: ignore[method-assign]


def shard_names_held(place: Place) -> set[str]:
    """The shard names the bucket holds objects of."""
    return {Path(n).name.removesuffix(".safetensors") for n in place.objects("shards/")}


@pytest.mark.parametrize("place", ["gs", "az"], indirect=True)
def test_gc_keeps_a_shard_another_node_put_again_between_its_listing_and_its_delete(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    if place.scheme == "gs" and not deletes_conditionally(place, tmp_path):
        pytest.skip("this fake-gcs-server ignores a delete's ifGenerationMatch (#1282)")
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=SHARD_BYTES)
    shards = shard_names_held(place)
    later = time.time() + 100
    node_a = bucket_store(place.url, tmp_path / "node-a")
    dropped = gc(node_a.layout, GcOptions(older_than=1.0, retention=HOUR), now=later)
    assert dropped.roots_dropped and shard_names_held(place) == shards  # unnamed, young

    def node_b_builds_again() -> None:
        again = open_store(place.url, local_cache=tmp_path / "node-b")
        build(audio_dir, encoder_file, cache=again, workers=0, shard_bytes=SHARD_BYTES)

    before_first_shard_delete(node_a.bucket, node_b_builds_again)
    swept = gc(node_a.layout, GcOptions(retention=HOUR), now=later + 2 * HOUR)
    # Node b's build published the same content-named shards: gc deleted none of them.
    assert swept.problems == [] and swept.shards_deleted == 0
    reader_tier = tmp_path / "reader"
    newest = open_store(place.url, local_cache=reader_tier)
    named = set(catalog_shards(newest.catalog))
    assert named == shards and shard_names_held(place) == shards
    assert verify_named(newest).status == "clean"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=reader_tier, on_miss="error"
    )
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    assert ds.cache_info().encoded == 0
    ds.close()
