"""Round twenty-six: Kaldi folders and lhotse cuts read as built (r26).

A dataset over a Kaldi folder (relative ``wav.scp``) or a cut manifest (relative sources) takes
its relative paths from the folder its root's build took them from (``Root.workdir``) alone, as
a local table's path-only cells are (r25.3), never from its own working directory where one is
recorded: run from a directory holding other clips of the same relative names, it serves the
clips built, publishes the root with their keys and the build's folder, and ``gc`` keeps their
features. Real stores built by the real code; features compared with the encoder run now on
each clip decoded by soundfile; ``featbake gc`` run as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from tests.conftest import run_cli
from tests.encode.test_tables_audio_paths import only_path, write_clip, write_path_parquet
from tests.export.test_round14_review import _aged_clips
from tests.export.test_round15_paths import _relative_cuts, _relative_kaldi
from tests.helpers import bake, printed

pq = pytest.importorskip("pyarrow.parquet")

#: The span each cut of ``_relative_cuts`` takes of its clip (its first 0.2 s); a Kaldi
#: folder's rows are whole files.
CUT_SECONDS = 0.2


def encoded_now(encoder: Path, clip: Path, seconds: float | None) -> torch.Tensor:
    """The encoder loaded afresh and run now on ``clip`` decoded by soundfile (its first
    ``seconds``; None: all of it): what a dataset must serve for it."""
    audio, rate = soundfile.read(clip, dtype="float32")
    assert rate == 16000 and audio.ndim == 1
    if seconds is not None:
        audio = audio[: round(seconds * rate)]
    module = torch.jit.load(str(encoder))
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(audio)).unsqueeze(0))[0]


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two feature tensors are not the same features (shape or values)."""
    return a.shape != b.shape or not torch.allclose(a, b)


def root_items(store: Path) -> tuple[str, dict[str, str]]:
    """The store's one root's recorded working directory and items (name -> key)."""
    cat = Catalog(Layout(store), read_only=True)
    try:
        (root,) = cat.roots()
        return root.workdir, dict(cat.root_items(root.name))
    finally:
        cat.close()


def other_clips_of_the_same_names(project: Path, job: Path, clips: list[Path]) -> list[Path]:
    """In ``job``, another real clip at each of ``clips``' paths relative to ``project`` (each
    clip reversed, at twice its length: other bytes, other features)."""
    out = []
    for clip in clips:
        other = job / clip.relative_to(project)
        other.parent.mkdir(parents=True, exist_ok=True)
        audio, rate = soundfile.read(clip, dtype="float32")
        soundfile.write(other, np.concatenate([audio[::-1], audio]), rate)
        out.append(other)
    return out


@pytest.mark.parametrize("kind", ["kaldi", "cuts"])
def test_a_dataset_run_elsewhere_reads_the_clips_built_not_others_of_the_same_names(
    kind: str, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from the project (a Kaldi folder of whole files, relative ``wav.scp``; relative
    cuts of 0.2 s), clip 2 deleted since. A dataset made from ``job/``, which holds other clips
    at every relative path, serves the project's clips (clip 2 as built: gone from the
    recorded folder, not read from ``job/``), publishes the root with the build's keys and
    folder, `gc --grace 0s` (a subprocess) frees nothing, and a dataset from the project hits
    every item. Before, ``job/``'s clips were read: the dataset served their features,
    published the root with their keys recording ``job/``, and `gc` freed the build's."""
    project, job = tmp_path / "project", tmp_path / "job"
    project.mkdir()
    monkeypatch.chdir(project)
    clips = _aged_clips(project, 3)
    data = _relative_kaldi(project, clips)[0] if kind == "kaldi" else _relative_cuts(project, clips)
    seconds = None if kind == "kaldi" else CUT_SECONDS
    store = tmp_path / "store"
    report = bake(data, encoder_file, store)
    assert (report.failed, report.encoded) == ([], 3), report.failed
    built = root_items(store)
    assert built[0] == str(project)
    want = [encoded_now(encoder_file, clip, seconds) for clip in clips]
    others = other_clips_of_the_same_names(project, job, clips)
    clips[2].unlink()

    monkeypatch.chdir(job)
    ds = CachedFeatureDataset(data, encoder_file, cache=store)
    assert len(ds) == 3
    for i, other in enumerate(others):
        torch.testing.assert_close(ds[i], want[i])
        assert differs(ds[i], encoded_now(encoder_file, other, seconds)), i
    del ds
    assert root_items(store) == built
    gc = run_cli("gc", "--cache", store, "--grace", "0s")
    assert gc.returncode == 0, printed(gc)

    monkeypatch.chdir(project)
    again = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    for i in range(3):
        torch.testing.assert_close(again[i], want[i])
    assert root_items(store) == built


