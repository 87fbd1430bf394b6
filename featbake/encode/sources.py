"""Data adapters: find inputs, and turn one file into the encoder's input tensor.

A source knows files and decoding, never models. Two ship today:

* :class:`AudioSource`: wav, flac, ogg (and mp3 where libsndfile has it), decoded with soundfile,
  mixed to mono, resampled with soxr, optionally cropped. Output: ``[T]`` float32 (``[C, T]`` when
  ``mono=False``).
* :class:`NpySource`: ``.npy`` arrays loaded as they are (float32), without pickles.

Adding a source (images, video) means a new class with ``extensions`` and ``load``; the build
pipeline, keys and dataset do not change.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from featbake.errors import SourceError
from featbake.recipe import Recipe


class Source(Protocol):
    """What the pipeline needs from a data adapter."""

    kind: str
    extensions: tuple[str, ...]

    def load(self, path: str | os.PathLike[str]) -> torch.Tensor:
        """Decode and preprocess one file into the encoder's input (no batch dimension)."""
        ...


def _soundfile_extensions() -> tuple[str, ...]:
    import soundfile

    exts = [".wav", ".flac", ".ogg"]
    if "MP3" in soundfile.available_formats():
        exts.append(".mp3")
    return tuple(exts)


class AudioSource:
    """Audio files -> mono float32 waveforms at the recipe's sample rate."""

    kind = "audio"

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.extensions = _soundfile_extensions()

    def load(self, path: str | os.PathLike[str]) -> torch.Tensor:
        """Decode, mix down, resample and crop one file.

        Raises:
            SourceError: the file is missing, unreadable, empty or not audio.
        """
        import soundfile
        import soxr

        try:
            info = soundfile.info(os.fspath(path))
            frames = -1
            if self.recipe.max_seconds is not None:
                # Read a little more than needed so the resampler has context at the crop point.
                frames = int(np.ceil(self.recipe.max_seconds * info.samplerate)) + 64
            audio, rate = soundfile.read(
                os.fspath(path), frames=frames, dtype="float32", always_2d=True
            )
        except FileNotFoundError as e:
            raise SourceError(f"{path}: file not found") from e
        except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError) as e:
            raise SourceError(
                f"{path}: {_unreadable(path) or 'cannot decode audio'} ({_reason(e)})"
            ) from e
        if audio.shape[0] == 0:
            raise SourceError(f"{path}: the file holds no audio samples")
        if not np.isfinite(audio).all():
            raise SourceError(f"{path}: the audio holds NaN or infinite samples")
        audio = audio.mean(axis=1, keepdims=True) if self.recipe.mono else audio
        if rate != self.recipe.sample_rate:
            audio = soxr.resample(audio, rate, self.recipe.sample_rate, quality="HQ")
        if self.recipe.max_seconds is not None:
            audio = audio[: round(self.recipe.max_seconds * self.recipe.sample_rate)]
        audio = np.ascontiguousarray(audio.T, dtype=np.float32)  # [C, T]
        if self.recipe.normalize:
            audio = zero_mean_unit_var(audio)
        return torch.from_numpy(audio[0] if self.recipe.mono else audio)


def zero_mean_unit_var(audio: np.ndarray) -> np.ndarray:
    """Each channel to zero mean and unit variance, as Hugging Face's feature extractors do.

    Per clip and before any padding (``Wav2Vec2FeatureExtractor.zero_mean_unit_var_norm`` uses
    the unpadded length), so a clip's input never depends on what it is batched with.
    """
    mean = audio.mean(axis=-1, keepdims=True)
    var = audio.var(axis=-1, keepdims=True)
    return np.ascontiguousarray((audio - mean) / np.sqrt(var + 1e-7), dtype=np.float32)


def _unreadable(path: str | os.PathLike[str]) -> str | None:
    """Why the OS cannot open ``path`` (libsndfile only says "System error"), or None."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except FileNotFoundError:
        return "file not found"
    except OSError as e:
        return f"cannot read: {e.strerror}"
    return None


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class NpySource:
    """``.npy`` arrays -> float32 tensors, loaded without pickles."""

    kind = "npy"
    extensions = (".npy",)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def load(self, path: str | os.PathLike[str]) -> torch.Tensor:
        """Load one array as float32.

        Raises:
            SourceError: missing, not a .npy, an object array, or empty.
        """
        try:
            arr = np.load(os.fspath(path), allow_pickle=False)
        except FileNotFoundError as e:
            raise SourceError(f"{path}: file not found") from e
        except (ValueError, OSError, EOFError) as e:
            raise SourceError(f"{path}: not a readable .npy array ({_reason(e)})") from e
        if arr.size == 0:
            raise SourceError(f"{path}: the array is empty")
        if not np.issubdtype(arr.dtype, np.number):
            raise SourceError(f"{path}: arrays of dtype {arr.dtype} cannot be encoded")
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def source_for(recipe: Recipe) -> Source:
    """The source adapter that the recipe names."""
    return NpySource(recipe) if recipe.source == "npy" else AudioSource(recipe)


def scan(data: str | os.PathLike[str], extensions: Sequence[str]) -> list[str]:
    """Relative paths of the files under ``data`` with one of ``extensions``, in a stable order.

    Hidden files and folders (a leading dot) are skipped; symlinks to files are followed.

    Raises:
        SourceError: ``data`` is not a directory, or holds no matching file.
    """
    root = Path(data)
    if not root.is_dir():
        raise SourceError(f"data folder {data} does not exist or is not a directory")
    exts = {e.lower() for e in extensions}
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in exts:
                found.append(name if rel == "." else os.path.join(rel, name))
    if not found:
        raise SourceError(
            f"no input files ({', '.join(sorted(exts))}) under {data}; "
            "check the folder, or pick the source kind with --source"
        )
    found.sort()
    return found
