"""Round seventeen: what a dataset serves for an input it cannot hash now (r17.4-r17.7).

A dataset keys each item by its input's bytes now; the key its root's build recorded stands in
only for an input gone since the build (a deleted file keeps serving its features, as designed).
Before, it stood in for any input that failed to hash: a row whose file is still there but no
longer holds its segment, a tar member cut short, a row changed to name another file that is
gone. And a miss decoded a folder's file, then hashed it again: a file swapped and put back in
between stored one version's features under the other's key. Real files, real stores built by
the real code, every served feature compared with the encoder run now.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from featbake.errors import SourceError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import make_tone
from tests.conftest import REPO, invoke, live_features
from tests.helpers import bake, printed

RATE = 16000


def _wav(seconds: float, seed: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, make_tone(seconds, RATE, seed=seed), RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _live(encoder: Path, data: bytes, tmp_path: Path, start: float = 0.0, end: float | None = None):
    """The encoder run now on ``data``'s samples from ``start`` to ``end`` seconds."""
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    cut = audio[round(start * rate) : None if end is None else round(end * rate)]
    spot = tmp_path / "live.wav"
    soundfile.write(spot, np.ascontiguousarray(cut), rate, subtype="FLOAT")
    return live_features(encoder, spot)


def _ids(ds: CachedFeatureDataset) -> list[str]:
    return [ds.item_id(i) for i in range(len(ds))]


def _leaving_out(data: Path, encoder: Path, store: Path, words: str) -> CachedFeatureDataset:
    """A dataset over ``data`` made under exactly one-line warnings, one matching ``words``
    (the rows it leaves out, and why)."""
    with pytest.warns(UserWarning, match=words) as caught:
        ds = CachedFeatureDataset(data, encoder, cache=store)
    assert all("\n" not in str(w.message) for w in caught)
    return ds


