"""Every ``--option`` featbake's messages and docstrings name is an option of one of its commands
(or of the named tool it belongs to): advice naming an option that does not exist sends the user
nowhere (issue 28 item 17: the tier budget advised ``--shard-bytes``; the option is
``--shard-size``)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

import featbake.cli.main  # noqa: F401  (registers every command on the app)
from featbake.cli.app import app

PACKAGE = Path(__file__).resolve().parents[2] / "featbake"
#: Options of other tools that featbake's advice names: torchrun, SLURM's sbatch, docker; and
#: click's own --help.
FOREIGN = {"--nproc-per-node", "--array", "--dependency", "--cpus", "--help"}
# Azurite's own options (--blobHost, --inMemoryPersistence, --loose, --silent,
# --skipApiVersionCheck), read up to their first capital: featbake/testing.py starts it.
FOREIGN |= {"--blob", "--in", "--loose", "--silent", "--skip"}
# gcloud's: how a gzip-encoded object gets into a gs bucket (store/objects.py says so).
FOREIGN |= {"--gzip-local"}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def command_options() -> set[str]:
    """The long options of every featbake command and group."""
    found: set[str] = set()
    stack = [typer.main.get_command(app)]
    while stack:
        command = stack.pop()
        for param in command.params:
            found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        stack.extend(getattr(command, "commands", {}).values())
    return found


def test_every_option_featbake_names_exists() -> None:
    known = command_options() | FOREIGN
    named = {
        (m.group(), path.relative_to(PACKAGE).as_posix())
        for path in PACKAGE.rglob("*.py")
        for m in OPTION.finditer(path.read_text())
    }
    unknown = sorted((option, where) for option, where in named if option not in known)
    assert not unknown, f"options named in featbake that no command takes: {unknown}"
