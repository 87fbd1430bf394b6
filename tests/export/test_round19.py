"""Round nineteen, export: a manifest root built with ``--column``, two exports to one OUT at
once, what ``--overwrite`` may replace, and an OUT whose folder is missing.

Real stores built by the real code, exported through the ``featbake`` command and read back
by pyarrow, tarfile and zarr; features compared with the encoder run now.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from featbake.store.files import Taken, lock_taken
from featbake.testing import make_tone, write_audio_folder
from tests.conftest import invoke, run_cli
from tests.encode.test_manifests import write_jsonl
from tests.helpers import Live, bake, one_red_line, printed

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
zarr = pytest.importorskip("zarr")


@pytest.fixture
def built(encoder_file: Path, store_dir: Path, tmp_path: Path) -> Path:
    """A store holding one folder root of three clips."""
    write_audio_folder(tmp_path / "audio", 3, seconds=(0.3, 0.6), seed=1)
    bake(tmp_path / "audio", encoder_file, store_dir)
    return store_dir


def test_a_root_built_with_column_is_read_by_that_column_without_it(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL whose rows name their audio in ``wav`` (no ``path`` column), built with
    ``--column wav``. A plain export tried the default column only: every row's labels were
    left out, and a clip replaced since the build was exported as built, "removed or
    unreadable". The export now finds the column the root's name says: labels kept, the
    replaced clip left out and named as changed."""
    write_audio_folder(tmp_path / "audio", 3, seconds=(0.3, 0.6), seed=1)
    clips = sorted((tmp_path / "audio").glob("*.wav"))
    rows = [{"id": f"u{i}", "wav": str(c), "label": 10 + i} for i, c in enumerate(clips)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    built = run_cli("build", "-e", encoder_file, "-d", manifest, "--column", "wav",
                    "--cache", store_dir)  # fmt: skip
    assert built.returncode == 0, printed(built)
    soundfile.write(tmp_path / "other.wav", make_tone(0.45, seed=77), 16000)
    os.replace(tmp_path / "other.wav", clips[1])  # u1's clip is other audio now
    out = tmp_path / "f.parquet"
    r = run_cli("export", "--format", "parquet", out, "--cache", store_dir)
    assert r.returncode == 0, printed(r)
    assert "1 of 3 items" in printed(r) and "changed" in printed(r), printed(r)
    assert "cannot be opened" not in printed(r), printed(r)
    table = pq.read_table(out).to_pylist()
    assert {rec["id"]: rec["label"] for rec in table} == {"u0": 10, "u2": 12}
    live = Live()
    for rec in table:
        want = np.asarray(live(encoder_file, clips[int(rec["id"][1:])]))
        got = np.asarray(rec["features"], np.float32).reshape(rec["features_shape"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_second_export_to_the_same_out_at_once_is_refused(built: Path, tmp_path: Path) -> None:
    """Two exports to one OUT at once each deleted the other's ``OUT.partial``: both could
    say "exported" and leave an OUT no reader opened. While an export holds ``OUT.lock`` a
    second is refused in one line; after it, the export runs and leaves no lock file."""
    out = tmp_path / "f.zarr"
    fd = os.open(tmp_path / "f.zarr.lock", os.O_RDWR | os.O_CREAT)  # a running export's
    try:
        assert lock_taken(fd) is Taken.TAKEN
        r = run_cli("export", out, "--cache", built)
        line = one_red_line(r)
        assert r.returncode == 2 and "another export to" in line and "is running" in line, line
        assert not out.exists() and not (tmp_path / "f.zarr.partial").exists()
    finally:
        os.close(fd)
    r = run_cli("export", out, "--cache", built)
    assert r.returncode == 0, printed(r)
    assert zarr.open_group(str(out), mode="r").attrs["items"] == 3
    assert not (tmp_path / "f.zarr.lock").exists()


def test_overwrite_replaces_only_what_featbake_exported(built: Path, tmp_path: Path) -> None:
    """``--overwrite`` replaced anything of the format's type: a folder of the user's own
    audio shards, a Parquet table and a Zarr store another program wrote, and a Parquet file
    of the user's at ``OUT.partial`` even without ``--overwrite``. Each is refused in one line
    and left as it was; featbake's own exports are still replaced."""
    raw = tmp_path / "raw-shards"
    raw.mkdir()
    with tarfile.open(raw / "shard-000000.tar", "w") as tar:  # webdataset's own naming
        tar.add(next((tmp_path / "audio").glob("*.wav")), arcname="s0.wav")
    pq.write_table(pa.table({"text": ["precious"]}), tmp_path / "mine.parquet")
    mine = zarr.open_group(str(tmp_path / "mine.zarr"), mode="w")
    mine.create_array("precious", shape=(3,), dtype="i4")[:] = [1, 2, 3]
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"x": [1]}), tmp_path / "p" / "f.parquet")  # someone's finished
    os.replace(tmp_path / "p" / "f.parquet", tmp_path / "p" / "g.parquet.partial")
    cases = [
        ("webdataset", raw, ["--overwrite"]),
        ("parquet", tmp_path / "mine.parquet", ["--overwrite"]),
        ("zarr", tmp_path / "mine.zarr", ["--overwrite"]),
    ]
    cases.append(("parquet", tmp_path / "p" / "g.parquet", []))  # its OUT.partial: not ours
    for fmt, out, extra in cases:
        r = run_cli("export", "--format", fmt, out, "--cache", built, *extra)
        line = one_red_line(r)
        assert r.returncode == 2 and "featbake export" in line, line
    assert sorted(p.name for p in raw.iterdir()) == ["shard-000000.tar"]
    assert pq.read_table(tmp_path / "mine.parquet").column_names == ["text"]
    assert list(zarr.open_group(str(tmp_path / "mine.zarr"), mode="r").array_keys()) == ["precious"]
    assert pq.read_table(tmp_path / "p" / "g.parquet.partial").column_names == ["x"]
    for fmt, out in (("webdataset", tmp_path / "w"), ("parquet", tmp_path / "f.parquet"),
                     ("zarr", tmp_path / "f.zarr")):  # fmt: skip
        for _ in range(2):  # made, then replaced
            r = run_cli("export", "--format", fmt, out, "--cache", built, "--overwrite")
            assert r.returncode == 0, printed(r)
    with tarfile.open(tmp_path / "w" / "shard-000000.tar") as tar:
        assert any(name.endswith(".json") for name in tar.getnames())
    meta = json.loads(pq.read_schema(tmp_path / "f.parquet").metadata[b"featbake"])
    assert "featbake_version" in meta and pq.read_table(tmp_path / "f.parquet").num_rows == 3


