"""Round fourteen, export (r14.x1-r14.x5): an input changed since the build under the same id.

A manifest names each item by an explicit id; the build stored the features of the file the row
named then. Where the file changed since (other bytes of the same size with its mtime put back,
another file moved over it, a segment's bounds moved), the export paired the old file's
features with the row's labels now: a wrong (features, label) pair handed to a probe. Each
item's input is now keyed again as the build keyed it, through the catalog's hash cache, and an
item whose key differs is left out (one yellow line; ``--strict-rows`` refuses).

Real stores built by the real code from real manifests, exported through the ``featbake``
command and read back by pyarrow, tarfile and zarr, not featbake; features checked against the
encoder run now on the files the rows name.
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
import torch

from featbake.testing import make_tone, write_audio_folder
from tests.conftest import invoke
from tests.encode.test_manifests import write_jsonl
from tests.helpers import Live, age, bake, printed

pq = pytest.importorskip("pyarrow.parquet")
zarr = pytest.importorskip("zarr")


def _lines(r, word: str) -> list[str]:
    return [line for line in printed(r).splitlines() if word in line]


def _aged_clips(tmp_path: Path, n: int) -> list[Path]:
    """``n`` clips made to look a minute old: the build's hash-cache rows of them are trusted
    (not "racy"), so the export's check reads them only where their stat changed."""
    write_audio_folder(tmp_path / "audio", n, seconds=(0.3, 0.6), seed=1)
    clips = sorted((tmp_path / "audio").rglob("*.wav"))
    for clip in clips:
        age(clip, 60)
    return clips


def _same_size_other_bytes(path: Path) -> None:
    """Rewrite ``path`` in place with other samples of the same length (same size), and put
    its mtime back, as ``cp -p`` or ``touch -r`` would: only the ctime tells."""
    st = path.stat()
    audio, rate = soundfile.read(path, dtype="float32")
    soundfile.write(path, make_tone(len(audio) / rate, rate, seed=99)[: len(audio)], rate)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _parquet_features(path: Path) -> dict[str, tuple[torch.Tensor, object]]:
    """id -> (features, label), read by pyarrow."""
    out = {}
    for rec in pq.read_table(path).to_pylist():
        got = torch.tensor(np.array(rec["features"], dtype=np.float32))
        out[rec["id"]] = (got.reshape(rec["features_shape"]), rec["label"])
    return out


