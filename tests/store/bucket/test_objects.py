"""The byte seam (``featbake.store.objects``): each scheme's class against its real server on
loopback (moto, fake-gcs-server, Azurite) answers the same calls alike: paged listings with a
start-after name and a delimiter, stat, whole and ranged GETs, create-only puts that one racer
wins, deletes, and one-line errors for what is absent."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import featbake
from featbake.errors import ConfigError, StoreError
from featbake.store.objects import AzureObjects, GCSObjects, ObjectStore, S3Objects
from featbake.store.url import BucketURL, azure_blob_endpoint, redact
from tests.store.bucket.conftest import S3, Remote
from tests.store.bucket.faults import Asked, DroppingProxy


def store_of(place: Remote | S3) -> ObjectStore:
    return ObjectStore(BucketURL.parse(place.url))


def put(store: ObjectStore, tmp_path: Path, name: str, data: bytes, **kw: bool) -> bool:
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    return store.upload(name, src, **kw)


def test_each_scheme_has_its_class() -> None:
    kinds = {s: type(ObjectStore(BucketURL.parse(f"{s}://team/p"))) for s in ("s3", "gs", "az")}
    assert kinds == {"s3": S3Objects, "gs": GCSObjects, "az": AzureObjects}


def test_listing_stat_and_reads_agree_on_every_place(place: Remote | S3, tmp_path: Path) -> None:
    store = store_of(place)
    names = ["a/1.bin", "a/2.bin", "a/3.bin", "a/sub/4.bin", "b.bin"]
    for i, name in enumerate(names):
        assert put(store, tmp_path, name, bytes(range(i, i + 100)))
    assert [o.name for o in store.list("a/")] == names[:4]
    first = store.list_page("a/", keys=2)
    assert [o.name for o in first.objects] == ["a/1.bin", "a/2.bin"] and first.truncated
    rest = store.list_page("a/", after=first.last, keys=2)
    assert [o.name for o in rest.objects] == ["a/3.bin", "a/sub/4.bin"]
    rolled = store.list_page("a/", after="a/1.bin", delimiter="/")
    assert [o.name for o in rolled.objects] == ["a/2.bin", "a/3.bin"]
    assert rolled.last == "a/sub/" and not rolled.truncated

    info = store.head("a/2.bin")
    assert info is not None and info.size == 100 and info.etag
    assert store.head("a/none.bin") is None
    whole = store.read("a/2.bin")
    assert whole.data == bytes(range(1, 101)) and whole.info == info
    assert store.read_range("a/2.bin", 10, 5) == bytes(range(11, 16))
    ranged = store.read_range_of("a/2.bin", 95, 10)  # fewer at its end
    assert ranged.data == bytes(range(96, 101)) and ranged.info.size == 100
    assert ranged.info.etag == info.etag
    dest = tmp_path / "dest.bin"
    dest.write_bytes(b"x" * 500)  # a reserved file: cut to the object's size
    assert store.download("a/2.bin", dest) == 100 and dest.read_bytes() == whole.data
    with pytest.raises(FileNotFoundError, match=r"a/none\.bin"):
        store.read("a/none.bin")

    store.delete(["a/1.bin", "a/none.bin"])  # one already gone is no error
    assert [o.name for o in store.list("a/")] == names[1:4]


def test_a_rewrite_changes_the_version_tag(place: Remote | S3, tmp_path: Path) -> None:
    store = store_of(place)
    put(store, tmp_path, "x.bin", b"one")
    before = store.head("x.bin")
    put(store, tmp_path, "x.bin", b"two")
    after = store.head("x.bin")
    assert before is not None and after is not None and before.etag != after.etag


def deletes_conditionally(place: Remote | S3, tmp_path: Path) -> bool:
    """Whether ``place``'s server honours a delete's condition: an object put again after it
    was seen, then deleted as seen, is still there. fake-gcs-server as the wrapper ships it
    deletes whatever ``ifGenerationMatch`` says (fsouza/fake-gcs-server#1282, fixed upstream
    by #2343); Google Cloud Storage answers 412."""
    store = store_of(place)
    name = f"probe-{uuid.uuid4().hex[:8]}.bin"
    put(store, tmp_path, name, b"seen")
    seen = store.head(name)
    assert seen is not None
    put(store, tmp_path, name, b"seen")
    store.delete([seen])
    there = store.head(name) is not None
    store.delete([name])
    return there


def test_a_delete_of_an_object_as_listed_keeps_it_once_put_again(
    place: Remote | S3, tmp_path: Path
) -> None:
    """A delete given objects as a listing saw them deletes only those versions: one put again
    since with other bytes is kept on every cloud, and so is one put again with the same bytes
    on gs and az, whose version tags change with every put (s3's ETag does not: the next
    test); the kept names are returned, nothing raises. One unchanged, or already gone, goes
    and is not kept; a name alone goes whatever it holds."""
    if place.scheme == "gs" and not deletes_conditionally(place, tmp_path):
        pytest.skip("this fake-gcs-server ignores a delete's ifGenerationMatch (#1282)")
    store = store_of(place)
    for name in ("same.bin", "other.bin", "still.bin", "gone.bin", "plain.bin"):
        put(store, tmp_path, name, b"first")
    listed = {o.name: o for o in store.list("")}
    put(store, tmp_path, "other.bin", b"second")
    if place.scheme != "s3":
        put(store, tmp_path, "same.bin", b"first")
    store.delete(["gone.bin"])
    doomed = [listed[n] for n in ("same.bin", "other.bin", "still.bin", "gone.bin")]
    kept = store.delete([*doomed, "plain.bin"])
    expected = ["other.bin"] if place.scheme == "s3" else ["same.bin", "other.bin"]
    assert kept == expected
    assert [o.name for o in store.list("")] == sorted(expected)
    assert store.read("other.bin").data == b"second"


@pytest.mark.parametrize("place", ["gs", "az"], indirect=True)
def test_a_delete_of_an_object_as_listed_sends_its_version_as_the_condition(
    place: Remote | S3, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """What reaches the server: gs's DELETE carries ``ifGenerationMatch`` with the generation
    listed, az's ``If-Match`` with the ETag listed (quoted, as the service gave it); a name
    alone carries none. Checked on the wire, where fake-gcs-server ignores the condition."""
    store = store_of(place)
    put(store, tmp_path, "a.bin", b"bytes")
    put(store, tmp_path, "b.bin", b"bytes")
    (seen,) = store.list("a.bin")
    proxy = proxied()
    store = store_of(place)  # a client of the proxy
    store.delete([seen, "b.bin"])
    deletes = [a for a in proxy.requests if a.method == "DELETE"]
    assert [a.names("features/a.bin") for a in deletes] == [True, False]
    conditional, plain = deletes
    if place.scheme == "gs":
        assert f"ifGenerationMatch={seen.etag}" in conditional.target
        assert "ifGenerationMatch" not in plain.target
    else:
        assert f'if-match: "{seen.etag}"'.lower() in conditional.head.lower()
        assert "if-match" not in plain.head.lower()


def test_an_s3_delete_keeps_an_object_last_changed_after_it_was_seen(
    s3: S3, tmp_path: Path
) -> None:
    """S3 conditions a delete on the ETag alone, which the same bytes put again keep: its
    delete of an object as seen keeps one whose last change is a second or more after the one
    seen (a HEAD first), and deletes one seen at its last change, whatever the milliseconds a
    listing gave beside the HEAD's whole seconds."""
    store = store_of(s3)
    put(store, tmp_path, "shard.bin", b"same bytes")
    now = store.head("shard.bin")
    assert now is not None
    seen_before = now._replace(modified=now.modified - 5)  # listed before its last put
    assert store.delete([seen_before]) == ["shard.bin"]
    assert store.read("shard.bin").data == b"same bytes"
    seen_at = now._replace(modified=now.modified + 0.9)  # a listing's milliseconds
    assert store.delete([seen_at]) == [] and store.head("shard.bin") is None


def test_an_s3_delete_refused_per_key_is_one_line_not_counted_as_deleted(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 authorises ``DeleteObjects`` per key and answers 200 with the keys it refused in the
    body's ``Errors`` (a missing ``s3:DeleteObject``, an object lock); the answer moto gives
    is passed through with such a refusal added for one key. The delete says so in one line
    naming the key, the code and what to check; the other key is deleted. Before, the answer
    was not read: gc counted a refused shard as deleted and its bytes as freed."""
    store = store_of(s3)
    for name in ("a.bin", "b.bin"):
        put(store, tmp_path, name, name.encode())
    real = store.client.delete_objects

    def refusing_one(**kw: Any) -> Any:
        kept = kw["Delete"]["Objects"][0]
        rest = kw["Delete"]["Objects"][1:]
        answer = real(**{**kw, "Delete": {**kw["Delete"], "Objects": rest}})
        refusal = {"Key": kept["Key"], "Code": "AccessDenied", "Message": "Access Denied"}
        return {**answer, "Errors": [refusal]}

    monkeypatch.setattr(store.client, "delete_objects", refusing_one)
    with pytest.raises(StoreError) as refused:
        store.delete(store.list(""))
    line = str(refused.value)
    assert "\n" not in line and "1 of 2 objects could not be deleted" in line, line
    assert "a.bin: AccessDenied" in line and "delete permission" in line, line
    assert [o.name for o in store.list("")] == ["a.bin"]


@pytest.mark.parametrize("size", [1000, 9 << 20])
def test_of_two_racing_create_only_puts_one_wins(
    place: Remote | S3, tmp_path: Path, size: int, request: pytest.FixtureRequest
) -> None:
    """What keeps two merges from both publishing one catalog version; 9 MiB: a catalog past
    google-cloud-storage's 8 MiB, which it uploads resumable. GCS enforces
    ``ifGenerationMatch=0`` there too; the fake-gcs-server binary of the pip wrapper does not
    (fsouza/fake-gcs-server#1967, fixed in its PR #2260): both racers win, so gs is expected
    to fail at that size until the binary is newer (strict: the test says when it is). S3's
    create-only put is one ``If-None-Match: *`` request at any size (``S3Objects.put``), the
    1,000-byte case's; moto's server tests the condition before it has taken a 9 MiB body and
    let both racers win once in a full run: a race of the emulator's, not of the client's."""
    if place.scheme == "s3" and size > 8 << 20:
        pytest.skip("one request at any size on s3, as at 1,000 bytes; moto's check races")
    if place.scheme == "gs" and size > 8 << 20:
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="fake-gcs-server#1967: resumable uploads")
        )
    store = store_of(place)
    won: dict[int, bool] = {}
    start = threading.Barrier(2)

    def racer(i: int) -> None:
        src = tmp_path / f"v{i}.sqlite"
        src.write_bytes(bytes([i]) * size)
        start.wait()
        won[i] = store.upload("catalog/v000000001.sqlite", src, create=True)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won.values()) == [False, True]
    winner = next(i for i, w in won.items() if w)
    assert store.read("catalog/v000000001.sqlite").data == bytes([winner]) * size
    assert not put(store, tmp_path, "catalog/v000000001.sqlite", b"late", create=True)


def test_opening_a_store_and_reading_an_object_asks_for_that_object_alone(
    place: Remote | S3,
    tmp_path: Path,
    proxied: Callable[..., DroppingProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every request a new client sends for a read names the object: nothing featbake did not
    ask for. google-cloud-storage (3.11 on) gave each new client a thread that fetched the
    bucket's metadata for OpenTelemetry spans (traces off), a request per process and bucket
    with the library's own retries, going on after featbake gave up on a stalled endpoint.
    The threads the read started are joined before counting, so the count is whole."""
    put(store_of(place), tmp_path, "a.bin", b"x" * 100)
    proxy = proxied()
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def recorded(thread: threading.Thread) -> None:
        started.append(thread)
        start(thread)

    store = store_of(place)  # a new client, made on its first call
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", recorded)
        assert store.read("a.bin").data == b"x" * 100
    for thread in started:
        if thread not in proxy.threads:
            thread.join(30)
    assert proxy.requests, "the read did not go through the proxy"
    others = [a for a in proxy.requests if not a.names(store.key("a.bin"))]
    assert not others, others


def test_a_missing_bucket_is_one_line(place: Remote | S3) -> None:
    store = ObjectStore(BucketURL.parse(f"{place.url.split(':')[0]}://fb-nobucket-here/p"))
    with pytest.raises(StoreError, match=r"the bucket 'fb-nobucket-here' does not exist"):
        store.list("catalog/")


def test_no_azure_account_is_one_line_saying_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"AZURE_STORAGE_CONNECTION_STRING.*ACCOUNT_NAME"):
        ObjectStore(BucketURL.parse("az://features/p")).list("")


def test_connection_strings_reach_no_message_and_no_tier_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "c2VjcmV0a2V5"
    connection = (
        f"DefaultEndpointsProtocol=https;AccountName=team;AccountKey={secret};"
        "EndpointSuffix=core.windows.net"
    )
    assert secret not in redact(f"cannot parse {connection}")
    assert secret not in redact("https://team.blob.core.windows.net/c/x?sv=1&sig=c2VjcmV0a2V5")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
    assert azure_blob_endpoint({"AZURE_STORAGE_CONNECTION_STRING": connection}) == (
        "https://team.blob.core.windows.net"
    )
    folder = ObjectStore(BucketURL.parse("az://features/p")).tier_folder()
    assert folder == "az_team.blob.core.windows.net" and secret not in folder
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    assert ObjectStore(BucketURL.parse("gs://bb/p")).tier_folder() == "gs_127.0.0.1_4443"


def test_an_azure_account_without_a_key_or_azure_identity_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "team")
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # not installed
    with pytest.raises(
        ConfigError,
        match=r"^no credentials for az://features/p: set AZURE_STORAGE_CONNECTION_STRING, or "
        r"AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_KEY \(or pip install azure-identity",
    ):
        ObjectStore(BucketURL.parse("az://features/p")).list("")


def test_gcs_without_credentials_is_one_line_saying_what_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("google.cloud.storage")
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud login here
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no VM's service account
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    with pytest.raises(StoreError, match=r"^no credentials for gs://bb/p: run `gcloud auth"):
        ObjectStore(BucketURL.parse("gs://bb/p")).list("")


def test_gcs_whose_token_endpoint_cannot_be_reached_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A service account's key whose token endpoint refuses the connection (an offline node, a
    firewall): an internal TransportError before, now the one line of a store not reached."""
    pytest.importorskip("google.cloud.storage")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()  # fmt: skip
    account = {"type": "service_account", "project_id": "p", "private_key_id": "1",
               "private_key": pem, "client_email": "x@p.iam.gserviceaccount.com",
               "client_id": "1", "token_uri": "http://127.0.0.1:9/token"}  # fmt: skip
    (tmp_path / "sa.json").write_text(json.dumps(account))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "sa.json"))
    monkeypatch.setenv("FEATBAKE_OBJECT_BACKOFF", "0.01")
    with pytest.raises(StoreError, match=r"^cannot reach the token endpoint of the Application"):
        ObjectStore(BucketURL.parse("gs://bb/p")).list("")


def test_a_missing_object_in_a_gs_bucket_named_with_bucket_is_absent(
    gcs_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 404 was a missing bucket wherever the bucket's name (in the request's URL) held the
    word "bucket": a shard deleted under ``gs://team-bucket/...`` stopped every reader with
    "the bucket does not exist" instead of being a miss."""
    for k, v in gcs_server.env.items():
        monkeypatch.setenv(k, v)
    name = f"fb-bucket-{uuid.uuid4().hex[:8]}"
    gcs_server.make_bucket(name)
    store = ObjectStore(BucketURL.parse(f"gs://{name}/bucket-prefix"))
    assert store.head("shards/ab/gone.safetensors") is None
    with pytest.raises(FileNotFoundError):
        store.read("shards/ab/gone.safetensors")
    store.delete(["shards/ab/gone.safetensors"])  # gone already: nothing to do
    with pytest.raises(StoreError, match=r"the bucket 'fb-bucket-none' does not exist"):
        ObjectStore(BucketURL.parse("gs://fb-bucket-none/p")).list("catalog/")


def test_an_object_whose_key_holds_an_empty_folder_is_passed_over_not_read_as_another(
    place: Remote | S3, tmp_path: Path
) -> None:
    """``audio/sub//x.wav`` beside ``audio/sub/x.wav``: read back from its URL as a path, the
    first was the second (``//`` collapsed), so its item was hashed, encoded and served from
    the other object's bytes. It is passed over with why; a manifest naming it, refused."""
    from featbake.store.byteplace import OBJECTS, UNNAMABLE_KEY, bytes_at

    store = ObjectStore(BucketURL.parse(place.url))
    for key, data in (("audio/sub/x.wav", b"one"), ("audio/sub//x.wav", b"two")):
        (tmp_path / "f").write_bytes(data)
        store.upload(key, tmp_path / "f")
    found = OBJECTS.inputs(f"{place.url}/audio", [".wav"])
    assert found.inputs == ["sub/x.wav"]
    assert [(p.path, p.reason) for p in found.skipped] == [("sub//x.wav", UNNAMABLE_KEY)]
    odd = f"{place.url}/audio/sub//x.wav"
    with pytest.raises(ConfigError, match=r"holds an empty, '\.' or '\.\.' folder"):
        bytes_at(odd).named(odd, "")


def test_an_azure_listing_past_a_page_names_every_object_whatever_the_order(
    azurite_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Azure has no "start after": a page listed from the prefix again and skipped names in
    code point order, where Azurite lists in UTF-16 order (an emoji before U+FF01): a name at
    a page's edge was skipped, its input never built. A listing is now paged by the service's
    own tokens."""
    from featbake.store.objects import LIST_PAGE_KEYS

    for k, v in azurite_server.env.items():
        monkeypatch.setenv(k, v)
    name = f"fb-{uuid.uuid4().hex[:12]}"
    azurite_server.make_bucket(name)
    store = ObjectStore(BucketURL.parse(f"az://{name}/p"))
    (tmp_path / "f").write_bytes(b"x")
    names = [f"a{i:04d}.wav" for i in range(LIST_PAGE_KEYS - 1)]
    names += ["b\U0001f600.wav", "b\uff01.wav"]

    def upload(chunk: list[str]) -> None:
        for n in chunk:
            store.upload(n, tmp_path / "f")

    threads = [threading.Thread(target=upload, args=(names[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o.name for o in store.list("")] == sorted(names)


def test_inputs_read_bytes_through_the_store_seam_and_never_branch_on_urls() -> None:
    """Every input kind reads its bytes through ``featbake.store.byteplace`` (a local file or an
    object behind one interface): outside ``featbake/store`` no code asks whether a path is a
    URL (35 places did, each a branch of its own)."""
    root = Path(featbake.__file__).parent
    asking = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path.parent.name != "store"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "is_url(" in line
    ]
    assert asking == []


@pytest.mark.parametrize("place", ["gs"], indirect=True)
def test_each_chunk_request_of_a_gs_resumable_upload_is_tried_again_on_its_own(
    place: Remote | S3, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """google-cloud-storage sends a resumable upload's chunks (files over 8 MiB) as requests
    apart, each wrapped by the one retry policy of the call: its predicate counted the retries
    of all of them together, so a multi-GB upload had 3 retries in all, not 3 per request.
    Here the connections of 4 chunk requests close before the server reads them, each once
    (fake-gcs-server appends a chunk sent again whole, where GCS answers with what it has: an
    answer lost after the chunk was stored would corrupt the object here): each request is sent
    again and the upload completes whole, as on GCS."""
    from featbake.store.objects import gcs_retry, timeouts

    chunk = 256 << 10  # the library's smallest chunk
    data = os.urandom((8 << 20) + chunk)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    key = BucketURL.parse(place.url).key("big.bin")
    to_lose = {k * chunk for k in (1, 2, 3, 4)}

    def chunk_request(asked: Asked) -> bool:
        sent = re.search(r"\r\ncontent-range: bytes (\d+)-", asked.head, re.IGNORECASE)
        first = sent is not None and int(sent[1]) in to_lose
        if first and sent is not None:
            to_lose.discard(int(sent[1]))
        return asked.method == "PUT" and first

    proxy = proxied(refuse=chunk_request)
    store = store_of(place)
    blob = store.client.blob(key, chunk_size=chunk)
    blob.upload_from_filename(str(src), retry=gcs_retry(cut_bodies=True), timeout=timeouts())
    assert len(proxy.cut) == 4 and not to_lose
    assert store.read("big.bin").data == data


def test_an_objects_digest_with_nothing_held_is_streamed_from_one_get(
    place: Remote | S3, tmp_path: Path
) -> None:
    """A digest with nothing held (a Ray hashing task's: 8 readers per CPU) read each object
    whole into memory, some 512 objects at once on a 64-CPU node. It is hashed as it comes
    now, from one GET whose stat it records. Not bounded on az: azure-storage-blob's downloader
    holds several copies of what each GET reads (a 6 MiB object peaked at 56 MB in one GET;
    in GETs of 4 MiB, ``AZURE_GET_BYTES``, at 38 MB, and so does a 24 MiB one)."""
    import hashlib
    import tracemalloc

    from featbake.store.byteplace import bytes_at

    data = os.urandom(6 << 20)
    store = store_of(place)
    assert put(store, tmp_path, "a.wav", data)
    info = store.head("a.wav")
    assert info is not None
    url = f"{place.url}/a.wav"
    objects = bytes_at(url)
    objects.digest(url, store.file_stat(info))  # the client made, its pool warm
    tracemalloc.start()
    try:
        got = objects.digest(url, store.file_stat(info))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not isinstance(got, str), got
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.stat == store.file_stat(info)
    if place.scheme != "az":
        assert peak < len(data) // 2, peak  # 1 MiB chunks (whole before: 6.3-6.8 MiB)


def test_a_streamed_digest_cut_mid_body_is_hashed_again_from_the_start(
    place: Remote | S3, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """A cut body is read again whole, and the hash starts again with it: a hash that went on
    from the bytes of the cut try would be wrong, and recorded as the object's."""
    import hashlib

    from featbake.store.byteplace import bytes_at

    data = os.urandom(3 << 20)
    assert put(store_of(place), tmp_path, "a.wav", data)
    proxy = proxied(drops=1, after=1 << 20)
    store = store_of(place)
    info = store.head("a.wav")
    assert info is not None
    url = f"{place.url}/a.wav"
    got = bytes_at(url).digest(url, store.file_stat(info))
    assert proxy.dropped == 1
    assert not isinstance(got, str) and got.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("raw", ["fast", "-1", "nan", "inf"])
def test_a_bad_backoff_setting_is_one_line_on_every_cloud(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$FEATBAKE_OBJECT_BACKOFF`` (what the waits between a request's tries are multiplied
    by) is checked where a client is made (s3, az) or a call is tried (gs): one line naming it."""
    from featbake.store.objects import backoff_scale, gcs_retry

    monkeypatch.setenv("FEATBAKE_OBJECT_BACKOFF", raw)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    calls: list[Callable[[], object]] = [
        backoff_scale,
        lambda: gcs_retry(cut_bodies=True),
        lambda: ObjectStore(BucketURL.parse("s3://team/p")).client,
        lambda: ObjectStore(BucketURL.parse("az://team/p")).client,
    ]
    for call in calls:
        with pytest.raises(ConfigError) as said:
            call()
        message = str(said.value)
        assert "$FEATBAKE_OBJECT_BACKOFF" in message and repr(raw) in message, message
        assert "\n" not in message


def test_the_backoff_setting_scales_every_clouds_waits_not_its_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One setting scales the waits between tries on s3 (botocore's delays after a throttled
    answer: up to 1, 2, 4 s), gs (``gcs_retry``: 1, 2, 4 s) and az (the SDK's policy: 3, 5,
    9 s, +-1 s), and leaves the number of tries as it was: botocore still retries the third
    attempt and not the fourth."""
    from azure.storage.blob import ExponentialRetry
    from botocore.awsrequest import AWSResponse

    from featbake.store.objects import MAX_ATTEMPTS, azure_retry, backoff_scale, gcs_retry

    assert backoff_scale() == 1.0
    default = azure_retry(ExponentialRetry)
    assert [round(default.get_backoff_time({"count": n})) for n in (1, 2, 3)] != [0, 0, 0]
    monkeypatch.setenv("FEATBAKE_OBJECT_BACKOFF", "0.01")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert backoff_scale() == 0.01
    scaled = azure_retry(ExponentialRetry)
    for n in (1, 2, 3):  # 1 + 2**n s, +-1 s, a hundredth of it
        assert 0.01 * 2**n <= scaled.get_backoff_time({"count": n}) <= 0.01 * (2 + 2**n)
    retry = gcs_retry(cut_bodies=True)
    assert (retry._initial, retry._maximum) == (0.01, 0.04)

    client = ObjectStore(BucketURL.parse("s3://team/p")).client
    op = client.meta.service_model.operation_model("GetObject")
    throttled = AWSResponse("http://127.0.0.1:9/team/p/x", 503, {}, None)

    def delay(attempt: int) -> object:
        answers = client.meta.events.emit(
            "needs-retry.s3.GetObject",
            response=(throttled, {"Error": {"Code": "SlowDown"}}),
            endpoint=None,
            operation=op,
            attempts=attempt,
            caught_exception=None,
            request_dict={"context": {}},
        )
        return next((a for _, a in answers if a is not None), None)

    for attempt in range(1, MAX_ATTEMPTS):
        waits = [delay(attempt) for _ in range(10)]
        assert all(isinstance(w, float) and 0 <= w <= 0.01 * 2 ** (attempt - 1) for w in waits)
    assert delay(MAX_ATTEMPTS) is None  # the tries are botocore's 4, as before


@pytest.mark.parametrize("place", ["gs"], indirect=True)
def test_a_gzip_encoded_gs_object_is_one_line_on_every_read(
    place: Remote | S3, tmp_path: Path
) -> None:
    """An object uploaded gzip-encoded (``gsutil cp -Z``: ``Content-Encoding: gzip``) is served
    decompressed, another size than stored. Before: a whole read and a digest said the body
    "ended after 51000 of 1201 bytes" after 4 tries (a network fault, it seemed), a ranged read
    was requests' ContentDecodingError (an internal error), a download took the decompressed
    bytes in silence. Each read is now one line that says what it is and what to do."""
    import gzip

    data = os.urandom(1000) + b"a" * 50_000
    store = store_of(place)
    blob = store.client.blob(BucketURL.parse(place.url).key("x.wav"))
    blob.content_encoding = "gzip"
    blob.upload_from_string(gzip.compress(data), content_type="audio/wav")
    reads: dict[str, Callable[[], object]] = {
        "read": lambda: store.read("x.wav"),
        "range": lambda: store.read_range("x.wav", 10, 20),
        "digest": lambda: store.hashed("x.wav"),
        "download": lambda: store.download("x.wav", tmp_path / "x.wav"),
    }
    for what, read in reads.items():
        with pytest.raises(StoreError) as said:
            read()
        message = str(said.value)
        assert f"{place.url}/x.wav is stored gzip-compressed" in message, (what, message)
        assert "upload it again" in message and "\n" not in message, (what, message)
    assert put(store, tmp_path, "plain.wav", data) and store.read("plain.wav").data == data


def test_the_tries_a_read_counts_are_the_requests_the_server_saw(
    place: Remote | S3,
    tmp_path: Path,
    proxied: Callable[..., DroppingProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read's limit of 4 requests per part counts each request as it is sent, on every cloud,
    whichever layer sends it: here two answers are cut mid-body and the third comes whole, and
    the requests counted for the object are the requests the server saw for it. Before, gs
    counted in two places (a download's first request where featbake made the call, each retry
    in the library's retry predicate) and not its metadata GETs at all: 3 counted of 6 sent."""
    from featbake.store import objects

    data = os.urandom(100_000)
    assert put(store_of(place), tmp_path, "x.bin", data)
    key = BucketURL.parse(place.url).key("x.bin")
    counted: list[objects.Part] = []
    real = objects.asked_again

    def counting(part: objects.Part) -> bool:
        asked = real(part)
        if asked and objects.asked_again is counting:
            counted.append(part)
        return asked

    proxy = proxied(drops=2, after=16 << 10)
    store = store_of(place)
    monkeypatch.setattr(objects, "asked_again", counting)
    assert store.read("x.bin").data == data
    seen = [a for a in proxy.requests if a.names(key)]
    assert proxy.dropped == 2 and len(seen) >= 3, seen
    assert len(counted) == len(seen), (counted, [a.target for a in seen])


def test_an_object_of_several_gets_reads_whole_on_every_place(
    place: Remote | S3, tmp_path: Path
) -> None:
    """An object of more than one of the Azure downloader's GETs (``AZURE_GET_BYTES``, 4 MiB,
    so that its memory is bounded by a GET, not by the object) reads whole, by a range across
    two GETs, and into a file, the same bytes on every place."""
    from featbake.store.objects import AZURE_GET_BYTES

    data = os.urandom(2 * AZURE_GET_BYTES + 12_345)
    store = store_of(place)
    assert put(store, tmp_path, "big.bin", data)
    got = store.read("big.bin")
    assert got.data == data and got.info.size == len(data)
    start = AZURE_GET_BYTES - 1000
    assert (
        store.read_range("big.bin", start, AZURE_GET_BYTES) == data[start : start + AZURE_GET_BYTES]
    )
    assert store.download("big.bin", tmp_path / "big.out") == len(data)
    assert (tmp_path / "big.out").read_bytes() == data


def test_an_object_put_again_with_its_bytes_mid_read_reads_whole_on_every_place(
    place: Remote | S3, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """Another node puts an object again with the same bytes (a content-named shard both
    publish) between a read's first and second GET for it: each read gives its bytes whole,
    and a whole read the version tag of what it read. Before, az's downloader sent its later
    4 MiB GETs with ``If-Match`` the first's ETag and the 412 ended the read after one try
    ("StorageErrorCode.CONDITION_NOT_MET"); gs's GET of the generation its metadata pinned was
    a 404, read as FileNotFoundError. s3 reads in one GET: nothing is put again there."""
    import hashlib

    from featbake.store.objects import AZURE_GET_BYTES

    data = os.urandom(2 * AZURE_GET_BYTES + 12_345)
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    name = "shards/ab/cd.safetensors"
    other = store_of(place)  # another node's client, made now: straight to the server
    assert other.upload(name, src)
    key = BucketURL.parse(place.url).key(name)
    gets: list[Asked] = []
    put_again: list[int] = []

    def second_get_puts_again(asked: Asked) -> bool:
        if asked.method == "GET" and asked.names(key):
            gets.append(asked)
            if len(gets) == 2:
                assert other.upload(name, src)  # before the GET reaches the server
                put_again.append(len(gets))
        return False

    proxied(refuse=second_get_puts_again)
    store = store_of(place)

    def downloaded() -> bytes:
        store.download(name, tmp_path / "got")
        return (tmp_path / "got").read_bytes()

    start, length = AZURE_GET_BYTES - 1000, AZURE_GET_BYTES + 2000  # across two az GETs
    reads: list[tuple[Callable[[], bytes], bytes]] = [
        (lambda: store.read(name).data, data),
        (lambda: store.read_range(name, start, length), data[start : start + length]),
        (lambda: bytes.fromhex(store.hashed(name).sha256), hashlib.sha256(data).digest()),
        (downloaded, data),
    ]
    for n, (read, wanted) in enumerate(reads):
        gets.clear()
        assert read() == wanted, n
    if place.scheme == "az":  # every read there is several GETs
        assert len(put_again) == len(reads), put_again
    got = store.read(name)
    info = other.head(name)
    assert info is not None and got.info.etag == info.etag and got.data == data


@pytest.mark.parametrize("place", ["az", "gs"], indirect=True)
def test_an_object_put_again_at_every_read_fails_naming_the_writer_not_the_network(
    place: Remote | S3, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """Something puts an object again before every GET of it (a sync job looping over the
    bucket): each of a read's tries meets a new version and the read gives up in one line
    that says so. Before, the line said to check the network and the endpoint, which were
    fine. s3 reads in one GET: nothing is put again mid-read there."""
    from featbake.store.objects import AZURE_GET_BYTES

    data = os.urandom(2 * AZURE_GET_BYTES + 12_345)
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    name = "shards/ab/ef.safetensors"
    other = store_of(place)
    assert other.upload(name, src)
    key = BucketURL.parse(place.url).key(name)

    def every_get_puts_again(asked: Asked) -> bool:
        if asked.method == "GET" and asked.names(key):
            assert other.upload(name, src)
        return False

    proxied(refuse=every_get_puts_again)
    with pytest.raises(StoreError, match="was put again during each read") as e:
        store_of(place).read(name)
    assert "\n" not in str(e.value) and "check the network" not in str(e.value)


@pytest.mark.parametrize("place", ["az"], indirect=True)
def test_an_azure_put_answered_condition_not_met_is_a_race_lost(
    place: Remote | S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put the service answers 412 ``ConditionNotMet`` is the name taken (a create-only put
    returns False), as a 409 ``BlobAlreadyExists`` is. azure-storage-blob hands that code over
    as its enum, which never matched the service's word: the 412 was a StoreError
    ("StorageErrorCode.CONDITION_NOT_MET"). The SDK makes a create-only put's own 412 a 409
    before featbake sees it, so here the put's condition is an ETag the object no longer has."""
    from azure.core import MatchConditions

    store = store_of(place)
    name = "catalog/v000000001.sqlite"
    assert put(store, tmp_path, name, b"first")
    stale = store.head(name)
    assert stale is not None and put(store, tmp_path, name, b"second")

    def put_if_unchanged(self: AzureObjects, name: str, src: Path, *, create: bool) -> None:
        blob = self.client.get_blob_client(self.key(name))
        condition = {"etag": stale.etag, "match_condition": MatchConditions.IfNotModified}
        blob.upload_blob(src.read_bytes(), overwrite=True, **condition)

    with monkeypatch.context() as m:
        m.setattr(AzureObjects, "put", put_if_unchanged)
        assert not put(store, tmp_path, name, b"third", create=True)
    assert store.read(name).data == b"second"


@pytest.mark.parametrize("place", ["az"], indirect=True)
def test_an_azure_refusal_names_the_services_code(
    place: Remote | S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request Azure refuses (a wrong account key) is one line naming the code the service
    gave, as Azure's documentation lists it; before, it named the SDK's enum
    ("StorageErrorCode.AUTHORIZATION_FAILURE")."""
    import base64

    connection = place.env["AZURE_STORAGE_CONNECTION_STRING"]
    key = connection.partition("AccountKey=")[2].partition(";")[0]
    wrong = base64.b64encode(b"not the key" * 4).decode()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection.replace(key, wrong))
    store = store_of(place)
    for call in (lambda: store.list(""), lambda: store.read("x.bin")):
        with pytest.raises(StoreError) as said:
            call()
        message = str(said.value)
        assert "was denied (AuthorizationFailure)" in message, message
        assert "StorageErrorCode" not in message and "\n" not in message, message


@pytest.mark.parametrize("url", ["127.0.0.1:4443/x", "ftp://127.0.0.1:4443/x", "http:///x"])
def test_a_gs_request_to_a_url_requests_cannot_send_is_one_line(url: str) -> None:
    """requests' MissingSchema, InvalidSchema and InvalidURL (an endpoint the client was given
    that is no http(s) URL) are one line saying how to write the endpoint, not an internal
    error."""
    import requests

    store = ObjectStore(BucketURL.parse("gs://bb/p"))
    with pytest.raises(ConfigError) as said, store.errors("x"):
        requests.get(url, timeout=1)
    message = str(said.value)
    assert message.startswith("cannot send a request for gs://bb/p/x to ") and "\n" not in message
    assert "write STORAGE_EMULATOR_HOST as http://host:port" in message, message
