"""The byte seam under a bucket store: one object-store interface, one class per URL scheme.

A bucket store (:mod:`featbake.store.bucket`), bucket inputs and containers in a bucket make
only the calls of :class:`ObjectStore`: list (paged, with a prefix and a start-after name),
stat (size, ETag or generation, last change), get whole or a byte range, put (create-only for
catalog versions; big files in parts), delete (of an object as a listing saw it: only while it
is still that version). Each scheme's class speaks its cloud through the
cloud's own client library and turns that library's errors into the same featbake errors:
absent (``FileNotFoundError`` / None), exists (a create-only put returns False), transient (a
body cut short: tried again), and one actionable line for everything else (no credentials, no
bucket, access denied, an unreachable or stalled endpoint).

- ``s3://`` — :class:`S3Objects` (boto3): AWS, MinIO, R2, Ceph, GCS's S3 interoperability.
- ``gs://`` — :class:`GCSObjects` (google-cloud-storage): Application Default Credentials,
  ``STORAGE_EMULATOR_HOST`` for an emulator (anonymous there).
- ``az://`` — :class:`AzureObjects` (azure-storage-blob): ``AZURE_STORAGE_CONNECTION_STRING``,
  or ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_KEY`` or azure-identity's
  ``DefaultAzureCredential``.

The client libraries were chosen by measurement (``benchmarks/cloud_clients.py``,
docs/object_store.md): each vendor SDK works in a forked DataLoader worker and exposes the
create-only condition directly (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure
``If-None-Match: *``). Each process makes its own client on first use
(:class:`~featbake.process.ProcessLocal`); a pickled store carries only its URL.

Example:
    >>> store = ObjectStore(BucketURL.parse("gs://team/features"))  # doctest: +SKIP
    >>> type(store).__name__, [o.name for o in store.list("catalog/")]  # doctest: +SKIP
    ('GCSObjects', ['catalog/v000000001.sqlite'])
"""

from __future__ import annotations

import contextlib
import filecmp
import functools
import hashlib
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

from featbake.errors import ConfigError, StoreError, first_line
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.store.hash_cache import FileStat
from featbake.store.url import (
    BucketURL,
    azure_blob_endpoint,
    azure_connection_endpoint,
    endpoint,
    endpoint_folder,
    endpoint_label,
    gcs_emulator,
    gcs_endpoint,
    redact,
)
from featbake.threadpool import map_in_threads

# == objects =======================================================================================
#: Whole-object downloads cut short (a dropped connection mid-body) are tried this many times.
DOWNLOAD_TRIES = 4
#: Read size of a streaming download.
CHUNK = 8 << 20
#: Read size of a streamed hash (:meth:`ObjectStore.hashed`): what one digest holds at once.
HASH_CHUNK = 1 << 20
#: Files smaller than this go up to S3 in one PutObject on the caller's thread (boto3's
#: multipart threshold, so the same requests): fragments, catalog versions, small shards.
SINGLE_PUT_BYTES = 8 << 20
#: Seconds to wait for a connection, and for an answer once connected
#: (``$FEATBAKE_OBJECT_TIMEOUT``, else ``$FEATBAKE_S3_TIMEOUT``, sets the second): a stalled
#: endpoint is one line, never a hang.
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_ENV = "FEATBAKE_OBJECT_TIMEOUT"
S3_TIMEOUT_ENV = "FEATBAKE_S3_TIMEOUT"
READ_TIMEOUT_S = 20.0
#: Scales every wait between a request's tries, on every cloud (``$FEATBAKE_OBJECT_BACKOFF``,
#: default 1: the clients' own waits, as below); 0.01 waits a hundredth as long, 0 not at all.
BACKOFF_ENV = "FEATBAKE_OBJECT_BACKOFF"
#: Requests a client sends before it gives up (throttling, 5xx answers, connection errors).
MAX_ATTEMPTS = 4
#: Connections one client keeps open: as many as the threads that share it at most (a
#: manifest's HEADs, :data:`featbake.store.byteplace.HEAD_THREADS`); past botocore's default
#: pool (10) a thread's connection would be dropped after each request and opened again.
CLIENT_CONNECTIONS = 16
#: Objects one listing request names at most (S3's cap, and its default).
LIST_PAGE_KEYS = 1000
#: Files above this go up in parts (S3 multipart, GCS resumable, Azure blocks).
PART_BYTES = 64 << 20
#: Bytes one GET of the Azure client's downloader asks for, its first and each after (the SDK's
#: own chunk size). Its downloader holds some 9 times what one GET brings while it reads it: a
#: 6 MiB object read in one GET peaked at 56.7 MB under tracemalloc, a 24 MiB one at 226 MB (a
#: 64 MiB shard some 600 MB); in 4 MiB GETs, 37.8 and 46 MB, whatever the object's size.
AZURE_GET_BYTES = 4 << 20


class ObjectInfo(NamedTuple):
    """One object: its name inside the store, size in bytes, last change (epoch s), and its
    version tag (S3 and Azure: the ETag; GCS: the generation), which changes with its bytes."""

    name: str
    size: int
    modified: float
    etag: str


def object_name(deleted: str | ObjectInfo) -> str:
    """The name of an object :meth:`ObjectStore.delete` is given (a name, or an object as a
    listing saw it)."""
    return deleted if isinstance(deleted, str) else deleted.name


class ListedPage(NamedTuple):
    """One page of a listing (one request): its objects in name order, the last name it
    covered (an object's, or a sub-folder's that the delimiter rolled up, ``a/b/``: every name
    after it sorts after all of that sub-folder's), and whether names follow."""

    objects: list[ObjectInfo]
    last: str
    truncated: bool


class ObjectBytes(NamedTuple):
    """An object's bytes and what the response that carried them said of it."""

    info: ObjectInfo
    data: bytes


class HashedObject(NamedTuple):
    """An object's SHA-256 (hex) and what the response whose bytes were hashed said of it."""

    info: ObjectInfo
    sha256: str


class ChunkSink:
    """A file-like ``write`` that hands each chunk to ``take`` and counts the bytes: where a
    streamed download goes (google-cloud-storage's ``download_to_file`` writes to it; the s3
    and az bodies' chunks are written to it)."""

    def __init__(self, take: Callable[[bytes], object]) -> None:
        self.take = take
        self.size = 0

    def write(self, data: bytes) -> int:
        self.take(data)
        self.size += len(data)
        return len(data)


_T = TypeVar("_T")


class Absent(Exception):
    """The object asked for does not exist (the bucket does)."""


class Exists(Exception):
    """A create-only put found the object there."""


class PastTheEnd(Exception):
    """A ranged GET that starts at or past the object's end (HTTP 416: S3 and Azure refuse
    it; GCS's reads answer no bytes, as :meth:`ObjectStore.read_range` does for all three)."""


class Transient(Exception):
    """A read cut short, or an answer that did not come in time: worth trying again."""


class PutAgain(Transient):
    """An object put again between two requests of one read (a later GET's condition failed,
    the generation it pinned gone): read again whole."""


class TriesSpent(Transient):
    """A read asked for the same bytes :data:`DOWNLOAD_TRIES` times, counting the client's own
    tries (:meth:`ObjectStore.tries_counted`): not tried again."""


#: One part of an object a request asks for: (method, URL or key, byte range or "").
Part = tuple[str, str, str]

#: Within one read (:meth:`ObjectStore.tries_counted`), how often this thread asked for each
#: part of an object, whichever layer sent the request (featbake's tries, or the client's own
#: retries: each cloud's client reports its requests here); None outside a read.
_ASKED: ContextVar[Counter[Part] | None] = ContextVar("featbake_asked", default=None)
#: Within one read, the part of the last request this thread counted (None before any).
_LAST_ASKED: ContextVar[Part | None] = ContextVar("featbake_last_asked", default=None)


def asked_again(part: Part) -> bool:
    """Count one more request for ``part`` within this thread's read: False (and not counted)
    when the read already asked for it :data:`DOWNLOAD_TRIES` times. Outside a read, True.
    The one place a request is counted (:func:`count_asked`, as each client sends it)."""
    asked = _ASKED.get()
    if asked is None:
        return True
    if asked[part] >= DOWNLOAD_TRIES:
        return False
    asked[part] += 1
    _LAST_ASKED.set(part)
    return True


def last_may_be_asked_again() -> bool:
    """Whether this thread's read may send the request it sent last once more (it asked for
    that part fewer than :data:`DOWNLOAD_TRIES` times); counts nothing. Outside a read, True.
    A client's retry rule asks it before a retry, so that the read ends with what the last
    request met (a stall, a cut) rather than with :class:`TriesSpent`."""
    asked, last = _ASKED.get(), _LAST_ASKED.get()
    return asked is None or last is None or asked[last] < DOWNLOAD_TRIES


def count_asked(part: Part) -> None:
    """Count a request about to be sent for ``part`` (:func:`asked_again`).

    Raises:
        TriesSpent: the read already asked for it :data:`DOWNLOAD_TRIES` times.
    """
    if not asked_again(part):
        raise TriesSpent(f"asked {DOWNLOAD_TRIES} times for {part[2] or 'the whole'}")


_SCHEMES: dict[str, type[ObjectStore]] = {}


def register(scheme: str) -> Callable[[type[_S]], type[_S]]:
    """Make a class the object store of URLs ``scheme://...``."""

    def add(cls: type[_S]) -> type[_S]:
        cls.scheme = scheme
        _SCHEMES[scheme] = cls
        return cls

    return add


