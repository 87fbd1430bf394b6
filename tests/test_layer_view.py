"""``layer_view`` on a store without layer parts: one clear error on every read path.

(The views themselves, over a real Hugging Face model's layers, are tested in test_hf.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.bake.pipeline import build
from featbake.errors import ConfigError
from featbake.serve.dataset import CachedFeatureDataset

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
