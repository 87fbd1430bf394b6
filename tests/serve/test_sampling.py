"""The pure epoch plans of :mod:`featbake.serve.sampling` beyond DistributedSampler's rule (issue
30 items 2 and 3, issue 32 item 13): batches by length within a frame budget, blocks of shards,
and ranks that take uneven shares. Properties over random lengths, shards and world sizes,
each checked against a plain statement of what the plan promises."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.serve.sampling import (
    EpochPlan,
    Order,
    PlanInputs,
    Shuffle,
    block_plan,
    block_windows,
    frame_batches,
    rest_of_epoch,
    share_batches,
)

SHUFFLES = st.sampled_from([Shuffle.ITEMS, Shuffle.NONE, Shuffle.BLOCKS])


@st.composite
def frame_orders(draw: st.DrawFn) -> tuple[Order, list[int], list[int]]:
    n = draw(st.integers(0, 60))
    lengths = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    shards = draw(st.lists(st.integers(-1, 6), min_size=n, max_size=n))
    budget = draw(st.integers(max(lengths, default=1) or 1, 2000))
    world = draw(st.integers(1, 4))
    order = Order(
        n,
        draw(st.none() | st.integers(1, 9)),
        draw(SHUFFLES),
        draw(st.integers(0, 2**31 - 1)),
        draw(st.integers(0, world - 1)),
        world,
        draw(st.booleans()),
        draw(st.booleans()),
        budget,
        draw(st.integers(1, 4)),
    )
    return order, lengths, shards


def _ranks(
    order: Order, epoch: int, lengths: list[int], shards: list[int]
) -> list[list[list[int]]]:
    return [
        Order(**{**order.__dict__, "rank": r}).batches(epoch, lengths, shards)
        for r in range(order.world)
    ]


@settings(max_examples=300, deadline=None)
@given(frame_orders(), st.integers(0, 3))
def test_frame_batches_keep_the_budget_and_read_every_item(
    drawn: tuple[Order, list[int], list[int]], epoch: int
) -> None:
    order, lengths, shards = drawn
    ranks = _ranks(order, epoch, lengths, shards)
    budget = order.batch_frames
    assert budget is not None
    for batches in ranks:
        for b in batches:
            assert b and len(b) * max(lengths[i] for i in b) <= budget
            assert order.batch_size is None or len(b) <= order.batch_size
    seen = Counter(i for batches in ranks for b in batches for i in b)
    if order.world == 1 or not order.even_batches:
        assert seen == Counter(range(order.n))  # every item exactly once
    else:
        assert len({len(batches) for batches in ranks}) == 1  # every rank as many steps
        if not order.drop_last:
            assert set(seen) == set(range(order.n))
    # the same seed and epoch: the same batches, on every call and in every process
    assert _ranks(order, epoch, lengths, shards) == ranks


def test_frame_batches_group_similar_lengths_and_differ_by_epoch() -> None:
    lengths = [50 + (i * 7919) % 1450 for i in range(2000)]  # 0.5-15 s at 100 frames/s
    order = Order(2000, None, Shuffle.ITEMS, 3, batch_frames=20000)
    real = []
    for epoch in range(2):
        batches = order.batches(epoch, lengths)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        real.append(sum(lengths) / padded)
    assert min(real) >= 0.9
    assert order.batches(0, lengths) != order.batches(1, lengths)
    assert Order(2000, None, Shuffle.ITEMS, 4, batch_frames=20000).batches(0, lengths) != (
        order.batches(0, lengths)
    )


@settings(max_examples=300, deadline=None)
@given(
    shards=st.lists(st.integers(-1, 12), max_size=80),
    seed=st.integers(0, 2**31 - 1),
    epoch=st.integers(0, 5),
    window=st.integers(1, 5),
)
def test_block_windows_visit_every_item_once_from_at_most_window_shards(
    shards: list[int], seed: int, epoch: int, window: int
) -> None:
    windows = block_windows(shards, seed, epoch, window)
    assert sorted(i for w in windows for i in w) == list(range(len(shards)))
    for w in windows:
        assert len({shards[i] for i in w}) <= window
    assert block_windows(shards, seed, epoch, window) == windows


def test_two_block_epochs_differ() -> None:
    shards = [i // 10 for i in range(200)]
    assert block_windows(shards, 0, 0, 3) != block_windows(shards, 0, 1, 3)


@settings(max_examples=200, deadline=None)
@given(nb=st.integers(0, 30), world=st.integers(1, 5), drop_last=st.booleans())
def test_share_batches_evens_out_or_reads_each_batch_once(
    nb: int, world: int, drop_last: bool
) -> None:
    batches = [[i] for i in range(nb)]
    even = [share_batches(batches, r, world, drop_last, True) for r in range(world)]
    assert len({len(s) for s in even}) == 1
    uneven = [share_batches(batches, r, world, drop_last, False) for r in range(world)]
    assert sorted(b[0] for s in uneven for b in s) == list(range(nb))


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 40),
    world=st.integers(1, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_uneven_ranks_read_each_index_exactly_once(
    n: int, world: int, shuffle: bool, drop_last: bool, seed: int
) -> None:
    plans = [EpochPlan(n, 3, shuffle, seed, 1, r, world, False, False) for r in range(world)]
    assert sorted(i for p in plans for i in p.indices()) == list(range(n))
    assert [len(p.indices()) for p in plans] == [p.per_rank() for p in plans]
    cut = [EpochPlan(n, 3, shuffle, seed, 1, r, world, drop_last, False) for r in range(world)]
    assert [len(p.batches()) for p in cut] == [p.batch_count() for p in cut]


@settings(max_examples=300, deadline=None)
@given(frame_orders(), st.integers(0, 3))
def test_a_block_plan_names_each_windows_shards_in_reading_order(
    drawn: tuple[Order, list[int], list[int]], epoch: int
) -> None:
    """What a bucket store is told of a rank's block-ordered epoch, against a plain loop: the
    rank's items cut where their window changes, each run's stored shards in first-read order."""
    order, _, shards = drawn
    order = Order(**{**order.__dict__, "shuffle": Shuffle.BLOCKS, "batch_frames": None})
    batches = order.batches(epoch, shards=shards)
    windows = block_windows(shards, order.seed, epoch, order.window)
    window_of = {i: k for k, w in enumerate(windows) for i in w}
    want: list[list[int]] = []
    last = None
    for i in (i for b in batches for i in b):
        if window_of[i] != last:
            want.append([])
            last = window_of[i]
        if shards[i] >= 0 and shards[i] not in want[-1]:
            want[-1].append(shards[i])
    assert order.block_plan(epoch, batches, shards) == want
    assert block_plan(windows, batches, shards) == want
    assert all(len(run) <= order.window for run in want)
    plain = Order(**{**order.__dict__, "shuffle": Shuffle.ITEMS})
    assert plain.block_plan(epoch, batches, shards) is None


@settings(max_examples=300, deadline=None)
@given(frame_orders(), st.booleans(), st.integers(0, 3), st.data())
def test_a_resumed_epoch_is_the_uninterrupted_remainder_whatever_the_placement_is_now(
    drawn: tuple[Order, list[int], list[int]], by_length: bool, epoch: int, data: st.DataObject
) -> None:
    """Round four, item 5: the rest of an epoch is planned from the placement it started with,
    carried in the state as a string, whatever the store's placement is when it resumes: the
    batches served before the cut and those after it are the uninterrupted epoch's."""
    order, lengths, shards = drawn
    if not by_length:
        order = Order(**{**order.__dict__, "batch_frames": None})
    whole = order.batches(epoch, lengths, shards)
    cut = data.draw(st.integers(0, len(whole)))
    saved = order.inputs(lengths, shards).encode()
    assert saved.isascii() and (saved == "") == (not order.needs_placement())
    # The store changed since (a build, gc or write-back moved items): the plan does not take
    # today's placement, only the hints to a bucket store name where the items are now.
    now_shards = data.draw(st.lists(st.integers(-1, 9), min_size=order.n, max_size=order.n))
    inputs = PlanInputs.decode(saved, order.n)
    rest = order.plan(epoch, inputs)[cut:]
    assert whole[:cut] + rest == whole
    served = Counter(i for b in whole[:cut] + rest for i in b)
    assert served == Counter(i for b in whole for i in b)
    if order.shuffle is Shuffle.BLOCKS and not by_length:  # the hints name the shards now
        hints = order.block_plan(epoch, rest, now_shards, inputs)
        windows = block_windows(inputs.blocks, order.seed, epoch, order.window)  # type: ignore[arg-type]
        assert hints == block_plan(windows, rest, now_shards)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 2**40), max_size=80), st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_blocks_by_shard_rank_give_the_windows_of_the_shard_ids(
    shards: list[int], seed: int, window: int
) -> None:
    """A state carries each item's block as its shard's rank (small ints, whatever the ids): the
    windows are those of the ids themselves."""
    order = Order(len(shards), 2, Shuffle.BLOCKS, seed, window=window)
    blocks = PlanInputs.decode(order.inputs(shards=shards).encode(), len(shards)).blocks
    assert blocks is not None and blocks.max(initial=0) < max(len(set(shards)), 1)
    for epoch in range(2):
        want = block_windows(shards, seed, epoch, window)
        assert block_windows(blocks, seed, epoch, window) == want


