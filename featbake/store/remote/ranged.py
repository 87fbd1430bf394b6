"""Reading a shard in a bucket without fetching it: its header once, then each tensor's bytes
with one ranged GET (HTTP ``Range``), checked with the shard format's CRC like every read.

Used when the local tier cannot hold what the store holds (see
:meth:`featbake.store.remote.store.BucketStore.reads_ranged`): a shuffled epoch over shards
that keep being evicted would download each shard many times over (bench_bucket: 234 shard
downloads for 400 items over 8 shards with a 3-shard budget), while a ranged GET moves one
item's bytes. A span whose bytes fail their CRC is fetched once more, then the error names
the object.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from featbake.errors import StoreCorrupt
from featbake.store.reader import ShardReader, SpanCheck, VerifyMode
from featbake.store.shard_format import MAX_HEADER_BYTES
from featbake.store.shard_header import corrupt_shard, parse_header

#: (start, length) -> the object's bytes there (fewer at its end).
RangeGet = Callable[[int, int], bytes]


class RangedShardReader(ShardReader):
    """A :class:`ShardReader` over a shard object, read by ranges (see the module docstring).

    Args:
        path: the shard's path in the local tier (its name there; no file is made).
        get: reads a byte range of the object.
        size: the object's size.
        where: the object's URL, for messages.
    """

    def __init__(
        self, path: Path, get: RangeGet, size: int, where: str, verify: VerifyMode | str
    ) -> None:
        self.path = Path(path)
        self.verify = VerifyMode.parse(verify)
        self._fd = -1
        self._get = get
        self._size = size
        self.where = where
        self.metadata, self.tensors = self._read_header()
        self.version = self.metadata["format_version"]
        self._verified: set[str] = set()

    def _read_header(self) -> tuple[dict[str, str], dict[str, Any]]:
        head = self._get(0, 8)
        if len(head) < 8:
            raise corrupt_shard(self.path, f"{self.where} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > self._size:
            raise corrupt_shard(self.path, f"header length {n} does not fit {self.where}")
        raw = self._get(8, n)
        if len(raw) != n:
            raise corrupt_shard(self.path, f"the header of {self.where} is cut short")
        return parse_header(self.path, raw, 8 + n, self._size)

    def _read_bytes(self, begin: int, dest: Any) -> int:
        data = self._get(begin, dest.nbytes)
        got = np.frombuffer(data, dtype=np.uint8)
        dest.reshape(-1)[: got.size] = got
        return got.size

    def read_span(self, begin: int, dest: Any, check: SpanCheck | None = None) -> None:
        """One ranged GET (and its check); a CRC mismatch is fetched once more.

        Raises:
            StoreCorrupt: the bytes fail their checksum twice (the message names the object).
        """
        try:
            super().read_span(begin, dest, check)
        except StoreCorrupt:
            try:
                super().read_span(begin, dest, check)
            except StoreCorrupt as e:
                raise StoreCorrupt(
                    f"{self.where}: {e} on two reads: the object is damaged in the bucket and "
                    "its bytes are not served; delete it, then build again"
                ) from e

    def unlinked(self) -> bool:
        return False  # nothing on disk

    def will_need(self, name: str) -> bool:
        return False  # no page cache to warm: the bytes come with the read

    def close(self) -> None:
        return None
