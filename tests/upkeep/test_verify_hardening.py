"""verify and verify --repair against a hostile or busy store (issue 11, items 10, 11, 16, 18).

Each test builds a real store, damages it the way the hardening campaign did, and checks that
verify reports it (never crashes), that repair keeps every feature it can prove and that what is
served afterwards equals live encoding.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import threading
from pathlib import Path

import pytest

from featbake.errors import StoreError
from featbake.progress import Progress
from featbake.store.catalog import REQUIRED_COLUMNS, Catalog
from featbake.store.layout import Layout, lock_path, shared_write_lock
from featbake.store.shard import ShardReader
from featbake.testing import write_audio_folder
from featbake.upkeep import VERIFY_REPAIRED, FindingKind, verify
from tests.conftest import invoke
from tests.helpers import Live, assert_serves, bake, manifest, shard_files


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_with_header(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _keys_in(path: Path) -> set[str]:
    with ShardReader(path) as r:
        return {name.partition("/")[0] for name in r.tensors}


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
    monkeypatch.setattr("featbake.store.layout.EXCLUSIVE_WAIT_S", 0.2)
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