def test_overwrite_keeps_what_a_user_added_to_a_zarr_export(built: Path, tmp_path: Path) -> None:
    """An array of labels and an attribute a user added to a Zarr export were deleted by
    ``export --overwrite`` without a word (exit 0; a webdataset folder holding other files is
    refused). Refused in one line naming them, the export left as it was; the export as
    written is still replaced."""
    out = tmp_path / "f.zarr"
    assert invoke("export", out, "--cache", built).returncode == 0
    group = zarr.open_group(str(out), mode="a")
    group.create_array("labels", shape=(3,), dtype="i4")[:] = [7, 8, 9]
    group.attrs["my_note"] = "hand-labelled"
    r = invoke("export", out, "--cache", built, "--overwrite")
    line = one_red_line(r)
    assert r.returncode == 2 and "holds attribute 'my_note', labels, which the export" in line
    kept = zarr.open_group(str(out), mode="r")
    assert kept["labels"][:].tolist() == [7, 8, 9] and kept.attrs["my_note"] == "hand-labelled"
    (out / "NOTES.txt").write_text("mine\n")  # a file of the user's, as webdataset refuses
    del zarr.open_group(str(out), mode="a").attrs["my_note"]
    shutil.rmtree(out / "labels")
    line = one_red_line(invoke("export", out, "--cache", built, "--overwrite"))
    assert "holds NOTES.txt, which the export did not write" in line, line
    (out / "NOTES.txt").unlink()
    zarr.open_group(str(out), mode="a")["values"].attrs["units"] = "dB"  # a node's, not the top's
    line = one_red_line(invoke("export", out, "--cache", built, "--overwrite"))
    assert "holds the attributes of values, which the export did not write" in line, line
    del zarr.open_group(str(out), mode="a")["values"].attrs["units"]
    assert invoke("export", out, "--cache", built, "--overwrite").returncode == 0
    older = zarr.open_group(str(out), mode="a")  # an export made before `part_groups` was
    del older.attrs["part_groups"]
    assert invoke("export", out, "--cache", built, "--overwrite").returncode == 0


