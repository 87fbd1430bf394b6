"""The build's arguments, checked before any work: one :class:`ConfigError` per bad value.

:func:`featbake.bake.pipeline.build` is a public entry point, so library callers reach it
without the CLI's parsing: every option that sizes something (a batch, a shard, a worker
pool) or picks a mode is checked here, with the valid range in the message, before the store
is opened or a file is hashed. Pure: the CPU count is passed in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from featbake.encode.naming import encoder_not_found, is_import_path
from featbake.errors import ConfigError
from featbake.image_recipe import View

#: The view every build stores (``--views`` adds others).
ORIGINAL_VIEW = View.ORIGINAL

#: ``batching`` choices (the values of :class:`featbake.bake.batching.Batching`).
BATCHING_CHOICES = ("auto", "padded", "exact")
#: Decode workers allowed per usable CPU (and at least :data:`MIN_WORKER_CAP` in all).
WORKERS_PER_CPU = 4
MIN_WORKER_CAP = 64


@dataclass(frozen=True)
class BuildArguments:
    """The build's sizing and mode options as given (``None``: featbake chooses)."""

    batching: object = "auto"
    batch_size: object = 16
    workers: object = None
    shard_bytes: object = 1
    batch_seconds: object = None
    batch_samples: object = None
    encoder: object = None
    threads: object = None
    seal_every: object = 30.0


def worker_cap(cpus: int) -> int:
    """The most decode workers a build starts on ``cpus`` usable CPUs."""
    return max(MIN_WORKER_CAP, WORKERS_PER_CPU * max(1, cpus))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value > 0


def check_build_arguments(args: BuildArguments, cpus: int) -> None:
    """Refuse an option no build can run with, naming it and a valid value.

    Raises:
        ConfigError: an empty ``encoder`` (``Path("")`` is the current folder, which would be
            read as a model folder); an unknown ``batching``; a ``batch_size`` or
            ``shard_bytes`` below 1 or not a whole number; ``workers`` negative or more than
            :func:`worker_cap` (each worker is a process with its own memory: thousands would
            exhaust the machine before the first file is read); ``batch_seconds`` not a
            positive finite number (NaN and inf cannot size a batch); ``seal_every`` not a
            positive finite number of seconds; ``batch_samples`` below 1;
            ``threads`` not a whole number from 1 to 4 per usable CPU.
    """
    if isinstance(args.encoder, (str, os.PathLike)) and not os.fspath(args.encoder).strip():
        raise ConfigError(
            "--encoder is empty; give a TorchScript (.pt) or torch.export (.pt2) file, a Hugging "
            "Face model folder or an import path like mypkg.models:build_encoder"
        )
    if not isinstance(args.batching, str) or args.batching not in BATCHING_CHOICES:
        raise ConfigError(
            f"--batching must be one of {', '.join(BATCHING_CHOICES)}, got {args.batching!r}"
        )
    if not _whole(args.batch_size) or args.batch_size < 1:  # type: ignore[operator]
        raise ConfigError(f"--batch-size must be a whole number from 1, got {args.batch_size!r}")
    if not _whole(args.shard_bytes) or args.shard_bytes < 1:  # type: ignore[operator]
        raise ConfigError(
            f"--shard-size must be positive, got {args.shard_bytes!r} bytes (e.g. 256MiB)"
        )
    _check_workers(args.workers, cpus)
    if args.batch_seconds is not None and not _positive_finite(args.batch_seconds):
        raise ConfigError(
            f"--batch-seconds must be a positive, finite number of seconds, got "
            f"{args.batch_seconds!r} (default 160)"
        )
    _check_threads(args.threads, cpus)
    if not _positive_finite(args.seal_every):
        raise ConfigError(
            f"--seal-every must be a positive, finite number of seconds, got {args.seal_every!r} "
            "(default 30)"
        )
    samples = args.batch_samples
    if samples is not None and (not _whole(samples) or samples < 1):  # type: ignore[operator]
        raise ConfigError(f"batch_samples must be a whole number from 1, got {samples!r}")


def _check_workers(workers: object, cpus: int) -> None:
    if workers is None:
        return
    if not _whole(workers) or workers < 0:  # type: ignore[operator]
        raise ConfigError(f"--workers must be 0 or more, got {workers!r}")
    cap = worker_cap(cpus)
    if workers > cap:  # type: ignore[operator]
        raise ConfigError(
            f"--workers {workers} is more than featbake starts on {cpus} usable CPUs "
            f"(at most {cap}): each decode worker is a process with its own memory, and more "
            f"workers than CPUs only adds start-up time; use --workers {cap} or fewer, or leave "
            "it unset to let featbake choose"
        )


#: More encoder threads than this per usable CPU is refused (oversubscription, not a setting).
THREADS_PER_CPU = 4


def _check_threads(threads: object, cpus: int) -> None:
    if threads is None:
        return
    cap = THREADS_PER_CPU * max(1, cpus)
    if not _whole(threads) or not 1 <= threads <= cap:  # type: ignore[operator]
        raise ConfigError(
            f"--threads must be a whole number from 1 to {cap} ({THREADS_PER_CPU} per usable "
            f"CPU, {cpus} here), got {threads!r}; leave it unset to keep torch's own count "
            "(torch.set_num_threads or OMP_NUM_THREADS)"
        )


def check_views(views: Sequence[str], source: str) -> None:
    """Refuse a view other than the original for inputs that are not images (``source``: the
    recipe's, resolved against the encoder)."""
    if tuple(views) != (ORIGINAL_VIEW,) and source != "image":
        raise ConfigError(
            f"--views {','.join(v for v in views if v != ORIGINAL_VIEW)} applies to image "
            f"inputs, not {source}; add --source image or use a vision model folder"
        )


def refuse_a_missing_encoder(
    spec: str, source: str, views: Sequence[str], args: BuildArguments, cpus: int
) -> None:
    """Raise what a build of a missing encoder path raises first, before torch is imported.

    A path that is not there (no import path, not empty) fails the build at
    :func:`check_encoder_found`; the checks a build makes before it run here first, in the
    same order (``--views`` for a recipe's ``source``, as :func:`featbake.bake.views.build_views`
    checks it: a missing path resolves no folder's recipe; then :func:`check_build_arguments`),
    so a command with two mistakes names the same one as before, and neither needs torch
    (seconds of CPU before a one-line answer). Any other encoder returns: the build checks it.
    """
    if not spec.strip() or is_import_path(spec) or os.path.exists(spec):
        return
    check_views(views, source)
    check_build_arguments(args, cpus)
    check_encoder_found(spec)


def check_encoder_found(spec: object) -> None:
    """Raise ``EncoderLoadError`` when ``spec`` names a file or folder that is not there.

    A build calls it before it reads its data: a mistyped ``--encoder ./dinov2-small`` over an
    image folder is named as such, not taken for an audio encoder that finds no audio files.
    An import path is checked when it is imported.
    """
    if not isinstance(spec, (str, os.PathLike)):
        return  # a module or a loaded encoder
    spec_s = os.fspath(spec)
    if not is_import_path(spec_s) and not os.path.exists(spec_s):
        raise encoder_not_found(spec_s)
