"""Catalog hardening (issue 11): stale hash-cache entries (item 1), a lost catalog beside intact
shards and roots (item 8), and a store that cannot be written (item 17)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from featbake.bake.pipeline import build
from featbake.encode.fingerprints import cached_file_encoder_fp, encoder_fingerprint, hash_inputs
from featbake.encode.loaders import load_encoder
from featbake.errors import StoreError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import SCHEMA_VERSION, Access, Catalog, FileStat, HashRow, RootSpec
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, save_torchscript
from tests.conftest import REPO, invoke, live_features
from tests.helpers import can_mount_privately

#: A root the tests publish before they take the catalog away or make the store read-only.
ROOT = RootSpec("r", "/d", encoder_label="e", encoder_fp="e" * 64, recipe_fp="r" * 64, recipe={})
ARCHIVE_TIME = 1_500_000_000  # a fixed date, as a reproducible tarball or a zip gives its files


def _settle() -> None:
    """Let a second pass, so entries recorded from now on are not "racy" for files made so far."""
    time.sleep(1.1)


def _cp_p(src: Path, dst: Path) -> None:
    """The real ``cp -p``: rewrites ``dst`` in place (same inode), keeping ``src``'s mtime."""
    subprocess.run(["cp", "-p", str(src), str(dst)], check=True)


def _same_size_versions(folder: Path) -> tuple[Path, Path]:
    old, new = folder / "v1.bin", folder / "v2.bin"
    old.write_bytes(b"A" * 4096)
    new.write_bytes(b"B" * 4096)
    for p in (old, new):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    return old, new


# -- item 1: stat-cache staleness ----------------------------------------------------------------
def test_cp_p_of_a_new_version_over_a_hashed_file_is_hashed_again(tmp_path: Path) -> None:
    old, new = _same_size_versions(tmp_path)
    data = tmp_path / "data.bin"
    _cp_p(old, data)
    _settle()
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        assert hash_inputs(cat, [str(data)])[0] == {
            str(data): hashlib.sha256(b"A" * 4096).hexdigest()
        }
        before = os.stat(data)
        _cp_p(new, data)
        after = os.stat(data)
        # What the cache used to trust is all unchanged; only ctime tells.
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
            before.st_size,
            before.st_mtime_ns,
            before.st_ino,
        )
        assert hash_inputs(cat, [str(data)])[0] == {
            str(data): hashlib.sha256(b"B" * 4096).hexdigest()
        }