def store_class(scheme: str) -> type[ObjectStore]:
    """The class registered for ``scheme`` (``s3``, ``gs``, ``az``).

    Raises:
        ConfigError: no class speaks that scheme.
    """
    try:
        return _SCHEMES[scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ConfigError(f"featbake speaks {known}, not {scheme}://") from None


def object_stat(info: ObjectInfo) -> FileStat:
    """What the hash cache compares for an object: (size, last change, ETag).

    The last change is counted in whole seconds (a GET's ``Last-Modified`` header has no
    more); the ETag, a string, becomes a 60-bit number in the inode's place. Each scheme's
    store maps its own version tag into ``ObjectInfo.etag`` (S3's and Azure's ETag, GCS's
    ETag too), so one mapping serves them all (:meth:`ObjectStore.file_stat`).

    Example:
        >>> object_stat(ObjectInfo("a.wav", 4, 1700000000.25, "abc")).mtime_ns
        1700000000000000000
    """
    modified_ns = int(info.modified) * 1_000_000_000
    etag = int(hashlib.sha256(info.etag.encode()).hexdigest()[:15], 16)
    return FileStat(info.size, modified_ns, etag, modified_ns)


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps) is a wait past a timeout (any client's ``...Timeout...``
    error, or Python's ``TimeoutError``), not an answer cut short."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, TimeoutError) or "Timeout" in type(at).__name__:
            return True
        at = at.__cause__ or at.__context__
    return False


class ObjectStore(ProcessLocalState):
    """The objects under ``scheme://bucket/prefix``; names are relative to the prefix.

    ``ObjectStore(url)`` makes the class registered for ``url.scheme`` (:func:`register`).
    Subclasses implement the one-request primitives (``list_page``, ``head``, ``get_once``,
    ``download_once``, ``stream_once``, ``put``, ``delete``; here they raise
    ``NotImplementedError``) and ``translate`` (their library's errors into featbake's); reads
    tried again on a cut body, and the messages, live here. Not an ``abc.ABC``:
    ``ObjectStore(url)`` is how callers make one, whatever the scheme.

    Example:
        >>> b = ObjectStore(BucketURL.parse("s3://team/features"))  # doctest: +SKIP
        >>> [o.name for o in b.list("catalog/")]  # doctest: +SKIP
    """

    scheme: ClassVar[str] = ""
    #: The setting to check when the endpoint does not answer (for messages).
    ENDPOINT_HINT: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> ObjectStore:
        if cls is ObjectStore and args:  # the class of the URL's scheme
            cls = store_class(args[0].scheme)
        return super().__new__(cls)

    def __init__(self, url: BucketURL) -> None:
        self.url = url

    #: This process's client (made on first use, again after fork; never pickled).
    client: ProcessLocal[Any] = ProcessLocal(lambda self: self.connect(), lock=True)

    def key(self, name: str) -> str:
        """The object key of ``name`` under the store's prefix."""
        return self.url.key(name)

    def where(self, name: str) -> str:
        """``scheme://bucket/prefix/name``: how messages name an object."""
        return f"{self.url}/{name}"

    def file_stat(self, info: ObjectInfo) -> FileStat:
        """What the hash cache compares for object ``info``: its size, last change and version
        tag (:func:`object_stat`); a scheme whose version tag is not its ETag overrides it."""
        return object_stat(info)

    # -- one request each, per scheme ------------------------------------------------------------
    def connect(self) -> Any:
        """A new client (or a bucket/container handle) for this process.

        Raises:
            ConfigError: the library is not installed, or its settings cannot make a client.
        """
        raise NotImplementedError

    def endpoint_label(self) -> str:
        """How messages name the endpoint, without credentials."""
        raise NotImplementedError

    def tier_folder(self) -> str:
        """The local tier's folder for this endpoint (never credentials)."""
        raise NotImplementedError

    def list_page(
        self, prefix: str, after: str = "", *, keys: int = LIST_PAGE_KEYS, delimiter: str = ""
    ) -> ListedPage:
        """One request's page: up to ``keys`` names that start with ``prefix`` and sort after
        ``after`` (a listing can start anywhere, not only where the last page ended), names
        holding ``delimiter`` past the prefix rolled up into one sub-folder.

        Example:
            >>> b.list_page("audio/clip", after="audio/clip0999.wav")  # doctest: +SKIP
            ListedPage(objects=[ObjectInfo(name='audio/clip1000.wav', ...), ...], ...)

        Raises:
            StoreError: the bucket cannot be listed (the client's error in one line).
        """
        raise NotImplementedError

    def head(self, name: str) -> ObjectInfo | None:
        """The object ``name``, or None if there is none."""
        raise NotImplementedError

    def get_once(self, name: str, start: int = 0, length: int | None = None) -> ObjectBytes:
        """One GET of ``name`` (whole, or ``length`` bytes from ``start``), its body read
        whole; the info is the whole object's (its size, not the range's).

        Raises:
            Absent: there is no such object.
            Transient: the body ended early or the answer did not come in time.
        """
        raise NotImplementedError

    def download_once(self, name: str, dest: Path) -> int:
        """One GET of ``name`` streamed into ``dest`` (written from its start, cut to size).

        Raises:
            Absent: there is no such object.
            Transient: the body ended early.
        """
        raise NotImplementedError

    def stream_once(self, name: str, take: Callable[[bytes], object]) -> ObjectInfo:
        """One GET of ``name``, its body handed to ``take`` chunk by chunk as it comes (never
        whole in memory, where the library allows); the object as that response gives it.

        Raises:
            Absent: there is no such object.
            Transient: the body ended early.
        """
        raise NotImplementedError

    def put(self, name: str, src: Path, *, create: bool) -> None:
        """Put file ``src`` as ``name`` (in parts when big); ``create``: only if absent.

        Raises:
            Exists: ``create`` and an object of that name was there.
        """
        raise NotImplementedError

    def delete(self, objects: Iterable[str | ObjectInfo]) -> Sequence[str]:
        """Delete objects: one named by its name whatever it holds, one given as an
        :class:`ObjectInfo` (as a listing or a stat saw it) only while it is still that version;
        the names of those kept because they were put again since. One already gone is no error
        (nor kept: a condition refused for want of any version is asked about with a HEAD).

        The condition is each cloud's own: GCS ``ifGenerationMatch`` (the generation), Azure
        ``If-Match`` (the ETag; both change with every put, the same bytes too). S3's
        general-purpose buckets condition a delete on the ETag alone, which the same bytes put
        again keep: there a HEAD first keeps an object whose ETag differs or whose last change
        is later than the one seen (:meth:`S3Objects.put_again_since`), the delete following it
        unconditional. gc's sweep deletes content-named shards this way: another node may put
        the same bytes again, and publish a fragment naming them, after gc listed them.

        Example:
            >>> listed = b.list("shards/")  # doctest: +SKIP
            >>> b.delete(listed)  # doctest: +SKIP
            ['shards/ab/ab12.safetensors']
        """
        raise NotImplementedError

    def translate(self, name: str, e: BaseException) -> None:
        """Raise what a user can act on for the library's error ``e`` (:class:`Absent`,
        :class:`Exists`, :class:`Transient`, or a one-line ``StoreError``); re-raise ``e`` when
        it is none of those."""
        raise NotImplementedError

    # -- reads -----------------------------------------------------------------------------------
    def list(self, prefix: str) -> list[ObjectInfo]:
        """The objects whose names start with ``prefix`` (e.g. ``"catalog/"``), in name order."""
        out: list[ObjectInfo] = []
        after = ""
        while True:
            page = self.list_page(prefix, after)
            out.extend(page.objects)
            if not page.truncated or not page.last:
                return out
            after = page.last

    def download(self, name: str, dest: Path) -> int:
        """Stream object ``name`` into file ``dest``; its size. Tried whole again when the
        connection drops mid-body.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        return self._tried(name, lambda: self.download_once(name, dest))

    def read(self, name: str) -> ObjectBytes:
        """Object ``name``'s bytes, whole, in memory, with the size, last change and ETag of
        the response that carried them (so the bytes and the ETag belong together, whatever
        was written since a listing). Tried whole again when the connection drops mid-body.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        return self._tried(name, lambda: self.get_once(name))

    def hashed(self, name: str) -> HashedObject:
        """Object ``name``'s SHA-256 from one GET streamed through the hash
        (:meth:`stream_once`), with the size, last change and ETag of that response: what a
        digest needs, without the object whole in memory. Tried whole again when the
        connection drops mid-body.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """

        def once() -> HashedObject:
            sha = hashlib.sha256()  # afresh for each try
            info = self.stream_once(name, sha.update)
            return HashedObject(info, sha.hexdigest())

        return self._tried(name, once)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` from ``start`` (fewer at its end): one ranged GET.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        if length <= 0:
            return b""
        return self._ranged(name, start, length).data

    def read_range_of(self, name: str, start: int, length: int) -> ObjectBytes:
        """As :meth:`read_range`, with the object's size, last change and ETag as that one
        response gives them: a reader that checks the object is unchanged needs no HEAD beside
        the GET.

        Raises:
            FileNotFoundError: there is no such object.
            StoreError: it could not be read (after :data:`DOWNLOAD_TRIES` tries).
        """
        asked = max(1, length)  # a GET of no bytes is no request: ask one, keep none
        got = self._ranged(name, start, asked)
        return ObjectBytes(got.info, got.data[:length])

    def _ranged(self, name: str, start: int, length: int) -> ObjectBytes:
        """One ranged read of :meth:`_tried`; a range past the object's end (an object cut
        short since its reader learned its size) is no bytes on every cloud alike, so the
        reader finds the shard short and says it is damaged.

        Raises:
            FileNotFoundError: there is no such object.
        """
        try:
            return self._tried(name, lambda: self.get_once(name, start, length))
        except PastTheEnd:
            info = self.head(name)
            if info is None:
                raise FileNotFoundError(self.where(name)) from None
            return ObjectBytes(info, b"")

    def check_whole(self, name: str, got: int, size: int) -> None:
        """Raise :class:`Transient` (tried again whole) if a body of ``size`` bytes ended
        after ``got``.

        Raises:
            Transient: ``got`` is not ``size``.
        """
        if got != size:
            raise Transient(f"{self.where(name)} ended after {got} of {size} bytes")

    @contextlib.contextmanager
    def tries_counted(self) -> Iterator[None]:
        """A context for one read of :meth:`_tried`: each request this thread sends for the
        object, featbake's tries and the client's own retries alike, counts into the read's
        :data:`DOWNLOAD_TRIES` per part (:func:`count_asked`; :class:`TriesSpent` past them).
        Each cloud's client reports each request as it sends it: s3 botocore's ``before-send``
        event, gs the session's transport adapter (:func:`gcs_requests_counted`), az the
        client's ``raw_request_hook``."""
        token = _ASKED.set(Counter())
        last = _LAST_ASKED.set(None)
        try:
            yield
        finally:
            _LAST_ASKED.reset(last)
            _ASKED.reset(token)

    def _tried(self, name: str, once: Callable[[], _T]) -> _T:
        """``once()``, again (with backoff) while a body is cut short: the same bytes are
        asked for :data:`DOWNLOAD_TRIES` times at most, the client's own tries included. An
        answer that never came after the client's own tries is one line at once
        (:meth:`unanswered`): tried again whole, a stalled endpoint was asked 4 x 4 times."""
        last: BaseException | None = None
        with self.tries_counted():
            for attempt in range(DOWNLOAD_TRIES):
                try:
                    with self.errors(name, retried=True):
                        return once()
                except Absent:
                    raise FileNotFoundError(self.where(name)) from None
                except TriesSpent as e:
                    last = last or e
                    break
                except Transient as e:
                    last = e.__cause__ or e  # a PutAgain has none: itself
                    time.sleep(0.1 * 2**attempt * backoff_scale())
        raise StoreError(self.not_downloaded(name, last)) from last

    def not_downloaded(self, name: str, last: BaseException | None) -> str:
        """Why :meth:`_tried` gave up on ``name``, and what to do: where the object was put
        again during each read, whoever writes it (another node, a sync), not the network."""
        tries = f"after {DOWNLOAD_TRIES} tries"
        if isinstance(last, PutAgain):
            return (
                f"cannot download {self.where(name)} {tries}: it was put again during each "
                "read (something is writing it over and over: another build, a sync job); stop "
                "that writer or wait for it to finish, then run this again"
            )
        return (
            f"cannot download {self.where(name)} {tries} ({redact(str(last))}); check the "
            f"network and the endpoint ({self.ENDPOINT_HINT}), then run this again"
        )

    # -- writes ----------------------------------------------------------------------------------
    def upload(self, name: str, src: Path, *, create: bool = False) -> bool:
        """Put file ``src`` as object ``name``. With ``create``, only if no object of that name
        exists (S3 and Azure ``If-None-Match: *``, GCS ``ifGenerationMatch=0``): False when
        another writer's did (:meth:`holds`). Big files go up in parts.

        Raises:
            StoreError: the upload failed (the message says why and what to do).
        """
        try:
            with self.errors(name):
                self.put(name, src, create=create)
        except Exists:
            return self.holds(name, src)
        return True

    def holds(self, name: str, src: Path) -> bool:
        """Whether object ``name`` holds exactly file ``src``'s bytes.

        A create-only put that finds its name taken may have met its own object: the server
        stored the first request, its answer was lost, and the client sent the put again. That
        put succeeded, and its caller must not take it for a race lost (a merge would publish
        its change again as the next version, and report it as found there). Other bytes are
        another writer's (the same bytes from another writer are the same version: either may
        go on as its publisher). A HEAD, and a download only when the sizes agree.
        """
        info = self.head(name)
        if info is None or info.size != os.path.getsize(src):
            return False
        fd, there = tempfile.mkstemp(prefix=f".{src.name}.", suffix=".there", dir=src.parent)
        os.close(fd)
        try:
            self.download(name, Path(there))
            return filecmp.cmp(src, there, shallow=False)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(there)

    # -- errors ----------------------------------------------------------------------------------
    def errors(self, name: str, *, retried: bool = False) -> _Errors:
        """A context that turns the client's exceptions into one actionable line. ``retried``:
        the caller tries again on a cut body or a read timeout (:meth:`_tried`); elsewhere
        those are one line too."""
        return _Errors(self, name, retried)

    def unanswered(self, name: str, e: BaseException) -> StoreError:
        """The one line for a request whose answer never came (or came cut short) after the
        client's tries: a stalled endpoint must not hang a command or end it with an internal
        error. It says which: a wait past the read timeout, or answers cut short."""
        why = redact(str(e.__cause__ or e))
        if not timed_out(e):
            return StoreError(
                f"{self.endpoint_label()} cut its answers for {self.where(name)} short after "
                f"{MAX_ATTEMPTS} tries ({why}); check the endpoint and the network (a proxy or "
                "load balancer closing connections?)"
            )
        return StoreError(
            f"{self.endpoint_label()} did not answer for {self.where(name)} within "
            f"{read_timeout():g} s after {MAX_ATTEMPTS} tries ({why}); "
            f"check the endpoint and the network, or raise ${READ_TIMEOUT_ENV}"
        )

    def no_bucket(self) -> StoreError:
        """The one line for a bucket (container) that is not there."""
        return StoreError(
            f"the bucket {self.url.bucket!r} does not exist at {self.endpoint_label()}; create "
            f"it, or fix the URL or {self.ENDPOINT_HINT}"
        )

    def denied(self, name: str, why: str, fix: str) -> StoreError:
        """The one line for a request the service refused."""
        return StoreError(f"access to {self.where(name)} was denied ({why}); check {fix}")

    def unreachable(self, name: str, e: BaseException) -> StoreError:
        """The one line for an endpoint that refused the connection or does not resolve."""
        return StoreError(
            f"cannot reach {self.endpoint_label()} for {self.where(name)} ({redact(str(e))}); "
            f"check {self.ENDPOINT_HINT} and the network"
        )

    def no_connection(self, name: str) -> StoreError:
        """The one line for an endpoint that accepted no connection in time."""
        return StoreError(
            f"{self.endpoint_label()} accepted no connection within {CONNECT_TIMEOUT_S} s for "
            f"{self.where(name)}; check {self.ENDPOINT_HINT} and the network"
        )


_S = TypeVar("_S", bound=ObjectStore)


class _Errors:
    """Translates a client library's exceptions (see :meth:`ObjectStore.errors`)."""

    def __init__(self, store: ObjectStore, name: str, retried: bool) -> None:
        self.store = store
        self.name = name
        self.retried = retried

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is None or isinstance(e, Absent | Exists | PastTheEnd | FileNotFoundError):
            return
        if not isinstance(e, StoreError | ConfigError | Transient):
            try:
                self.store.translate(self.name, e)
            except Transient as t:
                if self.retried:
                    raise
                raise self.store.unanswered(self.name, t) from None
        if isinstance(e, Transient) and not self.retried:
            raise self.store.unanswered(self.name, e) from None


def raise_translated(store: ObjectStore, name: str, e: BaseException) -> None:
    """Raise what a user can act on for the client's error ``e`` (re-raise what is not one)."""
    store.translate(name, e)


def read_timeout() -> float:
    """Seconds a request waits for an answer: ``$FEATBAKE_OBJECT_TIMEOUT``, else
    ``$FEATBAKE_S3_TIMEOUT`` (its name before there were other clouds), else 20.

    Raises:
        ConfigError: the variable is not a positive number.
    """
    var = next((v for v in (READ_TIMEOUT_ENV, S3_TIMEOUT_ENV) if os.environ.get(v)), "")
    if not var:
        return READ_TIMEOUT_S
    raw = os.environ[var]
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(f"${var} must be a number of seconds above 0, got {raw!r}")
    return value


def backoff_scale() -> float:
    """What every wait between a request's tries is multiplied by: ``$FEATBAKE_OBJECT_BACKOFF``,
    else 1 (the waits described at each cloud's client). It scales botocore's backoff (s3),
    :func:`gcs_retry`'s (gs), the Azure client's policy (az) and featbake's own between whole
    reads of a cut body alike; the tries themselves are not changed.

    Raises:
        ConfigError: the variable is not a number of 0 or more.
    """
    raw = os.environ.get(BACKOFF_ENV, "")
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(
            f"${BACKOFF_ENV} must be a number of 0 or more (what the waits between tries are "
            f"multiplied by; 1 by default), got {raw!r}"
        )
    return value


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds, as the requests-based clients take them."""
    return (CONNECT_TIMEOUT_S, read_timeout())


def content_range_size(header: str | None, fallback: int) -> int:
    """The whole object's size from a ``Content-Range: bytes 0-99/12345`` header.

    Example:
        >>> content_range_size("bytes 0-99/12345", 100), content_range_size(None, 7)
        (12345, 7)
    """
    if not header:
        return fallback
    total = str(header).rpartition("/")[2]
    return int(total) if total.isdigit() else fallback


# == s3 ============================================================================================
# The S3 API through boto3, one client per process.
#
# Chosen by measurement (``benchmarks/s3_clients.py``, docs/object_store.md). obstore spends a
# third of boto3's client CPU per ranged GET, but its Rust runtime is process-global: after a
# ``fork`` (DataLoader's default on Linux) any obstore call in the child hangs, even through a
# client made in the child, once the parent has used obstore (measured: killed by an alarm after
# 10 s; obstore#441). A bucket store reads whole shards into its local tier, where one request
# moves megabytes and the per-request CPU does not show; there boto3 was as fast or faster (a
# 64 MiB GET in 91 ms against 179), works after fork and spawn, and reads the whole AWS
# configuration (``AWS_PROFILE``, SSO, instance roles) as users expect.
#
# Configuration is S3's standard environment: ``AWS_ENDPOINT_URL`` (MinIO, R2, Ceph, a loopback
# server), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_REGION``.
# Endpoints other than AWS are addressed path-style, as litdata does. Throttling, 5xx answers and
# connection errors are retried with backoff by botocore ("standard" mode), and so is an answer
# that does not come within the read timeout: after botocore's 4 attempts that is one line, not
# tried again. botocore never asks again for a body: a download cut or stalled mid-body is
# featbake's to try again whole (:meth:`ObjectStore._tried`). Within a read every request,
# botocore's retries included, counts into the read's 4 (:func:`s3_request_counted`).
def s3_request_counted(request: Any, **_: Any) -> None:
    """botocore's ``before-send`` handler, run before each request the client sends, its own
    retries included: within a read, count it for its part (method, URL, range), and refuse the
    one past :data:`DOWNLOAD_TRIES` (:class:`TriesSpent`, which botocore does not retry)."""
    count_asked((request.method, request.url, request.headers.get("Range") or ""))


def s3_backoff_scaled(client: Any) -> None:
    """Scale the waits of ``client``'s retries by :func:`backoff_scale` (botocore's "standard"
    mode waits rand(0, 1) x 2**n x 50 ms between tries, x 1 s after throttling, and has no
    setting for it): its retry handler is made again by botocore (the same conditions, quota
    and :data:`MAX_ATTEMPTS`) and each delay it returns is scaled. Left as botocore made it at
    the default scale."""
    scale = backoff_scale()
    if scale == 1.0:
        return
    from botocore.retries import standard

    events = client.meta.events
    events.unregister("needs-retry.s3", unique_id="retry-config-s3")
    handler = standard.register_retry_handler(client, max_attempts=MAX_ATTEMPTS)
    events.unregister("needs-retry.s3", unique_id="retry-config-s3")

    def needs_retry(**kwargs: Any) -> Any:
        delay = handler.needs_retry(**kwargs)
        numeric = isinstance(delay, int | float) and not isinstance(delay, bool)
        return delay * scale if numeric else delay

    events.register("needs-retry.s3", needs_retry, unique_id="retry-config-s3")


def listed_info(entry: Mapping[str, Any], strip: int) -> ObjectInfo:
    """An object as a listing names it (``Contents[]``; its key less ``strip`` characters):
    the same size, last change and ETag as a HEAD or a GET of it gives."""
    return ObjectInfo(
        entry["Key"][strip:],
        int(entry["Size"]),
        entry["LastModified"].timestamp(),
        entry.get("ETag", "").strip('"'),
    )


@register("s3")
class S3Objects(ObjectStore):
    """``s3://bucket/prefix`` through boto3 (see the section's comment)."""

    ENDPOINT_HINT = "AWS_ENDPOINT_URL"

    def connect(self) -> Any:
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
            retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
            s3={"addressing_style": "path"} if url else {},
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=read_timeout(),
            max_pool_connections=CLIENT_CONNECTIONS,
        )
        try:
            session = boto3.session.Session()
            region = session.region_name or "us-east-1"
            client = session.client("s3", endpoint_url=url, region_name=region, config=config)
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
        client.meta.events.register("before-send.s3", s3_request_counted)
        s3_backoff_scaled(client)
        return client

    @contextlib.contextmanager
    def body_read(self, name: str) -> Iterator[None]:
        """Reading an answer's body: botocore does not ask again for a body, so one that
        stalls past the read timeout is cut short (:class:`Transient`), featbake's to read
        again whole; a timeout before the answer came is botocore's, after its tries."""
        from botocore import exceptions as bx

        try:
            yield
        except bx.ReadTimeoutError as e:
            raise Transient(f"{self.where(name)}: {e}") from e

    def endpoint_label(self) -> str:
        return endpoint_label()

    def tier_folder(self) -> str:
        return endpoint_folder(endpoint())

    def list_page(
        self, prefix: str, after: str = "", *, keys: int = LIST_PAGE_KEYS, delimiter: str = ""
    ) -> ListedPage:
        strip = len(self.key(""))
        options: dict[str, Any] = {
            "Bucket": self.url.bucket,
            "Prefix": self.key(prefix),
            "MaxKeys": keys,
        }
        if after:
            options["StartAfter"] = self.key(after)
        if delimiter:
            options["Delimiter"] = delimiter
        with self.errors(prefix):
            got = self.client.list_objects_v2(**options)
        objects = [listed_info(o, strip) for o in got.get("Contents", ())]
        folders = [str(p["Prefix"])[strip:] for p in got.get("CommonPrefixes", ())]
        last = max([o.name for o in objects[-1:]] + folders[-1:], default="")
        return ListedPage(objects, last, bool(got.get("IsTruncated")))

    def head(self, name: str) -> ObjectInfo | None:
        try:
            with self.errors(name):
                h = self.client.head_object(Bucket=self.url.bucket, Key=self.key(name))
        except Absent:
            return None
        return ObjectInfo(
            name, int(h["ContentLength"]), h["LastModified"].timestamp(), h["ETag"].strip('"')
        )

    def get_once(self, name: str, start: int = 0, length: int | None = None) -> ObjectBytes:
        options = {} if length is None else {"Range": f"bytes={start}-{start + length - 1}"}
        got = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name), **options)
        body = got["Body"]
        try:
            with self.body_read(name):
                data = body.read()
        finally:
            body.close()
        if len(data) != int(got["ContentLength"]):
            raise Transient(f"{self.where(name)} ended after {len(data)} bytes")
        size = len(data)
        if length is not None:
            if "ContentRange" in got:
                size = content_range_size(got["ContentRange"], size)
            else:  # the range ignored: the whole object came
                data = data[start : start + length]
        info = ObjectInfo(name, size, got["LastModified"].timestamp(), got["ETag"].strip('"'))
        return ObjectBytes(info, bytes(data))

    def download_once(self, name: str, dest: Path) -> int:
        size = 0
        # Into the file as it is (its space may be reserved), cut to the object's size after.
        with open(dest, "r+b" if dest.exists() else "wb") as f:
            got = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name))
            expected = int(got["ContentLength"])
            body = got["Body"]
            try:
                with self.body_read(name):
                    for chunk in body.iter_chunks(CHUNK):
                        size += f.write(chunk)
            finally:
                body.close()
            f.truncate(size)
        self.check_whole(name, size, expected)
        return size

    def stream_once(self, name: str, take: Callable[[bytes], object]) -> ObjectInfo:
        got = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name))
        sink = ChunkSink(take)
        body = got["Body"]
        try:
            with self.body_read(name):
                for chunk in body.iter_chunks(HASH_CHUNK):
                    sink.write(chunk)
        finally:
            body.close()
        self.check_whole(name, sink.size, int(got["ContentLength"]))
        return ObjectInfo(name, sink.size, got["LastModified"].timestamp(), got["ETag"].strip('"'))

    def put(self, name: str, src: Path, *, create: bool) -> None:
        if create or os.path.getsize(src) < SINGLE_PUT_BYTES:
            # One request on this thread (up to 5 GB): a dataset's last uses are uploaded by
            # its finalizer at exit, after the interpreter refuses new threads, which
            # upload_file's transfer pool needs (the uses were lost in silence).
            with open(src, "rb") as f:
                extra = {"IfNoneMatch": "*"} if create else {}
                self.client.put_object(Bucket=self.url.bucket, Key=self.key(name), Body=f, **extra)
        else:  # multipart above boto3's threshold
            self.client.upload_file(os.fspath(src), self.url.bucket, self.key(name))

    def delete(self, objects: Iterable[str | ObjectInfo]) -> Sequence[str]:
        batch = list(objects)
        kept: list[str] = []
        for i in range(0, len(batch), 1000):  # DeleteObjects takes 1000 keys a request
            kept += self._delete_batch(batch[i : i + 1000])
        return kept

    def _delete_batch(self, batch: Sequence[str | ObjectInfo]) -> list[str]:
        """Delete up to 1000 objects in one request, those seen (``ObjectInfo``) only where a
        HEAD finds them as seen (:meth:`put_again_since`, the HEADs at once on the client's
        connections, each batch deleted as soon as its HEADs are back: a put again between a
        HEAD and the delete is one batch's HEADs apart, not every batch's); the names kept.

        Raises:
            StoreError: S3 refused to delete some of them (its answer's ``Errors``: denied, an
                object lock), named with the first refusal and what to check.
        """
        seen = [o for o in batch if isinstance(o, ObjectInfo)]
        moved = map_in_threads(self.put_again_since, seen, threads=CLIENT_CONNECTIONS)
        kept = [o.name for o, again in zip(seen, moved, strict=True) if again]
        put_since = frozenset(kept)
        names = [n for n in map(object_name, batch) if n not in put_since]
        if not names:
            return kept
        with self.errors(names[0]):
            answer = self.client.delete_objects(
                Bucket=self.url.bucket,
                Delete={"Objects": [{"Key": self.key(n)} for n in names], "Quiet": True},
            )
        refused = answer.get("Errors") or []
        if refused:
            first = refused[0]
            raise StoreError(
                f"{len(refused)} of {len(names)} objects could not be deleted from "
                f"{self.url}: {first.get('Key', '?')}: {first.get('Code', '?')} "
                f"({first.get('Message', '')}); check the credentials' delete permission, the "
                "bucket's policy and any object lock, then run this again"
            )
        return kept

    def put_again_since(self, seen: ObjectInfo) -> bool:
        """Whether object ``seen`` was put again since it was seen so (a HEAD now): its ETag
        differs, or its last change is a second or more later.

        S3's general-purpose buckets condition a delete on the ETag alone (``If-Match``), and
        an object's ETag is its bytes' digest: the same bytes put again, as another node puts a
        content-named shard, keep it. Their last change is what moves; a listing's and a HEAD's
        are not always the same to the millisecond (a HEAD says whole seconds), so a second
        later is put again. What a HEAD cannot see is a put between it and the delete (one
        batch's HEADs, run at once: :meth:`_delete_batch`).
        """
        now = self.head(seen.name)
        return now is not None and (now.etag != seen.etag or now.modified - seen.modified >= 1)

    def translate(self, name: str, e: BaseException) -> None:
        from botocore import exceptions as bx

        if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
            raise StoreError(
                f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE), and AWS_ENDPOINT_URL for a server other than AWS; then run "
                "this again"
            ) from None
        if isinstance(e, bx.IncompleteReadError | bx.ResponseStreamingError):
            raise Transient(str(e)) from e
        if isinstance(e, bx.ReadTimeoutError):
            # No answer within the read timeout after botocore's own tries (a body's stall is
            # :meth:`body_read`'s): tried again whole, a read sent 16 requests for 4.
            raise self.unanswered(name, e) from None
        if isinstance(e, bx.ConnectTimeoutError):
            raise self.no_connection(name) from None
        if isinstance(e, bx.EndpointConnectionError | bx.ConnectionClosedError):
            raise self.unreachable(name, e) from None
        if not isinstance(e, bx.ClientError):
            raise e
        self._raise_client_error(name, e)

    def _raise_client_error(self, name: str, e: Any) -> None:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            raise self.no_bucket() from None
        if code in ("404", "NoSuchKey", "NotFound"):
            raise Absent(name) from None
        if code in ("416", "InvalidRange"):
            raise PastTheEnd(name) from None
        if code in ("412", "PreconditionFailed", "ConditionalRequestConflict"):
            raise Exists(name) from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise self.denied(
                name,
                code,
                "the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and "
                "the bucket's policy",
            ) from None
        raise StoreError(f"{self.where(name)}: {code or type(e).__name__}: {redact(str(e))}") from e


# == gcs ===========================================================================================
# Google Cloud Storage through google-cloud-storage (the JSON API over requests).
#
# Credentials are Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud
# auth application-default login``, a VM's service account); with ``STORAGE_EMULATOR_HOST``
# set (fake-gcs-server, the tests) the client is anonymous and talks to that endpoint. A version
# tag is the object's generation (a number that changes with each write), and a create-only put
# is ``ifGenerationMatch=0``. Files above 8 MiB go up as resumable uploads (the library's rule).
# A GET through the library does not give the object's size and last change, so a read that
# must return them asks the metadata first and then GETs that very generation
# (``ifGenerationMatch``): the bytes and the info belong together, at two requests. The library
# retries each call at most as often as the other clouds' clients (:func:`gcs_retry`).
class GCSTries:
    """Whether google-cloud-storage tries one request again after error ``e`` (a retry
    predicate, :func:`gcs_retry`): what fails before an answer (429, 5xx, a refused or reset
    connection, an answer that did not come in time) is tried again, :data:`MAX_ATTEMPTS`
    requests at most, each request its own (:func:`gcs_retry_class`). ``cut_bodies``: an answer
    cut short too. Within a read, no retry of a request whose part the read asked for
    :data:`DOWNLOAD_TRIES` times (:func:`last_may_be_asked_again`): the requests themselves are
    counted where they are sent (:func:`gcs_requests_counted`), not here."""

    def __init__(self, *, cut_bodies: bool) -> None:
        self.cut_bodies = cut_bodies
        self.left = MAX_ATTEMPTS - 1

    def fresh(self) -> GCSTries:
        """The same predicate with all its retries left: one per request."""
        return GCSTries(cut_bodies=self.cut_bodies)

    def __call__(self, e: Exception) -> bool:
        import requests
        from google.api_core.retry import if_transient_error

        cut = isinstance(e, requests.exceptions.ChunkedEncodingError)
        transient = bool(if_transient_error(e)) or isinstance(e, requests.exceptions.Timeout)
        if not transient or (cut and not self.cut_bodies) or self.left <= 0:
            return False
        if not last_may_be_asked_again():
            return False  # the read asked for these bytes DOWNLOAD_TRIES times already
        self.left -= 1
        return True


@functools.cache
def gcs_retry_class() -> type[Any]:
    """api_core's ``Retry``, counting its predicate's tries afresh for each function it wraps.

    google-cloud-storage wraps each request it sends with the one ``Retry`` a call was given
    (an API call's one request; a download, resumed from a cut or a stall; each chunk of a
    resumable upload apart, 100 MiB each), and api_core's deadline already starts anew at each
    wrapped function. A predicate counting the whole call's retries gave a multi-GB upload 3
    retries for all its chunk requests together; here each request gets its own.
    """
    from google.api_core.retry import Retry

    class EachRequest(Retry):
        """api_core's ``Retry``, its :class:`GCSTries` fresh for each wrapped function."""

        def __call__(self, func: Any, on_error: Any = None) -> Any:
            tries = self._predicate
            own = self.with_predicate(tries.fresh()) if isinstance(tries, GCSTries) else self
            return Retry.__call__(own, func, on_error)

    return EachRequest


def gcs_retry(*, cut_bodies: bool) -> Any:
    """One call's retry policy for google-cloud-storage: each request the call sends (an upload's
    chunks are requests apart) is tried again on what fails before an answer, backing off up
    to 1, 2, 4 s (times :func:`backoff_scale`), :data:`MAX_ATTEMPTS` requests at most (as
    botocore's and the Azure client's policies here), within those requests' time and the waits
    (:class:`GCSTries`).

    ``cut_bodies``: an answer cut short is tried again too (a listing's, a metadata call's, an
    upload's: as botocore does). Not for a download's body: the library resumes a cut download
    from the cut, every cut, until its deadline, so a server cutting every answer kept one read
    going for a minute and more. There the cut ends the call, and :meth:`ObjectStore._tried`
    tries the read whole again, :data:`DOWNLOAD_TRIES` requests for its bytes in all, the
    library's retries of a stalled answer counted in, as on s3 and az.
    """
    deadline = read_timeout() * MAX_ATTEMPTS + 7
    tries = GCSTries(cut_bodies=cut_bodies)
    scale = backoff_scale()  # $FEATBAKE_OBJECT_BACKOFF
    return gcs_retry_class()(
        predicate=tries, initial=scale, multiplier=2, maximum=4 * scale, timeout=deadline
    )


def gcs_part(method: str, url: str) -> Part:
    """The part a google-cloud-storage request asks for: its method and URL (generation and
    ``alt=media`` included). Not its ``Range``: the library resumes a download cut or stalled
    mid-body from where it stopped, and that request asks again for the same read's bytes."""
    return (method, url, "")


@functools.cache
def gcs_counted_adapter() -> type[Any]:
    """requests' transport adapter that counts each request a google-cloud-storage client's
    session sends into this thread's read (:func:`count_asked`) and has ``inner`` send it."""
    from requests.adapters import BaseAdapter

    class CountedAdapter(BaseAdapter):
        """Counts, then sends through the adapter it wraps."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            count_asked(gcs_part(str(request.method), str(request.url)))
            return self.inner.send(request, *args, **kwargs)

        def close(self) -> None:
            self.inner.close()

    return CountedAdapter


def gcs_requests_counted(session: Any) -> None:
    """Count every request ``session`` (a google-cloud-storage client's requests session)
    sends, the library's retries and resumed downloads included, as it is sent: within a read
    each counts into the read's :data:`DOWNLOAD_TRIES` per part (:class:`TriesSpent` past them),
    as botocore's ``before-send`` does on s3 and the request hook on az. One rule: a request is
    counted when it goes out, not where featbake or the retry rule expects one."""
    counted = gcs_counted_adapter()
    for prefix, inner in list(session.adapters.items()):
        if not isinstance(inner, counted):
            session.mount(prefix, counted(inner))


def read_stalled(e: BaseException) -> bool:
    """Whether requests' error ``e`` is an answer that did not come within the read timeout:
    its ``ReadTimeout`` before the answer, or mid-body a ``ConnectionError`` from urllib3's
    ``ReadTimeoutError`` (not a body cut short, which is ``ChunkedEncodingError``)."""
    import requests
    from urllib3.exceptions import ReadTimeoutError

    if isinstance(e, requests.exceptions.ReadTimeout):
        return True
    mid_body = isinstance(e, requests.exceptions.ConnectionError)
    return mid_body and any(isinstance(a, ReadTimeoutError) for a in e.args)


def gcs_traced() -> bool:
    """Whether the user turned google-cloud-storage's OpenTelemetry traces on (its documented
    ``ENABLE_GCS_PYTHON_CLIENT_OTEL_TRACES``, read as the library reads it)."""
    value = os.environ.get("ENABLE_GCS_PYTHON_CLIENT_OTEL_TRACES", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def untraced(client: Any) -> None:
    """Take from a new google-cloud-storage client the bucket metadata cache it keeps for
    OpenTelemetry spans (3.11 on), unless the user turned the library's traces on.

    On a client's first call that names a bucket, the cache starts a thread that GETs the
    bucket (``storage.buckets.get``: a request per process and bucket, refused to object-only
    roles), traces on or not, with the library's default retry (120 s) outside featbake's
    tries: against a stalled endpoint it kept asking after featbake had given up; and a 404
    starts another, asking whether the bucket still exists. The library's switch
    (``DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA``) is read from the environment, for
    the whole process: featbake's own clients go without the cache instead, which the library
    allows for at each use (googleapis/google-cloud-python#17650).
    """
    if not gcs_traced() and hasattr(client, "_bucket_metadata_cache"):
        client._bucket_metadata_cache = None


@register("gs")
class GCSObjects(ObjectStore):
    """``gs://bucket/prefix`` through google-cloud-storage (see the section's comment)."""

    ENDPOINT_HINT = "STORAGE_EMULATOR_HOST or the Application Default Credentials"

    def connect(self) -> Any:
        try:
            from google.auth import exceptions as ax
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage
        except ImportError:
            raise ConfigError(
                f"{self.url} is a Google Cloud Storage store, which needs the gcs extra: "
                "pip install 'featbake[gcs]' (google-cloud-storage)"
            ) from None
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or None
        emulator = gcs_emulator(os.environ)  # ConfigError: not an http(s) endpoint
        try:
            if emulator:
                client = storage.Client(
                    project=project or "featbake",
                    credentials=AnonymousCredentials(),
                    client_options={"api_endpoint": emulator},  # the library's, unchecked
                )
            else:
                client = storage.Client(project=project)
        except ax.DefaultCredentialsError:
            raise self.no_credentials() from None
        except (ValueError, OSError) as e:
            raise ConfigError(
                f"cannot make a Google Cloud Storage client for {self.url}: {redact(str(e))}; "
                "check GOOGLE_CLOUD_PROJECT and the Application Default Credentials"
            ) from None
        untraced(client)
        gcs_requests_counted(client._http)  # the client's session (made now if not yet)
        return client.bucket(self.url.bucket)

    def no_credentials(self) -> StoreError:
        """The one line for no Application Default Credentials."""
        return StoreError(
            f"no credentials for {self.url}: run `gcloud auth application-default login`, or set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file "
            "(STORAGE_EMULATOR_HOST for an emulator); then run this again"
        )

    def endpoint_label(self) -> str:
        return redact(gcs_endpoint(os.environ))

    def tier_folder(self) -> str:
        return "gs_" + endpoint_folder(gcs_endpoint(os.environ))

    def _options(self) -> dict[str, Any]:
        """Each call's timeouts, and its tries (:func:`gcs_retry`)."""
        return {"timeout": timeouts(), "retry": gcs_retry(cut_bodies=True)}

    def _media(self) -> dict[str, Any]:
        """A download's timeouts and tries (:func:`gcs_retry`): its requests count into the
        read's as they are sent (:func:`gcs_requests_counted`); a cut body is
        :meth:`ObjectStore._tried`'s to try again."""
        return {"timeout": timeouts(), "retry": gcs_retry(cut_bodies=False)}

    def _info(self, blob: Any, strip: int) -> ObjectInfo:
        return ObjectInfo(
            blob.name[strip:], int(blob.size or 0), blob.updated.timestamp(), str(blob.generation)
        )

    def list_page(
        self, prefix: str, after: str = "", *, keys: int = LIST_PAGE_KEYS, delimiter: str = ""
    ) -> ListedPage:
        strip = len(self.key(""))
        start = self.key(after) if after else None
        options = self._options()
        with self.errors(prefix):
            bucket = self.client
            pages = bucket.client.list_blobs(
                bucket,
                prefix=self.key(prefix),
                start_offset=start,  # GCS starts AT a name: the name itself is dropped below
                page_size=keys + 1 if after else keys,
                delimiter=delimiter or None,
                **options,
            )
            try:
                page = next(pages.pages)
                blobs = [b for b in page if b.name != start]
                rolled = sorted(p for p in page.prefixes if start is None or p > start)
            except StopIteration:
                blobs, rolled = [], []
            truncated = pages.next_page_token is not None or len(blobs) > keys
        objects = [self._info(b, strip) for b in blobs[:keys]]
        folders = [p[strip:] for p in rolled]
        last = max([o.name for o in objects[-1:]] + folders[-1:], default="")
        return ListedPage(objects, last, truncated)

    def head(self, name: str) -> ObjectInfo | None:
        blob = self._metadata(name)
        return None if blob is None else self._info(blob, len(self.key("")))

    def _metadata(self, name: str) -> Any:
        """Object ``name``'s metadata (a blob), or None if there is none."""
        options = self._options()
        with self.errors(name):
            return self.client.get_blob(self.key(name), **options)

    def _read_head(self, name: str) -> ObjectInfo:
        """What a read of ``name`` pins: its metadata, checked readable as stored.

        Raises:
            Absent: there is no such object.
            StoreError: it is stored gzip-encoded (:meth:`refuse_gzip`).
        """
        blob = self._metadata(name)
        if blob is None:
            raise Absent(name)
        self.refuse_gzip(name, blob.content_encoding, int(blob.size or 0))
        return self._info(blob, len(self.key("")))

    def refuse_gzip(self, name: str, encoding: str | None, size: int | None = None) -> None:
        """Refuse to read ``name`` if it is stored gzip-encoded (``Content-Encoding: gzip``, as
        ``gsutil cp -Z`` and ``gcloud storage cp --gzip-local`` upload): GCS serves it
        decompressed, so the bytes read are not the ``size`` stored that its stat, the hash
        cache and every check of a body cut short go by, and a byte range of it is a range of
        the compressed bytes. Before, a read said the body "ended after 51000 of 1202 bytes"
        after 4 tries, a ranged read was an internal error, and a download took it silently.

        Raises:
            StoreError: it is gzip-encoded (one line: upload it again without the encoding).
        """
        if "gzip" not in (encoding or "").lower():
            return
        stored = "" if size is None else f", {size} bytes"
        raise StoreError(
            f"{self.where(name)} is stored gzip-compressed (Content-Encoding: gzip{stored}) and "
            "served decompressed, while featbake reads an object as stored (its size, checks "
            "and byte ranges): upload it again without that encoding (not `gsutil cp -Z` or "
            "`gcloud storage cp --gzip-local`)"
        )

    @contextlib.contextmanager
    def pinned(self, name: str) -> Iterator[None]:
        """A context for the GET of the generation a read pinned (:meth:`_read_head`): that
        generation gone (404) is :class:`Transient`, read again from its metadata.

        The object was put again between the two requests: another node publishing the
        content-named shard it also holds (the same bytes, a new generation), a catalog's head
        rewritten. Before, such a read was FileNotFoundError for an object that was there. One
        deleted meanwhile is FileNotFoundError still, from the next try's metadata.
        """
        from google.api_core import exceptions as gx

        try:
            yield
        except gx.NotFound:
            raise PutAgain(f"{self.where(name)} was put again while it was read") from None

    def get_once(self, name: str, start: int = 0, length: int | None = None) -> ObjectBytes:
        info = self._read_head(name)
        blob = self.client.blob(self.key(name), generation=int(info.etag))
        end = None if length is None else start + length - 1
        if length is None:
            with self.pinned(name):
                data = blob.download_as_bytes(**self._media())
        elif start >= info.size:
            data = b""
        else:
            with self.pinned(name):
                data = blob.download_as_bytes(start=start, end=end, checksum=None, **self._media())
        if length is None:
            self.check_whole(name, len(data), info.size)
        return ObjectBytes(info, data)

    def download_once(self, name: str, dest: Path) -> int:
        blob = self.client.blob(self.key(name))
        with open(dest, "r+b" if dest.exists() else "wb") as f:
            # The library checks the whole's MD5/CRC32C unless it resumed a stalled body (a
            # 206 answer is not checked); the size and the pinned generation still are.
            blob.download_to_file(f, **self._media())
            size = f.tell()
            f.truncate(size)
        self.refuse_gzip(name, blob.content_encoding)  # as the answer says it is stored
        return size

    def stream_once(self, name: str, take: Callable[[bytes], object]) -> ObjectInfo:
        info = self._read_head(name)  # the GET gives no size and date: its metadata
        blob = self.client.blob(self.key(name), generation=int(info.etag))
        sink = ChunkSink(take)  # the library writes each chunk of the body as it comes
        # Its CRC32C is checked by the library unless a stalled body was resumed (a 206);
        # the size and the generation pinned by the HEAD hold either way.
        with self.pinned(name):
            blob.download_to_file(sink, **self._media())
        self.check_whole(name, sink.size, info.size)
        return info

    def put(self, name: str, src: Path, *, create: bool) -> None:
        blob = self.client.blob(self.key(name))
        condition = {"if_generation_match": 0} if create else {}
        blob.upload_from_filename(os.fspath(src), **condition, **self._options())

    def delete(self, objects: Iterable[str | ObjectInfo]) -> Sequence[str]:
        return [object_name(o) for o in objects if self._kept_from_delete(o)]

    def _kept_from_delete(self, deleted: str | ObjectInfo) -> bool:
        """Delete one object (given as seen: only that generation, ``ifGenerationMatch``);
        whether it was kept instead, another generation there now."""
        name = object_name(deleted)
        seen = {} if isinstance(deleted, str) else {"if_generation_match": int(deleted.etag)}
        try:
            with contextlib.suppress(Absent), self.errors(name):
                self.client.delete_blob(self.key(name), **seen, **self._options())
        except Exists:  # 412: another generation there now, or none (gone already)
            return self.head(name) is not None
        return False

    def translate(self, name: str, e: BaseException) -> None:
        import requests
        from google.api_core import exceptions as gx
        from google.auth import exceptions as ax
        from google.cloud.storage import exceptions as sx

        if isinstance(e, gx.RetryError) and isinstance(e.cause, Exception):
            self.translate(name, e.cause)  # what the last try met, after the library's tries
        if isinstance(e, ax.DefaultCredentialsError | ax.RefreshError | ax.TransportError):
            raise self.credentials_failed(name, e) from None
        if isinstance(e, gx.PreconditionFailed):
            raise Exists(name) from None
        if isinstance(e, gx.NotFound):
            if self.says_no_bucket(name, str(e.message)):
                raise self.no_bucket() from None
            raise Absent(name) from None
        if isinstance(e, gx.Forbidden | gx.Unauthorized):
            raise self.denied(
                name, f"{e.code}", "the Application Default Credentials and the bucket's IAM"
            ) from None
        unsent = self.unsent(name, e)
        if unsent is not None:
            raise unsent from None
        if read_stalled(e):
            # After the library's own tries (a stalled download resumed, each counted into
            # the read's 4): tried again whole, a read sent 16 requests for 4.
            raise self.unanswered(name, e) from None
        if isinstance(
            e,
            requests.exceptions.ChunkedEncodingError
            | sx.DataCorruption
            | ConnectionError,  # the library's own, for a body that ended short unnoticed
        ):
            raise Transient(str(e)) from e
        if isinstance(e, requests.exceptions.ConnectionError):
            raise self.unreachable(name, e) from None
        if isinstance(e, gx.GoogleAPICallError):
            raise StoreError(f"{self.where(name)}: {e.code}: {redact(str(e.message))}") from e
        raise e

    def unsent(self, name: str, e: BaseException) -> Exception | None:
        """The one line for a request that never reached the endpoint, None for another error:
        no connection in time, or a URL requests cannot send to (``InvalidSchema``,
        ``InvalidURL``, ``MissingSchema``: an endpoint :func:`gcs_emulator` let through), which
        was an internal error."""
        import requests

        if isinstance(e, requests.exceptions.ConnectTimeout):
            return self.no_connection(name)
        bad = requests.exceptions
        if isinstance(e, bad.InvalidSchema | bad.InvalidURL | bad.MissingSchema):
            return ConfigError(
                f"cannot send a request for {self.where(name)} to {self.endpoint_label()} "
                f"({redact(first_line(e))}); write STORAGE_EMULATOR_HOST as http://host:port"
            )
        return None

    def credentials_failed(self, name: str, e: BaseException) -> StoreError:
        """The one line for credentials that are not there or could not be refreshed: their
        token endpoint unreachable (an offline node) is said as such, not as storage's."""
        from google.auth import exceptions as ax

        if isinstance(e, ax.TransportError):
            return StoreError(
                f"cannot reach the token endpoint of the Application Default Credentials for "
                f"{self.where(name)} ({redact(first_line(e))}); check the network (an offline "
                "node needs STORAGE_EMULATOR_HOST or credentials it can refresh)"
            )
        return self.no_credentials()

    def says_no_bucket(self, name: str, message: str) -> bool:
        """Whether a 404 for ``name`` says the bucket is not there ("The specified bucket does
        not exist"), not the object ("No such object: <bucket>/<key>"): read in the service's
        message with the request's URL, the bucket's name and the object's key taken out,
        which may hold the word themselves (``gs://team-bucket/...``: every missing object was
        a missing bucket)."""
        if name.endswith("/") or not name:
            return True
        said = re.sub(r"\S+://\S+", "", message)  # the request's URL (``DELETE http://...:``)
        for part in (f"{self.url.bucket}/{self.key(name)}", self.key(name), self.url.bucket):
            said = said.replace(part, "")
        return "bucket" in said.lower()


# == azure =========================================================================================
# Azure Blob Storage through azure-storage-blob; ``az://container/prefix`` in the storage
# account the environment names.
#
# ``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's, or an account's from the portal), else
# ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_KEY``, else with azure-identity's
# ``DefaultAzureCredential`` (managed identity, ``az login``) when that package is installed.
# A create-only put is ``If-None-Match: *`` (``overwrite=False``); files above 64 MiB go up as
# blocks. A listing cannot start after a name (Azure has no StartAfter), so a page asked to
# start after one reads the listing from the prefix's start and passes over the names up to it.
#
# The SDK's downloader asks again for a body cut mid-download, 3 requests in all with a fixed
# 1 s wait, and has no setting for it; featbake's reads try again whole on a cut. So a read
# counts its requests at the client's request hook (:func:`azure_request_counted`): the same
# bytes are asked for :data:`DOWNLOAD_TRIES` times in all, as on s3 and gs, never 3 x 4.
def azure_request_counted(request: Any) -> None:
    """azure-storage-blob's ``raw_request_hook``, run before each request the client sends,
    its own retries included: within a read, count the request for its bytes (method, URL,
    range), and refuse the one past :data:`DOWNLOAD_TRIES` for the same (:func:`count_asked`)."""
    http = request.http_request
    headers = http.headers
    count_asked((http.method, http.url, headers.get("x-ms-range") or headers.get("Range") or ""))


def azure_cut_body(e: BaseException) -> BaseException | None:
    """The cut answer body that ``e`` is or wraps, None when it is none: an
    ``IncompleteReadError``, or the ``HttpResponseError`` (status None) azure-storage-blob's
    downloader raises after its own tries from one, or from a ``ServiceResponseError`` met
    mid-body. featbake reads such a body again whole (:meth:`ObjectStore._tried`)."""
    from azure.core import exceptions as zx

    if isinstance(e, zx.IncompleteReadError):
        return e
    cause = e.__cause__
    wrapped = isinstance(e, zx.HttpResponseError) and e.status_code is None
    if wrapped and isinstance(cause, zx.ServiceResponseError | zx.IncompleteReadError):
        return cause
    return None


def azure_error_code(e: BaseException) -> str:
    """The service's error code in ``e`` as the service spells it ("ConditionNotMet",
    "AuthorizationFailure"), "" when it gives none. azure-storage-blob hands most codes over as
    its ``StorageErrorCode`` enum, whose ``str()`` is the enum's own name
    ("StorageErrorCode.CONDITION_NOT_MET"): compared with the service's words it never matched,
    and messages showed the enum, not the code its documentation lists."""
    code = getattr(e, "error_code", None) or ""
    return str(getattr(code, "value", code))


def azure_retry(policy: type[Any]) -> Any:
    """The Azure client's retry policy: :data:`MAX_ATTEMPTS` requests, backing off 3, 5 and 9 s
    (1 + 2**n, +-1 s: the SDK counts the try before it waits), each wait times
    :func:`backoff_scale`. The SDK's default waits 15 s, then 18, 24 before its tries: a
    stalled endpoint would take a minute to become one line. ``policy``: the SDK's
    ``ExponentialRetry``."""
    scale = backoff_scale()

    class Scaled(policy):
        """The SDK's exponential policy, its waits scaled."""

        def get_backoff_time(self, settings: dict[str, Any]) -> float:
            return float(super().get_backoff_time(settings)) * scale

    return Scaled(
        initial_backoff=1, increment_base=2, retry_total=MAX_ATTEMPTS - 1, random_jitter_range=1
    )


@register("az")
class AzureObjects(ObjectStore):
    """``az://container/prefix`` through azure-storage-blob (see the section's comment)."""

    ENDPOINT_HINT = "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME"

    def connect(self) -> Any:
        try:
            from azure.storage.blob import BlobServiceClient, ExponentialRetry
        except ImportError:
            raise ConfigError(
                f"{self.url} is an Azure Blob store, which needs the azure extra: "
                "pip install 'featbake[azure]' (azure-storage-blob)"
            ) from None
        options: dict[str, Any] = {
            "connection_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": read_timeout(),
            "retry_policy": azure_retry(ExponentialRetry),
            "max_single_put_size": PART_BYTES,
            "max_block_size": 8 << 20,
            "max_single_get_size": AZURE_GET_BYTES,  # its memory: 9 x one GET's bytes
            "max_chunk_get_size": AZURE_GET_BYTES,
            "raw_request_hook": azure_request_counted,  # a read's tries, the SDK's included
        }
        env = os.environ
        connection = env.get("AZURE_STORAGE_CONNECTION_STRING", "")
        azure_connection_endpoint(env)  # ConfigError: a BlobEndpoint the SDK would misread
        account = "" if connection else azure_blob_endpoint(env)
        credential = None if connection else self._credential()
        try:
            if connection:
                service = BlobServiceClient.from_connection_string(connection, **options)
            else:
                service = BlobServiceClient(account, credential=credential, **options)
        except ValueError as e:
            raise ConfigError(
                f"cannot make an Azure Blob client for {self.url}: {redact(str(e))}; check "
                "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME)"
            ) from None
        return service.get_container_client(self.url.bucket)

    def _credential(self) -> Any:
        key = os.environ.get("AZURE_STORAGE_KEY")
        if key:
            return key
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise ConfigError(
                f"no credentials for {self.url}: set AZURE_STORAGE_CONNECTION_STRING, or "
                "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_KEY (or pip install "
                "azure-identity for DefaultAzureCredential)"
            ) from None
        return DefaultAzureCredential()

    def endpoint_label(self) -> str:
        try:
            return redact(azure_blob_endpoint(os.environ))
        except ConfigError:
            return "Azure (no AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME)"

    def tier_folder(self) -> str:
        return "az_" + endpoint_folder(azure_blob_endpoint(os.environ))

    def _info(self, props: Any, name: str, size: int | None = None) -> ObjectInfo:
        return ObjectInfo(
            name,
            int(props.size if size is None else size),
            props.last_modified.timestamp(),
            str(props.etag).strip('"'),
        )

    def list(self, prefix: str) -> list[ObjectInfo]:
        """The objects under ``prefix``, in name order: one listing paged by the service's own
        continuation tokens (Azure has no "start after": :meth:`list_page` lists from the
        prefix again and skips what sorts before, which costs pages squared, and where the
        service's order is not the names' code point order, as Azurite's UTF-16 order of a
        name with an emoji beside one with a character past U+E000, skipped a name at a page's
        edge)."""
        strip = len(self.key(""))
        with self.errors(prefix):
            items = self.client.list_blobs(
                name_starts_with=self.key(prefix), results_per_page=LIST_PAGE_KEYS
            )
            found = [self._info(item, item.name[strip:]) for item in items]
        return sorted(found, key=lambda o: o.name)

    def list_page(
        self, prefix: str, after: str = "", *, keys: int = LIST_PAGE_KEYS, delimiter: str = ""
    ) -> ListedPage:
        strip = len(self.key(""))
        start = self.key(after) if after else ""
        listed: list[tuple[str, Any]] = []  # (key, properties or None for a sub-folder)
        truncated = False
        with self.errors(prefix):
            container = self.client
            if delimiter:
                items = container.walk_blobs(
                    name_starts_with=self.key(prefix), delimiter=delimiter, results_per_page=keys
                )
            else:
                items = container.list_blobs(
                    name_starts_with=self.key(prefix), results_per_page=keys
                )
            for item in items:
                if item.name <= start:
                    continue
                if len(listed) == keys:
                    truncated = True
                    break
                folder = not hasattr(item, "last_modified")
                listed.append((item.name, None if folder else item))
        objects = [self._info(p, k[strip:]) for k, p in listed if p is not None]
        folders = [k[strip:] for k, p in listed if p is None]
        last = max([o.name for o in objects[-1:]] + folders[-1:], default="")
        return ListedPage(objects, last, truncated)

    def head(self, name: str) -> ObjectInfo | None:
        try:
            with self.errors(name):
                props = self.client.get_blob_client(self.key(name)).get_blob_properties()
        except Absent:
            return None
        return self._info(props, name)

    @contextlib.contextmanager
    def one_version(self, name: str) -> Iterator[None]:
        """A context for one read of object ``name`` in the downloader's GETs: a version put
        meanwhile is :class:`Transient`, read again whole from the start (:meth:`_tried`).

        The downloader asks its GETs after the first with ``If-Match`` the first's ETag, so an
        object put again mid-read is a 412 (``ConditionNotMet``), not bytes of two versions.
        featbake puts objects again on purpose: another node publishing the content-named shard
        it also holds (the same bytes, a new ETag), a catalog's head rewritten. A shard of more
        than one GET (:data:`AZURE_GET_BYTES`) failed its fetch there, where s3 (one GET) and
        gs (unpinned) served it.
        """
        from azure.core import exceptions as zx

        try:
            yield
        except zx.HttpResponseError as e:
            if e.status_code != 412 and azure_error_code(e) != "ConditionNotMet":
                raise
            raise PutAgain(f"{self.where(name)} was put again while it was read") from None

    def get_once(self, name: str, start: int = 0, length: int | None = None) -> ObjectBytes:
        blob = self.client.get_blob_client(self.key(name))
        with self.one_version(name):
            if length is None:
                got = blob.download_blob(max_concurrency=1)
            else:
                got = blob.download_blob(offset=start, length=length, max_concurrency=1)
            data = got.readall()
        self.check_whole(name, len(data), got.size)
        props = got.properties
        size = len(data) if length is None else content_range_size(props.content_range, len(data))
        return ObjectBytes(self._info(props, name, size), data)

    def download_once(self, name: str, dest: Path) -> int:
        blob = self.client.get_blob_client(self.key(name))
        with open(dest, "r+b" if dest.exists() else "wb") as f, self.one_version(name):
            got = blob.download_blob(max_concurrency=1)
            size = got.readinto(f)
            f.truncate(size)
        self.check_whole(name, size, got.size)
        return size

    def stream_once(self, name: str, take: Callable[[bytes], object]) -> ObjectInfo:
        # Handed out in the SDK's chunks, one GET of AZURE_GET_BYTES each: its downloader holds
        # several copies of each GET's bytes meanwhile (a 6 MiB object peaked at 37.8 MB under
        # tracemalloc; at 56.7 MB when it came in one GET, 226 MB for 24 MiB).
        blob = self.client.get_blob_client(self.key(name))
        sink = ChunkSink(take)
        with self.one_version(name):
            got = blob.download_blob(max_concurrency=1)
            for chunk in got.chunks():
                sink.write(chunk)
        self.check_whole(name, sink.size, got.size)
        return self._info(got.properties, name, sink.size)

    def put(self, name: str, src: Path, *, create: bool) -> None:
        blob = self.client.get_blob_client(self.key(name))
        with open(src, "rb") as f:
            blob.upload_blob(f, length=os.fstat(f.fileno()).st_size, overwrite=not create)

    def delete(self, objects: Iterable[str | ObjectInfo]) -> Sequence[str]:
        return [object_name(o) for o in objects if self._kept_from_delete(o)]

    def _kept_from_delete(self, deleted: str | ObjectInfo) -> bool:
        """Delete one blob (given as seen: only that ETag, ``If-Match``); whether it was kept
        instead, put again since."""
        from azure.core import MatchConditions

        name = object_name(deleted)
        seen: dict[str, Any] = {}
        if not isinstance(deleted, str):
            etag = f'"{deleted.etag}"'  # quoted, as the service gave it (ObjectInfo's is bare)
            seen = {"etag": etag, "match_condition": MatchConditions.IfNotModified}
        try:
            with contextlib.suppress(Absent), self.errors(name):
                self.client.delete_blob(self.key(name), **seen)
        except Exists:  # 412 ConditionNotMet: another ETag there now, or none (gone already)
            return self.head(name) is not None
        return False

    def translate(self, name: str, e: BaseException) -> None:
        from azure.core import exceptions as zx

        code = azure_error_code(e)
        if isinstance(e, zx.ResourceExistsError) or code in (
            "ConditionNotMet",
            "BlobAlreadyExists",
        ):
            # A create-only put's: 409, or 412 from a block list (the SDK makes that a
            # ResourceExistsError); a read's 412 is :meth:`one_version`'s.
            raise Exists(name) from None
        if isinstance(e, zx.ResourceNotFoundError):
            if code == "ContainerNotFound":
                raise self.no_bucket() from None
            raise Absent(name) from None
        if isinstance(e, zx.ClientAuthenticationError):
            raise self.denied(
                name,
                code or type(e).__name__,
                "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                "AZURE_STORAGE_KEY, and the container's access",
            ) from None
        if isinstance(e, zx.ServiceRequestTimeoutError):
            raise self.no_connection(name) from None
        if isinstance(e, zx.ServiceResponseError):
            # No answer (a timeout, a connection closed before the status line) after the
            # SDK's own tries: one line, not tried again whole, which would multiply them.
            raise self.unanswered(name, e) from None
        cut = azure_cut_body(e)
        if cut is not None:
            raise Transient(str(cut)) from cut
        if isinstance(e, ValueError) and "header" in str(e):
            # The SDK's downloader parsing an answer cut inside its head ("Required
            # Content-Range response header is missing or malformed."): a cut answer.
            raise Transient(f"an answer cut inside its head ({first_line(e)})") from e
        if isinstance(e, zx.ServiceRequestError):
            raise self.unreachable(name, e) from None
        if isinstance(e, zx.HttpResponseError):
            self._raise_response_error(name, e, code)
        raise e

    def _raise_response_error(self, name: str, e: Any, code: str) -> None:
        """Raise what an HTTP error answer means (``e``: the SDK's ``HttpResponseError``)."""
        if code == "InvalidRange" or e.status_code == 416:
            raise PastTheEnd(name) from None
        if e.status_code == 403:
            raise self.denied(name, code or "403", "the credentials") from None
        raise StoreError(
            f"{self.where(name)}: {code or e.status_code}: {redact(str(e.reason))}"
        ) from e
