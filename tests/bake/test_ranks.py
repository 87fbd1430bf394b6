"""Builds split across ranks: the pure partition and rank logic, and real multi-process builds.

The multi-process tests run real processes (`torchrun --nproc-per-node 2` with the gloo
backend, or two `featbake build --shard i/2` commands) with an import-path encoder that logs
every input it encodes, so "each distinct input exactly once across ranks" is counted, not
assumed. Stored features are checked against the encoder run now.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import finish_part
from featbake.bake.ranks import (
    MAX_PARTS,
    BuildView,
    RankSource,
    RankSpec,
    check_views_agree,
    device_for_rank,
    inputs_only_on,
    my_part,
    owned_by_lower_ranks,
    parse_shard,
    partition,
    rank_from_env,
    resolve_rank,
)
from featbake.encode.sources import source_for
from featbake.errors import ConfigError, RanksDisagree, StoreError
from featbake.recipe import Recipe
from featbake.store.catalog import Catalog
from featbake.store.fragments import FragmentKind, fragment_keys, sealed_fragments
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.conftest import REPO, encoded_rows, invoke, live_features
from tests.helpers import assert_store_consistent, stored_features

ENCODER = "countenc:build"


# -- the pure part ---------------------------------------------------------------------------
def test_parse_shard() -> None:
    assert parse_shard("0/4") == RankSpec(0, 4, 0, RankSource.FLAG)
    assert parse_shard(" 3/4 ").rank == 3
    for bad in ("4/4", "1", "a/2", "-1/2", "1/0", "1/2/3", ""):
        with pytest.raises(ConfigError):
            parse_shard(bad)


def test_rank_from_torchrun_and_slurm_environments() -> None:
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert rank_from_env(torchrun) == RankSpec(5, 8, 1, RankSource.TORCHRUN)
    # An array submitted as --array=1-7:2 has tasks 1, 3, 5, 7: task 5 is part 2 (0-based).
    array = {
        "SLURM_ARRAY_TASK_ID": "5",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "1",
        "SLURM_ARRAY_TASK_STEP": "2",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert rank_from_env(array) == RankSpec(2, 4, 0, RankSource.SLURM_ARRAY)
    tasks = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}
    assert rank_from_env(tasks) == RankSpec(3, 4, 3, RankSource.SLURM_TASKS)
    # torchrun inside a SLURM allocation: torchrun's variables win.
    assert rank_from_env({**tasks, **torchrun}).source is RankSource.TORCHRUN
    # A plain one-task SLURM job, or nothing at all: one process does everything.
    assert rank_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == RankSpec()
    assert rank_from_env({}) == RankSpec()
    # --shard wins over the environment.
    assert resolve_rank("1/2", torchrun) == RankSpec(1, 2, 0, RankSource.FLAG)
    with pytest.raises(ConfigError, match="RANK"):
        rank_from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError):
        rank_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="grid"):
        rank_from_env({**array, "SLURM_ARRAY_TASK_ID": "4"})


def test_cuda_means_the_local_rank_under_torchrun_only() -> None:
    torchrun = RankSpec(5, 8, 1, RankSource.TORCHRUN)
    assert device_for_rank("cuda", torchrun) == "cuda:1"
    assert device_for_rank("cuda:0", torchrun) == "cuda:0"
    assert device_for_rank("cpu", torchrun) == "cpu"
    assert device_for_rank("cuda", RankSpec(3, 4, 0, RankSource.SLURM_ARRAY)) == "cuda"
    assert device_for_rank("cuda", RankSpec()) == "cuda"


@pytest.mark.parametrize("seed", range(20))
def test_partition_against_a_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    n, world = rng.randint(0, 300), rng.randint(1, 9)
    sizes = [rng.choice([0, 1, 10, 1000, 10**6]) + rng.randint(0, 500) for _ in range(n)]
    parts = partition(sizes, world)
    assert len(parts) == world
    # Every input in exactly one part: no padding, no duplicates, nothing lost.
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(sizes[i] for i in p) for p in parts]
    if n:
        assert max(loads) <= sum(sizes) / world + max(sizes)
    assert partition(sizes, world) == parts  # deterministic: every rank computes the same
    assert [my_part(sizes, RankSpec(r, world)) for r in range(world)] == parts


@pytest.mark.parametrize("seed", range(10))
def test_more_parts_than_inputs_agree_with_the_full_partition(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(0, 12)
    sizes = [rng.choice([0, 5, 10**6]) for _ in range(n)]
    world = n + rng.randint(1, 20)
    parts = partition(sizes, world)
    assert [my_part(sizes, RankSpec(r, world)) for r in range(world)] == parts


def test_a_huge_part_count_is_refused_and_never_sized_by() -> None:
    """--shard 0/1000000000 used to build a heap of a billion ranks: memory in proportion to N."""
    with pytest.raises(ConfigError, match="more than featbake splits a build into"):
        parse_shard("0/1000000000")
    with pytest.raises(ConfigError, match="more than featbake splits"):
        rank_from_env({"RANK": "0", "WORLD_SIZE": str(10**12)})
    start = time.perf_counter()
    assert my_part([7, 8, 9], RankSpec(MAX_PARTS - 1, MAX_PARTS)) == []
    assert my_part([7, 8, 9], RankSpec(1, MAX_PARTS)) == [1]
    assert time.perf_counter() - start < 0.05  # O(inputs), not O(parts)
    with pytest.raises(ConfigError, match="expected I/N"):
        parse_shard("0/\u00b2")  # a digit to str.isdigit, not to int()


def test_partition_balances_bytes_not_counts() -> None:
    # One large file and many small ones: an even split by count would give one rank 2x bytes.
    sizes = [600] + [100] * 6
    parts = partition(sizes, 2)
    assert [sum(sizes[i] for i in p) for p in parts] == [600, 600]
    assert parts == [[0], [1, 2, 3, 4, 5, 6]]


# -- real multi-process builds ---------------------------------------------------------------
@pytest.fixture
def many_clips(tmp_path: Path) -> Path:
    """Twenty distinct clips of varied length (no two files alike)."""
    root = tmp_path / "clips"
    write_audio_folder(root, 16, seconds=(0.2, 0.9), subdirs=2, seed=5)
    write_audio_folder(root / "fixed", 4, seconds=0.5, seed=6)
    return root


def live(path: Path) -> torch.Tensor:
    """The counting encoder's features computed now (it is TinyConvEncoder with seed 0)."""
    x = source_for(Recipe()).load(path)
    with torch.inference_mode():
        return TinyConvEncoder()(x.unsqueeze(0))[0]


