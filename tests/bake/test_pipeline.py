"""The bake as a library: reuse, equality with live encoding, bad inputs, strictness, batching."""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

import featbake.encode.fingerprints
import featbake.store.shard as store_mod
from featbake.bake.batching import ShapeBatcher
from featbake.bake.pipeline import build
from featbake.bake.threads import AHEAD, decoded_items
from featbake.encode.encoders import from_module
from featbake.encode.outputs import encode_batch
from featbake.encode.sources import source_for
from featbake.errors import ConfigError, EncodeError, SourceError, StoreError
from featbake.progress import Progress
from featbake.recipe import Recipe
from featbake.store.catalog import Catalog
from featbake.store.hash_cache import FileStat
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.conftest import live_features
from tests.helpers import assert_store_consistent, stored_features


def test_rebuild_encodes_nothing_and_features_equal_live(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "c"
    first = build(audio_dir, encoder_file, cache=cache, batch_size=4, workers=2)
    assert (first.files, first.encoded, first.reused, first.failed) == (16, 16, 0, [])
    assert first.shards_written == 1 and first.bytes_written > 0
    again = build(audio_dir, encoder_file, cache=cache, batch_size=4, workers=2)
    assert (again.encoded, again.reused, again.bytes_written, again.shards_written) == (0, 16, 0, 0)
    stored = stored_features(cache, first.root)
    assert len(stored) == 16
    for rel, parts in stored.items():
        live = live_features(encoder_file, audio_dir / rel)
        assert parts[""].dtype == torch.float32
        assert torch.allclose(parts[""], live, rtol=1e-5, atol=1e-6), rel
    assert_store_consistent(cache)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_stored_dtype_equals_live_output_cast(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, dtype: str
) -> None:
    recipe = Recipe(dtype=dtype)
    # batch_size=1 runs the exact computation live encoding does: equality is bit for bit.
    report = build(audio_dir, encoder_file, cache=tmp_path / "c", recipe=recipe, batch_size=1)
    assert report.encoded == 16
    for rel, parts in stored_features(tmp_path / "c", report.root).items():
        live = live_features(encoder_file, audio_dir / rel, recipe)
        assert parts[""].dtype == recipe.torch_dtype
        assert torch.equal(parts[""], live), rel


def test_batched_encoding_is_within_the_stored_dtype(tmp_path: Path, encoder_file: Path) -> None:
    data = tmp_path / "same"
    write_audio_folder(data, 20, seconds=1.0, seed=9)  # one shape: real batches of 8
    recipe = Recipe(dtype="float16")
    report = build(data, encoder_file, cache=tmp_path / "c", recipe=recipe, batch_size=8)
    for rel, parts in stored_features(tmp_path / "c", report.root).items():
        live = live_features(encoder_file, data / rel, recipe)
        assert torch.allclose(parts[""].float(), live.float(), rtol=2e-3, atol=1e-4), rel


def test_corrupt_audio_is_reported_and_the_rest_stored(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    (audio_dir / "bad.wav").write_bytes(b"RIFF....WAVEfmt garbage")
    (audio_dir / "empty.flac").write_bytes(b"")
    soundfile.write(audio_dir / "silent.wav", np.zeros(0, dtype=np.float32), 16000)
    report = build(audio_dir, encoder_file, cache=tmp_path / "c", workers=2)
    assert report.encoded == 16 and report.files == 19
    failed = dict(report.failed)
    assert set(failed) == {"bad.wav", "empty.flac", "silent.wav"}
    assert "cannot decode audio" in failed["bad.wav"]
    assert "no audio samples" in failed["silent.wav"]
    assert not report.ok
    stored = stored_features(tmp_path / "c", report.root)
    assert set(stored) == {
        p for p, _ in Catalog(Layout(tmp_path / "c")).root_items(report.root)
    } - set(failed)
    # A rerun retries only the failures.
    again = build(audio_dir, encoder_file, cache=tmp_path / "c")
    assert again.encoded == 0 and len(again.failed) == 3


def test_an_encoder_error_on_one_item_skips_only_that_item(
    tmp_path: Path, encoder_file: Path
) -> None:
    data = tmp_path / "d"
    write_audio_folder(data, 6, seconds=0.5, seed=3)
    # 0.01 s is shorter than the encoder's first conv kernel (400 samples): it raises on that
    # input alone, inside a batch of equal shapes with a good neighbour.
    soundfile.write(data / "tiny1.wav", np.full(160, 0.1, np.float32), 16000)
    soundfile.write(data / "tiny2.wav", np.full(160, 0.2, np.float32), 16000)
    report = build(data, encoder_file, cache=tmp_path / "c", batch_size=4)
    assert report.encoded == 6
    assert [p for p, _ in report.failed] == ["tiny1.wav", "tiny2.wav"]
    assert "failed on a batch of shape (1, 160)" in report.failed[0][1]


def test_strict_stops_at_the_first_failure_and_keeps_what_was_encoded(
    tmp_path: Path, encoder_file: Path
) -> None:
    data = tmp_path / "d"
    write_audio_folder(data, 10, seconds=0.5, seed=4)
    (data / "clip00005.wav").write_bytes(b"broken")
    with pytest.raises(SourceError, match=r"clip00005\.wav"):
        build(data, encoder_file, cache=tmp_path / "c", batch_size=1, workers=0, strict=True)
    cat = Catalog(Layout(tmp_path / "c"))
    stored = cat.conn.execute("SELECT COUNT(*) FROM features").fetchone()[0]
    cat.close()
    assert stored == 5  # the five before it were sealed, nothing after it was encoded
    report = build(data, encoder_file, cache=tmp_path / "c", workers=0)
    assert report.encoded == 4 and len(report.failed) == 1


def test_npy_inputs(tmp_path: Path) -> None:
    data = tmp_path / "arrays"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        np.save(data / f"a{i}.npy", rng.standard_normal((3, 8)).astype(np.float32))
    lin = torch.nn.Linear(8, 4)
    report = build(data, lin, cache=tmp_path / "c", recipe=Recipe(source="npy"), batch_size=2)
    assert report.encoded == 5
    src = source_for(Recipe(source="npy"))
    for rel, parts in stored_features(tmp_path / "c", report.root).items():
        with torch.no_grad():
            live = lin(src.load(data / rel))
        assert torch.allclose(parts[""], live, atol=1e-6)


def test_progress_reports_hash_and_encode(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    seen: list[Progress] = []
    build(audio_dir, encoder_file, cache=tmp_path / "c", progress=seen.append)
    phases = Counter(p.phase for p in seen)
    assert phases["hash"] >= 1 and phases["encode"] >= 1
    last = [p for p in seen if p.phase == "encode"][-1]
    assert (last.done, last.total) == (16, 16)
    assert last.bytes_written > 0


def test_a_full_disk_during_a_build_is_a_store_error(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def enospc_for_shards(fd: int) -> None:
        # Only shard files fill the disk here (the root manifest, written first, still fits).
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if re.fullmatch(r"[0-9a-f]{32}\.part", name):  # a shard being written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to tell shard files apart")
    monkeypatch.setattr(store_mod.os, "fsync", enospc_for_shards)
    with pytest.raises(StoreError, match="disk is full"):
        build(audio_dir, encoder_file, cache=tmp_path / "c", workers=0)
    assert list((tmp_path / "c" / "tmp").iterdir()) == []
    monkeypatch.undo()
    report = build(audio_dir, encoder_file, cache=tmp_path / "c", workers=0)
    assert report.encoded == 16  # nothing half-written was taken for done


def test_bad_options(tmp_path: Path, encoder_file: Path, audio_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--workers"):
        build(audio_dir, encoder_file, cache=tmp_path / "c", workers=-1)
    with pytest.raises(ConfigError, match="--batch-size"):
        build(audio_dir, encoder_file, cache=tmp_path / "c", batch_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            build(audio_dir, encoder_file, cache=tmp_path / "c", device="cuda")


def test_encode_batch_gives_each_item_its_own_storage() -> None:
    enc = from_module(TinyConvEncoder())
    out = encode_batch(enc, [torch.randn(1600) for _ in range(3)], Recipe(dtype="bfloat16"))
    assert len(out) == 3 and all(o[""].dtype == torch.bfloat16 for o in out)
    assert len({o[""].untyped_storage().data_ptr() for o in out}) == 3
    assert out[0][""].untyped_storage().nbytes() == out[0][""].numel() * 2

    class NoBatch(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    with pytest.raises(EncodeError, match="leading batch dimension"):
        encode_batch(from_module(NoBatch()), [torch.ones(3)], Recipe())


# -- batching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_shape_batcher_against_a_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.randint(1, 6)
    b = ShapeBatcher(bs)
    shapes = [(rng.choice([100, 200, 300, 400, 500, 600, 700]),) for _ in range(300)]
    out: list[list[tuple[tuple[int, ...], int]]] = []
    for i, s in enumerate(shapes):
        out.extend(b.add(s, (s, i)))
        assert b._pending <= b.max_pending  # memory stays bounded
    out.extend(b.flush())
    items = [i for batch in out for _, i in batch]
    assert sorted(items) == list(range(300))  # every item exactly once
    for batch in out:
        assert 1 <= len(batch) <= bs
        assert len({s for s, _ in batch}) == 1  # one shape per batch
    assert b.flush() == []


def test_a_batch_of_one_is_a_view_of_its_input_and_encodes_as_in_a_batch() -> None:
    seen: list[int] = []

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.data_ptr())
            return x * 2

    class Same(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    x, y = torch.randn(48_000), torch.randn(48_000)  # above torch's parallel grain: no copy
    (alone,) = encode_batch(from_module(Scale()), [x], Recipe())
    assert seen == [x.data_ptr()]  # the encoder got the input itself, batched as a view
    together = encode_batch(from_module(Scale()), [x, y], Recipe())
    torch.testing.assert_close(alone[""], together[0][""], rtol=0, atol=0)
    (echo,) = encode_batch(from_module(Same()), [x], Recipe())
    assert echo[""].data_ptr() != x.data_ptr()  # what is stored never aliases the input
    torch.testing.assert_close(echo[""], x, rtol=0, atol=0)


def test_shape_batcher_fills_batches_of_one_shape() -> None:
    b = ShapeBatcher(3)
    assert b.add((5,), "a") == [] and b.add((5,), "b") == []
    assert b.add((5,), "c") == [["a", "b", "c"]]


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_rewritten_after_hashing_is_failed_not_stored_under_its_old_key(
    tmp_path: Path, encoder_file: Path, workers: int, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key names the hashed bytes; features of newer bytes must never be stored under it.

    With the hashed bytes kept (featbake/encode/fingerprints.py) the old bytes are what is
    decoded, so the input is stored under its key; past the budget (``held=False``) it is read
    again and fails as changed."""
    if not held:
        monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    data, backup = tmp_path / "a", tmp_path / "b"
    write_audio_folder(data, 3, seconds=1.0, seed=5)
    write_audio_folder(backup, 3, seconds=1.0, seed=5)  # the same bytes: the same keys
    victim = data / sorted(p.name for p in data.iterdir())[0]
    cache = tmp_path / "store"

    rewritten: list[bool] = []

    def rewrite_after_hashing(p: Progress) -> None:
        if p.phase == "hash" and p.done == p.total and not rewritten:
            rewritten.append(True)
            write_audio_folder(tmp_path / "new", 1, seconds=0.7, seed=9)
            os.replace(next((tmp_path / "new").iterdir()), victim)

    report = build(data, encoder_file, cache=cache, workers=workers, progress=rewrite_after_hashing)
    if held:
        assert report.ok and report.encoded == 3  # from the bytes its key was made from
    else:
        assert [p for p, _ in report.failed] == [victim.name]
        assert "changed while featbake was reading it" in report.failed[0][1]
        assert report.encoded == 2
    # The backup holds the old bytes: whatever the store serves for it is their live encoding.
    again = build(backup, encoder_file, cache=cache, workers=0)
    assert again.ok and again.reused + again.encoded == 3
    assert again.reused == (3 if held else 2)
    got = stored_features(cache, again.root)
    for name, parts in got.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, backup / name))
    # A rerun picks up the new bytes under their own key.
    rerun = build(data, encoder_file, cache=cache, workers=0)
    assert rerun.ok and rerun.encoded == 1
    torch.testing.assert_close(
        stored_features(cache, rerun.root)[victim.name][""], live_features(encoder_file, victim)
    )


def test_a_wrong_output_name_stops_the_build_with_a_config_error(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path
) -> None:
    """A missing --output is the user's option, not every input failing: stop, leave no root."""
    cache = tmp_path / "store"
    with pytest.raises(ConfigError, match=r"no output 'nope'.*'hidden', 'pooled'"):
        build(audio_dir, multi_encoder_file, cache=cache, recipe=Recipe(output="nope"), workers=0)
    cat = Catalog(Layout(cache))
    try:
        assert cat.conn.execute("SELECT COUNT(*) FROM roots").fetchone() == (0,)
    finally:
        cat.close()
    good = build(audio_dir, multi_encoder_file, cache=cache, recipe=Recipe(output="pooled"))
    assert good.ok and good.encoded == 16


class _NanOnLong(TinyConvEncoder):
    """TinyConvEncoder(seed=0), except that inputs over 1 s come out as NaN (or +inf)."""

    def __init__(self, bad: float = float("nan")) -> None:
        super().__init__()
        self.bad = bad

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        return out * self.bad if wav.shape[1] > 16000 else out


@pytest.mark.parametrize(
    ("dtype", "bad", "said", "unsaid"),
    [
        ("float16", 1e6, "past float16's range (65504)", ""),
        ("int8", float("nan"), "int8 holds neither NaN nor infinity", "--allow-nonfinite"),
        ("fp8", float("inf"), "fp8 holds neither NaN nor infinity", "--allow-nonfinite"),
    ],
    ids=["float16-finite-past-its-range", "int8-nan", "fp8-inf"],
)
def test_a_row_not_stored_as_nonfinite_says_what_the_stored_dtype_needs(
    tmp_path: Path, audio_dir: Path, dtype: str, bad: float, said: str, unsaid: str
) -> None:
    """A float16 build of finite outputs up to 1e6 failed each long item as "the encoder
    returned NaN or infinite values ... Pass --allow-nonfinite", which then stored and served
    ``inf``; an int8 or fp8 build's line gave the same advice, which that dtype refuses. Each
    line now says what the stored dtype holds and what to store instead."""
    report = build(
        audio_dir, _NanOnLong(bad), cache=tmp_path / "c", workers=0, recipe=Recipe(dtype=dtype)
    )
    assert report.failed
    for _, reason in report.failed:
        assert said in reason and "\n" not in reason, reason
        assert not unsaid or unsaid not in reason, reason
        if dtype == "float16":
            assert "--dtype bfloat16 or float32" in reason, reason


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_features_are_refused_unless_allowed(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, bad: float
) -> None:
    recipe = Recipe()
    lengths = {
        str(p.relative_to(audio_dir)): source_for(recipe).load(p).shape[0]
        for p in audio_dir.rglob("*.wav")
    }
    long = {rel for rel, n in lengths.items() if n > 16000}
    assert 0 < len(long) < len(lengths)
    report = build(audio_dir, _NanOnLong(bad), cache=tmp_path / "c", workers=0)
    assert {p for p, _ in report.failed} == long
    assert all("NaN or infinite values" in r and "--allow-nonfinite" in r for _, r in report.failed)
    stored = stored_features(tmp_path / "c", report.root)
    assert set(stored) == set(lengths) - long
    for rel, parts in stored.items():
        live = live_features(encoder_file, audio_dir / rel)  # TorchScript vs eager, batched
        assert torch.allclose(parts[""], live, rtol=1e-5, atol=1e-6), rel
    allowed = build(audio_dir, _NanOnLong(bad), cache=tmp_path / "c", allow_nonfinite=True)
    assert allowed.ok and allowed.encoded == len(long)
    stored = stored_features(tmp_path / "c", report.root)
    assert all(not torch.isfinite(stored[rel][""]).all() for rel in long)


def test_an_encoder_raising_a_keyerror_skips_those_items_and_stores_the_rest(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    class KeyErrorOnLong(TinyConvEncoder):
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            if wav.shape[1] > 16000:
                raise KeyError("speaker")  # e.g. a lookup table in an import-path module
            return super().forward(wav)

    report = build(audio_dir, KeyErrorOnLong(), cache=tmp_path / "c", batch_size=4, workers=0)
    assert report.failed and report.encoded == report.files - len(report.failed)
    assert all("KeyError: 'speaker'" in reason for _, reason in report.failed)
    for rel, parts in stored_features(tmp_path / "c", report.root).items():
        live = live_features(encoder_file, audio_dir / rel)  # TorchScript vs eager, batched
        assert torch.allclose(parts[""], live, rtol=1e-5, atol=1e-6), rel


def test_auto_workers_leave_the_callers_torch_threads_as_they_were(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = build(audio_dir, encoder_file, cache=tmp_path / "c")  # workers=None: chosen
        assert report.ok and report.encoded == report.files
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ({"batching": "x"}, "--batching must be one of auto, padded, exact"),
        ({"batching": None}, "--batching must be one of auto, padded, exact"),
        ({"batch_size": 0}, "--batch-size must be"),
        ({"batch_size": True}, "--batch-size must be"),
        ({"shard_bytes": 0}, "--shard-size must be positive"),
        ({"workers": -1}, "--workers must be 0 or more"),
        ({"workers": 10**6}, "is more than featbake starts"),
        ({"batch_seconds": float("nan")}, "--batch-seconds must be a positive, finite"),
        ({"batch_seconds": float("inf")}, "--batch-seconds must be a positive, finite"),
        ({"batch_samples": 0}, "batch_samples must be"),
        ({"shard": "0/1000000000"}, "more than featbake splits"),
    ],
)
def test_the_public_build_refuses_bad_arguments_before_any_work(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, option: dict, needle: str
) -> None:
    """build(batching="x") raised a bare ValueError from the Batching enum, after hashing."""
    with pytest.raises(ConfigError, match=needle):
        build(audio_dir, encoder_file, cache=tmp_path / "c", **option)
    assert not (tmp_path / "c").exists()


def test_an_empty_encoder_name_is_refused_not_read_as_the_current_folder(
    tmp_path: Path, audio_dir: Path
) -> None:
    with pytest.raises(ConfigError, match="--encoder is empty"):
        build(audio_dir, "", cache=tmp_path / "c")


# == test_decode ===================================================================================
# Decoding for a build without decode workers: on one thread of the process, a few inputs
# ahead of the encoder, in order, each input's failure its own (real wav files).


class Recording:
    """The audio source, recording which thread decoded each file."""

    def __init__(self) -> None:
        self.inner = source_for(Recipe())
        self.kind, self.extensions = self.inner.kind, self.inner.extensions
        self.threads: list[str] = []

    def load(self, path, data=None):  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)
        return self.inner.load(path, data)


def test_without_workers_inputs_are_decoded_ahead_on_a_thread_in_order(tmp_path: Path) -> None:
    write_audio_folder(tmp_path / "a", 10, seconds=(0.2, 0.4), seed=3)
    paths = sorted(str(p) for p in (tmp_path / "a").rglob("*.wav"))
    (tmp_path / "a" / "bad.wav").write_bytes(b"not audio")
    paths.insert(4, str(tmp_path / "a" / "bad.wav"))
    stats = [FileStat.of(p) for p in paths]
    source = Recording()
    got = decoded_items(paths, source, 0, stats)  # type: ignore[arg-type]
    first = next(got)
    time.sleep(0.5)  # the caller encodes item 0: meanwhile the next ones are decoded
    assert first[0] == 0 and len(source.threads) == AHEAD + 1
    items = [first, *got]
    assert [i for i, _ in items] == list(range(len(paths)))
    assert isinstance(items[4][1], str) and "bad.wav" in items[4][1]  # its own failure
    for (_, x), path in zip(items, paths, strict=True):
        if path.endswith("bad.wav"):
            continue
        torch.testing.assert_close(x, source_for(Recipe()).load(path))
    assert set(source.threads) == {"featbake-decode_0"}


def test_a_build_stopped_early_leaves_no_decode_running(tmp_path: Path) -> None:
    write_audio_folder(tmp_path / "a", 12, seconds=(0.2, 0.4), seed=4)
    paths = sorted(str(p) for p in (tmp_path / "a").rglob("*.wav"))
    source = Recording()
    got = decoded_items(paths, source, 0, [FileStat.of(p) for p in paths])  # type: ignore[arg-type]
    next(got)
    got.close()  # the pipeline stopped (an error, SIGTERM): pending decodes are cancelled
    assert len(source.threads) <= AHEAD + 2
    assert not [t for t in threading.enumerate() if t.name.startswith("featbake-decode")]


class TorchResizing(Recording):
    """The audio source, then a torch op big enough to run in parallel (as an image resize by
    ``interpolate`` does), recording torch's thread count on the decoding thread."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_threads: list[int] = []

    def load(self, path, data=None):  # type: ignore[no-untyped-def]
        self.torch_threads.append(torch.get_num_threads())
        big = torch.rand(1, 3, 600, 600)
        torch.nn.functional.interpolate(big, size=(1200, 1200), mode="bilinear")
        return super().load(path, data)


def _os_threads_settled(at_most: int) -> int:
    """This process's OS threads, once a thread that just ended has left (within 5 s)."""
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or "OpenMP" not in torch.__config__.parallel_info(),
    reason="counts OpenMP threads through /proc",
)
def test_the_decode_thread_starts_no_openmp_team_beside_the_encoders(tmp_path: Path) -> None:
    """Issue 31 item 4: torch's parallel ops on the decode-ahead thread started an OpenMP team
    of its own (torch.get_num_threads() threads) beside the encoder's, and left it behind."""
    write_audio_folder(tmp_path / "a", 6, seconds=(0.2, 0.4), seed=5)
    paths = sorted(str(p) for p in (tmp_path / "a").rglob("*.wav"))
    source = TorchResizing()
    caller = torch.get_num_threads()
    torch.set_num_threads(2)  # the encoder's team: two threads, whatever the machine
    try:
        torch.nn.functional.interpolate(torch.rand(1, 3, 600, 600), size=(1200, 1200))
        before = len(os.listdir("/proc/self/task"))  # the caller's team is up
        got = list(decoded_items(paths, source, 0, [FileStat.of(p) for p in paths]))  # type: ignore[arg-type]
        after = _os_threads_settled(before)
        assert torch.get_num_threads() == 2  # the encoder's count is untouched
    finally:
        torch.set_num_threads(caller)
    assert source.torch_threads == [1] * len(paths)
    assert after == before  # the decode thread is gone, and no team of its own is left
    assert set(source.threads) == {"featbake-decode_0"}
    for (_, x), path in zip(got, paths, strict=True):
        torch.testing.assert_close(x, source_for(Recipe()).load(path))


# == an input changed in place at every stage, for every local kind ================================
# Each kind's items are 16 kHz clips of one length (so a new version is the same size), ids u0..:
# the victim's bytes are overwritten in place where they lie (its file, its tar member, its table
# cell: parquet written uncompressed), size and mtime kept (``cp -p``-like; only ctime moves).
CLIP_S = 0.5
#: A manifest's segment rows: id -> (clip, start, end seconds).
SEGMENTS = {"u0-seg": ("u0", 0.0, 0.25), "u1-seg": ("u1", 0.125, 0.375)}


def _clip(seed: int) -> bytes:
    import io

    out = io.BytesIO()
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, int(16000 * CLIP_S))
    soundfile.write(out, samples.astype(np.float32), 16000, format="WAV", subtype="FLOAT")
    return out.getvalue()


def _write_kind(kind: str, folder: Path, clips: list[bytes]) -> Path:
    """``clips`` as data of ``kind`` in ``folder``; the path to build (``--data``)."""
    import io
    import json
    import tarfile

    folder.mkdir(parents=True)
    ids = [f"u{i}" for i in range(len(clips))]
    if kind in ("folder", "manifest", "segments", "kaldi"):
        for i, c in zip(ids, clips, strict=True):
            (folder / f"{i}.wav").write_bytes(c)
        if kind == "folder":
            return folder
        if kind == "kaldi":  # a Kaldi data folder: wav.scp of recordings, no segments file
            # absolute: Kaldi takes a relative path from the working directory, not the folder
            (folder / "wav.scp").write_text("".join(f"{i} {folder / i}.wav\n" for i in ids))
            return folder
        # u0 named by a whole row, another and a segment row (decoded from the bytes kept);
        # with "segments", u1 is named by a segment row only (decoded by seeking)
        rows = [{"id": i, "path": f"{i}.wav"} for i in ids if kind == "manifest" or i != "u1"]
        for ident, (name, start, end) in SEGMENTS.items():
            if kind == "segments" or name == "u0":
                rows.append({"id": ident, "path": f"{name}.wav", "start": start, "end": end})
        rows.append({"id": "again", "path": "u0.wav"})
        (folder / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder / "m.jsonl"
    if kind == "tar":
        with tarfile.open(folder / "s.tar", "w") as tf:
            for i, c in zip(ids, clips, strict=True):
                info = tarfile.TarInfo(f"{i}.wav")
                info.size = len(c)
                tf.addfile(info, io.BytesIO(c))
        return folder / "s.tar"
    pa = pytest.importorskip("pyarrow")
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = [{"bytes": c, "path": f"{i}.wav"} for i, c in zip(ids, clips, strict=True)]
    table = pa.table({"id": ids, "audio": pa.array(cells, type=media)})
    if kind == "parquet":
        pytest.importorskip("pyarrow.parquet").write_table(
            table, folder / "t.parquet", compression="none", row_group_size=2
        )
        return folder / "t.parquet"
    with pa.ipc.new_stream(folder / "t.arrow", table.schema) as writer:
        writer.write_table(table)
    return folder / "t.arrow"


def _rewrite_in_place(folder: Path, old: bytes, new: bytes) -> None:
    """Overwrite ``old``'s bytes with ``new`` (the same length) in the one file of ``folder``
    that holds them, keeping its size, inode and mtime."""
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        data = f.read_bytes()
        at = data.find(old)
        if at < 0:
            continue
        before = f.stat()
        with open(f, "r+b") as out:
            out.seek(at)
            out.write(new)
        os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (f.stat().st_size, f.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        return
    raise AssertionError(f"no file of {folder} holds the clip")


def _assert_serves_now(
    cache: Path, root: str, clips: dict[str, bytes], ref: Path, enc: Path
) -> None:
    """Every stored item of ``root`` is the encoder run now on the bytes its id holds."""
    import io

    stored = stored_features(cache, root)
    assert stored
    for rel, parts in stored.items():
        name, start, end = SEGMENTS.get(rel, ("u0" if rel == "again" else Path(rel).stem, 0, 0))
        ref_file = ref / f"{rel.replace('/', '_')}.wav"
        if end:  # a segment: its samples, cut without featbake
            samples, rate = soundfile.read(io.BytesIO(clips[name]), dtype="float32")
            cut = samples[round(start * rate) : round(end * rate)]
            soundfile.write(ref_file, cut, rate, format="WAV", subtype="FLOAT")
        else:
            ref_file.write_bytes(clips[name])
        torch.testing.assert_close(parts[""], live_features(enc, ref_file), msg=rel)


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize(
    "kind", ["folder", "manifest", "segments", "kaldi", "tar", "parquet", "arrow"]
)
def test_an_input_rewritten_in_place_after_hashing_or_between_builds_is_never_stored_stale(
    tmp_path: Path, encoder_file: Path, kind: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each local kind, one clip rewritten in place (same size, same mtime) right after the
    build hashed it: its features are those of the bytes hashed (kept, ``held``) or it fails
    as changed, never the new bytes under the old key (checked through a copy of the old data,
    which reuses what was stored); the next build, whose hash cache holds the old digest under
    the old stat (trusted at once here), reads it again and stores the new bytes' features."""
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    if not held:
        monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    old = {f"u{i}": _clip(i) for i in range(3)}
    data = _write_kind(kind, tmp_path / "data", list(old.values()))
    backup = _write_kind(kind, tmp_path / "backup", list(old.values()))  # the same keys
    victim = "u1" if kind == "segments" else "u0"
    now = {**old, victim: _clip(99)}
    cache, ref = tmp_path / "store", tmp_path / "ref"
    ref.mkdir()
    done: list[bool] = []

    def rewrite_after_hashing(p: Progress) -> None:
        if p.phase == "hash" and p.done == p.total and not done:
            done.append(True)
            _rewrite_in_place(tmp_path / "data", old[victim], now[victim])

    first = build(data, encoder_file, cache=cache, workers=0, progress=rewrite_after_hashing)
    assert done
    failed = dict(first.failed)
    if held and kind != "segments":  # a file only segment rows name is never held
        assert first.ok, failed
    else:
        assert {victim, f"{victim}-seg"} & {Path(p).stem for p in failed} and all(
            "changed" in why for why in failed.values()
        ), failed
    copy = build(backup, encoder_file, cache=cache, workers=0)
    assert copy.ok and copy.reused == first.encoded
    _assert_serves_now(cache, copy.root, old, ref, encoder_file)
    again = build(data, encoder_file, cache=cache, workers=0)
    assert again.ok, again.failed
    _assert_serves_now(cache, again.root, now, ref, encoder_file)


@pytest.mark.parametrize("held", [True, False])
def test_an_image_rewritten_in_place_after_hashing_or_between_builds_is_never_stored_stale(
    tmp_path: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a folder of images (BMP: a new picture of the same size is the same
    number of bytes), the reference decoded by Pillow and the encoder run directly."""
    from PIL import Image

    from featbake.image_recipe import ImageRecipe, Resize, ResizeKind

    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    if not held:
        monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    plain = ImageRecipe(resize=Resize(ResizeKind.NONE, 0, 0), crop=None, rescale=None)
    recipe = Recipe(source="image", image=plain.replace(mean=None, std=None))
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 4, 4), torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten()
    ).eval()

    def picture(seed: int) -> bytes:
        import io

        pixels = np.random.default_rng(seed).integers(0, 256, (16, 24, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="BMP")
        return out.getvalue()

    def encoded_now(data: bytes) -> torch.Tensor:
        import io

        with Image.open(io.BytesIO(data)) as im:
            x = torch.from_numpy(np.array(im.convert("RGB"), dtype=np.float32))
        with torch.inference_mode():
            return encoder(x.permute(2, 0, 1).unsqueeze(0))[0]

    old = {f"u{i}.bmp": picture(i) for i in range(3)}
    now = {**old, "u0.bmp": picture(99)}
    for folder in ("data", "backup"):
        (tmp_path / folder).mkdir()
        for name, data in old.items():
            (tmp_path / folder / name).write_bytes(data)
    cache, done = tmp_path / "store", []

    def rewrite_after_hashing(p: Progress) -> None:
        if p.phase == "hash" and p.done == p.total and not done:
            done.append(True)
            _rewrite_in_place(tmp_path / "data", old["u0.bmp"], now["u0.bmp"])

    kw: dict = {"cache": cache, "recipe": recipe, "workers": 0}
    first = build(tmp_path / "data", encoder, progress=rewrite_after_hashing, **kw)
    assert done and (first.ok if held else [p for p, _ in first.failed] == ["u0.bmp"])
    copy = build(tmp_path / "backup", encoder, **kw)
    assert copy.ok and copy.reused == first.encoded
    for name, parts in stored_features(cache, copy.root).items():
        torch.testing.assert_close(parts[""], encoded_now(old[name]), msg=name)
    again = build(tmp_path / "data", encoder, **kw)
    assert again.ok and set(stored_features(cache, again.root)) == set(now)
    for name, parts in stored_features(cache, again.root).items():
        torch.testing.assert_close(parts[""], encoded_now(now[name]), msg=name)


def test_a_rebuild_that_gc_raced_before_its_manifest_encodes_what_gc_deleted(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose root was dropped, built again: the build finds every feature stored
    (no root reaches them yet), and a gc committing before the build publishes its manifest
    deletes them. The build now sees that another writer committed meanwhile and asks again,
    so it encodes them. Before, it trusted what it had found: "encoded 0, reused 16", and a
    root with every item missing."""
    from featbake.upkeep import GcOptions, drop_root, execute_gc, plan_gc
    from tests.helpers import Live, assert_serves, bake

    store = tmp_path / "store"
    # the encoder's fingerprint trusted from the hash cache at once (as minutes later), so
    # the build looks its keys up before its manifest to decide whether to load it
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    asked = Catalog.present_keys
    gcs: list[int] = []

    def then_gc(self: Catalog, keys: list[str]) -> set[str]:
        found = asked(self, keys)
        if not gcs:  # the first lookup: the encoder's load decided on it
            plan = plan_gc(store, GcOptions(), now=time.time() + 40 * 86400.0)
            gcs.append(execute_gc(plan).rows_deleted)
        return found

    monkeypatch.setattr(Catalog, "present_keys", then_gc)
    report = build(audio_dir, encoder_file, cache=store, workers=0)
    assert gcs[0] > 0  # gc deleted the unreached rows in between
    assert report.encoded == 16 and report.reused == 0
    monkeypatch.setattr(Catalog, "present_keys", asked)
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


class _CountsAndMask(torch.nn.Module):
    """Features, each row's sample count plus 32,791 (exact in int64, not in float16) and a
    bool mask: the outputs of an encoder that reports lengths and padding with its features."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(1, 4)

    def forward(self, wav: torch.Tensor) -> dict[str, torch.Tensor]:
        counts = (wav != 0).sum(-1) + 32_791
        return {"feats": self.proj(wav[:, :64, None]), "n": counts, "mask": wav[:, :5] > 0}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_integer_and_bool_outputs_are_stored_exact_whatever_the_float_dtype(
    tmp_path: Path, dtype: str
) -> None:
    """A build with ``--dtype float16`` cast every output part to float16: a length of
    36,809 was stored as 36,800 (bfloat16: 36,864) and a mask as 1.0. Integer and bool
    parts are now stored as they are; int8, which quantises floats, refuses them in one line
    (it rounded them too)."""
    write_audio_folder(tmp_path / "audio", 3, seconds=(0.2, 0.4), seed=4)
    encoder = _CountsAndMask().eval().requires_grad_(False)
    recipe = Recipe(dtype=dtype)
    store = tmp_path / "store"
    if dtype == "int8":
        with pytest.raises(ConfigError, match=r"'n' holds torch\.int64 values, which int8"):
            build(tmp_path / "audio", encoder, cache=store, recipe=recipe, workers=0)
        picked = Recipe(dtype=dtype, output="n")  # one part stored: named as picked, not 'tensor'
        with pytest.raises(ConfigError, match=r"'n' holds torch\.int64 values, which int8"):
            build(tmp_path / "audio", encoder, cache=store, recipe=picked, workers=0)
        return
    report = build(tmp_path / "audio", encoder, cache=store, recipe=recipe, workers=0)
    assert (report.encoded, report.failed) == (3, [])
    got = stored_features(store, report.root)
    for rel, parts in got.items():
        wav = source_for(recipe).load(tmp_path / "audio" / rel)
        with torch.inference_mode():
            want = encoder(wav.unsqueeze(0))
        assert parts["n"].dtype == torch.int64 and parts["mask"].dtype == torch.bool
        assert torch.equal(parts["n"], want["n"][0]) and torch.equal(parts["mask"], want["mask"][0])
        assert parts["feats"].dtype == recipe.torch_dtype
        torch.testing.assert_close(parts["feats"], want["feats"][0].to(recipe.torch_dtype))
