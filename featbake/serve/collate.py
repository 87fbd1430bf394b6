"""Batch variable-length feature sequences into padded tensors.

Baked features are ``[T_i, D...]`` tensors whose time axis differs per item, so the
stock ``default_collate`` (which stacks) cannot batch them. :func:`pad_collate` pads
them to a common length and returns the true lengths alongside, for masking.

It runs once per training step, so it allocates the output once, copies each item
into its slice and writes the pad value only where padding goes; inside a DataLoader
worker it allocates that output in shared memory, as ``default_collate`` does, so
the batch reaches the main process without another copy.

In the main process (``num_workers=0``) large batches come from a small pool of buffers
(:class:`BatchPool`): a buffer is handed out again only when no tensor, view or array made
from it is alive any more, so a batch the caller still holds is never overwritten. Why:
a fresh multi-MiB allocation is returned to the OS when freed and page-faults on every
4 KiB page when the next one is written; on the 2-core benchmark machine that costs about
0.5 ms per MiB, more than reading the features themselves.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate, get_worker_info

from featbake.errors import ConfigError, first_line

__all__ = ["BatchPool", "PaddedBatch", "pad_collate"]

Padded = tuple[torch.Tensor, torch.Tensor]

#: The dtypes of an int8/fp8 store's packed tensors (``Scheme.packed_dtype``): a one-dimensional
#: item of one is a single packed row, codes then scale, which cannot be padded.
_PACKED_DTYPES = (torch.int8, torch.uint8)


class PaddedBatch(list):
    """A batch's items that already lie, padded with zeros, in one ``[B, T_max, D...]`` tensor.

    A dataset's ``__getitems__`` may return this instead of a plain list: its elements are views
    ``padded[i, :lengths[i]]``, so any collate function works on them, and :func:`pad_collate`
    returns ``(padded, lengths)`` as they are, without copying the batch a second time. Inside a
    DataLoader worker ``padded`` is allocated in shared memory, as the collate would.

    A reader that hands the batch straight to :func:`pad_collate` (``FeatureLoader`` over a
    dataset whose batches reach its collate as read) builds it inside :func:`batches_whole`:
    then the item views are made only if something asks for them (:meth:`with_views`), since
    making 32 views cost 45-85 us a batch, ~7% of reading a batch of 32 fp16 ``[T, 768]``
    items from the page cache.

    Attributes:
        padded: the batch tensor the items are views of.
        lengths: ``[B]`` int64 lengths.
    """

    padded: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, padded: torch.Tensor, lengths: Sequence[int]) -> PaddedBatch:
        """Wrap ``padded`` (zero-padded past each length) as a list of item views (none yet
        inside :func:`batches_whole`)."""
        batch = cls()
        batch.padded = padded
        batch.lengths = torch.tensor(list(lengths), dtype=torch.int64)
        if get_worker_info() is not None:
            batch.lengths.share_memory_()
        return batch if _placement.whole else batch.with_views()

    def with_views(self) -> PaddedBatch:
        """This batch with its item views ``padded[i, :lengths[i]]`` as its elements (made
        once: a batch built inside :func:`batches_whole` has none until asked)."""
        if len(self) != len(self.lengths):
            padded = self.padded
            self[:] = [padded[i, :n] for i, n in enumerate(self.lengths.tolist())]
        return self


class BatchPool:
    """Reusable batch buffers for one process: large batches without page faults.

    Each buffer is an anonymous memory mapping. ``torch.frombuffer`` makes every tensor (and
    every view or numpy array of it) keep a reference to its buffer, so a buffer whose only
    reference is the pool's own is provably unused and may be written again. The pool keeps at
    most ``keep`` buffers; a buffer pushed out while a batch still uses it lives on until that
    batch is dropped, then returns to the OS. Extra memory: at most ``keep`` batches.

    Args:
        keep: how many buffers to keep (2 covers "the batch in use + the one being built").
        min_bytes: smaller requests are left to the ordinary allocator (cheap there).

    Example:
        >>> pool = BatchPool()
        >>> t = pool.empty((32, 360, 768), torch.float16)
        >>> t.shape
        torch.Size([32, 360, 768])
    """

    def __init__(self, keep: int = 3, min_bytes: int = 1 << 20) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self._bufs: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.created = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype`` (its old contents remain)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        buf = self._take(nbytes)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def _take(self, nbytes: int) -> mmap.mmap:
        """The free buffer that fits handed out last, else a new one.

        Newest first: batches are dropped in the order they were made, so that is the buffer
        freed last, the likeliest to be still in the CPU's caches. Oldest first, a loader that
        keeps 8 buffers for a loop holding 2 wrote each batch into the coldest one. Measured
        read-only on 2 CPUs: ``DataLoader(num_workers=0)`` 6-7% slower oldest first, and
        ``FeatureLoader`` 7-16% more CPU per epoch on a loaded machine (its rate unchanged
        with the load kept off).
        """
        with self._lock:
            bufs = self._bufs
            for k in range(len(bufs) - 1, -1, -1):
                # 2 references: the pool's list and getrefcount's own argument.
                if sys.getrefcount(bufs[k]) == 2 and nbytes <= len(bufs[k]) <= 2 * nbytes:
                    buf = bufs.pop(k)
                    bufs.append(buf)  # most recently used last
                    self.reused += 1
                    return buf
            # Room for slightly longer batches later (T_max varies from batch to batch).
            buf = mmap.mmap(-1, nbytes + nbytes // 8)
            self.created += 1
            if len(bufs) >= self.keep:
                free = [k for k in range(len(bufs)) if sys.getrefcount(bufs[k]) == 2]
                bufs.pop(free[0] if free else 0)
            bufs.append(buf)
            return buf


_pool = BatchPool()


def alloc_batch(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised batch tensor: shared memory in a DataLoader worker, else pooled."""
    return _alloc(like, shape)


