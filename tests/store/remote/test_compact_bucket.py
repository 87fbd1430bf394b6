"""The first int8 build into a bucket store: its fidelity travels in its fragment, the merge
that publishes the catalog version records it, and a fresh node serves every feature equal to
the live output quantised (issue 28.6: it exited 5, "could not record the measured fidelity")."""

from __future__ import annotations

from pathlib import Path

import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.quantize import Fidelity, Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.store.catalog import read_fidelity
from featbake.store.open import open_store
from tests.conftest import live_features
from tests.store.remote.conftest import S3


def test_a_first_int8_build_into_a_bucket_records_fidelity_and_serves_live(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    recipe = Recipe(dtype="int8")
    report = build(audio_dir, encoder_file, cache=s3.url, recipe=recipe, batch_size=1, workers=0)
    assert report.ok and report.merged and report.fidelity is not None
    recorded = read_fidelity(open_store(s3.url), report.root)
    assert recorded == Fidelity.from_json(report.fidelity)
    assert not s3.objects("fragments/")  # folded into the published version
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "reader",
        on_miss="error", dtype="int8",
    )  # fmt: skip
    for i in range(len(ds)):
        live = live_features(encoder_file, Path(ds.path(i)), Recipe())
        assert isinstance(live, torch.Tensor)
        want = dequantize(quantize(live, Scheme.INT8), Scheme.INT8, torch.float16)
        assert torch.equal(ds[i], want), i