def test_a_placement_built_in_order_is_a_short_string() -> None:
    """A million items in 4,000 shards built in order, each 50-1500 frames long."""
    n = 1_000_000
    shards = np.repeat(np.arange(4000), n // 4000)
    lengths = np.random.default_rng(0).integers(50, 1500, n)
    blocks = Order(n, 32, Shuffle.BLOCKS, 0).inputs(shards=shards).encode()
    both = Order(n, 32, Shuffle.BLOCKS, 0, batch_frames=4000).inputs(lengths, shards).encode()
    print(f"blocks {len(blocks)} chars, blocks and lengths {len(both)} chars")
    assert len(blocks) < 20_000 and len(both) < 2 * 2 * n  # lengths: ~11 bits each


def _share(order: Order, world: int, epoch: int, inputs: PlanInputs, stages: tuple) -> list:
    """Every rank's batches over ``world`` ranks (of the rest after ``stages``)."""
    return [
        Order(**{**order.__dict__, "rank": r, "world": world}).plan(epoch, inputs, stages)
        for r in range(world)
    ]


@settings(max_examples=400, deadline=None)
@given(frame_orders(), st.booleans(), st.integers(1, 5), st.integers(1, 5), st.data())
def test_an_epoch_resumed_over_other_world_sizes_reads_each_item_once(
    drawn: tuple[Order, list[int], list[int]],
    by_length: bool,
    world_b: int,
    world_c: int,
    data: st.DataObject,
) -> None:
    """Round four, elastic resume: ranks of one world size stop after ``cut`` batches each
    (at the same step; a rank with fewer read them all), ranks of another share out the rest,
    and maybe stop too and a third world size goes on. The batches read by all runs together
    hold every item once with ``even_batches=False``; with it, every item at least once, the
    repeats only those that even out each run's ranks; with ``drop_last``, no item twice."""
    order, lengths, shards = drawn
    if not by_length:
        order = Order(**{**order.__dict__, "batch_frames": None})
    epoch = data.draw(st.integers(0, 2))
    inputs = order.inputs(lengths, shards)
    stages: tuple = ()
    read: list[int] = []
    for world in (order.world, world_b, world_c):
        ranks = _share(order, world, epoch, inputs, stages)
        cut = data.draw(st.integers(0, max(map(len, ranks), default=0)))
        if world == world_c:  # the last run reads to the end
            cut = max(map(len, ranks), default=0)
        read += [i for batches in ranks for b in batches[:cut] for i in b]
        stages = (*stages, (world, cut))
    counts = Counter(read)
    assert set(counts) <= set(range(order.n))
    if order.drop_last:
        assert all(c == 1 for c in counts.values())
    elif not order.even_batches:
        assert counts == Counter(range(order.n))
    else:
        assert set(counts) == set(range(order.n))
        unit = 1  # an item repeated, or by length the batch it is in
        if order.batch_frames is not None:
            unit = max((len(b) for b in order.epoch_units(epoch, inputs)), default=0)
        assert sum(c - 1 for c in counts.values()) <= (world_b + world_c + order.world) * unit


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 50), st.integers(1, 6), st.integers(0, 60), st.booleans(), st.booleans())
def test_the_rest_of_an_epoch_is_what_no_rank_read_in_order(
    n: int, world: int, done: int, even: bool, drop_last: bool
) -> None:
    """The rest of an epoch of ``n`` units after ``world`` ranks read ``done`` each of their
    shares (:func:`share_batches`) is exactly the units none of them read, in order."""
    units = list(range(n))
    read = {u for r in range(world) for u in share_batches(units, r, world, drop_last, even)[:done]}
    reachable = {u for r in range(world) for u in share_batches(units, r, world, drop_last, even)}
    rest = rest_of_epoch(n, world, done, even, drop_last)
    assert rest == sorted(rest) and not read & set(rest)
    assert read | set(rest) == reachable


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 200))
def test_an_item_longer_than_the_budget_is_a_batch_of_its_own(
    lengths: list[int], budget: int
) -> None:
    """As lhotse's samplers: an item over ``batch_frames`` is read alone (the loaders warn),
    every other batch keeps the budget, every item once."""
    batches = frame_batches(range(len(lengths)), lengths, budget, np.random.default_rng(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= budget or len(b) == 1


@pytest.mark.parametrize("seed", [-1, -(2**40), 2**63 + 5])
def test_any_int_seed_plans_blocks_lengths_and_mixtures(seed: int) -> None:
    """``DistributedSampler`` and ``randperm`` take any int seed; the block and length orders
    and MixedDataset drew with numpy, which takes words from 0 only: a negative seed ended in
    ``ValueError: expected non-negative integer``. Every epoch now reads each item once, and
    seeds from 0 draw the plans they always drew."""
    from featbake.serve.mixing import MixPlan

    lengths = [5, 9, 3, 7, 2, 8, 6, 4]
    shards = [0, 0, 1, 1, 2, 2, 3, 3]
    orders = [
        Order(8, 3, Shuffle.BLOCKS, seed, window=2),
        Order(8, None, Shuffle.ITEMS, seed, batch_frames=12),
        Order(8, None, Shuffle.BLOCKS, seed, batch_frames=12, window=2),
    ]
    for order in orders:
        for epoch in range(3):
            plan = order.plan(epoch, order.inputs(lengths, shards))
            assert sorted(i for b in plan for i in b) == list(range(8))
    plan = MixPlan((3, 5), (0.5, 0.5), 8, seed)
    for epoch in range(3):
        drawn = plan.epoch(epoch)
        assert len(drawn) == 8 and all(0 <= j < (3, 5)[k] for k, j in drawn)
    from featbake.serve.sampling import seeded

    words = (7, 2, 1)
    want = np.random.default_rng(list(words)).permutation(50)
    assert (seeded(*words).permutation(50) == want).all()


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 2**80 + 3])
def test_a_seed_from_2_to_the_64_draws_the_plans_it_drew_before(seed: int) -> None:
    """Taking every seed modulo 2**64 (to take negative ones) made 2**64 + 5 draw seed 5's
    plans, not its own: a run resumed with such a seed read another order. Only negative
    words are mapped now; a block order, a length order and a mixture draw what numpy drew."""
    from featbake.serve.mixing import MixPlan

    lengths, shards = [5, 9, 3, 7, 2, 8, 6, 4], [0, 0, 1, 1, 2, 2, 3, 3]
    for shuffle, kw in ((Shuffle.BLOCKS, {"window": 2}), (Shuffle.ITEMS, {"batch_frames": 12})):
        mine = Order(8, 3 if shuffle is Shuffle.BLOCKS else None, shuffle, seed, **kw)
        low = Order(8, 3 if shuffle is Shuffle.BLOCKS else None, shuffle, seed % 2**64, **kw)
        plans = [o.plan(1, o.inputs(lengths, shards)) for o in (mine, low)]
        assert plans[0] != plans[1], shuffle
    assert MixPlan((3, 5), (0.5, 0.5), 8, seed).epoch(0) != MixPlan(
        (3, 5), (0.5, 0.5), 8, seed % 2**64
    ).epoch(0)
    assert (seeded_words(seed, 0, 1) == np.random.default_rng([seed, 0, 1]).permutation(50)).all()


