"""How the encoder's idle OpenMP threads wait (issue 42 item 4): passive only on a busy node,
never over the user's own setting. The command line's use of it is tested in
``tests/cli/test_build.py`` (a real build child, its environment recorded by the encoder)."""

from __future__ import annotations

from pathlib import Path

import pytest

import featbake.cpu_share as share


def test_the_policy_is_passive_exactly_where_the_load_reaches_the_busy_share_per_cpu() -> None:
    for cpus in (1, 2, 16, 64):
        for load in (0.0, 0.5 * cpus, 1.0 * cpus, 1.49 * cpus, 1.5 * cpus, 4.0 * cpus):
            busy = load >= share.BUSY_LOAD_PER_CPU * cpus  # the naive model
            assert share.wait_policy({}, load, cpus) == ("PASSIVE" if busy else None)


@pytest.mark.parametrize(
    "users", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "0"}, {"KMP_BLOCKTIME": "200"}]
)
def test_a_users_own_wait_setting_is_never_overridden(users: dict[str, str]) -> None:
    env = dict(users)
    assert share.choose_wait_policy(env) is None and env == users  # whatever the load now
    assert share.wait_policy(users, 1000.0, 2) is None


def test_the_load_is_read_from_the_kernels_file_and_set_in_the_environment_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(share, "LOADAVG", loadavg)
    monkeypatch.setattr(share.os, "cpu_count", lambda: 2)
    loadavg.write_text("7.25 6.00 5.00 3/200 999\n")
    assert share.node_load() == 7.25
    env: dict[str, str] = {}
    assert share.choose_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    loadavg.write_text("0.40 0.30 0.20 1/200 999\n")
    env = {}
    assert share.choose_wait_policy(env) is None and env == {}
    loadavg.unlink()  # unreadable: the node's load from the OS, or 0.0
    assert share.node_load() >= 0.0
