"""A build into a bucket writes fragments (a rank's catalog): when padding is found inexact in
a later batch, the items sealed before are encoded again into later fragments, and the merge
that publishes the version folds a build's newest fragments first, so their rows win."""

from __future__ import annotations

from pathlib import Path

from featbake.bake.batching import BatchingMode
from featbake.bake.pipeline import build
from tests.store.remote.conftest import S3
from tests.test_padded_redo import LittlePaddingLeaks, assert_serves_alone, clips


def test_a_bucket_build_replaces_what_padded_batches_sealed_before_the_guard_failed(
    s3: S3, tmp_path: Path
) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    report = build(data, module, cache=s3.url, workers=0, batch_size=3, batching="padded")
    assert report.ok and report.merged and report.batching == BatchingMode.EXACT
    assert "items padded before were encoded again alone" in report.batching_note
    assert not s3.objects("fragments/")
    assert_serves_alone(data, module, cache=s3.url, local_cache=tmp_path / "reader")
