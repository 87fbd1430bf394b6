"""Which of a folder's files are one dataset: featbake's split judgement against ``datasets``' own
(``get_data_patterns``, then the files each split's patterns match, as ``load_dataset(...,
data_dir=...)`` resolves them), for folders of audio files, tar shards and parquet files, local
and in a bucket; a parquet folder's files holding one table's columns; tars in an audio folder
(round ten: inputs)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.encoders import torchscript_quietly
from featbake.errors import SourceError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.containers import refuse_several_splits, schema_difference
from featbake.testing import write_audio_folder
from tests.conftest import invoke, live_features
from tests.encode.test_bucket_inputs import upload
from tests.encode.test_containers import (
    audio_tensor,
    run_now,
    upload_shards,
    wav_bytes,
    write_audio_parquet,
    write_tar,
)

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pa_dataset = pytest.importorskip("pyarrow.dataset")
pq = pytest.importorskip("pyarrow.parquet")


def datasets_splits(folder: Path) -> dict[str, list[str]]:
    """split -> the files (relative, sorted) ``datasets`` reads of ``folder`` in it."""
    patterns = datasets.data_files.get_data_patterns(str(folder))
    resolved = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=str(folder))
    return {str(s): sorted(os.path.relpath(f, folder) for f in fs) for s, fs in resolved.items()}


def assert_serves_live(data: Path, encoder_file: Path, store: Path, n: int) -> None:
    """``data`` (an audio folder) built: ``n`` clips, each served equal to the encoder now."""
    report = build(data, encoder_file, cache=store, workers=0)
    assert (report.encoded + report.reused, report.failed) == (n, [])
    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    assert len(ds) == n
    for i in range(n):
        want = live_features(encoder_file, data / ds.item_id(i))
        torch.testing.assert_close(ds[i], want, msg=ds.item_id(i))


@pytest.mark.parametrize(
    ("layout", "said"),
    [
        (
            {"train": 2, "test": 1},
            "holds the splits train (2 files), test (1 file), as datasets reads its folders",
        ),
        ({"train": 2, "dev": 1}, "train (2 files), validation (1 file)"),
        ({"train": 2, "extra": 1}, "train (2 files) and 1 file that name no split (extra/"),
    ],
)
def test_an_audio_folder_of_split_folders_is_refused_naming_them(
    tmp_path: Path, encoder_file: Path, layout: dict[str, int], said: str
) -> None:
    """``audio/train/`` beside ``audio/test/`` was built as one dataset (the ids showed the
    split), where ``load_dataset("audiofolder", data_dir=...)`` reads two splits: the test
    clips were served among the training ones. The folder is refused by the tar and parquet
    folders' one rule, in one line naming each split and its file count and saying to pass one
    split's folder (exit 8, and from a dataset); that folder builds, each clip served equal to
    the encoder now (in10.1)."""
    data = tmp_path / "audio"
    for seed, (split, n) in enumerate(layout.items()):
        write_audio_folder(data / split, n, seconds=0.3, seed=seed + 1)
    got = datasets_splits(data)
    assert len(got) == 2 or (list(got) == ["train"] and len(got["train"]) == 2), got
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and said in line, line
    assert f"its folder as --data (such as {data.resolve() / 'train'})" in line, line
    with pytest.raises(SourceError, match=re.escape(said)):
        build(data, encoder_file, cache=store, workers=0)
    assert_serves_live(data / "train", encoder_file, store, 2)


def test_an_audio_folder_whose_splits_sit_deeper_is_refused_and_speakers_are_not_splits(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Splits under a level of their own (``LibriSpeech/train-clean-100/``, ``dev-clean/``)
    are ``datasets``' splits as well; speaker folders (``spk1/``, ``spk2/``) name none and the
    folder builds as one, as ``datasets`` reads it (in10.1)."""
    data = tmp_path / "LibriSpeech"
    write_audio_folder(data / "train-clean-100" / "19", 2, seconds=0.3, seed=3)
    write_audio_folder(data / "dev-clean" / "84", 1, seconds=0.3, seed=4)
    assert sorted(datasets_splits(data)) == ["train", "validation"]
    with pytest.raises(SourceError, match=r"train \(2 files\), validation \(1 file\)") as e:
        build(data, encoder_file, cache=tmp_path / "store", workers=0)
    assert f"such as {data / 'train-clean-100'})" in str(e.value), e.value
    speakers = tmp_path / "speakers"
    write_audio_folder(speakers / "spk1", 2, seconds=0.3, seed=5)
    write_audio_folder(speakers / "spk2", 1, seconds=0.3, seed=6)
    assert list(datasets_splits(speakers)) == ["train"]
    assert_serves_live(speakers, encoder_file, tmp_path / "store", 3)


