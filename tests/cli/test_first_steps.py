"""A newcomer's first commands and first mistakes: each mistake is one red line saying what to
do, and each example a command's help shows pastes as one command."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import torch
import typer

import featbake.cli.main  # noqa: F401  (registers every command on the app)
from featbake.cli.app import app
from featbake.testing import TinyConvEncoder
from tests.conftest import invoke, run_cli
from tests.helpers import bake


def _examples(group: click.Group, prefix: str = "featbake") -> dict[str, list[str]]:
    """'featbake build' -> the example lines its help's epilog shows, for every command."""
    found: dict[str, list[str]] = {}
    for name, command in group.commands.items():
        path = f"{prefix} {name}"
        text = (command.epilog or "").replace("\b\n", "")  # click's keep-as-written marker
        shown = text.split("Examples:", 1)[1] if "Examples:" in text else ""
        found[path] = [ln.strip() for ln in shown.splitlines() if ln.startswith("  ")]
        if isinstance(command, click.Group):
            found.update(_examples(command, path))
    return found


def test_every_help_example_prints_whole_on_one_line_in_80_columns() -> None:
    """Click rewrapped help epilogs to the terminal: `featbake build --help` in 80 columns split
    `--cache s3://team-bucket/features` at its hyphen, so the example pasted ran as two broken
    commands."""
    examples = _examples(typer.main.get_command(app))  # type: ignore[arg-type]
    assert len(examples["featbake build"]) >= 10 and examples["featbake gc"]
    for command, lines in examples.items():
        done = run_cli(*command.split()[1:], "--help", env={"COLUMNS": "80"})
        assert done.returncode == 0, done.stderr
        shown = {ln.strip() for ln in done.stdout.splitlines()}
        assert not [ln for ln in lines if ln not in shown], f"{command} --help broke an example"


def test_a_mistyped_option_or_command_is_one_red_line_naming_the_help(tmp_path: Path) -> None:
    """Click's own rendering of a usage error was three lines: the usage, a hint, the error."""
    cases = {  # the arguments -> what the line names, and whose help it points to
        ("build", "--encoder", "ckpt.pt", "--dat", "./audio"): ("--data", "featbake build"),
        ("stat",): ("Did you mean 'stats'?", "featbake"),
        ("build", "--data", "./audio"): ("'--encoder'", "featbake build"),
        ("roots", "drop"): ("'name'", "featbake roots drop"),
    }
    for args, (said, command) in cases.items():
        done = run_cli(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
        assert said in lines[0] and f"{command} --help`" in lines[0], lines[0]
    bare = run_cli(cwd=tmp_path)  # no command at all: the answer is the help
    assert "Usage:" in bare.stdout + bare.stderr and "Commands" in bare.stdout + bare.stderr


def test_a_state_dict_given_as_weights_says_how_to_convert_it(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--weights` reads safetensors; a `torch.save` state dict failed with safetensors' own
    "header too large", which names no fix. The line now gives the conversion, and the
    conversion it gives, pasted, makes weights the build takes."""
    (tmp_path / "mymodels.py").write_text(
        "from featbake.testing import TinyConvEncoder\n\n\ndef build():\n"
        "    return TinyConvEncoder(seed=5)\n"
    )
    torch.save(TinyConvEncoder(seed=7).state_dict(), tmp_path / "sd.pt")
    args = ["build", "--encoder", "mymodels:build", "--data", audio_dir, "--cache", "store"]
    done = run_cli(*args, "--weights", "sd.pt", cwd=tmp_path)  # the line as a user sees it
    assert done.returncode == 4, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    call = re.search(r"safetensors\.torch\.save_file\(torch\.load\('.+?'\), '.+?'\)", done.stderr)
    assert call is not None, done.stderr
    convert = f"import torch, safetensors.torch\n{call[0]}"
    monkeypatch.chdir(tmp_path)  # pasted where the build ran, run here: no torch imported again
    exec(compile(convert, "<pasted>", "exec"), {})
    # The build that takes them, in this process (the module on the path as cwd puts it there).
    done = invoke(*args, "--weights", "sd.safetensors", cwd=tmp_path,
                  env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(r"encoded\s+16\b", done.stdout), done.stdout


def test_export_of_a_part_a_plain_tensor_root_lacks_says_to_drop_the_choice(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """A single-tensor encoder's root stores one part named '' : the refusal of `--output
    pooled` read "(it stores '')", which names nothing a user can pass."""
    bake(audio_dir, encoder_file, store_dir)
    # The first refusal in a process of its own (its stderr whole, as a user sees it), the
    # rest in this one (the same command and output, without importing torch again).
    for run, choice in ((run_cli, ["--output", "pooled"]), (invoke, ["--layers", "6"])):
        done = run("export", "--cache", store_dir, "--format", "zarr", tmp_path / "f.zarr",
                   *choice)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "''" not in done.stderr, done.stderr
        assert "without --output and --layers" in done.stderr, done.stderr
    done = invoke("export", "--cache", store_dir, "--format", "zarr", tmp_path / "f.zarr")
    assert done.returncode == 0 and "(ragged;" in done.stdout, done.stderr


def test_a_folder_without_config_json_as_encoder_says_what_encoder_takes(
    tmp_path: Path, audio_dir: Path
) -> None:
    """`--encoder ./audio` (the data folder, options swapped) was handed to transformers, whose
    "Unrecognized model ... Should have a `model_type` key in its config.json" names no fix."""
    done = run_cli("build", "--encoder", audio_dir, "--data", audio_dir, "--cache", tmp_path / "c")
    assert done.returncode == 4, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "without config.json" in lines[0], done.stderr
    assert "TorchScript (.pt)" in lines[0] and "model_type" not in lines[0], lines[0]


def test_a_file_given_as_data_is_said_to_be_a_file(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """One clip, or the encoder with the options swapped, as `--data` read "data folder X does
    not exist or is not a directory" of a file that plainly exists."""
    clip = next(audio_dir.rglob("*.wav"))
    # The first in a process of its own (its stderr whole), the second in this one.
    for run, encoder, data in ((run_cli, encoder_file, clip), (invoke, audio_dir, encoder_file)):
        done = run("build", "--encoder", encoder, "--data", data, "--cache", tmp_path / "c")
        assert done.returncode == 8, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and f"{data} is a file, not a folder" in lines[0], done.stderr
        assert "does not exist" not in lines[0] and "a folder holding it" in lines[0], lines[0]
