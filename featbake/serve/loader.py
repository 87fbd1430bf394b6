"""``FeatureLoader``: batches read ahead on a thread of the training process, no workers.

With ``DataLoader(num_workers=N)`` every batch is read in a worker process, then pickled
through a pipe (or a shared-memory handle) to the training process: measured on 2 cores, that
hand-off capped every reader at 650-930 items/s while featbake reads 6,000/s in the main
process (issue 19). Its reads (``pread`` + CRC-32C) release the GIL, so a thread can read the
next batches while the training step runs, as FFCV's loader does, with no pickling and no
second copy of the dataset's state.

What it yields is what ``DataLoader(ds, batch_size=B, sampler=DistributedSampler(ds, ...),
collate_fn=pad_collate, drop_last=...)`` yields (see :mod:`featbake.serve.sampling`), labels
included when ``ds`` is a ``StackDataset(features, labels)``; or batches by length
(``batch_frames``), or blocks of shards (``shuffle="blocks"``: give a bucket store's tier room
for two windows, since a batch may straddle two), planned from the catalog without a read.
Every epoch is a function of the options, seed and epoch (and, by length or by block, of the
store's placement when it started), so :meth:`FeatureLoader.state_dict` is a few ints (and that
placement, compressed: see :mod:`featbake.serve.loader`).

Cold reads: on a store larger than the page cache each read waits for the disk, and one read
at a time ran at half to two thirds of the disk's bandwidth here (0.7x mmap'd safetensors
shards one item per step: a page fault reads megabytes around each tensor). The loader knows
which items come next, so before each batch it asks the dataset to start reading the next
``read_ahead`` items (:meth:`CachedFeatureDataset.will_need`, ``posix_fadvise(WILLNEED)`` per
tensor): those reads are in flight together while the thread reads and checks the current
batch, and find their pages cached when their turn comes (1.3-1.6x the mmap'd shards, one item
per step and batches of 32; ``make bench`` part ``cold``). On a warm store the hints find
every page cached and thin out to every 8th item (see :class:`ReadAhead`).

How it uses the CPUs: one reader thread calls ``ds.__getitems__`` for one batch at a time
(the dataset spreads a batch's rows over up to 4 threads of its own) and collates it; misses
are encoded live on that thread with torch's thread count, beside the training step. The
thread shares the GIL with the step: measured on 2 cores beside a small probe's step (many
small torch calls, each giving up and taking back the GIL), the reads were not hidden and the
epoch took 1.8-2.5x the step alone. Much of that was not the GIL (the reader took it back
10-20 us after each batch's compiled read) but page faults: the batches alive behind a step
outnumbered the process's 3 pooled buffers, so each batch was a fresh mapping (3.4x the read's
CPU). The loader now keeps ``prefetch + 4`` buffers of its own, and reads on one thread while
the loop has a batch to go on with (queued beyond the one it may be waiting to take: see
:func:`threads_cap`), so the step keeps the CPUs it chose. Keep ``DataLoader`` with workers
when items need heavy Python work per item (augmentation), when the step is Python-heavy, or
when most items miss: those want processes of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import itertools
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Sampler, StackDataset, Subset

import featbake.device as dev
from featbake.errors import ConfigError, FeatbakeError
from featbake.pace import Pace, ReadsOn
from featbake.serve.collate import (
    BatchPool,
    batches_whole,
    pad_collate,
    pinned_batches,
    pooled_batches,
)
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.index import ItemPlacement
from featbake.serve.prefetch import Staging, holding_attribute
from featbake.serve.reads import handing_over, read_threads_at_most
from featbake.serve.sampling import (
    Order,
    PlanInputs,
    Shuffle,
    Stage,
    follow_blocks,
    shuffle_of,
    too_long,
    window_for,
)

# == read_ahead ====================================================================================
# What the loader asks of its dataset, reached through ``StackDataset`` and ``Subset``: the
# reads to start ahead of a batch (:class:`ReadAhead`, :func:`hint_of`) and each item's length
# and shard (:func:`placement_of`), which plan epochs by length and by block.
#: Items whose reads are started ahead of the batch being read (measured on a cold store of
#: ~600 KB items: 16-64 in flight all gave about the disk's bandwidth; 1 gave half of it).
READ_AHEAD = 32
#: Items in a row found cached after which only every SAMPLE-th item is hinted (see ReadAhead).
WARM_STREAK = 256
SAMPLE = 32


class ReadAhead:
    """Which items to hint before each batch: those up to ``window`` past the batch's end.

    The batches are one rank's epoch in order; each item is hinted once, before its batch is
    read and at most ``window`` items ahead of that batch's end. ``hint`` returns
    how many reads it started. Once ``WARM_STREAK`` items in a row were all cached (a store in
    the page cache), only every ``SAMPLE``-th item is hinted, which is enough to notice the
    store going cold: the first sampled item that starts a read has the items skipped since the
    last sample hinted too, and ends the streak. (A hint per item made a warm epoch of one item
    per step 5-10% slower here.)
    """

    def __init__(
        self,
        batches: Sequence[Sequence[int]],
        window: int,
        hint: Callable[[list[int]], int] | None,
        streak: int = 0,
    ) -> None:
        self._flat = [i for idx in batches for i in idx] if hint is not None and window else []
        self._ends = list(itertools.accumulate(len(idx) for idx in batches))
        self._window = window
        self._chunk = max(1, window // 4)
        self._hint = hint
        self._done = 0  # items of the flat order hinted (or skipped as warm) so far
        self.streak = streak  # items in a row whose hints found them cached (an epoch's
        # last is the next one's first: a warm store is not probed item by item every epoch)
        self._skipped: list[int] = []  # items not hinted since the last sample (warm)

    def before(self, b: int) -> None:
        """Hint the items not hinted yet, up to ``window`` past the end of batch ``b``.

        Batch ``b``'s own items are always hinted by now; past them, hints wait until a
        quarter of the window is due, so one item per step makes one call per few items (each
        call's probe lets the training thread take the GIL, which it may then hold for a while).
        """
        if self._hint is None or not self._flat:
            return
        start, upto = self._done, min(len(self._flat), self._ends[b] + self._window)
        if upto - start < self._chunk and start >= self._ends[b]:
            return
        self._done = upto
        flat = self._flat
        if self.streak < WARM_STREAK:
            started = self._hint(flat[start:upto])
        else:
            self._skipped += [flat[p] for p in range(start, upto) if p % SAMPLE]
            sample = [flat[p] for p in range(start, upto) if not p % SAMPLE]
            if not sample:
                return
            started = self._hint(sample)
            if started:  # cold again: the items skipped since the last sample too
                self._hint(self._skipped)
            self._skipped = []
        self.streak = 0 if started else self.streak + upto - start


def hint_of(dataset: Any) -> Callable[[list[int]], int] | None:
    """The dataset's ``will_need``, or one that reaches it through ``StackDataset`` members
    (which all take the same index) or a ``Subset`` (which maps it); None when it has none."""
    hint = getattr(dataset, "will_need", None)
    if callable(hint):
        return hint
    if isinstance(dataset, Subset):
        inner = hint_of(dataset.dataset)
        if inner is None:
            return None
        mapping = dataset.indices
        return lambda idx: inner([mapping[i] for i in idx])
    if isinstance(dataset, StackDataset):
        members = dataset.datasets
        found = [hint_of(m) for m in (members.values() if isinstance(members, dict) else members)]
        hints = [h for h in found if h is not None]
        if hints:
            return lambda idx: sum(h(idx) for h in hints)
    return None


def ahead_window(dataset: Any, read_ahead: int) -> int:
    """The items to hint ahead: ``read_ahead``, or more where the dataset's store advises it
    (a bucket read by ranges: see ``CachedFeatureDataset.ahead_items``); 0 stays 0."""
    advice = getattr(dataset, "ahead_items", None)
    if not read_ahead or not callable(advice):
        return read_ahead
    return max(read_ahead, int(advice()))


def placement_of(dataset: Any, epoch: int | None = None) -> ItemPlacement | None:
    """Each item's length and shard as the catalog holds them (no feature read), through
    ``StackDataset`` (its first member that knows) and ``Subset``; None when none knows.

    ``epoch``: for a dataset that draws its items per epoch (it has ``set_epoch``, as a
    :class:`~featbake.MixedDataset`), that epoch's placement, without drawing it: a loader
    plans an epoch (or ``len()`` of the next) while its reader thread reads the current one.
    """
    placement = getattr(dataset, "placement", None)
    if callable(placement):
        per_epoch = epoch is not None and callable(getattr(dataset, "set_epoch", None))
        found: ItemPlacement = placement(epoch) if per_epoch else placement()
        return found
    if isinstance(dataset, Subset):
        inner = placement_of(dataset.dataset, epoch)
        if inner is None:
            return None
        idx = np.asarray(dataset.indices, dtype=np.int64)
        return ItemPlacement(inner.lengths[idx], inner.shards[idx])
    if isinstance(dataset, StackDataset):
        members = dataset.datasets
        for m in members.values() if isinstance(members, dict) else members:
            if (inner := placement_of(m, epoch)) is not None:
                return inner
    return None


def _members(dataset: StackDataset | ConcatDataset) -> list[Any]:
    members = dataset.datasets
    return list(members.values() if isinstance(members, dict) else members)


def set_epoch_of(dataset: Any, epoch: int) -> None:
    """Tell the dataset which epoch is read (a :class:`~featbake.MixedDataset` draws its
    items per epoch): its ``set_epoch``, or its members' through ``StackDataset``,
    ``ConcatDataset`` and ``Subset``. A loader calls it before planning each epoch: the
    epoch's placement is the dataset's of that epoch."""
    setter = getattr(dataset, "set_epoch", None)
    if callable(setter):
        setter(epoch)
    elif isinstance(dataset, Subset):
        set_epoch_of(dataset.dataset, epoch)
    elif isinstance(dataset, StackDataset | ConcatDataset):
        for m in _members(dataset):
            set_epoch_of(m, epoch)


def draws_per_epoch(dataset: Any) -> bool:
    """Whether the dataset draws its items per epoch (it has ``set_epoch``, as a
    :class:`~featbake.MixedDataset`), itself or a member of a ``StackDataset``,
    ``ConcatDataset`` or ``Subset``: its placement is then each epoch's own."""
    if callable(getattr(dataset, "set_epoch", None)):
        return True
    if isinstance(dataset, Subset):
        return draws_per_epoch(dataset.dataset)
    if isinstance(dataset, StackDataset | ConcatDataset):
        return any(draws_per_epoch(m) for m in _members(dataset))
    return False


def warn_hidden_draws(dataset: Any) -> None:
    """Warn where a dataset of the user's own holds a :class:`~featbake.MixedDataset`
    (``Labelled(mixed).mixed``) and has no ``set_epoch`` to pass the epoch on: unless the
    wrapper sets the mixture's epoch itself, the loader's epochs never reach it, and every
    epoch reads epoch 0's draw (a down-weighted dataset never read past it). A warning, not a
    refusal: a wrapper may drive its mixture's epochs itself."""
    if draws_per_epoch(dataset):
        return
    held = holding_attribute(dataset, is_mixture)
    if held is not None:
        kind = type(dataset).__name__
        warnings.warn(
            f"{kind} holds a MixedDataset ({held}) and has no set_epoch, so the loader cannot "
            f"pass it the epoch: unless {kind} sets it itself, every epoch reads epoch 0's "
            f"draw; give {kind} a set_epoch(epoch) that calls self.{held}.set_epoch(epoch) "
            f"(and a fingerprint() returning self.{held}.fingerprint(), so a resume checks it)",
            HiddenDrawsWarning,
            stacklevel=3,
        )


def is_mixture(dataset: Any) -> bool:
    """Whether ``dataset`` is a mixture that draws its items per epoch (a
    :class:`~featbake.MixedDataset`, known by what it offers: ``set_epoch``, ``locate`` and
    ``fingerprint``; serve/mixing.py imports this module, not the other way round)."""
    return all(callable(getattr(dataset, m, None)) for m in ("set_epoch", "locate", "fingerprint"))


class HiddenDrawsWarning(UserWarning):
    """A loader's dataset hides a mixture whose epochs it cannot set (see
    :func:`warn_hidden_draws`)."""


def fingerprint_of(dataset: Any) -> str:
    """The dataset's own ``fingerprint()`` (a mixture's datasets' lengths, weights, items per
    epoch and seed), through ``StackDataset``, ``ConcatDataset`` and ``Subset``; "" for none.
    A loader folds it into its state's fingerprint: a state of another mixture is refused."""
    fingerprint = getattr(dataset, "fingerprint", None)
    if callable(fingerprint):
        return str(fingerprint())
    if isinstance(dataset, Subset):
        return fingerprint_of(dataset.dataset)
    if isinstance(dataset, StackDataset):
        return next((f for f in map(fingerprint_of, _members(dataset)) if f), "")
    if isinstance(dataset, ConcatDataset):  # each member's, in order (a mixture among them)
        inner = [fingerprint_of(m) for m in _members(dataset)]
        return hashlib.sha256("\n".join(inner).encode()).hexdigest()[:16] if any(inner) else ""
    return ""


def fingerprint_before(dataset: Any) -> str:
    """:func:`fingerprint_of` as featbake took it before a mixture inside a ``ConcatDataset``
    or a mixture was folded in (serve6.4, serve6.11): a mixture's own, a concatenation's "".
    A state saved then is still taken at an epoch's start (see :meth:`Resume.load`)."""
    own = getattr(dataset, "own_fingerprint", None)
    if callable(own):
        return str(own())
    fingerprint = getattr(dataset, "fingerprint", None)
    if callable(fingerprint):
        return str(fingerprint())
    if isinstance(dataset, Subset):
        return fingerprint_before(dataset.dataset)
    if isinstance(dataset, StackDataset):
        return next((f for f in map(fingerprint_before, _members(dataset)) if f), "")
    return ""


def items_of(dataset: Any) -> str:
    """A digest of the items the dataset's positions name (a CachedFeatureDataset's item ids,
    a MixedDataset's datasets' items), through ``StackDataset`` and ``ConcatDataset`` (their
    members') and ``Subset`` (its indices too); "" when none says. A loader's state carries
    it: a state part way through an epoch cannot resume over other items (a build or gc since
    that dropped one input and added another keeps the count, and every position past them
    names another item)."""
    own = getattr(dataset, "items_digest", None)
    if callable(own):
        return str(own())
    parts: list[str] = []
    if isinstance(dataset, Subset):
        inner = items_of(dataset.dataset)
        if inner:
            picked = np.asarray(dataset.indices, dtype=np.int64).tobytes()
            parts = [inner, hashlib.sha256(picked).hexdigest()]
    elif isinstance(dataset, StackDataset | ConcatDataset):
        parts = [items_of(m) for m in _members(dataset)]
    if not any(parts):
        return ""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def warn_too_long(inputs: PlanInputs, budget: int | None) -> bool:
    """Warn (one line) when items are longer than ``budget`` frames: each is read as a batch
    of its own. Whether it warned."""
    if budget is None or inputs.lengths is None:
        return False
    count, longest = too_long(inputs.lengths, budget)
    if count:
        warnings.warn(
            f"{count} items are longer than batch_frames={budget} (the longest has {longest} "
            f"frames): each is read as a batch of its own; give batch_frames at least "
            f"{longest} to batch them",
            stacklevel=4,  # the user's iter(), len() or DataLoader
        )
    return bool(count)


# == resume ========================================================================================
# Where a :class:`~featbake.serve.loader.FeatureLoader` stands in its epochs, to resume.
#
# A state is small and plain: the epoch, how many of its batches were handed out, the seed, the
# rank and world size, a fingerprint of the options that shape the order, and (by length or by
# block) the placement the epoch was planned from. Every epoch's batches are a pure function of
# those (:mod:`featbake.serve.sampling`), so a new loader with the same arguments recomputes the
# epoch and skips what was handed out: nothing is read twice or skipped, and the epochs after
# it are the uninterrupted loader's. The placement is the one of the epoch's start, not the
# store's now: a build, a gc or the write-back of misses moves items between shards, and a
# plan recomputed from where they are now is another order (issue "round four", item 5).
#: The keys of a state and their types ("plan", the placement, and "resumed", the runs over
#: other world sizes the epoch was resumed from, are read on their own: older states lack them).
STATE_KEYS = {
    "epoch": int,
    "position": int,
    "seed": int,
    "rank": int,
    "world_size": int,
    "fingerprint": str,
}


@dataclass
class Progress:
    """The epoch being read: its number, batches handed out so far, how many it has, and what
    it was planned from (None when its order needs no placement)."""

    epoch: int
    done: int
    total: int
    inputs: PlanInputs | None = None
    stages: tuple[Stage, ...] = ()


@dataclass(frozen=True)
class Position:
    """Where a loader stands: the epoch to read, its batches already handed out, what that
    epoch was planned from (None: planned when it starts, from the placement then), and the
    runs over other world sizes it was resumed from (each its world size and the batches each
    of its ranks handed out: :meth:`Order.plan` shares out the rest)."""

    epoch: int
    done: int
    inputs: PlanInputs | None = None
    stages: tuple[Stage, ...] = ()


@dataclass
class Resume:
    """The loader's resume state, kept on the training thread.

    Attributes:
        pending: the position loaded and not started yet.
        current: the epoch being read (or the last one read).
    """

    pending: Position | None = None
    current: Progress | None = None
    #: An epoch a loaded state was saved at the end of (its position the next epoch's start):
    #: ``set_epoch`` of it reads nothing, and the next epoch is read whole.
    finished: int | None = None

    def choose(self, epoch: int) -> None:
        """``set_epoch(epoch)``: a loaded position holds only for its own epoch, but for the
        epoch it was saved at the end of (a state saved at an epoch's last batch says the next
        epoch's start; a loop resuming "the epoch it was in" is told that epoch is read)."""
        p = self.pending
        if p is None or p.epoch == epoch:
            return
        if p.epoch == epoch + 1 and p.done == 0 and not p.stages:
            self.finished = epoch
            return
        self.pending = None

    def inputs_for(self, epoch: int) -> PlanInputs | None:
        """What epoch ``epoch`` must be planned from: the loaded state's when it resumes that
        epoch, else None (planned from the store's placement now)."""
        if self.pending is not None and self.pending.epoch == epoch:
            return self.pending.inputs
        return None

    def stages_for(self, epoch: int) -> tuple[Stage, ...]:
        """The runs over other world sizes epoch ``epoch`` resumes from (none unless loaded)."""
        if self.pending is not None and self.pending.epoch == epoch:
            return self.pending.stages
        return ()

    def start(self, epoch: int, total: int, inputs: PlanInputs | None = None) -> int:
        """Epoch ``epoch`` (``total`` batches, planned from ``inputs``) starts: how many of its
        batches to skip."""
        if self.finished == epoch:  # read before the state was saved: the next one stays
            self.finished = None
            self.current = Progress(epoch, total, total, inputs, ())
            return total
        skip, stages = 0, self.stages_for(epoch)
        if self.pending is not None and self.pending.epoch == epoch:
            skip = min(self.pending.done, total)
        self.pending, self.finished = None, None
        self.current = Progress(epoch, skip, total, inputs, stages)
        return skip

    def handed_out(self) -> None:
        """One more batch reached the training loop."""
        assert self.current is not None
        self.current.done += 1

    def where(self, next_epoch: int) -> Position:
        """The position to save, ``next_epoch`` being the loader's next."""
        if self.pending is not None:
            return self.pending
        c = self.current
        if c is not None and c.epoch == next_epoch - 1 and c.done < c.total:
            return Position(c.epoch, c.done, c.inputs, c.stages)
        return Position(next_epoch, 0)

    def within(self, epoch: int) -> Position:
        """The position to save for a sampler on epoch ``epoch`` (which it does not leave by
        itself): the batches of it handed out, all of them once it is read."""
        c = self.current
        if self.pending is None and c is not None and c.epoch == epoch:
            return Position(c.epoch, c.done, c.inputs, c.stages)
        return self.pending or Position(epoch, 0)

    @staticmethod
    def saved(order: Order, at: Position) -> dict[str, Any]:
        """The state to save at ``at`` (see :meth:`FeatureLoader.state_dict`)."""
        plan = "" if at.inputs is None else at.inputs.encode()
        return {"epoch": at.epoch, "position": at.done, "seed": order.seed, "rank": order.rank,
                "world_size": order.world, "fingerprint": order.fingerprint(), "plan": plan,
                "resumed": [list(stage) for stage in at.stages], "items": order.items,
                "window": order.window}  # fmt: skip

    def load(self, order: Order, state: Any, *, default_window: bool = False) -> tuple[Order, int]:
        """Take ``state``: the order with its seed, and the epoch to read next.

        With ``default_window`` (no ``window`` was given, so it is the one the tier here
        fits), the order takes the state's window: a block order's default follows the
        node's tier (``window_for``), and the run resumed goes on in the saved run's order.

        A state saved over another world size (at the step the run stopped: rank 0's, which
        has the most batches when they are uneven) resumes its epoch over this one: the items
        (batches, by length) its ranks had not read are shared out over this run's ranks
        (:func:`~featbake.serve.sampling.rest_of_epoch`).

        Raises:
            ConfigError: not a state, options (or a mixture) that shape another order, or a
                state part way through an epoch by length or by block that lacks the
                placement the epoch was planned from.
        """
        checked = _checked(state)
        saved_world = checked["world_size"]
        window = saved_window(checked, order.window, default_window)
        order = dataclasses.replace(order, seed=checked["seed"], window=window)
        stages, done = _stages(checked), checked["position"]
        _same_order(dataclasses.replace(order, world=saved_world, rank=0), checked)
        _same_items(order, checked, bool(stages or done))
        if saved_world != order.world and done:
            stages, done = (*stages, (saved_world, done)), 0
        inputs = _inputs(order, checked)
        self.pending = Position(checked["epoch"], done, inputs, stages)
        self.current = None
        return order, checked["epoch"]


def saved_window(state: dict[str, Any], window: int, default: bool) -> int:
    """The window to resume ``state`` with: the state's when this one is the ``default``
    (a block order's default follows the tier, r12.m2), else ``window``; a state saved before
    states carried it keeps ``window``.

    Raises:
        ConfigError: the state's ``window`` is not a whole number from 1.
    """
    saved = state.get("window")
    if saved is None:
        return window
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
        raise ConfigError(f"not a loader state: 'window' is {saved!r}; pass what state_dict() gave")
    return saved if default else window


def _same_order(as_saved: Order, state: dict[str, Any]) -> None:
    """Refuse a state saved with options that give another order than ``as_saved``; one
    saved before a mixture inside a ``ConcatDataset`` or a mixture was fingerprinted is taken
    in epoch 0 or at an epoch's start: that inner mixture then drew its epoch 0 in every
    epoch, so part way through a later one its positions named other items.

    Raises:
        ConfigError: another order, or such an older state part way through an epoch.
    """
    if as_saved.fingerprint() == state["fingerprint"]:
        return
    if as_saved.fingerprint_before() == state["fingerprint"]:
        if state["epoch"] and (state["position"] or _stages(state)):
            raise ConfigError(
                f"this loader state is part way through epoch {state['epoch']}, saved by a "
                "featbake whose mixture inside a ConcatDataset or a mixture drew its epoch 0 in "
                "every epoch, so the rest of that epoch cannot be read as it was; "
                f"{_LOADER_RESTART}"
            )
        return
    raise ConfigError(
        "this loader state was saved with options that give another order (batch_size, "
        "batch_frames, shuffle, window, drop_last, even_batches, a dataset of another "
        "length, or a MixedDataset of other datasets, weights, epoch_items or seed): "
        "make the loader with the arguments of the saved run"
    )


#: How a FeatureLoader's state refused over other items reads its epoch from the start.
_LOADER_RESTART = "load the state with 'position' 0 and 'resumed' [] to read that epoch afresh"


def _same_items(
    order: Order, state: dict[str, Any], started: bool, restart: str = _LOADER_RESTART
) -> None:
    """Refuse a state part way through an epoch (``started``) saved over other items than the
    dataset's now (its ``items``; a state saved before states kept it is taken as it is);
    ``restart`` says how to read that epoch from its start instead.

    Raises:
        ConfigError: the items differ, or ``items`` is not a string.
    """
    saved = state.get("items", "")
    if not isinstance(saved, str):
        raise ConfigError(f"not a loader state: 'items' is {saved!r}; pass what state_dict() gave")
    if started and saved and order.items and saved != order.items:
        raise ConfigError(
            f"this state is part way through epoch {state['epoch']} of other items than this "
            "dataset's (a build or gc since changed which inputs it serves, keeping their "
            "count, or the dataset is wrapped otherwise than when it was saved: another "
            "StackDataset, ConcatDataset or Subset around it), so the rest of that epoch cannot "
            f"be told apart; make the dataset as it was, over the data as it was, or {restart}"
        )


def _stages(state: dict[str, Any]) -> tuple[Stage, ...]:
    """The state's ``resumed`` runs (none in a state saved before they were kept)."""
    runs = state.get("resumed", [])
    ok = isinstance(runs, list) and all(
        isinstance(r, list | tuple)
        and len(r) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
        and r[0] >= 1
        for r in runs
    )
    if not ok:
        raise ConfigError(
            f"not a FeatureLoader state: 'resumed' is {runs!r}; pass what state_dict() returned"
        )
    return tuple((int(w), int(d)) for w, d in runs)


def _inputs(order: Order, state: dict[str, Any]) -> PlanInputs | None:
    """The placement ``state``'s epoch was planned from, None when it needs none (its order
    needs no placement, or no batch of it was handed out: planned afresh when it starts).

    Raises:
        ConfigError: the state is part way through an epoch by length or by block and does not
            say what it was planned from (saved before states kept it), or its plan is not one.
    """
    text = state.get("plan", "")
    if not isinstance(text, str):
        raise ConfigError(
            f"not a FeatureLoader state: 'plan' is {text!r}; pass what state_dict() returned"
        )
    if not order.needs_placement() or (state["position"] == 0 and not state.get("resumed")):
        return None
    if not text:
        raise ConfigError(
            f"this loader state is {state['position']} batches into epoch {state['epoch']} and "
            "does not hold the shard placement and lengths that epoch was planned from (saved "
            "by an older featbake), and a build, gc or write-back since would change its order: "
            "load it with position 0 to start the epoch over"
        )
    inputs = PlanInputs.decode(text, order.n)
    lacks = (order.shuffle is Shuffle.BLOCKS and inputs.blocks is None) or (
        order.batch_frames is not None and inputs.lengths is None
    )
    if lacks:
        raise ConfigError(
            "not a FeatureLoader state: its 'plan' lacks what this order is planned from; pass "
            "what state_dict() returned"
        )
    return inputs


def _checked(
    state: Any, keys: dict[str, type] = STATE_KEYS, what: str = "FeatureLoader"
) -> dict[str, Any]:
    """``state`` if it is a ``what`` state (every key of ``keys``, of its type, a count from
    0), else a ConfigError. A seed is any int (the loader takes a negative one)."""
    if not isinstance(state, dict):
        raise ConfigError(f"a {what} state is a dict from state_dict(), got {type(state).__name__}")
    for key, kind in keys.items():
        value = state.get(key)
        if (
            not isinstance(value, kind)
            or isinstance(value, bool)
            or (isinstance(value, int) and value < 0 and key != "seed")
        ):
            raise ConfigError(
                f"not a {what} state: {key!r} is {value!r}; pass what state_dict() returned"
            )
    return state


#: The keys of a BlockSampler's state and their types.
SAMPLER_KEYS = {
    "epoch": int,
    "yielded": int,
    "seed": int,
    "world_size": int,
    "fingerprint": str,
    "plan": str,
}


# == blocks ========================================================================================
# ``BlockSampler``: the block shuffle as a sampler for ``DataLoader``, and the rank and world
# size that a sampler or loader takes from ``torch.distributed`` when not given.
class BlockSampler(Sampler[int]):
    """Indices in blocks of shards, for ``DataLoader`` users: what ``FeatureLoader(ds,
    shuffle="blocks")`` reads, as a sampler.

    Each epoch visits the shards in a new order (``seed`` and the epoch), ``window`` shards at a
    time, the items of each window shuffled together: a reader needs only ``window`` shards at
    once, so a bucket store's tier of a few shards serves the epoch fetching each about once.
    What it gives up against a full shuffle is in :mod:`featbake.serve.sampling`. Split over
    ranks as ``DistributedSampler`` (``num_replicas``, ``rank`` default from
    ``torch.distributed``; the first items repeated so every rank takes as many).

    Args:
        dataset: a :class:`~featbake.CachedFeatureDataset` (or one in a ``StackDataset`` or
            ``Subset``): its catalog says each item's shard, nothing is read.
        seed: the order's seed (the same on every rank).
        window: shards open at a time; by default 4, or fewer where a bucket store's tier
            would not hold two windows of the dataset's shards (a loaded state's window, the
            one its run chose, replaces the default).
        num_replicas, rank: this process's share, as ``DistributedSampler``.
        drop_last: drop the items that do not divide evenly among ranks instead of repeating.

    The placement is read once, when the sampler is made, and every epoch is planned from it.
    :meth:`state_dict` carries it with the indices of the epoch handed out so far
    (``yielded``), so a sampler made after a build, a gc or a write-back that loads the state
    yields the rest of that epoch, then draws the orders the first would have: the protocol of
    torchdata's ``StatefulDistributedSampler``, which its ``StatefulDataLoader`` follows. A
    plain ``DataLoader`` with workers takes indices ahead of the loop (``prefetch_factor``
    batches per worker), so a state saved in the loop counts those as read and a resume skips
    them: save through ``StatefulDataLoader`` there (``num_workers=0`` is exact).

    Example:
        >>> sampler = BlockSampler(ds, seed=0, window=4)  # doctest: +SKIP
        >>> loader = DataLoader(ds, 32, sampler=sampler, collate_fn=pad_collate)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for padded, lengths in loader: ...
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int = 0,
        window: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        placement = placement_of(dataset)
        if placement is None:
            raise ConfigError(
                "BlockSampler needs a CachedFeatureDataset (or one in a StackDataset or Subset), "
                "whose catalog knows each item's shard"
            )
        self._shards = placement.shards.tolist()
        self._dataset = dataset  # told each epoch's windows (a bucket store fetches by them)
        self._per_epoch = draws_per_epoch(dataset)  # a mixture: each epoch's own placement
        rank, world = rank_and_world(rank, num_replicas)
        self._window_given = window is not None  # else a state's window is taken (r12.m2)
        window = window_for(dataset, Shuffle.BLOCKS, window)
        # The mixture's fingerprint, as FeatureLoader's; "" before it was folded in (r12.m1).
        self._order = Order(len(dataset), 1, Shuffle.BLOCKS, seed, rank, world, drop_last,
                            window=window, source=fingerprint_of(dataset),
                            items=items_of(dataset), source_before="")  # fmt: skip
        self._inputs = self._order.inputs(shards=self._shards)  # what every epoch is drawn from
        self.epoch = 0
        self.yielded = 0  # indices of the epoch being read handed out so far
        self._pending: Position | None = None  # loaded: (epoch, indices to skip)
        self._chosen: int | None = None  # set_epoch's since the last iter() (see load)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s order next (call it before each epoch, as DistributedSampler),
        and tell the dataset (a mixture draws its items per epoch); a loaded state's rest
        holds only for its own epoch."""
        if epoch != self.epoch:  # none of it handed out yet: a state saved now reads it all
            self.yielded = 0
        self.epoch, self._chosen = epoch, epoch
        if self._pending is not None and self._pending.epoch != epoch:
            self._pending = None
        set_epoch_of(self._dataset, epoch)

    def __iter__(self) -> Iterator[int]:
        """The epoch's indices (the rest of a loaded state's epoch), planned at the first
        ``next``: torchdata's ``StatefulDataLoader`` makes an iterator when it loads a state
        and, where that state's epoch had ended, drops it for a new one; planned at ``iter()``,
        the first took the loaded position and the second read the whole epoch again."""
        yield from self._epoch_read()

    def _epoch_read(self) -> Iterator[int]:
        """:meth:`__iter__`'s indices, planned now."""
        skip = 0
        if self._pending is not None and self._pending.epoch == self.epoch:
            skip = self._pending.done
        if self._per_epoch and not skip:  # a mixture's blocks: the items this epoch draws
            self._inputs = self._order.inputs(shards=self._epoch_shards())
        self._pending = None
        if self._per_epoch:
            self._shards = self._epoch_shards()
        batches = self._order.plan(self.epoch, self._inputs)
        order = [i for b in batches for i in b]
        rest = [order[skip:]]
        follow_blocks(
            self._dataset, self._order.block_plan(self.epoch, rest, self._shards, self._inputs)
        )
        self.yielded = min(skip, len(order))
        return self._counted(order[skip:])

    def _epoch_shards(self) -> list[int]:
        """Each position's shard in the epoch read (a mixture's items of that epoch)."""
        placement = placement_of(self._dataset, self.epoch)
        assert placement is not None  # it had one when the sampler was made
        return [int(s) for s in placement.shards]

    def _counted(self, order: list[int]) -> Iterator[int]:
        """``order``, counting in :attr:`yielded` each index as it is handed out; the epoch
        read, a ``set_epoch`` before it no longer says which epoch a state loaded next is for."""
        for i in order:
            self.yielded += 1
            yield i
        self._chosen = None

    def __len__(self) -> int:
        return self._order.item_plan(self.epoch).per_rank()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, its indices handed out so far, the seed, a fingerprint of the options
        (and of a mixture sampled), the window and the placement the orders are drawn from
        (plain ints and strings): what :meth:`load_state_dict` goes on from."""
        o = self._order
        at = self._pending or Position(self.epoch, self.yielded)
        return {"epoch": at.epoch, "yielded": at.done, "seed": o.seed, "world_size": o.world,
                "fingerprint": o.fingerprint(), "plan": self._inputs.encode(),
                "items": o.items, "window": o.window}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`state_dict` of a sampler with the same arguments over
        the same dataset): the next ``iter()`` yields the rest of its epoch, and every epoch is
        drawn from its seed and its placement, whatever the store holds now.

        Raises:
            ConfigError: not such a state, or saved over another world size or with options
                that give another order.
        """
        checked = _checked(state, SAMPLER_KEYS, "BlockSampler")
        window = saved_window(checked, self._order.window, not self._window_given)
        order = dataclasses.replace(self._order, seed=checked["seed"], window=window)
        before = checked["fingerprint"] == order.fingerprint_before()
        if checked["world_size"] != order.world or not (
            before or order.fingerprint() == checked["fingerprint"]
        ):
            raise ConfigError(
                "this BlockSampler state was saved over another world size or with options that "
                "give another order (window, drop_last, a dataset of another length, or a "
                "MixedDataset of other datasets, weights, epoch_items or seed): make the "
                "sampler with the arguments of the saved run"
            )
        _same_items(order, checked, checked["yielded"] > 0, "load it with 'yielded' 0")
        inputs = PlanInputs.decode(checked["plan"], order.n)
        if inputs.blocks is None:
            raise ConfigError("not a BlockSampler state: its 'plan' has no blocks")
        if before and checked["yielded"]:
            self._same_draw(order, checked, inputs.blocks)
        self._order, self._inputs, self.epoch = order, inputs, checked["epoch"]
        self._pending = Position(checked["epoch"], checked["yielded"])
        if self._chosen is not None:  # torchdata loads it at iter(), after the loop's set_epoch
            self.set_epoch(self._chosen)
        set_epoch_of(self._dataset, self.epoch)

    def _same_draw(self, order: Order, state: dict[str, Any], blocks: np.ndarray) -> None:
        """Refuse a state part way through an epoch saved before the mixture was folded into
        the fingerprint (r12.m1) unless the mixture draws that epoch as the state's plan says
        (each position's block): the same mixture over the same placement, as far as the
        state can tell.

        Raises:
            ConfigError: the mixture's draw of that epoch puts other blocks at its positions.
        """
        placement = placement_of(self._dataset, state["epoch"])
        assert placement is not None  # it had one when the sampler was made
        now = order.inputs(shards=placement.shards).blocks
        if now is None or not np.array_equal(now, blocks):
            raise ConfigError(
                f"this BlockSampler state is {state['yielded']} indices into epoch "
                f"{state['epoch']} and was saved by a featbake that did not fold the mixture "
                "into it; this mixture draws other items at that epoch's positions (another "
                "mixture, or a build or gc since moved them), so the rest of that epoch "
                "cannot be read as it was: load it with 'yielded' 0 to read that epoch afresh"
            )


class LengthBatchSampler(Sampler[list[int]]):
    """Batches by length for ``DataLoader(batch_sampler=...)`` and torchdata's
    ``StatefulDataLoader``: what ``FeatureLoader(ds, batch_frames=...)`` reads, as lists of
    indices.

    Items of similar length go together, each batch's padded size (items x longest) at most
    ``batch_frames`` frames and at most ``batch_size`` items when given, planned from each
    item's length as the catalog holds it (``ds.placement().lengths``: rows of the stored
    features; nothing is read). An item longer than ``batch_frames`` is a batch of its own
    (one warning says how many), as lhotse's samplers do.

    Args:
        dataset: a :class:`~featbake.CachedFeatureDataset` or :class:`~featbake.MixedDataset`
            (or one in a ``StackDataset`` or ``Subset``).
        batch_frames: the padded size a batch stays within, in frames (time steps).
        batch_size: at most this many items a batch.
        shuffle: a new order each epoch (``seed`` and the epoch); ``"blocks"``: by length
            within blocks of ``window`` shards, shards in a new order each epoch (a bucket
            store's tier told each epoch's windows), as ``FeatureLoader(shuffle="blocks")``;
            False: batches in length order.
        window: shards open at a time for ``shuffle="blocks"``, as :class:`FeatureLoader`'s.
        seed: the order's seed (the same on every rank).
        rank, world_size: this process's share (whole batches), as ``DistributedSampler``.
        drop_last: over several ranks, drop the batches that do not divide evenly instead of
            repeating the first ones.
        even_batches: False reads each batch once, ranks taking one batch more than others.

    Each epoch is planned when it starts, from the placement then (call :meth:`set_epoch`
    before each, as with ``DistributedSampler``; it is handed on to a dataset that draws its
    items per epoch). :meth:`state_dict` is a :class:`FeatureLoader`'s state (the epoch, the
    batches handed out, the placement it was planned from): a new sampler that loads it yields
    the rest of that epoch, even over another world size (the rest shared out anew). Save it
    through ``StatefulDataLoader``: a plain ``DataLoader`` with workers takes batches ahead of
    the loop, which a state saved in the loop counts as read.

    Example:
        >>> sampler = LengthBatchSampler(ds, batch_frames=20_000, seed=0)  # doctest: +SKIP
        >>> loader = StatefulDataLoader(  # doctest: +SKIP
        ...     ds, batch_sampler=sampler, collate_fn=pad_collate
        ... )
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for padded, lengths in loader: ...
    """

    def __init__(  # noqa: PLR0913 - the options FeatureLoader takes for batch_frames
        self,
        dataset: Any,
        batch_frames: int,
        *,
        batch_size: int | None = None,
        shuffle: bool | str = True,
        window: int | None = None,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        even_batches: bool = True,
    ) -> None:
        if batch_frames is None:
            raise ConfigError("LengthBatchSampler needs batch_frames, a whole number from 1")
        rank, world = rank_and_world(rank, world_size)
        self._dataset = dataset
        order = shuffle_of(shuffle)  # "blocks" as FeatureLoader reads it (r12.m3)
        self._order = Order(
            len(dataset), batch_size, order, seed, rank, world, drop_last, even_batches,
            batch_frames, window_for(dataset, order, window), source=fingerprint_of(dataset),
            items=items_of(dataset), source_before=fingerprint_before(dataset),
        )  # fmt: skip
        self._window_given = window is not None  # else a state's window is taken (r12.m2)
        self.epoch = 0
        self._resume = Resume()
        self._warned = False
        self._chosen: int | None = None  # set_epoch's since the last iter() (see load)

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` next; a loaded state's rest holds only for its own epoch."""
        self.epoch, self._chosen = epoch, epoch
        self._resume.choose(epoch)
        set_epoch_of(self._dataset, epoch)

    def _planned(self) -> tuple[list[list[int]], PlanInputs]:
        """This rank's batches of the epoch: from the loaded state's placement when it
        resumes that epoch, else from the dataset's now."""
        inputs = self._resume.inputs_for(self.epoch)
        if inputs is None:
            placement = placement_of(self._dataset, self.epoch)
            if placement is None:
                raise ConfigError(
                    "LengthBatchSampler needs a CachedFeatureDataset (or a MixedDataset of "
                    "them, or one in a StackDataset or Subset), whose catalog knows each length"
                )
            inputs = self._order.inputs(placement.lengths, placement.shards)
        self._warned = self._warned or warn_too_long(inputs, self._order.batch_frames)
        return self._order.plan(self.epoch, inputs, self._resume.stages_for(self.epoch)), inputs

    def __iter__(self) -> Iterator[list[int]]:
        """The epoch's batches (the rest of a loaded state's epoch), planned at the first
        ``next``, as :meth:`BlockSampler.__iter__`'s (an iterator made and dropped by
        torchdata's restore takes no loaded position)."""
        yield from self._epoch_read()

    def _epoch_read(self) -> Iterator[list[int]]:
        """:meth:`__iter__`'s batches, planned now."""
        set_epoch_of(self._dataset, self.epoch)  # a mixture draws the epoch read
        batches, inputs = self._planned()
        skip = self._resume.start(self.epoch, len(batches), inputs)
        if self._order.shuffle is Shuffle.BLOCKS:  # the tier fetches the epoch's windows
            placement = placement_of(self._dataset, self.epoch)  # where the items are now
            shards = None if placement is None else placement.shards.tolist()
            follow_blocks(
                self._dataset, self._order.block_plan(self.epoch, batches[skip:], shards, inputs)
            )
        return self._counted(batches[skip:])

    def _counted(self, batches: list[list[int]]) -> Iterator[list[int]]:
        """``batches``, each counted as handed out once the loader asks for it; the epoch
        read, a ``set_epoch`` before it no longer says which epoch a state loaded next is for."""
        for batch in batches:
            self._resume.handed_out()
            yield batch
        self._chosen = None

    def __len__(self) -> int:
        """Batches in the epoch to plan next (its whole share, even when resumed part way)."""
        return len(self._planned()[0])

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands, as :meth:`FeatureLoader.state_dict` (plain ints and
        strings): the epoch, its batches handed out, the seed, the world size, a fingerprint
        of the options and the placement the epoch was planned from."""
        return self._resume.saved(self._order, self._resume.within(self.epoch))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`state_dict` of a sampler with the same options over
        the same dataset, or a :class:`FeatureLoader`'s with ``batch_frames``): the next
        ``iter()`` yields the rest of its epoch.

        Raises:
            ConfigError: not such a state, or saved with options (or over a mixture) that
                give another order.
        """
        self._order, self.epoch = self._resume.load(
            self._order, state, default_window=not self._window_given
        )
        if self._chosen is not None:  # torchdata loads it at iter(), after the loop's set_epoch
            self.set_epoch(self._chosen)
        set_epoch_of(self._dataset, self.epoch)


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank and world size given, else torch.distributed's, else the whole dataset."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if distributed():
        dist = torch.distributed
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    if rank is not None or world_size is not None:
        raise ConfigError(
            "give both rank and world_size (or neither, to take them from torch.distributed)"
        )
    return 0, 1


def distributed() -> bool:
    """True inside an initialised ``torch.distributed`` process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# == loader ========================================================================================
#: How long the reader waits to hand over a batch before it looks at the stop flag again.
_POLL_SECONDS = 0.1
#: Every reader thread of this process still running, by its run: stopped at exit
#: (:func:`_stop_readers_at_exit`), before the interpreter's teardown.
_LIVE_READERS: weakref.WeakKeyDictionary[_ThreadRun, threading.Thread] = weakref.WeakKeyDictionary()


def _stop_readers_at_exit() -> None:
    """Stop the readers of iterators a script left open (a step-counted loop that ends
    mid-epoch), while the interpreter is whole: a reader still in torch's code during the
    teardown ended the process with ``terminate called without an active exception``."""
    for run, reader in list(_LIVE_READERS.items()):
        FeatureLoader._reader_stopped(run, reader)


atexit.register(_stop_readers_at_exit)


class ReaderDied(FeatbakeError):
    """The loader's reader thread ended without handing over its batches or an error."""


@dataclass(frozen=True)
class _Failed:
    """The reader thread's exception, handed to the training thread in place of a batch."""

    error: BaseException


_END = object()
#: Batches whose copies to the device are started before the one handed out (as
#: ``DevicePrefetcher``'s default depth).
STAGED_AHEAD = 2


def reads_on_of(asked: str, staging: Staging | None) -> ReadsOn:
    """``reads_on`` checked: ``"auto"``, ``"thread"`` or ``"loop"``; auto reads on the thread
    when batches are staged to a device (the copy ahead needs the batch read ahead).

    Raises:
        ConfigError: any other value.
    """
    try:
        reads_on = ReadsOn(asked)
    except ValueError:
        raise ConfigError(f"reads_on must be 'auto', 'thread' or 'loop', got {asked!r}") from None
    if reads_on is ReadsOn.AUTO and staging is not None:
        return ReadsOn.THREAD
    return reads_on


def staging_to(device: torch.device | None, staging: bool | None) -> Staging | None:
    """How a loader's batches reach ``device``: copied through a :class:`Staging` (on CUDA,
    or wherever ``staging`` is True), else None (they stay where they are read)."""
    if device is None or staging is False or (staging is None and not dev.is_cuda(device)):
        return None
    return Staging(device, staged=True)


_NOTHING = object()  # no batch held (see Held)


class FeatureLoader:
    """An iterable over collated batches, read ahead on a thread of this process.

    Args:
        dataset: a map-style dataset: a :class:`~featbake.CachedFeatureDataset`, a
            :class:`~featbake.MixedDataset` of several (told each epoch: ``set_epoch``), or a
            ``StackDataset`` of one with labels; anything with ``__getitems__`` or
            ``__getitem__`` and ``__len__``.
        batch_size: items per batch (default 32); with ``batch_frames``, at most this many.
        shuffle: ``True``: a new order each epoch (``seed + epoch``), as ``DistributedSampler``;
            ``"blocks"``: shards in a new order each epoch, ``window`` of them at a time, their
            items shuffled together (see :mod:`featbake.serve.sampling` for what it gives up);
            ``False``: the dataset's order.
        batch_frames: batches by length instead: items of similar length together, each
            batch's padded size (items x longest) at most this many frames (time steps), from
            the lengths the catalog holds; every rank gets as many batches. An item longer
            than this is a batch of its own (one warning says how many).
        window: shards open at a time for ``shuffle="blocks"``; by default 4, or fewer where
            a bucket store's tier would not hold two windows of the dataset's shards (then
            each shard is fetched about once an epoch); a loaded state's window, the one its
            run chose, replaces the default.
        drop_last: drop the last, short batch (and, over several ranks, the indices that do
            not divide evenly among them).
        even_batches: over several ranks, repeat the first items (batches, with
            ``batch_frames``) so that every rank takes as many steps, as ``DistributedSampler``
            does and DDP needs; ``False`` (for evaluation) reads each item once, and ranks may
            take one batch more than others (Accelerate's ``even_batches``).
        prefetch: batches read ahead of the one the training step holds. On the CPU each batch
            alive at once has a buffer of the loader's own, reused: ``prefetch + 4`` batches'
            memory stay with the loader between epochs.
        read_ahead: items past the batch being read whose reads are started early (a hint to
            the kernel, for a store that is not in the page cache); 0 starts none. Used when
            the dataset has ``will_need`` (a :class:`~featbake.CachedFeatureDataset`, or one
            inside a ``StackDataset`` or ``Subset``).
        seed: the shuffle's seed; None draws one per loader (0 under ``torch.distributed``,
            where every rank must draw the same order).
        collate_fn: turns a batch's items into what the step takes (default :func:`pad_collate`).
        device: move each batch there (``"cuda"``: built in page-locked buffers on the reader
            thread, copied on a side stream ``STAGED_AHEAD`` batches before it is handed out:
            :class:`~featbake.serve.prefetch.Staging`, as ``DevicePrefetcher``); None leaves it
            on the CPU.
        staging: copy batches to ``device`` through the staging pool; None: on CUDA only.
            True with ``device="cpu"`` runs that path with plain copies, as
            ``DevicePrefetcher(staging=True)`` does (how it is tested without a GPU).
        rank, world_size: this process's share of every epoch, as ``DistributedSampler``;
            default from ``torch.distributed`` when it is initialised, else the whole dataset.
        reads_on: where batches are read. ``"thread"``: on the loader's reader thread, ahead
            of the step. ``"loop"``: in the training loop's thread when it asks for the next
            batch, as ``DataLoader(num_workers=0)`` does. ``"auto"`` (the default): on the
            thread, and in the loop while the loop's steps take under an eighth of a batch's
            read, where there is no step to hide a read behind and the hand-over between
            threads is all the thread adds (a loop that only reads ran 1.1-1.25x faster so;
            see :mod:`featbake.pace`). With ``device`` staging, always the thread.

    Each ``iter()`` is one epoch and advances the epoch; :meth:`set_epoch` chooses the next.
    :meth:`state_dict` and :meth:`load_state_dict` resume an epoch where it stopped.

    Example:
        >>> ds = CachedFeatureDataset("./audio", "ckpt.pt")  # doctest: +SKIP
        >>> loader = FeatureLoader(StackDataset(ds, labels), batch_size=32)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     loader.set_epoch(epoch)
        ...     for padded, lengths, labels in loader:
        ...         step(padded, lengths, labels)
    """

    def __init__(  # noqa: PLR0913 - the public options, as DataLoader takes them
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        shuffle: bool | str = True,
        batch_frames: int | None = None,
        window: int | None = None,
        drop_last: bool = False,
        even_batches: bool = True,
        prefetch: int = 4,
        seed: int | None = None,
        collate_fn: Callable[[Sequence[Any]], Any] = pad_collate,
        device: str | torch.device | None = None,
        staging: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        read_ahead: int = READ_AHEAD,
        reads_on: str = "auto",
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch must be a whole number from 1, got {prefetch!r}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ConfigError(f"read_ahead must be a whole number from 0, got {read_ahead!r}")
        warn_hidden_draws(dataset)
        self.read_ahead = read_ahead
        self._streak = 0  # ReadAhead's, carried from one epoch to the next
        self.dataset = dataset
        self.collate_fn = collate_fn
        # pad_collate takes a dataset's padded batch as it is: its item views go unmade
        self._whole = collate_fn is pad_collate and batches_reach_collate(dataset)
        self.prefetch = prefetch
        # Every batch alive at once has a buffer of its own, reused from batch to batch: the
        # queue's, the one the reader builds (or waits to hand over), the training loop's
        # current and previous batch (its loop variable holds that one while next() runs), and
        # the dataset's batch that a collate copies from (pad_collate of StackDataset items).
        self._buffers = BatchPool(keep=prefetch + 4)
        self.device = None if device is None else dev.resolve_device(device)
        self._staging = staging_to(self.device, staging)
        self._pace = Pace(reads_on_of(reads_on, self._staging))
        rank, world = rank_and_world(rank, world_size)
        if seed is None:  # ranks must draw one order: DistributedSampler's default seed, 0
            seed = 0 if world > 1 or distributed() else int(torch.randint(0, 2**31, (1,)).item())
        if batch_size is None and batch_frames is None:
            batch_size = 32
        # Order checks batch_size, batch_frames, window, rank and world.
        order = shuffle_of(shuffle)
        self._order = Order(
            len(dataset), batch_size, order, seed, rank, world, drop_last, even_batches,
            batch_frames, window_for(dataset, order, window), fingerprint_of(dataset),
            items_of(dataset), fingerprint_before(dataset),
        )  # fmt: skip
        self._window_given = window is not None  # else a state's window is taken (r12.m2)
        self.epoch = 0
        self._resume = Resume()
        self._shards: list[int] | None = None  # each item's shard now, for a block order's plan
        self._warned = False  # about items longer than batch_frames: once per loader

    @property
    def seed(self) -> int:
        return self._order.seed

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s order next (as ``DistributedSampler.set_epoch``); the rest of
        a resumed epoch is kept when ``epoch`` is that epoch."""
        self.epoch = epoch
        self._resume.choose(epoch)
        set_epoch_of(self.dataset, epoch)

    def __len__(self) -> int:
        """Batches in the next epoch (the whole epoch, even when resumed part way; resumed
        over another world size, this rank's share of the rest)."""
        if self._order.batch_frames is None and not self._resume.stages_for(self.epoch):
            return self._order.item_plan(self.epoch).batch_count()  # blocks too: split alike
        return len(self._batches(self.epoch)[0])

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the epoch, the batches of it handed out (those read ahead
        but not handed out are read again), the seed, the world size, a fingerprint of the
        options that shape the order, and ``plan``: for an epoch by length or by block, the
        placement it was planned from (each item's block and length as the catalog held them
        when it started; compressed, a few bytes per shard for a store built in order), so
        that a build, gc or write-back since does not change the rest of it; ``resumed``,
        the runs over other world sizes this epoch was resumed from; and ``window``, the block
        order's (a loader made without one takes it: the default follows the node's tier).
        Plain ints and strings, for any checkpoint.

        Example:
            >>> state = {"model": model.state_dict(), "data": loader.state_dict()}  # doctest: +SKIP
            >>> loader.load_state_dict(state["data"])  # a new run, same arguments  # doctest: +SKIP
        """
        return self._resume.saved(self._order, self._resume.where(self.epoch))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`state_dict` of a loader with the same arguments): the
        next ``iter()`` yields the rest of that epoch, the ones after it the next epochs.

        The seed is the state's (a loader made with ``seed=None`` draws its own). Each rank
        loads its own state (rank 0's serves every rank too while batches are even). The rest
        of an epoch by length or by block is planned from the placement the state holds, the
        epochs after it from the store as it is then, as the uninterrupted loader's were.

        A state saved over another world size resumes the epoch over this one (load rank 0's
        on every rank): the items (batches, by length) the saved run's ranks had not read, in
        the epoch's order, are shared out over this run's ranks. With ``even_batches=False``
        each item of the epoch is read once across the runs; with the default, the only
        repeats are those that give each run's ranks as many steps.

        Raises:
            ConfigError: the state is not one, or was saved with options (or over a
                MixedDataset) that give another order, or is part way through an epoch by
                length or by block and was saved without its placement (by an older featbake).
        """
        self._order, self.epoch = self._resume.load(
            self._order, state, default_window=not self._window_given
        )
        set_epoch_of(self.dataset, self.epoch)

    def __iter__(self) -> Iterator[Any]:
        return self._epoch_through(self._staging, STAGED_AHEAD)

    def staged_through(self, staging: Staging, depth: int) -> Iterator[Any] | None:
        """The next epoch's batches copied to the device through ``staging``, ``depth``
        batches ahead, each counted as handed out when the loop takes it: what a
        ``DevicePrefetcher`` wrapping this loader reads (before, the batches it started ahead
        counted as read, and a state saved in the loop skipped them). None for a loader that
        moves its batches itself (``device=``): the prefetcher reads it as any loader."""
        if self._staging is not None:
            return None
        return self._epoch_through(staging, depth)

    def _epoch_through(self, staging: Staging | None, depth: int) -> Iterator[Any]:
        """The next epoch's batches, through ``staging`` (``depth`` ahead) when given."""
        epoch = self.epoch
        self.epoch += 1
        set_epoch_of(self.dataset, epoch)  # a mixture draws the epoch read
        batches, inputs = self._batches(epoch)
        skip = self._resume.start(epoch, len(batches), inputs)
        plan = self._order.block_plan(epoch, batches[skip:], self._shards, inputs)
        follow_blocks(self.dataset, plan)
        read = self._epoch(batches, skip)
        if staging is not None:
            read = staging.ahead(read, depth)
        return self._handed(read)

    @property
    def staging(self) -> Staging | None:
        """How batches reach ``device`` (its pinned pool's counters: ``staging.pool.stats()``),
        None when they stay on the CPU."""
        return self._staging

    def _handed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, each counted as handed out when the training loop takes it (those
        started on the device ahead of it are read again by a state saved now)."""
        try:
            for batch in batches:
                self._resume.handed_out()
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # the reader stops at once, not when the generator is collected

    def _batches(self, epoch: int) -> tuple[list[list[int]], PlanInputs | None]:
        """This rank's batches of epoch ``epoch`` and what they were planned from: a loaded
        state's placement for the epoch it resumes, else lengths and shards from the catalog
        now when the order needs them (no feature is read to plan an epoch)."""
        o = self._order
        stages = self._resume.stages_for(epoch)
        if not o.needs_placement():
            return o.plan(epoch, PlanInputs(), stages), None
        placement = placement_of(self.dataset, epoch)  # a mixture's: that epoch's
        if placement is None:
            raise ConfigError(
                "batch_frames and shuffle='blocks' need a CachedFeatureDataset (or a "
                "MixedDataset of them, or one in a StackDataset or Subset), whose catalog knows "
                "each item's length and shard"
            )
        self._shards = placement.shards.tolist()  # where the items are now: what to fetch
        inputs = self._resume.inputs_for(epoch)
        if inputs is None:
            inputs = o.inputs(placement.lengths, placement.shards)
        self._warned = self._warned or warn_too_long(inputs, o.batch_frames)
        return o.plan(epoch, inputs, stages), inputs

    def _epoch(self, batches: list[list[int]], skip: int) -> Iterator[Any]:
        """The epoch's batches from ``skip`` on, read on the reader thread or in the loop's
        thread as the loop's pace says (:mod:`featbake.pace`), in order either way."""
        batches = batches[skip:]
        window = ahead_window(self.dataset, self.read_ahead)
        ahead = ReadAhead(batches, window, hint_of(self.dataset), self._streak)
        b = 0
        try:
            while b < len(batches):
                if self._pace.choose():
                    b = yield from self._in_loop(batches, b, ahead)
                else:
                    b = yield from self._on_thread(batches, b, ahead)
        finally:
            self._streak = ahead.streak

    def _in_loop(
        self, batches: list[list[int]], start: int, ahead: ReadAhead
    ) -> Generator[Any, None, int]:
        """Batches from ``start`` read in the loop's thread when it asks, as long as its pace
        keeps them there; the batch to go on from (``len(batches)``: none)."""
        pace = self._pace
        for b in range(start, len(batches)):
            t0 = time.perf_counter()
            ahead.before(b)
            with self._building():
                batch = self.collate_fn(_items(self.dataset, batches[b]))
            t1 = time.perf_counter()
            pace.read(t1 - t0)
            yield batch
            pace.stepped(time.perf_counter() - t1)
            if not pace.choose():
                return b + 1
        return len(batches)

    def _on_thread(
        self, batches: list[list[int]], start: int, ahead: ReadAhead
    ) -> Generator[Any, None, int]:
        """Batches from ``start`` read ahead on a reader thread, until the loop's pace moves the
        reads into the loop (the thread then stops after the batch it is reading); the batch
        to go on from (``len(batches)``: none)."""
        run = _ThreadRun(batches, queue.Queue(maxsize=self.prefetch))
        reader = threading.Thread(
            target=self._read, args=(run, start, ahead), name="featbake-loader", daemon=True
        )
        reader.start()
        _LIVE_READERS[run] = reader
        pace = self._pace
        try:
            while True:
                item = _next_from(run.ready, reader, run.waiting)
                if item is _END:
                    return len(batches)
                if isinstance(item, _Switched):
                    return item.at
                if isinstance(item, _Failed):
                    raise item.error
                t0 = time.perf_counter()
                yield item
                pace.stepped(time.perf_counter() - t0)
                if pace.choose():
                    run.switch.set()  # the reader stops after the batch it is reading
        finally:
            self._reader_stopped(run, reader)

    @staticmethod
    def _reader_stopped(
        run: _ThreadRun,
        reader: threading.Thread,
        empty: type[Exception] = queue.Empty,
        finalizing: Callable[[], bool] = sys.is_finalizing,
        live: weakref.WeakKeyDictionary[_ThreadRun, threading.Thread] = _LIVE_READERS,
    ) -> None:
        """Stop ``run``'s reader (the step stopped early, or failed: it ends at its next batch)
        and wait for it, its queue drained so it is never blocked on a put.

        An iterator a script left open is closed in the interpreter's teardown, after its
        modules' names are gone (``queue`` is None there): what this needs is bound here, and
        there the daemon reader ends with the process, unwaited. Before, the teardown printed
        ``Exception ignored in: <generator object FeatureLoader._handed>`` and a traceback.
        The cyclic collector closes an iterator left in a reference cycle on whichever thread
        allocates, often the reader itself: told to stop, it ends at its next batch, unwaited
        (joining itself raised ``RuntimeError: cannot join current thread``)."""
        run.stop.set()
        if finalizing() or threading.current_thread() is reader:
            return
        try:
            while True:
                run.ready.get_nowait()
        except empty:
            pass
        reader.join()
        live.pop(run, None)

    def _read(self, run: _ThreadRun, start: int, ahead: ReadAhead) -> None:
        """The reader thread: read and collate each batch from ``start``, in order, until told
        to stop, or to switch (then ``_Switched`` says where the loop goes on).

        Everything it runs is inside the ``try``: the training thread must get any error,
        not wait for a batch that never comes.
        """
        try:
            with self._building():
                self._read_batches(run, start, ahead)
        except BaseException as e:  # handed to the training thread, raised there
            _put(run.ready, _Failed(e), run.stop)

    @contextlib.contextmanager
    def _building(self) -> Iterator[None]:
        """How this thread builds batches while inside: for a device in the staging pool's
        buffers (the copy to the device reads them there), else in the loader's own pool; and
        taken whole by pad_collate where the dataset's reads reach it."""
        staging = self._staging
        pool = pooled_batches(self._buffers) if staging is None else pinned_batches(staging.pool)
        with pool, batches_whole() if self._whole else contextlib.nullcontext():
            yield

    def _read_batches(self, run: _ThreadRun, start: int, ahead: ReadAhead) -> None:
        """Read each batch from ``start`` and hand it over, in order: a batch is handed over
        just before the next one's rows are read (:func:`handing_over`), or after that read
        when it read none.
        """
        ready, stop, batches = run.ready, run.stop, run.batches
        held = Held(ready, stop)
        ahead.before(start)
        for b in range(start, len(batches)):
            if stop.is_set():
                return
            if run.switch.is_set():  # the loop reads the rest: hand over what is read
                held.hand()
                _put(ready, _Switched(b), stop)
                return
            cap = threads_cap(ready.qsize() + held.count(), run.waiting.now)
            t0 = time.perf_counter()
            try:
                with read_threads_at_most(cap), handing_over(held.hand):
                    batch = self.collate_fn(_items(self.dataset, batches[b]))
            finally:
                held.hand()  # no rows read (misses, the RAM tier), or the read failed: now
            self._pace.read(time.perf_counter() - t0)
            if held.stopped:
                return
            if b + 1 < len(batches):  # before the hand-over: the training thread waits now
                ahead.before(b + 1)
            held.hold(batch)
        held.hand()
        if not held.stopped:
            _put(ready, _END, stop)


@dataclass(eq=False)  # one run is one object: kept by identity (_LIVE_READERS)
class _ThreadRun:
    """One run of the reader thread: the epoch's batches, the queue it hands them over in,
    and what the loop tells it (stop; switch: the loop reads the rest) and shows (waiting)."""

    batches: list[list[int]]
    ready: queue.Queue[Any]
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    switch: threading.Event = dataclasses.field(default_factory=threading.Event)
    waiting: Waiting = dataclasses.field(default_factory=lambda: Waiting(now=True))


@dataclass(frozen=True)
class _Switched:
    """The reader thread stopped for the loop to read the rest, from batch ``at``."""

    at: int


@dataclass
class Waiting:
    """Whether the training thread is waiting for the reader's next batch: set by it around
    its wait on the queue (:func:`_next_from`), read by the reader (:func:`threads_cap`)."""

    now: bool = False


def threads_cap(queued: int, waiting: bool = False) -> int | None:
    """The cap on a batch's read threads (:func:`read_threads_at_most`) with ``queued`` batches
    ready: one while the training loop has a batch to go on with, none once it may wait.

    A loop ``waiting`` for a batch has none to go on with, even with one queued: that one is
    the batch the reader has just handed over, which the loop has not taken yet: it needs the
    GIL, which the reader may hold from its ``put`` to this check. Read as "a batch to go on
    with", it capped most batches of a read-only epoch at one thread (FeatureLoader at ~0.55x
    ``DataLoader(num_workers=0)`` on 2 CPUs, issue 31). Behind a 1-thread step as long as a
    read, or 2x or 10x as long, both rules ran alike (medians within noise, 12-20 epochs); a
    rule that also capped that batch when the loop's last step took a quarter of a read or
    more ran 5-9% slower there.
    """
    return 1 if queued > int(waiting) else None


class Held:
    """The batch the reader read last, not handed to the training thread yet.

    Handed over (:meth:`hand`) just before the reader releases the GIL to read the next
    batch's rows: the training thread, woken by it, then runs while the rows are read, where
    before it took the GIL at the first torch call of the next batch's set-up and the reader
    waited for it (~90 us a batch on 2 CPUs, read-only: FeatureLoader at 0.86-0.93x
    ``DataLoader(num_workers=0)``).
    """

    def __init__(self, ready: queue.Queue, stop: threading.Event) -> None:
        self._ready = ready
        self._stop = stop
        self._batch: Any = _NOTHING
        self.stopped = False  # the training thread stopped reading: nothing more to hand over

    def count(self) -> int:
        """Batches held (0 or 1): the training loop has them to go on with once the next
        batch's rows are read."""
        return int(self._batch is not _NOTHING)

    def hold(self, batch: Any) -> None:
        """Keep ``batch`` until :meth:`hand`."""
        self._batch = batch

    def hand(self) -> None:
        """Hand the held batch over (waiting for room in the queue); nothing if none."""
        batch, self._batch = self._batch, _NOTHING
        if batch is not _NOTHING and not self.stopped:
            self.stopped = not _put(self._ready, batch, self._stop)


def _put(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Hand ``item`` over, waiting for room; False once the training thread stopped reading."""
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            ready.put(item, timeout=_POLL_SECONDS)
            return True
    return False


def _next_from(ready: queue.Queue, reader: threading.Thread, waiting: Waiting) -> Any:
    """The reader's next batch, ``_END`` or ``_Failed``; a reader that died without handing
    either over (it cannot, short of the interpreter stopping it) is an error, not a hang.
    ``waiting`` says meanwhile that the training thread waits (see :func:`threads_cap`)."""
    waiting.now = True
    try:
        while True:
            with contextlib.suppress(queue.Empty):
                return ready.get(timeout=_POLL_SECONDS)
            if not reader.is_alive() and ready.empty():
                why = "FeatureLoader's reader thread ended without a batch or an error"
                return _Failed(
                    ReaderDied(f"{why} (stopped from outside); iterate the loader again")
                )
    finally:
        waiting.now = False


def batches_reach_collate(dataset: Any) -> bool:
    """Whether what the loader reads of ``dataset`` reaches its collate as the dataset's reads
    built it: a :class:`~featbake.CachedFeatureDataset`, or a ``Subset`` of one. Not through
    a ``StackDataset`` or a :class:`~featbake.MixedDataset`, which iterate the batch's items."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return getattr(type(dataset), "__getitems__", None) is CachedFeatureDataset.__getitems__


def _items(dataset: Any, idx: list[int]) -> Sequence[Any]:
    """One batch's items, through ``__getitems__`` when the dataset has it (as DataLoader)."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return getitems(idx)
    return [dataset[i] for i in idx]


__all__ = [
    "READ_AHEAD",
    "SAMPLE",
    "WARM_STREAK",
    "FeatureLoader",
    "LengthBatchSampler",
    "ReadAhead",
    "ReaderDied",
    "hint_of",
]
