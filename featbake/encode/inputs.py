"""Where a build's inputs live: a local folder, or a prefix in a bucket (``s3://bucket/audio/``).

The build (and its parts) ask one :class:`Inputs` for everything that differs between the two:
the name a root is keyed by, the sorted listing, each input's path and size, the digests through
the hash cache, and the source that decodes them. Keys do not depend on the place: the same
bytes in a folder and in a bucket give the same key, so their features are stored once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

from featbake.encode.fingerprints import hash_inputs, resolve_path
from featbake.encode.held import HeldBytes
from featbake.encode.sources import ScanResult, Source, scan_inputs
from featbake.progress import Progress
from featbake.store.catalog import FileStat, HashCache
from featbake.store.remote.url import is_url


class Inputs(Protocol):
    """A data location as a build sees it (see :func:`inputs_at`)."""

    @property
    def where(self) -> str:
        """The location as roots and reports name it: a resolved folder, or a bucket URL."""
        ...

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The inputs with one of ``extensions`` (relative names, sorted) and files skipped."""
        ...

    def path(self, rel: str) -> str:
        """The full name of input ``rel``: what messages, the hash cache and decoders use."""
        ...

    def size(self, rel: str) -> int:
        """Input ``rel``'s size in bytes (0 if unknown), to balance a build's parts."""
        ...

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(path -> SHA-256, path -> why it could not be read), as :func:`hash_inputs` says."""
        ...

    @property
    def stat_tells_change(self) -> bool:
        """Whether one ``stat`` of an input tells that it changed (``revalidate=True``)."""
        ...

    def source(self, inner: Source) -> Source:
        """``inner`` (the recipe's source), made to read inputs from this place."""
        ...


class Folder:
    """Inputs in a local folder, scanned recursively (see :func:`scan_inputs`)."""

    def __init__(self, data: str | os.PathLike[str]) -> None:
        self.folder = resolve_path(data)

    @property
    def where(self) -> str:
        return self.folder

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        return scan_inputs(self.folder, extensions)

    def path(self, rel: str) -> str:
        return os.path.join(self.folder, rel)

    def size(self, rel: str) -> int:
        try:
            return os.stat(self.path(rel)).st_size
        except OSError:
            return 0  # it fails, with its reason, in the part that hashes it

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        return hash_inputs(catalog, paths, progress, stats, held)

    @property
    def stat_tells_change(self) -> bool:
        return True

    def source(self, inner: Source) -> Source:
        return inner


def inputs_at(data: str | os.PathLike[str]) -> Inputs:
    """The inputs at ``data``: a folder, or a bucket prefix for an ``s3://`` URL.

    Raises:
        ConfigError: a URL of a scheme featbake does not speak.

    Example:
        >>> inputs_at("s3://team/audio/").where
        's3://team/audio'
    """
    where = os.fspath(data)
    if is_url(where):
        from featbake.encode.bucket_inputs import BucketInputs

        return BucketInputs.at(where)
    return Folder(where)
