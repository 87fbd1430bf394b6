"""A real S3-compatible server on loopback for the bucket-store tests: moto's server mode.

One server per test session (started in a subprocess, stopped at the end); each test gets its
own bucket and the standard AWS environment pointing at the server, so featbake's code sees
exactly what it would see with MinIO or AWS. The server's access log (werkzeug's, one line per
request) goes to a file, so a test counts the requests the server answered (:meth:`S3.requests`).
"""

from __future__ import annotations

import re
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
        server.terminate()
        server.wait(10)


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
