"""The Ray hashing tasks a build runs on the cluster (:func:`digest_batch`, :func:`read_batch`),
in a module of their own that imports no torch.

Ray pickles a task's function by its module's name, and each worker process imports that module
before its first task: a hashing task defined in bake/ray_engine.py (which imports torch, the
build's pipeline and the encoders) paid torch's import, seconds of CPU, in every worker it ran
in, for work that reads and hashes bytes. Here it imports only what it runs: the byte hashing of
:mod:`featbake.encode.fingerprints`, the byte seam, and :mod:`featbake.bake.engine_wire`
(tests/bake/test_ray_tasks.py checks, in a fresh process, that importing this module and running
a task imports no torch). Tar shards and table files are read through their readings' classes
(``ContainerRead``: :mod:`featbake.encode.webdataset`, :mod:`featbake.encode.tables`), whose
modules, unpickled by the task, load torch only where a tensor is made, which a task never does.

The driver's side (which inputs go to tasks, how many a task, their results vouched for and
added up) stays in bake/ray_engine.py (:class:`~featbake.bake.ray_engine.ClusterDigests`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from featbake.bake.engine_wire import CarriedError, check_protocol
from featbake.encode.fingerprints import (
    ContainerAsk,
    ContainerDigested,
    ContainerRead,
    DigestAsk,
    Digested,
    digest_here,
    read_here,
)
from featbake.errors import ConfigError, FeatbakeError
from featbake.store.byteplace import bytes_at
from featbake.store.claims import this_host
from featbake.store.containers import stat_or_none
from featbake.store.hash_cache import FileStat

T = TypeVar("T")  # what a hashing task gives for each ask


@dataclass
class SeenHere:
    """How a hashing task on this host sees the files whose stats the
    driver took, on host ``driver_host``: the stat it checks its reads against.

    On the driver's own host a stat is taken whole (size, mtime, inode, ctime). On another
    host the same mount may show other inode numbers (and ctimes) for the same file (a FUSE or
    clustered file system numbering inodes per node), so a file there whose size and mtime_ns
    are the driver's is read checked against its stat here, whole (a file rewritten while it
    is read is refused by its inode and ctime here), and what was read is reported back at
    the driver's stat (:meth:`driver_stat`). That does not make it the version the driver
    stat'ed: a file rewritten in place with its mtime put back keeps size and mtime. The
    driver vouches for it by its own stat after the task returned
    (:func:`~featbake.bake.ray_engine.vouched`); an engine's worker there hashes what it
    decodes (:meth:`~featbake.bake.pipeline.PartEncoder.keyed_here`). A name that is no file
    here (an object) keeps the driver's stat.
    """

    driver_host: str
    #: this host's stat of a file -> the driver's stat of the same version
    back: dict[FileStat, FileStat] = field(default_factory=dict)
    #: file -> its stat here, taken once (a tar's members, a table's cells share their file's)
    here: dict[str, FileStat | None] = field(default_factory=dict)

    def stat(self, file: str, seen: FileStat) -> FileStat:
        """``file``'s stat here if it is the version the driver saw at ``seen``, else
        ``seen`` (the driver's host; a file changed, gone, or no file here)."""
        if self.driver_host == this_host():
            return seen
        if file not in self.here:
            self.here[file] = stat_or_none(file) if os.path.isabs(file) else None
        here = self.here[file]
        if here is None or (here.size, here.mtime_ns) != (seen.size, seen.mtime_ns):
            return seen
        self.back[here] = seen
        return here

    def driver_stat(self, stat: FileStat | None) -> FileStat | None:
        """The driver's stat of what this host read at ``stat`` (``stat`` itself if this host
        took no other for it)."""
        return stat if stat is None else self.back.get(stat, stat)


@dataclass(frozen=True)
class HashedBatch(Generic[T]):
    """What one hashing task returns: each input's :class:`Digested` (or each container's
    :class:`ContainerDigested`) it did, and the one-line error it raised after them, if any (a
    :class:`CarriedError`, raised again on the driver)."""

    digested: list[T] = field(default_factory=list)
    error: CarriedError | None = None

    def raise_error(self) -> None:
        """Raise the task's error as its own class, with its own line, if it had one."""
        if self.error is not None:
            self.error.raise_again()


def digest_batch(
    asks: list[DigestAsk], driver_host: str = "", protocol: int = 1
) -> HashedBatch[Digested]:
    """One hashing task (run by a Ray worker): ``asks`` (inputs of one place) read and hashed
    on the worker's threads, no bytes kept (the actors read their inputs themselves). Each
    read is checked against its file's stat as this host sees the version the driver stat'ed
    on ``driver_host`` (:class:`SeenHere`), and its digest returned at the driver's stat.
    ``protocol``: the driver's :data:`ENGINE_PROTOCOL` (a driver of the featbake before sent
    neither argument)."""
    if (refused := refused_protocol(protocol)) is not None:
        return refused
    seen = SeenHere(driver_host)
    here = [DigestAsk(a.path, seen.stat(a.path, a.stat)) for a in asks]
    return hashed_batch(
        lambda: (digested_as_driver(d, seen) for d in digest_here(bytes_at(asks[0].path), here))
    )


def digested_as_driver(done: Digested, seen: SeenHere) -> Digested:
    """``done`` with the stat it was read at as the driver's (see :class:`SeenHere`)."""
    if isinstance(done.got, str):
        return done
    stat = seen.driver_stat(done.got.stat)
    assert stat is not None  # a digest's stat is one
    return Digested(done.path, done.got._replace(stat=stat))


def read_batch(
    asks: list[ContainerAsk], driver_host: str = "", protocol: int = 1
) -> HashedBatch[ContainerDigested]:
    """One container-hashing task (run by a Ray worker): each of ``asks``' containers read
    by its :class:`ContainerRead` (a tar's listed members, a table file's cells), in order, no
    bytes kept; each reading checked against its container's stat as this host sees the
    version the driver listed or scanned on ``driver_host`` (:class:`SeenHere`), and its stat
    returned as the driver's. ``protocol``: as for :func:`digest_batch`."""
    if (refused := refused_protocol(protocol)) is not None:
        return refused
    seen = SeenHere(driver_host)
    here = [replace(a, read=reading_here(a.read, seen)) for a in asks]

    def as_driver(done: ContainerDigested) -> ContainerDigested:
        return replace(done, got=done.got._replace(stat=seen.driver_stat(done.got.stat)))

    return hashed_batch(lambda: map(as_driver, read_here(here)))


def reading_here(read: ContainerRead, seen: SeenHere) -> ContainerRead:
    """``read`` checked against its container's stat as this host sees it (the stat a tar's
    members were listed at, a table file's rows scanned at: the driver's)."""
    # Imported here: the task's unpickling of ``read`` imported its module, not both.
    from featbake.encode.tables import CellReading
    from featbake.encode.webdataset import MemberReading

    if isinstance(read, MemberReading) and read.listed_at is not None:
        return replace(read, listed_at=seen.stat(read.tar, read.listed_at))
    if isinstance(read, CellReading) and read.cell.scanned is not None:
        scanned = seen.stat(read.file.path, read.cell.scanned)
        return replace(read, cell=replace(read.cell, scanned=scanned))
    return read


def refused_protocol(protocol: int) -> HashedBatch[Any] | None:
    """A hashing task's answer to a driver of another featbake (:func:`check_protocol`'s
    line, carried back), or None for one of this featbake."""
    try:
        check_protocol(protocol, "the build's driver")
    except ConfigError as e:
        return HashedBatch([], CarriedError.of(e))
    return None


def hashed_batch(results: Callable[[], Iterable[T]]) -> HashedBatch[T]:
    """What a hashing task returns: every result ``results()`` gave, and the one-line error it
    raised after them, if any (a bucket's configuration, say: its line, not a traceback; the
    results before it are kept by the driver)."""
    done: list[T] = []
    try:
        for one in results():
            done.append(one)
    except FeatbakeError as e:
        return HashedBatch(done, CarriedError.of(e))
    return HashedBatch(done)
