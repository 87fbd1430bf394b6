"""The README's vision example, as written: build a folder's whole output, then serve one part.

The README builds ``featbake build --encoder ./dinov2-small --data ./images`` (every output
part stored) and then serves ``CachedFeatureDataset("./images", "./dinov2-small",
recipe=Recipe(output="pooled"))``. The dataset's items are copied from what the build stored,
never encoded again: this prints how many images the dataset opened (0) and encoded (0).

Everything is made here, in ``--work``: synthetic pictures and a tiny DINOv2 built from a
config and saved with its image processor (``probe_images.py``'s). Nothing is downloaded.

Run: ``python examples/readme_vision.py [--images 16] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from PIL import Image
from probe_images import CLASSES, save_backbone, write_images

from featbake import CachedFeatureDataset
from featbake.recipe import Recipe

OPENED: list[str] = []  # every image PIL opened in this process


def counting_open(real):  # type: ignore[no-untyped-def]
    """PIL's ``Image.open``, counting each call (what "decoded an image" means here)."""

    def open_counted(fp, *args, **kwargs):  # type: ignore[no-untyped-def]
        OPENED.append(str(fp))
        return real(fp, *args, **kwargs)

    return open_counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "readme_vision_work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.chdir(args.work)  # the README's relative paths: ./images, ./dinov2-small, ./.featbake
    if not Path("images").exists():
        write_images(Path("images"), args.images)
    if not Path("dinov2-small").exists():
        save_backbone(Path("dinov2-small"))
    built = subprocess.run(
        [sys.executable, "-m", "featbake", "build", "--encoder", "./dinov2-small",
         "--data", "./images", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(built.stdout)
    print(f"build: encoded {report['encoded']}, reused {report['reused']}")

    Image.open = counting_open(Image.open)  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        # -- the README's snippet --
        ds = CachedFeatureDataset("./images", "./dinov2-small", recipe=Recipe(output="pooled"))
        X = torch.stack([ds[i] for i in range(len(ds))])  # [N, 64] DINOv2 CLS embeddings
        probe = torch.nn.Linear(X.shape[1], len(CLASSES))  # a linear probe, trained on X
    for w in said:
        print(f"warning: {w.message}")
    print(f"served {tuple(X.shape)} pooled embeddings to a probe of {probe.in_features} inputs")
    print(f"dataset: opened {len(OPENED)} images, encoded {ds.cache_info().encoded}")


if __name__ == "__main__":
    main()
