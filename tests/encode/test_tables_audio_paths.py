"""Tables whose Audio cells hold a path and no bytes: what ``Dataset.to_parquet`` writes for a
dataset made from local audio files (``{"bytes": null, "path": "clips/a.wav"}``), which
``datasets`` decodes by opening the file at the path (a relative one from the working
directory: ``Audio.decode_example``).

Each such cell is read from its file (a relative path from the working directory, else from
the table file's folder), keyed by the SHA-256 of that file's bytes, and every stored or served
feature is checked against the encoder run now on the file decoded by soundfile (featbake's code
not used). A path that names no file, and a cell with neither bytes nor a path, are bad rows
naming the row (and the path). Before, every path-only row failed ("the cell holds no bytes"):
a build exited 3 with nothing built and a dataset over the table had no items.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch

from featbake.bake.pipeline import build
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.encode.tables import CellSource, Table
from featbake.errors import FeatbakeError, SourceError
from featbake.keys import sha256_hex
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.roots import root_file
from featbake.testing import make_tone
from tests.conftest import invoke
from tests.helpers import stored_features

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

RATE = 16000
#: The Arrow type ``datasets`` stores an Audio (and Image) column as.
AUDIO = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
#: The features ``datasets`` records in the schema's ``huggingface`` metadata for such a table.
FEATURES = {"audio": {"_type": "Audio"}, "label": {"dtype": "int64", "_type": "Value"}}


# == data made in the test =========================================================================
def write_clip(path: Path, seed: int, seconds: float = 0.4) -> Path:
    """A real WAV file of a seeded tone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, make_tone(seconds, RATE, seed=seed), RATE, format="WAV")
    return path


