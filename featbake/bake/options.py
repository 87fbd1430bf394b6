"""The build's knobs that change speed or strictness, never the stored features."""

from __future__ import annotations

from dataclasses import dataclass

from featbake.bake.stored import DEFAULT_MAX_ERROR
from featbake.bake.threads import DEFAULT_SEAL_SECONDS
from featbake.cpus import BakeThreads, bake_threads
from featbake.device import encoder_thread_count, process_cpus
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.store.shard import DEFAULT_SHARD_BYTES


@dataclass(frozen=True)
class BakeOptions:
    """The build's knobs that change speed or strictness, never the stored features."""

    batch_size: int = 16
    workers: int | None = None
    strict: bool = False
    shard_bytes: int = DEFAULT_SHARD_BYTES
    on_gpu: bool = False
    allow_nonfinite: bool = False
    encoder_threads: int | None = None
    max_error: float | None = DEFAULT_MAX_ERROR  # relative RMS error a quantised build may have
    seal_seconds: float = DEFAULT_SEAL_SECONDS  # a shard being filled is sealed this often

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"--workers must be 0 or more, got {self.workers}")
        bound = self.max_error
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < 1e9
        ):
            raise ConfigError(f"--max-error must be a positive fraction, e.g. 0.05; got {bound!r}")

    def check_recipe(self, recipe: Recipe) -> None:
        """Refuse options the recipe cannot honour (NaN has no int8 or fp8 code)."""
        if self.allow_nonfinite and recipe.scheme is not None:
            raise ConfigError(
                f"--allow-nonfinite cannot store NaN or infinity as {recipe.dtype}; "
                "store such features with --dtype float32 or float16"
            )

    def threads(self) -> BakeThreads:
        """Decode workers and encoder threads for the CPUs this process may use (read after
        the encoder loaded, so a thread count its factory set is kept)."""
        cpus = process_cpus()
        threads = encoder_thread_count(self.encoder_threads, cpus)
        return bake_threads(cpus, self.workers, threads, on_gpu=self.on_gpu)
