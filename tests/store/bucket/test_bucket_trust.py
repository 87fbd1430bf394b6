"""A bucket store trusts nothing it reads (issue 28 items 1-5, 8, 15, 17; issue 27's bucket bugs;
issue 32 items 5-7): verify checks the bucket's own objects from any node, the Python upkeep API
and the CLI agree, a stale tier never publishes over the bucket, names read from the bucket never
become paths outside the store, credentials never reach a message or a folder name, and a
stalled or malformed endpoint is one line. Served features are compared with the encoder now."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import ConfigError, StoreCorrupt
from featbake.quantize import Scheme
from featbake.quantize import dequantize as dequantize_rows
from featbake.recipe import Recipe
from featbake.serve.loader import FeatureLoader
from featbake.store.catalog import open_sqlite
from featbake.store.objects import ObjectStore
from featbake.store.open import open_store
from featbake.store.shard import ShardReader
from featbake.store.url import BucketURL
from featbake.store.versions import newest, version_name, version_of
from featbake.testing import write_audio_folder
from featbake.upkeep import GcOptions, gc, verify
from tests.conftest import invoke, live_features, run_cli
from tests.store.bucket.conftest import (
    QUICK_BACKOFF,
    S3,
    SCHEMES,
    Place,
    bucket_store,
    endpoint_env,
    upstream_port,
)

HOUR = 3600.0


def bucket_of(place: Place) -> ObjectStore:
    return ObjectStore(BucketURL.parse(place.url))


def flip_a_byte(place: Place, name: str, tmp: Path) -> None:
    """Rewrite object ``name`` with one byte of its payload changed (its name stays)."""
    data = bytearray(bucket_of(place).read(name).data)
    data[-10] ^= 0xFF
    tmp.write_bytes(bytes(data))
    bucket_of(place).upload(name, tmp)


def publish_edited_version(url: str, work: Path, *statements: tuple[str, tuple]) -> None:
    """Publish version 2 as version 1 with ``statements`` run on it: what anyone with write
    access to the bucket can do."""
    edited = work / "edited.sqlite"
    bucket = ObjectStore(BucketURL.parse(url))
    bucket.download(version_name(1), edited)
    conn = open_sqlite(edited)
    for sql, params in statements:
        conn.execute(sql, params)
    conn.close()
    bucket.upload(version_name(2), edited)


def outside(victim: Path) -> str:
    """A name that walks from any folder of the store up to ``victim`` (its suffix left off)."""
    return "../" * 12 + str(victim.with_suffix("")).lstrip("/")


def assert_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def test_a_shard_object_holding_another_shards_bytes_is_not_kept_in_a_tier(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two shard objects overwritten with each other's sound bytes pass every CRC: a whole
    fetch kept each in the tier under the other's name, every read failed ("holds no tensor
    ... verify --repair"), and went on failing on that node after the objects were deleted and
    built again. A fetch checks the bytes' SHA-256 against the name now: refused in one line
    naming the object, nothing kept, and once the objects are put right the node serves."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    bucket = ObjectStore(BucketURL.parse(s3.url))
    first, second = s3.objects("shards/")[:2]
    for name in (first, second):
        bucket.download(name, tmp_path / Path(name).name)
    bucket.put(first, tmp_path / Path(second).name, create=False)
    bucket.put(second, tmp_path / Path(first).name, create=False)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")
    node = tmp_path / "node-c"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=node, on_miss="error"
    )
    with pytest.raises(StoreCorrupt, match="holds the bytes of shard") as refused:
        for i in range(len(ds)):
            ds[i]
    assert "\n" not in str(refused.value) and "shards/" in str(refused.value)
    kept = {p.stem for p in node.rglob("*.safetensors")}
    assert not kept & {Path(first).stem, Path(second).stem}
    bucket.delete([first, second])  # as verify says, then built again elsewhere
    again = build(audio_dir, encoder_file, cache=open_store(s3.url, local_cache=tmp_path / "b"))
    assert again.encoded > 0
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=node, on_miss="error"
    )
    assert_live(ds, encoder_file)


def damaged_copy(bucket: ObjectStore, name: str, other: str, damage: str, tmp: Path) -> Path:
    """A file of shard object ``name``'s bytes with ``damage`` done: ``swap`` (``other``'s
    sound bytes), ``cut`` (its second half gone) or ``flip`` (a payload byte changed)."""
    data = bytearray(bucket.read(other if damage == "swap" else name).data)
    if damage == "cut":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    tmp.write_bytes(bytes(data))
    return tmp


@pytest.mark.parametrize("damage", ["swap", "cut", "flip"])
def test_a_damaged_object_read_by_ranges_is_named_with_the_buckets_fix(
    s3: S3,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    """A shard object overwritten (another shard's bytes, cut short, a byte changed) and read
    by ranges was refused in the words of a directory's damaged file: the tier's path (where
    nothing lies), "run `featbake verify --repair`" (refused on a bucket), and for a bad span
    both fixes in one message. One line now names the object and the bucket's fix, as a whole
    fetch's refusal does; the other items are served as the encoder gives them now."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    bucket = bucket_of(s3)
    first, second = s3.objects("shards/")[:2]
    bucket.upload(first, damaged_copy(bucket, first, second, damage, tmp_path / "x"))
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")
    node = tmp_path / "node"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=node, on_miss="error"
    )
    refused, served = [], 0
    for i in range(len(ds)):
        try:
            got = ds[i]
        except StoreCorrupt as e:
            refused.append(str(e))
            continue
        torch.testing.assert_close(got, live_features(encoder_file, Path(ds.path(i))))
        served += 1
    assert refused and served, (refused, served)
    message = refused[0]
    assert message.startswith(f"{s3.url}/{first} is damaged in the bucket ("), message
    assert message.endswith("delete it, then build again (a build encodes again what a missing "
                            "shard held)"), message  # fmt: skip
    assert "\n" not in message and "verify --repair" not in message and str(node) not in message


