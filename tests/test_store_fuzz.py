"""Fuzzing the shard reader (hypothesis, bounded): hostile bytes give a FeatbakeError, nothing else.

Whatever lies at a shard's path (random bytes, a valid shard with flipped, cut or appended bytes,
a header of random JSON or of plausible but inconsistent entries, absurdly nested arrays), opening
it, reading each tensor with and without checks, and ``verify_all`` either succeed or raise a
:class:`FeatbakeError` (mostly :class:`StoreCorrupt`): never another exception, a crash or a hang.
"""

from __future__ import annotations

import json
import signal
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featbake.errors import FeatbakeError, StoreCorrupt
from featbake.store.shard import ShardReader, VerifyMode, shard_header, shard_metadata

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # bounded and repeatable: the same examples on every run
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _valid_shard() -> bytes:
    tensors = {
        "a" * 64: torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b" * 64 + "/hidden": torch.ones(2, 5, dtype=torch.float16),
        "b" * 64 + "/pooled": torch.tensor([True, False]),
        "c" * 64: torch.zeros(0, 7),
    }
    head, order = shard_header(tensors, shard_metadata(tensors, "e" * 64, "r" * 64))
    return head + b"".join(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, t in order
    )


VALID = _valid_shard()


@pytest.fixture
def shard_path(tmp_path: Path) -> Iterator[Path]:
    """One file, rewritten by each example; an alarm fails the test instead of hanging it."""

    def _hang(*_: object) -> None:
        raise TimeoutError("the shard reader hung")

    old = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(120)
    yield tmp_path / "fuzz.safetensors"
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _exercise(path: Path, data: bytes) -> None:
    """Everything a reader does with a shard; only FeatbakeErrors may escape."""
    path.write_bytes(data)
    try:
        with ShardReader(path, verify=VerifyMode.FIRST) as r:
            for name, info in r.tensors.items():
                assert info.begin <= info.end <= len(data)  # what was accepted is consistent
                for mode in (VerifyMode.NEVER, VerifyMode.ALWAYS):
                    try:
                        t = r.read(name, verify=mode)
                    except StoreCorrupt:
                        continue
                    assert t.numel() * t.element_size() == info.end - info.begin
            r.verify_all()
    except FeatbakeError:
        pass


def _with_header(header: object, data: bytes = b"", length_delta: int = 0) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", max(0, len(text) + length_delta)) + text + data


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(shard_path: Path, data: bytes) -> None:
    _exercise(shard_path, data)


@FUZZ
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=6
    ),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
    tail=st.binary(max_size=64),
)
def test_a_valid_shard_mutated(
    shard_path: Path, flips: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    raw = bytearray(VALID)
    for pos, bits in flips:
        raw[pos] ^= bits
    _exercise(shard_path, bytes(raw[:cut]) + tail)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
DIM = st.one_of(st.integers(-3, 6), st.integers(2**31, 2**64), st.booleans(), st.floats())
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.one_of(
            st.sampled_from(["F32", "F16", "BF16", "I32", "BOOL", "U8", "F8", "x"]), JSON
        ),
        "shape": st.one_of(st.lists(DIM, max_size=3), JSON),
        "data_offsets": st.one_of(st.lists(DIM, min_size=0, max_size=3), JSON),
    }
)
META = st.one_of(
    st.just(shard_metadata({}, "e" * 64, "r" * 64)),
    st.builds(
        lambda v, sums: {"format": "featbake-shard", "format_version": v, "checksums": sums},
        st.sampled_from(["1", "2", "3", ""]),
        st.one_of(st.just("{}"), st.text(max_size=20), JSON.map(json.dumps)),
    ),
    JSON,
)


@FUZZ
@given(
    meta=META,
    entries=st.dictionaries(st.text(min_size=1, max_size=5), ENTRY, max_size=4),
    data=st.binary(max_size=128),
    length_delta=st.integers(-4, 4),
)
def test_plausible_headers_with_inconsistent_entries(
    shard_path: Path, meta: object, entries: dict, data: bytes, length_delta: int
) -> None:
    _exercise(shard_path, _with_header({"__metadata__": meta, **entries}, data, length_delta))


@FUZZ
@given(header=JSON, data=st.binary(max_size=64))
def test_headers_of_random_json(shard_path: Path, header: object, data: bytes) -> None:
    _exercise(shard_path, _with_header(header, data))


@pytest.mark.parametrize("where", ["header", "checksums"])
def test_arrays_nested_200000_deep_are_a_store_corrupt(shard_path: Path, where: str) -> None:
    """Before: RecursionError out of json.loads."""
    deep = "[" * 200_000 + "]" * 200_000
    if where == "header":
        data = struct.pack("<Q", len(deep)) + deep.encode()
    else:
        meta = {"format": "featbake-shard", "format_version": "2", "checksums": deep}
        data = _with_header({"__metadata__": meta})
    shard_path.write_bytes(data)
    with pytest.raises(StoreCorrupt, match="unreadable"):
        ShardReader(shard_path)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 48]},  # 60 bytes claimed
        {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [-4, -3], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [12], "data_offsets": [48, 0]},
        {"dtype": "F32", "shape": [True, 12], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [12], "data_offsets": [0, 48, 96]},
        {"dtype": "C64", "shape": [6], "data_offsets": [0, 48]},
        {"dtype": ["F32"], "shape": [12], "data_offsets": [0, 48]},
        {"shape": [12], "data_offsets": [0, 48]},
        [1, 2, 3],
    ],
)
def test_an_entry_that_does_not_fit_its_byte_range_is_a_store_corrupt(
    shard_path: Path, entry: object
) -> None:
    """Before: RuntimeError ("shape ... is invalid"), TypeError or a served wrong tensor."""
    meta = shard_metadata({}, "e" * 64, "r" * 64)
    shard_path.write_bytes(_with_header({"__metadata__": meta, "x": entry}, bytes(48)))
    with pytest.raises(StoreCorrupt, match="damaged"):
        ShardReader(shard_path)


@pytest.mark.parametrize("meta", [7, "featbake-shard", [], {"format": 1}, None])
def test_metadata_that_is_not_a_string_map_is_a_store_corrupt(
    shard_path: Path, meta: object
) -> None:
    shard_path.write_bytes(_with_header({"__metadata__": meta}))
    with pytest.raises(StoreCorrupt, match="not a featbake shard"):
        ShardReader(shard_path)
