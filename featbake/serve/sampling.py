"""Which items an epoch reads, in which order, on which rank (pure: no I/O, no threads; one
function, :func:`follow_blocks`, hands a block order's plan to the dataset that reads it).

:class:`~featbake.serve.loader.FeatureLoader` yields what ``DataLoader(ds,
sampler=DistributedSampler(ds, ...), batch_size=B, drop_last=...)`` yields, so a training
script can swap one for the other and see the same batches. This module is that sampler's rule,
written out so it can be checked against torch's own over many sizes:

- shuffled: ``torch.randperm(n)`` from a generator seeded with ``seed + epoch`` (every rank
  computes the same permutation), else ``0..n-1``;
- split over ``world`` ranks: without ``drop_last`` the order is padded by repeating its head
  until it divides evenly (every rank takes the same number of steps, as DDP needs); with it,
  the tail that does not divide is dropped; rank ``r`` takes every ``world``-th index from
  ``r``;
- batched: consecutive runs of ``batch_size``; the last, shorter one is kept unless
  ``drop_last``.

With ``even_batches=False`` (Accelerate's name) nothing is repeated or dropped to even out the
ranks: rank ``r`` takes every ``world``-th index from ``r``, so ranks may take one batch more
than others (for evaluation, where a repeated item would count twice).

Resumed over another world size (:meth:`Order.plan`'s ``stages``): every order is the whole
epoch's sequence of units (items, or batches by length) shared out by that rule, so once each
of ``world`` ranks has read its first ``done`` units the units read are the sequence's first
``done * world`` positions; the rest (:func:`rest_of_epoch`, in the epoch's order) is shared
out over the new ranks by the same rule, and again for each later run.

Two other orders are planned here from what the catalog holds (no feature read), and are not
DistributedSampler's (see :class:`Order`):

- **by length** (``batch_frames``): items sorted by length with a little noise (each epoch's
  neighbours differ), cut greedily so that a batch's padded size (items x longest) stays within
  ``batch_frames``, the batches then shuffled; ranks share out whole batches, every rank the
  same number (the first batches repeated to even out, as DistributedSampler repeats items);
- **by block** (``shuffle="blocks"``): shards in a random order, ``window`` shards at a time,
  the items of each window shuffled together. What it gives up: two items of shards in
  different windows never meet in one batch, and an epoch reads a shard's items close together
  in time (items baked together, often from one folder, stay near each other). What it keeps:
  every item once per epoch, a new shard order and new batches every epoch, and a reader that
  needs only ``window`` shards at a time (a tier of a few shards serves an epoch fetching each
  shard about once). A bucket store is told each epoch's windows (:func:`block_plan`,
  :func:`follow_blocks`): it fetches their shards whole, the next window's in the background,
  and evicts a window's once the reads have moved on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import StackDataset, Subset

from featbake.errors import ConfigError
from featbake.length_batches import greedy_batches

#: Each item's int (a shard id, a length), as a list or a numpy array.
Ints = Sequence[int] | np.ndarray
#: What ranks share out: an epoch's items (ints) or its batches (lists of ints).
Unit = TypeVar("Unit")
#: A resume over another world size: the world size a state was saved over and how many
#: batches each of its ranks had handed out (see :func:`rest_of_epoch`).
Stage = tuple[int, int]


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: its indices in order, cut into batches."""

    n: int
    batch_size: int
    shuffle: bool
    seed: int
    epoch: int
    rank: int = 0
    world: int = 1
    drop_last: bool = False
    even_batches: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ConfigError(f"batch_size must be a whole number from 1, got {self.batch_size!r}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be a whole number from 1, got {self.batch_size}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(
                f"rank {self.rank} of {self.world} ranks: rank must be from 0 to world_size - 1"
            )

    def indices(self, order: list[int] | None = None) -> list[int]:
        """This rank's indices for the epoch, in reading order (DistributedSampler's rule), of
        ``order`` when given (the whole epoch's, every rank's alike), else of its own."""
        if order is None:
            order = self.order()
        if self.world == 1:
            return order
        if not self.even_batches:
            return order[self.rank :: self.world]
        total = self.per_rank() * self.world
        if total > len(order) and order:
            pad = total - len(order)
            order = order + (order * math.ceil(pad / len(order)))[:pad]
        return order[:total][self.rank : total : self.world]

    def order(self) -> list[int]:
        """The whole epoch's order, before it is shared out: ``randperm`` of ``seed + epoch``,
        taken modulo 2**64 as torch takes a negative seed (a seed past torch's range would
        otherwise fail at the epoch that reaches it; every seed in it draws as before)."""
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed((self.seed + self.epoch) % (1 << 64))
        order: list[int] = torch.randperm(self.n, generator=g).tolist()
        return order

    def batches(self, order: list[int] | None = None) -> list[list[int]]:
        """The indices cut into batches of ``batch_size`` (the last kept unless ``drop_last``)."""
        idx = self.indices(order)
        cut = [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        if self.drop_last and cut and len(cut[-1]) < self.batch_size:
            cut.pop()
        return cut

    def per_rank(self) -> int:
        """How many indices each rank reads (DistributedSampler's ``num_samples``)."""
        if self.world == 1:
            return self.n
        if not self.even_batches:
            return len(range(self.rank, self.n, self.world))
        if self.drop_last and self.n % self.world:
            return math.ceil((self.n - self.world) / self.world)
        return math.ceil(self.n / self.world)

    def batch_count(self) -> int:
        """How many batches :meth:`batches` returns, without drawing the permutation."""
        per_rank = self.per_rank()
        if self.drop_last:
            return per_rank // self.batch_size
        return math.ceil(per_rank / self.batch_size)


#: The noise added to log(length) before sorting for ``batch_frames``: neighbours differ each
#: epoch while a batch's lengths stay within about 10% of each other.
LENGTH_NOISE = math.log(1.1)


class Shuffle(StrEnum):
    """How an epoch's order is drawn."""

    NONE = "none"  #: the dataset's order
    ITEMS = "items"  #: every item anywhere (``shuffle=True``)
    BLOCKS = "blocks"  #: shards in a random order, a window of them shuffled together


def shuffle_of(shuffle: bool | str) -> Shuffle:
    """``True``/``False``/``"blocks"`` (what FeatureLoader takes) as a :class:`Shuffle`."""
    if shuffle is True or shuffle is False:
        return Shuffle.ITEMS if shuffle else Shuffle.NONE
    if shuffle == "blocks":
        return Shuffle.BLOCKS
    raise ConfigError(f'shuffle must be True, False or "blocks", got {shuffle!r}')


@dataclass(frozen=True)
class Order:
    """What shapes every epoch's batches on one rank but the epoch itself.

    ``batch_frames`` (batches by length) needs ``lengths``, ``Shuffle.BLOCKS`` needs
    ``shards`` (each item's shard id, -1 when not stored): both as the catalog holds them.
    """

    n: int
    batch_size: int | None
    shuffle: Shuffle
    seed: int
    rank: int = 0
    world: int = 1
    drop_last: bool = False
    even_batches: bool = True
    batch_frames: int | None = None
    window: int = 4
    source: str = ""  # the dataset's own fingerprint (a MixedDataset's mixture), "" for none
    # A digest of the items the positions name (the dataset's item ids), "" where unknown: not
    # in the fingerprint (states saved before it resume as they did), checked on its own.
    items: str = ""
    # The dataset's fingerprint as states saved before a mixture inside a ConcatDataset or a
    # mixture was folded in hold it (serve6.4, serve6.11), None where it is ``source``.
    source_before: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch_frames", "window"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a whole number from 1, got {v!r}")
        self.item_plan(0)  # checks batch_size, rank and world

    def fingerprint(self) -> str:
        """A digest of what shapes the order (all but the seed and the rank): a state saved
        under other options, or over another mixture of datasets, must not resume here."""
        left_out = ("seed", "rank", "items", "source_before")
        shape = {k: v for k, v in asdict(self).items() if k not in left_out}
        if not self.source:  # an order over a plain dataset keeps the digest it always had
            del shape["source"]
        blob = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def fingerprint_before(self) -> str | None:
        """:meth:`fingerprint` as a state saved before a mixture inside the dataset was
        folded in holds it; None where it is the same."""
        if self.source_before is None or self.source_before == self.source:
            return None
        return replace(self, source=self.source_before, source_before=None).fingerprint()

    def item_plan(self, epoch: int) -> EpochPlan:
        """DistributedSampler's rule for this order's epoch (batches of ``batch_size``)."""
        size = self.batch_size if self.batch_size is not None else 32
        shuffled = self.shuffle is Shuffle.ITEMS
        return EpochPlan(
            self.n, size, shuffled, self.seed, epoch, self.rank, self.world, self.drop_last,
            self.even_batches,
        )  # fmt: skip

    def block_plan(
        self,
        epoch: int,
        batches: Sequence[Sequence[int]],
        shards: Sequence[int] | None,
        inputs: PlanInputs | None = None,
    ) -> list[list[int]] | None:
        """The shards ``batches`` (this rank's, of epoch ``epoch``, from where it starts
        reading) read window by window (:func:`block_plan`); None unless the order is by
        block. The windows are those of ``inputs`` (what the epoch was planned from) when
        given, else of ``shards``; the shards named are ``shards`` (where the items are now)."""
        if self.shuffle is not Shuffle.BLOCKS:
            return None
        now = _given(shards, "shards", self.n)
        blocks = (inputs or self.inputs(None, now)).blocks
        windows = block_windows(_given(blocks, "shards", self.n), self.seed, epoch, self.window)
        return block_plan(windows, batches, now)

    def batches(
        self, epoch: int, lengths: Sequence[int] | None = None, shards: Sequence[int] | None = None
    ) -> list[list[int]]:
        """This rank's batches of epoch ``epoch``, planned from ``lengths`` and ``shards`` (as
        the catalog holds them now)."""
        return self.plan(epoch, self.inputs(lengths, shards))

    def inputs(self, lengths: Ints | None = None, shards: Ints | None = None) -> PlanInputs:
        """What this order's epochs are planned from of a placement (:class:`PlanInputs`):
        each item's block for ``Shuffle.BLOCKS``, each item's length for ``batch_frames``."""
        blocks = None
        if self.shuffle is Shuffle.BLOCKS:
            sid = np.asarray(_given(shards, "shards", self.n), dtype=np.int64)
            # Ranks of the shard ids: the same windows as the ids (block_windows groups and
            # visits them in id order), and small ints whatever the ids are.
            blocks = np.unique(sid, return_inverse=True)[1].reshape(-1).astype(np.int64)
        lens = None
        if self.batch_frames is not None:
            lens = np.asarray(_given(lengths, "lengths", self.n), dtype=np.int64)
        return PlanInputs(blocks, lens)

    def needs_placement(self) -> bool:
        """Whether an epoch's plan depends on the store's placement (blocks or lengths), not
        only on the options, the seed and the epoch."""
        return self.shuffle is Shuffle.BLOCKS or self.batch_frames is not None

    def plan(self, epoch: int, inputs: PlanInputs, stages: Sequence[Stage] = ()) -> list[list[int]]:
        """This rank's batches of epoch ``epoch``, planned from ``inputs`` (:meth:`inputs`):
        a pure function of the options, the seed, the epoch and ``inputs``. ``stages``: the
        runs over other world sizes this epoch was resumed from (each its world size and the
        batches each of its ranks handed out); this rank's batches are then its share of
        the epoch's rest (:func:`rest_of_epoch`)."""
        units = self.epoch_units(epoch, inputs)
        if self.batch_frames is not None:
            for world, done in stages:
                units = self._rest(units, world, done)
            return share_batches(units, self.rank, self.world, self.drop_last, self.even_batches)
        if not stages:
            return self.item_plan(epoch).batches(units)
        size = self.item_plan(epoch).batch_size
        for world, done in stages:
            units = self._rest(units, world, done * size)
        mine = share_batches(units, self.rank, self.world, self.drop_last, self.even_batches)
        cut = [mine[i : i + size] for i in range(0, len(mine), size)]
        if self.drop_last and cut and len(cut[-1]) < size:
            cut.pop()
        return cut

    def _rest(self, units: list[Unit], world: int, done: int) -> list[Unit]:
        rest = rest_of_epoch(len(units), world, done, self.even_batches, self.drop_last)
        return [units[p] for p in rest]

    def epoch_units(self, epoch: int, inputs: PlanInputs) -> list:
        """The whole epoch before ranks share it out: its items in order (cut into batches of
        ``batch_size`` after sharing), or with ``batch_frames`` its batches."""
        windows = None
        if self.shuffle is Shuffle.BLOCKS:
            blocks = _given(inputs.blocks, "shards", self.n)
            windows = block_windows(blocks, self.seed, epoch, self.window)
        if self.batch_frames is None:
            if windows is not None:
                return [i for w in windows for i in w]
            return self.item_plan(epoch).order()
        lengths = _given(inputs.lengths, "lengths", self.n)
        rng = None if self.shuffle is Shuffle.NONE else _rng(self.seed, epoch, 1)
        cut: list[list[int]] = []
        for group in windows if windows is not None else [list(range(self.n))]:
            part = frame_batches(group, lengths, self.batch_frames, rng, self.batch_size)
            cut += _shuffled(part, rng) if windows is not None else part  # within its window
        if self.shuffle is Shuffle.ITEMS:
            cut = _shuffled(cut, rng)
        return cut


