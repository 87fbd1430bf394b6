"""The examples run as a user runs them (a subprocess, at a small size), so they never rot.

A rerun, whose point is what it finds stored and reuses, runs the example's ``main`` in this
process instead (:func:`rerun_example_here`): another process than the one that built, without
an interpreter and torch's import of its own (~5 s of CPU each here).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: object) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def rerun_example_here(name: str, *args: object) -> str:
    """Run an example in this process as ``python examples/NAME ARGS`` runs it: its stdout.

    The example's folder leads ``sys.path`` (as for a script); ``sys.argv``, ``sys.path``, the
    working folder and PIL's ``Image.open`` (which an example may wrap) are restored after.
    """
    from PIL import Image

    script = REPO / "examples" / name
    argv, path, cwd, image_open = list(sys.argv), list(sys.path), os.getcwd(), Image.open
    out = io.StringIO()
    try:
        sys.argv = [str(script), *map(str, args)]
        sys.path.insert(0, str(script.parent))
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:], Image.open = argv, path, image_open  # type: ignore[method-assign]
        os.chdir(cwd)
    return out.getvalue()


def test_probe_learns_the_labels_from_baked_features(tmp_path: Path) -> None:
    out = run_example("probe.py", "--clips", 48, "--epochs", 20, "--work", tmp_path)
    assert "baked 48 clips (0 reused)" in out
    accuracy = float(re.search(r"^accuracy: ([\d.]+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.9, out
    # The rerun tells only its reuse: no DataLoader workers to start for it.
    again = rerun_example_here(
        "probe.py", "--clips", 48, "--epochs", 1, "--workers", 0, "--work", tmp_path
    )
    assert "baked 0 clips (48 reused)" in again


def test_distilling_from_baked_features_gives_the_live_teachers_losses(tmp_path: Path) -> None:
    out = run_example("distill_student.py", "--clips", 32, "--epochs", 2, "--work", tmp_path)
    epochs = re.findall(r"live teacher [\d.]+s loss ([\d.]+), baked [\d.]+s loss ([\d.]+)", out)
    assert len(epochs) == 2, out
    for live, baked in epochs:
        assert float(live) > 0 and abs(float(live) - float(baked)) <= 1e-6 * float(live), out


def test_cached_encoder_example_encodes_once_and_equals_the_uncached_model(
    tmp_path: Path,
) -> None:
    out = run_example("cached_encoder.py", "--clips", 32, "--epochs", 2, "--work", tmp_path)
    first, second = re.findall(r"^epoch \d: .*'encoded': (\d+)}$", out, re.MULTILINE)
    assert (int(first), int(second)) == (32, 0), out
    assert "cached model == uncached model on the same batch" in out


def test_probe_from_zarr_fits_from_the_export_alone(tmp_path: Path) -> None:
    out = run_example("probe_from_zarr.py", "--clips", 32, "--work", tmp_path)
    assert "32 items from feats.zarr" in out
    accuracy = float(re.search(r"^accuracy: ([\d.]+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.9, out
    # The pooling it did through xarray and dask equals pooling the encoder's output now.
    sys.path.insert(0, str(REPO))
    from examples.probe_from_zarr import pooled_features
    from tests.conftest import live_features

    pooled, paths = pooled_features(tmp_path / "feats.zarr")
    for row, rel in list(zip(pooled, paths, strict=True))[:6]:
        want = live_features(tmp_path / "encoder.pt", tmp_path / "clips" / rel).mean(0)
        np.testing.assert_allclose(row, want.numpy(), rtol=1e-5, atol=1e-6)


def test_image_probe_learns_from_baked_embeddings_with_flipped_views(tmp_path: Path) -> None:
    out = run_example("probe_images.py", "--images", 32, "--epochs", 30, "--work", tmp_path)
    assert "baked 64 embeddings (2 views), 0 reused" in out
    accuracy = float(re.search(r"^accuracy: ([\d.]+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.9, out
    again = rerun_example_here("probe_images.py", "--images", 32, "--epochs", 1, "--work", tmp_path)
    assert "baked 0 embeddings (2 views), 64 reused" in again


def test_readme_vision_example_serves_a_part_without_opening_an_image(tmp_path: Path) -> None:
    """Issue 32 item 2: `Recipe(output="pooled")` over a store built without --output encoded
    every image again, in silence; each part is now copied from what the build stored."""
    out = run_example("readme_vision.py", "--images", 16, "--work", tmp_path)
    assert "build: encoded 16, reused 0" in out
    assert "dataset: opened 0 images, encoded 0" in out and "warning" not in out, out
    again = rerun_example_here("readme_vision.py", "--images", 16, "--work", tmp_path)
    assert "build: encoded 0, reused 16" in again
    assert "dataset: opened 0 images, encoded 0" in again and "warning" not in again, again
    # What it served equals the encoder run now (a dataset over an empty store encodes live).
    from featbake import CachedFeatureDataset
    from featbake.recipe import Recipe

    images, model, recipe = tmp_path / "images", tmp_path / "dinov2-small", Recipe(output="pooled")
    served = CachedFeatureDataset(images, model, cache=tmp_path / ".featbake", recipe=recipe,
                                  on_miss="error")  # fmt: skip
    live = CachedFeatureDataset(images, model, cache=tmp_path / "empty", recipe=recipe,
                                write_back=False)  # fmt: skip
    assert len(served) == len(live) == 16
    for i in range(16):
        assert served.path(i) == live.path(i)
        torch.testing.assert_close(served[i], live[i], rtol=1e-5, atol=1e-6)
    assert live.cache_info().encoded == 16
