"""The bucket sweep's rules, checked against a naive model over random listings."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from featbake.store.bucket import ObjectInfo, kept_versions, sweep, version_name

times = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(st.lists(times, min_size=1, max_size=8), times, st.floats(min_value=0, max_value=500))
def test_the_newest_version_is_always_kept_and_a_version_goes_once_its_successor_is_old(
    published: list[float], now: float, retention: float
) -> None:
    ordered = sorted(published)
    versions = [ObjectInfo(version_name(i + 1), 1, t, "") for i, t in enumerate(ordered)]
    kept = kept_versions(versions, now + 1000, retention)
    assert len(ordered) in kept
    for n in range(1, len(ordered)):
        retired_for = now + 1000 - ordered[n]  # version n was replaced when n+1 appeared
        assert (n in kept) == (retired_for < retention)


@given(
    st.dictionaries(st.text("ab", min_size=1, max_size=3), times, max_size=8),
    st.sets(st.text("ab", min_size=1, max_size=3)),
    st.sets(st.text("ab", min_size=1, max_size=3)),
    st.floats(min_value=0, max_value=500),
)
def test_a_shard_goes_only_when_nothing_names_it_and_it_is_older_than_the_retention(
    shards: dict[str, float], named: set[str], pending: set[str], retention: float
) -> None:
    now = 1000.0
    listing = [ObjectInfo(f"shards/{n[:2]}/{n}.safetensors", 10, t, "") for n, t in shards.items()]
    got = sweep([], listing, {1: named}, pending, now, retention)
    deleted = {o.name.rsplit("/", 1)[1].removesuffix(".safetensors") for o in got.shards}
    want = {n for n, t in shards.items() if n not in named | pending and now - t >= retention}
    assert deleted == want
    assert got.young_shards == sum(
        1 for n, t in shards.items() if n not in named | pending and now - t < retention
    )
