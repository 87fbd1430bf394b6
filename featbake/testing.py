"""Small, deterministic encoders and synthetic audio for the demo, the benchmarks and the tests.

Nothing here is downloaded: the encoders are tiny TorchScript-able modules with seeded weights, and
the audio is tones and noise written with soundfile.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from featbake.encode.encoders import torchscript_quietly


class TinyConvEncoder(nn.Module):
    """A wav2vec-style conv front end: ``[B, T]`` waveform -> ``[B, T // hop, dim]`` frames."""

    def __init__(self, dim: int = 64, hidden: int = 32, hop: int = 160, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.conv1 = nn.Conv1d(1, hidden, kernel_size=400, stride=hop)
        self.conv2 = nn.Conv1d(hidden, dim, kernel_size=3, padding=1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.conv1(wav.unsqueeze(1)))
        x = torch.nn.functional.gelu(self.conv2(x))
        return x.transpose(1, 2)


class MultiOutputEncoder(nn.Module):
    """Like :class:`TinyConvEncoder` but returns several hidden layers as a dict."""

    def __init__(self, dim: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.front = TinyConvEncoder(dim=dim, seed=seed)
        self.proj = nn.Linear(dim, 8)

    def forward(self, wav: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.front(wav)
        return {"hidden": hidden, "pooled": self.proj(hidden).mean(dim=1)}


class LogMelTransformer(nn.Module):
    """A mid-size speech encoder: log-mel frames ``[B, T, 80]`` -> ``[B, T, width]``.

    Used by the serving benchmark as the "live encoding" cost that a cache saves.
    """

    def __init__(self, n_mels: int = 80, width: int = 256, layers: int = 6, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(n_mels, width)
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, batch_first=True
        )
        self.body = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        return self.body(self.inp(mels))


class LengthsEncoder(nn.Module):
    """A lengths-protocol encoder: strided conv front end + transformer with a padding mask.

    ``forward(wav [B, T], lengths [B]) -> (frames [B, T', dim], out_lengths [B])``. Padding is
    exact: a frame is kept only when its whole receptive field lies in the clip, and padded
    frames are masked out of attention (see :mod:`featbake.encode.encoders`).
    """

    def __init__(
        self, dim: int = 32, layers: int = 2, kernel: int = 400, hop: int = 320, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kernel = kernel
        self.hop = hop
        self.conv = nn.Conv1d(1, dim, kernel_size=kernel, stride=hop)
        layer = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=2 * dim, batch_first=True, dropout=0.0
        )
        self.body = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.nn.functional.gelu(self.conv(wav.unsqueeze(1))).transpose(1, 2)
        out_lengths = torch.div(lengths - self.kernel, self.hop, rounding_mode="floor") + 1
        frames = torch.arange(x.shape[1], device=x.device)
        pad_mask = frames[None, :] >= out_lengths[:, None]
        return self.body(x, src_key_padding_mask=pad_mask), out_lengths


def save_torchscript(module: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Script ``module`` in eval mode and save it with ``torch.jit.save``."""
    module = module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    with torchscript_quietly():
        scripted = torch.jit.script(module)
        torch.jit.save(scripted, str(path))
    return Path(path)


def make_tone(
    seconds: float, sample_rate: int = 16000, seed: int = 0, channels: int = 1
) -> np.ndarray:
    """A deterministic clip of a few tones plus noise, ``[T, channels]`` float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    sig = sum(
        rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * t + rng.uniform(0, 6))
        for _ in range(3)
    )
    sig = sig + 0.02 * rng.standard_normal(t.shape)
    out = np.stack([sig * (1 - 0.2 * c) for c in range(channels)], axis=1)
    return np.clip(out, -1, 1).astype(np.float32)


def write_audio_folder(
    folder: str | os.PathLike[str],
    n: int,
    *,
    seconds: float | tuple[float, float] = 1.0,
    sample_rate: int = 16000,
    fmt: str = "wav",
    seed: int = 0,
    subdirs: int = 0,
) -> list[Path]:
    """Write ``n`` synthetic clips of ``seconds`` (or a (min, max) range); return their paths."""
    import soundfile

    root = Path(folder)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        dur = seconds if isinstance(seconds, (int, float)) else float(rng.uniform(*seconds))
        sub = root / f"part{i % subdirs}" if subdirs else root
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"clip{i:05d}.{fmt}"
        soundfile.write(path, make_tone(dur, sample_rate, seed=seed * 100_003 + i), sample_rate)
        paths.append(path)
    return paths


def write_image_folder(
    root: str | os.PathLike[str],
    n: int,
    *,
    size: tuple[int, int] = (64, 96),
    seed: int = 0,
    quality: int = 90,
) -> list[Path]:
    """Write ``n`` seeded JPEGs of smooth colour fields with noise (photo-like, so JPEG
    sizes and decode times are realistic); sizes vary by up to a quarter around ``size``
    (height, width), so shortest-edge resizes meet different aspect ratios.

    Example:
        >>> write_image_folder("./images", 4)  # doctest: +SKIP
    """
    from PIL import Image  # Pillow only for image folders

    rng = np.random.default_rng(seed)
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        h, w = (int(s * rng.uniform(0.75, 1.25)) for s in size)
        ys, xs = np.mgrid[0:h, 0:w]
        phase = rng.uniform(0, 6.3, 3)
        field = [127 + 100 * np.sin(xs / w * 3 + ys / h * 2 + p) for p in phase]
        pixels = np.stack(field, -1) + rng.normal(0, 12, (h, w, 3))
        path = out / f"img_{i:05d}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=quality)
        paths.append(path)
    return paths


def drop_page_cache(*folders: str | os.PathLike[str]) -> None:
    """Drop every shard file under ``folders`` from the page cache, so the next reads go to the
    disk (a cold store, for tests and benchmarks of read-ahead). Only clean pages are dropped:
    shards are fsynced when sealed. A no-op where ``posix_fadvise`` is missing (macOS).
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for folder in folders:
        for p in Path(folder).rglob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
