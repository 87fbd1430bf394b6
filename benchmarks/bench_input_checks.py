"""What telling the kind of ``--data`` costs a large folder of clips.

Every ``featbake build --data FOLDER`` first asks whether the folder is tar shards
(:func:`featbake.encode.webdataset.is_webdataset`) or a table
(:func:`featbake.encode.tables.is_table`) before it scans it as a folder of files. Each check
should stop at the first entry that says no, however many files the folder holds. Timed here:
both checks together on a folder of empty ``.wav`` files (made in a temporary folder unless one
is given), median of 7 runs.

Run: ``chrt -f 10 python benchmarks/bench_input_checks.py [FOLDER] [--files N]`` (default
100,000 files); run it in the old and new trees alternately to compare.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from featbake.encode.tables import is_table
from featbake.encode.webdataset import is_webdataset


def made_folder(root: Path, files: int) -> Path:
    """A folder of ``files`` empty clips ``c000000.wav``..."""
    folder = root / "clips"
    folder.mkdir()
    for i in range(files):
        (folder / f"c{i:06d}.wav").touch()
    return folder


def checks_ms(where: str, runs: int = 7) -> float:
    """The median time of both checks on ``where``, in milliseconds."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        assert not is_webdataset(where) and not is_table(where)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv: list[str]) -> None:
    files = int(argv[argv.index("--files") + 1]) if "--files" in argv else 100_000
    given = [a for a in argv if not a.startswith("--") and not a.isdigit()]
    with tempfile.TemporaryDirectory() as tmp:
        where = given[0] if given else str(made_folder(Path(tmp), files))
        print(f"is_webdataset + is_table on {where}: {checks_ms(where):.2f} ms (median of 7)")


if __name__ == "__main__":
    main(sys.argv[1:])