def assert_serves_live(store: Path, data: Path) -> dict[str, torch.Tensor]:
    """The store's one root names every input, and each stored feature equals live encoding."""
    root = root_name(store)
    got = stored_features(store, root)
    files = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.wav"))
    assert sorted(got) == files
    for rel, parts in got.items():
        torch.testing.assert_close(parts[""], live(data / rel), rtol=1e-4, atol=1e-5)
    assert_store_consistent(store)
    return {rel: parts[""] for rel, parts in got.items()}


def root_name(store: Path) -> str:
    out = invoke("roots", "--json", "--cache", store)
    assert out.returncode == 0, out.stderr
    (root,) = json.loads(out.stdout)
    return root["name"]


def distinct_inputs(data: Path) -> int:
    return len(list(data.rglob("*.wav")))


def torchrun(*args: object, env: dict[str, str]) -> subprocess.CompletedProcess:
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    full = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [str(torchrun_bin), "--nproc-per-node", "2", "--standalone", "-m", "featbake"]
        + [str(a) for a in args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
        cwd=REPO,
    )


def test_torchrun_two_ranks_encode_each_input_once_and_equal_one_process(
    tmp_path: Path, many_clips: Path, counting_encoder: dict[str, str]
) -> None:
    store = tmp_path / "ranks"
    args = ("build", "-e", ENCODER, "-d", many_clips, "--cache", store, "--workers", "0")
    done = torchrun(*args, env=counting_encoder)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = Counter(encoded_rows(counting_encoder))
    assert len(calls) == distinct_inputs(many_clips)  # every input encoded ...
    assert set(calls.values()) == {1}  # ... exactly once across both ranks
    assert sealed_fragments(Layout(store)) == []  # rank 0 merged everything
    ranked = assert_serves_live(store, many_clips)

    single = tmp_path / "single"
    # One process, in this one (the ranks are the processes this test is about).
    one = invoke(*args[:-4], "--cache", single, "--workers", "0", env=counting_encoder)
    assert one.returncode == 0, one.stderr
    assert root_name(single) == root_name(store)
    alone = stored_features(single, root_name(single))
    assert sorted(alone) == sorted(ranked)
    for rel, feats in ranked.items():
        assert torch.equal(alone[rel][""], feats)

    before = len(encoded_rows(counting_encoder))
    again = torchrun(*args, env=counting_encoder)
    assert again.returncode == 0, again.stderr
    assert len(encoded_rows(counting_encoder)) == before  # a rerun encodes nothing


