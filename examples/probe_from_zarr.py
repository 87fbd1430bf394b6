"""Fit a probe from a Zarr export alone: opened with xarray, pooled with dask, no featbake.

``featbake export --format zarr`` writes a root's features as plain Zarr v3: ``paths`` and
``keys`` per item, and per output part either dense ``values[item, feature]`` or ragged
``values[frame, feature]`` with ``offsets[item_edge]`` and ``lengths[item]``. Anyone can read
it (another team, a notebook, a cluster job) with xarray and dask. This script bakes and
exports once, then does the rest as that reader would: mean-pools each item's frames from the
ragged array lazily, and trains a logistic-regression probe on the pooled features.

Everything is made here (the clips of examples/probe.py and its tiny encoder).

Run: ``python examples/probe_from_zarr.py [--clips 200] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
import xarray as xr

import featbake
from featbake.export.zarr import export_zarr
from featbake.testing import TinyConvEncoder, save_torchscript

try:  # run as a script: examples/ is on sys.path
    from probe import CLASSES, write_clips
except ImportError:  # imported as examples.probe_from_zarr
    from examples.probe import CLASSES, write_clips


def pooled_features(export: Path) -> tuple[np.ndarray, list[str]]:
    """Mean of each item's frames, computed lazily from the ragged ``values`` (dask)."""
    top = xr.open_zarr(export, consolidated=False)  # one output: its arrays are at the top
    offsets = top["offsets"].values
    values = top["values"]  # [frame, feature], dask-backed: nothing is read yet
    frame_item = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    values = values.assign_coords(item_of_frame=("frame", frame_item))
    pooled = values.groupby("item_of_frame").mean().compute()  # one pass over the chunks
    return pooled.values, [str(p) for p in top["paths"].values]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path(__file__).parent / "zarr_work")
    args = parser.parse_args(argv)
    data, store, export = args.work / "clips", args.work / "store", args.work / "feats.zarr"
    if not data.exists():
        write_clips(data, args.clips)
    encoder = save_torchscript(TinyConvEncoder(), args.work / "encoder.pt")
    featbake.build(data, encoder, cache=store)
    shutil.rmtree(export, ignore_errors=True)
    export_zarr(export, cache=store)  # `featbake export --format zarr feats.zarr --cache ...`

    # From here on, only the export, xarray and dask: what any other reader would have.
    x, paths = pooled_features(export)
    y = torch.tensor([list(CLASSES).index(Path(p).parent.name) for p in paths])
    x_t = torch.from_numpy(x).float()
    x_t = (x_t - x_t.mean(0)) / (x_t.std(0) + 1e-6)
    torch.manual_seed(0)
    probe = torch.nn.Linear(x_t.shape[1], len(CLASSES))
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    for _ in range(args.epochs):  # full-batch logistic regression
        loss = torch.nn.functional.cross_entropy(probe(x_t), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    accuracy = float((probe(x_t).argmax(1) == y).float().mean())
    print(f"{len(paths)} items from {export.name}, {x.shape[1]} features each")
    print(f"accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