@pytest.mark.parametrize(
    ("layout", "said"),
    [
        ({"train": 2, "test": 1}, "train (2 files), test (1 file)"),
        ({"train": 2, "extra": 1}, "name no split (extra/"),
    ],
)
def test_an_audio_prefix_of_split_folders_is_refused_as_a_local_folder_is(
    s3: Any, tmp_path: Path, encoder_file: Path, layout: dict[str, int], said: str
) -> None:
    """The same layouts under ``s3://bucket/audio/``: refused by the same rule in one line
    (exit 8), one split's prefix built, each clip served equal to the encoder now (in10.1)."""
    data = tmp_path / "audio"
    for seed, (split, n) in enumerate(layout.items()):
        write_audio_folder(data / split, n, seconds=0.3, seed=seed + 1)
    prefix = f"s3://{s3.bucket}/audio/"
    upload(data, prefix)
    store = tmp_path / "store"
    result = invoke("build", "--data", prefix, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and said in line, line
    assert f"such as s3://{s3.bucket}/audio/train)" in line, line
    one = f"s3://{s3.bucket}/audio/train/"
    report = build(one, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    ds = CachedFeatureDataset(one, encoder_file, cache=store, on_miss="error")
    assert len(ds) == 2
    for i in range(2):
        want = live_features(encoder_file, data / "train" / ds.item_id(i))
        torch.testing.assert_close(ds[i], want, msg=ds.item_id(i))


@pytest.mark.parametrize(
    "names",
    [
        ["train/a.wav", "test/b.wav"],
        ["train/a.wav", "b.wav"],
        ["spk1/a.wav", "spk2/b.wav"],
        ["data/holdout-00000-of-00001.parquet", "data/main-00000-of-00002.parquet"],
        ["data/holdout-00000-of-00001.parquet", "data/train-00000-of-00002.parquet"],
        ["data/train-00000-of-00001.parquet", "data/train.parquet"],
        ["data/train-00000-of-00001.tar", "data/train-00001-of-00002.tar"],
        ["data/holdout-00000-of-00001.tar", "data/x.tar"],
        ["data/holdout-00000-of-00001.tar", "test/x.tar"],
        ["holdout-00000-of-00001.parquet", "main-00000-of-00002.parquet"],
        ["data/sub/holdout-00000-of-00001.tar", "data/sub/main-00000-of-00001.tar"],
        ["data/holdout-00000-of-00001.tar"],
    ],
)
def test_featbake_reads_as_one_exactly_what_datasets_reads_as_one_split(
    tmp_path: Path, names: list[str]
) -> None:
    """The round-ten layouts: split folders of audio files, and the Hub's shard names
    (``data/{split}-00000-of-00002.parquet``, any word a split) ``datasets`` tries before
    its keywords. featbake reads them as one exactly where ``datasets`` reads them all as one
    split, else refuses them (in10.1, in10.2)."""
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    got = datasets_splits(tmp_path)
    as_one = len(got) == 1 and next(iter(got.values())) == sorted(names)
    try:
        refuse_several_splits(str(tmp_path), sorted(names))
    except SourceError:
        assert not as_one, got
    else:
        assert as_one, got


def test_custom_split_shard_names_are_refused_as_splits_in_a_folder_and_a_prefix(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """A Hub snapshot of ``data/main-00000-of-00001.parquet`` beside
    ``data/holdout-00000-of-00001.parquet`` is two splits to ``datasets`` (its shard-name
    pattern: any word a split), and was built as one table, the held-out rows served among
    the others; the same for tars. Refused now in one line naming both, locally and under a
    bucket prefix; the main split's file serves its rows equal to the encoder now (in10.2)."""
    clips = [wav_bytes(0.3 + 0.1 * i, 90 + i) for i in range(3)]
    snap = tmp_path / "snapshot"
    (snap / "data").mkdir(parents=True)
    (snap / "README.md").write_text("# card\n")
    write_audio_parquet(snap / "data/main-00000-of-00001.parquet", clips[:2], label=[1, 2])
    write_audio_parquet(snap / "data/holdout-00000-of-00001.parquet", clips[2:], label=[3])
    assert sorted(datasets_splits(snap)) == ["holdout", "main"]
    wds = tmp_path / "wds"
    (wds / "data").mkdir(parents=True)
    write_tar(wds / "data/main-00000-of-00001.tar", [("m0", {"wav": clips[0]})])
    write_tar(wds / "data/holdout-00000-of-00001.tar", [("h0", {"wav": clips[2]})])
    assert sorted(datasets_splits(wds)) == ["holdout", "main"]
    said = "holds the splits holdout (1 file), main (1 file), as datasets reads its shard names"
    store = tmp_path / "store"
    for data, column in ((snap, ["--column", "audio"]), (wds, [])):
        result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store,
                        *column)  # fmt: skip
        assert result.returncode == 8, result.stdout + result.stderr
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and said in line, line
    prefix = f"s3://{s3.bucket}/snap/"
    parquets = ("data/main-00000-of-00001.parquet", "data/holdout-00000-of-00001.parquet")
    upload_shards(prefix, {n: snap / n for n in parquets})
    with pytest.raises(SourceError, match=re.escape(said)):
        build(prefix, encoder_file, cache=store, workers=0, column="audio")
    tars = ("data/main-00000-of-00001.tar", "data/holdout-00000-of-00001.tar")
    upload_shards(f"s3://{s3.bucket}/wds/", {n: wds / n for n in tars})
    with pytest.raises(SourceError, match=re.escape(said)):
        build(f"s3://{s3.bucket}/wds/", encoder_file, cache=store, workers=0)
    main = snap / "data/main-00000-of-00001.parquet"
    report = build(main, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(main, encoder_file, cache=store, column="audio", on_miss="error")
    assert [ds.row(i)["label"] for i in range(len(ds))] == [1, 2]
    for i in range(2):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i])))


