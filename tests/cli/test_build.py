"""`featbake build`: reports and exit codes through the command run in this process
(tests.conftest.invoke); kill -9, Ctrl-C, signals, killed workers and concurrency in real
subprocesses.
"""

from __future__ import annotations

import ast
import io
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from rich.console import Console

from featbake.bake.pipeline import build
from featbake.cli import app as cli_app
from featbake.encode.sources import AudioSource
from featbake.errors import EncoderLoadError
from featbake.recipe import Recipe
from featbake.testing import TinyConvEncoder, write_audio_folder, write_image_folder
from tests.conftest import REPO, invoke, live_features, run_cli
from tests.helpers import (
    COMMAND_THEN_MODULES,
    assert_store_consistent,
    can_mount_privately,
    stored_features,
)

# An import-path encoder that is TinyConvEncoder(seed=0) but slow, and logs each call, so a test
# can interrupt a build at a known point. Sleep and log come from the environment: not in the key.
SLOW_MODULE = textwrap.dedent(
    """
    import os, time
    from featbake.testing import TinyConvEncoder

    class Slow(TinyConvEncoder):
        def forward(self, wav):
            time.sleep(float(os.environ.get("SLOW_SLEEP", "0")))
            log = os.environ.get("SLOW_LOG")
            if log:
                with open(log, "a") as f:
                    f.write(f"{wav.shape[0]}\\n")
            return super().forward(wav)

    def build():
        return Slow()
    """
)


def _json(res: subprocess.CompletedProcess) -> dict:
    assert res.stdout.strip(), res.stderr
    return json.loads(res.stdout)


def _feature_count(cache: Path) -> int:
    if not (cache / "catalog.sqlite").exists():
        return 0
    conn = sqlite3.connect(cache / "catalog.sqlite", timeout=30)
    try:
        return conn.execute("SELECT COUNT(*) FROM features").fetchone()[0]
    except sqlite3.OperationalError:
        return 0  # schema not created yet
    finally:
        conn.close()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    pkg = tmp_path / "pkgs"
    pkg.mkdir(exist_ok=True)
    (pkg / "slow_enc.py").write_text(SLOW_MODULE)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{pkg}", "COLUMNS": "200", **extra}
    env.pop("FEATBAKE_DEBUG", None)
    return env


def _popen(
    args: list, env: dict[str, str], log: Path, new_session: bool = False
) -> subprocess.Popen:
    # Output to a file, not a pipe: DataLoader workers outliving a killed parent keep pipes open.
    out = open(log, "w")  # noqa: SIM115 - closed by the caller via proc.stdout_file
    proc = subprocess.Popen(
        [sys.executable, "-m", "featbake", *map(str, args)],
        stdout=out,
        stderr=out,
        env=env,
        start_new_session=new_session,
    )
    proc.stdout_file = out  # type: ignore[attr-defined]
    return proc


def _wait_for(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the build to make progress")
        time.sleep(0.02)


def _assert_all_stored_and_live(cache: Path, root: str, data: Path, n: int) -> None:
    stored = stored_features(cache, root)
    assert len(stored) == n
    src = AudioSource(Recipe())
    enc = TinyConvEncoder().eval()
    for rel, parts in stored.items():
        with torch.no_grad():
            live = enc(src.load(data / rel).unsqueeze(0))[0]
        assert torch.allclose(parts[""], live, rtol=1e-5, atol=1e-6), rel
    assert_store_consistent(cache)


# -- the everyday surface -------------------------------------------------------------------------
def test_json_report_and_rebuild(tmp_path: Path, encoder_file: Path, audio_dir: Path) -> None:
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c", "--json"]
    first = _json(invoke(*args))
    assert first["files"] == first["encoded"] == 16 and first["failed"] == []
    assert len(first["encoder_fp"]) == 64 and first["root"].startswith("r-")
    again = invoke(*args)
    assert again.returncode == 0
    report = _json(again)
    assert (report["encoded"], report["reused"], report["bytes_written"]) == (0, 16, 0)
    for rel, parts in stored_features(tmp_path / "c", report["root"]).items():
        assert torch.allclose(parts[""], live_features(encoder_file, audio_dir / rel), atol=1e-6)


def _wait_past_racy() -> None:
    """Sleep until files written before now are past the hash cache's racy window."""
    from featbake.store.hash_cache import RACY_NS

    time.sleep(RACY_NS / 1e9 + 0.05)


def test_a_noop_rebuild_does_not_load_the_encoder_and_a_new_input_does(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 4: a rebuild that finds every feature stored loaded the TorchScript file
    only for the summary's batching line (a large checkpoint's load outweighed the rest of
    such a rebuild). Its key is the file's cached digest: no load is needed for it."""
    import featbake.encode.loaders as loaders

    loads: list[Path] = []
    real_load = loaders._load_torchscript

    def counted(path: Path) -> object:
        loads.append(path)
        return real_load(path)

    monkeypatch.setattr(loaders, "_load_torchscript", counted)
    # A file changed within a second of its hashing is hashed again (git's racy rule): the
    # encoder was written a moment ago, a checkpoint on disk is older.
    _wait_past_racy()
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c"]
    first = invoke(*args)
    assert first.returncode == 0 and "batching" in first.stdout and len(loads) == 1
    noop = invoke(*args)
    assert noop.returncode == 0, noop.stderr
    summary = dict(line.split(maxsplit=1) for line in noop.stdout.splitlines())
    assert (summary["encoded"], summary["reused"]) == ("0", "16")
    assert "batching" not in summary  # nothing was batched: no line says how
    assert len(loads) == 1, "a no-op rebuild loaded the encoder"
    report = _json(invoke(*args, "--json"))
    assert (report["reused"], report["batching"], len(loads)) == (16, "", 1)
    # One new input: the encoder is loaded (once), encodes it alone, and says how it batched.
    write_audio_folder(audio_dir / "new", 1, seconds=0.7, seed=9)
    grown = _json(invoke(*args, "--json"))
    assert (grown["encoded"], grown["reused"], len(loads)) == (1, 16, 2)
    assert grown["batching"] == "exact" and grown["encoder_fp"] == report["encoder_fp"]
    stored = stored_features(tmp_path / "c", grown["root"])
    assert len(stored) == 17
    for rel, parts in stored.items():
        assert torch.allclose(parts[""], live_features(encoder_file, audio_dir / rel), atol=1e-6)


def test_a_noop_rebuild_of_a_changed_encoder_file_loads_it_and_encodes_again(
    tmp_path: Path, audio_dir: Path
) -> None:
    """The unloaded key is the file's cached digest only while its stat is unchanged: an
    encoder file replaced in place is loaded, fingerprinted anew, and everything re-encoded."""
    from featbake.testing import save_torchscript

    enc = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "enc.pt")
    _wait_past_racy()  # its cached digest is trusted (see the test above)
    args = ["build", "-e", enc, "-d", audio_dir, "--cache", tmp_path / "c", "--json"]
    first = _json(invoke(*args))
    save_torchscript(TinyConvEncoder(seed=1), tmp_path / "other.pt").replace(enc)
    again = _json(invoke(*args))
    assert again["encoder_fp"] != first["encoder_fp"]
    assert (again["encoded"], again["reused"], again["batching"]) == (16, 0, "exact")
    for rel, parts in stored_features(tmp_path / "c", again["root"]).items():
        assert torch.allclose(parts[""], live_features(enc, audio_dir / rel), atol=1e-6)