#: What an encoded :class:`PlanInputs` starts with (its format's version).
PLAN_FORMAT = "plan1"
#: The integer types an encoded :class:`PlanInputs` array may have (little-endian).
_PLAN_DTYPES = ("|u1", "<u2", "<u4", "<u8", "|i1", "<i2", "<i4", "<i8")


@dataclass(frozen=True, eq=False)
class PlanInputs:
    """What an epoch's plan is built from besides the options, the seed and the epoch: the
    store's placement as it was when the epoch started (:meth:`Order.inputs`).

    A build, a gc or a write-back moves items between shards (and gc can drop them), so a
    plan recomputed from today's placement is another order: a resumed epoch would repeat some
    items and skip others. A loader's state carries these (:meth:`encode`, a short string for
    a store built in order: runs of one block compress to a few bytes) and plans the rest of
    the epoch from them.

    Attributes:
        blocks: each item's block (its shard's rank among the shard ids, -1 first) for a block
            order, else None.
        lengths: each item's length (-1: not stored) for ``batch_frames``, else None.
    """

    blocks: np.ndarray | None = None
    lengths: np.ndarray | None = None

    @cached_property
    def text(self) -> str:
        """:meth:`encode`, made once (a loader's state is saved often, its epoch's inputs once)."""
        fields = [
            f"{name}={_packed(values)}"
            for name, values in (("blocks", self.blocks), ("lengths", self.lengths))
            if values is not None
        ]
        return ";".join([PLAN_FORMAT, *fields]) if fields else ""

    def encode(self) -> str:
        """These inputs as a plain string (ASCII; "" when the order needs none).

        Example:
            >>> PlanInputs(np.array([0, 0, 1])).encode()[:12]
            'plan1;blocks'
        """
        return self.text

    @classmethod
    def decode(cls, text: str, n: int) -> PlanInputs:
        """The inputs :meth:`encode` gave ``text`` for ``n`` items.

        Raises:
            ConfigError: ``text`` is not what :meth:`encode` gives for ``n`` items.
        """
        if not text:
            return cls()
        head, *fields = text.split(";")
        if head != PLAN_FORMAT:
            raise _bad_plan(f"it starts with {head[:20]!r}, not {PLAN_FORMAT!r}")
        found: dict[str, np.ndarray] = {}
        for field in fields:
            name, _, packed = field.partition("=")
            if name not in ("blocks", "lengths") or name in found:
                raise _bad_plan(f"it has a field {name[:20]!r}")
            found[name] = _unpacked(packed, n)
        if "blocks" in found and (found["blocks"] < 0).any():
            raise _bad_plan("it gives an item a negative block")
        return cls(found.get("blocks"), found.get("lengths"))


