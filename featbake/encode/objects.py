"""Inputs in a bucket: the objects under ``s3://bucket/prefix/``, listed, hashed, decoded.

Its own module (beside :mod:`featbake.encode.inputs`, which re-exports it) so that kinds of
data that name objects one by one (a manifest's ``s3://`` rows, tar shards in a bucket) read
them with the same code, without importing the dispatch that imports them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import torch

from featbake.encode.fingerprints import HeldBytes
from featbake.encode.sources import ScanResult, Source
from featbake.errors import SourceError
from featbake.progress import Progress
from featbake.store.bucket import Bucket, ObjectBytes
from featbake.store.byteplace import HEAD_THREADS as HEAD_THREADS
from featbake.store.byteplace import LIST_PAGE_HEADS as LIST_PAGE_HEADS
from featbake.store.byteplace import FolderListing as FolderListing
from featbake.store.byteplace import common_prefix as common_prefix
from featbake.store.byteplace import head_or_why as head_or_why
from featbake.store.byteplace import just_before as just_before
from featbake.store.byteplace import object_at as object_at
from featbake.store.byteplace import read_object as read_object
from featbake.store.byteplace import stat_objects as stat_objects
from featbake.store.hash_cache import COARSE_RACY_FACTOR, RACY_NS, FileStat, HashCache, HashRow
from featbake.store.objects import ObjectInfo
from featbake.store.objects import object_stat as object_stat
from featbake.store.url import BucketURL
from featbake.threadpool import OBJECT_THREADS, map_in_threads

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