def test_summary_and_cache_from_the_environment(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    res = invoke(
        "build", "-e", encoder_file, "-d", audio_dir, env={"FEATBAKE_CACHE": str(tmp_path / "env")}
    )
    assert res.returncode == 0, res.stderr
    for word in ("encoded", "reused", "failed", "written", "time"):
        assert word in res.stdout
    assert (tmp_path / "env" / "catalog.sqlite").is_file()
    # Without a terminal (a CI log), progress comes as plain lines that end at the full count.
    # Labelled, and no rate over a too-short window (it used to print "1,510,004 items/s").
    assert "hash: 16/16" in res.stderr
    done = r"(done in [\d.]+s|[\d,]+ items/s, elapsed \d+s)"
    assert re.search(rf"^encode: 16/16, {done}", res.stderr, re.MULTILINE), res.stderr


def test_help_shows_an_example_and_exit_codes() -> None:
    res = run_cli("build", "--help")
    assert res.returncode == 0
    assert "featbake build --encoder ckpt.pt --data ./audio" in res.stdout
    assert "130" in res.stdout and "--trust-pickle" in res.stdout


def test_version() -> None:
    import featbake

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"featbake {featbake.__version__}"


@pytest.mark.parametrize(
    ("case", "code", "needle"),
    [
        ("no-data", 8, "does not exist"),
        ("no-encoder", 4, "not found"),
        ("bad-dtype", 2, "--dtype float16"),
        ("bad-size", 2, "shard"),
    ],
)
def test_errors_are_one_red_line_with_a_documented_code(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, case: str, code: int, needle: str
) -> None:
    args = {
        "no-data": ["-e", encoder_file, "-d", tmp_path / "nope"],
        "no-encoder": ["-e", tmp_path / "nope.pt", "-d", audio_dir],
        "bad-dtype": ["-e", encoder_file, "-d", audio_dir, "--dtype", "int4"],
        "bad-size": ["-e", encoder_file, "-d", audio_dir, "--shard-size", "lots"],
    }[case]
    # A narrow console (or a pipe, 80 columns) must not wrap the one line into several.
    res = invoke("build", *args, "--cache", tmp_path / "c", env={"COLUMNS": "40"})
    assert res.returncode == code, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_corrupt_audio_exit_3_lists_it_and_stores_the_rest(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    (audio_dir / "part0" / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c"]
    res = invoke(*args)
    assert res.returncode == 3
    assert "part0/broken.wav" in res.stderr and "cannot decode audio" in res.stderr
    assert "1 of 17 inputs failed" in res.stderr
    report = _json(invoke(*args, "--json"))  # exit 3 again, with the JSON on stdout
    assert report["encoded"] == 0 and report["reused"] == 16
    assert report["failed"][0]["path"] == "part0/broken.wav"
    strict = invoke(*args, "--strict")
    assert strict.returncode == 8 and "broken.wav" in strict.stderr


def test_every_input_failing_alike_blames_the_encoder_or_options_not_the_inputs(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Issue 18 item 9: a mono encoder given --no-mono failed on all 16 inputs, and the message
    told the user to fix or remove the inputs. A 17th, broken file fails differently: the
    inputs are then at fault, as before."""
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c", "--no-mono"]
    res = invoke(*args)
    assert res.returncode == 3
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: every input (16) failed the same way: the encoder")
    assert "--mono/--no-mono" in last and "not at the inputs" in last
    assert "Fix or remove them" not in res.stderr
    listed = [ln for ln in res.stderr.splitlines() if ln.startswith("failed ")]
    assert len(listed) == 16
    assert not [ln for ln in listed if re.match(r"failed (\S+): \1:", ln)]  # named once
    (audio_dir / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    mixed = invoke(*args)
    assert mixed.returncode == 3 and "17 of 17 inputs failed" in mixed.stderr
    ok = invoke(*args[:-1], "--json")  # mono, as the encoder expects
    assert ok.returncode == 3 and _json(ok)["encoded"] == 16
    causes = {f["path"]: f["cause"] for f in _json(invoke(*args, "--json"))["failed"]}
    assert causes.pop("broken.wav") == "data" and set(causes.values()) == {"encoder"}


def test_every_input_failing_alike_for_the_data_points_at_the_data_not_the_encoder(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Round four item 14: every row naming a missing file, and every cell of a table written
    by ``to_parquet`` without its bytes, were told "That points at the encoder or the
    options". The advice follows the failures' cause (data or encoder), not a blanket
    sentence."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = "".join(json.dumps({"path": f"gone/{i}.wav", "label": i}) + "\n" for i in range(3))
    (tmp_path / "gone.jsonl").write_text(rows)
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = pa.array([{"bytes": None, "path": f"clip{i}.wav"} for i in range(3)], media)
    pq.write_table(pa.table({"audio": cells, "label": [0, 1, 2]}), tmp_path / "paths.parquet")
    for data in ("gone.jsonl", "paths.parquet"):
        args = ["build", "-e", encoder_file, "-d", tmp_path / data, "--cache", tmp_path / "c"]
        res = invoke(*args)
        assert res.returncode == 3, res.stderr
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("error: every input (3) failed the same way: "), last
        assert "That points at the data, not at the encoder" in last
        assert "--column" in last and "encoder or the options" not in res.stderr
        report = _json(invoke(*args, "--json"))
        assert [f["cause"] for f in report["failed"]] == ["data"] * 3


# -- interruption ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill_9_then_rerun_completes_and_reencodes_nothing_sealed(tmp_path: Path) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 60, seconds=0.5, seed=11)  # 12.8 KB of features each
    cache = tmp_path / "c"
    env = _env(tmp_path, SLOW_SLEEP="0.05")
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", cache]
    args += ["--batch-size", "1", "--workers", "1", "--shard-size", "32KiB"]
    proc = _popen(args, env, tmp_path / "first.log")
    try:
        _wait_for(lambda: _feature_count(cache) >= 9 or proc.poll() is not None)
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.stdout_file.close()  # type: ignore[attr-defined]
    assert proc.returncode == -signal.SIGKILL  # killed mid-build, not finished
    assert workers, "the build ran without its decode worker"
    # Its decode worker dies with it (it used to hang forever on a pipe nobody read).
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"decode workers outlived the killed build: {alive}"
    sealed = _feature_count(cache)
    assert 9 <= sealed < 60
    # The rerun in this process, decoding in it too: the killed build is this test's process.
    res = invoke(*args, "--workers", "0", "--json", env={"PYTHONPATH": env["PYTHONPATH"]})
    assert res.returncode == 0, res.stderr
    report = _json(res)
    assert report["reused"] == sealed
    assert report["encoded"] == 60 - sealed  # nothing that was sealed is encoded again
    _assert_all_stored_and_live(cache, report["root"], data, 60)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["process", "group"])
@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_ctrl_c_or_sigterm_exits_and_seals_what_was_encoded(
    tmp_path: Path, target: str, sig: signal.Signals, code: int, word: str
) -> None:
    """SIGINT or SIGTERM to the build alone, or to its whole process group (a terminal's Ctrl-C,
    SLURM's scancel). SIGTERM is how torchrun stops surviving ranks and how Kubernetes and
    docker stop a job: it keeps sealed work as Ctrl-C does, with exit code 143 (issue 16
    item 4); it used to kill the build at once (-15), losing everything not yet sealed."""
    data = tmp_path / "audio"
    write_audio_folder(data, 40, seconds=0.5, seed=12)
    cache = tmp_path / "c"
    calls = tmp_path / "calls.log"
    env = _env(tmp_path, SLOW_SLEEP="0.05", SLOW_LOG=str(calls))
    # One big shard: nothing seals on its own before the end, so whatever is stored after the
    # interrupt was sealed by the interrupt.
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", cache, "--batch-size", "1"]
    args += ["--workers", "1"]  # a decode worker, which a signal to the group reaches too
    proc = _popen(args, env, tmp_path / "first.log", new_session=True)
    try:
        _wait_for(
            lambda: (
                (calls.exists() and len(calls.read_text().split()) >= 5) or proc.poll() is not None
            )
        )
        assert _feature_count(cache) == 0
        called = len(calls.read_text().split())
        if target == "group":  # the DataLoader workers get it too
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(60)
    finally:
        proc.stdout_file.close()  # type: ignore[attr-defined]
    output = (tmp_path / "first.log").read_text()
    assert proc.returncode == code, output
    assert word in output and "Traceback" not in output
    sealed = _feature_count(cache)
    # Every item whose encoding had finished is sealed; at most the one in flight is lost.
    assert called - 1 <= sealed <= len(calls.read_text().split()) < 40
    assert list((cache / "tmp").iterdir()) == []
    res = invoke(*args, "--workers", "0", "--json", env={"PYTHONPATH": env["PYTHONPATH"]})
    report = _json(res)
    assert (report["reused"], report["encoded"]) == (sealed, 40 - sealed)
    _assert_all_stored_and_live(cache, report["root"], data, 40)


@pytest.mark.slow
def test_two_concurrent_builds_on_one_cache_both_succeed(tmp_path: Path) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 30, seconds=(0.3, 0.8), seed=13, subdirs=3)
    cache = tmp_path / "c"  # fresh: both processes race to create the catalog too
    env = _env(tmp_path, SLOW_SLEEP="0.01")
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", cache, "--json"]
    args += ["--shard-size", "64KiB"]
    procs = [_popen(args, env, tmp_path / f"p{i}.log") for i in range(2)]
    for p in procs:
        p.wait(120)
        p.stdout_file.close()  # type: ignore[attr-defined]
    logs = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], logs
    reports = [json.loads(log[log.index("{") :]) for log in logs]
    assert reports[0]["root"] == reports[1]["root"]
    assert all(r["encoded"] + r["reused"] == 30 for r in reports)
    _assert_all_stored_and_live(cache, reports[0]["root"], data, 30)
    # And a third run finds everything.
    third = _json(invoke(*args, env={"PYTHONPATH": env["PYTHONPATH"]}))
    assert third["encoded"] == 0


CHANNEL_MEAN = textwrap.dedent(
    """
    import torch

    class ChannelMean(torch.nn.Module):
        def forward(self, x):  # [B, T] -> [B, 1]; [B, C, T] -> [B, C, 1]
            return x.mean(dim=-1, keepdim=True)

    def build():
        return ChannelMean()
    """
)


def test_no_mono_keeps_channels_and_is_its_own_key(tmp_path: Path) -> None:
    import soundfile

    from featbake.testing import make_tone

    data = tmp_path / "stereo"
    data.mkdir()
    soundfile.write(data / "a.wav", make_tone(0.5, channels=2, seed=3), 16000)
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "chan_enc.py").write_text(CHANNEL_MEAN)
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{pkg}"}
    cache = tmp_path / "cache"
    reports = {}
    for flag in ("--mono", "--no-mono"):
        res = invoke("build", "-e", "chan_enc:build", "-d", data, "--cache", cache, flag,
                      "--workers", "0", "--json", env=env)  # fmt: skip
        assert res.returncode == 0, res.stderr
        reports[flag] = _json(res)
        stored = stored_features(cache, reports[flag]["root"])["a.wav"][""]
        x = AudioSource(Recipe(mono=flag == "--mono")).load(data / "a.wav")
        assert torch.equal(stored, x.mean(dim=-1, keepdim=True))  # live, per the recipe
        assert stored.shape == ((1,) if flag == "--mono" else (2, 1))
    assert reports["--mono"]["recipe_fp"] != reports["--no-mono"]["recipe_fp"]


# -- hardening: inputs that are not regular files, absurd options, dead workers, output -----------
def test_fifo_symlink_loop_and_non_utf8_name_are_skipped_not_hung(
    tmp_path: Path, encoder_file: Path
) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 3, seconds=0.3, seed=31)
    os.mkfifo(data / "x.wav")  # reading it would block the build forever
    os.symlink(".", data / "link")  # os.walk(followlinks=True) repeated every file 40 times
    os.link(os.fsencode(data / "clip00000.wav"), os.path.join(os.fsencode(data), b"t\xe9.wav"))
    res = run_cli("build", "-e", encoder_file, "-d", data, "--cache", tmp_path / "c", "--json",
                  "--workers", "2", timeout=120)  # fmt: skip
    assert res.returncode == 3, res.stderr
    report = _json(res)
    assert report["encoded"] == 3 and report["files"] == 5
    failed = {f["path"]: f["reason"] for f in report["failed"]}
    assert "not a regular file (a FIFO)" in failed["x.wav"]
    assert "not valid UTF-8" in failed["t\\xe9.wav"]
    assert "internal error" not in res.stderr
    items = sqlite3.connect(tmp_path / "c" / "catalog.sqlite").execute(
        "SELECT COUNT(*) FROM root_items"
    )
    assert items.fetchone()[0] == 3  # one item per file, not one per path through the loop


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--sample-rate", "1000000000", "--sample-rate must be"),
        ("--max-seconds", "nan", "--max-seconds must be"),
        ("--max-seconds", "inf", "--max-seconds must be"),
        ("--max-seconds", "-1", "--max-seconds must be"),
        ("--device", "meta", "--device meta is not supported"),
        ("--batch-seconds", "nan", "--batch-seconds must be a positive, finite"),
        ("--batch-seconds", "inf", "--batch-seconds must be a positive, finite"),
        ("--shard-size", "0", "--shard-size must be positive"),
        ("--workers", "10000", "--workers 10000 is more than featbake starts"),
        ("--shard", "0/1000000000", "more than featbake splits a build into"),
        ("--batching", "x", "--batching must be"),
        ("--encoder", "", "--encoder is empty"),
    ],
)
def test_absurd_options_are_config_errors_before_any_work(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, option: str, value: str, needle: str
) -> None:
    res = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c",
                  option, value, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "internal error" not in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, res.stderr
    assert not (tmp_path / "c").exists() or _feature_count(tmp_path / "c") == 0
    assert "hash:" not in res.stderr  # refused before any input was read


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _build_pid(pid: int) -> int:
    """The process that runs the build: the command's supervised child (featbake/cli/supervise)."""
    (child,) = _children(pid)
    return child


@pytest.mark.slow
def test_a_decode_worker_killed_ends_the_build_with_one_clear_line(tmp_path: Path) -> None:
    """What the OOM killer does to a worker that decodes a huge clip: SIGKILL."""
    data = tmp_path / "audio"
    write_audio_folder(data, 60, seconds=0.3, seed=32)
    cache = tmp_path / "c"
    calls = tmp_path / "calls.log"
    env = _env(tmp_path, SLOW_SLEEP="0.05", SLOW_LOG=str(calls))
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", cache, "--batch-size", "1"]
    args += ["--workers", "2"]
    proc = _popen(args, env, tmp_path / "build.log")
    try:
        _wait_for(lambda: (calls.exists() and calls.read_text().strip()) or proc.poll() is not None)
        workers = _children(_build_pid(proc.pid))
        assert workers, "the build runs no decode worker"
        os.kill(workers[0], signal.SIGKILL)
        proc.wait(60)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout_file.close()  # type: ignore[attr-defined]
    output = (tmp_path / "build.log").read_text()
    assert proc.returncode == 8, output
    assert "a decode worker died" in output and "--workers" in output
    assert "Traceback" not in output and "internal error" not in output


@pytest.mark.slow
def test_a_file_size_limit_with_decode_workers_does_not_hang(tmp_path: Path) -> None:
    """`ulimit -f` (or a full /dev/shm): decoded clips must not need files to reach the encoder."""
    import resource

    data = tmp_path / "audio"
    # 150 s at 8 kHz: 2.4 MB on disk, 9.6 MB decoded at 16 kHz (over the limit below), 3.8 MB of
    # features; the limit leaves the catalog (and its WAL) room to work.
    write_audio_folder(data, 4, seconds=150.0, sample_rate=8000, seed=33)
    limit = 8 * 1024 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**_env(tmp_path), "COLUMNS": "200"}
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", tmp_path / "c", "--json"]
    args += ["--workers", "2", "--batch-size", "1", "--shard-size", "64KiB"]
    res = subprocess.run(
        [sys.executable, "-m", "featbake", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,  # before: hung forever
        preexec_fn=small_files,
    )
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stderr
    assert _json(res)["encoded"] == 4


def test_names_and_errors_print_literally_without_emoji(tmp_path: Path, encoder_file: Path) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 2, seconds=0.3, seed=34)
    (data / ":x: take1.wav").write_bytes(b"RIFF not audio")
    res = invoke("build", "-e", encoder_file, "-d", data, "--cache", tmp_path / "c")
    assert res.returncode == 3
    assert ":x: take1.wav" in res.stderr and "\u274c" not in res.stderr
    res = invoke("build", "-e", "nopkg_xyz:factory:", "-d", data, "--cache", tmp_path / "c")
    assert res.returncode == 4
    assert "nopkg_xyz:factory:" in res.stderr and "\U0001f3ed" not in res.stderr


def test_encoder_files_and_modules_that_misbehave_get_their_own_line(
    tmp_path: Path, audio_dir: Path
) -> None:
    # Junk, and junk whose first bytes read as a pickle of protocol 229 (one random file in 256
    # starts so: torch then warned "Detected pickle protocol 229 ... weights_only" on a line of
    # its own before featbake's).
    junk = tmp_path / "model.pt"
    for head in (b"", b"\x80\xe5"):
        junk.write_bytes(head + random.Random(7).randbytes(4096))
        res = run_cli("build", "-e", junk, "-d", audio_dir, "--cache", tmp_path / "c")
        assert res.returncode == 4
        said = res.stderr.strip()
        assert "is not a TorchScript (.pt)" in said and "weights_only" not in said, said
        assert len(said.splitlines()) == 1, said
    env = _env(tmp_path)
    (tmp_path / "pkgs" / "quits.py").write_text("import sys\ndef build():\n    sys.exit(3)\n")
    res = invoke("build", "-e", "quits:build", "-d", audio_dir, "--cache", tmp_path / "c",
                 env={"PYTHONPATH": env["PYTHONPATH"]})  # fmt: skip
    assert res.returncode == 4 and "quits:build() called sys.exit(3)" in res.stderr


def test_non_finite_features_exit_3_unless_allowed(tmp_path: Path, audio_dir: Path) -> None:
    env = _env(tmp_path)
    (tmp_path / "pkgs" / "nan_enc.py").write_text(
        "from featbake.testing import TinyConvEncoder\n"
        "class Nan(TinyConvEncoder):\n"
        "    def forward(self, wav):\n"
        "        return super().forward(wav) * float('nan')\n"
        "def build():\n"
        "    return Nan()\n"
    )
    args = ["build", "-e", "nan_enc:build", "-d", audio_dir, "--cache", tmp_path / "c", "--json"]
    res = invoke(*args, env={"PYTHONPATH": env["PYTHONPATH"]})
    assert res.returncode == 3
    report = _json(res)
    assert report["encoded"] == 0 and len(report["failed"]) == 16
    assert _feature_count(tmp_path / "c") == 0
    res = invoke(*args, "--allow-nonfinite", env={"PYTHONPATH": env["PYTHONPATH"]})
    assert res.returncode == 0 and _json(res)["encoded"] == 16


def test_export_to_a_path_that_cannot_be_created_is_one_line(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "c"
    assert invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", cache).returncode == 0
    (tmp_path / "afile").write_text("x")
    res = invoke("export", tmp_path / "afile" / "feats.zarr", "--cache", cache)
    assert res.returncode == 2, res.stderr  # refused before anything is written
    assert "of OUT is not a folder" in res.stderr and "internal error" not in res.stderr


def test_roots_verify_and_gc_do_not_hard_wrap_off_a_terminal(
    tmp_path: Path, encoder_file: Path
) -> None:
    data = tmp_path / ("a_rather_long_folder_name_for_the_clips_" * 3) / "audio"
    write_audio_folder(data, 2, seconds=0.3, seed=35)
    cache = tmp_path / "c"
    assert invoke("build", "-e", encoder_file, "-d", data, "--cache", cache).returncode == 0
    shard = next((cache / "shards").rglob("*.safetensors"))
    with open(shard, "r+b") as f:  # damage a data byte: verify names the shard's path
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    env = {"COLUMNS": ""}  # as from cron or a pipe: rich would assume 80 columns
    roots = invoke("roots", "--cache", cache, env=env)
    assert str(data) in roots.stdout, roots.stdout
    res = invoke("verify", "--cache", cache, env=env)
    assert res.returncode == 11
    assert any(shard.name in line for line in res.stdout.splitlines()), res.stdout
    assert all(len(line) <= 80 or shard.name in line or str(data) in line
               for line in res.stdout.splitlines())  # fmt: skip
    time.sleep(1.1)  # the root was built (and used) over a second ago
    gc = invoke("gc", "--cache", cache, "--older-than", "1s", "--dry-run", env=env)
    assert gc.returncode == 0, gc.stderr
    assert any(str(data) in line for line in gc.stdout.splitlines()), gc.stdout


def _keys_of_shard(path: Path) -> set[str]:
    from featbake.store.shard import ShardReader

    with ShardReader(path) as r:
        return {name.partition("/")[0] for name in r.tensors}


def test_a_shard_deleted_by_hand_is_encoded_again_by_the_next_build(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Issue 11, item 9 (build half): before, the rebuild said "encoded 0, reused 16" and the
    features of the lost shard stayed lost (rows naming a file that is gone)."""
    from featbake.serve.dataset import CachedFeatureDataset

    cache = tmp_path / "c"
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", cache, "--json"]
    first = _json(invoke(*args, "--shard-size", "60KB"))
    assert first["encoded"] == 16
    shards = sorted((cache / "shards").glob("*/*.safetensors"))
    lost = _keys_of_shard(shards[0]) | _keys_of_shard(shards[-1])
    assert 2 <= len(lost) < 16
    shards[0].unlink()
    shards[-1].unlink()
    # A new input too: the re-encoded features then seal into a shard of new content, and the
    # rows that named the lost shards must point at it (not "first row wins" to a lost file).
    write_audio_folder(audio_dir / "new", 1, seconds=0.5, seed=91)
    again = invoke(*args)
    assert again.returncode == 0, again.stderr
    report = _json(again)
    assert (report["encoded"], report["reused"]) == (len(lost) + 1, 16 - len(lost))
    assert _json(invoke(*args))["encoded"] == 0
    check = invoke("verify", "--cache", cache)
    assert check.returncode == 0, check.stdout
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=cache, on_miss="error")
    assert len(ds) == 17
    for i in range(len(ds)):
        torch.testing.assert_close(
            ds[i], live_features(encoder_file, Path(ds.path(i))), rtol=1e-5, atol=1e-6
        )


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_one_mib_dev_shm_with_decode_workers_does_not_hang(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Issue 11, item 6: Docker's small /dev/shm (here 1 MiB, in a private mount namespace),
    with clips that decode to 1.9 MB each: workers used to fail writing torch's shared-memory
    files and the build hung forever."""
    data = tmp_path / "audio"
    write_audio_folder(data, 4, seconds=30.0, seed=36)
    cache = tmp_path / "c"
    build = (
        f"{sys.executable} -m featbake build -e {encoder_file} -d {data} --cache {cache} "
        "--workers 2 --batch-size 2 --json"
    )
    shell = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && {build}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    res = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True,
                         env=env, timeout=120, check=False)  # fmt: skip
    assert "Traceback" not in res.stderr and "No space left" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stderr
    report = _json(res)
    assert report["encoded"] == 4
    for rel, parts in stored_features(cache, report["root"]).items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, data / rel))


FAILING_ENCODERS = {
    # Issue 11, item 13: a TorchScript `raise` and a KeyError from an import-path module on the
    # long clips; item 5: a complex output (used to be cast silently to its real part).
    "torchscript-raise": None,
    "import-path-keyerror": (
        "from featbake.testing import TinyConvEncoder\n"
        "class KeyErrorOnLong(TinyConvEncoder):\n"
        "    def forward(self, wav):\n"
        "        if wav.shape[1] > 16000:\n"
        "            raise KeyError('speaker')\n"
        "        return super().forward(wav)\n"
        "def build():\n"
        "    return KeyErrorOnLong()\n"
    ),
    "complex-output": (
        "import torch\n"
        "from featbake.testing import TinyConvEncoder\n"
        "class ComplexOnLong(TinyConvEncoder):\n"
        "    def forward(self, wav):\n"
        "        out = super().forward(wav)\n"
        "        return out * (1 + 1j) if wav.shape[1] > 16000 else out\n"
        "def build():\n"
        "    return ComplexOnLong()\n"
    ),
}
NEEDLES = {
    "torchscript-raise": "clip longer than a second",
    "import-path-keyerror": "KeyError: 'speaker'",
    "complex-output": "complex output",
}


class _RaisesOnLong(torch.nn.Module):
    """TinyConvEncoder(seed=0) that raises on clips over a second (a TorchScript ``raise``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyConvEncoder()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.shape[1] > 16000:
            raise ValueError("clip longer than a second")
        return self.inner(wav)


@pytest.mark.parametrize("kind", list(FAILING_ENCODERS))
def test_an_encoder_failing_on_some_inputs_skips_them_and_exits_3(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, kind: str
) -> None:
    """Before: the first failing batch aborted the whole build with "internal error"."""
    from featbake.testing import save_torchscript

    env = _env(tmp_path)
    if kind == "torchscript-raise":
        encoder = str(save_torchscript(_RaisesOnLong(), tmp_path / "raises.pt"))
    else:
        (tmp_path / "pkgs" / "failing_enc.py").write_text(FAILING_ENCODERS[kind] or "")
        encoder = "failing_enc:build"
    long = {
        str(p.relative_to(audio_dir))
        for p in audio_dir.rglob("*.wav")
        if AudioSource(Recipe()).load(p).shape[0] > 16000
    }
    assert 0 < len(long) < 16
    res = invoke("build", "-e", encoder, "-d", audio_dir, "--cache", tmp_path / "c", "--json",
                  "--batch-size", "4", env={"PYTHONPATH": env["PYTHONPATH"]})  # fmt: skip
    assert res.returncode == 3, res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    report = _json(res)
    assert {f["path"] for f in report["failed"]} == long
    assert all(NEEDLES[kind] in f["reason"] for f in report["failed"]), report["failed"]
    assert "The following operation failed" not in res.stdout + res.stderr
    stored = stored_features(tmp_path / "c", report["root"])
    assert set(stored) == {str(p.relative_to(audio_dir)) for p in audio_dir.rglob("*.wav")} - long
    for rel, parts in stored.items():
        torch.testing.assert_close(parts[""], live_features(encoder_file, audio_dir / rel),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(("where", "status"), [("encoder", "7"), ("factory", "0")])
def test_an_encoder_that_ends_the_process_is_reported_with_its_own_code(
    tmp_path: Path, audio_dir: Path, where: str, status: str
) -> None:
    """os._exit(7) in forward used to end the build with 7, the code of a cache miss, silently."""
    env = _env(tmp_path)
    body = "os._exit(int(os.environ['EXIT_WITH']))"
    (tmp_path / "pkgs" / "exits.py").write_text(
        "import os\nfrom featbake.testing import TinyConvEncoder\n"
        "class E(TinyConvEncoder):\n"
        f"    def forward(self, wav):\n        {body}\n"
        f"def make():\n    {body if where == 'factory' else 'pass'}\n    return E()\n"
    )
    res = run_cli("build", "-e", "exits:make", "-d", audio_dir, "--cache", tmp_path / "c",
                  env={"PYTHONPATH": env["PYTHONPATH"], "EXIT_WITH": status})  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("hash")]
    assert res.returncode == 9, res.stderr
    assert len(lines) == 1 and "ended abruptly" in lines[0], res.stderr
    assert f"exit status was {status}" in lines[0] and "rerun to continue" in lines[0]


def test_a_build_killed_by_a_signal_is_reported_and_one_forwarded_is_not(
    tmp_path: Path, audio_dir: Path
) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 30, seconds=0.3, seed=35)
    env = _env(tmp_path, SLOW_SLEEP="0.1", SLOW_LOG=str(tmp_path / "calls.log"))
    args = ["build", "-e", "slow_enc:build", "-d", data, "--cache", tmp_path / "c"]
    args += ["--workers", "0", "--batch-size", "1"]
    proc = _popen(args, env, tmp_path / "build.log")
    try:
        _wait_for(lambda: (tmp_path / "calls.log").exists() or proc.poll() is not None)
        os.kill(_build_pid(proc.pid), signal.SIGKILL)  # what the OOM killer does
        proc.wait(60)
    finally:
        proc.stdout_file.close()  # type: ignore[attr-defined]
    output = (tmp_path / "build.log").read_text()
    assert proc.returncode == 9, output
    assert "ended abruptly" in output and "killed by SIGKILL" in output
    assert "Traceback" not in output, output
    assert len([ln for ln in output.splitlines() if ln.startswith("error:")]) == 1, output


# == test_cli_messages =============================================================================
# What the CLI says before any work (issue 32 items 9 and 14): a missing encoder is named
# before the data is looked at, and each command's help lists only the exit codes it exits with.


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


#: Mistakes a build checks before its encoder, each with the one line it gives.
CHECKED_BEFORE_THE_ENCODER = {
    "--batching x": "--batching must be auto, padded or exact",
    "--layers x": "--layers takes whole numbers",
    "--crop 3": "image options (--crop) apply to image inputs",
    "--image-mode L": "image options (--image-mode) apply",  # the option, not the field's
    "--max-tokens 3": "text options (--max-tokens",
    "--engine y": "--engine must be local or ray",
    "--views hflip --workers -1": "--views hflip applies to image inputs",
    "--workers -1 --threads 999": "--workers must be 0 or more",
    "--shard-size 0": "--shard-size must be positive",
    "--seal-every 0": "--seal-every must be a positive",
}


def test_a_missing_encoder_is_named_without_torch_after_the_checks_that_come_first(
    tmp_path: Path, encoder_file: Path
) -> None:
    """`featbake build --encoder missing.pt` imported torch and the build's modules (seconds of
    CPU) before saying the encoder is missing. The checks a build makes before the encoder's
    now need no torch and run first, in their order: a command with two mistakes names the
    same one for a missing encoder as for one that is there."""
    clips = tmp_path / "clips"
    write_audio_folder(clips, 1)
    missing = tmp_path / "missing.pt"
    args = ["build", "--encoder", str(missing), "--data", str(clips), "--cache",
            str(tmp_path / "c")]  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", COMMAND_THEN_MODULES, *args],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
                         timeout=120)  # fmt: skip
    assert ran.returncode == 4, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"encoder {missing} not found" in lines[0], lines
    assert ran.stdout.strip() == "imported: []", ran.stdout
    for options, said in CHECKED_BEFORE_THE_ENCODER.items():
        for encoder in (missing, encoder_file):
            res = invoke(*args[:2], encoder, *args[3:], *options.split())
            assert res.returncode == 2, (options, encoder, res.stderr)
            lines = [line for line in res.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and said in lines[0], (options, encoder, lines)
    assert not (tmp_path / "c").exists()


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


# == test_cli_summary ==============================================================================
# Issue 32 item 15: what a build prints off a terminal, and what its watching process loads.
#
# Summary lines used to carry as many trailing spaces as the longest value was long (~150 behind
# a batching note): a rich ``Table`` pads every cell. And the process that only watches the build
# imported typer, rich and every command before starting the child that imports them again.


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
    store = tmp_path / "store"
    args = ["build", "-e", str(encoder_file), "-d", str(audio_dir), "--cache", str(store)]
    first = invoke(*args)  # the store the no-op rebuild below finds
    assert first.returncode == 0, first.stderr
    # The environment variable reaches every Python the command starts (-X importtime does not).
    res = subprocess.run(
        [sys.executable, "-m", "featbake", *args],
        capture_output=True, text=True, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    summary = dict(line.split(maxsplit=1) for line in res.stdout.splitlines())
    assert (summary["encoded"], summary["reused"]) == ("0", "16")  # a no-op rebuild
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


# The command run as from the shell (its arguments from sys.argv), in this one process, with
# every full pass of the cyclic collector recorded, and whether start-up's objects were frozen
# by then (a pass before the freeze walks everything torch and the CLI imported).
GC_PROBE = """
import gc, json, runpy, sys
passes = []
gc.callbacks.append(
    lambda phase, info: phase == "stop" and info["generation"] == 2
    and passes.append(gc.get_freeze_count())
)
sys.argv = ["featbake", *sys.argv[1:]]
runpy.run_module("featbake", run_name="__main__")
seen = {"passes": passes, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
print("GC " + json.dumps(seen), file=sys.stderr)
"""


def test_a_noop_rebuilds_start_up_runs_no_full_collection(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Issue 31 item 4: importing typer, rich, pydantic, torch and featbake made the cyclic
    collector walk every object they made, three times in a no-op rebuild (~0.15-0.3 s of CPU
    on a busy node), finding nothing. Start-up now runs with the collector paused, and what it
    made is frozen before the build's own work, for which the collector runs again."""
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "c"]
    assert invoke(*args).returncode == 0  # the store the probed no-op rebuild finds
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_NO_SUPERVISOR": "1"}
    res = subprocess.run(
        [sys.executable, "-c", GC_PROBE, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "reused" in res.stdout
    seen = json.loads(res.stderr.split("GC ", 1)[1])
    assert seen["enabled"], "the collector was left paused"
    assert seen["frozen"] > 100_000  # torch's and the CLI's objects, out of the collector's way
    assert [frozen for frozen in seen["passes"] if frozen == 0] == [], seen["passes"]


def test_the_command_line_uses_no_private_module_of_typer_or_click() -> None:
    """Issue 42 item 5: the CLI wrapped typer's private ``_coercion`` and ``_param_types``
    modules (a typer release may change them at any time). Only public names are used now."""
    private: list[str] = []
    for path in sorted((REPO / "featbake").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            private += [
                f"{path.name}: {name}"
                for name in names
                if name.split(".")[0] in {"typer", "click"}
                and any(part.startswith("_") for part in name.split(".")[1:])
            ]
    assert private == []


# The command line as from the shell, with the node's load read from a file the test writes, and
# an import-path encoder that records the OpenMP wait policy in its process's environment.
WAIT_RUN = """
import sys
from pathlib import Path

import featbake.cpu_share as share

share.LOADAVG = Path(sys.argv[1])
sys.argv = ["featbake", *sys.argv[2:]]
from featbake.cli import main

main()
"""
WAIT_PROBE = """
import os
from featbake.testing import TinyConvEncoder


class WaitProbe(TinyConvEncoder):
    def forward(self, wav):
        with open(os.environ["WAIT_LOG"], "a") as log:
            log.write(os.environ.get("OMP_WAIT_POLICY", "-") + "\\n")
        return super().forward(wav)


def make():
    return WaitProbe()
"""


@pytest.mark.parametrize(
    ("load_per_cpu", "users", "seen"),
    [
        (4.0, {}, "PASSIVE"),
        (0.0, {}, "-"),
        (4.0, {"OMP_WAIT_POLICY": "active"}, "active"),
        (4.0, {"GOMP_SPINCOUNT": "10000"}, "-"),
    ],
)
def test_the_build_child_lets_openmp_threads_sleep_on_a_busy_node_unless_the_user_chose(
    tmp_path: Path, audio_dir: Path, load_per_cpu: float, users: dict[str, str], seen: str
) -> None:
    """Issue 42 item 4: on a node with no CPU to spare, torch's OpenMP threads spinning at their
    barriers took the CPU their team-mates needed (a conv encoder's build 16-219 s beside other
    work, 1.3-8.4 s with passive waiting). The watched child sets ``OMP_WAIT_POLICY=PASSIVE``
    before torch loads, only where the load average says the node is busy, and never over the
    user's own setting of how OpenMP threads wait."""
    (tmp_path / "wait_probe.py").write_text(WAIT_PROBE)
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"{load_per_cpu * (os.cpu_count() or 1):.2f} 0.00 0.00 1/100 4242\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    env["WAIT_LOG"] = str(tmp_path / "wait.log")
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "FEATBAKE_NO_SUPERVISOR"):
        env.pop(name, None)
    env.update(users)
    args = ["build", "-e", "wait_probe:make", "-d", audio_dir, "--cache", tmp_path / "c"]
    res = subprocess.run(
        [sys.executable, "-c", WAIT_RUN, str(loadavg), *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert set((tmp_path / "wait.log").read_text().split()) == {seen}
    summary = dict(line.split(maxsplit=1) for line in res.stdout.splitlines())
    assert summary["encoded"] == summary["files"] == "16"


def test_an_option_that_does_nothing_in_the_build_is_noted(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """``--max-error`` without int8/fp8 and ``--batch-seconds`` under exact batching were taken
    in silence: a user tuning them saw no effect and no word of why. One note each."""
    args = ["build", "-e", encoder_file, "-d", audio_dir, "--cache", tmp_path / "s"]
    r = invoke(*args, "--max-error", "0.01", "--batching", "exact", "--batch-seconds", "10")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 2 and "--max-error" in notes[0] and "--batch-seconds" in notes[1], notes
    r = invoke(*args, "--dtype", "int8", "--max-error", "0.01")
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


class _FailsByParity(torch.nn.Module):
    """An encoder that fails on every input, in words that differ by the input's length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2 == 0:
            raise RuntimeError("this encoder takes no even length")
        raise RuntimeError("this encoder takes no odd length either")


def test_every_input_failing_in_the_encoder_in_other_words_still_points_at_it(
    tmp_path: Path,
) -> None:
    """Every input failed in the encoder, but in words that differ by more than numbers (an
    output of another shape for some lengths): the build told the user to fix or remove the
    inputs. It points at the encoder, naming the first failure."""
    import soundfile as sf

    data = tmp_path / "audio"
    data.mkdir()
    for i, n in enumerate([16000, 16001, 16002]):
        sf.write(data / f"c{i}.wav", torch.zeros(n).numpy(), 16000)
    encoder = tmp_path / "fails.pt"
    torch.jit.script(_FailsByParity()).save(str(encoder))
    res = invoke("build", "-e", encoder, "-d", data, "--cache", tmp_path / "c")
    assert res.returncode == 3, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: every input (3) failed, each in the encoder (the first: "), last
    assert "not at the inputs" in last and "Fix or remove them" not in res.stderr