def test_two_shard_processes_and_a_merge_equal_one_process(
    tmp_path: Path, many_clips: Path, counting_encoder: dict[str, str]
) -> None:
    store = tmp_path / "store"
    args = ("build", "-e", ENCODER, "-d", many_clips, "--cache", store, "--workers", "0")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "featbake", *map(str, args), "--shard", f"{i}/2"],
            env={**os.environ, **counting_encoder},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert not (store / "catalog.sqlite").exists()  # ranks never write the shared catalog
    pending = invoke("roots", "--cache", store)  # no catalog yet: its build waits for the merge
    assert "2 of 2 ranks done" in pending.stdout and "run `featbake merge`" in pending.stdout
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0, merged.stderr
    assert "1 roots published" in merged.stdout
    calls = Counter(encoded_rows(counting_encoder))
    assert len(calls) == distinct_inputs(many_clips) and set(calls.values()) == {1}
    assert_serves_live(store, many_clips)

    # A rerun split another way (3 parts, and one process) still encodes nothing.
    for shard in ("0/3", "1/3", "2/3"):
        rerun = invoke(*args, "--shard", shard, env=counting_encoder)
        assert rerun.returncode == 0, rerun.stderr
    assert invoke("merge", "--cache", store).returncode == 0
    assert invoke(*args, env=counting_encoder).returncode == 0
    assert sum(calls.values()) == len(encoded_rows(counting_encoder))


