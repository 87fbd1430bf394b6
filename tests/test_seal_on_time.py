"""Issue 32 item 1: shards are sealed on time as well as on size, so SIGKILL keeps what was
encoded up to ``--seal-every`` ago. With the default 256 MiB shard size nothing used to be
sealed before the end of a build: a build killed after 51 s of encoding reran from zero."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from featbake.bake.threads import WriterThread
from featbake.encode.sources import AudioSource
from featbake.errors import ConfigError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import Layout
from featbake.store.shard import ShardWriter
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.conftest import encoded_rows, invoke, run_cli
from tests.helpers import assert_store_consistent

EFP, RFP = "e" * 64, "r" * 64


def test_the_writer_thread_seals_a_small_shard_once_it_waited_seal_seconds(
    tmp_path: Path,
) -> None:
    layout = Layout(tmp_path / "store").ensure()
    writer = WriterThread(layout, EFP, RFP, shard_bytes=1 << 30, seal_seconds=0.2)
    try:
        writer.put("a" * 64, {"": torch.ones(4, 8)})
        writer.put("b" * 64, {"": torch.zeros(4, 8)})
        assert writer.bytes_pending > 0 and writer.bytes_written == 0
        deadline = time.monotonic() + 20
        # Nothing more is put: the thread seals on its own, far below the 1 GiB shard size.
        while writer.shards == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.shards == 1 and writer.new_rows == 2
    finally:
        writer.close()
    assert writer.shards == 1  # close had nothing left to seal


def test_shard_writer_seal_seconds_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--seal-every must be positive"):
        ShardWriter(Layout(tmp_path), EFP, RFP, seal_seconds=0)
    bad = invoke("build", "-e", "x:y", "-d", tmp_path, "--seal-every", "nan")
    assert bad.returncode != 0 and "--seal-every" in bad.stderr


def _sealed(cache: Path) -> tuple[int, int]:
    """(feature rows, shards) in the catalog: what a SIGKILL cannot take back."""
    if not (cache / "catalog.sqlite").exists():
        return 0, 0
    conn = sqlite3.connect(cache / "catalog.sqlite", timeout=30)
    try:
        rows = conn.execute("SELECT COUNT(*) FROM features").fetchone()[0]
        shards = conn.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
        return rows, shards
    except sqlite3.OperationalError:
        return 0, 0  # schema not created yet
    finally:
        conn.close()


@pytest.mark.slow
def test_sigkill_keeps_what_was_sealed_on_time_and_the_rerun_encodes_only_the_rest(
    tmp_path: Path, counting_encoder: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "audio"
    n = 40
    write_audio_folder(data, n, seconds=0.3, seed=61)
    cache = tmp_path / "c"
    # The default shard size (256 MiB): only sealing on time seals anything before the end.
    args = ["build", "-e", "countenc:build", "-d", data, "--cache", cache]
    args += ["--batch-size", "1", "--workers", "0", "--seal-every", "0.5"]
    env = {**os.environ, **counting_encoder, "COUNT_DELAY": "0.1", "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featbake", *map(str, args)], stdout=log, stderr=log, env=env
        )
        deadline = time.monotonic() + 120
        while _sealed(cache)[1] < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # what preemption and the OOM killer send
        proc.wait(60)
    assert proc.returncode != 0, (tmp_path / "first.log").read_text()  # killed, not finished
    sealed, shards = _sealed(cache)
    first_run = len(encoded_rows(counting_encoder))
    assert shards >= 3 and 0 < sealed < n <= first_run + n - sealed
    rerun = run_cli(*args, "--json", env={**counting_encoder})
    assert rerun.returncode == 0, rerun.stderr
    assert f'"reused": {sealed}' in rerun.stdout and f'"encoded": {n - sealed}' in rerun.stdout
    # The encoder ran on exactly what was not sealed: what a kill kept is not encoded again.
    assert len(encoded_rows(counting_encoder)) - first_run == n - sealed
    assert_store_consistent(cache)
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[-1])
    ds = CachedFeatureDataset(data, "countenc:build", cache=cache, on_miss="error")
    src, enc = AudioSource(Recipe()), TinyConvEncoder().eval()
    assert len(ds) == n
    for i in range(n):
        with torch.no_grad():
            live = enc(src.load(Path(ds.path(i))).unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], live, rtol=1e-5, atol=1e-6)