def pad_collate(
    batch: Sequence[Any],
    *,
    pad_to_multiple: int | None = None,
    pad_value: float = 0.0,
) -> Any:
    """Pad and batch variable-length features, returning their lengths too.

    Three batch layouts are supported:

    * ``[T_i, D...]`` tensors -> ``(padded [B, T_max, D...], lengths [B] int64)``.
    * dicts of such tensors (multi-output encoders) -> ``{name: (padded, lengths)}``; an
      entry that is a dict is padded the same way, and one that is no ``[T, ...]`` tensor (a
      label, a 0-d tensor, a string) goes through ``default_collate``: a keyword
      ``StackDataset(feats=ds, y=labels)`` -> ``{"feats": (padded, lengths), "y": labels}``.
    * tuples/lists whose first element is a feature (tensor or dict) and whose other
      elements are anything ``default_collate`` handles, e.g. ``(feat, label)`` ->
      ``(padded, lengths, *rest)`` for tensor features, ``({name: (padded, lengths)},
      *rest)`` for dict features; each remaining position goes through
      ``default_collate``.

    Args:
        batch: The items of one batch, as a DataLoader passes them.
        pad_to_multiple: If given, round ``T_max`` up to a multiple of this, which keeps
            shapes few (kinder to kernels' autotuning and to pinned-buffer reuse).
        pad_value: Value written into the padding positions.

    Returns:
        The padded batch, in the layout described above.

    Raises:
        ConfigError: For an empty batch, a non-positive ``pad_to_multiple``, items
            of unsupported type, mixed dtypes, mismatched trailing dimensions or
            dict items with different keys.

    Example:
        >>> feats = [torch.ones(2, 3), torch.ones(4, 3)]
        >>> padded, lengths = pad_collate(feats)
        >>> tuple(padded.shape), lengths.tolist()
        ((2, 4, 3), [2, 4])
        >>> padded, lengths, labels = pad_collate([(f, i) for i, f in enumerate(feats)])
        >>> labels.tolist()
        [0, 1]
    """
    if (len(batch.lengths) if type(batch) is PaddedBatch else len(batch)) == 0:
        raise ConfigError(
            "pad_collate got an empty batch; check the Dataset's length and the sampler"
        )
    if pad_to_multiple is not None and (
        isinstance(pad_to_multiple, bool)
        or not isinstance(pad_to_multiple, int)
        or pad_to_multiple < 1
    ):
        raise ConfigError(
            f"pad_to_multiple must be a positive integer such as 8, got {pad_to_multiple!r}"
        )
    if type(batch) is PaddedBatch:
        t_max = batch.padded.shape[1]
        if pad_value == 0 and (pad_to_multiple is None or t_max % pad_to_multiple == 0):
            return batch.padded, batch.lengths  # the dataset already built this batch in place
        batch = batch.with_views()  # padded again below, from its items
    first = batch[0]
    if isinstance(first, torch.Tensor):
        return _pad_tensors(batch, pad_to_multiple, pad_value, where="")
    if isinstance(first, Mapping):
        return _pad_dicts(batch, pad_to_multiple, pad_value, where="")
    if isinstance(first, (tuple, list)):
        return _pad_tuples(batch, pad_to_multiple, pad_value)
    raise ConfigError(
        f"pad_collate cannot batch items of type {type(first).__name__}: expected "
        "[T, D...] tensors, dicts of them, or (feature, ...) tuples"
    )


