"""Containers as inputs (issue 29 item 3): webdataset tar shards, a Hugging Face dataset saved to
disk, and parquet files with embedded audio bytes, all made in the test.

Every served or stored item is checked against the encoder run now on that item's bytes decoded
without featbake's code (Pillow or soundfile, then the encoder module directly).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image, ImageOps

from featbake.bake.pipeline import build
from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.encode.tables import Table, is_table
from featbake.encode.webdataset import MemberSource, WebDataset, is_webdataset, key_and_extension
from featbake.errors import SourceError
from featbake.image_recipe import ImageRecipe, Resize, ResizeKind
from featbake.keys import sha256_hex
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.byteplace import LocalFiles, expand_braces, refuse_tars_beside_files
from featbake.store.catalog import Catalog
from featbake.store.containers import (
    HEADER_BLOCK,
    Member,
    ReadBack,
    TableFile,
    refuse_several_splits,
)
from featbake.store.layout import Layout
from featbake.testing import make_tone, write_audio_folder, write_image_folder
from tests.conftest import invoke, run_cli
from tests.helpers import real_photos, stored_features

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: Decoded pixels as they are (no resize, crop or normalisation): the reference needs no featbake.
PLAIN = ImageRecipe(resize=Resize(ResizeKind.NONE, 0, 0), crop=None, rescale=None).replace(
    mean=None, std=None
)
IMAGE_RECIPE = Recipe(source="image", image=PLAIN)


# == data made in the test =========================================================================
def photographs(tmp_path: Path, n: int = 4) -> list[bytes]:
    """JPEG bytes: the machine's real photographs (where there are any) and seeded photo-like
    images of varied sizes."""
    made = write_image_folder(tmp_path / "made", n, size=(40, 56), seed=5)
    return [Path(p).read_bytes() for p in real_photos()] + [p.read_bytes() for p in made]


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A webdataset shard: each sample's members in order, named ``key.ext``."""
    with tarfile.open(path, "w") as tf:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
    return path


def image_samples(images: list[bytes], start: int = 0) -> list[tuple[str, dict[str, bytes]]]:
    return [
        (
            f"sample{start + i:04d}",
            {
                "jpg": data,
                "txt": f"a photo number {start + i}".encode(),
                "cls": str((start + i) % 3).encode(),
                "json": json.dumps({"n": start + i}).encode(),
            },
        )
        for i, data in enumerate(images)
    ]


def wav_bytes(seconds: float, seed: int, fmt: str = "WAV") -> bytes:
    out = io.BytesIO()
    soundfile.write(out, make_tone(seconds, 16000, seed=seed), 16000, format=fmt)
    return out.getvalue()


def hf_metadata(features: dict[str, Any]) -> dict[bytes, bytes]:
    """The schema metadata ``datasets`` writes: its features under ``huggingface``."""
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def write_audio_parquet(path: Path, clips: list[bytes | None], **extra: list[Any]) -> Path:
    """A parquet file as the Hub stores audio: an ``audio`` struct {bytes, path} column."""
    cells = [
        None if c is None else {"bytes": c, "path": f"clip{i}.wav"} for i, c in enumerate(clips)
    ]
    columns = {"audio": pa.array(cells, type=MEDIA), **{k: pa.array(v) for k, v in extra.items()}}
    features = {"audio": {"_type": "Audio", "sampling_rate": 16000}}
    table = pa.table(columns).replace_schema_metadata(hf_metadata(features))
    pq.write_table(table, path, row_group_size=2)  # several row groups
    return path


def save_to_disk(folder: Path, images: list[bytes], labels: list[int], shards: int = 2) -> Path:
    """A folder laid out as ``Dataset.save_to_disk`` writes it: Arrow IPC stream shards
    ``data-0000N-of-0000M.arrow``, ``state.json`` naming them, ``dataset_info.json``."""
    folder.mkdir(parents=True)
    features = {"image": {"_type": "Image"}, "label": {"_type": "Value", "dtype": "int64"}}
    cells = [{"bytes": b, "path": None} for b in images]
    table = pa.table({"image": pa.array(cells, type=MEDIA), "label": pa.array(labels)})
    table = table.replace_schema_metadata(hf_metadata(features))
    per = -(-len(images) // shards)
    names = []
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.ipc.new_stream(folder / name, table.schema) as writer:
            writer.write_table(table.slice(s * per, per))
        names.append(name)
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0" * 16,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}, indent=2))
    return folder


# == references: featbake's code not used =========================================================
def image_tensor(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    return torch.from_numpy(np.array(image, dtype=np.float32)).permute(2, 0, 1).contiguous()


def audio_tensor(data: bytes) -> torch.Tensor:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert rate == 16000
    return torch.from_numpy(np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32))


def image_encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 8, 8)
    return torch.nn.Sequential(conv, torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten()).eval()