def test_a_tar_in_an_audio_folders_subfolder_is_one_note_not_left_out_unsaid(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """An audio folder with ``shards/a.tar`` and ``shards/b.tar`` in a subfolder built its
    clips and passed over the tars without a word (their samples never built). The clips still
    build, and one note names the first tar, how many, and how to build them, locally and
    under a bucket prefix (in10.4)."""
    data = tmp_path / "audio"
    write_audio_folder(data, 2, seconds=0.3, seed=7)
    (data / "shards").mkdir()
    for name in ("a.tar", "b.tar"):
        write_tar(data / "shards" / name, [(name[0], {"wav": wav_bytes(0.3, 8)})])
    (data / "__MACOSX").mkdir()
    write_tar(data / "__MACOSX" / "a.tar", [("a", {"wav": wav_bytes(0.3, 8)})])
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 0, result.stdout + result.stderr
    notes = [line for line in (result.stdout + result.stderr).splitlines() if "note:" in line]
    assert len(notes) == 1, notes
    assert f"2 tar files under {data.resolve()} are not read (shards/a.tar)" in notes[0], notes
    assert "pass them as --data on their own" in notes[0], notes
    assert_serves_live(data, encoder_file, store, 2)
    prefix = f"s3://{s3.bucket}/audio/"
    upload(data, prefix)
    report = build(prefix, encoder_file, cache=store, workers=0)
    assert (report.encoded + report.reused, report.failed) == (2, [])
    (note,) = report.notes
    assert note.startswith(f"2 tar files under s3://{s3.bucket}/audio are not read (shards/a.tar)")


# == one table: its files' columns =================================================================
def mixed_tables(folder: Path, case: str, clips: list[bytes]) -> None:
    """Two parquet files of audio structs whose schemas differ as ``case`` says."""
    folder.mkdir()
    write_audio_parquet(folder / "a.parquet", clips[:2], label=[1, 2])
    if case == "label type":
        write_audio_parquet(folder / "b.parquet", clips[2:], label=["3"])
    elif case == "label missing":
        write_audio_parquet(folder / "b.parquet", clips[2:])
    elif case == "column type":
        table = pa.table({"audio": pa.array(clips[2:], pa.binary()), "label": pa.array([3])})
        pq.write_table(table, folder / "b.parquet")
    else:  # metadata only: no huggingface features, a field's own metadata
        write_audio_parquet(folder / "c.parquet", clips[2:])
        table = pa.table({"audio": pq.read_table(folder / "c.parquet")["audio"]})
        (folder / "c.parquet").unlink()
        field = table.schema.field("audio").with_metadata({b"note": b"x"})
        table = table.cast(pa.schema([field])).append_column("label", pa.array([3]))
        table = table.replace_schema_metadata(None)
        pq.write_table(table, folder / "b.parquet")


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("label type", "column 'label' holds int64 in the first, string in the second"),
        ("label missing", "column 'label' is in the first, not the second"),
        ("column type", "column 'audio' holds struct<bytes: binary, path: string> in the first"),
    ],
)
def test_a_parquet_folder_whose_files_columns_differ_is_refused_naming_two(
    tmp_path: Path, encoder_file: Path, case: str, said: str
) -> None:
    """Parquet files whose columns differ (the label an int in one file and a string in the
    next, or missing there; the encoded column a struct in one and bytes in the other) were
    read file by file: one dataset's rows served with labels of two types, or with none.
    ``datasets`` (and pyarrow's dataset, but for bytes beside a struct, which it refuses) reads
    them as one table by casting each file to the first one's columns, a guess (``"3"`` read as
    3, a missing label as None). featbake refuses to guess: one line naming two files and the
    difference (exit 8, and from a dataset) (in10.3)."""
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(3)]
    data = tmp_path / "tables"
    mixed_tables(data, case, clips)
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store,
                    "--column", "audio")  # fmt: skip
    assert result.returncode == 8, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "(a.parquet, b.parquet: " in line and said in line, line
    with pytest.raises(SourceError, match=re.escape(said)):
        CachedFeatureDataset(data, encoder_file, cache=store, column="audio")


