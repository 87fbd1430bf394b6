"""verify: catches damage (never silent garbage), repairs it, and rebuilds a lost catalog."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featbake.errors import CacheMiss, FeatbakeError, StoreCorrupt, StoreError
from featbake.keys import feature_key
from featbake.progress import Progress
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import REQUIRED_COLUMNS, Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.store.locks import lock_path, shared_write_lock
from featbake.store.open import open_catalog
from featbake.store.shard import ShardReader
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder
from featbake.upkeep import (
    VERIFY_CLEAN,
    VERIFY_DAMAGED,
    VERIFY_REPAIRED,
    FindingKind,
    VerifyReport,
    list_roots,
    stats,
    verify,
)
from featbake.upkeep.check import check_hash_cache
from tests.conftest import invoke, live_features, run_cli
from tests.helpers import Live, assert_serves, bake, fails_after, manifest, printed, shard_files


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


def _key_ends(path: Path) -> dict[str, int]:
    """Each key of a sound shard and the file offset where the last of its tensors' bytes end:
    a cut at ``n`` bytes leaves a key whole exactly when its end is at most ``n``."""
    ends: dict[str, int] = {}
    with ShardReader(path) as r:
        for name, info in r.tensors.items():
            key = name.partition("/")[0]
            ends[key] = max(ends.get(key, 0), info.end)
    return ends


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


@pytest.mark.parametrize(
    ("read", "check"), [("item", "always"), ("batch", "always"), ("item", "first")]
)
def test_a_shard_repaired_under_an_open_dataset_is_looked_up_again_not_refused(
    encoder_file: Path, audio_dir: Path, store_dir: Path, read: str, check: str
) -> None:
    """A dataset held a shard open when a byte of it was damaged and `featbake verify
    --repair` quarantined it. Checking every read (verify="always"), every read of its items
    then failed "... is damaged; run `featbake verify --repair`", the repair just run, naming a
    path where nothing lies (the open file kept its bytes); checking each item's first read
    (the default), the damaged bytes were served for the rest of the process. Those items are
    looked up again now (with verify="first" within 256 reads of the repair, when the dataset
    next looks at `quarantine/`): the damaged one, which the repair dropped, is a miss encoded
    as the encoder gives it now, its salvaged neighbours are served from where the repair put
    them."""
    bake(audio_dir, encoder_file, store_dir)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, verify=check, on_miss="encode"
    )
    for i in range(len(ds)):
        ds[i]  # every shard opened, every item checked once
    victim = sorted(shard_files(store_dir))[0]
    keys = sorted(_keys_in(victim))
    _flip_data_byte(victim, keys[0])
    repaired = invoke("verify", "--repair", "--cache", store_dir)
    assert repaired.returncode == 10 and not victim.exists(), repaired.stdout + repaired.stderr
    held = [i for i in range(len(ds)) if ds.key(i) in keys]
    assert len(held) == len(keys) >= 2
    if check == "first":
        other = next(i for i in range(len(ds)) if i not in held)
        for _ in range(256):
            ds[other]
    got = [ds[i] for i in held] if read == "item" else ds.__getitems__(held)
    for i, features in zip(held, got, strict=True):
        torch.testing.assert_close(features, live_features(encoder_file, Path(ds.path(i))))
    assert ds.cache_info().encoded == 1


def test_mayhem_deleted_truncated_flipped_shards_and_no_catalog(
    encoder_file: Path, multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    one = bake(audio_dir, encoder_file, store_dir, shard_bytes=40_000)
    two = bake(audio_dir, multi_encoder_file, store_dir, shard_bytes=40_000)
    before = {r: manifest(store_dir, r) for r in (one.root, two.root)}
    files = sorted(shard_files(store_dir))
    assert len(files) >= 6
    deleted, flipped = files[0], files[4]
    # A shard of two keys or more (how items fall into shards varies with the writer's
    # hand-offs), cut between the ends of its first two keys: one is whole, the next is not.
    truncated = next(f for f in (*files[1:4], *files[5:]) if len(_key_ends(f)) >= 2)
    first, second = sorted(_key_ends(truncated).values())[:2]
    cut = (first + second) // 2
    past_cut = {key for key, end in _key_ends(truncated).items() if end > cut}
    assert past_cut and past_cut != _keys_in(truncated)  # the cut falls among its keys
    lost = _keys_in(deleted) | past_cut  # what lay wholly before the cut is salvaged
    flipped_key = sorted(_keys_in(flipped))[0]
    with ShardReader(flipped) as r:
        flipped_tensor = next(t for t in r.tensors if t.startswith(flipped_key))
    deleted.unlink()
    with open(truncated, "r+b") as f:
        f.truncate(cut)
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


def _refusals(
    ds: CachedFeatureDataset, encoder: Path, keys: dict[Path, str]
) -> dict[str, FeatbakeError]:
    """What the dataset refused, by key (a miss, a damaged shard); every item it served is
    checked here to equal ``encoder`` run now on its file."""
    out = {}
    for i in range(len(ds)):
        path = Path(ds.path(i))
        try:
            got = ds[i]
        except FeatbakeError as e:
            out[keys[path]] = e
            continue
        torch.testing.assert_close(got, live_features(encoder, path), rtol=1e-5, atol=1e-6)
    return out


def test_a_shard_cut_short_is_salvaged_up_to_the_cut_and_never_served_before_repair(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """A shard file cut short (a disk that filled mid-copy, an interrupted rsync) is refused
    by every read until ``verify --repair``, which keeps each feature whose bytes lie wholly
    before the cut (it lost all of them before) and quarantines the file; a build then
    encodes exactly the features past the cut."""
    report = bake(audio_dir, encoder_file, store_dir, shard_bytes=150_000)
    victim = max(shard_files(store_dir), key=lambda p: len(_keys_in(p)))
    ends = _key_ends(victim)
    cut = victim.stat().st_size * 6 // 10
    whole = {k for k, end in ends.items() if end <= cut}
    past = set(ends) - whole
    assert len(whole) >= 2 and past, (cut, ends)
    os.truncate(victim, cut)
    keys = {audio_dir / rel: key for rel, key in manifest(store_dir, report.root)}

    with closing(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    ) as ds:
        before = _refusals(ds, encoder_file, keys)
    assert set(before) == set(ends), before  # never the cut shard's bytes, the rest as live
    assert all(isinstance(e, StoreCorrupt) for e in before.values()), before

    fixed = run_cli("verify", "--repair", "--json", "--cache", store_dir)
    assert fixed.returncode == VERIFY_REPAIRED, fixed.stdout + fixed.stderr
    assert "Traceback" not in fixed.stdout + fixed.stderr
    done = json.loads(fixed.stdout)
    assert done["status"] == "repaired" and done["features_salvaged"] == len(whole), done
    assert done["features_lost"] == len(past), done
    assert any(f"{len(past)} tensors past its end are lost" in a for a in done["actions"]), done
    assert (store_dir / "quarantine" / victim.name).exists() and not victim.exists()
    assert verify(store_dir).status == "clean"

    with closing(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    ) as ds:
        after = _refusals(ds, encoder_file, keys)
    assert set(after) == past, after  # what lay before the cut is served, as encoded now
    assert all(isinstance(e, CacheMiss) for e in after.values()), after
    assert bake(audio_dir, encoder_file, store_dir, shard_bytes=150_000).encoded == len(past)
    with closing(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    ) as ds:
        assert _refusals(ds, encoder_file, keys) == {}


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


# == test_verify_hardening =========================================================================
# verify and verify --repair against a hostile or busy store (issue 11, items 10, 11, 16, 18).
#
# Each test builds a real store, damages it the way the hardening campaign did, and checks that
# verify reports it (never crashes), that repair keeps every feature it can prove and that what is
# served afterwards equals live encoding.


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_with_header(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _victim(store: Path) -> Path:
    """The first shard holding at least two keys (so a neighbour can be salvaged)."""
    return next(p for p in sorted(shard_files(store)) if len(_keys_in(p)) >= 2)


# -- item 11: zeros appended to an intact shard ------------------------------------------------
def test_zeros_appended_to_a_shard_are_repaired_in_place_without_losing_features(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    victim = _victim(store_dir)
    with open(victim, "ab") as f:
        f.write(b"\0" * 4096)
    found = verify(store_dir)
    assert [f.kind for f in found.findings if f.damage] == [FindingKind.CORRUPT_SHARD]

    fixed = verify(store_dir, repair_damage=True)
    assert fixed.exit_code == VERIFY_REPAIRED and fixed.status == "repaired", fixed.remaining
    assert fixed.features_lost == 0 and fixed.features_salvaged == len(_keys_in(victim))
    assert victim.is_file()
    assert not (store_dir / "quarantine" / victim.name).exists()  # the sound copy stays put
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16
    assert bake(audio_dir, encoder_file, store_dir).encoded == 0  # nothing was lost


# -- item 2: repair never launders a header it cannot prove ---------------------------------------
def _format_1_store(audio_dir: Path, encoder_file: Path, store_dir: Path, monkeypatch) -> str:
    """A store built by the old writer: format-1 checksums cover a tensor's bytes only."""
    import functools

    from featbake.store import shard as writer_mod
    from featbake.store.shard import shard_metadata

    with monkeypatch.context() as m:
        m.setattr(writer_mod, "shard_metadata", functools.partial(shard_metadata, version="1"))
        return bake(audio_dir, encoder_file, store_dir).root