def seeded_words(*words: int) -> np.ndarray:
    """A permutation of 50 drawn by :func:`featbake.serve.sampling.seeded` of ``words``."""
    from featbake.serve.sampling import seeded

    return seeded(*words).permutation(50)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**64 + 5, -(2**63) - 7, 2**90])
def test_an_item_order_takes_any_int_seed_at_every_epoch(seed: int) -> None:
    """``randperm``'s seed is ``seed + epoch``, which torch takes only from -2**63 to
    2**64 - 1: ``seed=2**64 - 1`` read epoch 0, then raised ``Overflow when unpacking long
    long`` at epoch 1 (a state's seed past it at its first epoch). It is taken modulo 2**64,
    as torch takes a negative seed, so every seed in torch's range draws the order it drew."""
    for epoch in range(3):
        plan = EpochPlan(20, 4, True, seed, epoch, rank=1, world=2)
        order = plan.order()
        assert sorted(order) == list(range(20))
        assert sorted(i for b in plan.batches(order) for i in b) == sorted(order[1::2])
    for inside in (-1, -(2**63), 0, 7, 2**64 - 2):
        want = torch.randperm(20, generator=torch.Generator().manual_seed(inside + 1))
        assert EpochPlan(20, 4, True, inside, 1).order() == want.tolist()
