"""Read-ahead hints (store/shard.py): a range not in the page cache has its reads started
and is cached soon after without anyone reading it; a cached range is left alone; a hint never
raises. Pages are dropped with ``posix_fadvise(DONTNEED)``, as the cold benchmark does.

The library's probe (a one-byte ``RWF_NOWAIT`` read) starts reading the page it asks about, so
the tests look with ``mincore`` over an untouched mapping instead, which reads nothing."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

import pytest

from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, cached, can_hint, will_need, write_shard

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
        assert will_need(fd, MIB, 2 * MIB)  # reads started, not waited for
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
        _drop(reader.fd)
        a = reader.tensors["a"]
        if _resident(reader.path, a.begin, a.end - a.begin) > 0:
            pytest.skip("this filesystem keeps its pages cached (tmpfs?)")
        assert reader.will_need("a")
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
