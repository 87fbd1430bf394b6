"""The manifest command the split refusal gives (in10.6, in10.9), pasted into a shell: the
manifest it writes builds every file, under a hidden folder and with a comma in a name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from featbake.bake.pipeline import build
from featbake.testing import write_audio_folder
from tests.conftest import invoke


def _pasted_manifest(audio: Path, encoder_file: Path, where: Path) -> Path:
    """Run build on ``audio`` (refused as splits) and paste the refusal's manifest command."""
    r = invoke("build", "--data", audio, "--encoder", encoder_file,
               "--cache", where / "store")  # fmt: skip
    assert r.returncode == 8, r.stderr
    line = r.stderr.strip()
    command = re.search(r"--data: (\{ echo path; .*?\} > all\.csv), then --data all\.csv", line)
    assert command is not None, line
    subprocess.run(["bash", "-c", command.group(1)], cwd=where, check=True)
    return where / "all.csv"


def test_the_manifest_command_lists_a_folder_under_a_hidden_folder(
    tmp_path: Path, encoder_file: Path
) -> None:
    audio = tmp_path / ".cache" / "audio"
    for speaker in ("alice", "bob", "test"):
        write_audio_folder(audio / speaker, 2, seconds=0.3, seed=len(speaker))
    manifest = _pasted_manifest(audio, encoder_file, tmp_path)
    assert len(manifest.read_text().splitlines()) == 7, manifest.read_text()
    report = build(manifest, encoder_file, cache=tmp_path / "store", workers=0)
    assert (report.encoded + report.reused, report.failed) == (6, [])


def test_the_manifest_command_survives_a_comma_in_a_file_name(
    tmp_path: Path, encoder_file: Path
) -> None:
    audio = tmp_path / "audio"
    for speaker in ("alice", "bob", "test"):
        write_audio_folder(audio / speaker, 2, seconds=0.3, seed=len(speaker))
    first = sorted((audio / "alice").glob("*.wav"))[0]
    first.rename(first.with_name("take 1, final.wav"))
    manifest = _pasted_manifest(audio, encoder_file, tmp_path)
    report = build(manifest, encoder_file, cache=tmp_path / "store", workers=0)
    assert (report.encoded + report.reused, report.failed) == (6, [])
