"""Issue 32 item 2 in the library: a dataset asking one output of a store built with the whole
output copies each part (encodes nothing), and a dataset that will encode live what the store
holds under other options says so once, naming the option."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.errors import SourceError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from tests.conftest import live_features


def test_one_output_of_a_whole_output_store_is_copied_not_encoded(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    assert build(audio_dir, multi_encoder_file, cache=store_dir, workers=0).encoded == 16
    recipe = Recipe(output="pooled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copying is not live encoding: nothing to warn of
        ds = CachedFeatureDataset(audio_dir, multi_encoder_file, cache=store_dir, recipe=recipe)
    assert ds.stored() == 0  # not under this recipe's keys: each item is a miss...
    for i in range(len(ds)):
        want = live_features(multi_encoder_file, Path(ds.path(i)), recipe)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-6)
    assert ds.cache_info().encoded == 0  # ...copied from the whole output, never encoded
    ds.flush()
    again = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, recipe=recipe, on_miss="error"
    )
    assert again.stored() == 16  # written back under its own keys: plain hits from now on
    for i in range(len(again)):
        want = live_features(multi_encoder_file, Path(again.path(i)), recipe)
        torch.testing.assert_close(again[i], want, rtol=1e-5, atol=1e-6)


def test_a_file_changed_since_the_dataset_was_made_is_not_copied(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    build(audio_dir, multi_encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store_dir, recipe=Recipe(output="pooled")
    )
    victim = Path(ds.path(0))
    victim.write_bytes(victim.read_bytes()[:-64])  # rewritten after its key was hashed
    with pytest.raises(SourceError, match="changed since this dataset was created"):
        ds[0]  # neither copied under the old bytes' key nor encoded from the new bytes


def test_live_encoding_of_data_stored_under_other_options_warns_once_naming_them(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    with pytest.warns(UserWarning) as said:
        ds = CachedFeatureDataset(
            audio_dir, encoder_file, cache=store_dir, recipe=Recipe(sample_rate=8000)
        )
    texts = [str(w.message) for w in said if "featbake:" in str(w.message)]
    assert len(texts) == 1, texts
    assert "16 of 16 items" in texts[0] and "will be encoded live" in texts[0]
    assert "sample_rate=16000 in the store, 8000 asked" in texts[0]
    assert ds.stored() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the store's own options: nothing to say
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)
