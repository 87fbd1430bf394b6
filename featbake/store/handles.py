"""A per-process LRU of open shard readers, bounded in open files and reset after fork."""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from featbake.errors import ShardMissing
from featbake.perprocess import ProcessStamp
from featbake.store.layout import RemotePlace
from featbake.store.reader import ShardReader, VerifyMode

#: A bucket store's process looks for evicted files among its open readers at least this often
#: (on every fetch, and at most once a second on other opens: up to 64 ``fstat`` calls).
TEND_SECONDS = 1.0


#: Fetches of one shard a reader tries when the node's other processes keep evicting it between
#: the fetch and the open (a tier far too small for its readers).
FETCH_TRIES = 3


class ShardHandles:
    """A per-process cache of open :class:`ShardReader` objects, bounded in open files.

    After ``fork`` (DataLoader workers) the child drops its parent's handles and opens its own.
    With a ``remote`` (a bucket store), a shard missing from the local tier is fetched first.
    """

    def __init__(
        self,
        max_open: int = 64,
        verify: VerifyMode | str = VerifyMode.FIRST,
        remote: RemotePlace | None = None,
    ) -> None:
        self.max_open = max_open
        self.remote = remote
        self._tended = 0.0
        self.verify = VerifyMode.parse(verify)  # a ConfigError now, not at the first read
        self._readers: OrderedDict[Path, ShardReader] = OrderedDict()
        self._stamp = ProcessStamp()

    def get(self, path: Path) -> ShardReader:
        """An open reader for ``path``, opening (and evicting the least recent) as needed."""
        if self._stamp.stale:
            # The parent's readers are its bookkeeping, but the fds are this process's own
            # copies: close them, or each forked worker keeps up to max_open files open.
            for r in self._readers.values():
                r.close()
            self._readers = OrderedDict()
            self._stamp = ProcessStamp()
        reader = self._readers.get(path)
        if reader is not None:
            self._readers.move_to_end(path)
            return reader
        reader = self._open(path)
        self._readers[path] = reader
        while len(self._readers) > self.max_open:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def _open(self, path: Path) -> ShardReader:
        """A new reader of ``path``; from a bucket store, fetched into its tier when missing.

        Raises:
            ShardMissing: the shard is gone (from the bucket too).
        """
        if self.remote is None:
            return ShardReader(path, verify=self.verify)
        try:
            reader = ShardReader(path, verify=self.verify)
        except ShardMissing:
            name = path.name.removesuffix(".safetensors")
            ranged = self.remote.ranged_reader(name, path, self.verify)
            if ranged is not None:
                return ranged
            reader = self._fetched(name, path)
        else:
            if time.monotonic() - self._tended > TEND_SECONDS:  # another process's evictions
                self._tend_tier(self.remote)
        self.remote.opened(path)
        return reader

    def _fetched(self, name: str, path: Path) -> ShardReader:
        """A reader of shard ``name`` fetched into the tier. Another process of the node may
        evict it between the fetch and the open (the tier is shared): fetched again then, not
        taken for a shard gone from the store.

        Raises:
            ShardMissing: the bucket has no such shard, or it kept vanishing.
        """
        assert self.remote is not None
        for attempt in range(FETCH_TRIES):
            self._tend_tier(self.remote)  # before the fetch evicts: see _tend_tier
            if self.remote.fetch_shard(name, self._close_evicted) is None:
                raise ShardMissing(f"shard {name} is gone from {self.remote} (deleted by gc)")
            try:
                return ShardReader(path, verify=self.verify)
            except ShardMissing:
                if attempt == FETCH_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _tend_tier(self, remote: RemotePlace) -> None:
        """Before a bucket store's tier may evict for a new shard: close the readers of files it
        evicted (an open file keeps its disk space, beyond the tier's budget), and stamp the
        rest as used (a reader held open all epoch reads its shard, unseen by file times), in
        the order this process used them."""
        self._tended = time.monotonic()
        self._close_evicted()
        # Least recently used first, 1 us apart: file times come from a coarse clock, so one
        # stamp for all would tie them, and ties evict by name (the current shards too).
        # (What RemotePlace.opened does, with the time given.)
        now = time.time_ns() - len(self._readers) * 1000
        for k, path in enumerate(self._readers):
            with contextlib.suppress(OSError):  # a ranged reader's shard has no file here
                os.utime(path, ns=(now + k * 1000,) * 2)

    def _close_evicted(self) -> None:
        """Close the readers of files the tier unlinked (their space is freed only then)."""
        for path, reader in list(self._readers.items()):
            if reader.unlinked():
                del self._readers[path]
                reader.close()

    @property
    def open_readers(self) -> OrderedDict[Path, ShardReader]:
        """The open readers by path, least recently used first. Read-only but for
        ``move_to_end``: hit paths check a remembered reader with one lookup and, when they
        switch shards, move it to the end to keep the LRU order."""
        return self._readers

    def forget(self, path: Path) -> None:
        """Close and drop the handle of a shard that moved or vanished."""
        reader = self._readers.pop(path, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        while self._readers:
            _, r = self._readers.popitem()
            r.close()

    def __iter__(self) -> Iterator[Path]:
        return iter(self._readers)
