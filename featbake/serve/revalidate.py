"""``revalidate=True``: serve a file's feature as the file is now, not as it was indexed.

A dataset maps each item to a key once, when it is made (:mod:`featbake.serve.index`); by
default a file rewritten later keeps its old feature for that item. With ``revalidate=True``
each read of an item first compares its file's stat (size, mtime_ns, inode, ctime_ns: one
``stat`` call) with the one its key was hashed at; when they differ the file is hashed again
(through the hash cache), the item is re-keyed in this process, and the read goes on as usual:
a hit when the store holds the new bytes' feature, else a miss under ``on_miss``. A file gone
since keeps serving its stored feature, as without ``revalidate``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from featbake.encode.fingerprints import hash_inputs
from featbake.encode.inputs import inputs_at
from featbake.errors import ConfigError
from featbake.serve.index import Index, raise_unreadable
from featbake.serve.state import ProcessState
from featbake.store.catalog import FileStat

__all__ = ["refuse_revalidate_of_objects", "revalidate"]


def revalidate(index: Index, st: ProcessState, idx: Iterable[int]) -> None:
    """Re-key every item of ``idx`` whose file changed since its key was hashed.

    Raises:
        SourceError: a changed file cannot be read now (its old feature is not served).
    """
    stats = index.stats
    for i in idx:
        path = index.path(i)
        try:
            now = FileStat.of(path)
        except OSError:
            continue  # gone: its stored feature is served, as when the dataset was made
        if now != tuple(stats[i]):
            _rekey(index, st, i, path)


def _rekey(index: Index, st: ProcessState, i: int, path: str) -> None:
    """Hash item ``i``'s file again, find its new key's feature, forget what was read of it."""
    hashed: dict[str, FileStat] = {}
    with st.catalogs.scoped() as catalog:
        digests, failed = hash_inputs(catalog, [path], stats=hashed)
        raise_unreadable([p for p in (path,) if p in failed], failed)
        key = index.spec.key(digests[path])
        locs = catalog.locate_many([key]).get(key) or []
    shards = {loc.shard for loc in locs}
    index.rekey(i, key, hashed[path], shards.pop() if len(shards) == 1 else None)
    st.forget(i)


def refuse_revalidate_of_objects(data: Any, revalidate: bool) -> None:
    """Raise when ``revalidate=True`` is asked of inputs a ``stat`` cannot revalidate.

    Raises:
        ConfigError: ``data`` is a bucket prefix: checking each object's ETag at every read
            would cost a request per item.
    """
    if not revalidate or not isinstance(data, str | os.PathLike):
        return
    inputs = inputs_at(data)
    if not inputs.stat_tells_change:
        raise ConfigError(
            f"revalidate=True is not built for inputs in a bucket ({inputs.where}): the dataset "
            "keys each object by the ETag it had when the dataset was made. Make a new dataset "
            "(or run `featbake build`) after objects change"
        )
