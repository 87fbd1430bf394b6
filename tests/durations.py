"""Test files run heaviest first, by the seconds each took when last recorded.

``make test`` runs the suite on one xdist worker per core, a file at a time (``--dist
loadfile``): a worker that finishes a file takes the next one in the queue. xdist's own order
(most tests first) queued files of few, slow tests (bucket builds, torchrun ranks, kills, each
several minutes) among the last, where one worker ran them alone while the other had nothing left.
Queued longest first (list scheduling by longest processing time), the workers end within about
one short file of each other.

``tests/durations.json`` holds each file's seconds (setup, call and teardown of its tests, as
measured on two workers), written by ``make durations``. A file it does not name (a new one)
counts :data:`UNKNOWN_TEST_SECONDS` per test; a stale figure only costs balance, never a result.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")

#: What a test of a file the record does not name is taken to cost (the suite's median is
#: under a second; a new file is rarely among the heaviest).
UNKNOWN_TEST_SECONDS = 1.0


def file_of(nodeid: str) -> str:
    """The file a test id names (``tests/x.py::test_y[a]`` -> ``tests/x.py``)."""
    return nodeid.split("::", 1)[0]


def heaviest_first(
    files: Sequence[str], counts: Mapping[str, int], seconds: Mapping[str, float]
) -> list[str]:
    """``files`` ordered by their recorded seconds, heaviest first; a file with no record
    weighs :data:`UNKNOWN_TEST_SECONDS` per test; ties keep the collected order.

    >>> heaviest_first(["a.py", "b.py", "c.py"], {"a.py": 3, "b.py": 1, "c.py": 9}, {"b.py": 40.0})
    ['b.py', 'c.py', 'a.py']
    """

    def weight(f: str) -> float:
        recorded = seconds.get(f)
        return recorded if recorded is not None else UNKNOWN_TEST_SECONDS * counts.get(f, 1)

    return sorted(files, key=lambda f: -weight(f))  # sorted is stable: ties keep their order


def recorded_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """The record's seconds per file; none where there is no record (a run is then in xdist's
    order of test counts)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        default=None,
        help="write each test file's seconds (setup+call+teardown) to PATH as JSON "
        "(make durations writes tests/durations.json, the order make test runs files in)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Reorder the collected tests file by file, heaviest file first (each file's own order
    kept). Every xdist worker collects the same order, which ``--no-loadscope-reorder`` keeps."""
    seconds = recorded_seconds()
    if not seconds:
        return
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[file_of(item.nodeid)].append(item)
    counts = {f: len(its) for f, its in by_file.items()}
    items[:] = [it for f in heaviest_first(list(by_file), counts, seconds) for it in by_file[f]]


class DurationRecorder:
    """Sums each file's test seconds as reports arrive (on xdist's controller: every worker's)
    and writes them at the session's end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        self.path.write_text(json.dumps({f: round(s, 1) for f, s in ordered}, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(DurationRecorder(Path(path)), "featbake-durations")
