"""The typer app, its consoles and the options every command shares."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
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

from featbake.gcpause import end_startup
from featbake.progress import MIN_RATE_SECONDS, bytes_text, progress_line
from featbake.store.url import BucketURL, StoreKind, store_kind
from featbake.units import format_bytes
from featbake.version import __version__

# == app ===========================================================================================
#: Off a terminal (a log file, a pipe): wide enough never to hard-wrap.
UNWRAPPED_WIDTH = 10_000


def make_console(*, stderr: bool = False) -> Console:
    """A console that prints text literally and never splits a line it was not asked to.

    ``emoji=False``: a file named ``:x: take1.wav`` or an import path ``pkg:factory:`` must
    print as written, not as an emoji (markup is escaped where names are printed). Off a
    terminal rich assumes 80 columns (or ``$COLUMNS``) and hard-wraps, splitting shard paths
    in two; there the width is unbounded, and tables take their natural width.
    """
    on_terminal = Console(stderr=stderr).is_terminal
    return Console(
        stderr=stderr,
        highlight=False,
        emoji=False,
        soft_wrap=True,
        width=None if on_terminal else piped_width(os.environ),
    )


def piped_width(env: Mapping[str, str]) -> int:
    """The width off a terminal: ``$COLUMNS`` when set (``COLUMNS=80 featbake roots | less``
    fits 80 columns), else unbounded, so a pipe or a log never splits a path."""
    columns = env.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and int(columns) > 0 else UNWRAPPED_WIDTH


console = make_console(stderr=True)


#: The Unicode categories that break or rewrite a terminal's line: control characters, and
#: the line and paragraph separators (U+2028, U+2029).
BREAKING = frozenset({"Cc", "Zl", "Zp"})


def one_line(text: str) -> str:
    """``text`` with its control characters written as escapes (a newline as ``\\n``).

    A path may hold a newline or a carriage return; printed as it is, an error naming it would
    be two lines, or one overwritten, where every featbake error is one line a log can grep.
    """
    if text.isprintable():
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) in BREAKING else ch
        for ch in text
    )


def red_line(label: str, message: str) -> None:
    """Print ``label: message`` on stderr as one line, the label in red: how every error,
    stop and interruption a command ends with is said."""
    console.print(f"[bold red]{label}:[/] {escape(one_line(message))}", soft_wrap=True)


out = make_console()


@contextlib.contextmanager
def stdout_for_json_only(as_json: bool) -> Iterator[None]:
    """While a ``--json`` command runs, what a library prints to ``sys.stdout`` goes to stderr.

    The JSON, printed after, is then all its stdout holds: Ray's driver prints a dead worker's
    notice (``(raylet) A worker died ...``) to ``sys.stdout``, and a reader of ``--json``
    found lines it could not parse before the object."""
    if not as_json:
        yield
        return
    kept = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = kept


def examples(*commands: str) -> str:
    """A help epilog's "Examples:" block, each command printed whole on its own line.

    Click rewraps a help paragraph to the terminal's width: a long example split at a hyphen
    (``s3://team-`` / ``bucket/features``) or between an option and its value pastes as two
    broken commands. Click's ``\\b`` marker keeps a paragraph as written.
    """
    return "Examples:\n\n" + "".join(f"\b\n  {command}\n\n" for command in commands)


#: What each exit code means (featbake/errors.py sets them; 130 and 143 come from signals).
EXIT_MEANINGS = {
    0: "ok",
    2: "bad option",
    3: "some inputs failed (the rest stored)",
    4: "encoder could not load or run",
    5: "store cannot be read or written",
    6: "corrupt store data",
    7: "cache miss",
    8: "input unreadable",
    9: "the build process ended abruptly (e.g. os._exit in the encoder)",
    130: "interrupted",
    143: "stopped by SIGTERM",
}


def exit_codes(*codes: int, note: str = "") -> str:
    """A command's "Exit codes: ..." help line, naming only the codes that command exits with
    (a build's 3 and 9 on ``stats --help`` would send a reader looking for failed inputs)."""
    listed = ", ".join(f"{code} {EXIT_MEANINGS[code]}" for code in codes)
    return f"Exit codes: {listed}{note}."


#: Every code: the build's (and the top-level help's) list.
EXIT_CODES = exit_codes(*EXIT_MEANINGS, note=" (sealed work kept in both)")
#: What a command that reads or tidies a store (stats, gc, merge, export) exits with.
UPKEEP_EXIT_CODES = exit_codes(0, 2, 5, 6, 130)


app = typer.Typer(
    name="featbake",
    help=(
        "Compute a frozen encoder's features once; serve them at training time.\n\n"
        "\b\n"
        "  featbake build --encoder ckpt.pt --data ./audio   # bake (again: nothing recomputed)\n"
        "  featbake stats                                    # what the store holds\n"
        "  featbake gc --dry-run                             # what gc would free\n"
        "  featbake verify                                   # check every checksum\n\n"
        "In Python: CachedFeatureDataset('./audio', encoder='ckpt.pt') serves the same keys.\n\n"
        "The store lives in --cache DIR (default $FEATBAKE_CACHE or ./.featbake). "
        "Run `featbake COMMAND --help` for a command's options and examples.\n\n" + EXIT_CODES
    ),
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache",
        envvar="FEATBAKE_CACHE",
        help="Store directory, or a bucket: s3://bucket/prefix (AWS_ENDPOINT_URL, AWS_PROFILE "
        "or keys as for any S3 tool), gs://bucket/prefix (Application Default Credentials) or "
        "az://container/prefix (AZURE_STORAGE_CONNECTION_STRING). "
        "[default: $FEATBAKE_CACHE or ./.featbake]",
        show_default=False,
    ),
]
LocalCacheOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FEATBAKE_LOCAL_CACHE",
        help="A bucket store's local disk tier (fast local disk, shared by a node's processes). "
        "[default: ~/.cache/featbake/buckets]",
        show_default=False,
    ),
]
LocalCacheSizeOpt = Annotated[
    str | None,
    typer.Option(
        envvar="FEATBAKE_LOCAL_CACHE_SIZE",
        help="Byte budget of the local tier, e.g. 200GiB. [default: 100GiB]",
        show_default=False,
    ),
]


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print a JSON report on stdout, for scripts.")
]


