"""The README never lies: every `featbake` command and every option it shows exists."""

from __future__ import annotations

import re
from pathlib import Path

import click
import typer

from featbake.cli.main import app

REPO = Path(__file__).resolve().parents[1]
#: Options the README shows that belong to other tools (torchrun, pip, make).
OTHER_TOOLS = {"--nproc-per-node", "--standalone", "--nnodes"}


def _commands(group: click.Group, prefix: str = "") -> dict[str, set[str]]:
    """'build' -> its options, 'roots drop' -> its options, ... for every command."""
    out: dict[str, set[str]] = {}
    for name, cmd in group.commands.items():
        path = f"{prefix}{name}"
        out[path] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, f"{path} "))
    return out


def _code(text: str) -> list[str]:
    """Every line of code the README shows: fenced blocks' lines and inline spans."""
    fenced = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    lines = [ln for block in fenced for ln in block.splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return lines + re.findall(r"`([^`\n]+)`", prose)


def test_every_command_and_option_in_the_readme_exists() -> None:
    commands = _commands(typer.main.get_command(app))  # type: ignore[arg-type]
    every_option = set().union(*commands.values())
    code = _code((REPO / "README.md").read_text())
    invocations = [ln.split("#")[0].split() for ln in code if re.match(r"\s*featbake [a-z]", ln)]
    assert len(invocations) >= 10, "the README shows fewer featbake commands than expected"
    for words in invocations:
        cmd = words[1] if words[1] in commands else ""
        assert cmd, f"the README runs `featbake {words[1]}`, which is no command"
        if len(words) > 2 and f"{cmd} {words[2]}" in commands:
            cmd = f"{cmd} {words[2]}"
        for opt in (w.split("=")[0] for w in words if w.startswith("--")):
            assert opt in commands[cmd] | {"--help"}, f"`featbake {cmd}` has no {opt}"
    named = {o for ln in code for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", ln)}
    missing = named - every_option - OTHER_TOOLS - {"--help"}
    assert not missing, f"the README names options no featbake command has: {sorted(missing)}"
