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
from featbake.progress import MIN_RATE_SECONDS, bytes_text, progress_line
from featbake.units import format_bytes


class _Rate(ProgressColumn):
    """items/s once the phase has run long enough for a rate to mean something."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time or task.elapsed or 0.0
        speed = task.finished_speed or task.speed
        if elapsed < MIN_RATE_SECONDS or not speed:
            return Text("- items/s", style="cyan")
        return Text(f"{speed:,.0f} items/s", style="cyan")


class _Labelled(ProgressColumn):
    """Another column's text behind a label ("ETA 0:00:25", "elapsed 0:00:03")."""

    def __init__(self, label: str, column: ProgressColumn) -> None:
        super().__init__()
        self.label, self.column = label, column

    def render(self, task: Task) -> Text:
        inner = self.column.render(task)
        return Text.assemble(f"{self.label} ", inner if isinstance(inner, Text) else str(inner))


def _size(nbytes: int) -> str:
    return format_bytes(nbytes) if nbytes else ""


class _Bytes(ProgressColumn):
    """Bytes sealed (what survives a kill) and bytes still in the writer's hands."""

    def render(self, task: Task) -> Text:
        sealed, pending = int(task.fields.get("bytes", 0)), int(task.fields.get("pending", 0))
        return Text(bytes_text(_size(sealed), _size(pending)), style="green")


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<7}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        _Labelled("ETA", TimeRemainingColumn()),
        _Labelled("elapsed", TimeElapsedColumn()),
        _Bytes(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


def summary_lines(rows: list[tuple[str, str]]) -> list[str]:
    """``label  value`` lines, labels padded to one column and nothing after the value.

    A rich ``Table`` pads every cell to its column's widest one: off a terminal each summary
    line carried as many trailing spaces as the longest value is long (~150 behind a batching
    note; issue 32 item 15). Markup in a value (``[red]3[/]``) is left for the console.

    Example:
        >>> summary_lines([("root", "r-1"), ("encoded", "16")])
        ['root     r-1', 'encoded  16']
    """
    width = max((len(label) for label, _ in rows), default=0)
    return [f"{label:<{width}}  {value}".rstrip() for label, value in rows]


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
        sealed = _size(getattr(p, "bytes_written", 0))
        pending = _size(getattr(p, "bytes_pending", 0))
        seconds = now - started[p.phase]
        line = progress_line(p.phase, p.done, p.total, seconds, sealed, pending)
        console.print(line, highlight=False)

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
                pending=getattr(p, "bytes_pending", 0),
            )
            return
        if not p.total or p.phase in finished:
            return
        now = time.monotonic()
        # The line for the last item waits for its bytes to be sealed (the build's last word).
        if p.done >= p.total and not getattr(p, "bytes_pending", 0):
            finished.add(p.phase)
            log_line(p, now)
        elif now - last_line.get(p.phase, started[p.phase]) >= LOG_EVERY_S:
            last_line[p.phase] = now
            log_line(p, now)

    return on_progress
