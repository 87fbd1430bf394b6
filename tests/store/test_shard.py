"""Shard files: the exact format, content names, checksums; what crashes and full disks leave."""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import mmap
import os
import signal
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import featbake.store.shard as store_mod
from featbake.errors import ConfigError, FeatbakeError, ShardMissing, StoreCorrupt, StoreError
from featbake.store import shard as shard_format
from featbake.store.catalog import Location
from featbake.store.features import ShardHandles, relocated
from featbake.store.layout import Layout
from featbake.store.shard import (
    Leases,
    ReaderClosed,
    ReaderState,
    ShardReader,
    ShardWriter,
    Span,
    VerifyMode,
    cached,
    can_hint,
    checksum_v1,
    crc32c,
    crc32c_tensor,
    read_spans,
    shard_header,
    shard_metadata,
    split_tensor_name,
    tensor_buffer,
    tensor_name,
    will_need,
    write_shard,
)
from tests.helpers import fails_after

EFP, RFP = "e" * 64, "r" * 64


def _sample() -> dict[str, torch.Tensor]:
    return {
        "k1": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "k2/hidden": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "k2/pooled": torch.tensor([0.25], dtype=torch.bfloat16),
    }


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(tmp_path / "store").ensure()


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


# -- the format ------------------------------------------------------------------------------------
GOLDEN_HEADER = (
    b'{"__metadata__":{"checksums":"{\\"k1\\":\\"1aa626e0\\",\\"k2/hidden\\":\\"9e718cbc\\",'
    b'\\"k2/pooled\\":\\"8dcfedfc\\"}","encoder_fp":"' + b"e" * 64 + b'","format":"featbake-shard",'
    b'"format_version":"2","recipe_fp":"' + b"r" * 64 + b'"},'
    b'"k1":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
    b'"k2/hidden":{"dtype":"F16","shape":[2],"data_offsets":[24,28]},'
    b'"k2/pooled":{"dtype":"BF16","shape":[1],"data_offsets":[28,30]}}'
)
GOLDEN_NAME = "98ebcf4476c4d1d76e400f81a5d7c498978d435999add832109dbed7fc50b482"
GOLDEN_DATA = bytes.fromhex("000000000000803f0000004000004040000080400000a040003e00c0803e")
#: The same tensors as format 1 (zlib CRC-32 of the bytes only) wrote them: still read.
GOLDEN_V1_HEADER = (
    b'{"__metadata__":{"checksums":"{\\"k1\\":\\"91e79017\\",\\"k2/hidden\\":\\"94d5d536\\",'
    b'\\"k2/pooled\\":\\"bb3b971f\\"}","encoder_fp":"' + b"e" * 64 + b'","format":"featbake-shard",'
    b'"format_version":"1","recipe_fp":"' + b"r" * 64 + b'"},'
    b'"k1":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
    b'"k2/hidden":{"dtype":"F16","shape":[2],"data_offsets":[24,28]},'
    b'"k2/pooled":{"dtype":"BF16","shape":[1],"data_offsets":[28,30]}}'
)
GOLDEN_V1_NAME = "8421a22905370ea1fadeab00c52fac7782321e0470b35a58ed1156bd75a0dd48"


def _golden_file(header: bytes) -> bytes:
    padded = header + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(padded)) + padded + GOLDEN_DATA


def test_shard_bytes_are_pinned(layout: Layout) -> None:
    """The exact bytes of a shard: a change here changes every content name (bump the format)."""
    shard = write_shard(layout, _sample(), EFP, RFP)
    raw = shard.path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0  # the data region starts 8-byte aligned
    assert raw == _golden_file(GOLDEN_HEADER)
    assert raw[8 + n :] == GOLDEN_DATA
    # The same tensors give the same bytes in any process and in any insertion order.
    assert shard.name == GOLDEN_NAME
    again = write_shard(layout, dict(reversed(list(_sample().items()))), EFP, RFP)
    assert again.name == shard.name