def test_a_hash_recorded_within_a_second_of_the_files_change_is_not_trusted(
    tmp_path: Path,
) -> None:
    """git's "racy" rule: a write right after hashing may leave the whole stat unchanged on a
    file system with coarse timestamps, so such an entry is treated as unknown."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"new bytes")
    st = FileStat.of(f)
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        # The same stat as now, with the old content's digest, recorded as the file changed.
        cat.put_hashes([HashRow(str(f), st, "0" * 64)], recorded_ns=st.mtime_ns)
        assert cat.cached_hashes([str(f)]) == {}
        assert hash_inputs(cat, [str(f)])[0][str(f)] == hashlib.sha256(b"new bytes").hexdigest()
        # Recorded well after the change, the same entry is trusted (the file is not read).
        cat.put_hashes([HashRow(str(f), st, "0" * 64)], recorded_ns=st.ctime_ns + 2 * 10**9)
        assert hash_inputs(cat, [str(f)])[0][str(f)] == "0" * 64


def test_a_retrained_checkpoint_copied_over_with_cp_p_is_fingerprinted_again(
    tmp_path: Path,
) -> None:
    v1 = save_torchscript(TinyConvEncoder(seed=0), tmp_path / "v1.pt")
    v2 = save_torchscript(TinyConvEncoder(seed=1), tmp_path / "v2.pt")
    assert v1.stat().st_size == v2.stat().st_size  # same architecture: same size
    for p in (v1, v2):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    enc = tmp_path / "enc.pt"
    _cp_p(v1, enc)
    _settle()
    with Catalog(Layout(tmp_path / "store").ensure()) as cat:
        fp1 = encoder_fingerprint(load_encoder(enc), cat, None)
        assert cached_file_encoder_fp(cat, enc) == fp1  # the no-load path trusts it
        _cp_p(v2, enc)
        assert cached_file_encoder_fp(cat, enc) is None  # ctime changed: cannot vouch
        fp2 = encoder_fingerprint(load_encoder(enc), cat, None)
    assert fp2 != fp1 and fp2 == load_encoder(v2).fingerprint


def test_build_and_dataset_after_cp_p_serve_the_new_version(
    tmp_path: Path, encoder_file: Path, store_dir: Path
) -> None:
    from featbake.testing import write_audio_folder

    data, versions = tmp_path / "data", tmp_path / "versions"
    write_audio_folder(data, 3, seconds=0.5, seed=1)
    write_audio_folder(versions, 1, seconds=0.5, seed=9)
    target = sorted(data.rglob("*.wav"))[0]
    (new,) = sorted(versions.rglob("*.wav"))
    assert new.stat().st_size == target.stat().st_size
    for p in (target, new):
        os.utime(p, (ARCHIVE_TIME, ARCHIVE_TIME))
    _settle()
    first = build(data, encoder_file, cache=store_dir, workers=0)
    assert first.encoded == 3
    _cp_p(new, target)
    second = build(data, encoder_file, cache=store_dir, workers=0)
    assert (second.encoded, second.reused) == (1, 2)  # not "reused 3"
    ds = CachedFeatureDataset(data, encoder_file, cache=store_dir, on_miss="error")
    i = [ds.path(j) for j in range(len(ds))].index(str(target))
    torch.testing.assert_close(ds[i], live_features(encoder_file, target))


def test_a_schema_2_catalog_is_migrated_and_its_hash_rows_are_hashed_again(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 10)
    os.utime(f, (ARCHIVE_TIME, ARCHIVE_TIME))
    with Catalog(layout) as cat:
        cat.record_encoder("e" * 64, "a.pt", "torchscript")
    conn = sqlite3.connect(layout.catalog)  # make it a version-2 catalog with a cached hash
    conn.execute("ALTER TABLE hash_cache DROP COLUMN ctime_ns")
    conn.execute("ALTER TABLE hash_cache DROP COLUMN recorded_ns")
    st = os.stat(f)
    conn.execute(
        "INSERT INTO hash_cache VALUES (?,?,?,?,?)",
        (str(f), st.st_size, st.st_mtime_ns, st.st_ino, "0" * 64),  # a stale digest
    )
    conn.execute("UPDATE meta SET value='2' WHERE name='schema_version'")
    conn.commit()
    conn.close()
    with Catalog(layout) as cat:
        assert [r.label for r in cat.encoder_rows()] == ["a.pt"]  # old rows kept
        row = cat.hash_rows([str(f)])[str(f)]
        assert (row.ctime_ns, row.recorded_ns) == (0, 0)
        assert hash_inputs(cat, [str(f)])[0][str(f)] == hashlib.sha256(b"x" * 10).hexdigest()
        version = cat.conn.execute("SELECT value FROM meta WHERE name='schema_version'")
        assert version.fetchone() == (str(SCHEMA_VERSION),)


# -- item 8: the catalog deleted, shards and roots/*.json intact --------------------------------
def _delete_catalog(store: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store / 'catalog.sqlite'}{suffix}").unlink(missing_ok=True)


def test_a_new_catalog_beside_root_manifests_is_refused(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    with Catalog(layout) as cat:
        cat.replace_root(ROOT, [("a.wav", "k")])
    _delete_catalog(layout.root)
    with pytest.raises(StoreError, match=r"no catalog\.sqlite.*featbake verify --repair"):
        _ = Catalog(layout).conn
    assert not layout.catalog.exists()
    with Catalog(layout, rebuild=True) as cat:  # what verify --repair does
        assert cat.roots() == []


@pytest.mark.slow
def test_build_refuses_to_start_over_when_the_catalog_is_lost(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    first = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert first.returncode == 0, first.stderr
    shards = sorted(p.name for p in store_dir.rglob("*.safetensors"))
    _delete_catalog(store_dir)
    again = invoke("build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir)
    assert again.returncode == 5, again.stdout + again.stderr
    assert "featbake verify --repair" in again.stderr and "Traceback" not in again.stderr
    assert not (store_dir / "catalog.sqlite").exists()  # nothing started over
    assert sorted(p.name for p in store_dir.rglob("*.safetensors")) == shards
    repaired = invoke("verify", "--cache", store_dir, "--repair")
    assert repaired.returncode == 10, repaired.stdout + repaired.stderr
    res = invoke(
        "build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir, "--json"
    )
    assert res.returncode == 0 and '"encoded": 0' in res.stdout, res.stdout + res.stderr


# -- item 17: a store that cannot be written ---------------------------------------------------
READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from featbake.export.zarr import export_zarr
    from featbake.serve.dataset import CachedFeatureDataset
    from featbake.upkeep import list_roots, stats, verify
    store, data, enc, out = sys.argv[1:5]
    s = stats(store)
    roots = list_roots(store)
    report = verify(store)
    exported = export_zarr(out, cache=store)
    ds = CachedFeatureDataset(data, enc, cache=store, on_miss="error")
    feats = [ds[i] for i in range(len(ds))]
    from torch.utils.data import DataLoader  # forked workers open their own read-only catalog
    for i, f in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
        assert torch.equal(f, feats[i])
    torch.save({ds.path(i): f for i, f in enumerate(feats)}, out + ".pt")
    print(json.dumps({"features": s.features, "roots": len(roots), "status": report.status,
                      "exit": report.exit_code, "stored": ds.stored(), "n": len(ds)}))
    """
)


