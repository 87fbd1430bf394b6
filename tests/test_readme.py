"""The README never lies: every `featbake` command and every option it shows exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import torch
import typer

from featbake.cli.main import app
from tests.conftest import live_features, run_cli

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


def _quickstart() -> str:
    """The README's quickstart section: from its heading to the next heading."""
    text = (REPO / "README.md").read_text()
    start = text.index("## 60-second quickstart")
    return text[start : text.index("\n#", start + 1)]


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    """A newcomer's first minutes, pasted: the try-it block makes an encoder and clips, the
    shell block's featbake commands bake and rebake them, and the training snippet serves an
    epoch. The snippet's prefetcher once asked for CUDA by name, which is a ConfigError on a
    machine without a GPU although its comment promised a no-op there."""
    section = _quickstart()
    try_it, training = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    shell = re.search(r"^```bash\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert shell is not None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FEATBAKE_CACHE", None)

    def python(code: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr

    python(try_it)
    commands = [ln.split("#")[0].split() for ln in shell[1].splitlines()]
    outputs = []
    for words in (w for w in commands if w and w[0] == "featbake"):
        done = run_cli(*words[1:], cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert re.search(r"encoded\s+8\b", outputs[0]) and re.search(r"encoded\s+0\b", outputs[1])
    python(
        training + "\nimport torch\n"
        "torch.save({'feats': feats.cpu(), 'lengths': lengths.cpu(), "
        "'paths': [str(ds.path(i)) for i in range(len(ds))]}, 'batch.pt')\n"
    )
    batch = torch.load(tmp_path / "batch.pt")
    assert len(batch["paths"]) == 8 and batch["feats"].shape[0] == 8  # one batch of 32 at most
    served = [batch["feats"][j, :n] for j, n in enumerate(batch["lengths"].tolist())]
    for path in batch["paths"]:
        live = live_features(tmp_path / "ckpt.pt", Path(path))
        assert any(f.shape == live.shape and torch.equal(f, live) for f in served), path