def _packed(values: np.ndarray) -> str:
    """``values`` (ints) as ``dtype:base64(zlib(bytes))``, in the smallest type that holds them."""
    lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, 0)
    dtype = np.result_type(np.min_scalar_type(lo), np.min_scalar_type(hi)).newbyteorder("<")
    raw = np.ascontiguousarray(values, dtype=dtype).tobytes()
    return f"{dtype.str}:{base64.b64encode(zlib.compress(raw, 9)).decode('ascii')}"


def _unpacked(packed: str, n: int) -> np.ndarray:
    """The ``n`` ints :func:`_packed` wrote, as int64."""
    dtype, _, data = packed.partition(":")
    if dtype not in _PLAN_DTYPES:
        raise _bad_plan(f"an array's type is {dtype[:20]!r}")
    try:
        raw = zlib.decompress(base64.b64decode(data, validate=True))
    except (binascii.Error, zlib.error, ValueError) as e:
        raise _bad_plan(f"an array does not decode ({e})") from None
    width = np.dtype(dtype).itemsize
    if len(raw) != n * width:
        raise _bad_plan(f"an array has {len(raw) // width} items, and this dataset {n}")
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def _bad_plan(why: str) -> ConfigError:
    return ConfigError(
        f"not a loader's or sampler's state: its 'plan' is not one ({why}); pass what "
        "state_dict() returned, to one over the same dataset"
    )


