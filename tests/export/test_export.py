"""export: a root's features read back with plain zarr (no featbake) equal live encoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from featbake.errors import ConfigError
from featbake.export.source import plan_layout
from featbake.export.zarr import CHUNK_BYTES, export_zarr
from featbake.progress import GcProgress
from tests.helpers import Live, bake, manifest


def test_plan_layout_picks_ragged_or_dense_and_refuses_the_rest() -> None:
    assert plan_layout("", "F32", [(3, 4), (5, 4)]).lengths == (3, 5)
    dense = plan_layout("p", "F16", [(8,), (8,)])
    assert not dense.ragged and dense.trailing == (8,)
    with pytest.raises(ConfigError, match="more than their first dimension"):
        plan_layout("", "F32", [(3, 4), (3, 5)])


def test_ragged_export_round_trips_through_plain_zarr(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    seen: list[GcProgress] = []
    out = export_zarr(tmp_path / "f.zarr", cache=store_dir, progress=seen.append)
    assert out.items == 16 and out.layouts == {"": "ragged"}
    assert seen and seen[-1].done == seen[-1].total == 16

    g = zarr.open_group(str(tmp_path / "f.zarr"), mode="r")
    items = manifest(store_dir, report.root)
    assert list(g["keys"][:]) == [k for _, k in items]
    assert list(g["paths"][:]) == [p for p, _ in items]
    offsets = g["offsets"][:]
    assert offsets[0] == 0 and offsets[-1] == g["values"].shape[0]
    assert list(np.diff(offsets)) == list(g["lengths"][:])
    assert g["values"].chunks[0] * 64 * 4 <= CHUNK_BYTES
    assert g.attrs["root"] == report.root and g.attrs["missing"] == 0
    values = g["values"]
    for i, (rel, _) in enumerate(items):
        got = torch.from_numpy(values[int(offsets[i]) : int(offsets[i + 1])])
        torch.testing.assert_close(got, live(encoder_file, audio_dir / rel))
    assert not (tmp_path / "f.zarr.partial").exists()


def test_dense_and_multi_output_export(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    live = Live()
    report = bake(audio_dir, multi_encoder_file, store_dir)
    out = export_zarr(tmp_path / "m.zarr", cache=store_dir, root=report.root[:6])
    assert out.layouts == {"hidden": "ragged", "pooled": "dense"}
    g = zarr.open_group(str(tmp_path / "m.zarr"), mode="r")
    pooled, hidden, offsets = g["pooled/values"][:], g["hidden/values"], g["hidden/offsets"][:]
    assert pooled.shape == (16, 8)
    for i, rel in enumerate(g["paths"][:]):
        want = live(multi_encoder_file, audio_dir / str(rel))
        torch.testing.assert_close(torch.from_numpy(pooled[i]), want["pooled"])
        got = torch.from_numpy(hidden[int(offsets[i]) : int(offsets[i + 1])])
        torch.testing.assert_close(got, want["hidden"])


def test_export_needs_a_root_choice_and_a_free_destination(
    encoder_file: Path, multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    bake(audio_dir / "fixed", encoder_file, store_dir)
    (tmp_path / "taken.zarr").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        export_zarr(tmp_path / "taken.zarr", cache=store_dir)
    out = export_zarr(tmp_path / "fixed.zarr", cache=store_dir)
    assert out.layouts == {"": "dense"}  # four clips of exactly 1 s: one shape
    assert zarr.open_group(str(tmp_path / "fixed.zarr"), mode="r")["values"].shape == (
        4,
        98,
        64,
    )  # conv: (16000 - 400) // 160 + 1
    bake(audio_dir, multi_encoder_file, store_dir)
    with pytest.raises(ConfigError, match="--root"):
        export_zarr(tmp_path / "two.zarr", cache=store_dir)


def test_overwrite_refuses_what_is_not_an_export(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """--overwrite replaces an earlier export, never the store, a folder of other files, a file."""
    bake(audio_dir / "fixed", encoder_file, store_dir)
    shards_before = sorted(p.name for p in store_dir.rglob("*.safetensors"))
    for bad in (store_dir, store_dir / "feats.zarr", store_dir.parent):
        with pytest.raises(ConfigError, match="store"):
            export_zarr(bad, cache=store_dir, overwrite=True)
    assert sorted(p.name for p in store_dir.rglob("*.safetensors")) == shards_before
    assert (store_dir / "catalog.sqlite").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a Zarr"):
        export_zarr(other, cache=store_dir, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"
    afile = tmp_path / "afile"
    afile.write_text("x")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="file"):
            export_zarr(afile, cache=store_dir, overwrite=overwrite)
    assert afile.read_text() == "x"
    assert not (tmp_path / "afile.partial").exists()  # refused before any work
    # A folder beside OUT named OUT.partial that is not an interrupted export is left alone.
    (tmp_path / "feats.zarr.partial").mkdir()
    (tmp_path / "feats.zarr.partial" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a Zarr"):
        export_zarr(tmp_path / "feats.zarr", cache=store_dir)
    assert (tmp_path / "feats.zarr.partial" / "keep.txt").exists()
    # An earlier export is replaced.
    (tmp_path / "feats.zarr.partial" / "keep.txt").unlink()
    first = export_zarr(tmp_path / "feats.zarr", cache=store_dir)
    again = export_zarr(tmp_path / "feats.zarr", cache=store_dir, overwrite=True)
    assert again.items == first.items == 4
    assert zarr.open_group(str(tmp_path / "feats.zarr"), mode="r")["values"].shape[0] == 4


def test_a_shard_deleted_by_hand_stops_the_export_with_the_fix(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The export reads through the one located-read rule (a vanished shard is a miss) and turns
    the miss into one error that names the fix; nothing is published at the destination."""
    from featbake.errors import StoreError

    bake(audio_dir, encoder_file, store_dir)
    next(store_dir.rglob("*.safetensors")).unlink()
    with pytest.raises(StoreError, match="verify --repair"):
        export_zarr(tmp_path / "lost.zarr", cache=store_dir)
    assert not (tmp_path / "lost.zarr").exists()


