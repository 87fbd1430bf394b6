"""Shared fixtures: a tiny deterministic TorchScript encoder, real audio files, a tmp store.

Everything is real: encoders are saved with ``torch.jit.save``, audio is written with soundfile,
the store is a directory with safetensors shards and a SQLite catalog, and CLI tests run
``python -m featbake`` in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import (
    MultiOutputEncoder,
    TinyConvEncoder,
    save_torchscript,
    write_audio_folder,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def encoder_file(tmp_path: Path) -> Path:
    """A TorchScript TinyConvEncoder (``[B, T]`` -> ``[B, T/160, 64]``)."""
    return save_torchscript(TinyConvEncoder(), tmp_path / "encoder.pt")


@pytest.fixture
def multi_encoder_file(tmp_path: Path) -> Path:
    """A TorchScript encoder returning ``{"hidden": [B, T', 32], "pooled": [B, 8]}``."""
    return save_torchscript(MultiOutputEncoder(), tmp_path / "multi.pt")


@pytest.fixture
def audio_dir(tmp_path: Path) -> Path:
    """Twelve wav clips of 0.3-1.2 s in two subfolders, plus four clips of exactly 1 s."""
    root = tmp_path / "audio"
    write_audio_folder(root, 12, seconds=(0.3, 1.2), subdirs=2, seed=1)
    write_audio_folder(root / "fixed", 4, seconds=1.0, seed=2)
    return root


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


def live_features(encoder_path: Path, audio_path: Path, recipe: Recipe | None = None) -> object:
    """Features computed *now*: load the encoder afresh and run it on one preprocessed file."""
    recipe = recipe or Recipe()
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_path))
    x = source_for(recipe).load(audio_path)
    with torch.inference_mode():
        out = module(x.unsqueeze(0))
    if isinstance(out, dict):
        if recipe.output is not None:
            return out[recipe.output][0].to(recipe.torch_dtype)
        return {k: v[0].to(recipe.torch_dtype) for k, v in out.items()}
    return out[0].to(recipe.torch_dtype)


def run_cli(*args: str | os.PathLike[str], env: dict[str, str] | None = None, **kw: object):
    """Run ``python -m featbake ARGS`` in a subprocess; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    full_env.pop("FEATBAKE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "featbake", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=kw.pop("timeout", 300),
        **kw,
    )


COUNTING_ENCODER = '''
import hashlib
import os
import time

from featbake.testing import TinyConvEncoder


class CountingEncoder(TinyConvEncoder):
    """TinyConvEncoder that appends a digest of each input row to $COUNT_CALLS per call."""

    def forward(self, wav):
        log = os.environ.get("COUNT_CALLS")
        if log:
            with open(log, "a") as f:
                for row in wav:
                    f.write(hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16] + "\\n")
        time.sleep(float(os.environ.get("COUNT_DELAY", "0")))
        return super().forward(wav)


def build():
    return CountingEncoder()
'''


@pytest.fixture
def counting_encoder(tmp_path: Path) -> dict[str, str]:
    """An import-path encoder that logs each encoded input; returns the env to run it with.

    ``env["COUNT_CALLS"]`` is the log (one line per encoded input row); the encoder is
    ``countenc:build`` once ``env["PYTHONPATH"]`` is used.
    """
    pkg = tmp_path / "encpkg"
    pkg.mkdir()
    (pkg / "countenc.py").write_text(COUNTING_ENCODER)
    return {
        "PYTHONPATH": f"{REPO}{os.pathsep}{pkg}",
        "COUNT_CALLS": str(tmp_path / "calls.log"),
    }


def encoded_rows(env: dict[str, str]) -> list[str]:
    """The input digests the counting encoder has seen so far (one per encoded input)."""
    log = Path(env["COUNT_CALLS"])
    return log.read_text().split() if log.exists() else []
