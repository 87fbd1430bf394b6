"""featbake serves what the user's own loader gives: a NeMo manifest's rows as NeMo's
``AudioSegment.from_file`` reads them, a row timed by ``start`` + ``duration`` as lhotse counts
it, a ``datasets`` Audio column at the rate ``cast_column`` declared (or a build refused in one
line), and a webdataset ``--column`` no sample holds named with the members they do hold.

Each reference is computed here without featbake: the samples the tool's loader reads (NeMo's
seek-and-read logic verbatim, lhotse's own ``Recording.load_audio``, the cell's bytes decoded
at the rate ``datasets`` declares), run through an encoder loaded afresh whose features are the
very samples fed, so one sample early, late or extra is seen.
"""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from torch import nn

from featbake.bake.pipeline import build
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.webdataset import WebDataset
from featbake.errors import SourceError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import save_torchscript
from tests.conftest import run_cli

RATE = 16000


class Samples(nn.Module):
    """``[B, T]`` -> ``[B, T, 1]``: the features are the samples fed, exactly."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return wav.unsqueeze(-1)


@pytest.fixture
def samples_encoder(tmp_path: Path) -> Path:
    return save_torchscript(Samples(), tmp_path / "samples.pt")


def encoded_now(encoder: Path, audio: np.ndarray) -> torch.Tensor:
    """The encoder, loaded afresh, on ``[T]`` samples (no batch dimension in the result)."""
    with torchscript_quietly():
        module = torch.jit.load(str(encoder))
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None])[0]


def noise_wav(path: Path, seconds: float, rate: int, seed: int, channels: int = 1) -> np.ndarray:
    """``seconds`` of seeded noise written as float32 WAV (no quantisation); its samples."""
    shape = (round(seconds * rate), channels)
    samples = np.random.default_rng(seed).uniform(-0.9, 0.9, shape).astype(np.float32)
    soundfile.write(path, samples, rate, subtype="FLOAT")
    return samples


def dataset(data: Path, encoder: Path, cache: Path, **kw: Any) -> CachedFeatureDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "creating a store"
        return CachedFeatureDataset(data, encoder, cache=cache, on_miss="error", **kw)


# -- NeMo: offset and duration, each truncated ------------------------------------------------
def nemo_from_file(audio_file: Path, offset: float, duration: float) -> np.ndarray:
    """NeMo's ``AudioSegment.from_file`` (its soundfile branch), verbatim: seek to
    ``int(offset * sr)``, read ``int(duration * sr)`` samples."""
    with soundfile.SoundFile(str(audio_file), "r") as f:
        sample_rate = f.samplerate
        if offset is not None and offset > 0:
            f.seek(int(offset * sample_rate))
        if duration is not None and duration > 0:
            return f.read(int(duration * sample_rate), dtype="float32")
        return f.read(dtype="float32")


#: (offset, duration) of a NeMo manifest's rows: three fall between two samples, where NeMo
#: truncates and rounding to the nearest sample starts or ends one sample off.
NEMO_ROWS = [(1.23456, 2.1), (3.00004, 1.50003), (5.5, 2.0), (7.81234, 3.45678), (12.0, 1.0)]


def test_a_nemo_manifest_row_is_read_as_nemo_truncates_its_offset_and_duration(
    tmp_path: Path, samples_encoder: Path, store_dir: Path
) -> None:
    """A NeMo ``train_manifest.json`` (``audio_filepath``, ``offset``, ``duration``) built by
    the CLI serves each row the samples NeMo's own loader reads: from ``int(offset * sr)``,
    ``int(duration * sr)`` of them. Before, featbake rounded ``offset * sr`` and
    ``(offset + duration) * sr``: rows 0, 1 and 3 started one sample late (19,753 where NeMo
    reads from 19,752) and row 3 held 55,309 samples where NeMo reads 55,308. The keys follow
    the samples read: a row naming the old (nearest) bounds keys apart from the NeMo row."""
    long = tmp_path / "long.wav"
    full = noise_wav(long, 20, RATE, seed=7)[:, 0]
    rows = [
        {"audio_filepath": "long.wav", "offset": o, "duration": d, "text": f"utt {k}"}
        for k, (o, d) in enumerate(NEMO_ROWS)
    ]
    m = tmp_path / "train_manifest.json"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli("build", "-e", samples_encoder, "-d", m, "--column", "audio_filepath",
                  "--cache", store_dir)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    ds = dataset(m, samples_encoder, store_dir, column="audio_filepath")
    for i, (offset, duration) in enumerate(NEMO_ROWS):
        want = encoded_now(samples_encoder, nemo_from_file(long, offset, duration))
        assert ds.row(i)["text"] == f"utt {i}"
        torch.testing.assert_close(ds[i], want, rtol=0, atol=0, msg=f"row {i}")
    assert [ds[i].shape[0] for i in range(5)] == [33600, 24000, 32000, 55308, 16000]
    assert ds[3][0, 0].item() == full[124997]  # NeMo's first sample; nearest was 124,998
    # The old cut (nearest bounds of the same seconds) is another key: a store built before
    # never serves it for the NeMo row.
    nearest = tmp_path / "nearest.jsonl"
    spans = [{"path": "long.wav", "start": o, "end": o + d} for o, d in NEMO_ROWS]
    nearest.write_text("".join(json.dumps(r) + "\n" for r in spans))
    old = dataset(nearest, samples_encoder, store_dir)
    moved = [ds.key(i) != old.key(i) for i in range(5)]
    assert moved == [True, True, False, True, False]


# -- lhotse: start and duration, each counted half up ------------------------------------------
def test_a_row_timed_by_start_and_duration_is_read_as_lhotse_loads_it(
    tmp_path: Path, samples_encoder: Path, store_dir: Path
) -> None:
    """A JSONL row timed by ``start`` and ``duration`` (lhotse's timing of cuts and
    supervisions) serves the samples lhotse's own ``Recording.load_audio(offset, duration)``
    reads: the start and the duration each counted by ``compute_num_samples``. Before, the
    row's end was ``start + duration`` rounded to the nearest sample: at start = duration =
    1.00002 s featbake read 16,001 samples where lhotse reads 16,000."""
    lhotse = pytest.importorskip("lhotse")
    long = tmp_path / "long.wav"
    noise_wav(long, 4, RATE, seed=3)
    rows = [
        {"id": "a", "path": "long.wav", "start": 1.00002, "duration": 1.00002},
        {"id": "b", "path": "long.wav", "start": 2.3, "duration": 0.70004},
    ]
    m = tmp_path / "rows.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build(m, samples_encoder, cache=store_dir, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    ds = dataset(m, samples_encoder, store_dir)
    rec = lhotse.Recording.from_file(str(long))
    for i, row in enumerate(rows):
        audio = rec.load_audio(offset=row["start"], duration=row["duration"])[0]
        torch.testing.assert_close(ds[i], encoded_now(samples_encoder, audio), rtol=0, atol=0)
    assert [ds[i].shape[0] for i in range(2)] == [16000, 11201]


# -- datasets: an Audio column cast to another rate --------------------------------------------
def wav_cell(seconds: float, rate: int, seed: int, channels: int = 1) -> dict[str, Any]:
    """A ``datasets`` Audio cell: float32 WAV bytes of seeded noise."""
    out = io.BytesIO()
    shape = (round(seconds * rate), channels)
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, shape).astype(np.float32)
    soundfile.write(out, samples, rate, format="WAV", subtype="FLOAT")
    return {"bytes": out.getvalue(), "path": f"clip{seed}.wav"}


def cast_dataset(tmp_path: Path, layout: str, cells: list[dict[str, Any]], **audio: Any) -> Path:
    """``cells`` as a ``datasets`` Audio column cast by ``Audio(**audio)``, saved as
    ``save_to_disk`` writes it, or as a parquet file (the Hub's layout)."""
    datasets = pytest.importorskip("datasets")
    labels = list(range(len(cells)))
    ds = datasets.Dataset.from_dict({"audio": cells, "label": labels})
    ds = ds.cast_column("audio", datasets.Audio(**audio))
    if layout == "parquet":
        ds.to_parquet(str(tmp_path / "cast.parquet"))
        return tmp_path / "cast.parquet"
    ds.save_to_disk(str(tmp_path / "cast"))
    return tmp_path / "cast"


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet"])
def test_a_datasets_audio_column_cast_to_8k_is_said_at_16k_and_built_at_8k(
    tmp_path: Path, samples_encoder: Path, store_dir: Path, layout: str
) -> None:
    """``ds.cast_column("audio", Audio(sampling_rate=8000))``: ``datasets`` gives each row at
    8 kHz, and the feature is recorded (``dataset_info.json``, the files' ``huggingface``
    metadata). A build at the default 16 kHz says so in one note naming the column, both
    rates and ``--sample-rate 8000`` (not refused: a Hub dataset declares its files' own rate
    where a training loop casts it to the encoder's); with ``--sample-rate 8000`` each row is
    served the encoder run now on the 8,000 samples a second that ``datasets`` gives (the cells
    are 8 kHz WAVs, which it decodes as they are). Before, the build served 16,000 samples a
    second, upsampled, said nowhere."""
    cells = [wav_cell(1.0, 8000, seed=i) for i in range(3)]
    data = cast_dataset(tmp_path, layout, cells, sampling_rate=8000)
    res = run_cli("build", "-e", samples_encoder, "-d", data, "--column", "audio",
                  "--cache", store_dir)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    said = [line for line in (res.stdout + res.stderr).splitlines() if "8000 Hz" in line]
    assert len(said) == 1, res.stdout + res.stderr
    for part in ("note", "column 'audio'", "16000 Hz", "--sample-rate 8000"):
        assert part in said[0], said[0]

    res = run_cli("build", "-e", samples_encoder, "-d", data, "--column", "audio",
                  "--cache", store_dir, "--sample-rate", "8000")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "8000 Hz" not in res.stdout + res.stderr
    ds = dataset(data, samples_encoder, store_dir, column="audio", sample_rate=8000)
    for i, cell in enumerate(cells):
        given, rate = soundfile.read(io.BytesIO(cell["bytes"]), dtype="float32")
        assert rate == 8000 and ds[i].shape == (8000, 1)
        torch.testing.assert_close(ds[i], encoded_now(samples_encoder, given), rtol=0, atol=0)


@pytest.mark.parametrize(("channels", "mono", "fix"), [(2, True, "pass --no-mono"),
                                                       (1, False, "drop --no-mono")])  # fmt: skip
def test_a_datasets_audio_column_of_declared_channels_says_the_other_layout(
    tmp_path: Path, encoder_file: Path, store_dir: Path, channels: int, mono: bool, fix: str
) -> None:
    """``Audio(num_channels=2)`` gives each row's two channels, ``num_channels=1`` one mixed:
    a recipe that mixes (keeps) them is said in one note naming the flag that matches (before:
    built without a word, the encoder fed what the user's loader never gives)."""
    cells = [wav_cell(0.5, RATE, seed=i, channels=2) for i in range(2)]
    data = cast_dataset(tmp_path, "save_to_disk", cells, num_channels=channels)
    report = build(data, encoder_file, cache=store_dir, workers=0, recipe=Recipe(mono=mono))
    assert [n for n in report.notes if fix in n and "column 'audio'" in n], report.notes
    matching = build(data, encoder_file, cache=tmp_path / "s", workers=0,
                     recipe=Recipe(mono=not mono))  # fmt: skip
    assert not [n for n in matching.notes if "column 'audio'" in n], matching.notes


# -- webdataset: a --column no sample holds --------------------------------------------------
def test_a_column_no_sample_holds_names_the_members_the_samples_hold(tmp_path: Path) -> None:
    """Samples of ``.clean.wav``, ``.noisy.wav`` and ``.txt`` members built with ``--column
    wav``: each sample is set aside saying which ``--column`` names its audio, and the scan's
    error offers ``--column clean.wav`` (before: "no a .wav member", "e.g. --column jpg")."""
    tar = tmp_path / "train-0.tar"
    with tarfile.open(tar, "w") as t:
        for k in range(2):
            for name in ("clean.wav", "noisy.wav"):
                data = io.BytesIO()
                soundfile.write(data, np.zeros(1600, np.float32), RATE, format="WAV")
                info = tarfile.TarInfo(f"utt{k}.{name}")
                info.size = len(data.getvalue())
                t.addfile(info, io.BytesIO(data.getvalue()))
            info = tarfile.TarInfo(f"utt{k}.txt")
            info.size = 2
            t.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(SourceError) as raised:
        WebDataset(str(tar), column="wav").scan([".wav", ".flac"])
    said = str(raised.value)
    assert "no member .wav (it has .clean.wav, .noisy.wav, .txt;" in said
    assert "--column clean.wav or --column noisy.wav names one" in said
    assert said.endswith("name a member the samples hold with --column (e.g. --column clean.wav) "
                         "or pick --source")  # fmt: skip
    assert "no a " not in said and "--column jpg" not in said