def _shuffled(batches: list[list[int]], rng: np.random.Generator | None) -> list[list[int]]:
    return batches if rng is None else [batches[j] for j in rng.permutation(len(batches))]


def _given(values: Ints | None, name: str, n: int) -> Ints:
    if values is None or len(values) != n:
        raise ConfigError(f"this order needs each of the {n} items' {name}")
    return values


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    """One generator per (seed, epoch, use): every rank draws the same numbers."""
    return seeded(seed, epoch, salt)


def seeded(*words: int) -> np.random.Generator:
    """numpy's generator of ``words`` (a seed, an epoch, what it draws), for any int a seed
    may be: numpy takes words from 0 only, where torch (``randperm``'s ``seed + epoch``)
    takes negative ones too; a negative word is taken modulo 2**64 (as torch takes a negative
    seed), every word from 0 as numpy takes it, so every plan drawn so far (2**64 and up
    included) is drawn again.

    Example:
        >>> int(seeded(3, 1).integers(100)) == int(np.random.default_rng([3, 1]).integers(100))
        True
        >>> draw = seeded(2**64 + 5).integers(100)
        >>> int(draw) == int(np.random.default_rng(2**64 + 5).integers(100))
        True
    """
    return np.random.default_rng([w if w >= 0 else w % (1 << 64) for w in map(int, words)])


