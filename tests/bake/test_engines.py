"""The build's engine seam (``build(..., engine=...)``) with an engine of the user's own that
runs each task in this process: one written before engines could hash (no ``digester``) still
builds, its inputs hashed here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from featbake.bake import pipeline
from featbake.bake.pipeline import (
    BuildEncoder,
    EngineJob,
    PartEncoder,
    PartResult,
    ProgressFn,
    WorkItem,
    build,
)
from featbake.encode.tables import CarriedCell
from featbake.errors import CacheMiss
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store import hash_cache
from featbake.store.hash_cache import HashRow
from featbake.testing import write_audio_folder
from tests.conftest import live_features
from tests.encode.test_containers import wav_bytes, write_audio_parquet, write_tar
from tests.encode.test_manifests import reference, write_jsonl
from tests.helpers import rewrite_each, stored_features, wait_past_racy


class InProcess:
    """An engine that encodes its work items here, in one task, through the worker every
    engine's tasks run (:class:`PartEncoder`); it has no ``digester``."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []

    @contextlib.contextmanager
    def started(self) -> Iterator[InProcess]:
        yield self

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        self.items += items
        return PartEncoder(job).encode(items)


def test_an_engine_without_a_digester_hashes_here_and_builds(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    engine = InProcess()
    report = build(audio_dir, encoder_file, cache=tmp_path / "store", engine=engine)  # type: ignore[arg-type]
    assert (report.failed, report.encoded, len(engine.items)) == ([], 16, 16)
    got = stored_features(tmp_path / "store", report.root)
    assert len(got) == 16
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel))


# == round nine: a worker on another node ======================================================
class SeenElsewhere(InProcess):
    """An engine whose worker sees each input's stat other than the driver did by ``shift``
    (its fields moved by one): a mount that numbers inodes per node shows another node other
    inode numbers and ctimes for the same, unchanged file."""

    def __init__(self, *shift: str) -> None:
        super().__init__()
        self.shift = shift

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        moved = []
        for it in items:
            assert it.stat is not None
            stat = it.stat._replace(**{f: getattr(it.stat, f) + 1 for f in self.shift})
            moved.append(it._replace(stat=stat))
        return super().encode(job, moved, progress)


@pytest.mark.parametrize(
    ("worker_host", "shift", "encoded"),
    [
        ("node-2", ("inode", "ctime_ns"), 16),  # another node: its own inode numbers
        (None, ("inode", "ctime_ns"), 0),  # the driver's host: an inode differing is a change
        # another node: the driver's stat is not compared there, the bytes read are (cl9.14)
        ("node-2", ("mtime_ns",), 16),
        ("node-2", ("size",), 16),
    ],
)
def test_a_worker_on_another_node_compares_size_and_mtime_not_its_mounts_inodes(
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    worker_host: str | None,
    shift: tuple[str, ...],
    encoded: int,
) -> None:
    """Round nine, engines: a Ray worker checked each input after decoding against the
    driver's stat whole, inode and ctime included; on a shared mount that shows each node
    other inode numbers every input of a worker on another node was refused as changed. A
    worker on another node now hashes what it reads and compares the key it makes with the
    item's (cl9.14: the driver's stat is not compared there, so a stat moved in any field
    encodes the unchanged files); on the driver's host the whole stat is still compared."""
    if worker_host is not None:  # the worker's host; the job names the driver's, made before
        monkeypatch.setattr(pipeline, "this_host", lambda: worker_host, raising=False)
    engine = SeenElsewhere(*shift)
    store = tmp_path / "store"
    report = build(audio_dir, encoder_file, cache=store, engine=engine)  # type: ignore[arg-type]
    assert (report.encoded, len(report.failed)) == (encoded, 16 - encoded)
    assert all("changed while featbake was reading it" in why for _, why in report.failed)
    got = stored_features(store, report.root) if encoded else {}
    assert len(got) == encoded
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel))


