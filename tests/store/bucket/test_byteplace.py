"""The byte seam (``featbake.store.byteplace``): a local file and the same bytes as an object, on
each cloud, answer alike (members, bytes, digests, listings), each with its own stat."""

from __future__ import annotations

import gzip
import hashlib
import io
import random
import tarfile
from pathlib import Path

import pytest

from featbake.store.byteplace import LOCAL_FILES, OBJECTS, bytes_at
from featbake.store.objects import ObjectStore
from featbake.store.url import BucketURL
from tests.store.bucket.conftest import S3, Remote


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_a_tar_reads_alike_as_a_file_and_as_an_object_on_every_cloud(
    place: Remote | S3, tmp_path: Path
) -> None:
    """Plain and gzip tars: the members listed, each member's bytes and the digests are the same
    read from the file and from the object; the object's stat is the one its listing gives, and
    a folder and a prefix of tars only are told as such."""
    members = {f"s{i}.wav": bytes([i]) * (700 + 300 * i) for i in range(4)}
    plain = write_tar(tmp_path / "s.tar", members)
    packed = tmp_path / "s.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    prefix = f"{place.scheme}://{place.bucket}/shards"
    bucket = ObjectStore(BucketURL.parse(prefix))
    for f in (plain, packed):
        bucket.upload(f.name, f)
    assert (bytes_at(str(plain)), bytes_at(f"{prefix}/s.tar")) == (LOCAL_FILES, OBJECTS)
    listed = OBJECTS.listed(prefix)
    assert sorted(listed) == [f"{prefix}/s.tar", f"{prefix}/s.tar.gz"]
    for f in (plain, packed):
        url = f"{prefix}/{f.name}"
        local = LOCAL_FILES.tar_members(str(f))
        remote = OBJECTS.tar_members(url)
        assert [(m.name, m.offset, m.size) for m in remote] == [
            (m.name, m.offset, m.size) for m in local
        ]
        assert [m.name for m in remote] == list(members)
        stat = OBJECTS.stat(url)
        assert stat is not None and stat == bucket.file_stat(listed[url])
        for m in remote:
            data, at = OBJECTS.read_member(url, m)
            assert data == members[m.name] == LOCAL_FILES.read_member(str(f), m)[0]
            assert at == stat
        want = {n: hashlib.sha256(d).hexdigest() for n, d in members.items()}
        got = OBJECTS.member_digests(url, remote)
        assert (got.digests, got.stat) == (want, stat)
        assert LOCAL_FILES.member_digests(str(f), local).digests == want
    assert OBJECTS.holds_only(prefix + "/", (".tar", ".tar.gz"))
    assert LOCAL_FILES.holds_only(str(tmp_path), (".tar", ".tar.gz"))
    assert not OBJECTS.holds_only(prefix + "/", (".tar",))  # a .tar.gz is another kind


def test_a_gzip_tar_object_is_streamed_by_ranges_never_read_whole(
    place: Remote | S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``.tar.gz`` object was read whole (one GET, the whole stream decompressed in memory)
    to list it, to hash it and to read any member. Now its stream is fetched in order by
    ranged GETs and decompressed as it comes: a member near its start costs the bytes up to
    it (well under half of an object of 8 incompressible members), hashing every member one
    pass (about the object, never a whole GET), each answer the listing's, the object's stat
    the one its responses gave. A stream cut short lists its torn member, locally as in a
    bucket."""
    monkeypatch.setattr("featbake.store.containers.GZIP_BLOCK", 1 << 16)
    rng = random.Random(5)
    members = {f"m{i}.bin": rng.randbytes(200_000) for i in range(8)}  # incompressible
    packed = tmp_path / "s.tar.gz"
    packed.write_bytes(gzip.compress(write_tar(tmp_path / "s.tar", members).read_bytes()))
    size = packed.stat().st_size
    prefix = f"{place.scheme}://{place.bucket}/gz"
    ObjectStore(BucketURL.parse(prefix)).upload(packed.name, packed)
    url = f"{prefix}/{packed.name}"
    stat = OBJECTS.stat(url)
    gets: list[int] = []  # bytes asked by each GET (-1: whole)
    whole, ranged = ObjectStore.read, ObjectStore.read_range_of
    monkeypatch.setattr(ObjectStore, "read", lambda b, n: gets.append(-1) or whole(b, n))
    monkeypatch.setattr(
        ObjectStore, "read_range_of", lambda b, n, s, k: gets.append(k) or ranged(b, n, s, k)
    )
    remote = OBJECTS.tar_members(url, size)
    assert remote == LOCAL_FILES.tar_members(str(packed))
    gets.clear()
    data, at = OBJECTS.read_member(url, remote[0])
    assert data == members["m0.bin"] and at == stat
    assert gets and -1 not in gets and sum(gets) < size / 2, (gets, size)
    gets.clear()
    got = OBJECTS.member_digests(url, remote)
    want = {n: hashlib.sha256(d).hexdigest() for n, d in members.items()}
    assert (got.digests, got.stat) == (want, stat)
    assert -1 not in gets and sum(gets) < size + 3 * (1 << 16), (gets, size)

    # Cut in half: the listing ends with the member the stream ends inside, named as torn (a
    # local one failed its whole shard: seeking a cut gzip stream to its end raised EOFError).
    torn = tmp_path / "torn.tar.gz"
    torn.write_bytes(packed.read_bytes()[: size // 2])
    ObjectStore(BucketURL.parse(prefix)).upload(torn.name, torn)
    local = LOCAL_FILES.tar_members(str(torn))
    remote = OBJECTS.tar_members(f"{prefix}/{torn.name}")
    assert [m[:3] for m in local] == [m[:3] for m in remote]
    assert "truncated tar member" in local[-1].problem and not any(m.problem for m in local[:-1])
