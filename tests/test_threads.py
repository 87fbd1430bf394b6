"""Threads belong to the user (issue 19, item 1).

featbake used to set torch's thread count to the CPUs it could use for the whole build,
overriding ``OMP_NUM_THREADS=1``, the user's ``torch.set_num_threads(1)`` and an encoder
factory's own setting (silero-vad sets 1): on a node shared with other work, a many-small-ops
model then built several times slower than the user's own loop. Each test here records the
thread count the encoder itself sees while it encodes, and checks the features against
running the encoder now.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.sources import source_for
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder
from tests.conftest import run_cli

PROBE = """\
import os
import torch
from featbake.testing import TinyConvEncoder


class ThreadProbe(TinyConvEncoder):
    '''TinyConvEncoder that appends the torch thread count it runs with to $THREADS_LOG.'''

    def forward(self, wav):
        with open(os.environ["THREADS_LOG"], "a") as log:
            log.write(f"{torch.get_num_threads()}\\n")
        return super().forward(wav)


def make():
    return ThreadProbe()


def make_single_threaded():
    # What silero-vad's loader does: the model's own code sets its thread count.
    torch.set_num_threads(1)
    return ThreadProbe()
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An import-path encoder package; yields the log of thread counts seen by forward()."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "thread_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(pkg))
    log = tmp_path / "threads.log"
    monkeypatch.setenv("THREADS_LOG", str(log))
    before = torch.get_num_threads()
    try:
        yield log
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    data = tmp_path / "audio"
    write_audio_folder(data, 4, seconds=0.3, seed=5)
    return data


def seen(log: Path) -> set[int]:
    """The thread counts the encoder ran with, each call one line."""
    return {int(x) for x in log.read_text().split()}


def assert_serves_live(data: Path, store: Path, encoder: str) -> None:
    """Every item served equals the encoder run now (loaded afresh from its import path)."""
    from thread_probe import make  # type: ignore[import-not-found]

    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    live = make().eval()
    for i in range(len(ds)):
        wav = source_for(Recipe()).load(ds.path(i))
        with torch.inference_mode():
            want = live(wav.unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], want)


def test_the_users_torch_thread_count_is_kept_during_and_after_a_build(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    report = build(clips, "thread_probe:make", cache=tmp_path / "s", workers=0)
    assert report.encoded == 4
    assert seen(probe) == {1}  # featbake used to raise it to the CPUs it may use
    assert torch.get_num_threads() == 1
    assert_serves_live(clips, tmp_path / "s", "thread_probe:make")


def test_threads_asked_for_are_used_while_encoding_then_the_users_count_is_back(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    build(clips, "thread_probe:make", cache=tmp_path / "s", workers=0, threads=3)
    assert seen(probe) == {3}
    assert torch.get_num_threads() == 1


def test_an_encoder_factorys_own_thread_count_is_kept(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(2)
    build(clips, "thread_probe:make_single_threaded", cache=tmp_path / "s", workers=0)
    assert seen(probe) == {1}


def test_a_dataset_encoding_misses_leaves_the_users_count_alone(
    probe: Path, clips: Path, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    ds = CachedFeatureDataset(clips, "thread_probe:make", cache=tmp_path / "s")
    assert ds.stored() == 0
    ds.__getitems__([0, 1])
    ds.flush()
    assert seen(probe) == {1} and torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, 10_000])
def test_threads_out_of_range_are_refused_before_any_work(
    probe: Path, clips: Path, tmp_path: Path, bad: object
) -> None:
    with pytest.raises(ConfigError, match="--threads must be a whole number from 1"):
        build(clips, "thread_probe:make", cache=tmp_path / "s", threads=bad)  # type: ignore[arg-type]
    assert not probe.exists()


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        ({"OMP_NUM_THREADS": "1"}, [], {1}),  # was raised to 2 on this 2-CPU machine
        ({"OMP_NUM_THREADS": "1"}, ["--threads", "2"], {2}),
        ({}, ["--threads", "1"], {1}),
    ],
)
def test_cli_build_keeps_omp_num_threads_and_takes_threads(
    probe: Path,
    clips: Path,
    tmp_path: Path,
    env: dict[str, str],
    args: list[str],
    expected: set[int],
) -> None:
    pythonpath = os.pathsep.join([str(Path(__file__).parents[1]), str(tmp_path / "pkgs")])
    res = run_cli(
        *["build", "-e", "thread_probe:make", "-d", clips, "--cache", tmp_path / "s"],
        *["--workers", "0", *args],
        env={**env, "PYTHONPATH": pythonpath, "THREADS_LOG": str(probe)},
    )
    assert res.returncode == 0, res.stderr
    assert seen(probe) == expected
    assert_serves_live(clips, tmp_path / "s", "thread_probe:make")
