"""export to Parquet and webdataset: read back with pyarrow, Hugging Face datasets and webdataset
(no featbake), every feature equal to the encoder run now, the rows' columns carried."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from featbake.errors import ConfigError
from featbake.export import webdataset as wds_export
from featbake.export.parquet import column_names, export_parquet
from featbake.export.source import chosen_parts, row_columns
from featbake.export.webdataset import export_webdataset, sample_key, unique_keys
from featbake.export.zarr import column_array, export_zarr
from tests.conftest import invoke
from tests.helpers import Live, bake

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def labelled_manifest(audio_dir: Path, path: Path) -> list[dict]:
    """A JSONL manifest of the folder's clips with a label, a speaker and (for some) a note."""
    rows = []
    for i, clip in enumerate(sorted(audio_dir.rglob("*.wav"))):
        row = {"path": str(clip), "id": f"utt.{i:02d}", "label": i % 3, "speaker": f"s{i % 2}"}
        if i % 4 == 0:
            row["note"] = {"take": i}
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# -- pure parts -------------------------------------------------------------------------------


def test_parts_are_chosen_by_output_or_layers_and_unknown_ones_are_named() -> None:
    assert chosen_parts(["tokens", "pooled"], output=None, layers=None) == ["pooled", "tokens"]
    assert chosen_parts(["layer0", "layer6"], output=None, layers=[6]) == ["layer6"]
    with pytest.raises(ConfigError, match=r"no part 'layer3' \(it stores 'layer0', 'layer6'\)"):
        chosen_parts(["layer0", "layer6"], output=None, layers=[3])
    with pytest.raises(ConfigError, match="not both"):
        chosen_parts(["pooled"], output="pooled", layers=[1])


def test_row_columns_and_their_typed_arrays() -> None:
    cols = row_columns([{"a": 1}, {"a": 2, "b": "x"}, {}])
    assert cols == {"a": [1, 2, None], "b": [None, "x", None]}
    assert column_array([1, 2]).dtype == np.int64
    floats = column_array([1, None, 2.5])
    assert floats.dtype == np.float64 and np.isnan(floats[1])
    assert column_array([{"k": 1}, None]).tolist() == ['{"k": 1}', ""]
    assert column_names([""], ["id", "features", "label"]) == {
        "id": "row_id", "features": "row_features", "label": "label",
    }  # fmt: skip


def test_sample_keys_are_one_sample_each_and_stay_inside_the_shard() -> None:
    keys = unique_keys(["a.wav", "a_wav", "../x.flac", "/abs/y.wav", "a.wav"])
    assert keys == ["a_wav", "a_wav-2", "__/x_flac", "abs/y_wav", "a_wav-3"]
    assert all("." not in k and not k.startswith("/") for k in keys)
    assert sample_key("") == "_"


# -- parquet ----------------------------------------------------------------------------------


def test_parquet_export_reads_back_with_pyarrow_and_datasets_equal_to_live(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    live = Live()
    rows = labelled_manifest(audio_dir, tmp_path / "train.jsonl")
    report = bake(tmp_path / "train.jsonl", encoder_file, store_dir)
    by_id = {r["id"]: r for r in rows}

    out = tmp_path / "feats.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"exported 16 items of root {report.root}" in r.stdout
    assert not out.with_name("feats.parquet.partial").exists()

    table = pq.read_table(out)
    assert table.column_names[:4] == ["id", "key", "features", "features_shape"]
    assert set(table.column_names[4:]) == {"label", "speaker", "note"}
    meta = json.loads(table.schema.metadata[b"featbake"])
    assert meta["root"] == report.root
    assert table.schema.field("features").type == pa.list_(pa.list_(pa.float32(), 64))
    for rec in table.to_pylist():
        row = by_id[rec["id"]]
        want = live(encoder_file, Path(row["path"]))
        got = torch.tensor(np.array(rec["features"], dtype=np.float32))
        assert list(got.shape) == rec["features_shape"]
        torch.testing.assert_close(got, want)
        assert rec["label"] == row["label"] and rec["speaker"] == row["speaker"]
        assert rec["note"] == (json.dumps(row["note"]) if "note" in row else None)

    datasets = pytest.importorskip("datasets")
    hf = datasets.load_dataset(
        "parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf")
    ).with_format("torch")
    first = hf[0]
    torch.testing.assert_close(
        first["features"], live(encoder_file, Path(by_id[first["id"]]["path"]))
    )
    assert int(first["label"]) == by_id[first["id"]]["label"]