def test_a_rank_killed_mid_run_then_rerun_completes_the_store(
    tmp_path: Path, counting_encoder: dict[str, str]
) -> None:
    data = tmp_path / "long"
    write_audio_folder(data, 44, seconds=(0.2, 0.4), seed=9)
    store = tmp_path / "store"
    layout = Layout(store)
    args = ["build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0"]
    args += ["--shard-size", "1KiB", "--batch-size", "1"]  # one shard per input
    env = {**os.environ, **counting_encoder, "COUNT_DELAY": "0.15"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "featbake", *map(str, args), "--shard", "0/2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(encoded_rows(counting_encoder)) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    frags = sealed_fragments(layout)
    assert frags and {f.kind for f in frags} == {FragmentKind.PART}  # killed before the end
    kept = fragment_keys([f.path for f in frags])
    first_run = len(encoded_rows(counting_encoder))
    # Every shard sealed is recorded as it is sealed (issue 16 item 4: it used to be every 16
    # shards or 60 s): only what was still in the writer's hands when SIGKILL came is lost.
    assert first_run - 2 <= len(kept) <= first_run < distinct_inputs(data)

    for shard in ("0/2", "1/2"):
        rerun = invoke(*args, "--shard", shard, env={**counting_encoder})
        assert rerun.returncode == 0, rerun.stderr
    rows = encoded_rows(counting_encoder)
    # The reruns encoded everything except what part 0's sealed fragments held.
    assert len(rows) == first_run + distinct_inputs(data) - len(kept)
    assert invoke("merge", "--cache", store).returncode == 0
    assert_serves_live(store, data)


@pytest.mark.parametrize("how", ["raise", "os._exit"])
def test_a_failing_torchrun_rank_says_which_rank_and_that_a_rerun_continues(
    tmp_path: Path, many_clips: Path, how: str
) -> None:
    """Before, the user saw torchrun's traceback and no featbake line naming the rank. Rank 0
    is slow, so it is still encoding when torchrun stops it with SIGTERM: it says it was
    stopped, and the one `error:` line is the failing rank's (CI once saw two `error:` lines)."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    fail = "raise SystemExit(5)" if how == "raise" else "os._exit(7)"
    (pkg / "rank_fails.py").write_text(
        "import os, time\nfrom featbake.testing import TinyConvEncoder\n"
        "class E(TinyConvEncoder):\n    def forward(self, wav):\n"
        f"        if os.environ['RANK'] == '1':\n            {fail}\n"
        "        time.sleep(0.3)\n"
        "        return super().forward(wav)\n"
        "def make():\n    return E()\n"
    )
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{pkg}"}
    args = ("build", "-e", "rank_fails:make", "-d", many_clips, "--cache", tmp_path / "s")
    res = torchrun(*args, "--workers", "0", env=env)
    assert res.returncode != 0
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(ours) == 1, res.stderr
    assert "rank 1 (part 2 of 2 (torchrun)) failed" in ours[0]
    assert "rerun the same command to continue" in ours[0]
    stopped = [ln for ln in res.stderr.splitlines() if ln.startswith("stopped:")]
    assert len(stopped) == 1, res.stderr
    assert "rank 0 (part 1 of 2 (torchrun)): stopped by SIGTERM" in stopped[0]


def test_identical_files_on_two_torchrun_ranks_are_encoded_once(
    tmp_path: Path, counting_encoder: dict[str, str]
) -> None:
    """Issue 16 item 7: content dedup held within a rank only. Every clip here has a twin
    under another folder, and the byte-balanced partition puts the twins on different ranks:
    each content must be encoded once across both ranks, and every file served equal to live."""
    import shutil

    data = tmp_path / "twins"
    write_audio_folder(data / "a", 6, seconds=(0.2, 0.6), seed=21)
    shutil.copytree(data / "a", data / "b")
    store = tmp_path / "store"
    args = ("build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0", "--json")
    done = torchrun(*args, env=counting_encoder)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = Counter(encoded_rows(counting_encoder))
    assert len(calls) == 6 and set(calls.values()) == {1}  # 12 files, 6 contents, once each
    served = assert_serves_live(store, data)
    assert len(served) == 12
    assert invoke("verify", "--cache", store).returncode == 0


def test_ranks_leave_a_key_to_the_lowest_rank_that_holds_it() -> None:
    keys = [["a", "b"], ["b", "c"], ["a", "c", "d"]]
    assert owned_by_lower_ranks(0, keys) == set()
    assert owned_by_lower_ranks(1, keys) == {"b"}
    assert owned_by_lower_ranks(2, keys) == {"a", "c"}
    encoded = [set(k) - owned_by_lower_ranks(r, keys) for r, k in enumerate(keys)]
    assert sorted(x for part in encoded for x in part) == ["a", "b", "c", "d"]  # each once


def test_merge_keeps_one_copy_of_content_two_concurrent_parts_both_encoded(
    tmp_path: Path, counting_encoder: dict[str, str]
) -> None:
    """Parts started one by one (``--shard``, SLURM arrays) cannot exchange keys: two running at
    once both encode a content they share. `featbake merge` then keeps one feature per key, and
    every file is served equal to live."""
    import shutil

    data = tmp_path / "twins"
    write_audio_folder(data / "a", 5, seconds=(0.2, 0.5), seed=23)
    shutil.copytree(data / "a", data / "b")
    store = tmp_path / "store"
    args = ["build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0"]
    # Neither part encodes past its first input (nor seals) before the other has planned its
    # work: each one's first encoder call waits for the other's (before, 1 s per call, 5 s).
    meeting = tmp_path / "meet"
    meeting.mkdir()
    env = {**os.environ, **counting_encoder, "COUNT_MEET": str(meeting), "COUNT_PARTIES": "2"}
    parts = [
        subprocess.Popen(
            [sys.executable, "-m", "featbake", *map(str, args), "--shard", f"{i}/2"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    for p in parts:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    calls = Counter(encoded_rows(counting_encoder))
    assert len(calls) == 5 and set(calls.values()) == {2}  # both parts encoded every content
    assert invoke("merge", "--cache", store).returncode == 0
    with Catalog(Layout(store), read_only=True) as cat:
        assert len({r.key for r in cat.all_feature_rows()}) == len(list(cat.all_feature_rows()))
        assert len(list(cat.all_feature_rows())) == 5
    assert len(assert_serves_live(store, data)) == 10
    assert invoke("verify", "--cache", store).returncode == 0


# -- parts left unfinished (round four item 9) -----------------------------------------------
def sealed_keys(store: Path) -> set[str]:
    """The keys the store's sealed fragments hold tensors of (what killed parts kept)."""
    return fragment_keys([f.path for f in sealed_fragments(Layout(store))])


def wait_for_sealed(store: Path, proc: subprocess.Popen, at_least: int) -> None:
    """Wait until the store's fragments hold ``at_least`` keys (polling the store's files)."""
    deadline = time.monotonic() + 120
    while len(sealed_keys(store)) < at_least:
        assert proc.poll() is None, "the build ended before it sealed enough to be killed"
        assert time.monotonic() < deadline, "the build sealed nothing in 120 s"
        time.sleep(0.02)


def verify_line(store: Path) -> tuple[int, str]:
    """``featbake verify``'s exit code and output."""
    res = invoke("verify", "--cache", store)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_shard_part_is_reused_by_a_one_process_rerun_merged_and_not_damage(
    tmp_path: Path, counting_encoder: dict[str, str], sig: signal.Signals
) -> None:
    """Before: a one-process rerun encoded all 20 again, `merge` did nothing, and `verify`
    called the store damaged (exit 11, "catalog missing") until `verify --repair`."""
    data = tmp_path / "clips"
    write_audio_folder(data, 20, seconds=(0.2, 0.4), seed=9)
    store = tmp_path / "store"
    args = ["build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0"]
    args += ["--batch-size", "1", "--seal-every", "0.05"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "featbake", *map(str, args), "--shard", "0/2"],
        env={**os.environ, **counting_encoder, "COUNT_DELAY": "0.1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_sealed(store, proc, 3)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) != 0  # stopped mid-build, not finished
    kept = sealed_keys(store)
    assert 3 <= len(kept) < distinct_inputs(data)

    # (c) verify before any merge: parts waiting, a note, not damage.
    code, said = verify_line(store)
    assert code == 0, said
    assert "parts-waiting" in said and "run `featbake merge` or rerun the build" in said
    assert "damaged" not in said

    # (a) one process reuses what the part sealed and encodes only the rest.
    before = len(encoded_rows(counting_encoder))
    rerun = invoke(*args, "--json", env=counting_encoder)
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert report["reused"] == len(kept)
    assert report["encoded"] == distinct_inputs(data) - len(kept)
    assert len(encoded_rows(counting_encoder)) - before == distinct_inputs(data) - len(kept)

    # (b) merge retires the unfinished build; verify is clean, with nothing waiting.
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0, merged.stderr
    assert "retired" in merged.stdout
    assert sealed_fragments(Layout(store)) == []
    code, said = verify_line(store)
    assert code == 0 and "verify: clean" in said and "parts-waiting" not in said, said
    assert_serves_live(store, data)


def test_a_sigtermd_torchrun_build_is_reused_by_a_rerun_in_another_number_of_parts(
    tmp_path: Path, counting_encoder: dict[str, str]
) -> None:
    """torchrun stopped with SIGTERM (a preempted job): each rank seals what it encoded. A
    rerun in three `--shard` parts reuses every sealed shard (before, only a rerun with the
    same number of parts did), and the merge publishes the root and retires the old build."""
    data = tmp_path / "clips"
    write_audio_folder(data, 24, seconds=(0.2, 0.4), seed=10)
    store = tmp_path / "store"
    args = ["build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0"]
    args += ["--batch-size", "1", "--seal-every", "0.05"]
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **counting_encoder}
    launcher = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*launcher, "--standalone", "-m", "featbake", *map(str, args)],
        env={**env, "COUNT_DELAY": "0.1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    wait_for_sealed(store, proc, 4)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    kept = sealed_keys(store)
    assert 4 <= len(kept) < distinct_inputs(data)
    code, said = verify_line(store)
    assert code == 0 and "parts-waiting" in said and "damaged" not in said, said

    before = len(encoded_rows(counting_encoder))
    reused = 0
    for shard in ("0/3", "1/3", "2/3"):
        part = invoke(*args, "--shard", shard, "--json", env=counting_encoder)
        assert part.returncode == 0, part.stderr
        reused += json.loads(part.stdout)["reused"]
    assert reused == len(kept)
    assert len(encoded_rows(counting_encoder)) - before == distinct_inputs(data) - len(kept)
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0 and "1 roots published" in merged.stdout, merged.stderr
    assert sealed_fragments(Layout(store)) == []
    code, said = verify_line(store)
    assert code == 0 and "verify: clean" in said and "parts-waiting" not in said, said
    assert_serves_live(store, data)


# A build in parts recorded none of the inputs it could not decode (each part sees only its
# own failures, and a part's catalog kept none), so a dataset counted a corrupt input as an item
# and failed on it (on_miss="error") or tried to encode it live. Each part's ``done`` fragment
# now carries them, and the merge records their union beside the root.
def assert_leaves_out_the_broken_input(
    data: Path, encoder: Path, store: Path | str, broken: str, **kw: object
) -> None:
    """A dataset on ``store`` leaves ``broken`` out with one warning naming it, and serves
    every other input (none a miss) equal to the encoder run now."""
    with pytest.warns(UserWarning) as caught:
        ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error", **kw)
    said = [str(w.message) for w in caught if "could not be decoded" in str(w.message)]
    assert len(said) == 1 and "1 input(s)" in said[0] and broken in said[0], said
    ids = [ds.item_id(i) for i in range(len(ds))]
    assert broken not in ids and len(ids) == distinct_inputs(data) - 1
    for i in range(len(ds)):
        want = live_features(encoder, Path(ds.path(i)))
        torch.testing.assert_close(ds[i], want, rtol=1e-4, atol=1e-5)


def test_shard_parts_record_an_undecodable_input_and_the_dataset_leaves_it_out(
    tmp_path: Path, many_clips: Path, encoder_file: Path
) -> None:
    (many_clips / "part1" / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    store = tmp_path / "store"
    args = ("build", "-e", encoder_file, "-d", many_clips, "--cache", store, "--workers", "0")
    codes = [invoke(*args, "--shard", f"{i}/2").returncode for i in range(2)]
    assert sorted(codes) == [0, 3], codes  # the part holding the broken input says so
    merged = invoke("merge", "--cache", store)
    assert merged.returncode == 0, merged.stderr
    assert_leaves_out_the_broken_input(many_clips, encoder_file, store, "part1/broken.wav")


def test_torchrun_ranks_record_an_undecodable_input_and_the_dataset_leaves_it_out(
    tmp_path: Path, many_clips: Path, encoder_file: Path
) -> None:
    (many_clips / "part0" / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    store = tmp_path / "store"
    args = ("build", "-e", encoder_file, "-d", many_clips, "--cache", store, "--workers", "0")
    done = torchrun(*args, env={"PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and sealed_fragments(Layout(store)) == [], done.stderr
    assert_leaves_out_the_broken_input(many_clips, encoder_file, store, "part0/broken.wav")


# -- ranks that do not see the same build ----------------------------------------------------
# Each rank computes the build's id from the root, encoder, recipe and listing it sees. Ranks
# that saw another encoder, recipe or listing each sealed a build of their own that never
# completed: torchrun exited 0, rank 0 said "merged", and no root was published.
LAUNCHER = """
import json, os, shutil, sys, time
import featbake.bake.pipeline as pipeline
from featbake.cli.main import main

rank, case = os.environ["RANK"], os.environ.get("DISAGREE", "")
if case == "encoder" and rank == "1":
    sys.path.insert(0, os.environ["NODE1"])  # this node's copy of the encoder's module
if case == "inputs":  # a clip lands in the data folder after rank 0's scan, before rank 1's
    scan, landed = pipeline.scanned_inputs, os.path.join(os.environ["DATA"], "zz_late.wav")

    def scanned_inputs(*args, **kwargs):
        deadline = time.monotonic() + 120
        while rank == "1" and not os.path.exists(landed) and time.monotonic() < deadline:
            time.sleep(0.01)
        found = scan(*args, **kwargs)
        if rank == "0":
            shutil.copy(os.environ["LATE"], landed + ".tmp")
            os.replace(landed + ".tmp", landed)
        return found

    pipeline.scanned_inputs = scanned_inputs
sys.argv = ["featbake", *json.loads(os.environ["BUILD_ARGS"])]
if case == "option" and rank == "1":
    sys.argv += ["--dtype", "float16"]  # one node's launch script carries another option
main()
"""


def launched(
    tmp_path: Path, args: Sequence[object], env: dict[str, str], disagree: str = ""
) -> subprocess.CompletedProcess:
    """Two torchrun ranks (gloo) running ``featbake *args`` through :data:`LAUNCHER`, which
    makes them disagree as ``disagree`` says (``""``: not at all)."""
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    extra = {"BUILD_ARGS": json.dumps([str(a) for a in args]), "DISAGREE": disagree}
    return subprocess.run(
        [str(torchrun_bin), "--nproc-per-node", "2", "--standalone", str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **env, **extra},
        timeout=300,
        cwd=REPO,
    )


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    """The featbake ``error:`` lines the ranks printed (a rank torchrun stopped first prints
    ``stopped:``); none says a rank of its own failed (torchrun's own traceback follows)."""
    assert "internal error" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert lines and all(" failed: " not in ln for ln in lines), res.stderr
    return lines


def assert_nothing_built(store: Path, counting_encoder: dict[str, str]) -> None:
    """The ranks stopped before any encoded: no input encoded, no fragment, no root."""
    assert encoded_rows(counting_encoder) == []
    assert sealed_fragments(Layout(store)) == []
    assert not (store / "catalog.sqlite").exists()


def test_ranks_that_list_other_inputs_stop_and_a_rerun_publishes_every_rank_saying_merged(
    tmp_path: Path, counting_encoder: dict[str, str]
) -> None:
    """A clip landing between the ranks' scans: every rank stops before encoding, saying the
    data changed as the build started (before: exit 0, "merged", no root). Rerun, every input
    is encoded once, and each rank says the build was merged: rank 1 used to say "run
    `featbake merge`" although rank 0 had merged before any rank returned."""
    data = tmp_path / "clips"
    write_audio_folder(data, 6, seconds=(0.2, 0.5), seed=31)
    write_audio_folder(tmp_path / "late", 1, seconds=0.4, seed=32)
    store = tmp_path / "store"
    args = ("build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0")
    late = str(next((tmp_path / "late").glob("*.wav")))
    env = {**counting_encoder, "DATA": str(data), "LATE": late}
    stopped = launched(tmp_path, args, env, disagree="inputs")
    assert stopped.returncode != 0
    said = error_lines(stopped)
    assert len(set(said)) == 1, said  # every rank says the same
    assert "rank 1 lists other inputs than rank 0 (7 inputs on rank 1, 6 on rank 0" in said[0]
    assert "only on rank 1: zz_late.wav" in said[0]
    assert "the data changed while the build started" in said[0] and "rerun" in said[0]
    assert_nothing_built(store, counting_encoder)

    done = launched(tmp_path, args, env)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(ln.strip() for ln in done.stdout.splitlines() if ln.startswith("part"))
    assert parts == [
        "part      part 1 of 2 (torchrun): fragment sealed, merged",
        "part      part 2 of 2 (torchrun): fragment sealed, merged by rank 0",
    ], done.stdout
    calls = Counter(encoded_rows(counting_encoder))
    assert len(calls) == 7 and set(calls.values()) == {1}
    assert sealed_fragments(Layout(store)) == []
    assert len(assert_serves_live(store, data)) == 7
    assert "nothing to merge" in invoke("merge", "--cache", store).stdout


@pytest.mark.parametrize("disagree", ["encoder", "option"])
def test_ranks_given_another_encoder_or_option_all_stop_before_encoding(
    tmp_path: Path, counting_encoder: dict[str, str], disagree: str
) -> None:
    """Rank 1's node holds another version of the encoder's module at the same import path, or
    its launch carries ``--dtype float16``: every rank stops before encoding with one line
    naming what differs (before: exit 0, "merged", two half builds pending for ever)."""
    from tests.conftest import COUNTING_ENCODER

    node1 = tmp_path / "node1"
    node1.mkdir()
    other = COUNTING_ENCODER.replace("return CountingEncoder()", "return CountingEncoder(seed=1)")
    (node1 / "countenc.py").write_text(other)
    data = tmp_path / "clips"
    write_audio_folder(data, 4, seconds=(0.2, 0.4), seed=33)
    store = tmp_path / "store"
    args = ("build", "-e", ENCODER, "-d", data, "--cache", store, "--workers", "0")
    env = {**counting_encoder, "NODE1": str(node1)}
    res = launched(tmp_path, args, env, disagree=disagree)
    assert res.returncode != 0
    said = error_lines(res)
    assert len(set(said)) == 1, said
    if disagree == "encoder":
        assert "rank 1's encoder differs from rank 0's: countenc:build is " in said[0]
        assert "give every rank the same encoder" in said[0]
    else:
        assert "rank 1's recipe differs from rank 0's: dtype float16 on rank 1, float32" in said[0]
        assert "launch every rank with the same options" in said[0]
    assert_nothing_built(store, counting_encoder)


def view(**changes: object) -> BuildView:
    """A rank's view of a build, with ``changes``."""
    base = BuildView(
        "r-1", "/d", None, "m:make", "e" * 64, (("dtype", "float32"),), "p" * 64, 2, "l" * 64
    )
    return dataclasses.replace(base, **changes)


def test_the_first_rank_that_differs_is_named_with_what_differs_and_its_exit_code() -> None:
    check_views_agree([view(), view(), view()])
    cases = [
        (view(encoder_fp="f" * 64), "rank 2's encoder differs from rank 0's", 2),
        (view(recipe_fp="q" * 64, recipe=(("dtype", "int8"),)), "dtype int8 on rank 2", 2),
        (view(root="r-2", data="/e"), "data /e on rank 2, /d on rank 0", 2),
        (view(root="r-2", column="text"), "column text on rank 2, None on rank 0", 2),
        (view(listing="m" * 64, inputs=3), "3 inputs on rank 2, 2 on rank 0", 8),
    ]
    for other, says, code in cases:
        with pytest.raises(RanksDisagree, match=re.escape(says)) as caught:
            check_views_agree([view(), view(), other])
        assert caught.value.exit_code == code and "\n" not in str(caught.value)
    assert inputs_only_on(1, [("a", 1), ("b", 2)], [("a", 1)]) == "only on rank 1: b"
    many = [(f"{i}.wav", 1) for i in range(5)]
    assert inputs_only_on(1, [("0.wav", 9)], many) == (
        "only on rank 0: 1.wav, 2.wav, 3.wav and 1 more; another size on rank 1: 0.wav"
    )


def test_a_merge_that_leaves_the_build_waiting_is_never_reported_merged(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's merge under torchrun: its build's other part sealed nothing of this build (it
    formed another), so the merge publishes nothing. Before, finish_part said merged anyway."""
    data = tmp_path / "clips"
    write_audio_folder(data, 4, seconds=(0.2, 0.4), seed=34)
    store = tmp_path / "store"
    args = ("build", "-e", encoder_file, "-d", data, "--cache", store, "--workers", "0")
    part = invoke(*args, "--shard", "0/2", "--json")
    assert part.returncode == 0, part.stderr
    fragment = json.loads(part.stdout)["fragment"]
    with socket.socket() as s:  # a group of one process stands for the ranks' group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    spec = RankSpec(0, 2, 0, RankSource.TORCHRUN)
    with pytest.raises(StoreError, match=r"the merge published nothing of it \(root r-"):
        finish_part(Layout(store), spec, fragment)
    assert FragmentKind.DONE in {f.kind for f in sealed_fragments(Layout(store))}  # waiting
