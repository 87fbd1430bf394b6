"""Tests for featbake.lru.ByteLRU, including a model-based check against a naive LRU."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from featbake.lru import ByteLRU, CacheInfo, nbytes_of


def sized(n: int) -> bytes:
    return b"x" * n


def test_nbytes_of_tensor_array_dict_tuple() -> None:
    t = torch.zeros(3, 4, dtype=torch.float32)
    a = np.zeros(5, dtype=np.int16)
    assert nbytes_of(t) == 48
    assert nbytes_of(a) == 10
    assert nbytes_of({"a": t, "b": a}) == 58
    assert nbytes_of((t, [a, a])) == 68
    assert nbytes_of(torch.zeros(0)) == 0


def test_nbytes_of_rejects_unknown() -> None:
    with pytest.raises(TypeError, match="getsizeof"):
        nbytes_of(object())


def test_basic_get_put_and_counters() -> None:
    cache: ByteLRU[str, torch.Tensor] = ByteLRU(max_bytes=100)
    t = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    assert cache.put("a", t)
    assert cache.get("a") is t
    assert cache.get("missing") is None
    assert cache.get("missing", 7) == 7
    info = cache.info()
    assert (info.hits, info.misses, info.items, info.bytes, info.max_bytes) == (1, 2, 1, 40, 100)
    assert info.hit_rate == pytest.approx(1 / 3)


def test_eviction_order_is_lru() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, getsizeof=len)
    for k in "abcde":
        cache.put(k, sized(2))
    assert cache.keys() == list("abcde")
    cache.get("a")  # a becomes most recent
    cache.put("f", sized(4))  # must evict b and c
    assert cache.keys() == ["d", "e", "a", "f"]
    assert cache.info().evictions == 2
    assert cache.bytes == 10


def test_replace_existing_key_updates_size_and_recency() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, getsizeof=len)
    cache.put("a", sized(3))
    cache.put("b", sized(3))
    cache.put("a", sized(5))
    assert cache.keys() == ["b", "a"]
    assert cache.bytes == 8
    assert cache.info().evictions == 0
    # Replacing with a value that fills the cache evicts the others, not itself.
    cache.put("a", sized(10))
    assert cache.keys() == ["a"]
    assert cache.bytes == 10


def test_too_large_is_rejected_and_drops_stale_value() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, getsizeof=len)
    cache.put("keep", sized(4))
    cache.put("a", sized(4))
    assert not cache.put("a", sized(11))
    assert "a" not in cache  # never serve the old value for a key just overwritten
    assert cache.keys() == ["keep"]
    assert cache.bytes == 4
    assert cache.info().rejected == 1
    assert cache.info().evictions == 0


def test_exactly_max_bytes_fits() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, getsizeof=len)
    assert cache.put("a", sized(10))
    assert cache.bytes == 10


def test_zero_budget_disables_cache() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(0, getsizeof=len)
    assert not cache.put("a", sized(1))
    assert not cache.put("empty", b"")
    assert len(cache) == 0
    assert cache.get("a") is None
    assert cache.info().rejected == 2


def test_negative_budget_rejected() -> None:
    with pytest.raises(ValueError):
        ByteLRU(-1)


def test_contains_does_not_touch_recency_or_counters() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(4, getsizeof=len)
    cache.put("a", sized(2))
    cache.put("b", sized(2))
    assert "a" in cache
    assert "zzz" not in cache
    assert cache.keys() == ["a", "b"]
    info = cache.info()
    assert (info.hits, info.misses) == (0, 0)
    cache.put("c", sized(2))
    assert cache.keys() == ["b", "c"]  # a was still least recent


def test_pop_and_clear() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, getsizeof=len)
    cache.put("a", sized(3))
    cache.put("b", sized(4))
    assert cache.pop("a") == sized(3)
    assert cache.pop("a", "gone") == "gone"
    assert cache.bytes == 4
    assert len(cache) == 1
    cache.get("b")
    cache.clear()
    assert len(cache) == 0
    assert cache.bytes == 0
    assert cache.info().hits == 1  # counters survive clear()


def test_dict_values_sized_by_default() -> None:
    cache: ByteLRU[str, dict[str, torch.Tensor]] = ByteLRU(100)
    value = {"h": torch.zeros(5), "pooled": torch.zeros(2, dtype=torch.float64)}
    assert cache.put("x", value)
    assert cache.bytes == 20 + 16


def test_cache_info_frozen_and_hit_rate_zero() -> None:
    info = ByteLRU(1).info()
    assert info.hit_rate == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.hits = 3  # type: ignore[misc]


def test_iter_len_repr() -> None:
    cache: ByteLRU[int, bytes] = ByteLRU(10, getsizeof=len)
    for k in range(3):
        cache.put(k, sized(1))
    assert list(cache) == [0, 1, 2]
    assert len(cache) == 3
    assert "items=3" in repr(cache)


class NaiveLRU:
    """Reference model: a recency-ordered list of keys plus a dict of sizes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.order: list[Any] = []
        self.values: dict[Any, bytes] = {}
        self.hits = self.misses = self.evictions = self.rejected = 0
        self.victims: list[Any] = []

    def size(self) -> int:
        return sum(len(v) for v in self.values.values())

    def get(self, key: Any) -> bytes | None:
        if key in self.values:
            self.hits += 1
            self.order.remove(key)
            self.order.append(key)
            return self.values[key]
        self.misses += 1
        return None

    def put(self, key: Any, value: bytes) -> bool:
        if key in self.values:
            self.order.remove(key)
            del self.values[key]
        if self.max_bytes == 0 or len(value) > self.max_bytes:
            self.rejected += 1
            return False
        while self.size() + len(value) > self.max_bytes:
            victim = self.order.pop(0)
            del self.values[victim]
            self.victims.append(victim)
            self.evictions += 1
        self.order.append(key)
        self.values[key] = value
        return True

    def pop(self, key: Any) -> bytes | None:
        if key in self.values:
            self.order.remove(key)
            return self.values.pop(key)
        return None


