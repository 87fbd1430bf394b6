"""The build's writer thread (bake/threads.py): features are handed over in batches, and
every one put is sealed, readable and in the catalog after ``close``; an error in the thread
reaches the caller."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import featbake.bake.threads as writer_thread
from featbake.bake.threads import HANDOFF_ITEMS, WriterThread
from featbake.errors import ConfigError
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader

EFP, RFP = "e" * 64, "r" * 64


def _features(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"{i:064x}": torch.randn(5 + i % 7, 16, generator=g) for i in range(n)}


@pytest.mark.parametrize("n", [1, HANDOFF_ITEMS - 1, HANDOFF_ITEMS, 3 * HANDOFF_ITEMS + 5])
def test_every_feature_put_is_sealed_and_in_the_catalog(
    tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_SECONDS", 3600)  # batches by count only
    layout = Layout(tmp_path / "store").ensure()
    features = _features(n)
    writer = WriterThread(layout, EFP, RFP, shard_bytes=4096)  # several shards from 32 items
    put = 0
    for key, t in features.items():
        writer.put(key, {"": t})
        put += t.nbytes
        if n < HANDOFF_ITEMS:  # nothing handed over yet, and counted as pending (not sealed)
            assert writer.bytes_pending == put and writer.bytes_written == 0
    writer.close()
    assert writer.new_rows == n
    with Catalog(layout) as catalog:
        for key, t in features.items():
            (loc,) = catalog.locate(key)
            with ShardReader(layout.shard_path(loc.shard)) as reader:
                torch.testing.assert_close(reader.read(key, verify="always"), t, rtol=0, atol=0)


def test_a_slow_encoders_features_are_written_as_they_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_SECONDS", 0.05)
    layout = Layout(tmp_path / "store").ensure()
    writer = WriterThread(layout, EFP, RFP, shard_bytes=1)  # a shard per feature
    for i, (key, t) in enumerate(_features(3).items()):
        time.sleep(0.06)  # an encoder slower than the hand-off bound
        writer.put(key, {"": t})
        deadline = time.monotonic() + 10
        while writer.shards < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.shards == i + 1  # sealed before the next one was encoded
    writer.close()


def test_a_failure_in_the_thread_reaches_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_thread, "HANDOFF_ITEMS", 2)
    writer = WriterThread(Layout(tmp_path / "store").ensure(), EFP, RFP, shard_bytes=1 << 20)
    writer.put("a" * 64, {"": torch.zeros(3, dtype=torch.complex64)})  # no safetensors dtype
    with pytest.raises(ConfigError, match="cannot store dtype"):
        for i in range(500):  # handed over at the second put; raised by a put after the thread
            writer.put(f"{i:064x}", {"": torch.zeros(3)})
            time.sleep(0.01)
    with pytest.raises(ConfigError, match="cannot store dtype"):
        writer.close()  # and again at close, which waits for the thread