def test_a_dataset_without_a_recorded_folder_takes_paths_from_its_own(
    encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no folder is recorded (a root written before roots recorded one, or by a build
    of an older featbake), a dataset takes a Kaldi folder's relative paths from its working
    directory, as Kaldi does: from ``job/``, its clips' features, encoded live."""
    from featbake.encode.inputs import inputs_at, read_as_built, workdir_of

    project, job = tmp_path / "project", tmp_path / "job"
    project.mkdir()
    monkeypatch.chdir(project)
    clips = _aged_clips(project, 2)
    kaldi, _ = _relative_kaldi(project, clips)
    others = other_clips_of_the_same_names(project, job, clips)
    monkeypatch.chdir(job)
    for recorded, files in (("", others), (str(project), clips)):
        inputs = inputs_at(kaldi)
        if recorded:
            read_as_built(inputs, recorded)
        inputs.scan(())
        assert [item.file for item in inputs.items.values()] == [str(f) for f in files]
        assert workdir_of(inputs) == str(recorded or job)
    shutil.rmtree(project / "audio")  # gone from the recorded folder: the record stays
    inputs = inputs_at(kaldi)
    read_as_built(inputs, str(project))
    inputs.scan(())
    assert [item.file for item in inputs.items.values()] == [str(c) for c in clips]
    assert workdir_of(inputs) == str(project)
    assert not any(os.path.exists(c) for c in clips)


# == the export's check of a row changed to name a gone file =======================================
def exported(store: Path, out: Path, *extra: str):
    """``featbake export --format parquet`` run as a subprocess, and its table (None where it
    failed)."""
    r = run_cli("export", "--format", "parquet", out, "--cache", store, "--json", *extra)
    return r, (pq.read_table(out) if r.returncode == 0 else None)


def exported_rows(table) -> dict[str, torch.Tensor]:
    """Each exported item's id -> its features (a parquet export's ragged ``[T, 64]`` rows)."""
    ids = table.column("id").to_pylist()
    feats = table.column("features").to_pylist()
    return {i: torch.tensor(np.array(f, dtype=np.float32)) for i, f in zip(ids, feats, strict=True)}


def test_an_export_leaves_out_a_manifest_row_changed_to_name_a_gone_file(
    encoder_file: Path, tmp_path: Path
) -> None:
    """A JSONL built u1 -> x.wav, u2 -> y.wav, u3 -> z.wav; written again u1 -> y.wav,
    u2 -> x.wav; x.wav deleted. `featbake export` exported y.wav's features as u2's, counted
    ``unchecked``, where a dataset leaves u2 out in one warning (r17.4). Now the gone file is
    checked against the hash cache's last row of it, as the dataset checks it: u2 is left out,
    counted ``changed`` with u1 (its file now y.wav, its features x.wav's); u3 is exported,
    z.wav's features. Before the edit, x.wav deleted, u1 is exported as built
    (``unchecked``)."""
    x, y = write_clip(tmp_path / "x.wav", 1), write_clip(tmp_path / "y.wav", 2, 0.6)
    z = write_clip(tmp_path / "z.wav", 3, 0.5)
    manifest = tmp_path / "train.jsonl"
    rows = [{"id": "u1", "path": "x.wav"}, {"id": "u2", "path": "y.wav"}]
    rows.append({"id": "u3", "path": "z.wav"})
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    assert not bake(manifest, encoder_file, store).failed
    want = {u: encoded_now(encoder_file, f, None) for u, f in (("u1", x), ("u2", y), ("u3", z))}
    x.unlink()
    r, table = exported(store, tmp_path / "deleted.parquet")  # rows unchanged: as built
    assert r.returncode == 0 and table is not None, printed(r)
    assert counts(r) == (3, 0, 1), printed(r)
    got = exported_rows(table)
    for u in want:
        torch.testing.assert_close(got[u], want[u])

    rows[:2] = [{"id": "u1", "path": "y.wav"}, {"id": "u2", "path": "x.wav"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r, table = exported(store, tmp_path / "swapped.parquet")
    assert r.returncode == 0 and table is not None, printed(r)
    assert list(exported_rows(table)) == ["u3"], printed(r)
    torch.testing.assert_close(exported_rows(table)["u3"], want["u3"])
    assert counts(r) == (1, 2, 0), printed(r)
    with pytest.warns(UserWarning, match=r"1 row\(s\).*of another file"):
        ds = CachedFeatureDataset(manifest, encoder_file, cache=store)
    assert [ds.item_id(i) for i in range(len(ds))] == ["u1", "u3"]
    torch.testing.assert_close(ds[0], want["u2"])  # u1 names y.wav now


def counts(r) -> tuple[int, int, int]:
    """An export's (items, changed, unchecked), from its ``--json`` report."""
    report = json.loads(r.stdout[r.stdout.index("{") :])
    return report["items"], report["changed"], report["unchecked"]


def test_an_export_leaves_out_a_table_row_changed_to_name_a_gone_clip(
    encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a local table of path-only cells (relative, beside the table): rows 0, 1,
    2 built naming x.wav, y.wav, z.wav; the table written again with rows 0 and 1 the other
    way round; x.wav deleted. `featbake export` exported row 1 as built, y.wav's features,
    ``unchecked``; a dataset keeps it back (r25.3). Now it is left out, ``changed``, as row 0
    is (its clip now y.wav); row 2 is exported, z.wav's features."""
    monkeypatch.chdir(tmp_path)
    x, y = write_clip(tmp_path / "x.wav", 1), write_clip(tmp_path / "y.wav", 2, 0.6)
    z = write_clip(tmp_path / "z.wav", 3, 0.5)
    table = write_path_parquet(tmp_path / "train.parquet", [only_path(c.name) for c in (x, y, z)])
    store = tmp_path / "store"
    assert not bake(table, encoder_file, store, column="audio").failed
    want = [encoded_now(encoder_file, c, None) for c in (x, y, z)]
    write_path_parquet(table, [only_path(c.name) for c in (y, x, z)])
    x.unlink()
    r, out = exported(store, tmp_path / "swapped.parquet")
    assert r.returncode == 0 and out is not None, printed(r)
    assert list(exported_rows(out)) == ["train.parquet:2"], printed(r)
    torch.testing.assert_close(exported_rows(out)["train.parquet:2"], want[2])
    assert counts(r) == (1, 2, 0), printed(r)
    with pytest.warns(UserWarning, match=r"1 row\(s\).*train.parquet:1 names 'x.wav'"):
        ds = CachedFeatureDataset(table, encoder_file, cache=store, column="audio")
    assert [ds.item_id(i) for i in range(len(ds))] == ["train.parquet:0", "train.parquet:2"]
    torch.testing.assert_close(ds[0], want[1])  # row 0 names y.wav now


def rerecorded(clip: Path) -> None:
    """``clip`` written again as another take (reversed: other bytes, other features)."""
    audio, rate = soundfile.read(clip, dtype="float32")
    soundfile.write(clip, np.ascontiguousarray(audio[::-1]), rate)


def test_a_dataset_whose_recorded_folder_is_gone_reads_its_own_and_says_so(
    encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kaldi folder kept outside the job folders, built from ``job1/``; ``job1/`` removed
    since, ``job2/`` holding the same clips with one re-recorded and one more row. A dataset
    from ``job2/`` reads them there (the re-recorded one encoded live, the new row an item)
    after one warning naming the gone folder and what to do, and its root records ``job2/``.
    Before, every row was taken as gone (served its stored features, the re-recorded one its
    old take's) and the new row was left out."""
    job1, job2 = tmp_path / "job1", tmp_path / "job2"
    job1.mkdir()
    monkeypatch.chdir(job1)
    clips = _aged_clips(job1, 3)
    kaldi, rel = _relative_kaldi(job1, clips)
    moved = tmp_path / "corpus" / "kaldi"
    shutil.copytree(kaldi, moved)
    report = bake(moved, encoder_file, tmp_path / "store")
    assert (report.failed, report.encoded) == ([], 3), report.failed
    shutil.copytree(job1, job2, ignore=shutil.ignore_patterns("kaldi"), copy_function=shutil.copy2)
    shutil.rmtree(job1)
    rerecorded(job2 / rel[1])
    extra = write_clip(job2 / "extra.wav", 5)
    with (moved / "wav.scp").open("a") as f:
        f.write(f"r3 {extra.name}\n")
    monkeypatch.chdir(job2)
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(moved, encoder_file, cache=tmp_path / "store")
    lines = [str(w.message) for w in told if "no folder now" in str(w.message)]
    assert len(lines) == 1 and str(job1) in lines[0] and "featbake build" in lines[0], lines
    assert [ds.item_id(i) for i in range(len(ds))] == ["r0", "r1", "r2", "r3"]
    for i, name in enumerate([*rel, extra.name]):
        torch.testing.assert_close(ds[i], encoded_now(encoder_file, job2 / name, None))
    del ds
    assert root_items(tmp_path / "store")[0] == str(job2)


def test_a_rebuild_from_elsewhere_reads_the_built_clips_first_and_keeps_their_folder(
    encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from ``project/``; ``job/`` holds another take of clip 0 only, and the build runs
    again from ``job/``: it reads the project's clips (0 encoded) and the root still records
    ``project/``. Clip 1 re-recorded in the project since: a dataset from the project serves
    its new take. Before, the rebuild read ``job/``'s clip 0 and recorded ``job/``, so the
    dataset read ``job/`` alone and served clip 1's old take as built."""
    project, job = tmp_path / "project", tmp_path / "job"
    project.mkdir()
    monkeypatch.chdir(project)
    clips = _aged_clips(project, 3)
    kaldi, rel = _relative_kaldi(project, clips)
    store = tmp_path / "store"
    assert bake(kaldi, encoder_file, store).encoded == 3
    other_clips_of_the_same_names(project, job, clips[:1])
    monkeypatch.chdir(job)
    again = bake(kaldi, encoder_file, store)
    assert (again.failed, again.encoded) == ([], 0), again.failed
    assert root_items(store)[0] == str(project)
    rerecorded(project / rel[1])
    monkeypatch.chdir(project)
    ds = CachedFeatureDataset(kaldi, encoder_file, cache=store)
    for i, name in enumerate(rel):
        torch.testing.assert_close(ds[i], encoded_now(encoder_file, project / name, None))


def test_an_export_leaves_out_a_row_edited_to_name_a_file_never_hashed(
    encoder_file: Path, tmp_path: Path
) -> None:
    """A JSONL built u1 -> x.wav, u2 -> y.wav; u2 then edited to name ``new_take.wav``, never
    copied (so never hashed). A dataset leaves u2 out (the manifest changed since the build:
    its stored features may be another file's); `featbake export` now leaves it out too,
    counted ``changed``. Before, it exported y.wav's features as u2's, ``unchecked``."""
    from featbake.store.roots import root_file

    x, y = write_clip(tmp_path / "x.wav", 1), write_clip(tmp_path / "y.wav", 2, 0.6)
    manifest = tmp_path / "train.jsonl"
    rows = [{"id": "u1", "path": "x.wav"}, {"id": "u2", "path": "y.wav"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    report = bake(manifest, encoder_file, store)
    assert not report.failed
    rows[1] = {"id": "u2", "path": "new_take.wav"}
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    when = manifest.stat().st_mtime - 60  # the root published a minute before the edit
    os.utime(root_file(Layout(store), report.root), (when, when))
    r, table = exported(store, tmp_path / "edited.parquet")
    assert r.returncode == 0 and table is not None, printed(r)
    assert list(exported_rows(table)) == ["u1"], printed(r)
    torch.testing.assert_close(exported_rows(table)["u1"], encoded_now(encoder_file, x, None))
    assert counts(r) == (1, 1, 0), printed(r)
    with pytest.warns(UserWarning, match="never hashed here"):
        ds = CachedFeatureDataset(manifest, encoder_file, cache=store)
    assert [ds.item_id(i) for i in range(len(ds))] == ["u1"]
    assert y.exists()