def test_an_export_whose_shard_object_was_deleted_names_the_buckets_fix(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """An export reading a shard object deleted after the catalog named it said to run
    `featbake verify --repair`, which a bucket refuses: it says to build again (a build encodes
    again what a missing object held), and a build then makes the export whole."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0, shard_bytes=60_000)
    bucket_of(s3).delete(s3.objects("shards/")[:1])
    out = tmp_path / "out.tar"
    args = ("export", "--cache", s3.url, "--format", "webdataset", out)
    got = invoke(*args, "--local-cache", tmp_path / "node")
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 5 and len(lines) == 1, got.stderr
    assert "vanished during the export (gc ran, or its shard object was deleted)" in lines[0]
    assert "build again" in lines[0] and "verify --repair" not in lines[0], lines[0]
    again = build(audio_dir, encoder_file, cache=open_store(s3.url, local_cache=tmp_path / "b"))
    assert again.encoded > 0
    assert invoke(*args, "--local-cache", tmp_path / "node2").returncode == 0


def test_a_bucket_whose_catalog_versions_were_deleted_says_so(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Every catalog version deleted, the shards left: a fresh node said the store had "no
    published catalog yet; build into it", as of a new one, and `verify` called it clean, every
    shard an orphan (gc's to delete). Each says the versions are gone and what to do, in one
    line."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    bucket = ObjectStore(BucketURL.parse(s3.url))
    bucket.delete(s3.objects("catalog/"))
    for command in ("stats", "verify"):
        got = invoke(command, "--cache", s3.url, "--local-cache", tmp_path / f"fresh-{command}")
        lines = got.stderr.strip().splitlines()
        assert got.returncode != 0 and len(lines) == 1, (command, got.stdout, got.stderr)
        assert "holds shard objects but no catalog version and no fragment" in lines[0], lines[0]
        assert "restore them from a copy" in lines[0]
    # A build in parts not merged yet holds fragments: told to merge, as before.
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part)
    got = invoke("stats", "--cache", s3.url, "--local-cache", tmp_path / "fresh2")
    assert got.returncode != 0 and "featbake merge" in got.stderr, got.stderr
    assert "no catalog version and no fragment" not in got.stderr


# -- verify checks the bucket's objects -----------------------------------------------------------
def test_verify_reads_the_objects_not_the_tier_that_holds_good_copies(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "node-a"
    store = open_store(place.url, local_cache=tier)
    build(audio_dir, encoder_file, cache=store, workers=0, shard_bytes=60_000)
    shard = place.objects("shards/")[0]
    flip_a_byte(place, shard, tmp_path / "flipped")
    # The builder's tier still holds the good copy: verify must not look there.
    report = verify(place.url, local_cache=tier)
    assert report.status == "damaged" and report.exit_code == 11
    (bad,) = report.remaining
    assert bad.subject == f"{place.url}/{shard}" and "delete this object" in bad.detail
    assert report.shards_checked == len(place.objects("shards/")) - 1 and report.bytes_checked > 0
    cli = invoke("verify", "--cache", place.url, "--local-cache", tier)
    assert cli.returncode == 11, cli.stderr
    assert f"{place.url}/{shard}" in cli.stdout and "corrupt-shard" in cli.stdout


def test_two_shard_objects_holding_each_others_bytes_are_damaged(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    a, b = place.objects("shards/")[:2]
    bucket = bucket_of(place)
    (tmp_path / "a").write_bytes(bucket.read(a).data)
    (tmp_path / "b").write_bytes(bucket.read(b).data)
    bucket.upload(a, tmp_path / "b")
    bucket.upload(b, tmp_path / "a")
    report = verify(place.url, local_cache=tmp_path / "fresh")
    assert {f.subject for f in report.remaining} == {f"{place.url}/{a}", f"{place.url}/{b}"}


def test_the_python_api_refuses_to_repair_a_bucket_and_forgets_nothing(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    catalogs = place.objects("catalog/")
    fresh = tmp_path / "fresh-node"  # its tier holds no shard yet
    with pytest.raises(ConfigError, match="not built for a bucket store"):
        verify(place.url, repair_damage=True, local_cache=fresh)
    assert verify(place.url, local_cache=fresh).status == "clean"
    assert place.objects("catalog/") == catalogs  # nothing published
    again = build(
        audio_dir, encoder_file, cache=open_store(place.url, local_cache=fresh), workers=0
    )
    assert again.encoded == 0 and again.reused == 16


# -- a stale tier never publishes over the bucket --------------------------------------------------
def roots_in_bucket(place: Place, tmp: Path) -> list[str]:
    bucket = bucket_of(place)
    v = newest(place.objects("catalog/"))
    bucket.download(version_name(v), tmp)
    conn = open_sqlite(tmp)
    try:
        return sorted(r[0] for r in conn.execute("SELECT data FROM roots"))
    finally:
        conn.close()


def lose_catalog(catalog: Path, how: str) -> None:
    """The tier's copy of the catalog lost as ``how`` says; its ``catalog.version`` stays."""
    import sqlite3

    if how == "deleted":
        catalog.unlink()
    elif how == "emptied":
        catalog.write_bytes(b"")  # a power cut between its rename and its pages reaching disk
    elif how == "cut short":
        catalog.write_bytes(catalog.read_bytes()[:4096])
    else:  # its tables dropped: an SQLite file of its own, holding none
        catalog.unlink()
        conn = sqlite3.connect(catalog)
        conn.execute("CREATE TABLE x(a)")
        conn.execute("DROP TABLE x")
        conn.close()


@pytest.mark.parametrize("how", ["deleted", "emptied", "cut short", "no tables"])
def test_a_tier_that_lost_its_catalog_fetches_it_again_before_it_publishes(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path, how: str
) -> None:
    """A tier whose copy is gone, emptied, cut short or holds no table, its pin kept, fetches
    the bucket's again: trusted by its pin, an empty copy served nothing (``stats``: no root)
    and a build of other data published a next version from it, every earlier root lost to
    every node."""
    tier = tmp_path / "node"
    build(audio_dir, encoder_file, cache=open_store(place.url, local_cache=tier), workers=0)
    (catalog,) = tier.rglob("catalog.sqlite")
    lose_catalog(catalog, how)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tier, on_miss="error"
    )
    assert_live(ds, encoder_file)
    lose_catalog(catalog, how)
    other = tmp_path / "other"
    write_audio_folder(other, 2, seconds=0.5, seed=9)
    build(other, encoder_file, cache=open_store(place.url, local_cache=tier), workers=0)
    assert len(roots_in_bucket(place, tmp_path / "v.sqlite")) == 2  # the first root survived
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert_live(ds, encoder_file)


