"""Progress bars and log lines for long commands; time formatting."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from featbake.cli.app import console
from featbake.units import format_bytes


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} items/s" if speed else "- items/s", style="cyan")


class _Bytes(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(format_bytes(int(task.fields.get("bytes", 0))), style="green")


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<7}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        _Bytes(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


def format_when(ts: float) -> str:
    import datetime as _dt

    if not ts:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


#: Without a terminal (CI logs, nohup), progress is one plain line per phase this often.
LOG_EVERY_S = 10.0


def tick_bar(bar: Progress, tasks: dict[str, Any]) -> Any:
    """A library progress callback that drives ``bar``, or writes log lines without a terminal."""
    # rich asks isatty() on every is_terminal read (~90 us): once per build is enough.
    on_terminal = console.is_terminal
    last_line: dict[str, float] = {}
    started: dict[str, float] = {}
    finished: set[str] = set()

    def log_line(p: Any, now: float) -> None:
        rate = p.done / max(now - started[p.phase], 1e-9)
        eta = f", ETA {(p.total - p.done) / rate:.0f}s" if rate and p.total else ""
        size = f", {format_bytes(p.bytes_written)}" if getattr(p, "bytes_written", 0) else ""
        console.print(f"{p.phase}: {p.done:,}/{p.total:,} ({rate:,.0f} items/s{eta}{size})")

    def on_progress(p: Any) -> None:
        if p.phase not in started:
            started[p.phase] = time.monotonic()
            if on_terminal:
                tasks[p.phase] = bar.add_task(p.phase, total=p.total or None)
        if on_terminal:
            bar.update(
                tasks[p.phase],
                completed=p.done,
                total=p.total or None,
                bytes=getattr(p, "bytes_written", 0),
            )
            return
        if not p.total or p.phase in finished:
            return
        now = time.monotonic()
        if p.done >= p.total:
            finished.add(p.phase)
            log_line(p, now)
        elif now - last_line.get(p.phase, started[p.phase]) >= LOG_EVERY_S:
            last_line[p.phase] = now
            log_line(p, now)

    return on_progress
