"""The entry point: run the app; featbake errors become one red line and an exit code."""

from __future__ import annotations

import os
import sys
import warnings

import typer
from rich.markup import escape

# Importing the command modules registers their commands on the app.
from featbake.cli import build, export, gc, merge, store, verify  # noqa: F401
from featbake.cli.app import app, console
from featbake.errors import FeatbakeError


def _one_line_warning(message: object, category: type, *_: object, **__: object) -> str:
    return f"featbake: {message}\n"  # e.g. the shared-filesystem notice: one line, no source


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning featbake errors into one red line and an exit code."""
    warnings.formatwarning = _one_line_warning  # type: ignore[assignment]
    try:
        # Without standalone mode typer *returns* the code of a `raise typer.Exit(code)`, and 130
        # when it caught a KeyboardInterrupt itself: dropping it would turn Ctrl-C into success.
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
    except Exception as e:
        # Usage errors (unknown command or option): typer's own exceptions in typer >= 0.20,
        # click's before. Both know how to show themselves and carry an exit code.
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        console.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
            "(rerun with FEATBAKE_DEBUG=1 for a traceback, and please report it)"
        )
        sys.exit(1)
