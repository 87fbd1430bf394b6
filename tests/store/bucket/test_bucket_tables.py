"""A local table of path-only audio cells built into a bucket store and read on other nodes
(each node a fresh local tier of the bucket): a row edited to name another clip that is not
there is kept back, not served its old clip's features, on every node, as on a local store
(``tests/encode/test_tables_audio_paths.py``); a table only touched or copied serves every row
as built. Served features are compared with the encoder run now on each clip (soundfile)."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.bucket import merge_bucket
from featbake.store.open import open_store
from tests.encode.test_tables_audio_paths import (
    PathTable,
    clip_tensor,
    encoder_now,
    only_path,
    pq,
    run_now,
    write_path_parquet,
)
from tests.store.bucket.conftest import S3, bucket_store

SERVED = [f"train.parquet:{n}" for n in (0, 1, 2)]


def built_on_node_a(
    tmp_path: Path, s3: S3, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[PathTable, dict[int, torch.Tensor]]:
    """A :class:`PathTable` built into the bucket from its project folder on node A; each
    clip's features run now."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = open_store(s3.url, local_cache=tmp_path / "node-a")
    build(t.table, encoder_file, cache=store, workers=0, column="audio")
    module = encoder_now(encoder_file)
    return t, {n: run_now(module, clip_tensor(f)) for n, f in t.files.items()}


def dataset_on(node: Path, s3: S3, t: PathTable, encoder_file: Path) -> CachedFeatureDataset:
    return CachedFeatureDataset(t.table, encoder_file, cache=s3.url, local_cache=node,
                                column="audio")  # fmt: skip


def ids(ds: CachedFeatureDataset) -> list[str]:
    return [ds.item_id(i) for i in range(len(ds))]


def test_a_row_edited_to_name_a_missing_clip_is_kept_back_on_a_fresh_node(
    tmp_path: Path, s3: S3, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built on node A; row 4 then edited to name a clip that is not there, its own clip
    deleted. A dataset on node B (a fresh tier: the root's manifest brought in after the edit)
    keeps row 4 back with one warning; so does node A's, and node C's after node A's dataset
    published the root again (row 0's new key). Before, a fresh tier dated the table's edit by
    its own copy of the manifest, so node B served row 4 the deleted clip's features."""
    t, want = built_on_node_a(tmp_path, s3, encoder_file, monkeypatch)
    new0 = t.project / "clips" / "new0.wav"
    shutil.copyfile(t.files[1], new0)
    cells = t.cells()
    write_path_parquet(
        t.table, [only_path("clips/new0.wav"), *cells[1:4], only_path("clips/renamed.wav")]
    )
    t.files[4].unlink()
    for node in ("node-b", "node-a", "node-c"):
        with pytest.warns(UserWarning) as told:
            ds = dataset_on(tmp_path / node, s3, t, encoder_file)
        lines = [str(w.message) for w in told if "train.parquet:4" in str(w.message)]
        assert len(lines) == 1 and "stored features are kept, not served" in lines[0], node
        assert ids(ds) == SERVED, node
        assert torch.equal(ds[0], want[1]), node  # row 0 names a copy of clip 1 now
        for i in (1, 2):
            assert torch.equal(ds[i], want[i]), (node, i)
        if node == "node-a":  # its root, holding row 0's new key, published in the bucket
            del ds
            gc.collect()
            merged = merge_bucket(bucket_store(s3.url, tmp_path / "merger"))
            assert len(merged.roots) == 1, merged
    renamed = t.project / "clips" / "renamed.wav"
    shutil.copyfile(t.files[2], renamed)
    back = dataset_on(tmp_path / "node-d", s3, t, encoder_file)
    assert ids(back) == [*SERVED, "train.parquet:4"]
    assert torch.equal(back[3], want[2])  # the clip its cell names now, not the one built


def test_a_table_copied_over_itself_serves_its_gone_rows_as_built_on_a_fresh_node(
    tmp_path: Path, s3: S3, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table copied over itself (its rows unchanged, its status new) and clip 4 deleted:
    node B serves row 4 as built (the hash cache keys the clip its cell names as the root
    does), equal to the encoder run on the clip before it went."""
    t, want = built_on_node_a(tmp_path, s3, encoder_file, monkeypatch)
    copy = t.table.with_name("copy.parquet")
    shutil.copyfile(t.table, copy)
    copy.replace(t.table)
    t.files[4].unlink()
    with pytest.warns(UserWarning):
        ds = dataset_on(tmp_path / "node-b", s3, t, encoder_file)
    assert ids(ds) == [*SERVED, "train.parquet:4"]
    assert torch.equal(ds[3], want[4])
    assert pq.read_table(t.table).num_rows == 6