def test_xarray_opens_an_export_and_dask_computes_on_it(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Issue 18 item 1: xarray.open_zarr failed ("missing the dimension_names metadata")."""
    import xarray as xr

    live = Live()
    bake(audio_dir, multi_encoder_file, store_dir)
    export_zarr(tmp_path / "m.zarr", cache=store_dir)
    top = xr.open_zarr(tmp_path / "m.zarr", consolidated=False)
    assert top["paths"].dims == ("item",) and top.sizes["item"] == 16
    pooled = xr.open_zarr(tmp_path / "m.zarr", group="pooled", consolidated=False)
    assert pooled["values"].dims == ("item", "feature")
    hidden = xr.open_zarr(tmp_path / "m.zarr", group="hidden", consolidated=False)
    assert hidden["values"].dims == ("frame", "feature")
    assert hidden["offsets"].dims == ("item_edge",) and hidden["lengths"].dims == ("item",)
    # A lazy (dask) computation over the export equals the same over live encoding.
    assert pooled["values"].chunks is not None  # dask-backed, not loaded
    mean_pooled = pooled["values"].mean("item").compute().values
    paths = [str(p) for p in top["paths"].values]
    want = torch.stack([live(multi_encoder_file, audio_dir / p)["pooled"] for p in paths])
    np.testing.assert_allclose(mean_pooled, want.mean(0).numpy(), rtol=1e-5, atol=1e-6)
    frames = int(hidden["lengths"].sum().compute())
    assert frames == sum(live(multi_encoder_file, audio_dir / p)["hidden"].shape[0] for p in paths)


def test_an_int8_root_is_refused_not_exported_as_packed_codes(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    from featbake.recipe import Recipe

    store = tmp_path / "store"
    report = bake(audio_dir, encoder_file, store, recipe=Recipe(dtype="int8"))
    with pytest.raises(ConfigError, match="stores int8, which export does not dequantise"):
        export_zarr(tmp_path / "out.zarr", cache=store, root=report.root)
    assert not (tmp_path / "out.zarr").exists()


@pytest.mark.parametrize("fmt", ["zarr", "parquet", "webdataset"])
def test_an_export_over_the_file_size_limit_says_so_and_leaves_nothing(
    fmt: str, encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The OS refusing a write for room (here RLIMIT_FSIZE: "File too large", as a full disk
    gives "No space left on device") is one line that says to free space, not to choose a
    folder one can write to, and nothing is left at OUT; the CLI, in a process of its own."""
    import resource

    from tests.conftest import run_cli

    bake(audio_dir, encoder_file, store_dir)
    out = tmp_path / f"out.{fmt}"
    # room for every file of the store to grow by a little (SQLite's journal), not for the
    # export's one file (or zarr's one chunk) of all the features
    largest = max(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
    limit = largest + 65_536
    assert sum(p.stat().st_size for p in store_dir.rglob("*.safetensors")) > 2 * limit

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = run_cli("export", "--format", fmt, out, "--cache", store_dir, preexec_fn=small_files)
    assert r.returncode == 5, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write the export {out}: ")
    assert "File too large" in lines[0] and lines[0].endswith("choose an OUT on another disk")
    assert not out.exists() and not Path(f"{out}.partial").exists()