def block_windows(shards: Ints, seed: int, epoch: int, window: int) -> list[list[int]]:
    """Items grouped by shard, the shards in a random order, ``window`` shards at a time, the
    items of each window shuffled together (items not stored, shard -1, are one more block)."""
    sid = np.asarray(shards, dtype=np.int64)
    rng = _rng(seed, epoch, 0)
    by_shard = np.argsort(sid, kind="stable")
    ids, starts = np.unique(sid[by_shard], return_index=True)
    members = np.split(by_shard, starts[1:]) if len(ids) else []
    visit = rng.permutation(len(members))
    out = []
    for k in range(0, len(visit), window):
        items = np.concatenate([members[j] for j in visit[k : k + window]])
        out.append([int(i) for i in rng.permutation(items)])
    return out


def block_plan(
    windows: Sequence[Sequence[int]], batches: Sequence[Sequence[int]], shards: Ints
) -> list[list[int]]:
    """The shards a rank reads, window by window, in its reading order: ``batches`` cut where
    an item's window (of the epoch's ``windows``) changes, each run's shards in their first
    read's order (items not stored, shard -1, name none). A rank's share repeats the first
    items at its end to even out the ranks: they are one more run.

    Example:
        >>> block_plan([[0, 1], [2, 3]], [[1, 0], [3], [2, 0]], shards=[5, 5, 7, 8])
        [[5], [8, 7], [5]]
    """
    flat = np.asarray([i for b in batches for i in b], dtype=np.int64)
    if not len(flat):
        return []
    window_of = np.empty(len(shards), dtype=np.int64)
    for k, w in enumerate(windows):
        window_of[np.asarray(w, dtype=np.int64)] = k
    sid = np.asarray(shards, dtype=np.int64)[flat]
    cuts = np.flatnonzero(np.diff(window_of[flat])) + 1
    plan = []
    for run in np.split(sid, cuts):
        stored = run[run >= 0]
        names, first = np.unique(stored, return_index=True)
        plan.append([int(s) for s in names[np.argsort(first)]])
    return plan


def follow_blocks(dataset: object, plan: list[list[int]] | None) -> bool:
    """Hand ``plan`` (:func:`block_plan`; None: no block order) to the dataset that reads it:
    ``dataset`` or, through ``Subset`` and ``StackDataset``, the member whose shards the plan
    names (the first that has ``follow_blocks``, as loaders take the first that knows each
    item's placement). Whether a store follows it."""
    follow = _method_of(dataset, "follow_blocks")
    return follow is not None and bool(follow(plan))


#: Shards a window of a block order holds unless the store's tier calls for fewer.
DEFAULT_WINDOW = 4


def window_for(dataset: object, shuffle: Shuffle, window: int | None) -> int:
    """A loader's ``window``: as given, else :data:`DEFAULT_WINDOW` shards, or fewer where a
    bucket store's tier would not hold two windows of the dataset's shards (its
    ``block_window``, found as :func:`follow_blocks` finds its reader): the default then
    fetches each shard about once an epoch by itself. Only a block order asks; every other
    order keeps the default (and the fingerprint its saved states carry)."""
    if window is not None:
        return window
    fitting = _method_of(dataset, "block_window")
    if shuffle is not Shuffle.BLOCKS or fitting is None:
        return DEFAULT_WINDOW
    return int(fitting(DEFAULT_WINDOW))


