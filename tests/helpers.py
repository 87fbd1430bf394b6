"""Helpers shared by the test files (import them from here, never from another test file).

Each section says whose tests it serves; everything is real (real builds, real reads, features
compared with live encoding).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featbake.bake.pipeline import build
from featbake.recipe import Recipe
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.hash_cache import racy_window_ns
from featbake.store.layout import Layout
from featbake.store.objects import ObjectStore
from featbake.store.shard import ShardReader
from featbake.threadpool import map_in_threads
from tests.conftest import live_features

# == upkeep and export (tests/upkeep, tests/export): build, list shards, serve against live =====


def bake(data: Path, encoder: Path, store: Path, shard_bytes: int = 60_000, **kw: object):
    """A real build in this process (no decoding workers: faster for tiny folders)."""
    return build(data, encoder, cache=store, workers=0, shard_bytes=shard_bytes, **kw)


def shard_files(store: Path) -> dict[Path, int]:
    """Every shard file under the store and its size."""
    return {p: p.stat().st_size for p in (store / "shards").glob("*/*.safetensors")}


def shards_of_encoder(store: Path, encoder_fp: str) -> dict[Path, int]:
    """Shard files whose header names ``encoder_fp`` (read from the files, not the catalog)."""
    out = {}
    for p, size in shard_files(store).items():
        with ShardReader(p) as r:
            if r.metadata["encoder_fp"] == encoder_fp:
                out[p] = size
    return out


def manifest(store: Path, root: str) -> list[tuple[str, str]]:
    cat = Catalog(Layout(store))
    try:
        return [tuple(x) for x in cat.root_items(root)]
    finally:
        cat.close()


class Live:
    """Live encoding, memoised per (encoder bytes, file): what the store must agree with."""

    def __init__(self) -> None:
        self._memo: dict[tuple[bytes, str, str], object] = {}

    def __call__(self, encoder: Path, path: Path, recipe: Recipe | None = None) -> object:
        memo_key = (hashlib.sha256(Path(encoder).read_bytes()).digest(), str(path), repr(recipe))
        if memo_key not in self._memo:
            self._memo[memo_key] = live_features(encoder, path, recipe)
        return self._memo[memo_key]


def assert_serves(
    store: Path,
    root: str,
    data: Path,
    encoder: Path,
    live: Live,
    *,
    allow_missing: bool = False,
) -> int:
    """Read every item of ``root`` through FeatureReader and compare with live encoding.

    Returns how many items were served (the rest were misses, allowed only if asked).
    """
    reader = FeatureReader(Layout(store))
    served = 0
    try:
        for rel, key in manifest(store, root):
            got = reader.get(key)
            if got is None:
                assert allow_missing, f"{rel} ({key}) is not served"
                continue
            want = live(encoder, data / rel)
            if isinstance(want, dict):
                assert set(got) == set(want)
                for part, t in want.items():
                    torch.testing.assert_close(got[part], t, rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(got[""], want, rtol=1e-5, atol=1e-6)
            served += 1
    finally:
        reader.close()
    return served


def printed(r: Any) -> str:
    """All a finished command printed (a subprocess's or ``invoke``'s result), stripped."""
    return (r.stdout + r.stderr).strip()


#: A fresh interpreter running a ``featbake`` command (its arguments after ``-c``), then printing
#: which of torch and transformers it imported (``imported: [...]`` on stdout).
COMMAND_THEN_MODULES = """
import sys
from featbake.cli.main import main
try:
    main(sys.argv[1:])
