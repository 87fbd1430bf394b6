"""Shared fixtures: a tiny deterministic TorchScript encoder, real audio files, a tmp store.

Everything is real: encoders are saved with ``torch.jit.save``, audio is written with soundfile,
the store is a directory with safetensors shards and a SQLite catalog. CLI tests run
``python -m featbake`` in a subprocess (:func:`run_cli`) where the process is the point, and the
same command in this process (:func:`invoke`) where what it prints and exits with is.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import (
    MultiOutputEncoder,
    TinyConvEncoder,
    save_torchscript,
    write_audio_folder,
)

REPO = Path(__file__).resolve().parents[1]

# Property tests draw the same examples in every run (per test, from its source), so a red run
# is a failure anyone can repeat, never a draw that went one way in CI: one catalog fuzz example
# met a damaged page only in one run's catalog (up11.1). `HYPOTHESIS_PROFILE=explore make test`
# draws afresh to hunt for new counterexamples; what it finds becomes an example of its own.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


class TickingClock:
    """A pace clock on which every reading is one tick after the last.

    A padded batch and the guard's run alone then each take one tick, so per input sample a
    padded batch (several items' samples) always costs less than an item alone: ``auto`` stays
    padded whatever the load of the machine running the tests. On the real clock a busy machine
    once timed padded batches 1.18x slower and a build went exact-shape, failing a test about
    padding (tests/bake/test_batching.py).
    """

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test``: one worker per core) each worker's torch gets its share
    of the cores for its own in-process work, as a DataLoader worker gets one thread: with
    torch's default (every core) in each worker, the workers' OpenMP teams fight over the same
    cores and torch-heavy test files ran 4x slower (tests/bake/test_batching.py with
    tests/encode/test_hf.py on 2 workers: 112-131 s, 25-31 s with one thread each). Subprocesses
    (the CLI, torchrun ranks) keep torch's default; tests of thread counts set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(autouse=True)
def pace_never_reads_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-process build times its batches on a :class:`TickingClock`; tests of the pace
    verdict put a modelled device clock there instead (tests/bake/test_batching.py)."""
    monkeypatch.setattr("featbake.bake.batching.pace_clock", TickingClock())


@pytest.fixture
def encoder_file(tmp_path: Path) -> Path:
    """A TorchScript TinyConvEncoder (``[B, T]`` -> ``[B, T/160, 64]``)."""
    return save_torchscript(TinyConvEncoder(), tmp_path / "encoder.pt")


@pytest.fixture
def multi_encoder_file(tmp_path: Path) -> Path:
    """A TorchScript encoder returning ``{"hidden": [B, T', 32], "pooled": [B, 8]}``."""
    return save_torchscript(MultiOutputEncoder(), tmp_path / "multi.pt")


@pytest.fixture
def audio_dir(tmp_path: Path) -> Path:
    """Twelve wav clips of 0.3-1.2 s in two subfolders, plus four clips of exactly 1 s."""
    root = tmp_path / "audio"
    write_audio_folder(root, 12, seconds=(0.3, 1.2), subdirs=2, seed=1)
    write_audio_folder(root / "fixed", 4, seconds=1.0, seed=2)
    return root


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


def live_features(encoder_path: Path, audio_path: Path, recipe: Recipe | None = None) -> object:
    """Features computed *now*: load the encoder afresh and run it on one preprocessed file."""
    recipe = recipe or Recipe()
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_path))
    x = source_for(recipe).load(audio_path)
    with torch.inference_mode():
        out = module(x.unsqueeze(0))
    if isinstance(out, dict):
        if recipe.output is not None:
            return out[recipe.output][0].to(recipe.torch_dtype)
        return {k: v[0].to(recipe.torch_dtype) for k, v in out.items()}
    return out[0].to(recipe.torch_dtype)