def shifted_carried(carried: object | None, shift: tuple[str, ...]) -> object | None:
    """A table cell's carried value as the driver's host saw it: the stat its scan read the
    file's rows at moved as the item's stat is (the driver's stats, all of them)."""
    if isinstance(carried, CarriedCell) and carried.scanned is not None:
        scanned = carried.scanned
        moved = scanned._replace(**{f: getattr(scanned, f) + 1 for f in shift})
        return dataclasses.replace(carried, scanned=moved)
    return carried


class ContainersSeenElsewhere(SeenElsewhere):
    """:class:`SeenElsewhere` whose table cells' carried scan stats move too (the driver
    carries the stat its own scan read each file's rows at)."""

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        moved = [it._replace(carried=shifted_carried(it.carried, self.shift)) for it in items]
        return super().encode(job, moved, progress)


def data_of(kind: str, audio: Path, folder: Path) -> tuple[Path, dict[str, Path]]:
    """Six of ``audio``'s clips as a manifest's rows (each naming its file), as members of a
    tar shard, or as cells of a parquet file; with each item's name -> the clip it is."""
    clips = sorted(audio.rglob("*.wav"))[:6]
    folder.mkdir()
    if kind == "manifest":
        rows = folder / "rows.jsonl"
        lines = [json.dumps({"id": f"c{i}", "path": str(c)}) + "\n" for i, c in enumerate(clips)]
        rows.write_text("".join(lines))
        return rows, {f"c{i}": c for i, c in enumerate(clips)}
    if kind == "tar":
        samples = [(f"c{i}", {"wav": c.read_bytes()}) for i, c in enumerate(clips)]
        write_tar(folder / "shard-000.tar", samples)
        return folder, {f"c{i}": c for i, c in enumerate(clips)}  # a sample by its key
    write_audio_parquet(folder / "a.parquet", [c.read_bytes() for c in clips])
    return folder, {f"a.parquet:{i}": c for i, c in enumerate(clips)}


@pytest.mark.parametrize("kind", ["manifest", "tar", "parquet"])
@pytest.mark.parametrize(
    ("worker_host", "shift", "encoded"),
    [
        ("node-2", ("inode", "ctime_ns"), 6),  # another node: its own inode numbers
        (None, ("inode", "ctime_ns"), 0),  # the driver's host: an inode differing is a change
        # another node: the driver's stat is not compared there, the bytes read are (cl9.14)
        ("node-2", ("mtime_ns",), 6),
        ("node-2", ("size",), 6),
    ],
)
def test_rows_members_and_cells_on_another_node_compare_their_files_size_and_mtime(
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    worker_host: str | None,
    shift: tuple[str, ...],
    encoded: int,
) -> None:
    """Round nine, engines: a manifest row, a tar member and a table cell each carry the stat
    of the file holding them, and a worker on another node compared it whole (inode and ctime
    included) with its own stat of that file, refusing every item of a mount that numbers
    inodes per node. Now each is hashed there as read and its key compared, as for a plain
    file (cl9.14); on the driver's host the whole stat still is compared."""
    data, clips = data_of(kind, audio_dir, tmp_path / "data")
    if worker_host is not None:  # the worker's host; the job names the driver's, made before
        monkeypatch.setattr(pipeline, "this_host", lambda: worker_host, raising=False)
    store = tmp_path / "store"
    engine = ContainersSeenElsewhere(*shift)
    report = build(data, encoder_file, cache=store, engine=engine)  # type: ignore[arg-type]
    assert (report.encoded, len(report.failed)) == (encoded, 6 - encoded), report.failed
    changed = ("changed while featbake was reading it", "changed since it was hashed", "replaced")
    assert all(any(c in why for c in changed) for _, why in report.failed), report.failed
    got = stored_features(store, report.root) if encoded else {}
    assert sorted(got) == (sorted(clips) if encoded else [])
    for name, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, clips[name]))


