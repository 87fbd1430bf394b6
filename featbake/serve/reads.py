"""How a dataset finds its items' bytes: one item, a batch in place, the located hit paths.

Every path reads with the store's one read path (:func:`~featbake.store.shard.read_spans`, a
single tensor being a batch of one) from this process's open shards
(:class:`~featbake.store.features.ShardHandles`, least recently used closed first), and follows
gc by the store's one rule (:func:`~featbake.store.features.relocated`): a shard that vanished
is looked up again in the catalog, and a feature whose shard is gone for good (deleted by hand,
lost in a partial copy) becomes a miss, which the dataset encodes again when it may.

A ``None`` from a batch path means "take the general path", never "not stored".
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from featbake.device import process_cpus
from featbake.errors import ConfigError, ShardDamaged, ShardMissing, StoreCorrupt, StoreError
from featbake.native import kernels
from featbake.process import PerProcess
from featbake.quantize import (
    SCALE_BYTES,
    PackedRows,
    ScaleSpan,
    Scheme,
    Unpacked,
    damaged_positions,
    dequantize_native,
    dequantize_unpacked,
    unpack,
)
from featbake.recipe import Recipe, stored_dtypes
from featbake.serve.collate import PaddedBatch, alloc_batch
from featbake.serve.index import Index
from featbake.serve.state import Located, ProcessState, mapped_empty
from featbake.store.catalog import Location
from featbake.store.features import relocated
from featbake.store.fidelity import SERVED, recorded_serve_dtype
from featbake.store.layout import Layout
from featbake.store.open import place_of
from featbake.store.place import damaged_shard
from featbake.store.shard import (
    ST_TO_DTYPE,
    Leases,
    ShardReader,
    Span,
    SpanCheck,
    TensorInfo,
    native_readable,
    read_leased,
    read_spans,
    tensor_buffer,
    tensor_name,
    unfinite_scale,
)

# == served ========================================================================================
# What a dataset serves from an ``int8`` / ``fp8`` store: dequantised, or raw.
#
# Every read path (located hits, the RAM tier, padded batches, misses) works on the stored form,
# the packed tensor of :mod:`featbake.quantize` (the RAM tier so holds 4x the items float32
# would); :class:`Served` turns it into what the user asked for at the dataset's exits:
#
# * ``dequantize=True`` (the default): ``codes * scale`` in ``serve_dtype`` (float16 unless
#   asked otherwise), shape ``[T, D]`` as a float store would serve it;
# * ``dequantize=False``: the packed ``[T, D + 4]`` tensor as stored, to copy to the GPU as is
#   (a quarter of float32's bytes) and dequantise there with :func:`featbake.quantize.dequantize`.
#   :func:`~featbake.serve.collate.pad_collate` pads packed items with zero rows, whose scale is
#   0, so a padded raw batch dequantises to zeros past each length (leave ``pad_value`` at 0).
#   Its scales are still checked (one strided read of the scale column): a row whose scale is
#   not finite (a damaged shard's) is refused as on the dequantising paths, naming the shard,
#   never handed on to dequantise into NaN or inf on the GPU. An item of one dimension (an
#   encoder's ``[T]``) is one packed row ``[T + 4]``, its scale last: padding it would move the
#   scale, so its batches are lists of the items as ``ds[i]`` serves them, and ``pad_collate``
#   refuses them (serve such a store dequantised to batch it).
#
# No ``inf`` is served from finite features, and no cast rounds coarser than the codes: each item
# and batch is checked against the dtype it is served in (:meth:`ScaleSpan.holds`, a look at one
# scale a row) and refused in one line if it does not fit. Left to choose (``serve_dtype=None``),
# a dataset serves the dtype its build found holds every value (:meth:`Served.for_index`):
# float16, or
# float32 for features past float16's range (~1e7) or below its precision (~1e-6).
#: Dtypes a quantised store may be served in.
SERVE_DTYPES = {name: stored_dtypes()[name] for name in ("float32", "float16", "bfloat16")}


#: The error for a batch whose rows at these positions have a scale that is not finite (the
#: read path's: it names each row's shard and item).
Refusal = Callable[[Sequence[int]], StoreCorrupt]


@dataclass(frozen=True)
class Served:
    """Serves stored items and batches of one scheme: dequantised into one dtype, or as stored
    (``dequantize=False``, ``dtype`` then the packed one); either way a row whose scale is not
    finite is refused."""

    scheme: Scheme
    dtype: torch.dtype
    chosen: bool = True  # the user named the dtype (else the default, or the build's record)
    dequantize: bool = True  # False: the packed tensors as stored, their scales checked

    @classmethod
    def packed(cls, scheme: Scheme) -> Served:
        """Serves ``scheme``'s packed tensors as stored, refusing damaged rows."""
        return cls(scheme, scheme.packed_dtype, chosen=True, dequantize=False)

    def item(self, value: Any) -> Any:
        """An item (a packed tensor, or a dict of them) dequantised, or as stored once its
        scales are checked (``dequantize=False``).

        Raises:
            StoreCorrupt: a row's scale is not finite.
            ConfigError: the item holds values the served dtype cannot (see the module).
        """
        if not self.dequantize:
            for t in [value] if isinstance(value, torch.Tensor) else value.values():
                if damaged_positions(t, self.scheme):
                    raise self.damaged()
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        return {name: self.tensor(t) for name, t in value.items()}

    def tensor(self, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One packed tensor dequantised (into ``out`` if given), its scales checked.

        On the CPU one pass of the compiled kernel where it is built, its scales checked from
        the span it returns (written first: an ``out`` of a refused item is discarded with it).
        """
        if out is None and packed.dim() and packed.shape[-1] >= SCALE_BYTES:
            shape = (*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES)
            out = torch.empty(shape, dtype=self.dtype, device=packed.device)
        span = dequantize_native(packed, self.scheme, out) if out is not None else None
        if span is None:
            parts = self.fitting(unpack(packed, self.scheme))
            return dequantize_unpacked(parts, self.scheme, self.dtype, out)
        self.check(span)
        assert out is not None
        return out

    def fitting(self, parts: Unpacked) -> Unpacked:
        """``parts``, once their row scales are checked to fit the served dtype (:meth:`check`)."""
        self.check(ScaleSpan.of(parts.scales))  # float32 too: a damaged row's scale
        return parts

    def refuse_damaged(self, reader: ShardReader, name: str, value: Any) -> None:
        """Raise if ``value``, tensor ``name`` read as stored from ``reader``, is packed rows of
        this scheme with a scale that is not finite (the error names the shard).

        Raises:
            StoreCorrupt: a row's scale is not finite.
        """
        if isinstance(value, torch.Tensor) and damaged_positions(value, self.scheme):
            raise reader.damaged(unfinite_scale(name))

    def check(self, span: ScaleSpan) -> None:
        """Refuse rows whose scales ``span`` the served dtype cannot serve.

        Raises:
            StoreCorrupt: a row's scale is not finite (a damaged shard: never served as NaN).
            ConfigError: a value would be served as ``inf``, or rounded coarser than its codes.
        """
        if span.damaged:  # the read paths name the shard; an item read as stored gets here
            raise self.damaged()
        if self.dtype == torch.float32 or span.holds(self.dtype, self.scheme):
            return
        name = str(self.dtype).removeprefix("torch.")
        default = "" if self.chosen else " (the default serve_dtype)"
        raise ConfigError(
            f"this {self.scheme.value} store holds {span.describe(self.scheme)}, which "
            f"{name}{default} cannot serve without an inf or a rounding coarser than its codes: "
            "pass serve_dtype='float32' (or 'bfloat16': the same range in half the bytes)"
        )

    def damaged(self) -> StoreCorrupt:
        """The error for a row whose scale is not finite where its shard is not known here."""
        return StoreCorrupt(
            f"a stored {self.scheme.value} row has a scale that is not finite (its shard "
            "is damaged); run `featbake verify --repair` to quarantine it, then `featbake "
            "build` to recompute what it held"
        )

    def rows(self, trailing: tuple[int, ...]) -> PackedRows:
        """How packed rows of trailing shape ``trailing`` (``(..., D + 4)``) are read served."""
        return PackedRows(self.scheme, self.dtype, trailing[-1] - SCALE_BYTES)

    def for_index(self, layout: Layout, index: Index) -> Served:
        """This, or float32 where the user named no dtype and the build of the root ``index``
        serves recorded that float16 cannot hold its values."""
        if self.chosen or not self.dequantize or index.root is None:
            return self
        if recorded_serve_dtype(layout, index.root) != "float32":
            return self
        return Served(self.scheme, SERVED["float32"], chosen=False)

    def batch(self, batch: PaddedBatch, refusal: Refusal | None = None) -> PaddedBatch:
        """A padded batch of packed rows dequantised into a new padded batch (in shared memory
        inside a DataLoader worker, as the read path's own batch is), or as it is once its
        scales are checked (``dequantize=False``).

        Raises:
            StoreCorrupt: a row's scale is not finite: ``refusal`` of the batch positions that
                hold one (the read path's error, naming the shards), else unnamed.
            ConfigError: the batch holds values the served dtype cannot (see the module).
        """
        packed = batch.padded
        if not self.dequantize:  # one strided read of the scales
            bad = damaged_positions(packed, self.scheme)
            if bad:
                raise refusal(bad) if refusal is not None else self.damaged()
            return batch
        out = alloc_batch(
            torch.empty(0, dtype=self.dtype), (*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES)
        )
        try:
            self.tensor(packed, out)  # refuses a damaged row, unnamed (its scales are read here)
        except StoreCorrupt:
            if refusal is None:
                raise
            bad = damaged_positions(packed, self.scheme)  # only now: which rows, to name
            if bad:
                raise refusal(bad) from None
            raise
        return PaddedBatch.of(out, batch.lengths.tolist())


def served_for(
    recipe: Recipe, serve_dtype: str | torch.dtype | None, dequantize_items: bool
) -> Served | None:
    """How a dataset of ``recipe`` serves its items: None when as stored (float dtypes); a
    quantised one with ``dequantize=False`` as stored too, its damaged rows refused.

    Raises:
        ConfigError: ``serve_dtype`` or ``dequantize=False`` for a float store, an unknown
            ``serve_dtype``, or both ``serve_dtype`` and ``dequantize=False``.

    Example:
        >>> served_for(Recipe(dtype="int8"), None, True).dtype
        torch.float16
    """
    scheme = recipe.scheme
    if scheme is None:
        if serve_dtype is not None or not dequantize_items:
            raise ConfigError(
                f"serve_dtype and dequantize=False apply to int8 and fp8 stores; this dataset "
                f"stores {recipe.dtype} (cast the items yourself, or build with --dtype int8)"
            )
        return None
    if not dequantize_items:
        if serve_dtype is not None:
            raise ConfigError(
                "dequantize=False serves the stored int8/fp8 tensors as they are; drop "
                "serve_dtype, or keep dequantize=True to serve that dtype"
            )
        return Served.packed(scheme)  # as stored, damaged rows refused
    return Served(scheme, _serve_dtype(serve_dtype), chosen=serve_dtype is not None)


def _serve_dtype(asked: str | torch.dtype | None) -> torch.dtype:
    if asked is None:
        return torch.float16
    if isinstance(asked, torch.dtype) and asked in SERVE_DTYPES.values():
        return asked
    if isinstance(asked, str) and asked in SERVE_DTYPES:
        return SERVE_DTYPES[asked]
    raise ConfigError(
        f"serve_dtype must be one of {', '.join(SERVE_DTYPES)}, got {asked!r} "
        "(e.g. serve_dtype='float32')"
    )


# == row_pool ======================================================================================
# Reading the rows of one batch on several threads (the main process only).
#
# A row's read is a ``pread`` from the page cache and, on its first read in a process, a CRC-32C
# of the bytes: both release the GIL, and together they are ~95% of a batch's time. On 2 CPUs,
# two threads read a batch of 32 fp32 ``[T, 768]`` rows in about half the time. All bookkeeping
# (which rows were checked, the handles' LRU order, the RAM tier) stays on the caller's thread:
# a row job touches only its own slice of the batch and the shard's read-only file descriptor.
#
# No pool inside a DataLoader worker: there, ``num_workers`` processes already share the CPUs.
#: Below this many bytes a batch is read on the caller's thread: a hand-off costs ~20 us.
MIN_PARALLEL_BYTES = 4 << 20
#: More threads than this only contend for memory bandwidth.
MAX_THREADS = 4

RowJob = Callable[[], None]


def _new_pool() -> ThreadPoolExecutor:
    # MAX_THREADS at most; a run submits threads - 1 parts, and threads start only when needed.
    return ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="featbake-read")


#: This process's pool: a forked child makes its own (the parent's threads are not there), and
#: the holder's lock is held across fork(), so a parent thread making the pool at that moment
#: cannot leave the child a lock held forever (its first batch would hang).
_pools: PerProcess[ThreadPoolExecutor] = PerProcess(_new_pool, lock=True)
#: The CPUs this process may use (affinity + cgroup files, ~76 us), counted once per process.
_cpus: PerProcess[int] = PerProcess(process_cpus)


class _Cap(threading.local):
    most: int | None = None  # this thread's cap on a batch's read threads (read_threads_at_most)


_cap = _Cap()


@contextlib.contextmanager
def read_threads_at_most(most: int | None) -> Iterator[None]:
    """On this thread, batches are read on at most ``most`` threads (None: no cap).

    ``FeatureLoader`` reads on one thread while the training loop has a batch waiting: its
    step then runs on the CPUs it chose (``torch.set_num_threads``), and a second read thread
    would only take turns with it on one of them; the reads go wide again as soon as the loop
    waits for a batch.
    """
    before, _cap.most = _cap.most, most
    try:
        yield
    finally:
        _cap.most = before


class _HandOver(threading.local):
    due: Callable[[], None] | None = None  # run once before this thread's next batch read


_hand_over = _HandOver()


@contextlib.contextmanager
def handing_over(due: Callable[[], None]) -> Iterator[None]:
    """On this thread, ``due`` runs once, just before the next batch's rows are read.

    ``FeatureLoader`` hands its previous batch to the training thread there: that thread then
    takes the GIL while this one reads with it released, instead of between this thread's
    Python steps (each torch call of a batch's set-up lets it in, and this thread then waits
    for it). A batch that reads no rows (misses, RAM-tier items) does not run it: the caller
    runs it after the block (it must be harmless to run twice).
    """
    before, _hand_over.due = _hand_over.due, due
    try:
        yield
    finally:
        _hand_over.due = before


def _due() -> None:
    """Run this thread's :func:`handing_over` callable, once."""
    due, _hand_over.due = _hand_over.due, None
    if due is not None:
        due()


def read_threads() -> int:
    """Threads a batch may be read on here: the CPUs this process may use, 1 in a worker,
    at most this thread's cap (:func:`read_threads_at_most`)."""
    if get_worker_info() is not None:
        return 1
    most = max(1, min(MAX_THREADS, _cpus.get()))
    cap = _cap.most
    return most if cap is None else max(1, min(most, cap))


def run_rows(jobs: Sequence[RowJob], nbytes: int, threads: int | None = None) -> None:
    """Run every row job, on ``threads`` threads when the batch is large enough.

    Each thread runs a contiguous run of rows. The first exception raised by a job (a short
    read, a checksum mismatch) is raised here after every job has finished, so no thread is
    still writing into the batch when the caller sees it.
    """
    run = RowRun(nbytes, threads)
    parts = run.split(len(jobs))
    for part in parts[:-1]:
        run.submit(jobs[part])
    run.run_here(jobs[parts[-1]] if parts else [])


def read_rows(
    rows: Sequence[Any],
    nbytes: int,
    span_of: Callable[[Any], Span] | None = None,
    packed: PackedRows | None = None,
) -> ScaleSpan:
    """Read a batch's rows with :func:`~featbake.store.shard.read_spans`, a run per thread.

    ``rows`` are spans, or made into spans by ``span_of``, on this thread, just before their
    run is handed to the pool: making the last run's spans (Python, under the GIL: checksum
    descriptors) then overlaps the pool reading the first ones. With the compiled kernels
    (:mod:`featbake.native`) the batch is instead one call, on as many threads, that releases
    the GIL once: behind a Python-bound training step each taking of the GIL back waits for
    the step to yield it (up to ``sys.getswitchinterval()``, 5 ms), so a read that took it
    back after every row fell behind the step. With ``packed`` the rows are dequantised as
    they are read; the span of their scales is returned. Errors are raised as by
    :func:`run_rows`, after every run has finished.
    """
    run = RowRun(nbytes)
    if kernels() is not None:  # the whole batch in one call, one release of the GIL
        spans = rows if span_of is None else [span_of(r) for r in rows]
        if all(native_readable(s) for s in spans):
            _due()
            return read_spans(spans, packed, run.threads)
        rows, span_of = spans, None
    _due()
    parts = run.split(len(rows))
    got: list[ScaleSpan] = []
    for k, part in enumerate(parts):
        chunk = rows[part]
        spans = chunk if span_of is None else [span_of(r) for r in chunk]
        job = functools.partial(_read_run, spans, packed, got)
        if k < len(parts) - 1:
            run.submit([job])
        else:
            run.run_here([job])
    return functools.reduce(ScaleSpan.merged, got, ScaleSpan())


def _read_run(spans: Sequence[Span], packed: PackedRows | None, got: list[ScaleSpan]) -> None:
    got.append(read_spans(spans, packed))  # list.append is atomic: runs on several threads


class RowRun:
    """One batch's row jobs: the first runs handed to the pool, the last run on this thread.

    The caller may build each run's jobs just before handing it over, so that building the
    last run's jobs (Python, under the GIL) overlaps the pool reading the first ones.
    """

    def __init__(self, nbytes: int, threads: int | None = None) -> None:
        threads = read_threads() if threads is None else threads
        self.threads = 1 if nbytes < MIN_PARALLEL_BYTES else max(1, threads)
        self._futures: list[Future[None]] = []

    def split(self, n: int) -> list[slice]:
        """``n`` rows as contiguous runs, one per thread (the last one is this thread's)."""
        k = max(1, min(self.threads, n))
        step = -(-n // k) if n else 0
        return [slice(s, min(n, s + step)) for s in range(0, n, step)] if n else []

    def submit(self, jobs: Sequence[RowJob]) -> None:
        """Hand a run of jobs to the pool (run here when there is no pool)."""
        if self.threads <= 1:
            _run_all(jobs)
            return
        self._futures.append(_pools.get().submit(_run_all, jobs))

    def run_here(self, jobs: Sequence[RowJob]) -> None:
        """Run the last run here, then wait for the pool's; raise the first error of any."""
        errors: list[BaseException] = []
        try:
            _run_all(jobs)
        except Exception as e:
            errors.append(e)
        for f in self._futures:
            failed = f.exception()
            if failed is not None:
                errors.append(failed)
        self._futures = []
        if errors:
            raise errors[0]


def _run_all(jobs: Sequence[RowJob]) -> None:
    for job in jobs:
        job()


# == reads =========================================================================================
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


def apart_from(value: Any, kept: Any, alloc: Callable[..., torch.Tensor]) -> Any:
    """``value`` (a tensor, or a dict of parts) with each tensor that shares memory with one
    of ``kept``'s copied into a buffer from ``alloc``; the others (dequantised into memory of
    their own) as they are."""
    held = {t.untyped_storage().data_ptr() for t in _tensors(kept)}

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            return t
        return alloc(tuple(t.shape), t.dtype).copy_(t)

    if isinstance(value, torch.Tensor):
        return own(value)
    return {name: own(t) for name, t in value.items()}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value.values())


def _owned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer the caller owns (``mapped_empty``'s signature: the RAM tier's is mapped)."""
    return torch.empty(shape, dtype=dtype)


def _shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer in shared memory: a DataLoader worker's item is sent to the main process
    as it is (torch copies a tensor outside shared memory into it before it is sent)."""
    return alloc_batch(torch.empty(0, dtype=dtype), shape)


def item_buffers(st: ProcessState) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """Where this process reads an item into: its own mapping for the RAM tier (which keeps
    it), shared memory in a DataLoader worker (one copy fewer per item: one item per step,
    fp16 [T, 768], w=2, read at 0.84x mmap'd shards, at 1.0x with this), else the heap."""
    return mapped_empty if st.use_lru else _shared if st.in_worker else _owned


class PartRead(NamedTuple):
    """One stored tensor of an item's planned read: its output part ("" for a single tensor),
    its tensor name in the shard, where it lies (its reader leased by the plan), and its check
    (None: not on this read)."""

    part: str
    name: str
    loc: Located
    check: SpanCheck | None


def located_in(reader: ShardReader, path: Path, sid: int, name: str) -> Located:
    """Where tensor ``name`` of shard ``sid`` (open as ``reader``) lies, from its header.

    Raises:
        StoreCorrupt: the shard holds no such tensor, or not of a dtype served.
    """
    return _located(reader, path, sid, name, reader.info(name))


def _located(reader: ShardReader, path: Path, sid: int, name: str, info: TensorInfo) -> Located:
    dtype = ST_TO_DTYPE.get(info.dtype)
    if dtype is None:
        raise reader.damaged(f"tensor {name} has a dtype featbake does not serve")
    return Located(sid, path, reader, info.begin, info.end - info.begin, dtype, info.shape)


def part_read(
    reader: ShardReader, path: Path, sid: int, name: str, part: str, check: bool
) -> PartRead:
    """The planned read of tensor ``name`` (output ``part``) of shard ``sid``, checked or not.

    Raises:
        StoreCorrupt: the shard holds no such tensor.
    """
    info = reader.info(name)
    loc = _located(reader, path, sid, name, info)
    return PartRead(part, name, loc, reader.check_of(name, info) if check else None)


class Reads:
    """The read paths over one dataset's :class:`Index`; stateless but for shard paths.

    Process state (handles, flags, counters) is passed in: this object crosses pickling.
    """

    def __init__(self, index: Index, layout: Layout, served: Served | None = None) -> None:
        self.index = index
        self.layout = layout
        self.served = served  # how items are served: their rows' scales checked when read
        self._paths: list[Path] = []

    def shard_path(self, sid: int) -> Path:
        paths = self._paths
        names = self.index.shard_names
        while len(paths) < len(names):
            paths.append(self.layout.shard_path(names[len(paths)]))
        return paths[sid]

    def _open(self, st: ProcessState, sid: int, held: Leases) -> tuple[Path, ShardReader]:
        """The reader of shard ``sid``, leased into ``held`` (open until ``held`` ends); one
        dict lookup and a lease when it is open already.

        Raises:
            ShardMissing: the file is gone.
        """
        path = self.shard_path(sid)
        reader = st.open_readers.get(path)
        if reader is None or not held.take(reader):  # closed since by another thread's eviction
            reader = st.reader(path, held)
        elif path is not st.last_path:  # keep the LRU order, with one C call per switch
            st.handles.touch(path)
            st.last_path = path
        return path, reader

    # -- one item: plan, run, serve -----------------------------------------------------------
    # An item is a batch of one. Its read is planned first (each stored tensor's location, its
    # dtype and shape, whether this read checks its checksum, whether its rows are dequantised
    # as they are read), run once (read_leased: the compiled read, or the Python fallback), then
    # served. Every read of stored features goes through here or through a batch's plan, both
    # with the one location check (:meth:`located`) and the one checksum rule (:meth:`checks`);
    # every reader is leased by the plan (ShardHandles.lease) until the read is done.
    def checks(self, st: ProcessState, i: int) -> bool:
        """The one checksum rule: whether this read of item ``i`` checks its CRC. With
        ``verify="first"``, the first read of it in this dataset (the flags forked workers
        share, so a fresh worker does not check again what another checked); with
        ``"always"`` every read; with ``"never"`` none."""
        return st.check_always or (st.check_first and not st.verified[i])

    def located(self, st: ProcessState, i: int, held: Leases) -> Located | None:
        """The one location check: item ``i``'s remembered location, its reader leased into
        ``held``, while it is valid: the reader is still the open one of its shard here (an
        eviction, by this thread or another, closes it) and the index still puts the item in
        that shard (gc may move it); None: plan from the shard's header.
        """
        loc = st.loc[i]
        if (
            loc is None
            or self.index.shard[i] != loc.sid
            or st.open_readers.get(loc.path) is not loc.reader
            or not held.take(loc.reader)
        ):
            return None
        if loc.path is not st.last_path:  # keep the handles' LRU order (one C call)
            st.handles.touch(loc.path)
            st.last_path = loc.path
        return loc

    def item(self, st: ProcessState, i: int) -> Any:
        """Item ``i`` from the RAM tier or the store, as served (dequantised; no layer view),
        marked used; None when neither holds it (a miss).

        Raises:
            StoreCorrupt: its bytes fail their checksum, or a row's scale is not finite.
            ConfigError: it holds values the served dtype cannot.
        """
        if st.use_lru:
            value = st.lru.get(i)
            if value is not None:
                st.touch(i)
                return self.served_apart(st, value)
        sid = int(self.index.shard[i])
        if sid < 0:
            return None
        try:
            with Leases() as held:
                value, served = self._item_held(st, i, sid, held)
        except (ShardMissing, ShardDamaged) as e:
            # gc compacted or dropped the shard after the index was built, or `verify --repair`
            # quarantined it while this process held it open: look it up again.
            path = self.shard_path(sid)
            if isinstance(e, ShardDamaged) and not st.handles.forget_if_replaced(path):
                raise
            st.handles.forget(path)
            value, served = self.relocate(st, i), False
            if value is None:
                return None
        st.touch(i)
        if st.use_lru:  # read into the tier's own mapping (served is False: kept as stored)
            st.lru.put(i, value)
            return self.served_apart(st, value)
        return value if served else self.as_served(value)

    def as_served(self, value: Any) -> Any:
        """A stored value as the dataset serves it (int8/fp8 dequantised)."""
        return value if self.served is None else self.served.item(value)

    def served_apart(self, st: ProcessState, kept: Any) -> Any:
        """The RAM tier's value ``kept`` as served, in memory of the caller's own: a tensor
        served as kept (a float store's, or packed with ``dequantize=False``) is copied (into
        shared memory in a DataLoader worker, which sends it as it is).

        Before, the tier's own tensor was served: a training step that edited its item in
        place (``x -= x.mean()``, with ``collate_fn=list`` or ``ds[i]``) changed what every
        later read of that item served, the rest of the run."""
        return apart_from(self.as_served(kept), kept, _shared if st.in_worker else _owned)

    def _item_held(self, st: ProcessState, i: int, sid: int, held: Leases) -> tuple[Any, bool]:
        """Item ``i`` read from shard ``sid`` (its readers leased into ``held``), and whether it
        was served as read (dequantised in one pass).

        Raises:
            ShardMissing: the shard is gone.
        """
        check = self.checks(st, i)
        loc = None if check else self.located(st, i, held)
        if loc is not None:  # a remembered location: one read, nothing looked up
            name = self.index.key(i) if self.served is not None else ""  # names a damaged row
            plan = [PartRead("", name, loc, None)]
        else:
            parts = self.index.parts
            key = self.index.key(i)
            if parts is None:  # not known yet (nothing stored when indexed): the catalog says
                return self.read_locations(st, self.locate(st, key), held, check), False
            path, reader = self._open(st, sid, held)
            plan = [part_read(reader, path, sid, tensor_name(key, p), p, check) for p in parts]
            if parts == ("",):
                st.loc[i] = plan[0].loc
        value, served = self._run(st, plan)
        if check:
            st.verified[i] = 1
        st.store_reads += 1
        return value, served

    def read_locations(
        self, st: ProcessState, locs: Sequence[Location], held: Leases, check: bool
    ) -> Any:
        """A feature read from catalog locations ``locs`` (its readers leased into ``held``), as
        stored: its tensor, or a dict of parts.

        Raises:
            ShardMissing: the catalog has no location, or a shard it names is gone.
        """
        if not locs:
            raise ShardMissing("the feature is no longer in the store")
        plan = []
        for loc in locs:
            sid = self.index.sid(loc.shard)
            path, reader = self._open(st, sid, held)
            plan.append(part_read(reader, path, sid, loc.tensor, loc.part, check))
        return self._run(st, plan, serve=False)[0]

    def _run(self, st: ProcessState, plan: list[PartRead], serve: bool = True) -> tuple[Any, bool]:
        """Run an item's planned reads once; its value (a tensor, or a dict of parts) and
        whether it is served as read: a single tensor of packed rows, with no RAM tier (which
        keeps the stored form), is dequantised in one pass; all else is read as stored, each
        buffer the caller's own (in its own mapping for the RAM tier: see ``mapped_empty``).
        """
        served = self.served if serve and not st.use_lru and len(plan) == 1 else None
        alloc = item_buffers(st)
        spans, values = [], []
        packed = None
        for part in plan:
            loc = part.loc
            packed = served_rows(served, loc.dtype, loc.shape)
            if packed is not None:  # dequantised as read (served is not None: see served_rows)
                out = alloc((*loc.shape[:-1], packed.width), packed.dtype)
                buf = out.reshape(-1).view(torch.uint8)
            else:
                buf = alloc((loc.nbytes,), torch.uint8)
                out = buf.view(loc.dtype).view(loc.shape)
            # Its address given: the compiled read takes no numpy ctypes of it (~1 us).
            spans.append(
                Span(loc.reader, loc.offset, buf.numpy(), None, part.check, buf.data_ptr())
            )
            values.append(out)
        scales = read_leased(spans, packed)
        if packed is not None:
            assert served is not None
            served.check(scales)
        elif self.served is not None:  # a damaged row is refused here, naming its shard
            for part, t in zip(plan, values, strict=True):
                self.served.refuse_damaged(part.loc.reader, part.name, t)
        if len(plan) == 1 and not plan[0].part:  # served as read: dequantised, or checked raw
            return values[0], packed is not None or (served is not None and not served.dequantize)
        return {part.part: t for part, t in zip(plan, values, strict=True)}, False

    @staticmethod
    def locate(st: ProcessState, key: str) -> list[Location]:
        """The catalog's current locations of ``key`` (empty: not stored)."""
        return st.catalog.locate(key)

    def relocate(self, st: ProcessState, i: int) -> Any:
        """Item ``i`` looked up again in the catalog (:func:`relocated`) and read as stored;
        None: a miss."""
        ix = self.index
        check = self.checks(st, i)

        def read(locs: list[Location]) -> Any:
            with Leases() as held:
                return self.read_locations(st, locs, held, check)

        got = relocated(ix.key(i), functools.partial(self.locate, st), read)
        if got is None:
            ix.shard[i] = -1
            return None
        locs, value = got
        ix.shard[i] = ix.sid(locs[0].shard)
        if ix.parts is None:
            ix.parts = tuple(loc.part for loc in locs)
        if check:
            st.verified[i] = 1
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
        with Leases() as held:
            return self._hint(st, idx, parts, held)

    def _hint(
        self, st: ProcessState, idx: Sequence[int], parts: tuple[str, ...], held: Leases
    ) -> int:
        """:meth:`will_need` with the shards it opens leased into ``held``."""
        ix = self.index
        wanted = [i for i in idx if ix.shard[i] >= 0 and not (st.use_lru and i in st.lru)]
        fetching = self._fetched_ahead(st, wanted)
        readers = st.open_readers
        started = 0
        for i in wanted:
            path = self.shard_path(int(ix.shard[i]))
            if path in fetching:
                continue
            reader = readers.get(path)
            if reader is None:
                if len(readers) >= st.handles.max_open:
                    continue
                try:
                    reader = st.reader(path, held)
                except StoreError:  # ShardMissing, StoreCorrupt: the read itself says so
                    continue
            key = ix.key(i)
            started += sum(reader.will_need(tensor_name(key, p)) for p in parts)
        return started

    def _fetched_ahead(self, st: ProcessState, idx: Sequence[int]) -> set[Path]:
        """The shards of items ``idx`` not open here that their place fetches whole in the
        background (a bucket not reading them by ranges): a hint never waits for that, nor opens
        them. Each shard is asked once, in the items' order, before any is opened (a bucket
        reading by ranges starts their headers' GETs meanwhile, so they overlap)."""
        place, readers = place_of(self.layout), st.open_readers
        paths = dict.fromkeys(self.shard_path(int(self.index.shard[i])) for i in idx)
        return {
            path
            for path in paths
            if path not in readers and place.fetch_ahead(path.name.removesuffix(".safetensors"))
        }

    # -- a batch in place ---------------------------------------------------------------------
    def padded_located(
        self, st: ProcessState, idx: list[int], served: Served | None = None
    ) -> PaddedBatch | None:
        """The hit path of a batch whose items were all read (and checked) before here.

        One pread per item straight into its row of the batch, no per-item tensor or view
        (with ``served``, dequantised as it is read: :func:`served_rows`); None (take the
        general path) if any item is not located, not yet checked, or moved, or its reader was
        closed since (every reader is leased for the whole read).
        """
        with Leases() as held:
            return self._padded_held(st, idx, served, held)

    def _padded_held(
        self, st: ProcessState, idx: list[int], served: Served | None, held: Leases
    ) -> PaddedBatch | None:
        """:meth:`padded_located` with each item's reader leased into ``held``."""
        first = st.loc[idx[0]]
        if first is None or not first.shape:
            return None
        dtype, trailing = first.dtype, first.shape[1:]
        if packed_vectors(served, dtype, trailing):
            return None
        got: list[Located] = []
        for i in idx:
            if self.checks(st, i):  # this read checks it: the general path does
                return None
            loc = self.located(st, i, held)
            if loc is None or loc.dtype is not dtype or loc.shape[1:] != trailing:
                return None
            got.append(loc)
        lengths = [loc.shape[0] for loc in got]
        packed = served_rows(served, dtype, trailing)
        padded = alloc_batch(*_batch_of(dtype, trailing, packed, len(idx), max(lengths)))
        flat = np.asarray(tensor_buffer(padded))
        base = padded.data_ptr()  # flat's address: the compiled read takes each row's from it
        row_bytes = padded[0].nbytes
        step_bytes = padded[0][0].nbytes if len(padded[0]) else 0
        touch = st.touch
        spans = []
        for j, (i, loc) in enumerate(zip(idx, got, strict=True)):
            start, end = j * row_bytes, j * row_bytes + loc.shape[0] * step_bytes
            spans.append(
                Span(
                    loc.reader,
                    loc.offset,
                    flat[start:end],
                    flat[end : start + row_bytes],
                    None,
                    base + start,
                )
            )
            touch(i)
        scales = read_rows(spans, padded.nbytes, packed=packed)
        if served is not None and packed is not None:
            served.check(scales)
        st.store_reads += len(idx)
        return as_served(padded, lengths, served, packed, self.refusal(st, idx))

    def padded(
        self, st: ProcessState, idx: list[int], served: Served | None = None
    ) -> PaddedBatch | None:
        """The batch read in place into a padded tensor, or None to take the general path.

        With ``served`` (an int8/fp8 store served dequantised) the batch is served: each row
        dequantised as it is read, straight into the served batch. With the RAM tier on, which
        keeps packed rows, the packed batch is read and then dequantised.
        """
        if not st.use_lru and not st.check_always:
            batch = self.padded_located(st, idx, served)
            if batch is not None:
                return batch
        shard = self.index.shard
        if st.use_lru:
            if any(shard[i] < 0 and i not in st.lru for i in idx):
                return None  # a miss: checked before any lookup so hits are counted once
        elif (shard[idx] < 0).any():
            return None
        after = served is not None and st.use_lru  # the RAM tier's rows: read packed, then served
        with Leases() as held:  # every shard read stays open until the batch is read
            plan = self._plan(st, idx, held, served)
            if plan is None:
                return None
            batch = self._fill(st, idx, plan, held, None if after else served)
        if after and batch is not None:
            assert served is not None
            return served.batch(batch, self.refusal(st, idx))
        return batch

    def _plan(
        self, st: ProcessState, idx: list[int], held: Leases, served: Served | None = None
    ) -> _Plan | None:
        """Each row's source, if all rows share trailing shape and dtype (and are not packed
        rows of one dimension, see :func:`packed_vectors`); else None. The shards opened are
        leased into ``held``."""
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
                    _, reader = self._open(st, sid, held)
                except ShardMissing:
                    return None
                info = reader.tensors.get(self.index.key(i))
                if info is None:
                    return None
                shape, dtype = info.shape, ST_TO_DTYPE.get(info.dtype)
            if not shape or dtype is None:
                return None
            if want is None:
                if packed_vectors(served, dtype, shape[1:]):
                    return None
                want = (shape[1:], dtype)
            elif (shape[1:], dtype) != want:
                return None
            out.append(_Source(value, sid, shape[0]))
        assert want is not None and want[1] is not None
        return _Plan(out, want[0], want[1])

    def _fill(
        self,
        st: ProcessState,
        idx: list[int],
        plan: _Plan,
        held: Leases,
        served: Served | None = None,
    ) -> PaddedBatch | None:
        """Fill a padded batch: RAM-tier rows copied here, stored rows read by ``run_rows``.

        Every shard is opened and leased into ``held`` (and every row's check decided) before
        any read, on this thread: a shard this batch's own opens evicted (a batch over more
        shards than ``max_open_shards``), or another thread's did, stays open for the read;
        the reads run on the read pool, into byte slices of the batch (no torch op per row: one
        would wake torch's OpenMP threads, which then spin on the CPUs the readers need); what
        was read is recorded here after. With ``served`` (never with the RAM tier: see
        :meth:`padded`) the rows are dequantised as they are read.
        """
        lengths = [s.length for s in plan.sources]
        t_max = max(lengths)
        packed = served_rows(served, plan.dtype, plan.trailing)
        padded = alloc_batch(*_batch_of(plan.dtype, plan.trailing, packed, len(idx), t_max))
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
                path, reader = self._open(st, src.sid, held)
            except ShardMissing:
                return None  # moved meanwhile: the general path relocates it
            check = self.checks(st, i)
            start, end = j * row_bytes, j * row_bytes + src.length * step_bytes
            dest, tail = flat[start:end], flat[end : start + row_bytes]
            read.append(_RowRead(i, src.sid, path, reader, j, dest, tail, check))
        span_of = functools.partial(self._span, packed=packed)
        try:
            scales = read_rows(read, padded.nbytes, span_of, packed)
        except ShardDamaged:
            if any([st.handles.forget_if_replaced(r.path) for r in read]):
                return None  # quarantined meanwhile: the general path looks each item up
            raise
        if served is not None and packed is not None:
            served.check(scales)
        for r in read:
            st.loc[r.i] = located_in(r.reader, r.path, r.sid, self.index.key(r.i))
            if r.check:
                st.verified[r.i] = 1
            if st.use_lru:  # the RAM tier owns its copy, not a view of this batch
                row = padded[r.row, : lengths[r.row]]
                st.lru.put(r.i, mapped_empty(row.shape, row.dtype).copy_(row))
        st.store_reads += len(read)
        for i in idx:
            st.touch(i)
        return as_served(padded, lengths, served, packed, self.refusal(st, idx))

    def refusal(self, st: ProcessState, idx: list[int]) -> Refusal:
        """The error for the rows of batch ``idx`` at some positions whose scale is not finite:
        it names the first one's shard and tensor, as a read from the store does, wherever the
        batch got it (the store or the RAM tier); every such item is dropped from the RAM tier,
        which so never keeps a damaged row (a read of it alone then goes to the store, and is
        refused there, named too)."""

        def refused(positions: Sequence[int]) -> StoreCorrupt:
            items = [idx[j] for j in positions]
            if st.use_lru:
                for i in items:
                    st.lru.pop(i)
            i = items[0]
            sid, name = int(self.index.shard[i]), tensor_name(self.index.key(i), "")
            if sid < 0:  # not in a shard the index knows (never so for a stored row)
                return StoreCorrupt(
                    f"item {i} (tensor {name}) has a row scale that is not finite; run "
                    "`featbake verify --repair` to quarantine its shard, then `featbake build`"
                )
            return damaged_shard(self.layout, self.index.shard_names[sid], unfinite_scale(name))

        return refused

    def _span(self, r: _RowRead, packed: PackedRows | None = None) -> Span:
        key = self.index.key(r.i)
        return r.reader.span(key, r.dest, verify=r.check, tail=r.tail, packed=packed)


def packed_vectors(served: Served | None, dtype: torch.dtype, trailing: tuple[int, ...]) -> bool:
    """Whether stored rows (``dtype``, trailing shape ``trailing``) are packed items of one
    dimension: ``[T + 4]``, one row of ``T`` codes and its scale. Padding such items along their
    only dimension would move each scale into the batch's codes, so a batch of them takes the
    general path: each item served on its own (dequantised, or as stored), as ``ds[i]`` is."""
    return served is not None and not trailing and dtype == served.scheme.packed_dtype


def served_rows(
    served: Served | None, dtype: torch.dtype, trailing: tuple[int, ...]
) -> PackedRows | None:
    """How a batch's stored rows (``dtype``, trailing shape ``trailing``) are read: dequantised
    by ``served`` as they are read, or None: as stored (then :func:`as_served` dequantises the
    batch after, or refuses rows that are not packed rows of ``served``'s scheme)."""
    if (
        served is None
        or not served.dequantize
        or dtype != served.scheme.packed_dtype
        or not trailing
        or trailing[-1] <= SCALE_BYTES
    ):
        return None
    return served.rows(trailing)


def as_served(
    padded: torch.Tensor,
    lengths: list[int],
    served: Served | None,
    packed: PackedRows | None,
    refusal: Refusal | None = None,
) -> PaddedBatch:
    """A filled batch as it is served: dequantised after the reads where it was not as read
    (or as stored, its scales checked); a damaged row refused by ``refusal``."""
    batch = PaddedBatch.of(padded, lengths)
    return served.batch(batch, refusal) if served is not None and packed is None else batch


def _batch_of(
    dtype: torch.dtype, trailing: tuple[int, ...], packed: PackedRows | None, n: int, t_max: int
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``alloc_batch``'s arguments for a batch of ``n`` rows: stored, or served by ``packed``."""
    if packed is None:
        return torch.empty(0, dtype=dtype), (n, t_max, *trailing)
    return torch.empty(0, dtype=packed.dtype), (n, t_max, *trailing[:-1], packed.width)


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


__all__ = [
    "PartRead",
    "Reads",
    "read_threads",
    "read_threads_at_most",
]