def test_a_shard_hashed_beside_its_write_is_named_by_its_bytes(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard of DIGEST_BESIDE_BYTES or more is hashed on a thread while its file is written
    and fsynced: its name is still the SHA-256 of the file's bytes, the same name the hash in
    line gives, and its tensors read back."""
    torch.manual_seed(0)
    tensors = {tensor_name(f"{i:064x}"): torch.randn(300, 64) for i in range(16)}  # 1.2 MB
    assert sum(t.nbytes for t in tensors.values()) >= store_mod.DIGEST_BESIDE_BYTES
    threads: list[str] = []
    real = store_mod.sha256_hex

    def noting_the_thread(bufs: list[object]) -> str:
        threads.append(threading.current_thread().name)
        return real(bufs)

    monkeypatch.setattr(store_mod, "sha256_hex", noting_the_thread)
    shard = write_shard(layout, tensors, EFP, RFP)
    assert threads and threads[0].startswith("featbake-shard-digest")
    assert shard.name == hashlib.sha256(shard.path.read_bytes()).hexdigest()
    monkeypatch.setattr(store_mod, "DIGEST_BESIDE_BYTES", 1 << 40)  # the same shard, in line
    shard.path.unlink()
    assert write_shard(layout, tensors, EFP, RFP).name == shard.name
    assert threads[-1] == threading.current_thread().name
    with ShardReader(shard.path) as r:
        for name, t in tensors.items():
            assert torch.equal(r.read(name), t)
    assert _files(layout.tmp) == []


def test_the_old_format_writer_still_gives_the_pinned_v1_bytes(layout: Layout) -> None:
    """Tests write format-1 shards through ``version="1"``: they match what featbake 1 wrote."""
    tensors = _sample()
    head, order = shard_header(tensors, shard_metadata(tensors, EFP, RFP, version="1"))
    raw = head + b"".join(bytes(tensor_buffer(t)) for _, t in order)
    assert raw == _golden_file(GOLDEN_V1_HEADER)
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_V1_NAME


def test_a_v1_shard_still_reads_and_verifies(tmp_path: Path) -> None:
    """A shard of format 1 (pinned bytes): read, verified with CRC-32, a flipped byte caught."""
    path = tmp_path / f"{GOLDEN_V1_NAME}.safetensors"
    path.write_bytes(_golden_file(GOLDEN_V1_HEADER))
    with ShardReader(path, verify="always") as r:
        assert r.version == "1" and r.verify_all() == []
        assert not r.checksums_bind_header  # bytes only: a repair cannot prove dtype or shape
        for name, t in _sample().items():
            got = r.read(name)
            assert got.dtype == t.dtype and torch.equal(got, t)
    raw = bytearray(path.read_bytes())
    raw[_data_start(path) + 25] ^= 0x01  # inside k2/hidden
    path.write_bytes(raw)
    with ShardReader(path) as r:
        assert r.verify_all() == ["k2/hidden"]
        with pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k2/hidden"):
            r.read("k2/hidden")


def test_plain_safetensors_reads_a_shard(layout: Layout) -> None:
    tensors = _sample()
    shard = write_shard(layout, tensors, EFP, RFP)
    with safe_open(str(shard.path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t)
    assert meta["format"] == "featbake-shard" and meta["format_version"] == "2"
    assert (meta["encoder_fp"], meta["recipe_fp"]) == (EFP, RFP)
    # Format 2: CRC-32C of '["name","DTYPE",[shape]]' followed by the bytes, as 8 hex digits.
    sums = json.loads(meta["checksums"])
    st = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

    def want(n: str, t: torch.Tensor) -> str:
        desc = json.dumps([n, st[t.dtype], list(t.shape)]).replace(" ", "").encode()
        return f"{google_crc32c.value(desc + t.view(-1).view(torch.uint8).numpy().tobytes()):08x}"

    assert sums == {n: want(n, t) for n, t in tensors.items()}


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.float64,
    ],
)
def test_every_storable_dtype_round_trips(layout: Layout, dtype: torch.dtype) -> None:
    t = (torch.arange(-5, 7).reshape(3, 4) % 3).to(dtype)
    shard = write_shard(layout, {"x": t, "empty": torch.zeros(0, 2, dtype=dtype)}, EFP, RFP)
    with ShardReader(shard.path, verify="always") as r:
        assert torch.equal(r.read("x"), t) and r.read("x").dtype == dtype
        assert r.read("empty").shape == (0, 2)
    with safe_open(str(shard.path), framework="pt") as f:
        assert torch.equal(f.get_tensor("x"), t)


def test_tensor_names() -> None:
    assert tensor_name("ab", "") == "ab" and tensor_name("ab", "hidden") == "ab/hidden"
    assert split_tensor_name("ab/hidden") == ("ab", "hidden")
    assert split_tensor_name("ab") == ("ab", "")


# -- corruption ------------------------------------------------------------------------------------
def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_a_flipped_byte_fails_its_checksum(layout: Layout) -> None:
    shard = write_shard(layout, _sample(), EFP, RFP)
    raw = bytearray(shard.path.read_bytes())
    raw[_data_start(shard.path) + 5] ^= 0x10  # inside k1
    shard.path.write_bytes(raw)
    # safetensors itself loads the damaged tensor without a word ...
    with safe_open(str(shard.path), framework="pt") as f:
        assert not torch.equal(f.get_tensor("k1"), _sample()["k1"])
    # ... our reader refuses it and names the fix; the untouched tensors still read.
    r = ShardReader(shard.path)
    with pytest.raises(StoreCorrupt, match=r"checksum mismatch in tensor k1.*verify --repair"):
        r.read("k1")
    assert torch.equal(r.read("k2/hidden"), _sample()["k2/hidden"])
    assert r.verify_all() == ["k1"]
    assert r.read("k1", verify="never").shape == (2, 3)
    r.close()


def test_a_truncated_shard_is_detected(layout: Layout) -> None:
    """What a crash mid-write would leave if the file were published in place."""
    shard = write_shard(layout, _sample(), EFP, RFP)
    full = shard.path.read_bytes()
    for cut in (len(full) - 1, _data_start(shard.path), 100, 5):
        shard.path.write_bytes(full[:cut])
        with pytest.raises(StoreCorrupt, match="damaged"):
            ShardReader(shard.path)


def test_a_cut_shard_opens_only_with_cut_ok_holding_just_its_whole_tensors_each_checked(
    layout: Layout,
) -> None:
    """Repair's salvage reads a shard cut short (a disk that filled mid-copy) with ``cut_ok``:
    only the tensors whose bytes end at or before the cut, each still checked; every other
    reader refuses the file as before."""
    tensors = _sample()
    shard = write_shard(layout, tensors, EFP, RFP)
    full = shard.path.read_bytes()
    with ShardReader(shard.path) as whole:
        k1_end = whole.tensors["k1"].end
        assert whole.cut == () and whole.tensors["k2/hidden"].begin == k1_end
    for cut in (k1_end, k1_end + 1):  # at k1's last byte, and inside k2/hidden
        shard.path.write_bytes(full[:cut])
        with pytest.raises(StoreCorrupt, match="truncated"):
            ShardReader(shard.path)
        with ShardReader(shard.path, verify="always", cut_ok=True) as r:
            assert set(r.tensors) == {"k1"} and r.cut == ("k2/hidden", "k2/pooled")
            assert torch.equal(r.read("k1"), tensors["k1"])
    flipped = bytearray(full[:k1_end])
    flipped[k1_end - 1] ^= 0x01
    shard.path.write_bytes(bytes(flipped))
    with ShardReader(shard.path, cut_ok=True) as r, pytest.raises(StoreCorrupt, match="checksum"):
        r.read("k1")
    for cut in (_data_start(shard.path) - 1, 5):  # the header itself cut: nothing to parse
        shard.path.write_bytes(full[:cut])
        with pytest.raises(StoreCorrupt, match="damaged"):
            ShardReader(shard.path, cut_ok=True)


def test_a_zeroed_tail_is_detected(layout: Layout) -> None:
    """A shard cut short by SIGKILL and padded with zeros (safetensors loads it silently)."""
    shard = write_shard(layout, _sample(), EFP, RFP)
    raw = bytearray(shard.path.read_bytes())
    raw[-6:] = bytes(6)
    shard.path.write_bytes(raw)
    with ShardReader(shard.path) as r:
        assert "k1" not in r.verify_all()
        assert set(r.verify_all()) == {"k2/hidden", "k2/pooled"}


def test_a_foreign_safetensors_file_is_not_a_shard(tmp_path: Path) -> None:
    p = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(p))
    with pytest.raises(StoreCorrupt, match="not a featbake shard"):
        ShardReader(p)


def test_a_missing_shard_raises_shard_missing(tmp_path: Path) -> None:
    with pytest.raises(ShardMissing, match="verify --repair"):
        ShardReader(tmp_path / "nope.safetensors")


def test_reading_an_absent_tensor_says_to_repair(layout: Layout) -> None:
    shard = write_shard(layout, _sample(), EFP, RFP)
    with ShardReader(shard.path) as r, pytest.raises(StoreCorrupt, match="holds no tensor"):
        r.read("zz")


# -- a full disk -----------------------------------------------------------------------------------
def _enospc(*_a: object, **_k: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_on_fsync_gives_an_actionable_store_error(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod.os, "fsync", _enospc)
    with pytest.raises(StoreError, match=r"disk is full.*--cache DIR.*rerun to continue"):
        write_shard(layout, _sample(), EFP, RFP)
    assert _files(layout.tmp) == [] and _files(layout.shards) == []


def test_enospc_halfway_through_writing_leaves_no_partial_shard(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file fills up after some bytes (as a real disk does): nothing partial remains."""
    real_open = open

    class Filling:
        def __init__(self, f: object) -> None:
            self.f, self.written = f, 0

        def write(self, b: object) -> int:
            if self.written + len(b) > 64:  # type: ignore[arg-type]
                self.f.write(bytes(b)[: 64 - self.written])  # type: ignore[attr-defined]
                self.f.flush()  # type: ignore[attr-defined]
                _enospc()
            self.written += len(b)  # type: ignore[arg-type]
            return self.f.write(b)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.f, name)

        def __enter__(self) -> Filling:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()  # type: ignore[attr-defined]

    monkeypatch.setattr(
        store_mod, "open", lambda *a, **k: Filling(real_open(*a, **k)), raising=False
    )
    with pytest.raises(StoreError, match=r"No space left on device.*disk is full"):
        write_shard(layout, _sample(), EFP, RFP)
    assert _files(layout.tmp) == [] and _files(layout.shards) == []


