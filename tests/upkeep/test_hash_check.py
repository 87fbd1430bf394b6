"""verify re-derives the hash cache instead of trusting it (issue 11, item 3).

A hash-cache row says "the file with this stat hashes to this digest"; a dataset trusts it to map
the file to its key without reading it. A row edited to give file A the digest of file B made the
dataset serve B's feature for A, and `verify --repair` kept the row. Each test edits real rows of
a real build, checks that the fault is real (the dataset serves the wrong feature), then that
verify reports it, repair re-derives it, and every served feature equals live encoding again.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import torch

from featbake.keys import feature_key
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, save_torchscript
from featbake.upkeep import FindingKind, verify
from featbake.upkeep.check import check_hash_cache
from tests.conftest import live_features, run_cli
from tests.helpers import bake, manifest

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

    found = run_cli("verify", "--cache", store_dir)
    assert found.returncode == 11, found.stdout + found.stderr
    assert "hash-cache" in found.stdout and a in found.stdout
    fixed = run_cli("verify", "--repair", "--cache", store_dir)
    assert fixed.returncode == 10, fixed.stdout + fixed.stderr
    assert "re-keyed 1 manifest items" in fixed.stdout, fixed.stdout
    again = run_cli("verify", "--cache", store_dir)
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

    fixed = run_cli("verify", "--repair", "--cache", store_dir)
    assert fixed.returncode == 10, fixed.stdout + fixed.stderr
    assert "re-keyed 2 manifest items" in fixed.stdout, fixed.stdout
    assert manifest(store_dir, report.root) == right
    assert run_cli("verify", "--cache", store_dir).returncode == 0