def _check_read_only_run(proc: subprocess.CompletedProcess, out: Path, audio_dir: Path,
                         encoder_file: Path) -> None:  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert got["status"] == "clean" and got["exit"] == 0
    assert got["features"] == 16 and got["roots"] == 1 and got["stored"] == got["n"] == 16
    served = torch.load(str(out) + ".pt")
    for path, feat in served.items():
        torch.testing.assert_close(feat, live_features(encoder_file, Path(path)))
    assert (out / "zarr.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_store_on_a_read_only_mount_is_read(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """A real read-only bind mount (root ignores chmod, not a read-only mount): stats, roots,
    verify, export and the dataset with on_miss="error" work, and verify says clean."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    _settle()
    CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir)  # hashes no longer racy
    assert not Path(f"{store_dir / 'catalog.sqlite'}-wal").exists()  # closed cleanly
    before = {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()}
    ro, out = tmp_path / "ro", tmp_path / "out.zarr"
    ro.mkdir()
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY_SCRIPT)
    shell = (
        f"mount --bind {store_dir} {ro} && mount -o remount,bind,ro {ro} && "
        f"{sys.executable} {script} {ro} {audio_dir} {encoder_file} {out}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    _check_read_only_run(proc, out, audio_dir, encoder_file)
    assert {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()} == before
    cli = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {store_dir} {ro} && mount -o remount,bind,ro "
         f"{ro} && {sys.executable} -m featbake stats --cache {ro} && {sys.executable} -m featbake "
         f"verify --cache {ro} && {sys.executable} -m featbake roots --cache {ro}"],
        capture_output=True, text=True, env={**env, "COLUMNS": "200"}, timeout=300, check=False,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "damaged" not in cli.stdout + cli.stderr


@pytest.mark.slow
def test_a_store_opened_read_only_is_read_and_writes_say_so(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """The same reads with the catalog forced read-only (FEATBAKE_READ_ONLY=1, what a store
    without write permission gets for a non-root user), and a build says why it cannot run."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    out = tmp_path / "out.zarr"
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEATBAKE_READ_ONLY": "1"}
    proc = subprocess.run(
        [sys.executable, script, store_dir, audio_dir, encoder_file, out],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    _check_read_only_run(proc, out, audio_dir, encoder_file)
    res = invoke("build", "--data", audio_dir, "--encoder", encoder_file, "--cache", store_dir,
                  env={"FEATBAKE_READ_ONLY": "1"})  # fmt: skip
    assert res.returncode == 5 and "read-only" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr


def test_a_store_without_write_permission_is_read(
    tmp_path: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files and directories chmod'ed read-only. Root ignores permission bits, so what a
    non-root user's os.access() says is simulated (the mount test above is the real thing)."""
    layout = Layout(store_dir).ensure()
    with Catalog(layout) as cat:
        cat.replace_root(ROOT, [("a.wav", "k")])
    paths = [store_dir, *store_dir.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    real_access = os.access

    def access(path: object, mode: int, **kw: object) -> bool:
        return False if mode & os.W_OK else real_access(path, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    try:
        with Catalog(layout) as cat:
            assert cat.access is Access.IMMUTABLE  # no -wal/-shm left, the folder is read-only
            assert [r.name for r in cat.roots()] == ["r"]
            assert cat.root_items("r") == [("a.wav", "k")]
            cat.touch(["k"])  # a cache: skipped, not an error
            with pytest.raises(StoreError, match="read-only"):
                cat.drop_root("r")
    finally:
        for p in paths:
            p.chmod(0o755 if p.is_dir() else 0o644)