def test_unwritable_store_says_so(layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*_a: object, **_k: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(store_mod.os, "replace", denied)
    with pytest.raises(StoreError, match=r"Permission denied.*writable"):
        write_shard(layout, _sample(), EFP, RFP)
    assert _files(layout.tmp) == [] and _files(layout.shards) == []


def test_layout_ensure_reports_an_uncreatable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="--cache DIR"):
        Layout(blocker / "store").ensure()


# -- the writer ------------------------------------------------------------------------------------
def test_writer_seals_at_the_target_size_and_on_exit(layout: Layout) -> None:
    sealed = []
    feats = {f"{i:064x}": torch.full((10,), float(i)) for i in range(7)}  # 40 bytes each
    with ShardWriter(layout, EFP, RFP, target_bytes=100, on_seal=sealed.append) as w:
        for k, t in feats.items():
            w.add(k, {"": t})
    assert [len(s.entries) for s in sealed] == [3, 3, 1]
    for s in sealed:
        with ShardReader(s.path) as r:
            for e in s.entries:
                assert torch.equal(r.read(e.tensor), feats[e.key])


def test_writer_seals_what_it_holds_when_the_block_raises(layout: Layout) -> None:
    sealed = []
    with (
        pytest.raises(KeyboardInterrupt),
        ShardWriter(layout, EFP, RFP, on_seal=sealed.append) as w,
    ):
        w.add("a" * 64, {"": torch.ones(3)})
        raise KeyboardInterrupt
    assert len(sealed) == 1 and sealed[0].entries[0].key == "a" * 64


def test_writer_item_limit_and_first_wins(layout: Layout) -> None:
    w = ShardWriter(layout, EFP, RFP, max_items=2)
    assert w.add("a" * 64, {"": torch.ones(4)}) is None
    assert w.add("a" * 64, {"": torch.zeros(4)}) is None  # duplicate name: first wins
    shard = w.add("b" * 64, {"h": torch.zeros(2), "p": torch.zeros(1)})
    assert shard is not None and len(shard.entries) == 3
    with ShardReader(shard.path) as r:
        assert torch.equal(r.read("a" * 64), torch.ones(4))
    assert w.seal() is None  # nothing pending


def test_writer_rejects_bad_limits_and_dtypes(layout: Layout) -> None:
    with pytest.raises(ConfigError, match="--shard-size"):
        ShardWriter(layout, EFP, RFP, target_bytes=0)
    w = ShardWriter(layout, EFP, RFP)
    with pytest.raises(ConfigError, match="cannot store dtype"):
        w.add("a" * 64, {"": torch.zeros(2, dtype=torch.complex64)})


def test_checksum_v1_is_crc32_hex() -> None:
    assert checksum_v1(b"") == "00000000"
    assert checksum_v1(b"featbake") == f"{zlib.crc32(b'featbake'):08x}"


