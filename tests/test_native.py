"""The compiled kernels (featbake/kernels.c, through featbake/native.py) against the pure-Python
path they replace: the same bytes out for every case, every SIMD width this machine has, every
scheme and served dtype, errors raised alike, and the fallback taken where they are off."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from featbake import native
from featbake.bake.pipeline import build
from featbake.errors import ConfigError, StoreCorrupt
from featbake.quantize import (
    SCALE_BYTES,
    PackedRows,
    ScaleSpan,
    Scheme,
    dequantize,
    dequantize_native,
    dequantize_unpacked,
    quantize,
    unpack,
)
from featbake.recipe import Recipe
from featbake.serve.collate import PaddedBatch
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.reads import Served
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, read_spans, write_shard
from tests.conftest import live_features

compiled = pytest.mark.skipif(
    native.kernels() is None, reason="featbake.kernels is not built here, or FEATBAKE_NATIVE=0"
)
SERVED = (torch.float16, torch.bfloat16, torch.float32)
EFP, RFP = "e" * 64, "r" * 64


def _widths() -> list[int]:
    """Every loop width this machine runs (0 portable, 1 AVX2, 2 AVX-512)."""
    kernels = native.kernels()
    assert kernels is not None
    return list(range(kernels.set_width(99) + 1))


@pytest.fixture
def width_reset() -> Iterator[None]:
    yield
    kernels = native.kernels()
    if kernels is not None:
        kernels.set_width(99)


def _rows(d: int) -> torch.Tensor:
    """Rows that reach every case: ordinary, zero (a padding's), tiny (subnormal results in
    float16), huge (past float16's range) and ones whose scale is float32's largest."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(37, d, generator=g)
    x[3] = 0
    x[4] *= 1e-6
    x[5] *= 1e-30
    x[6] *= 1e6
    x[7] *= 3e38 / x[7].abs().max()
    x[8, : min(d, 3)] = torch.tensor([1e-45, -2.5, 7.0])[: min(d, 3)]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@compiled
@pytest.mark.usefixtures("width_reset")
@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("d", [1, 5, 16, 40, 771])
def test_dequantise_kernel_gives_the_python_paths_bits(scheme: Scheme, d: int) -> None:
    packed = quantize(_rows(d), scheme)
    kernels = native.kernels()
    assert kernels is not None
    for width in _widths():
        assert kernels.set_width(width) == width
        for dtype in SERVED:
            want = dequantize_unpacked(unpack(packed, scheme), scheme, dtype)
            got = torch.full_like(want, 7.0)
            span = dequantize_native(packed, scheme, got)
            assert span == ScaleSpan.of(unpack(packed, scheme).scales)
            assert torch.equal(_bits(got), _bits(want)), (width, dtype)


@compiled
@pytest.mark.usefixtures("width_reset")
def test_every_fp8_code_dequantises_as_the_python_path() -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # NaN codes included
    scales = torch.tensor([1.0, 0.5, 3e-3, 1e-30, 7.5e35, 2.0**-20, 0.0, 1.0 / 3])
    packed = torch.cat([codes, scales.view(torch.uint8).reshape(8, 4)], dim=1)
    kernels = native.kernels()
    assert kernels is not None
    for width in _widths():
        kernels.set_width(width)
        for dtype in SERVED:
            want = dequantize_unpacked(unpack(packed, Scheme.FP8), Scheme.FP8, dtype)
            got = torch.empty_like(want)
            assert dequantize_native(packed, Scheme.FP8, got) is not None
            assert torch.equal(_bits(got), _bits(want)), (width, dtype)


@compiled
def test_dequantize_takes_the_kernel_only_where_it_applies() -> None:
    packed = quantize(torch.randn(6, 8), Scheme.INT8)
    out = torch.empty(6, 8, dtype=torch.float16)
    assert dequantize_native(packed, Scheme.INT8, out) is not None
    # Not its layout or dtype: nothing written, the Python path serves it.
    strided = torch.empty(6, 16, dtype=torch.float16)[:, :8]
    assert dequantize_native(packed, Scheme.INT8, strided) is None
    assert dequantize_native(packed, Scheme.INT8, torch.empty(6, 8, dtype=torch.float64)) is None
    assert dequantize_native(packed[::2], Scheme.INT8, torch.empty(3, 8)) is None
    assert dequantize_native(packed, Scheme.FP8, out) is None  # int8 bytes are not fp8's
    want = dequantize_unpacked(unpack(packed, Scheme.INT8), Scheme.INT8, torch.float16)
    assert torch.equal(dequantize(packed[::2], Scheme.INT8), want[::2])
    assert torch.equal(dequantize(packed, Scheme.INT8, out=strided), want)


def test_fallback_turns_the_kernels_off_and_the_environment_too() -> None:
    with native.fallback():
        assert native.kernels() is None
        packed = quantize(torch.randn(3, 8), Scheme.INT8)
        assert dequantize_native(packed, Scheme.INT8, torch.empty(3, 8)) is None
    if os.environ.get("FEATBAKE_NATIVE", "1") != "0":
        assert (native.kernels() is not None) == native.built()
    code = "from featbake import native; print(native.kernels() is None)"
    env = {**os.environ, "FEATBAKE_NATIVE": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "True", run.stderr


# -- a batch's reads ---------------------------------------------------------------------------
def _shard(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    return write_shard(Layout(tmp_path / "store").ensure(), tensors, EFP, RFP).path


def _read_padded(
    path: Path, names: list[str], packed: PackedRows | None, item: int, threads: int = 1
) -> tuple[np.ndarray, ScaleSpan]:
    """A padded batch of ``names`` read with read_spans, its bytes poisoned first."""
    with ShardReader(path) as r:
        shapes = [r.tensors[n].shape for n in names]
        t_max = max(s[0] for s in shapes)
        width = shapes[0][-1] if packed is None else packed.width
        row = t_max * width * item
        rows = np.full((len(names), row), 0xAB, dtype=np.uint8)
        spans = []
        for j, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            n = shape[0] * width * item
            spans.append(r.span(name, rows[j, :n], tail=rows[j, n:], packed=packed, verify=j != 1))
        got = read_spans(spans, packed, threads)
        assert r._verified == {n for j, n in enumerate(names) if j != 1}
    return rows, got


@compiled
@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("dtype", SERVED)
def test_a_batch_read_dequantised_gives_the_python_paths_bytes(
    tmp_path: Path, scheme: Scheme, dtype: torch.dtype
) -> None:
    items = {f"k{i}": quantize(_rows(24)[: 3 + 5 * i], scheme) for i in range(4)}
    path = _shard(tmp_path, items)
    packed = PackedRows(scheme, dtype, 24)
    got, span = _read_padded(path, list(items), packed, dtype.itemsize)
    on3, span3 = _read_padded(path, list(items), packed, dtype.itemsize, threads=3)
    with native.fallback():
        want, want_span = _read_padded(path, list(items), packed, dtype.itemsize)
    assert np.array_equal(got, want) and span == want_span
    assert np.array_equal(on3, want) and span3 == want_span
    served = torch.from_numpy(got).view(dtype).view(4, -1, 24)
    for j, t in enumerate(items.values()):
        n = t.shape[0]
        assert torch.equal(_bits(served[j, :n]), _bits(dequantize_unpacked(
            unpack(t, scheme), scheme, dtype)))  # fmt: skip
        assert not served[j, n:].any()


@compiled
def test_a_batch_read_as_stored_gives_the_python_paths_bytes(tmp_path: Path) -> None:
    items = {f"k{i}": torch.randn(2 + 3 * i, 12, dtype=torch.float16) for i in range(5)}
    path = _shard(tmp_path, items)
    got, _ = _read_padded(path, list(items), None, 2)
    assert np.array_equal(_read_padded(path, list(items), None, 2, threads=4)[0], got)
    with native.fallback():
        want, _ = _read_padded(path, list(items), None, 2)
    assert np.array_equal(got, want)
    batch = torch.from_numpy(got).view(torch.float16).view(5, -1, 12)
    assert torch.equal(batch[4, :14], items["k4"]) and not batch[0, 2:].any()


def _read_many(path: Path, names: list[str], want: np.ndarray) -> None:
    """Read the batch 40 times on 3 threads each, in a forked child: exit 0 when every read
    gave ``want``'s bytes."""
    ok = all(np.array_equal(_read_padded(path, names, None, 2, 3)[0], want) for _ in range(40))
    sys.exit(0 if ok else 1)


@compiled
def test_batches_read_at_once_from_several_threads_and_in_a_forked_child_are_whole(
    tmp_path: Path,
) -> None:
    # read_rows keeps its threads from call to call (starting one per run cost 60-80 us a
    # batch): a call that finds them busy (another thread reading) starts its own, and a
    # forked child, which has none of its parent's threads, starts new ones instead of
    # waiting on threads that are not there.
    import multiprocessing
    import threading

    items = {f"k{i}": torch.randn(2 + 3 * i, 12, dtype=torch.float16) for i in range(9)}
    path = _shard(tmp_path, items)
    names = list(items)
    with native.fallback():
        want, _ = _read_padded(path, names, None, 2)
    same: list[bool] = []

    def read() -> None:
        for _ in range(40):
            same.append(np.array_equal(_read_padded(path, names, None, 2, threads=3)[0], want))

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(120)  # a bound for a broken kernel, never reached when it works
    assert len(same) == 160 and all(same)
    child = multiprocessing.get_context("fork").Process(target=_read_many, args=(path, names, want))
    child.start()
    child.join(120)  # as above: a child waiting on its parent's threads never ends
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0


@pytest.mark.parametrize("native_on", [True, False])
def test_a_flipped_byte_and_a_cut_shard_fail_alike(tmp_path: Path, native_on: bool) -> None:
    if native_on and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    items = {f"k{i}": quantize(torch.randn(4, 8), Scheme.INT8) for i in range(3)}
    path = _shard(tmp_path, items)
    with ShardReader(path) as r:
        begin = r.tensors["k1"].begin
    with open(path, "r+b") as f:
        f.seek(begin + 3)
        byte = f.read(1)
        f.seek(begin + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    packed = PackedRows(Scheme.INT8, torch.float16, 8)
    ctx = contextlib.nullcontext if native_on else native.fallback
    with ctx(), pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k1"):
        _read_padded(path, ["k0", "k2", "k1"], packed, 2)
    with ctx(), pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k1"):
        _read_padded(path, ["k1", "k0", "k2"], packed, 2, threads=2)  # a later run succeeds
    with ShardReader(path) as r, ctx():
        os.truncate(path, r.tensors["k2"].end - 5)  # after opening: k2's read comes short
        dest = np.zeros(4 * 8 * 2, dtype=np.uint8)
        spans = [r.span(n, dest, packed=packed, verify=False) for n in ("k0", "k2")]
        with pytest.raises(StoreCorrupt, match="tensor k2 is cut short"):
            read_spans(spans, packed)


# -- CRC-32C by carry-less multiplication -------------------------------------------------------
@compiled
@pytest.mark.usefixtures("width_reset")
def test_the_crc_kernel_equals_google_crc32c_for_every_length_alignment_and_width() -> None:
    """Every length 0-4096 (the folding loop starts at 256 bytes, folds 16 at a time after its
    last 256-byte round, and ends on 0-15 bytes), unaligned starts, large buffers."""
    import google_crc32c

    from featbake.store import shard

    kernels = native.kernels()
    assert kernels is not None and shard._EXTEND_ADDR is not None
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, size=(1 << 20) + 64, dtype=np.uint8)
    cases = [(n, 0) for n in range(4097)] + [
        (int(rng.integers(256, 1 << 20)), int(rng.integers(0, 64))) for _ in range(64)
    ]
    for width in _widths():
        kernels.set_width(width)
        for n, at in cases:
            seed = int(rng.integers(0, 2**32))
            got = kernels.crc32c(seed, data.ctypes.data + at, n, shard._EXTEND_ADDR)
            assert got == google_crc32c.extend(seed, data[at : at + n].tobytes()), (width, n, at)


@compiled
@pytest.mark.usefixtures("width_reset")
def test_a_flipped_bit_anywhere_in_a_large_tensor_fails_its_check_on_every_loop(
    tmp_path: Path,
) -> None:
    """One bit flipped in a 467 KB tensor, in its first 256 bytes, its folded middle, the 16-byte
    folds after the last round and its last bytes: the compiled read refuses each, at every
    width; the intact tensor reads back whole."""
    big = torch.randn(300, 779).to(torch.float16)  # 467,400 bytes: 200 after the rounds
    path = _shard(tmp_path, {"a": torch.randn(3, 5), "big": big})
    with ShardReader(path) as r:
        begin, end = r.tensors["big"].begin, r.tensors["big"].end
    size = end - begin
    kernels = native.kernels()
    assert kernels is not None
    for width in _widths():
        kernels.set_width(width)
        dest = np.zeros(size, dtype=np.uint8)
        with ShardReader(path) as r:
            read_spans([r.span("big", dest)])
        assert torch.equal(torch.from_numpy(dest).view(torch.float16).view(300, 779), big)
    assert size % 256 == 200
    for where in (0, 255, 256 + 7, size // 2, size - 200 + 3, size - 5, size - 1):
        with open(path, "r+b") as f:
            f.seek(begin + where)
            byte = f.read(1)[0]
            f.seek(begin + where)
            f.write(bytes([byte ^ 0x04]))
        for width in _widths():
            kernels.set_width(width)
            dest = np.zeros(size, dtype=np.uint8)
            with ShardReader(path) as r, pytest.raises(StoreCorrupt, match="checksum mismatch"):
                read_spans([r.span("big", dest)])
        with open(path, "r+b") as f:  # put it back for the next place
            f.seek(begin + where)
            f.write(bytes([byte]))


# -- through the dataset -----------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "serve"), [("int8", torch.float16), ("fp8", torch.bfloat16)])
def test_a_dataset_serves_the_same_bytes_with_the_kernels_and_without(
    audio_dir: Path, encoder_file: Path, store_dir: Path, dtype: str, serve: torch.dtype
) -> None:
    # batch_size=1: the build runs what live encoding runs, so stored bytes are equal.
    report = build(audio_dir, encoder_file, cache=store_dir, recipe=Recipe(dtype=dtype),
                   batch_size=1)  # fmt: skip
    assert report.ok
    scheme = Scheme(dtype)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype=dtype, serve_dtype=serve, on_miss="error"
    )
    want = []
    for i in range(len(ds)):
        live = live_features(encoder_file, Path(ds.path(i)), Recipe())
        assert isinstance(live, torch.Tensor)
        want.append(dequantize_unpacked(unpack(quantize(live, scheme), scheme), scheme, serve))
    idx = [3, 0, 7, 12, 5]
    seen = []
    # Planned (first reads, checked) with the kernels, then located batches with and without.
    for on in (True, False, True, False):
        with contextlib.nullcontext() if on else native.fallback():
            batch = ds.__getitems__(idx)
            items = [ds[i] for i in idx]
        assert isinstance(batch, PaddedBatch) and batch.padded.dtype == serve
        for j, i in enumerate(idx):
            assert torch.equal(_bits(batch[j]), _bits(want[i])), (on, i)
            assert torch.equal(_bits(items[j]), _bits(want[i])), (on, i)
            assert not batch.padded[j, len(want[i]) :].any(), (on, i)  # each row's tail zeroed
        seen.append(batch.padded.clone())
    assert all(torch.equal(_bits(s), _bits(seen[0])) for s in seen)
    assert ds.cache_info().encoded == 0


@pytest.mark.parametrize("native_on", [True, False])
def test_values_float16_cannot_hold_are_refused_on_the_batch_path(
    tmp_path: Path, native_on: bool
) -> None:
    if native_on and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    items = {"k0": quantize(torch.randn(4, 8), Scheme.INT8),
             "k1": quantize(torch.randn(3, 8) * 1e7, Scheme.INT8)}  # fmt: skip
    path = _shard(tmp_path, items)
    served = Served(Scheme.INT8, torch.float16)
    with contextlib.nullcontext() if native_on else native.fallback():
        _, span = _read_padded(path, ["k0", "k1"], served.rows((8 + SCALE_BYTES,)), 2)
        with pytest.raises(ConfigError, match="cannot serve without an inf"):
            served.check(span)
        with pytest.raises(ConfigError, match="cannot serve without an inf"):
            served.tensor(items["k1"])


class _Counting:
    """The compiled kernels, counting calls of read_rows."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read_rows(self, *args: object) -> object:
        self.calls += 1
        return self.inner.read_rows(*args)  # type: ignore[attr-defined]


@compiled
def test_a_batch_is_one_call_of_the_compiled_read(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GIL is released once per batch, on its planned and its located path alike (the
    Python path took it back after every row's read and check)."""
    report = build(audio_dir, encoder_file, cache=store_dir, recipe=Recipe(dtype="int8"))
    assert report.ok
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", on_miss="error"
    )
    counting = _Counting(native.kernels())
    monkeypatch.setitem(native._state, "kernels", counting)
    for k in range(1, 4):  # planned (checked on first read), then located twice
        batch = ds.__getitems__(list(range(k, 16, 2)))
        assert isinstance(batch, PaddedBatch) and batch.padded.dtype == torch.float16
        assert counting.calls == k


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_located_item_is_read_dequantised_in_one_pass_and_a_cut_one_fails(
    tmp_path: Path, scheme: Scheme, native_on: bool
) -> None:
    """The dataset's hit path (``ShardReader.read_packed_span``): the same bits as the Python
    dequantise, the scales' span for the served check, and a short read named."""
    if native_on and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    items = {"k0": quantize(_rows(24), scheme), "k1": quantize(torch.randn(9, 24) * 1e7, scheme)}
    path = _shard(tmp_path, items)
    packed = PackedRows(scheme, torch.float16, 24)
    ctx = contextlib.nullcontext if native_on else native.fallback
    with ShardReader(path) as r, ctx():
        out = torch.full((37, 24), 7.0, dtype=torch.float16)
        span = r.read_packed_span(r.tensors["k0"].begin, out, packed)
        want = unpack(items["k0"], scheme)
        assert span == ScaleSpan.of(want.scales)
        assert torch.equal(_bits(out), _bits(dequantize_unpacked(want, scheme, torch.float16)))
        big = torch.empty(9, 24, dtype=torch.float16)
        assert not r.read_packed_span(r.tensors["k1"].begin, big, packed).holds(
            torch.float16, scheme
        )
        os.truncate(path, r.tensors["k1"].end - 5)
        with pytest.raises(StoreCorrupt, match="tensor k1 is cut short"):
            r.read_packed_span(r.tensors["k1"].begin, big, packed)


@compiled
def test_an_item_served_dequantised_is_one_call_of_the_compiled_read(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One item per step, located: its pread and dequantise in one call, no packed copy."""
    assert build(audio_dir, encoder_file, cache=store_dir, recipe=Recipe(dtype="int8")).ok
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="int8", on_miss="error"
    )
    first = ds[4]  # planned: located and checked here
    counting = _Counting(native.kernels())
    monkeypatch.setitem(native._state, "kernels", counting)
    again = [ds[4] for _ in range(3)]
    assert counting.calls == 3
    assert all(torch.equal(_bits(a), _bits(first)) for a in again)


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_located_item_of_no_rows_or_one_dimension_is_served_as_the_stored_one(
    tmp_path: Path, scheme: Scheme, native_on: bool
) -> None:
    """``read_packed_span`` of an item of no rows (``[0, D + 4]``), a 1-D one and a 3-D one:
    what ``Served.item`` makes of the stored tensor, bit for bit, on both paths (the Python
    path raised torch's RuntimeError for no rows: an empty array viewed as float16)."""
    if native_on and native.kernels() is None:
        pytest.skip("featbake.kernels is not built here, or FEATBAKE_NATIVE=0")
    items = {
        "none": quantize(torch.randn(0, 24), scheme),
        "flat": quantize(torch.randn(24), scheme),
        "deep": quantize(torch.randn(2, 3, 24), scheme),
    }
    path = _shard(tmp_path, items)
    packed = PackedRows(scheme, torch.float16, 24)
    served = Served(scheme, torch.float16)
    ctx = contextlib.nullcontext if native_on else native.fallback
    with ShardReader(path) as r, ctx():
        for name, stored in items.items():
            out = torch.empty((*stored.shape[:-1], 24), dtype=torch.float16)
            span = r.read_packed_span(r.tensors[name].begin, out, packed)
            assert span == ScaleSpan.of(unpack(stored, scheme).scales), name
            assert torch.equal(_bits(out), _bits(served.item(stored))), name


def _damaged_rows(scheme: Scheme) -> torch.Tensor:
    """Packed rows of ``scheme`` whose scales are damaged: NaN (quiet, negative, signalling
    with a payload), +inf, -inf; then two sound rows and a zero one."""
    packed = quantize(_rows(21)[:8], scheme)
    bits = [0x7FC00000, 0xFFC00000, 0x7FA00001, 0x7F800000, 0xFF800000]
    scales = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    packed[: len(bits), -SCALE_BYTES:] = scales.view(packed.dtype).reshape(len(bits), 4)
    return packed


@compiled
@pytest.mark.usefixtures("width_reset")
@pytest.mark.parametrize("scheme", list(Scheme))
def test_a_row_whose_scale_is_not_finite_is_nan_on_every_loop_and_counted(scheme: Scheme) -> None:
    """Issue "round four" item 7: the AVX2 loop gave bfloat16 +-0.0 where the portable loop
    gave NaN, and torch's casts keep a NaN's payload: such a row is now the dtype's quiet NaN
    in every value, on every loop and on the Python path, and the span counts it damaged."""
    packed = _damaged_rows(scheme)
    kernels = native.kernels()
    assert kernels is not None
    sound = ScaleSpan.of(unpack(packed[5:], scheme).scales)
    for dtype in SERVED:
        want = dequantize_unpacked(unpack(packed, scheme), scheme, dtype)
        nan = torch.full((), math.nan, dtype=dtype)
        assert torch.equal(_bits(want[:5]), _bits(nan).expand(5, 21)), dtype
        for width in _widths():
            kernels.set_width(width)
            got = torch.full_like(want, 7.0)
            span = dequantize_native(packed, scheme, got)
            assert span == ScaleSpan(sound.low, sound.high, damaged=5)
            assert torch.equal(_bits(got), _bits(want)), (width, dtype)
    assert ScaleSpan.of(unpack(packed, scheme).scales) == span


@compiled
def test_kernel_arguments_out_of_range_are_one_value_error_each() -> None:
    """Issue "round four" item 14: read_rows with a negative width raised SystemError."""
    kernels = native.kernels()
    assert kernels is not None
    buf = torch.zeros(64, dtype=torch.uint8)
    at = buf.data_ptr()
    span = (0, 0, 8, at, 0, 0, 0, -1)
    bad_calls = {
        "read_rows d=-1": lambda: kernels.read_rows([span], 0, 0, 1, -1),
        "read_rows d huge": lambda: kernels.read_rows([span], 0, 0, 1, sys.maxsize),
        "read_rows scheme": lambda: kernels.read_rows([span], 0, 2, 1, 4),
        "read_rows out": lambda: kernels.read_rows([span], 0, 0, 3, 4),
        "span offset": lambda: kernels.read_rows([(0, -1, 8, at, 0, 0, 0, -1)], 0, -1, 0, 0),
        "span nbytes": lambda: kernels.read_rows([(0, 0, -8, at, 0, 0, 0, -1)], 0, -1, 0, 0),
        "span tail": lambda: kernels.read_rows([(0, 0, 8, at, 0, -1, 0, -1)], 0, -1, 0, 0),
        "span dest 0": lambda: kernels.read_rows([(0, 0, 8, 0, 0, 0, 0, -1)], 0, -1, 0, 0),
        "span tail 0": lambda: kernels.read_rows([(0, 0, 8, at, 0, 4, 0, -1)], 0, -1, 0, 0),
        "span want": lambda: kernels.read_rows([(0, 0, 8, at, 0, 0, 0, 1 << 32)], 1, -1, 0, 0),
        "span no crc": lambda: kernels.read_rows([(0, 0, 8, at, 0, 0, 0, 5)], 0, -1, 0, 0),
        "dequant rows": lambda: kernels.dequant(at, 8, -1, 4, at, 0, 1),
        "dequant d": lambda: kernels.dequant(at, 8, 1, -4, at, 0, 1),
        "dequant d huge": lambda: kernels.dequant(at, 8, 1, sys.maxsize, at, 0, 1),
        "dequant stride": lambda: kernels.dequant(at, 7, 1, 4, at, 0, 1),
        "dequant src 0": lambda: kernels.dequant(0, 8, 1, 4, at, 0, 1),
        "dequant scheme": lambda: kernels.dequant(at, 8, 1, 4, at, -1, 1),
    }
    for what, call in bad_calls.items():
        with pytest.raises(ValueError) as caught:
            call()
        message = str(caught.value)
        assert message and "\n" not in message, what
    assert kernels.set_width(-5) == kernels.set_width(-1)  # negative: the width unchanged
