"""``python -m featbake`` runs the CLI."""

from featbake.cli.main import main

main()
