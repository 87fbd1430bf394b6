"""The export's write paths: batches of items in order, the tar writer against tarfile byte for
byte, zarr's values written in blocks of chunks, Parquet's columns a chunk per item, and each
format's compression, every feature read back (without featbake) equal to the encoder run now."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from featbake.errors import ConfigError
from featbake.export import source
from featbake.export import zarr as zarr_export
from featbake.export.parquet import export_parquet
from featbake.export.source import open_source, stream
from featbake.export.webdataset import ShardWriter, npy_chunks
from featbake.export.zarr import export_zarr
from tests.helpers import Live, bake, manifest

pq = pytest.importorskip("pyarrow.parquet")


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


def test_a_corrupt_item_in_a_later_row_group_stops_the_parquet_export(
    encoder_file: Path,
    audio_dir: Path,
    store_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from featbake.errors import StoreCorrupt

    bake(audio_dir, encoder_file, store_dir)
    monkeypatch.setattr(source, "READ_BATCH", 4)
    shard = max(store_dir.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # the last item's bytes: its batch is read after others were written
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreCorrupt):
        export_parquet(tmp_path / "bad.parquet", cache=store_dir)
    assert not (tmp_path / "bad.parquet").exists()


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
        np.save(saved, np.ascontiguousarray(a), allow_pickle=False)
        assert b"".join(bytes(c) for c in npy_chunks(a)) == saved.getvalue()

    members = {f"s{i}/{'long' * 30 if i == 1 else 'x'}.npy": a for i, a in enumerate(arrays)}
    meta = {"s0.json": json.dumps({"id": "clip é.wav"}).encode()}
    writer = ShardWriter(tmp_path, 1 << 30)
    writer.add({n: npy_chunks(a) for n, a in members.items()})
    writer.add({n: [b] for n, b in meta.items()})
    writer.close()

    with tarfile.open(tmp_path / "tarfile.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [
            *((n, b"".join(bytes(c) for c in npy_chunks(a))) for n, a in members.items()),
            *meta.items(),
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    assert (tmp_path / "shard-000000.tar").read_bytes() == (tmp_path / "tarfile.tar").read_bytes()


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