def test_parquet_files_whose_schemas_differ_in_metadata_only_are_one_table(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Files that differ only in metadata (one without ``datasets``' features, a field's own
    metadata) are one table to pyarrow's dataset, and still to featbake: 3 rows built and served
    in its order with their labels, equal to the encoder now (in10.3)."""
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(3)]
    data = tmp_path / "tables"
    mixed_tables(data, "metadata", clips)
    want = pa_dataset.dataset(data).to_table()
    store = tmp_path / "store"
    report = build(data, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded + report.reused, report.failed) == (3, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, column="audio", on_miss="error")
    assert [ds.row(i)["label"] for i in range(len(ds))] == want["label"].to_pylist()
    cells = want["audio"].to_pylist()
    for i in range(len(ds)):
        assert torch.equal(ds[i], run_now(module, audio_tensor(cells[i]["bytes"])))


def served_rows(data: Path, encoder_file: Path, store: Path, column: str) -> list[Any]:
    """Build ``data`` (a parquet folder) and return each served row's ``column`` value, the
    features checked equal to the encoder now, in pyarrow's dataset order."""
    want = pa_dataset.dataset(sorted(map(str, data.rglob("*.parquet")))).to_table()
    report = build(data, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded + report.reused, report.failed) == (want.num_rows, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, column="audio", on_miss="error")
    cells = want["audio"].to_pylist()
    for i in range(len(ds)):
        assert torch.equal(ds[i], run_now(module, audio_tensor(cells[i]["bytes"])))
    return [ds.row(i)[column] for i in range(len(ds))]


def test_a_parquet_shard_whose_carried_column_is_all_none_is_one_table(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A shard whose text column is all None (Arrow's ``null`` type, as pandas writes an
    all-None chunk) beside one of strings is one table to pyarrow's dataset, and to featbake:
    built, its rows served with str and None texts as pyarrow reads them (in10.5)."""
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(4)]
    data = tmp_path / "tables"
    data.mkdir()
    write_audio_parquet(data / "part-0.parquet", clips[:2], text=["hello", "world"])
    write_audio_parquet(data / "part-1.parquet", clips[2:], text=[None, None])
    assert pq.read_schema(data / "part-1.parquet").field("text").type == pa.null()
    assert pa_dataset.dataset(data).to_table()["text"].to_pylist() == ["hello", "world", None, None]
    r = invoke("build", "--data", data, "--encoder", encoder_file,
               "--cache", tmp_path / "cli-store", "--column", "audio")  # fmt: skip
    assert r.returncode == 0, r.stderr
    texts = served_rows(data, encoder_file, tmp_path / "store", "text")
    assert texts == ["hello", "world", None, None]


def test_string_and_large_string_labels_are_one_table(tmp_path: Path, encoder_file: Path) -> None:
    """A string label written by pandas (``string``) beside the same label written by polars
    (``large_string``), and an int32 count beside an int64 one, are one table: built, each
    row's label served as a str and its count as an int, whichever file (in10.5)."""
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(4)]
    data = tmp_path / "tables"
    data.mkdir()
    write_audio_parquet(data / "part-0.parquet", clips[:2], label=["a", "b"], n=[1, 2])
    second = write_audio_parquet(data / "part-1.parquet", clips[2:], label=["c", "d"], n=[3, 4])
    table = pq.read_table(second)
    for name, kind in (("label", pa.large_string()), ("n", pa.int32())):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, table[name].cast(kind))
    pq.write_table(table, second)
    r = invoke("build", "--data", data, "--encoder", encoder_file,
               "--cache", tmp_path / "cli-store", "--column", "audio")  # fmt: skip
    assert r.returncode == 0, r.stderr
    labels = served_rows(data, encoder_file, tmp_path / "store", "label")
    assert labels == ["a", "b", "c", "d"] and all(type(v) is str for v in labels)
    counts = served_rows(data, encoder_file, tmp_path / "store", "n")
    assert counts == [1, 2, 3, 4] and all(type(v) is int for v in counts)