def _method_of(dataset: object, method: str) -> Callable[..., Any] | None:
    """``dataset``'s ``method``, or that of the first member through ``Subset`` and
    ``StackDataset`` that has it; None when none has it."""
    found = getattr(dataset, method, None)
    if callable(found):
        return found
    if isinstance(dataset, Subset):
        return _method_of(dataset.dataset, method)
    if isinstance(dataset, StackDataset):
        members = dataset.datasets
        for m in members.values() if isinstance(members, dict) else members:
            found = _method_of(m, method)
            if found is not None:
                return found
    return None


def frame_batches(
    items: Sequence[int],
    lengths: Ints,
    budget: int,
    rng: np.random.Generator | None,
    max_items: int | None = None,
) -> list[list[int]]:
    """``items`` in batches whose padded size (items x longest) is at most ``budget`` frames.

    Sorted by length (with noise on log(length) when ``rng`` is given, so that each epoch's
    batches differ), then cut greedily: a batch ends where the next item would take it over
    ``budget`` (or ``max_items``). An item longer than ``budget`` on its own is a batch of its
    own (as lhotse's samplers do; the loaders warn, :func:`too_long`). Returns the batches in
    length order.

    Raises:
        ConfigError: an item's length is not stored yet.
    """
    if not len(items):
        return []
    ix = np.asarray(items, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)[ix]
    if (lens < 0).any():
        raise ConfigError(
            f"batch_frames needs each item's length from the store, and {(lens < 0).sum()} "
            "items have none: they are not stored yet (run `featbake build` on the data first, "
            "or read one epoch with batch_size, then ds.flush()), or their dataset does not "
            "say its lengths (a ViewsDataset, a dataset of your own in a MixedDataset: use "
            "batch_size for it)"
        )
    key = np.log(np.maximum(lens, 1).astype(np.float64))
    if rng is not None:
        key = key + rng.uniform(0.0, LENGTH_NOISE, len(key))
    order = np.argsort(key, kind="stable").tolist()
    cut = greedy_batches(order, lens.tolist(), budget, max_items or None)
    return [[int(ix[j]) for j in batch] for batch in cut]


def share_batches(
    batches: list[Unit], rank: int, world: int, drop_last: bool, even: bool
) -> list[Unit]:
    """Rank ``rank``'s share of an epoch's batches (or items: DistributedSampler's rule):
    every ``world``-th from ``rank``; with ``even`` every rank takes as many (the first
    batches repeated to even out, or with ``drop_last`` the last ones dropped)."""
    if world == 1 or not batches:
        return batches
    if even and len(batches) % world:
        if drop_last:
            batches = batches[: len(batches) - len(batches) % world]
        else:
            pad = world - len(batches) % world
            batches = batches + (batches * math.ceil(pad / len(batches)))[:pad]
    return batches[rank::world]


def too_long(lengths: Ints, budget: int) -> tuple[int, int]:
    """How many items are longer than ``budget`` frames (each a batch of its own), and the
    longest length (0 for none)."""
    lens = np.asarray(lengths, dtype=np.int64)
    return int((lens > budget).sum()), int(lens.max()) if len(lens) else 0


def shared_length(n: int, world: int, even: bool, drop_last: bool) -> int:
    """How many units (items, or batches by length) ``world`` ranks read of an epoch's ``n``
    together (:func:`share_batches`): with ``even`` a multiple of ``world`` (the first ones
    repeated, or with ``drop_last`` the last ones dropped), else ``n``."""
    if world == 1 or not even or not n or n % world == 0:
        return n
    return (n // world) * world if drop_last else math.ceil(n / world) * world


def rest_of_epoch(n: int, world: int, done: int, even: bool, drop_last: bool) -> list[int]:
    """The positions of an epoch's ``n`` units that ``world`` ranks had not read once each
    had read the first ``done`` units of its share, in order: what a resume over another
    world size shares out anew.

    Rank ``r`` reads positions ``r, r + world, ...`` of the shared sequence (a position past
    ``n`` repeats position ``p % n``, one past the dropped tail is never read), so the first
    ``done`` of every rank are the positions below ``done * world``.

    Example:
        >>> rest_of_epoch(7, world=2, done=2, even=True, drop_last=False)
        [4, 5, 6]
    """
    total = shared_length(n, world, even, drop_last)
    read = np.zeros(n, dtype=bool)
    if n:
        read[np.arange(min(done * world, total)) % n] = True
    return [int(p) for p in np.flatnonzero(~read[: min(n, total)])]
