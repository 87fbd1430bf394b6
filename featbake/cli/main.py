"""The entry point: run the app; featbake errors become one red line and an exit code."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
import warnings
from typing import NoReturn

import typer

from featbake.bake.interrupt import raise_on_sigterm

# Importing the command modules registers their commands on the app.
from featbake.cli import (
    build,  # noqa: F401
    upkeep,  # noqa: F401  (registers stats, roots, gc, verify, merge, export)
)
from featbake.cli.app import app, console, one_line, red_line
from featbake.cli.supervise import (
    in_part,
    leave_child,
    report_clean_exit,
    status_channel,
    supervise_if_build,
)
from featbake.errors import FeatbakeError, RanksDisagree, Terminated


def _one_line_warning(message: object, category: type, *_: object, **__: object) -> str:
    # e.g. the shared-filesystem notice: one line, no source
    return f"featbake: {one_line(str(message))}\n"


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning featbake errors into one red line and an exit code.

    ``featbake build`` from the command line (``argv`` None: the console script, ``python -m
    featbake``) runs in a child process this one forks and watches (see
    :mod:`featbake.cli.supervise`), so a build process ended by its encoder is still reported.
    A program that passes ``argv`` runs the command in its own process: a forked child of it
    must never return into the program's code.
    """
    warnings.formatwarning = _one_line_warning
    args = sys.argv[1:] if argv is None else argv
    if not _supervise_or_report(args, command_line=argv is None):
        _run(argv)
        return
    code: object = 0
    try:  # the watched build child: leaves without the interpreter's teardown (supervise.py)
        _run(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:  # FEATBAKE_DEBUG's re-raise, or anything _run let through
        traceback.print_exc()
        code = 1
    # Out of the except block: the traceback and the frames it held are freed first, so what
    # they owned (a DataLoader's workers) shuts down as it does on a normal exit.
    leave_child(code)


#: What an interrupted command leaves, by command (a build keeps the shards it sealed; an export
#: removes its partial output; the rest change the store in steps that a rerun finishes).
INTERRUPTED = {
    "build": "everything sealed so far is kept; rerun to continue",
    "export": "the export was not written (its partial output is removed); rerun it",
}


def interrupted_line(argv: list[str] | None) -> str:
    """The line after "interrupted:" for the command ``argv`` runs (the console script's own
    arguments when None).

    Example:
        >>> interrupted_line(["export", "--format", "zarr", "f.zarr"])
        'the export was not written (its partial output is removed); rerun it'
        >>> interrupted_line(["--version"])
        'rerun the command to finish it'
    """
    args = sys.argv[1:] if argv is None else argv
    command = next((a for a in args if not a.startswith("-")), "")
    return INTERRUPTED.get(command, "rerun the command to finish it")


def empty_argument(args: list[str]) -> str | None:
    """What an empty (or blank) argument gives, named, or None where none is (pure).

    No featbake argument means anything empty: a script's unset variable (``--cache "$DIR"``)
    read ``""`` as the current folder, ``featbake roots drop "$ROOT"`` dropped the one root
    an empty prefix matches, ``--data ""`` built the whole current folder.

    Example:
        >>> empty_argument(["gc", "--cache", ""]), empty_argument(["roots", "drop", " "])
        ('the value of --cache', "argument 3 (' ')")
        >>> empty_argument(["stats", "--cache=", "--json"]), empty_argument(["stats"])
        ('the value of --cache', None)
    """
    for i, arg in enumerate(args):
        option, eq, value = arg.partition("=")
        if arg.startswith("--") and eq and not value.strip():
            return f"the value of {option}"
        if arg.strip():
            continue
        before = args[i - 1] if i else ""
        if before.startswith("-") and "=" not in before and len(before) > 1:
            return f"the value of {before}"
        return f"argument {i + 1} ({arg!r})"
    return None


def _refuse_empty(args: list[str]) -> None:
    """Exit 2 with one line where an argument is empty (:func:`empty_argument`)."""
    empty = empty_argument(args)
    if empty is not None:
        red_line(
            "error",
            f"{empty} is empty (an unset variable in a script?); "
            "give it a value (nothing was read or written)",
        )
        sys.exit(2)


def _run(argv: list[str] | None) -> None:
    """Run the app; featbake errors become one red line and an exit code."""
    _refuse_empty(sys.argv[1:] if argv is None else argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (torchrun, SLURM, Kubernetes, docker) stops a command as Ctrl-C does, with its
        # own exit code; a build turns it into a stop at its next safe point.
        previous = signal.signal(signal.SIGTERM, raise_on_sigterm)
    try:
        _run_app(argv)
    finally:
        # The command is over: a SIGTERM from here on (the interpreter's exit handlers) ends
        # the process as it would have, not with a traceback out of an exit handler.
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_app(argv: list[str] | None) -> None:
    """The app, run; each way it ends turned into one line and an exit code (see :func:`_run`)."""
    try:
        # Without standalone mode typer *returns* the code of a `raise typer.Exit(code)`, and 130
        # when it caught a KeyboardInterrupt itself: dropping it would turn Ctrl-C into success.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code != 0:
            if code == 130:
                red_line("interrupted", interrupted_line(argv))
            sys.exit(code)
    except FeatbakeError as e:
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        # Ranks that disagree all stop alike, and the line names them: no one rank failed.
        red_line("error", str(e) if isinstance(e, RanksDisagree) else in_part(str(e)))
        sys.exit(e.exit_code)
    except Terminated as e:
        # A stop asked for from outside is not a failure of its own: under torchrun the rank
        # that failed prints the one `error:` line, and the ranks torchrun then stops say so,
        # with what stopping left (this command's, not the build's words).
        red_line("stopped", in_part(f"{e}: {interrupted_line(argv)}", failed=False))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        red_line("interrupted", interrupted_line(argv))
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort as e:
        if isinstance(e.__cause__, EOFError):
            # Click turns an EOFError raised anywhere in a command (a truncated gzip or pickle
            # a library read) into Abort: it is that error, not the user's "aborted".
            _exit_on_other_error(e.__cause__)
        console.print("[bold red]aborted")  # the user said no: nothing more to say
        sys.exit(130)
    except Exception as e:
        _exit_on_other_error(e)


def _exit_on_other_error(e: Exception) -> NoReturn:
    """Exit for an exception no featbake error covers: a usage error (an unknown command or
    option: typer's own exceptions in typer >= 0.20, click's before; both carry an exit code) as
    one line, anything else as an internal error (its traceback under FEATBAKE_DEBUG)."""
    show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
    if callable(show) and isinstance(code, int):
        line = usage_error_line(e)
        if line is None:
            show()
        else:
            red_line("error", line)
        sys.exit(code)
    if os.environ.get("FEATBAKE_DEBUG"):
        raise e
    message = in_part(f"{type(e).__name__}: {e}")
    red_line(
        "internal error",
        f"{message} (rerun with FEATBAKE_DEBUG=1 for a traceback, and please report it)",
    )
    sys.exit(1)


def usage_error_line(e: Exception) -> str | None:
    """The one line a usage error (an unknown option or command, a missing or bad value) prints:
    what the parser said and where the command's options are listed. None for a command called
    without arguments, whose answer is its help.

    Click's own rendering is three lines (usage, a hint, the error) ahead of any featbake line.
    """
    message = getattr(e, "format_message", None)
    if type(e).__name__ == "NoArgsIsHelpError" or not callable(message):
        return None
    command = getattr(getattr(e, "ctx", None), "command_path", None) or "featbake"
    said = " ".join(str(message()).split()).rstrip(".")
    # "Did you mean 'stats'?" ends a sentence of its own.
    joined = f"{said} See" if said.endswith("?") else f"{said}; see"
    return f"{joined} `{command} --help`"


def _supervise_or_report(args: list[str], *, command_line: bool) -> bool:
    """Fork a build's watched child (this process waits and exits with its code) when the
    command came from the command line, or, in that child, report a clean exit.

    Returns:
        True in the watched child.
    """
    if command_line:
        supervise_if_build(args)
    status = status_channel()
    if status is not None:
        atexit.register(report_clean_exit, status)
    return status is not None
