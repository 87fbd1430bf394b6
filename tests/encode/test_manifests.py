"""Manifests, Kaldi data folders and lhotse cuts: items that are rows, many of them segments of
long recordings (issue 29 items 1, 2, 5 and 6).

The recordings are made here by concatenating clips (two recordings at rates other than the
recipe's, one of them stereo); every served item is checked against a reference computed
without featbake's code: soundfile reads the span, numpy mixes (or picks the channel), soxr
resamples, and the TorchScript encoder, loaded afresh, runs on it.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import importlib.util
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator, Sequence
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import soxr
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import featbake.store.byteplace as byteplace
from featbake.bake.pipeline import build
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.inputs import CUT_FIELDS, FirstLine, Folder, inputs_at
from featbake.encode.manifests import CutsInputs, KaldiInputs, ManifestInputs
from featbake.encode.sources import AudioSource
from featbake.errors import CacheMiss, ConfigError, SourceError
from featbake.export.zarr import export_zarr
from featbake.keys import item_digest
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.objects import ObjectStore
from featbake.store.url import BucketURL
from featbake.testing import make_tone, save_torchscript, write_audio_folder
from tests.conftest import REPO, invoke, live_features, run_cli
from tests.helpers import held_by_a_thread, manifest, printed, put_many, stored_features
from tests.store.bucket.conftest import S3

RATE = 16000  # the recipe's rate


# -- data made here --------------------------------------------------------------------------
def long_recording(path: Path, seconds: int, rate: int, seed: int, channels: int = 1) -> Path:
    """A recording concatenated from one-second clips of different "speakers" (seeds)."""
    clips = [make_tone(1.0, rate, seed=seed * 100 + i, channels=channels) for i in range(seconds)]
    soundfile.write(path, np.concatenate(clips), rate)
    return path


#: (utterance, recording, start, end, label, speaker): deliberately not in id order.
SEGMENTS = [
    ("utt-z", "recA", 0.25, 1.5, 3, "spk1"),
    ("utt-b", "recA", 1.5, 2.75, 1, "spk2"),
    ("utt-m", "recB", 0.0, 0.9, 0, "spk1"),
    ("utt-a", "recA", 3.1, 5.0, 2, "spk3"),
    ("utt-k", "recB", 2.2, 4.05, 1, "spk2"),
    ("utt-c", "recA", 0.25, 1.5, 3, "spk1"),  # the same span as utt-z: one key, one feature
]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``wavs/recA.wav`` (22.05 kHz mono, 6 s), ``wavs/recB.flac`` (8 kHz stereo, 5 s), a Kaldi
    folder ``kaldi/`` over them and the same segments as ``train.jsonl`` with labels. The
    working directory is ``tmp_path``, as a Kaldi or icefall recipe runs from the folder
    that its ``wav.scp`` and cuts' relative paths are relative to."""
    monkeypatch.chdir(tmp_path)
    wavs = tmp_path / "wavs"
    wavs.mkdir()
    long_recording(wavs / "recA.wav", 6, 22050, seed=1)
    long_recording(wavs / "recB.flac", 5, 8000, seed=2, channels=2)
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    (kaldi / "wav.scp").write_text(f"recA {wavs / 'recA.wav'}\nrecB wavs/recB.flac\n")
    lines = [f"{u} {r} {s} {e}" for u, r, s, e, _, _ in SEGMENTS]
    (kaldi / "segments").write_text("\n".join(lines) + "\n")
    (kaldi / "text").write_text("".join(f"{u} words of {u}\n" for u, *_ in SEGMENTS))
    (kaldi / "utt2spk").write_text("".join(f"{u} {spk}\n" for u, *_, spk in SEGMENTS))
    files = {"recA": "wavs/recA.wav", "recB": "wavs/recB.flac"}
    rows = [
        {"id": u, "path": files[r], "start": s, "end": e, "label": lab, "speaker": spk}
        for u, r, s, e, lab, spk in SEGMENTS
    ]
    write_jsonl(tmp_path / "train.jsonl", rows)
    return tmp_path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- the reference, without featbake ---------------------------------------------------------
def lhotse_count(seconds: float, rate: int) -> int:
    """Samples in ``seconds`` as lhotse's ``compute_num_samples`` counts them: half up."""
    return int(Decimal(round(seconds * rate, 8)).quantize(0, rounding=ROUND_HALF_UP))


def reference(
    encoder: Path,
    file: Path,
    start: float | None,
    end: float | None,
    channel: int | None = None,
    lhotse: bool = False,
) -> torch.Tensor:
    """The encoder run now on a span soundfile read, mixed (or one channel), soxr-resampled;
    its samples rounded to the nearest, or as lhotse counts them (a cut's start and duration,
    each half up)."""
    info = soundfile.info(str(file))
    rate = info.samplerate
    first = 0 if start is None else round(start * rate)
    last = info.frames if end is None else round(end * rate)
    if lhotse:
        first = lhotse_count(start or 0.0, rate)
        last = info.frames if end is None else first + lhotse_count(end - (start or 0.0), rate)
    audio, _ = soundfile.read(str(file), start=first, stop=last, dtype="float32", always_2d=True)
    mono = audio[:, channel] if channel is not None else audio.mean(axis=1)
    if rate != RATE:
        mono = soxr.resample(mono[:, None], rate, RATE, quality="HQ")[:, 0]
    with torchscript_quietly():
        module = torch.jit.load(str(encoder))
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))[None])[0]


