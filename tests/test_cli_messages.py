"""What the CLI says before any work (issue 32 items 9 and 14): a missing encoder is named
before the data is looked at, and each command's help lists only the exit codes it exits with."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.bake.pipeline import build
from featbake.errors import EncoderLoadError
from featbake.testing import write_image_folder
from tests.conftest import invoke


def test_a_missing_encoder_folder_is_named_before_the_data(tmp_path: Path) -> None:
    """Old main: "no input files (.flac, .mp3, .ogg, .wav)" for an image folder, since a
    missing folder is no vision folder and the recipe stayed audio."""
    images = tmp_path / "images"
    write_image_folder(images, 2)
    missing = tmp_path / "dinov2-small"
    res = invoke("build", "-d", images, "-e", missing, "--cache", tmp_path / "c")
    assert res.returncode == 4, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"encoder {missing} not found" in lines[0], lines
    with pytest.raises(EncoderLoadError, match="dinov2-small not found"):
        build(images, missing, cache=tmp_path / "c", workers=0)
    assert not (tmp_path / "c" / "catalog.sqlite").exists()


def _exit_codes(command: str) -> str:
    res = invoke(*command.split(), "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # help text wraps at any word
    return text[text.index("Exit codes:") :]


@pytest.mark.parametrize("command", ["stats", "export", "gc", "merge"])
def test_help_lists_only_the_commands_own_exit_codes(command: str) -> None:
    codes = _exit_codes(command)
    assert "2 bad option" in codes and "6 corrupt store data" in codes
    for build_only in ("3 some inputs failed", "4 encoder", "8 input unreadable", "9 the build"):
        assert build_only not in codes, (command, codes)


def test_build_help_lists_every_exit_code() -> None:
    codes = _exit_codes("build")
    for code in ("3 some inputs failed", "4 encoder", "8 input unreadable", "9 the build"):
        assert code in codes, codes


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_program_calling_main_runs_the_build_in_its_own_process(
    tmp_path: Path, debug: str
) -> None:
    """Review: a program calling ``featbake.cli.main.main(["build", ...])`` (one thread, no
    torch) had its process forked for the watched build, and with FEATBAKE_DEBUG=1 the child's
    re-raised error returned into the program's own code, which then ran twice (in two pids)
    and its parent exited 0 for a failed build. Only the command line's build is forked."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    script = (
        "import os\n"
        "from featbake.cli.main import main\n"
        "try:\n"
        f"    main(['build', '-d', {str(tmp_path / 'nodata')!r}, '-e', 'x.pt', '--cache', "
        f"{str(tmp_path / 's')!r}])\n"
        "except BaseException as e:\n"
        "    print('caught', type(e).__name__, os.getpid(), flush=True)\n"
        "print('next step', os.getpid(), flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEATBAKE_")}
    env.update(PYTHONPATH=str(REPO), FEATBAKE_DEBUG=debug)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    steps = [line.split() for line in res.stdout.splitlines() if line.startswith("next step")]
    assert len(steps) == 1, res.stdout + res.stderr
    caught = [line.split() for line in res.stdout.splitlines() if line.startswith("caught")]
    assert len(caught) == 1 and caught[0][-1] == steps[0][-1], res.stdout