def test_parquet_export_of_one_part_keeps_its_dtype_and_refuses_a_folder(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    from featbake.recipe import Recipe

    live = Live()
    bake(audio_dir, multi_encoder_file, store_dir, recipe=Recipe(dtype="float16"))
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(ConfigError, match="not a Parquet file"):
        export_parquet(tmp_path / "dir.parquet", cache=store_dir)
    report = export_parquet(tmp_path / "p.parquet", cache=store_dir, output="pooled")
    assert report.parts == ("pooled",) and report.items == 16
    table = pq.read_table(tmp_path / "p.parquet")
    assert "hidden" not in table.column_names
    assert table.schema.field("pooled").type == pa.list_(pa.float16(), 8)
    for rec in table.to_pylist():
        want = live(multi_encoder_file, audio_dir / rec["id"], Recipe(dtype="float16"))
        got = torch.tensor(np.array(rec["pooled"], dtype=np.float16))
        torch.testing.assert_close(got, want["pooled"])
    with pytest.raises(ConfigError, match="exists"):
        export_parquet(tmp_path / "p.parquet", cache=store_dir)


def test_a_root_built_with_output_exports_its_part_and_names_it_refusing_another(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A root built with ``--output hidden`` holds that part, stored as its one unnamed part.
    Exporting ``--output hidden`` was refused ("its encoder returned one tensor, stored as one
    unnamed part"), and so was ``--output pooled``, neither naming the part the root holds:
    now the first exports it, and the second names it and what to run."""
    from featbake.recipe import Recipe
    from tests.conftest import run_cli

    assert chosen_parts([""], output="hidden", layers=None, picked="hidden") == [""]
    with pytest.raises(ConfigError, match=r"--layers 3\b"):
        chosen_parts([""], output=None, layers=[3], picked="hidden")
    report = bake(audio_dir, multi_encoder_file, store_dir, recipe=Recipe(output="hidden"))
    res = run_cli("export", "--format", "parquet", tmp_path / "x.parquet", "--cache", store_dir,
                  "--output", "pooled")  # fmt: skip
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    said = " ".join((res.stdout + res.stderr).split())  # one line, wrapped by the console
    assert "the root stores one part, 'hidden' (it was built with --output hidden)" in said
    assert "`featbake build --output pooled` (the same --encoder and --data)" in said
    assert not (tmp_path / "x.parquet").exists()

    live = Live()
    done = export_parquet(tmp_path / "h.parquet", cache=store_dir, output="hidden")
    assert done.parts == ("",) and done.items == 16 and done.root == report.root
    for rec in pq.read_table(tmp_path / "h.parquet").to_pylist():
        want = live(multi_encoder_file, audio_dir / rec["id"])
        assert isinstance(want, dict)
        got = torch.tensor(np.array(rec["features"], dtype=np.float32))
        torch.testing.assert_close(got, want["hidden"])


# -- webdataset -------------------------------------------------------------------------------


def test_webdataset_export_reads_back_with_webdataset_equal_to_live(
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wds = pytest.importorskip("webdataset")
    live = Live()
    rows = labelled_manifest(audio_dir, tmp_path / "train.jsonl")
    bake(tmp_path / "train.jsonl", encoder_file, store_dir)
    by_id = {r["id"]: r for r in rows}
    monkeypatch.setattr(wds_export, "SHARD_BYTES", 20_000)  # several shards

    out = tmp_path / "wds"
    r = invoke("export", "--format", "webdataset", out, "--cache", store_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    shards = sorted(out.glob("shard-*.tar"))
    assert len(shards) > 1 and not (tmp_path / "wds.partial").exists()

    urls = [str(s) for s in shards]
    seen = set()
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode():
        meta = sample["json"]
        row = by_id[meta["id"]]
        torch.testing.assert_close(
            torch.from_numpy(sample["npy"]), live(encoder_file, Path(row["path"]))
        )
        assert meta["label"] == row["label"] and meta["speaker"] == row["speaker"]
        seen.add(meta["id"])
    assert seen == set(by_id)


def test_webdataset_export_of_several_parts_names_each_member(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    live = Live()
    bake(audio_dir, multi_encoder_file, store_dir)
    report = export_webdataset(tmp_path / "w", cache=store_dir)
    assert report.parts == ("hidden", "pooled")
    with tarfile.open(tmp_path / "w" / "shard-000000.tar") as tar:
        names = tar.getnames()
        first = names[0].split(".")[0]
        assert names[:3] == [f"{first}.hidden.npy", f"{first}.pooled.npy", f"{first}.json"]
        meta = json.loads(tar.extractfile(names[2]).read())  # type: ignore[union-attr]
        want = live(multi_encoder_file, audio_dir / meta["id"])
        for part in ("hidden", "pooled"):
            data = tar.extractfile(f"{first}.{part}.npy").read()  # type: ignore[union-attr]
            got = np.load(__import__("io").BytesIO(data))
            torch.testing.assert_close(torch.from_numpy(got), want[part])
    # the same export again refuses, and replaces with --overwrite only what it wrote
    with pytest.raises(ConfigError, match="exists"):
        export_webdataset(tmp_path / "w", cache=store_dir)
    (tmp_path / "w" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="other than the shards featbake exports"):
        export_webdataset(tmp_path / "w", cache=store_dir, overwrite=True)


# -- zarr carries the rows too ----------------------------------------------------------------


def test_zarr_export_carries_the_rows_columns(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    import zarr

    rows = labelled_manifest(audio_dir, tmp_path / "train.jsonl")
    bake(tmp_path / "train.jsonl", encoder_file, store_dir)
    r = invoke("export", tmp_path / "f.zarr", "--cache", store_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    g = zarr.open_group(str(tmp_path / "f.zarr"), mode="r")
    by_id = {r["id"]: r for r in rows}
    ids = [str(x) for x in g["paths"][:]]
    assert list(g["columns/label"][:]) == [by_id[i]["label"] for i in ids]
    assert g["columns/label"].dtype == np.int64
    assert [str(s) for s in g["columns/speaker"][:]] == [by_id[i]["speaker"] for i in ids]
    # without the data (moved away), the export still runs, with one warning
    for clip in audio_dir.rglob("*.wav"):
        clip.unlink()
    (tmp_path / "train.jsonl").unlink()
    r = invoke("export", tmp_path / "g.zarr", "--cache", store_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the rows' columns are left out" in r.stdout + r.stderr
    assert "columns" not in zarr.open_group(str(tmp_path / "g.zarr"), mode="r")
    assert export_zarr(tmp_path / "h.zarr", cache=store_dir).items == 16


def test_the_cli_compresses_as_asked_and_refuses_what_a_format_does_not_offer(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq
    import zarr

    live = Live()
    bake(audio_dir, encoder_file, store_dir)
    r = invoke("export", "--format", "parquet", tmp_path / "z.parquet", "--compression", "zstd",
               "--cache", store_dir)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    meta = pq.ParquetFile(tmp_path / "z.parquet").metadata
    assert meta.row_group(0).column(2).compression == "ZSTD"  # the features column
    r = invoke("export", tmp_path / "z.zarr", "--compression", "zstd", "--cache", store_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    values = zarr.open_group(str(tmp_path / "z.zarr"), mode="r")["values"]
    assert [type(c).__name__ for c in values.compressors] == ["ZstdCodec"]
    ids = [str(p) for p in zarr.open_group(str(tmp_path / "z.zarr"), mode="r")["paths"][:]]
    offsets = zarr.open_group(str(tmp_path / "z.zarr"), mode="r")["offsets"][:]
    for k, rel in enumerate(ids):
        want = live(encoder_file, audio_dir / rel)
        got = torch.from_numpy(np.asarray(values[offsets[k] : offsets[k + 1]]))
        torch.testing.assert_close(got, want)
    for fmt, name, said in [
        ("webdataset", "zstd", "a webdataset export writes plain tars; drop --compression"),
        ("zarr", "snappy", "a zarr export compresses with none or zstd, not snappy"),
        ("parquet", "lz5", "unknown compression 'lz5'; choose one of none, snappy, zstd"),
    ]:
        out = tmp_path / f"bad-{fmt}"
        r = invoke("export", "--format", fmt, out, "--compression", name, "--cache", store_dir)
        assert r.returncode != 0 and said in r.stdout + r.stderr, r.stdout + r.stderr
        assert "Traceback" not in r.stdout + r.stderr
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
