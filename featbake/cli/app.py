"""The typer app, its consoles and the options every command shares."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from featbake.version import __version__

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
out = make_console()


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
        "or keys as for any S3 tool). [default: $FEATBAKE_CACHE or ./.featbake]",
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
