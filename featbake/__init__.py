"""featbake: compute a frozen encoder's features once, serve them at training time.

Public API::

    featbake.build(data, encoder, cache=...)           # the bake (also: `featbake build`)
    featbake.CachedFeatureDataset(data, encoder=...)   # serve baked features to a DataLoader
    featbake.pad_collate, featbake.DevicePrefetcher    # batching and device prefetch
    featbake.CachedEncoder(encoder, cache=...)         # intercept a frozen encoder in-process
    featbake.Recipe(sample_rate=16000, ...)            # preprocessing options, part of every key

Names are imported on first use (PEP 562), so ``featbake --help`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "build": "featbake.build",
    "BuildReport": "featbake.build",
    "CachedEncoder": "featbake.cached_encoder",
    "PaddedBatch": "featbake.collate",
    "pad_collate": "featbake.collate",
    "CachedFeatureDataset": "featbake.dataset",
    "ServeStats": "featbake.dataset",
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
    "DevicePrefetcher": "featbake.prefetch",
    "Recipe": "featbake.recipe",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'featbake' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