@pytest.mark.parametrize("direct", [True, False], ids=["by-address", "fallback-copy"])
def test_crc32c_agrees_with_google_crc32c_on_every_buffer_kind(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The by-address fast path and the copying fallback give google_crc32c's own values."""
    if not direct:
        monkeypatch.setattr(shard_format, "_EXTEND_AT", None)
    elif shard_format._EXTEND_AT is None:
        pytest.skip("this google_crc32c build does not expose crc32c_extend")
    data = os.urandom(100_003)
    want = google_crc32c.value(data)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for buf in (data, bytearray(data), memoryview(data), t.numpy(), memoryview(t.numpy())):
        assert crc32c(buf) == want
    assert crc32c_tensor(t) == want and crc32c_tensor(t[:0]) == 0 and crc32c(b"") == 0
    assert crc32c(data[50:], crc32c(data[:50])) == want  # extends like google_crc32c.extend
    assert crc32c_tensor(t[1::2]) == google_crc32c.value(data[1::2])  # strided: a copy
    assert f"{crc32c(b'123456789'):08x}" == "e3069283"  # the published check value


def test_handles_are_bounded_and_reopen_after_forget(layout: Layout) -> None:
    shards = [write_shard(layout, {"x": torch.tensor([float(i)])}, EFP, RFP) for i in range(4)]
    h = ShardHandles(max_open=2)
    for s in shards:
        h.get(s.path)
    assert list(h) == [shards[2].path, shards[3].path]
    h.forget(shards[3].path)
    assert list(h) == [shards[2].path]
    assert torch.equal(h.get(shards[0].path).read("x"), torch.tensor([0.0]))
    h.close()
    assert list(h) == []


def test_an_evicted_reader_stays_open_until_its_last_lease_is_released(layout: Layout) -> None:
    """Issue "round four" item 3: eviction closed a reader another thread was reading."""
    shards = [write_shard(layout, {"x": torch.tensor([float(i)])}, EFP, RFP) for i in range(3)]
    h = ShardHandles(max_open=1)
    with Leases() as outer:
        first = h.lease(shards[0].path, outer)
        fd = first.fd
        with Leases() as inner:
            h.lease(shards[1].path, inner)  # evicts the first: retired, still leased twice
            assert first.state is ReaderState.RETIRING and _fd_open(fd)
        assert first.state is ReaderState.RETIRING and _fd_open(fd)
        assert torch.equal(first.read("x"), torch.tensor([0.0]))  # its own file still
    assert first.state is ReaderState.CLOSED and first.fd == -1  # the last release closed it
    assert not first.acquire()  # a closed reader is never leased again, nor read
    with pytest.raises(ReaderClosed, match="closed before this read"):
        first.read("x")
    h.get(shards[2].path)  # an idle reader is closed at its eviction
    assert list(h) == [shards[2].path]
    with Leases() as held:
        assert torch.equal(h.lease(shards[0].path, held).read("x"), torch.tensor([0.0]))
    h.close()


def test_no_lease_is_taken_once_a_retired_reader_is_being_closed(layout: Layout) -> None:
    """A retire (or last release) that decided to close the file lets its lock go before it
    closes: a lease taken then would read while the file closes, so none is."""
    reader = ShardReader(write_shard(layout, {"x": torch.ones(2)}, EFP, RFP).path)
    closing, go = threading.Event(), threading.Event()
    close = reader.close

    def held_close() -> None:
        closing.set()
        go.wait(30)  # a bound for a broken test, never reached when it runs
        close()

    reader.close = held_close  # type: ignore[method-assign]
    retiring = threading.Thread(target=reader.retire)
    retiring.start()
    try:
        assert closing.wait(30)
        assert not reader.acquire()
    finally:
        go.set()
        retiring.join()
    assert reader.state is ReaderState.CLOSED and reader.fd == -1


def test_handles_close_inherited_fds_in_a_forked_child(layout: Layout) -> None:
    """A child drops its parent's shard handles and closes its copies of their fds."""
    paths = [
        layout.shard_path(write_shard(layout, {f"k{i}": torch.ones(3)}, EFP, RFP).name)
        for i in range(3)
    ]
    handles = ShardHandles(max_open=8)
    fds = [handles.get(p).fd for p in paths]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report which inherited fds are still open after one get()
        try:
            os.close(r)
            handles.get(paths[0])
            still = [fd for fd in fds if _fd_open(fd)]
            os.write(w, json.dumps(still).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        still_open = json.loads(f.read())
    os.waitpid(pid, 0)
    # The child reopened paths[0] (possibly reusing a freed number), so at most that one fd.
    assert len(still_open) <= 1
    assert all(_fd_open(fd) for fd in fds)  # the parent's own handles are untouched
    assert handles.get(paths[1]).read("k1").tolist() == [1.0, 1.0, 1.0]
    handles.close()


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- format 2 binds what a tensor is, not only its bytes (issue 11, item 2) ------------------------
HEADER_EDITS = {
    "dtype F32 -> I32": (b'"k1":{"dtype":"F32"', b'"k1":{"dtype":"I32"'),
    "shape reversed": (b'"shape":[2,3]', b'"shape":[3,2]'),
    "names swapped": (b'"k2/hidden":{', b'"k2/XXXXXX":{'),
}


def _edit_header(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert raw.count(old) == 1 and len(old) == len(new)  # same byte count: offsets still fit
    path.write_bytes(raw.replace(old, new))


@pytest.mark.parametrize("edit", HEADER_EDITS, ids=list(HEADER_EDITS))
def test_a_header_edit_with_the_same_byte_count_fails_the_checksum(
    layout: Layout, edit: str
) -> None:
    """A dtype, shape or name edited in the header is caught by the reader and by verify."""
    from featbake.upkeep import check_shard

    shard = write_shard(layout, _sample(), EFP, RFP)
    old, new = HEADER_EDITS[edit]
    if edit == "names swapped":  # k2/hidden <-> k2/pooled: each name now heads the other's bytes
        _edit_header(shard.path, b'"k2/hidden":{', b'"k2/XXXXXX":{')
        _edit_header(shard.path, b'"k2/pooled":{', b'"k2/hidden":{')
        _edit_header(shard.path, b'"k2/XXXXXX":{', b'"k2/pooled":{')
        damaged = {"k2/hidden", "k2/pooled"}
    else:
        _edit_header(shard.path, old, new)
        damaged = {"k1"}
    with ShardReader(shard.path) as r:
        assert r.checksums_bind_header
        for name in damaged:
            with pytest.raises(StoreCorrupt, match=f"checksum mismatch in tensor {name}"):
                r.read(name)
        assert set(r.verify_all()) == damaged
    check = check_shard(shard.path)
    assert not check.sound and set(check.intact) == set(_sample()) - damaged


@pytest.mark.parametrize("edit", ["dtype", "shape"])
def test_the_dataset_never_serves_a_tensor_whose_header_was_edited(
    audio_dir: Path, encoder_file: Path, store_dir: Path, edit: str
) -> None:
    """Issue 11, item 2, end to end: before, the dataset served the I32 (or transposed) tensor
    without an error; now every read path refuses it and serves the others equal to live."""
    from featbake.bake.pipeline import build
    from featbake.serve.dataset import CachedFeatureDataset
    from tests.conftest import live_features

    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=60_000)
    shard = sorted(Layout(store_dir).shards.rglob("*.safetensors"))[0]
    with ShardReader(shard) as r:
        name, info = next(iter(r.tensors.items()))
    old = json.dumps({name: {"dtype": "F32", "shape": list(info.shape)}}, separators=(",", ":"))
    new = {"dtype": "I32", "shape": list(info.shape)}
    if edit == "shape":
        new = {"dtype": "F32", "shape": list(info.shape)[::-1]}
    _edit_header(
        shard, old[1:-2].encode(), json.dumps({name: new}, separators=(",", ":"))[1:-2].encode()
    )
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    bad = next(i for i in range(len(ds)) if ds.key(i) == name)
    for read in (lambda: ds[bad], lambda: ds.__getitems__([bad, (bad + 1) % len(ds)])):
        with pytest.raises(StoreCorrupt, match=f"checksum mismatch in tensor {name}"):
            read()
    for i in range(len(ds)):
        if i != bad:
            torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


def test_format_2_checksums_detect_a_flipped_byte_in_every_tensor(layout: Layout) -> None:
    shard = write_shard(layout, _sample(), EFP, RFP)
    good = shard.path.read_bytes()
    start = _data_start(shard.path)
    for offset, name in ((0, "k1"), (23, "k1"), (24, "k2/hidden"), (29, "k2/pooled")):
        raw = bytearray(good)
        raw[start + offset] ^= 0x80
        shard.path.write_bytes(raw)
        with ShardReader(shard.path) as r:
            assert r.verify_all() == [name]


# -- verify modes ----------------------------------------------------------------------------------
def test_verify_mode_is_an_enum_and_an_unknown_mode_is_a_config_error(layout: Layout) -> None:
    """Before: any value but "always"/"first" silently meant "never"."""
    shard = write_shard(layout, _sample(), EFP, RFP)
    for bad in ("sometimes", "ALWAYS", "", "nevr"):
        with pytest.raises(ConfigError, match="verify must be 'first', 'always' or 'never'"):
            ShardReader(shard.path, verify=bad)
        with pytest.raises(ConfigError, match="verify must be"):
            ShardHandles(verify=bad)
    with ShardReader(shard.path, verify="always") as r:
        assert r.verify is VerifyMode.ALWAYS
        with pytest.raises(ConfigError, match="verify must be"):
            r.read("k1", verify="sometimes")
    # Each mode does what it says, on a shard whose k1 bytes are damaged.
    raw = bytearray(shard.path.read_bytes())
    raw[_data_start(shard.path)] ^= 0x01
    shard.path.write_bytes(raw)
    with ShardReader(shard.path, verify=VerifyMode.NEVER) as r:
        assert r.read("k1").shape == (2, 3)  # unchecked, as asked
        with pytest.raises(StoreCorrupt):
            r.read("k1", verify=VerifyMode.FIRST)
    with ShardReader(shard.path, verify="first") as r:
        with pytest.raises(StoreCorrupt):
            r.read("k1")
        with pytest.raises(StoreCorrupt):  # a failed check is not remembered as passed
            r.read("k1")
        assert torch.equal(r.read("k2/hidden"), _sample()["k2/hidden"])


# -- only regular files are shards (issue 11, item 7) ----------------------------------------------
def test_a_fifo_directory_or_device_at_a_shard_path_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    device = tmp_path / "dev.safetensors"
    device.symlink_to("/dev/zero")
    cases = {fifo: "FIFO", folder: "directory", device: "character device"}
    with fails_after(10):
        for path, kind in cases.items():
            with pytest.raises(StoreCorrupt, match=f"not a regular file but a {kind}"):
                ShardReader(path)
            with pytest.raises(StoreCorrupt, match="verify --repair"):
                ShardHandles().get(path)


def test_a_symlink_loop_at_a_shard_path_is_a_store_error(tmp_path: Path) -> None:
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    with pytest.raises(StoreError, match="cannot open shard"):
        ShardReader(loop)


def test_a_regular_shard_reads_blocking_after_the_nonblocking_open(layout: Layout) -> None:
    """O_NONBLOCK is only for the open: the fd used for reads is an ordinary blocking one."""
    import fcntl

    shard = write_shard(layout, _sample(), EFP, RFP)
    with ShardReader(shard.path) as r:
        assert not fcntl.fcntl(r.fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert fcntl.fcntl(r.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert torch.equal(r.read("k1"), _sample()["k1"])


# -- format-1 stores still serve -------------------------------------------------------------------
def test_a_store_of_format_1_shards_still_verifies_and_serves(
    audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store built by the old writer (CRC-32, format 1) is served equal to live encoding."""
    from torch.utils.data import DataLoader

    from featbake.bake.pipeline import build
    from featbake.serve.collate import pad_collate
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.store.features import FeatureReader
    from featbake.upkeep import check_shard
    from tests.conftest import live_features

    with monkeypatch.context() as m:  # the old code path: format-1 metadata
        m.setattr(store_mod, "shard_metadata", functools.partial(shard_metadata, version="1"))
        build(audio_dir, encoder_file, cache=store_dir, workers=0)
    layout = Layout(store_dir)
    shards = sorted(layout.shards.rglob("*.safetensors"))
    assert shards
    for path in shards:
        with ShardReader(path) as r:
            assert r.version == "1" and r.verify_all() == []
        assert check_shard(path).sound
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = [live_features(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], want[i], rtol=1e-5, atol=1e-6)
    fresh = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    order = list(range(len(fresh)))[::-1]
    loader = DataLoader(fresh, batch_size=5, sampler=order, collate_fn=pad_collate)
    for b, (padded, lengths) in enumerate(loader):
        for j, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(padded[j, :n], want[order[b * 5 + j]], rtol=1e-5, atol=1e-6)
    reader = FeatureReader(layout, verify="always")
    got = reader.get(ds.key(0))
    assert got is not None
    torch.testing.assert_close(got[""], want[0], rtol=1e-5, atol=1e-6)
    reader.close()
    # A flipped byte in a format-1 shard is still caught on the dataset's first read.
    with ShardReader(shards[0]) as r:
        name, info = next(iter(r.tensors.items()))
    raw = bytearray(shards[0].read_bytes())
    raw[info.begin + 3] ^= 0x04
    shards[0].write_bytes(raw)
    damaged = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    i = next(i for i in range(len(damaged)) if damaged.key(i) == split_tensor_name(name)[0])
    with pytest.raises(StoreCorrupt, match="checksum mismatch"):
        damaged[i]


def test_a_fifo_in_place_of_a_shard_fails_the_dataset_and_export_reads_at_once(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Issue 11, item 7: before, the dataset and `export` blocked forever opening the FIFO."""
    from featbake.bake.pipeline import build
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.store.features import FeatureReader

    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    shard = next(Layout(store_dir).shards.rglob("*.safetensors"))
    with ShardReader(shard) as r:
        key = split_tensor_name(next(iter(r.tensors)))[0]
    shard.unlink()
    os.mkfifo(shard)
    i = next(i for i in range(len(ds)) if ds.key(i) == key)
    reader = FeatureReader(Layout(store_dir), verify="always")  # what `export` reads through
    with fails_after(20):
        with pytest.raises(StoreCorrupt, match="not a regular file but a FIFO"):
            ds[i]
        with pytest.raises(StoreCorrupt, match="not a regular file but a FIFO"):
            reader.get(key)
    reader.close()
    from tests.conftest import run_cli

    res = run_cli("export", store_dir.parent / "out.zarr", "--cache", store_dir, timeout=60)
    assert res.returncode == 6, res.stdout + res.stderr  # StoreCorrupt, within seconds
    assert "not a regular file but a FIFO" in res.stderr and "Traceback" not in res.stderr


@settings(max_examples=400, deadline=None)
@given(
    name=st.one_of(st.text(max_size=20), st.sampled_from(["ab" * 32, "ab" * 32 + "/layer6"])),
    dtype=st.sampled_from(["F32", "F16", "BF16", 'X"', "\u00e9"]),
    shape=st.lists(st.integers(0, 10**9), max_size=4),
)
def test_tensor_descriptor_is_the_canonical_json_of_every_name(
    name: str, dtype: str, shape: list[int]
) -> None:
    """The fast path formats exactly the bytes ``json.dumps`` gives (format 2's checksums)."""
    want = json.dumps([name, dtype, shape], separators=(",", ":"), ensure_ascii=True).encode()
    assert shard_format.tensor_descriptor(name, dtype, tuple(shape)) == want


# == test_reader ===================================================================================
# The store's one read path (store/shard.py ``read_spans``) and its one vanished-shard rule
# (store/features.py ``relocated``), on their own: every read of a stored tensor goes through
# them, so their edge cases are pinned here rather than through each caller.

EFP, RFP = "e" * 64, "r" * 64


def _reader_sample() -> dict[str, torch.Tensor]:
    return {
        "k1": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "k2": torch.arange(4, dtype=torch.float32).reshape(1, 4),
        "k3": torch.zeros(0, 3),
    }


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(Layout(tmp_path / "store").ensure(), _reader_sample(), EFP, RFP).path


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def test_spans_of_a_batch_are_read_checked_and_their_padding_zeroed(shard: Path) -> None:
    want = _reader_sample()
    with ShardReader(shard) as r:
        rows = np.full((3, 48), 0xAB, dtype=np.uint8)  # a padded batch's bytes, not yet zero
        spans = []
        for j, name in enumerate(want):
            n = r.tensors[name].end - r.tensors[name].begin
            spans.append(r.span(name, rows[j, :n], verify=j != 1, tail=rows[j, n:]))
        read_spans(spans)
        for j, t in enumerate(want.values()):
            n = t.numel() * t.element_size()
            assert np.array_equal(rows[j, :n], _bytes(t))
            assert not rows[j, n:].any()
        assert r.read("k1", verify="never").equal(want["k1"])


def test_a_span_of_the_wrong_size_is_refused_before_reading(shard: Path) -> None:
    with ShardReader(shard) as r, pytest.raises(Exception, match="needs 24 bytes"):
        r.span("k1", np.empty(23, dtype=np.uint8))


def test_a_corrupt_span_raises_and_names_its_tensor(shard: Path) -> None:
    with ShardReader(shard) as r:
        begin = r.tensors["k2"].begin
        with open(shard, "r+b") as f:
            f.seek(begin)
            f.write(b"\x01")
        dest = np.empty(16, dtype=np.uint8)
        with pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k2"):
            read_spans([r.span("k2", dest)])
        read_spans([r.span("k2", dest, verify=False)])  # unchecked: read as it is


def test_an_unchecked_located_read_cut_short_names_its_tensor(shard: Path) -> None:
    """The located hit paths read by offset alone (no name on the hot path); a shard cut
    short under an open reader still names the tensor, as a checked read does."""
    with ShardReader(shard) as r:
        info = r.tensors["k2"]
        os.truncate(shard, info.begin + 3)
        dest = np.empty(info.end - info.begin, dtype=np.uint8)
        with pytest.raises(StoreCorrupt, match="tensor k2 is cut short"):
            r.read_span(info.begin, dest)
        with pytest.raises(StoreCorrupt, match="tensor k2 is cut short"):
            read_spans([Span(r, info.begin, dest, None, None)])


def test_a_checksum_that_is_not_hex_is_a_mismatch_not_a_crash(tmp_path: Path) -> None:
    tensors = _reader_sample()
    meta = shard_metadata(tensors, EFP, RFP)
    sums = json.loads(meta["checksums"])
    sums["k1"] = "not-hex!"
    meta["checksums"] = json.dumps(sums)
    head, order = shard_header(tensors, meta)
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(head + b"".join(_bytes(t).tobytes() for _, t in order))
    with ShardReader(path) as r:
        with pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k1"):
            r.read("k1", verify="always")
        assert r.read("k2", verify="always").equal(tensors["k2"])


def _loc(shard: str) -> Location:
    return Location(key="k", part="", shard=shard, dtype="F32", shape=(1,), nbytes=4)


def test_relocated_reads_where_the_catalog_now_puts_the_key() -> None:
    moved = [_loc("new")]
    got = relocated("k", lambda key: moved, lambda locs: locs[0].shard)
    assert got == (moved, "new")


def test_relocated_is_a_miss_when_the_key_is_gone_or_its_new_shard_too() -> None:
    def gone(locs: list[Location]) -> str:
        raise ShardMissing("gone")

    assert relocated("k", lambda key: [], lambda locs: "never read") is None
    assert relocated("k", lambda key: [_loc("new")], gone) is None


def test_relocated_raises_corrupt_bytes() -> None:
    def corrupt(locs: list[Location]) -> str:
        raise StoreCorrupt("bad")

    with pytest.raises(StoreCorrupt):
        relocated("k", lambda key: [_loc("new")], corrupt)


# == test_store_fuzz ===============================================================================
# Fuzzing the shard reader (hypothesis, bounded): hostile bytes give a FeatbakeError, nothing else.
#
# Whatever lies at a shard's path (random bytes, a valid shard with flipped, cut or appended bytes,
# a header of random JSON or of plausible but inconsistent entries, absurdly nested arrays), opening
# it, reading each tensor with and without checks, and ``verify_all`` either succeed or raise a
# :class:`FeatbakeError` (mostly :class:`StoreCorrupt`): never another exception, a crash or a hang.

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # bounded and repeatable: the same examples on every run
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _valid_shard() -> bytes:
    tensors = {
        "a" * 64: torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b" * 64 + "/hidden": torch.ones(2, 5, dtype=torch.float16),
        "b" * 64 + "/pooled": torch.tensor([True, False]),
        "c" * 64: torch.zeros(0, 7),
    }
    head, order = shard_header(tensors, shard_metadata(tensors, "e" * 64, "r" * 64))
    return head + b"".join(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, t in order
    )


VALID = _valid_shard()


@pytest.fixture
def shard_path(tmp_path: Path) -> Iterator[Path]:
    """One file, rewritten by each example; an alarm fails the test instead of hanging it."""

    def _hang(*_: object) -> None:
        raise TimeoutError("the shard reader hung")

    old = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(120)
    yield tmp_path / "fuzz.safetensors"
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _exercise(path: Path, data: bytes) -> None:
    """Everything a reader does with a shard; only FeatbakeErrors may escape."""
    path.write_bytes(data)
    try:
        with ShardReader(path, verify=VerifyMode.FIRST) as r:
            for name, info in r.tensors.items():
                assert info.begin <= info.end <= len(data)  # what was accepted is consistent
                for mode in (VerifyMode.NEVER, VerifyMode.ALWAYS):
                    try:
                        t = r.read(name, verify=mode)
                    except StoreCorrupt:
                        continue
                    assert t.numel() * t.element_size() == info.end - info.begin
            r.verify_all()
    except FeatbakeError:
        pass


def _with_header(header: object, data: bytes = b"", length_delta: int = 0) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", max(0, len(text) + length_delta)) + text + data


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(shard_path: Path, data: bytes) -> None:
    _exercise(shard_path, data)


@FUZZ
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=6
    ),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
    tail=st.binary(max_size=64),
)
def test_a_valid_shard_mutated(
    shard_path: Path, flips: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    raw = bytearray(VALID)
    for pos, bits in flips:
        raw[pos] ^= bits
    _exercise(shard_path, bytes(raw[:cut]) + tail)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
DIM = st.one_of(st.integers(-3, 6), st.integers(2**31, 2**64), st.booleans(), st.floats())
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.one_of(
            st.sampled_from(["F32", "F16", "BF16", "I32", "BOOL", "U8", "F8", "x"]), JSON
        ),
        "shape": st.one_of(st.lists(DIM, max_size=3), JSON),
        "data_offsets": st.one_of(st.lists(DIM, min_size=0, max_size=3), JSON),
    }
)
META = st.one_of(
    st.just(shard_metadata({}, "e" * 64, "r" * 64)),
    st.builds(
        lambda v, sums: {"format": "featbake-shard", "format_version": v, "checksums": sums},
        st.sampled_from(["1", "2", "3", ""]),
        st.one_of(st.just("{}"), st.text(max_size=20), JSON.map(json.dumps)),
    ),
    JSON,
)


@FUZZ
@given(
    meta=META,
    entries=st.dictionaries(st.text(min_size=1, max_size=5), ENTRY, max_size=4),
    data=st.binary(max_size=128),
    length_delta=st.integers(-4, 4),
)
def test_plausible_headers_with_inconsistent_entries(
    shard_path: Path, meta: object, entries: dict, data: bytes, length_delta: int
) -> None:
    _exercise(shard_path, _with_header({"__metadata__": meta, **entries}, data, length_delta))


@FUZZ
@given(header=JSON, data=st.binary(max_size=64))
def test_headers_of_random_json(shard_path: Path, header: object, data: bytes) -> None:
    _exercise(shard_path, _with_header(header, data))


@pytest.mark.parametrize("where", ["header", "checksums"])
def test_arrays_nested_200000_deep_are_a_store_corrupt(shard_path: Path, where: str) -> None:
    """Before: RecursionError out of json.loads."""
    deep = "[" * 200_000 + "]" * 200_000
    if where == "header":
        data = struct.pack("<Q", len(deep)) + deep.encode()
    else:
        meta = {"format": "featbake-shard", "format_version": "2", "checksums": deep}
        data = _with_header({"__metadata__": meta})
    shard_path.write_bytes(data)
    with pytest.raises(StoreCorrupt, match="unreadable"):
        ShardReader(shard_path)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 48]},  # 60 bytes claimed
        {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [-4, -3], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [12], "data_offsets": [48, 0]},
        {"dtype": "F32", "shape": [True, 12], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [12], "data_offsets": [0, 48, 96]},
        {"dtype": "C64", "shape": [6], "data_offsets": [0, 48]},
        {"dtype": ["F32"], "shape": [12], "data_offsets": [0, 48]},
        {"shape": [12], "data_offsets": [0, 48]},
        [1, 2, 3],
    ],
)
def test_an_entry_that_does_not_fit_its_byte_range_is_a_store_corrupt(
    shard_path: Path, entry: object
) -> None:
    """Before: RuntimeError ("shape ... is invalid"), TypeError or a served wrong tensor."""
    meta = shard_metadata({}, "e" * 64, "r" * 64)
    shard_path.write_bytes(_with_header({"__metadata__": meta, "x": entry}, bytes(48)))
    with pytest.raises(StoreCorrupt, match="damaged"):
        ShardReader(shard_path)


