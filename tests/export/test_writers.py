"""The export's write paths: batches of items in order, the tar writer against tarfile byte for
byte, zarr's values written in blocks of chunks, Parquet's columns a chunk per item, and each
format's compression, every feature read back (without featbake) equal to the encoder run now."""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from featbake.errors import ConfigError
from featbake.export import parquet as parquet_export
from featbake.export import source
from featbake.export import webdataset as webdataset_export
from featbake.export import zarr as zarr_export
from featbake.export.parquet import export_parquet
from featbake.export.source import RESERVE_BYTES, OutputFile, open_source, stream
from featbake.export.webdataset import ShardWriter, export_webdataset, npy_chunks, tar_header
from featbake.export.zarr import export_zarr
from featbake.recipe import Recipe
from tests.helpers import Live, bake, manifest

pq = pytest.importorskip("pyarrow.parquet")


def npy_bytes(a: np.ndarray) -> bytes:
    """What :func:`npy_chunks` gives, as one ``bytes`` (``bytes()`` of a 0-d array is not its
    data: it takes the value as a length)."""
    return b"".join(memoryview(c).tobytes() for c in npy_chunks(a))


# -- batches ---------------------------------------------------------------------------------


def test_batches_come_complete_and_in_the_roots_order(
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    report = bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr(source, "READ_BATCH", 3)
    src = open_source(store_dir, None)
    batches = list(stream(src))
    assert [len(b) for b in batches] == [3, 3, 3, 3, 3, 1]
    assert [(i.path, i.key) for b in batches for i in b] == manifest(store_dir, report.root)


@pytest.mark.parametrize("fmt", ["zarr", "parquet", "webdataset"])
def test_a_corrupt_item_read_ahead_stops_the_export_and_leaves_nothing(
    fmt: str,
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reading thread's StoreCorrupt is raised by the export, after earlier runs (Parquet:
    row groups) were written; nothing is left, and the thread is gone once the export returns."""
    from featbake.errors import StoreCorrupt

    bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr(source, "READ_BATCH", 4)
    shard = max(store_dir.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # the shard's last item: read after others were written
    shard.write_bytes(bytes(data))
    export = {"zarr": export_zarr, "parquet": export_parquet, "webdataset": export_webdataset}
    with pytest.raises(StoreCorrupt, match="checksum mismatch"):
        export[fmt](tmp_path / "out", cache=store_dir)
    assert not list(tmp_path.glob("out*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("featbake-export-")]


def test_an_error_while_writing_stops_the_reading_thread(
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr(source, "READ_BATCH", 2)
    monkeypatch.setattr(webdataset_export, "GROUP_BYTES", 1)  # a run per item: more to read

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "add", full)
    with pytest.raises(OSError, match="No space left"):
        export_webdataset(tmp_path / "w", cache=store_dir)
    assert not (tmp_path / "w").exists() and not (tmp_path / "w.partial").exists()
    assert not [t for t in threading.enumerate() if t.name == "featbake-export-read"]


# -- the tar writer ---------------------------------------------------------------------------


def test_shards_are_the_bytes_tarfile_writes_and_npy_members_what_numpy_save_writes(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((7, 5)).astype(np.float16),
        np.asfortranarray(rng.standard_normal((4, 3))),  # written C-ordered, as numpy.save does
        np.array(3, dtype=np.int64),
        np.zeros((0, 4), dtype=np.float32),
        rng.random(9) > 0.5,
    ]
    for a in arrays:
        saved = io.BytesIO()
        np.save(saved, np.asarray(a, order="C"), allow_pickle=False)  # a 0-d array stays 0-d
        assert npy_bytes(a) == saved.getvalue()

    members = {f"s{i}/{'long' * 30 if i == 1 else 'x'}.npy": a for i, a in enumerate(arrays)}
    meta = {"s0.json": json.dumps({"id": "clip é.wav"}).encode()}
    writer = ShardWriter(tmp_path, 1 << 30)
    writer.add({n: npy_chunks(a) for n, a in members.items()})
    writer.add({n: [b] for n, b in meta.items()})
    writer.close()

    with tarfile.open(tmp_path / "tarfile.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [
            *((n, npy_bytes(a)) for n, a in members.items()),
            *meta.items(),
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    assert (tmp_path / "shard-000000.tar").read_bytes() == (tmp_path / "tarfile.tar").read_bytes()


@pytest.mark.parametrize("length", [1, 99, 100, 101, 250])
@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 8**11 - 1, 8**11])
def test_tar_headers_are_tarfiles_own_for_any_name_length_and_size(length: int, size: int) -> None:
    name = ("d/" + "n" * length)[-length:]
    for each in (name, name[:-1] + "é"):  # not ASCII: tarfile's pax record
        info = tarfile.TarInfo(each)
        info.size, info.mode, info.mtime = size, 0o644, 0
        assert tar_header(each, size) == info.tobuf(tarfile.PAX_FORMAT), (len(each), size)


def test_a_long_member_name_round_trips_through_tarfile_and_webdataset(tmp_path: Path) -> None:
    """A key past ustar's 100-character name field (a pax record), data of sizes that are not
    whole blocks: tarfile reads every name, size and byte back, webdataset one sample per key."""
    wds = pytest.importorskip("webdataset")
    rng = np.random.default_rng(1)
    keys = ["deep/" * 25 + "clip_wav", "short"]
    arrays = [rng.standard_normal((3, 7)).astype(np.float16), rng.standard_normal(5)]
    writer = ShardWriter(tmp_path, 1 << 30)
    for key, a in zip(keys, arrays, strict=True):
        writer.add({f"{key}.npy": npy_chunks(a), f"{key}.json": [b'{"id": 1}']})
    writer.close()
    shard = tmp_path / "shard-000000.tar"
    assert len(keys[0]) + 4 > 100 and shard.stat().st_size % tarfile.RECORDSIZE == 0
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{k}.{e}" for k in keys for e in ("npy", "json")]
        for m, a in zip(members[::2], arrays, strict=True):
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            assert m.size == len(data) == len(npy_bytes(a))
            np.testing.assert_array_equal(np.load(io.BytesIO(data)), a)
    samples = list(wds.WebDataset(str(shard), shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == keys
    for sample, a in zip(samples, arrays, strict=True):
        np.testing.assert_array_equal(sample["npy"], a)


def test_output_files_write_whole_through_short_writes_and_give_back_what_they_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: writev(fd, [bytes(bufs[0])[:7]]))
    want = [b"head", np.arange(300, dtype=np.float32), b"", np.zeros((0, 3)), b"tail"]
    with OutputFile(tmp_path / "f.bin") as out:
        out.write(want)
        out.write([b"more"])
    got = (tmp_path / "f.bin").read_bytes()
    assert got == b"".join(bytes(np.asarray(c).data) if not isinstance(c, bytes) else c
                           for c in want) + b"more"  # fmt: skip
    stat = (tmp_path / "f.bin").stat()
    assert stat.st_size == len(got) and stat.st_blocks * 512 < RESERVE_BYTES


def test_an_output_file_whose_write_writes_nothing_fails_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``writev`` that comes back with 0 bytes written for a non-empty buffer would be
    called again for ever. Before, an export's writer (its own copy of the write-on loop,
    without the claims' guard) did so; now the one ``write_all`` of ``featbake/store/files.py``
    fails with ENOSPC, which the export reports as a full disk."""
    calls: list[int] = []

    def writes_nothing(fd: int, bufs: list[memoryview]) -> int:
        calls.append(len(bufs))
        if len(calls) > 3:
            raise AssertionError("writev called again after it wrote nothing")
        return 0

    monkeypatch.setattr(os, "writev", writes_nothing)
    with OutputFile(tmp_path / "f.bin") as out, pytest.raises(OSError) as e:
        out.write([b"head", np.arange(4, dtype=np.float32)])
    assert e.value.errno == errno.ENOSPC and calls == [2]


def test_an_output_file_is_written_whole_where_no_blocks_can_be_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with less room than a reservation step (fallocate fails) still takes the
    bytes: the reservation is given up, the writes go on."""
    calls: list[int] = []

    def no_room(fd: int, mode: int, offset: int, nbytes: int) -> int:
        calls.append(nbytes)
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(source, "_FALLOCATE", no_room)
    with OutputFile(tmp_path / "f.bin") as out:
        for _ in range(3):
            out.write([b"x" * 1000])
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 3000 and calls == [RESERVE_BYTES]


# -- zarr blocks and compression --------------------------------------------------------------


def test_zarr_values_written_in_blocks_of_chunks_read_back_equal_to_live(
    multi_encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of 6 rows (768 bytes of [T, 32] float32), written 2 chunks a block: items
    straddle chunks and blocks."""
    live = Live()
    bake(audio_dir, multi_encoder_file, store_dir)
    monkeypatch.setattr(zarr_export, "CHUNK_BYTES", 768)
    monkeypatch.setattr(zarr_export, "CHUNKS_PER_WRITE", 4)  # 2 parts: 2 chunks each
    monkeypatch.setattr(source, "READ_BATCH", 5)
    export_zarr(tmp_path / "b.zarr", cache=store_dir)
    g = zarr.open_group(str(tmp_path / "b.zarr"), mode="r")
    hidden, offsets = g["hidden/values"], g["hidden/offsets"][:]
    assert hidden.chunks[0] == 6 and hidden.compressors == ()
    assert int(np.diff(offsets).max()) > 2 * 6  # an item longer than a block
    for i, rel in enumerate(g["paths"][:]):
        want = live(multi_encoder_file, audio_dir / str(rel))
        torch.testing.assert_close(torch.from_numpy(g["pooled/values"][i]), want["pooled"])
        got = torch.from_numpy(hidden[int(offsets[i]) : int(offsets[i + 1])])
        torch.testing.assert_close(got, want["hidden"])


def test_zarr_chunk_files_are_the_bytes_zarr_writes_itself(
    multi_encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The uncompressed values' chunk files, written by the export itself (items straddling
    chunks, the edge chunk zero-padded), hold the bytes zarr writes for the same values."""
    bake(audio_dir, multi_encoder_file, store_dir)
    monkeypatch.setattr(zarr_export, "CHUNK_BYTES", 700)  # hidden: 5 rows of 128 bytes
    export_zarr(tmp_path / "o.zarr", cache=store_dir)
    g = zarr.open_group(str(tmp_path / "o.zarr"), mode="r")
    assert g["hidden/values"].shape[0] % g["hidden/values"].chunks[0]  # an edge chunk
    for name in ("hidden/values", "pooled/values"):
        ours = g[name]
        ref = zarr.create_array(
            str(tmp_path / "ref" / name), shape=ours.shape, chunks=ours.chunks,
            dtype=ours.dtype, compressors=None, dimension_names=ours.metadata.dimension_names,
        )  # fmt: skip
        ref[:] = ours[:]
        files = {
            f.relative_to(tmp_path / "o.zarr" / name): f.read_bytes()
            for f in (tmp_path / "o.zarr" / name).rglob("c/**/*")
            if f.is_file()
        }
        assert len(files) == -(-ours.shape[0] // ours.chunks[0])
        assert files == {
            f.relative_to(tmp_path / "ref" / name): f.read_bytes()
            for f in (tmp_path / "ref" / name).rglob("c/**/*")
            if f.is_file()
        }


def test_parquet_row_groups_are_cut_by_bytes_and_read_back_equal_to_live(
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live = Live()
    bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr(parquet_export, "ROW_GROUP_BYTES", 4_000)  # a few items a group
    monkeypatch.setattr(source, "READ_BATCH", 7)
    export_parquet(tmp_path / "g.parquet", cache=store_dir)
    meta = pq.ParquetFile(tmp_path / "g.parquet").metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sum(sizes) == 16 and max(sizes) < 7 and len(sizes) > 3
    for rec in pq.read_table(tmp_path / "g.parquet").to_pylist():
        got = torch.tensor(np.array(rec["features"], dtype=np.float32))
        assert list(got.shape) == rec["features_shape"]
        torch.testing.assert_close(got, live(encoder_file, audio_dir / rec["id"]))


def test_a_bfloat16_root_exports_widened_exactly_in_every_format(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """float32 values whose low 16 bits are zero (bfloat16 widened, not rounded), equal to the
    encoder run now in bfloat16 (to its last bit: a batch of one may round one value apart)."""
    wds = pytest.importorskip("webdataset")
    live, recipe = Live(), Recipe(dtype="bfloat16")
    bake(audio_dir, encoder_file, store_dir, recipe=recipe)

    def check(got: np.ndarray, rel: str) -> None:
        assert got.dtype == np.float32 and not (got.view(np.uint32) & 0xFFFF).any()
        want = live(encoder_file, audio_dir / rel, recipe)
        torch.testing.assert_close(torch.from_numpy(got).to(torch.bfloat16), want)

    export_zarr(tmp_path / "b.zarr", cache=store_dir)
    g = zarr.open_group(str(tmp_path / "b.zarr"), mode="r")
    offsets = g["offsets"][:]
    for i, rel in enumerate(g["paths"][:]):
        check(g["values"][int(offsets[i]) : int(offsets[i + 1])], str(rel))

    export_parquet(tmp_path / "b.parquet", cache=store_dir)
    for rec in pq.read_table(tmp_path / "b.parquet").to_pylist():
        check(np.array(rec["features"], dtype=np.float32), rec["id"])

    export_webdataset(tmp_path / "b-wds", cache=store_dir)
    shard = str(tmp_path / "b-wds" / "shard-000000.tar")
    for sample in wds.WebDataset(shard, shardshuffle=False).decode():
        check(sample["npy"], sample["json"]["id"])


def test_compression_is_a_choice_each_format_reads_back(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    live = Live()
    bake(audio_dir, encoder_file, store_dir)

    export_zarr(tmp_path / "z.zarr", cache=store_dir, compression="zstd")
    g = zarr.open_group(str(tmp_path / "z.zarr"), mode="r")
    assert [type(c).__name__ for c in g["values"].compressors] == ["ZstdCodec"]
    offsets = g["offsets"][:]
    got = torch.from_numpy(g["values"][int(offsets[0]) : int(offsets[1])])
    torch.testing.assert_close(got, live(encoder_file, audio_dir / str(g["paths"][0])))

    for name, codec in (("snappy", "SNAPPY"), ("zstd", "ZSTD"), ("none", "UNCOMPRESSED")):
        out = tmp_path / f"{name}.parquet"
        kw = {} if name == "snappy" else {"compression": name}  # snappy: the default
        export_parquet(out, cache=store_dir, **kw)
        assert pq.ParquetFile(out).metadata.row_group(0).column(2).compression == codec
        rec = pq.read_table(out).slice(0, 1).to_pylist()[0]
        got = torch.tensor(np.array(rec["features"], dtype=np.float32))
        torch.testing.assert_close(got, live(encoder_file, audio_dir / rec["id"]))

    with pytest.raises(ConfigError, match="none or zstd, not snappy"):
        export_zarr(tmp_path / "s.zarr", cache=store_dir, compression="snappy")
    with pytest.raises(ConfigError, match="unknown compression 'lzma'; choose one of none"):
        export_parquet(tmp_path / "l.parquet", cache=store_dir, compression="lzma")


# -- empty items and per-item scalars --------------------------------------------------------


class FramesAndScalar(torch.nn.Module):
    """``frames`` ``[B, T // 1000, 16]`` (no frame under 1000 samples) and ``scalar`` ``[B]``."""

    def forward(self, wav: torch.Tensor) -> dict[str, torch.Tensor]:
        b, t = wav.shape
        n = t // 1000
        frames = wav[:, : n * 1000].reshape(b, n, 1000)[:, :, :16] * 1000.0
        return {"frames": frames, "scalar": wav.sum(dim=1)}


@pytest.mark.parametrize("seconds", [(0.03, 0.5, 1.3), (0.03, 0.04)], ids=["first", "all"])
def test_empty_items_and_per_item_scalars_export_in_every_format(
    seconds: tuple[float, ...], tmp_path: Path
) -> None:
    """An item of no frames first in a run ("first": its part ragged), or in every item ("all":
    the part dense, ``[0, 16]`` each), and a part of shape ``()`` each: every format exports
    them equal to the encoder run now, shapes and all. Before, an empty first item of a run
    raised IndexError in every format, webdataset wrote a scalar as ``(1,)``, and Parquet
    refused an axis of length 0 (Arrow has no fixed-size list of 0)."""
    import soundfile

    from featbake.testing import make_tone, save_torchscript

    audio = tmp_path / "audio"
    audio.mkdir()
    for i, s in enumerate(seconds):
        soundfile.write(audio / f"c{i}.wav", make_tone(s, seed=i), 16000)
    enc = save_torchscript(FramesAndScalar(), tmp_path / "enc.pt")
    store, live = tmp_path / "store", Live()
    bake(audio, enc, store)
    got: dict[str, dict[tuple[str, str], np.ndarray]] = {"zarr": {}, "parquet": {}, "wds": {}}

    export_zarr(tmp_path / "o.zarr", cache=store)
    g = zarr.open_group(str(tmp_path / "o.zarr"), mode="r")
    for i, rel in enumerate(g["paths"][:]):
        for part in ("frames", "scalar"):
            values = g[part]["values"]
            if "offsets" in g[part]:
                o = g[part]["offsets"][:]
                got["zarr"][str(rel), part] = np.asarray(values[int(o[i]) : int(o[i + 1])])
            else:
                got["zarr"][str(rel), part] = np.asarray(values[i])

    export_parquet(tmp_path / "o.parquet", cache=store)
    for rec in pq.read_table(tmp_path / "o.parquet").to_pylist():
        for part in ("frames", "scalar"):
            shape = rec[part + "_shape"]
            got["parquet"][rec["id"], part] = np.array(rec[part], np.float32).reshape(shape)

    export_webdataset(tmp_path / "o-wds", cache=store)
    with tarfile.open(tmp_path / "o-wds" / "shard-000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    ids = {n.split(".")[0]: json.loads(b)["id"] for n, b in members.items() if n.endswith(".json")}
    for name, data in members.items():
        if name.endswith(".npy"):
            key, part, _ = name.split(".")
            got["wds"][ids[key], part] = np.load(io.BytesIO(data))

    for fmt, export in (("zarr", export_zarr), ("parquet", export_parquet),
                        ("wds", export_webdataset)):  # fmt: skip
        report = export(tmp_path / f"frames-{fmt}", cache=store, output="frames")
        assert report.items == len(seconds), fmt  # the first run's first item has no bytes
    for fmt, arrays in got.items():
        assert len(arrays) == 2 * len(seconds), fmt
        for (rel, part), array in arrays.items():
            want = live(enc, audio / rel)[part]  # type: ignore[index]
            assert array.shape == tuple(want.shape), (fmt, rel, part)
            torch.testing.assert_close(torch.from_numpy(np.array(array)), want, msg=f"{fmt} {rel}")


def test_a_zarr_export_failing_at_its_second_part_closes_the_first_parts_files(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A full disk while the second part's values are created: the first part's chunk file,
    opened ahead on its thread, is closed, and nothing is left. Before, it stayed open (a
    descriptor to a deleted file) until the process ended."""
    bake(audio_dir, multi_encoder_file, store_dir)
    made = zarr_export._PartWriter.__init__
    calls: list[int] = []

    def full_at_the_second(self: object, *args: object, **kw: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        made(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(zarr_export._PartWriter, "__init__", full_at_the_second)
    out = tmp_path / "full.zarr"
    with pytest.raises(OSError, match="No space left"):
        export_zarr(out, cache=store_dir)
    fds = Path("/proc/self/fd")
    held = [os.readlink(fds / f) for f in os.listdir(fds) if (fds / f).exists()]
    assert calls == [1, 1] and not [f for f in held if str(out) in f]
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_a_zarr_export_is_v3_whatever_zarrs_default_format(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path
) -> None:
    """``ZARR_DEFAULT_ZARR_FORMAT=2`` (zarr's config) made the export fail with zarr's
    "Zarr format 2 arrays do not support dimension names" (an internal error at the CLI)."""
    live = Live()
    bake(audio_dir, encoder_file, store_dir)
    with zarr.config.set({"default_zarr_format": 2}):
        export_zarr(tmp_path / "v.zarr", cache=store_dir)
    g = zarr.open_group(str(tmp_path / "v.zarr"), mode="r")
    assert g.metadata.zarr_format == 3
    offsets = g["offsets"][:]
    for i, rel in enumerate(g["paths"][:]):
        got = torch.from_numpy(np.asarray(g["values"][int(offsets[i]) : int(offsets[i + 1])]))
        torch.testing.assert_close(got, live(encoder_file, audio_dir / str(rel)))