def _pad_tuples(batch: Sequence[Any], pad_to_multiple: int | None, pad_value: float) -> tuple:
    width = len(batch[0])
    if width == 0:
        raise ConfigError("pad_collate got an empty tuple as item 0; expected (feature, ...)")
    for i, item in enumerate(batch):
        if not isinstance(item, (tuple, list)) or len(item) != width:
            raise ConfigError(
                f"pad_collate: item {i} is not a tuple/list of length {width} like item 0"
            )
    feats = [item[0] for item in batch]
    head = feats[0]
    if isinstance(head, torch.Tensor):
        head_out: tuple = _pad_tensors(feats, pad_to_multiple, pad_value, where=" (position 0)")
    elif isinstance(head, Mapping):
        head_out = (_pad_dicts(feats, pad_to_multiple, pad_value, where=" (position 0)"),)
    else:
        raise ConfigError(
            f"pad_collate: the first element of each tuple must be a feature tensor or dict, "
            f"got {type(head).__name__}"
        )
    rest = tuple(default_collate([item[j] for item in batch]) for j in range(1, width))
    return (*head_out, *rest)


def _pad_dicts(
    batch: Sequence[Any], pad_to_multiple: int | None, pad_value: float, where: str
) -> dict[str, Padded]:
    names = list(batch[0].keys())
    expected = set(names)
    for i, item in enumerate(batch):
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"pad_collate: item {i}{where} is a {type(item).__name__}, item 0 is a dict"
            )
        if set(item.keys()) != expected:
            missing = sorted(map(str, expected - set(item.keys())))
            extra = sorted(map(str, set(item.keys()) - expected))
            raise ConfigError(
                f"pad_collate: item {i}{where} has different keys than item 0 "
                f"(missing {missing}, extra {extra})"
            )
    return {
        name: _pad_entry([item[name] for item in batch], pad_to_multiple, pad_value, where, name)
        for name in names
    }


def _pad_entry(
    values: list[Any], pad_to_multiple: int | None, pad_value: float, where: str, name: str
) -> Any:
    """One entry of dict items batched: ``[T, ...]`` tensors padded, dicts of them padded as
    dicts, anything else (a label, a 0-d tensor, a string) by ``default_collate``."""
    first, here = values[0], f"{where}[{name!r}]"
    if isinstance(first, Mapping):
        return _pad_dicts(values, pad_to_multiple, pad_value, where=here)
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return _pad_tensors(values, pad_to_multiple, pad_value, where=here)
    try:
        return default_collate(values)
    except (TypeError, RuntimeError) as e:
        raise ConfigError(f"pad_collate: item 0{here} cannot be batched: {first_line(e)}") from e


