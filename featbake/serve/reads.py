"""How a dataset finds its items' bytes: one item, a batch in place, the located hit paths.

Every path reads with the store's one read path (:func:`~featbake.store.reader.read_spans`, a
single tensor being a batch of one) from this process's open shards
(:class:`~featbake.store.handles.ShardHandles`, least recently used closed first), and follows
gc by the store's one rule (:func:`~featbake.store.features.relocated`): a shard that vanished
is looked up again in the catalog, and a feature whose shard is gone for good (deleted by hand,
lost in a partial copy) becomes a miss, which the dataset encodes again when it may.

A ``None`` from a batch path means "take the general path", never "not stored".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from featbake.errors import ShardMissing, StoreError
from featbake.serve.collate import PaddedBatch, alloc_batch
from featbake.serve.index import Index
from featbake.serve.process import mapped_empty
from featbake.serve.row_pool import read_rows
from featbake.serve.state import Located, ProcessState
from featbake.store.catalog import Location
from featbake.store.features import read_locations, relocated
from featbake.store.layout import Layout
from featbake.store.reader import ShardReader, Span, read_spans
from featbake.store.shard_format import ST_TO_DTYPE, tensor_buffer, tensor_name

__all__ = ["Reads"]


@dataclass(frozen=True)
class _Source:
    """Where one row of a padded batch comes from: a RAM-tier tensor, or a stored tensor."""

    value: torch.Tensor | None
    sid: int
    length: int


class _Plan(NamedTuple):
    """A padded batch to fill: each row's source, and the shape and dtype all rows share."""

    sources: list[_Source]
    trailing: tuple[int, ...]
    dtype: torch.dtype


