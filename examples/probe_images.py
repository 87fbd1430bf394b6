"""A linear probe on a frozen vision backbone's baked embeddings, with flipped views, on a CPU.

The pattern of DINOv2's and CLIP's linear-probe evaluations: run the backbone over the images
once (``featbake build --encoder ./dinov2 --data ./images --views hflip``), then train a linear
head for many epochs on the stored ``pooled`` embeddings. ``ViewsDataset`` serves the original's
or the flipped image's embedding per item and epoch, so horizontal flipping, the augmentation
probes keep, survives caching.

Everything is made here: two classes of synthetic pictures over noise (a bright vertical
stripe near the left edge, or in the middle: a flip moves the first to the right edge and
keeps its class) and a tiny DINOv2 built from a config and saved with its image processor.
Nothing is downloaded.

Run: ``python examples/probe_images.py [--images 64] [--epochs 30] [--work DIR]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from featbake.bake.views import build_views
from featbake.image_recipe import parse_views
from featbake.recipe import Recipe
from featbake.serve.views import ViewsDataset

CLASSES = ("edge", "middle")  # where a bright vertical stripe is: near an edge, or centred


def write_images(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` pictures of 40-56 px, half of each class, in ``folder/<class>/``."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        name = CLASSES[i % 2]
        h, w = (int(rng.integers(40, 57)) for _ in range(2))
        pixels = rng.integers(0, 90, (h, w, 3)).astype(np.uint8)
        left = int(w * rng.uniform(0.05, 0.2)) if name == "edge" else int(w * 0.42)
        pixels[:, left : left + w // 6] = 230
        (folder / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / name / f"img{i:05d}.jpg", quality=92)


def save_backbone(folder: Path) -> Path:
    """A seeded tiny DINOv2 (2 layers, width 64) and its processor: resize 40, crop 32."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    transformers.Dinov2Model(config).eval().save_pretrained(folder)
    pil = getattr(transformers, "BitImageProcessorPil", None)  # transformers 5: PIL backend
    (pil or transformers.BitImageProcessor)(
        size={"shortest_edge": 40},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "probe_images_work")
    args = parser.parse_args()
    images, store = args.work / "images", args.work / "store"
    if not images.exists():
        write_images(images, args.images)
    backbone = args.work / "dinov2-tiny"
    if not backbone.exists():
        save_backbone(backbone)
    recipe = Recipe(output="pooled")
    reports = build_views(
        images, backbone, cache=store, recipe=recipe, views=parse_views("hflip"), workers=0
    )
    print(
        f"baked {sum(r.encoded for r in reports)} embeddings (2 views), "
        f"{sum(r.reused for r in reports)} reused"
    )
    ds = ViewsDataset(images, backbone, cache=store, recipe=recipe, on_miss="error", seed=0)
    labels = torch.tensor([CLASSES.index(Path(ds.path(i)).parent.name) for i in range(len(ds))])
    torch.manual_seed(0)
    probe = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, len(CLASSES)))
    optim = torch.optim.Adam(probe.parameters(), lr=1e-2)
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)  # a new coin per item: original or flipped embedding
        x = torch.stack([ds[i] for i in range(len(ds))])
        loss = nn.functional.cross_entropy(probe(x), labels)
        optim.zero_grad()
        loss.backward()
        optim.step()
    ds.set_epoch(args.epochs)
    with torch.no_grad():
        x = torch.stack([ds[i] for i in range(len(ds))])
        accuracy = (probe(x).argmax(1) == labels).float().mean().item()
    print(f"final loss: {loss.item():.4f}")
    print(f"accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
