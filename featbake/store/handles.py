"""A per-process LRU of open shard readers, bounded in open files and reset after fork."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from featbake.errors import ShardMissing
from featbake.perprocess import ProcessStamp
from featbake.store.layout import RemotePlace
from featbake.store.reader import ShardReader, VerifyMode


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
            if self.remote.fetch_shard(path.name.removesuffix(".safetensors")) is None:
                raise
            reader = ShardReader(path, verify=self.verify)
        self.remote.opened(path)
        return reader

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