def _pad_tensors(
    batch: Sequence[Any], pad_to_multiple: int | None, pad_value: float, where: str
) -> Padded:
    elem = batch[0]
    if not isinstance(elem, torch.Tensor) or elem.dim() == 0:
        raise ConfigError(f"pad_collate: item 0{where} must be a tensor of shape [T, D...]")
    if elem.dim() == 1 and elem.dtype in _PACKED_DTYPES:
        raise ConfigError(
            f"pad_collate: item 0{where} is a one-dimensional {elem.dtype} tensor, as an int8/fp8 "
            "store serves a [T] item with dequantize=False (its one row scale in its last 4 "
            "bytes, which padding would move): serve it dequantised (the default); a sequence "
            "of your own in int8 or uint8 (bytes of a transcript) pads once cast, `.long()`"
        )
    trailing = elem.shape[1:]
    dtype = elem.dtype
    expected = "[" + ", ".join(["T", *map(str, trailing)]) + "]"
    lengths_list: list[int] = []
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"pad_collate: item {i}{where} is a {type(t).__name__}, item 0 is a tensor"
            )
        if t.dtype != dtype:
            raise ConfigError(
                f"pad_collate: item {i}{where} has dtype {t.dtype}, item 0 has {dtype}; "
                "cast features to one dtype before batching"
            )
        if t.dim() == 0 or t.shape[1:] != trailing:
            raise ConfigError(
                f"pad_collate: item {i}{where} has shape {tuple(t.shape)}, expected "
                f"{expected} like item 0 (all items must share the dims after T)"
            )
        lengths_list.append(t.shape[0])

    t_max = max(lengths_list)
    if pad_to_multiple is not None:
        t_max = -(-t_max // pad_to_multiple) * pad_to_multiple
    shape = (len(batch), t_max, *trailing)

    out = _alloc(elem, shape)
    for i, t in enumerate(batch):
        n = lengths_list[i]
        row = out[i]
        if n:
            row[:n].copy_(t)
        if n < t_max:
            row[n:].fill_(pad_value)
    lengths = torch.tensor(lengths_list, dtype=torch.int64)
    if get_worker_info() is not None:
        lengths.share_memory_()  # B int64s: moving them is cheaper than a second code path
    return out, lengths


class Buffers(Protocol):
    """Where a thread's batches are built (:func:`pinned_batches`): a staging pool's
    ``acquire`` (:class:`~featbake.serve.prefetch.PinnedPool`)."""

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class _Placement(threading.local):
    pinned: Buffers | None = None  # this thread's staging pool (pinned_batches)
    pool: BatchPool | None = None  # this thread's pool (pooled_batches), else the process's
    whole = False  # PaddedBatch.of leaves the item views to be made when asked (batches_whole)


_placement = _Placement()


@contextlib.contextmanager
def pinned_batches(pool: Buffers) -> Iterator[None]:
    """On this thread, batches are built in ``pool``'s buffers (page-locked where CUDA is).

    ``FeatureLoader(device="cuda")`` reads on its thread inside this with its staging pool
    (:class:`~featbake.serve.prefetch.Staging`), so each batch is built where the
    non-blocking copy to the GPU reads it from, instead of being copied there after.
    """
    before, _placement.pinned = _placement.pinned, pool
    try:
        yield
    finally:
        _placement.pinned = before


@contextlib.contextmanager
def batches_whole() -> Iterator[None]:
    """On this thread, a :class:`PaddedBatch` is made without its item views until asked.

    For a reader that hands what the dataset's ``__getitems__`` returns straight to
    :func:`pad_collate`, which takes the padded tensor and never reads the views. Nothing that
    iterates the batch's items may run inside (a ``StackDataset`` pairing them with labels:
    the list is empty until :meth:`PaddedBatch.with_views`).
    """
    before, _placement.whole = _placement.whole, True
    try:
        yield
    finally:
        _placement.whole = before


@contextlib.contextmanager
def pooled_batches(pool: BatchPool) -> Iterator[None]:
    """On this thread, unpinned batches come from ``pool`` instead of the process's pool.

    ``FeatureLoader`` reads inside this with a pool that keeps as many buffers as it has
    batches alive at once (queued, being built, held by the training loop): the process's pool
    keeps 3, so behind a training step most batches were fresh mappings, page-faulted as they
    were read (3.4x the read's CPU time per batch, measured on 2 CPUs).
    """
    before, _placement.pool = _placement.pool, pool
    try:
        yield
    finally:
        _placement.pool = before


def _alloc(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Allocate an uninitialised tensor: in shared memory inside a DataLoader worker, pinned
    inside :func:`pinned_batches`, else from the process's pool."""
    if get_worker_info() is None:
        if like.device.type == "cpu":
            if _placement.pinned is not None:
                return _placement.pinned.acquire(shape, like.dtype)
            return (_placement.pool or _pool).empty(shape, like.dtype)
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    # Same trick as torch's collate_tensor_fn: a worker's result is sent to the main
    # process through shared memory, so building it there directly saves a full copy.
    numel = 1
    for s in shape:
        numel *= s
    storage = like._typed_storage()._new_shared(numel, device=like.device)
    return like.new(storage).resize_(shape)
