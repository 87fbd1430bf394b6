"""A padded build into a bucket stopped before its late batch failed the padding check, then
run again: on its node, on another node, and on another node after a merge published what the
stopped build stored (docs/reliability.md r22.3).

Which items came from padded batches was known only to the run that padded them. A build that
may pad records the keys it sets out to encode before it encodes any (store/roots.py); that
record was a file of the node's tier, so a rerun on another node read none and reused the items
stored padded, served off by the padding's drift. And where a merge had folded the stopped
build's rows into a published version, the rerun's rows encoded again lost to them at its own
merge (the first row folded wins), and a version that held such rows kept them until a build
finished. The stores are real (moto's S3 on loopback), and every item served is compared with
the encoder run now on that item alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.store.bucket import merge_bucket
from featbake.store.catalog import Catalog
from featbake.store.fragment_catalog import FragmentCatalog, RankPart
from featbake.store.open import open_store
from featbake.store.roots import RootSpec
from featbake.store.shard import write_shard
from featbake.testing import save_torchscript, write_audio_folder
from tests.bake.test_batching import (
    LittlePaddingLeaks,
    assert_serves_alone,
    clips,
    interrupted_after_padded_batches,
)
from tests.store.bucket.conftest import S3, bucket_store


@pytest.mark.parametrize(
    "rerun", ["same-node", "other-node", "other-node-after-a-merge", "other-node-after-it-failed"]
)
def test_a_padded_bucket_build_stopped_and_run_again_anywhere_serves_each_item_as_alone(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rerun: str
) -> None:
    """12 clips whose padding drifts by 0.5 only when padded a little, built padded in
    batches of 3 into a bucket and stopped after 9 (3 batches passed the check; the 4th would
    fail it), or (``after-it-failed``) after the 4th failed it, before the 9 were encoded
    again (rerun then in exact batches). The rerun encodes them again alone wherever it runs,
    and its end removes the record from the bucket; a third node serves all 12 equal to the
    encoder run on each alone. Before: on another node 3 of 12 were served off by 0.5, and
    after a merge of another build in between as well."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder = save_torchscript(module, tmp_path / "leaky.pt")
    failed = rerun.endswith("after-it-failed")
    interrupted_after_padded_batches(data, encoder, s3.url, at=12 if failed else 9)
    assert len(s3.objects("padding/")) == 1  # what the stopped build set out to encode
    if rerun != "same-node":
        monkeypatch.setenv("FEATBAKE_LOCAL_CACHE", str(tmp_path / "node-b"))
    if rerun == "other-node-after-a-merge":  # another build's merge folds the stopped one's
        write_audio_folder(tmp_path / "other", 3, seconds=1.0, seed=77)  # rows into a version
        build(tmp_path / "other", encoder, cache=s3.url, workers=0, batching="exact")
        assert s3.objects("catalog/")
    batching = "exact" if failed else "padded"  # the record alone has them encoded again
    again = build(data, encoder, cache=s3.url, workers=0, batch_size=3, batching=batching)
    if failed:  # the record says a check failed: all it names are encoded again, as work
        assert again.ok and (again.reused, again.encoded) == (0, 12), again
    else:
        assert again.ok and (again.reused, again.encoded) == (9, 3), again
        assert "the 9 items padded before were encoded again alone" in again.batching_note
    assert s3.objects("padding/") == []
    tier = tmp_path / ("local-cache" if rerun == "same-node" else "node-b")  # the rerun's
    assert list(tier.rglob("roots")) and not list(tier.rglob("*.padding"))  # nor its copy
    monkeypatch.setenv("FEATBAKE_LOCAL_CACHE", str(tmp_path / "node-c"))
    assert_serves_alone(data, module, encoder, cache=s3.url)


def test_void_rows_a_version_holds_are_dropped_from_it_while_their_build_waits(
    s3: S3, tmp_path: Path
) -> None:
    """Part 0/2 stores key a padded; another build's merge publishes its rows with that
    build's; part 0's check then fails: it forgets a, stores it again and ends, part 1 never
    run. Before, each merge dropped the padded row in its working copy but published nothing
    (no build finished), so the bucket went on serving it. Now the merge that finds rows the
    version held void publishes: a fresh node reads the row stored again."""
    efp, rfp = "e" * 64, "r" * 64
    a, c = "a" * 64, "c" * 64
    layout = open_store(s3.url, local_cache=tmp_path / "node-a")
    part = FragmentCatalog(layout, RankPart(0, 2, [("a.wav", 10), ("z.wav", 10)]))
    part.record_encoder(efp, "enc", "torchscript")
    part.replace_root(RootSpec("w", "/d", "enc", efp, rfp, {}), [("a.wav", a)])
    part.add_shard(write_shard(layout, {a: torch.ones(3)}, efp, rfp))  # padded
    part.flush()
    other = FragmentCatalog(layout, RankPart(0, 1, [("c.wav", 10)]))
    other.record_encoder(efp, "enc", "torchscript")
    other.replace_root(RootSpec("o", "/o", "enc", efp, rfp, {}), [("c.wav", c)])
    other.add_shard(write_shard(layout, {c: torch.zeros(3)}, efp, rfp))
    assert other.finish() is not None
    other.close()
    merge_bucket(bucket_store(s3.url, tmp_path / "node-m"))  # the waiting padded row too
    part.forget_keys([a])
    exact = write_shard(layout, {a: torch.full((3,), 2.0)}, efp, rfp)
    part.add_shard(exact)
    part.close()
    report = merge_bucket(bucket_store(s3.url, tmp_path / "node-m"))
    assert report.void_rows == 1
    fresh = bucket_store(s3.url, tmp_path / "node-r")
    fresh.sync_catalog()
    with Catalog(fresh.layout, read_only=True) as cat:
        assert [loc.shard for loc in cat.locate(a)] == [exact.name]
