"""Inputs in a bucket (``--data s3://bucket/audio/``) on a real S3 server (moto, loopback); the
representative tests also on ``gs://`` (fake-gcs-server) and ``az://`` (Azurite).

Real wav files are written, uploaded, built from the bucket into a local store, and every
stored feature is compared with running the encoder now on the same file.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import featbake.encode.fingerprints
from featbake.bake.pipeline import build
from featbake.encode.inputs import BucketInputs, ObjectSource, inputs_at
from featbake.encode.sources import load_unchanged, source_for
from featbake.errors import SourceError, StoreError
from featbake.recipe import Recipe
from featbake.store.byteplace import LIST_PAGE_HEADS, common_prefix, just_before, stat_objects
from featbake.store.hash_cache import FileStat
from featbake.store.objects import ListedPage, ObjectInfo, ObjectStore, object_stat
from featbake.store.url import BucketURL
from featbake.testing import LoopbackServer, write_audio_folder
from tests.conftest import invoke, live_features
from tests.helpers import put_many, stored_features
from tests.store.bucket.conftest import S3, Remote


def upload(folder: Path, url: str) -> list[str]:
    """Put every file under ``folder`` into the bucket under ``url``; their relative names."""
    bucket = ObjectStore(BucketURL.parse(url))
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    for name in names:
        bucket.upload(name, folder / name)
    return names


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the objects read whole (GETs) by this process, in order."""
    got: list[str] = []
    real = ObjectStore.read

    def counted(self: ObjectStore, name: str):  # type: ignore[no-untyped-def]
        got.append(name)
        return real(self, name)

    monkeypatch.setattr(ObjectStore, "read", counted)
    return got


def bake(data: str, encoder: Path, store: Path, **kw: object):
    return build(data, encoder, cache=store, workers=0, shard_bytes=60_000, **kw)


def assert_live(store: Path, root: str, encoder: Path, folder: Path, n: int) -> None:
    stored = stored_features(store, root)
    assert len(stored) == n
    for rel, parts in stored.items():
        torch.testing.assert_close(parts[""], live_features(encoder, folder / rel), msg=rel)


def test_a_build_from_a_bucket_stores_the_live_features_and_a_rebuild_reads_nothing(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, reads: list[str]
) -> None:
    url = f"{place.scheme}://{place.bucket}/audio/"
    names = upload(audio_dir, url)
    store = tmp_path / "store"
    report = bake(url, encoder_file, store)
    assert report.encoded == len(names) == 16 and not report.failed
    assert report.data == f"{place.scheme}://{place.bucket}/audio"  # the root is keyed by the URL
    # once each: hashed and decoded from one response (by the bucket's client: names are keys)
    assert sorted(reads) == sorted(f"audio/{n}" for n in names)
    assert_live(store, report.root, encoder_file, audio_dir, 16)

    reads.clear()
    again = bake(url, encoder_file, store)
    assert (again.encoded, again.reused, again.root) == (0, 16, report.root)
    assert reads == []  # every digest came from the hash cache, by ETag, size and date


def test_a_changed_object_is_hashed_and_encoded_again(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, reads: list[str]
) -> None:
    url = f"{place.scheme}://{place.bucket}/audio"
    upload(audio_dir, url)
    store = tmp_path / "store"
    bake(url, encoder_file, store)
    changed = "fixed/clip00001.wav"
    assert (audio_dir / changed).is_file()
    write_audio_folder(tmp_path / "new", 1, seconds=0.7, seed=99)
    shutil.copy(next((tmp_path / "new").glob("*.wav")), audio_dir / changed)
    ObjectStore(BucketURL.parse(url)).upload(changed, audio_dir / changed)  # new bytes, new ETag

    reads.clear()
    report = bake(url, encoder_file, store)
    assert (report.encoded, report.reused) == (1, 15)
    assert reads == [f"audio/{changed}"]
    assert_live(store, report.root, encoder_file, audio_dir, 16)


def _object_gets(s3: S3, mark: int, prefix: str) -> list[str]:
    """The objects under ``prefix`` the server answered a GET of (from its access log) since
    ``mark``: the listing (``GET /bucket?list-type=2``) is not one."""
    under = f"/{s3.bucket}/{prefix}/"
    return [
        r.name[len(under) :]
        for r in s3.requests(mark)
        if r.method == "GET" and r.status == 200 and r.name.startswith(under)
    ]


