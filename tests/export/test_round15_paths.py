"""Round fifteen: where relative paths were taken from (r15p.1-).

A Kaldi folder's ``wav.scp`` and a lhotse cut manifest's sources may name files relative to the
working directory (Kaldi and icefall recipes run from theirs). A build takes them from its own;
its root now records that folder (``Root.workdir``), and whatever opens the root's data again
(the export's check, a repair's re-keying, an engine's worker) takes them from there, not from
wherever it runs. Real stores built by the real code, exported through the ``featbake``
command (in-process, and as a subprocess), read back by pyarrow.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import soundfile
import torch

from featbake.store.catalog import SCHEMA_VERSION, Catalog
from featbake.store.layout import Layout
from tests.conftest import invoke, run_cli
from tests.export.test_round14_review import (
    _aged_clips,
    _export,
    _manifests,
    _report,
    _same_size_other_bytes,
)
from tests.helpers import Live, bake, printed, stored_features

pq = pytest.importorskip("pyarrow.parquet")


def _counts(r) -> tuple[int, int, int]:
    report = _report(r)
    return report["items"], report["changed"], report["unchecked"]


def _only_root(store: Path):
    with Catalog(Layout(store), read_only=True) as cat:
        (root,) = cat.roots()
    return root


def _relative_cuts(tmp_path: Path, clips: list[Path]) -> Path:
    """``fbank/cuts.jsonl.gz``: the cuts of ``_manifests`` with each source relative to
    ``tmp_path`` (the working directory), as icefall writes ``download/...`` sources in cuts
    under ``data/fbank/``."""
    _manifests(tmp_path, clips)
    with gzip.open(tmp_path / "cuts.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        for source in row["recording"]["sources"]:
            source["source"] = os.path.relpath(source["source"], tmp_path)
    (tmp_path / "fbank").mkdir()
    cuts = tmp_path / "fbank" / "cuts.jsonl.gz"
    with gzip.open(cuts, "wt") as g:
        g.write("".join(json.dumps(r) + "\n" for r in rows))
    return cuts


# == r15p.1: lhotse cuts with relative sources, exported from another directory ===================
def test_relative_cuts_exported_from_another_directory_are_checked(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cuts whose recordings' sources are relative to the working directory, built from there,
    one clip rewritten since (same size, mtime put back). Exported from another directory, the
    export took the sources from its own: every cut "cannot be read", all three exported as
    built, the rewritten one too. The root records where the build took them from; the export
    reads them there: the rewritten clip's cut is left out, the other two checked."""
    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    cuts = _relative_cuts(tmp_path, clips)
    assert not bake(cuts, encoder_file, store_dir).failed
    assert _only_root(store_dir).workdir == str(tmp_path)
    _same_size_other_bytes(clips[1])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = _export(store_dir, tmp_path / "c.parquet")
    assert r.returncode == 0 and "cannot be read" not in r.stderr, printed(r)
    assert _counts(r) == (2, 1, 0), printed(r)
    assert pq.read_table(tmp_path / "c.parquet").column("id").to_pylist() == ["c0", "c2"]


