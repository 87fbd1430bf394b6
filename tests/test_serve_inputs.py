"""What a dataset is given and what it may do with the store: a list of paths gets the folder
scan's checks, a read-only store is served without a write, and ``revalidate=True`` follows
files rewritten after the dataset was made. Features are compared with running the encoder now.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from featbake.encode.sources import check_input_files, scan_inputs
from featbake.errors import SourceError
from featbake.testing import write_audio_folder
from tests.conftest import REPO

LIST_OF_BAD_PATHS = textwrap.dedent(
    """
    import sys
    from featbake.errors import SourceError
    from featbake.serve.dataset import CachedFeatureDataset
    enc, store, *paths = sys.argv[1:]
    try:
        CachedFeatureDataset(paths, enc, cache=store)
    except SourceError as e:
        print("SourceError:", e)
    else:
        print("no error")
    """
)


def _construct_in_a_subprocess(tmp_path: Path, encoder: Path, paths: list[Path]) -> str:
    """Make a dataset of ``paths`` in a child process with a deadline (a FIFO would block the
    constructor forever: the deadline turns that into a failure, not a hung test run)."""
    script = tmp_path / "ds.py"
    script.write_text(LIST_OF_BAD_PATHS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, script, encoder, tmp_path / "store", *paths]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_list_with_a_fifo_or_a_symlink_loop_fails_at_once(tmp_path: Path, encoder_file) -> None:
    """Issue 16 item 8: ``CachedFeatureDataset([fifo, wav])`` blocked forever on the FIFO."""
    write_audio_folder(tmp_path / "a", 1, seconds=0.3)
    wav = tmp_path / "a" / "clip00000.wav"
    fifo, loop = tmp_path / "a" / "fifo.wav", tmp_path / "a" / "loop.wav"
    os.mkfifo(fifo)
    loop.symlink_to(loop.name)  # loop.wav -> loop.wav
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [fifo, wav, loop])
    assert out.startswith("SourceError: 2 of the 3 input files cannot be inputs"), out
    assert f"{fifo}: not a regular file (a FIFO)" in out
    assert f"{loop}: cannot stat: Too many levels of symbolic links" in out
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [wav, Path("/dev/zero")])
    assert "/dev/zero: not a regular file (a character device)" in out, out


def test_a_list_and_the_folder_scan_refuse_the_same_files_alike(tmp_path: Path) -> None:
    """One check for both: each bad file gets the same reason from the scan and from a list."""
    data = tmp_path / "a"
    write_audio_folder(data, 1, seconds=0.3)
    os.mkfifo(data / "fifo.wav")
    (data / "loop.wav").symlink_to("loop.wav")
    (data / "gone.wav").symlink_to("nowhere.wav")
    (data / "dir.wav").mkdir()
    (data / "dir.wav" / "inside.txt").write_text("x")
    skipped = {s.path: s.reason for s in scan_inputs(data, [".wav"]).skipped}
    assert sorted(skipped) == ["fifo.wav", "gone.wav", "loop.wav"]  # a folder is walked
    for name in ["fifo.wav", "gone.wav", "loop.wav", "dir.wav"]:
        with pytest.raises(SourceError) as refused:
            check_input_files([data / "clip00000.wav", data / name])
        assert str(refused.value).startswith("1 of the 2 input files cannot be inputs")
        if name in skipped:
            assert f"{data / name}: {skipped[name]};" in str(refused.value)
    with pytest.raises(SourceError, match="a folder"):
        check_input_files([data / "dir.wav"])
    with pytest.raises(SourceError, match="list of input files is empty"):
        check_input_files([])
    assert check_input_files([data / "clip00000.wav"]) == [str(data / "clip00000.wav")]