def _edit_first_tensor(path: Path, edit: str) -> str:
    """Edit the first tensor's dtype or shape in place, keeping the byte count; its key."""
    raw = path.read_bytes()
    header, _ = _header_and_data(path)
    name = next(k for k in header if k != "__metadata__")
    entry = header[name]
    old = json.dumps({name: entry}, separators=(",", ":"))[1:-1].encode()
    changed = dict(entry)
    if edit == "dtype":
        changed["dtype"] = "I32"  # F32 -> I32: the same 4 bytes per element
    else:
        changed["shape"] = entry["shape"][::-1]
    new = json.dumps({name: changed}, separators=(",", ":"))[1:-1].encode()
    assert raw.count(old) == 1 and len(old) == len(new) and old != new
    path.write_bytes(raw.replace(old, new))
    return name.partition("/")[0]


@pytest.mark.parametrize("edit", ["dtype", "shape"])
@pytest.mark.parametrize("catalog", ["kept", "lost"])
@pytest.mark.parametrize("fmt", ["1", "2"])
def test_repair_never_launders_an_edited_header(
    fmt: str,
    edit: str,
    catalog: str,
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header edited to read I32 for F32 or a reversed shape, with the same byte count.

    Format 2's checksum binds the header, so the edited tensor fails and only its neighbours
    are salvaged. Before, a format-1 shard (bytes-only checksums) passed, repair copied the
    edited tensor into a fresh format-2 shard, reported "repaired", verify then said clean and
    the dataset served an I32 (or transposed) tensor. Now a format-1 tensor is salvaged only
    where the catalog confirms its dtype and shape."""
    live = Live()
    if fmt == "1":
        root = _format_1_store(audio_dir, encoder_file, store_dir, monkeypatch)
    else:
        root = bake(audio_dir, encoder_file, store_dir).root
    victim = _victim(store_dir)
    keys = _keys_in(victim)
    edited = _edit_first_tensor(victim, edit)
    if catalog == "lost":
        (store_dir / "catalog.sqlite").unlink()
    assert verify(store_dir).status == "damaged"
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert any("cannot prove" in a for a in fixed.actions) == (fmt == "1"), fixed.actions
    assert verify(store_dir).status == "clean"
    served = assert_serves(store_dir, root, audio_dir, encoder_file, live, allow_missing=True)
    if fmt == "2" or catalog == "kept":  # the neighbours are proven, the edited tensor is not
        assert served == 15
    else:  # nothing vouches for any tensor of the damaged format-1 shard
        assert served == 16 - len(keys)
    again = bake(audio_dir, encoder_file, store_dir)
    assert again.encoded == 16 - served and edited in {k for _, k in manifest(store_dir, root)}
    assert assert_serves(store_dir, root, audio_dir, encoder_file, live) == 16


def test_zeros_appended_to_a_format_1_shard_are_salvaged_where_the_catalog_confirms(
    encoder_file: Path, audio_dir: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = Live()
    root = _format_1_store(audio_dir, encoder_file, store_dir, monkeypatch)
    victim = _victim(store_dir)
    keys = _keys_in(victim)
    with open(victim, "ab") as f:
        f.write(b"\0" * 4096)
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired" and fixed.features_lost == 0, fixed.actions
    assert fixed.features_salvaged == len(keys)
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, root, audio_dir, encoder_file, live) == 16


# -- item 16: hostile shards and a catalog lacking a table -------------------------------------
def _shape_off(path: Path) -> None:
    header, data = _header_and_data(path)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [3]  # same byte range, a shape that does not fit it
    _write_with_header(path, json.dumps(header).encode(), data)


def _nested_arrays(path: Path) -> None:
    _, data = _header_and_data(path)
    _write_with_header(path, b"[" * 200_000 + b"]" * 200_000, data)


def _metadata_number(path: Path) -> None:
    header, data = _header_and_data(path)
    header["__metadata__"] = 5
    _write_with_header(path, json.dumps(header).encode(), data)


def _symlink_loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)  # resolves to itself: ELOOP


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # opening it to read would block until a writer came


HOSTILE_SHARDS = {
    "fifo": _fifo,
    "shape-does-not-fit": _shape_off,
    "200k-nested-arrays": _nested_arrays,
    "metadata-is-a-number": _metadata_number,
    "symlink-loop": _symlink_loop,
}


@pytest.mark.parametrize("damage", sorted(HOSTILE_SHARDS))
def test_hostile_shards_are_findings_never_crashes(
    damage: str, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    victim = _victim(store_dir)
    keys = _keys_in(victim)
    HOSTILE_SHARDS[damage](victim)

    found = verify(store_dir)
    assert found.status == "damaged"
    kinds = {f.kind for f in found.findings if f.damage}
    if damage in ("symlink-loop", "fifo"):
        assert kinds == {FindingKind.NOT_A_FILE, FindingKind.MISSING_SHARD}
    else:
        assert kinds == {FindingKind.CORRUPT_SHARD}

    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert not os.path.lexists(victim)  # moved to quarantine/, link or file
    assert verify(store_dir).status == "clean"
    served = assert_serves(
        store_dir, report.root, audio_dir, encoder_file, live, allow_missing=True
    )
    # Only what the damaged shard held may be lost (with a bad entry among sound ones, a reader
    # that checks entries one by one lets repair salvage the neighbours; every served feature
    # equals live encoding either way), and a rebuild recomputes exactly that.
    assert 16 - len(keys) <= served < 16
    assert bake(audio_dir, encoder_file, store_dir).encoded == 16 - served


def test_a_nested_json_shard_through_the_cli_is_one_line_and_exit_10(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    bake(audio_dir, encoder_file, store_dir)
    _nested_arrays(_victim(store_dir))
    proc = invoke("verify", "--cache", store_dir, "--repair")
    assert proc.returncode == 10, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "corrupt-shard" in proc.stdout


@pytest.mark.parametrize("table", ["features", "root_items", "shards", "meta"])
def test_a_catalog_lacking_a_table_is_rebuilt(
    table: str, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    with sqlite3.connect(store_dir / "catalog.sqlite") as c:
        c.execute(f"DROP TABLE {table}")
    found = verify(store_dir)
    assert [f.kind for f in found.findings if f.damage] == [FindingKind.CATALOG]
    assert any(f"no table {table}" in f.detail for f in found.findings)
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


def test_a_catalog_whose_index_disagrees_with_its_table_is_rebuilt_by_repair(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round eleven, upkeep: a damaged table page that ``quick_check`` passes (it does not
    compare an index with its table; the fuzz test below met one in a 16-CPU build's catalog)
    made ``verify --repair`` end in ``sqlite3.DatabaseError: database disk image is
    malformed`` as it forgot the shard row it could not match. Repair now rebuilds such a
    catalog from the shards, as it does one ``quick_check`` refuses."""
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    catalog = store_dir / "catalog.sqlite"
    with closing(sqlite3.connect(catalog)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (name,), size = c.execute("SELECT name FROM shards LIMIT 1").fetchone(), 4096
        (root,) = c.execute("SELECT rootpage FROM sqlite_schema WHERE name='shards'").fetchone()
    raw = bytearray(catalog.read_bytes())
    page = slice((root - 1) * size, root * size)  # the table's page, not its UNIQUE index's
    at = raw[page].index(name.encode()) + (root - 1) * size
    raw[at] = ord("0" if name[0] != "0" else "1")  # the row's name, behind the index's back
    catalog.write_bytes(bytes(raw))
    with closing(sqlite3.connect(catalog)) as c:
        assert c.execute("PRAGMA quick_check").fetchone() == ("ok",)  # the blind spot
        assert c.execute("PRAGMA integrity_check").fetchone() != ("ok",)
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert any("rebuilt the catalog" in a for a in fixed.actions), fixed.actions
    assert verify(store_dir).status == "clean"
    with closing(sqlite3.connect(catalog)) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert fixed.features_lost == 0  # every shard is sound: the rebuild indexes them all
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


def test_a_catalog_page_with_several_damaged_cells_is_named_in_one_line(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """``quick_check`` says one line per damaged cell, under a ``*** in database main ***``
    head: ``verify`` printed them as they came, over several lines. Now one line names them
    (as a bucket's downloaded catalog version already did: one check serves both)."""
    bake(audio_dir, encoder_file, store_dir)
    catalog = store_dir / "catalog.sqlite"
    with closing(sqlite3.connect(catalog)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        ((root,),) = c.execute("SELECT rootpage FROM sqlite_schema WHERE name='features_shard'")
    raw = bytearray(catalog.read_bytes())
    raw[(root - 1) * 4096 + 8 : root * 4096] = bytes(4096 - 8)  # every cell's offset zeroed
    catalog.write_bytes(bytes(raw))
    proc = invoke("verify", "--cache", store_dir)
    lines = [
        line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "damaged:" in line
    ]
    assert len(lines) == 1 and lines[0].count("On tree page") > 1, printed(proc)
    assert "***" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("version", ["\x00", "three", "3.5"])
def test_a_catalog_whose_schema_version_is_not_a_number_is_rebuilt(
    version: str, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round eleven, upkeep: a schema version that is not a number (a zero byte over the
    ``meta`` row, as the catalog fuzz test wrote) raised ``ValueError`` out of every command
    that opened the catalog, ``verify`` and ``verify --repair`` included. It is read as a
    damaged catalog: named by verify, rebuilt by repair."""
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    with closing(sqlite3.connect(store_dir / "catalog.sqlite")) as c:
        c.execute("UPDATE meta SET value=? WHERE name='schema_version'", (version,))
        c.commit()
    found = verify(store_dir)
    assert [f.kind for f in found.findings if f.damage] == [FindingKind.CATALOG], found.findings
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired" and fixed.features_lost == 0, fixed.remaining
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


def test_required_columns_are_those_of_a_fresh_catalog(tmp_path: Path) -> None:
    cat = Catalog(Layout(tmp_path / "s").ensure())
    try:
        tables = {
            r[0] for r in cat.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        assert set(REQUIRED_COLUMNS) == tables
        for table, columns in REQUIRED_COLUMNS.items():
            have = {r[1] for r in cat.conn.execute(f"PRAGMA table_info({table})")}
            assert columns <= have, table  # newer columns may come; these must stay
    finally:
        cat.close()


def test_a_corrupt_manifest_of_a_cataloged_root_is_rewritten_not_lost(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    live = Live()
    report = bake(audio_dir, encoder_file, store_dir)
    manifest_path = store_dir / "roots" / f"{report.root}.json"
    manifest_path.write_text("[" * 100_000)
    found = verify(store_dir)
    assert {f.kind for f in found.findings if f.damage} == {FindingKind.ROOT_FILE_CORRUPT}
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert json.loads(manifest_path.read_text())["name"] == report.root
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, live) == 16


# -- item 18: --cache pointing at a folder that is not a store -----------------------------------
def test_repair_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    before = sorted(p.name for p in home.iterdir())
    for repair in (False, True):
        with pytest.raises(StoreError, match="not a featbake store"):
            verify(home, repair_damage=repair)
    proc = invoke("verify", "--cache", home, "--repair")
    assert proc.returncode == 5 and "not a featbake store" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in home.iterdir()) == before  # nothing created


# -- item 10: verify --repair while a build writes -----------------------------------------------
def test_repair_refuses_while_a_writer_holds_the_lock(
    encoder_file: Path, audio_dir: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr("featbake.store.locks.EXCLUSIVE_WAIT_S", 0.2)
    # A writer sealing a shard right now holds the lock shared.
    with shared_write_lock(Layout(store_dir)), pytest.raises(StoreError, match="writing shards"):
        verify(store_dir, repair_damage=True)
    assert lock_path(Layout(store_dir)).exists()
    assert verify(store_dir, repair_damage=True).status == "clean"  # released: repair runs


N_RACE = 150


@pytest.mark.slow
def test_repair_in_a_loop_while_a_build_writes_loses_no_rows(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A repair every few encoded items, while the build's writer thread seals shards.

    The build's progress callback hands over to a repair and waits for it (so repairs surely
    happen during the build, whatever the machine's speed); the writer thread keeps sealing
    the queued items meanwhile. Without the write lock, repairs forget the rows of shards
    sealed after their scan listed the files, and items are no longer served.
    """
    live = Live()
    data = tmp_path / "many"
    write_audio_folder(data, N_RACE, seconds=0.1, seed=5)
    want_repair, repaired, done = threading.Event(), threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def hand_over(p: Progress) -> None:
        if p.phase == "encode" and p.done and p.done % 10 == 0 and p.done < p.total:
            repaired.clear()
            want_repair.set()
            repaired.wait(60)

    def build() -> None:
        try:
            result["report"] = bake(
                data, encoder_file, store_dir, shard_bytes=1, batch_size=1, progress=hand_over
            )
        finally:
            done.set()
            want_repair.set()

    t = threading.Thread(target=build)
    t.start()
    repairs = 0
    while not done.is_set():
        want_repair.wait(60)
        want_repair.clear()
        if not done.is_set():
            # Planted damage: each repair then runs its whole catalog pass.
            (store_dir / "roots" / "zz-junk.json").write_text("{")
            verify(store_dir, repair_damage=True)
            repairs += 1
        repaired.set()
    t.join()
    assert repairs >= 10
    report = result["report"]
    assert verify(store_dir).status == "clean"
    assert assert_serves(store_dir, report.root, data, encoder_file, live) == N_RACE


# == test_verify_fuzz ==============================================================================
# Bounded fuzz of what verify reads: shard headers and the catalog file (issue 11, item 16).
#
# Whatever bytes hypothesis puts there, ``verify`` and ``verify --repair`` either return a report
# or raise a :class:`FeatbakeError` (one clear line in the CLI): never another exception, never a
# hang (each example runs under an alarm). The examples are fixed (derandomized) so a failure
# reproduces; to hunt for new ones run with ``FEATBAKE_FUZZ_EXAMPLES=300`` (random examples).

EXAMPLE_TIMEOUT_S = 20

FUZZ = settings(
    max_examples=int(os.environ.get("FEATBAKE_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=not os.environ.get("FEATBAKE_FUZZ_EXAMPLES"),  # fixed examples unless hunting
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real store (4 clips, several shards), its catalog checkpointed into one file."""
    tmp = tmp_path_factory.mktemp("fuzzbase")
    encoder = save_torchscript(TinyConvEncoder(), tmp / "encoder.pt")
    write_audio_folder(tmp / "audio", 4, seconds=(0.3, 0.6), seed=3)
    store = tmp / "store"
    bake(tmp / "audio", encoder, store, shard_bytes=20_000)
    with sqlite3.connect(store / "catalog.sqlite") as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return store


def _survives(base: Path, damage: Callable[[Path], None]) -> None:
    """Damage a copy of ``base``; verify, repair and verify again may only report or refuse."""
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store"
        shutil.copytree(base, store)
        damage(store)
        with fails_after(EXAMPLE_TIMEOUT_S, "verify"):
            for repair in (False, True, False):
                try:
                    report = verify(store, repair_damage=repair)
                except FeatbakeError:
                    continue
                assert isinstance(report, VerifyReport)
                assert report.exit_code in (0, 10, 11)


def _split(path: Path) -> tuple[int, bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def _write(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@FUZZ
@given(
    which=st.integers(0, 99),
    mode=st.sampled_from(["bytes", "document", "entry", "length"]),
    at=st.lists(st.tuples(st.integers(0, 2**31), st.binary(min_size=1, max_size=4)), max_size=6),
    value=JSON,
    length=st.integers(0, 2**64 - 1),
)
def test_fuzzed_shard_headers_never_crash_verify(
    base_store: Path,
    which: int,
    mode: str,
    at: list[tuple[int, bytes]],
    value: object,
    length: int,
) -> None:
    def damage(store: Path) -> None:
        files = sorted(shard_files(store))
        path = files[which % len(files)]
        n, head, data = _split(path)
        if mode == "bytes":  # random bytes over the JSON header
            buf = bytearray(head)
            for pos, chunk in at:
                i = pos % len(buf)
                buf[i : i + len(chunk)] = chunk
            _write(path, bytes(buf[:n]), data)
        elif mode == "document":  # the whole header replaced by some JSON value
            _write(path, json.dumps(value).encode(), data)
        elif mode == "entry":  # one entry (a tensor's or __metadata__) replaced
            doc = json.loads(head)
            names = sorted(doc)
            doc[names[which % len(names)]] = value
            _write(path, json.dumps(doc).encode(), data)
        else:  # a length prefix that lies
            path.write_bytes(struct.pack("<Q", length) + head + data)

    _survives(base_store, damage)


@FUZZ
@given(
    at=st.lists(
        st.tuples(st.integers(0, 2**31), st.binary(min_size=1, max_size=64)), min_size=1, max_size=8
    )
)
def test_fuzzed_catalog_bytes_never_crash_verify(
    base_store: Path, at: list[tuple[int, bytes]]
) -> None:
    def damage(store: Path) -> None:
        path = store / "catalog.sqlite"
        buf = bytearray(path.read_bytes())
        for pos, chunk in at:
            i = pos % len(buf)
            buf[i : i + len(chunk)] = chunk
        path.write_bytes(bytes(buf))

    _survives(base_store, damage)


# == test_hash_check ===============================================================================
# verify re-derives the hash cache instead of trusting it (issue 11, item 3).
#
# A hash-cache row says "the file with this stat hashes to this digest"; a dataset trusts it to map
# the file to its key without reading it. A row edited to give file A the digest of file B made the
# dataset serve B's feature for A, and `verify --repair` kept the row. Each test edits real rows of
# a real build, checks that the fault is real (the dataset serves the wrong feature), then that
# verify reports it, repair re-derives it, and every served feature equals live encoding again.

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _settle() -> None:
    """Let the files just written age past the racy window: their hash rows are then trusted."""
    time.sleep(1.1)


def _rows(store: Path) -> dict[str, str]:
    with sqlite3.connect(store / "catalog.sqlite") as c:
        return dict(c.execute("SELECT path, sha256 FROM hash_cache").fetchall())


def _set_digest(store: Path, path: str, sha: str) -> None:
    """The hostile edit: one row's digest, nothing else (its stat still matches the file)."""
    with sqlite3.connect(store / "catalog.sqlite") as c:
        assert c.execute("UPDATE hash_cache SET sha256=? WHERE path=?", (sha, path)).rowcount == 1


def _item(ds: CachedFeatureDataset, path: Path) -> int:
    return next(i for i in range(len(ds)) if Path(ds.path(i)) == path)


def _assert_all_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))), **TOL)


def test_a_row_giving_a_file_anothers_digest_is_found_and_re_derived(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _settle()
    report = bake(audio_dir, encoder_file, store_dir)
    rows = _rows(store_dir)
    a, b = sorted(str(p) for p in audio_dir.rglob("*.wav"))[:2]
    _set_digest(store_dir, a, rows[b])
    # The fault is real: the dataset serves B's feature for A.
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    torch.testing.assert_close(ds[_item(ds, Path(a))], live_features(encoder_file, Path(b)), **TOL)
    # A rebuild now keys A with B's digest in the root manifest too.
    bake(audio_dir, encoder_file, store_dir)
    wrong_key = feature_key(report.encoder_fp, report.recipe_fp, rows[b])
    rel_a = os.path.relpath(a, audio_dir)
    assert dict(manifest(store_dir, report.root))[rel_a] == wrong_key

    found = invoke("verify", "--cache", store_dir)
    assert found.returncode == 11, found.stdout + found.stderr
    assert "hash-cache" in found.stdout and a in found.stdout
    fixed = invoke("verify", "--repair", "--cache", store_dir)
    assert fixed.returncode == 10, fixed.stdout + fixed.stderr
    assert "re-keyed 1 manifest items" in fixed.stdout, fixed.stdout
    again = invoke("verify", "--cache", store_dir)
    assert again.returncode == 0, again.stdout
    assert a not in _rows(store_dir) or _rows(store_dir)[a] == rows[a]
    right_key = feature_key(report.encoder_fp, report.recipe_fp, rows[a])
    assert dict(manifest(store_dir, report.root))[rel_a] == right_key
    _assert_all_live(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error"),
        encoder_file,
    )
    assert bake(audio_dir, encoder_file, store_dir).encoded == 0  # A's own feature was kept


def test_a_cached_encoder_fingerprint_is_never_kept_by_repair(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """verify cannot check an encoder's cached fingerprint without loading the encoder, which
    upkeep never does: repair drops those rows (each is computed again on next use)."""
    other = save_torchscript(TinyConvEncoder(seed=1), tmp_path / "other.pt")
    _settle()
    bake(audio_dir, encoder_file, store_dir)
    bake(audio_dir, other, store_dir)
    rows = _rows(store_dir)
    mine = next(p for p in rows if p.startswith("encoder-fp:") and p.endswith("/encoder.pt"))
    theirs = next(p for p in rows if p.startswith("encoder-fp:") and p.endswith("/other.pt"))
    _set_digest(store_dir, mine, rows[theirs])
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    path = Path(ds.path(0))
    torch.testing.assert_close(ds[0], live_features(other, path), **TOL)  # the fault is real

    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "clean" and fixed.exit_code == 0  # nothing else was wrong
    assert any("cached encoder fingerprints" in line for line in fixed.actions), fixed.actions
    assert not any(p.startswith("encoder-fp:") for p in _rows(store_dir))
    _assert_all_live(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error"),
        encoder_file,
    )


def test_rows_carried_over_by_a_catalog_rebuild_are_checked_too(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _settle()
    bake(audio_dir, encoder_file, store_dir)
    rows = _rows(store_dir)
    a, b = sorted(str(p) for p in audio_dir.rglob("*.wav"))[:2]
    _set_digest(store_dir, a, rows[b])
    with sqlite3.connect(store_dir / "catalog.sqlite") as c:
        c.execute("DROP TABLE shards")  # unusable: repair rebuilds it, carrying the hash rows
    fixed = verify(store_dir, repair_damage=True)
    assert fixed.status == "repaired", fixed.remaining
    assert verify(store_dir).status == "clean"
    assert _rows(store_dir).get(a, rows[a]) == rows[a]
    _assert_all_live(
        CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error"),
        encoder_file,
    )


def test_only_rows_that_would_be_trusted_are_read_and_hostile_paths_are_skipped(
    tmp_path: Path, store_dir: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A changed, missing or racy file's row is never trusted, so it is not read (nor damage);
    a FIFO or a symlink loop at a row's path never hangs or fails the check."""
    _settle()
    bake(audio_dir, encoder_file, store_dir)
    files = sorted(audio_dir.rglob("*.wav"))
    files[0].write_bytes(files[0].read_bytes() + b"\0")  # changed since: its stat differs
    files[1].unlink()
    fifo = tmp_path / "fifo.wav"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.wav"
    loop.symlink_to(loop)
    st = fifo.stat()
    with sqlite3.connect(store_dir / "catalog.sqlite") as c:
        for p in (fifo, loop):  # rows whose stat matches what is there now, and not racy
            c.execute(
                "INSERT INTO hash_cache(path, size, mtime_ns, inode, ctime_ns, sha256, "
                "recorded_ns) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (str(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, "0" * 64,
                 time.time_ns() + 10**10),
            )  # fmt: skip
    check = check_hash_cache(Layout(store_dir))
    assert check.wrong == ()
    assert check.files_read == 14  # 16 built, one changed, one deleted
    kinds = {f.kind for f in verify(store_dir).findings if f.damage}
    assert FindingKind.HASH_CACHE not in kinds


def test_repair_re_keys_a_manifest_roots_items_and_segments_through_its_inputs(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """`_rekey_manifests` joined the root's data with the item's name: for a manifest root
    (`train.jsonl` + `u0`) that names no file, so items keyed from a wrong row kept the wrong
    key after `verify --repair`. Through the inputs seam, a row of the manifest and a segment of
    the same recording are both re-keyed."""
    import json

    a, b = sorted(str(p) for p in audio_dir.rglob("*.wav"))[:2]
    rows = [
        {"id": "u0", "path": a},
        {"id": "u1", "path": a, "start": 0.1, "end": 0.3},
        {"id": "u2", "path": b},
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _settle()
    report = bake(train, encoder_file, store_dir)
    assert report.encoded == 3 and not report.failed
    right = manifest(store_dir, report.root)
    _set_digest(store_dir, a, _rows(store_dir)[b])
    bake(train, encoder_file, store_dir)  # a rebuild keys u0 and u1 from b's digest
    wrong = manifest(store_dir, report.root)
    assert [k for _, k in wrong] != [k for _, k in right]
    assert wrong[2] == right[2]

    fixed = invoke("verify", "--repair", "--cache", store_dir)
    assert fixed.returncode == 10, fixed.stdout + fixed.stderr
    assert "re-keyed 2 manifest items" in fixed.stdout, fixed.stdout
    assert manifest(store_dir, report.root) == right
    assert invoke("verify", "--cache", store_dir).returncode == 0


# == round four: containers =================================================================


def _tar_of_clips(path: Path, clips: list[bytes]) -> Path:
    """A webdataset shard of one ``.wav`` and one ``.txt`` member per sample."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for i, clip in enumerate(clips):
            for name, data in ((f"u{i:03d}.wav", clip), (f"u{i:03d}.txt", b"words")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def test_verify_opens_each_container_once_not_once_per_member(
    tmp_path: Path, store_dir: Path, encoder_file: Path, audio_dir: Path, monkeypatch
) -> None:
    """verify reopened a tar for every hash-cache row naming one of its members (and parsed
    every header before it: ``getmember``) and a parquet file for every cell's row: quadratic
    (2,000 members: 196 s). Now each container is opened and listed once, its members and cells
    read in order; every row is still checked, and an edited one still found."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import tarfile

    clips = [p.read_bytes() for p in sorted(audio_dir.rglob("*.wav"))]
    tar = _tar_of_clips(tmp_path / "shard.tar", clips)
    table = tmp_path / "clips.parquet"
    pq.write_table(pa.table({"audio": pa.array(clips, pa.binary())}), table, row_group_size=3)
    _settle()
    for data in (tar, table):
        assert not bake(data, encoder_file, store_dir).failed
    _set_digest(store_dir, f"{tar}:u001.wav", "0" * 64)
    opened: list[str] = []
    tar_open, parquet_file = tarfile.open, pq.ParquetFile

    def open_tar(name: object = None, *a: object, **kw: object) -> tarfile.TarFile:
        opened.append(str(name or kw.get("fileobj")))
        return tar_open(name, *a, **kw)  # type: ignore[arg-type]

    def open_parquet(source: object, *a: object, **kw: object) -> object:
        opened.append(str(source))
        return parquet_file(source, *a, **kw)

    monkeypatch.setattr(tarfile, "open", open_tar)
    monkeypatch.setattr(pq, "ParquetFile", open_parquet)
    check = check_hash_cache(Layout(store_dir))
    assert sorted(opened) == sorted([str(tar), str(table)]), opened
    assert check.files_read == 2 * len(clips)
    assert [m.path for m in check.wrong] == [f"{tar}:u001.wav"]


def test_parts_waiting_for_a_merge_are_a_note_and_a_lost_catalog_beside_them_is_still_damage(
    encoder_file: Path, audio_dir: Path, tmp_path: Path
) -> None:
    """Round four item 9: a build in parts with one part unfinished is a `parts-waiting` note
    (exit 0, with what to do), whether a catalog exists yet or not (before, a store holding
    only parts' fragments was "damaged", exit 11). A catalog lost from a store whose root
    manifests say it existed is damage still."""
    from featbake.bake.pipeline import build

    store = tmp_path / "store"
    build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")
    assert not (store / "catalog.sqlite").exists()
    first = verify(store)
    (note,) = first.findings
    assert note.kind is FindingKind.PARTS_WAITING and not note.damage
    assert "run `featbake merge` or rerun the build" in note.detail
    assert (first.status, first.exit_code) == ("clean", VERIFY_CLEAN)

    other = tmp_path / "other"
    write_audio_folder(other, 2, seconds=0.3, seed=31)
    build(other, encoder_file, cache=store, workers=0)  # a catalog and a root manifest now
    assert [f.kind for f in verify(store).findings] == [FindingKind.PARTS_WAITING]
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store}/catalog.sqlite{suffix}").unlink(missing_ok=True)
    lost = verify(store)
    assert lost.exit_code == VERIFY_DAMAGED
    assert {f.kind for f in lost.findings} == {FindingKind.CATALOG, FindingKind.PARTS_WAITING}


def test_verify_finds_a_shard_a_fragment_names_gone_and_a_fragment_it_cannot_read(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Round six, upkeep: a build in parts whose sealed fragment names a shard deleted by hand,
    and another part whose fragment is garbage. `verify` said clean (exit 0) although the merge
    then skipped the lost shard's features and refused the garbage fragment (exit 6). Both are
    damage now, each one line saying what to do; `--repair` moves the unreadable fragment
    aside, and a merge then a build make the store clean and whole again."""
    from featbake.store.fragments import fragment_shard_names, sealed_fragments

    store = tmp_path / "store"
    bake(audio_dir / "fixed", encoder_file, store)  # the store's catalog
    for part in ("0/2", "1/2"):
        bake(audio_dir, encoder_file, store, shard_bytes=20_000, shard=part)
    layout = Layout(store)
    lost = sorted(fragment_shard_names(layout))[0]
    layout.shard_path(lost).unlink()
    out = invoke("verify", "--cache", store)
    assert out.returncode == 11, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("missing-shard"))
    assert lost in line and "featbake build" in line

    owner = {f.path for f in sealed_fragments(layout) if lost not in _shard_names_of(f.path)}
    garbage = sorted(owner)[0]
    garbage.write_bytes(b"not a fragment" * 100)
    out = invoke("verify", "--cache", store)
    assert out.returncode == 11
    assert any(x.startswith(f"fragment {garbage}") for x in out.stdout.splitlines())

    repaired = invoke("verify", "--repair", "--cache", store)
    assert repaired.returncode == 11, repaired.stdout  # the lost shard stays lost
    assert not garbage.exists()
    invoke("merge", "--cache", store)
    report = bake(audio_dir, encoder_file, store)
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


def _shard_names_of(fragment: Path) -> set[str]:
    with closing(sqlite3.connect(f"file:{fragment}?mode=ro", uri=True)) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM shards")}


def _refused(code: int, message: str) -> sqlite3.OperationalError:
    """The error SQLite gives where the disk refuses a write (``code``: its extended code)."""
    error = sqlite3.OperationalError(message)
    error.sqlite_errorcode = code  # type: ignore[attr-defined]
    return error


def test_verify_on_a_full_disk_is_one_line_and_never_rebuilds_a_sound_catalog(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round six, upkeep: on a full disk, opening a WAL catalog (even read-only) fails with
    SQLITE_IOERR_SHMSIZE (its shared-memory file cannot grow: seen on a 400 KiB tmpfs). verify
    called the sound catalog unreadable (exit 11, "--repair rebuilds it"), and `--repair` moved
    it to quarantine/ and then failed to make a new one with an internal error, leaving a store
    with no catalog. Both now say in one line that the disk refused a write (exit 5), and the
    catalog stays where it is."""
    import featbake.store.catalog as catalog_module

    store = tmp_path / "store"
    report = bake(audio_dir, encoder_file, store)
    real = catalog_module.open_sqlite

    def full_disk(path, *args, **kw):  # every catalog file this store opens
        if Path(path).name.startswith("catalog.sqlite"):
            raise _refused(sqlite3.SQLITE_IOERR_SHMSIZE, "disk I/O error")
        return real(path, *args, **kw)

    monkeypatch.setattr(catalog_module, "open_sqlite", full_disk)
    for args in (("verify",), ("verify", "--repair")):
        out = invoke(*args, "--cache", store)
        lines = [x for x in out.stderr.splitlines() if x.strip()]
        assert out.returncode == 5, out.stdout + out.stderr
        assert lines[-1].startswith("error: cannot write the catalog"), lines
        assert "internal error" not in out.stdout + out.stderr
        assert (store / "catalog.sqlite").is_file() and not (store / "quarantine").exists()
    monkeypatch.setattr(catalog_module, "open_sqlite", real)
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


def test_verify_of_an_older_catalog_on_a_read_only_store_is_not_damage(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round six, upkeep: a catalog an older featbake wrote (schema 2) on a read-only store.
    verify called it damaged (exit 11) in a line that said both "open the store once where it
    is writable" and "--repair rebuilds it"; the catalog is sound and only waits for a writable
    open to be upgraded. verify now says what stats says (one line, exit 5), and where the
    store is writable it upgrades the catalog and is clean."""
    store = tmp_path / "store"
    report = bake(audio_dir, encoder_file, store)
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:  # as featbake 2 wrote it
        conn.execute("ALTER TABLE hash_cache DROP COLUMN ctime_ns")
        conn.execute("ALTER TABLE hash_cache DROP COLUMN recorded_ns")
        conn.execute("UPDATE meta SET value='2' WHERE name='schema_version'")
        conn.commit()
    monkeypatch.setenv("FEATBAKE_READ_ONLY", "1")
    for args in (("verify",), ("verify", "--repair"), ("stats",)):
        out = invoke(*args, "--cache", store)
        assert out.returncode == 5, out.stdout + out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert "schema version 2 and is read-only here" in last and "--repair" not in last
    monkeypatch.delenv("FEATBAKE_READ_ONLY")
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir, encoder_file, Live()) == 16


#: Hash-cache rows of inputs (repair drops every cached encoder fingerprint, by design).
_INPUT_HASH_ROWS = "SELECT count(*) FROM hash_cache WHERE path NOT LIKE 'encoder-fp:%'"

_KILLED_REBUILD = """
import os, signal, sys
import featbake.store.catalog as catalog
real, calls = catalog.FeatureRows.add_shard, []
def add_shard(self, *args, **kw):  # the rebuild's second shard: one is in the new catalog
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args, **kw)
catalog.FeatureRows.add_shard = add_shard
from featbake.upkeep import verify
verify(sys.argv[1], repair_damage=True)
"""


def test_a_repair_killed_while_it_rebuilds_the_catalog_loses_nothing(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """Round six, upkeep: a catalog lacking a table, and a root whose manifest file is gone
    (only the old catalog knows it). `verify --repair` moved the old catalog to quarantine/
    before it built the new one; killed in between, it left a partial catalog (or none), and
    the next repair, no longer reading the old one, lost that root (its features then
    unreached, for gc to delete) and every hash-cache row. The old catalog now waits in
    catalog.rebuilding/ until the new one is whole: gc refuses meanwhile, verify calls it
    damage, and the next repair reads it again."""
    import subprocess
    import sys

    store = tmp_path / "store"
    kept = bake(audio_dir / "fixed", encoder_file, store)
    only_in_catalog = bake(audio_dir, encoder_file, store, shard_bytes=20_000)
    (store / "roots" / f"{only_in_catalog.root}.json").unlink()
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        conn.execute("DROP TABLE encoders")
        hashed = conn.execute(
            "SELECT count(*) FROM hash_cache WHERE path NOT LIKE 'encoder-fp:%'"
        ).fetchone()[0]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_REBUILD, str(store)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr
    gc_out = invoke("gc", "--cache", store)
    assert gc_out.returncode == 5 and "verify --repair` of" in gc_out.stderr, gc_out.stderr
    stats_out = invoke("stats", "--cache", store)  # a partial catalog's numbers are not the store's
    assert stats_out.returncode == 5 and "verify --repair` of" in stats_out.stderr
    assert invoke("verify", "--cache", store).returncode == 11
    assert invoke("verify", "--repair", "--cache", store).returncode == 10

    assert {kept.root, only_in_catalog.root} <= {r.name for r in list_roots(store)}
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        assert (
            conn.execute(
                "SELECT count(*) FROM hash_cache WHERE path NOT LIKE 'encoder-fp:%'"
            ).fetchone()[0]
            == hashed
        )
    assert invoke("gc", "--cache", store).returncode == 0
    assert verify(store).status == "clean"
    live = Live()
    assert assert_serves(store, kept.root, audio_dir / "fixed", encoder_file, live) == 4
    assert assert_serves(store, only_in_catalog.root, audio_dir, encoder_file, live) == 16


@pytest.mark.parametrize(
    "column, value", [("recipe", "not json"), ("recipe", "[1, 2]"), ("last_used", "yesterday")]
)
def test_a_root_row_of_the_wrong_kind_is_one_line_found_by_verify_and_repaired(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, column: str, value: str
) -> None:
    """Round six, upkeep: SQLite keeps whatever a column is given, and its quick_check says
    nothing of it. A root row whose recipe is not a JSON object, or whose last use is text,
    ended stats, roots, gc and even verify and verify --repair in an internal error
    (JSONDecodeError, TypeError). Every command now says in one line which root's row is
    damaged (exit 6); verify calls the catalog damaged (exit 11) and --repair rebuilds it from
    the root manifests (exit 10), after which the store is clean and serves."""
    store = tmp_path / "store"
    report = bake(audio_dir / "fixed", encoder_file, store)
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        conn.execute(f"UPDATE roots SET {column}=?", (value,))
        conn.commit()
    for args in (("stats",), ("roots",), ("gc", "--older-than", "1d")):
        out = invoke(*args, "--cache", store)
        assert out.returncode == 6, out.stdout + out.stderr
        line = out.stderr.strip().splitlines()[-1]  # the root named, or its table (gc)
        assert line.startswith("error: the catalog") and "verify --repair" in line, line
        assert report.root in line or "roots hold values of the wrong kind" in line, line
    found = invoke("verify", "--cache", store)
    assert found.returncode == 11 and "internal error" not in found.stderr, found.stderr
    assert invoke("verify", "--repair", "--cache", store).returncode == 10
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir / "fixed", encoder_file, Live()) == 4


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE features SET nbytes='big' WHERE key=(SELECT min(key) FROM features)",
        "UPDATE features SET last_used='today' WHERE key=(SELECT min(key) FROM features)",
        "UPDATE features SET shape='[3,' WHERE key=(SELECT min(key) FROM features)",
        "UPDATE shards SET bytes='many' WHERE id=(SELECT min(id) FROM shards)",
    ],
)
def test_feature_and_shard_rows_of_the_wrong_kind_are_damage_and_gc_refuses_them(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, edit: str
) -> None:
    """Round six, upkeep: feature or shard rows holding a value not of their column's kind
    (SQLite keeps it; quick_check says nothing). verify called such a catalog clean (exit 0),
    while gc --max-bytes and stats ended in internal errors (TypeError), or summed the text as
    0. verify now finds them (exit 11) and --repair rebuilds the catalog from the shard headers
    (exit 10); gc refuses in one line (exit 6) before it plans anything, and so does stats
    where it adds such a value up."""
    store = tmp_path / "store"
    report = bake(audio_dir / "fixed", encoder_file, store)
    with closing(sqlite3.connect(store / "catalog.sqlite")) as conn:
        conn.execute(edit)
        conn.commit()
    found = invoke("verify", "--cache", store)
    assert found.returncode == 11, found.stdout + found.stderr
    assert "hold values of the wrong kind" in found.stdout
    refused = invoke("gc", "--max-bytes", "50KiB", "--cache", store)
    assert refused.returncode == 6 and refused.stderr.strip().startswith("error: the catalog"), (
        refused.stderr
    )
    counted = invoke("stats", "--json", "--cache", store)
    if "shape" in edit:  # stats adds no shapes up: its numbers are right, and it says them
        assert counted.returncode == 0, counted.stderr
    else:  # a sum over text is no number (SQLite's sum took 'big' for 0): one line, exit 6
        assert counted.returncode == 6, counted.stdout + counted.stderr
        assert counted.stderr.strip().startswith("error: the catalog"), counted.stderr
        assert "hold values of the wrong kind" in counted.stderr, counted.stderr
    assert invoke("verify", "--repair", "--cache", store).returncode == 10
    assert verify(store).status == "clean"
    assert assert_serves(store, report.root, audio_dir / "fixed", encoder_file, Live()) == 4


def test_verifys_note_on_tmp_leftovers_counts_what_stats_and_gc_count(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round nine, upkeep: verify's note on ``tmp/`` counted its files only, while stats and
    gc's sweep count each folder a killed process left there too (a scratch copy of a shard):
    the note said "1 files (10 bytes)" of a tmp/ that stats called 2 leftovers holding a shard.
    It counts them by the same rule now (``Place.leftovers``)."""
    bake(audio_dir, encoder_file, store_dir)
    tmp = store_dir / "tmp"
    left = tmp / "scratch-of-a-killed-run"
    left.mkdir(parents=True)
    shard = next(iter(shard_files(store_dir)))
    shutil.copyfile(shard, left / shard.name)
    (tmp / "x.part").write_bytes(b"x" * 10)
    seen = stats(store_dir)
    assert (seen.tmp_files, seen.tmp_bytes) == (2, shard.stat().st_size + 10)

    report = verify(store_dir)
    assert report.status == "clean"
    (note,) = [f for f in report.findings if f.kind is FindingKind.TMP_LEFTOVERS]
    assert note.detail.startswith(f"2 leftovers ({seen.tmp_bytes} bytes) ")
    assert not note.damage


@pytest.mark.parametrize("column", ["shape", "dtype", "shard_id"])
def test_a_row_naming_its_tensor_wrongly_is_repaired_from_the_shard_that_holds_it(
    audio_dir: Path, encoder_file: Path, store_dir: Path, column: str
) -> None:
    """One feature row's ``shape``, ``dtype`` or shard edited: its sound shard's header holds
    the tensor under other metadata (or another shard is named). ``verify --repair`` deleted
    the row and reported it lost ("rebuild to recompute"), though the sound shard still held
    the feature: only shards the catalog did not list were indexed. Now the shards holding a
    deleted row's key are indexed again: nothing is lost, every item is served (hits, equal to
    the encoder run now), and a rebuild encodes nothing."""
    report = bake(audio_dir, encoder_file, store_dir)
    with closing(sqlite3.connect(store_dir / "catalog.sqlite")) as conn:
        key, shape, dtype = conn.execute(
            "SELECT key, shape, dtype FROM features ORDER BY key LIMIT 1"
        ).fetchone()
        (other,) = conn.execute(
            "SELECT min(id) FROM shards WHERE id != (SELECT shard_id FROM features WHERE key=?)",
            (key,),
        ).fetchone()  # another sound shard, which lacks the tensor
        wrong = {
            "shape": json.dumps([json.loads(shape)[0] - 1, *json.loads(shape)[1:]]),
            "dtype": "float16" if dtype != "float16" else "float32",
            "shard_id": other,
        }[column]
        conn.execute(f"UPDATE features SET {column}=? WHERE key=?", (wrong, key))
        conn.commit()
    repaired = invoke("verify", "--cache", store_dir, "--repair", "--json")
    assert repaired.returncode == VERIFY_REPAIRED, repaired.stdout + repaired.stderr
    assert json.loads(repaired.stdout)["features_lost"] == 0, repaired.stdout
    with closing(sqlite3.connect(store_dir / "catalog.sqlite")) as conn:
        assert conn.execute("SELECT count(*) FROM features WHERE key=?", (key,)).fetchone() == (1,)
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, Live()) == len(
        manifest(store_dir, report.root)
    )
    assert bake(audio_dir, encoder_file, store_dir).encoded == 0
