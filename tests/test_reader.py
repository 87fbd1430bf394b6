"""The store's one read path (store/shard.py ``read_spans``) and its one vanished-shard rule
(store/features.py ``relocated``), on their own: every read of a stored tensor goes through
them, so their edge cases are pinned here rather than through each caller."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from featbake.errors import ShardMissing, StoreCorrupt
from featbake.store.catalog import Location
from featbake.store.features import relocated
from featbake.store.layout import Layout
from featbake.store.shard import (
    ShardReader,
    Span,
    read_spans,
    shard_header,
    shard_metadata,
    write_shard,
)

EFP, RFP = "e" * 64, "r" * 64


def _sample() -> dict[str, torch.Tensor]:
    return {
        "k1": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "k2": torch.arange(4, dtype=torch.float32).reshape(1, 4),
        "k3": torch.zeros(0, 3),
    }


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(Layout(tmp_path / "store").ensure(), _sample(), EFP, RFP).path


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def test_spans_of_a_batch_are_read_checked_and_their_padding_zeroed(shard: Path) -> None:
    want = _sample()
    with ShardReader(shard) as r:
        rows = np.full((3, 48), 0xAB, dtype=np.uint8)  # a padded batch's bytes, not yet zero
        spans = []
        for j, name in enumerate(want):
            n = r.tensors[name].end - r.tensors[name].begin
            spans.append(r.span(name, rows[j, :n], verify=j != 1, tail=rows[j, n:]))
        read_spans(spans)
        for j, t in enumerate(want.values()):
            n = t.numel() * t.element_size()
            assert np.array_equal(rows[j, :n], _bytes(t))
            assert not rows[j, n:].any()
        assert r.read("k1", verify="never").equal(want["k1"])


def test_a_span_of_the_wrong_size_is_refused_before_reading(shard: Path) -> None:
    with ShardReader(shard) as r, pytest.raises(Exception, match="needs 24 bytes"):
        r.span("k1", np.empty(23, dtype=np.uint8))


def test_a_corrupt_span_raises_and_names_its_tensor(shard: Path) -> None:
    with ShardReader(shard) as r:
        begin = r.tensors["k2"].begin
        with open(shard, "r+b") as f:
            f.seek(begin)
            f.write(b"\x01")
        dest = np.empty(16, dtype=np.uint8)
        with pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k2"):
            read_spans([r.span("k2", dest)])
        read_spans([r.span("k2", dest, verify=False)])  # unchecked: read as it is


def test_an_unchecked_located_read_cut_short_names_its_tensor(shard: Path) -> None:
    """The located hit paths read by offset alone (no name on the hot path); a shard cut
    short under an open reader still names the tensor, as a checked read does."""
    with ShardReader(shard) as r:
        info = r.tensors["k2"]
        os.truncate(shard, info.begin + 3)
        dest = np.empty(info.end - info.begin, dtype=np.uint8)
        with pytest.raises(StoreCorrupt, match="tensor k2 is cut short"):
            r.read_span(info.begin, dest)
        with pytest.raises(StoreCorrupt, match="tensor k2 is cut short"):
            read_spans([Span(r, info.begin, dest, None, None)])


def test_a_checksum_that_is_not_hex_is_a_mismatch_not_a_crash(tmp_path: Path) -> None:
    tensors = _sample()
    meta = shard_metadata(tensors, EFP, RFP)
    sums = json.loads(meta["checksums"])
    sums["k1"] = "not-hex!"
    meta["checksums"] = json.dumps(sums)
    head, order = shard_header(tensors, meta)
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(head + b"".join(_bytes(t).tobytes() for _, t in order))
    with ShardReader(path) as r:
        with pytest.raises(StoreCorrupt, match="checksum mismatch in tensor k1"):
            r.read("k1", verify="always")
        assert r.read("k2", verify="always").equal(tensors["k2"])


def _loc(shard: str) -> Location:
    return Location(key="k", part="", shard=shard, dtype="F32", shape=(1,), nbytes=4)


def test_relocated_reads_where_the_catalog_now_puts_the_key() -> None:
    moved = [_loc("new")]
    got = relocated("k", lambda key: moved, lambda locs: locs[0].shard)
    assert got == (moved, "new")


def test_relocated_is_a_miss_when_the_key_is_gone_or_its_new_shard_too() -> None:
    def gone(locs: list[Location]) -> str:
        raise ShardMissing("gone")

    assert relocated("k", lambda key: [], lambda locs: "never read") is None
    assert relocated("k", lambda key: [_loc("new")], gone) is None


def test_relocated_raises_corrupt_bytes() -> None:
    def corrupt(locs: list[Location]) -> str:
        raise StoreCorrupt("bad")

    with pytest.raises(StoreCorrupt):
        relocated("k", lambda key: [_loc("new")], corrupt)