def _built_manifest(tmp_path: Path, x: bytes, y: bytes, encoder: Path, store: Path) -> Path:
    """``train.jsonl``: u1 -> x.wav, u2 -> y.wav (``x``, ``y`` written beside it), built."""
    (tmp_path / "x.wav").write_bytes(x)
    (tmp_path / "y.wav").write_bytes(y)
    manifest = tmp_path / "train.jsonl"
    rows = [{"id": "u1", "path": "x.wav"}, {"id": "u2", "path": "y.wav"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not bake(manifest, encoder, store).failed
    return manifest


# == r17.4: a row changed to name a file that is gone ==============================================
def test_a_row_changed_to_name_a_deleted_file_is_not_served_another_files_features(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Built with u1 -> x.wav and u2 -> y.wav; the manifest written again with the ids the
    other way round, and x.wav deleted. u2 was served the features the root recorded for
    u2, y.wav's, though its row names x.wav. The hash cache knew x.wav's digest: u2's
    recorded key is not x.wav's, so u2 is left out in one warning naming why; u1 (y.wav)
    is y.wav's features."""
    x, y = _wav(0.4, 1), _wav(0.4, 2)
    manifest = _built_manifest(tmp_path, x, y, encoder_file, store_dir)
    rows = [{"id": "u1", "path": "y.wav"}, {"id": "u2", "path": "x.wav"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "x.wav").unlink()
    ds = _leaving_out(manifest, encoder_file, store_dir, r"1 row\(s\).*of another file")
    assert _ids(ds) == ["u1"]
    torch.testing.assert_close(ds[0], _live(encoder_file, y, tmp_path))


def test_a_row_edited_to_name_a_file_never_hashed_is_not_served_as_built(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """Built with u1 -> x.wav; the row then edited to name z.wav (a take not copied yet), and
    a dataset made before the next build. The hash cache never knew z.wav, so r17.4's check
    passed, and u1 was served x.wav's features beside its edited row. A whole-file row the
    store never hashed, whose file is gone, is left out where the manifest changed since the
    root's build; u2 is served."""
    x, y = _wav(0.4, 1), _wav(0.4, 2)
    manifest = _built_manifest(tmp_path, x, y, encoder_file, store_dir)
    rows = [{"id": "u1", "path": "z.wav", "label": 7}, {"id": "u2", "path": "y.wav"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = max(p.stat().st_mtime for p in (store_dir / "roots").glob("*.json"))
    os.utime(manifest, (built + 10, built + 10))  # edited after the build, whatever the clock
    ds = _leaving_out(manifest, encoder_file, store_dir, r"1 row\(s\).*never hashed here")
    assert _ids(ds) == ["u2"]
    torch.testing.assert_close(ds[0], _live(encoder_file, y, tmp_path))


def test_a_row_whose_file_was_deleted_is_still_served_as_built(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The designed case stays: a manifest's rows unchanged, one file deleted since the
    build (its raw audio removed once baked): its row is served the features of the bytes it
    had, and the other row its file's features now."""
    x, y = _wav(0.4, 1), _wav(0.3, 2)
    manifest = _built_manifest(tmp_path, x, y, encoder_file, store_dir)
    (tmp_path / "x.wav").unlink()
    ds = CachedFeatureDataset(manifest, encoder_file, cache=store_dir, on_miss="error")
    assert _ids(ds) == ["u1", "u2"]
    torch.testing.assert_close(ds[0], _live(encoder_file, x, tmp_path))
    torch.testing.assert_close(ds[1], _live(encoder_file, y, tmp_path))


# == r17.5: a segment past the end of its rewritten file ===========================================
def test_a_segment_past_the_end_of_its_rewritten_file_is_left_out(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A CSV row u1 = a.wav [0.1, 0.4); a.wav rewritten since as a new 0.3 s take, so the
    segment is past its end. u1 was served its old take's features (bytes on no disk now).
    It is left out in one warning naming the row, as the build now skips it; u2 is served."""
    old, b = _wav(0.5, 1), _wav(0.3, 2)
    (tmp_path / "a.wav").write_bytes(old)
    (tmp_path / "b.wav").write_bytes(b)
    manifest = tmp_path / "segs.csv"
    manifest.write_text("id,path,start,end\nu1,a.wav,0.1,0.4\nu2,b.wav,,\n")
    assert not bake(manifest, encoder_file, store_dir).failed
    (tmp_path / "a.wav").write_bytes(_wav(0.3, 7))
    ds = _leaving_out(manifest, encoder_file, store_dir, r"1 row\(s\).*segs.csv:2")
    assert _ids(ds) == ["u2"]
    torch.testing.assert_close(ds[0], _live(encoder_file, b, tmp_path))


# == r17.6: a tar member cut short =================================================================
def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _built_then_cut_short(tmp_path: Path, encoder: Path, store: Path) -> tuple[Path, bytes]:
    """A shard of s1 and s2 built into ``store``, then replaced by a new version copied
    halfway (its new s2 cut short); the shard and s1's bytes."""
    s1, s2_old, s2_new = _wav(0.3, 1), _wav(0.3, 2), _wav(0.3, 9)
    shard = tmp_path / "shard-000.tar"
    shard.write_bytes(_tar([("s1.wav", s1), ("s2.wav", s2_old)]))
    assert not bake(shard, encoder, store).failed
    new = _tar([("s1.wav", s1), ("s2.wav", s2_new)])
    shard.write_bytes(new[: new.find(s2_new) + len(s2_new) // 2])
    return shard, s1


def test_a_tar_member_cut_short_is_not_served_its_old_features(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A webdataset shard replaced by a new version copied halfway, so its s2 member (new
    bytes) is cut short. s2 was served its old bytes' features, which no file holds now. It
    is left out in one warning; s1 (unchanged) is served its features."""
    shard, s1 = _built_then_cut_short(tmp_path, encoder_file, store_dir)
    ds = _leaving_out(shard, encoder_file, store_dir, r"1 row\(s\)")
    assert _ids(ds) == ["s1"]
    torch.testing.assert_close(ds[0], _live(encoder_file, s1, tmp_path))


def test_an_export_leaves_out_a_tar_member_cut_short_as_a_dataset_does(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """The export's check reads the data by the dataset's rule (``inputs.input_gone``): the
    member cut short is still listed, so it changed since its build and is left out
    (``changed`` 1); it was exported as built, counted ``unchecked``. s1 is exported with the
    encoder's features of its bytes, checked."""

    pq = pytest.importorskip("pyarrow.parquet")
    _, s1 = _built_then_cut_short(tmp_path, encoder_file, store_dir)
    out = tmp_path / "e.parquet"
    r = invoke("export", "--format", "parquet", out, "--cache", store_dir, "--json")
    assert r.returncode == 0, printed(r)
    report = json.loads(r.stdout)
    assert (report["items"], report["changed"], report["unchecked"]) == (1, 1, 0), printed(r)
    (row,) = pq.read_table(out).to_pylist()
    assert row["id"] == "s1", row["id"]
    got = torch.tensor(np.array(row["features"], dtype=np.float32)).reshape(row["features_shape"])
    torch.testing.assert_close(got, _live(encoder_file, s1, tmp_path))


# == r17.7: a folder's file swapped and put back while a miss decodes it ===========================
def test_a_file_swapped_back_while_a_miss_decodes_it_stores_nothing_under_its_key(
    encoder_file: Path, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder dataset made over a.wav = v1; a.wav rewritten as v2, and put back to v1 by
    another writer right after the miss first read it (the decoder, and the reader of a
    file's bytes, are wrapped to do so exactly then). The miss decoded v2 and its check
    hashed the file after: v1 again, so v2's features were stored under v1's key and served
    to every dataset over v1. Now the miss decodes the bytes it hashed: it is refused in one
    line, and a dataset made again over v1 (still v1) encodes and serves v1's features."""
    from featbake.encode import sources
    from featbake.errors import SourceError
    from featbake.store.byteplace import LocalFiles

    folder = tmp_path / "audio"
    folder.mkdir()
    v1, v2 = _wav(0.4, 1), _wav(0.4, 2)
    clip = folder / "a.wav"
    clip.write_bytes(v1)
    (folder / "b.wav").write_bytes(_wav(0.3, 3))
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(folder, encoder_file, cache=store_dir)
    clip.write_bytes(v2)
    decode, read = sources.AudioSource.load, LocalFiles.read

    def put_back(path: object) -> None:
        if str(path).endswith("a.wav"):
            clip.write_bytes(v1)

    def decode_then_put_back(self, path, data=None):  # type: ignore[no-untyped-def]
        x = decode(self, path, data)
        put_back(path)
        return x

    def read_then_put_back(self, path):  # type: ignore[no-untyped-def]
        got = read(self, path)
        put_back(path)
        return got

    with monkeypatch.context() as m:
        m.setattr(sources.AudioSource, "load", decode_then_put_back)
        m.setattr(LocalFiles, "read", read_then_put_back)
        with pytest.raises(SourceError, match="changed since this dataset was created") as e:
            ds[0]
    assert "\n" not in str(e.value)
    del ds
    assert clip.read_bytes() == v1
    again = CachedFeatureDataset(folder, encoder_file, cache=store_dir)
    torch.testing.assert_close(again[0], _live(encoder_file, v1, tmp_path))


# == r17.8: a list of paths holding a symlink re-pointed since =====================================
def test_a_listed_symlink_repointed_since_is_revalidated_where_it_points_now(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A list of paths naming a symlink to take 1, ``revalidate=True``; the link re-pointed at
    take 2 (how a "current" link is updated). The list's paths were resolved once, so the
    dataset kept checking take 1 and served its features; now each path is kept as named, as
    a folder's files are: take 2's features (a miss, encoded live)."""
    takes = tmp_path / "takes"
    takes.mkdir()
    t1, t2 = _wav(0.4, 1), _wav(0.4, 2)
    (takes / "t1.wav").write_bytes(t1)
    (takes / "t2.wav").write_bytes(t2)
    link = tmp_path / "current.wav"
    link.symlink_to(takes / "t1.wav")
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset([link], encoder_file, cache=store_dir, revalidate=True)
    assert ds.path(0) == str(link)
    torch.testing.assert_close(ds[0], _live(encoder_file, t1, tmp_path))
    link.unlink()
    link.symlink_to(takes / "t2.wav")
    torch.testing.assert_close(ds[0], _live(encoder_file, t2, tmp_path))


def test_a_folder_reached_through_a_link_repointed_since_is_refused_by_revalidate(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A folder given as ``data -> corpus-v1``, ``revalidate=True``; the link re-pointed at
    corpus-v2 (same names, other takes). The folder was resolved once, so each read stat'ed
    corpus-v1's file, saw no change, and served its features for data/c0.wav, which holds
    v2's bytes now. It is refused in one line saying to make the dataset again."""
    for version, seed in (("corpus-v1", 1), ("corpus-v2", 2)):
        (tmp_path / version).mkdir()
        (tmp_path / version / "c0.wav").write_bytes(_wav(0.4, seed))
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "corpus-v1")
    assert not bake(link, encoder_file, store_dir).failed
    ds = CachedFeatureDataset(link, encoder_file, cache=store_dir, revalidate=True)
    torch.testing.assert_close(ds[0], _live(encoder_file, _wav(0.4, 1), tmp_path))
    link.unlink()
    link.symlink_to(tmp_path / "corpus-v2")
    with pytest.raises(SourceError, match=r"leads to .*corpus-v2 now, not to .*corpus-v1"):
        ds[0]
    again = CachedFeatureDataset(link, encoder_file, cache=store_dir, revalidate=True)
    torch.testing.assert_close(again[0], _live(encoder_file, _wav(0.4, 2), tmp_path))


# == r17.12: a baked store on a disk with no room left =============================================
def _no_room() -> None:
    """In a child process: any write that would grow a file fails (EFBIG), as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


#: Item 0 of a dataset made with no room to grow a file (once imported: torch's import
#: writes a probe file to the temporary folder, which a full store's disk need not hold).
SERVE_FIRST = """
import json, resource, signal, sys
from featbake.serve.dataset import CachedFeatureDataset
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
ds = CachedFeatureDataset(sys.argv[1], sys.argv[2], cache=sys.argv[3], on_miss="error")
print(json.dumps(ds[0].tolist()))
"""


def test_a_store_on_a_disk_with_no_room_is_read_with_featbake_read_only(
    encoder_file: Path, store_dir: Path, tmp_path: Path
) -> None:
    """A baked store whose disk has no room left (a child process that may not grow any
    file). Every open failed, ``FEATBAKE_READ_ONLY=1`` too: a read-only open of a WAL
    catalog must make its ``-shm`` file. Now a read-only open falls back to an immutable one
    where no ``-wal`` frame is waiting: a dataset reads the store with the variable (its
    features the encoder's now), ``stats`` and ``roots`` with or without it (they only read);
    a writer (``gc``) says in one line to set it."""
    folder = tmp_path / "audio"
    folder.mkdir()
    (folder / "a.wav").write_bytes(_wav(0.4, 1))
    assert not bake(folder, encoder_file, store_dir).failed
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}

    def run(*args: str, room: bool = False, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], env={**env, **extra}, preexec_fn=None if room else _no_room,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    refused = run("-m", "featbake", "gc", "--cache", str(store_dir))
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 5 and len(lines) == 1, printed(refused)
    assert "FEATBAKE_READ_ONLY=1" in lines[0], lines[0]
    for extra in ({}, {"FEATBAKE_READ_ONLY": "1"}):  # readers read it either way
        for command in ("stats", "roots"):
            read = run("-m", "featbake", command, "--cache", str(store_dir), **extra)
            assert read.returncode == 0 and "roots (1)" in read.stdout, printed(read)
    args = ("-c", SERVE_FIRST, str(folder), str(encoder_file), str(store_dir))
    served = run(*args, room=True, FEATBAKE_READ_ONLY="1")  # no room once imported
    assert served.returncode == 0, printed(served)
    got = torch.tensor(json.loads(served.stdout.splitlines()[-1]))
    torch.testing.assert_close(got, _live(encoder_file, (folder / "a.wav").read_bytes(), tmp_path))