def test_a_part_result_travels_as_json_with_its_failures_and_error_typed() -> None:
    """A task's result goes back to the driver as JSON: its failures (name, reason) and the
    error it carried come back equal, the error raised as its own class with its own line,
    and the failures counted in the build's report by name."""
    from featbake.bake.pipeline import CarriedError, Failure
    from featbake.bake.report import BuildReport, FailureCause
    from featbake.errors import SourceError

    changed = SourceError("b.wav: changed while featbake was reading it")
    failed = [Failure("a.wav", "cannot decode: x")]
    error = PartResult.raised(changed).error
    result = PartResult(3, 1, failed=failed, causes=[FailureCause.DATA], error=error)
    back = PartResult.from_json(result.to_json())
    assert back == result
    assert back.error == CarriedError("SourceError", "b.wav: changed while featbake was reading it")
    with pytest.raises(SourceError, match=r"^b\.wav: changed while featbake was reading it$"):
        back.raise_error()
    report = BuildReport("r", "d", "e", "fp", "rfp", 3)
    back.add_to(report)
    assert (report.encoded, report.failed) == (1, [("a.wav", "cannot decode: x")])
    PartResult.from_json(PartResult().to_json()).raise_error()  # nothing carried: no raise


# == round nine: rewritten in place, its mtime kept, before a worker on another node reads it ====
class RewrittenBeforeTheTask(InProcess):
    """An engine whose task starts after ``rewrite`` ran: between the driver's hashing and the
    worker's reads."""

    def __init__(self, rewrite: Callable[[], None]) -> None:
        super().__init__()
        self.rewrite = rewrite

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        self.rewrite()
        return super().encode(job, items, progress)


#: item id -> (the file holding what the driver hashed for it, its span's start and end)
Wanted = dict[str, tuple[Path, float | None, float | None]]


def rewritten_data(kind: str, tmp: Path) -> tuple[Path, Path, Callable[[], None], Wanted]:
    """(the data built, a copy of it as the driver hashed it, its rewrite in place with other
    audio of the same size, each item's audio as hashed): a folder's files, a tar's members,
    a parquet file's cells (each pair of rows swapped) or a manifest's segments of one
    recording."""
    data, old, clips = tmp / "data", tmp / "old", tmp / "clips"
    for d in (data, old, clips):
        d.mkdir()
    if kind == "folder":
        write_audio_folder(data, 3, seconds=0.5, seed=4)
        shutil.copytree(data, old, dirs_exist_ok=True)
        files = sorted(data.iterdir())
        others = {f: wav_bytes(0.5, seed=90 + i) for i, f in enumerate(files)}
        want: Wanted = {f.name: (old / f.name, None, None) for f in files}
        return data, old, lambda: rewrite_each(others), want
    if kind == "manifest":
        rec, old_rec = data / "rec.wav", old / "rec.wav"
        rec.write_bytes(wav_bytes(2.0, seed=3))
        old_rec.write_bytes(rec.read_bytes())
        spans = [(0.2 * i, 0.2 * i + 0.3) for i in range(4)]
        for where, f in ((data, rec), (old, old_rec)):
            rows = [
                {"id": f"u{i}", "path": str(f), "start": s, "end": e}
                for i, (s, e) in enumerate(spans)
            ]
            write_jsonl(where / "train.jsonl", rows)
        new = {rec: wav_bytes(2.0, seed=30)}
        want = {f"u{i}": (old_rec, s, e) for i, (s, e) in enumerate(spans)}
        return data / "train.jsonl", old / "train.jsonl", lambda: rewrite_each(new), want
    audio = [wav_bytes(0.5, seed=i) for i in range(4)]
    for i, b in enumerate(audio):
        (clips / f"{i}.wav").write_bytes(b)
    if kind == "tar":
        write_tar(data / "s.tar", [(f"c{i}", {"wav": b}) for i, b in enumerate(audio)])
        other = [(f"c{i}", {"wav": wav_bytes(0.5, seed=40 + i)}) for i in range(4)]
        again = write_tar(tmp / "again.tar", other)
        names = [f"c{i}" for i in range(4)]
    else:  # parquet: the same cells, each pair of rows swapped
        write_audio_parquet(data / "t.parquet", audio)
        again = write_audio_parquet(tmp / "again.parquet", [audio[i ^ 1] for i in range(4)])
        names = [f"t.parquet:{i}" for i in range(4)]
    shutil.copytree(data, old, dirs_exist_ok=True)
    (target,) = data.iterdir()
    rewritten = {target: again.read_bytes()}
    want = {n: (clips / f"{i}.wav", None, None) for i, n in enumerate(names)}
    return data, old, lambda: rewrite_each(rewritten), want


