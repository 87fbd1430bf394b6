"""Fingerprints that read files: inputs (with the hash cache) and encoders (cached by file stat)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import BinaryIO

from featbake.encode.encoders import PICKLE, LoadedEncoder, detect_kind
from featbake.keys import sha256_file, sha256_hex
from featbake.progress import Progress
from featbake.store.hash_cache import ENCODER_FP_PREFIX, FileStat, HashCache, HashRow
from featbake.threadpool import map_in_threads

# == held ==========================================================================================
# Input bytes kept from hashing for decoding: a first build reads each input once.
#
# A first build hashed every input (for its key) and later decoded it from the file again: two
# reads of the data (issue 31 item 3). The bytes read for the digest are kept here, within a
# budget, and the decoder takes them (:class:`featbake.bake.threads.HeldSource`) instead of
# opening the file again. They are exactly the bytes the key was made from, so no file changed
# since can be stored under an old key; inputs past the budget are read twice, as before.
#: Bytes of inputs kept between hashing and decoding at most (inputs past it are read again).
HELD_BYTES = 256 << 20


class HeldBytes:
    """path -> the bytes hashed for its key, up to ``budget`` bytes in all (thread-safe).

    One bytes object may be kept under several paths (:meth:`share`: the segments of one
    object in a bucket); it is counted against the budget once, until its last path lets go.

    Example:
        >>> held = HeldBytes(budget=1 << 20)
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.bin"
        >>> _ = p.write_bytes(b"abc")
        >>> held.digest(str(p))[:8], held.take(str(p)), held.take(str(p))
        ('ba7816bf', b'abc', None)
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = HELD_BYTES if budget is None else budget
        self.size = 0
        self._data: dict[str, bytes] = {}
        self._users: dict[int, int] = {}  # id of a bytes object kept -> how many paths keep it
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def digest(self, path: str, expect: FileStat | None = None) -> str | None:
        """SHA-256 of the file at ``path``, its bytes kept when they fit in the budget.

        With ``expect``, only the file that stat names is read: None (nothing kept) when the
        file opened is another version, or changes while it is read (see :func:`digest_as`).

        Raises:
            OSError: the file cannot be read.
        """
        with open(path, "rb") as f:
            opened = FileStat.of(f.fileno())
            if expect is not None and opened != expect:
                return None
            with self._lock:
                fits = self.size + opened.size <= self.budget
                if fits:
                    self.size += opened.size  # reserved before reading: threads hash in parallel
            if not fits:
                return streamed_digest(f, expect)
            try:
                data = f.read()
                same = unchanged(f, expect)
            finally:
                with self._lock:
                    self.size -= opened.size  # the reservation becomes the bytes read, if kept
        if not same:
            return None
        with self._lock:
            self._put(path, data)
        return sha256_hex(data)

    def keep(self, path: str, data: bytes) -> bool:
        """Keep ``data``, the bytes just hashed for the input named ``path`` (a tar member, a
        table's cell, an object), if they fit in the budget; whether they were kept."""
        with self._lock:
            if self.size + len(data) > self.budget:
                return False
            self._put(path, data)
        return True

    def share(self, path: str, names: Collection[str]) -> None:
        """Keep the bytes kept for ``path`` under each of ``names`` instead (the rows that
        decode from one object), counted once; nothing if none were kept for ``path``."""
        with self._lock:
            data = self._data.get(path)
            if data is None:
                return
            for name in names:
                self._put(name, data)
            self._drop(path)

    def peek(self, path: str) -> bytes | None:
        """The bytes kept for ``path``, or None; still kept (a header read from them)."""
        with self._lock:
            return self._data.get(path)

    def take(self, path: str) -> bytes | None:
        """The bytes kept for ``path`` (given once, then dropped), or None."""
        with self._lock:
            data = self._data.get(path)
            if data is not None:
                self._drop(path)
            return data

    def keep_only(self, paths: Collection[str]) -> None:
        """Drop what was kept for inputs not in ``paths`` (stored already: never decoded)."""
        with self._lock:
            for path in [p for p in self._data if p not in paths]:
                self._drop(path)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._users.clear()
            self.size = 0

    def _put(self, path: str, data: bytes) -> None:
        """Keep ``data`` under ``path``, counting its bytes if no other path keeps it (the
        lock held)."""
        if path in self._data:
            self._drop(path)
        users = self._users.get(id(data), 0)
        if users == 0:
            self.size += len(data)
        self._users[id(data)] = users + 1
        self._data[path] = data

    def _drop(self, path: str) -> None:
        """Forget ``path``'s bytes, uncounting them when no other path keeps them (the lock
        held)."""
        data = self._data.pop(path)
        users = self._users.pop(id(data)) - 1
        if users:
            self._users[id(data)] = users
        else:
            self.size -= len(data)


