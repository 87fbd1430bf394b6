"""The ``featbake`` command: parse options, call one library function, render with rich.

Known errors print one red line and exit with the code documented in :mod:`featbake.errors`;
a traceback appears only with ``FEATBAKE_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
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
from rich.table import Table
from rich.text import Text

from featbake import __version__
from featbake.errors import BuildIncomplete, ConfigError, FeatbakeError
from featbake.units import format_bytes, parse_bytes

console = Console(stderr=True, highlight=False)
out = Console(highlight=False)

EXIT_CODES = """Exit codes: 0 ok, 2 bad option, 3 some inputs failed (the rest stored), 4 encoder
could not load or run, 5 store unwritable, 6 corrupt store data, 7 cache miss, 8 input unreadable,
130 interrupted (sealed work kept)."""

app = typer.Typer(
    name="featbake",
    help=(
        "Compute a frozen encoder's features once; serve them at training time.\n\n"
        "  featbake build --encoder ckpt.pt --data ./audio\n\n"
        "The store lives in --cache DIR (default $FEATBAKE_CACHE or ./.featbake).\n\n" + EXIT_CODES
    ),
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache",
        envvar="FEATBAKE_CACHE",
        help="Store directory. [default: $FEATBAKE_CACHE or ./.featbake]",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print a JSON report on stdout, for scripts.")
]


def _version(value: bool) -> None:
    if value:
        out.print(f"featbake {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Compute a frozen encoder's features once; serve them at training time."""


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} items/s" if speed else "- items/s", style="cyan")


class _Bytes(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(format_bytes(int(task.fields.get("bytes", 0))), style="green")


def _progress_bar() -> Progress:
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


@app.command(
    epilog=(
        "Examples:\n\n"
        "  featbake build --encoder ckpt.pt --data ./audio\n\n"
        "  featbake build --encoder encoder.pt2 --data ./audio --max-seconds 10 --dtype float16\n\n"
        "  featbake build --encoder mypkg.models:build --weights w.safetensors --data ./audio "
        "--device cuda --json\n\n" + EXIT_CODES
    )
)
def build(
    encoder: Annotated[
        str,
        typer.Option(
            "--encoder",
            "-e",
            help="TorchScript (.pt), torch.export (.pt2) file, or import path pkg.module:factory.",
        ),
    ],
    data: Annotated[
        Path, typer.Option("--data", "-d", help="Folder of inputs (scanned recursively).")
    ],
    cache: CacheOpt = None,
    weights: Annotated[
        Path | None, typer.Option(help="safetensors weights for an import-path encoder.")
    ] = None,
    source: Annotated[str, typer.Option(help="Input kind: audio or npy.")] = "audio",
    sample_rate: Annotated[int, typer.Option(help="Resample audio to this rate (Hz).")] = 16000,
    max_seconds: Annotated[
        float | None, typer.Option(help="Crop audio to its first N seconds.", show_default=False)
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            help="Store only this encoder output (dict key or tuple index).", show_default=False
        ),
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="Stored dtype: float32, float16 or bfloat16.")
    ] = "float32",
    batch_size: Annotated[int, typer.Option(help="Inputs per encoder call.")] = 16,
    workers: Annotated[int, typer.Option(help="Decoding worker processes (0: none).")] = 2,
    device: Annotated[str, typer.Option(help="Where the encoder runs: cpu, cuda, cuda:N.")] = "cpu",
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 256MiB.")] = "256MiB",
    strict: Annotated[
        bool, typer.Option(help="Stop at the first bad input instead of skipping it.")
    ] = False,
    trust_pickle: Annotated[
        bool,
        typer.Option(help="Allow a pickled whole-module checkpoint (loading it runs its code)."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run an encoder over a data folder once and store its features.

    Inputs already in the store are skipped (a rerun encodes nothing); bad inputs are skipped and
    listed at the end, and the exit code is then 3.
    """
    from featbake.build import Progress as BuildProgress
    from featbake.build import build as run_build
    from featbake.recipe import Recipe

    recipe = Recipe(
        source=source,
        sample_rate=sample_rate,
        max_seconds=max_seconds,
        output=output,
        dtype=dtype,
    )
    try:
        shard_bytes = parse_bytes(shard_size)
    except ConfigError as e:
        raise ConfigError(f"--shard-size: {e}") from e
    bar = _progress_bar()
    tasks: dict[str, Any] = {}

    def on_progress(p: BuildProgress) -> None:
        if p.phase not in tasks:
            tasks[p.phase] = bar.add_task(p.phase, total=p.total or None)
        bar.update(tasks[p.phase], completed=p.done, total=p.total or None, bytes=p.bytes_written)

    with bar:
        report = run_build(
            data,
            encoder,
            cache=cache,
            recipe=recipe,
            weights=weights,
            trust_pickle=trust_pickle,
            batch_size=batch_size,
            workers=workers,
            device=device,
            strict=strict,
            shard_bytes=shard_bytes,
            progress=on_progress,
        )
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        _print_build_summary(report)
    if report.failed:
        raise BuildIncomplete(
            f"{len(report.failed)} of {report.files} inputs failed (listed above); "
            "everything else is stored. Fix or remove them and rerun; finished work is not redone"
        )


def _print_build_summary(report: Any) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("root", report.root)
    table.add_row("encoder", f"{escape(report.encoder)} ({report.encoder_fp[:12]})")
    table.add_row("files", f"{report.files:,}")
    table.add_row("encoded", f"{report.encoded:,}")
    table.add_row("reused", f"{report.reused:,}")
    if report.duplicates:
        table.add_row("duplicates", f"{report.duplicates:,} (identical files share a feature)")
    table.add_row("failed", f"[red]{len(report.failed):,}[/]" if report.failed else "0")
    table.add_row(
        "written", f"{format_bytes(report.bytes_written)} in {report.shards_written} shards"
    )
    table.add_row("time", f"{report.seconds:.2f}s")
    out.print(table)
    for path, reason in report.failed[:50]:
        console.print(f"[red]failed[/] {escape(path)}: {escape(reason)}")
    if len(report.failed) > 50:
        console.print(f"[red]... and {len(report.failed) - 50} more (see --json)")


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning featbake errors into one red line and an exit code."""
    try:
        # Outside standalone mode typer *returns* an exit code instead of exiting: 130 when it
        # caught a KeyboardInterrupt itself. Dropping it would turn Ctrl-C into success.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code != 0:
            if code == 130:
                console.print(
                    "[bold red]interrupted:[/] everything sealed so far is kept; rerun to continue"
                )
            sys.exit(code)
    except FeatbakeError as e:
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        console.print(
            "[bold red]interrupted:[/] everything sealed so far is kept; rerun to continue"
        )
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        console.print("[bold red]aborted")
        sys.exit(130)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        console.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
            "(rerun with FEATBAKE_DEBUG=1 for a traceback, and please report it)"
        )
        sys.exit(1)
