"""Inputs in a bucket: the objects under ``s3://bucket/prefix/``, listed, hashed, decoded.

Its own module (beside :mod:`featbake.encode.inputs`, which re-exports it) so that kinds of
data that name objects one by one (a manifest's ``s3://`` rows, tar shards in a bucket) read
them with the same code, without importing the dispatch that imports them.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import io
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from featbake.encode.fingerprints import HeldBytes
from featbake.encode.sources import ScanResult, Source
from featbake.errors import SourceError, StoreError
from featbake.process import OBJECT_THREADS, map_in_threads
from featbake.progress import Progress
from featbake.store.bucket import (
    CLIENT_CONNECTIONS,
    LIST_PAGE_KEYS,
    Bucket,
    ListedPage,
    ObjectBytes,
    ObjectInfo,
)
from featbake.store.byteplace import object_at as object_at
from featbake.store.catalog import COARSE_RACY_FACTOR, RACY_NS, FileStat, HashCache, HashRow
from featbake.store.objects import object_stat as object_stat
from featbake.store.url import BucketURL

# == bucket_inputs =================================================================================
# Inputs in a bucket: ``--data s3://bucket/audio/`` listed, hashed once, decoded from bytes.
#
# The objects under the prefix with the source's extensions are the inputs, sorted by name
# (as a folder scan sorts its relative paths; names with a hidden part, ``.x/`` or ``.x``, are
# passed over as the scan passes hidden files). Each is named ``s3://bucket/audio/<rel>``.
#
# **Hash cache.** An object's entry is keyed by its URL and compared on (size, last change,
# ETag): :func:`object_stat` puts them in a :class:`FileStat`, the ETag as a number in the
# inode's place. An unchanged object (same listing) reuses its digest and is never read, so a
# rebuild downloads nothing for what the store already holds. A digest is recorded against the
# ETag of the very response whose bytes were hashed (not the listing's), so the pair cannot
# disagree; that is also why such rows are never "racy": git's rule guards a file rewritten
# within a timestamp tick without its stat changing, and an object's ETag changes with its bytes.
#
# **Decoding** reads each object whole into memory (one clip or image) and hands the bytes to the
# recipe's source (soundfile and Pillow read file objects): nothing is written to disk. The
# response's ETag must still be the one hashed, or the item fails as a file changed mid-build
# does (:func:`featbake.encode.sources.load_unchanged`).
#
# **One GET per new object** (issue 31 item 3). A build hands :meth:`BucketInputs.hash` its
# :class:`~featbake.encode.fingerprints.HeldBytes`: the bytes of the response that was hashed
# are kept there (within its budget) and decoded from there, so a first build GETs each new
# object once, and a rebuild none. The ETag check holds by construction for them: the bytes
# decoded ARE the hashed response's, whose ETag the digest was recorded against, so an object
# rewritten since cannot be stored under the old key. Objects past the budget are GET again
# to decode, and checked by that response's ETag as above.
#
# Credentials, endpoint and region come from the standard AWS environment (see
# :mod:`featbake.store.bucket`), whose errors (no credentials, no such bucket, access
# denied) are one line each.


def never_racy_ns(rows: Sequence[HashRow]) -> int:
    """When hash rows of objects are recorded as taken: a tick after the newest change.

    Git's racy rule guards a file rewritten within a timestamp tick without its stat changing;
    an object's stat holds its ETag, which changes with its bytes, so its rows are never racy
    (see the module's docstring).
    """
    newest = max((r.stat.mtime_ns for r in rows), default=0)
    return max(time.time_ns(), newest + RACY_NS * COARSE_RACY_FACTOR + 1)  # whole seconds


def _hidden(name: str) -> bool:
    return any(part.startswith(".") for part in name.split("/"))


class BucketInputs:
    """The objects under ``s3://bucket/prefix/`` as a build's inputs (an ``Inputs``)."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.listed: dict[str, ObjectInfo] = {}  # relative name -> the listing's info

    @classmethod
    def at(cls, where: str) -> BucketInputs:
        """The inputs under the URL ``where`` (``s3://bucket/prefix/``); nothing is read yet."""
        return cls(Bucket(BucketURL.parse(where)))

    @property
    def where(self) -> str:
        return str(self.bucket.url)

    @property
    def stat_tells_change(self) -> bool:
        return False  # an object's ETag needs a request per item: revalidate is refused

    def path(self, rel: str) -> str:
        return self.bucket.where(rel)

    def rel(self, path: str) -> str:
        return path[len(self.where) + 1 :]

    def size(self, rel: str) -> int:
        info = self.listed.get(rel)
        return info.size if info else 0

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The objects under the prefix with one of ``extensions``, sorted by name.

        Raises:
            SourceError: none (an empty or missing prefix, or objects of other kinds).
            StoreError: the bucket cannot be listed (no credentials, no such bucket, denied).
        """
        exts = tuple(e.lower() for e in extensions)
        listing = self.bucket.list("")
        self.listed = {
            o.name: o for o in listing if o.name.lower().endswith(exts) and not _hidden(o.name)
        }
        if not self.listed:
            found = f"{len(listing)} objects, none of them" if listing else "no objects, so no"
            raise SourceError(
                f"{found} input files ({', '.join(sorted(exts))}) under {self.where}/; check "
                "the URL (the prefix, e.g. s3://bucket/audio/), or pick the source kind with "
                "--source"
            )
        return ScanResult(sorted(self.listed), [])

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each object, reading only those whose (size, last change, ETag) the
        hash cache does not know. ``stats`` is filled with each digest's :func:`object_stat`;
        ``held``, if given, keeps the bytes read (within its budget) for the build to decode.

        Returns:
            (path -> sha256, path -> reason for objects that could not be read)
        """
        stats = {} if stats is None else stats
        for p in paths:
            stats[p] = object_stat(self.listed[self.rel(p)])
        cached = catalog.cached_hashes(list(paths))
        digests = {p: e.sha256 for p in paths if (e := cached.get(p)) and e.stat == stats[p]}
        todo = [p for p in paths if p not in digests]
        failed: dict[str, str] = {}
        fresh: list[HashRow] = []
        if progress:
            progress(Progress("hash", len(digests), len(paths)))
        digest = functools.partial(self._digest, held=held)
        for p, got in zip(todo, map_in_threads(digest, todo, OBJECT_THREADS), strict=True):
            if isinstance(got, str):
                failed[p] = got
            else:
                stats[p], digests[p] = got
                fresh.append(HashRow(p, *got))
                done = len(digests) + len(failed)
                if progress and (done % 256 == 0 or done == len(paths)):
                    progress(Progress("hash", done, len(paths)))
        catalog.put_hashes(fresh, recorded_ns=never_racy_ns(fresh))
        return digests, failed

    def _digest(self, path: str, held: HeldBytes | None = None) -> tuple[FileStat, str] | str:
        """(stat, SHA-256) of the bytes one GET returned, or why the object cannot be read;
        those bytes kept in ``held`` under ``path`` if they fit."""
        got = read_object(self.bucket, self.rel(path))
        if isinstance(got, str):
            return got
        if held is not None:
            held.keep(path, got.data)  # the very bytes hashed below: see the module's comment
        return object_stat(got.info), hashlib.sha256(got.data).hexdigest()

    def source(self, inner: Source) -> Source:
        return ObjectSource(inner, self.bucket)

    def row(self, rel: str) -> dict[str, Any]:
        return {}


def read_object(bucket: Bucket, rel: str) -> ObjectBytes | str:
    """Object ``rel``, whole, or why it cannot be read (gone, or the bucket's one line)."""
    try:
        return bucket.read(rel)
    except FileNotFoundError:
        return "object not found (deleted since the listing?)"
    except StoreError as e:
        return str(e)


class ObjectSource:
    """The recipe's source over a bucket's objects: each read whole, decoded from its bytes.

    Pickled into decode workers by its bucket's URL: each process makes its own client.
    """

    def __init__(self, inner: Source, bucket: Bucket) -> None:
        self.inner = inner
        self.bucket = bucket
        self.kind = inner.kind
        self.extensions = inner.extensions

    def _read(self, path: str | os.PathLike[str]) -> ObjectBytes:
        got = read_object(self.bucket, os.fspath(path)[len(str(self.bucket.url)) + 1 :])
        if isinstance(got, str):
            raise SourceError(f"{path}: {got}")
        return got

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read object ``path`` (an ``s3://`` URL under the bucket) and decode its bytes.

        Raises:
            SourceError: it is gone, cannot be read, or cannot be decoded.
        """
        return self.inner.load(path, io.BytesIO(self._read(path).data) if data is None else data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode object ``path`` if the response carrying its bytes has the stat (ETag, size,
        last change) its digest was taken with.

        Raises:
            SourceError: it changed since it was hashed, is gone, or cannot be decoded.
        """
        got = self._read(path)
        if stat is None or object_stat(got.info) != stat:
            raise SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        return self.inner.load(path, io.BytesIO(got.data))


# == object_stats ==================================================================================
# The stat of objects named one by one (a manifest's ``s3://`` rows), what the hash cache compares
# (:func:`object_stat`), in as few requests as a folder's layout allows, without knowing how many
# objects a folder holds.
#
# **Per folder** (the names' common folder), the choice is one LIST page per up to
# :data:`~featbake.store.bucket.LIST_PAGE_KEYS` names (a page names each object's size, last
# change and ETag, as a HEAD does) or a HEAD per name. A folder whose rows name most of it is
# listed (a 100,000-row rebuild: 100 LISTs, not 100,000 HEADs); two rows in a folder of a million
# objects are two HEADs, not a thousand pages. The rule, a ski-rental one:
#
# * a folder with fewer than :data:`LIST_PAGE_HEADS` names is HEADed: one page could save no more
#   HEADs than its own price (AWS bills a LIST as 12.5 HEADs; a page of 1,000 entries is ~250 KB
#   of XML to move and parse, and the next page waits for it);
# * else it is listed page by page, each page from its names' longest common prefix (``a/clip0``,
#   not only ``a/``; ``/`` as the delimiter, so a sub-folder is one entry) and starting just
#   before the first name not yet settled (``StartAfter``: a stretch of the folder no row names
#   is jumped over, not paged through), and a name the page's range passed without showing is
#   HEADed (gone, most likely: its HEAD fails it as before);
# * listing stops, and the names left are HEADed, once the pages spent cost a page more (in HEADs,
#   at :data:`LIST_PAGE_HEADS` a page) than the HEADs they saved.
#
# **Worst case**, for a folder of ``n`` names: the listing stops before its pages cost two pages
# more than the HEADs they saved, so the requests are at most ``n + 1`` (a HEAD each: ``n``) and
# their price at most two pages over ``n`` HEADs; in the best case (the rows name the folder's
# objects) ``ceil(n / 1000)`` LISTs and no HEAD. A LIST the bucket refuses (a policy granting
# ``s3:GetObject`` without ``s3:ListBucket``) or that fails turns the bucket's names left to HEADs.
#
# The HEADs (of every folder) run :data:`HEAD_THREADS` at once, and the folders' listings as
# many, through the one pool every hashing loop uses (:func:`featbake.process.map_in_threads`)
# and one client per bucket (boto3's clients are thread-safe; making one costs ~0.1 s, so not one
# per folder).

#: What one LIST page costs, counted in HEADs (see above): a folder with fewer names is HEADed.
LIST_PAGE_HEADS = 12
#: HEADs (and folder listings) in flight at once: each waits mostly on its round trip.
HEAD_THREADS = CLIENT_CONNECTIONS


def just_before(name: str) -> str:
    """A name that sorts before ``name`` with (almost) nothing between: its last character one
    lower (S3 sorts keys by their UTF-8 bytes, which is code-point order), or dropped where one
    lower is no character. Between the two lie only names that start with the result and go on
    (``a/clip7.wau...``): they cost their place in a page, and ``name`` itself sorts after it.

    Example:
        >>> just_before("a/clip7.wav")
        'a/clip7.wau'
    """
    if not name:
        return ""
    last = ord(name[-1]) - 1
    if last < 0 or 0xD800 <= last <= 0xDFFF:
        return name[:-1]
    return name[:-1] + chr(last)


def common_prefix(a: str, b: str) -> str:
    """The longest start ``a`` and ``b`` share, character by character (not by path part: a
    listing's prefix narrows to ``a/clip0``, not only ``a/``).

    Example:
        >>> common_prefix("a/clip0017.wav", "a/clip0423.wav")
        'a/clip0'
    """
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


@dataclass
class FolderListing:
    """One folder's names, settled by listing it page by page while that pays (see the
    section's comment): ``found`` from pages, ``passed`` (a page's range went past them and
    did not show them) and ``todo`` (not reached) left for HEADs.

    Args:
        bucket: the bucket, names relative to it.
        todo: the folder's names, sorted, none settled yet.
        refused: set once a listing of this bucket failed: no folder lists again.
    """

    bucket: Bucket
    todo: list[str]
    refused: threading.Event
    found: dict[str, ObjectInfo] = field(default_factory=dict)
    passed: list[str] = field(default_factory=list)
    pages: int = 0
    last: str = ""

    def pays(self) -> bool:
        """Whether to list one more page: names are left, listing is not refused, and the pages
        so far cost (in HEADs) less than a page more than the HEADs they saved."""
        spent = self.pages * LIST_PAGE_HEADS - len(self.found)
        return bool(self.todo) and not self.refused.is_set() and spent < LIST_PAGE_HEADS

    def run(self) -> FolderListing:
        """List pages while :meth:`pays`; itself, with what they settled."""
        if len(self.todo) < LIST_PAGE_HEADS:
            return self  # a page could not save its own price: all HEADs
        while self.pays():
            prefix = common_prefix(self.todo[0], self.todo[-1])  # sorted: theirs is all's
            after = max(self.last, just_before(self.todo[0]))
            try:
                page = self.bucket.list_page(prefix, after, keys=LIST_PAGE_KEYS, delimiter="/")
            except StoreError:
                self.refused.set()  # denied or failing: the names left are HEADed, as before
                return self
            self.pages += 1
            self.settle(page)
        return self

    def settle(self, page: ListedPage) -> None:
        """The names ``page`` covers (up to its last name, or all when nothing follows it):
        found where it shows them, passed where not."""
        shown = {o.name: o for o in page.objects}
        end = bisect.bisect_right(self.todo, page.last) if page.truncated else len(self.todo)
        for name in self.todo[:end]:
            if name in shown:
                self.found[name] = shown[name]
            else:
                self.passed.append(name)
        del self.todo[:end]
        self.last = max(self.last, page.last)

    @property
    def unsettled(self) -> list[str]:
        """The names a HEAD settles: passed by a page, or not reached."""
        return [*self.passed, *self.todo]


def head_or_why(bucket: Bucket, name: str) -> ObjectInfo | str:
    """Object ``name``'s HEAD, or why there is none (not found, or the bucket's one line)."""
    try:
        info = bucket.head(name)
    except StoreError as e:
        return str(e)
    return "object not found" if info is None else info


def stat_objects(bucket: Bucket, names: Sequence[str]) -> dict[str, ObjectInfo | str]:
    """Each named object's size, last change and ETag (from a LIST page or a HEAD: the same
    :func:`object_stat` either way), or why it cannot be read, in the fewest requests the
    section's rule finds (its comment states the worst case).

    Example:
        >>> stat_objects(Bucket(BucketURL.parse("s3://team")), ["a/x.wav"])  # doctest: +SKIP
        {'a/x.wav': ObjectInfo(name='a/x.wav', size=32044, modified=..., etag='9b2c...')}
    """
    folders: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        folders.setdefault(name.rpartition("/")[0], []).append(name)
    refused = threading.Event()
    listings = [FolderListing(bucket, group, refused) for group in folders.values()]
    out: dict[str, ObjectInfo | str] = {}
    heads: list[str] = []
    for done in map_in_threads(FolderListing.run, listings, HEAD_THREADS):
        out.update(done.found)
        heads += done.unsettled
    head = functools.partial(head_or_why, bucket)
    out.update(zip(heads, map_in_threads(head, heads, HEAD_THREADS), strict=True))
    return out