# == fingerprints ==================================================================================
def file_fingerprint(path: str | os.PathLike[str] | int) -> str:
    """SHA-256 of a file's bytes (a path, or an open descriptor read from its position),
    streamed (never the whole file in memory)."""
    return sha256_file(path)


def unchanged(f: BinaryIO, expect: FileStat | None) -> bool:
    """Whether the file ``f`` has open still has the stat ``expect`` (always, without one)."""
    return expect is None or FileStat.of(f.fileno()) == expect


def streamed_digest(f: BinaryIO, expect: FileStat | None) -> str | None:
    """SHA-256 of the open file ``f`` from its position, streamed; None if it no longer has
    the stat ``expect`` once read (it changed while it was read)."""
    sha = file_fingerprint(f.fileno())
    return sha if unchanged(f, expect) else None


def digest_as(path: str, expect: FileStat) -> str | None:
    """SHA-256 of the file at ``path`` if it is the version ``expect`` names, unchanged while
    it is read (streamed), else None.

    A digest is recorded in the hash cache under the stat taken before it was read, so it
    must be that file's: the stat of the file opened is compared before and after the read
    (not the path's: a folder swapped for another version, whose files keep their stats,
    would pass a path's stat taken after as well as git's index would).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return streamed_digest(f, expect) if unchanged(f, expect) else None


def resolve_path(path: str | os.PathLike[str]) -> str:
    """The absolute, symlink-free form of a path, as stored in the catalog."""
    return str(Path(path).expanduser().resolve())


# -- planning --------------------------------------------------------------------------------
#: Why an input whose file was replaced or rewritten between its stat and its read fails.
CHANGED_WHILE_READ = (
    "changed while featbake was reading it (replaced or rewritten after it was stat'ed); "
    "rerun the build once it stops changing"
)


def hash_inputs(
    catalog: HashCache,
    paths: Sequence[str],
    progress: Callable[[Progress], None] | None = None,
    stats: dict[str, FileStat] | None = None,
    held: HeldBytes | None = None,
    hold: Collection[str] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """SHA-256 of each file, re-reading only files whose (size, mtime, ctime, inode) changed.

    A cached digest is trusted only if the file's stat equals the one it was hashed with, and
    the file had not changed within a second of that (a "racy" entry, see ``FileStat.racy``).

    Args:
        catalog: whose hash cache to consult and fill.
        paths: the files to hash.
        progress: called as hashing advances.
        stats: if given, filled with path -> the FileStat each digest belongs to, so a later
            reader can tell whether the file changed since (see :class:`DecodeDataset`).
        held: if given, keeps the bytes of the files read, for a build to decode them from
            (see :mod:`featbake.encode.fingerprints`).
        hold: with ``held``, the only paths whose bytes it keeps (None: all of them); the
            others are hashed streamed (a recording whose segments are decoded by seeking).

    Returns:
        (path -> sha256, path -> reason for files that could not be read)
    """
    stats = {} if stats is None else stats
    failed: dict[str, str] = {}
    stat_time = time.time_ns()  # before the stats: what a racy entry is measured against
    for p in paths:
        try:
            stats[p] = FileStat.of(p)
        except OSError as e:
            failed[p] = f"cannot stat: {e.strerror}"
    cached = catalog.cached_hashes(list(stats))
    digests = {
        p: cached[p].sha256 for p, st in stats.items() if p in cached and cached[p].stat == st
    }
    todo = [p for p in stats if p not in digests]
    done = len(digests)
    if progress:
        progress(Progress("hash", done, len(paths)))
    fresh: list[HashRow] = []

    def one(p: str) -> tuple[str, str | None, str | None]:
        try:
            if held is not None and (hold is None or p in hold):
                sha = held.digest(p, stats[p])
            else:
                sha = digest_as(p, stats[p])
        except OSError as e:
            return p, None, f"cannot read: {e.strerror}"
        return p, sha, None if sha else CHANGED_WHILE_READ

    for p, sha, err in map_in_threads(one, todo):
        done += 1
        if sha is None:
            failed[p] = err or "unreadable"
        else:
            digests[p] = sha
            fresh.append(HashRow(p, stats[p], sha))
        if progress and (done % 256 == 0 or done == len(paths)):
            progress(Progress("hash", done, len(paths)))
    catalog.put_hashes(fresh, recorded_ns=stat_time)
    return digests, failed


def encoder_cache_id(encoder: LoadedEncoder, weights: str | None) -> tuple[str, str] | None:
    """(hash-cache id, backing file) for an encoder whose fingerprint can be cached, else None.

    A TorchScript or .pt2 file holds its architecture and weights, so its fingerprint depends on
    the file alone. An import-path encoder's architecture lives in code, so its id includes the
    identity (its repr and code digest) beside the weights file. A pickle's class lives in code
    too: its id includes the identity beside the file, under an ``encoder-fp:pickle:`` prefix
    that :func:`cached_file_encoder_fp` never looks up (a pickle cannot be vouched for unloaded).
    """
    if weights is not None:
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(weights)}".encode())
        return f"{ENCODER_FP_PREFIX}import:{ident}", weights
    if encoder.kind == PICKLE and os.path.isfile(encoder.label):
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(encoder.label)}".encode())
        return f"{ENCODER_FP_PREFIX}pickle:{ident}", encoder.label
    if encoder.kind != "module" and os.path.isfile(encoder.label):
        return file_encoder_cache_id(encoder.label), encoder.label
    return None


def file_encoder_cache_id(path: str | os.PathLike[str]) -> str:
    """The hash-cache id under which a file encoder's fingerprint is remembered."""
    return f"{ENCODER_FP_PREFIX}file:{resolve_path(path)}"