@pytest.mark.parametrize(
    ("first", "second", "agree"),
    [
        ("string", "large_string", True),
        ("null", "int64", True),
        ("int32", "int64", True),
        ("float32", "float64", True),
        ("list<item: string>", "large_list<item: large_string>", True),
        ("string", "int64", False),
        ("int64", "float64", False),
        ("binary", "string", False),
    ],
)
def test_types_agree_where_their_values_are_one_kind(first: str, second: str, agree: bool) -> None:
    """Which Arrow types of one column are one table's (in10.5): width and offsets differ only."""
    kinds = {
        "string": pa.string(), "large_string": pa.large_string(), "null": pa.null(),
        "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
        "float64": pa.float64(), "binary": pa.binary(),
        "list<item: string>": pa.list_(pa.string()),
        "large_list<item: large_string>": pa.large_list(pa.large_string()),
    }  # fmt: skip
    a, b = pa.schema([("x", kinds[first])]), pa.schema([("x", kinds[second])])
    assert (schema_difference(a, b) is None) is agree
    assert (schema_difference(b, a) is None) is agree


def test_a_speaker_named_test_is_refused_with_a_way_to_build_every_speaker(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A speaker folder named ``test`` beside others is a split to ``datasets``, refused as
    in10.1; the one line also gives a shell command writing a manifest of every clip, which
    builds all 6 clips as one dataset, each served equal to the encoder now (in10.6)."""
    audio = tmp_path / "audio"
    for speaker in ("alice", "bob", "test"):
        write_audio_folder(audio / speaker, 2, seconds=0.3, seed=len(speaker))
    r = invoke("build", "--data", audio, "--encoder", encoder_file,
               "--cache", tmp_path / "store")  # fmt: skip
    assert r.returncode == 8, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "split test (2 files)" in line and "manifest" in line
    command = re.search(r"--data: (\{ echo path; .*?\} > all\.csv), then --data all\.csv", line)
    assert command is not None, line
    subprocess.run(["bash", "-c", command.group(1)], cwd=tmp_path, check=True)
    manifest = tmp_path / "all.csv"
    assert len(manifest.read_text().splitlines()) == 7  # the header and 6 clips
    report = build(manifest, encoder_file, cache=tmp_path / "store", workers=0)
    assert (report.encoded + report.reused, report.failed) == (6, [])
    ds = CachedFeatureDataset(manifest, encoder_file, cache=tmp_path / "store", on_miss="error")
    assert len(ds) == 6
    for i in range(6):
        clip = Path(ds.item_id(i))
        assert clip.is_absolute() and clip.is_relative_to(audio)
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip), msg=str(clip))


CARD_TWO_SPLITS = (
    "---\nconfigs:\n- config_name: default\n  data_files:\n"
    "  - split: train\n    path: shards/alpha.parquet\n"
    "  - split: heldout\n    path: shards/beta.parquet\n---\n# a dataset card\n"
)


def test_a_snapshot_whose_readme_configs_name_two_splits_is_refused(
    s3: Any, tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub snapshot whose README.md front matter's ``configs`` names two splits' files is a
    DatasetDict to ``load_dataset(snapshot)``, and was built as one table, the held-out rows
    served among the training ones. Refused now in one line naming the splits and their
    files, locally and under a bucket prefix (one GET of the listed README.md), for parquet
    files and an audio folder; a card declaring one split, or no configs, changes nothing:
    the 3 rows built and served equal to the encoder now (in10.7)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(3)]
    snap = tmp_path / "snapshot"
    (snap / "shards").mkdir(parents=True)
    write_audio_parquet(snap / "shards" / "alpha.parquet", clips[:2], label=[0, 1])
    write_audio_parquet(snap / "shards" / "beta.parquet", clips[2:], label=[2])
    (snap / "README.md").write_text(CARD_TWO_SPLITS)
    splits = datasets.load_dataset(str(snap))
    assert {s: len(d) for s, d in splits.items()} == {"train": 2, "heldout": 1}
    said = (
        "declares the splits train (shards/alpha.parquet), heldout (shards/beta.parquet) "
        "(configs: default)"
    )
    store = tmp_path / "store"
    r = invoke("build", "--data", snap, "--encoder", encoder_file,
               "--cache", store, "--column", "audio")  # fmt: skip
    assert r.returncode == 8, r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and said in line and "pass one split's files" in line
    prefix = f"s3://{s3.bucket}/snap/"
    names = ("README.md", "shards/alpha.parquet", "shards/beta.parquet")
    upload_shards(prefix, {n: snap / n for n in names})
    with pytest.raises(SourceError, match=re.escape(said)):
        build(prefix, encoder_file, cache=store, workers=0, column="audio")
    audio = tmp_path / "audio"
    write_audio_folder(audio / "a", 2, seconds=0.3, seed=1)
    write_audio_folder(audio / "b", 1, seconds=0.3, seed=2)
    (audio / "README.md").write_text(
        CARD_TWO_SPLITS.replace("shards/alpha.parquet", "a/*").replace("shards/beta.parquet", "b/*")
    )
    r = invoke("build", "--data", audio, "--encoder", encoder_file, "--cache", store)
    assert r.returncode == 8 and "declares the splits train (a/*), heldout (b/*)" in r.stderr
    upload_shards(f"s3://{s3.bucket}/audio/", {
        str(p.relative_to(audio)): p for p in audio.rglob("*") if p.is_file()
    })  # fmt: skip
    with pytest.raises(SourceError, match=re.escape("heldout (b/*)")):
        build(f"s3://{s3.bucket}/audio/", encoder_file, cache=store, workers=0)
    one = "---\nconfigs:\n- config_name: default\n  data_files: shards/*.parquet\n---\n"
    for card in (one, "---\nlicense: mit\n---\n# card\n", "# no front matter\n"):
        (snap / "README.md").write_text(card)
        assert served_rows(snap, encoder_file, store, "label") == [0, 1, 2]


def test_files_in_dunder_folders_are_no_split_locally_or_under_a_prefix(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """``__pycache__/test/b.wav`` is in no split to ``datasets`` (it leaves ``__name__/``
    folders out, as featbake's shard and table walks do: in9.12), but a folder's (a prefix's)
    input scan read it, so ``spk1/`` beside it was refused as a split beside files of none.
    Now the folder and the prefix build their 2 clips, each served equal to the encoder now
    (in10.8)."""
    audio = tmp_path / "audio"
    write_audio_folder(audio / "spk1", 2, seconds=0.3, seed=5)
    write_audio_folder(audio / "__pycache__" / "test", 1, seconds=0.3, seed=6)
    assert datasets_splits(audio) == {"train": ["spk1/clip00000.wav", "spk1/clip00001.wav"]}
    assert_serves_live(audio, encoder_file, tmp_path / "store", 2)
    prefix = f"s3://{s3.bucket}/dunder/"
    upload_shards(prefix, {
        str(p.relative_to(audio)): p for p in audio.rglob("*.wav")
    })  # fmt: skip
    report = build(prefix, encoder_file, cache=tmp_path / "store", workers=0)
    assert (report.encoded + report.reused, report.failed) == (2, [])
    ds = CachedFeatureDataset(prefix, encoder_file, cache=tmp_path / "store", on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["spk1/clip00000.wav", "spk1/clip00001.wav"]
    for i in range(2):
        want = live_features(encoder_file, audio / ds.item_id(i))
        torch.testing.assert_close(ds[i], want, msg=ds.item_id(i))


def test_a_folder_with_a_datasets_metadata_file_says_how_to_serve_in_its_order(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``load_dataset("audiofolder")`` orders a folder's rows by its ``metadata.csv`` (and
    takes its columns); a folder build serves the files in path order, so labels in
    ``datasets``' order paired with the store's (``StackDataset``, same length) were paired
    with other clips, and nothing said so. The build says so in a note with the command that
    serves the file's order; that command serves its rows in its order, labels in
    ``ds.row(i)``, each equal to the encoder run now."""
    data = tmp_path / "audio"
    clips = write_audio_folder(data, 3, seconds=0.3, seed=4)
    order = [clips[2], clips[0], clips[1]]
    rows = "".join(f"{p.name},{label}\n" for label, p in enumerate(order))
    (data / "metadata.csv").write_text("file_name,label\n" + rows)
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 0, result.stderr
    said = f"pass --data {data.resolve()}/metadata.csv --column file_name"
    assert said in result.stdout + result.stderr, result.stdout + result.stderr
    manifest = data / "metadata.csv"
    args = ("--data", manifest, "--column", "file_name", "--encoder", encoder_file)
    assert invoke("build", *args, "--cache", store).returncode == 0
    ds = CachedFeatureDataset(manifest, encoder_file, cache=store, column="file_name",
                              on_miss="error")  # fmt: skip
    assert [ds.row(i) for i in range(3)] == [{"label": str(n)} for n in range(3)]
    for i, clip in enumerate(order):  # the file's order, not the folder's
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip))


def test_a_folder_with_a_parquet_metadata_file_is_said_too() -> None:
    """``datasets`` reads ``metadata.parquet`` as it reads ``metadata.csv``
    (``folder_based_builder.METADATA_FILENAMES``): the note names it, and since a ``.parquet``
    ``--data`` is read as a table of cells, says to write it as a CSV manifest first."""
    from featbake.store.byteplace import metadata_note

    note = metadata_note("/d", ["a.wav", "metadata.parquet"])
    assert note.startswith("/d/metadata.parquet orders the rows"), note
    assert "pass --data /d/metadata.csv (written from it, the same columns)" in note, note
    assert metadata_note("/d", ["a.wav", "notes.csv"]) == ""
