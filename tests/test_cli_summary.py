"""Issue 32 item 15: what a build prints off a terminal, and what its watching process loads.

Summary lines used to carry as many trailing spaces as the longest value was long (~150 behind
a batching note): a rich ``Table`` pads every cell. And the process that only watches the build
imported typer, rich and every command before starting the child that imports them again.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

from featbake.bake.pipeline import build
from featbake.cli import app as cli_app
from featbake.testing import TinyConvEncoder
from tests.conftest import REPO, run_cli


def test_a_piped_build_prints_no_trailing_spaces_and_ends_with_what_is_sealed(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    res = run_cli("build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines() + res.stderr.splitlines()
    assert [ln for ln in lines if ln != ln.rstrip()] == []
    batching = [ln for ln in res.stdout.splitlines() if ln.startswith("batching")]
    assert batching and len(batching[0]) > 40  # the longest value, which set the padding
    assert [ln.split()[0] for ln in res.stdout.splitlines()][:3] == ["root", "encoder", "files"]
    encode = [ln for ln in res.stderr.splitlines() if ln.startswith("encode:")]
    # The last word on bytes is what is sealed, with nothing left pending.
    assert encode and encode[-1].endswith("sealed") and "pending" not in encode[-1], encode


def test_a_noop_rebuild_starts_one_python_and_the_watcher_imports_no_typer_rich_or_torch(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Issue 31 item 4: the watched child is forked, not a second interpreter. It used to be
    started as ``python -m featbake``: Python's start-up and featbake's CLI imported twice in
    every build, a no-op rebuild included."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    args = ["build", "-e", str(encoder_file), "-d", str(audio_dir), "--cache", str(tmp_path)]
    first = subprocess.run([sys.executable, "-m", "featbake", *args], env=env, timeout=300)
    assert first.returncode == 0
    # The environment variable reaches every Python the command starts (-X importtime does not).
    res = subprocess.run(
        [sys.executable, "-m", "featbake", *args],
        capture_output=True, text=True, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "reused    " in res.stdout and "encoded   0" in res.stdout  # a no-op rebuild
    loaded = [
        ln.split("|")[-1].strip()
        for ln in res.stderr.splitlines()
        if ln.startswith("import time:") and "|" in ln and "self [us]" not in ln
    ]
    # One interpreter: Python's own start-up imports (encodings) and torch, once each.
    assert loaded.count("encodings") == 1 and loaded.count("torch") == 1, loaded
    assert loaded.count("featbake.cli.supervise") == 1
    # What the watching process imported before it forked: lines printed up to its own module.
    before_fork = set(loaded[: loaded.index("featbake.cli.supervise") + 1])
    assert not {"typer", "rich", "torch", "numpy", "featbake.cli.main"} & before_fork


def test_the_progress_bar_starts_no_thread_and_is_drawn_between_batches(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 4: rich redrew the bar from a thread of its own, 10 times a second, while
    the encoder ran (it held the GIL for each redraw, and on a busy node took a CPU from the
    encoder's OpenMP team). Now the only threads beside the build's are featbake's own."""
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=160, highlight=False)
    monkeypatch.setattr(cli_app, "console", terminal)
    alive_in_forward: list[set[threading.Thread]] = []

    class Watched(TinyConvEncoder):
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            alive_in_forward.append(set(threading.enumerate()))
            return super().forward(wav)

    before = set(threading.enumerate())
    bar = cli_app.progress_bar()
    with bar:
        tick = cli_app.tick_bar(bar, {})
        report = build(audio_dir, Watched(), cache=tmp_path / "c", progress=tick, workers=0)
    assert report.encoded == report.files == 16
    assert alive_in_forward
    started = {t.name for alive in alive_in_forward for t in alive - before}
    assert started and all(name.startswith("featbake-") for name in started), started
    drawn = screen.getvalue()
    assert "encode" in drawn and "16/16" in drawn  # the bar was drawn, to its last item


def test_a_build_is_forked_only_from_a_process_that_may_fork() -> None:
    """A program that imported torch (its CUDA cannot be used in a forked child) or runs
    threads calls `featbake.cli.main.main(["build", ...])`: the build runs in its process."""
    from featbake.cli.supervise import wants_supervisor

    assert "torch" in sys.modules  # as in such a program
    assert not wants_supervisor(["build", "-e", "enc.pt", "-d", "data"])
    code = (
        "import sys; from featbake.cli.supervise import wants_supervisor as w; "
        "sys.exit(0 if w(['build', '-e', 'e.pt']) and not w(['stats']) else 1)"
    )
    env = {k: v for k, v in os.environ.items() if k != "FEATBAKE_NO_SUPERVISOR"}
    assert (
        subprocess.run(
            [sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)}
        ).returncode
        == 0
    )
