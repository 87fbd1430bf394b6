"""greedy_batches, the one rule for batches by length: checked against its definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from featbake.length_batches import greedy_batches


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=40),
    budget=st.integers(1, 200),
    max_items=st.one_of(st.none(), st.integers(1, 8)),
    step=st.integers(1, 8),
)
def test_batches_keep_the_order_fit_the_budget_and_end_only_where_they_must(
    lengths: list[int], budget: int, max_items: int | None, step: int
) -> None:
    def pad_to(n: int) -> int:
        return -(-n // step) * step

    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = greedy_batches(order, lengths, budget, max_items, pad_to)
    assert [i for b in batches for i in b] == order  # every item once, in the order given
    for k, batch in enumerate(batches):
        cost = len(batch) * pad_to(max(lengths[i] for i in batch))
        assert cost <= budget or len(batch) == 1  # over budget only alone
        assert max_items is None or len(batch) <= max_items
        if k + 1 < len(batches):  # a batch ends only where the next item could not join
            grown = [*batch, batches[k + 1][0]]
            over = len(grown) * pad_to(max(lengths[i] for i in grown)) > budget
            assert over or (max_items is not None and len(batch) == max_items)