finally:
    print("imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""

#: One fresh interpreter running several ``featbake`` commands in turn (a JSON list of argument
#: lists, the one argument after ``-c``): after each, a line ``==`` on stdout and ``== [exit
#: code, [torch and transformers if imported by then]]`` on stderr, so each command's output is
#: told apart and the first command that imported torch is named (:func:`commands_then_modules`).
COMMANDS_THEN_MODULES = """
import json, sys
from featbake.cli.main import main
for argv in json.loads(sys.argv[1]):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    took = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    print("==", flush=True)
    print("==", json.dumps([code, took]), file=sys.stderr, flush=True)
"""


@dataclass(frozen=True)
class Ran:
    """One command of :func:`commands_then_modules`: its exit code, its non-blank stdout and
    stderr lines, and which of torch and transformers were imported when it ended."""

    code: int
    out: list[str]
    err: list[str]
    imported: list[str]


def commands_then_modules(commands: list[list[str]], timeout: float = 300) -> list[Ran]:
    """Run ``commands`` in turn in one fresh interpreter (:data:`COMMANDS_THEN_MODULES`)."""
    ran = subprocess.run(
        [sys.executable, "-c", COMMANDS_THEN_MODULES, json.dumps(commands)],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=timeout,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr

    def split(text: str) -> list[list[str]]:
        runs: list[list[str]] = [[]]
        for line in text.splitlines():
            if line.startswith("=="):
                runs[-1].append(line)
                runs.append([])
            elif line.strip():
                runs[-1].append(line)
        assert runs[-1] == [] and len(runs) == len(commands) + 1, text
        return runs[:-1]

    out: list[Ran] = []
    for printed_, said in zip(split(ran.stdout), split(ran.stderr), strict=True):
        code, took = json.loads(said[-1][3:])
        out.append(Ran(code, printed_[:-1], said[:-1], took))
    return out


def age(path: Path, seconds: float) -> None:
    """Make a file look ``seconds`` old."""
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def change_every_other_clip(audio: Path, seed: int = 7_000) -> None:
    """Write new sound into every other clip of ``audio`` (in path order): rebuilt, each shard
    of the earlier build holds garbage (the old features) beside live rows."""
    import soundfile

    from featbake.testing import make_tone

    for i, wav in enumerate(sorted(audio.rglob("*.wav"))[1::2]):
        soundfile.write(wav, make_tone(0.6, seed=seed + i), 16_000)


# == builds (test_build, test_cli_build, test_merge, test_ranks, test_padded, test_hf) ==========


def stored_features(cache: Path, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Relative path -> stored parts, for every item of a root that is stored."""
    layout = Layout(cache)
    cat = Catalog(layout)
    reader = FeatureReader(layout, verify="always")
    try:
        items = cat.root_items(root)
        got = reader.get_many([k for _, k in items])
        return {p: got[k] for p, k in items if k in got}
    finally:
        reader.close()
        cat.close()


def assert_store_consistent(cache: Path) -> None:
    """Every catalog row names a sealed shard that holds the tensor with a valid checksum."""
    layout = Layout(cache)
    cat = Catalog(layout)
    assert cat.conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    rows = cat.conn.execute(
        "SELECT f.key, f.part, s.name, f.dtype, f.shape FROM features f "
        "JOIN shards s ON s.id = f.shard_id"
    ).fetchall()
    orphans = cat.conn.execute(
        "SELECT COUNT(*) FROM features WHERE shard_id NOT IN (SELECT id FROM shards)"
    ).fetchone()
    assert orphans == (0,)
    by_shard: dict[str, list[tuple]] = {}
    for row in rows:
        by_shard.setdefault(row[2], []).append(row)
    for name, entries in by_shard.items():
        with ShardReader(layout.shard_path(name)) as r:
            assert r.verify_all() == []
            for key, part, _, dtype, _shape in entries:
                name_in_shard = f"{key}/{part}" if part else key
                assert r.tensors[name_in_shard].dtype == dtype
    cat.close()


def root_keys(cache: Path, root: str) -> dict[str, str]:
    """Relative path -> key, from a root's manifest."""
    cat = Catalog(Layout(cache))
    try:
        return dict(cat.root_items(root))
    finally:
        cat.close()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (inf for a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# == tests that mount file systems (read-only stores, a small /dev/shm) ==========================


def can_mount_privately() -> bool:
    """Whether ``unshare -m`` and ``mount`` work here (root in a private mount namespace)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


# == images (test_images, test_hf_vision) ========================================================

#: Camera photographs that ship with software (the Rust embedded book's board photos: a
#: progressive JPEG, and one with EXIF and Photoshop blocks). No Python package installed here
#: ships a photograph; the tests that use these skip, saying so, where none exist.
PHOTO_GLOBS = (
    os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html/embedded-book/assets/*.jp*g"),
)


def real_photos() -> list[str]:
    """Up to three distinct photographs found on this machine (one copy per file name)."""
    found = sorted(p for pattern in PHOTO_GLOBS for p in glob.glob(pattern))
    by_name = {os.path.basename(p): p for p in found if os.path.getsize(p) > 50_000}
    return sorted(by_name.values())[:3]


@contextlib.contextmanager
def held_by_a_thread(lock: Any) -> Iterator[None]:
    """``lock`` held by another thread for the block's length (a fork inside the block copies
    it held: what a child must never wait on), released and the thread joined after."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def fails_after(seconds: int, what: str = "the block") -> Iterator[None]:
    """Fail (rather than hang the suite) if the block takes longer than ``seconds``: a
    TimeoutError naming ``what`` (SIGALRM, so the main thread only)."""

    def hang(*_: object) -> None:
        raise TimeoutError(f"{what} did not finish within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def put_many(bucket: ObjectStore, names: list[str], body: bytes = b"") -> None:
    """Objects ``names`` (``body`` each), put 16 at a time (3,000 in seconds, not a minute)."""

    def put(name: str) -> None:
        bucket.client.put_object(Bucket=bucket.url.bucket, Key=bucket.key(name), Body=body)

    list(map_in_threads(put, names, 16))


def rewrite_in_place(path: Path, data: bytes) -> None:
    """``path`` rewritten in place with ``data`` (its size), its mtime set back as ``cp -p``,
    ``touch -r``, ``rsync -t`` or an archive unpacked with fixed dates leave it: only its ctime
    tells, and another node's mount shows other ctimes."""
    before = path.stat()
    assert len(data) == before.st_size
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def rewrite_each(files: dict[Path, bytes]) -> None:
    """Each of ``files`` rewritten in place with its bytes (:func:`rewrite_in_place`)."""
    for path, data in files.items():
        rewrite_in_place(path, data)


def run_past_a_marker(args: list[str], marker: str, env: dict[str, str] | None = None) -> str:
    """Run a Python child that prints ``marker`` once set up, then the risky part; its stdout
    after the marker. A child still running 60 s after the marker (the part takes well under a
    second) hung: its threads' stacks (faulthandler, on SIGABRT) fail the test, naming where."""
    child = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == marker, child.communicate()[1]
    try:
        out, err = child.communicate(timeout=60)  # a hang, not a slow machine
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
        _, stacks = child.communicate()
        frames = re.findall(r'File "(?:.*/)?([^/"]+)", line (\d+) in (\w+)', stacks)
        where = [f"{name}:{line} {fn}" for name, line, fn in frames if name != "contextlib.py"]
        raise AssertionError(f"hung past {marker!r}, in: {' <- '.join(where[:9])}") from None
    assert child.returncode == 0, err
    return out.strip()


def script_lines(tmp_path: Path, text: str, clips: int = 2) -> list[str]:
    """The lines the training script ``text`` prints, run as ``python train.py DATA STORE``
    over ``clips`` clips it writes and a store not made yet (featbake importable from here)."""
    from featbake.testing import write_audio_folder
    from tests.conftest import REPO

    write_audio_folder(tmp_path / "data", clips, seconds=0.3, seed=4)
    script = tmp_path / "train.py"
    script.write_text(text)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.splitlines()


def wait_past_racy(folder: Path) -> None:
    """Return once the clock is past the racy window of every file in ``folder`` (a digest
    recorded before then is not trusted by a rebuild: ``FileStat.racy``). A wait on the clock,
    not on the machine's load."""
    newest = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in folder.iterdir()
                 if p.exists())  # fmt: skip
    past = newest + racy_window_ns(newest, newest) + 1
    while time.time_ns() <= past:
        time.sleep((past - time.time_ns()) / 1e9 + 1e-3)


def one_red_line(r) -> str:
    """The one line a refused command printed (no traceback, no internal error)."""
    said = printed(r)
    assert "Traceback" not in said and "internal error" not in said, said
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, said
    return lines[0]