def write_path_parquet(path: Path, cells: list[dict[str, Any] | None]) -> Path:
    """A parquet file as ``Dataset.to_parquet`` writes a dataset cast to ``Audio()`` over local
    files: an ``audio`` struct<bytes: binary, path: string> column whose cells hold a path and
    null bytes, a ``label`` column, the features under the schema's ``huggingface`` metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"audio": pa.array(cells, type=AUDIO), "label": pa.array(range(len(cells)), pa.int64())}
    )
    meta = {b"huggingface": json.dumps({"info": {"features": FEATURES}}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path, row_group_size=2)
    return path


def only_path(named: str | Path) -> dict[str, Any]:
    return {"bytes": None, "path": str(named)}


# == references: featbake's code not used =========================================================
def clip_tensor(path: Path) -> torch.Tensor:
    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    assert rate == RATE
    return torch.from_numpy(np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32))


def encoder_now(encoder_file: Path) -> torch.nn.Module:
    with torchscript_quietly():
        return torch.jit.load(str(encoder_file))


def run_now(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(x.unsqueeze(0))[0]


def catalog(tmp_path: Path) -> Catalog:
    return Catalog(Layout(tmp_path / "store").ensure())


def root_before(store: Path, root: str, table: Path) -> None:
    """Date root ``root``'s manifest file a minute before ``table``'s status last changed:
    the table then changed after the root was written, with no wait (a change time cannot be
    set back; the root's modification time can)."""
    when = max(table.stat().st_ctime, table.stat().st_mtime) - 60
    os.utime(root_file(Layout(store), root), (when, when))


def root_of(store: Path, root: str) -> tuple[str, dict[str, str]]:
    """Root ``root``'s recorded working directory and items (name -> key)."""
    cat = Catalog(Layout(store))
    try:
        found = cat.root(root)
        assert found is not None
        return found.workdir, dict(cat.root_items(root))
    finally:
        cat.close()


# == the test's table ==============================================================================
class PathTable:
    """``project/clips/*.wav`` and ``project/out/train.parquet``, written as a user of
    ``datasets`` does from ``project/``: rows 0 and 4 name their clip relative to the project
    (the working directory, as ``datasets`` reads them), row 1 absolutely, row 2 relative to the
    table file's folder (``out/near/c2.wav`` as ``near/c2.wav``), row 3 a clip that does not
    exist, row 5 neither bytes nor a path."""

    def __init__(self, tmp_path: Path) -> None:
        self.project = tmp_path / "project"
        clips = self.project / "clips"
        self.files = {
            0: write_clip(clips / "c0.wav", 10),
            1: write_clip(clips / "c1.wav", 11, 0.5),
            2: write_clip(self.project / "out" / "near" / "c2.wav", 12, 0.3),
            4: write_clip(clips / "c4.wav", 14, 0.6),
        }
        self.table = write_path_parquet(
            self.project / "out" / "train.parquet",
            [
                only_path("clips/c0.wav"),
                only_path(self.files[1]),
                only_path("near/c2.wav"),
                only_path("clips/missing.wav"),
                only_path("clips/c4.wav"),
                {"bytes": None, "path": None},
            ],
        )

    def cells(self) -> list[dict[str, Any] | None]:
        """The table's ``audio`` cells as written now."""
        return pq.read_table(self.table).column("audio").to_pylist()

    def missing_reason(self) -> str:
        return (
            f"{self.table}:3: the cell holds no bytes and its path 'clips/missing.wav' names no "
            f"file at {self.project / 'clips' / 'missing.wav'} (from the working directory, as "
            f"datasets opens it) nor at {self.project / 'out' / 'clips' / 'missing.wav'} (beside "
            "the table file)"
        )


@dataclass
class BuiltTable:
    """A :class:`PathTable` built from its project folder (the working directory): its store,
    the build's report and root items, the encoder, and each clip's features run now."""

    t: PathTable
    store: Path
    report: Any
    built: dict[str, str]
    module: torch.nn.Module
    want: dict[int, torch.Tensor]


def built_in_project(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> BuiltTable:
    """A :class:`PathTable` built from its project folder, as :class:`BuiltTable` holds it."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    _, built = root_of(store, report.root)
    module = encoder_now(encoder_file)
    want = {n: run_now(module, clip_tensor(f)) for n, f in t.files.items()}
    return BuiltTable(t, store, report, built, module, want)


def others_in_job(tmp_path: Path) -> tuple[Path, dict[int, Path]]:
    """``job/``, holding other clips named as rows 0 and 4's (``clips/c0.wav``, ``c4.wav``)."""
    job = tmp_path / "job"
    return job, {n: write_clip(job / "clips" / f"c{n}.wav", 60 + n, 0.45) for n in (0, 4)}


# == tests =========================================================================================
def test_a_table_datasets_to_parquet_wrote_builds_each_row_from_its_file(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``datasets`` itself writes the table (where it is installed): its schema and
    ``huggingface`` metadata are the ones the other tests' tables have, its cells hold a path
    and null bytes, and a build over it stores each row's features equal to the encoder run now
    on the clip it names; before, every row failed and nothing was built."""
    datasets = pytest.importorskip("datasets")
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    named = ["clips/c0.wav", str(t.files[1]), "clips/c4.wav"]
    made = datasets.Dataset.from_dict({"audio": named, "label": [0, 1, 2]})
    theirs = t.project / "hf" / "train.parquet"
    made.cast_column("audio", datasets.Audio()).to_parquet(str(theirs))
    written, ours = pq.read_schema(theirs), pq.read_schema(t.table)
    assert written.remove_metadata() == ours.remove_metadata()
    assert json.loads(written.metadata[b"huggingface"]) == json.loads(ours.metadata[b"huggingface"])
    assert pq.read_table(theirs).column("audio").to_pylist() == [only_path(n) for n in named]
    report = build(theirs, encoder_file, cache=tmp_path / "store", workers=0, column="audio")
    assert (report.encoded, report.failed) == (3, [])
    stored = stored_features(tmp_path / "store", report.root)
    module = encoder_now(encoder_file)
    assert sorted(stored) == [f"train.parquet:{i}" for i in range(3)]
    for i, n in enumerate((0, 1, 4)):
        want = run_now(module, clip_tensor(t.files[n]))
        torch.testing.assert_close(stored[f"train.parquet:{i}"][""], want, msg=str(n))


def test_path_only_cells_are_keyed_by_their_files_bytes_and_decoded_from_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each path-only cell's digest is its file's SHA-256 (as the same file's in a folder) and it
    decodes to the file's samples; the missing clip and the empty cell fail with one line naming
    the row (and the path and where it was looked for)."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    inputs = Table(str(t.table))
    scanned = inputs.scan(source_for(Recipe()).extensions)
    assert scanned.inputs == [f"train.parquet:{i}" for i in range(6)] and not scanned.skipped
    paths = [inputs.path(r) for r in scanned.inputs]
    stats: dict[str, Any] = {}
    digests, failed = inputs.hash(catalog(tmp_path), paths, stats=stats)
    assert failed == {
        paths[3]: t.missing_reason(),
        paths[5]: f"{t.table}:5: the cell holds neither bytes nor a path",
    }
    assert digests == {paths[i]: sha256_hex(f.read_bytes()) for i, f in t.files.items()}
    source = inputs.source(source_for(Recipe()))
    assert isinstance(source, CellSource)
    for i, f in t.files.items():
        assert torch.equal(source.load(paths[i]), clip_tensor(f)), i
        assert torch.equal(source.load_unchanged(paths[i], stats[paths[i]]), clip_tensor(f)), i
    with pytest.raises(SourceError) as got:
        source.load(paths[3])
    assert str(got.value) == t.missing_reason()
    # A clip rewritten after its digest was taken is not decoded under the old key.
    write_clip(t.files[4], 99, 0.6)
    with pytest.raises(SourceError, match=r"train.parquet:4: the file its path 'clips/c4.wav' na"):
        source.load_unchanged(paths[4], stats[paths[4]])


def test_a_relative_path_is_taken_from_the_working_directory_first_then_the_tables_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where both the working directory and the table's folder hold the file a relative path
    names, the working directory's is read (the one ``datasets`` opens); run from elsewhere,
    the table's folder's is."""
    t = PathTable(tmp_path)
    shadow = write_clip(t.project / "out" / "clips" / "c0.wav", 50)  # beside the table too
    monkeypatch.chdir(t.project)
    inputs = Table(str(t.table))
    paths = [inputs.path(r) for r in inputs.scan([".wav"]).inputs]
    digests, _ = inputs.hash(catalog(tmp_path), paths[:1])
    assert digests == {paths[0]: sha256_hex(t.files[0].read_bytes())}
    monkeypatch.chdir(tmp_path)  # nothing under clips/ here
    again = Table(str(t.table))
    again.scan([".wav"])
    digests, failed = again.hash(catalog(tmp_path), paths[:3])
    assert digests == {
        paths[0]: sha256_hex(shadow.read_bytes()),
        paths[1]: sha256_hex(t.files[1].read_bytes()),  # absolute: wherever it is run from
        paths[2]: sha256_hex(t.files[2].read_bytes()),
    }
    assert not failed


def test_a_build_over_path_only_cells_stores_each_clips_features_and_a_dataset_serves_them(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build encodes each row from its file and fails the two bad rows (named with their
    reasons); a dataset over the table serves the four rows, with their labels, equal to the
    encoder run now on each file; before, the build failed every row and the dataset was
    empty."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    assert report.encoded == 4
    assert dict(report.failed) == {
        "train.parquet:3": t.missing_reason(),
        "train.parquet:5": f"{t.table}:5: the cell holds neither bytes nor a path",
    }
    module = encoder_now(encoder_file)
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    said = " ".join(str(w.message) for w in told)
    assert "clips/missing.wav" in said and "train.parquet:3" in said, said
    assert [ds.item_id(i) for i in range(len(ds))] == [f"train.parquet:{i}" for i in (0, 1, 2, 4)]
    for i, n in enumerate((0, 1, 2, 4)):
        assert ds.row(i) == {"label": n}
        assert torch.equal(ds[i], run_now(module, clip_tensor(t.files[n]))), n


def test_a_clip_rewritten_behind_an_unchanged_table_is_read_again_not_served_stale(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table file is unchanged, one clip it names is rewritten: a rebuild keys that row by
    the new bytes (its file's stat is the hash cache's, not the table's), and the dataset
    serves the new clip's features."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    store = tmp_path / "store"
    assert build(t.table, encoder_file, cache=store, workers=0, column="audio").encoded == 4
    table_bytes = t.table.read_bytes()
    write_clip(t.files[1], 77, 0.7)
    assert t.table.read_bytes() == table_bytes
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded, report.reused) == (1, 3)
    module = encoder_now(encoder_file)
    with pytest.warns(UserWarning, match="clips/missing.wav"):  # the bad rows
        ds = CachedFeatureDataset(
            t.table, encoder_file, cache=store, column="audio", on_miss="error"
        )
    for i, n in enumerate((0, 1, 2, 4)):
        assert torch.equal(ds[i], run_now(module, clip_tensor(t.files[n]))), n


def test_a_dataset_encodes_path_only_misses_live_from_their_files(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No build: a dataset over the table encodes each row live from its clip (the bad rows
    left out, warned of)."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    module = encoder_now(encoder_file)
    with pytest.warns(UserWarning):
        ds = CachedFeatureDataset(t.table, encoder_file, cache=tmp_path / "store", column="audio")
    assert len(ds) == 4
    for i, n in enumerate((0, 1, 2, 4)):
        assert torch.equal(ds[i], run_now(module, clip_tensor(t.files[n]))), n


def test_the_cli_builds_a_folder_of_path_only_parquet_and_exits_3_naming_the_missing_clip(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``featbake build --data out/`` (a folder of parquet files) from the project: the four
    readable rows are stored, each equal to the encoder run now on its clip; the missing clip
    and the empty cell are failed rows naming the row and the path, and the build exits 3."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    out = invoke(
        "build", "--encoder", encoder_file, "--data", t.table.parent, "--cache",
        tmp_path / "store", "--workers", "0",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert re.search(r"^encoded\s+4$", text, re.MULTILINE), text
    flat = " ".join(text.split())
    assert "failed train.parquet:3: " in flat and "'clips/missing.wav' names no file" in flat, text
    root = re.search(r"^root\s+(\S+)$", text, re.MULTILINE)
    assert root, text
    stored = stored_features(tmp_path / "store", root.group(1))
    module = encoder_now(encoder_file)
    assert sorted(stored) == [f"train.parquet:{i}" for i in (0, 1, 2, 4)]
    for n in (0, 1, 2, 4):
        want = run_now(module, clip_tensor(t.files[n]))
        torch.testing.assert_close(stored[f"train.parquet:{n}"][""], want, msg=str(n))
    assert os.getcwd() == str(t.project)


def test_rows_whose_clips_are_not_found_now_are_served_as_built_and_kept_by_gc(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset opened from another working directory (relative clips not reached from
    there), or after a clip was deleted, serves the rows as built, as a manifest row whose file
    is gone is served; its root keeps them, so `gc` keeps their features. Before, such rows
    were dropped, the root was published again without them, and `gc` freed their features:
    the dataset from the build's directory then missed all of them. A row of a table rewritten
    since the build that names a file gone is not served as built (it may name another), its
    modification time set back or not (its change time tells)."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    module = encoder_now(encoder_file)
    rows = (0, 1, 2, 4)
    elsewhere = tmp_path / "job"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.warns(UserWarning):
        away = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert [away.item_id(i) for i in range(len(away))] == [f"train.parquet:{n}" for n in rows]
    for i, n in enumerate(rows):
        assert torch.equal(away[i], run_now(module, clip_tensor(t.files[n]))), n
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    monkeypatch.chdir(t.project)
    kept = t.files[4].read_bytes()
    t.files[4].unlink()
    with pytest.warns(UserWarning):
        home = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert len(home) == len(rows)
    for i, n in enumerate(rows):  # row 4's clip gone: as built
        want = clip_tensor(t.files[n]) if n != 4 else None
        if want is None:
            t.files[4].write_bytes(kept)
            want = clip_tensor(t.files[4])
            t.files[4].unlink()
        assert torch.equal(home[i], run_now(module, want)), n
    cells = pq.read_table(t.table).column("audio").to_pylist()
    cells[4] = only_path("clips/other.wav")  # edited after the build to name another clip ...
    write_path_parquet(t.table, cells)
    os.utime(t.table, (1, 1))  # ... its modification time set back, as cp -p does
    root_before(store, report.root, t.table)
    with pytest.warns(UserWarning):
        edited = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert "train.parquet:4" not in [edited.item_id(i) for i in range(len(edited))]


def test_rows_whose_clips_are_gone_in_a_copied_table_are_served_as_built_and_kept_by_gc(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table file is copied over itself (``cp``: its modification and change times after
    the root's) and touched, its rows unchanged; two clips are deleted (one relative to the
    working directory, one beside the table). Each of those rows still names the clip its
    build hashed (the hash cache keys that file as the root does): it is the same input, so
    the dataset serves it as built, the root keeps it, and `gc` keeps its features. Before,
    both rows were refused, the root was published again without them and `gc` freed their
    features."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report, built, want = b.t, b.store, b.report, b.built, b.want
    copy = tmp_path / "copy.parquet"
    shutil.copyfile(t.table, copy)
    shutil.copyfile(copy, t.table)  # cp back: new modification and change times
    os.utime(t.table)  # touched
    t.files[2].unlink()
    t.files[4].unlink()
    root_before(store, report.root, t.table)
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    said = " ".join(str(w.message) for w in told)
    assert "train.parquet:2" not in said and "train.parquet:4" not in said, said
    rows = (0, 1, 2, 4)
    assert [ds.item_id(i) for i in range(len(ds))] == [f"train.parquet:{n}" for n in rows]
    for i, n in enumerate(rows):
        assert torch.equal(ds[i], want[n]), n
    assert root_of(store, report.root)[1] == built
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    stored = stored_features(store, report.root)
    assert sorted(stored) == [f"train.parquet:{n}" for n in rows]
    for n in rows:
        assert torch.equal(stored[f"train.parquet:{n}"][""], want[n]), n


def test_a_row_edited_to_name_another_missing_clip_is_not_served_and_its_features_are_kept(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row edited after the build to name another clip that is not there cannot be told to
    be the input built: it is not served, but the root keeps it with its key as built, so
    `gc` keeps its features, and one warning line names the row, the path its cell names now
    and what to do. Its clip restored, the row is served again (the edit undone, the cell
    naming the clip built). Before, the root was published again without the row and `gc`
    freed its features."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report, built, want = b.t, b.store, b.report, b.built, b.want
    cells = pq.read_table(t.table).column("audio").to_pylist()
    edited = [*cells[:4], only_path("clips/renamed.wav"), cells[5]]
    write_path_parquet(t.table, edited)
    root_before(store, report.root, t.table)
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert [ds.item_id(i) for i in range(len(ds))] == [f"train.parquet:{n}" for n in (0, 1, 2)]
    lines = [str(w.message) for w in told if "train.parquet:4" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "train.parquet:4 names 'clips/renamed.wav'" in lines[0], lines
    assert "stored features are kept, not served" in lines[0], lines
    assert f"restore the clips they name (relative to {t.project}, the build's" in lines[0]
    assert root_of(store, report.root)[1] == built
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    stored = stored_features(store, report.root)
    assert sorted(stored) == [f"train.parquet:{n}" for n in (0, 1, 2, 4)]
    assert torch.equal(stored["train.parquet:4"][""], want[4])
    write_path_parquet(t.table, cells)  # the edit undone
    root_before(store, report.root, t.table)
    t.files[4].unlink()  # its clip gone: the row names the clip built, served as built
    with pytest.warns(UserWarning):
        back = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert [back.item_id(i) for i in range(len(back))][-1] == "train.parquet:4"
    assert torch.equal(back[len(back) - 1], want[4])


def test_a_dataset_and_a_rebuild_elsewhere_read_the_clips_built_not_others_of_the_same_names(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build records the working directory it took relative paths from. Run from another
    directory that holds other clips of the same relative names, a dataset serves the clips
    built (equal to the encoder run now on them, not on the others), its root keeps the
    build's keys and folder, and `gc` keeps every feature; a rebuild from there reuses all
    four rows; the table opened again as built (an export's check) takes them from the
    recorded folder. Before, the other clips were read: the dataset served their features,
    published the root with their keys, and `gc` freed the build's."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report, built, module, want = b.t, b.store, b.report, b.built, b.module, b.want
    job, others = others_in_job(tmp_path)
    monkeypatch.chdir(job)
    with pytest.warns(UserWarning):
        ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    rows = (0, 1, 2, 4)
    assert [ds.item_id(i) for i in range(len(ds))] == [f"train.parquet:{n}" for n in rows]
    for i, n in enumerate(rows):
        assert torch.equal(ds[i], want[n]), n
    for n, other in others.items():
        assert not torch.equal(want[n], run_now(module, clip_tensor(other))), n
    assert root_of(store, report.root) == (str(t.project), built)
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    stored = stored_features(store, report.root)
    assert sorted(stored) == [f"train.parquet:{n}" for n in rows]
    again = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    assert (again.encoded, again.reused) == (0, 4)
    assert root_of(store, report.root) == (str(t.project), built)
    opened = Table(str(t.table), workdir=str(t.project))  # as an export opens it
    paths = [opened.path(r) for r in opened.scan([".wav"]).inputs]
    digests, _ = opened.hash(catalog(tmp_path), [paths[0], paths[4]])
    assert digests == {paths[n]: sha256_hex(t.files[n].read_bytes()) for n in (0, 4)}
    # The build's clips away (and the others), the absolute clip rewritten: the root is
    # published again (row 1's new key), still recording the build's folder, rows 0 and 4
    # served as built.
    (t.project / "clips").rename(t.project / "away")
    shutil.rmtree(job / "clips")
    write_clip(tmp_path / "c1.wav", 31, 0.5)
    t.files[1] = tmp_path / "c1.wav"
    cells = pq.read_table(t.table).column("audio").to_pylist()
    write_path_parquet(t.table, [cells[0], only_path(t.files[1]), *cells[2:]])
    with pytest.warns(UserWarning):
        moved = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert [moved.item_id(i) for i in range(len(moved))] == [f"train.parquet:{n}" for n in rows]
    assert torch.equal(moved[1], run_now(module, clip_tensor(t.files[1])))
    for i in (0, 3):
        assert torch.equal(moved[i], want[rows[i]]), i
    workdir, now = root_of(store, report.root)
    assert workdir == str(t.project) and now != built


def test_a_row_kept_back_stays_kept_back_when_the_root_is_published_again(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 4 is edited to name another clip that is not there (its own clip deleted), row 0 to
    name a new clip. The first dataset keeps row 4 back and publishes the root with row 0's new
    key, so the root's manifest is newer than the table's edit. The next datasets keep row 4
    back all the same (one warning each), the root keeps its key as built and `gc` its
    features; once the clip its cell names is there, the row is served from that clip. Before,
    the second dataset served row 4 the deleted clip's features, without a warning."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    module = encoder_now(encoder_file)
    want4 = run_now(module, clip_tensor(t.files[4]))
    _, built = root_of(store, report.root)
    new0 = write_clip(t.project / "clips" / "new0.wav", 99)
    cells = pq.read_table(t.table).column("audio").to_pylist()
    write_path_parquet(
        t.table, [only_path("clips/new0.wav"), *cells[1:4], only_path("clips/renamed.wav")]
    )
    t.files[4].unlink()
    root_before(store, report.root, t.table)
    served = [f"train.parquet:{n}" for n in (0, 1, 2)]
    for _ in range(3):  # the first publishes row 0's new key; the others see a newer root
        with pytest.warns(UserWarning) as told:
            ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
        assert [ds.item_id(i) for i in range(len(ds))] == served
        lines = [str(w.message) for w in told if "train.parquet:4" in str(w.message)]
        assert len(lines) == 1 and "stored features are kept, not served" in lines[0], lines
        assert torch.equal(ds[0], run_now(module, clip_tensor(new0)))
        _, items = root_of(store, report.root)
        assert items["train.parquet:4"] == built["train.parquet:4"]
        assert items["train.parquet:0"] != built["train.parquet:0"]
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    assert torch.equal(stored_features(store, report.root)["train.parquet:4"][""], want4)
    renamed = write_clip(t.project / "clips" / "renamed.wav", 44, 0.35)
    with pytest.warns(UserWarning) as told:
        back = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert not [w for w in told if "kept, not served" in str(w.message)]
    assert [back.item_id(i) for i in range(len(back))] == [*served, "train.parquet:4"]
    assert torch.equal(back[3], run_now(module, clip_tensor(renamed)))


def test_a_build_decides_the_rows_kept_back_and_a_drop_takes_their_record(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset keeps row 4 back (edited to name a missing clip) and records it; a rebuild,
    which decides every row again, takes the record, so once the clip is there a dataset
    serves it; `featbake roots drop` takes a record left beside a root. Before, the record
    outlived the rebuild (the row stayed kept back, its warning saying the build had not
    run) and the drop."""
    t = PathTable(tmp_path)
    monkeypatch.chdir(t.project)
    store = tmp_path / "store"
    report = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    cells = t.cells()
    write_path_parquet(t.table, [*cells[:4], only_path("clips/renamed.wav")])
    t.files[4].unlink()
    root_before(store, report.root, t.table)
    with pytest.warns(UserWarning, match="kept, not served"):
        CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    held = store / "roots" / f"{report.root}.held"
    assert held.is_file()
    renamed = write_clip(t.project / "clips" / "renamed.wav", 44, 0.35)
    again = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    assert again.root == report.root and not held.exists()
    ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio", on_miss="error")
    assert ds.item_id(3) == "train.parquet:4"
    assert torch.equal(ds[3], run_now(encoder_now(encoder_file), clip_tensor(renamed)))
    held.write_text('{"rows": {"train.parquet:4": "k"}}')
    assert invoke("roots", "drop", report.root, "--cache", store).returncode == 0
    assert not held.exists()


def test_a_build_and_a_dataset_from_a_deleted_working_directory_need_it_only_for_relative_cells(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a working directory deleted since, a build and a dataset over a table of
    embedded bytes, and over one whose path-only cells are absolute, serve every row equal to
    the encoder run now. Before, both raised the OS's FileNotFoundError of the working
    directory (the folder a root records was read for every table)."""
    clip = write_clip(tmp_path / "c.wav", 5)
    embedded = tmp_path / "bytes.parquet"
    cell = {"bytes": clip.read_bytes(), "path": "c.wav"}
    pq.write_table(pa.table({"audio": pa.array([cell], AUDIO)}), embedded)
    absolute = write_path_parquet(tmp_path / "abs.parquet", [only_path(clip)])
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    want = run_now(encoder_now(encoder_file), clip_tensor(clip))
    for data in (embedded, absolute):
        store = tmp_path / f"store-{data.stem}"
        report = build(data, encoder_file, cache=store, workers=0, column="audio")
        assert report.encoded == 1 and not report.failed
        ds = CachedFeatureDataset(data, encoder_file, cache=store, column="audio", on_miss="error")
        assert torch.equal(ds[0], want)
        live = CachedFeatureDataset(data, encoder_file, cache=tmp_path / f"live-{data.stem}")
        assert torch.equal(live[0], want)


def test_a_dataset_run_elsewhere_while_the_clips_are_away_never_moves_the_recorded_folder(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build's clips are moved away for a while, and a dataset is opened from another
    directory that holds other clips of the same relative names: it serves the rows as built
    (not the other clips), and the root still records the build's working directory. The
    clips back, a dataset and a rebuild from the project read the project's clips, and `gc`
    keeps every feature. Before, the dataset recorded its own directory in the root, and from
    then on the project's own runs served, and a rebuild stored, the other clips' features."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report, built, module, want = b.t, b.store, b.report, b.built, b.module, b.want
    job, others = others_in_job(tmp_path)
    for n, other in others.items():
        assert not torch.equal(want[n], run_now(module, clip_tensor(other))), n
    (t.project / "clips").rename(t.project / "away")
    monkeypatch.chdir(job)
    rows = (0, 1, 2, 4)
    with pytest.warns(UserWarning):
        elsewhere = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    assert [elsewhere.item_id(i) for i in range(len(elsewhere))] == [
        f"train.parquet:{n}" for n in rows
    ]
    for i, n in enumerate(rows):
        if n != 1:  # row 1's clip is absolute, under the folder moved away: as built too
            assert torch.equal(elsewhere[i], want[n]), n
    assert root_of(store, report.root) == (str(t.project), built)
    (t.project / "away").rename(t.project / "clips")
    monkeypatch.chdir(t.project)
    with pytest.warns(UserWarning):
        home = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    for i, n in enumerate(rows):
        assert torch.equal(home[i], want[n]), n
    again = build(t.table, encoder_file, cache=store, workers=0, column="audio")
    assert (again.encoded, again.reused) == (0, 4)
    assert root_of(store, report.root) == (str(t.project), built)
    assert invoke("gc", "--cache", store, "--grace", "0s").returncode == 0
    stored = stored_features(store, report.root)
    for n in rows:
        assert torch.equal(stored[f"train.parquet:{n}"][""], want[n]), n


def test_a_table_opened_from_a_deleted_working_directory_needs_it_only_for_relative_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened from a working directory deleted since, a table of embedded bytes named by its
    absolute path is scanned and hashed, and a bucket's table is refused in one line of its
    own (no credentials here); neither needs the working directory. Before, opening either
    raised the OS's FileNotFoundError of the working directory."""
    data = tmp_path / "bytes.parquet"
    clip = write_clip(tmp_path / "c.wav", 5)
    table = pa.table({"audio": pa.array([{"bytes": clip.read_bytes(), "path": "c.wav"}], AUDIO)})
    pq.write_table(table, data)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    inputs = Table(str(data), "audio")
    paths = [inputs.path(r) for r in inputs.scan([".wav"]).inputs]
    digests, failed = inputs.hash(catalog(tmp_path), paths)
    assert (digests, failed) == ({paths[0]: sha256_hex(clip.read_bytes())}, {})
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(FeatbakeError, match="no credentials"):
        Table("s3://bucket/t.parquet")


def test_a_row_edited_before_a_repair_writes_the_manifest_anew_is_still_kept_back(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 4 edited to name another clip that is not there (its own clip deleted), then the
    root's manifest file written anew before any dataset opens the table (`featbake verify
    --repair` rewriting a manifest gone from `roots/`): the root was last published by the
    build, so the dataset keeps row 4 back. Before, the table's change was told by the manifest
    file's time, which the repair moved past the edit: row 4 was served the deleted clip's
    features."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report = b.t, b.store, b.report
    cells = t.cells()
    write_path_parquet(t.table, [*cells[:4], only_path("clips/renamed.wav"), cells[5]])
    t.files[4].unlink()
    root_file(Layout(store), report.root).unlink()
    repaired = invoke("verify", "--cache", store, "--repair")
    assert repaired.returncode == 10, repaired.stderr  # damage found and repaired
    assert root_file(Layout(store), report.root).exists()
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
    lines = [str(w.message) for w in told if "train.parquet:4" in str(w.message)]
    assert len(lines) == 1 and "stored features are kept, not served" in lines[0], lines
    assert [ds.item_id(i) for i in range(len(ds))] == [f"train.parquet:{n}" for n in (0, 1, 2)]
    for i in range(3):
        assert torch.equal(ds[i], b.want[i]), i


def test_a_part_of_a_build_leaves_the_rows_kept_back_kept_back_until_its_root_is_published(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 4 edited to name a missing clip (its own deleted), row 0 to name a new clip: a
    dataset keeps row 4 back and publishes the root (row 0's new key). Then part 0 of a build
    in two parts runs (`--shard 0/2`; its manifest waits for the merge): the next dataset keeps
    row 4 back all the same. Before, the part took the record of rows kept back though it
    published no root, and the next dataset served row 4 the deleted clip's features."""
    b = built_in_project(tmp_path, encoder_file, monkeypatch)
    t, store, report = b.t, b.store, b.report
    write_clip(t.project / "clips" / "new0.wav", 99)
    cells = t.cells()
    write_path_parquet(
        t.table, [only_path("clips/new0.wav"), *cells[1:4], only_path("clips/renamed.wav")]
    )
    t.files[4].unlink()
    root_before(store, report.root, t.table)
    served = [f"train.parquet:{n}" for n in (0, 1, 2)]
    for part in (None, "0/2"):
        if part is not None:
            build(t.table, encoder_file, cache=store, workers=0, column="audio", shard=part)
        with pytest.warns(UserWarning) as told:
            ds = CachedFeatureDataset(t.table, encoder_file, cache=store, column="audio")
        lines = [str(w.message) for w in told if "train.parquet:4" in str(w.message)]
        assert len(lines) == 1 and "kept, not served" in lines[0], (part, lines)
        assert [ds.item_id(i) for i in range(len(ds))] == served, part