def cached_file_encoder_fp(catalog: HashCache, path: str | os.PathLike[str]) -> str | None:
    """A file encoder's fingerprint without loading it, if the file is unchanged since last time.

    This lets a dataset map inputs to keys (and serve hits) without ever loading the encoder.
    Always None for a pickled module: its fingerprint depends on its class's source code too,
    which only loading it reveals (and the build never caches it under this file id).
    """
    if detect_kind(Path(path)) == PICKLE:
        return None  # also ignores file-id entries written before pickles were keyed by code
    ident = file_encoder_cache_id(path)
    hit = catalog.cached_hashes([ident]).get(ident)
    try:
        return hit.sha256 if hit and hit.stat == FileStat.of(path) else None
    except OSError:
        return None


def encoder_fingerprint(encoder: LoadedEncoder, catalog: HashCache, weights: str | None) -> str:
    """The encoder's fingerprint, cached in the hash cache against its file's stat.

    Hashing a large checkpoint's weights costs a full pass over them; an unchanged file (same
    size, mtime, ctime and inode, not changed within a second of hashing) reuses the last
    result, as input files do. The file's stat is the one taken before it was loaded
    (:attr:`LoadedEncoder.loaded_from`): a file changed since is another version, for which
    nothing is cached (the loaded module's own fingerprint is used).
    """
    cache = encoder_cache_id(encoder, weights)
    if cache is None:
        return encoder.fingerprint
    ident, backing = cache
    seen = encoder.loaded_from
    stat_time = time.time_ns() if seen is None else seen.taken_ns
    st = FileStat.of(backing)
    # The fingerprint is the loaded module's: it may stand for the file only if the file is
    # still the one loaded (a checkpoint renamed over during the load is another version).
    same = seen is None or seen.stat == st
    hit = catalog.cached_hashes([ident]).get(ident)
    if same and hit and hit.stat == st:
        encoder._fingerprint = hit.sha256
        return hit.sha256
    fp = encoder.fingerprint
    if same:
        catalog.put_hashes([HashRow(ident, st, fp)], recorded_ns=stat_time)
    return fp
