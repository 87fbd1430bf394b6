"""verify --repair, first step: an intact shard under a wrong name gets its content name back.

A shard's name is the SHA-256 of its bytes, so a file whose every tensor is intact but whose
name is not its digest was renamed, not damaged: two shard files whose names were swapped, a
rename cycle, a copy under a name nobody uses, or a file moved into the wrong folder. Repair
used to treat such a file like damage (salvage its tensors into a fresh shard, quarantine the
file); in a swap the first fresh shard landed on the path of the other file, which was not
salvaged yet, and that file's features were lost. Renaming each file to the name its bytes hash
to loses nothing and leaves the catalog's rows pointing at the right bytes again.

A file is renamed only when its true name is wanted: the catalog names that shard, or another
shard file sits under that name (a swap or cycle). Anything else (zeros appended to a shard,
say, whose digest names no shard) keeps the salvage path, which rewrites the clean shard.
Renames go through a staging name beside the destination, so a cycle never overwrites a file
that is still to be moved; a crash between the two steps leaves the staged file for the next
``verify --repair`` to report and quarantine, never to delete.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

from featbake.errors import StoreError
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.upkeep.files import quarantine
from featbake.upkeep.findings import CatalogState, RepairOutcome, ShardCheck, VerifyScan
from featbake.upkeep.shard_check import sha256_file

STAGING_SUFFIX = ".renaming"


def wanted_names(layout: Layout, scan: VerifyScan) -> set[str]:
    """Shard names someone expects to find: the catalog's shard rows and every file's name."""
    names = {c.name for c in scan.shards}
    if scan.catalog_state is CatalogState.OK:
        try:
            with closing(Catalog(layout, read_only=True)) as cat:
                names.update(s.name for s in cat.shard_rows())
        except (StoreError, sqlite3.Error):
            pass  # an unreadable catalog: the files' own names still tell swaps and cycles
    return names


def misnamed_intact(layout: Layout, scan: VerifyScan) -> list[ShardCheck]:
    """Checks whose only fault is the file's name or folder, and whose true name is wanted."""
    wanted = wanted_names(layout, scan)
    return [
        c
        for c in scan.shards
        if not c.sound
        and c.digest
        and not c.failed
        and c.entries
        and c.digest in wanted
        and Path(c.path) != layout.shard_path(c.digest)
    ]


def rename_back(layout: Layout, scan: VerifyScan) -> RepairOutcome:
    """Give every misnamed intact shard its content name; what was done, as repair actions."""
    checks = misnamed_intact(layout, scan)
    staged: list[tuple[ShardCheck, Path]] = []
    for c in checks:  # first every file out of the way, so a cycle overwrites nothing
        dest = layout.shard_path(c.digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = dest.with_name(f".{dest.name}.{os.getpid()}.{len(staged)}{STAGING_SUFFIX}")
        os.replace(c.path, stage)
        staged.append((c, stage))
    out = RepairOutcome()
    for c, stage in staged:
        dest = layout.shard_path(c.digest)
        if _holds(dest, c.digest):
            os.unlink(stage)  # the same bytes are already there under their name
            out.actions.append(f"removed {c.path}: a second copy of shard {c.digest}")
            continue
        if os.path.lexists(dest):
            moved = quarantine(layout, dest)
            out.actions.append(f"quarantined {dest} (not the bytes its name promises) -> {moved}")
        os.replace(stage, dest)
        out.actions.append(f"renamed {c.path} back to its content name {c.digest}")
    return out


def _holds(path: Path, digest: str) -> bool:
    """Whether ``path`` is a regular file whose bytes hash to ``digest``."""
    try:
        return path.is_file() and not path.is_symlink() and sha256_file(path) == digest
    except OSError:
        return False
