"""The `featbake` command line: one module per command group."""

from featbake.cli.main import main

__all__ = ["main"]
