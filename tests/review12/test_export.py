"""Round twelve review, export: the gaps it found (r12.e1-e3), fixed.

Real stores built by the real code from real manifests, exported through the ``featbake
export`` command (in this process) and read back by pyarrow, tarfile and zarr, not featbake.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from featbake.testing import write_audio_folder
from tests.conftest import invoke
from tests.helpers import Live, bake


def _clips(tmp_path: Path, n: int = 4) -> list[Path]:
    write_audio_folder(tmp_path / "audio", n, seconds=(0.3, 0.6), seed=1)
    return sorted((tmp_path / "audio").rglob("*.wav"))


def _one_line_or_done(r) -> str:
    """What the command printed, for the assertion messages."""
    return (r.stdout + r.stderr).strip()


def test_a_carried_column_mixing_numbers_and_text_exports_to_parquet(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL whose ``speaker`` is a number on some rows and text on others (LibriSpeech-style
    ids next to ``"19a"``): the build carries the column, zarr writes it as text and webdataset
    as each row's JSON, but ``_carried_table`` in ``featbake/export/parquet.py`` hands the
    values to ``pa.array`` as they are, which refuses the mix: "internal error: ArrowTypeError:
    Expected bytes, got a 'int' object", exit 1, nothing exported."""
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"path": str(c), "id": f"u{i}", "speaker": 19 if i % 2 else "19a"}
        for i, c in enumerate(_clips(tmp_path))
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bake(tmp_path / "m.jsonl", encoder_file, store_dir)
    out = tmp_path / "f.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir)
    said = _one_line_or_done(r)
    assert "internal error" not in said and "Traceback" not in said, said
    assert r.returncode == 0, said
    by_id = {row["id"]: row for row in rows}
    table = pq.read_table(out).to_pylist()
    assert [str(rec["speaker"]) for rec in table] == [
        str(by_id[rec["id"]]["speaker"]) for rec in table
    ]


def test_a_carried_key_column_reaches_the_webdataset_json(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A manifest of music clips labelled with their musical ``key`` ("C", "Am", ...): the
    build carries it, Parquet writes it as ``row_key`` (``column_names``) and zarr as
    ``columns/key``, but ``_meta`` in ``featbake/export/webdataset.py`` writes
    ``{**row, "id": ..., "key": ...}``, so the row's value is overwritten by the 64-hex
    content key in every sample and the label is lost in silence (exit 0)."""
    live = Live()
    keys = ["C", "Am", "G", "Em"]
    rows = [
        {"path": str(c), "id": f"song{i}", "key": keys[i]} for i, c in enumerate(_clips(tmp_path))
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bake(tmp_path / "m.jsonl", encoder_file, store_dir)
    out = tmp_path / "wds"
    r = invoke("export", "--format", "webdataset", out, "--cache", store_dir)
    assert r.returncode == 0, _one_line_or_done(r)
    by_id = {row["id"]: row for row in rows}
    seen = 0
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if not member.name.endswith(".json"):
                    continue
                meta = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
                row = by_id[meta["id"]]
                npy = member.name[: -len(".json")] + ".npy"
                got = np.load(io.BytesIO(tar.extractfile(npy).read()))  # type: ignore[union-attr]
                torch.testing.assert_close(
                    torch.from_numpy(got), live(encoder_file, Path(row["path"]))
                )
                assert row["key"] in meta.values(), f"the row's key {row['key']!r} is not in {meta}"
                seen += 1
    assert seen == len(rows)


def test_a_csv_with_an_unnamed_column_exports_to_zarr(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """``DataFrame.to_csv`` keeps the index by default, under a header cell of no name
    (``,path,label``): the build carries that column as ``""``, and ``_write_columns`` in
    ``featbake/export/zarr.py`` creates ``columns/`` + ``""``, which is the group itself:
    "internal error: ContainsGroupError: A group exists ... at path 'columns'", exit 1, and
    nothing exported, for zarr, the default format (Parquet and webdataset export it)."""
    pd = pytest.importorskip("pandas")
    zarr = pytest.importorskip("zarr")
    clips = _clips(tmp_path, 3)
    frame = pd.DataFrame({"path": [str(c) for c in clips], "label": [0, 1, 2]})
    frame.to_csv(tmp_path / "m.csv")  # pandas' default: the index as an unnamed first column
    assert (tmp_path / "m.csv").read_text().startswith(",path,label")
    bake(tmp_path / "m.csv", encoder_file, store_dir)
    out = tmp_path / "f.zarr"
    r = invoke("export", out, "--cache", store_dir)
    said = _one_line_or_done(r)
    assert "internal error" not in said and "Traceback" not in said, said
    assert r.returncode == 0, said
    g = zarr.open_group(str(out), mode="r")
    paths = [str(p) for p in g["paths"][:]]
    labels = {str(c): str(i) for i, c in enumerate(clips)}  # a CSV's cells are text
    assert [str(x) for x in g["columns/label"][:]] == [labels[p] for p in paths]


def test_carried_columns_that_clash_or_that_zarr_cannot_name_keep_a_name_each(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """One rule names carried columns in every format (``carried_names``): a column named as
    the format's own field (``key``) or as zarr cannot name an array (``""``, ``a/b``) is
    written as ``row_<name>``, ``row_`` added again where another column has that name, so a
    manifest with both ``key`` and ``row_key`` keeps both in Parquet (one was dropped) and in
    the webdataset JSON, and zarr writes ``a/b`` as one array, not a group ``a``."""
    pq = pytest.importorskip("pyarrow.parquet")
    zarr = pytest.importorskip("zarr")
    rows = [
        {"path": str(c), "id": f"u{i}", "key": f"k{i}", "row_key": f"r{i}", "a/b": i, "": f"n{i}"}
        for i, c in enumerate(_clips(tmp_path))
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bake(tmp_path / "m.jsonl", encoder_file, store_dir)
    by_id = {row["id"]: row for row in rows}
    for fmt in ("parquet", "webdataset", "zarr"):
        r = invoke("export", "--format", fmt, tmp_path / fmt, "--cache", store_dir)
        assert r.returncode == 0, _one_line_or_done(r)

    shared = {"key": "row_row_key", "row_key": "row_key"}  # Parquet's and the JSON's
    for rec in pq.read_table(tmp_path / "parquet").to_pylist():
        row = by_id[rec["id"]]
        assert {new: rec[new] for new in (*shared.values(), "a/b", "")} == {
            **{new: row[old] for old, new in shared.items()}, "a/b": row["a/b"], "": row[""],
        }  # fmt: skip
    seen = 0
    for shard in sorted((tmp_path / "webdataset").glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
                    row = by_id[meta["id"]]
                    assert len(meta["key"]) == 64 and meta[""] == row[""]
                    assert all(meta[new] == row[old] for old, new in shared.items())
                    seen += 1
    assert seen == len(rows)
    g = zarr.open_group(str(tmp_path / "zarr"), mode="r")
    order = [by_id[str(i)] for i in g["paths"][:]]  # each item's id, a manifest row's
    assert sorted(g["columns"].array_keys()) == ["key", "row_", "row_a_b", "row_key"]
    for old, new in {"key": "key", "row_key": "row_key", "a/b": "row_a_b", "": "row_"}.items():
        assert [str(x) for x in g[f"columns/{new}"][:]] == [str(r[old]) for r in order]
