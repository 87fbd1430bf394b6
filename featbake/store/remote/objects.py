"""The bucket: the few object calls a store makes, through boto3, one client per process.

Chosen by measurement (``benchmarks/s3_clients.py``, docs/object_store.md). obstore spends a
third of boto3's client CPU per ranged GET, but its Rust runtime is process-global: after a
``fork`` (DataLoader's default on Linux) any obstore call in the child hangs, even through a
client made in the child, once the parent has used obstore (measured: killed by an alarm after
10 s; obstore#441). A bucket store reads whole shards into its local tier, where one request
moves megabytes and the per-request CPU does not show; there boto3 was as fast or faster (a
64 MiB GET in 91 ms against 179), works after fork and spawn, and reads the whole AWS
configuration (``AWS_PROFILE``, SSO, instance roles) as users expect.

Configuration is S3's standard environment: ``AWS_ENDPOINT_URL`` (MinIO, R2, Ceph, a loopback
server), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_REGION``.
Endpoints other than AWS are addressed path-style, as litdata does. Throttling, 5xx answers and
connection errors are retried with backoff by botocore ("standard" mode); a download cut
mid-body is retried whole by :meth:`Bucket.download`. Each process makes its own client on
first use (:class:`~featbake.perprocess.PerProcess`); a pickled :class:`Bucket` carries only
its URL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from featbake.errors import ConfigError, StoreError
from featbake.perprocess import PerProcess
from featbake.store.remote.url import BucketURL, endpoint, endpoint_label, redact

#: Whole-object downloads cut short (a dropped connection mid-body) are tried this many times.
DOWNLOAD_TRIES = 4
#: Read size of a streaming download.
CHUNK = 8 << 20
#: Seconds to wait for a connection, and for an answer once connected
#: (``$FEATBAKE_S3_TIMEOUT`` sets the second): a stalled endpoint is one line, never a hang.
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_ENV = "FEATBAKE_S3_TIMEOUT"
READ_TIMEOUT_S = 20.0
#: Requests botocore sends before it gives up (throttling, 5xx answers, connection errors).
MAX_ATTEMPTS = 4


class ObjectInfo(NamedTuple):
    """One object: its name inside the store, size in bytes, last change (epoch s), ETag."""

    name: str
    size: int
    modified: float
    etag: str


class ObjectBytes(NamedTuple):
    """An object's bytes and what the response that carried them said of it."""

    info: ObjectInfo
    data: bytes


_T = TypeVar("_T")


