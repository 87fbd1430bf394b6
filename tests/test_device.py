"""CPU budget (affinity, cgroup quota) and the build's thread plan; device validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from featbake.cpus import (
    BakeThreads,
    bake_threads,
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
    ("cpus", "workers", "on_gpu", "plan"),
    [
        (1, None, False, BakeThreads(0, 1)),
        (2, None, False, BakeThreads(0, 2)),  # on 2 CPUs workers only steal the encoder's time
        (4, None, False, BakeThreads(1, 3)),
        (16, None, False, BakeThreads(4, 12)),
        (64, None, False, BakeThreads(8, 56)),
        (2, 2, False, BakeThreads(2, 2)),  # asked for: the encoder keeps every CPU, as by hand
        (8, 3, True, BakeThreads(3, 1)),
        (8, 0, False, BakeThreads(0, 8)),
        (8, None, True, BakeThreads(7, 1)),  # a GPU encoder: the CPUs decode
        (1, None, True, BakeThreads(0, 1)),
    ],
)
def test_bake_threads_chosen_ones_fit_the_cpus(
    cpus: int, workers: int | None, on_gpu: bool, plan: BakeThreads
) -> None:
    got = bake_threads(cpus, workers, on_gpu=on_gpu)
    assert got == plan
    if workers is None:
        assert got.decode_workers + (1 if on_gpu else got.encoder_threads) <= max(cpus, 1)


def test_torch_threads_restores_the_callers_count() -> None:
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("device", ["meta", "cuda:x", "tpu", "nonsense"])
def test_check_device_refuses_devices_a_build_cannot_run_on(device: str) -> None:
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        check_device(device)


def test_check_device_accepts_cpu() -> None:
    assert check_device("cpu") == torch.device("cpu")
