"""The one thread pool every hashing loop uses (input files, bucket objects, the hash-cache
check), and how many threads hash at once (a leaf, no I/O of its own)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TypeVar

#: Threads that hash files at once: hashlib releases the GIL, and a few keep a disk (or an NFS
#: mount) busy; more only queue on it.
HASH_THREADS = 4
#: Threads that hash a bucket's objects at once: each waits mostly on its GET.
OBJECT_THREADS = 8

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def map_in_threads(
    fn: Callable[[_In], _Out], items: Collection[_In], threads: int = HASH_THREADS
) -> Iterator[_Out]:
    """``fn`` over ``items`` on up to ``threads`` threads, results in ``items``' order, each as
    soon as it and those before it are done: the one pool every hashing loop uses (input files,
    bucket objects, the hash-cache check). One item or one thread runs inline, with no pool.
    """
    if len(items) <= 1 or threads <= 1:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="featbake-hash") as pool:
        yield from pool.map(fn, items)