def assert_items_are_segments(
    ds: CachedFeatureDataset, encoder: Path, corpus: Path, lhotse: bool = False
) -> None:
    """Every item of ``ds`` equals the encoder run now on its segment (SEGMENTS, in order; as
    lhotse counts a cut's samples where ``lhotse``)."""
    files = {"recA": corpus / "wavs" / "recA.wav", "recB": corpus / "wavs" / "recB.flac"}
    assert [ds.item_id(i) for i in range(len(ds))] == [u for u, *_ in SEGMENTS]
    for i, (_, rec, start, end, *_) in enumerate(SEGMENTS):
        want = reference(encoder, files[rec], start, end, lhotse=lhotse)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def assert_cuts_served(plain: Path, encoder_file: Path, store_dir: Path) -> None:
    """Build the cut manifest ``plain`` (cuts c0, c1 labelled 5, 6) by the CLI and check each
    cut is served with its label, equal to the encoder run now on what lhotse loads of it."""
    import lhotse

    result = invoke("build", "--data", plain, "--encoder", encoder_file, "--cache", store_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    ds = quiet_dataset(plain, encoder_file, store_dir, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["c0", "c1"]
    for i, cut in enumerate(lhotse.load_manifest(plain)):
        assert ds.row(i)["label"] == i + 5
        want = encoded_now(encoder_file, cut.load_audio(), cut.sampling_rate)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def quiet_dataset(data: Path, encoder: Path, cache: Path, **kw: Any) -> CachedFeatureDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "creating a store", live encoding
        return CachedFeatureDataset(data, encoder, cache=cache, **kw)


# -- dispatch and plumbing ---------------------------------------------------------------------
def test_inputs_at_picks_the_kind_of_data(corpus: Path) -> None:
    assert isinstance(inputs_at(corpus / "train.jsonl"), ManifestInputs)
    assert isinstance(inputs_at(corpus / "kaldi"), KaldiInputs)
    assert isinstance(inputs_at(corpus / "cuts.jsonl.gz"), CutsInputs)
    assert isinstance(inputs_at(corpus / "wavs"), Folder)
    assert Folder(corpus / "wavs").row("recA.wav") == {}
    with pytest.raises(ConfigError, match="--column audio names a column of a manifest"):
        inputs_at(corpus / "wavs", column="audio")


def test_segment_digest_covers_file_bounds_and_channel() -> None:
    sha = "ab" * 32
    d = item_digest("segment", sha, 1.5, 3.0, None)
    assert d == item_digest("segment", sha, 1.5, 3, None)  # 3 and 3.0 are one bound
    others = [
        item_digest("segment", sha, 1.5, 3.25, None),
        item_digest("segment", sha, 1.0, 3.0, None),
        item_digest("segment", sha, 1.5, 3.0, 0),
        item_digest("segment", "cd" * 32, 1.5, 3.0, None),
        item_digest("cell", sha, 1.5, 3.0, None),
    ]
    assert len({d, *others}) == 6 and sha not in others


# -- serving: Kaldi, JSONL and cuts over the same segments ------------------------------------
def test_kaldi_build_then_jsonl_serves_every_segment_as_the_encoder_now(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    report = build(corpus / "kaldi", encoder_file, cache=store_dir, workers=0)
    assert not report.failed and report.files == 6
    assert report.encoded == 5 and report.duplicates == 1  # utt-c is utt-z's span
    # The root names the utterances in the segments file's order, not sorted.
    assert [rel for rel, _ in manifest(store_dir, report.root)] == [u for u, *_ in SEGMENTS]

    ds = quiet_dataset(corpus / "kaldi", encoder_file, store_dir, on_miss="error")
    assert len(ds) == 6 and ds.stored() == 6
    assert_items_are_segments(ds, encoder_file, corpus)
    assert ds.row(0) == {"recording": "recA", "text": "words of utt-z", "speaker": "spk1"}
    assert ds.path(2).endswith("kaldi/segments:3")

    # The same segments as a JSONL manifest have the same keys: served with no encoding.
    js = quiet_dataset(corpus / "train.jsonl", encoder_file, store_dir, on_miss="error")
    assert [js.key(i) for i in range(6)] == [ds.key(i) for i in range(6)]
    assert js.stored() == 6
    assert_items_are_segments(js, encoder_file, corpus)
    assert [js.row(i)["label"] for i in range(6)] == [lab for *_, lab, _ in SEGMENTS]
    assert js.row(1) == {"label": 1, "speaker": "spk2"}


def test_a_manifest_never_built_encodes_its_segments_live(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    ds = quiet_dataset(corpus / "train.jsonl", encoder_file, store_dir)
    assert ds.stored() == 0 and len(ds) == 6
    assert_items_are_segments(ds, encoder_file, corpus)
    ds.flush()
    again = quiet_dataset(corpus / "train.jsonl", encoder_file, store_dir, on_miss="error")
    assert again.stored() == 6  # written back under the segments' keys
    assert_items_are_segments(again, encoder_file, corpus)


def test_lhotse_cuts_are_read_without_lhotse(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    files = {"recA": ("wavs/recA.wav", [0]), "recB": (str(corpus / "wavs/recB.flac"), [0, 1])}
    cuts = []
    for u, rec, start, end, _, spk in SEGMENTS:
        source, channels = files[rec]
        recording = {
            "id": rec,
            "sources": [{"type": "file", "channels": channels, "source": source}],
            "sampling_rate": 22050 if rec == "recA" else 8000,
        }
        sup = {"id": u, "recording_id": rec, "start": 0.0, "duration": end - start,
               "text": f"words of {u}", "speaker": spk}  # fmt: skip
        cut = {"id": u, "start": start, "duration": end - start, "recording": recording,
               "supervisions": [sup], "type": "MonoCut",
               "channel": channels if rec == "recB" else 0}  # fmt: skip
        cuts.append(json.dumps(cut))
    with gzip.open(corpus / "cuts.jsonl.gz", "wt") as f:
        f.write("\n".join(cuts) + "\n")
    # Decode workers: the segments' source travels to worker processes.
    report = build(corpus / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=2)
    assert not report.failed and report.files == 6
    ds = quiet_dataset(corpus / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    assert_items_are_segments(ds, encoder_file, corpus, lhotse=True)  # 0.25 s: 5,512.5 samples
    assert ds.row(3) == {"recording": "recA", "text": "words of utt-a", "speaker": "spk3"}


def test_csv_with_another_column_channels_and_whole_files(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A CSV names its input with --column; a row without start/end is the whole file (the same
    key as the file in a folder), ``channel`` picks one channel of a stereo file."""
    rows = [
        {"audio": "wavs/recB.flac", "start": "1.0", "end": "2.5", "channel": "1", "lab": "x"},
        {"audio": "wavs/recA.wav", "start": "", "end": "", "channel": "", "lab": "y"},
    ]
    with open(corpus / "clips.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    report = build(corpus / "clips.csv", encoder_file, cache=store_dir, column="audio", workers=0)
    assert not report.failed and report.encoded == 2
    ds = quiet_dataset(corpus / "clips.csv", encoder_file, store_dir, column="audio")
    assert ds.item_id(0) == "wavs/recB.flac#1.0-2.5@ch1" and ds.item_id(1) == "wavs/recA.wav"
    assert ds.row(0) == {"lab": "x"}
    wav_b, wav_a = corpus / "wavs/recB.flac", corpus / "wavs/recA.wav"
    torch.testing.assert_close(ds[0], reference(encoder_file, wav_b, 1.0, 2.5, channel=1))
    torch.testing.assert_close(ds[1], reference(encoder_file, wav_a, None, None))
    folder = quiet_dataset(corpus / "wavs", encoder_file, store_dir)
    assert folder.key(0) == ds.key(1)  # recA.wav whole: one key, in a folder or a manifest


# -- read once -------------------------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts files hashed and audio frames decoded (soundfile reads) in this process."""
    seen = {"hashed": 0, "frames": 0}
    real_hash, real_read = byteplace.sha256_file, soundfile.SoundFile.read

    def hashed(path: Any) -> str:
        seen["hashed"] += 1
        return real_hash(path)

    def read(self: soundfile.SoundFile, frames: int = -1, *args: Any, **kw: Any) -> Any:
        out = real_read(self, frames, *args, **kw)
        seen["frames"] += len(out)
        return out

    monkeypatch.setattr(byteplace, "sha256_file", hashed)
    monkeypatch.setattr(soundfile.SoundFile, "read", read)
    yield seen


def test_many_segments_hash_a_recording_once_and_read_only_their_spans(
    tmp_path: Path, encoder_file: Path, store_dir: Path, counted: dict[str, int]
) -> None:
    rec = long_recording(tmp_path / "long.wav", 20, 16000, seed=3)
    time.sleep(1.1)  # a file changed within the second its hash is cached is hashed again (racy)
    bounds = [(0.5 * i, 0.5 * i + 0.5) for i in range(40)]
    write_jsonl(
        tmp_path / "m.jsonl", [{"path": "long.wav", "start": s, "end": e} for s, e in bounds]
    )
    report = build(tmp_path / "m.jsonl", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 40 and not report.failed
    assert counted["hashed"] == 1  # one recording, hashed once for its 40 segments
    frames = soundfile.info(str(rec)).frames
    assert counted["frames"] == frames  # the spans tile it: every sample read exactly once
    again = build(tmp_path / "m.jsonl", encoder_file, cache=store_dir, workers=0)
    assert again.reused == 40 and counted["hashed"] == 1 and counted["frames"] == frames


# -- bad rows --------------------------------------------------------------------------------
def test_each_bad_row_is_skipped_with_its_line_and_the_rest_builds(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    rows: list[Any] = [
        {"path": "wavs/recA.wav", "start": 0.0, "end": 1.0, "label": 0},  # 1: good
        "{not json",  # 2
        {"file": "wavs/recA.wav"},  # 3: no path column
        {"path": "wavs/recA.wav", "start": 2.0, "end": 2.0},  # 4: start >= end
        {"path": "wavs/gone.wav"},  # 5: missing file
        {"path": "wavs/recA.wav", "start": 5.5, "end": 6.5},  # 6: past the end (6 s)
        {"path": "wavs/recA.wav", "start": 6.5},  # 7: to the end, from past the end
        {"path": "wavs/recB.flac", "start": 0.0, "end": 1.0, "channel": 2},  # 8: no channel 2
        {"path": "hdfs://bucket/a.wav"},  # 9: a scheme featbake does not read
        {"path": "wavs/recB.flac", "start": "x", "end": 1.0},  # 10: not seconds
        {"path": "wavs/recA.wav", "start": 1.0, "end": 2.0, "label": 1},  # 11: good
    ]
    write_jsonl(corpus / "bad.jsonl", rows)
    report = build(corpus / "bad.jsonl", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 2 and report.files == 11
    reasons = dict(report.failed)
    assert len(reasons) == 9
    assert "malformed JSON" in reasons["bad.jsonl:2"]
    assert "no 'path' column" in reasons["bad.jsonl:3"]
    assert "not before end" in reasons["bad.jsonl:4"]
    assert "bad.jsonl:5" in reasons["wavs/gone.wav"] and "gone.wav" in reasons["wavs/gone.wav"]
    past = reasons["wavs/recA.wav#5.5-6.5"]
    assert "bad.jsonl:6" in past and "past the end of its recording (6.000 s)" in past
    late = reasons["wavs/recA.wav#6.5-inf"]
    assert "bad.jsonl:7" in late and "starts at 6.5 s, at or past the end" in late
    no_channel = reasons["wavs/recB.flac#0.0-1.0@ch2"]
    assert "bad.jsonl:8" in no_channel
    assert "channel 2 is not one of the recording's 2 channels" in no_channel
    assert "speak s3://, gs://, az://, not hdfs://" in reasons["bad.jsonl:9"]
    assert "not a number of seconds" in reasons["bad.jsonl:10"]

    with pytest.warns(UserWarning, match="4 row"):  # gone, past the end (2), no such channel
        ds = CachedFeatureDataset(corpus / "bad.jsonl", encoder_file, cache=store_dir)
    assert [ds.row(i)["label"] for i in range(len(ds))] == [0, 1] and ds.stored() == 2
    want = reference(encoder_file, corpus / "wavs/recA.wav", 1.0, 2.0)
    torch.testing.assert_close(ds[1], want, rtol=1e-5, atol=1e-5)


def test_a_bad_file_named_whole_and_by_a_segment_is_named_in_both_reasons(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A file named whole is decoded from the bytes kept from hashing it, its segments' bounds
    read from them too: libsndfile then names ``<_io.BytesIO object at 0x...>``; the reasons
    name the file, as when it is read from its path."""
    (tmp_path / "bad.wav").write_bytes(b"not audio at all" * 64)
    rows = [{"id": "whole", "path": "bad.wav"}, {"id": "part", "path": "bad.wav", "end": 0.1}]
    write_jsonl(tmp_path / "m.jsonl", rows)
    report = build(tmp_path / "m.jsonl", encoder_file, cache=store_dir, workers=0)
    reasons = dict(report.failed)
    assert sorted(reasons) == ["part", "whole"]
    for why in reasons.values():
        assert f"'{tmp_path / 'bad.wav'}'" in why and "BytesIO" not in why, why
    assert "cannot decode audio" in reasons["whole"]
    assert "cannot read its audio header" in reasons["part"]


def test_segments_to_the_end_of_the_recording_kaldi_minus_one_and_rows_without_end(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Kaldi's ``end`` -1 and a JSONL row with no ``end`` run to the recording's end; a row
    with no ``start`` starts at 0; ``0 -1`` is the whole file, keyed as the file in a folder;
    a lhotse cut with no duration runs to the end. Before, -1 and a row with one bound were
    refused."""
    wav_a, flac_b = corpus / "wavs/recA.wav", corpus / "wavs/recB.flac"
    segments = corpus / "kaldi" / "segments"
    # -1 however it is written: a %.2f writer's "-1.00" was a bad row ("not a time")
    segments.write_text("utt-1 recA 4.5 -1\nutt-2 recB 3.25 -1.00\nutt-3 recA 0 -1.0\n")
    for name in ("text", "utt2spk"):
        (corpus / "kaldi" / name).unlink()
    report = build(corpus / "kaldi", encoder_file, cache=store_dir, workers=0)
    assert not report.failed and report.encoded == 3
    ds = quiet_dataset(corpus / "kaldi", encoder_file, store_dir, on_miss="error")
    torch.testing.assert_close(ds[0], reference(encoder_file, wav_a, 4.5, None))
    torch.testing.assert_close(ds[1], reference(encoder_file, flac_b, 3.25, None))
    torch.testing.assert_close(ds[2], reference(encoder_file, wav_a, None, None))
    folder = quiet_dataset(corpus / "wavs", encoder_file, store_dir)
    assert folder.key(0) == ds.key(2)  # recA whole: one key, in Kaldi or a folder

    rows = [
        {"id": "a", "path": "wavs/recA.wav", "start": 4.5},  # as utt-1: the same key
        {"id": "b", "path": "wavs/recB.flac", "end": 1.25, "channel": 1},
        {"id": "c", "path": "wavs/recB.flac", "start": 2.0, "channel": 0},
    ]
    write_jsonl(corpus / "open.jsonl", rows)
    report = build(corpus / "open.jsonl", encoder_file, cache=store_dir, workers=2)
    assert not report.failed and report.encoded == 2 and report.reused == 1
    js = quiet_dataset(corpus / "open.jsonl", encoder_file, store_dir, on_miss="error")
    assert js.key(0) == ds.key(0)
    torch.testing.assert_close(js[0], reference(encoder_file, wav_a, 4.5, None))
    torch.testing.assert_close(js[1], reference(encoder_file, flac_b, None, 1.25, channel=1))
    torch.testing.assert_close(js[2], reference(encoder_file, flac_b, 2.0, None, channel=0))

    recording = {"id": "recB", "sources": [{"type": "file", "channels": [0, 1],
                 "source": str(flac_b)}], "sampling_rate": 8000}  # fmt: skip
    cut = {"id": "cut-1", "start": 3.25, "recording": recording, "type": "MonoCut"}
    with gzip.open(corpus / "cuts.jsonl.gz", "wt") as f:
        f.write(json.dumps(cut) + "\n")
    report = build(corpus / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert not report.failed and report.reused == 1  # utt-2's span
    cuts = quiet_dataset(corpus / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    torch.testing.assert_close(cuts[0], reference(encoder_file, flac_b, 3.25, None))


def test_duplicate_ids_and_piped_wav_scp_are_refused_in_one_line(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    rows = [
        {"id": "a", "path": "wavs/recA.wav"},
        {"id": "b", "path": "x"},
        {"id": "a", "path": "y"},
    ]
    write_jsonl(corpus / "dup.jsonl", rows)
    with pytest.raises(SourceError, match=r"id 'a' is on two rows \(.*dup.jsonl:1 and .*:3\)"):
        build(corpus / "dup.jsonl", encoder_file, cache=store_dir)
    (corpus / "kaldi" / "wav.scp").write_text("recA sox in.sph -t wav - |\n")
    with pytest.raises(SourceError, match=r"wav.scp:1: recording recA is a command .* wav file"):
        build(corpus / "kaldi", encoder_file, cache=store_dir)
    # A recording on two lines: the last one was taken in silence, the first file never read.
    wavs = corpus / "wavs"
    (corpus / "kaldi" / "wav.scp").write_text(
        f"recA {wavs / 'recA.wav'}\nrecB {wavs / 'recB.flac'}\nrecA {wavs / 'recB.flac'}\n"
    )
    with pytest.raises(SourceError, match=r"recording id 'recA' is on lines 1 and 3 of .*wav.scp"):
        build(corpus / "kaldi", encoder_file, cache=store_dir)


def test_kaldi_bad_segments_lines_are_skipped(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    segments = corpus / "kaldi" / "segments"
    # A fifth field is the channel, as extract-segments takes it (before: "5 fields, not 4").
    extra = "utt-x recZ 0 1\nutt-y recA 1\nutt-w recB 0.5 1.5 1\nutt-v recB 0.5 1.5 left\n"
    segments.write_text(segments.read_text() + extra)
    report = build(corpus / "kaldi", encoder_file, cache=store_dir, workers=0)
    reasons = dict(report.failed)
    assert "recording 'recZ' is not in wav.scp" in reasons["segments:7"]
    assert "3 fields, not 4" in reasons["segments:8"]
    assert "channel 'left' is not a channel number" in reasons["segments:10"]
    assert report.encoded == 6 and len(reasons) == 3
    ds = quiet_dataset(corpus / "kaldi", encoder_file, store_dir, on_miss="error")
    assert ds.item_id(6) == "utt-w"
    want = reference(encoder_file, corpus / "wavs/recB.flac", 0.5, 1.5, channel=1)
    torch.testing.assert_close(ds[6], want, rtol=1e-5, atol=1e-5)


def test_cli_build_of_a_manifest_exits_3_naming_the_lines(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    rows: list[Any] = [{"path": "wavs/recA.wav", "start": 0, "end": 1}, "[1, 2", {"path": "no.wav"}]
    write_jsonl(corpus / "train.jsonl", rows)
    data = ("-d", corpus / "train.jsonl", "--column", "path")  # the default column, named
    got = invoke("build", "-e", encoder_file, *data, "--cache", store_dir)
    assert got.returncode == 3, got.stderr
    text = got.stdout + got.stderr
    assert "train.jsonl:2: malformed JSON" in text
    assert "train.jsonl:3" in text and "no.wav" in text
    assert "2 of 3 inputs failed" in text
    roots = invoke("roots", "--cache", store_dir, "--json")
    assert json.loads(roots.stdout)[0]["data"] == str(corpus / "train.jsonl")


def test_export_names_items_by_their_ids(corpus: Path, encoder_file: Path, store_dir: Path) -> None:
    build(corpus / "kaldi", encoder_file, cache=store_dir, workers=0)
    export_zarr(corpus / "f.zarr", cache=store_dir)
    g = zarr.open_group(str(corpus / "f.zarr"), mode="r")
    assert list(g["paths"][:]) == [u for u, *_ in SEGMENTS]


def test_tsv_line_numbers_and_revalidate_refused(
    corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    lines = ["path\tstart\tend\tword", "wavs/recA.wav\t0.5\t1.5\tyes", "wavs/recA.wav\t2.0"]
    lines += ["wavs/recA.wav\t2.0\t3.0\tno\textra", "wavs/recA.wav\t4.0\t4.5\tmaybe"]
    (corpus / "words.tsv").write_text("\n".join(lines) + "\n")
    report = build(corpus / "words.tsv", encoder_file, cache=store_dir, workers=0)
    assert dict(report.failed) == {
        "words.tsv:3": "fewer fields than the header names (2, not 4)",
        "words.tsv:4": "more fields than the header names (5, not 4)",
    }
    ds = quiet_dataset(corpus / "words.tsv", encoder_file, store_dir, on_miss="error")
    assert [ds.row(i) for i in range(len(ds))] == [{"word": "yes"}, {"word": "maybe"}]
    want = reference(encoder_file, corpus / "wavs/recA.wav", 4.0, 4.5)
    torch.testing.assert_close(ds[1], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"revalidate=True is not built for inputs .* manifest"):
        quiet_dataset(corpus / "words.tsv", encoder_file, store_dir, revalidate=True)


def test_rows_in_a_bucket_are_hashed_once_decoded_from_held_bytes_and_served(
    s3: S3, corpus: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``s3://`` rows: each object read once, to hash it and to decode all its segments; the
    features equal the same segments read locally (the same keys), and a rebuild reads none."""
    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/wavs"))
    for name in ("recA.wav", "recB.flac"):
        bucket.upload(name, corpus / "wavs" / name)
    reads: list[str] = []
    real = ObjectStore.read
    monkeypatch.setattr(ObjectStore, "read", lambda b, name: reads.append(name) or real(b, name))
    files = {"recA": f"s3://{s3.bucket}/wavs/recA.wav", "recB": f"s3://{s3.bucket}/wavs/recB.flac"}
    rows: list[Any] = [
        {"id": u, "path": files[r], "start": s, "end": e, "label": lab}
        for u, r, s, e, lab, _ in SEGMENTS
    ]
    rows.append({"path": files["recA"], "start": 5.5, "end": 6.5})  # past the end: line 7
    rows.append({"path": f"s3://{s3.bucket}/wavs/gone.wav"})  # line 8
    write_jsonl(corpus / "s3.jsonl", rows)
    report = build(corpus / "s3.jsonl", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 5 and report.duplicates == 1
    reasons = dict(report.failed)
    assert "s3.jsonl:7" in reasons[f"{files['recA']}#5.5-6.5"]
    assert "past the end of its recording" in reasons[f"{files['recA']}#5.5-6.5"]
    assert "s3.jsonl:8" in reasons[f"s3://{s3.bucket}/wavs/gone.wav"]
    # one GET each: hashed (by the bucket's client: names are keys), then decoded from its bytes
    assert sorted(reads) == ["wavs/recA.wav", "wavs/recB.flac"]

    local = quiet_dataset(corpus / "train.jsonl", encoder_file, store_dir, on_miss="error")
    assert local.stored() == 6  # the same segments' keys, wherever their bytes were read
    reads.clear()
    with pytest.warns(UserWarning, match="1 row"):
        ds = CachedFeatureDataset(corpus / "s3.jsonl", encoder_file, cache=store_dir)
    # the segment past its recording's end, which the build could not decode, is left out
    assert len(ds) == 6 and ds.stored() == 6 and reads == []  # the hash cache knew both
    assert_items_are_segments(local, encoder_file, corpus)
    for i in range(6):
        torch.testing.assert_close(ds[i], local[i])
    assert ds.row(0) == {"label": 3}

    live = quiet_dataset(corpus / "s3.jsonl", encoder_file, corpus / "other-store")
    reads.clear()
    torch.testing.assert_close(live[1], local[1])  # a miss: the segment decoded from the bucket
    torch.testing.assert_close(live[3], local[3])
    assert reads == ["wavs/recA.wav"]  # held for its next segment (the bucket's client: a key)


def test_live_decoding_of_rows_in_several_folders_makes_one_client_per_bucket(
    s3: S3, corpus: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset decoding ``s3://`` rows live made a client per folder of its rows (~0.1-0.2 s
    each); it makes one per bucket, and every feature is the encoder's on that segment now."""
    local = {"wavs": corpus / "wavs" / "recA.wav", "more": corpus / "wavs" / "recB.flac"}
    for folder, file in local.items():
        ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/{folder}")).upload(file.name, file)
    rows = [
        {"id": f"{folder}-{k}", "path": f"s3://{s3.bucket}/{folder}/{file.name}", "start": k,
         "end": k + 1.0}
        for folder, file in local.items() for k in (0.0, 1.0)
    ]  # fmt: skip
    write_jsonl(corpus / "two.jsonl", rows)
    made: list[str] = []
    real_init = ObjectStore.__init__

    def counted(self: ObjectStore, *args: Any, **kwargs: Any) -> None:
        made.append(str(args[0]) if args else "")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "__init__", counted)
    # Opening reads each object's header (its rate keys the segments), decoding its bytes.
    ds = quiet_dataset(corpus / "two.jsonl", encoder_file, tmp_path / "store")
    got = [ds[i] for i in range(len(ds))]  # misses: decoded from the bucket
    # One, through the byte seam: it stats the rows' objects, reads their headers (their rates
    # key the segments) and decodes every row (one per folder before, then one per use).
    assert made == [f"s3://{s3.bucket}"], made
    for x, row in zip(got, rows, strict=True):
        want = reference(encoder_file, local[row["id"].split("-")[0]], row["start"], row["end"])
        torch.testing.assert_close(x, want)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_decode_bucket_rows_with_objects_of_their_own(
    s3: S3, corpus: Path, encoder_file: Path, store_dir: Path, context: str
) -> None:
    """``s3://`` rows encoded live in DataLoader workers, forked while a thread of the parent
    held the bytes' lock (a build's decode thread, a dataset's miss): each worker reads the
    objects with a lock and bytes of its own (the inherited lock held hung a forked worker's
    first row), and every feature equals the encoder run now on its segment."""
    from torch.utils.data import DataLoader

    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/wavs"))
    for name in ("recA.wav", "recB.flac"):
        bucket.upload(name, corpus / "wavs" / name)
    files = {"recA": f"s3://{s3.bucket}/wavs/recA.wav", "recB": f"s3://{s3.bucket}/wavs/recB.flac"}
    rows = [{"id": u, "path": files[r], "start": s, "end": e} for u, r, s, e, *_ in SEGMENTS]
    write_jsonl(corpus / "s3.jsonl", rows)
    ds = quiet_dataset(corpus / "s3.jsonl", encoder_file, store_dir)
    objects = ds._misses.source.objects  # type: ignore[attr-defined]
    with held_by_a_thread(objects.lock):  # a thread inside the held bytes' lock at the fork
        loader = DataLoader(
            ds, batch_size=None, num_workers=1, multiprocessing_context=context, timeout=30
        )
        got = list(loader)
    local = {"recA": corpus / "wavs" / "recA.wav", "recB": corpus / "wavs" / "recB.flac"}
    for x, (_, rec, start, end, *_) in zip(got, SEGMENTS, strict=True):
        torch.testing.assert_close(x, reference(encoder_file, local[rec], start, end))


# -- rows naming many objects of a folder: its LIST pages, not a HEAD each --------------------
def bucket_requests(s3: S3, mark: int) -> dict[str, list[str]]:
    """The requests for this test's bucket the server answered since ``mark`` by kind: LIST
    (``GET /bucket?list-type=2``), HEAD and GET (of an object), each with its target."""
    out: dict[str, list[str]] = {"LIST": [], "HEAD": [], "GET": []}
    for r in s3.requests(mark):
        kind = "LIST" if r.method == "GET" and "list-type=2" in r.name else r.method
        out.setdefault(kind, []).append(r.name)
    return out


def assert_rows_live(store: Path, root: str, encoder: Path, files: dict[str, Path]) -> None:
    """Every stored item (named by its URL) equals the encoder run now on its local twin."""
    stored = stored_features(store, root)
    assert sorted(stored) == sorted(files)
    for url, parts in stored.items():
        torch.testing.assert_close(parts[""], live_features(encoder, files[url]), msg=url)


@pytest.mark.parametrize("page", [1000, 10])
def test_a_manifest_of_a_folders_objects_lists_it_and_heads_only_the_missing_row(
    s3: S3, tmp_path: Path, encoder_file: Path, store_dir: Path, page: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A manifest naming a folder's 24 objects: a first build and a rebuild stat them with one
    LIST per page (``page``: S3's 1,000, and 10 to make several pages), not a HEAD per row one
    after another (the old code: 25 HEADs per build); only the missing row is HEADed, and fails
    by its line. The two objects an earlier build hashed by their HEADs are not read again: a
    listed stat is the stat their GET recorded. Every stored feature is the encoder's now."""
    monkeypatch.setattr("featbake.store.byteplace.LIST_PAGE_KEYS", page)
    clips = write_audio_folder(tmp_path / "clips", 24, seconds=(0.2, 0.4), seed=5)
    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/clips"))
    for clip in clips:
        bucket.upload(clip.name, clip)
    files = {f"s3://{s3.bucket}/clips/{c.name}": c for c in clips}
    urls = list(files)
    gone = f"s3://{s3.bucket}/clips/gone.wav"

    write_jsonl(tmp_path / "two.jsonl", [{"path": u} for u in urls[:2]])
    mark = s3.log_mark()
    two = build(tmp_path / "two.jsonl", encoder_file, cache=store_dir, workers=0)
    sent = bucket_requests(s3, mark)
    assert (two.encoded, len(sent["LIST"]), len(sent["HEAD"]), len(sent["GET"])) == (2, 0, 2, 2)

    write_jsonl(tmp_path / "all.jsonl", [*({"path": u} for u in urls), {"path": gone}])
    for new in (22, 0):  # a first build of the 22 others, then a rebuild
        mark = s3.log_mark()
        report = build(tmp_path / "all.jsonl", encoder_file, cache=store_dir, workers=0)
        sent = bucket_requests(s3, mark)
        assert (report.encoded, report.reused) == (new, 24 - new)
        assert len(sent["LIST"]) == -(-24 // page)  # 1 page, or 3 of 10
        assert sent["HEAD"] == [f"/{s3.bucket}/clips/gone.wav"]  # the row the listing lacked
        assert len(sent["GET"]) == new  # each object read once, and only if new
        reasons = dict(report.failed)
        assert list(reasons) == [gone]
        assert "all.jsonl:25" in reasons[gone] and "object not found" in reasons[gone]
    assert_rows_live(store_dir, report.root, encoder_file, files)


def test_two_rows_of_a_folder_of_thousands_are_two_heads_not_its_listing(
    s3: S3, tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows in a folder of 3,002 objects: two HEADs (concurrent), not the folder's three
    LIST pages; the features are the encoder's now. (Here 302 objects in LIST pages of 100:
    three pages still, a tenth of the objects to put.)"""
    from featbake.store.objects import S3Objects

    real = S3Objects.list_page

    def hundreds(self: S3Objects, prefix: str, after: str = "", **kw: Any) -> Any:
        return real(self, prefix, after, **{**kw, "keys": 100})

    monkeypatch.setattr(S3Objects, "list_page", hundreds)
    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/crowd"))
    put_many(bucket, [f"n{i:05d}.bin" for i in range(300)])
    clips = write_audio_folder(tmp_path / "clips", 2, seconds=0.3, seed=6)
    for clip, name in zip(clips, ("a.wav", "z.wav"), strict=True):
        bucket.upload(name, clip)
    files = {f"s3://{s3.bucket}/crowd/a.wav": clips[0], f"s3://{s3.bucket}/crowd/z.wav": clips[1]}
    write_jsonl(tmp_path / "two.jsonl", [{"path": u} for u in files])
    mark = s3.log_mark()
    report = build(tmp_path / "two.jsonl", encoder_file, cache=store_dir, workers=0)
    sent = bucket_requests(s3, mark)
    assert report.encoded == 2 and not report.failed
    assert (len(sent["LIST"]), sorted(sent["HEAD"])) == (
        0, [f"/{s3.bucket}/crowd/a.wav", f"/{s3.bucket}/crowd/z.wav"]
    )  # fmt: skip
    assert_rows_live(store_dir, report.root, encoder_file, files)


# -- round four: lhotse's own cuts (multi-source recordings, transforms), shared keys, paths ----
def encoded_now(encoder: Path, audio: np.ndarray, rate: int) -> torch.Tensor:
    """The encoder, loaded afresh, on ``[C, T]`` samples at ``rate`` (lhotse's
    ``cut.load_audio()``): channels averaged and soxr-resampled to the recipe's rate, as
    featbake's recipe prepares any file."""
    mono = np.asarray(audio, dtype=np.float32).mean(axis=0)
    if rate != RATE:
        mono = soxr.resample(mono[:, None], rate, RATE, quality="HQ")[:, 0]
    with torchscript_quietly():
        module = torch.jit.load(str(encoder))
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))[None])[0]


def assert_served_as_lhotse_loads(manifest: Path, cuts: Any, encoder: Path, store: Path) -> None:
    """Each cut of ``manifest`` (built into ``store``) has a key of its own and is served the
    encoder run now on lhotse's own ``cut.load_audio()``."""
    ds = quiet_dataset(manifest, encoder, store, on_miss="error")
    assert len({ds.key(i) for i in range(len(ds))}) == len(ds) == len(cuts)
    for i, cut in enumerate(cuts):
        want = encoded_now(encoder, cut.load_audio(), cut.sampling_rate)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5, msg=cut.id)


def noise_wav(path: Path, seconds: float, rate: int, seed: int) -> Path:
    """``seconds`` of seeded noise at ``rate`` (float32 WAV, so no quantisation blurs it)."""
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, round(seconds * rate))
    soundfile.write(path, samples.astype(np.float32), rate, subtype="FLOAT")
    return path


def test_a_cut_on_one_channel_of_a_recording_stored_one_file_per_channel(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AMI/CHiME-style recording, one file per channel: a cut on channel 1 is encoded from
    the file holding channel 1 (before: from the first file, so channel 1's cut was channel
    0's features and counted as a duplicate); a cut over both files is refused in one line."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    for c in range(2):
        noise_wav(tmp_path / f"mic{c}.wav", 3.0, 16000, seed=10 + c)
    sources = [lhotse.AudioSource("file", [c], f"mic{c}.wav") for c in range(2)]
    rec = lhotse.Recording("meeting", sources, 16000, 48000, 3.0)
    cuts = lhotse.CutSet.from_cuts(
        [lhotse.MonoCut(f"ch{c}", 0.5, 1.5, channel=c, recording=rec) for c in range(2)]
        + [rec.to_cut()]  # a MultiCut of channels [0, 1]: two files
    )
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 2 and report.duplicates == 0
    (where, why), = report.failed  # fmt: skip
    assert where == "cuts.jsonl.gz:3" and "\n" not in why
    assert why.startswith("cut meeting: the cut takes channels [0, 1] of 2 sources"), why
    ds = quiet_dataset(tmp_path / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    assert ds.key(0) != ds.key(1)
    for i, cut in enumerate(list(cuts)[:2]):
        want = encoded_now(encoder_file, cut.load_audio(), 16000)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def perturbed_cuts(tmp_path: Path) -> Any:
    """A 22.05 kHz recording's cut, and it speed-perturbed (1.1, 0.9: icefall's
    ``cuts.perturb_speed``) and volume-perturbed (2.0), in ``cuts.jsonl.gz`` written by lhotse."""
    lhotse = pytest.importorskip("lhotse")
    noise_wav(tmp_path / "utt.wav", 4.0, 22050, seed=20)
    cut = lhotse.Recording.from_file("utt.wav").to_cut().truncate(offset=1.5, duration=2.5)
    cuts = lhotse.CutSet.from_cuts([cut])
    cuts = cuts + cuts.perturb_speed(1.1) + cuts.perturb_speed(0.9) + cuts.perturb_volume(2.0)
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    return cuts


def test_perturbed_cuts_are_served_the_audio_lhotse_loads_for_them(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recording.transforms`` (speed, volume) are applied as lhotse applies them: each cut is
    served the encoder run now on lhotse's own ``cut.load_audio()``, under a key of its own.
    Before, the transforms were ignored: the unperturbed audio at the perturbed times (max
    abs difference ~5), and ``_sp0.9`` failed as past the end of its recording."""
    monkeypatch.chdir(tmp_path)
    cuts = perturbed_cuts(tmp_path)
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=2)
    assert not report.failed and report.encoded == 4
    assert_served_as_lhotse_loads(tmp_path / "cuts.jsonl.gz", cuts, encoder_file, store_dir)


def test_cuts_whose_times_fall_between_two_samples_are_read_as_lhotse_reads_them(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 22.05 kHz any time in odd hundredths of a second falls half-way between two samples:
    lhotse rounds the start and the duration each half up, where Python's ``round`` goes to
    even. Before, a cut at 1.25 s started one sample early (served other features than the
    encoder on ``cut.load_audio()``), and two volume-perturbed cuts that lhotse reads from
    samples 27,563 and 27,562 shared a key (one served the other's features, a duplicate)."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "r.wav", 4.0, 22050, seed=40)
    rec = lhotse.Recording.from_file("r.wav", recording_id="r")
    plain = [lhotse.MonoCut(f"c{i}", start, 1.35, 0, recording=rec)
             for i, start in enumerate((1.25, 0.75, 27562 / 22050))]  # fmt: skip
    cuts = lhotse.CutSet.from_cuts([*plain, plain[0].perturb_volume(2.0),
                                    plain[2].perturb_volume(2.0)])  # fmt: skip
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert not report.failed and report.encoded == 5 and report.duplicates == 0
    assert_served_as_lhotse_loads(tmp_path / "cuts.jsonl.gz", cuts, encoder_file, store_dir)


def test_padded_cuts_are_refused_in_one_line_each_naming_what_they_are(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cuts.pad(duration=...)`` saves MixedCut lines (``tracks``, no ``recording``): a
    manifest of them was taken for a row manifest ("has no column 'path' ... --column"), and
    one after a plain cut was "not a cut". Each is now one line saying it is a padded cut;
    the plain cut builds."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "r.wav", 3.0, 16000, seed=50)
    cut = lhotse.Recording.from_file("r.wav").to_cut().truncate(offset=0.5, duration=1.0)
    lhotse.CutSet.from_cuts([cut.pad(duration=2.0)]).to_file(tmp_path / "padded.jsonl.gz")
    got = invoke("build", "-e", encoder_file, "-d", tmp_path / "padded.jsonl.gz",
                 "--cache", store_dir)  # fmt: skip
    assert got.returncode == 3 and "--column" not in got.stderr, got.stderr
    assert "is a MixedCut (a padded or mixed cut" in got.stdout + got.stderr
    lhotse.CutSet.from_cuts([cut, cut.pad(duration=2.0)]).to_file(tmp_path / "both.jsonl.gz")
    report = build(tmp_path / "both.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 1 and len(report.failed) == 1
    assert "a padded or mixed cut" in report.failed[0][1]


@pytest.mark.parametrize("kind", ["RecordingSet", "SupervisionSet"])
def test_a_lhotse_recordings_or_supervisions_manifest_is_refused_naming_cuts(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:  # fmt: skip
    """A ``RecordingSet`` or ``SupervisionSet`` given as --data was read as rows: "no column
    'path' ... name the input with --column", and ``--column sources`` then failed every row.
    It is one line saying how to make cuts of them, whatever the column; a manifest of one's
    own timed by ``start``/``duration`` beside its paths still builds."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "r.wav", 2.0, 16000, seed=51)
    recording = lhotse.Recording.from_file("r.wav")
    manifest_file = tmp_path / f"{kind}.jsonl.gz"
    if kind == "RecordingSet":
        lhotse.RecordingSet.from_recordings([recording]).to_file(manifest_file)
    else:
        segment = lhotse.SupervisionSegment("s1", recording.id, 0.5, 1.0, channel=0, text="a")
        lhotse.SupervisionSet.from_segments([segment]).to_file(manifest_file)
    for column in ((), ("--column", "sources")):
        got = invoke("build", "-e", encoder_file, "-d", manifest_file, "--cache", store_dir,
                     *column)  # fmt: skip
        lines = got.stderr.strip().splitlines()
        assert got.returncode == SourceError.exit_code and len(lines) == 1, got.stderr
        assert f"is a lhotse {kind} manifest" in lines[0] and "CutSet.from_manifests" in lines[0]
    rows = tmp_path / "rows.jsonl"
    timed = {"path": "r.wav", "recording_id": "r", "start": 0.5, "duration": 1.0}
    rows.write_text("".join(json.dumps(r) + "\n" for r in ({**timed, "path": None}, timed)))
    report = build(rows, encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 1 and len(report.failed) == 1  # its null path is that row's error


def test_perturbed_cuts_without_lhotse_are_refused_one_line_each(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where lhotse is not installed, each cut with transforms is skipped in one line naming
    the cut and its transforms; the plain cut builds."""
    monkeypatch.chdir(tmp_path)
    cuts = list(perturbed_cuts(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lhotse" else real(name, *a)
    )
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 1
    reasons = dict(report.failed)
    assert sorted(reasons) == ["cuts.jsonl.gz:2", "cuts.jsonl.gz:3", "cuts.jsonl.gz:4"]
    for line, what in ((2, "speed 1.1"), (3, "speed 0.9"), (4, "volume 2.0")):
        why = reasons[f"cuts.jsonl.gz:{line}"]
        assert why.startswith(f"cut {cuts[line - 1].id}: recording transforms ({what})"), why
        assert "pip install lhotse" in why and "\n" not in why


def test_a_lhotse_cut_and_a_kaldi_segment_of_the_same_samples_share_a_key(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys hash a segment's sample bounds at its file's rate, not its float seconds: a 6 s
    recording cut into 40 windows by lhotse (``start + duration`` in floats) and the same
    windows as a Kaldi ``segments`` file (``%.2f``, the last one ``-1``) are one set of keys,
    so the second build encodes nothing (before: 40 of them again); a cut of the whole
    recording is the file's key, as in a folder."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "long.wav", 6.0, 16000, seed=30)
    whole = lhotse.Recording.from_file("long.wav").to_cut()
    windows = list(whole.cut_into_windows(0.15))
    assert len(windows) == 40
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    (kaldi / "wav.scp").write_text(f"long {tmp_path / 'long.wav'}\n")
    ends = [f"{w.end:.2f}" for w in windows[:-1]] + ["-1"]
    pairs = enumerate(zip(windows, ends, strict=True))
    lines = [f"w{i:02d} long {w.start:.2f} {end}" for i, (w, end) in pairs]
    (kaldi / "segments").write_text("\n".join(lines) + "\n")
    first = build(kaldi, encoder_file, cache=store_dir, workers=0)
    assert first.encoded == 40 and not first.failed

    lhotse.CutSet.from_cuts([*windows, whole]).to_file(tmp_path / "cuts.jsonl.gz")
    again = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert (again.encoded, again.reused, again.failed) == (1, 40, [])  # only the whole file
    ds = quiet_dataset(tmp_path / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    folder = quiet_dataset(tmp_path, encoder_file, store_dir, on_miss="error")
    assert ds.key(40) == folder.key(0)  # long.wav whole: the file's key
    for i in (0, 7, 39, 40):
        want = encoded_now(encoder_file, [*windows, whole][i].load_audio(), 16000)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def test_relative_paths_of_cuts_and_wav_scp_are_taken_from_the_working_directory(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """icefall's layout: cuts under ``data/fbank/`` name ``download/...`` paths, relative to
    the recipe's folder the build runs from, as lhotse and Kaldi take them (before: taken from
    the manifest's folder, so every row failed as a missing file). A dataset opened from the
    same folder serves them; run from elsewhere, a path found only beside the manifest is
    refused in one line that says where relative paths are taken from."""
    lhotse = pytest.importorskip("lhotse")
    (tmp_path / "download").mkdir()
    (tmp_path / "data" / "fbank").mkdir(parents=True)
    (tmp_path / "data" / "train").mkdir()
    noise_wav(tmp_path / "download" / "a.wav", 2.0, 16000, seed=40)
    monkeypatch.chdir(tmp_path)
    cut = lhotse.Recording.from_file("download/a.wav").to_cut().truncate(offset=0.5, duration=1)
    assert cut.recording.sources[0].source == "download/a.wav"
    lhotse.CutSet.from_cuts([cut]).to_file(tmp_path / "data/fbank/cuts.jsonl.gz")
    (tmp_path / "data/train/wav.scp").write_text("a download/a.wav\n")
    (tmp_path / "data/train/segments").write_text("u a 0.5 1.5\n")

    got = run_cli("build", "-e", encoder_file, "-d", "data/fbank/cuts.jsonl.gz",
                  "--cache", store_dir, cwd=tmp_path)  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    kaldi = build("data/train", encoder_file, cache=store_dir, workers=0)
    assert not kaldi.failed and kaldi.reused == 1  # the same samples of the same file
    ds = quiet_dataset(Path("data/fbank/cuts.jsonl.gz"), encoder_file, store_dir, on_miss="error")
    want = encoded_now(encoder_file, cut.load_audio(), 16000)
    torch.testing.assert_close(ds[0], want, rtol=1e-5, atol=1e-5)

    # The same cuts beside download/, built from another folder: lhotse would not find them.
    lhotse.CutSet.from_cuts([cut]).to_file(tmp_path / "cuts.jsonl.gz")
    monkeypatch.chdir(tmp_path / "data")
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    (where, why), = report.failed  # fmt: skip
    assert where == "cuts.jsonl.gz:1" and "\n" not in why
    assert f"download/a.wav is not in the working directory ({tmp_path / 'data'})" in why
    assert f"run from {tmp_path} or write absolute paths" in why


# -- round four: how rows are read ---------------------------------------------------------------
def clips_for_rows(folder: Path, n: int) -> list[Path]:
    """``n`` short clips of different lengths in ``folder/clips``, in name order."""
    write_audio_folder(folder / "clips", n, seconds=(0.3, 0.8), seed=7)
    return sorted((folder / "clips").glob("*.wav"))


def assert_rows_served(
    data: Path, encoder: Path, store: Path, rows: list[dict[str, str]], clips: list[Path]
) -> None:
    """The dataset over ``data`` holds ``rows`` (carried columns, in order), each stored and
    equal to the encoder run now on its clip."""
    ds = quiet_dataset(data, encoder, store, on_miss="error")
    assert [ds.row(i) for i in range(len(ds))] == rows
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], reference(encoder, clip, None, None))


def test_a_common_voice_tsv_keeps_its_quote_marks_and_a_short_row_is_named(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Round four item 4: a Common Voice TSV whose sentence opened a quote was read with CSV
    quoting: the cell ran over the next rows, 2 of 5 rows vanished without a line ("failed 0",
    exit 0) and a row got another row's label. A TSV is not quoted; a row with the wrong
    number of fields is a bad row at its line."""
    clips = clips_for_rows(tmp_path, 5)
    sentences = ['"Quoted start, never closed', "plain one", 'a "mid" quote', '"both"', "last"]
    lines = ["client_id\tpath\tsentence\tlabel"]
    lines += [
        f"u{i}\tclips/{c.name}\t{s}\t{i}"
        for i, (c, s) in enumerate(zip(clips, sentences, strict=True))
    ]
    lines.insert(3, "u9\tclips/x.wav\tshort")  # line 4: a field short
    (tmp_path / "validated.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = build(tmp_path / "validated.tsv", encoder_file, cache=store_dir, workers=0)
    assert (report.files, report.encoded) == (6, 5)
    assert dict(report.failed) == {
        "validated.tsv:4": "fewer fields than the header names (3, not 4)"
    }
    rows = [{"client_id": f"u{i}", "sentence": s, "label": str(i)} for i, s in enumerate(sentences)]
    assert_rows_served(tmp_path / "validated.tsv", encoder_file, store_dir, rows, clips)


def test_a_common_voice_tsv_names_its_clips_by_file_name_as_common_voice_lays_them_out(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Common Voice's ``validated.tsv`` names each clip by its file name alone, the clips lying
    in ``clips/`` beside it: the rows are read from there, by the CLI and a dataset, each
    served equal to the encoder run now with its row (before: every row failed, "cannot stat",
    exit 8). A file beside the manifest is still taken first."""
    clips = clips_for_rows(tmp_path, 3)
    lines = ["client_id\tpath\tsentence"]
    lines += [f"u{i}\t{c.name}\tsentence {i}" for i, c in enumerate(clips)]
    tsv = tmp_path / "validated.tsv"
    tsv.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = invoke("build", "--data", tsv, "--encoder", encoder_file, "--cache", store_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [{"client_id": f"u{i}", "sentence": f"sentence {i}"} for i in range(3)]
    assert_rows_served(tsv, encoder_file, store_dir, rows, clips)
    # A manifest whose files lie beside it reads them there, whatever clips/ holds.
    beside = tmp_path / "beside"
    write_audio_folder(beside, 1, seconds=(0.5, 0.5), seed=99)
    (beside / "clips").mkdir()
    name = next(beside.glob("*.wav")).name
    clips[0].rename(beside / "clips" / name)
    (beside / "m.tsv").write_text(f"path\tlabel\n{name}\tx\n", encoding="utf-8")
    assert build(beside / "m.tsv", encoder_file, cache=store_dir, workers=0).failed == []
    assert_rows_served(beside / "m.tsv", encoder_file, store_dir, [{"label": "x"}], [beside / name])


def test_a_csv_row_with_an_open_quote_or_another_field_count_is_a_bad_row_at_its_line(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Round four item 4, CSV: a quote left open is a bad row at its line and the rows after it
    are each read (before, the cell ran to the end of the file: every later row gone, in
    silence); a row of another field count than the header's is a bad row, never padded or
    merged; cells Excel quotes (a comma, a doubled quote, a line break) are read as written."""
    clips = clips_for_rows(tmp_path, 6)
    names = [f"clips/{c.name}" for c in clips]
    text = (
        "path,label\n"
        f'{names[0]},"open quote, never closed\n'  # line 2
        f"{names[1]},one\n"
        f"{names[2]},two,extra\n"  # line 4
        f'{names[3]},"a, quoted ""cell"""\n'
        f'{names[4]},"two\nlines"\n'  # lines 6-7: one record
        f"{names[5]},last\n"
    )
    (tmp_path / "clips.csv").write_text(text, encoding="utf-8")
    report = build(tmp_path / "clips.csv", encoder_file, cache=store_dir, workers=0)
    failed = dict(report.failed)
    assert (report.files, report.encoded, sorted(failed)) == (6, 4, ["clips.csv:2", "clips.csv:4"])
    assert failed["clips.csv:2"].startswith("malformed CSV (")
    assert failed["clips.csv:4"] == "more fields than the header names (3, not 2)"
    labels = ["one", 'a, quoted "cell"', "two\nlines", "last"]
    rows = [{"label": lab} for lab in labels]
    served = [clips[1], clips[3], clips[4], clips[5]]
    assert_rows_served(tmp_path / "clips.csv", encoder_file, store_dir, rows, served)


def test_a_csv_saved_by_excel_with_a_byte_order_mark_reads_its_first_column(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Round four item 14: Excel's "CSV UTF-8" starts with a byte-order mark (and ends lines
    with CRLF); read as plain UTF-8 the first column was named "\\ufeffpath", and every row
    failed as "no 'path' column (columns: path, label)". A JSONL saved by Notepad likewise."""
    clips = clips_for_rows(tmp_path, 3)
    body = "path,label\r\n" + "".join(f"clips/{c.name},{i}\r\n" for i, c in enumerate(clips))
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    jsonl = "".join(
        json.dumps({"path": f"clips/{c.name}", "label": i}) + "\n" for i, c in enumerate(clips)
    )
    (tmp_path / "notepad.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl.encode("utf-8"))
    for name, label in (("excel.csv", str), ("notepad.jsonl", int)):
        report = build(tmp_path / name, encoder_file, cache=store_dir, workers=0)
        assert not report.failed and report.encoded + report.reused == 3, report.failed
        rows = [{"label": label(i)} for i in range(3)]
        assert_rows_served(tmp_path / name, encoder_file, store_dir, rows, clips)


def test_a_column_no_row_holds_is_one_line_and_the_tables_exit_code_for_every_layout(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Round four item 14: a typo'd ``--column`` over a JSONL was a bad-row line per row and
    exit 3, over a parquet table one line and exit 8. Now every layout refuses it before any
    work in one line naming the columns there are, with the table's code (8: the data has no
    such column, as a tar without the member); a row alone without the column is still a bad
    row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clips = clips_for_rows(tmp_path, 3)
    names = [f"clips/{c.name}" for c in clips]
    write_jsonl(tmp_path / "m.jsonl", [{"path": n, "label": i} for i, n in enumerate(names)])
    for ext, sep in (("csv", ","), ("tsv", "\t")):
        lines = [f"path{sep}label"] + [f"{n}{sep}{i}" for i, n in enumerate(names)]
        (tmp_path / f"m.{ext}").write_text("\n".join(lines) + "\n")
    cells = pa.array([c.read_bytes() for c in clips], pa.binary())
    pq.write_table(pa.table({"path": cells, "label": [0, 1, 2]}), tmp_path / "m.parquet")
    for ext in ("jsonl", "csv", "tsv", "parquet"):
        data = tmp_path / f"m.{ext}"
        got = invoke(
            "build", "-e", encoder_file, "-d", data, "--cache", store_dir, "--column", "paht"
        )
        lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
        assert got.returncode == 8 and len(lines) == 1, (ext, got.stderr)
        assert lines[0].startswith(f"error: {data} has no column 'paht'"), lines
        assert re.search(r"\(columns: (path, label|label, path)\); .*--column", lines[0])
    assert not (store_dir / "catalog.sqlite").exists()  # refused before any work
    write_jsonl(tmp_path / "some.jsonl", [{"path": names[0]}, {"file": names[1]}])
    report = build(tmp_path / "some.jsonl", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 1 and [p for p, _ in report.failed] == ["some.jsonl:2"]


def test_a_cuts_custom_fields_and_its_supervisions_language_and_gender_are_carried(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lhotse cut's ``custom`` fields (the labels a recipe attaches), its supervision's
    language, gender and custom fields reach ``ds.row(i)`` beside its text and speaker (before:
    text, speaker and recording only, so a probe's labels were lost)."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "utt.wav", 2.0, 16000, seed=21)
    rec = lhotse.Recording.from_file("utt.wav")
    sup = lhotse.SupervisionSegment(
        "s0", rec.id, 0.0, 1.0, text="hello", speaker="spk1", language="en", gender="f",
        custom={"emotion": "happy"},
    )  # fmt: skip
    cut = rec.to_cut().truncate(duration=1.0)
    cut.supervisions = [sup]
    cut.custom = {"label": 7, "emotion": "calm"}
    lhotse.CutSet.from_cuts([cut]).to_file(tmp_path / "cuts.jsonl.gz")
    report = build(tmp_path / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert not report.failed and report.encoded == 1
    ds = quiet_dataset(tmp_path / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    row = ds.row(0)
    assert row["label"] == 7 and row["emotion"] == "calm"  # the cut's own custom field wins
    assert (row["text"], row["speaker"], row["language"], row["gender"]) == (
        "hello", "spk1", "en", "f",
    )  # fmt: skip
    want = encoded_now(encoder_file, cut.load_audio(), cut.sampling_rate)
    torch.testing.assert_close(ds[0], want, rtol=1e-5, atol=1e-5)


def test_a_cut_manifest_lhotse_wrote_uncompressed_is_read_as_cuts(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CutSet.to_file("cuts.jsonl")`` writes the cuts as plain JSONL (lhotse picks gzip by
    the name): it is read as cuts, the CLI build and a dataset alike, each cut served the
    encoder run now on lhotse's ``cut.load_audio()`` with its labels (before: read as a
    manifest of paths, "no column 'path' ... name the input with --column", exit 8)."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "utt.wav", 3.0, 16000, seed=31)
    rec = lhotse.Recording.from_file("utt.wav")
    cuts = [rec.to_cut().truncate(offset=0.25 + i, duration=0.5).with_id(f"c{i}") for i in range(2)]
    for i, cut in enumerate(cuts):
        cut.custom = {"label": i + 5}
    plain = tmp_path / "cuts.jsonl"
    lhotse.CutSet.from_cuts(cuts).to_file(plain)
    assert plain.read_bytes()[:1] == b"{"  # lhotse wrote it uncompressed
    assert_cuts_served(plain, encoder_file, store_dir)
    # A JSONL manifest of paths is still one: its first row is no cut.
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"path": "utt.wav", "recording": "r1", "type": "MonoCut"}) + "\n")
    assert type(inputs_at(rows)) is ManifestInputs


def test_a_first_line_over_a_mebibyte_is_told_cut_or_row_by_its_fields(
    tmp_path: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lhotse cut whose ``custom`` holds 1.5 MiB (an alignment, an embedding as text) first
    in ``cuts.jsonl``, and a row of 1.5 MiB first in ``rows.jsonl.gz``: each is told by its
    fields (lhotse writes a cut's ``type`` last), read as cuts and as rows, each item served
    equal to the encoder run now (before: the first MiB of the line was read and failed to
    parse, so the cuts were taken for rows, exit 8, and the rows for cuts, nothing built).
    The decision holds no more than a read's bytes of a line of 24 MiB in memory."""
    lhotse = pytest.importorskip("lhotse")
    monkeypatch.chdir(tmp_path)
    noise_wav(tmp_path / "utt.wav", 3.0, 16000, seed=33)
    rec = lhotse.Recording.from_file("utt.wav")
    cuts = [rec.to_cut().truncate(offset=0.25 + i, duration=0.5).with_id(f"c{i}") for i in range(2)]
    cuts[0].custom = {"label": 5, "alignment": "ab " * (1 << 19)}  # 1.5 MiB
    cuts[1].custom = {"label": 6}
    plain = tmp_path / "cuts.jsonl"
    lhotse.CutSet.from_cuts(cuts).to_file(plain)
    assert len(plain.read_bytes().split(b"\n")[0]) > 1 << 20
    assert_cuts_served(plain, encoder_file, store_dir)
    # Rows: the first carries 1.5 MiB of text (and nested values) before its path.
    clips = clips_for_rows(tmp_path, 2)
    first = {
        "notes": ["x" * (3 << 19), {"y": [1, 2.5, None, True]}],
        "path": f"clips/{clips[0].name}",
    }
    rows = tmp_path / "rows.jsonl.gz"
    with gzip.open(rows, "wt", encoding="utf-8") as f:
        f.write(json.dumps(first) + "\n" + json.dumps({"path": f"clips/{clips[1].name}"}) + "\n")
    result = invoke("build", "--data", rows, "--encoder", encoder_file, "--cache", store_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    ds = quiet_dataset(rows, encoder_file, store_dir, on_miss="error")
    assert len(ds) == 2 and ds.row(1) == {}
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip))
    # 24 MiB on one line, its type last: decided holding no more than a read's bytes.
    huge = tmp_path / "huge.jsonl"
    with huge.open("w") as f:
        f.write('{"id": "h", "recording": {"id": "r"}, "custom": {"x": "' + "z" * (24 << 20))
        f.write('"}, "type": "MonoCut"}\n')
    tracemalloc.start()
    try:
        picked = type(inputs_at(huge))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert picked is CutsInputs and peak < 4 << 20, peak


class Trickle(io.BytesIO):
    """A file that hands out at most ``step`` bytes a read (a pipe, a gzip stream's pieces)."""

    def __init__(self, data: bytes, step: int) -> None:
        super().__init__()
        self.data, self.at, self.step = data, 0, step

    def read(self, n: int = -1) -> bytes:
        got = self.data[self.at : self.at + min(self.step, n if n >= 0 else self.step)]
        self.at += len(got)
        return got


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(max_size=4) | st.sampled_from(["type", "recording"]), inner, max_size=3
        )
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(["type", "recording", "id", "custom", 'a"\\b']), JSON),
    ascii_only=st.booleans(),
    step=st.integers(1, 7),
    tail=st.sampled_from(["", "\n", "\n{", " \n", " x"]),
)
def test_the_first_lines_fields_are_what_json_reads_however_it_is_cut(
    fields: dict[str, Any], ascii_only: bool, step: int, tail: str
) -> None:
    """:class:`FirstLine` against ``json.loads`` of the whole line: the same ``type`` and
    ``recording`` as :func:`is_a_cut` reads them, read a few bytes at a time (a value cut
    between reads, escapes and multibyte characters included); a line that is not one JSON
    object alone (trailing text) is None for both."""
    line = json.dumps(fields, ensure_ascii=ascii_only) + tail
    try:
        whole = json.loads(line.split("\n")[0])
    except ValueError:
        whole = None
    want = None if whole is None else {
        k: {} if isinstance(v, dict) else v if isinstance(v, str) else None
        for k, v in whole.items()
        if k in CUT_FIELDS
    }  # fmt: skip
    got = FirstLine(Trickle(line.encode(), step)).fields(CUT_FIELDS)
    assert got == want


def test_rows_on_each_channel_of_one_file_without_ids_are_each_an_item(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A telephone call's two sides as rows of one stereo file, the same times on channel 0
    and 1, no ``id`` column: each row is its own item (its id names its channel), served its
    channel with its label (before: both rows had the id ``call.wav#0.5-2.0`` and the manifest
    was refused, "ids must be unique")."""
    call = long_recording(tmp_path / "call.wav", 3, 16000, seed=7, channels=2)
    rows = [
        {"path": "call.wav", "start": 0.5, "end": 2.0, "channel": c, "speaker": f"side{c}"}
        for c in (0, 1)
    ] + [{"path": "call.wav", "start": 0.5, "end": 2.0, "speaker": "both"}]
    m = tmp_path / "calls.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build(m, encoder_file, cache=store_dir, workers=0)
    assert (report.encoded, report.failed) == (3, [])
    ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error")
    ids = [ds.item_id(i) for i in range(len(ds))]
    assert len(set(ids)) == 3, ids
    for i, channel in enumerate([0, 1, None]):
        assert ds.row(i) == {"speaker": rows[i]["speaker"]}
        want = reference(encoder_file, call, 0.5, 2.0, channel=channel)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def test_a_row_with_start_and_duration_is_served_that_segment(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A manifest that times its segments by ``start`` and ``duration`` (as lhotse's cuts and
    supervisions do) serves each row ``[start, start + duration)``, equal to the encoder run now
    on that span (before: the duration was carried as a label and each row served from its
    start to the recording's end, in silence). An ``end`` wins over a ``duration``; a
    ``duration`` without a ``start`` stays a label of the whole file (NeMo's manifests)."""
    long = long_recording(tmp_path / "long.wav", 4, 16000, seed=9)
    rows = [
        {"id": "a", "path": "long.wav", "start": 1.0, "duration": 0.5, "label": 1},
        {"id": "b", "path": "long.wav", "start": 0.25, "duration": 1.25, "label": 2},
        {"id": "c", "path": "long.wav", "start": 2.0, "end": 3.0, "duration": 9, "label": 3},
        {"id": "d", "path": "long.wav", "duration": 4.0, "label": 4},
    ]
    m = tmp_path / "timed.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build(m, encoder_file, cache=store_dir, workers=0)
    assert (report.encoded, report.failed) == (4, [])
    ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error")
    spans = [(1.0, 1.5), (0.25, 1.5), (2.0, 3.0), (None, None)]
    for i, (start, end) in enumerate(spans):
        assert ds.row(i)["label"] == i + 1
        want = reference(encoder_file, long, start, end)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)


def test_rows_naming_a_fifo_or_a_folder_are_bad_rows_not_a_hang(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A manifest row, a Kaldi ``wav.scp`` entry or a cut naming a FIFO (reading it blocks
    until a writer comes, which never does) or a folder is a bad row saying what it is, as a
    folder's FIFO is (before: the build blocked in the FIFO's open forever, and SIGTERM could
    not stop it); the other rows are built and served equal to the encoder run now."""
    good = tmp_path / "good.wav"
    soundfile.write(good, make_tone(0.5, 16000, seed=3), 16000)
    os.mkfifo(tmp_path / "pipe.wav")
    (tmp_path / "folder.wav").mkdir()
    rows = [{"id": i, "path": f"{i}.wav"} for i in ("pipe", "folder", "good")]
    rows.append({"id": "seg", "path": "pipe.wav", "start": 0.1, "end": 0.2})
    m = tmp_path / "odd.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    res = run_cli("build", "-e", encoder_file, "-d", m, "--cache", store, timeout=120)
    assert res.returncode == 3, res.stderr
    assert "internal error" not in res.stderr
    said = res.stdout + res.stderr
    assert said.count("not a regular file (a FIFO)") == 2, said
    assert "not a regular file (a folder)" in said, said
    ds = quiet_dataset(m, encoder_file, store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["good"]
    torch.testing.assert_close(ds[0], live_features(encoder_file, good))


#: A test-only decoder hook, loaded by the build's interpreter: decoding the clip
#: ``STUCK_CLIP`` (by its bytes) says so through the FIFO ``STUCK_READY``, then opens the FIFO
#: ``STUCK_FIFO`` for reading, a real ``open(2)`` that blocks until a writer comes: none does
#: (an NFS server gone, as the decoder sees it).
STUCK_HOOK = """
import os, signal, soundfile, threading, time

STUCK = open(os.environ["STUCK_CLIP"], "rb").read()


def taken_here():  # the kernel gives the process's SIGTERM to this thread, the stuck one,
    # once the main thread waits for its work (its first input's: nothing comes before)
    if os.environ.get("STUCK_SIGNAL") != "here":
        return
    import sys

    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name == "wait" and (
            frame.f_code.co_filename.endswith("threading.py")
        ):
            break
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)


class Stuck(soundfile.SoundFile):
    def __init__(self, file, *args, **kwargs):
        data = file.getvalue() if hasattr(file, "getvalue") else None
        if data is None and isinstance(file, str):
            data = open(file, "rb").read()
        if data == STUCK:
            if os.environ["STUCK_AT"] == "held":  # once the other worker holds the flag
                open(os.environ["STUCK_READY"] + ".reached", "w").close()
                while not os.path.exists(os.environ["STUCK_READY"] + ".held"):
                    time.sleep(0.01)
            taken_here()
            with open(os.environ["STUCK_READY"], "w") as ready:
                ready.write("stuck")
            open(os.environ["STUCK_FIFO"], "rb")
        super().__init__(file, *args, **kwargs)


soundfile.SoundFile = Stuck
if os.environ["STUCK_AT"] == "hash":  # the clip's first read, hashing it, blocks instead
    import builtins

    plain_open = builtins.open

    def stuck_open(file, *args, **kwargs):
        if isinstance(file, str) and file == os.environ["STUCK_CLIP"]:
            taken_here()
            with plain_open(os.environ["STUCK_READY"], "w") as ready:
                ready.write("stuck")
            plain_open(os.environ["STUCK_FIFO"], "rb")
        return plain_open(file, *args, **kwargs)

    builtins.open = stuck_open
if os.environ["STUCK_AT"] == "held":  # the other decode worker, as it takes its 3rd input
    # (after the stuck one was reached), stops while it holds the loader's "done" flag, a lock
    # between processes: as a worker descheduled there on a busy machine is when it is killed
    import multiprocessing.synchronize
    from torch.utils.data import get_worker_info

    plain_is_set, calls = multiprocessing.synchronize.Event.is_set, []

    def held_is_set(self):
        if get_worker_info() is not None:
            calls.append(1)
            if len(calls) == 3:
                while not os.path.exists(os.environ["STUCK_READY"] + ".reached"):
                    time.sleep(0.01)
                with self._cond:
                    with open(os.environ["STUCK_READY"] + ".tmp", "w") as held:
                        held.write(str(os.getpid()))  # whole once it has its name:
                    os.replace(held.name, os.environ["STUCK_READY"] + ".held")
                    time.sleep(3600)
        return plain_is_set(self)

    multiprocessing.synchronize.Event.is_set = held_is_set
"""


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (Linux's ``/proc``), each after its parent."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


def _stacks_of(pids: list[int], proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What ``proc`` printed once each of ``pids`` (``proc`` last) was sent SIGABRT in turn,
    the next only if ``proc`` is still running a minute later (a supervisor reports its child's
    end itself; its own stack would interleave); killed if not even faulthandler ends it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.communicate(timeout=60)
    proc.kill()
    return proc.communicate()


def _ended(proc: subprocess.Popen[str], seconds: float) -> subprocess.CompletedProcess[str]:
    """``proc`` once it has ended, or once stopped ``seconds`` later (a bound against a hang),
    with all it printed either way, for a failure's message: a hung ``proc`` and the processes
    under it (the supervised build, its decode workers) are sent SIGABRT, on which faulthandler
    (``PYTHONFAULTHANDLER``, set by :func:`_stuck_build_stopped`) writes every thread's stack
    to the inherited stderr, so the message says where each hung."""
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        out, err = _stacks_of([*reversed(_descendants(proc.pid)), proc.pid], proc)
        err += f"\n(stopped: still running {seconds:.0f} s later; its stacks are above)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _stuck_build_stopped(
    tmp_path: Path,
    encoder_file: Path,
    at: str,
    workers: str,
    stop: Callable[[int], None],
    signal_here: bool = False,
    stuck: int = 3,
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """A build of 6 clips whose 4th is stuck in a read that never returns (``STUCK_HOOK``, at
    ``at``), ``stop(build pid)`` called once the decoder is stuck: what it printed once it
    ended (or was killed 600 s later), its data folder and its store. ``signal_here``: the
    stuck thread sends itself SIGTERM as it gets stuck (a process's signal the kernel gave
    that thread). ``stuck``: which clip is stuck (in sorted order)."""
    data = tmp_path / "audio"
    write_audio_folder(data, 6, seconds=(0.3, 0.8), seed=41)
    clips = sorted(data.glob("*.wav"))
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "stuck_hook.py").write_text(STUCK_HOOK)
    ready, fifo = tmp_path / "ready", tmp_path / "never"
    os.mkfifo(ready)
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{REPO}",
           "STUCK_CLIP": str(clips[stuck]), "STUCK_READY": str(ready), "STUCK_AT": at,
           "STUCK_FIFO": str(fifo), "STUCK_SIGNAL": "here" if signal_here else "",
           "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    env.pop("FEATBAKE_DEBUG", None)
    store = tmp_path / "store"
    command = ["build", "-e", str(encoder_file), "-d", str(data), "--cache", str(store),
               "--batch-size", "1", "--workers", workers]  # fmt: skip
    code = "import stuck_hook; from featbake.cli.main import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, *command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        reader = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)  # no writer yet: opens at once
        try:  # until the decoder says it is stuck (a bound against a build that never gets there,
            # wide: a loaded machine slows the build, never the verdict)
            reached = select.select([reader], [], [], 600)[0]
        finally:
            os.close(reader)
        if reached:
            stop(proc.pid)
        ran = _ended(proc, 600)  # its output whatever happened, for the message
        assert reached, f"the decoder never reached the clip: {printed(ran)}"
    finally:
        proc.kill()
    return ran, data, store


def assert_sealed_before_the_stuck_clip_and_rebuilt(
    data: Path, encoder_file: Path, store: Path, most: int
) -> None:
    """The clips a stopped :func:`_stuck_build_stopped` sealed (up to ``most``, in order, the
    stuck one never) are served equal to the encoder run now, and a rerun reuses them and
    builds the rest."""
    clips = sorted(data.glob("*.wav"))
    ds = quiet_dataset(data, encoder_file, store, on_miss="error")
    sealed = 0  # how far the encoder got before the stop: the clips before the stuck one
    for i, clip in enumerate(clips):
        try:
            got = ds[i]
        except CacheMiss:
            continue
        assert i == sealed < most, i
        torch.testing.assert_close(got, live_features(encoder_file, clip))
        sealed += 1
    report = build(data, encoder_file, cache=store, workers=0)
    assert (report.reused, report.encoded, report.failed) == (sealed, 6 - sealed, [])
    ds = quiet_dataset(data, encoder_file, store, on_miss="error")
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip))


@pytest.mark.parametrize(
    ("at", "workers", "here"),
    [("decode", "0", False), ("decode", "2", False), ("held", "2", False), ("hash", "0", False),
     ("decode", "0", True), ("hash", "0", True)],
)  # fmt: skip
def test_sigterm_stops_a_build_whose_decoder_is_stuck_in_a_read_keeping_what_it_sealed(
    tmp_path: Path, encoder_file: Path, at: str, workers: str, here: bool
) -> None:
    """SIGTERM (Kubernetes, SLURM, ``timeout``) to a build whose decoder is stuck in a read that
    never returns (its 4th clip's open of a FIFO no writer opens; on the decode thread, and in a
    decode worker process, also while the other worker holds the loader's "done" flag; or its
    first read, hashing it, on a hashing thread): the build stops with its one line and exit
    143, the clips it encoded before (as many as the encoder reached: up to 3) sealed and
    served equal to the encoder run now, and a rerun reuses them and builds the rest. Before,
    the main thread waited for the stuck decode for ever (the signal only noted for the next
    checkpoint), and the decode thread was joined at exit; and (``held``) the stopped build
    killed its workers and then waited for ever on the flag the killed one held. ``here``:
    the kernel gives the process's SIGTERM to the stuck thread itself, as it may give it to
    any thread; before, the main thread's wait for that thread's work never woke to run the
    handler, and the build printed nothing and never ended."""

    def stop(pid: int) -> None:
        if not here:  # else the stuck thread has taken it already
            os.kill(pid, signal.SIGTERM)

    ran, data, store = _stuck_build_stopped(
        tmp_path, encoder_file, at, workers, stop, here, 0 if here else 3
    )
    err = ran.stderr
    assert ran.returncode == 143, printed(ran)
    last = err.strip().splitlines()[-1]  # after the progress lines
    assert last.startswith("stopped: stopped by SIGTERM"), printed(ran)
    assert err.count("stopped:") == 1 and "Traceback" not in err, printed(ran)
    assert_sealed_before_the_stuck_clip_and_rebuilt(
        data, encoder_file, store, 0 if at == "hash" or here else 3
    )


def test_a_decode_worker_killed_holding_the_loaders_flag_ends_the_build_with_its_line(
    tmp_path: Path, encoder_file: Path
) -> None:
    """The OOM killer ends a decode worker while it holds the loader's "done" flag (a lock
    between processes, taken as each input arrives) and the other worker is stuck in a read:
    the build ends with its one line (exit 8, "a decode worker died"), keeping the clips it
    sealed, served equal to the encoder run now. Before, its shutdown set the flag and waited
    for ever on the lock the dead worker held."""

    def kill_holder(pid: int) -> None:
        os.kill(int((tmp_path / "ready.held").read_text()), signal.SIGKILL)

    ran, data, store = _stuck_build_stopped(tmp_path, encoder_file, "held", "2", kill_holder)
    err = ran.stderr
    assert ran.returncode == 8, printed(ran)
    assert "a decode worker died" in err.strip().splitlines()[-1], printed(ran)
    assert "Traceback" not in err and "internal error" not in err, printed(ran)
    assert_sealed_before_the_stuck_clip_and_rebuilt(data, encoder_file, store, 3)


def test_a_cut_whose_source_is_a_bucket_url_is_read_from_the_bucket(
    s3: S3, corpus: Path, encoder_file: Path, store_dir: Path
) -> None:
    """lhotse writes a recording stored in a bucket as a source of type ``url``
    (``AudioSource("url", [0], "s3://...")``): featbake reads it as a manifest's ``s3://`` row,
    each cut served equal to the encoder run now on its samples (before: every such cut was
    refused, "a source of type url, not file"); an ``https://`` source is one line per cut."""
    lhotse = pytest.importorskip("lhotse")
    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}/wavs"))
    bucket.upload("recA.wav", corpus / "wavs/recA.wav")
    url = f"s3://{s3.bucket}/wavs/recA.wav"
    rec = lhotse.Recording("recA", [lhotse.AudioSource("url", [0], url)], 22050, 6 * 22050, 6.0)
    web = lhotse.Recording("web", [lhotse.AudioSource("url", [0], "https://x.org/a.wav")],
                           22050, 22050, 1.0)  # fmt: skip
    cuts = [lhotse.MonoCut(f"c{k}", k + 0.5, 1.0, channel=0, recording=rec) for k in range(2)]
    cuts.append(lhotse.MonoCut("w", 0.0, 1.0, channel=0, recording=web))
    lhotse.CutSet.from_cuts(cuts).to_file(corpus / "cuts.jsonl.gz")
    report = build(corpus / "cuts.jsonl.gz", encoder_file, cache=store_dir, workers=0)
    assert report.encoded == 2, report.failed
    (why,) = [r for p, r in report.failed]
    assert "cut w:" in why and "https" in why and "\n" not in why
    ds = quiet_dataset(corpus / "cuts.jsonl.gz", encoder_file, store_dir, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["c0", "c1"]
    for k in range(2):
        want = reference(encoder_file, corpus / "wavs/recA.wav", k + 0.5, k + 1.5)
        torch.testing.assert_close(ds[k], want, rtol=1e-5, atol=1e-5)


def test_a_gzipped_jsonl_manifest_of_rows_is_read_as_rows(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A JSONL manifest of rows compressed as ``rows.jsonl.gz`` is a manifest (its first line
    is no lhotse cut): each row built and served equal to the encoder run now, its label
    carried (before: taken for a cut manifest, every row "not a cut ..."; nothing built)."""
    write_audio_folder(tmp_path / "clips", 3, seconds=(0.3, 0.6), seed=12)
    clips = sorted((tmp_path / "clips").glob("*.wav"))
    rows = [{"path": f"clips/{c.name}", "label": i} for i, c in enumerate(clips)]
    m = tmp_path / "rows.jsonl.gz"
    with gzip.open(m, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    result = invoke("build", "--data", m, "--encoder", encoder_file, "--cache", store_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error")
    assert [ds.row(i) for i in range(len(ds))] == [{"label": i} for i in range(3)]
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip))


def test_gzipped_csv_and_tsv_manifests_are_read_as_their_plain_kind(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A CSV or TSV manifest compressed as ``rows.csv.gz`` / ``rows.tsv.gz`` (pandas'
    ``to_csv("x.csv.gz")``, a shell's ``gzip``) is read as the plain CSV or TSV is, through
    gzip: each row built and served equal to the encoder run now, its columns carried
    (before: not taken for a manifest at all, read as a folder that does not exist)."""
    clips = clips_for_rows(tmp_path, 3)
    for name, sep in (("rows.csv.gz", ","), ("rows.tsv.gz", "\t")):
        m = tmp_path / name
        with gzip.open(m, "wt", encoding="utf-8", newline="") as f:
            f.write(f"path{sep}speaker\n")
            f.write("".join(f"clips/{c.name}{sep}s {i}\n" for i, c in enumerate(clips)))
        result = invoke("build", "--data", m, "--encoder", encoder_file, "--cache", store_dir)
        assert result.returncode == 0, name + result.stdout + result.stderr
        ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error")
        assert [ds.row(i) for i in range(len(ds))] == [{"speaker": f"s {i}"} for i in range(3)]
        for i, clip in enumerate(clips):
            torch.testing.assert_close(ds[i], live_features(encoder_file, clip))


def test_a_row_decodes_in_a_process_that_never_scanned_by_what_it_carries(tmp_path: Path) -> None:
    # What an engine's worker gets with each row: the file, span and effects, not the row's
    # other columns; with one task's rows a fresh ManifestInputs (never scanned) decodes each
    # as the scanning one does, segments included, and holds only the last task's rows.
    long = tmp_path / "long.wav"
    soundfile.write(long, make_tone(3.0, 16000, seed=4), 16000)
    rows = [
        {"id": "whole", "path": str(long), "speaker": "x" * 1000},
        {"id": "seg", "path": str(long), "start": 0.5, "end": 1.25, "label": 3},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scanned = ManifestInputs(manifest)
    scanned.scan([".wav"])
    inner = AudioSource(Recipe())
    whole, seg = scanned.path("whole"), scanned.path("seg")
    carried = {p: scanned.carried(p) for p in (whole, seg)}
    assert all(c is not None and c.row == {} for c in carried.values())  # type: ignore[attr-defined]
    assert scanned.row("whole") and scanned.row("seg")  # the scan still holds the columns
    fresh = ManifestInputs(manifest)
    with pytest.raises(SourceError, match="not a row of the manifest now"):
        fresh.source(inner).load(whole)
    assert fresh.carry(carried) == {}
    for path in (whole, seg):
        torch.testing.assert_close(fresh.source(inner).load(path), scanned.source(inner).load(path))
    assert fresh.source(inner).load(seg).shape[-1] == 12000  # 0.75 s at 16 kHz: the segment
    assert fresh.carry({seg: carried[seg]}) == {}  # the next task's rows replace the last's
    with pytest.raises(SourceError, match="not a row of the manifest now"):
        fresh.source(inner).load(whole)


def test_a_nemo_manifest_serves_each_row_from_its_offset_for_its_duration(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """NeMo's manifests (`train_manifest.json`: JSON lines of `audio_filepath`, `offset`,
    `duration`, `text`) time a row by `offset` and `duration`: an `offset` (0 too) makes the row
    the segment `[offset, offset + duration)` (no duration: to the end), and a row without one
    is read from 0 for its `duration` (here the file's: the whole file). Before,
    `--data train_manifest.json` was read as a folder that does not exist, and the same rows in
    a `.jsonl` were each served whole, their offset carried as a label: features of the wrong
    audio, said nowhere."""
    long = long_recording(tmp_path / "long.wav", 4, 16000, seed=11)
    rows = [
        {"audio_filepath": "long.wav", "offset": 1.0, "duration": 0.5, "text": "a"},
        {"audio_filepath": "long.wav", "offset": 0, "duration": 1.25, "text": "b"},
        {"audio_filepath": "long.wav", "offset": 2.5, "text": "c"},
        {"audio_filepath": "long.wav", "duration": 4.0, "text": "d"},
        {"audio_filepath": "long.wav", "start": 3.0, "offset": 1.0, "duration": 0.5, "text": "e"},
    ]
    m = tmp_path / "train_manifest.json"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build(m, encoder_file, cache=store_dir, workers=0, column="audio_filepath")
    assert (report.encoded, report.failed) == (5, [])
    ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error", column="audio_filepath")
    spans = [(1.0, 1.5), (0.0, 1.25), (2.5, None), (None, None), (3.0, 3.5)]
    for i, (start, end) in enumerate(spans):
        assert ds.row(i)["text"] == rows[i]["text"]
        want = reference(encoder_file, long, start, end)
        torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-5)
    # A .json that is one JSON document, not JSON lines: one line saying so, nothing built.
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(rows, indent=2))
    with pytest.raises(SourceError, match="is not JSON lines"):
        build(whole, encoder_file, cache=store_dir, workers=0, column="audio_filepath")


class SamplesFed(nn.Module):
    """``[B, T]`` -> ``[B, T, 1]``: the features are the samples fed, exactly."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return wav.unsqueeze(-1)


def noise_file(path: Path, seconds: float, seed: int) -> Path:
    """``seconds`` of seeded noise at :data:`RATE` as float32 WAV (read back bit for bit)."""
    shape = (round(seconds * RATE), 1)
    soundfile.write(path, np.random.default_rng(seed).uniform(-0.9, 0.9, shape), RATE, "FLOAT")
    return path


def nemo_reads(file: Path, offset: float, duration: float) -> np.ndarray:
    """The samples NeMo's ``AudioSegment.from_file`` reads for a row, by its rule, with
    soundfile alone: from ``int(offset * rate)`` where the offset is above 0, then
    ``int(duration * rate)`` samples where the duration is above 0 (fewer at the file's end),
    else to the end."""
    rate = soundfile.info(str(file)).samplerate
    start = int(offset * rate) if offset > 0 else 0
    frames = int(duration * rate) if duration > 0 else -1
    audio, _ = soundfile.read(str(file), frames=frames, start=start, dtype="float32")
    return audio


def served_samples(ds: CachedFeatureDataset, i: int) -> np.ndarray:
    """Item ``i`` as served by a :class:`SamplesFed` store: the samples featbake read."""
    return ds[i][:, 0].numpy()


#: A NeMo row made by :func:`nemo_store`: (its file, the file's seconds, offset or None, duration).
NemoRow = tuple[str, float, float | None, float]


def nemo_store(tmp_path: Path, store: Path, rows: Sequence[NemoRow]) -> CachedFeatureDataset:
    """Build a NeMo manifest of ``rows`` (one file of noise per row) with a :class:`SamplesFed`
    encoder; the dataset serving it, each row checked equal to what NeMo's rule reads."""
    encoder = save_torchscript(SamplesFed(), tmp_path / "samples.pt")
    lines = []
    for k, (name, secs, offset, duration) in enumerate(rows):
        noise_file(tmp_path / name, secs, seed=40 + k)
        row = {"audio_filepath": name, "duration": duration, "text": f"t{k}"}
        lines.append(row if offset is None else {**row, "offset": offset})
    m = write_jsonl(tmp_path / "train_manifest.json", lines)
    report = build(m, encoder, cache=store, workers=0, column="audio_filepath")
    assert (report.encoded, report.failed) == (len(rows), [])
    ds = quiet_dataset(m, encoder, store, on_miss="error", column="audio_filepath")
    for i, (name, _, offset, duration) in enumerate(rows):
        want = nemo_reads(tmp_path / name, offset or 0.0, duration)
        np.testing.assert_array_equal(served_samples(ds, i), want, err_msg=f"row {i}")
        assert ds.row(i)["text"] == f"t{i}"
    return ds


def test_a_nemo_row_without_an_offset_is_read_for_its_duration_from_0(
    tmp_path: Path, store_dir: Path
) -> None:
    """NeMo's datasets pass every manifest row's ``duration`` to ``AudioSegment.from_file``,
    with ``offset=0`` where the row has none: it reads ``int(duration * rate)`` samples from
    the file's start, truncated (0.30007 s at 16 kHz: 4,801 of 4,801.12; 0.30004 s: 4,800 of
    4,800.64, where the nearest sample would read 4,801). Before, a ``duration`` without an
    ``offset`` was taken for a label and each row was served its whole file (16,000, 16,000
    and 32,000 samples). Each id names its duration, as a segment from 0 is named."""
    rows = [("a.wav", 1.0, None, 0.30007), ("b.wav", 1.0, None, 0.30004), ("c.wav", 2.0, None, 1.5)]
    ds = nemo_store(tmp_path, store_dir, rows)
    assert [len(served_samples(ds, i)) for i in range(3)] == [4801, 4800, 24000]
    ids = ["a.wav#0.0-0.30007", "b.wav#0.0-0.30004", "c.wav#0.0-1.5"]
    assert [ds.item_id(i) for i in range(3)] == ids


def test_nemo_rows_of_one_file_and_other_durations_are_other_items_never_served_the_old(
    tmp_path: Path, store_dir: Path
) -> None:
    """A second review of r24.3: a NeMo row without an offset was named by its path whatever
    its duration, so two rows of one file with other durations were refused as one id (the
    whole manifest, exit 8), and a row whose file was deleted, its duration edited since, was
    served the old duration's features as built (32,000 samples where it reads 8,000). The
    id now names the duration: both rows are items, and the edited row is not served."""
    encoder = save_torchscript(SamplesFed(), tmp_path / "samples.pt")
    noise_file(tmp_path / "a.wav", 3.0, seed=60)
    rows = [
        {"audio_filepath": "a.wav", "duration": 1.0, "text": "one"},
        {"audio_filepath": "a.wav", "duration": 2.0, "text": "two"},
    ]
    m = write_jsonl(tmp_path / "train_manifest.json", rows)
    report = build(m, encoder, cache=store_dir, workers=0, column="audio_filepath")
    assert (report.encoded, report.failed) == (2, [])
    ds = quiet_dataset(m, encoder, store_dir, on_miss="error", column="audio_filepath")
    assert [len(served_samples(ds, i)) for i in range(2)] == [16000, 32000]
    (tmp_path / "a.wav").unlink()
    write_jsonl(m, [{**rows[1], "duration": 0.5}])
    gone = quiet_dataset(m, encoder, store_dir, column="audio_filepath")
    assert len(gone) == 0


def test_a_nemo_duration_of_0_or_less_reads_to_the_end_from_the_offset(
    tmp_path: Path, store_dir: Path
) -> None:
    """NeMo's ``AudioSegment.from_file`` reads to the file's end where ``duration > 0`` does
    not hold (``duration: 0``, or below), from ``int(offset * rate)`` where the row has an
    offset. Before, ``duration: 0`` at an offset was a bad row ("start 0.5 is not before end
    0.5") and a negative one was refused ("not a time in the recording"): the build failed
    them; ``duration: 0`` without an offset was served whole (NeMo's read, by luck)."""
    rows = [("d.wav", 1.5, None, 0), ("e.wav", 2.0, 0.5, 0), ("f.wav", 1.0, 0.25, -1)]
    ds = nemo_store(tmp_path, store_dir, rows)
    assert [len(served_samples(ds, i)) for i in range(3)] == [24000, 24000, 12000]
    assert [ds.item_id(i) for i in range(3)] == ["d.wav", "e.wav#0.5-inf", "f.wav#0.25-inf"]


def test_a_nemo_row_at_a_negative_offset_is_read_from_0_as_nemos_is(
    tmp_path: Path, store_dir: Path
) -> None:
    """NeMo's ``AudioSegment.from_file`` seeks only ``if offset > 0``: a row at a negative
    offset reads from the file's start (``int(duration * rate)`` samples, or to the end for a
    duration of 0 or less). Before, such a row was refused ("offset -0.5 is not a time in
    the recording"): built, it failed. A row of another manifest (no ``audio_filepath``) at a
    negative offset is still refused, naming it."""
    rows = [("g.wav", 1.0, -0.5, 0.5), ("h.wav", 1.5, -1.0, 0), ("i.wav", 1.0, -0.25, 0.30007)]
    ds = nemo_store(tmp_path, store_dir, rows)
    assert [len(served_samples(ds, i)) for i in range(3)] == [8000, 24000, 4801]
    assert [ds.item_id(i) for i in range(3)] == ["g.wav#0.0-0.5", "h.wav", "i.wav#0.0-0.30007"]
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [{"path": "g.wav", "offset": -0.5, "duration": 0.5}]
    )
    report = build(plain, tmp_path / "samples.pt", cache=store_dir, workers=0)
    assert (report.encoded, len(report.failed)) == (0, 1), report
    assert "offset -0.5 is not a time in the recording" in str(report.failed[0])


def test_a_nemo_read_past_its_files_end_stops_there_as_nemos_does(
    tmp_path: Path, store_dir: Path
) -> None:
    """NeMo's ``read(int(duration * rate))`` stops at the file's end (soundfile reads what is
    there): a whole-file row whose ``duration`` was rounded up (2.01 s for a 2 s file) is the
    whole file, keyed as the file; a row at an offset whose duration runs past the end is the
    rest of the file. Before, the offset row was refused ("ends past the end of its
    recording"): built, it failed; an offset past the end is still refused, naming its start."""
    encoder = save_torchscript(SamplesFed(), tmp_path / "samples.pt")
    long = noise_file(tmp_path / "long.wav", 2.0, seed=50)
    rows = [
        {"audio_filepath": "long.wav", "duration": 2.01, "text": "whole"},
        {"audio_filepath": "long.wav", "offset": 1.5, "duration": 1.0, "text": "rest"},
        {"audio_filepath": "long.wav", "offset": 2.5, "duration": 1.0, "text": "past"},
    ]
    m = write_jsonl(tmp_path / "train_manifest.json", rows)
    report = build(m, encoder, cache=store_dir, workers=0, column="audio_filepath")
    assert (report.encoded, len(report.failed)) == (2, 1), report.failed
    assert "starts at 2.5 s, at or past the end of its recording" in str(report.failed[0])
    ds = quiet_dataset(m, encoder, store_dir, on_miss="error", column="audio_filepath")
    for i, (offset, duration) in enumerate([(0.0, 2.01), (1.5, 1.0)]):
        want = nemo_reads(long, offset, duration)
        np.testing.assert_array_equal(served_samples(ds, i), want, err_msg=f"row {i}")
    assert [len(served_samples(ds, i)) for i in range(2)] == [32000, 8000]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"path": "long.wav"}])
    assert ds.key(0) == quiet_dataset(plain, encoder, store_dir, on_miss="error").key(0)


def test_a_damaged_gzip_manifest_is_one_line_and_nan_first_rows_are_rows(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Round eight, review: telling a cut manifest from rows reads the first line of a
    ``.jsonl.gz``; a damaged gzip body there escaped as zlib's error (an internal error at the
    CLI), and a first row holding a top-level NaN or Infinity (``json.dumps`` writes them) was
    taken for no JSON object, so a manifest of rows was opened as lhotse cuts and every row
    skipped as "not a cut". A damaged file is now one line naming it; such rows are rows."""
    good = tmp_path / "a.wav"
    soundfile.write(good, make_tone(0.5, 16000, seed=5), 16000)
    rows = [{"path": "a.wav", "snr": float("nan")}, {"path": "a.wav", "snr": float("inf"), "id": 2}]
    m = tmp_path / "rows.jsonl.gz"
    with gzip.open(m, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    report = build(m, encoder_file, cache=store_dir, workers=0)
    assert (report.encoded, report.failed, report.files) == (1, [], 2)
    ds = quiet_dataset(m, encoder_file, store_dir, on_miss="error")
    for i in range(2):
        torch.testing.assert_close(ds[i], live_features(encoder_file, good))

    damaged = bytearray(m.read_bytes())
    damaged[20:40] = bytes(20)  # the deflate stream garbled, the gzip header intact
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(damaged))
    res = run_cli("build", "-e", encoder_file, "-d", bad, "--cache", tmp_path / "s2", timeout=120)
    assert res.returncode in (3, 8), res.stdout + res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert str(bad) in res.stdout + res.stderr
