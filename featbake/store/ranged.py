"""Reading a shard in a bucket by ranges, without fetching it (see the comment below): the
:class:`RangedShardReader` a bucket store hands its readers when its tier cannot hold the store."""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from featbake.errors import ShardDamaged, StoreCorrupt
from featbake.process import PerProcess
from featbake.store.shard import (
    MAX_HEADER_BYTES,
    ShardHeader,
    ShardReader,
    SpanCheck,
    VerifyMode,
    damaged_object,
    parse_header,
)

# Reading a shard in a bucket without fetching it: its header once, then each tensor's bytes
# with one ranged GET (HTTP ``Range``), checked with the shard format's CRC like every read.
#
# Used when the local tier cannot hold what the store holds (see
# :meth:`featbake.store.bucket.BucketStore.reads_ranged`): a shuffled epoch over shards
# that keep being evicted would download each shard many times over (bench_bucket: 234 shard
# downloads for 400 items over 8 shards with a 3-shard budget), while a ranged GET moves one
# item's bytes. A span whose bytes fail their CRC is fetched once more, then the error names
# the object.
#: (start, length) -> the object's bytes there (fewer at its end).
RangeGet = Callable[[int, int], bytes]

#: Ranged GETs in flight for read-ahead, per process (their latency overlaps; boto3's client
#: is shared by threads).
AHEAD_THREADS = 8
#: Read-ahead spans one reader keeps before dropping the oldest (each holds one tensor's bytes).
MAX_AHEAD = 256
#: Bytes of a shard's start read to open it: its header in one GET when it fits (a header of
#: a few hundred tensors does; a longer one takes a second GET).
HEADER_GUESS = 64 << 10
#: Hinted items (read by ranges) before the read reaches a shard's first hinted item that its
#: grouped GET is started: late enough that the hints past it have named more of the shard's
#: items, early enough that the GET is in by the read (8 GETs in flight).
LEAD = 16
#: Hinted spans of one shard closer than this are fetched by one GET, the bytes between them
#: thrown away: on moto a GET costs ~3.5 ms and 2 MiB more of its body ~1.2 ms (S3's first
#: byte takes tens of ms), so a request saved is worth megabytes moved.
GAP_BYTES = 4 << 20

_POOL: PerProcess[ThreadPoolExecutor] = PerProcess(
    lambda: ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="featbake-ranged"), lock=True
)


class Ahead(NamedTuple):
    """A hinted span's bytes: the grouped GET that brings them, where they start in its body,
    how many, and the span's place in the hint order."""

    got: Future[bytes]
    offset: int
    length: int
    seq: int


class Hinted(NamedTuple):
    """A hinted span not asked of the bucket yet: its end and its place in the hint order."""

    end: int
    seq: int


