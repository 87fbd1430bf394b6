"""The `featbake` command line: one module per command group."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """The ``featbake`` command (see :func:`featbake.cli.main.main`).

    A build is handed to its watched child before typer, rich or torch are imported: the
    process that only watches needs none of them (0.1-0.2 s of every build; issue 32 item 15).
    Only the command line's own build (``argv`` None) is: a program passing ``argv`` runs the
    command in its own process (a forked child must never return into the program's code).
    """
    from featbake.cli.supervise import supervise_if_build
    from featbake.gcpause import pause_gc_for_startup

    if argv is None:  # the command line: this process is the command's own (featbake/gcpause.py)
        pause_gc_for_startup()
        supervise_if_build(sys.argv[1:])
    from featbake.cli.main import main as run

    run(argv)


__all__ = ["main"]
