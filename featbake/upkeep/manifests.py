"""Root manifest files (``roots/*.json``) read so that no content of theirs can crash upkeep."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from featbake.errors import StoreCorrupt
from featbake.store.catalog import Root, RootItem, read_root_file


def read_manifest(path: Path) -> tuple[Root, list[RootItem]]:
    """A root manifest file, parsed.

    Raises:
        StoreCorrupt: it is not a readable manifest, including hostile JSON (a bare number,
            arrays nested too deep to parse) that ``read_root_file`` lets through.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would hang the read, a link lie
            raise StoreCorrupt(
                f"root manifest {path} is not a regular file; `featbake verify --repair` moves "
                "it to quarantine/"
            )
    except OSError as e:
        raise StoreCorrupt(f"root manifest {path} is unreadable ({e.strerror or e})") from e
    try:
        return read_root_file(path)
    except (RecursionError, AttributeError) as e:
        raise StoreCorrupt(
            f"root manifest {path} is unreadable ({type(e).__name__}); `featbake verify "
            "--repair` moves it to quarantine/"
        ) from e
