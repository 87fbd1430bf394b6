"""Decoding for a build without decode workers: on one thread of the process, a few inputs
ahead of the encoder, in order, each input's failure its own (real wav files)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from featbake.bake.threads import AHEAD, decoded_items
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.store.catalog import FileStat
from featbake.testing import write_audio_folder


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