def test_overwrite_keeps_an_array_a_user_added_under_columns(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """``columns/`` holds the root's own columns, under any names: an array of the user's
    there was deleted by ``--overwrite``. The ``columns`` attribute names the export's own, so
    the user's is refused by name; the export's own columns are replaced as before."""
    write_audio_folder(tmp_path / "audio", 3, seconds=(0.3, 0.6), seed=1)
    clips = sorted((tmp_path / "audio").glob("*.wav"))
    rows = [{"path": str(c), "label": 10 + i} for i, c in enumerate(clips)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    assert invoke("build", "-e", encoder_file, "-d", manifest, "--cache", store_dir).returncode == 0
    out = tmp_path / "f.zarr"
    assert invoke("export", out, "--cache", store_dir).returncode == 0
    group = zarr.open_group(str(out), mode="a")
    assert group.attrs["columns"] == ["label"] and group["columns/label"][:].tolist() == [
        10,
        11,
        12,
    ]
    group["columns"].create_array("my_labels", shape=(3,), dtype="i4")[:] = [7, 8, 9]
    line = one_red_line(invoke("export", out, "--cache", store_dir, "--overwrite"))
    assert "holds columns/my_labels, which the export did not write" in line, line
    shutil.rmtree(out / "columns" / "my_labels")
    assert invoke("export", out, "--cache", store_dir, "--overwrite").returncode == 0


def test_a_zarr_export_killed_in_zarrs_rename_is_rerun(built: Path, tmp_path: Path) -> None:
    """A kill within zarr's write of a ``zarr.json`` leaves its temporary file
    (``zarr.<hex>.partial``) in ``OUT.partial``: every rerun, ``--overwrite`` too, refused it
    as "not a Zarr store featbake exported". It is the export's own leftover now."""
    partial = tmp_path / "f.zarr.partial"
    partial.mkdir()
    (partial / f"zarr.{'ab' * 16}.partial").write_text("{")
    r = invoke("export", tmp_path / "f.zarr", "--cache", built)
    assert r.returncode == 0, printed(r)
    assert zarr.open_group(str(tmp_path / "f.zarr"), mode="r").attrs["items"] == 3
    assert not partial.exists()


def test_an_out_whose_folder_is_missing_is_refused_and_nothing_is_made(
    built: Path, tmp_path: Path
) -> None:
    """A Zarr export to ``no/such/f.zarr`` made the missing folders (zarr's own open does),
    and a failed export left them behind; Parquet and WebDataset refused. Every format now
    refuses in one line, and nothing is made."""
    for fmt in ("zarr", "parquet", "webdataset"):
        r = run_cli("export", "--format", fmt, tmp_path / "no" / "such" / "f.out",
                    "--cache", built)  # fmt: skip
        line = one_red_line(r)
        assert r.returncode == 2 and "does not exist" in line, line
    assert not (tmp_path / "no").exists()


def test_carried_dates_decimals_bytes_and_nan_are_written_as_text_and_json_hold_them(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A table's timestamp, decimal and binary columns, and a label missing (NaN once read):
    Zarr's text cells kept JSON's quotes (``'"2024-01-01T00:00:00"'``), bytes were a Python
    ``repr`` (``"b'\\\\x00\\\\x01'"``) and WebDataset's JSON held a bare ``NaN``, which no JSON
    reader takes. Now ISO 8601 text, the decimal's text, bytes as hex and null."""
    import datetime
    import decimal

    from tests.encode.test_containers import wav_bytes, write_audio_parquet

    table = write_audio_parquet(
        tmp_path / "t.parquet",
        [wav_bytes(0.4, seed=i) for i in range(2)],
        id=["r0", "r1"],
        label=[1.5, float("nan")],
        ts=[datetime.datetime(2024, 1, 1), datetime.datetime(2024, 1, 2, 3, 4)],
        dec=[decimal.Decimal("1.10"), decimal.Decimal("2.2")],
        bin=[b"\x00\x01", b"\xff"],
    )
    built = run_cli("build", "-e", encoder_file, "-d", table, "--cache", store_dir)
    assert built.returncode == 0, printed(built)
    for fmt, out in (("zarr", tmp_path / "o.zarr"), ("webdataset", tmp_path / "w")):
        r = run_cli("export", "--format", fmt, out, "--cache", store_dir, "--strict-rows")
        assert r.returncode == 0, printed(r)
    columns = zarr.open_group(str(tmp_path / "o.zarr"), mode="r")["columns"]
    assert list(columns["ts"][:]) == ["2024-01-01T00:00:00", "2024-01-02T03:04:00"]
    assert list(columns["dec"][:]) == ["1.10", "2.20"]
    assert list(columns["bin"][:]) == ["0001", "ff"]

    def strict(text: str) -> object:
        raise ValueError(f"not JSON: {text}")

    docs = []
    with tarfile.open(tmp_path / "w" / "shard-000000.tar") as tar:
        for member in tar:
            if member.name.endswith(".json"):
                data = tar.extractfile(member)
                assert data is not None
                docs.append(json.loads(data.read(), parse_constant=strict))
    by_id = {d["id"]: d for d in docs}
    assert (by_id["r0"]["label"], by_id["r1"]["label"]) == (1.5, None)
    assert (by_id["r1"]["ts"], by_id["r1"]["dec"], by_id["r1"]["bin"]) == (
        "2024-01-02T03:04:00",
        "2.20",
        "ff",
    )


def test_inputs_added_to_the_data_since_the_build_are_counted_or_refused(
    built: Path, tmp_path: Path
) -> None:
    """A clip added to the folder after the build was missing from the export with no word,
    ``--strict-rows`` included (it lists the data now, and compared only the root's items).
    One yellow line counts it; ``--strict-rows`` refuses, naming it."""
    soundfile.write(tmp_path / "audio" / "new.wav", make_tone(0.4, seed=9), 16000)
    r = run_cli("export", "--format", "parquet", tmp_path / "f.parquet", "--cache", built,
                "--json")  # fmt: skip
    assert r.returncode == 0, printed(r)
    assert json.loads(r.stdout)["added"] == 1 and json.loads(r.stdout)["items"] == 3
    said = [line for line in r.stderr.splitlines() if "its data lists now" in line]
    assert len(said) == 1 and "1 item" in said[0] and "--strict-rows" in said[0], r.stderr
    strict = run_cli("export", tmp_path / "s.zarr", "--cache", built, "--strict-rows")
    line = one_red_line(strict)
    assert strict.returncode == 2 and "'new.wav'" in line, line
    assert not (tmp_path / "s.zarr").exists()
