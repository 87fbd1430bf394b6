"""Round thirteen, export (r13.x1-r13.x6): rows gone from the manifest since the build, what
``--overwrite`` may delete, whole numbers past int64 in zarr, and names that differ only in case
(or that clash with an export's own names).

Real stores built by the real code from real manifests and tar shards, exported through the
``featbake`` command (a subprocess where what it prints is the surface) and read back by
pyarrow, tarfile and zarr, not featbake.
"""

from __future__ import annotations

import io
import json
import tarfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from torch import nn

from featbake.export.source import carried_names
from featbake.export.webdataset import part_extensions
from featbake.testing import TinyConvEncoder, make_tone, save_torchscript, write_audio_folder
from tests.conftest import invoke, run_cli
from tests.encode.test_manifests import write_jsonl
from tests.helpers import Live, bake, one_red_line, printed

pq = pytest.importorskip("pyarrow.parquet")
zarr = pytest.importorskip("zarr")


def _clips(tmp_path: Path, n: int = 4) -> list[Path]:
    write_audio_folder(tmp_path / "audio", n, seconds=(0.3, 0.6), seed=1)
    return sorted((tmp_path / "audio").rglob("*.wav"))


def _wds_samples(folder: Path) -> dict[str, dict[str, bytes]]:
    """Each sample's members by extension, split as webdataset splits a member's name (the key
    is the name up to the first dot of its last path part)."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                head, _, last = m.name.rpartition("/")
                stem, _, ext = last.partition(".")
                key = f"{head}/{stem}" if head else stem
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                samples.setdefault(key, {})[ext] = data
    return samples


# == r13.x1: rows gone from the manifest since the build ===========================================
def test_items_whose_rows_left_the_manifest_are_warned_of_or_refused(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL of 4 labelled clips is built; then one row is deleted and one row's id renamed
    (``u1`` to ``u1b``). The export reads the rows from the manifest as it is now: the two items
    it no longer lists were exported with null labels and no word. Now: one yellow line with
    the count and what to do, the labels of the others as the manifest says; and under
    ``--strict-rows`` one red line, exit 2, nothing written."""
    clips = _clips(tmp_path)
    rows = [{"path": str(c), "id": f"u{i}", "label": 10 + i} for i, c in enumerate(clips)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    bake(manifest, encoder_file, store_dir)
    changed = [rows[0], {**rows[1], "id": "u1b"}, {**rows[2], "label": 99}]  # u3 deleted
    write_jsonl(manifest, changed)

    out = tmp_path / "f.parquet"
    r = run_cli("export", "--format", "parquet", out, "--cache", store_dir)
    assert r.returncode == 0, printed(r)
    warned = [line for line in printed(r).splitlines() if "no row" in line]
    assert len(warned) == 1, printed(r)
    assert "2 of 4 items" in warned[0] and "--strict-rows" in warned[0], warned[0]
    assert "featbake build" in warned[0], warned[0]
    got = {rec["id"]: rec["label"] for rec in pq.read_table(out).to_pylist()}
    assert got == {"u0": 10, "u1": None, "u2": 99, "u3": None}  # u2's label as it is now

    strict = tmp_path / "strict.zarr"
    r = run_cli("export", strict, "--cache", store_dir, "--strict-rows")
    line = one_red_line(r)
    assert r.returncode == 2 and "2 of 4 items" in line and "u1" in line, line
    assert not strict.exists() and not Path(f"{strict}.partial").exists()

    write_jsonl(manifest, rows)  # the manifest as built: no word, and --strict-rows exports
    r = invoke("export", strict, "--cache", store_dir, "--strict-rows")
    assert r.returncode == 0 and "no row" not in printed(r), printed(r)


def test_strict_rows_refuses_a_root_whose_rows_cannot_be_read(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The manifest moved away since the build: by default one yellow line and ids and keys
    exported (as before); under ``--strict-rows`` a refusal (no rows at all is no row for
    every item)."""
    clips = _clips(tmp_path, 2)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"path": str(c), "label": 1} for c in clips])
    bake(manifest, encoder_file, store_dir)
    manifest.rename(tmp_path / "moved.jsonl")
    r = invoke("export", tmp_path / "a.zarr", "--cache", store_dir)
    assert r.returncode == 0 and "rows' columns are left out" in printed(r), printed(r)
    r = invoke("export", tmp_path / "b.zarr", "--cache", store_dir, "--strict-rows")
    line = one_red_line(r)
    assert r.returncode == 2 and "cannot be read" in line and "--strict-rows" in line, line
    assert not (tmp_path / "b.zarr").exists()


# == r13.x2: what --overwrite may delete ===========================================================
def _wav(seconds: float, seed: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, make_tone(seconds, 16000, seed=seed), 16000, format="WAV")
    return out.getvalue()


def _audio_shards(folder: Path, n: int = 3) -> Path:
    """A folder of webdataset shards of labelled clips (``.wav`` and ``.cls`` per sample)."""
    folder.mkdir(parents=True)
    with tarfile.open(folder / "shard-000000.tar", "w") as tf:
        for i in range(n):
            for ext, data in (("wav", _wav(0.3 + 0.1 * i, i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"clip{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return folder


def test_overwrite_refuses_the_data_a_root_was_built_from(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A root built from a folder of webdataset shards (only ``.tar`` files, as an export's
    folder): ``featbake export --format webdataset SHARDS --overwrite`` deleted the user's data
    and wrote the export in its place (exit 0). Now one red line naming the root, exit 2, the
    shards untouched; the same for OUT holding the data, and for the store itself."""
    shards = _audio_shards(tmp_path / "shards")
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    bake(shards, encoder_file, store_dir)

    r = run_cli("export", "--format", "webdataset", shards, "--cache", store_dir, "--overwrite")
    line = one_red_line(r)
    assert r.returncode == 2 and "data" in line and "built from" in line, line
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before
    for out in (tmp_path, store_dir):  # holds the data; is the store
        r = invoke("export", "--format", "webdataset", out, "--cache", store_dir, "--overwrite")
        assert r.returncode == 2, printed(r)
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before

    inside = shards / "feats.zarr"  # inside the data: its next scan would find the export
    r = invoke("export", inside, "--cache", store_dir)
    assert r.returncode == 2 and not inside.exists(), printed(r)

    # a genuine earlier export is still replaced
    wds = tmp_path / "out-wds"
    for _ in range(2):
        r = invoke("export", "--format", "webdataset", wds, "--cache", store_dir, "--overwrite")
        assert r.returncode == 0, printed(r)
    assert len(_wds_samples(wds)) == 3


def test_overwrite_replaces_only_a_parquet_file(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """``--format parquet OUT --overwrite`` replaced any file at OUT: a clip the manifest names,
    or the manifest itself (the data). Now a file that is not Parquet, and the manifest, are
    refused in one line; an earlier export is replaced."""
    clips = _clips(tmp_path, 2)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"path": str(c), "label": 1} for c in clips])
    bake(manifest, encoder_file, store_dir)
    for target in (clips[0], manifest):
        before = target.read_bytes()
        r = invoke("export", "--format", "parquet", target, "--cache", store_dir, "--overwrite")
        assert r.returncode == 2, printed(r)
        assert target.read_bytes() == before
    out = tmp_path / "f.parquet"
    for _ in range(2):
        r = invoke("export", "--format", "parquet", out, "--cache", store_dir, "--overwrite")
        assert r.returncode == 0, printed(r)
    assert pq.read_table(out).num_rows == 2


