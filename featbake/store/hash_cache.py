"""The hash cache's records and its trust rule: when a remembered digest still vouches for a file.

A build hashes every input once and remembers (path, stat, digest) in the catalog's ``hash_cache``
table (:meth:`featbake.store.catalog.FeatureRows.cached_hashes`); the next build trusts a row
only while the file's :class:`FileStat` is unchanged and the row is not "racy" (recorded too soon
after the file's last change to notice a later write: git's index has the same rule). The encode
layer sees the cache through :class:`HashCache` alone: the catalog's, or a stand-in's that seals
its rows into fragments.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

#: A cached hash is "racy" when its file's mtime lies within this long of the moment the hash was
#: recorded: a write in that window can leave (size, mtime, ctime, inode) unchanged on file systems
#: with coarse timestamps (git's index has the same rule, with the same one-second margin).
RACY_NS = 1_000_000_000
#: Stamps in whole seconds may come from a file system that keeps them to 2 s (FAT, where ctime
#: is mtime): a write up to 2 s after the stamp's tick keeps the whole stat, so such an entry is
#: racy for twice :data:`RACY_NS` (a finer file system's stamps are whole seconds only by chance,
#: and then cost one more read at most).
COARSE_RACY_FACTOR = 2


def racy_window_ns(mtime_ns: int, ctime_ns: int) -> int:
    """How long after a file's stamps a hash recorded still cannot vouch for it: the stamps'
    tick (git's racy rule, which compares with its index file's own stamp, of the same tick)."""
    if mtime_ns % 1_000_000_000 == 0 and ctime_ns % 1_000_000_000 == 0:
        return RACY_NS * COARSE_RACY_FACTOR
    return RACY_NS


#: Hash-cache ids under which encoder fingerprints are cached (``encoder-fp:file:PATH``, ...).
ENCODER_FP_PREFIX = "encoder-fp:"


class FileStat(NamedTuple):
    """What the hash cache compares to say a file is unchanged since it was hashed.

    ``ctime_ns`` is there because no user tool can set it: ``cp -p`` (or unpacking an archive
    with fixed dates) over an existing file keeps its size, mtime and inode, but not its ctime.
    (A NamedTuple, not a dataclass: a million of them are made when a large folder is indexed.)
    """

    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int = 0

    @classmethod
    def of(cls, path: str | os.PathLike[str] | int) -> FileStat:
        """The stat of ``path``, or of the file an open descriptor names."""
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def racy(self, recorded_ns: int) -> bool:
        """True if a hash recorded at ``recorded_ns`` cannot vouch for this stat.

        A file modified within :data:`RACY_NS` of the recording (2 s for stamps in whole
        seconds, :func:`racy_window_ns`; or "in the future", a clock skew) may have changed
        after it was read without its stat changing.
        """
        window = racy_window_ns(self.mtime_ns, self.ctime_ns)
        return max(self.mtime_ns, self.ctime_ns) > recorded_ns - window


class HashEntry(NamedTuple):
    """A trusted hash-cache entry: the file's stat when it was hashed, and its digest."""

    stat: FileStat
    sha256: str


class HashRow(NamedTuple):
    """One row to remember in the hash cache: ``path`` with ``stat`` hashed to ``sha256``."""

    path: str
    stat: FileStat
    sha256: str


class HashCache(Protocol):
    """The hash cache as builds and datasets use it: the catalog's, or that of a stand-in that
    writes fragments (a rank of a sharded build, a serving process on a shared filesystem)."""

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]: ...

    def put_hashes(self, rows: Iterable[HashRow], *, recorded_ns: int | None = None) -> None: ...


class HashCacheRow(NamedTuple):
    """A ``hash_cache`` row as stored (``ctime_ns`` and ``recorded_ns`` are 0 in old rows)."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int
    sha256: str
    recorded_ns: int

    @classmethod
    def of(cls, path: str, stat: FileStat, sha256: str, recorded_ns: int) -> HashCacheRow:
        """The row: ``path`` with ``stat`` hashed to ``sha256``, stat taken at ``recorded_ns``."""
        return cls(path, stat.size, stat.mtime_ns, stat.inode, stat.ctime_ns, sha256, recorded_ns)

    @property
    def stat(self) -> FileStat:
        return FileStat(self.size, self.mtime_ns, self.inode, self.ctime_ns)

    def trusted(self) -> HashEntry | None:
        """The entry, or None if it is racy or predates ctime (then the file is hashed again)."""
        return trusted_entry(self)


def trusted_entry(row: tuple) -> HashEntry | None:
    """:meth:`HashCacheRow.trusted` of a raw row (the loop of a large folder's lookup)."""
    _, size, mtime, inode, ctime, sha, recorded = row
    if recorded <= 0 or ctime <= 0 or max(mtime, ctime) > recorded - racy_window_ns(mtime, ctime):
        return None
    return HashEntry(FileStat(size, mtime, inode, ctime), sha)
