"""Round fourteen, review of the export's check (r14.r1-): where an export could still pair a
row with features of other bytes, or leave out an unchanged item.

Real stores built by the real code from real manifests (JSONL, CSV, Kaldi folders, lhotse
cuts, parquet tables, tar shards), exported through the ``featbake`` command run in-process
and read back by pyarrow, not featbake.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from pathlib import Path

import pytest
import soundfile
import torch

from featbake.testing import make_tone, write_audio_folder
from tests.conftest import invoke
from tests.helpers import Live, age, bake

pq = pytest.importorskip("pyarrow.parquet")


def _said(r) -> str:
    return (r.stdout + r.stderr).strip()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _report(r) -> dict:
    return json.loads(r.stdout[r.stdout.index("{") :])


def _aged_clips(tmp_path: Path, n: int, name: str = "audio", seed: int = 1) -> list[Path]:
    """``n`` clips made to look a minute old (the build's hash-cache rows of them trusted)."""
    write_audio_folder(tmp_path / name, n, seconds=(0.3, 0.6), seed=seed)
    clips = sorted((tmp_path / name).rglob("*.wav"))
    for clip in clips:
        age(clip, 60)
    return clips


def _same_size_other_bytes(path: Path) -> None:
    """Other samples of the same length written over ``path``, its mtime put back."""
    st = path.stat()
    audio, rate = soundfile.read(path, dtype="float32")
    soundfile.write(path, make_tone(len(audio) / rate, rate, seed=99)[: len(audio)], rate)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _export(store: Path, out: Path, *extra: str | os.PathLike[str]):
    return invoke("export", "--format", "parquet", out, "--cache", store, "--json", *extra)


# == r14.r1: a root built with --column, exported without it (or with another) ===================
def test_a_root_built_with_column_is_checked_by_that_column(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL names two files per row (``path``, clean, and ``noisy``); the build named
    ``--column noisy``. The export keyed each row's ``path`` file instead, none of which gives
    the stored keys: "3 of 3 items ... changed ...: nothing is left to export", exit 2, over
    data that had not changed at all. The root's name says which column its build named
    (``keys.root_id``): the export reads the rows by it, whether --column is left out or
    another given, and still leaves out the one noisy file that did change."""
    clips = _aged_clips(tmp_path, 3)
    noisy = _aged_clips(tmp_path, 3, "noisy", seed=5)
    rows = [
        {"path": str(c), "noisy": str(n), "id": f"u{i}", "label": i}
        for i, (c, n) in enumerate(zip(clips, noisy, strict=True))
    ]
    bake(_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir, column="noisy")
    for extra in ((), ("--column", "path"), ("--column", "noisy")):
        r = _export(store_dir, tmp_path / "f.parquet", "--strict-rows", "--overwrite", *extra)
        assert r.returncode == 0 and "its data" not in r.stderr, (extra, _said(r))
        report = _report(r)
        assert (report["items"], report["changed"], report["unchecked"]) == (3, 0, 0), report
        got = {rec["id"]: rec["label"] for rec in pq.read_table(tmp_path / "f.parquet").to_pylist()}
        assert got == {"u0": 0, "u1": 1, "u2": 2}, (extra, got)

    _same_size_other_bytes(noisy[1])
    _same_size_other_bytes(clips[2])  # not the column built from: no change to its item
    r = _export(store_dir, tmp_path / "f.parquet", "--overwrite")
    assert r.returncode == 0, _said(r)
    assert (_report(r)["items"], _report(r)["changed"]) == (2, 1), _said(r)
    table = pq.read_table(tmp_path / "f.parquet").to_pylist()
    live = Live()
    for rec in table:
        i = int(rec["id"][1:])
        got = torch.tensor(rec["features"]).reshape(rec["features_shape"])
        torch.testing.assert_close(got, live(encoder_file, noisy[i]))
    assert sorted(rec["id"] for rec in table) == ["u0", "u2"], table


# == r14.r2: a segment its file no longer holds ====================================================
def test_a_segment_its_file_no_longer_holds_is_changed_not_unknown(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A JSONL of segments of three recordings. Then recA is rewritten shorter (0.7 s: s0 now
    other samples, s1's span 0.5-0.9 s past its end), recB's bytes are replaced by bytes that
    are no audio, and s3's ``end`` is moved past the end of recC (unchanged). Each of s1, s2
    and s3 names an input that is not there now, yet the export counted them "cannot be
    read ... whether they changed is unknown" and exported their old features with the rows'
    labels (the files read fine: only their spans are not in them). Now a row whose file is
    read but holds no such input is changed, left out like s0; only s4 is exported."""
    recs = {}
    for name, seed in (("recA", 3), ("recB", 4), ("recC", 5)):
        recs[name] = tmp_path / f"{name}.wav"
        soundfile.write(recs[name], make_tone(1.0, 16000, seed=seed), 16000)
        age(recs[name], 60)
    spans = [("recA", 0.0, 0.4), ("recA", 0.5, 0.9), ("recB", 0.1, 0.5), ("recC", 0.0, 0.5),
             ("recC", 0.5, 0.9)]  # fmt: skip
    rows = [
        {"path": str(recs[r]), "id": f"s{i}", "start": s, "end": e, "label": i}
        for i, (r, s, e) in enumerate(spans)
    ]
    manifest = _jsonl(tmp_path / "seg.jsonl", rows)
    bake(manifest, encoder_file, store_dir)
    soundfile.write(recs["recA"], make_tone(0.7, 16000, seed=9), 16000)
    recs["recB"].write_bytes(b"no audio here" * 100)
    _jsonl(manifest, [*rows[:3], {**rows[3], "end": 1.5}, rows[4]])

    r = _export(store_dir, tmp_path / "f.parquet")
    assert r.returncode == 0, _said(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (1, 4, 0), _said(r)
    assert "cannot be read" not in r.stderr, _said(r)
    assert pq.read_table(tmp_path / "f.parquet").column("id").to_pylist() == ["s4"]

    recs["recC"].unlink()  # a file gone is still unknown (s3, s4), not changed
    r = _export(store_dir, tmp_path / "f.parquet", "--overwrite")
    assert r.returncode == 0, _said(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (2, 3, 2), _said(r)
