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
from tests.encode.test_manifests import write_jsonl
from tests.helpers import Live, age, bake, printed

pq = pytest.importorskip("pyarrow.parquet")


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
    bake(write_jsonl(tmp_path / "m.jsonl", rows), encoder_file, store_dir, column="noisy")
    for extra in ((), ("--column", "path"), ("--column", "noisy")):
        r = _export(store_dir, tmp_path / "f.parquet", "--strict-rows", "--overwrite", *extra)
        assert r.returncode == 0 and "its data" not in r.stderr, (extra, printed(r))
        report = _report(r)
        assert (report["items"], report["changed"], report["unchecked"]) == (3, 0, 0), report
        got = {rec["id"]: rec["label"] for rec in pq.read_table(tmp_path / "f.parquet").to_pylist()}
        assert got == {"u0": 0, "u1": 1, "u2": 2}, (extra, got)

    _same_size_other_bytes(noisy[1])
    _same_size_other_bytes(clips[2])  # not the column built from: no change to its item
    r = _export(store_dir, tmp_path / "f.parquet", "--overwrite")
    assert r.returncode == 0, printed(r)
    assert (_report(r)["items"], _report(r)["changed"]) == (2, 1), printed(r)
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
    manifest = write_jsonl(tmp_path / "seg.jsonl", rows)
    bake(manifest, encoder_file, store_dir)
    soundfile.write(recs["recA"], make_tone(0.7, 16000, seed=9), 16000)
    recs["recB"].write_bytes(b"no audio here" * 100)
    write_jsonl(manifest, [*rows[:3], {**rows[3], "end": 1.5}, rows[4]])

    r = _export(store_dir, tmp_path / "f.parquet")
    assert r.returncode == 0, printed(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (1, 4, 0), printed(r)
    assert "cannot be read" not in r.stderr, printed(r)
    assert pq.read_table(tmp_path / "f.parquet").column("id").to_pylist() == ["s4"]

    recs["recC"].unlink()  # a file gone is still unknown (s3, s4), not changed
    r = _export(store_dir, tmp_path / "f.parquet", "--overwrite")
    assert r.returncode == 0, printed(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (2, 3, 2), printed(r)


def _manifests(tmp_path: Path, clips: list[Path]) -> dict[str, Path]:
    """The clips as a CSV (paths relative to it), a Kaldi folder (relative ``wav.scp``
    paths, one 0.2 s segment each), lhotse cuts (absolute) and a parquet table of their bytes
    with labels; the working directory is ``tmp_path``."""
    with open(tmp_path / "m.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "id", "label"])
        w.writerows([os.path.relpath(c, tmp_path), f"u{i}", i] for i, c in enumerate(clips))
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    rel = [os.path.relpath(c, tmp_path) for c in clips]
    (kaldi / "wav.scp").write_text("".join(f"r{i} {p}\n" for i, p in enumerate(rel)))
    (kaldi / "segments").write_text("".join(f"s{i} r{i} 0.0 0.2\n" for i in range(len(clips))))
    (kaldi / "text").write_text("".join(f"s{i} words {i}\n" for i in range(len(clips))))
    cuts = []
    for i, c in enumerate(clips):
        info = soundfile.info(str(c))
        source = {"type": "file", "channels": [0], "source": str(c)}
        recording = {
            "id": f"r{i}",
            "sources": [source],
            "sampling_rate": info.samplerate,
            "num_samples": info.frames,
            "duration": info.frames / info.samplerate,
        }
        sup = {"id": f"c{i}", "recording_id": f"r{i}", "start": 0.0, "duration": 0.2,
               "text": f"t{i}"}  # fmt: skip
        cuts.append(
            {
                "id": f"c{i}",
                "start": 0.0,
                "duration": 0.2,
                "channel": 0,
                "supervisions": [sup],
                "recording": recording,
                "type": "MonoCut",
            }
        )
    with gzip.open(tmp_path / "cuts.jsonl.gz", "wt") as g:
        g.write("".join(json.dumps(c) + "\n" for c in cuts))
    import pyarrow as pa

    cells = [{"bytes": c.read_bytes(), "path": c.name} for c in clips]
    pq.write_table(pa.table({"audio": cells, "label": list(range(len(clips)))}),
                   tmp_path / "t.parquet")  # fmt: skip
    age(tmp_path / "t.parquet", 60)
    return {"csv": tmp_path / "m.csv", "kaldi": kaldi, "cuts": tmp_path / "cuts.jsonl.gz",
            "table": tmp_path / "t.parquet"}  # fmt: skip


# == r14.r3: every kind of manifest keys to its stored keys, and a change is caught ===============
def test_csv_kaldi_cuts_and_tables_key_as_built_and_catch_a_change(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CSV, a Kaldi folder, lhotse cuts and a parquet table of audio cells over the same
    clips, each built (the table with ``--column audio``) and exported with --strict-rows:
    every item exported, no line. Then one clip is rewritten (same size, mtime put back) and
    the table rewritten with another clip's bytes in row 1: each export leaves that one item
    out."""
    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    data = _manifests(tmp_path, clips)
    for name, where in data.items():
        column = "audio" if name == "table" else None
        assert not bake(where, encoder_file, store_dir / name, column=column).failed
        r = _export(store_dir / name, tmp_path / f"{name}.parquet", "--strict-rows")
        assert r.returncode == 0 and "its data" not in r.stderr, (name, printed(r))
        assert (_report(r)["items"], _report(r)["changed"]) == (3, 0), (name, printed(r))

    _same_size_other_bytes(clips[1])
    import pyarrow as pa

    cells = [{"bytes": c.read_bytes(), "path": c.name} for c in (clips[0], clips[2], clips[2])]
    pq.write_table(pa.table({"audio": cells, "label": [0, 1, 2]}), data["table"])
    for name in data:
        r = _export(store_dir / name, tmp_path / f"{name}.parquet", "--overwrite")
        assert r.returncode == 0, (name, printed(r))
        report = _report(r)
        assert (report["items"], report["changed"], report["unchecked"]) == (2, 1, 0), (name, r)


# == r14.r4: a Kaldi folder exported from another working directory ================================
def test_a_kaldi_root_exported_from_another_directory_is_checked(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kaldi folder whose ``wav.scp`` names files relative to the working directory (as
    Kaldi and icefall recipes run), built from there, one clip rewritten since; exported from
    another directory. The root did not record that directory, so the export took the paths
    from its own: every item "cannot be read" and was exported as built, the rewritten clip's
    too. The build now records it (``Root.workdir``) and the export reads the data from there:
    the rewritten clip's item is left out and the rest checked."""
    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    data = _manifests(tmp_path, clips)
    bake(data["kaldi"], encoder_file, store_dir)
    _same_size_other_bytes(clips[1])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = _export(store_dir, tmp_path / "k.parquet")
    assert r.returncode == 0, printed(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (2, 1, 0), printed(r)


# == r14.r5: data that cannot be opened at all =====================================================
def test_data_that_cannot_be_opened_counts_every_item_unchecked(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The manifest moved away after the build, and a clip rewritten: nothing can be checked.
    The export went on (as it should: a store outlives its raw data) but its report said
    ``"unchecked": 0`` and no line said the items were unchecked, only that the rows' columns
    were left out: a script that trusts ``unchecked == 0`` took the rewritten clip's old
    features for checked ones. Now every exported item is counted unchecked, with the line
    that says so."""
    clips = _aged_clips(tmp_path, 3)
    rows = [{"path": str(c), "id": f"u{i}", "label": i} for i, c in enumerate(clips)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    bake(manifest, encoder_file, store_dir)
    _same_size_other_bytes(clips[0])
    manifest.rename(tmp_path / "moved.jsonl")
    r = _export(store_dir, tmp_path / "f.parquet")
    assert r.returncode == 0 and "rows' columns are left out" in r.stderr, printed(r)
    report = _report(r)
    assert (report["items"], report["changed"], report["unchecked"]) == (3, 0, 3), printed(r)
    unread = [line for line in r.stderr.splitlines() if "cannot be read from its data" in line]
    assert len(unread) == 1 and unread[0].startswith("3 of 3 items"), printed(r)
    assert "exported as built" in unread[0], unread[0]


# == r14.r6: each row read once ====================================================================
def test_each_items_row_is_read_once(encoder_file: Path, store_dir: Path, tmp_path: Path) -> None:
    """Tar shards whose samples carry ``.json`` rows: a row is a member read from its tar.
    The export read every item's row twice (once for its columns, once more to ask whether
    the data lists it before keying its input): twice the member reads of a large shard set.
    The real reader of the root's data (the CLI's), counted: one read per item."""
    import tarfile

    from featbake.cli.upkeep import _root_rows
    from featbake.export.parquet import export_parquet
    from featbake.export.source import RootData

    clips = _aged_clips(tmp_path, 4)
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tf:
        for i, clip in enumerate(clips):
            tf.add(clip, f"c{i}.wav")
            row = tmp_path / f"c{i}.json"
            row.write_text(json.dumps({"label": i}))
            tf.add(row, f"c{i}.json")
    age(shards / "shard-000000.tar", 60)
    bake(shards, encoder_file, store_dir)
    reads: list[str] = []

    def counted(root):
        data = _root_rows(None)(root)

        def row(path: str):
            reads.append(path)
            return data.row(path)

        return RootData(row, data.digests)

    report = export_parquet(tmp_path / "f.parquet", cache=store_dir, rows_for=counted)
    assert (report.items, report.changed, report.unchecked) == (4, 0, 0), report
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 4, reads


# == r14.r7: several roots over the same data in one store =========================================
def test_roots_over_the_same_data_are_each_checked_by_their_own_reading(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """One JSONL built twice into one store, by its ``path`` column and by ``--column noisy``:
    two roots. Each exported with ``--root`` (and a --column that is the other root's) keys
    its own column's files: no word under --strict-rows; a noisy file rewritten since changes
    the noisy root's item alone."""
    clips = _aged_clips(tmp_path, 2)
    noisy = _aged_clips(tmp_path, 2, "noisy", seed=5)
    rows = [
        {"path": str(c), "noisy": str(n), "id": f"u{i}", "label": i}
        for i, (c, n) in enumerate(zip(clips, noisy, strict=True))
    ]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    clean = bake(manifest, encoder_file, store_dir).root
    dirty = bake(manifest, encoder_file, store_dir, column="noisy").root
    assert clean != dirty
    for root, column in ((clean, "noisy"), (dirty, "path"), (clean, None), (dirty, None)):
        extra = ("--column", column) if column else ()
        r = _export(store_dir, tmp_path / "f.parquet", "--root", root, "--strict-rows",
                    "--overwrite", *extra)  # fmt: skip
        assert r.returncode == 0 and "its data" not in r.stderr, (root, column, printed(r))
    _same_size_other_bytes(noisy[0])
    for root, changed in ((clean, 0), (dirty, 1)):
        r = _export(store_dir, tmp_path / "f.parquet", "--root", root, "--overwrite")
        assert r.returncode == 0 and _report(r)["changed"] == changed, (root, printed(r))


def test_an_image_root_and_its_flipped_view_key_as_built(tmp_path: Path) -> None:
    """An image folder built with ``--views hflip`` (two roots, one recipe each, the same
    digests): each exported with --root and --strict-rows, every item; an image rewritten
    since is left out of both."""
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    from featbake.testing import write_image_folder

    images = tmp_path / "images"
    write_image_folder(images, 3, size=(37, 53), seed=3)
    for image in images.rglob("*.*"):
        age(image, 60)
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64,
                                           image_size=32, patch_size=8)  # fmt: skip
    folder = tmp_path / "clip"
    transformers.CLIPVisionModel(config).eval().save_pretrained(folder)
    proc = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    proc(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    store = tmp_path / "s"
    r = invoke("build", "-e", folder, "-d", images, "--cache", store, "--views", "hflip", "--json")
    assert r.returncode == 0, printed(r)
    roots = [rep["root"] for rep in json.loads(r.stdout)]
    for root in roots:
        r = _export(store, tmp_path / "f.parquet", "--root", root, "--strict-rows", "--overwrite")
        assert r.returncode == 0 and _report(r)["items"] == 3, (root, printed(r))
    first = sorted(p for p in images.rglob("*.*"))[0]
    st = first.stat()
    Image.new("RGB", (37, 53), (200, 10, 10)).save(first, format=Image.open(first).format)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    for root in roots:
        r = _export(store, tmp_path / "f.parquet", "--root", root, "--overwrite")
        assert r.returncode == 0 and _report(r)["changed"] == 1, (root, printed(r))


# == r14.r8: a symlinked data folder, relative paths, another working directory ====================
def test_relative_rows_through_a_symlink_key_as_built_from_any_directory(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSONL with paths relative to its folder, reached through a symlinked data folder
    (``data -> corpus-v1``), built from one working directory and exported from another: no
    word under --strict-rows (each row's file resolved from the manifest's folder, as the build
    resolved it); a clip rewritten since is left out."""
    v1 = tmp_path / "corpus-v1"
    clips = _aged_clips(v1, 2)
    rows = [
        {"path": os.path.relpath(c, v1), "id": f"u{i}", "label": i} for i, c in enumerate(clips)
    ]
    write_jsonl(v1 / "m.jsonl", rows)
    (tmp_path / "data").symlink_to(v1)
    monkeypatch.chdir(v1 / "audio")
    bake(Path("../../data/m.jsonl"), encoder_file, store_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = _export(store_dir, tmp_path / "f.parquet", "--strict-rows")
    assert r.returncode == 0 and "its data" not in r.stderr, printed(r)
    assert (_report(r)["items"], _report(r)["unchecked"]) == (2, 0), printed(r)
    _same_size_other_bytes(clips[1])
    r = _export(store_dir, tmp_path / "f.parquet", "--overwrite")
    assert r.returncode == 0 and _report(r)["changed"] == 1, printed(r)


# == r14.r9: a table built by its second audio column ==============================================
def test_a_table_built_by_its_second_audio_column_is_checked_by_it(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A parquet table with two audio columns (``clean``, ``noisy``) built with ``--column
    noisy``, exported without --column: the table's default (its first audio column) is
    not the build's, and every item was "changed": nothing exported, exit 2, over a table
    that had not changed. The root's name tells the column (a cell's column is a candidate
    whatever its values hold)."""
    import pyarrow as pa

    clips = _aged_clips(tmp_path, 2)
    noisy = _aged_clips(tmp_path, 2, "noisy", seed=5)
    table = pa.table({
        "clean": [{"bytes": c.read_bytes(), "path": c.name} for c in clips],
        "noisy": [{"bytes": c.read_bytes(), "path": c.name} for c in noisy],
        "label": [0, 1],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    age(tmp_path / "t.parquet", 60)
    assert not bake(tmp_path / "t.parquet", encoder_file, store_dir, column="noisy").failed
    r = _export(store_dir, tmp_path / "f.parquet", "--strict-rows")
    assert r.returncode == 0 and "its data" not in r.stderr, printed(r)
    assert (_report(r)["items"], _report(r)["changed"]) == (2, 0), printed(r)
