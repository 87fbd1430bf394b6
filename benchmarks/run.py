"""Run every benchmark (``benchmarks/bench_*.py``) and print one table of measured ratios.

Each module exposes ``main(quick: bool = False) -> list[dict]``; rows carry ``bench``, ``metric``,
``value``, ``unit``, ``target``, ``ok`` and ``note``. Ratios are measured side by side in one run
(featbake against the plain alternative on the same data), because absolute times drift on shared
machines.

Usage:
    python benchmarks/run.py                 # everything (several minutes)
    python benchmarks/run.py --quick         # smaller data, for a smoke check
    python benchmarks/run.py serve build     # only bench_serve.py and bench_build.py
    python benchmarks/run.py --json out.json # also write the rows as JSON
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("only", nargs="*", help="bench names to run (serve, build, upkeep)")
    parser.add_argument("--quick", action="store_true", help="small data, for a smoke check")
    parser.add_argument("--json", type=Path, help="write all rows to this JSON file")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    console = Console(width=None if sys.stdout.isatty() else 120)
    modules = sorted(HERE.glob("bench_*.py"))
    if args.only:
        modules = [m for m in modules if m.stem.removeprefix("bench_") in args.only]
    rows: list[dict] = []
    for path in modules:
        console.print(f"[bold]running {path.name}[/] ...")
        t0 = time.perf_counter()
        rows.extend(_load(path).main(quick=args.quick))
        console.print(f"  done in {time.perf_counter() - t0:.0f}s")
    table = Table(title="featbake benchmarks" + (" (quick)" if args.quick else ""))
    for col in ("bench", "metric", "value", "target", "ok", "#"):
        table.add_column(col, overflow="fold")
    notes = []
    for r in rows:
        ok = r.get("ok")
        mark = "" if ok is None else ("[green]yes[/]" if ok else "[red]no[/]")
        ref = ""
        if r.get("note"):
            if r["note"] not in notes:
                notes.append(r["note"])
            ref = str(notes.index(r["note"]) + 1)
        value = f"{_fmt(r.get('value', ''))} {r.get('unit', '')}".strip()
        table.add_row(
            r.get("bench", ""), r.get("metric", ""), value, r.get("target") or "", mark, ref
        )
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"  {i:>2}. {note}", highlight=False)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