class Bucket:
    """A store's objects under ``s3://bucket/prefix``; names are relative to the prefix.

    Example:
        >>> b = Bucket(BucketURL.parse("s3://team/features"))  # doctest: +SKIP
        >>> [o.name for o in b.list("catalog/")]  # doctest: +SKIP
    """

    def __init__(self, url: BucketURL) -> None:
        self.url = url
        self._client: PerProcess[Any] = PerProcess(self._connect, lock=True)

    def __getstate__(self) -> dict:
        return {"url": self.url}  # the client never crosses a process boundary

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def _connect(self) -> Any:
        try:
            import boto3
            from botocore import exceptions as bx
            from botocore.config import Config
        except ImportError:
            raise ConfigError(
                f"{self.url} is a bucket store, which needs the s3 extra: "
                "pip install 'featbake[s3]' (boto3)"
            ) from None
        url = endpoint()
        config = Config(
            retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
            s3={"addressing_style": "path"} if url else {},
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=read_timeout(),
        )
        try:
            session = boto3.session.Session()
            region = session.region_name or "us-east-1"
            return session.client("s3", endpoint_url=url, region_name=region, config=config)
        except bx.ProfileNotFound as e:
            raise ConfigError(
                f"{e} (AWS_PROFILE={os.environ.get('AWS_PROFILE', '')!r}); name a profile in "
                "~/.aws/config, or unset AWS_PROFILE and set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY"
            ) from None
        except (ValueError, bx.BotoCoreError) as e:
            raise ConfigError(
                f"cannot make an S3 client for {self.url} at {endpoint_label()}: "
                f"{redact(str(e))}; check AWS_ENDPOINT_URL, AWS_REGION and AWS_PROFILE"
            ) from None

    @property
    def client(self) -> Any:
        """This process's boto3 client (made on first use, again after fork)."""
        return self._client.get()

    def key(self, name: str) -> str:
        """The object key of ``name`` under the store's prefix."""
        return self.url.key(name)

    def where(self, name: str) -> str:
        """``s3://bucket/prefix/name``: how messages name an object."""
        return f"{self.url}/{name}"

    # -- reads ---------------------------------------------------------------------------------
    def list(self, prefix: str) -> list[ObjectInfo]:
        """The objects whose names start with ``prefix`` (e.g. ``"catalog/"``)."""
        strip = len(self.key(""))
        out = []
        with self.errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=self.key(prefix)
            )
            for page in pages:
                for o in page.get("Contents", ()):
                    out.append(
                        ObjectInfo(
                            o["Key"][strip:],
                            int(o["Size"]),
                            o["LastModified"].timestamp(),
                            o.get("ETag", "").strip('"'),
                        )
                    )
        return out

    def head(self, name: str) -> ObjectInfo | None:
        """The object ``name``, or None if there is none."""
        try:
            with self.errors(name):
                h = self.client.head_object(Bucket=self.url.bucket, Key=self.key(name))
        except _Absent:
            return None
        return ObjectInfo(
            name, int(h["ContentLength"]), h["LastModified"].timestamp(), h["ETag"].strip('"')
        )

    def download(self, name: str, dest: Path) -> int:
        """Stream object ``name`` into file ``dest``; its size. Tried whole again when the
        connection drops mid-body (botocore retries only a request's start).

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        return self._tried(name, lambda: self._download_once(name, dest))

    def read(self, name: str) -> ObjectBytes:
        """Object ``name``'s bytes, whole, in memory, with the size, last change and ETag of
        the response that carried them (so the bytes and the ETag belong together, whatever
        was written since a listing). Tried whole again when the connection drops mid-body.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        return self._tried(name, lambda: self._read_once(name))

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` from ``start`` (fewer at its end): one ranged GET.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        return self._tried(name, lambda: self._range_once(name, start, length))

    def _range_once(self, name: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        data, _ = self._get_whole(name, Range=f"bytes={start}-{start + length - 1}")
        return data

    def _get_whole(self, name: str, **options: str) -> tuple[bytes, dict[str, Any]]:
        """One GET of object ``name`` (``options``: e.g. ``Range``), its body read whole, and
        the response.

        Raises:
            _Transient: the body ended before its ``Content-Length``.
        """
        with self.errors(name, retried=True):
            got = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name), **options)
            body = got["Body"]
            try:
                data = body.read()
            finally:
                body.close()
        if len(data) != int(got["ContentLength"]):
            raise _Transient(f"{self.where(name)} ended after {len(data)} bytes")
        return bytes(data), got

    def _tried(self, name: str, once: Callable[[], _T]) -> _T:
        """``once()``, again (with backoff) while a body is cut short."""
        last: BaseException | None = None
        for attempt in range(DOWNLOAD_TRIES):
            try:
                return once()
            except _Absent:
                raise FileNotFoundError(self.where(name)) from None
            except _Transient as e:
                last = e.__cause__ or e
                time.sleep(0.1 * 2**attempt)
        raise StoreError(
            f"cannot download {self.where(name)} after {DOWNLOAD_TRIES} tries "
            f"({redact(str(last))}); check "
            "the network and the endpoint (AWS_ENDPOINT_URL), then run this again"
        ) from last

    def _read_once(self, name: str) -> ObjectBytes:
        data, got = self._get_whole(name)
        modified = got["LastModified"].timestamp()
        return ObjectBytes(ObjectInfo(name, len(data), modified, got["ETag"].strip('"')), data)

    def _download_once(self, name: str, dest: Path) -> int:
        size = 0
        # Into the file as it is (its space may be reserved), cut to the object's size after.
        with open(dest, "r+b" if dest.exists() else "wb") as f, self.errors(name, retried=True):
            got = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name))
            expected = int(got["ContentLength"])
            body = got["Body"]
            try:
                for chunk in body.iter_chunks(CHUNK):
                    size += f.write(chunk)
            finally:
                body.close()
            f.truncate(size)
            if size != expected:
                raise _Transient(f"{self.where(name)} ended after {size} of {expected} bytes")
        return size

    # -- writes --------------------------------------------------------------------------------
    def upload(self, name: str, src: Path, *, create: bool = False) -> bool:
        """Put file ``src`` as object ``name``. With ``create``, only if no object of that name
        exists (``If-None-Match: *``; one request, so up to 5 GB): False when one did. Without,
        big files go up in parts (multipart upload).

        Raises:
            StoreError: the upload failed (the message says why and what to do).
        """
        try:
            with self.errors(name):
                if create:
                    with open(src, "rb") as f:
                        self.client.put_object(
                            Bucket=self.url.bucket, Key=self.key(name), Body=f, IfNoneMatch="*"
                        )
                else:
                    self.client.upload_file(os.fspath(src), self.url.bucket, self.key(name))
        except _Exists:
            return False
        return True

    def delete(self, names: Iterable[str]) -> None:
        """Delete objects (one that is already gone is no error)."""
        batch = list(names)
        for i in range(0, len(batch), 1000):
            objects = [{"Key": self.key(n)} for n in batch[i : i + 1000]]
            with self.errors(batch[i]):
                self.client.delete_objects(
                    Bucket=self.url.bucket, Delete={"Objects": objects, "Quiet": True}
                )

    # -- errors --------------------------------------------------------------------------------
    def errors(self, name: str, *, retried: bool = False) -> _Errors:
        """A context that turns the client's exceptions into one actionable line. ``retried``:
        the caller tries again on a cut body or a read timeout (:meth:`_tried`); elsewhere
        those are one line too."""
        return _Errors(self, name, retried)


class _Absent(Exception):
    """The object asked for does not exist (the bucket does)."""


class _Exists(Exception):
    """A create-if-absent put found the object there."""


class _Transient(Exception):
    """A read cut short: worth trying again."""


class _Errors:
    """Translates botocore's exceptions (see :meth:`Bucket.errors`)."""

    def __init__(self, bucket: Bucket, name: str, retried: bool) -> None:
        self.bucket = bucket
        self.name = name
        self.retried = retried

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is not None and not isinstance(e, StoreError | ConfigError | _Transient):
            try:
                raise_translated(self.bucket, self.name, e)
            except _Transient as t:
                if self.retried:
                    raise
                raise unanswered(self.bucket, self.name, t) from None
        if isinstance(e, _Transient) and not self.retried:
            raise unanswered(self.bucket, self.name, e) from None


def raise_translated(bucket: Bucket, name: str, e: BaseException) -> None:
    """Raise what a user can act on for the client's error ``e`` (re-raise what is not one)."""
    from botocore import exceptions as bx

    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        raise StoreError(
            f"no credentials for {bucket.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE), and AWS_ENDPOINT_URL for a server other than AWS; then run this "
            "again"
        ) from None
    if isinstance(e, bx.IncompleteReadError | bx.ResponseStreamingError | bx.ReadTimeoutError):
        raise _Transient(str(e)) from e
    if isinstance(e, bx.ConnectTimeoutError):
        raise StoreError(
            f"{endpoint_label()} accepted no connection within {CONNECT_TIMEOUT_S} s for "
            f"{bucket.where(name)}; check AWS_ENDPOINT_URL and the network"
        ) from None
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectionClosedError):
        raise StoreError(
            f"cannot reach {endpoint_label()} for {bucket.where(name)} ({redact(str(e))}); "
            "check AWS_ENDPOINT_URL and the network"
        ) from None
    if not isinstance(e, bx.ClientError):
        raise e
    code = str(e.response.get("Error", {}).get("Code", ""))
    if code == "NoSuchBucket":
        raise StoreError(
            f"the bucket {bucket.url.bucket!r} does not exist at {endpoint_label()}; create it, or "
            "fix the URL or AWS_ENDPOINT_URL"
        ) from None
    if code in ("404", "NoSuchKey", "NotFound"):
        raise _Absent(name) from None
    if code in ("412", "PreconditionFailed", "ConditionalRequestConflict"):
        raise _Exists(name) from None
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        raise StoreError(
            f"access to {bucket.where(name)} was denied ({code}); check the credentials "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket's policy"
        ) from None
    raise StoreError(f"{bucket.where(name)}: {code or type(e).__name__}: {redact(str(e))}") from e


def unanswered(bucket: Bucket, name: str, e: BaseException) -> StoreError:
    """The one line for a request whose answer never came (or came cut short) after botocore's
    tries: a stalled endpoint must not hang a command or end it with an internal error."""
    return StoreError(
        f"{endpoint_label()} did not answer for {bucket.where(name)} within {read_timeout():g} s "
        f"after {MAX_ATTEMPTS} tries ({redact(str(e.__cause__ or e))}); check the endpoint and "
        f"the network, or raise ${READ_TIMEOUT_ENV}"
    )


def read_timeout() -> float:
    """Seconds a request waits for an answer (``$FEATBAKE_S3_TIMEOUT``, default 20).

    Raises:
        ConfigError: the variable is not a positive number.
    """
    raw = os.environ.get(READ_TIMEOUT_ENV)
    if not raw:
        return READ_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(f"${READ_TIMEOUT_ENV} must be a number of seconds above 0, got {raw!r}")
    return value