@pytest.mark.parametrize("held", [True, False])
def test_a_first_build_gets_each_object_once_and_a_rebuild_none(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, held: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Issue 31 item 3: counted by the server, a first build GETs each new object once (its
    digest and its decode from one response); past the held budget twice, as before."""
    url = f"s3://{s3.bucket}/audio/"
    names = upload(audio_dir, url)
    if not held:  # the old way: no bytes kept, every object GET again to decode
        monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    store = tmp_path / "store"
    mark = s3.log_mark()
    report = bake(url, encoder_file, store)
    assert report.encoded == len(names) == 16 and not report.failed
    gets = _object_gets(s3, mark, "audio")
    assert sorted(gets) == sorted(names if held else names * 2)
    assert_live(store, report.root, encoder_file, audio_dir, 16)

    mark = s3.log_mark()
    again = bake(url, encoder_file, store)
    assert (again.encoded, again.reused) == (0, 16)
    assert _object_gets(s3, mark, "audio") == []  # digests from the hash cache, by ETag


def test_a_bucket_build_is_the_same_store_as_a_folder_build(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Keys depend on bytes, not on where they were read: the bucket's inputs are all reused."""
    store = tmp_path / "store"
    bake(str(audio_dir), encoder_file, store)
    url = f"s3://{s3.bucket}/a"
    upload(audio_dir, url)
    report = bake(url, encoder_file, store)
    assert (report.encoded, report.reused) == (0, 16)


def test_the_listing_keeps_the_sources_extensions_in_name_order(s3: S3, tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    for name in ["b.wav", "a/z.WAV", "a/notes.txt", ".hidden.wav", ".cache/x.wav", "c.flac"]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")
    upload(folder, f"s3://{s3.bucket}/data")
    upload(folder, f"s3://{s3.bucket}/data2")  # a prefix that only starts the same
    inputs = BucketInputs.at(f"s3://{s3.bucket}/data/")
    found = inputs.scan(source_for(Recipe()).extensions)
    assert found.inputs == ["a/z.WAV", "b.wav", "c.flac"]
    assert inputs.path("b.wav") == f"s3://{s3.bucket}/data/b.wav"
    assert inputs.size("b.wav") == 1


def test_an_empty_prefix_and_a_missing_bucket_say_what_to_fix(s3: S3) -> None:
    with pytest.raises(SourceError, match=r"no objects.*under s3://.*/nothing/; check the URL"):
        BucketInputs.at(f"s3://{s3.bucket}/nothing/").scan([".wav"])
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        BucketInputs.at("s3://no-such-bucket/audio/").scan([".wav"])


def test_without_credentials_the_listing_says_which_variables_to_set(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match=r"no credentials.*AWS_ACCESS_KEY_ID"):
        BucketInputs.at(f"s3://{s3.bucket}/audio/").scan([".wav"])


def test_an_object_rewritten_after_hashing_is_not_decoded_under_the_old_key(
    s3: S3, audio_dir: Path
) -> None:
    url = f"s3://{s3.bucket}/audio"
    upload(audio_dir, url)
    inputs = BucketInputs.at(url)
    inputs.scan([".wav"])
    path = inputs.path("fixed/clip00000.wav")
    stats: dict[str, FileStat] = {}
    digests, failed = inputs.hash(_NoCache(), [path], stats=stats)
    assert not failed and len(digests[path]) == 64
    source = inputs.source(source_for(Recipe()))
    assert isinstance(source, ObjectSource)
    x = load_unchanged(source, path, stats[path])
    torch.testing.assert_close(x, source_for(Recipe()).load(audio_dir / "fixed/clip00000.wav"))
    ObjectStore(BucketURL.parse(url)).upload(
        "fixed/clip00000.wav", audio_dir / "fixed/clip00001.wav"
    )
    with pytest.raises(SourceError, match="changed while featbake was reading it"):
        load_unchanged(source, path, stats[path])


def test_an_object_deleted_after_the_listing_fails_alone(s3: S3, audio_dir: Path) -> None:
    url = f"s3://{s3.bucket}/audio"
    upload(audio_dir, url)
    inputs = BucketInputs.at(url)
    names = inputs.scan([".wav"]).inputs
    ObjectStore(BucketURL.parse(url)).delete([names[0]])
    paths = [inputs.path(n) for n in names]
    digests, failed = inputs.hash(_NoCache(), paths)
    assert failed == {paths[0]: "object not found (deleted since the listing?)"}
    assert sorted(digests) == sorted(paths[1:])


def test_a_folder_and_prefixes_of_one_bucket_read_alike_through_one_client(
    place: Remote | S3, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local folder and the same files under two prefixes of one bucket go through one
    interface (the byte seam): the same names, sizes and digests (the files' SHA-256), and the
    decoded clips equal the files'. Listing, stat'ing, hashing and decoding both prefixes make
    one client for the bucket; before, each prefix's inputs and its decoding made their own
    (a client costs ~0.1-0.2 s to make), and the folder walked and hashed its files apart."""
    made: list[str] = []
    real_init = ObjectStore.__init__

    def counted(self: ObjectStore, url: BucketURL) -> None:
        made.append(str(url))
        real_init(self, url)

    urls = [f"{place.scheme}://{place.bucket}/{p}" for p in ("one", "two/deeper")]
    for url in urls:
        upload(audio_dir, url)
    monkeypatch.setattr(ObjectStore, "__init__", counted)
    folder = inputs_at(audio_dir)
    rels = folder.scan([".wav"]).inputs
    want = {r: hashlib.sha256((audio_dir / r).read_bytes()).hexdigest() for r in rels}
    local, _ = folder.hash(_NoCache(), [folder.path(r) for r in rels])
    assert {os.path.relpath(p, folder.where): d for p, d in local.items()} == want
    for url in urls:
        inputs = inputs_at(url + "/")
        assert isinstance(inputs, BucketInputs) and inputs.scan([".wav"]).inputs == rels
        assert [inputs.size(r) for r in rels] == [folder.size(r) for r in rels]
        got, failed = inputs.hash(_NoCache(), [inputs.path(r) for r in rels])
        assert not failed and {inputs.rel(p): d for p, d in got.items()} == want
        source = inputs.source(source_for(Recipe()))
        torch.testing.assert_close(
            source.load(inputs.path(rels[0])), source_for(Recipe()).load(audio_dir / rels[0])
        )
    assert made == [f"{place.scheme}://{place.bucket}"], made


def test_an_objects_stat_follows_its_etag_size_and_date() -> None:
    one = ObjectInfo("a.wav", 10, 1_700_000_000.4, "9b2cf535f27731c974343645a3985328")
    assert object_stat(one) == object_stat(one._replace(modified=1_700_000_000.9))
    assert object_stat(one) != object_stat(one._replace(etag="0" * 32))
    assert object_stat(one) != object_stat(one._replace(size=11))
    assert object_stat(one) != object_stat(one._replace(modified=1_700_000_001.0))


class _NoCache:
    """A hash cache that knows nothing and keeps nothing."""

    def cached_hashes(self, paths: object) -> dict:
        return {}

    def put_hashes(self, rows: object, *, recorded_ns: int | None = None) -> None:
        return None


def test_the_cli_builds_from_a_bucket_with_decode_workers(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    url = f"{place.scheme}://{place.bucket}/audio/"
    upload(audio_dir, url)
    store = tmp_path / "store"
    done = invoke(
        "build", "--encoder", encoder_file, "--data", url, "--cache", store, "--workers", "2",
        "--json", env=place.env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"encoded": 16' in done.stdout
    assert "Traceback" not in done.stderr


def test_the_cli_names_a_missing_bucket_in_one_line(
    s3: S3, encoder_file: Path, tmp_path: Path
) -> None:
    done = invoke(
        "build", "--encoder", encoder_file, "--data", "s3://no-such-bucket/audio/",
        "--cache", tmp_path / "store", env=s3.env,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 5, done.stderr
    assert len(lines) == 1 and "'no-such-bucket' does not exist" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_dataset_over_a_bucket_serves_a_bucket_build_and_reads_no_object(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, reads: list[str]
) -> None:
    from featbake import CachedFeatureDataset

    url = f"s3://{s3.bucket}/audio/"
    upload(audio_dir, url)
    store = tmp_path / "store"
    bake(url, encoder_file, store)
    reads.clear()
    ds = CachedFeatureDataset(url, encoder_file, cache=store, on_miss="error")
    assert len(ds) == 16 and ds.path(0).startswith(f"s3://{s3.bucket}/audio/")
    for i in range(len(ds)):
        rel = ds.path(i)[len(url) :]
        torch.testing.assert_close(ds[i], live_features(encoder_file, audio_dir / rel))
    assert reads == []  # keys from the hash cache (one LIST), features from the store


def test_a_dataset_over_a_bucket_encodes_a_new_object_from_its_bytes(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, reads: list[str]
) -> None:
    from torch.utils.data import DataLoader

    from featbake import CachedFeatureDataset

    url = f"{place.scheme}://{place.bucket}/audio/"
    upload(audio_dir, url)
    ds = CachedFeatureDataset(url, encoder_file, cache=tmp_path / "store")
    got = list(DataLoader(ds, batch_size=None, num_workers=1))  # a forked worker reads objects
    for i, value in enumerate(got):
        rel = ds.path(i)[len(url) :]
        torch.testing.assert_close(value, live_features(encoder_file, audio_dir / rel))
    again = CachedFeatureDataset(url, encoder_file, cache=tmp_path / "store", on_miss="error")
    for i in range(len(again)):
        torch.testing.assert_close(again[i], got[i])  # written back by the workers


def test_a_dataset_does_not_encode_an_object_rewritten_since_it_was_indexed(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    from featbake import CachedFeatureDataset

    url = f"s3://{s3.bucket}/audio/"
    names = upload(audio_dir, url)
    ds = CachedFeatureDataset(url, encoder_file, cache=tmp_path / "store")
    other = audio_dir / names[1]
    ObjectStore(BucketURL.parse(url)).upload(names[0], other)  # new bytes, new ETag
    first = next(i for i in range(len(ds)) if ds.path(i).endswith(names[0]))
    with pytest.raises(SourceError, match="changed while featbake was reading it"):
        ds[first]


# -- objects named one by one: a folder's LIST pages or a HEAD each ----------------------------
class ModelBucket:
    """A bucket as a sorted list of names in memory, answering ListObjectsV2 (prefix,
    ``StartAfter``, ``MaxKeys``, a delimiter) and HEAD as S3 documents them, counting both;
    ``refuse``: every listing is denied (a policy without ``s3:ListBucket``)."""

    def __init__(self, names: list[str], refuse: bool = False) -> None:
        self.infos = {n: ObjectInfo(n, len(n), 1_700_000_000.0 + i, f"e{i}")
                      for i, n in enumerate(sorted(names))}  # fmt: skip
        self.keys = sorted(self.infos)
        self.refuse = refuse
        self.lists = 0
        self.heads = 0

    def list_page(self, prefix: str, after: str = "", *, keys: int = 1000,
                  delimiter: str = "") -> ListedPage:  # fmt: skip
        self.lists += 1
        if self.refuse:
            raise StoreError("access to s3://model was denied (AccessDenied)")
        entries: list[str] = []  # names, and sub-folders rolled up ("a/b/"), in name order
        for key in self.keys[bisect.bisect_right(self.keys, after) :]:
            if not key.startswith(prefix):
                continue
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            entry = key if cut < 0 else key[: cut + 1]
            if not entries or entries[-1] != entry:
                entries.append(entry)
        page = entries[:keys]
        objects = [self.infos[e] for e in page if e in self.infos]
        return ListedPage(objects, page[-1] if page else "", len(entries) > keys)

    def head(self, name: str) -> ObjectInfo | None:
        self.heads += 1
        return self.infos.get(name)


def _truth(bucket: ModelBucket, names: list[str]) -> dict[str, ObjectInfo | str]:
    return {n: bucket.infos.get(n, "object not found") for n in names}


def test_a_folder_named_whole_is_listed_a_page_per_thousand_with_no_head() -> None:
    names = [f"clips/c{i:05d}.wav" for i in range(2_500)]
    bucket = ModelBucket([*names, "clips/sub/x.wav", "other/y.wav"])
    got = stat_objects(bucket, names)  # type: ignore[arg-type]
    assert got == _truth(bucket, names)
    assert (bucket.lists, bucket.heads) == (3, 0)


def test_few_names_in_a_big_folder_are_headed_and_sparse_ones_stop_the_listing() -> None:
    folder = [f"big/c{i:05d}.wav" for i in range(30_000)]
    bucket = ModelBucket(folder)
    two = [folder[0], folder[-1]]
    assert stat_objects(bucket, two) == _truth(bucket, two)  # type: ignore[arg-type]
    assert (bucket.lists, bucket.heads) == (0, 2)  # fewer than a page's price: HEADs
    bucket.heads = 0
    sparse = folder[::2_000]  # 15 names, one per 2,000 objects: a page finds one each
    assert stat_objects(bucket, sparse) == _truth(bucket, sparse)  # type: ignore[arg-type]
    assert (bucket.lists, bucket.heads) == (2, 13)  # a page more than it saved: the rest HEADed
    assert bucket.lists + bucket.heads <= len(sparse) + 1


def test_a_listing_jumps_to_the_next_name_and_narrows_to_the_names_common_prefix() -> None:
    """The names' longest common prefix is listed, from just before the first name not yet
    found: a folder's stretches no row names, and its sub-folders, cost no page."""
    names = [f"a/x{i:04d}.wav" for i in range(20)] + [f"a/z{i:04d}.wav" for i in range(20)]
    others = [f"a/y{i:05d}.wav" for i in range(5_000)] + [f"a/x/{i}" for i in range(5_000)]
    bucket = ModelBucket([*names, *others])
    assert stat_objects(bucket, names) == _truth(bucket, names)  # type: ignore[arg-type]
    assert (bucket.lists, bucket.heads) == (2, 0)  # a/x0000.. then a jump to a/z0000..
    assert just_before("a/z0000.wav") == "a/z0000.wau"
    assert common_prefix("a/x0000.wav", "a/x0019.wav") == "a/x00"


def test_a_refused_listing_heads_every_name_and_missing_ones_fail_by_name() -> None:
    names = [f"d/c{i:03d}.wav" for i in range(40)]
    bucket = ModelBucket(names[:-3], refuse=True)
    got = stat_objects(bucket, names)  # type: ignore[arg-type]
    assert got == _truth(bucket, names)
    assert [n for n, v in got.items() if v == "object not found"] == names[-3:]
    assert (bucket.lists, bucket.heads) == (1, 40)  # one refusal: no folder lists again


@pytest.mark.parametrize("seed", range(60))
def test_stat_objects_matches_a_head_per_name_within_its_worst_case(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random folders, sub-folders, names (some missing) and page sizes: every result is what
    a HEAD of the name says, and no folder costs more than a HEAD each plus one request (plus
    two pages in price)."""
    rng = random.Random(seed)
    monkeypatch.setattr("featbake.store.byteplace.LIST_PAGE_KEYS", rng.choice([1, 3, 10, 1000]))
    ends = [".wav", "/x.wav", ""]  # an object, one in a sub-folder, one named as that folder
    objects = [
        f"f{rng.randrange(3)}/{rng.choice('abc')}{rng.randrange(400):03d}{rng.choice(ends)}"
        for _ in range(rng.randrange(1, 900))
    ]
    bucket = ModelBucket(objects)
    density = rng.choice([0.01, 0.1, 0.5, 1.0])
    wanted = [o for o in sorted(set(objects)) if "/" not in o[3:] and rng.random() < density]
    wanted += [f"f{rng.randrange(3)}/gone{i}" for i in range(rng.randrange(4))]
    assert stat_objects(bucket, wanted) == _truth(bucket, wanted)  # type: ignore[arg-type]
    folders = len({n.rpartition("/")[0] for n in wanted})
    assert bucket.lists + bucket.heads <= len(wanted) + folders
    price = bucket.lists * LIST_PAGE_HEADS + bucket.heads  # in HEADs
    assert price < len(wanted) + 2 * LIST_PAGE_HEADS * max(folders, 1)


def test_on_a_server_a_listed_stat_is_a_headed_one_and_the_listing_stops_when_sparse(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against moto: 300 objects, pages of 10 (S3's 1,000 scaled down); 13 names one per 23
    objects: two pages find one each, then HEADs; every stat as its HEAD's, a missing name
    failed by its HEAD. Counted in the server's log."""
    monkeypatch.setattr("featbake.store.byteplace.LIST_PAGE_KEYS", 10)
    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}"))
    keys = [f"sparse/c{i:04d}.wav" for i in range(300)]
    put_many(bucket, keys)
    names = [*keys[::23], "sparse/gone.wav"]
    mark = s3.log_mark()
    got = stat_objects(bucket, names)
    sent = s3.requests(mark)
    assert sum(r.method == "GET" and "list-type=2" in r.name for r in sent) == 2
    assert sum(r.method == "HEAD" for r in sent) == len(names) - 2
    assert got.pop("sparse/gone.wav") == "object not found"
    for name, info in got.items():
        assert not isinstance(info, str)
        assert object_stat(info) == object_stat(bucket.head(name)), name
        assert object_stat(info) == object_stat(bucket.read(name).info), name


def test_manifest_rows_naming_one_bucket_name_in_two_clouds_read_each_its_own(
    s3: S3, gcs_server: LoopbackServer, audio_dir: Path, encoder_file: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A manifest's object rows are grouped by scheme and bucket: ``gs://B/x.wav`` is read from
    Google Cloud Storage even when an S3 bucket ``B`` holds an ``x.wav`` too."""
    import json

    from featbake import CachedFeatureDataset

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    gcs_server.make_bucket(s3.bucket)  # the same name on both servers
    clips = sorted(audio_dir.rglob("*.wav"))[:2]
    for scheme, clip in zip(("s3", "gs"), clips, strict=True):
        ObjectStore(BucketURL.parse(f"{scheme}://{s3.bucket}/m")).upload("x.wav", clip)
    manifest = tmp_path / "rows.jsonl"
    rows = [{"path": f"{scheme}://{s3.bucket}/m/x.wav"} for scheme in ("s3", "gs")]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    report = build(manifest, encoder_file, cache=store, workers=0)
    assert report.encoded == 2 and not report.failed
    ds = CachedFeatureDataset(manifest, encoder_file, cache=store, on_miss="error")
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], live_features(encoder_file, clip))


def test_telling_an_audio_prefix_is_neither_shards_nor_a_table_costs_one_page_each(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """in9.3's checks listed a whole prefix each before saying no: a prefix of 2,500 clips
    cost 3 LIST pages per check (for a million objects, some 1,000 each). Now each reads a
    page at a time and stops at the first page that says no: one page each. (Here 250 clips
    in pages of 100: three pages still, a tenth of the objects to put.)"""
    from featbake.encode.tables import is_table
    from featbake.encode.webdataset import is_webdataset
    from featbake.store.objects import S3Objects

    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}"))
    put_many(bucket, [f"clips/c{i:05d}.wav" for i in range(250)])
    pages: list[str] = []
    real = S3Objects.list_page

    def counted(self: ObjectStore, prefix: str, after: str = "", **kw: object) -> ListedPage:
        pages.append(prefix)
        return real(self, prefix, after, **{**kw, "keys": 100})  # type: ignore[arg-type]

    monkeypatch.setattr(S3Objects, "list_page", counted)
    where = f"s3://{s3.bucket}/clips/"
    assert not is_webdataset(where) and not is_table(where)
    assert len(pages) == 2, pages


def test_a_prefixs_top_level_read_in_small_pages_goes_past_each_rolled_up_sub_prefix(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard check reads a prefix's top level with ``/`` as the delimiter, page by page: a
    page ending on a rolled-up sub-prefix (``b/``) goes on after all of its names, so every
    top-level object is seen once and the listing ends (pages of 2 here)."""
    from featbake.encode.webdataset import is_webdataset
    from featbake.store.byteplace import listed_lazily
    from featbake.store.objects import S3Objects

    bucket = ObjectStore(BucketURL.parse(f"s3://{s3.bucket}"))
    put_many(bucket, ["p/a.tar", "p/b/x.wav", "p/b/y.wav", "p/c.tar", "p/d/z.wav", "p/e.tar"])
    real = S3Objects.list_page

    def small(self: ObjectStore, prefix: str, after: str = "", **kw: Any) -> ListedPage:
        return real(self, prefix, after, **{**kw, "keys": 2})  # type: ignore[arg-type]

    monkeypatch.setattr(S3Objects, "list_page", small)
    assert list(listed_lazily(bucket, "p/", "/")) == ["a.tar", "c.tar", "e.tar"]
    assert is_webdataset(f"s3://{s3.bucket}/p/")  # the top level decides: tars only
