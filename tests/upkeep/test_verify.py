"""verify: catches damage (never silent garbage), repairs it, and rebuilds a lost catalog."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.store.open import open_catalog
from featbake.store.shard import ShardReader
from featbake.upkeep import VERIFY_CLEAN, VERIFY_DAMAGED, VERIFY_REPAIRED, stats, verify
from tests.helpers import Live, assert_serves, bake, manifest, shard_files


def _flip_data_byte(path: Path, tensor: str) -> None:
    """Flip one byte inside ``tensor``'s data (the header stays readable)."""
    with ShardReader(path) as r:
        info = r.tensors[tensor]
    with open(path, "r+b") as f:
        at = info.begin + (info.end - info.begin) // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _keys_in(path: Path) -> set[str]:
    with ShardReader(path) as r:
        return {name.partition("/")[0] for name in r.tensors}


def test_clean_store_is_clean(encoder_file: Path, audio_dir: Path, store_dir: Path) -> None:
    bake(audio_dir, encoder_file, store_dir)
    report = verify(store_dir)
    assert report.status == "clean" and report.exit_code == VERIFY_CLEAN
    assert report.shards_checked == len(shard_files(store_dir)) and not report.remaining


def test_a_flipped_byte_is_caught_by_verify_and_by_the_reader(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    victim = sorted(shard_files(store_dir))[0]
    keys = sorted(_keys_in(victim))
    assert len(keys) >= 2
    _flip_data_byte(victim, keys[0])

    reader = FeatureReader(Layout(store_dir))
    with pytest.raises(StoreCorrupt, match="checksum"):
        reader.get(keys[0])  # never silent garbage
    reader.close()
    found = verify(store_dir)
    assert found.status == "damaged" and found.exit_code == VERIFY_DAMAGED
    assert [f.kind for f in found.findings if f.damage] == ["corrupt-shard"]

    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired" and fixed.exit_code == VERIFY_REPAIRED
    assert fixed.features_salvaged == len(keys) - 1  # the intact neighbours were kept
    assert fixed.features_lost == 1
    assert (store_dir / "quarantine" / victim.name).exists() and not victim.exists()
    served = assert_serves(
        store_dir, report.root, audio_dir, encoder_file, live, allow_missing=True
    )
    assert served == 15
    assert verify(store_dir).status == "clean"
    again = bake(audio_dir, encoder_file, store_dir)
    assert again.encoded == 1
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


def test_mayhem_deleted_truncated_flipped_shards_and_no_catalog(
    encoder_file: Path, multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    one = bake(audio_dir, encoder_file, store_dir, shard_bytes=40_000)
    two = bake(audio_dir, multi_encoder_file, store_dir, shard_bytes=40_000)
    before = {r: manifest(store_dir, r) for r in (one.root, two.root)}
    files = sorted(shard_files(store_dir))
    assert len(files) >= 6
    deleted, truncated, flipped = files[0], files[2], files[4]
    lost = _keys_in(deleted) | _keys_in(truncated)
    flipped_key = sorted(_keys_in(flipped))[0]
    with ShardReader(flipped) as r:
        flipped_tensor = next(t for t in r.tensors if t.startswith(flipped_key))
    deleted.unlink()
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size // 2)
    _flip_data_byte(flipped, flipped_tensor)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store_dir}/catalog.sqlite{suffix}").unlink(missing_ok=True)

    with pytest.raises(StoreError, match="verify --repair"):
        open_catalog(store_dir)
    found = verify(store_dir)
    kinds = sorted(f.kind for f in found.findings if f.damage)
    assert kinds == ["catalog", "corrupt-shard", "corrupt-shard"], found.findings
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert verify(store_dir).status == "clean"
    assert {r: manifest(store_dir, r) for r in before} == before  # roots came back from roots/
    served = assert_serves(
        store_dir, one.root, audio_dir, encoder_file, live, allow_missing=True
    ) + assert_serves(store_dir, two.root, audio_dir, multi_encoder_file, live, allow_missing=True)
    assert served == 32 - len(lost | {flipped_key})  # a key missing one output is not served
    bake(audio_dir, encoder_file, store_dir, shard_bytes=40_000)
    bake(audio_dir, multi_encoder_file, store_dir, shard_bytes=40_000)
    assert assert_serves(store_dir, one.root, audio_dir, encoder_file, live) == 16
    assert assert_serves(store_dir, two.root, audio_dir, multi_encoder_file, live) == 16


def test_deleting_the_catalog_and_repairing_restores_everything(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    s0 = stats(store_dir)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store_dir}/catalog.sqlite{suffix}").unlink(missing_ok=True)
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired" and fixed.features_lost == 0
    s1 = stats(store_dir)
    assert (s1.features, s1.live_bytes, s1.disk_bytes, s1.shards) == (
        s0.features,
        s0.live_bytes,
        s0.disk_bytes,
        s0.shards,
    )
    assert [(r.name, r.items, r.missing) for r in s1.roots] == [
        (r.name, r.items, r.missing) for r in s0.roots
    ]
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16
    assert bake(audio_dir, encoder_file, store_dir).encoded == 0


def test_a_catalog_of_an_older_schema_is_rebuilt_keeping_its_roots(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    for p in (store_dir / "roots").glob("*.json"):
        p.unlink()  # a catalog from before root manifest files existed
    with sqlite3.connect(store_dir / "catalog.sqlite") as c:
        c.execute("UPDATE meta SET value='1' WHERE name='schema_version'")
    with pytest.raises(StoreError, match="schema version 1"):
        open_catalog(store_dir)
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert (store_dir / "roots" / f"{report.root}.json").exists()
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


def test_catalog_rows_pointing_nowhere_and_unnamed_shards(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    gone = sorted(shard_files(store_dir))[0]
    lost = _keys_in(gone)
    gone.unlink()
    cat = Catalog(Layout(store_dir))
    shard = sorted(shard_files(store_dir))[0].name.removesuffix(".safetensors")
    with cat.transaction() as c:  # forget one shard: its file becomes unnamed
        (sid,) = c.execute("SELECT id FROM shards WHERE name=?", (shard,)).fetchone()
        c.execute("DELETE FROM features WHERE shard_id=?", (sid,))
        c.execute("DELETE FROM shards WHERE id=?", (sid,))
    cat.close()
    found = verify(store_dir)
    assert {f.kind for f in found.findings if f.damage} == {"missing-shard"}
    assert "orphan-shard" in {f.kind for f in found.findings if not f.damage}
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired" and fixed.features_lost == len(lost)
    served = assert_serves(
        store_dir, report.root, audio_dir, encoder_file, live, allow_missing=True
    )
    assert served == 16 - len(lost)  # the unnamed shard was indexed again
    assert verify(store_dir).status == "clean"