class AheadQueue:
    """This process's hinted spans read by ranges, across readers (see :data:`LEAD`).

    The hints come in the order the reads will (the loader's sampler order), each span numbered
    as it comes; ``read`` is the number of the last span a read took. A reader's hinted spans
    wait until its first one is within :data:`LEAD` of ``read``, then go in one GET per run of
    spans (:func:`grouped`): a shuffled epoch asks each shard once per window it is read in,
    not once per item."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0  # spans hinted so far
        self.read = 0  # the number of the last hinted span a read took
        self.waiting: dict[RangedShardReader, int] = {}  # reader -> its first unasked span

    def start_due(self) -> None:
        """Start the grouped GETs of the readers whose first unasked span is near (lock held)."""
        due = [r for r, first in self.waiting.items() if first <= self.read + LEAD]
        for reader in due:
            reader.start_hinted()


_QUEUE: PerProcess[AheadQueue] = PerProcess(AheadQueue, lock=True)


def grouped(spans: list[tuple[int, int]], gap: int = GAP_BYTES) -> list[list[tuple[int, int]]]:
    """``(begin, end)`` spans sorted by begin, in runs whose neighbours are at most ``gap``
    bytes apart: each run is one GET."""
    runs: list[list[tuple[int, int]]] = []
    for span in sorted(spans):
        if runs and span[0] - max(e for _, e in runs[-1]) <= gap:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def head_ahead(get: RangeGet) -> Future[bytes]:
    """The GET of a shard's first :data:`HEADER_GUESS` bytes, started on the read-ahead threads
    (a hint names several shards before any is opened: their headers' GETs overlap)."""
    return _POOL.get().submit(get, 0, HEADER_GUESS)


class RangedShardReader(ShardReader):
    """A :class:`ShardReader` over a shard object, read by ranges (see the comment above).

    Args:
        path: the shard's path in the local tier (its name there; no file is made).
        get: reads a byte range of the object.
        size: the object's size.
        where: the object's URL, for messages.
    """

    reads_descriptor = False  # its bytes come by ranged GETs: the Python read path

    def __init__(
        self,
        path: Path,
        get: RangeGet,
        size: int,
        where: str,
        verify: VerifyMode | str,
        head: Future[bytes] | None = None,
    ) -> None:
        self.path = Path(path)
        self._head = head  # the GET of its first HEADER_GUESS bytes, started ahead (or None)
        self.verify = VerifyMode.parse(verify)
        self._fd = -1
        self._get = get
        self._size = size
        self.where = where
        header = self._read_header()
        self.metadata, self.tensors = header.metadata, header.tensors
        self.version = self.metadata["format_version"]
        self._verified: set[str] = set()
        self._ahead: OrderedDict[int, Ahead] = OrderedDict()  # begin -> its asked bytes
        self._hinted: dict[int, Hinted] = {}  # begin -> a hinted span not asked yet

    def _read_header(self, *, cut_ok: bool = False) -> ShardHeader:
        # most headers fit: one GET, not two (started ahead when a hint named the shard)
        head = self._head.result() if self._head is not None else self._get(0, HEADER_GUESS)
        self._head = None
        if len(head) < 8:
            raise self.damaged("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES or 8 + n > self._size:
            raise self.damaged(f"header length {n} does not fit its {self._size} bytes")
        raw = head[8 : 8 + n] if len(head) >= 8 + n else self._get(8, n)
        if len(raw) != n:
            raise self.damaged("the header is cut short")
        try:
            return parse_header(self.path, raw, 8 + n, self._size, cut_ok=cut_ok)
        except ShardDamaged as e:  # worded for a file: the object's place and fix instead
            raise self.damaged(e.why) from None

    def damaged(self, why: str) -> ShardDamaged:
        """The error names the bucket's object and its fix (delete it, build again), not the
        tier's path nor ``verify --repair`` (a directory's, refused on a bucket)."""
        return damaged_object(self.where, why)

    def lacking(self, name: str) -> StoreCorrupt:
        return self.damaged(f"it holds no tensor {name}, which the catalog names in it")

    def _read_bytes(self, begin: int, dest: Any) -> int:
        queue = _QUEUE.get()
        with queue.lock:
            if begin in self._hinted:
                self.start_hinted()  # needed now: with every span of this shard hinted so far
            ahead = self._ahead.pop(begin, None)
            if ahead is not None:
                queue.read = max(queue.read, ahead.seq)
                queue.start_due()
        if ahead is not None:
            data = memoryview(ahead.got.result())[ahead.offset : ahead.offset + ahead.length]
        else:
            data = memoryview(self._get(begin, dest.nbytes))
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
        except ShardDamaged:
            try:
                super().read_span(begin, dest, check)
            except ShardDamaged as e:
                raise self.damaged(f"{e.why}, on two reads") from e

    def unlinked(self) -> bool:
        return False  # nothing on disk

    def will_need(self, name: str) -> bool:
        """Note tensor ``name``'s span as coming: it is fetched with the shard's other hinted
        spans by one ranged GET on this process's read-ahead threads once the reads near it
        (:class:`AheadQueue`), and the read takes its bytes from there. True when noted."""
        info = self.tensors.get(name)
        if info is None:
            return False
        queue = _QUEUE.get()
        with queue.lock:
            if info.begin in self._ahead or info.begin in self._hinted:
                return False
            while self._ahead and len(self._ahead) + len(self._hinted) >= MAX_AHEAD:
                self._ahead.popitem(last=False)  # hints never read: keep memory bounded
            if len(self._hinted) >= MAX_AHEAD:
                return False
            queue.seq += 1
            self._hinted[info.begin] = Hinted(info.end, queue.seq)
            queue.waiting.setdefault(self, queue.seq)  # started by the reads (start_due)
        return True

    def start_hinted(self) -> None:
        """Ask the bucket for every hinted span of this shard not asked yet, one GET per run
        of nearby spans (:func:`grouped`; the queue's lock held)."""
        hinted, self._hinted = self._hinted, {}
        _QUEUE.get().waiting.pop(self, None)
        for run in grouped([(b, h.end) for b, h in hinted.items()]):
            start, stop = run[0][0], max(e for _, e in run)
            got = _POOL.get().submit(self._get, start, stop - start)
            for b, e in run:
                self._ahead[b] = Ahead(got, b - start, e - b, hinted[b].seq)

    def close(self) -> None:
        queue = _QUEUE.get()
        with queue.lock:
            queue.waiting.pop(self, None)
            self._hinted.clear()
