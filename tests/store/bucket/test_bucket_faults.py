"""A bucket store meets faults: a corrupted object, a server that drops connections mid-body,
no credentials, a missing bucket, a tier budget smaller than the data. Nothing wrong is served."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.bake.pipeline import build
from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.store.objects import MAX_ATTEMPTS, ObjectStore
from featbake.store.url import BucketURL
from featbake.upkeep.gc import GcOptions, gc
from tests.conftest import invoke, live_features
from tests.store.bucket.conftest import QUICK_BACKOFF, S3, SCHEMES, Place
from tests.store.bucket.faults import Asked, DroppingProxy, Stall


def bake(data: Path, encoder: Path, where: object, **kw: object):
    return build(data, encoder, cache=where, workers=0, shard_bytes=60_000, **kw)


def serve(
    place: Place, data: Path, encoder: Path, tier: Path, **kw: object
) -> CachedFeatureDataset:
    return CachedFeatureDataset(
        data, encoder, cache=place.url, local_cache=tier, on_miss="error", **kw
    )


def assert_live(ds: CachedFeatureDataset, encoder: Path) -> None:
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


def deleted_open_bytes(under: Path) -> int:
    """Bytes of unlinked shard files under ``under`` this process still holds open (only there:
    an earlier test in the same process may hold its own store's deleted shards)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{under}/") and target.endswith(".safetensors (deleted)"):
                held += os.fstat(int(fd)).st_size
        except OSError:
            continue
    return held


def shard_objects(place: Place) -> list[str]:
    return [o for o in place.objects("shards/")]


def test_a_corrupted_object_is_fetched_again_then_named_in_the_error(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    bake(audio_dir, encoder_file, place.url)
    bucket = ObjectStore(BucketURL.parse(place.url))
    victim = shard_objects(place)[0]
    local = tmp_path / "victim"
    bucket.download(victim, local)
    data = bytearray(local.read_bytes())
    data[-10] ^= 0xFF  # a tensor's bytes, past the header
    local.write_bytes(bytes(data))
    bucket.upload(victim, local)
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier")
    fails = rf"{victim} is damaged in the bucket \(tensors \w+ fail their checksums on 2 downloads"
    with pytest.raises(StoreCorrupt, match=fails):
        for i in range(len(ds)):
            ds[i]
    assert not list((tmp_path / "tier").rglob(Path(victim).name))  # never kept in the tier


def test_connections_dropped_mid_body_are_retried_and_nothing_wrong_is_served(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    proxied: Callable[..., DroppingProxy],
) -> None:
    bake(audio_dir, encoder_file, place.url)
    proxy = proxied(drops=3, after=20_000)
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier")
    assert_live(ds, encoder_file)
    ds.close()  # its last uses go up through the proxy, before the proxy closes
    assert proxy.dropped == 3


def test_a_server_that_always_drops_gives_one_clear_error(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    proxied: Callable[..., DroppingProxy],
) -> None:
    """featbake's own tries govern on every cloud: each cut ends the client's call, the read
    is tried whole 4 times, then one line: 4 requests for the shard's bytes, each cut. On gs,
    google-cloud-storage resumed each cut download from where it was cut, for as long as its
    deadline allowed (a minute and more), and the read got through a server that cut every
    answer. On az the SDK's downloader asked again for each cut body twice itself (1 s apart),
    inside each of featbake's 4 tries: 12 requests over some 12 s."""
    bake(audio_dir, encoder_file, place.url)
    proxy = proxied(drops=0, after=20_000)
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier")  # the catalog came whole
    proxy.drops_left = 10_000  # from now on every answer is cut after 20 kB
    with pytest.raises(
        StoreError, match=rf"cannot download {place.url}/shards/.*after 4 tries"
    ) as said:
        ds[0]
    ds.close()
    assert "\n" not in str(said.value)
    assert len(proxy.cut) == MAX_ATTEMPTS and len(set(proxy.cut)) == 1, proxy.cut


def create_only(asked: Asked) -> bool:
    """Whether a request is a create-only put (S3 and Azure ``If-None-Match: *``, GCS
    ``ifGenerationMatch=0``)."""
    return "\r\nif-none-match: *" in asked.head.lower() or "ifGenerationMatch=0" in asked.target


def test_a_catalog_version_whose_answer_was_lost_is_published_once(
    place: Place, audio_dir: Path, encoder_file: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """The server stored a catalog version (a create-only put) and its answer was lost; the
    client sent the put again and was told the object exists: its own. featbake took that
    for a race lost to another publisher and applied its change again to its own version,
    publishing it as the next one: a build published 2 versions, and a gc that dropped a root
    3, reporting that it dropped no root and deleted no row. On every cloud the client sends
    such a put again: each change is one version, and says what it did."""
    proxy = proxied(lose_answer=create_only)
    report = bake(audio_dir, encoder_file, place.url)
    assert len(proxy.cut) == 1  # the answer to the one create-only put: the version's
    assert place.objects("catalog/") == ["catalog/v000000001.sqlite"]
    proxy.lose_answer = create_only
    dropped = gc(place.url, GcOptions(), drop=[report.root])
    assert len(proxy.cut) == 2
    assert dropped.roots_dropped == [report.root] and dropped.rows_deleted == report.encoded
    assert place.objects("catalog/") == [f"catalog/v00000000{v}.sqlite" for v in (1, 2)]


def test_leaving_a_proxy_ends_its_threads() -> None:
    """Leaving a proxy closed its listening socket alone: the pumps of its open connections
    ran on, blocked in recv(), for the rest of the session, and a thread blocked in accept()
    is not woken by closing the socket it waits on (a shutdown wakes it)."""
    before = set(threading.enumerate())
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        with DroppingProxy(upstream.getsockname()[1], drops=0) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port))
            served, _ = upstream.accept()  # the proxy connected through: its pumps run
        left = set(threading.enumerate()) - before
        client.close()
        served.close()
    assert not left, left


def test_an_answer_that_comes_with_its_100_continue_in_one_read_is_still_lost() -> None:
    """A server that sends ``100 Continue`` and its final answer in one read (as moto can,
    when the proxy reads late under load) had the whole passed on as an interim answer: the
    answer to lose came through, and a test that counts lost answers saw one fewer."""
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        with DroppingProxy(upstream.getsockname()[1], drops=0, lose_answer=lambda a: True) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port))
            client.settimeout(30)  # a guard: an answer passed on would leave it open
            client.sendall(b"PUT /o HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            served, _ = upstream.accept()
            served.recv(65536)  # the request, forwarded whole
            served.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                           b"Content-Length: 0\r\n\r\n")  # fmt: skip
            got = b""
            while chunk := client.recv(65536):  # until the proxy closes the connection
                got += chunk
            client.close()
            served.close()
        assert got == b"HTTP/1.1 100 Continue\r\n\r\n" and proxy.cut == ["/o"], got