# == r15p.2: the readers take the folder as a parameter ============================================
def test_kaldi_and_cuts_opened_with_a_recorded_folder_take_paths_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One path resolution for a build and for reopening: ``inputs_at(..., workdir=)`` opens a
    Kaldi folder (``wav.scp`` + ``segments``) and relative cuts, a cut with ``transforms``
    too (lhotse's own decoding, whose recording's sources were made absolute from the working
    directory by a second ``os.path.abspath``), from another directory: every file is the
    recorded folder's. Without it (an old root), the working directory's, as before; a folder
    and a manifest of rows record none (their paths do not depend on it)."""
    from featbake.encode.inputs import inputs_at, workdir_of
    from featbake.encode.manifests import RowInputs

    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 2)
    cuts = _relative_cuts(tmp_path, clips)
    _second_cut_at_half_volume(cuts)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for data in (tmp_path / "kaldi", cuts):
        for workdir, base in ((str(tmp_path), tmp_path), ("", elsewhere)):
            inputs = inputs_at(data, workdir=workdir)
            assert isinstance(inputs, RowInputs) and workdir_of(inputs) == str(base)
            inputs.scan(())
            files = sorted({item.file for item in inputs.items.values()})
            assert files == [str(base / c.relative_to(tmp_path)) for c in clips], (data, files)
            effects = [i.effects for i in inputs.items.values() if i.effects is not None]
            for e in effects:
                (source,) = json.loads(e.recording)["sources"]
                assert source["source"] == str(base / clips[1].relative_to(tmp_path))
            assert len(effects) == (data == cuts)
    assert workdir_of(inputs_at(tmp_path / "m.csv", workdir=str(tmp_path))) == ""
    assert workdir_of(inputs_at(tmp_path / "audio")) == ""


# == r15p.3: a root recorded before the folder was kept ============================================
def _relative_kaldi(tmp_path: Path, clips: list[Path]) -> tuple[Path, list[str]]:
    """A Kaldi folder ``tmp_path/kaldi`` whose ``wav.scp`` names ``clips`` (rows ``r0``,
    ``r1``, ...) by their paths relative to ``tmp_path`` (the working directory it is built
    from), and those paths."""
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    rel = [os.path.relpath(c, tmp_path) for c in clips]
    (kaldi / "wav.scp").write_text("".join(f"r{i} {p}\n" for i, p in enumerate(rel)))
    return kaldi, rel


def _second_cut_at_half_volume(cuts: Path) -> None:
    """Give the second cut of ``cuts`` a recording ``transforms`` (lhotse's ``Volume``), which
    lhotse's own code decodes."""
    with gzip.open(cuts, "rt") as f:
        rows = [json.loads(line) for line in f]
    rows[1]["recording"]["transforms"] = [{"name": "Volume", "kwargs": {"factor": 0.5}}]
    with gzip.open(cuts, "wt") as g:
        g.write("".join(json.dumps(r) + "\n" for r in rows))


def _as_schema_3(store: Path) -> None:
    """The store as the featbake before schema 4 left it: no ``roots.workdir`` column, schema
    version 3, root manifest files without ``workdir``."""
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        conn.execute("ALTER TABLE roots DROP COLUMN workdir")
        conn.execute("UPDATE meta SET value='3' WHERE name='schema_version'")
        conn.commit()
    for manifest in (store / "roots").glob("*.json"):
        doc = json.loads(manifest.read_text())
        del doc["workdir"]
        manifest.write_text(json.dumps(doc))


def _schema_version(store: Path) -> str:
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        return str(conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()[0])


def test_a_root_without_a_recorded_folder_is_exported_as_before(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kaldi root a schema-3 store holds (no folder recorded). Read-only (a read-only mount)
    it is read as it is: stats and the export work, the catalog stays at 3 (a schema bump
    refused every read-only open, a FragmentCatalog's too, until a writer upgraded it). Where
    writable, verify migrates it to 4 (its root's folder ``""``) and finds it clean: the
    ``roots.workdir`` column is not required of a catalog (a 3 is sound, not damaged), and its
    manifest file, without the field, agrees with the row. Its data is read from the working
    directory as before: from the build's, the rewritten clip's item is left out; from
    another, every item is unchecked and exported as built, with the line that says so."""
    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    data = _manifests(tmp_path, clips)
    bake(data["kaldi"], encoder_file, store_dir)
    _as_schema_3(store_dir)
    _same_size_other_bytes(clips[1])

    monkeypatch.setenv("FEATBAKE_READ_ONLY", "1")
    assert invoke("stats", "--cache", store_dir).returncode == 0
    r = _export(store_dir, tmp_path / "k.parquet")
    assert r.returncode == 0, printed(r)
    assert _counts(r) == (2, 1, 0), printed(r)
    assert _schema_version(store_dir) == "3"
    monkeypatch.delenv("FEATBAKE_READ_ONLY")

    v = invoke("verify", "--cache", store_dir)
    assert v.returncode == 0, printed(v)
    assert _schema_version(store_dir) == str(SCHEMA_VERSION)
    assert _only_root(store_dir).workdir == ""
    r = _export(store_dir, tmp_path / "k.parquet", "--overwrite")
    assert r.returncode == 0 and _counts(r) == (2, 1, 0), printed(r)

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = _export(store_dir, tmp_path / "k.parquet", "--overwrite")
    assert r.returncode == 0, printed(r)
    assert _counts(r) == (3, 0, 3), printed(r)
    assert "cannot be read from its data" in r.stderr, printed(r)


# == r15p.4: the record survives the catalog's loss ===============================================
def test_a_catalog_rebuilt_from_root_files_keeps_the_recorded_folder(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root's manifest file carries the folder too: a catalog lost and rebuilt by
    ``verify --repair`` from the files still exports from another directory, checked."""
    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    data = _manifests(tmp_path, clips)
    bake(data["kaldi"], encoder_file, store_dir)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store_dir / 'catalog.sqlite'}{suffix}").unlink(missing_ok=True)
    v = invoke("verify", "--repair", "--cache", store_dir)
    assert "repair restored 1 roots from their manifest files" in v.stdout, printed(v)
    assert _only_root(store_dir).workdir == str(tmp_path)
    _same_size_other_bytes(clips[2])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = _export(store_dir, tmp_path / "k.parquet")
    assert r.returncode == 0 and _counts(r) == (2, 1, 0), printed(r)


# == r15p.5: `featbake build` run where the paths are, export run elsewhere =======================
def test_the_cli_build_from_the_recipe_folder_and_export_from_elsewhere(
    encoder_file: Path, tmp_path: Path
) -> None:
    """End to end, two processes: ``featbake build --data kaldi`` run in the folder its
    ``wav.scp`` is relative to (``--data`` and ``--cache`` relative too), one clip rewritten,
    ``featbake export`` run from another folder: the rewritten clip's utterance is left out,
    the others checked and exported with their texts. ``featbake roots`` shows the folder."""
    clips = _aged_clips(tmp_path, 3)
    _manifests(tmp_path, clips)
    built = run_cli("build", "-e", encoder_file, "-d", "kaldi", "--cache", "store", "--workers",
                    "0", cwd=tmp_path)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    listed = invoke("roots", "--cache", tmp_path / "store", "--json")
    assert [r["workdir"] for r in json.loads(listed.stdout)] == [str(tmp_path)], printed(listed)
    assert f"workdir  {tmp_path}" in invoke("roots", "--cache", tmp_path / "store").stdout
    _same_size_other_bytes(clips[0])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("export", "--format", "parquet", tmp_path / "k.parquet", "--cache",
                tmp_path / "store", "--json", cwd=elsewhere)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert _counts(r) == (2, 1, 0), r.stdout + r.stderr
    table = pq.read_table(tmp_path / "k.parquet").to_pylist()
    assert [(t["id"], t["text"]) for t in table] == [("s1", "words 1"), ("s2", "words 2")]


# == r17.3: `featbake build` run again from another directory ======================================
def test_a_rebuild_from_another_directory_keeps_the_root_and_its_features(
    encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``featbake build --data kaldi`` run in the folder its ``wav.scp`` is relative to, then
    again from another folder, where no path is found: each path is read where the last build
    read it. Before, every row failed ("cannot stat") and the build published a root of 0 items
    recording the other folder, so a ``gc`` then deleted every feature. Now the rebuild
    reuses all three, the root keeps its items and folder, a ``gc`` removes nothing, and a
    clip rewritten since is encoded again from the build's folder."""
    clips = _aged_clips(tmp_path, 3)
    _manifests(tmp_path, clips)
    store = tmp_path / "store"
    build = ("build", "-e", encoder_file, "-d", tmp_path / "kaldi", "--cache", store, "--json")
    monkeypatch.chdir(tmp_path)
    assert invoke(*build).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = invoke(*build)
    assert again.returncode == 0, printed(again)
    assert (_report(again)["reused"], _report(again)["failed"]) == (3, []), printed(again)
    root = _only_root(store)
    assert (root.items, root.workdir) == (3, str(tmp_path))
    gc = invoke("gc", "--cache", store, "--dry-run", "--json")
    assert gc.returncode == 0, printed(gc)
    assert json.loads(gc.stdout)["plan"]["unreached_features"] == 0, printed(gc)
    _same_size_other_bytes(clips[1])
    changed = invoke(*build)
    assert changed.returncode == 0 and _report(changed)["encoded"] == 1, printed(changed)
    assert _only_root(store).workdir == str(tmp_path)


# == r15p.6: a dataset over a Kaldi folder made from another directory =============================
def test_a_kaldi_dataset_from_another_directory_serves_features_of_the_bytes_it_names(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset takes a Kaldi folder's relative paths from the folder the build took them
    from (the root's record), where the bytes the store holds features of were read, whatever
    its own working directory holds. Built from ``tmp_path``, clip 1 rewritten since, clip 2
    deleted since; the dataset made from a folder that holds another file at clip 0's
    relative path and nothing at the others'. Row 0 is clip 0's features (since
    round twenty-six; before, the other file's, a miss encoded live), row 1 of clip 1's bytes
    now (read from the build's folder: before round seventeen, it was served as built, the
    features of its old bytes), row 2 as built (its file is gone, as a deleted file is)."""
    from featbake.serve.dataset import CachedFeatureDataset

    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    kaldi, rel = _relative_kaldi(tmp_path, clips)
    bake(kaldi, encoder_file, store_dir)
    old1, old2 = tmp_path / "old1.wav", tmp_path / "old2.wav"
    shutil.copy2(clips[1], old1)
    shutil.copy2(clips[2], old2)
    _same_size_other_bytes(clips[1])
    clips[2].unlink()
    elsewhere = tmp_path / "elsewhere"
    other = elsewhere / rel[0]
    other.parent.mkdir(parents=True)
    audio, rate = soundfile.read(old2, dtype="float32")
    soundfile.write(other, audio[::-1].copy(), rate)
    monkeypatch.chdir(elsewhere)
    ds = CachedFeatureDataset(kaldi, encoder_file, cache=store_dir)
    live = Live()
    assert [ds.item_id(i) for i in range(len(ds))] == ["r0", "r1", "r2"]
    torch.testing.assert_close(ds[0], live(encoder_file, clips[0]))
    assert ds[0].shape != live(encoder_file, other).shape
    torch.testing.assert_close(ds[1], live(encoder_file, clips[1]))
    assert not torch.allclose(ds[1], live(encoder_file, old1))
    torch.testing.assert_close(ds[2], live(encoder_file, old2))


def test_relative_cuts_served_from_another_directory_are_read_where_the_build_read_them(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training run from another directory than the build's, where no relative source is
    found: every cut is read from the build's folder. The clip rewritten since (same size,
    mtime put back) is served as its bytes are now, not as built; its write-back republishes
    the root, which still records the build's folder (every path was found there, none
    here), so an export from a third directory checks every cut against it."""
    from featbake.serve.dataset import CachedFeatureDataset

    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    cuts = _relative_cuts(tmp_path, clips)
    assert not bake(cuts, encoder_file, store_dir).failed
    old = tmp_path / "old1.wav"
    shutil.copy2(clips[1], old)
    _same_size_other_bytes(clips[1])
    for name in ("train", "third"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "train")
    ds = CachedFeatureDataset(cuts, encoder_file, cache=store_dir)
    live = Live()
    for i, clip in enumerate(clips):  # each cut: the clip's first 0.2 s
        torch.testing.assert_close(ds[i], live(encoder_file, _first_fifth(clip, tmp_path)))
    assert ds[1].shape == live(encoder_file, _first_fifth(old, tmp_path)).shape
    assert not torch.allclose(ds[1], live(encoder_file, _first_fifth(old, tmp_path)))
    del ds
    assert _only_root(store_dir).workdir == str(tmp_path)
    monkeypatch.chdir(tmp_path / "third")
    r = _export(store_dir, tmp_path / "c.parquet")
    assert r.returncode == 0 and "cannot be read" not in r.stderr, printed(r)
    assert _counts(r) == (3, 0, 0), printed(r)


def _first_fifth(clip: Path, tmp_path: Path) -> Path:
    """A file of ``clip``'s first 0.2 s (a cut's span of it), to encode live."""
    audio, rate = soundfile.read(clip, dtype="float32")
    out = tmp_path / "spans" / f"{clip.parent.name}-{clip.name}"
    out.parent.mkdir(exist_ok=True)
    soundfile.write(out, audio[: round(0.2 * rate)], rate, subtype="FLOAT")
    return out


def test_a_finder_given_the_builds_folder_says_where_each_path_was_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ToolPaths(fallback=)``: a relative path found from its folder is taken from there, one
    found only in the fallback folder from there, one found in neither names the first
    folder's (the row then fails to read, as before); an absolute path is kept. A cut
    manifest rebuilt from elsewhere with ``build_workdir`` takes its relative paths from the
    build's folder first (the files built, not a copy of one of them here), and records this
    directory only where every relative path it found came from here alone."""
    from featbake.encode.inputs import falling_back_to, inputs_at, workdir_of
    from featbake.encode.manifests import ToolPaths

    build, here = tmp_path / "build", tmp_path / "here"
    for folder, names in ((build, ("a.wav", "b.wav")), (here, ("a.wav",))):
        folder.mkdir()
        for n in names:
            (folder / n).write_bytes(b"x")
    finder = ToolPaths(str(tmp_path / "cuts.jsonl"), str(here), fallback=str(build))
    assert finder.file("a.wav") == str(here / "a.wav")
    assert finder.file("b.wav") == str(build / "b.wav")
    assert finder.file("c.wav") == str(here / "c.wav")
    assert finder.file(str(build / "a.wav")) == str(build / "a.wav")
    assert finder.folder_of(str(build / "b.wav")) == str(build)
    assert finder.folder_of(str(here / "a.wav")) == str(here)
    assert ToolPaths("m", str(here), fallback=str(here)).fallback == ""

    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 2)
    cuts = _relative_cuts(tmp_path, clips)
    _second_cut_at_half_volume(cuts)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    inputs = inputs_at(cuts)
    falling_back_to(inputs, str(tmp_path))
    inputs.scan(())
    assert workdir_of(inputs) == str(tmp_path)
    assert sorted(i.file for i in inputs.items.values()) == [str(c) for c in clips]
    (effects,) = [i.effects for i in inputs.items.values() if i.effects is not None]
    assert json.loads(effects.recording)["sources"][0]["source"] == str(clips[1])
    (tmp_path / "elsewhere" / clips[0].relative_to(tmp_path)).parent.mkdir(parents=True)
    shutil.copy2(clips[0], tmp_path / "elsewhere" / clips[0].relative_to(tmp_path))
    inputs.scan(())  # the build's clips first: the copy here is not read
    assert workdir_of(inputs) == str(tmp_path)
    assert sorted(i.file for i in inputs.items.values()) == [str(c) for c in clips]
    for c in clips:  # each copied here and gone from the build's folder: all found here
        target = tmp_path / "elsewhere" / c.relative_to(tmp_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(c, target)
        c.unlink()
    inputs.scan(())
    assert workdir_of(inputs) == str(tmp_path / "elsewhere")
    recorded = inputs_at(cuts, workdir=str(tmp_path / "other"))
    falling_back_to(recorded, str(tmp_path))  # opened with a recorded folder: no fallback
    assert recorded.build_workdir == ""


# == r15p.7: an engine's worker, whose working directory is not the driver's ======================
def test_an_engines_worker_opens_a_kaldi_folder_from_the_drivers_folder(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build through an engine sends its worker the root (``EngineJob.root``) with the
    folder the driver took the relative paths from; the worker, run from another directory
    (a node's own), opens the data with it rather than its own, and encodes the rows as the
    driver keyed them."""
    from featbake.bake.pipeline import PartEncoder, build
    from tests.bake.test_engines import InProcess

    opened: list[str] = []

    class Elsewhere(InProcess):
        def encode(self, job, items, progress):
            with monkeypatch.context() as m:
                m.chdir(tmp_path / "elsewhere")
                worker = PartEncoder(job)
                opened.append(worker.bake.place.workdir)
                self.items += items
                return worker.encode(items)

    monkeypatch.chdir(tmp_path)
    clips = _aged_clips(tmp_path, 3)
    kaldi, _ = _relative_kaldi(tmp_path, clips)
    (tmp_path / "elsewhere").mkdir()
    engine = Elsewhere()
    report = build(kaldi, encoder_file, cache=store_dir, engine=engine)  # type: ignore[arg-type]
    assert (report.failed, report.encoded) == ([], 3), report.failed
    assert opened == [str(tmp_path)]
    assert _only_root(store_dir).workdir == str(tmp_path)
    live = Live()
    got = stored_features(store_dir, report.root)
    for i, clip in enumerate(clips):
        torch.testing.assert_close(got[f"r{i}"][""], live(encoder_file, clip))