@pytest.mark.parametrize("kind", ["folder", "tar", "parquet", "manifest"])
def test_an_input_rewritten_with_its_mtime_kept_before_a_worker_on_another_node_reads_it(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Round nine, engines (corrects cl9.4, cl9.5): a worker on another node took a file whose
    size and mtime were the driver's as the version the driver hashed, so an input rewritten
    in place with its mtime set back between the driver's hashing and the worker's reads had
    the new audio's features stored under the old bytes' key: a dataset over copies of the old
    data was served the new audio's features for every item. The worker now hashes what it
    reads and refuses each item whose key those bytes do not make, one line each."""
    data, old, rewrite, want = rewritten_data(kind, tmp_path)
    monkeypatch.setattr(pipeline, "this_host", lambda: "node-2", raising=False)
    store = tmp_path / "store"
    report = build(data, encoder_file, cache=store, engine=RewrittenBeforeTheTask(rewrite))  # type: ignore[arg-type]
    wrong = 0
    if report.encoded:  # served from the store for the old data, against the encoder run now
        ds = CachedFeatureDataset(old, encoder_file, cache=store, on_miss="error")
        for i in range(len(ds)):
            file, start, end = want[ds.item_id(i)]
            now = reference(encoder_file, file, start, end)
            wrong += not torch.allclose(ds[i], now, rtol=1e-5, atol=1e-5)
        ds.close()
    assert (report.encoded, wrong, len(report.failed)) == (0, 0, len(want)), report.failed
    for _, why in report.failed:
        assert "\n" not in why and "changed since it was hashed" in why, why
        assert why.endswith("rerun the build"), why


class OneWorkerTwoTasks(InProcess):
    """An engine whose one worker (an actor) runs the build's items as two tasks, ``between``
    run after the first."""

    def __init__(self, between: Callable[[], None]) -> None:
        super().__init__()
        self.between = between

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        self.items += items
        worker, half = PartEncoder(job), len(items) // 2
        result = worker.encode(items[:half])
        self.between()
        result.add(worker.encode(items[half:]))
        return result


class CountedHashes(pipeline.HostHashes):
    """A worker's hash cache that counts the rows put in it, path by path."""

    put: ClassVar[Counter[str]] = Counter()

    def put_hashes(self, rows: Iterable[HashRow], *, recorded_ns: int | None = None) -> None:
        rows = list(rows)
        CountedHashes.put.update(r[0] for r in rows)
        super().put_hashes(rows, recorded_ns=recorded_ns)


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_worker_on_another_node_hashes_a_recording_once_for_its_tasks_segments(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch, rewritten: bool
) -> None:
    """Round nine, engines (after cl9.14): a worker on another node hashed a recording whole
    for every task naming its segments (a 10 h recording: once per task). Its own hash cache
    of this host's stats (``HostHashes``) keeps the digest for its later tasks; a recording
    rewritten in place with its mtime kept between two tasks shows this host another ctime,
    so it is hashed again and the second task's segments are refused. (Stats are made
    trustworthy at once: the racy window, which keeps a file stat'ed within its timestamp tick
    of a change from being trusted, is set to 0 here.)"""
    data, old, rewrite, want = rewritten_data("manifest", tmp_path)
    monkeypatch.setattr(pipeline, "this_host", lambda: "node-2", raising=False)
    monkeypatch.setattr(hash_cache, "racy_window_ns", lambda mtime, ctime: 0)
    monkeypatch.setattr(pipeline, "HostHashes", CountedHashes)
    CountedHashes.put.clear()
    engine = OneWorkerTwoTasks(rewrite if rewritten else lambda: None)
    report = build(data, encoder_file, cache=tmp_path / "store", engine=engine)  # type: ignore[arg-type]
    rec = str(data.parent / "rec.wav")
    assert CountedHashes.put[rec] == (2 if rewritten else 1), CountedHashes.put
    assert (report.encoded, len(report.failed)) == ((2, 2) if rewritten else (4, 0))
    ds = CachedFeatureDataset(old, encoder_file, cache=tmp_path / "store", on_miss="error")
    served = 0
    for i in range(len(ds)):
        file, start, end = want[ds.item_id(i)]
        try:
            got = ds[i]
        except CacheMiss:
            continue
        served += 1
        now = reference(encoder_file, file, start, end)
        torch.testing.assert_close(got, now, rtol=1e-5, atol=1e-5)
    ds.close()
    assert served == (2 if rewritten else 4)


# == round nine: a node of another featbake ====================================================
OLD_RESULT = {
    "items": 2, "encoded": 1, "reused": 0, "failed": [["a.wav", "cannot decode"]],
    "causes": ["data"], "bytes_written": 0, "shards_written": 0, "batching": "",
    "batching_note": "", "measured": None, "error_kind": "", "error": "",
}  # fmt: skip
OTHER_FEATBAKE = r"^.* runs another featbake than this node \(engine protocol 1, this node's \d+\)"


def test_a_result_from_a_worker_of_the_featbake_before_is_one_line() -> None:
    """A Ray node not yet upgraded sends the result JSON of the featbake before (failures as
    pairs, the error as two strings, no protocol number): the driver says the nodes run other
    featbakes, in one line, instead of failing inside the JSON (a TypeError before)."""
    from featbake.errors import ConfigError

    with pytest.raises(ConfigError, match=OTHER_FEATBAKE + r".*install the same featbake") as e:
        PartResult.from_json(json.dumps(OLD_RESULT))
    assert "\n" not in str(e.value)
    assert json.loads(PartResult().to_json())["protocol"] == pipeline.ENGINE_PROTOCOL


class OtherFeatbake(InProcess):
    """An engine whose driver is of another featbake: the job it sends its worker carries the
    protocol number before this one (a job pickled by it has none: read as 1)."""

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        self.items += items
        return PartEncoder(dataclasses.replace(job, protocol=1)).encode(items)


def test_a_worker_refuses_a_driver_of_another_featbake_in_one_line(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A worker sent a job by a driver of another featbake refuses it before loading the
    encoder: the build ends in the one line, nothing stored; a hashing task answers the same
    line (a driver of the featbake before calls it without a protocol)."""
    from featbake.bake.ray_engine import digest_batch
    from featbake.encode.fingerprints import DigestAsk
    from featbake.errors import ConfigError

    with pytest.raises(ConfigError, match=OTHER_FEATBAKE):
        build(audio_dir, encoder_file, cache=tmp_path / "store", engine=OtherFeatbake())  # type: ignore[arg-type]
    assert not list((tmp_path / "store").rglob("*.safetensors"))
    batch = digest_batch([DigestAsk(str(audio_dir / "a.wav"), None)])
    assert (batch.digested, batch.error is not None) == ([], True)
    with pytest.raises(ConfigError, match=OTHER_FEATBAKE):
        batch.raise_error()


def as_the_featbake_before_pickled_it(job: EngineJob) -> EngineJob:
    """``job`` as a worker unpickles it from a driver of the featbake before: its state has no
    ``protocol`` (that featbake's ``EngineJob`` had no such field)."""
    state = {k: v for k, v in vars(job).items() if k != "protocol"}
    old = object.__new__(EngineJob)
    old.__dict__.update(state)
    landed = pickle.loads(pickle.dumps(old))
    assert "protocol" not in vars(landed)
    return landed


class DriverOfTheFeatbakeBefore(InProcess):
    """An engine whose worker is sent the job as the featbake before pickled it."""

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        return PartEncoder(as_the_featbake_before_pickled_it(job)).encode(items)


def test_a_worker_refuses_a_job_pickled_by_a_driver_of_the_featbake_before(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round ten, engines (corrects cl9.16): the worker read ``getattr(job, "protocol", 1)``,
    but ``EngineJob``'s default is a class attribute, so a job pickled by a driver of the
    featbake before (no such field in its state) read as this node's number: the worker
    encoded and stored shards, then the old driver failed on the result. The number is read
    from the job's own state: refused in one line, nothing stored."""
    from featbake.errors import ConfigError

    with pytest.raises(ConfigError, match=OTHER_FEATBAKE):
        build(
            audio_dir,
            encoder_file,
            cache=tmp_path / "store",
            engine=DriverOfTheFeatbakeBefore(),  # type: ignore[arg-type]
        )
    assert not list((tmp_path / "store").rglob("*.safetensors"))


def read_as_the_featbake_before(text: str) -> PartResult:
    """A worker's result JSON as a driver of the featbake before read it (``PartResult.from_json``
    without a protocol: each key a field, so a key it does not know is a ``TypeError``)."""
    from featbake.bake.pipeline import CarriedError, Failure
    from featbake.bake.report import FailureCause

    doc = json.loads(text)
    measured, error = doc.pop("measured"), doc.pop("error")
    assert measured is None
    return PartResult(
        **doc
        | {
            "failed": [Failure(**f) for f in doc["failed"]],
            "causes": [FailureCause(c) for c in doc["causes"]],
            "error": None if error is None else CarriedError(**error),
        }
    )


class RayDriverOfTheFeatbakeBefore(InProcess):
    """A Ray build's driver of the featbake before: its actor (this featbake's ``PathActor``)
    is sent the job as that featbake pickled it, and its answer is read as that driver reads
    it."""

    def encode(
        self, job: EngineJob, items: Sequence[WorkItem], progress: ProgressFn | None
    ) -> PartResult:
        import numpy as np

        from featbake.bake import ray_engine

        batch = {
            "key": np.array([i.key for i in items]),
            "path": np.array([i.path for i in items]),
            "name": np.array([i.name for i in items]),
            "stat": np.array([ray_engine._stat_text(i.stat) for i in items]),
            "carried": np.array(
                [ray_engine._carried_bytes(i.carried) for i in items], dtype=object
            ),
        }
        actor = ray_engine.PathActor(as_the_featbake_before_pickled_it(job))
        result = read_as_the_featbake_before(actor(batch)[ray_engine.RESULT][0])
        result.raise_error()
        return result


def test_a_driver_of_the_featbake_before_gets_its_workers_refusal_as_one_line(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Round ten, engines (the other way of hd10.5): a Ray actor refusing a driver of the
    featbake before carried the refusal back in a result JSON with a protocol number, a key
    that driver's ``from_json`` does not know (a ``TypeError``, its CLI's internal error). A
    driver of protocol 1 is answered in its own shape, and reads the refusal's one line."""
    from featbake.errors import ConfigError

    with pytest.raises(ConfigError, match=OTHER_FEATBAKE + r".*install the same featbake") as e:
        build(
            audio_dir,
            encoder_file,
            cache=tmp_path / "store",
            engine=RayDriverOfTheFeatbakeBefore(),  # type: ignore[arg-type]
        )
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "store").rglob("*.safetensors"))


def test_an_encoder_file_replaced_after_its_key_was_taken_is_refused_at_its_load(
    tmp_path: Path,
) -> None:
    """An engine's worker was handed the driver's fingerprint and copied it onto whatever file
    it loaded: a checkpoint replaced after the driver keyed the build stored its features
    under the old encoder's keys (a Ray build: every item wrong, and `verify` clean). So did
    a plain build whose cached fingerprint was looked up before the file was replaced. A file
    whose stat is not the one looked up is hashed at its load, and refused unless it is the
    same encoder (another node's copy of the same checkpoint loads)."""
    from featbake.errors import EncoderLoadError
    from featbake.recipe import Recipe
    from featbake.store.catalog import Catalog
    from featbake.store.layout import Layout
    from featbake.testing import TinyConvEncoder, save_torchscript

    path = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "enc.pt")
    wait_past_racy(tmp_path)  # else its fingerprint, taken so soon after it, is not cached
    other = save_torchscript(TinyConvEncoder(seed=1), tmp_path / "other.pt")
    copy = tmp_path / "node-b" / "enc.pt"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    write_audio_folder(tmp_path / "audio", 2)
    report = build(tmp_path / "audio", path, cache=tmp_path / "store", workers=0)
    cpu, recipe = torch.device("cpu"), Recipe()
    with Catalog(Layout(tmp_path / "store")) as catalog:
        named = BuildEncoder.named(path, None, cpu, False, recipe, catalog)
    assert named.loaded is None and named.known_fp == report.encoder_fp  # keyed unloaded
    assert named.load().fingerprint == report.encoder_fp  # the same file: no hash
    for spec, same in ((copy, True), (other, False)):  # a worker given the driver's key
        worker = BuildEncoder(spec, None, cpu, False, recipe, "enc.pt", named.kind,
                              known_fp=report.encoder_fp)  # fmt: skip
        if same:
            assert worker.load().fingerprint == report.encoder_fp
        else:
            with pytest.raises(EncoderLoadError, match="changed while this build ran"):
                worker.load()
    with Catalog(Layout(tmp_path / "store")) as catalog:
        named = BuildEncoder.named(path, None, cpu, False, recipe, catalog)
    os.replace(other, path)  # replaced between the key's lookup and the load
    with pytest.raises(EncoderLoadError, match="changed while this build ran"):
        named.load()


@pytest.mark.parametrize(("worker_host", "hashed"), [(None, 0), ("node-2", 1)])
def test_a_worker_on_the_drivers_host_trusts_its_fingerprint_of_the_unchanged_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_host: str | None, hashed: int
) -> None:
    """Each engine worker hashed the checkpoint's weights at its load (r18.13's check), even
    on the driver's host, where the file's stat is the one the driver's fingerprint stands
    for. The job now carries that stat: a worker there that loads the file unchanged skips
    the hash; on another host it still hashes (and the features are the encoder's)."""
    from featbake.testing import TinyConvEncoder, save_torchscript

    path = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "enc.pt")
    wait_past_racy(tmp_path)
    write_audio_folder(tmp_path / "audio", 2)
    if worker_host is not None:  # the worker's host; the job names the driver's, made before
        monkeypatch.setattr(pipeline, "this_host", lambda: worker_host, raising=False)
    checks: list[str] = []
    real = BuildEncoder._check_same_encoder

    def hashed_weights(self: BuildEncoder, loaded: object) -> None:
        checks.append(self.label)
        real(self, loaded)  # type: ignore[arg-type]

    monkeypatch.setattr(BuildEncoder, "_check_same_encoder", hashed_weights)
    store = tmp_path / "store"
    report = build(tmp_path / "audio", path, cache=store, engine=InProcess())  # type: ignore[arg-type]
    assert (report.encoded, report.failed, len(checks)) == (2, [], hashed)
    for rel, parts in stored_features(store, report.root).items():
        torch.testing.assert_close(parts[""], live_features(path, tmp_path / "audio" / rel))