@pytest.mark.parametrize("meta", [7, "featbake-shard", [], {"format": 1}, None])
def test_metadata_that_is_not_a_string_map_is_a_store_corrupt(
    shard_path: Path, meta: object
) -> None:
    shard_path.write_bytes(_with_header({"__metadata__": meta}))
    with pytest.raises(StoreCorrupt, match="not a featbake shard"):
        ShardReader(shard_path)


# == test_readahead ================================================================================
# Read-ahead hints (store/shard.py): a range not in the page cache has its reads started
# and is cached soon after without anyone reading it; a cached range is left alone; a hint never
# raises. Pages are dropped with ``posix_fadvise(DONTNEED)``, as the cold benchmark does.
#
# The library's probe (a one-byte ``RWF_NOWAIT`` read) starts reading the page it asks about, so
# the tests look with ``mincore`` over an untouched mapping instead, which reads nothing.

needs_hints = pytest.mark.skipif(
    not can_hint() or not hasattr(os, "RWF_NOWAIT") or not sys.platform.startswith("linux"),
    reason="posix_fadvise, RWF_NOWAIT and mincore are Linux's",
)

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def _drop(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _resident(path: Path, begin: int, nbytes: int) -> float:
    """The share of the range's pages in the page cache, by ``mincore`` over a mapping that is
    never touched (so, unlike the library's probe, looking reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    first, last = begin // PAGE, (begin + nbytes - 1) // PAGE
    length = (last - first + 1) * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * PAGE)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = ctypes.create_string_buffer(last - first + 1)
        try:
            assert libc.mincore(addr, length, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, length)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / len(vec.raw)


def _cold_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 * MIB))
        f.flush()
        os.fsync(f.fileno())  # DONTNEED drops clean pages only
        _drop(f.fileno())
    if _resident(path, 0, 4 * MIB) > 0:
        pytest.skip("this filesystem keeps its pages cached (tmpfs?)")
    return path


def _hinted_cold(path: Path, hint: Callable[[], bool], fd: int, begin: int, nbytes: int) -> None:
    """``hint()`` (a ``will_need`` over the range) returns True just after the range's pages
    were dropped from the cache. A hint over a cached range is rightly none, and on a loaded
    machine the kernel may keep or take back a page between the drop and the hint (seen in
    full runs), so a try where the range is resident before or after a refused hint proves
    nothing and is made again; a refusal over a range cold on both sides fails."""
    for _ in range(20):
        _drop(fd)
        if _resident(path, begin, nbytes) > 0:
            continue  # the drop left pages: no cold range to hint
        if hint():
            return
        after = _resident(path, begin, nbytes)
        assert after > 0, f"no hint over a cold range ({begin}, {nbytes}): cached() says cached"
    pytest.skip("the kernel kept or took back this range's pages on every try")


def _read_ahead(path: Path, begin: int, nbytes: int) -> bool:
    """Whether all pages of the range came into the cache (within 10 s) with no read of them."""
    deadline = time.monotonic() + 10
    while _resident(path, begin, nbytes) < 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@needs_hints
def test_a_dropped_range_is_read_ahead_then_left_alone(tmp_path: Path) -> None:
    path = _cold_file(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        # reads started, not waited for
        _hinted_cold(path, lambda: will_need(fd, MIB, 2 * MIB), fd, MIB, 2 * MIB)
        assert _read_ahead(path, MIB, 2 * MIB)  # nobody read it: the kernel did
        assert _resident(path, 3 * MIB + MIB // 2, MIB // 2) == 0  # and nothing else
        assert not will_need(fd, MIB, 2 * MIB)  # cached now: no second hint
        assert os.pread(fd, 2 * MIB, MIB) == path.read_bytes()[MIB : 3 * MIB]
    finally:
        os.close(fd)


@needs_hints
def test_a_shard_tensor_is_hinted_by_name(tmp_path: Path) -> None:
    import torch

    tensors = {"a": torch.randn(512, 768), "b": torch.randn(256, 768)}
    sealed = write_shard(Layout(tmp_path / "store").ensure(), tensors, "e" * 64, "r" * 64)
    with ShardReader(sealed.path) as reader:
        a = reader.tensors["a"]
        hint = functools.partial(reader.will_need, "a")
        _hinted_cold(reader.path, hint, reader.fd, a.begin, a.end - a.begin)
        assert not reader.will_need("no-such-tensor")
        assert _read_ahead(reader.path, a.begin, a.end - a.begin)
        assert not reader.will_need("a")
        torch.testing.assert_close(reader.read("a", verify="always"), tensors["a"])


def test_a_hint_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    assert not will_need(fd, 0, 0)  # nothing to read
    will_need(fd, 10 * MIB, 4096)  # past the end: the kernel's business, not an error
    os.close(fd)
    assert not will_need(fd, 0, 100)  # a closed descriptor
    assert cached(fd, 0, 100) is None


def test_the_dtype_table_without_torch_agrees_with_torch() -> None:
    """ST_DTYPES, read by verify without torch, names each dtype's torch dtype and byte size;
    DTYPE_TO_ST and ST_TO_DTYPE, made from it on first use, stay importable and inverse."""
    from featbake.store.shard import DTYPE_TO_ST, ST_DTYPES, ST_ITEMSIZE, ST_TO_DTYPE

    for st_name, (name, size) in ST_DTYPES.items():
        dtype = getattr(torch, name)
        assert torch.empty(0, dtype=dtype).element_size() == size == ST_ITEMSIZE[st_name]
        assert DTYPE_TO_ST[dtype] == st_name and ST_TO_DTYPE[st_name] is dtype
    assert len(DTYPE_TO_ST) == len(ST_TO_DTYPE) == len(ST_DTYPES) == 10