def run_cli(*args: str | os.PathLike[str], env: dict[str, str] | None = None, **kw: object):
    """Run ``python -m featbake ARGS`` in a subprocess; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    full_env.pop("FEATBAKE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "featbake", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=kw.pop("timeout", 300),
        **kw,
    )


def invoke(*args: str | os.PathLike[str], env: dict[str, str] | None = None, **kw: object):
    """Run the ``featbake`` command in this process: what :func:`run_cli` returns, without
    starting an interpreter and importing torch for each call (1-3 s each on a busy machine).

    For tests of what a command does and prints. What only a process shows stays with
    :func:`run_cli`: the build's watching parent (signals, an encoder that ends the process, a
    killed build), tracebacks and ``FEATBAKE_DEBUG``, import-time cost, and a few end-to-end
    calls. As in :func:`run_cli`, ``env`` is added to the environment (``PYTHONPATH`` entries to
    ``sys.path``), the output is 200 columns wide and Python's warnings print as featbake's one
    line on stderr; everything is restored afterwards.
    """
    from featbake.cli import app as cli_app
    from featbake.cli.main import main

    argv = [str(a) for a in args]
    saved_env, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
    saved_sigterm, saved_format = signal.getsignal(signal.SIGTERM), warnings.formatwarning
    widths = [(c, c._width) for c in (cli_app.console, cli_app.out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    added = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p]
    code: object = 0
    try:
        os.environ.update({"COLUMNS": "200", **(env or {}), "FEATBAKE_NO_SUPERVISOR": "1"})
        os.environ.pop("FEATBAKE_DEBUG", None)
        sys.path[:0] = added
        importlib.invalidate_caches()
        if kw.get("cwd") is not None:
            os.chdir(str(kw["cwd"]))
        for console, _ in widths:
            console.width = cli_app.piped_width(os.environ)
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            warnings.catch_warnings(),
        ):
            warnings.resetwarnings()  # then Python's own start-up filters
            warnings.simplefilter("default")
            for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning):
                warnings.simplefilter("ignore", category)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = _warning_to_stderr
            try:
                main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        forget_modules_under([p for p in added if Path(p).resolve() != REPO])
        os.chdir(saved_cwd)
        signal.signal(signal.SIGTERM, saved_sigterm)
        warnings.formatwarning = saved_format
        for console, width in widths:
            console._width = width
    if code is not None and not isinstance(code, int):
        stderr.write(f"{code}\n")
        code = 1
    return subprocess.CompletedProcess(
        ["featbake", *argv], code or 0, stdout.getvalue(), stderr.getvalue()
    )


def forget_modules_under(folders: list[str]) -> None:
    """Drop the imported modules whose files lie under ``folders`` (a test's own encoder
    packages): the next call imports the file as it is then, as a new process would."""
    roots = [str(Path(f).resolve()) + os.sep for f in folders]
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and any(str(Path(file).resolve()).startswith(r) for r in roots):
            del sys.modules[name]


def _warning_to_stderr(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


COUNTING_ENCODER = '''
import hashlib
import os
import time

from featbake.testing import TinyConvEncoder


def meet():
    """With $COUNT_MEET (a folder) and $COUNT_PARTIES (n): this process's first call waits
    until n processes have made theirs, so none encodes past its first input (nor seals) before
    every other has planned its work. Bounded: 120 s."""
    folder, parties = os.environ.get("COUNT_MEET"), int(os.environ.get("COUNT_PARTIES", "0"))
    if not folder or MET:
        return
    MET.append(True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < parties and time.monotonic() < deadline:
        time.sleep(0.01)


MET = []


def hold(log):
    """With $COUNT_HOLD (n): once n rows are logged, every later call waits (bounded: 600 s)
    and encodes nothing, so a test that kills the process sees it mid-run however fast or
    slow the machine is, never a build that finished first."""
    n = int(os.environ.get("COUNT_HOLD", "0"))
    if not n or not log or not os.path.exists(log):
        return
    with open(log) as f:
        if len(f.read().split()) < n:
            return
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)


class CountingEncoder(TinyConvEncoder):
    """TinyConvEncoder that appends a digest of each input row to $COUNT_CALLS per call."""

    def forward(self, wav):
        log = os.environ.get("COUNT_CALLS")
        hold(log)
        if log:
            with open(log, "a") as f:
                for row in wav:
                    f.write(hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16] + "\\n")
        meet()
        time.sleep(float(os.environ.get("COUNT_DELAY", "0")))
        return super().forward(wav)


def build():
    return CountingEncoder()
'''


@pytest.fixture
def counting_encoder(tmp_path: Path) -> dict[str, str]:
    """An import-path encoder that logs each encoded input; returns the env to run it with.

    ``env["COUNT_CALLS"]`` is the log (one line per encoded input row); the encoder is
    ``countenc:build`` once ``env["PYTHONPATH"]`` is used.
    """
    pkg = tmp_path / "encpkg"
    pkg.mkdir()
    (pkg / "countenc.py").write_text(COUNTING_ENCODER)
    return {
        "PYTHONPATH": f"{REPO}{os.pathsep}{pkg}",
        "COUNT_CALLS": str(tmp_path / "calls.log"),
    }


def encoded_rows(env: dict[str, str]) -> list[str]:
    """The input digests the counting encoder has seen so far (one per encoded input)."""
    log = Path(env["COUNT_CALLS"])
    return log.read_text().split() if log.exists() else []