# == r14.x1: a row's file changed since the build under the same id ================================
def test_rows_whose_files_changed_are_left_out_and_the_rest_match_the_encoder_now(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL of 5 labelled clips with explicit ids is built. Then u0's file gets other bytes
    of the same size (mtime put back), another clip is moved over u1's file, u2's file is
    removed, and u3's label is fixed. The export paired u0's and u1's old features with their
    rows (exit 0, no word). Now: u0 and u1 are left out with one yellow line; u2, whose file
    cannot be read, is exported as built with a line of its own; every exported item's
    features equal the encoder run now on the file its row names (u2's: on its bytes as
    built), with the label the manifest holds now."""
    clips = _aged_clips(tmp_path, 5)
    kept = tmp_path / "u2-as-built.wav"
    shutil.copy2(clips[2], kept)
    rows = [{"path": str(c), "id": f"u{i}", "label": 10 + i} for i, c in enumerate(clips)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    bake(manifest, encoder_file, store_dir)
    _same_size_other_bytes(clips[0])
    other = tmp_path / "other.wav"
    soundfile.write(other, make_tone(0.45, 16000, seed=7), 16000)
    os.replace(other, clips[1])
    clips[2].unlink()
    write_jsonl(manifest, [*rows[:3], {**rows[3], "label": 99}, rows[4]])

    out = tmp_path / "f.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir, "--json")
    assert r.returncode == 0, printed(r)
    changed = _lines(r, "changed in its data since the build")
    assert len(changed) == 1 and changed[0].startswith("2 of 5 items of root "), printed(r)
    assert "left out" in changed[0] and "featbake build" in changed[0], changed[0]
    assert "--strict-rows" in changed[0], changed[0]
    unread = _lines(r, "cannot be read from its data now")
    assert len(unread) == 1 and unread[0].startswith("1 of 5 items"), printed(r)
    assert "exported as built" in unread[0], unread[0]
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert (report["items"], report["changed"], report["unchecked"]) == (3, 2, 1), report
    assert report["missing"] == 0, report  # changed items are not "not stored"

    got = _parquet_features(out)
    assert sorted(got) == ["u2", "u3", "u4"], sorted(got)
    live = Live()
    files = {"u2": kept, "u3": clips[3], "u4": clips[4]}
    for item_id, (features, label) in got.items():
        torch.testing.assert_close(features, live(encoder_file, files[item_id]))
        assert label == (99 if item_id == "u3" else 10 + int(item_id[1:])), (item_id, label)

    for fmt in ("zarr", "webdataset"):  # the same items in every format
        dest = tmp_path / fmt
        r = invoke("export", "--format", fmt, dest, "--cache", store_dir)
        assert r.returncode == 0 and len(_lines(r, "changed in its data")) == 1, printed(r)
        if fmt == "zarr":
            ids = [str(p) for p in zarr.open_group(str(dest), mode="r")["paths"][:]]
        else:
            with tarfile.open(next(dest.glob("*.tar"))) as tar:
                ids = [m.name.partition(".")[0] for m in tar.getmembers()]
        assert sorted(set(ids)) == ["u2", "u3", "u4"], (fmt, ids)


# == r14.x2: --strict-rows =========================================================================
def test_strict_rows_refuses_changed_or_unreadable_files_writing_nothing(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Under ``--strict-rows`` an item whose file changed is refused in one red line naming
    it (exit 2, nothing written), and so, once the data is put back, is one whose file is
    gone; with every file as built the strict export goes through with no word."""
    clips = _aged_clips(tmp_path, 3)
    saved = {c: c.read_bytes() for c in clips}
    rows = [{"path": str(c), "id": f"u{i}", "label": i} for i, c in enumerate(clips)]
    bake(write_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir)
    _same_size_other_bytes(clips[1])

    out = tmp_path / "s.zarr"
    r = invoke("export", out, "--cache", store_dir, "--strict-rows")
    lines = [line.removeprefix("error: ") for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, printed(r)
    assert lines[0].startswith("1 of 3 items of root ") and "'u1'" in lines[0], lines[0]
    assert "changed in its data" in lines[0] and "drop --strict-rows" in lines[0], lines[0]
    assert not out.exists() and not Path(f"{out}.partial").exists()

    clips[1].write_bytes(saved[clips[1]])  # the bytes as built, under a new stat: read again
    clips[2].unlink()
    r = invoke("export", out, "--cache", store_dir, "--strict-rows")
    assert r.returncode == 2 and "cannot be read from its data" in printed(r), printed(r)
    assert "'u2'" in printed(r) and not out.exists(), printed(r)

    clips[2].write_bytes(saved[clips[2]])
    r = invoke("export", out, "--cache", store_dir, "--strict-rows")
    assert r.returncode == 0 and "its data" not in printed(r), printed(r)
    assert len(zarr.open_group(str(out), mode="r")["paths"][:]) == 3

    # The manifest itself gone: said without "check --data", an option export does not have.
    (tmp_path / "m.jsonl").unlink()
    r = invoke("export", tmp_path / "t.zarr", "--cache", store_dir, "--strict-rows")
    assert r.returncode == 2 and "m.jsonl does not exist" in printed(r), printed(r)
    assert "--data" not in printed(r) and "drop --strict-rows" in printed(r), printed(r)


# == r14.x3: inputs that are not a row's whole file ================================================
def test_a_folder_root_and_moved_segment_bounds_are_checked_too(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A folder root: a file rewritten since the build is left out (its path is the id a user
    joins labels on), a file removed since is exported as built and counted. A manifest of
    segments: a row whose ``end`` moved under the same id is another input, left out; the
    untouched segment of the same recording is exported."""
    clips = _aged_clips(tmp_path, 3)
    bake(tmp_path / "audio", encoder_file, store_dir / "a")
    _same_size_other_bytes(clips[0])
    clips[1].unlink()
    r = invoke("export", "--format", "parquet", tmp_path / "a.parquet", "--cache", store_dir / "a")
    assert r.returncode == 0 and _lines(r, "changed")[0].startswith("1 of 3"), printed(r)
    assert _lines(r, "cannot be read from")[0].startswith("1 of 3"), printed(r)
    ids = pq.read_table(tmp_path / "a.parquet").column("id").to_pylist()
    assert len(ids) == 2 and clips[0].name not in " ".join(ids), ids
    assert clips[1].name in " ".join(ids), ids

    rec = tmp_path / "rec.wav"
    soundfile.write(rec, make_tone(1.0, 16000, seed=3), 16000)
    age(rec, 60)
    rows = [
        {"path": str(rec), "id": "s0", "start": 0.0, "end": 0.4, "label": 0},
        {"path": str(rec), "id": "s1", "start": 0.5, "end": 0.9, "label": 1},
    ]
    manifest = write_jsonl(tmp_path / "seg.jsonl", rows)
    bake(manifest, encoder_file, store_dir / "s")
    write_jsonl(manifest, [rows[0], {**rows[1], "end": 1.0}])
    out = tmp_path / "s.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir / "s")
    assert r.returncode == 0 and _lines(r, "changed")[0].startswith("1 of 2"), printed(r)
    assert pq.read_table(out).column("id").to_pylist() == ["s0"]


# == r14.x4: no false alarm ========================================================================
def test_data_as_built_exports_every_item_with_no_word(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Unchanged data of several kinds (a folder, a manifest of segments, tar shards with
    ``.cls`` labels) keys to the keys the build stored: every item exported, no line, under
    ``--strict-rows`` too (the check keys inputs exactly as the build did)."""
    clips = _aged_clips(tmp_path, 2)
    rows = [
        {"path": str(clips[0]), "id": "s0", "start": 0.0, "end": 0.2, "label": 0},
        {"path": str(clips[1]), "label": 1},
    ]
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tf:
        for i, clip in enumerate(clips):
            tf.add(clip, f"c{i}.wav")
            label = tmp_path / f"c{i}.cls"
            label.write_text(str(i))
            tf.add(label, f"c{i}.cls")
    age(shards / "shard-000000.tar", 60)
    for name, data in (
        ("folder", tmp_path / "audio"),
        ("segments", write_jsonl(tmp_path / "m.jsonl", rows)),
        ("tars", shards),
    ):
        bake(data, encoder_file, store_dir / name)
        r = invoke("export", tmp_path / f"{name}.zarr", "--cache", store_dir / name,
                   "--strict-rows", "--json")  # fmt: skip
        assert r.returncode == 0 and "its data" not in r.stderr, (name, printed(r))
        report = json.loads(r.stdout[r.stdout.index("{") :])
        assert (report["items"], report["changed"], report["unchecked"]) == (2, 0, 0), report


# == r14.x5: nothing left ==========================================================================
def test_every_item_changed_is_one_line_and_nothing_written(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Every file rewritten since the build: there is nothing true to export; one red line
    that says so and what to do, exit 2, nothing written."""
    clips = _aged_clips(tmp_path, 2)
    rows = [{"path": str(c), "id": f"u{i}", "label": i} for i, c in enumerate(clips)]
    bake(write_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir)
    for clip in clips:
        _same_size_other_bytes(clip)
    out = tmp_path / "f.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir)
    lines = [line.removeprefix("error: ") for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, printed(r)
    assert lines[0].startswith("2 of 2 items") and "nothing is left" in lines[0], lines[0]
    assert "featbake build" in lines[0] and not out.exists(), lines[0]
