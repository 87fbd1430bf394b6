"""featbake: compute a frozen encoder's features once, serve them at training time.

Public API::

    featbake.build(data, encoder, cache=...)       # the bake (also: `featbake build`)
    featbake.Recipe(sample_rate=16000, ...)        # preprocessing options, part of every key
"""

from featbake.build import BuildReport, build
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
from featbake.recipe import Recipe

__version__ = "0.1.0"

__all__ = [
    "BuildIncomplete",
    "BuildReport",
    "CacheMiss",
    "ConfigError",
    "EncodeError",
    "EncoderLoadError",
    "FeatbakeError",
    "Recipe",
    "ShardMissing",
    "SourceError",
    "StoreCorrupt",
    "StoreError",
    "__version__",
    "build",
]