# == options of one kind of store ==================================================================
@dataclass(frozen=True)
class OneKindOption:
    """An option that acts on one kind of store only: on the other it does nothing."""

    flag: str
    kind: StoreKind
    sets: str  # what it sets where it acts


#: By parameter name. Given on the command line for the other kind of store, each is one note
#: (never an error: a team's wrapper may pass them for every store; an environment variable
#: set for a node is never noted).
ONE_KIND_OPTIONS = {
    "local_cache": OneKindOption(
        "--local-cache", StoreKind.BUCKET, "a bucket store's local disk tier"
    ),
    "local_cache_size": OneKindOption(
        "--local-cache-size", StoreKind.BUCKET, "the byte budget of a bucket store's local tier"
    ),
    "retention": OneKindOption(
        "--retention",
        StoreKind.BUCKET,
        "how long gc keeps what a bucket store's retired catalog versions name (a directory "
        "store keeps no versions; its unnamed shards wait out --grace)",
    ),
    "grace": OneKindOption(
        "--grace",
        StoreKind.DIRECTORY,
        "how long gc leaves a directory store's unnamed shards and tmp/ files alone (a bucket "
        "store's unnamed shards wait out --retention)",
    ),
}


def inert_option_notes(given: Iterable[str], where: str) -> list[str]:
    """One line for each option of ``given`` (parameter names) that does nothing for the store
    at ``where``: what it sets, and on which kind of store.

    >>> [n.split(":")[0] for n in inert_option_notes(["retention", "grace", "as_json"], "st")]
    ['--retention does nothing for a directory store (st)']
    >>> inert_option_notes(["retention", "local_cache"], "s3://team/features")
    []
    """
    kind = store_kind(where)
    if kind is StoreKind.BUCKET:  # as the user wrote it (a Path turns s3:// into s3:/)
        where = str(BucketURL.parse(where))
    picked = [ONE_KIND_OPTIONS[n] for n in sorted(set(given)) if n in ONE_KIND_OPTIONS]
    return [
        f"{o.flag} does nothing for {kind.value} ({where}): it sets {o.sets}"
        for o in picked
        if o.kind is not kind
    ]


def note_inert_options(ctx: typer.Context, cache: Path | None) -> None:
    """Print :func:`inert_option_notes` for the options the running command ``ctx`` was given on
    its command line (not those from the environment or defaults), one yellow line each."""
    given = [name for name in ONE_KIND_OPTIONS if name in ctx.params and on_command_line(ctx, name)]
    where = os.fspath(cache) if cache is not None else os.environ.get("FEATBAKE_CACHE", "")
    for line in inert_option_notes(given, where or ".featbake"):
        console.print(f"[yellow]note:[/] {escape(line)}")


def on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether parameter ``name`` of ``ctx`` came from the command line (click's
    ``ParameterSource``, by name: typer 0.20 on vendors click under another module)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _version(value: bool) -> None:
    if value:
        out.print(f"featbake {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Compute a frozen encoder's features once; serve them at training time."""
    if ctx.invoked_subcommand != "build":  # a build's start-up ends after it imports torch
        end_startup()


# == render ========================================================================================
# Progress bars and log lines for long commands; time formatting.
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
    """The build's progress bar: drawn by :func:`tick_bar` from the build's own callback.

    rich redraws a live bar from a thread of its own, 10 times a second: a thread that woke
    during the encoder's calls and held the GIL for each redraw (~1.7% of a core, measured),
    and on a busy node preempted a thread of the encoder's OpenMP team, which the rest of
    the team then waits for (issue 31 item 4). Here no thread is started: the bar is redrawn
    on the build's thread, between its batches, at most every :data:`DRAW_EVERY_S`.
    """
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
        auto_refresh=False,
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
#: On a terminal, the bar is redrawn at most this often (seconds), from the progress callback.
DRAW_EVERY_S = 0.1


def tick_bar(bar: Progress, tasks: dict[str, Any]) -> Any:
    """A library progress callback that drives ``bar``, or writes log lines without a terminal."""
    # rich asks isatty() on every is_terminal read (~90 us): once per build is enough.
    on_terminal = console.is_terminal
    last_line: dict[str, float] = {}
    last_draw = [0.0]
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
            now = time.monotonic()
            if now - last_draw[0] >= DRAW_EVERY_S or (p.total and p.done >= p.total):
                last_draw[0] = now
                bar.refresh()  # on this thread: the bar starts none of its own
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