class ClosingEndpoint:
    """A server on loopback that reads each request's head, records its target, and closes
    the connection without answering (bounded: stopped at the end)."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def asked_for(self, key: str) -> int:
        """How many requests named object ``key`` (its path, plain or URL-encoded)."""
        names = (key, key.replace("/", "%2F"))
        return sum(t.partition("?")[0].endswith(names) for t in self.targets)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(10)
                head = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
                self.targets.append(line[1] if len(line) > 1 else "")  # before the close

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()


@pytest.fixture
def closing_endpoint() -> Iterator[ClosingEndpoint]:
    server = ClosingEndpoint()
    try:
        yield server
    finally:
        server.stop()


def cloud_env(scheme: str, endpoint: str) -> dict[str, str]:
    """Each cloud's settings naming ``endpoint`` (credentials that sign, never checked), and
    the clients' waits between tries scaled down (:data:`QUICK_BACKOFF`)."""
    if scheme == "s3":
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k",
                "AWS_SECRET_ACCESS_KEY": "s", **QUICK_BACKOFF}  # fmt: skip
    if scheme == "gs":
        return {"STORAGE_EMULATOR_HOST": endpoint, **QUICK_BACKOFF}
    connection = (
        "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;"
        f"BlobEndpoint={endpoint}/acct;"
    )
    return {"AZURE_STORAGE_CONNECTION_STRING": connection, **QUICK_BACKOFF}


