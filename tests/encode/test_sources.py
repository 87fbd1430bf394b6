"""Sources: decoding, mixdown, resampling against soxr itself, crops, and bad files named."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
import torch

from featbake.encode.sources import (
    AudioSource,
    NpySource,
    SkippedInput,
    scan,
    scan_inputs,
    source_for,
)
from featbake.errors import SourceError
from featbake.recipe import Recipe
from featbake.testing import make_tone, write_audio_folder


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg"])
def test_decodes_each_format(tmp_path: Path, fmt: str) -> None:
    clip = make_tone(0.5, 16000, seed=3)[:, 0]
    path = tmp_path / f"a.{fmt}"
    soundfile.write(path, clip, 16000)
    got = AudioSource(Recipe()).load(path)
    assert got.dtype == torch.float32 and got.shape == (8000,)
    want, _ = soundfile.read(path, dtype="float32")
    assert torch.equal(got, torch.from_numpy(want))
    if fmt != "ogg":  # lossless formats give the samples back (within 16-bit quantisation)
        assert np.abs(got.numpy() - clip).max() < 1e-4


def test_stereo_is_mixed_to_mono_or_kept(tmp_path: Path) -> None:
    stereo = make_tone(0.25, 16000, seed=4, channels=2)
    path = tmp_path / "s.wav"
    soundfile.write(path, stereo, 16000, subtype="FLOAT")
    mono = AudioSource(Recipe()).load(path)
    assert torch.allclose(mono, torch.from_numpy(stereo.mean(axis=1)), atol=1e-7)
    both = AudioSource(Recipe(mono=False)).load(path)
    assert both.shape == (2, 4000) and torch.equal(both, torch.from_numpy(stereo.T.copy()))


@pytest.mark.parametrize("rate", [44100, 8000])
def test_resampling_matches_soxr(tmp_path: Path, rate: int) -> None:
    clip = make_tone(0.7, rate, seed=5)
    path = tmp_path / f"r{rate}.wav"
    soundfile.write(path, clip, rate, subtype="FLOAT")
    got = AudioSource(Recipe(sample_rate=16000)).load(path)
    want = soxr.resample(clip, rate, 16000, quality="HQ")[:, 0]
    assert got.shape == want.shape and abs(len(want) - 0.7 * 16000) <= 1
    assert np.array_equal(got.numpy(), want.astype(np.float32))


def test_max_seconds_crops_after_resampling(tmp_path: Path) -> None:
    clip = make_tone(3.0, 44100, seed=6)
    path = tmp_path / "long.wav"
    soundfile.write(path, clip, 44100, subtype="FLOAT")
    got = AudioSource(Recipe(max_seconds=1.25)).load(path)
    assert got.shape == (20000,)
    whole = soxr.resample(clip, 44100, 16000, quality="HQ")[:, 0]
    # Only the first 1.25 s and the resampler's context are decoded, and the crop equals
    # resampling it all to float32's rounding, its last samples too (a margin of 64 samples
    # left them up to 1e-2 off).
    assert np.abs(got.numpy() - whole[:20000]).max() < 1e-5
    short = AudioSource(Recipe(max_seconds=10)).load(path)  # longer than the file: no padding
    assert short.shape == whole.shape


def test_crop_at_the_native_rate_is_exact(tmp_path: Path) -> None:
    clip = make_tone(2.0, 16000, seed=7)[:, 0]
    path = tmp_path / "c.wav"
    soundfile.write(path, clip, 16000, subtype="FLOAT")
    got = AudioSource(Recipe(max_seconds=0.5)).load(path)
    assert np.array_equal(got.numpy(), clip[:8000])


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    no_samples = tmp_path / "nosamples.wav"
    soundfile.write(no_samples, np.zeros((0,), dtype=np.float32), 16000)
    text = tmp_path / "text.flac"
    text.write_text("this is not audio at all\n" * 20)
    good = tmp_path / "good.wav"
    soundfile.write(good, make_tone(0.5, seed=8), 16000)
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(good.read_bytes()[:30])  # a header cut short
    nan = tmp_path / "nan.wav"
    soundfile.write(nan, np.array([0.0, np.nan, 0.1], dtype=np.float32), 16000, subtype="FLOAT")
    one = tmp_path / "one.wav"  # no sample left at 16 kHz (was encoded as an empty clip)
    soundfile.write(one, np.array([0.5], dtype=np.float32), 44100, subtype="FLOAT")
    loud = tmp_path / "loud.wav"  # finite, but soxr's filter overflows float32 to inf / NaN
    noise = np.random.default_rng(0).standard_normal(4410).astype(np.float32)
    soundfile.write(loud, noise / np.abs(noise).max() * 3.3e38, 44100, subtype="FLOAT")
    loud_stereo = tmp_path / "loud_stereo.wav"  # at 16 kHz: the mix of two channels overflows
    both = np.full((1600, 2), 3e38, np.float32)
    soundfile.write(loud_stereo, both, 16000, subtype="FLOAT")
    return {
        "empty": empty,
        "nosamples": no_samples,
        "text": text,
        "truncated": truncated,
        "nan": nan,
        "one": one,
        "loud": loud,
        "loud_stereo": loud_stereo,
        "missing": tmp_path / "missing.wav",
    }


@pytest.mark.parametrize(
    ("which", "reason"),
    [
        ("empty", "cannot decode audio"),
        ("nosamples", "holds no audio samples"),
        ("text", "cannot decode audio"),
        ("truncated", "cannot decode audio"),
        ("nan", "NaN"),
        ("one", "1 sample\\(s\\) at 44,100 Hz leave none resampled to 16,000 Hz"),
        ("loud", "the largest 3.3e\\+38\\) overflow float32 when mixed, resampled or normalised"),
        ("loud_stereo", "the largest 3e\\+38\\) overflow float32"),
        ("missing", "file not found"),
    ],
)
def test_bad_audio_is_a_source_error_naming_the_path(
    tmp_path: Path, which: str, reason: str
) -> None:
    path = _bad_files(tmp_path)[which]
    with pytest.raises(SourceError, match=reason) as e:
        AudioSource(Recipe()).load(path)
    assert str(path) in str(e.value)


def test_audio_normalised_past_float32_is_a_source_error(tmp_path: Path) -> None:
    """Finite mono samples far past [-1, 1] at the recipe's rate: normalising them made NaN
    features (the encoder was blamed) or, where only the variance overflowed, all-zero ones,
    served silently. The file is named instead; a float file a few times past 1 is normalised."""
    loud = tmp_path / "loud.wav"
    soundfile.write(loud, np.linspace(-3e38, 3e38, 1600, dtype=np.float32), 16000, subtype="FLOAT")
    with pytest.raises(SourceError, match=r"loud.wav: its samples .* overflow float32"):
        AudioSource(Recipe(normalize=True)).load(loud)
    big = tmp_path / "big.wav"  # a float32 variance of 1e20 noise is inf: every sample was 0
    noise = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 1e20
    soundfile.write(big, noise, 16000, subtype="FLOAT")
    with pytest.raises(SourceError, match=r"big.wav: its samples .* overflow float32"):
        AudioSource(Recipe(normalize=True)).load(big)
    fine = tmp_path / "fine.wav"  # a float file past [-1, 1], as some are: normalised as before
    soundfile.write(fine, noise / 1e20 * 40, 16000, subtype="FLOAT")
    got = AudioSource(Recipe(normalize=True)).load(fine).numpy()
    assert abs(float(got.std()) - 1) < 1e-3


def test_npy_source(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    np.save(tmp_path / "a.npy", arr)
    src = source_for(Recipe(source="npy"))
    assert isinstance(src, NpySource) and src.extensions == (".npy",)
    got = src.load(tmp_path / "a.npy")
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(arr.astype(np.float32)))
    np.save(tmp_path / "empty.npy", np.zeros((0, 3)))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "str.npy", np.array(["a", "b"]))
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    for name, reason in [
        ("empty.npy", "empty"),
        ("obj.npy", "not a readable .npy"),  # object arrays would need a pickle: refused
        ("str.npy", "cannot be encoded"),
        ("bad.npy", "not a readable .npy"),
        ("none.npy", "file not found"),
    ]:
        with pytest.raises(SourceError, match=reason) as e:
            src.load(tmp_path / name)
        assert name in str(e.value)


def test_scan_is_recursive_sorted_and_skips_hidden(tmp_path: Path) -> None:
    for rel in [
        "b.wav",
        "a/z.FLAC",
        "a/b/c.ogg",
        ".hidden/x.wav",
        "a/.y.wav",
        "notes.txt",
        "c.mp3",
    ]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    exts = AudioSource(Recipe()).extensions
    assert {".wav", ".flac", ".ogg"} <= set(exts)
    found = scan(tmp_path, exts)
    expected = ["a/b/c.ogg", "a/z.FLAC", "b.wav"] + (["c.mp3"] if ".mp3" in exts else [])
    assert found == sorted(expected)
    assert scan(tmp_path, exts) == found  # stable


def test_scan_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        scan(tmp_path / "nope", [".wav"])
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(SourceError, match="no input files"):
        scan(tmp_path, [".wav"])


def test_scan_skips_a_fifo_with_a_reason_and_never_opens_it(tmp_path: Path) -> None:
    write_audio_folder(tmp_path, 2, seconds=0.2)
    os.mkfifo(tmp_path / "x.wav")  # opening it for reading would block forever
    found = scan_inputs(tmp_path, [".wav"])
    assert found.inputs == ["clip00000.wav", "clip00001.wav"]
    assert [s.path for s in found.skipped] == ["x.wav"]
    assert "not a regular file (a FIFO)" in found.skipped[0].reason


def test_scan_follows_each_folder_once_through_a_symlink_loop(tmp_path: Path) -> None:
    write_audio_folder(tmp_path / "a", 1, seconds=0.2)
    os.symlink(".", tmp_path / "link")  # link -> .: os.walk(followlinks) went 40 levels deep
    os.symlink("..", tmp_path / "a" / "up")
    (tmp_path / "b").symlink_to(tmp_path / "a")  # the same folder under a second name
    assert scan(tmp_path, [".wav"]) == ["a/clip00000.wav"]


def test_scan_skips_a_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    write_audio_folder(tmp_path, 1, seconds=0.2)
    bad = os.path.join(os.fsencode(tmp_path), b"take\xff.wav")
    os.link(os.fsencode(tmp_path / "clip00000.wav"), bad)
    found = scan_inputs(tmp_path, [".wav"])
    assert found.inputs == ["clip00000.wav"]
    assert found.skipped == [
        SkippedInput("take\\xff.wav", found.skipped[0].reason),
    ]
    assert "not valid UTF-8" in found.skipped[0].reason
    found.skipped[0].path.encode("utf-8")  # printable and storable
