"""featbake: compute a frozen encoder's features once, serve them at training time.

Public API::

    featbake.build(data, encoder, cache=...)           # the bake (also: `featbake build`)
    featbake.CachedFeatureDataset(data, encoder=...)   # serve baked features to a DataLoader
    featbake.pad_collate, featbake.DevicePrefetcher    # batching and device prefetch
    featbake.CachedEncoder(encoder, cache=...)         # intercept a frozen encoder in-process
    featbake.ViewsDataset(data, encoder, views=...)    # baked image views (--views hflip)
    featbake.MixedDataset([ds_a, ds_b], weights=...)   # datasets mixed at set proportions
    featbake.FeatureLoader(ds, batch_frames=...)       # batches read ahead on a thread
    featbake.LengthBatchSampler(ds, batch_frames)      # batches by length for a DataLoader
    featbake.Recipe(sample_rate=16000, ...)            # preprocessing options, part of every key

Names are imported on first use (PEP 562), so ``featbake --help`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from featbake.version import __version__

_EXPORTS = {
    "build": "featbake.bake.pipeline",
    "BuildReport": "featbake.bake.report",
    "CachedEncoder": "featbake.serve.cached_encoder",
    "PaddedBatch": "featbake.serve.collate",
    "pad_collate": "featbake.serve.collate",
    "CachedFeatureDataset": "featbake.serve.dataset",
    "FeatureLoader": "featbake.serve.loader",
    "BlockSampler": "featbake.serve.loader",
    "LengthBatchSampler": "featbake.serve.loader",
    "ServeStats": "featbake.serve.dataset",
    "ViewsDataset": "featbake.serve.views",
    "MixedDataset": "featbake.serve.mixing",
    "BuildIncomplete": "featbake.errors",
    "CacheMiss": "featbake.errors",
    "ConfigError": "featbake.errors",
    "EncodeError": "featbake.errors",
    "EncoderLoadError": "featbake.errors",
    "FeatbakeError": "featbake.errors",
    "ShardMissing": "featbake.errors",
    "SourceError": "featbake.errors",
    "StoreCorrupt": "featbake.errors",
    "StoreError": "featbake.errors",
    "ByteLRU": "featbake.lru",
    "DevicePrefetcher": "featbake.serve.prefetch",
    "Recipe": "featbake.recipe",
}

__all__ = [
    "BlockSampler",
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
    "FeatureLoader",
    "LengthBatchSampler",
    "MixedDataset",
    "PaddedBatch",
    "Recipe",
    "ServeStats",
    "ShardMissing",
    "SourceError",
    "StoreCorrupt",
    "StoreError",
    "ViewsDataset",
    "__version__",
    "build",
    "pad_collate",
]

if TYPE_CHECKING:
    from featbake.bake.pipeline import build
    from featbake.bake.report import BuildReport
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
    from featbake.recipe import Recipe
    from featbake.serve.cached_encoder import CachedEncoder
    from featbake.serve.collate import PaddedBatch, pad_collate
    from featbake.serve.dataset import CachedFeatureDataset, ServeStats
    from featbake.serve.loader import BlockSampler, FeatureLoader, LengthBatchSampler
    from featbake.serve.mixing import MixedDataset
    from featbake.serve.prefetch import DevicePrefetcher
    from featbake.serve.views import ViewsDataset


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'featbake' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
