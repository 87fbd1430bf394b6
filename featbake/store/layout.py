"""Where things live inside a store directory, and the file primitives every writer uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from featbake.errors import StoreError


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Layout:
    """Where things live inside a cache directory."""

    root: Path

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.sqlite"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def shard_path(self, name: str) -> Path:
        """``shards/ab/<name>.safetensors`` for a shard named ``ab...``."""
        return self.shards / name[:2] / f"{name}.safetensors"

    def ensure(self) -> Layout:
        """Create the directories, or raise a StoreError that says why it could not."""
        try:
            for d in (self.root, self.shards, self.tmp):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the cache directory {self.root}: {e.strerror}; "
                "choose a writable place with --cache DIR or $FEATBAKE_CACHE"
            ) from e
        return self


def remove_file(path: Path) -> int:
    """Remove a file; its size in bytes, or 0 if it was already gone."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def default_cache_dir() -> Path:
    """``$FEATBAKE_CACHE`` if set, else ``./.featbake``."""
    return Path(os.environ.get("FEATBAKE_CACHE") or ".featbake")