@pytest.mark.slow  # the clients' backoff, 4 s on gs, 10-16 s on az, a hundredth of it here
@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_endpoint_that_never_answers_is_asked_at_most_4_times_for_a_read(
    closing_endpoint: ClosingEndpoint, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read from an endpoint that closes every connection before answering is one line
    after the client's own tries, MAX_ATTEMPTS requests for the object at most, on every
    cloud. Before: google-cloud-storage tried again until its 87 s deadline (some 20
    requests); featbake tried the Azure SDK's 4 attempts again whole, 4 times (16 requests,
    over a minute); botocore sent 5 (``max_attempts`` counts the retries alone)."""
    pytest.importorskip(
        {"s3": "boto3", "gs": "google.cloud.storage", "az": "azure.storage.blob"}[scheme]
    )
    for k, v in cloud_env(scheme, closing_endpoint.url).items():
        monkeypatch.setenv(k, v)
    store = ObjectStore(BucketURL.parse(f"{scheme}://bucket/p"))
    with pytest.raises(StoreError) as said:
        store.read("x")
    assert f"{scheme}://bucket/p/x" in str(said.value) and "\n" not in str(said.value)
    assert 1 <= closing_endpoint.asked_for("p/x") <= MAX_ATTEMPTS, closing_endpoint.targets


def test_no_credentials_and_no_bucket_are_one_line_each(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 only: the credential chain is boto3's (AWS_PROFILE, the shared files, instance
    metadata); GCS's and Azure's missing credentials and every place's missing bucket are in
    tests/store/bucket/test_objects.py."""
    missing = invoke("stats", "--cache", "s3://no-such-bucket-here/x", cwd=tmp_path)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    nowhere = str(tmp_path / "none")
    env = {"AWS_SHARED_CREDENTIALS_FILE": nowhere, "AWS_CONFIG_FILE": nowhere}
    done = invoke("stats", "--cache", s3.url, env={**env, "AWS_EC2_METADATA_DISABLED": "true"})
    for proc, words in ((done, "no credentials"), (missing, "does not exist")):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 5, proc.stderr
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr


