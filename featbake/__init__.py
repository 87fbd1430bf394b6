"""featbake: compute a frozen encoder's features once, serve them at training time.

Public API::

    featbake.build(data, encoder, cache=...)       # the bake (also: `featbake build`)
    featbake.Recipe(sample_rate=16000, ...)        # preprocessing options, part of every key
"""

from featbake.build import BuildReport, build
from featbake.cached_encoder import CachedEncoder
from featbake.collate import PaddedBatch, pad_collate
from featbake.dataset import CachedFeatureDataset, ServeStats
from featbake.errors import (
    BuildIncomplete,
    CacheMiss,
    ConfigError,
    EncodeError,
    EncoderLoadError,
    FeatbakeError,
    ShardMissing,
    SourceError,
    StoreCorrupt,
    StoreError,
)
from featbake.lru import ByteLRU
from featbake.prefetch import DevicePrefetcher
from featbake.recipe import Recipe

__version__ = "0.1.0"

__all__ = [
    "BuildIncomplete",
    "BuildReport",
    "ByteLRU",
    "CacheMiss",
    "CachedEncoder",
    "CachedFeatureDataset",
    "ConfigError",
    "DevicePrefetcher",
    "EncodeError",
    "EncoderLoadError",
    "FeatbakeError",
    "PaddedBatch",
    "Recipe",
    "ServeStats",
    "ShardMissing",
    "SourceError",
    "StoreCorrupt",
    "StoreError",
    "__version__",
    "build",
    "pad_collate",
]