def test_a_tier_from_before_the_prefix_was_rebuilt_fetches_the_new_version(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    old_node = tmp_path / "old-node"
    build(audio_dir, encoder_file, cache=open_store(place.url, local_cache=old_node), workers=0)
    bucket = bucket_of(place)
    bucket.delete(place.objects())  # the prefix is wiped and rebuilt by another node
    rebuilt = tmp_path / "rebuilt"
    write_audio_folder(rebuilt, 3, seconds=0.5, seed=5)
    build(rebuilt, encoder_file, cache=open_store(place.url, local_cache=tmp_path / "b"), workers=0)
    assert newest(place.objects("catalog/")) == 1  # the same version number, other bytes
    more = tmp_path / "more"
    write_audio_folder(more, 1, seconds=0.5, seed=6)
    build(more, encoder_file, cache=open_store(place.url, local_cache=old_node), workers=0)
    roots = roots_in_bucket(place, tmp_path / "v.sqlite")
    assert str(rebuilt) in roots and str(more) in roots and str(audio_dir) not in roots


def test_a_tier_folder_given_as_a_store_is_refused(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    build(audio_dir, encoder_file, cache=open_store(place.url, local_cache=tier), workers=0)
    (catalog,) = tier.rglob("catalog.sqlite")
    refused = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", catalog.parent)
    assert refused.returncode == 2, refused.stderr
    assert "local tier of the bucket store" in refused.stderr and place.url in refused.stderr


# -- names read from the bucket are never followed outside it ------------------------------------
def plant(store: str, work: Path, *statements: tuple[str, tuple]) -> None:
    """Edit ``store``'s catalog as anyone with write access to the place can: a directory's
    catalog.sqlite in place; a bucket's as a new version (:func:`publish_edited_version`)."""
    if "://" in store:
        publish_edited_version(store, work, *statements)
        return
    conn = open_sqlite(Path(store) / "catalog.sqlite")
    for sql, params in statements:
        conn.execute(sql, params)
    conn.close()


def shard_names(store: str) -> list[str]:
    """The shards ``store`` holds: its objects or its files under shards/."""
    if "://" in store:
        return sorted(o.name for o in ObjectStore(BucketURL.parse(store)).list("shards/"))
    return sorted(str(p) for p in (Path(store) / "shards").rglob("*") if p.is_file())


def plant_outside_shard(store: str, work: Path, victim: Path) -> None:
    """Name ``store``'s first shard by a path to ``victim``, and age its root past
    ``--older-than 1s`` so that gc drops it and meets the name."""
    then = time.time() - HOUR
    plant(
        store,
        work,
        ("UPDATE shards SET name = ? WHERE id = (SELECT min(id) FROM shards)", (outside(victim),)),
        ("UPDATE roots SET created = ?, last_used = ?", (then, then)),
        ("UPDATE features SET last_used = ?", (then,)),
    )


def test_a_planted_catalog_naming_a_path_outside_the_store_touches_nothing(
    place_store: str, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place_store, workers=0)
    shards = shard_names(place_store)
    victim = tmp_path / "victim" / "model.safetensors"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    plant_outside_shard(place_store, tmp_path, victim)
    cli = invoke("gc", "--cache", place_store, "--retention", "0s", "--older-than", "1s")
    assert cli.returncode == 6 and "not a shard name" in cli.stderr, (cli.stdout, cli.stderr)
    assert victim.read_bytes() == b"precious"
    assert shard_names(place_store) == shards  # nothing deleted on a planted catalog's word


@pytest.mark.parametrize("place_store", ["local", *SCHEMES], indirect=True)
def test_a_gc_refused_on_a_planted_name_leaves_the_catalog_as_it_was(
    place_store: str, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place_store, workers=0)
    plant_outside_shard(place_store, tmp_path, tmp_path / "victim.safetensors")
    gc_node = open_store(place_store, local_cache=tmp_path / "gc-node")
    for _ in range(2):  # the second run meets the same catalog: the first changed nothing
        with pytest.raises(StoreCorrupt, match="not a shard name"):
            gc(gc_node, GcOptions(older_than=1.0, retention=0.0))


def test_catalog_version_numbers_keep_working_past_nine_digits() -> None:
    big = version_name(1_234_567_890)
    assert big == "catalog/v1234567890.sqlite" and version_of(big) == 1_234_567_890
    assert newest(["catalog/v999999999.sqlite", big]) == 1_234_567_890


# -- URLs, endpoints and credentials --------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_empty_bucket_in_the_url_is_refused_and_makes_no_folder(
    scheme: str, tmp_path: Path
) -> None:
    got = invoke("stats", "--cache", f"{scheme}://", cwd=tmp_path)
    assert got.returncode == 2 and "names no bucket" in got.stderr, got.stderr
    assert not any(tmp_path.iterdir())


#: An Azurite connection string whose BlobEndpoint is ``{}``.
AZURITE = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey="
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;"
    "BlobEndpoint={};"
)