def test_the_tier_stays_within_its_budget_and_refuses_one_smaller_than_a_shard(
    place: Place,
    audio_dir: Path,
    encoder_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whole-shard fetches into a tier smaller than the store (by default such a tier reads
    by ranges: tests/store/bucket/test_bucket.py)."""
    monkeypatch.setenv("FEATBAKE_BUCKET_READS", "whole")
    bake(audio_dir, encoder_file, place.url)
    sizes = [o.size for o in ObjectStore(BucketURL.parse(place.url)).list("shards/")]
    assert len(sizes) >= 3
    budget = max(sizes) * 2
    ds = serve(place, audio_dir, encoder_file, tmp_path / "tier", local_cache_size=budget)
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    for _ in range(2):
        for i in order:
            torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
            assert tier.used_bytes() <= budget
            # Evicted files this process held open are closed before the download that
            # needed their space (an open file keeps it): on disk, too, within budget.
            assert tier.used_bytes() + deleted_open_bytes(tmp_path / "tier") <= budget
    assert tier.fetched > len(sizes)  # shards were evicted and fetched again
    tiny = serve(place, audio_dir, encoder_file, tmp_path / "tiny", local_cache_size=100)
    with pytest.raises(ConfigError, match=r"budget .* cannot hold"):
        tiny[0]


def test_denied_access_and_a_throttled_server_say_what_to_do() -> None:
    """S3 only: botocore's error codes (AccessDenied, SlowDown) translated; moto does not
    enforce policies, so botocore's own error objects stand in for AWS's answers."""
    from botocore.exceptions import ClientError

    from featbake.store.objects import raise_translated

    bucket = ObjectStore(BucketURL.parse("s3://team/features"))
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")
    with pytest.raises(StoreError, match=r"access to s3://team/features/x was denied.*AWS_PROFILE"):
        raise_translated(bucket, "x", denied)
    slow = ClientError({"Error": {"Code": "SlowDown", "Message": "rate"}}, "GetObject")
    with pytest.raises(StoreError, match=r"s3://team/features/x: SlowDown"):
        raise_translated(bucket, "x", slow)  # what is left after botocore's retries


def test_a_tier_whose_bucket_was_emptied_is_not_trusted(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """The tier held version 1 of a bucket that was then emptied (or replaced by another
    store of the same name): a build must encode again, not reuse the tier's catalog."""
    tier = tmp_path / "tier"
    from featbake.store.open import open_store

    bake(audio_dir, encoder_file, open_store(place.url, local_cache=tier))
    bucket = ObjectStore(BucketURL.parse(place.url))
    bucket.delete(o.name for o in bucket.list(""))
    report = bake(audio_dir, encoder_file, open_store(place.url, local_cache=tier))
    assert report.encoded == 16 and report.reused == 0
    fresh = serve(place, audio_dir, encoder_file, tmp_path / "fresh")
    for i in range(len(fresh)):
        torch.testing.assert_close(fresh[i], live_features(encoder_file, Path(fresh.path(i))))


def reads_bytes(scheme: str, key: str) -> Callable[[Asked], bool]:
    """Whether a request asks for object ``key``'s bytes: a GET of it (on gs the media GET,
    ``alt=media``, not the metadata one the read asks first)."""

    def asks(asked: Asked) -> bool:
        media = scheme != "gs" or "alt=media" in asked.target
        return asked.method == "GET" and asked.names(key) and media

    return asks


@pytest.mark.parametrize(
    "body",
    [pytest.param(None, id="silent", marks=pytest.mark.slow), pytest.param(1000, id="head-1kB")],
)  # slow: the Azure SDK's backoff before its tries (3, 5, 9 s; a hundredth here) on az-silent
def test_an_endpoint_that_stalls_is_asked_at_most_4_times_for_a_read(
    place: Place,
    tmp_path: Path,
    proxied: Callable[..., DroppingProxy],
    monkeypatch: pytest.MonkeyPatch,
    body: int | None,
) -> None:
    """An endpoint that reads each request for an object's bytes and never answers (or sends
    the answer's head and 1 kB of its body, then nothing): one line saying how many requests
    were sent, 4 at most for the bytes, whichever layer sent them, each paying the read timeout.
    Before: botocore's 4 attempts (s3) and google-cloud-storage's (gs) ended in a read timeout
    that featbake took for a cut body and tried whole again, 4 times: 16 GETs, "after 4 tries";
    a gs download stalled mid-body was "cannot reach" the endpoint."""
    src = tmp_path / "x.bin"
    src.write_bytes(os.urandom(100_000))
    assert ObjectStore(BucketURL.parse(place.url)).upload("x.bin", src)
    key = BucketURL.parse(place.url).key("x.bin")
    proxy = proxied(stall=Stall(reads_bytes(place.scheme, key), body))
    monkeypatch.setenv("FEATBAKE_OBJECT_TIMEOUT", "0.3")
    store = ObjectStore(BucketURL.parse(place.url))  # a new client: the timeout, the proxy
    with pytest.raises(StoreError) as said:
        store.read("x.bin")
    message = str(said.value)
    assert f"{place.url}/x.bin" in message and "\n" not in message
    assert f"after {MAX_ATTEMPTS} tries" in message, message
    assert 1 <= len(proxy.stalled) <= MAX_ATTEMPTS, proxy.stalled
    metadata = 1 if place.scheme == "gs" else 0  # gs asks the object's metadata first
    named = [a.target for a in proxy.requests if a.names(key)]
    assert len(named) <= len(proxy.stalled) + metadata, named


def test_answers_cut_short_every_time_are_said_to_be_cut_not_unanswered(
    place: Place, tmp_path: Path, proxied: Callable[..., DroppingProxy]
) -> None:
    """An endpoint that answers at once and cuts every answer after 200 bytes (a proxy or a
    load balancer closing connections) was reported as one that "did not answer within 20 s",
    sending the user after timeouts; the line now says the answers were cut short."""
    src = tmp_path / "x"
    src.write_bytes(os.urandom(50_000))
    ObjectStore(BucketURL.parse(place.url)).upload("x", src)
    proxy = proxied(drops=10_000, after=200)
    with pytest.raises(StoreError) as said:
        ObjectStore(BucketURL.parse(place.url)).read("x")
    message = str(said.value)
    assert "\n" not in message and "did not answer" not in message, message
    assert "after 4 tries" in message and proxy.cut, message