def test_an_out_of_dot_or_the_filesystem_root_is_checked_as_the_folder_it_names(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """``featbake export . --overwrite`` (or ``/``) stopped with ``internal error: ValueError:
    PosixPath('.') has an empty name``. Now ``.`` is the folder it names (here: holding the
    store, refused in one line) and ``/`` is refused in one line."""
    _clips(tmp_path, 2)
    bake(tmp_path / "audio", encoder_file, store_dir)
    for out in (".", "/"):
        r = invoke("export", out, "--cache", store_dir, "--overwrite", cwd=tmp_path)
        assert r.returncode == 2, printed(r)
        one_red_line(r)
    assert store_dir.is_dir() and (tmp_path / "audio").is_dir()


# == r13.x3: whole numbers past int64 in zarr ======================================================
def test_whole_numbers_past_int64_export_to_zarr_as_parquet_writes_them(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A manifest's ``hash`` column of uint64 values (some past 2**63-1), a ``big`` one past
    uint64, and ``near`` whole numbers past 2**53 with a missing one: zarr stopped with
    ``internal error: OverflowError`` (the first two) or wrote ``near`` as float64, rounded.
    Now each is written exact: as text where Arrow cannot type it, as Parquet writes it, and
    ``near`` as text (Parquet's null int64 has no zarr kind; webdataset's JSON keeps every
    number as it is)."""
    clips = _clips(tmp_path, 3)
    hashes = [2**64 - 1, 2**63, 7]
    bigs = [10**30, 1, 2]
    nears = [2**60 + 1, None, 3]
    rows = [
        {"path": str(c), "id": f"u{i}", "hash": hashes[i], "big": bigs[i], "near": nears[i]}
        for i, c in enumerate(clips)
    ]
    bake(write_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir)
    out = tmp_path / "f.zarr"
    r = run_cli("export", out, "--cache", store_dir)
    said = printed(r)
    assert "internal error" not in said and "Traceback" not in said, said
    assert r.returncode == 0, said
    r = invoke("export", "--format", "parquet", tmp_path / "f.parquet", "--cache", store_dir)
    assert r.returncode == 0, printed(r)
    g = zarr.open_group(str(out), mode="r")
    by_id = {row["id"]: row for row in rows}
    order = [by_id[str(p)] for p in g["paths"][:]]
    table = {rec["id"]: rec for rec in pq.read_table(tmp_path / "f.parquet").to_pylist()}
    for name in ("hash", "big", "near"):
        got = g[f"columns/{name}"][:].tolist()
        want = [row[name] for row in order]
        assert [None if v in ("", None) else int(v) for v in got] == want, (name, got)
        parquet = [table[row["id"]][name] for row in order]
        assert [None if v is None else int(v) for v in parquet] == want, (name, parquet)
        if name != "near":  # Parquet has a null int64; zarr writes text, not a rounded float
            assert [type(v) for v in got] == [type(v) for v in parquet] == [str] * 3, name


# == r13.x4: names that differ only in case ========================================================
def test_carried_names_differ_regardless_of_case_and_normalisation() -> None:
    """``Label`` and ``label`` (or an NFC and an NFD ``café``) are one file on a case-
    insensitive (or normalising) filesystem: the second gets ``row_``; a column alone keeps
    its name whatever its case, and one named ``ID`` or ``Key`` clashes with ``id``/``key``."""
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    names = carried_names(["Label", "label", "x", nfc, nfd, "ID"], taken=("id", "key"))
    assert names == {
        "Label": "Label", "label": "row_label", "x": "x", nfc: nfc, nfd: "row_" + nfd,
        "ID": "row_ID",
    }  # fmt: skip
    assert carried_names(["Speaker", "TEXT"]) == {"Speaker": "Speaker", "TEXT": "TEXT"}
    folded = [unicodedata.normalize("NFC", n).casefold() for n in names.values()]
    assert len(set(folded)) == len(folded)


def test_columns_differing_only_in_case_keep_an_array_each_in_zarr(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A manifest with ``Label`` (the annotator's) and ``label`` (the model's): zarr wrote
    ``columns/Label`` and ``columns/label``, one folder on macOS's or Windows' filesystem,
    where the second array overwrites the first. Now ``label`` is ``columns/row_label``, in
    every format alike (a Parquet column, a key of the webdataset JSON)."""
    clips = _clips(tmp_path, 3)
    rows = [
        {"path": str(c), "id": f"u{i}", "Label": f"a{i}", "label": f"m{i}"}
        for i, c in enumerate(clips)
    ]
    bake(write_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir)
    for fmt in ("zarr", "parquet", "webdataset"):
        r = invoke("export", "--format", fmt, tmp_path / fmt, "--cache", store_dir)
        assert r.returncode == 0, printed(r)
    by_id = {row["id"]: row for row in rows}
    g = zarr.open_group(str(tmp_path / "zarr"), mode="r")
    assert sorted(g["columns"].array_keys()) == ["Label", "row_label"]
    order = [by_id[str(p)] for p in g["paths"][:]]
    assert list(g["columns/Label"][:]) == [r["Label"] for r in order]
    assert list(g["columns/row_label"][:]) == [r["label"] for r in order]
    for rec in pq.read_table(tmp_path / "parquet").to_pylist():
        assert (rec["Label"], rec["row_label"]) == (
            by_id[rec["id"]]["Label"],
            by_id[rec["id"]]["label"],
        )
    for members in _wds_samples(tmp_path / "webdataset").values():
        meta = json.loads(members["json"])
        assert (meta["Label"], meta["row_label"]) == (
            by_id[meta["id"]]["Label"],
            by_id[meta["id"]]["label"],
        )


# == r13.x5: part names an export must make its own ================================================
class _OddParts(nn.Module):
    """An encoder whose outputs are named as an export's own names (``keys``, ``id``, a part's
    ``_shape``), differ only in case (``Pooled``/``pooled``) or hold a path separator."""

    def __init__(self) -> None:
        super().__init__()
        self.front = TinyConvEncoder(dim=8)

    def forward(self, wav: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.front(wav)
        m = h.mean(dim=1)
        return {
            "Pooled": m, "pooled": h.amax(dim=1), "keys": m * 2, "columns": m + 1,
            "id": m - 2, "pooled_shape": m * 3, "a/b": m - 1,
        }  # fmt: skip


def test_parts_named_as_an_exports_own_names_keep_their_features(
    store_dir: Path, tmp_path: Path
) -> None:
    """Parts named ``keys``/``columns`` (zarr's own arrays), ``id`` or ``pooled_shape``
    (Parquet's own columns), ``Pooled`` beside ``pooled``, or ``a/b``: zarr stopped with
    ``internal error: ContainsGroupError ... at path 'keys'``, Parquet wrote two columns named
    ``id`` (and two ``pooled_shape``), webdataset a member ``u0.a/b.npy`` that webdataset reads
    as another sample (``u0.a/b``). Now each part has a name of its own in each format, read
    back equal to the encoder run now, under the names zarr's ``part_groups`` attribute and
    Parquet's ``part_columns`` metadata record (webdataset's by the rule its doc states)."""
    enc = save_torchscript(_OddParts(), tmp_path / "odd.pt")
    clips = _clips(tmp_path, 2)
    rows = [{"path": str(c), "id": f"u{i}", "label": i} for i, c in enumerate(clips)]
    bake(write_jsonl(tmp_path / "m.jsonl", rows), enc, store_dir)
    for fmt in ("zarr", "parquet", "webdataset"):
        r = invoke("export", "--format", fmt, tmp_path / fmt, "--cache", store_dir)
        said = printed(r)
        assert "internal error" not in said and r.returncode == 0, (fmt, said)
    live = Live()
    path_of = {row["id"]: Path(row["path"]) for row in rows}
    parts = ["Pooled", "pooled", "keys", "columns", "id", "pooled_shape", "a/b"]

    def want(item_id: str, part: str) -> torch.Tensor:
        return live(enc, path_of[item_id])[part]

    g = zarr.open_group(str(tmp_path / "zarr"), mode="r")
    groups = g.attrs["part_groups"]
    assert sorted(groups) == sorted(parts)
    folded = [unicodedata.normalize("NFC", n).casefold() for n in groups.values()]
    assert len(set(folded)) == len(folded) and not any("/" in n for n in groups.values())
    for i, item_id in enumerate(g["paths"][:]):
        for part, name in groups.items():
            got = torch.from_numpy(g[f"{name}/values"][i])
            torch.testing.assert_close(got, want(str(item_id), part))

    table = pq.read_table(tmp_path / "parquet")
    meta = json.loads(table.schema.metadata[b"featbake"])
    columns = meta["part_columns"]
    assert sorted(columns) == sorted(parts)
    assert len(set(table.column_names)) == len(table.column_names), table.column_names
    for rec in table.to_pylist():
        assert rec["id"] in path_of and rec["label"] == int(rec["id"][1:])
        for part, name in columns.items():
            torch.testing.assert_close(torch.tensor(rec[name]), want(rec["id"], part))

    samples = _wds_samples(tmp_path / "webdataset")
    assert sorted(samples) == ["u0", "u1"], sorted(samples)
    exts = part_extensions(sorted(parts))  # the rule the module's doc states, in part order
    assert (exts["Pooled"], exts["pooled"], exts["a/b"]) == (
        "Pooled.npy",
        "part_pooled.npy",
        "part_a_b.npy",
    )
    for members in samples.values():
        info = json.loads(members["json"])
        assert sorted(members) == sorted([*exts.values(), "json"])
        for part, ext in exts.items():
            got = np.load(io.BytesIO(members[ext]))
            torch.testing.assert_close(torch.from_numpy(got), want(info["id"], part))


# == r13.x6: names a filesystem or UTF-8 cannot hold ===============================================
def test_columns_named_past_a_file_names_bytes_or_with_a_nul_or_lone_surrogate_export(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL whose keys are a 300-character name, ``"nul\\u0000x"`` and ``"\\ud800x"`` (valid
    JSON escapes), and whose ``note`` holds a lone surrogate: zarr stopped with "cannot write
    the export ...: File name too long; ... choose an OUT inside a folder you can write to"
    (wrong advice), ``internal error: ValueError: embedded null byte`` and ``internal error:
    UnicodeEncodeError``, Parquet with the last two. Now every column is written (zarr: a name
    it cannot take as ``row_<its position>`` or ``row_<name>``), the surrogate as its escape."""
    clips = _clips(tmp_path, 2)
    long, nul, lone = "a" * 300, "nul\x00x", "\ud800x"
    lines = [
        json.dumps(
            {"path": str(c), "id": f"u{i}", long: i, nul: i + 1, lone: i + 2, "note": "\ud800"}
        )
        for i, c in enumerate(clips)
    ]
    (tmp_path / "m.jsonl").write_text("".join(line + "\n" for line in lines))
    bake(tmp_path / "m.jsonl", encoder_file, store_dir)
    for fmt in ("zarr", "parquet", "webdataset"):
        r = invoke("export", "--format", fmt, tmp_path / fmt, "--cache", store_dir)
        said = printed(r)
        assert "internal error" not in said and r.returncode == 0, (fmt, said)
    g = zarr.open_group(str(tmp_path / "zarr"), mode="r")
    columns = {name: g[f"columns/{name}"][:].tolist() for name in g["columns"].array_keys()}
    order = [int(str(p)[1:]) for p in g["paths"][:]]
    want = [list(order), [i + 1 for i in order], [i + 2 for i in order], ["\\ud800"] * 2]
    assert sorted(map(repr, columns.values())) == sorted(map(repr, want)), columns
    assert all(len(name.encode()) <= 255 and "\x00" not in name for name in columns)
    table = pq.read_table(tmp_path / "parquet").to_pylist()
    assert [rec["note"] for rec in table] == ["\\ud800"] * 2
    assert all(rec[long] == int(rec["id"][1:]) and rec[nul] == rec[long] + 1 for rec in table)