@pytest.mark.parametrize(
    ("env", "says"),
    [({"AWS_ENDPOINT_URL": "minio:9000"}, "not an endpoint URL"),
     ({"AWS_ENDPOINT_URL": "http://"}, "not an endpoint URL"),
     ({"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"}, "not an endpoint URL"),
     ({"AWS_PROFILE": "no-such-profile-here"}, "no-such-profile-here"),
     ({"STORAGE_EMULATOR_HOST": "http://"}, "write it as http://host:port"),
     ({"STORAGE_EMULATOR_HOST": "ftp://127.0.0.1:4443"}, "write it as http://host:port"),
     ({"AZURE_STORAGE_CONNECTION_STRING": AZURITE.format("127.0.0.1:10000/devstoreaccount1")},
      "write it as http://host:port"),
     ({"AZURE_STORAGE_CONNECTION_STRING": AZURITE.format("http://")}, "not an endpoint URL")],
)  # fmt: skip
def test_a_malformed_endpoint_or_profile_is_one_line(
    env: dict[str, str], says: str, tmp_path: Path
) -> None:
    """``AWS_ENDPOINT_URL`` and ``AWS_PROFILE`` are boto3's own settings, read by botocore's
    config loader; ``STORAGE_EMULATOR_HOST`` and the connection string's ``BlobEndpoint`` are
    the other clouds' endpoints. Before, gs's was an internal error in its first request
    (requests' "No connection adapters were found"), az's without a scheme an SSL error in
    each (the SDK took it as a host to reach over HTTPS)."""
    scheme = "gs" if "STORAGE_EMULATOR_HOST" in env else "az" if "AZURE" in str(env) else "s3"
    got = invoke(
        "stats", "--cache", f"{scheme}://bucket/p", "--local-cache", tmp_path,
        env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", **env},
    )  # fmt: skip
    assert got.returncode == 2 and says in got.stderr, got.stderr
    assert "internal error" not in got.stderr and len(got.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("place", ["gs"], indirect=True)
def test_an_emulator_host_without_a_scheme_is_read_as_http(
    place: Place, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``STORAGE_EMULATOR_HOST=host:port``, as Google's other clients write it, is
    ``http://host:port``, what featbake's tier folder and messages already took it for: before,
    every gs:// command was an internal error ("InvalidSchema: No connection adapters were
    found"). Here a store's reads and writes, and a command, reach the server."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", place.endpoint.removeprefix("http://"))
    store = ObjectStore(BucketURL.parse(place.url))
    src = tmp_path / "x.bin"
    src.write_bytes(b"bytes")
    assert store.upload("a/x.bin", src) and store.read("a/x.bin").data == b"bytes"
    got = invoke("stats", "--cache", place.url)
    assert got.returncode == 5 and "has no published catalog yet" in got.stderr, got.stderr


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_bad_bucket_name_is_one_line(scheme: str, tmp_path: Path) -> None:
    got = invoke("stats", "--cache", f"{scheme}://Bad_Bucket!/p", "--local-cache", tmp_path)
    assert got.returncode == 2 and "not a bucket name" in got.stderr, got.stderr


def credentialed_env(place: Place) -> tuple[dict[str, str], list[str]]:
    """``place``'s cloud settings with secrets written into them (a user and password in the
    endpoint URL; Azure's account key besides), and the secrets, none of which may be printed
    or name a folder."""
    base = f"http://someone:hunter2secret@127.0.0.1:{upstream_port(place)}"
    env = endpoint_env(place, base)
    connection = place.env.get("AZURE_STORAGE_CONNECTION_STRING", "")
    key = connection.partition("AccountKey=")[2].partition(";")[0]
    return env, ["hunter2secret", *([key] if key else [])]


def test_credentials_in_the_endpoint_reach_no_message_and_no_folder(
    place: Place, tmp_path: Path
) -> None:
    env, secrets = credentialed_env(place)
    got = invoke(
        "stats", "--cache", f"{place.scheme}://no-such-bucket-here/p",
        "--local-cache", tmp_path / "t", env=env,
    )  # fmt: skip
    assert got.returncode == 5, got.stderr
    said = got.stderr + got.stdout
    assert not any(s in said for s in secrets), said
    if "127.0.0.1" in got.stderr:  # where the message names the endpoint, it is masked
        assert "***@127.0.0.1" in got.stderr, got.stderr
    assert "internal error" not in said and len(got.stderr.strip().splitlines()) == 1
    folders = [str(p) for p in (tmp_path / "t").rglob("*")]
    assert folders and not any(s in f or "someone" in f for f in folders for s in secrets)


@pytest.fixture
def stalled_endpoint() -> Iterator[str]:
    """A server that accepts connections and never answers (bounded: closed at the end)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        server.close()


def stalled_env(scheme: str, endpoint: str) -> dict[str, str]:
    """Each cloud's settings naming ``endpoint`` (the old S3 timeout variable for s3, the
    generic one for the others), the clients' waits between tries scaled down."""
    if scheme == "s3":
        named = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k",
                 "AWS_SECRET_ACCESS_KEY": "s", "FEATBAKE_S3_TIMEOUT": "0.5"}  # fmt: skip
    elif scheme == "gs":
        named = {"STORAGE_EMULATOR_HOST": endpoint, "FEATBAKE_OBJECT_TIMEOUT": "0.5"}
    else:
        connection = (
            "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;"
            f"BlobEndpoint={endpoint}/acct;"
        )
        named = {"AZURE_STORAGE_CONNECTION_STRING": connection, "FEATBAKE_OBJECT_TIMEOUT": "0.5"}
    return {**named, **QUICK_BACKOFF}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_stalled_endpoint_is_one_line_not_a_hang(
    stalled_endpoint: str, tmp_path: Path, scheme: str
) -> None:
    pytest.importorskip(
        {"s3": "boto3", "gs": "google.cloud.storage", "az": "azure.storage.blob"}[scheme]
    )
    got = run_cli(
        "stats", "--cache", f"{scheme}://bucket/p", "--local-cache", tmp_path,
        env=stalled_env(scheme, stalled_endpoint), timeout=120,
    )  # fmt: skip
    assert got.returncode == 5, got.stderr
    assert "did not answer" in got.stderr and "internal error" not in got.stderr
    assert "a2V5" not in got.stderr


