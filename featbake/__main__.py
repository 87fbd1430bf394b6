"""``python -m featbake`` runs the CLI."""

from featbake.cli import main

main()