KEYS = st.integers(min_value=0, max_value=12)


class ByteLRUMachine(RuleBasedStateMachine):
    """Drives ByteLRU and NaiveLRU with the same operations and compares them."""

    cache: ByteLRU[int, bytes]
    model: NaiveLRU

    @initialize(max_bytes=st.integers(min_value=0, max_value=40))
    def start(self, max_bytes: int) -> None:
        self.cache = ByteLRU(max_bytes, getsizeof=len)
        self.model = NaiveLRU(max_bytes)

    @rule(key=KEYS, size=st.integers(min_value=0, max_value=45))
    def put(self, key: int, size: int) -> None:
        value = bytes([key % 256]) * size
        before = set(self.cache.keys())
        stored = self.cache.put(key, value)
        n_victims = len(self.model.victims)
        assert stored == self.model.put(key, value)
        # Same victims: keys that disappeared other than the key being replaced.
        lost = before - set(self.cache.keys()) - {key}
        assert lost == set(self.model.victims[n_victims:])

    @rule(key=KEYS)
    def get(self, key: int) -> None:
        assert self.cache.get(key) == self.model.get(key)

    @rule(key=KEYS)
    def contains(self, key: int) -> None:
        assert (key in self.cache) == (key in self.model.values)

    @rule(key=KEYS)
    def pop(self, key: int) -> None:
        assert self.cache.pop(key) == self.model.pop(key)

    @invariant()
    def matches_model(self) -> None:
        cache, model = self.cache, self.model
        assert cache.keys() == model.order
        # White-box read of the stored values: get() would change recency and counters.
        assert {k: v for k, (v, _) in cache._data.items()} == model.values
        info = cache.info()
        assert info == CacheInfo(
            hits=model.hits,
            misses=model.misses,
            evictions=model.evictions,
            rejected=model.rejected,
            items=len(model.values),
            bytes=model.size(),
            max_bytes=model.max_bytes,
        )
        assert info.bytes <= info.max_bytes


ByteLRUMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestByteLRUModel = ByteLRUMachine.TestCase


def test_random_sequence_against_model() -> None:
    """A fixed-seed long random walk, complementing the shrinking stateful test."""
    rng = np.random.default_rng(1234)
    for max_bytes in (0, 1, 7, 64, 500):
        cache: ByteLRU[int, bytes] = ByteLRU(max_bytes, getsizeof=len)
        model = NaiveLRU(max_bytes)
        for _ in range(3000):
            op = rng.integers(0, 4)
            key = int(rng.integers(0, 30))
            if op <= 1:
                value = b"v" * int(rng.integers(0, max(2, max_bytes // 3)))
                assert cache.put(key, value) == model.put(key, value)
            elif op == 2:
                assert cache.get(key) == model.get(key)
            else:
                assert cache.pop(key) == model.pop(key)
            assert cache.keys() == model.order
            assert cache.bytes == model.size() <= max_bytes
        info = cache.info()
        assert (info.hits, info.misses, info.evictions, info.rejected) == (
            model.hits,
            model.misses,
            model.evictions,
            model.rejected,
        )


def test_two_threads_putting_and_popping_keep_the_byte_count_exact() -> None:
    """A process's RAM tier is used by a loader's reader thread and the training loop at once:
    unlocked, interleaved puts drifted the count from what is held (the tier shrank) until an
    eviction popped from an empty cache (``KeyError``). Locked, the count is what it holds."""
    cache: ByteLRU[int, bytes] = ByteLRU(max_bytes=64, getsizeof=len)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def churn(offset: int) -> None:
        start.wait()
        try:
            for n in range(100_000):
                key = (n * 7 + offset) % 24
                cache.put(key, b"x" * (1 + key % 13))
                if n % 5 == 0:
                    cache.pop((key + 3) % 24)
                cache.get((key + 1) % 24)
        except BaseException as e:
            errors.append(e)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=churn, args=(k,)) for k in (0, 5, 11, 17)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert errors == []
    held = sum(len(cache.get(k) or b"") for k in cache)
    assert cache.bytes == held <= cache.max_bytes


def test_a_pickled_cache_has_its_own_lock_and_the_same_entries() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(max_bytes=16, getsizeof=len)
    cache.put("a", b"abc")
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.keys() == ["a"] and copy.bytes == 3
    copy.put("b", b"x" * 15)  # evicts "a" in the copy only
    assert copy.keys() == ["b"] and cache.keys() == ["a"]
