"""CPU budget (affinity, cgroup quota) and the build's thread plan; device validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from featbake.cpus import (
    BakeThreads,
    bake_threads,
    encoder_threads,
    parse_cfs_quota,
    parse_cpu_max,
    usable_cpus,
)
from featbake.device import cgroup_cpu_limit, check_device, process_cpus, torch_threads
from featbake.errors import ConfigError


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("200000 100000\n", 2.0),
        ("150000 100000", 1.5),
        ("max 100000\n", math.inf),
        ("50000", 0.5),  # period left out: the kernel's default 100 ms
        ("0 100000", math.inf),
        ("garbage", math.inf),
        ("", math.inf),
    ],
)
def test_parse_cpu_max(text: str, cpus: float) -> None:
    assert parse_cpu_max(text) == cpus


def test_parse_cfs_quota() -> None:
    assert parse_cfs_quota("-1", "100000") == math.inf
    assert parse_cfs_quota("300000\n", "100000\n") == 3.0
    assert parse_cfs_quota("", "") == math.inf


def test_cgroup_v2_quota_at_the_root_and_in_the_own_cgroup(tmp_path: Path) -> None:
    root = _cgroup(tmp_path, {"cpu.max": "max 100000", "job/cpu.max": "250000 100000"})
    assert cgroup_cpu_limit(root, own="/") == math.inf
    assert cgroup_cpu_limit(root, own="/job") == 2.5
    _cgroup(tmp_path, {"cpu.max": "100000 100000"})  # the tighter one wins
    assert cgroup_cpu_limit(root, own="/job") == 1.0


def test_cgroup_v1_quota_and_no_cgroup_at_all(tmp_path: Path) -> None:
    root = _cgroup(
        tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}
    )
    assert cgroup_cpu_limit(root, own="") == 2.0
    assert cgroup_cpu_limit(tmp_path / "none", own="") == math.inf


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up() -> None:
    assert usable_cpus(range(64), math.inf) == 64
    assert usable_cpus(range(64), 2.0) == 2  # a container's --cpus 2 on a 64-core host
    assert usable_cpus(range(64), 1.5) == 2
    assert usable_cpus({3}, 8.0) == 1  # taskset -c 3
    assert usable_cpus(range(4), 0.1) == 1
    assert usable_cpus((), math.inf) == 1


def test_process_cpus_never_exceeds_the_affinity_mask() -> None:
    import os

    assert 1 <= process_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpus", "workers", "threads", "on_gpu", "plan"),
    [
        (1, None, 1, False, BakeThreads(0, 1)),
        (2, None, 2, False, BakeThreads(0, 2)),  # on 2 CPUs workers only steal the encoder's time
        (2, None, 1, False, BakeThreads(0, 1)),  # the user's 1 thread stays 1
        (4, None, 4, False, BakeThreads(1, 4)),
        (16, None, 16, False, BakeThreads(4, 16)),  # never lowered to make room for workers
        (64, None, 32, False, BakeThreads(8, 32)),
        (2, 2, 2, False, BakeThreads(2, 2)),  # asked for: as a hand-written DataLoader loop
        (8, 3, 4, True, BakeThreads(3, 4)),
        (8, 0, 8, False, BakeThreads(0, 8)),
        (8, None, 1, True, BakeThreads(7, 1)),  # a GPU encoder: the CPUs decode
        (1, None, 1, True, BakeThreads(0, 1)),
    ],
)
def test_bake_threads_keeps_the_encoder_threads_and_chooses_workers(
    cpus: int, workers: int | None, threads: int, on_gpu: bool, plan: BakeThreads
) -> None:
    assert bake_threads(cpus, workers, threads, on_gpu=on_gpu) == plan


@pytest.mark.parametrize(
    ("asked", "current", "cpus", "env_pinned", "expected"),
    [
        (None, 1, 2, False, 1),  # torch.set_num_threads(1), or an encoder factory's own setting
        (None, 2, 2, False, 2),  # torch's default on this machine
        (None, 64, 2, False, 2),  # torch's default ignores a container's CPU quota: lowered
        (None, 64, 2, True, 64),  # ... unless OMP_NUM_THREADS / MKL_NUM_THREADS says so
        (3, 1, 2, True, 3),  # --threads wins over everything
        (1, 64, 64, False, 1),
    ],
)
def test_encoder_threads_are_the_users_unless_over_the_cpu_quota(
    asked: int | None, current: int, cpus: int, env_pinned: bool, expected: int
) -> None:
    assert encoder_threads(asked, current, cpus, env_pinned=env_pinned) == expected


def test_torch_threads_restores_the_callers_count() -> None:
    caller = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's count is not the 1 asked for, however tests run
    try:
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), torch_threads(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)


@pytest.mark.parametrize("device", ["meta", "cuda:x", "tpu", "nonsense"])
def test_check_device_refuses_devices_a_build_cannot_run_on(device: str) -> None:
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        check_device(device)


def test_check_device_accepts_cpu() -> None:
    assert check_device("cpu") == torch.device("cpu")