class Reads:
    """The read paths over one dataset's :class:`Index`; stateless but for shard paths.

    Process state (handles, flags, counters) is passed in: this object crosses pickling.
    """

    def __init__(self, index: Index, layout: Layout) -> None:
        self.index = index
        self.layout = layout
        self._paths: list[Path] = []

    def shard_path(self, sid: int) -> Path:
        paths = self._paths
        names = self.index.shard_names
        while len(paths) < len(names):
            paths.append(self.layout.shard_path(names[len(paths)]))
        return paths[sid]

    def _open(self, st: ProcessState, sid: int) -> tuple[Path, ShardReader]:
        """The reader of shard ``sid``; one dict lookup when it is open already.

        Raises:
            ShardMissing: the file is gone.
        """
        path = self.shard_path(sid)
        reader = st.open_readers.get(path)
        if reader is None:
            reader = st.reader(path)
        elif path is not st.last_path:  # keep the LRU order, with one C call per switch
            st.open_readers.move_to_end(path)
            st.last_path = path
        return path, reader

    # -- one item -----------------------------------------------------------------------------
    def one(self, st: ProcessState, i: int, sid: int) -> Any:
        """Item ``i`` from shard ``sid``; None when the store no longer has it."""
        ix = self.index
        try:
            path, reader = self._open(st, sid)
            key = ix.key(i)
            check = st.check_always or (st.check_first and not st.verified[i])
            mode = "always" if check else "never"
            parts = ix.parts
            value: Any
            if parts == ("",) and st.use_lru:
                value = self._read_owned(reader, key, check)
            elif parts == ("",):
                value = reader.read(key, verify=mode)
                self.remember(st, i, sid, path, reader)
            elif parts is not None:
                value = {p: reader.read(tensor_name(key, p), verify=mode) for p in parts}
            else:
                value = self.located_value(st, self.locate(st, key))
        except ShardMissing:
            # gc compacted or dropped the shard after the index was built: look it up again.
            st.handles.forget(self.shard_path(sid))
            return self.relocate(st, i)
        if check:
            st.verified[i] = 1
        st.store_reads += 1
        return value

    @staticmethod
    def _read_owned(reader: ShardReader, key: str, check: bool) -> torch.Tensor:
        """A tensor in its own mapping, for the RAM tier (see ``mapped_empty``)."""
        info = reader.tensors.get(key)
        dtype = ST_TO_DTYPE.get(info.dtype) if info is not None else None
        if info is None or dtype is None:
            return reader.read(key, verify="always" if check else "never")  # raises StoreCorrupt
        value = mapped_empty(info.shape, dtype)
        reader.read_into(key, value, verify=check)
        return value

    def remember(self, st: ProcessState, i: int, sid: int, path: Path, reader: ShardReader) -> None:
        """Record where item ``i``'s tensor lies, for the located hit paths."""
        info = reader.tensors.get(self.index.key(i))
        dtype = ST_TO_DTYPE.get(info.dtype) if info is not None else None
        if info is not None and dtype is not None:
            st.loc[i] = Located(
                sid, path, reader, info.begin, info.end - info.begin, dtype, info.shape
            )

    @staticmethod
    def locate(st: ProcessState, key: str) -> list[Location]:
        """The catalog's current locations of ``key`` (empty: not stored)."""
        with st.catalogs.scoped() as catalog:
            return catalog.locate(key)

    def located_value(self, st: ProcessState, locs: Sequence[Location]) -> Any:
        """A feature read from catalog locations ``locs``: its tensor, or a dict of parts.

        Raises:
            ShardMissing: the catalog has no location, or a shard it names is gone.
        """
        if not locs:
            raise ShardMissing("the feature is no longer in the store")
        value = read_locations(locs, lambda shard: self._open(st, self.index.sid(shard))[1])
        return value[""] if list(value) == [""] else value

    def relocate(self, st: ProcessState, i: int) -> Any:
        """Item ``i`` looked up again in the catalog (:func:`relocated`); None: a miss."""
        ix = self.index
        got = relocated(
            ix.key(i),
            functools.partial(self.locate, st),
            functools.partial(self.located_value, st),
        )
        if got is None:
            ix.shard[i] = -1
            return None
        locs, value = got
        ix.shard[i] = ix.sid(locs[0].shard)
        if ix.parts is None:
            ix.parts = tuple(loc.part for loc in locs)
        st.store_reads += 1
        return value

    # -- reads to come ------------------------------------------------------------------------
    def will_need(self, st: ProcessState, idx: Sequence[int]) -> int:
        """Start reading stored items ``idx`` into the page cache, without waiting for them.

        A hint (:meth:`ShardReader.will_need`); returns how many tensors had reads started.
        Items in the RAM tier, misses, and items whose parts are not known yet are skipped. A
        shard is opened (its header read) only while this process has room for another open
        one, so a hint never closes a shard a read in progress uses; a shard that cannot be
        opened is skipped, and its item's read reports why.
        """
        ix = self.index
        parts = ix.parts
        if parts is None:
            return 0
        readers = st.open_readers
        started = 0
        for i in idx:
            sid = int(ix.shard[i])
            if sid < 0 or (st.use_lru and i in st.lru):
                continue
            path = self.shard_path(sid)
            reader = readers.get(path)
            if reader is None:
                # A bucket store's shard not open yet would be fetched whole here: a hint never
                # waits for that (read by ranges, opening reads its header, and GETs start).
                remote = self.layout.remote
                if len(readers) >= st.handles.max_open or (
                    remote is not None and not remote.reads_ranged()
                ):
                    continue
                try:
                    reader = st.reader(path)
                except StoreError:  # ShardMissing, StoreCorrupt: the read itself says so
                    continue
            key = ix.key(i)
            started += sum(reader.will_need(tensor_name(key, p)) for p in parts)
        return started

    # -- a batch in place ---------------------------------------------------------------------
    def padded_located(self, st: ProcessState, idx: list[int]) -> PaddedBatch | None:
        """The hit path of a batch whose items were all read (and checked) before here.

        One pread per item straight into its row of the batch, no per-item tensor or view;
        None (take the general path) if any item is not located, not yet checked, or moved.
        """
        locs = st.loc
        readers = st.open_readers
        shard = self.index.shard
        verified = st.verified
        check_first = st.check_first
        first = locs[idx[0]]
        if first is None or not first.shape:
            return None
        dtype, trailing = first.dtype, first.shape[1:]
        got: list[Located] = []
        for i in idx:
            loc = locs[i]
            if (
                loc is None
                or (check_first and not verified[i])
                or readers.get(loc.path) is not loc.reader
                or shard[i] != loc.sid
                or loc.dtype is not dtype
                or loc.shape[1:] != trailing
            ):
                return None
            got.append(loc)
        lengths = [loc.shape[0] for loc in got]
        padded = alloc_batch(torch.empty(0, dtype=dtype), (len(idx), max(lengths), *trailing))
        flat = np.asarray(tensor_buffer(padded))
        row_bytes = padded[0].nbytes
        touch = st.touch
        last = st.last_path
        spans = []
        for j, (i, loc) in enumerate(zip(idx, got, strict=True)):
            if loc.path is not last:  # keep the handles' LRU order
                readers.move_to_end(loc.path)
                last = st.last_path = loc.path
            start, end = j * row_bytes, j * row_bytes + loc.nbytes
            spans.append(
                Span(loc.reader, loc.offset, flat[start:end], flat[end : start + row_bytes], None)
            )
            touch(i)
        read_rows(spans, padded.nbytes)
        st.store_reads += len(idx)
        return PaddedBatch.of(padded, lengths)

    def padded(self, st: ProcessState, idx: list[int]) -> PaddedBatch | None:
        """The batch read in place into a padded tensor, or None to take the general path."""
        if not st.use_lru and not st.check_always:
            batch = self.padded_located(st, idx)
            if batch is not None:
                return batch
        shard = self.index.shard
        if st.use_lru:
            if any(shard[i] < 0 and i not in st.lru for i in idx):
                return None  # a miss: checked before any lookup so hits are counted once
        elif (shard[idx] < 0).any():
            return None
        plan = self._plan(st, idx)
        return self._fill(st, idx, plan) if plan is not None else None

    def _plan(self, st: ProcessState, idx: list[int]) -> _Plan | None:
        """Each row's source, if all rows share trailing shape and dtype; else None."""
        out: list[_Source] = []
        want: tuple[tuple[int, ...], torch.dtype | None] | None = None
        for i in idx:
            value = st.lru.get(i) if st.use_lru else None
            sid = int(self.index.shard[i])
            if value is not None:
                shape, dtype = tuple(value.shape), value.dtype
            else:
                if sid < 0:
                    return None
                try:
                    _, reader = self._open(st, sid)
                except ShardMissing:
                    return None
                info = reader.tensors.get(self.index.key(i))
                if info is None:
                    return None
                shape, dtype = info.shape, ST_TO_DTYPE.get(info.dtype)
            if not shape or dtype is None:
                return None
            if want is None:
                want = (shape[1:], dtype)
            elif (shape[1:], dtype) != want:
                return None
            out.append(_Source(value, sid, shape[0]))
        assert want is not None and want[1] is not None
        return _Plan(out, want[0], want[1])

    def _fill(self, st: ProcessState, idx: list[int], plan: _Plan) -> PaddedBatch | None:
        """Fill a padded batch: RAM-tier rows copied here, stored rows read by ``run_rows``.

        Every shard is opened (and every row's check decided) before any read, on this thread;
        the reads run on the read pool, into byte slices of the batch (no torch op per row: one
        would wake torch's OpenMP threads, which then spin on the CPUs the readers need); what
        was read is recorded here after.
        """
        lengths = [s.length for s in plan.sources]
        t_max = max(lengths)
        padded = alloc_batch(torch.empty(0, dtype=plan.dtype), (len(idx), t_max, *plan.trailing))
        flat = np.asarray(tensor_buffer(padded))
        step_bytes = padded[0][0].nbytes if t_max else 0  # one time step of one row
        row_bytes = step_bytes * t_max
        read: list[_RowRead] = []
        for j, (i, src) in enumerate(zip(idx, plan.sources, strict=True)):
            if src.value is not None:
                padded[j, : src.length].copy_(src.value)
                padded[j, src.length :].zero_()
                continue
            try:
                path, reader = self._open(st, src.sid)
            except ShardMissing:
                return None  # moved meanwhile: the general path relocates it
            check = bool(st.check_always or (st.check_first and not st.verified[i]))
            start, end = j * row_bytes, j * row_bytes + src.length * step_bytes
            dest, tail = flat[start:end], flat[end : start + row_bytes]
            read.append(_RowRead(i, src.sid, path, reader, j, dest, tail, check))
        if all(st.open_readers.get(r.path) is r.reader for r in read):
            read_rows(read, padded.nbytes, self._span)
        elif not self._read_each(st, read):
            return None
        for r in read:
            self.remember(st, r.i, r.sid, r.path, r.reader)
            if r.check:
                st.verified[r.i] = 1
            if st.use_lru:  # the RAM tier owns its copy, not a view of this batch
                row = padded[r.row, : lengths[r.row]]
                st.lru.put(r.i, mapped_empty(row.shape, row.dtype).copy_(row))
        st.store_reads += len(read)
        for i in idx:
            st.touch(i)
        return PaddedBatch.of(padded, lengths)

    def _span(self, r: _RowRead) -> Span:
        return r.reader.span(self.index.key(r.i), r.dest, verify=r.check, tail=r.tail)

    def _read_each(self, st: ProcessState, read: list[_RowRead]) -> bool:
        """Read the rows one by one, each shard opened just before its read (False: one moved).

        For a batch over more shards than this process keeps open: opening the last ones
        closed the first before their rows were read.
        """
        for j, r in enumerate(read):
            try:
                path, reader = self._open(st, r.sid)
            except ShardMissing:
                return False
            read[j] = r = r._replace(path=path, reader=reader)
            read_spans((self._span(r),))
        return True


class _RowRead(NamedTuple):
    """A stored row of a padded batch: item, shard and its reader, where its bytes go in the
    batch (``dest``, then the padding ``tail``), and whether its checksum is checked."""

    i: int
    sid: int
    path: Path
    reader: ShardReader
    row: int
    dest: np.ndarray
    tail: np.ndarray
    check: bool