# -- gc on a bucket -------------------------------------------------------------------------------
def test_a_dry_run_reports_what_the_run_does(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    later = time.time() + HOUR
    store = open_store(place.url, local_cache=tmp_path / "gc")
    dry = gc(store, GcOptions(older_than=1.0, retention=HOUR), now=later, dry_run=True)
    assert len(place.objects("catalog/")) == 1  # nothing published
    done = gc(store, GcOptions(older_than=1.0, retention=HOUR), now=later)
    assert done.rows_deleted == 16 and done.published
    assert dry.rows_deleted == done.rows_deleted
    assert dry.roots_dropped == done.roots_dropped


def test_gc_lists_shards_before_versions_so_a_merge_in_between_loses_nothing(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from featbake.store.bucket import merge_bucket

    # Two parts of a build: their shards and fragments are in the bucket, not yet merged.
    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=place.url, workers=0, shard=part, shard_bytes=60_000)
    assert not place.objects("catalog/") and place.objects("fragments/")
    gc_node = open_store(place.url, local_cache=tmp_path / "gc")
    merger = open_store(place.url, local_cache=tmp_path / "merger")
    real_list = ObjectStore.list
    calls: list[str] = []

    def list_then_merge(self: ObjectStore, prefix: str) -> list:
        got = real_list(self, prefix)
        calls.append(prefix)
        if len(calls) == 1:  # a merge publishes between gc's first listing and the rest
            merge_bucket(merger.remote)  # type: ignore[arg-type]
        return got

    monkeypatch.setattr(ObjectStore, "list", list_then_merge)
    gc(gc_node, GcOptions(retention=0.0), now=time.time() + HOUR)
    monkeypatch.setattr(ObjectStore, "list", real_list)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert_live(ds, encoder_file)


def test_stats_and_export_take_the_local_cache_options(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    tier = tmp_path / "named-tier"
    got = invoke(
        "stats",
        "--cache",
        place.url,
        "--local-cache",
        tier,
        "--local-cache-size",
        "20MiB",
        "--json",
    )
    assert got.returncode == 0, got.stderr
    held = json.loads(got.stdout)["tier"]
    assert held["budget"] == 20 << 20 and held["path"].startswith(str(tier))
    out = tmp_path / "f.zarr"
    exported = invoke("export", out, "--cache", place.url, "--local-cache", tier)
    assert exported.returncode == 0, exported.stderr
    shutil.rmtree(out)
    for args in (["roots"], ["merge"]):
        got = invoke(
            *args, "--cache", place.url, "--local-cache", tier, "--local-cache-size", "1GiB"
        )
        assert got.returncode == 0, (args, got.stderr)
    name = json.loads(invoke("roots", "--cache", place.url, "--json").stdout)[0]["name"]
    dropped = invoke("roots", "drop", name, "--cache", place.url, "--local-cache", tier)
    assert dropped.returncode == 0 and name in dropped.stdout, dropped.stderr


def test_a_read_only_build_into_a_bucket_writes_nothing(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    got = invoke(
        "build", "-e", encoder_file, "-d", audio_dir, "--cache", place.url,
        "--local-cache", tmp_path / "t", env={"FEATBAKE_READ_ONLY": "1"},
    )  # fmt: skip
    assert got.returncode == 5, got.stderr
    assert "read-only here (FEATBAKE_READ_ONLY=1)" in got.stderr and place.url in got.stderr
    assert place.objects() == []  # no shard, no fragment uploaded


def test_a_damaged_fragment_object_is_named_and_blocks_no_other_build(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    from featbake.store.bucket import DamagedFragmentWarning

    for part in ("0/2", "1/2"):  # a build in parts, not merged yet
        build(audio_dir, encoder_file, cache=place.url, workers=0, shard=part)
    fragments = place.objects("fragments/")
    fragment = fragments[-1]
    (tmp_path / "junk").write_bytes(b"not a fragment" * 100)
    bucket_of(place).upload(fragment, tmp_path / "junk")
    other = tmp_path / "other"
    write_audio_folder(other, 3, seconds=0.5, seed=4)
    with pytest.warns(DamagedFragmentWarning, match=rf"{place.url}/{fragment}.*delete that object"):
        report = build(other, encoder_file, cache=open_store(place.url, local_cache=tmp_path / "n"))
    assert report.ok and report.encoded == 3
    assert place.objects("fragments/") == fragments  # left for the user: nothing else lost
    ds = CachedFeatureDataset(
        other, encoder_file, cache=place.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert_live(ds, encoder_file)


def test_a_miss_on_a_bucket_store_names_the_bucket_not_the_tier(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    from featbake.errors import CacheMiss

    build(audio_dir, encoder_file, cache=place.url, workers=0)
    more = tmp_path / "more"
    write_audio_folder(more, 2, seconds=0.5, seed=8)
    tier = tmp_path / "tier"
    ds = CachedFeatureDataset(
        more, encoder_file, cache=place.url, local_cache=tier, on_miss="error"
    )
    with pytest.raises(CacheMiss) as miss:
        ds[0]
    said = str(miss.value)
    assert place.url in said and str(tier) not in said


def test_revalidate_over_a_bucket_prefix_is_refused_in_one_line(place: Place) -> None:
    with pytest.raises(ConfigError, match="revalidate=True is not built for inputs in a bucket"):
        CachedFeatureDataset(
            f"{place.scheme}://{place.bucket}/audio/", "encoder.pt", revalidate=True
        )


def test_a_bucket_build_leaves_the_tier_within_its_budget(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    store = open_store(place.url, local_cache=tier, local_cache_size="120KB")
    report = build(audio_dir, encoder_file, cache=store, workers=0, shard_bytes=30_000)
    assert report.encoded == 16 and len(place.objects("shards/")) > 4
    held = sum(p.stat().st_size for p in tier.rglob("*.safetensors"))
    assert held <= 120_000, held  # its own uploads are copies at once, young or not
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "r", on_miss="error"
    )
    assert_live(ds, encoder_file)


def test_a_nodes_processes_download_a_new_catalog_version_once(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    tier = tmp_path / "node"
    readers = [open_store(place.url, local_cache=tier).remote for _ in range(4)]
    more = tmp_path / "more"
    write_audio_folder(more, 1, seconds=0.5, seed=3)
    build(more, encoder_file, cache=open_store(place.url, local_cache=tmp_path / "b"), workers=0)
    downloads: list[str] = []
    real = ObjectStore.download

    def counted(self: ObjectStore, name: str, dest: Path) -> int:
        if name.startswith("catalog/"):
            downloads.append(name)
        return real(self, name, dest)

    monkeypatch.setattr(ObjectStore, "download", counted)
    start = threading.Barrier(len(readers))

    def sync(store: object) -> None:
        start.wait()
        assert store.sync_catalog() == 2  # type: ignore[attr-defined]

    threads = [threading.Thread(target=sync, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert downloads == [version_name(2)]


def test_one_output_after_a_whole_output_bucket_build_is_copied_not_encoded(
    place: Place, audio_dir: Path, multi_encoder_file: Path, tmp_path: Path
) -> None:
    from featbake.recipe import Recipe

    whole = build(audio_dir, multi_encoder_file, cache=place.url, workers=0)
    assert whole.encoded == 16
    store = open_store(place.url, local_cache=tmp_path / "other-node")
    part = build(
        audio_dir, multi_encoder_file, cache=store, workers=0, recipe=Recipe(output="pooled")
    )
    assert (part.encoded, part.derived) == (0, 16)  # a local store copies; the bucket did not
    ds = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=place.url, local_cache=tmp_path / "r",
        recipe=Recipe(output="pooled"), on_miss="error",
    )  # fmt: skip
    for i in range(len(ds)):
        want = live_features(multi_encoder_file, Path(ds.path(i)), Recipe(output="pooled"))
        torch.testing.assert_close(ds[i], want)


def test_an_open_ranged_reader_finds_features_a_new_version_moved(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "reader",
        on_miss="error", ram_cache=0,
    )  # fmt: skip
    assert_live(ds, encoder_file)  # every shard's ranged reader is open now
    bucket_of(place).delete(place.objects())  # the store is rebuilt with other shards
    rebuilt = open_store(place.url, local_cache=tmp_path / "builder")
    build(audio_dir, encoder_file, cache=rebuilt, workers=0, shard_bytes=25_000)
    assert_live(ds, encoder_file)  # found through the new version: no miss, nothing encoded
    assert ds.cache_info().encoded == 0


def test_gc_older_than_keeps_a_bucket_root_a_dataset_reads(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    then = time.time() - 40 * 86400  # the next version: the store as if built 40 days ago
    publish_edited_version(
        place.url,
        tmp_path,
        ("UPDATE roots SET created=?, last_used=?", (then, then)),
        ("UPDATE features SET last_used=?", (then,)),
    )
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    assert_live(ds, encoder_file)  # a training job's day: every item served
    ds.close()
    done = gc(open_store(place.url, local_cache=tmp_path / "gc"), GcOptions(older_than=86400))
    assert not done.roots_dropped
    reader = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "r2", on_miss="error"
    )
    assert_live(reader, encoder_file)


def test_a_damaged_catalog_version_is_named_with_what_to_do(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place.url, workers=0)
    (tmp_path / "junk").write_bytes(b"SQLite format 3\x00" + b"\x17" * 5000)
    bucket_of(place).upload(version_name(2), tmp_path / "junk")
    got = invoke("stats", "--cache", place.url, "--local-cache", tmp_path / "t")
    assert got.returncode == 6, got.stderr
    assert f"{place.url}/{version_name(2)}" in got.stderr and "delete that object" in got.stderr
    assert "internal error" not in got.stderr


def test_a_planted_root_name_is_never_followed_to_a_path(
    place_store: str, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    build(audio_dir, encoder_file, cache=place_store, workers=0)
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    hostile = outside(victim)
    then = time.time() - HOUR  # the root is older than --older-than 1s
    plant(
        place_store,
        tmp_path,
        ("UPDATE roots SET name = ?, created = ?, last_used = ?", (hostile, then, then)),
        ("UPDATE root_items SET root = ?", (hostile,)),
        ("UPDATE features SET last_used = ?", (then,)),
    )
    got = invoke("gc", "--cache", place_store, "--older-than", "1s")
    assert got.returncode == 6 and "not a root name" in got.stderr, got.stderr
    assert victim.read_text() == "precious"


def test_hints_fetch_the_coming_shards_in_the_background(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30 item 4: with whole-shard reads a reader's hints (FeatureLoader's read-ahead)
    start the coming shards' fetches on a background thread, epoch 1 included; the reads then
    find them in the tier."""
    from featbake.store.bucket import PREFETCH_AHEAD

    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")
    build(audio_dir, encoder_file, cache=place.url, workers=0, shard_bytes=60_000)
    tier = tmp_path / "reader"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tier, on_miss="error", ram_cache=0
    )
    store = ds._layout.remote
    assert store is not None and not list(tier.rglob("*.safetensors"))
    first = [i for i in range(len(ds)) if ds._index.shard[i] == ds._index.shard[0]]
    ds.will_need(range(len(ds)))  # a hint: nothing read, nothing waited for
    deadline = time.monotonic() + 60
    while store.prefetches_in_flight() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    held = list(tier.rglob("*.safetensors"))
    # The first shards came in ahead of any read: at least PREFETCH_AHEAD of them (more when
    # earlier fetches finished while the hint was still being walked).
    assert len(held) >= PREFETCH_AHEAD
    first_shard = ds._index.shard_names[int(ds._index.shard[first[0]])]
    assert any(p.name.startswith(first_shard) for p in held)
    fetched = store.tier.fetched  # type: ignore[attr-defined]
    for i in first:  # the first item's shard came in ahead: reading it fetches nothing
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    assert store.tier.fetched == fetched  # type: ignore[attr-defined]
    assert_live(ds, encoder_file)


# -- a tier's copy is not the bucket's object ----------------------------------------------------
def test_a_shard_object_deleted_as_verify_says_is_built_again_from_a_node_holding_a_copy(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """``verify`` names a damaged shard object: "delete this object, then build again". Run
    from the node that built the store, the build reused every key (its tier still held the
    shard) and uploaded nothing: verify named the shard missing for ever, and other nodes
    missed its items. What is stored is now asked of the bucket, not of the tier's copy."""
    tier = tmp_path / "node-a"
    build(audio_dir, encoder_file, cache=open_store(s3.url, local_cache=tier), workers=0,
          shard_bytes=60_000)  # fmt: skip
    shard = s3.objects("shards/")[0]
    flip_a_byte(s3, shard, tmp_path / "flipped")
    (bad,) = verify(s3.url, local_cache=tmp_path / "checker").remaining
    assert "delete this object" in bad.detail
    bucket_of(s3).delete([shard])
    again = build(audio_dir, encoder_file, cache=open_store(s3.url, local_cache=tier), workers=0,
                  shard_bytes=60_000)  # fmt: skip
    assert again.encoded > 0 and again.encoded + again.reused == 16
    assert verify(s3.url, local_cache=tmp_path / "checker-2").status == "clean"
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "node-b", on_miss="error"
    )
    assert_live(ds, encoder_file)


def test_a_shard_is_uploaded_whatever_a_listing_said_and_whoever_evicts_its_tier_copy(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two races of a build's upload. A listing taken before a gc swept an unnamed object of
    the same bytes (a killed build's): the upload was skipped, and the catalog named a shard
    the bucket lacked. Another process's reads evicting the tier's copy between the check and
    the upload: ``internal error: FileNotFoundError``. Each shard is now uploaded from a hard
    link of the tier's copy."""
    tier = tmp_path / "node-a"
    build(audio_dir, encoder_file, cache=open_store(s3.url, local_cache=tier), workers=0,
          shard_bytes=60_000)  # fmt: skip
    shard = s3.objects("shards/")[0]
    name = Path(shard).stem
    want = bucket_of(s3).read(shard).data
    store = bucket_store(s3.url, tier)  # a fresh process's view: nothing uploaded by it yet
    assert name in store.shard_objects()  # the listing names the object...
    bucket_of(s3).delete([shard])  # ...that a gc then sweeps
    store.publish_shards([name])
    assert bucket_of(s3).read(shard).data == want
    bucket_of(s3).delete([shard])
    store = bucket_store(s3.url, tier)
    upload = store.bucket.upload

    def evicted_first(obj: str, src: Path, **kw: bool) -> bool:
        store.layout.shard_path(name).unlink()  # another process's read made room
        return upload(obj, src, **kw)

    monkeypatch.setattr(store.bucket, "upload", evicted_first)
    store.publish_shards([name])
    assert bucket_of(s3).read(shard).data == want
    assert not list(store.layout.tmp.glob("*.upload"))  # the link is gone with its upload


def test_one_flipped_byte_in_a_catalog_version_is_named_by_every_command(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """A damaged page of a published version: ``verify`` said clean (exit 0) while ``stats``,
    ``gc``, ``roots`` and ``build`` ended in ``internal error: DatabaseError: database disk
    image is malformed``. The download's check runs SQLite's ``quick_check`` now."""
    build(audio_dir, encoder_file, cache=s3.url, workers=0)
    version = tmp_path / "v1.sqlite"
    bucket_of(s3).download(version_name(1), version)
    data = bytearray(version.read_bytes())
    data[4096] ^= 0xFF  # page 2's kind: a table's b-tree page no more
    version.write_bytes(bytes(data))
    bucket_of(s3).upload(version_name(2), version)
    for command in ("verify", "stats"):
        got = invoke(command, "--cache", s3.url, "--local-cache", tmp_path / command)
        assert got.returncode == 6, got.stdout + got.stderr
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{s3.url}/{version_name(2)} is damaged" in lines[0], lines
        assert "delete that object" in lines[0]


def test_a_range_past_an_objects_end_is_no_bytes_on_every_cloud(
    place: Place, tmp_path: Path
) -> None:
    """A shard object cut short since its reader learned its size: gs answered no bytes (the
    reader then said the shard is damaged, exit 6), s3 and az refused the range ("InvalidRange
    ... not satisfiable", exit 5) and named no damage."""
    (tmp_path / "ten").write_bytes(b"0123456789")
    bucket = bucket_of(place)
    bucket.upload("shards/ab/short", tmp_path / "ten")
    got = bucket.read_range_of("shards/ab/short", 20, 5)
    assert got.data == b"" and got.info.size == 10
    assert bucket.read_range("shards/ab/short", 10, 4) == b""
    assert bucket.read_range("shards/ab/short", 8, 4) == b"89"
    with pytest.raises(FileNotFoundError):
        bucket.read_range_of("shards/ab/none", 20, 5)


@pytest.mark.parametrize(
    ("ram_cache", "dequantize"), [(0, False), ("64MiB", True)], ids=["store-packed", "ram"]
)
def test_an_int8_row_scale_not_finite_in_an_object_is_named_with_the_buckets_fix(
    s3: S3,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ram_cache: object,
    dequantize: bool,
) -> None:
    """An int8 row whose scale is not finite (its checksum left as it was), read by ranges with
    verify="never", was refused by a batch and by the RAM tier naming the tier's path (where
    nothing lies) and `featbake verify --repair` (refused on a bucket): every path names the
    object and the bucket's fix now, as a read of the item alone did; its neighbours are served
    as the encoder gives them now."""
    build(audio_dir, encoder_file, cache=s3.url, recipe=Recipe(dtype="int8"), batch_size=1)
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "ranged")

    def dataset() -> CachedFeatureDataset:
        return CachedFeatureDataset(
            audio_dir, encoder_file, cache=s3.url, local_cache=tmp_path / "node", dtype="int8",
            on_miss="error", verify="never", ram_cache=ram_cache, dequantize=dequantize,
        )  # fmt: skip

    ds, bad = dataset(), 5
    name = nan_scale_in_object(bucket_of(s3), ds._index.key(bad), tmp_path / "x")
    damaged = rf"^{re.escape(s3.url)}/{re.escape(name)} is damaged in the bucket \(tensor \S+ "
    damaged += r"has a row scale that is not finite\): nothing of it is served; delete it, then"
    served = {
        i: live_features(encoder_file, Path(ds.path(i)), Recipe(dtype="float32")) for i in (3, 4, 7)
    }

    def assert_served(i: int, got: torch.Tensor) -> None:
        if not dequantize:
            got = dequantize_rows(got, Scheme.INT8, torch.float32)
        torch.testing.assert_close(got.float(), served[i], atol=0.05, rtol=0.05)

    for _ in range(2):  # read as stored, then located (or the RAM tier)
        with pytest.raises(StoreCorrupt, match=damaged):
            ds[bad]
        assert_served(4, ds[4])
    ds = dataset()
    for _ in range(2):  # padded batches: planned, then located (or the RAM tier)
        with pytest.raises(StoreCorrupt, match=damaged):
            ds.__getitems__([3, bad, 7])
        for i, got in zip((3, 7), ds.__getitems__([3, 7]), strict=True):
            assert_served(i, got)
    with pytest.raises(StoreCorrupt, match=damaged):
        ds[bad]
    with pytest.raises(StoreCorrupt, match=damaged):
        for _ in FeatureLoader(dataset(), batch_size=6, shuffle=False):
            pass


def nan_scale_in_object(bucket: ObjectStore, key: str, tmp: Path) -> str:
    """Write NaN over the second row's scale of ``key``'s stored int8 tensor in the shard
    object holding it (its checksum left as it was); that object's name."""
    for name in (o.name for o in bucket.list("shards/")):
        bucket.download(name, tmp)
        with ShardReader(tmp) as reader:
            info = reader.tensors.get(key)
        if info is None:
            continue
        width = info.shape[-1]
        at = info.begin + width + width - 4
        blob = bytearray(tmp.read_bytes())
        blob[at : at + 4] = np.float32(np.nan).tobytes()
        tmp.chmod(0o644)
        tmp.write_bytes(bytes(blob))
        bucket.upload(name, tmp)
        return name
    raise AssertionError(f"no shard object holds {key}")
