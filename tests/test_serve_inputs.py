"""What a dataset is given and what it may do with the store: a list of paths gets the folder
scan's checks, a read-only store is served without a write, and ``revalidate=True`` follows
files rewritten after the dataset was made. Features are compared with running the encoder now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import soundfile
import torch

from featbake.bake.pipeline import build
from featbake.encode.sources import check_input_files, scan_inputs
from featbake.errors import CacheMiss, SourceError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import make_tone, write_audio_folder
from tests.conftest import REPO, live_features
from tests.helpers import can_mount_privately

LIST_OF_BAD_PATHS = textwrap.dedent(
    """
    import sys
    from featbake.errors import SourceError
    from featbake.serve.dataset import CachedFeatureDataset
    enc, store, *paths = sys.argv[1:]
    try:
        CachedFeatureDataset(paths, enc, cache=store)
    except SourceError as e:
        print("SourceError:", e)
    else:
        print("no error")
    """
)


def _construct_in_a_subprocess(tmp_path: Path, encoder: Path, paths: list[Path]) -> str:
    """Make a dataset of ``paths`` in a child process with a deadline (a FIFO would block the
    constructor forever: the deadline turns that into a failure, not a hung test run)."""
    script = tmp_path / "ds.py"
    script.write_text(LIST_OF_BAD_PATHS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, script, encoder, tmp_path / "store", *paths]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_list_with_a_fifo_or_a_symlink_loop_fails_at_once(tmp_path: Path, encoder_file) -> None:
    """Issue 16 item 8: ``CachedFeatureDataset([fifo, wav])`` blocked forever on the FIFO."""
    write_audio_folder(tmp_path / "a", 1, seconds=0.3)
    wav = tmp_path / "a" / "clip00000.wav"
    fifo, loop = tmp_path / "a" / "fifo.wav", tmp_path / "a" / "loop.wav"
    os.mkfifo(fifo)
    loop.symlink_to(loop.name)  # loop.wav -> loop.wav
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [fifo, wav, loop])
    assert out.startswith("SourceError: 2 of the 3 input files cannot be inputs"), out
    assert f"{fifo}: not a regular file (a FIFO)" in out
    assert f"{loop}: cannot stat: Too many levels of symbolic links" in out
    out = _construct_in_a_subprocess(tmp_path, encoder_file, [wav, Path("/dev/zero")])
    assert "/dev/zero: not a regular file (a character device)" in out, out


def test_a_list_and_the_folder_scan_refuse_the_same_files_alike(tmp_path: Path) -> None:
    """One check for both: each bad file gets the same reason from the scan and from a list."""
    data = tmp_path / "a"
    write_audio_folder(data, 1, seconds=0.3)
    os.mkfifo(data / "fifo.wav")
    (data / "loop.wav").symlink_to("loop.wav")
    (data / "gone.wav").symlink_to("nowhere.wav")
    (data / "dir.wav").mkdir()
    (data / "dir.wav" / "inside.txt").write_text("x")
    skipped = {s.path: s.reason for s in scan_inputs(data, [".wav"]).skipped}
    assert sorted(skipped) == ["fifo.wav", "gone.wav", "loop.wav"]  # a folder is walked
    for name in ["fifo.wav", "gone.wav", "loop.wav", "dir.wav"]:
        with pytest.raises(SourceError) as refused:
            check_input_files([data / "clip00000.wav", data / name])
        assert str(refused.value).startswith("1 of the 2 input files cannot be inputs")
        if name in skipped:
            assert f"{data / name}: {skipped[name]};" in str(refused.value)
    with pytest.raises(SourceError, match="a folder"):
        check_input_files([data / "dir.wav"])
    with pytest.raises(SourceError, match="list of input files is empty"):
        check_input_files([])
    assert check_input_files([data / "clip00000.wav"]) == [str(data / "clip00000.wav")]


# -- issue 16 item 5: a read-only store with a new file in the data folder ---------------------
SERVE_READ_ONLY = textwrap.dedent(
    """
    import json, sys, warnings, torch
    from featbake.errors import CacheMiss
    from featbake.serve.dataset import CachedFeatureDataset
    store, data, enc, out = sys.argv[1:5]
    strict = CachedFeatureDataset(data, enc, cache=store, on_miss="error")
    new = [i for i in range(len(strict)) if "/new/" in strict.path(i)]
    feats, refused = {}, 0
    for i in range(len(strict)):
        try:
            feats[strict.path(i)] = strict[i]
        except CacheMiss:
            refused += 1
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        live = CachedFeatureDataset(data, enc, cache=store)  # on_miss="encode"
    got = {live.path(i): live[i] for i in range(len(live))}
    got.update({live.path(i): b for i, b in zip(new, live.__getitems__(new), strict=True)})
    live.close()
    torch.save({"strict": feats, "live": got}, out)
    print(json.dumps({"n": len(strict), "stored": strict.stored(), "refused": refused,
                      "new": len(new), "read_only": strict.read_only and live.read_only,
                      "warned": [str(w.message) for w in said]}))
    """
)


def _store_files(store: Path) -> dict[str, bytes]:
    """Every file of the store and its bytes, but what a ``mode=ro`` SQLite reader makes (the
    shared-memory index, an empty WAL): no content of the store."""
    files = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    return {
        name: data
        for name, data in files.items()
        if not name.endswith("-shm") and not (name.endswith("-wal") and not data)
    }


def _serve_read_only(tmp_path: Path, store: Path, audio_dir: Path, encoder: Path, how: str):
    """Build, add a file to the folder, serve it from ``store`` made read-only ``how``."""
    build(audio_dir, encoder, cache=store, workers=0)
    write_audio_folder(audio_dir / "new", 1, seconds=0.5, seed=77)  # not in the store
    before = _store_files(store)
    script, out = tmp_path / "serve_ro.py", tmp_path / "served.pt"
    script.write_text(SERVE_READ_ONLY)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, str(script), str(store), str(audio_dir), str(encoder), str(out)]
    if how == "mount":
        ro = tmp_path / "ro"
        ro.mkdir()
        shell = f'mount --bind {store} {ro} && mount -o remount,bind,ro {ro} && exec "$@"'
        run = ["unshare", "-m", "sh", "-c", shell, "sh", *run]
        run[run.index(str(store))] = str(ro)
    else:
        env["FEATBAKE_READ_ONLY"] = "1"
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _store_files(store) == before  # nothing published, written back or recorded
    assert not (store / "fragments").exists() or not any((store / "fragments").iterdir())
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)


@pytest.mark.parametrize(
    "how",
    [
        "env",
        pytest.param(
            "mount",
            marks=pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m (root)"),
        ),
    ],
)
def test_a_read_only_store_serves_what_it_holds_when_the_folder_grew(
    tmp_path: Path, audio_dir: Path, encoder_file: Path, store_dir: Path, how: str
) -> None:
    """Issue 16 item 5: the constructor published the grown folder's root and failed. Now the
    stored items are served, the new file is a miss under ``on_miss``, and no byte of the store
    changes, with $FEATBAKE_READ_ONLY=1 and on a real read-only mount."""
    said, served = _serve_read_only(tmp_path, store_dir, audio_dir, encoder_file, how)
    assert said["read_only"] and said["n"] == 17 and said["new"] == 1
    assert said["stored"] == 16 and said["refused"] == 1  # on_miss="error": a CacheMiss
    assert len(said["warned"]) == 1 and "read-only here, and 1 item(s)" in said["warned"][0]
    assert len(served["strict"]) == 16 and len(served["live"]) == 17
    for path, feat in served["live"].items():
        want = live_features(encoder_file, Path(path))
        torch.testing.assert_close(feat, want)
        if path in served["strict"]:
            torch.testing.assert_close(served["strict"][path], want)


# -- issue 16 item 11: a file rewritten after the dataset was made ------------------------------
def _rewrite(path: Path, source: Path) -> None:
    """Rewrite ``path`` in place with ``source``'s bytes, keeping its size and mtime (``cp -p``
    of a clip of equal length: only ctime tells)."""
    st = path.stat()
    path.write_bytes(source.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("ram_cache", [0, "16MiB"])
def test_revalidate_serves_a_rewritten_file_as_it_is_now(
    audio_dir: Path, encoder_file: Path, store_dir: Path, ram_cache: object
) -> None:
    """By default an item keeps the feature of its file as it was when the dataset was made
    (documented); with ``revalidate=True`` one stat per read notices the rewrite and the item is
    served as the file is now: a hit when the store holds the new bytes, else encoded live (or
    a CacheMiss under on_miss="error"), on the single-item and the batch paths alike."""
    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    opts = {"cache": store_dir, "ram_cache": ram_cache}
    plain = CachedFeatureDataset(audio_dir, encoder_file, on_miss="error", **opts)
    fresh = CachedFeatureDataset(audio_dir, encoder_file, revalidate=True, **opts)
    strict = CachedFeatureDataset(audio_dir, encoder_file, revalidate=True, on_miss="error", **opts)
    fixed = [i for i in range(len(plain)) if "/fixed/" in plain.path(i)]  # four 1 s clips
    a, b, c = (Path(plain.path(i)) for i in fixed[:3])
    old = [live_features(encoder_file, p) for p in (a, b)]
    for ds in (plain, fresh, strict):
        ds.__getitems__(fixed)  # read (located, RAM tier) before the rewrite
        ds[fixed[0]], ds[fixed[1]]
    _rewrite(a, c)  # bytes the store holds (c's)
    soundfile.write(b, make_tone(1.0, seed=99), 16000)  # bytes nobody encoded
    now = [live_features(encoder_file, p) for p in (a, b)]
    assert not torch.equal(now[0], old[0]) and not torch.equal(now[1], old[1])
    for k, i in enumerate(fixed[:2]):  # the default: the folder as it was (documented)
        torch.testing.assert_close(plain[i], old[k])
    torch.testing.assert_close(fresh[fixed[0]], now[0])
    assert fresh.cache_info().encoded == 0  # a's new bytes are c's: a hit
    torch.testing.assert_close(fresh[fixed[1]], now[1])  # encoded live
    assert fresh.cache_info().encoded == 1
    for got, want in zip(fresh.__getitems__(fixed[:2]), now, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(strict.__getitems__(fixed[:1])[0], now[0])
    # b's new bytes were encoded (and written back) by `fresh` in this process: every reader
    # here reads them at once (issue 18 item 4). Bytes nobody encoded are a miss.
    torch.testing.assert_close(strict[fixed[1]], now[1])
    d = Path(plain.path(fixed[3]))
    strict[fixed[3]]  # read before the rewrite
    soundfile.write(d, make_tone(1.0, seed=98), 16000)
    with pytest.raises(CacheMiss, match=str(d)):
        strict[fixed[3]]
    assert fresh.key(fixed[0]) == fresh.key(fixed[2]) != plain.key(fixed[0])
