"""The benchmarks stay runnable: every module imports, and the build bench's bare loop runs.

Speed itself is measured by `make bench`, never asserted here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as run.py does: dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("bench_*.py")))
def test_bench_module_imports_and_has_main(name: str) -> None:
    assert callable(_load(name).main)


def test_bare_loop_decodes_and_encodes_every_file(tmp_path: Path, encoder_file: Path) -> None:
    from featbake.testing import write_audio_folder

    write_audio_folder(tmp_path / "clips", 6, seconds=0.5)  # the bench's clips share one length
    seconds = _load("bench_build").bare_loop(tmp_path / "clips", encoder_file)
    assert seconds > 0


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files via /proc")
def test_bucket_bench_counts_a_deleted_file_while_it_is_open(tmp_path: Path) -> None:
    held_deleted = _load("bench_bucket").held_deleted
    shard = tmp_path / "ab" / "shard.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 4096)
    with shard.open("rb"):
        assert held_deleted(tmp_path) == 0  # not deleted: the tier's listing counts it
        shard.unlink()
        assert held_deleted(tmp_path) == 4096
    assert held_deleted(tmp_path) == 0


def test_bucket_bench_counts_a_first_builds_gets_of_its_inputs() -> None:
    """The read-once row counts what the server answered: one GET per object with the bytes
    hashed kept (1.0x the data's size), two without, none in a rebuild; a bucket parquet's
    requests per cell: the scan's one HEAD and ranged GETs, no LIST, a rebuild's one HEAD; a
    manifest's s3:// rows: one LIST of their folder, no HEAD (a HEAD each as before)."""
    pytest.importorskip("moto")
    rows = _load("bench_bucket").main_read_once(quick=True)
    assert [round(r["value"], 3) for r in rows[:2]] == [1.0, 2.0]
    assert len(rows) == 7 and rows[2]["value"] < rows[3]["value"]  # cells kept: fewer GETs
    for r in rows[2:4]:
        assert ", 1 HEAD for 16 cells" in r["note"] and "LIST" not in r["note"], r["note"]
        assert r["note"].endswith("a rebuild: 1 HEAD"), r["note"]
    assert rows[0]["note"].startswith("16 GETs") and rows[0]["note"].endswith("rebuild: 0 GETs")
    assert rows[1]["note"].startswith("32 GETs")
    # a manifest of the 16 objects as s3:// rows: its folder listed, a HEAD per row only as before
    assert [r["note"].split(" for ")[0] for r in rows[4:]] == [
        "1 LIST, 0 HEAD, 16 GET", "1 LIST, 0 HEAD, 0 GET", "0 LIST, 16 HEAD, 0 GET"
    ]  # fmt: skip
    assert rows[5]["ok"] is True


def test_peers_bench_readers_serve_the_same_items_once(tmp_path: Path) -> None:
    """Part peers compares readers of the same items: each reader (litdata's two where litdata is
    importable) yields every item once per epoch, equal in dtype, shape and bytes to its .npy."""
    import hashlib

    import numpy as np

    peers = _load("bench_peers")
    base = peers.prepare_items(tmp_path / "items", 6, "float16", seed=3)
    lit = peers.prepare_litdata(base, chunk_bytes=1 << 20) is not None
    assert lit == ((base / "litdata" / "index.json").exists())

    def key(dtype: str, shape: tuple[int, ...], data: bytes) -> str:
        return f"{dtype} {shape} {hashlib.sha256(data).hexdigest()}"

    arrays = [np.load(p) for p in sorted((base / "npy").glob("*.npy"))]
    want = sorted(key(str(a.dtype), a.shape, a.tobytes()) for a in arrays)
    for name in [r for r in peers.READERS if lit or r not in peers.LITDATA]:
        ds = peers.make(name, base, seed=1)
        got = [t.numpy() for t in peers.loader(name, ds, workers=0, seed=1)]
        assert sorted(key(str(a.dtype), a.shape, a.tobytes()) for a in got) == want, name