def run_now(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(x.unsqueeze(0))[0]


def catalog(tmp_path: Path) -> Catalog:
    return Catalog(Layout(tmp_path / "store").ensure())


# == webdataset: reading ===========================================================================
def test_keys_split_as_webdataset_splits_them() -> None:
    assert key_and_extension("a/b/0001.seg.PNG") == ("a/b/0001", "seg.png")
    assert key_and_extension("0001.jpg") == ("0001", "jpg")
    assert key_and_extension("README") is None  # no extension: no sample's
    assert key_and_extension("__index__") is None  # webdataset's metadata members
    assert expand_braces("shard-{000..002}.tar") == [
        "shard-000.tar",
        "shard-001.tar",
        "shard-002.tar",
    ]
    assert expand_braces("x-{a,b}-{8..10}.tar") == [
        "x-a-8.tar", "x-a-9.tar", "x-a-10.tar", "x-b-8.tar", "x-b-9.tar", "x-b-10.tar",
    ]  # fmt: skip


def test_which_folders_are_containers(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.tar").write_bytes(b"")
    (tmp_path / "shards" / ".hidden").write_bytes(b"")
    (tmp_path / "table").mkdir()
    for name in ("train-00000.parquet", "README.md", "dataset_infos.json"):
        (tmp_path / "table" / name).write_bytes(b"")
    (tmp_path / "audio").mkdir()
    for name in ("a.tar", "b.wav", "c.parquet"):
        (tmp_path / "audio" / name).write_bytes(b"")
    assert is_webdataset(str(tmp_path / "shards")) and not is_table(str(tmp_path / "shards"))
    assert is_table(str(tmp_path / "table")) and not is_webdataset(str(tmp_path / "table"))
    audio = str(tmp_path / "audio")  # a folder with other files is a folder of files
    assert not is_webdataset(audio) and not is_table(audio)
    assert not is_webdataset(str(tmp_path / "missing")) and is_webdataset("s3://b/x.tar")


def test_a_shard_is_read_in_tar_order_with_its_members_carried(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    tar = write_tar(tmp_path / "shard-000.tar", image_samples(images))
    inputs = WebDataset(str(tar))
    scanned = inputs.scan(source_for(IMAGE_RECIPE).extensions)
    assert scanned.inputs == [f"sample{i:04d}" for i in range(len(images))] and not scanned.skipped
    assert inputs.path("sample0001") == f"{tar}:sample0001.jpg"
    assert inputs.row("sample0002") == {"txt": "a photo number 2", "cls": 2, "json": {"n": 2}}
    cat = catalog(tmp_path)
    paths = [inputs.path(r) for r in scanned.inputs]
    digests, failed = inputs.hash(cat, paths)
    assert not failed
    assert [digests[p] for p in paths] == [sha256_hex(b) for b in images]  # = as files
    source = inputs.source(source_for(IMAGE_RECIPE))
    for p, data in zip(paths, images, strict=True):
        assert torch.equal(source.load(p), image_tensor(data)), p
    # A process that did not scan (a DataLoader worker, a dataset made later) finds the member.
    assert torch.equal(
        MemberSource(source_for(IMAGE_RECIPE)).load(paths[0]), image_tensor(images[0])
    )


def test_an_unchanged_shard_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import time

    tar = write_tar(tmp_path / "s.tar", image_samples(photographs(tmp_path)))
    time.sleep(1.1)  # a file changed within the second its hash is cached is hashed again (racy)
    inputs = WebDataset(str(tar))
    paths = [inputs.path(r) for r in inputs.scan([".jpg"]).inputs]
    cat = catalog(tmp_path)
    first, _ = inputs.hash(cat, paths)
    read: list[str] = []
    monkeypatch.setattr(
        LocalFiles,
        "member_digests",
        lambda self, t, m, held: ReadBack(read.append(t) or {}, None),
    )
    again, failed = WebDataset(str(tar)).hash(cat, paths)
    assert (again, failed, read) == (first, {}, [])
    os.utime(tar, None)  # touched: its stat changed, so it is read again
    _, failed = WebDataset(str(tar)).hash(cat, paths)
    assert read == [str(tar)] and failed  # (the stub read nothing)


def test_a_shard_renamed_over_after_its_listing_fails_its_members_and_caches_no_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local shard replaced (a new version moved over it) between the scan that listed its
    members and the hashing: the members fail as changed. Before, the bytes at the old
    offsets in the new tar (neither the old member nor the new) were hashed and recorded as
    each member's digest under the new tar's stat, trusted by a rebuild. A fresh scan hashes
    the new members."""
    folder = tmp_path / "shards"
    folder.mkdir()
    old = [wav_bytes(0.5, i) for i in range(3)]
    new = [wav_bytes(0.3 + 0.2 * i, 10 + i) for i in range(3)]
    write_tar(folder / "s.tar", [(f"k{i}", {"wav": old[i]}) for i in range(3)])
    shards = WebDataset(str(folder))
    paths = [shards.path(r) for r in shards.scan([".wav"]).inputs]
    write_tar(tmp_path / "next.tar", [(f"k{i}", {"wav": new[i]}) for i in range(3)])
    os.replace(tmp_path / "next.tar", folder / "s.tar")
    cat = catalog(tmp_path)
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    digests, failed = shards.hash(cat, paths)
    assert not digests and set(failed) == set(paths)
    assert all("replaced since its members were listed" in why for why in failed.values())
    assert not cat.cached_hashes(paths)
    again = WebDataset(str(folder))
    again.scan([".wav"])
    digests, failed = again.hash(cat, paths)
    assert not failed and [digests[p] for p in paths] == [sha256_hex(c) for c in new]


def test_a_truncated_member_is_a_bad_row_naming_tar_and_member(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    tar = write_tar(tmp_path / "s.tar", image_samples(images))
    whole = tar.read_bytes()
    cut = whole.find(images[-1]) + len(images[-1]) // 2  # inside the last sample's jpg
    tar.write_bytes(whole[:cut])
    inputs = WebDataset(str(tar))
    scanned = inputs.scan([".jpg"])
    paths = [inputs.path(r) for r in scanned.inputs]
    digests, failed = inputs.hash(catalog(tmp_path), paths)
    last = paths[-1]
    assert list(failed) == [last] and f"{tar}:sample{len(images) - 1:04d}.jpg" in failed[last]
    assert "truncated tar member" in failed[last]
    assert [digests[p] for p in paths[:-1]] == [sha256_hex(b) for b in images[:-1]]


@pytest.mark.parametrize("damage", ["checksum", "cut in a header"])
def test_a_damaged_header_fails_its_shard_in_one_line_and_loses_no_other(
    tmp_path: Path, encoder_file: Path, damage: str
) -> None:
    """tarfile ends an archive in silence at a header whose checksum fails or that the file
    ends inside (past its first member): every sample after it was lost with no line and the
    build said nothing failed. Now the shard is unreadable in one line naming the byte; the
    other shard's samples build and serve equal to the encoder run now."""
    clips = [wav_bytes(0.3 + 0.05 * i, i) for i in range(6)]
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tar(folder / "a.tar", [(f"a{i}", {"wav": c}) for i, c in enumerate(clips[:3])])
    bad = write_tar(folder / "b.tar", [(f"b{i}", {"wav": c}) for i, c in enumerate(clips[3:])])
    whole = bad.read_bytes()
    third = whole.find(clips[4]) + len(clips[4])  # the third member's header starts past it
    third += -third % 512
    if damage == "checksum":
        bad.write_bytes(whole[: third + 1] + bytes([whole[third + 1] ^ 1]) + whole[third + 2 :])
    else:
        bad.write_bytes(whole[: third + 300])
    with torchscript_quietly():
        encoder = torch.jit.load(str(encoder_file))
    report = build(folder, encoder_file, cache=tmp_path / "store", workers=0)
    assert report.encoded == 3, report
    ((where, why),) = report.failed
    assert where == "b.tar" and f"at byte {third:,}" in why and "\n" not in why, why
    assert "rewrite or re-download the shard" in why
    ds = CachedFeatureDataset(folder, encoder=encoder_file, cache=tmp_path / "store",
                              on_miss="error")  # fmt: skip
    assert len(ds) == 3
    for i in range(3):
        torch.testing.assert_close(ds[i], run_now(encoder, audio_tensor(clips[i])))


def test_a_shard_whose_end_marker_is_cut_short_reads_every_member(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A download cut inside the two blocks of zeros that end a tar: every member is whole,
    and the zeros left are the end, not a header cut short (which failed the shard)."""
    clips = [wav_bytes(0.3 + 0.05 * i, 30 + i) for i in range(3)]
    tar = write_tar(tmp_path / "s.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)])
    whole = tar.read_bytes()
    end = whole.find(clips[-1]) + len(clips[-1])
    end += -end % 512  # the last member's data padded to its block: the marker starts here
    tar.write_bytes(whole[: end + 300])
    report = build(tar, encoder_file, cache=tmp_path / "store", workers=0)
    assert not report.failed and report.encoded == 3


def test_a_member_whose_name_is_not_utf8_is_one_line_and_the_others_build(
    tmp_path: Path,
    encoder_file: Path,
) -> None:
    """A shard written where names are Latin-1 (``caf\\xe9.wav``): the build stopped with an
    internal UnicodeEncodeError (the name reached SQLite), nothing stored. Now that member
    fails in one line naming it printably, the others build."""
    clips = [wav_bytes(0.4 + 0.05 * i, 10 + i) for i in range(3)]
    tar = tmp_path / "latin.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        for name, data in zip(("s0.wav", "caf\xe9.wav", "s2.wav"), clips, strict=True):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with torchscript_quietly():
        encoder = torch.jit.load(str(encoder_file))
    got = invoke("build", "--encoder", encoder_file, "--data", tar,
                 "--cache", tmp_path / "store")  # fmt: skip
    assert got.returncode == 3, got.stderr
    assert "internal error" not in got.stderr and "Traceback" not in got.stderr
    assert f"{tar}:caf\\xe9.wav: the member's name is not valid UTF-8" in got.stdout + got.stderr
    with pytest.warns(UserWarning, match="not valid UTF-8"):
        ds = CachedFeatureDataset(tar, encoder=encoder_file, cache=tmp_path / "store",
                                  on_miss="error")  # fmt: skip
    assert [ds.item_id(i) for i in range(len(ds))] == ["s0", "s2"]
    for i, clip in ((0, clips[0]), (1, clips[2])):
        torch.testing.assert_close(ds[i], run_now(encoder, audio_tensor(clip)))


def test_containers_named_in_upper_case_are_read_as_in_lower_case(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``SHARD.TAR``, ``Part-0.Tar`` and ``DATA.PARQUET`` were taken as a shard and a table,
    then every item failed ("not the name of an item in a tar or a table"): an item's name
    was cut at its container's ending in lower case only."""
    clips = [wav_bytes(0.4 + 0.1 * i, 20 + i) for i in range(3)]
    write_tar(tmp_path / "SHARD.TAR", [(f"s{i}", {"wav": c}) for i, c in enumerate(clips)])
    (tmp_path / "shards").mkdir()
    write_tar(
        tmp_path / "shards" / "Part-0.Tar", [(f"s{i}", {"wav": c}) for i, c in enumerate(clips)]
    )
    write_audio_parquet(tmp_path / "DATA.PARQUET", list(clips))
    with torchscript_quietly():
        encoder = torch.jit.load(str(encoder_file))
    for data in (tmp_path / "SHARD.TAR", tmp_path / "shards", tmp_path / "DATA.PARQUET"):
        report = build(data, encoder_file, cache=tmp_path / "store", workers=0)
        assert not report.failed, report.failed
        ds = CachedFeatureDataset(data, encoder=encoder_file, cache=tmp_path / "store",
                                  on_miss="error")  # fmt: skip
        assert len(ds) == 3
        for i, clip in enumerate(clips):
            torch.testing.assert_close(ds[i], run_now(encoder, audio_tensor(clip)))


def test_column_picks_the_member_and_samples_without_it_are_set_aside(tmp_path: Path) -> None:
    clips = [wav_bytes(0.5, i) for i in range(3)]
    samples = [(f"u{i}", {"flac": clips[i], "txt": b"hi"}) for i in range(2)]
    samples.append(("u2", {"txt": b"no audio"}))
    tar = write_tar(tmp_path / "a.tar", samples)
    inputs = WebDataset(str(tar), column="flac")
    scanned = inputs.scan([".wav", ".flac"])
    assert scanned.inputs == ["u0", "u1"]
    assert [(s.path, "no member .flac" in s.reason) for s in scanned.skipped] == [("u2", True)]
    with pytest.raises(SourceError, match="--column"):
        WebDataset(str(tar), column="mp4").scan([".wav"])


def test_shards_by_folder_and_brace_pattern_and_duplicate_keys(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tar(folder / "shard-000.tar", image_samples(images[:2]))
    write_tar(folder / "shard-001.tar", image_samples(images[2:], start=2))
    assert is_webdataset(str(folder)) and is_webdataset(str(folder / "shard-{000..001}.tar"))
    want = [f"sample{i:04d}" for i in range(len(images))]
    assert WebDataset(str(folder)).scan([".jpg"]).inputs == want
    braces = WebDataset(str(folder / "shard-{000..002}.tar"))
    scanned = braces.scan([".jpg"])
    assert scanned.inputs == want
    assert [(s.path, s.reason.endswith("file not found")) for s in scanned.skipped] == [
        ("shard-002.tar", True)
    ]
    write_tar(folder / "shard-002.tar", image_samples(images[:1]))
    with pytest.raises(SourceError, match="two samples have the key 'sample0000'"):
        WebDataset(str(folder)).scan([".jpg"])
    in_bucket = WebDataset("s3://bucket/shards/shard-{000..001}.tar")  # read by ranged GETs
    assert in_bucket.tars == [f"s3://bucket/shards/shard-00{i}.tar" for i in range(2)]


# == tables: reading ===============================================================================
def test_a_parquet_file_of_audio_structs(tmp_path: Path) -> None:
    clips = [wav_bytes(0.4 + 0.1 * i, i, "FLAC" if i % 2 else "WAV") for i in range(5)]
    path = write_audio_parquet(
        tmp_path / "train.parquet", clips, speaker=["a", "b", "a", "c", "b"], n=[1, 2, 3, 4, 5]
    )
    assert is_table(str(path))
    inputs = Table(str(path))
    scanned = inputs.scan(source_for(Recipe()).extensions)
    assert inputs.column == "audio"  # the Audio column, found without --column
    assert scanned.inputs == [f"train.parquet:{i}" for i in range(5)] and not scanned.skipped
    assert inputs.path("train.parquet:3") == f"{path}:3"
    assert inputs.row("train.parquet:3") == {"speaker": "c", "n": 4}
    paths = [inputs.path(r) for r in scanned.inputs]
    digests, failed = inputs.hash(catalog(tmp_path), paths)
    assert not failed and [digests[p] for p in paths] == [sha256_hex(c) for c in clips]
    source = inputs.source(source_for(Recipe()))
    for p, clip in zip(paths, clips, strict=True):
        assert torch.equal(source.load(p), audio_tensor(clip)), p


def test_a_table_file_replaced_after_its_scan_fails_its_cells_and_caches_no_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parquet file renamed over (a new version written beside it, then moved in place)
    between the scan and the hashing: the reader opened at the scan still reads the old file
    through its footer, so its cells fail as changed; before, the old cells' digests were
    recorded under the new file's stat, and a rebuild trusted them (the old features served
    for the new cells). A fresh scan hashes the new cells."""
    old = [wav_bytes(0.4 + 0.1 * i, i, "WAV") for i in range(3)]
    new = [wav_bytes(0.4 + 0.1 * i, i + 7, "WAV") for i in range(3)]
    path = write_audio_parquet(tmp_path / "train.parquet", old)
    inputs = Table(str(path))
    paths = [inputs.path(r) for r in inputs.scan(source_for(Recipe()).extensions).inputs]
    write_audio_parquet(tmp_path / "next.parquet", new)
    os.replace(tmp_path / "next.parquet", path)
    cat = catalog(tmp_path)
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    digests, failed = inputs.hash(cat, paths)
    assert not digests and set(failed) == set(paths)
    assert all("replaced since its rows were read" in why for why in failed.values())
    assert not cat.cached_hashes([f"{p}:audio" for p in paths])
    again = Table(str(path))
    again.scan(source_for(Recipe()).extensions)
    digests, failed = again.hash(cat, paths)
    assert not failed and [digests[p] for p in paths] == [sha256_hex(c) for c in new]


def test_a_table_file_whose_id_pages_are_corrupt_is_one_line_naming_it(tmp_path: Path) -> None:
    """A parquet file whose footer reads well but whose ``id`` column's pages are corrupt:
    the scan stops with one line naming the file; before, pyarrow's two-line OSError from
    the column read escaped the scan (an internal error at the CLI)."""
    path = write_audio_parquet(
        tmp_path / "t.parquet",
        [wav_bytes(0.3, i) for i in range(4)],
        id=[f"id{i:06d}" for i in range(4)],
    )
    raw = bytearray(path.read_bytes())
    at = raw.find(b"id000002")
    raw[at - 40 : at + 40] = bytes(b ^ 0xFF for b in raw[at - 40 : at + 40])
    path.write_bytes(bytes(raw))
    with pytest.raises(SourceError) as got:
        Table(str(path)).scan(source_for(Recipe()).extensions)
    assert str(got.value).startswith(f"{path}: not a readable parquet or arrow file (")
    assert "\n" not in str(got.value) and str(got.value).endswith("replace or remove it")


def test_bad_cells_and_columns_are_bad_rows_with_their_row(tmp_path: Path) -> None:
    clips: list[bytes | None] = [wav_bytes(0.3, 0), None, wav_bytes(0.3, 2)]
    folder = tmp_path / "table"
    folder.mkdir()
    write_audio_parquet(folder / "a.parquet", clips, id=["x", "y", "z"])
    strings = tmp_path / "b.parquet"
    pq.write_table(pa.table({"audio": ["not", "bytes"], "id": ["p", "q"]}), strings)
    with pytest.raises(SourceError, match=r"column 'audio' of .* holds neither bytes nor"):
        Table(str(strings), column="audio").scan([".wav"])
    # Beside a file of Audio structs, the strings make no one table: refused in one line (in10.3).
    (folder / "b.parquet").write_bytes(strings.read_bytes())
    with pytest.raises(SourceError, match=r"\(a.parquet, b.parquet: column 'audio' holds struct"):
        Table(str(folder), column="audio").scan([".wav"])
    (folder / "b.parquet").unlink()
    inputs = Table(str(folder), column="audio")
    scanned = inputs.scan([".wav"])
    assert scanned.inputs == ["x", "y", "z"]  # ids from the id column
    paths = [inputs.path(r) for r in scanned.inputs]
    _, failed = inputs.hash(catalog(tmp_path), paths)
    assert failed == {paths[1]: f"{folder / 'a.parquet'}:1: the cell is null"}
    with pytest.raises(SourceError, match=r"has no column 'speaker' \(columns: audio, id\)"):
        Table(str(folder), column="speaker").scan([".wav"])
    with pytest.raises(SourceError, match=r"column 'id' of .* holds neither bytes nor .*--column"):
        Table(str(folder), column="id").scan([".wav"])
    write_audio_parquet(folder / "c.parquet", clips[:1], id=["x"])
    with pytest.raises(SourceError, match="two rows have the id 'x'"):
        Table(str(folder)).scan([".wav"])


def test_a_dataset_saved_to_disk_is_read_without_datasets(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    labels = list(range(len(images)))
    folder = save_to_disk(tmp_path / "hf", images, labels)
    assert is_table(str(folder))
    inputs = Table(str(folder))
    scanned = inputs.scan(source_for(IMAGE_RECIPE).extensions)
    n = -(-len(images) // 2)
    want = [f"data-00000-of-00002.arrow:{i}" for i in range(n)]
    want += [f"data-00001-of-00002.arrow:{i}" for i in range(len(images) - n)]
    assert inputs.column == "image" and scanned.inputs == want
    assert [inputs.row(r)["label"] for r in scanned.inputs] == labels
    paths = [inputs.path(r) for r in scanned.inputs]
    digests, _ = inputs.hash(catalog(tmp_path), paths)
    assert [digests[p] for p in paths] == [sha256_hex(b) for b in images]
    source = inputs.source(source_for(IMAGE_RECIPE))
    for p, data in zip(paths, images, strict=True):
        assert torch.equal(source.load(p), image_tensor(data)), p
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(SourceError, match=r"DatasetDict .* --data: .*dd/train"):
        Table(str(tmp_path / "dd"))


# == builds, datasets and the CLI ==================================================================
def test_a_tar_of_photographs_builds_and_serves_what_the_encoder_gives_now(
    tmp_path: Path,
) -> None:
    images = photographs(tmp_path)
    tar = write_tar(tmp_path / "shard-000.tar", image_samples(images))
    encoder, store = image_encoder(), tmp_path / "store"
    report = build(tar, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (report.encoded, report.failed) == (len(images), [])
    stored = stored_features(store, report.root)
    assert list(stored) == [f"sample{i:04d}" for i in range(len(images))]  # tar order, by key
    for (key, parts), data in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(data))), key
    again = build(tar, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (again.encoded, again.reused) == (0, len(images))
    ds = CachedFeatureDataset(tar, encoder, cache=store, recipe=IMAGE_RECIPE, on_miss="error")
    assert len(ds) == len(images)
    for i, data in enumerate(images):
        assert ds.item_id(i) == f"sample{i:04d}"
        assert ds.row(i) == {"txt": f"a photo number {i}", "cls": i % 3, "json": {"n": i}}
        assert torch.equal(ds[i], run_now(encoder, image_tensor(data)))
    # The same JPEGs as files have the same keys: a folder build reuses every one.
    folder = tmp_path / "as_files"
    folder.mkdir()
    for i, data in enumerate(images):
        (folder / f"{i}.jpg").write_bytes(data)
    files = build(folder, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (files.encoded, files.reused) == (0, len(images))


def test_a_first_build_reads_each_member_and_cell_once(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes hashed for the key are decoded (held), not read from the container again."""
    again: list[str] = []
    real_member, real_cells = LocalFiles.read_member, TableFile.cells

    def member(self: LocalFiles, tar: str, m: Member) -> Any:
        again.append(f"{tar}:{m.name}")
        return real_member(self, tar, m)

    def cells(self: TableFile, row: int, columns: Any) -> dict[str, Any]:
        again.append(f"{self.path}:{row}")
        return real_cells(self, row, columns)

    monkeypatch.setattr(LocalFiles, "read_member", member)
    monkeypatch.setattr(TableFile, "cells", cells)
    clips = [wav_bytes(0.3 + 0.1 * i, i) for i in range(4)]
    tar = write_tar(tmp_path / "a.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)])
    table = write_audio_parquet(tmp_path / "a.parquet", list(clips))
    for data in (tar, table):
        report = build(data, encoder_file, cache=tmp_path / f"s-{data.name}", workers=0)
        assert (report.encoded, report.failed) == (4, [])
    assert again == []


def test_a_built_shard_deleted_since_is_served_from_the_store(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    tar = write_tar(tmp_path / "s.tar", image_samples(images))
    encoder, store = image_encoder(), tmp_path / "store"
    build(tar, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    tar.unlink()
    ds = CachedFeatureDataset(tar, encoder, cache=store, recipe=IMAGE_RECIPE, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == [f"sample{i:04d}" for i in range(len(images))]
    for i, data in enumerate(images):
        assert torch.equal(ds[i], run_now(encoder, image_tensor(data)))
    with pytest.raises(SourceError, match="no sample 'sample0000'"):
        ds.row(0)


def test_a_dataset_over_a_shard_encodes_misses_live_from_the_tar(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    tar = write_tar(tmp_path / "s.tar", image_samples(images))
    encoder = image_encoder()
    store = tmp_path / "store"
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(tar, encoder, cache=store, recipe=IMAGE_RECIPE)
    assert len(ds) == len(images) and ds.stored() == 0
    for i, data in enumerate(images):
        assert torch.equal(ds[i], run_now(encoder, image_tensor(data))), i
    # Written back: a second dataset serves them from the store without encoding.
    again = CachedFeatureDataset(tar, encoder, cache=store, recipe=IMAGE_RECIPE, on_miss="error")
    assert [torch.equal(again[i], ds[i]) for i in range(len(ds))] == [True] * len(images)


def test_an_hf_dataset_saved_to_disk_builds_and_serves(tmp_path: Path) -> None:
    images = photographs(tmp_path)
    folder = save_to_disk(tmp_path / "hf", images, [i % 2 for i in range(len(images))])
    encoder, store = image_encoder(), tmp_path / "store"
    report = build(folder, encoder, cache=store, recipe=IMAGE_RECIPE, workers=2, column="image")
    assert (report.encoded, report.failed) == (len(images), [])
    ds = CachedFeatureDataset(
        folder, encoder, cache=store, recipe=IMAGE_RECIPE, column="image", on_miss="error"
    )
    assert len(ds) == len(images)
    for i, data in enumerate(images):
        assert ds.row(i) == {"label": i % 2}
        assert torch.equal(ds[i], run_now(encoder, image_tensor(data))), ds.item_id(i)


def test_a_parquet_of_audio_bytes_builds_with_bad_rows_skipped_and_serves(
    tmp_path: Path, encoder_file: Path
) -> None:
    clips: list[bytes | None] = [wav_bytes(0.3 + 0.1 * i, i) for i in range(5)]
    clips[1] = None  # a null cell
    clips[3] = b"RIFF not audio at all"  # an undecodable cell
    ids = [f"utt{i}" for i in range(5)]
    path = write_audio_parquet(tmp_path / "train.parquet", clips, id=ids, speaker=list("ababa"))
    store = tmp_path / "store"
    report = build(path, encoder_file, cache=store, workers=0, column="audio")
    assert report.encoded == 3
    reasons = dict(report.failed)
    assert set(reasons) == {"utt1", "utt3"}
    assert f"{path}:1: the cell is null" in reasons["utt1"]
    assert "cannot decode audio" in reasons["utt3"] and f"{path}:3" in reasons["utt3"]
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    with pytest.warns(UserWarning) as told:
        ds = CachedFeatureDataset(path, encoder_file, cache=store, column="audio")
    said = [str(w.message) for w in told]
    assert any("utt1: " in s and "train.parquet:1: the cell is null" in s for s in said), said
    assert any("could not be decoded" in s and "utt3" in s for s in said), said
    # The null cell is no item; the undecodable one is left out, as its build recorded it.
    assert [ds.item_id(i) for i in range(len(ds))] == ["utt0", "utt2", "utt4"]
    for i, n in enumerate([0, 2, 4]):
        assert ds.row(i) == {"speaker": "ab"[n % 2]}
        want = run_now(module, audio_tensor(clips[n]))  # type: ignore[arg-type]
        assert torch.equal(ds[i], want), n


def assert_serves_the_split(
    data: Path, encoder_file: Path, store: Path, split: Any, clips: list[bytes]
) -> None:
    """Build ``data`` (one split's table files) and check each row is served in ``split``'s
    order (the rows ``datasets`` reads) with its label, equal to the encoder run now on its
    clip."""
    report = build(data, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded, report.failed) == (split.num_rows, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, column="audio", on_miss="error")
    assert [ds.row(i)["label"] for i in range(len(ds))] == list(split["label"])
    for i in range(len(ds)):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i]))), ds.item_id(i)


def test_a_parquet_folder_of_several_splits_is_refused_naming_them_never_mixed(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A Hub snapshot's ``data/`` holds each split's files by name (``train-00000-of-00002``,
    ``test-00000-of-00001``), which ``datasets`` reads as a DatasetDict: the folder is refused
    in one line naming its splits, never served as one table with the test rows in it."""
    datasets = pytest.importorskip("datasets")
    data = tmp_path / "snapshot" / "data"
    data.mkdir(parents=True)
    clips = [wav_bytes(0.3 + 0.1 * i, i) for i in range(5)]
    labels = [10, 11, 12, 13, 14]
    for name, rows in (
        ("train-00000-of-00002", [0, 1]),
        ("train-00001-of-00002", [2, 3]),
        ("test-00000-of-00001", [4]),
    ):
        pick = [clips[r] for r in rows]
        write_audio_parquet(data / f"{name}.parquet", pick, label=[labels[r] for r in rows])
    splits = datasets.load_dataset(str(data), cache_dir=str(tmp_path / "hf_cache"))
    assert sorted(splits) == ["test", "train"]  # how the user's other loader reads the folder
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert "splits" in said and "train (2 files)" in said and "test (1 file)" in said, said
    with pytest.raises(SourceError, match=r"splits train \(2 files\), test \(1 file\)"):
        CachedFeatureDataset(data, encoder_file, cache=store, column="audio")
    # One split's files in a folder of their own: served in datasets' order, labels carried.
    train = tmp_path / "train"
    train.mkdir()
    for p in sorted(data.glob("train-*.parquet")):
        p.rename(train / p.name)
    assert_serves_the_split(train, encoder_file, store, splits["train"], clips)


def test_a_fifo_among_tar_shards_or_table_files_is_one_line_not_a_hang(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A FIFO named like a shard (``b.tar``) in a folder of tars, or like a table file
    (``b.parquet``) in a folder of parquet files, is refused in one line saying what it is
    (its open would block until a writer came, which never does); the tar beside it is built
    and served equal to the encoder run now. Before, the build blocked in the FIFO's open."""
    shards, tables = tmp_path / "shards", tmp_path / "tables"
    shards.mkdir()
    tables.mkdir()
    clip = wav_bytes(0.5, 3)
    write_tar(shards / "a.tar", [("s0", {"wav": clip, "cls": b"4"})])
    write_audio_parquet(tables / "a.parquet", [clip])
    os.mkfifo(shards / "b.tar")
    os.mkfifo(tables / "b.parquet")
    store = tmp_path / "store"
    res = run_cli("build", "-e", encoder_file, "-d", shards, "--cache", store, timeout=120)
    assert res.returncode == 3, res.stderr
    assert "b.tar: not a regular file (a FIFO)" in res.stdout + res.stderr
    res = run_cli("build", "-e", encoder_file, "-d", tables, "--column", "audio", "--cache",
                  store, timeout=120)  # fmt: skip
    assert res.returncode == 8, res.stderr
    said = res.stderr.strip()
    assert "b.parquet: not a regular file (a FIFO)" in said and len(said.splitlines()) == 1
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(shards, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["s0"] and ds.row(0) == {"cls": 4}
    assert torch.equal(ds[0], run_now(module, audio_tensor(clip)))


def test_a_folder_of_tar_shards_of_several_splits_is_refused_naming_them(
    tmp_path: Path, encoder_file: Path
) -> None:
    """The same for webdataset shards (path7.1): a Hub snapshot's ``data/`` of ``train-0000.tar``
    and ``test-0000.tar``, which ``datasets`` reads as two splits, is refused in one line; a
    brace pattern naming one split's shards builds them and serves each sample equal to the
    encoder run now, with its ``.cls``."""
    datasets = pytest.importorskip("datasets")
    data = tmp_path / "snapshot" / "data"
    data.mkdir(parents=True)
    clips = [wav_bytes(0.3 + 0.1 * i, i) for i in range(3)]
    train = [(f"t{i}", {"wav": clips[i], "cls": b"%d" % i}) for i in (0, 1)]
    write_tar(data / "train-0000.tar", train)
    write_tar(data / "test-0000.tar", [("e0", {"wav": clips[2], "cls": b"2"})])
    splits = datasets.data_files.get_data_patterns(str(data))  # how load_dataset splits it
    assert sorted(splits) == ["test", "train"]
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1 and "train (1 file), test (1 file)" in said, said
    pattern = str(data / "train-{0000..0000}.tar")
    assert build(pattern, encoder_file, cache=store, workers=0).encoded == 2
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(pattern, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["t0", "t1"]
    for i in range(2):
        assert ds.row(i) == {"cls": i}
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i])))


def test_a_folder_of_one_split_beside_files_of_none_is_refused_naming_what_it_would_mix(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``train.parquet`` beside ``extra.parquet``: ``datasets.load_dataset("parquet",
    data_dir=...)`` reads the train file alone and leaves the other out, where featbake read
    both as one table. The folder is refused in one line naming the split and the files left
    out (exit 8, and from a dataset); the train file as ``--data`` is built and served in
    ``datasets``' order with its labels, each equal to the encoder run now. The same for a
    folder of tar shards (``train-0000.tar`` beside ``extra-0000.tar``)."""
    datasets = pytest.importorskip("datasets")
    data = tmp_path / "tables"
    data.mkdir()
    clips = [wav_bytes(0.3 + 0.1 * i, 20 + i) for i in range(3)]
    write_audio_parquet(data / "train.parquet", clips[:2], label=[7, 8])
    write_audio_parquet(data / "extra.parquet", clips[2:], label=[9])
    splits = datasets.load_dataset("parquet", data_dir=str(data), cache_dir=str(tmp_path / "hf"))
    assert list(splits) == ["train"] and splits["train"].num_rows == 2  # extra.parquet left out
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store,
                    "--column", "audio")  # fmt: skip
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert "train (1 file) and 1 file that name no split (extra.parquet)" in said, said
    with pytest.raises(SourceError, match=r"name no split \(extra.parquet\)"):
        CachedFeatureDataset(data, encoder_file, cache=store, column="audio")
    train = data / "train.parquet"
    assert_serves_the_split(train, encoder_file, store, splits["train"], clips)
    # Tar shards: the same rule, the same line; one shard as --data is read.
    shards = tmp_path / "shards"
    shards.mkdir()
    write_tar(shards / "train-0000.tar", [("t0", {"wav": clips[0], "cls": b"0"})])
    write_tar(shards / "extra-0000.tar", [("e0", {"wav": clips[2], "cls": b"2"})])
    patterns = datasets.data_files.get_data_patterns(str(shards))
    assert list(patterns) == ["train"]
    result = invoke("build", "--data", shards, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    assert (
        "name no split (extra-0000.tar)" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    ), result.stderr
    one = shards / "train-0000.tar"
    report = build(one, encoder_file, cache=store, workers=0)
    assert (report.encoded + report.reused, report.failed) == (1, [])  # clip 0's key: stored
    ds = CachedFeatureDataset(one, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["t0"] and ds.row(0) == {"cls": 0}
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    assert torch.equal(ds[0], run_now(module, audio_tensor(clips[0])))


@pytest.mark.parametrize(
    "names",
    [
        ["a.parquet", "b.parquet"],
        ["train.parquet", "extra.parquet"],
        ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"],
        ["train.parquet", "test.parquet"],
        ["training_set.parquet", "notes.parquet"],
        ["retrain.parquet", "x.parquet"],
        ["my_valid_rows.parquet", "my_rows.parquet"],
        ["dev.parquet"],
        ["Train.parquet", "x.parquet"],
        ["test.parquet", "test2.parquet"],
        ["evaluation.parquet", "eval.parquet", "testing.parquet"],
        ["train 1.parquet", "valid 1.parquet"],
        ["trainset.parquet", "x.parquet"],
        ["data-train.parquet", "data-val.parquet"],
        ["shard-000.tar", "shard-001.tar"],
        ["train-0000.tar", "extra-0000.tar"],
        ["00_train_.tar", "01.tar"],
        ["train/a.tar", "test/b.tar"],
        ["train/a.tar", "b.tar"],
        ["train/a.tar", "train/test.tar"],
        ["data/train/a.parquet", "data/valid/b.parquet"],
        ["train-0/a.tar", "x/a.tar"],
        ["sub/train.tar", "sub/test.tar"],
        ["sub/a.tar", "other/b.tar"],
    ],
)
def test_a_folder_is_read_as_one_exactly_where_datasets_reads_it_as_one_split(
    tmp_path: Path, names: list[str]
) -> None:
    """featbake reads a folder's data files as one table (or one set of shards) exactly where
    ``datasets`` (``get_data_patterns``, then the files each split's patterns match, as
    ``load_dataset(..., data_dir=...)`` resolves them) reads them all as one split; else it
    refuses the folder."""
    datasets = pytest.importorskip("datasets")
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    patterns = datasets.data_files.get_data_patterns(str(tmp_path))
    resolved = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=str(tmp_path))
    got = {str(s): sorted(os.path.relpath(f, tmp_path) for f in fs) for s, fs in resolved.items()}
    as_one = len(got) == 1 and next(iter(got.values())) == sorted(names)
    try:
        refuse_several_splits(str(tmp_path), sorted(names))
    except SourceError:
        assert not as_one, got
    else:
        assert as_one, got


def test_a_table_file_that_cannot_be_read_fails_its_cells_in_one_line_each(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pyarrow's errors may run over several lines (a page header's thrift context); the
    # build's reason for each cell quotes the first, so the report stays one line a cell.
    path = write_audio_parquet(tmp_path / "t.parquet", [wav_bytes(0.3, 1), wav_bytes(0.4, 2)])

    def corrupt_page(self: object, name: str) -> Iterator[tuple[int, object]]:
        raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data\n"
                      "Deserializing page header failed.\n")  # fmt: skip
        yield  # a generator, as TableFile.column is

    monkeypatch.setattr("featbake.store.containers.TableFile.column", corrupt_page)
    report = build(path, encoder_file, cache=tmp_path / "store", workers=0)
    assert report.encoded == 0 and len(report.failed) == 2
    for _, why in report.failed:
        assert "\n" not in why and "Couldn't deserialize thrift" in why, why

    # pyarrow's ArrowNotImplementedError (a NotImplementedError: an encoding it cannot read)
    # fails the cells the same way, not the build with a traceback.
    def unsupported(self: object, name: str) -> Iterator[tuple[int, object]]:
        raise NotImplementedError("Unsupported encoding: BYTE_STREAM_SPLIT")
        yield

    monkeypatch.setattr("featbake.store.containers.TableFile.column", unsupported)
    report = build(path, encoder_file, cache=tmp_path / "store2", workers=0)
    assert report.encoded == 0 and len(report.failed) == 2
    assert all("Unsupported encoding" in why for _, why in report.failed), report.failed


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_encode_misses_from_a_table_and_a_shard(
    tmp_path: Path, encoder_file: Path, context: str
) -> None:
    """Misses decoded in DataLoader workers (forked, or the dataset pickled to spawned ones):
    each reads its container itself (the table's and the shard's datasets in one worker)."""
    from torch.utils.data import ConcatDataset, DataLoader

    clips = [wav_bytes(0.3 + 0.05 * i, i) for i in range(6)]
    table = write_audio_parquet(tmp_path / "a.parquet", list(clips))
    tar = write_tar(tmp_path / "a.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    both = []
    for data in (table, tar):
        with pytest.warns(UserWarning, match="no featbake store"):
            both.append(CachedFeatureDataset(data, encoder_file, cache=tmp_path / f"s-{data.name}"))
    loader = DataLoader(
        ConcatDataset(both), batch_size=None, num_workers=1, multiprocessing_context=context
    )
    got = list(loader)
    assert len(got) == 2 * len(clips)
    for x, clip in zip(got, clips + clips, strict=True):
        assert torch.equal(x, run_now(module, audio_tensor(clip)))


def test_a_forked_child_reads_a_table_through_a_parquet_file_of_its_own(tmp_path: Path) -> None:
    """A table's open parquet reader is the process's that opened it: a forked child (a
    DataLoader worker) opens its own, never reads through its parent's, and the parent's stays
    open and keeps reading. A bucket's file is read through a Python file object whose lock a
    parent's thread may hold at fork; the child never touches it."""
    clips = [wav_bytes(0.3 + 0.05 * i, i) for i in range(4)]
    path = write_audio_parquet(tmp_path / "t.parquet", list(clips))
    inputs = Table(str(path))
    paths = [inputs.path(r) for r in inputs.scan(source_for(Recipe()).extensions).inputs]
    source = inputs.source(source_for(Recipe()))
    assert torch.equal(source.load(paths[0]), audio_tensor(clips[0]))
    table_file = inputs.files[0]
    parents = id(table_file._pf)  # opened by the scan, kept for the reads

    def child() -> bool:
        read = [source.load(p) for p in paths]
        own = id(table_file._pf) != parents  # the child opened its own
        pairs = zip(read, clips, strict=True)
        return own and all(torch.equal(x, audio_tensor(c)) for x, c in pairs)

    pid = os.fork()
    if pid == 0:
        os._exit(0 if child() else 3)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert id(table_file._pf) == parents  # the parent's own, still its
    assert torch.equal(source.load(paths[3]), audio_tensor(clips[3]))


def test_loader_roots_and_export_over_a_table(tmp_path: Path, encoder_file: Path) -> None:
    """FeatureLoader and its padding work unchanged; roots name the table, export its ids."""
    import zarr

    from featbake.export.zarr import export_zarr
    from featbake.serve.loader import FeatureLoader

    clips = [wav_bytes(0.3 + 0.1 * i, i) for i in range(5)]
    ids = [f"utt{i}" for i in range(5)]
    table = write_audio_parquet(tmp_path / "t.parquet", list(clips), id=ids)
    store = tmp_path / "store"
    build(table, encoder_file, cache=store, workers=0)
    ds = CachedFeatureDataset(table, encoder_file, cache=store, on_miss="error")
    batches = list(FeatureLoader(ds, batch_size=2, shuffle=False))
    assert [int(n) for _, lengths in batches for n in lengths] == [len(ds[i]) for i in range(5)]
    for j, (padded, lengths) in enumerate(batches):
        for k, n in enumerate(lengths):
            assert torch.equal(padded[k, : int(n)], ds[2 * j + k])
    roots = invoke("roots", "--cache", store, "--json")
    assert json.loads(roots.stdout)[0]["data"] == str(table)
    export_zarr(tmp_path / "f.zarr", cache=store)
    assert list(zarr.open_group(str(tmp_path / "f.zarr"), mode="r")["paths"][:]) == ids


def test_the_cli_builds_a_shard_with_a_truncated_member_and_exits_3(
    tmp_path: Path, encoder_file: Path
) -> None:
    clips = [wav_bytes(0.4, i) for i in range(4)]
    tar = write_tar(tmp_path / "speech.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)])
    whole = tar.read_bytes()
    tar.write_bytes(whole[: whole.find(clips[-1]) + 100])
    out = invoke(
        "build", "--encoder", encoder_file, "--data", tar, "--cache", tmp_path / "store",
        "--column", "wav", "--workers", "0",
    )  # fmt: skip
    assert out.returncode == 3, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert f"{tar}:u3.wav: truncated tar member (100 of" in text, text
    assert re.search(r"^encoded\s+3$", text, re.MULTILINE) and "failed u3: " in text, text
    root = re.search(r"^root\s+(\S+)$", text, re.MULTILINE)
    assert root, text
    stored = stored_features(tmp_path / "store", root.group(1))
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    assert list(stored) == ["u0", "u1", "u2"]
    for (key, parts), clip in zip(stored.items(), clips, strict=False):  # batched by 3
        torch.testing.assert_close(parts[""], run_now(module, audio_tensor(clip)), msg=key)


# == webdataset shards in a bucket =================================================================
@pytest.fixture
def gets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(object, bytes asked) of every GET this process makes of a bucket object (whole or
    ranged), in order."""
    from featbake.store.objects import ObjectStore

    got: list[tuple[str, int]] = []
    whole, ranged, ranged_of = ObjectStore.read, ObjectStore.read_range, ObjectStore.read_range_of

    def read(self: ObjectStore, name: str) -> Any:
        got.append((name, -1))
        return whole(self, name)

    def read_range(self: ObjectStore, name: str, start: int, length: int) -> bytes:
        got.append((name, length))
        return ranged(self, name, start, length)

    def read_range_of(self: ObjectStore, name: str, start: int, length: int) -> Any:
        got.append((name, length))
        return ranged_of(self, name, start, length)

    monkeypatch.setattr(ObjectStore, "read", read)
    monkeypatch.setattr(ObjectStore, "read_range", read_range)
    monkeypatch.setattr(ObjectStore, "read_range_of", read_range_of)
    return got


def upload_shards(url: str, shards: dict[str, Path]) -> None:
    from featbake.store.objects import ObjectStore
    from featbake.store.url import BucketURL

    bucket = ObjectStore(BucketURL.parse(url))
    for name, path in shards.items():
        bucket.upload(name, path)


def test_shards_in_a_bucket_are_read_by_ranged_gets_and_a_rebuild_reads_no_byte(
    s3: Any, tmp_path: Path, gets: list[tuple[str, int]]
) -> None:
    """Tars in a bucket were refused in one line. Now: headers listed and members hashed by
    ranged GETs (never a whole shard), served equal to the encoder run now; the listing and
    digests cached by the shard's ETag, so a rebuild and a dataset read no object byte."""
    images = photographs(tmp_path)
    half = len(images) // 2
    shards = {
        "shard-000.tar": write_tar(tmp_path / "a.tar", image_samples(images[:half])),
        "shard-001.tar": write_tar(tmp_path / "b.tar", image_samples(images[half:], half)),
    }
    folder = f"s3://{s3.bucket}/shards"
    upload_shards(folder, shards)
    data = folder + "/shard-{000..001}.tar"
    encoder, store = image_encoder(), tmp_path / "store"
    report = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (report.encoded, report.failed) == (len(images), [])
    assert gets and all(n > 0 for _, n in gets)  # ranged GETs only, never a whole object
    headers = [n for _, n in gets if n == HEADER_BLOCK]
    members = sum(n for _, n in gets if n != HEADER_BLOCK)  # runs of adjacent members
    assert len(headers) <= 4 * len(images)  # a header GET per member at most, once
    assert members <= sum(p.stat().st_size for p in shards.values())  # each member read once
    stored = stored_features(store, report.root)
    assert list(stored) == [f"sample{i:04d}" for i in range(len(images))]
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key

    gets.clear()
    again = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (again.encoded, again.reused, again.root) == (0, len(images), report.root)
    ds = CachedFeatureDataset(data, encoder, cache=store, recipe=IMAGE_RECIPE, on_miss="error")
    served = [ds[i] for i in range(len(ds))]
    assert gets == []  # listings and digests from the hash cache, by ETag, size and date
    for i, jpg in enumerate(images):
        assert ds.item_id(i) == f"sample{i:04d}"
        assert torch.equal(served[i], run_now(encoder, image_tensor(jpg)))
    assert ds.row(half) == {"txt": f"a photo number {half}", "cls": half % 3, "json": {"n": half}}

    # A shard rewritten (another ETag) is listed and hashed again; the other is not read.
    gets.clear()
    changed = write_tar(tmp_path / "c.tar", image_samples(images[half:][::-1], half))
    upload_shards(folder, {"shard-001.tar": changed})
    third = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert third.reused >= half and not third.failed
    assert {name for name, _ in gets} == {"shards/shard-001.tar"}  # the key: one client per bucket


def test_tar_shards_and_a_parquet_file_are_read_in_place_on_every_cloud(
    place: Any, tmp_path: Path
) -> None:
    """Tar shards (a prefix of tars only, and a brace pattern) and a parquet file in an S3, GCS
    or Azure bucket are read through the one byte seam (``featbake.store.byteplace``): served
    equal to the encoder run now, and a rebuild reuses every item by the objects' versions."""
    images = photographs(tmp_path)
    half = len(images) // 2
    shards = {
        "shard-000.tar": write_tar(tmp_path / "a.tar", image_samples(images[:half])),
        "shard-001.tar": write_tar(tmp_path / "b.tar", image_samples(images[half:], half)),
    }
    root = f"{place.scheme}://{place.bucket}"
    upload_shards(f"{root}/shards", shards)
    table = pa.table({"image": pa.array(images, pa.binary())})
    pq.write_table(table, tmp_path / "images.parquet", row_group_size=2)
    upload_shards(f"{root}/tables", {"images.parquet": tmp_path / "images.parquet"})
    encoder = image_encoder()
    for data, column in (
        (f"{root}/shards/", None),
        (f"{root}/shards/shard-{{000..001}}.tar", None),
        (f"{root}/tables/images.parquet", "image"),
    ):
        store = tmp_path / f"store-{len(column or '')}-{data.endswith('/')}"
        report = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column=column)
        assert (report.encoded, report.failed) == (len(images), []), data
        stored = stored_features(store, report.root)
        for (key, parts), jpg in zip(stored.items(), images, strict=True):
            assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), (data, key)
        again = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column=column)
        assert (again.encoded, again.reused, again.root) == (0, len(images), report.root), data


def test_a_bucket_prefix_of_tars_only_is_read_as_shards_as_a_local_folder_is(
    s3: Any, tmp_path: Path, gets: list[tuple[str, int]]
) -> None:
    """``--data s3://bucket/shards/`` holding only ``.tar`` objects was read as plain objects
    (each tar one item, refused as no image); now it is the shards, in name order, as a local
    folder of tars is: each sample one item, served equal to the encoder run now. A prefix
    with any other object stays a prefix of objects."""
    from featbake.encode.inputs import BucketInputs, inputs_at
    from featbake.encode.webdataset import WebDataset

    images = photographs(tmp_path)
    half = len(images) // 2
    shards = {
        "shard-000.tar": write_tar(tmp_path / "a.tar", image_samples(images[:half])),
        "sub/shard-001.tar": write_tar(tmp_path / "b.tar", image_samples(images[half:], half)),
        ".hidden.json": tmp_path / "a.tar",  # hidden: passed over, as a folder scan does
    }
    prefix = f"s3://{s3.bucket}/shards/"
    upload_shards(prefix, shards)
    assert isinstance(inputs_at(prefix), WebDataset)
    encoder, store = image_encoder(), tmp_path / "store"
    report = build(prefix, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (report.encoded, report.failed) == (len(images), [])
    assert report.data == f"s3://{s3.bucket}/shards"
    assert gets and all(n > 0 for _, n in gets)  # ranged GETs only, never a whole object
    stored = stored_features(store, report.root)
    assert list(stored) == [f"sample{i:04d}" for i in range(len(images))]
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key
    ds = CachedFeatureDataset(prefix, encoder, cache=store, recipe=IMAGE_RECIPE, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == list(stored)
    assert torch.equal(ds[half], run_now(encoder, image_tensor(images[half])))

    upload_shards(prefix, {"cover.jpg": tmp_path / "a.tar"})  # not only tars now
    assert isinstance(inputs_at(prefix), BucketInputs)
    assert isinstance(inputs_at(f"s3://{s3.bucket}/none/"), BucketInputs)  # empty: objects


def test_a_bucket_member_decoded_costs_one_ranged_get_and_no_head(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member decoded from a bucket shard was read by a ranged GET and checked against the
    shard's stat by a HEAD: two requests per member. Now the GET's own response (ETag, last
    change, Content-Range total) is the stat checked: one request per member, counted by the
    server; a shard rewritten since its digests still fails the member, naming it."""
    import featbake.encode.fingerprints
    from featbake.encode.webdataset import WebDataset

    images = photographs(tmp_path)
    prefix = f"s3://{s3.bucket}/shards"
    upload_shards(prefix, {"only.tar": write_tar(tmp_path / "a.tar", image_samples(images))})
    data = f"{prefix}/only.tar"
    target = f"/{s3.bucket}/shards/only.tar"
    # No bytes held from hashing: every member is decoded from the bucket, checked.
    monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    encoder, store = image_encoder(), tmp_path / "store"
    mark = s3.log_mark()
    report = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (report.encoded, report.failed) == (len(images), [])
    asked = [r for r in s3.requests(mark) if r.name.partition("?")[0] == target]
    heads = [r for r in asked if r.method == "HEAD"]
    assert heads == []  # none per member, nor for the hash: the GETs' responses are checked
    stored = stored_features(store, report.root)
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key

    shards = WebDataset(data)
    rels = shards.scan(source_for(IMAGE_RECIPE).extensions).inputs
    source = shards.source(source_for(IMAGE_RECIPE))
    stat, path = shards.listed[data], shards.path(rels[1])
    mark = s3.log_mark()
    got = source.load_unchanged(path, stat)  # type: ignore[attr-defined]
    assert torch.equal(got, image_tensor(images[1]))
    assert [(r.method, r.status) for r in s3.requests(mark)] == [("GET", 206)]
    upload_shards(prefix, {"only.tar": write_tar(tmp_path / "b.tar", image_samples(images[::-1]))})
    with pytest.raises(SourceError, match=r"only.tar:sample0001.jpg: changed while"):
        source.load_unchanged(path, stat)  # type: ignore[attr-defined]


def test_a_dataset_encodes_a_bucket_shards_misses_live_from_ranged_reads(
    s3: Any, tmp_path: Path
) -> None:
    images = photographs(tmp_path, 2)
    folder = f"s3://{s3.bucket}/shards"
    upload_shards(folder, {"only.tar": write_tar(tmp_path / "a.tar", image_samples(images))})
    encoder = image_encoder()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(
            folder + "/only.tar", encoder, cache=tmp_path / "store", recipe=IMAGE_RECIPE
        )
    for i, jpg in enumerate(images):
        assert torch.equal(ds[i], run_now(encoder, image_tensor(jpg)))


# == verify: the hash rows of members and cells ====================================================
def test_verify_checks_the_hash_rows_of_tar_members_and_table_cells(tmp_path: Path) -> None:
    """verify hashed again only rows naming a file: a tar member's (``tar:member``) and a cell's
    (``file:row:column``) were skipped, so a row edited to another item's digest stayed trusted
    and served that item's feature. Now each is read (header, cell) and hashed again."""
    import sqlite3
    import time

    from featbake.encode.inputs import redigested
    from featbake.upkeep import FindingKind, verify

    images = photographs(tmp_path, 2)[:2]
    tar = write_tar(tmp_path / "shard.tar", image_samples(images))
    parquet = tmp_path / "images.parquet"
    pq.write_table(pa.table({"image": pa.array(images, pa.binary())}), parquet)
    time.sleep(1.1)  # past the racy window: the rows are trusted
    encoder, store = image_encoder(), tmp_path / "store"
    roots = {}
    for data in (tar, parquet):  # the same images: the parquet's are reused
        report = build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
        assert not report.failed
        roots[report.root] = stored_items(store, report.root)
    member, cell = f"{tar}:sample0000.jpg", f"{parquet}:0:image"
    with sqlite3.connect(store / "catalog.sqlite") as c:
        rows = dict(c.execute("SELECT path, sha256 FROM hash_cache").fetchall())
        assert rows[member] == rows[cell] == sha256_hex(images[0])
        other = sha256_hex(images[1])
        for path in (member, cell):
            c.execute("UPDATE hash_cache SET sha256=? WHERE path=?", (other, path))
    for data in (tar, parquet):  # rebuilt: the first item of each is keyed as the second
        build(data, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert all(stored_items(store, r) != items for r, items in roots.items())
    found = verify(store).findings
    named = {f.subject for f in found if f.kind is FindingKind.HASH_CACHE}
    assert named == {member, cell}, found
    fixed = verify(store, repair_damage=True, redigest=redigested)  # as the CLI calls it
    assert any("dropped 2 wrong hash-cache rows" in a for a in fixed.actions), fixed.actions
    assert any("re-keyed 2 manifest items" in a for a in fixed.actions), fixed.actions
    assert all(stored_items(store, r) == items for r, items in roots.items())
    assert verify(store).status == "clean"


def stored_items(store: Path, root: str) -> list[tuple[str, str]]:
    """A root's (item id, key) pairs, in order."""
    with Catalog(Layout(store), read_only=True) as cat:
        return [tuple(x) for x in cat.root_items(root)]


def test_a_parquet_file_in_a_bucket_is_read_by_ranged_gets_and_a_rebuild_reads_no_byte(
    s3: Any, tmp_path: Path, gets: list[tuple[str, int]]
) -> None:
    """A parquet file in a bucket was refused in one line. Now its footer and row groups are
    read by ranged GETs, its schema and ids cached by its ETag, so a rebuild and a dataset make
    no GET; every served row equals the encoder run now on its image."""
    images = photographs(tmp_path, 4)
    labels = list(range(len(images)))
    table = pa.table({"image": pa.array(images, pa.binary()), "label": labels})
    local = tmp_path / "images.parquet"
    pq.write_table(table, local, row_group_size=2)
    folder = f"s3://{s3.bucket}/tables"
    upload_shards(folder, {"images.parquet": local})
    url = folder + "/images.parquet"
    encoder, store = image_encoder(), tmp_path / "store"
    report = build(url, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column="image")
    assert (report.encoded, report.failed) == (len(images), [])
    assert gets and all(n > 0 for _, n in gets)  # ranged GETs only
    stored = stored_features(store, report.root)
    assert list(stored) == [f"images.parquet:{i}" for i in range(len(images))]
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key

    gets.clear()
    again = build(url, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column="image")
    assert (again.encoded, again.reused, again.root) == (0, len(images), report.root)
    ds = CachedFeatureDataset(
        url, encoder, cache=store, recipe=IMAGE_RECIPE, column="image", on_miss="error"
    )
    served = [ds[i] for i in range(len(ds))]
    assert gets == []  # schema, ids and digests from the hash cache, by ETag, size and date
    for i, jpg in enumerate(images):
        assert torch.equal(served[i], run_now(encoder, image_tensor(jpg)))
    assert ds.row(3) == {"label": 3}
    with pytest.warns(UserWarning, match="no featbake store"):  # misses encoded from the bucket
        live = CachedFeatureDataset(
            url, encoder, cache=tmp_path / "fresh", recipe=IMAGE_RECIPE, column="image"
        )
    for i, jpg in enumerate(images):
        assert torch.equal(live[i], run_now(encoder, image_tensor(jpg)))


def test_a_bucket_table_and_shard_in_the_cli_and_in_dataloader_workers(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """Decode workers (the CLI's) and forked DataLoader workers each read the bucket's objects
    by ranged GETs with their own client: nothing unpicklable crosses (the catalog a scan
    looked listings up in is dropped after it)."""
    from torch.utils.data import DataLoader

    clips = [wav_bytes(0.3 + 0.05 * i, i) for i in range(4)]
    folder = f"s3://{s3.bucket}/audio"
    upload_shards(
        folder,
        {
            "a.parquet": write_audio_parquet(tmp_path / "a.parquet", list(clips)),
            "a.tar": write_tar(
                tmp_path / "a.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)]
            ),
        },
    )
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for name in ("a.parquet", "a.tar"):
        store = tmp_path / f"s-{name}"
        done = invoke(
            "build", "--encoder", encoder_file, "--data", f"{folder}/{name}", "--cache", store,
            "--workers", "2", "--json", env=s3.env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f'"encoded": {len(clips)}' in done.stdout
        with pytest.warns(UserWarning, match="no featbake store"):
            ds = CachedFeatureDataset(
                f"{folder}/{name}", encoder_file, cache=tmp_path / f"l-{name}"
            )
        got = list(DataLoader(ds, batch_size=None, num_workers=1))
        assert len(got) == len(clips)
        for x, clip in zip(got, clips, strict=True):
            assert torch.equal(x, run_now(module, audio_tensor(clip)))


# == requests: no HEAD where a GET's response or the listing answers ===============================
def object_requests(s3: Any, mark: int, target: str) -> list[tuple[str, int]]:
    """(method, status) of the requests the server answered since ``mark`` for the object at
    ``target`` (``/bucket/key``), and ``("LIST", status)`` for each listing of the bucket."""
    out = []
    for r in s3.requests(mark):
        if "list-type=2" in r.name:
            out.append(("LIST", r.status))
        elif r.name.partition("?")[0] == target:
            out.append((r.method, r.status))
    return out


def test_listing_and_hashing_a_bucket_shard_of_large_members_fetches_it_about_once(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a bucket tar's headers fetched 64 KiB at each header, so a shard of members
    larger than that was fetched 1.61x to be listed and hashed (the bytes of each member
    after its header, skipped, then fetched again to hash). Now a block skipped past after its
    first few KiB is followed by small ones: ~1.0x, counted in the GETs' bodies. The digests
    are the members' SHA-256 (and a shard of small members still lists in a GET or two)."""
    import random

    from featbake.encode.fingerprints import HeldBytes
    from featbake.encode.webdataset import WebDataset
    from featbake.store.objects import ObjectStore

    rng = random.Random(3)
    big = [(f"s{i:03d}", {"bin": rng.randbytes(100_000 + 977 * i)}) for i in range(12)]
    small = [(f"t{i:03d}", {"bin": rng.randbytes(700)}) for i in range(40)]
    prefix = f"s3://{s3.bucket}/shards"
    shards = {"big.tar": write_tar(tmp_path / "big.tar", big),
              "small.tar": write_tar(tmp_path / "small.tar", small)}  # fmt: skip
    upload_shards(prefix, shards)
    fetched: list[int] = []
    real = ObjectStore.read_range_of

    def counted(self: ObjectStore, name: str, start: int, length: int) -> Any:
        got = real(self, name, start, length)
        fetched.append(len(got.data))
        return got

    monkeypatch.setattr(ObjectStore, "read_range_of", counted)
    for name, samples in (("big.tar", big), ("small.tar", small)):
        fetched.clear()
        shard = WebDataset(f"{prefix}/{name}")
        paths = [shard.path(r) for r in shard.scan([".bin"]).inputs]
        listing = len(fetched)
        digests, failed = shard.hash(catalog(tmp_path / f"c-{name}"), paths, held=HeldBytes())
        assert not failed
        assert [digests[p] for p in paths] == [sha256_hex(m["bin"]) for _, m in samples]
        size = shards[name].stat().st_size
        if name == "big.tar":
            assert sum(fetched) < 1.1 * size, (sum(fetched), size)  # 1.61x before
        else:  # 40 headers in the first 64 KiB (their data with them: hashed from a run GET)
            assert listing <= 2, fetched


def test_a_bucket_parquet_costs_one_head_a_build_and_none_per_cell_decoded(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket parquet's build made a LIST (asked whether it was tar shards), a HEAD at the
    scan, a HEAD after hashing, and a HEAD per cell decoded (each checked against the file's
    stat): 1 LIST + 10 HEADs for 8 cells. Now the scan's HEAD is the only one: the hash and
    each cell are checked by the ranged GETs' own responses (ETag, last change, size), and a
    rebuild makes that one request. Counted by the server; every row served is the encoder's
    now, and a file rewritten since its digests still fails its cells, by name."""
    import pickle

    import featbake.encode.fingerprints
    from featbake.encode.tables import Table

    images = photographs(tmp_path, 8)
    local = tmp_path / "images.parquet"
    pq.write_table(pa.table({"image": pa.array(images, pa.binary())}), local, row_group_size=2)
    folder = f"s3://{s3.bucket}/tables"
    upload_shards(folder, {"images.parquet": local})
    url, target = f"{folder}/images.parquet", f"/{s3.bucket}/tables/images.parquet"
    # No bytes held from hashing: every cell is decoded from the bucket, checked.
    monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    encoder, store = image_encoder(), tmp_path / "store"
    mark = s3.log_mark()
    report = build(url, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column="image")
    assert (report.encoded, report.failed) == (len(images), [])
    asked = object_requests(s3, mark, target)
    assert [a for a in asked if a[0] != "GET"] == [("HEAD", 200)], asked  # the scan's, alone
    assert all(a == ("GET", 206) for a in asked if a[0] == "GET"), asked  # ranged reads only
    stored = stored_features(store, report.root)
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key

    mark = s3.log_mark()
    again = build(url, encoder, cache=store, recipe=IMAGE_RECIPE, workers=0, column="image")
    assert (again.encoded, again.reused) == (0, len(images))
    assert object_requests(s3, mark, target) == [("HEAD", 200)]  # schema, ids, digests cached

    table = Table(url, "image")
    rels = table.scan(source_for(IMAGE_RECIPE).extensions).inputs
    source = table.source(source_for(IMAGE_RECIPE))
    stat, path = table.listed[url], table.path(rels[5])
    worker = pickle.loads(pickle.dumps(source))  # as a decode worker gets it: opens its own
    mark = s3.log_mark()
    got = worker.load_unchanged(path, stat)
    assert torch.equal(got, image_tensor(images[5]))
    assert {a for a in object_requests(s3, mark, target)} == {("GET", 206)}  # no HEAD
    rewritten = tmp_path / "other.parquet"
    pq.write_table(pa.table({"image": pa.array(images[::-1], pa.binary())}), rewritten)
    upload_shards(folder, {"images.parquet": rewritten})
    late = pickle.loads(pickle.dumps(source))
    with pytest.raises(SourceError, match=r"images.parquet:5: changed while"):
        late.load_unchanged(path, stat)


def test_bucket_shards_are_hashed_with_no_head_and_a_rewrite_still_fails_them(
    s3: Any, tmp_path: Path
) -> None:
    """Hashing a bucket's tar shards made a HEAD of each after reading it (its stat, to check
    it held still), though the listing had its stat and every ranged GET's response carries
    the object's ETag, last change and size. Now those responses are checked against the
    listing: a first build makes LISTs and ranged GETs only. A shard rewritten between the
    listing and the hashing still fails its samples, naming it; the other shard's stand."""
    from featbake.encode.webdataset import WebDataset

    images = photographs(tmp_path)
    half = len(images) // 2
    shards = {
        "shard-000.tar": write_tar(tmp_path / "a.tar", image_samples(images[:half])),
        "shard-001.tar": write_tar(tmp_path / "b.tar", image_samples(images[half:], half)),
    }
    prefix = f"s3://{s3.bucket}/shards"
    upload_shards(prefix, shards)
    encoder, store = image_encoder(), tmp_path / "store"
    mark = s3.log_mark()
    report = build(prefix + "/", encoder, cache=store, recipe=IMAGE_RECIPE, workers=0)
    assert (report.encoded, report.failed) == (len(images), [])
    methods = [(r.method, r.status) for r in s3.requests(mark)]
    assert ("HEAD", 200) not in methods, methods  # one per shard before
    assert {m for m, _ in methods} == {"GET"}
    stored = stored_features(store, report.root)
    for (key, parts), jpg in zip(stored.items(), images, strict=True):
        assert torch.equal(parts[""], run_now(encoder, image_tensor(jpg))), key

    shards_now = WebDataset(prefix + "/")
    paths = [shards_now.path(r) for r in shards_now.scan([".jpg"]).inputs]
    other = write_tar(tmp_path / "c.tar", image_samples(images[half:][::-1], half))
    upload_shards(prefix, {"shard-001.tar": other})  # after the listing, before the hashing
    digests, failed = shards_now.hash(catalog(tmp_path / "fresh"), paths)
    assert sorted(digests) == paths[:half]
    assert sorted(failed) == paths[half:]
    assert all("shard-001.tar changed while featbake was reading it" in w for w in failed.values())


def swap_folders(a: Path, b: Path) -> None:
    """Exchange folders ``a`` and ``b`` by renames (their files keep their stats)."""
    spare = a.parent / f"{a.name}.swap"
    os.rename(a, spare)
    os.rename(b, a)
    os.rename(spare, b)


def swap_back_after_scan(
    kind: Any, data: Path, other: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put ``other`` in ``data``'s place now, for the build's scan (``kind.scan``), and swap
    the two back right after that scan: the version hashed before is in place again."""
    swap_folders(data, other)
    real_scan = kind.scan

    def scan_then_swap(self: Any, extensions: Any) -> Any:
        got = real_scan(self, extensions)
        swap_folders(data, other)
        return got

    monkeypatch.setattr(kind, "scan", scan_then_swap)


def test_two_columns_of_one_table_are_two_roots_and_gc_keeps_both(
    tmp_path: Path, encoder_file: Path
) -> None:
    """Old main named the root by (table, encoder, recipe) alone: the build of ``--column far``
    replaced the root of ``--column audio``, and gc then freed every feature of the first."""
    from featbake.upkeep import GcOptions, execute_gc, plan_gc

    near = [wav_bytes(0.3 + 0.1 * i, i) for i in range(4)]
    far = [wav_bytes(0.5 + 0.1 * i, 10 + i) for i in range(4)]
    table = write_audio_parquet(tmp_path / "t.parquet", list(near), far=far)
    store = tmp_path / "store"
    for column in ("audio", "far"):
        assert build(table, encoder_file, cache=store, workers=0, column=column).encoded == 4
    roots = json.loads(invoke("roots", "--cache", store, "--json").stdout)
    assert len(roots) == 2 and {r["data"] for r in roots} == {str(table)}
    plan = plan_gc(store, GcOptions())
    execute_gc(plan)
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for column, clips in (("audio", near), ("far", far)):
        ds = CachedFeatureDataset(table, encoder_file, cache=store, column=column, on_miss="error")
        for i, clip in enumerate(clips):
            assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), (column, i)
    assert build(table, encoder_file, cache=store, workers=0, column="far").encoded == 0


def test_a_shard_swapped_back_after_its_listing_is_not_decoded_at_the_other_versions_offsets(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build scans shard version A (its members' offsets), then the folder is swapped back
    to version B, whose member digests the hash cache holds (hashed earlier: a dataset or a
    build over it). B holds the same members in the other order, so the digests come from
    the cache (B's stat is unchanged: a directory rename keeps its files' stats), and each
    member was decoded at A's offset in B: the other member's bytes, stored under this one's
    key. Now such a member fails by name; every feature stored is the encoder's now."""
    clips = {f"k{i}": wav_bytes(0.5, 20 + i) for i in range(2)}
    data, other = tmp_path / "shards", tmp_path / "shards-a"
    data.mkdir(), other.mkdir()
    write_tar(data / "s.tar", [(k, {"wav": clips[k]}) for k in ("k1", "k0")])  # version B
    write_tar(other / "s.tar", [(k, {"wav": wav_bytes(0.5, 30)}) for k in ("k0", "k1")])  # A
    store = tmp_path / "store"
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    known = WebDataset(str(data))
    paths = [known.path(r) for r in known.scan([".wav"]).inputs]
    with Catalog(Layout(store).ensure()) as cat:
        assert not known.hash(cat, paths)[1]  # B's digests cached

    swap_back_after_scan(WebDataset, data, other, monkeypatch)
    report = build(data, encoder_file, cache=store, workers=0)
    assert report.encoded == 0 and sorted(k for k, _ in report.failed) == ["k0", "k1"]
    assert all("replaced since its members were listed" in why for _, why in report.failed)
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for key, parts in stored_features(store, report.root).items():
        assert torch.equal(parts[""], run_now(module, audio_tensor(clips[key]))), key


@pytest.mark.parametrize("workers", [0, 2])
def test_a_table_swapped_back_after_its_scan_serves_each_id_its_own_cell(
    tmp_path: Path, encoder_file: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build scans table version A (each id's row), then the folder is swapped back to
    version B, whose cells the hash cache knows (its stat is unchanged by the directory
    renames), holding the same ids in the other order. Each id's row is A's, so B's cells
    must not stand for them: they fail by name. Before, a decode worker opened B afresh and
    found it unchanged since its digest, so id u0 was stored and served with u1's features."""
    clips = {f"u{i}": wav_bytes(0.5, 40 + i) for i in range(2)}
    data, other = tmp_path / "table", tmp_path / "table-a"
    data.mkdir(), other.mkdir()
    write_audio_parquet(data / "t.parquet", [clips["u1"], clips["u0"]], id=["u1", "u0"])  # B
    write_audio_parquet(other / "t.parquet", [clips["u0"], clips["u1"]], id=["u0", "u1"])  # A
    store = tmp_path / "store"
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # rows trusted at once, as later
    known = Table(str(data))
    paths = [known.path(r) for r in known.scan(source_for(Recipe()).extensions).inputs]
    with Catalog(Layout(store).ensure()) as cat:
        assert not known.hash(cat, paths)[1]  # B's cells cached

    swap_back_after_scan(Table, data, other, monkeypatch)
    report = build(data, encoder_file, cache=store, workers=workers)
    assert report.encoded == 0 and sorted(k for k, _ in report.failed) == ["u0", "u1"]
    assert all("replaced since its rows were read" in why for _, why in report.failed), report
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for key, parts in stored_features(store, report.root).items():
        assert torch.equal(parts[""], run_now(module, audio_tensor(clips[key]))), key


def test_a_samples_carried_members_are_not_read_from_a_shard_renamed_over_since(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A dataset reads a sample's other members (its label) when asked, perhaps hours after
    its scan listed their offsets. A shard renamed over since holds other bytes there: the
    label fails naming the shard, never another sample's label. Before, sample k0 was given
    k1's class (the new shard holds the samples in the other order)."""
    clips = {f"k{i}": wav_bytes(0.5, 50 + i) for i in range(2)}

    def shard(path: Path, order: list[str]) -> Path:
        return write_tar(path, [(k, {"wav": clips[k], "cls": k[1:].encode()}) for k in order])

    tar = shard(tmp_path / "s.tar", ["k0", "k1"])
    store = tmp_path / "store"
    assert build(tar, encoder_file, cache=store, workers=0).ok
    ds = CachedFeatureDataset(tar, encoder_file, cache=store, on_miss="error")
    assert [ds.row(i) for i in range(2)] == [{"cls": 0}, {"cls": 1}]
    os.replace(shard(tmp_path / "next.tar", ["k1", "k0"]), tar)
    for i in range(2):
        with pytest.raises(SourceError, match="replaced since its members were listed"):
            ds.row(i)


def test_a_rows_carried_columns_are_not_read_from_a_table_file_rewritten_since(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A dataset reads a row's other columns (its label) when asked, through the reader its
    scan opened. An Arrow file rewritten in place since (the reader's memory map shows the
    new bytes at the old offsets) fails naming the file, never another row's label. Before,
    row u0 was given u1's label (the new file holds the rows in the other order)."""
    clips = {f"u{i}": wav_bytes(0.5, 60 + i) for i in range(2)}
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

    def arrow(path: Path, order: list[str]) -> Path:
        cells = [{"bytes": clips[u], "path": f"{u}.wav"} for u in order]
        table = pa.table(
            {"id": order, "audio": pa.array(cells, type=media), "label": [int(u[1]) for u in order]}
        )
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
        return path

    path = arrow(tmp_path / "t.arrow", ["u0", "u1"])
    store = tmp_path / "store"
    assert build(path, encoder_file, cache=store, workers=0).ok
    ds = CachedFeatureDataset(path, encoder_file, cache=store, on_miss="error")
    assert [ds.row(i) for i in range(2)] == [{"label": 0}, {"label": 1}]
    new = arrow(tmp_path / "next.arrow", ["u1", "u0"]).read_bytes()
    assert len(new) == path.stat().st_size
    with open(path, "r+b") as f:  # in place: the same file the reader maps
        f.write(new)
    for i in range(2):
        with pytest.raises(SourceError, match="replaced since its rows were read"):
            ds.row(i)


# == round four: containers ========================================================================
def write_sparse_wav(path: Path, seconds: float, seed: int) -> bytes:
    """A wav of a tone, a long run of zero samples and a tone again, written with the zero
    blocks as holes (seeked over): a sparse file, as ``tar -S`` finds them. Returns its bytes."""
    tone = np.asarray(make_tone(0.1, 16000, seed=seed), np.float32).reshape(-1)
    samples = np.concatenate([tone, np.zeros(int(seconds * 16000), np.float32), tone])
    out = io.BytesIO()
    soundfile.write(out, samples, 16000, format="WAV", subtype="PCM_16")
    data, block = out.getvalue(), 4096
    with open(path, "wb") as f:
        for at in range(0, len(data), block):
            chunk = data[at : at + block]
            if chunk.count(0) == len(chunk):
                f.seek(len(chunk), os.SEEK_CUR)  # a hole
            else:
                f.write(chunk)
        f.truncate(len(data))
    return data


def test_a_sparse_member_is_a_bad_row_naming_it_never_the_next_members_bytes(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A sparse member (GNU ``tar -S``) stores only its data blocks; it was read as ``size``
    contiguous bytes from its offset, running into the next member: wrong features, exit 0.
    Now it is one bad row naming it (exit 3), and the member after it is encoded right."""
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar program here")
    folder = tmp_path / "clips"
    folder.mkdir()
    write_sparse_wav(folder / "a.wav", 4.0, seed=1)
    after = wav_bytes(6.0, 2)  # longer than the sparse member: its misread stays in the tar
    (folder / "b.wav").write_bytes(after)
    tar = tmp_path / "sparse.tar"
    subprocess.run(["tar", "-S", "-cf", str(tar), "-C", str(folder), "a.wav", "b.wav"], check=True)
    with tarfile.open(tar) as tf:
        if not tf.getmember("a.wav").issparse():
            pytest.skip("this filesystem keeps no holes: tar -S wrote the member whole")
    out = invoke(
        "build", "--encoder", encoder_file, "--data", tar, "--cache", tmp_path / "store",
        "--workers", "0",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert f"{tar}:a.wav: a sparse member (GNU tar -S)" in text, text
    root = re.search(r"^root\s+(\S+)$", text, re.MULTILINE)
    assert root, text
    stored = stored_features(tmp_path / "store", root.group(1))
    assert list(stored) == ["b"]
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    torch.testing.assert_close(stored["b"][""], run_now(module, audio_tensor(after)))


def tar_with_a_torn_last_member(path: Path, clips: list[bytes], declared: int) -> Path:
    """A shard whose last member (``u1.txt``, carried) declares ``declared`` bytes and holds a
    few: a tar cut short inside it, or a forged header."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i, clip in enumerate(clips):
            info = tarfile.TarInfo(f"u{i}.wav")
            info.size = len(clip)
            tf.addfile(info, io.BytesIO(clip))
        whole = buf.getvalue()[: tf.offset]
    torn = tarfile.TarInfo("u1.txt")
    torn.size = declared
    path.write_bytes(whole + torn.tobuf(tarfile.GNU_FORMAT) + b"the words" * 10)
    return path


def test_a_member_declaring_more_bytes_than_the_tar_holds_is_named_never_allocated(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A carried member declaring 1 TiB in a shard cut short gave a bare MemoryError from
    ``ds.row()`` (its declared size allocated to read it). Now the scan names it in one line
    and ``row()`` raises that line; the samples' features are built and served."""
    clips = [wav_bytes(0.4, i) for i in range(2)]
    tar = tar_with_a_torn_last_member(tmp_path / "s.tar", clips, 1 << 40)
    store = tmp_path / "store"
    report = build(tar, encoder_file, cache=store, workers=0)
    assert report.encoded == 2
    named = [f"{path}: {why}" for path, why in report.failed]
    assert named == [f"{tar}:u1.txt: truncated tar member (90 of {1 << 40} bytes); "
                     "rewrite or re-download the shard"], named  # fmt: skip
    ds = CachedFeatureDataset(tar, encoder_file, cache=store, on_miss="error")
    assert ds.row(0) == {}
    with pytest.raises(SourceError) as raised:
        ds.row(1)
    assert str(raised.value) == named[0]


def test_gzip_tar_shards_are_read_as_one_stream_built_served_and_verified(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``.tar.gz`` shards (as webdataset reads them) were "not a directory" or "no input files".
    Now each is read as one gzip stream: listed, hashed and decoded in order, its other members
    carried, its hash rows checked by verify; served features are the encoder's now."""
    import gzip
    import time

    from featbake.upkeep import verify
    from featbake.upkeep.check import check_hash_cache

    clips = [wav_bytes(0.3 + 0.1 * i, 10 + i) for i in range(5)]
    folder = tmp_path / "shards"
    folder.mkdir()
    for n, part in enumerate((clips[:3], clips[3:])):
        plain = write_tar(
            tmp_path / f"p{n}.tar",
            [(f"s{n}-{i}", {"wav": c, "cls": str(i).encode()}) for i, c in enumerate(part)],
        )
        (folder / f"shard-{n}.tar.gz").write_bytes(gzip.compress(plain.read_bytes()))
    time.sleep(1.1)  # past the racy window: the hash rows are trusted, so verify checks them
    store = tmp_path / "store"
    for data in (folder, folder / "shard-{0..1}.tar.gz"):
        report = build(data, encoder_file, cache=store, workers=0)
        assert (report.failed, report.encoded + report.reused) == ([], 5), report.failed
    ds = CachedFeatureDataset(folder, encoder_file, cache=store, on_miss="error")
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], run_now(module, audio_tensor(clip)), msg=str(i))
    assert [ds.row(i) for i in range(5)] == [{"cls": i} for i in (0, 1, 2, 0, 1)]
    assert check_hash_cache(Layout(store)).files_read == 5
    assert verify(store).status == "clean"


def test_gzip_tar_shards_in_a_bucket_are_streamed_by_ranges_built_and_served(
    s3: Any, tmp_path: Path, encoder_file: Path, gets: list[tuple[str, int]]
) -> None:
    """A ``.tar.gz`` shard in a bucket was refused in one line ("not read in place"), then read
    whole. Now its stream is fetched through the byte seam by ranged GETs and decompressed as
    it comes (a gzip stream cannot be read by ranges, but it can be streamed): a first build
    reads each shard once to list it and once to hash it (decoding from the bytes hashed), no
    GET of a whole object, a rebuild and a dataset over the store GET nothing; features and
    carried members are the encoder's now, and a shard cut short fails its torn member only."""
    import gzip

    clips = [wav_bytes(0.3 + 0.1 * i, 10 + i) for i in range(5)]
    shards = {}
    for n, part in enumerate((clips[:3], clips[3:])):
        plain = write_tar(
            tmp_path / f"p{n}.tar",
            [(f"s{n}-{i}", {"wav": c, "cls": str(i).encode()}) for i, c in enumerate(part)],
        )
        shards[f"shard-{n}.tar.gz"] = tmp_path / f"shard-{n}.tar.gz"
        shards[f"shard-{n}.tar.gz"].write_bytes(gzip.compress(plain.read_bytes()))
    prefix = f"s3://{s3.bucket}/shards"
    upload_shards(prefix, shards)
    store = tmp_path / "store"
    report = build(prefix + "/", encoder_file, cache=store, workers=0)
    assert (report.failed, report.encoded) == ([], 5), report.failed
    assert all(length > 0 for _, length in gets), gets  # ranged, never whole
    assert sorted(n for n, _ in gets) == sorted([f"shards/{n}" for n in shards] * 2)  # small
    gets.clear()
    again = build(prefix + "/", encoder_file, cache=store, workers=0)
    assert (again.encoded, again.reused, again.root) == (0, 5, report.root)
    ds = CachedFeatureDataset(prefix + "/", encoder_file, cache=store, on_miss="error")
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], run_now(module, audio_tensor(clip)), msg=str(i))
    assert gets == []  # listings and digests from the hash cache, by ETag, size and date
    assert [ds.row(i) for i in range(5)] == [{"cls": i} for i in (0, 1, 2, 0, 1)]

    torn = gzip.compress(write_tar(tmp_path / "t.tar", [("t-0", {"wav": clips[0]})]).read_bytes())
    (tmp_path / "torn.tar.gz").write_bytes(torn[: len(torn) // 2])
    upload_shards(f"s3://{s3.bucket}/torn", {"torn.tar.gz": tmp_path / "torn.tar.gz"})
    cut = build(f"s3://{s3.bucket}/torn/torn.tar.gz", encoder_file, cache=store, workers=0)
    assert cut.encoded == 0 and cut.failed, cut.failed
    assert "truncated tar member" in cut.failed[0][1] and len(cut.failed) == 1, cut.failed


def test_a_gzip_shards_members_read_in_order_decompress_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzip tar's members are read from one stream kept where the last read ended: decoding
    them in tar order (a build beyond its held bytes, a dataset's misses) opens the stream
    once, not once per member (each a decompression from the start: quadratic); a member
    before the position, or the file rewritten, starts it again. Bytes are the members'."""
    import gzip

    import featbake.store.containers as stored

    clips = [wav_bytes(0.2, 30 + i) for i in range(6)]
    plain = write_tar(tmp_path / "p.tar", [(f"u{i}", {"wav": c}) for i, c in enumerate(clips)])
    tar = tmp_path / "s.tar.gz"
    tar.write_bytes(gzip.compress(plain.read_bytes()))
    opened: list[str] = []
    real_open = stored.open_stream

    def open_stream(path: str) -> Any:
        opened.append(path)
        return real_open(path)

    monkeypatch.setattr(stored, "open_stream", open_stream)
    inputs = WebDataset(str(tar))
    paths = [inputs.path(r) for r in inputs.scan([".wav"]).inputs]
    source = inputs.source(source_for(Recipe()))
    assert [source.read(p) for p in paths] == clips
    assert opened == [str(tar)]
    assert source.read(paths[1]) == clips[1] and len(opened) == 2  # back: from the start
    tar.write_bytes(gzip.compress(plain.read_bytes()))  # rewritten: another stat
    os.utime(tar, ns=(1, 1))
    assert source.read(paths[2]) == clips[2] and len(opened) == 3


# == round nine: what a folder's listing reads, and what it leaves out ============================
def test_a_parquet_folder_passes_over_the_files_pyarrow_passes_over(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A writer's leftovers beside its parquet files (Spark's ``_SUCCESS`` and
    ``_committed_*``, a hidden ``.part-1.tmp.parquet`` being written, a ``_tmp.parquet``, a
    ``.crc``) are no data to pyarrow's dataset discovery (``ignore_prefixes`` ``['.', '_']``).
    featbake read the ``.parquet`` ones as rows (a half-written file served as data), and a
    ``_SUCCESS`` beside them made the folder no table at all (``--column`` refused as for a
    folder of files). Now the folder is the files pyarrow reads: built and served in
    pyarrow's order with its labels, each equal to the encoder run now."""
    import pyarrow.dataset as pads

    data = tmp_path / "spark-out"
    data.mkdir()
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(5)]
    write_audio_parquet(data / "part-00000.parquet", clips[:2], label=[1, 2])
    write_audio_parquet(data / "part-00001.parquet", clips[2:3], label=[3])
    write_audio_parquet(data / ".part-00002.tmp.parquet", clips[3:4], label=[98])
    write_audio_parquet(data / "_tmp.parquet", clips[4:], label=[99])
    for name in ("_SUCCESS", "_committed_4711", ".part-00000.parquet.crc"):
        (data / name).write_bytes(b"")
    read = pads.dataset(str(data))  # the plain alternative: what pyarrow reads of the folder
    assert [os.path.basename(f) for f in read.files] == ["part-00000.parquet", "part-00001.parquet"]
    labels = read.to_table().column("label").to_pylist()
    assert is_table(str(data))
    assert Table(str(data), "audio").scan([".wav"]).inputs == [
        "part-00000.parquet:0", "part-00000.parquet:1", "part-00001.parquet:0",
    ]  # fmt: skip
    store = tmp_path / "store"
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store,
                    "--column", "audio")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, column="audio", on_miss="error")
    assert [ds.row(i)["label"] for i in range(len(ds))] == labels == [1, 2, 3]
    for i in range(len(ds)):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i]))), ds.item_id(i)


@pytest.mark.parametrize(
    ("layout", "said"),
    [
        ({"train-000.tar": 0, "valid-000.tar": 1}, "train (1 file), validation (1 file)"),
        ({"train/000.tar": 0, "test/000.tar": 1}, "train (1 file), test (1 file)"),
        ({"train/000.tar": 0, "extra/000.tar": 1}, "name no split (extra/000.tar)"),
    ],
)
def test_a_bucket_prefix_of_tars_of_several_splits_is_refused_as_a_local_folder_is(
    s3: Any, tmp_path: Path, encoder_file: Path, layout: dict[str, int], said: str
) -> None:
    """``s3://bucket/wds/`` holding ``train-000.tar`` beside ``valid-000.tar`` (or ``train/``
    beside ``test/``) was built as one dataset, the held-out samples served as training ones,
    where the same files in a local folder are refused: ``datasets`` reads them as splits (its
    own split patterns, checked on a local copy of the layout). The prefix is refused by the
    same rule in one line (exit 8, and from a dataset); one split's prefix is built and
    served equal to the encoder run now."""
    datasets = pytest.importorskip("datasets")
    clips = [wav_bytes(0.3 + 0.1 * i, 60 + i) for i in range(2)]
    tars = [write_tar(tmp_path / f"{i}.tar", [(f"k{i}", {"wav": clips[i]})]) for i in (0, 1)]
    mirror = tmp_path / "mirror"
    for name in layout:
        (mirror / name).parent.mkdir(parents=True, exist_ok=True)
        (mirror / name).write_bytes(b"")
    assert len(datasets.data_files.get_data_patterns(str(mirror))) == 2 or "no split" in said
    prefix = f"s3://{s3.bucket}/wds/"
    upload_shards(prefix, {name: tars[i] for name, i in layout.items()})
    store = tmp_path / "store"
    result = invoke("build", "--data", prefix, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and said in line and f"s3://{s3.bucket}/wds" in line, line
    with pytest.raises(SourceError, match=re.escape(said)):
        CachedFeatureDataset(prefix, encoder_file, cache=store)
    first = next(iter(layout))
    one = f"s3://{s3.bucket}/wds/{first}"
    assert build(one, encoder_file, cache=store, workers=0).encoded == 1
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(one, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["k0"]
    assert torch.equal(ds[0], run_now(module, audio_tensor(clips[0])))


def test_a_shards_samples_are_the_ones_webdataset_reads_metadata_folders_left_out(
    tmp_path: Path, encoder_file: Path
) -> None:
    """webdataset's tar reader skips a top-level ``__name__`` member and everything in a
    top-level ``__name__/`` folder (``skip_meta``) as metadata; featbake made
    ``__meta__/s1.wav`` a sample of its own, an item the user's webdataset loader never sees.
    Now the samples are webdataset's own (its reader run on the shard), and each is served
    equal to the encoder run now."""
    wds = pytest.importorskip("webdataset")
    clips = [wav_bytes(0.3 + 0.1 * i, 80 + i) for i in range(4)]
    tar = tmp_path / "shard-000.tar"
    with tarfile.open(tar, "w") as tf:
        for name, data in (
            ("s0.wav", clips[0]), ("s0.cls", b"0"), ("__meta__/s1.wav", clips[1]),
            ("__index__", b"{}"), ("__thumbs__/x/s2.wav", clips[2]), ("s3.wav", clips[3]),
        ):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    theirs = [s["__key__"] for s in wds.WebDataset(str(tar), shardshuffle=False) if "wav" in s]
    assert theirs == ["s0", "s3"]
    assert WebDataset(str(tar)).scan([".wav"]).inputs == theirs
    store = tmp_path / "store"
    report = build(tar, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(tar, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == theirs
    for i, clip in enumerate((clips[0], clips[3])):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), i


def test_a_key_in_two_shards_is_refused_saying_how_to_fix_the_data(tmp_path: Path) -> None:
    """webdataset serves two samples of one key (in two shards, or ``a.b.wav`` and ``a.c.wav``,
    whose key is ``a`` in both) as two; featbake names each item by its key, and one id cannot
    name two features, so it refuses the shards, now saying how to fix them: rename one
    sample's members, or build the shards apart."""
    clip = wav_bytes(0.3, 90)
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tar(folder / "shard-000.tar", [("utt.a", {"wav": clip})])
    write_tar(folder / "shard-001.tar", [("utt.b", {"wav": clip})])
    with pytest.raises(SourceError) as told:
        WebDataset(str(folder)).scan([".wav"])
    said = str(told.value)
    assert "two samples have the key 'utt'" in said and "\n" not in said, said
    assert "rename one sample's members" in said and "up to the first dot" in said, said
    assert "build each set of shards as its own --data" in said, said


def test_a_bucket_prefix_of_parquet_is_read_as_a_local_folder_of_them_is(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """``s3://bucket/out/`` holding only parquet objects (and a writer's leftovers) was taken
    for a prefix of audio objects: ``--column`` refused as for a folder of files, and without
    it "none of them input files". It is now the table a local folder of the same files is:
    the names pyarrow passes over left out (``_SUCCESS``, a hidden temporary file, Spark's
    ``_temporary/``), built and served in pyarrow's order with its labels, equal to the encoder
    run now, a rebuild reusing every row; a prefix of two splits is refused in one line."""
    import pyarrow.dataset as pads

    clips = [wav_bytes(0.3 + 0.1 * i, 100 + i) for i in range(5)]
    mirror = tmp_path / "mirror"
    (mirror / "_temporary" / "0").mkdir(parents=True)
    write_audio_parquet(mirror / "part-00000.parquet", clips[:2], label=[1, 2])
    write_audio_parquet(mirror / "part-00001.parquet", clips[2:3], label=[3])
    write_audio_parquet(mirror / ".part-00002.tmp.parquet", clips[3:4], label=[98])
    write_audio_parquet(mirror / "_temporary" / "0" / "part-00003.parquet", clips[4:], label=[99])
    (mirror / "_SUCCESS").write_bytes(b"")
    read = pads.dataset(str(mirror))  # the plain alternative, on a local copy
    assert read.to_table().column("label").to_pylist() == [1, 2, 3]
    prefix = f"s3://{s3.bucket}/out/"
    upload_shards(prefix, {str(p.relative_to(mirror)): p for p in mirror.rglob("*") if p.is_file()})
    store = tmp_path / "store"
    report = build(prefix, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded, report.failed) == (3, [])
    assert report.data == f"s3://{s3.bucket}/out"
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(prefix, encoder_file, cache=store, column="audio", on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == [
        "part-00000.parquet:0", "part-00000.parquet:1", "part-00001.parquet:0",
    ]  # fmt: skip
    assert [ds.row(i)["label"] for i in range(len(ds))] == [1, 2, 3]
    for i in range(len(ds)):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i]))), i
    again = build(prefix, encoder_file, cache=store, workers=0, column="audio")
    assert (again.encoded, again.reused, again.root) == (0, 3, report.root)

    splits = f"s3://{s3.bucket}/splits/"
    named = {"train-00000-of-00001.parquet": "part-00000.parquet",
             "test-00000-of-00001.parquet": "part-00001.parquet"}  # fmt: skip
    upload_shards(splits, {name: mirror / local for name, local in named.items()})
    result = invoke("build", "--data", splits, "--encoder", encoder_file, "--cache", store,
                    "--column", "audio")  # fmt: skip
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1 and "train (1 file), test (1 file)" in said, said


def test_utterances_whose_names_hold_a_dot_are_not_left_out_unsaid(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A folder of ``spk1.utt1.wav``, ``spk1.utt2.wav``, ``spk2.utt1.wav`` tarred as it is:
    webdataset's key ends at the first dot, so ``spk1``'s two clips are one sample (its own
    reader run on the shard says so). The build encoded the first and left the second out
    without a word; now the build says so in one note (how many, an example, both choices;
    exit 0: nothing failed), and ``--column`` picks the member as asked, with no note."""
    wds = pytest.importorskip("webdataset")
    clips = [wav_bytes(0.3 + 0.1 * i, 120 + i) for i in range(3)]
    tar = tmp_path / "shard-000.tar"
    with tarfile.open(tar, "w") as tf:
        for name, data in zip(
            ("spk1.utt1.wav", "spk1.utt2.wav", "spk2.utt1.wav"), clips, strict=True
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    theirs = {
        s["__key__"]: sorted(k for k in s if not k.startswith("__"))
        for s in wds.WebDataset(str(tar), shardshuffle=False)
    }
    assert theirs == {"spk1": ["utt1.wav", "utt2.wav"], "spk2": ["utt1.wav"]}
    store = tmp_path / "store"
    res = invoke("build", "--data", tar, "--encoder", encoder_file, "--cache", store)
    assert res.returncode == 0, res.stdout + res.stderr
    said = res.stdout + res.stderr
    assert "1 sample member of the kind encoded left out" in said, said
    assert "shard-000.tar:spk1.utt2.wav beside spk1.utt1.wav, sample 'spk1'" in said, said
    assert "--column utt2.wav encodes the other" in said and "keys without dots" in said, said
    report = build(tar, encoder_file, cache=store, workers=0, column="utt1.wav")
    assert report.failed == [] and report.encoded + report.reused == 2
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(tar, encoder_file, cache=store, column="utt1.wav", on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["spk1", "spk2"]
    for i, clip in enumerate((clips[0], clips[2])):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), i


def test_a_local_folder_of_shards_or_tables_counts_its_subfolders_as_a_bucket_prefix_does(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A bucket prefix's listing holds its sub-prefixes' objects; a local folder's listing of
    tars and parquet files held its top level only. ``shards/a.tar`` beside ``shards/sub/b.tar``
    built ``a.tar`` alone, ``sub/b.tar``'s samples left out unsaid (``datasets`` and a bucket
    prefix read both); ``data/train/*.parquet`` beside ``data/test/*.parquet`` was no table
    (``--column`` refused as for a folder of files) where ``datasets`` reads two splits. Now a
    local folder is walked as a prefix is listed: the shards are built and served equal to the
    encoder run now, and the two splits refused in one line naming them."""
    datasets = pytest.importorskip("datasets")
    clips = [wav_bytes(0.3 + 0.1 * i, 140 + i) for i in range(3)]
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    write_tar(shards / "a.tar", [("t0", {"wav": clips[0]})])
    write_tar(shards / "sub" / "b.tar", [("t1", {"wav": clips[1]})])
    store = tmp_path / "store"
    report = build(shards, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(shards, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["t0", "t1"]
    for i in range(2):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clips[i]))), i

    data = tmp_path / "data"
    for split, pick in (("train", clips[:2]), ("test", clips[2:])):
        (data / split).mkdir(parents=True)
        write_audio_parquet(data / split / "0000.parquet", pick, label=list(range(len(pick))))
    assert sorted(datasets.data_files.get_data_patterns(str(data))) == ["test", "train"]
    result = invoke("build", "--data", data, "--encoder", encoder_file, "--cache", store,
                    "--column", "audio")  # fmt: skip
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1 and "train (1 file), test (1 file)" in said, said


# == round nine, inputs: corrections ==============================================================
def test_a_shard_folder_beside_a_subfolder_of_other_files_builds_its_shards(
    tmp_path: Path, encoder_file: Path
) -> None:
    """in9.7 judged a tar folder by every file under it: ``wds/shard-000.tar`` beside
    ``wds/preview/listen.wav`` built the preview alone (exit 0, the shard's samples left out
    unsaid), and beside ``notes/log.txt`` failed with "no input files". The top level decides
    again: both build the shard's 4 samples, served equal to the encoder run now. A top level
    holding a tar beside another file is one line saying so (exit 8), never an audio build."""
    clips = [wav_bytes(0.3 + 0.05 * i, 160 + i) for i in range(4)]
    store = tmp_path / "store"
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    beside = (("preview", "listen.wav", wav_bytes(0.3, 9)), ("notes", "log.txt", b"x"))
    for sub, name, data in beside:
        wds = tmp_path / sub / "wds"
        (wds / sub).mkdir(parents=True)
        write_tar(wds / "shard-000.tar", [(f"utt{i}", {"wav": c}) for i, c in enumerate(clips)])
        (wds / sub / name).write_bytes(data)
        report = build(wds, encoder_file, cache=store, workers=0)
        assert (report.encoded + report.reused, report.failed) == (4, []), sub
        ds = CachedFeatureDataset(wds, encoder_file, cache=store, on_miss="error")
        assert [ds.item_id(i) for i in range(len(ds))] == [f"utt{i}" for i in range(4)]
        for i, clip in enumerate(clips):
            assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), (sub, i)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_tar(mixed / "shard-000.tar", [("utt0", {"wav": clips[0]})])
    (mixed / "listen.wav").write_bytes(clips[1])
    result = invoke("build", "--data", mixed, "--encoder", encoder_file, "--cache", store)
    assert result.returncode == 8, result.stdout + result.stderr
    said = result.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert "holds tar shards (shard-000.tar, 1 in all) beside other files (listen.wav)" in said


class CountedScandir:
    """``os.scandir`` counting the entries the code under test reads (not a timing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries = 0
        real = os.scandir

        def scandir(path: Any = ".") -> Any:
            return self.Counted(real(path), self)

        monkeypatch.setattr(os, "scandir", scandir)

    class Counted:
        def __init__(self, it: Any, owner: CountedScandir) -> None:
            self.it, self.owner = it, owner

        def __enter__(self) -> CountedScandir.Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            for entry in self.it:
                self.owner.entries += 1
                yield entry

        def close(self) -> None:
            self.it.close()


def test_telling_a_large_audio_folder_is_neither_shards_nor_a_table_reads_few_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """in9.7's checks walked (read and sorted) a whole folder before judging its first file:
    on a 100,000-file folder 205 ms where 0.7 ms had done. Now each check reads entries as they
    come and stops at the first that says no: a folder of 3,000 clips (top level and a nested
    speaker folder) costs a few entries, not the folder."""
    flat = tmp_path / "flat"
    nested = tmp_path / "nested" / "spk1"
    for folder in (flat, nested):
        folder.mkdir(parents=True)
        for i in range(1500):
            (folder / f"c{i:05d}.wav").write_bytes(b"")
    counted = CountedScandir(monkeypatch)
    for where in (flat, nested.parent):
        counted.entries = 0
        assert not is_webdataset(str(where)) and not is_table(str(where))
        assert counted.entries <= 4, (where, counted.entries)


def test_a_sample_member_left_out_beside_its_kind_is_one_note_not_a_failure(
    tmp_path: Path, encoder_file: Path
) -> None:
    """in9.6 made ``x.wav`` beside ``x.noisy.wav`` (one sample ``x`` to webdataset) a failed
    input: every build exited 3 ("2 of 4 inputs failed ... rerun", which cannot help) and named
    ``--column noisy.wav`` alone. Now a build says it in one note line (how many, an example,
    both choices), exits 0, and each choice builds what it names, served equal to the encoder
    run now."""
    clean = [wav_bytes(0.3 + 0.1 * i, 180 + i) for i in range(2)]
    noisy = [wav_bytes(0.35 + 0.1 * i, 190 + i) for i in range(2)]
    tar = write_tar(
        tmp_path / "s.tar",
        [(k, {"wav": clean[i], "noisy.wav": noisy[i]}) for i, k in enumerate(("x", "y"))],
    )
    store = tmp_path / "store"
    res = invoke("build", "--data", tar, "--encoder", encoder_file, "--cache", store)
    assert res.returncode == 0, res.stdout + res.stderr
    notes = [line for line in res.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, res.stderr
    assert "2 sample members of the kind encoded left out" in notes[0], notes
    assert f"{tar}:x.noisy.wav beside x.wav" in notes[0], notes
    assert "--column wav keeps this choice, --column noisy.wav encodes the other" in notes[0]
    assert "failed" not in res.stderr, res.stderr
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for column, clips in ((None, clean), ("wav", clean), ("noisy.wav", noisy)):
        report = build(tar, encoder_file, cache=store, workers=0, column=column)
        assert report.failed == [] and bool(report.notes) == (column is None), report.notes
        ds = CachedFeatureDataset(tar, encoder_file, cache=store, column=column, on_miss="error")
        for i, clip in enumerate(clips):
            assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), (column, i)


@pytest.mark.parametrize("slash", ["/", ""])
def test_a_bucket_spark_output_prefix_named_dot_parquet_is_read_as_a_prefix(
    s3: Any, tmp_path: Path, encoder_file: Path, slash: str
) -> None:
    """``df.write.parquet("s3://b/out.parquet")`` writes a prefix named ``*.parquet``
    (``out.parquet/part-00000.snappy.parquet``, ``_SUCCESS``); in9.3 took the name for one
    object ("object not found"). The HEAD that finds no object now reads the name as a
    prefix: its rows built and served in pyarrow.dataset's order, equal to the encoder now."""
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(3)]
    mirror = tmp_path / "out.parquet"
    mirror.mkdir()
    write_audio_parquet(mirror / "part-00000.snappy.parquet", clips[:2], label=[1, 2])
    write_audio_parquet(mirror / "part-00001.snappy.parquet", clips[2:], label=[3])
    (mirror / "_SUCCESS").write_bytes(b"")
    prefix = f"s3://{s3.bucket}/out.parquet"
    upload_shards(prefix + "/", {p.name: p for p in mirror.iterdir()})
    store = tmp_path / "store"
    report = build(prefix + slash, encoder_file, cache=store, workers=0, column="audio")
    assert (report.encoded, report.failed, report.data) == (3, [], prefix)
    ds = CachedFeatureDataset(prefix + slash, encoder_file, cache=store, column="audio",
                              on_miss="error")  # fmt: skip
    import pyarrow.dataset as pads

    labels = pads.dataset(str(mirror)).to_table().column("label").to_pylist()
    assert [ds.row(i)["label"] for i in range(len(ds))] == labels == [1, 2, 3]
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    for i, clip in enumerate(clips):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), i


def test_tars_in_a_dunder_folder_are_passed_over_as_datasets_passes_them(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``datasets`` leaves files in ``__name__`` folders (``__MACOSX/``, ``__cache__/``) out
    of every split; in9.7's walk read their tars as shards, so a zip's ``__MACOSX/a.tar``
    copy beside ``a.tar`` was refused for its keys. Now they are passed over: ``a.tar``'s
    samples are built, served equal to the encoder now."""
    datasets = pytest.importorskip("datasets")
    clips = [wav_bytes(0.3 + 0.1 * i, 200 + i) for i in range(2)]
    data = tmp_path / "wds"
    for name in ("a.tar", "__MACOSX/a.tar", "__cache__/b.tar"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        write_tar(data / name, [(f"k{i}", {"wav": c}) for i, c in enumerate(clips)])
    patterns = datasets.data_files.get_data_patterns(str(data))
    files = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=str(data))
    assert [os.path.relpath(f, data) for fs in files.values() for f in fs] == ["a.tar"]
    store = tmp_path / "store"
    report = build(data, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["k0", "k1"]
    for i, clip in enumerate(clips):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), i


def test_an_unreadable_subfolder_of_a_shard_folder_is_one_note_not_left_out_unsaid(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """in9.7's walk passed over a subfolder it could not read, as ``os.walk`` does: its shards'
    samples were left out without a word. in9.13 failed the build on it; now (in9.14) the
    readable shards (or parquet files) build and the build's notes say, in one line, how many
    folders could not be read, the first, and what to do. The folder is made unreadable by its
    listing failing with EACCES (the tests may run as root)."""
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    write_tar(shards / "a.tar", [("t0", {"wav": wav_bytes(0.3, 1)})])
    write_tar(shards / "sub" / "b.tar", [("t1", {"wav": wav_bytes(0.3, 2)})])
    tables = tmp_path / "tables"
    (tables / "sub").mkdir(parents=True)
    write_audio_parquet(tables / "a.parquet", [wav_bytes(0.3, 3)])
    write_audio_parquet(tables / "sub" / "b.parquet", [wav_bytes(0.3, 4)])
    unreadable(monkeypatch, "sub")
    for data, column in ((shards, None), (tables, "audio")):
        report = build(data, encoder_file, cache=tmp_path / "store", workers=0, column=column)
        assert (report.encoded, report.failed) == (1, []), data
        (note,) = report.notes
        assert len(note.splitlines()) == 1
        assert note.startswith("1 folder under ") and f"{data / 'sub'}" in note
        assert "Permission denied" in note and "permissions" in note


def unreadable(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Listing a folder named ``name`` fails with EACCES (as ``lost+found``, mode 0700 and
    owned by root, does for every other user; the tests may run as root)."""
    real = os.scandir

    def scandir(path: Any = ".") -> Any:
        if not isinstance(path, int) and os.fspath(path).endswith(f"/{name}"):  # fd: rmtree's
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_a_shard_folder_at_a_volume_root_with_lost_and_found_builds(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """in9.13 failed every shard or parquet folder at a volume's root for a user other than
    root: ``lost+found`` (0700, root) cannot be listed. A folder that cannot hold inputs
    (``lost+found``, a ``__name__`` folder) is passed over without a word, unreadable or not."""
    data = tmp_path / "vol"
    (data / "lost+found").mkdir(parents=True)
    (data / "__MACOSX").mkdir()
    if kind == "tar":
        write_tar(
            data / "a.tar", [("t0", {"wav": wav_bytes(0.3, 1)}), ("t1", {"wav": wav_bytes(0.3, 2)})]
        )
        column = None
    else:
        write_audio_parquet(data / "a.parquet", [wav_bytes(0.3, 3), wav_bytes(0.3, 4)])
        column = "audio"
    unreadable(monkeypatch, "lost+found")
    report = build(data, encoder_file, cache=tmp_path / "store", workers=0, column=column)
    assert (report.encoded, report.failed, report.notes) == (2, [], [])


def test_an_audio_folder_with_an_unreadable_subfolder_says_so(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder scan passed over a subfolder it could not read without a word: its clips
    were left out, exit 0, while a shard folder said so. One rule for audio, shard and table
    folders now: the readable clips build, and one note says how many folders could not be
    read, the first, and what to do (in9.16)."""
    data = tmp_path / "audio"
    write_audio_folder(data / "spk1", 2, seconds=0.3, seed=1)
    write_audio_folder(data / "spk2", 2, seconds=0.3, seed=2)
    (data / "lost+found").mkdir()
    unreadable(monkeypatch, "spk2")
    monkeypatch.setattr(os, "scandir", unreadable_too(os.scandir, "lost+found"))
    report = build(data, encoder_file, cache=tmp_path / "store", workers=0)
    assert (report.encoded, report.failed) == (2, [])
    (note,) = report.notes
    assert note.startswith(f"1 folder under {data} could not be read ({data / 'spk2'}: ")
    assert "fix their permissions" in note and "--data" in note


def unreadable_too(scandir: Any, name: str) -> Any:
    """``scandir`` with a folder named ``name`` failing with EACCES as well."""

    def wrapped(path: Any = ".") -> Any:
        if not isinstance(path, int) and os.fspath(path).endswith(f"/{name}"):  # fd: rmtree's
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    return wrapped


@pytest.mark.parametrize("under", ["", "data/"])
def test_a_folder_of_shards_with_a_dataset_card_builds(
    tmp_path: Path, encoder_file: Path, under: str
) -> None:
    """A Hub webdataset snapshot holds ``README.md`` (its card) beside ``train-*.tar``, or
    beside ``data/*.tar``. The shard check took no file but tars, while a table's takes
    ``.md``/``.json`` beside it: the first was refused ("tar shards beside other files"), the
    second read as audio ("no input files"). Shards take the table's extras now (in9.15):
    both build, served equal to the encoder now."""
    clips = [wav_bytes(0.3, 1), wav_bytes(0.4, 2)]
    data = tmp_path / "wds"
    (data / under).mkdir(parents=True, exist_ok=True)
    for i, clip in enumerate(clips):
        write_tar(data / under / f"train-00{i}.tar", [(f"t{i}", {"wav": clip})])
    (data / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n# card\n")
    (data / "dataset_infos.json").write_text("{}\n")
    (data / ".gitattributes").write_text("*.tar filter=lfs\n")
    assert is_webdataset(str(data))
    store = tmp_path / "store"
    report = build(data, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["t0", "t1"]
    for i, clip in enumerate(clips):
        assert torch.equal(ds[i], run_now(module, audio_tensor(clip))), i


def test_tars_beside_a_dataset_card_are_not_refused_as_beside_other_files() -> None:
    """The refusal of tars beside other files at a folder's top level makes the same exception
    as the shard check: a card (``.md``, ``.json``) beside tars is no file of another kind."""
    refuse_tars_beside_files("d", ["README.md", "a.tar", "infos.json"])
    with pytest.raises(SourceError, match="beside other files"):
        refuse_tars_beside_files("d", ["README.md", "a.tar", "x.wav"])


def test_a_bucket_prefix_of_shards_with_a_dataset_card_builds(
    s3: Any, tmp_path: Path, encoder_file: Path
) -> None:
    """A Hub snapshot uploaded to a bucket: ``README.md`` beside ``data/*.tar`` under the
    prefix. It was read as a prefix of audio objects ("none of them input files"); now it
    is the shards, as the same local folder is (in9.15)."""
    clips = [wav_bytes(0.3, 3), wav_bytes(0.4, 4)]
    local = tmp_path / "snapshot"
    (local / "data").mkdir(parents=True)
    card = local / "README.md"
    card.write_text("# card\n")
    shards: dict[str, Path] = {"README.md": card}
    for i, clip in enumerate(clips):
        name = f"data/train-00{i}.tar"
        shards[name] = write_tar(local / name, [(f"t{i}", {"wav": clip})])
    prefix = f"s3://{s3.bucket}/snapshot/"
    upload_shards(prefix, shards)
    assert is_webdataset(prefix)
    store = tmp_path / "store"
    report = build(prefix, encoder_file, cache=store, workers=0)
    assert (report.encoded, report.failed) == (2, [])
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    stored = stored_features(store, report.root)
    assert list(stored) == ["t0", "t1"]
    for (key, parts), clip in zip(stored.items(), clips, strict=True):
        assert torch.equal(parts[""], run_now(module, audio_tensor(clip))), key


def test_the_note_on_left_out_members_counts_each_kind_when_samples_pick_apart(
    tmp_path: Path, encoder_file: Path
) -> None:
    """With no ``--column`` each sample picks its own member: ``a`` and ``b`` (``.wav`` and
    ``.noisy.wav``) encode ``.wav``, ``c`` (``.noisy.wav`` only) encodes that. in9.10's note
    said "--column wav keeps this choice", and that build fails ``c``. Now (in9.17) the note
    counts the samples encoded from each kind and names only a ``--column`` every sample
    holds, whose build keeps every sample."""
    clips = {n: wav_bytes(0.3, i) for i, n in enumerate(["a", "an", "b", "bn", "cn"], 1)}
    data = tmp_path / "wds"
    data.mkdir()
    write_tar(
        data / "s.tar",
        [
            ("a", {"wav": clips["a"], "noisy.wav": clips["an"]}),
            ("b", {"wav": clips["b"], "noisy.wav": clips["bn"]}),
            ("c", {"noisy.wav": clips["cn"]}),
        ],
    )
    store = tmp_path / "store"
    first = build(data, encoder_file, cache=store, workers=0)
    assert (first.encoded, first.failed) == (3, [])
    (note,) = first.notes
    assert "keeps this choice" not in note and "--column wav" not in note
    assert "2 samples encoded from .wav, 1 from .noisy.wav" in note
    assert "--column noisy.wav encodes that member of every sample" in note
    with torchscript_quietly():
        module = torch.jit.load(str(encoder_file))
    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    assert [ds.item_id(i) for i in range(len(ds))] == ["a", "b", "c"]
    for i, clip in enumerate(["a", "b", "cn"]):
        torch.testing.assert_close(ds[i], run_now(module, audio_tensor(clips[clip])), msg=clip)
    again = build(data, encoder_file, cache=tmp_path / "store2", workers=0, column="noisy.wav")
    assert (again.encoded, again.failed, again.notes) == (3, [], [])
