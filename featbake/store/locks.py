"""The store's advisory write lock (writers share it, ``verify --repair`` takes it alone) over
:func:`locked`, the lock the tier's locks use too, taken by the store's one lock primitive
(:func:`featbake.store.files.lock_taken`, its errno rule for a filesystem without locks) as
``flock``, as every featbake before took it (:class:`~featbake.store.files.LockCall`)."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from featbake.errors import StoreError
from featbake.process import critical_section
from featbake.store.files import LockCall, LockFile, Taken, lock_taken, opened_lock
from featbake.store.layout import Layout

# A shard writer holds the lock *shared* while it seals a shard and commits its catalog rows; repair
# holds it *exclusive* for its whole scan-and-fix. Repair therefore never sees a shard file whose
# rows are about to be committed (and forgets them as "missing"), and a writer that seals while
# repair runs waits until repair has finished. The lock is ``flock`` (``files.lock_taken`` with
# ``LockCall.FLOCK``: an earlier featbake's process still excludes) on ``<store>/write.lock``:
# the kernel drops it when its holder dies, so a killed build never leaves the store locked.
#
# On shared filesystems: Linux emulates ``flock`` on NFS (and on CIFS since 5.5) with byte-range
# locks on the whole file, so it spans hosts where the server's locking works; Lustre mounted with
# ``-o flock`` spans hosts, ``localflock`` (and NFS ``local_lock``) only one node, and a Lustre
# mount with neither fails every ``flock`` with ENOSYS, as NFS without a lock daemon does with
# ENOLCK. There the lock is skipped rather than failing every write: it only keeps repair away
# from writers, and on a shared filesystem repair is run while nothing else uses the store.
# Shards themselves need no lock: each is written under a unique temporary name and renamed to
# its content name, which is atomic on every one of these filesystems.
#: How long repair waits for writers that are sealing a shard right now before it refuses.
EXCLUSIVE_WAIT_S = 10.0


def lock_path(layout: Layout) -> Path:
    """``<store>/write.lock``: the file writers and repair ``flock``."""
    return layout.root / "write.lock"


def open_lock_file(path: Path) -> LockFile | None:
    """A lock file's descriptor (created if missing), which a forked child closes
    (:func:`featbake.store.files.opened_lock`: a child that outlives the block never keeps the
    lock); None where it cannot be created or opened. Made as the umask allows (a group's
    store: each member's process must open it for writing, which ``flock`` on NFS needs, or it
    runs unlocked), as every store file is."""
    try:
        return opened_lock(path, os.O_RDWR | os.O_CREAT)
    except OSError:
        return None


@contextlib.contextmanager
def locked(path: Path, *, shared: bool = False, wait: float | None = None) -> Iterator[int | None]:
    """The lock of the file at ``path`` (created; :func:`featbake.store.files.lock_taken`),
    shared or alone, held for the block: the one lock of the store's write lock, the tier's
    budget, its downloads and its catalog.

    ``wait`` None blocks until the lock is free; a number tries for that many seconds, then
    raises :class:`TimeoutError`. The kernel drops the lock when its holder dies. A filesystem
    without locks (see above) is run unlocked; a file that cannot be created yields None (the
    caller decides whether that is an error).
    """
    with critical_section():  # a finalizer run here hands its seal over (featbake.process)
        lock = open_lock_file(path)
        if lock is None:
            yield None
            return
        try:
            _take(lock, path, shared=shared, wait=wait)
            yield lock.fd
        finally:
            lock.close()  # closing the descriptor releases the lock (a forked child's: nothing)


@contextlib.contextmanager
def alone(path: Path, says: str, category: type[Warning]) -> Iterator[None]:
    """Hold the lock of the file at ``path`` alone for the block (:func:`locked`), one run of
    a kind at a time (a merge, a gc); where another run holds it, warn once with ``says`` as a
    ``category`` warning that this one waits for it (a long run: a wait in silence looks like
    a hang), then wait for it. A file that cannot be created runs the block unlocked, as
    :func:`locked` does."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(locked(path, wait=0))
        except TimeoutError:
            # 4: this generator, contextlib's __enter__, the run taking the lock, its caller.
            warnings.warn(says, category, stacklevel=4)
            held.enter_context(locked(path))
        yield


def _take(lock: LockFile, path: Path, *, shared: bool, wait: float | None) -> None:
    """Take ``lock`` as :func:`locked` says (blocking, or trying for ``wait`` seconds)."""
    if wait is None:
        lock_taken(lock.fd, wait=True, shared=shared, call=LockCall.FLOCK)
        return
    deadline = time.monotonic() + wait
    while lock_taken(lock.fd, shared=shared, call=LockCall.FLOCK) is Taken.HELD:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path} is held by another process") from None
        time.sleep(0.05)


@contextlib.contextmanager
def shared_write_lock(layout: Layout) -> Iterator[None]:
    """Hold the store's lock shared (a writer sealing a shard); waits while repair runs.

    A store where the lock file cannot be created is not writable either: the write that follows
    fails with its own clear error, so this does not add one.
    """
    with locked(lock_path(layout), shared=True):
        yield


@contextlib.contextmanager
def exclusive_write_lock(layout: Layout, wait_s: float | None = None) -> Iterator[None]:
    """Hold the store's lock alone (``verify --repair``), or refuse if writers keep it.

    Raises:
        StoreError: a build, gc or a training loop's write-back is sealing shards into the store
            and did not stop within ``wait_s`` seconds (default :data:`EXCLUSIVE_WAIT_S`); or
            the lock file cannot be created.
    """
    wait = EXCLUSIVE_WAIT_S if wait_s is None else wait_s
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(locked(lock_path(layout), wait=wait))
        except TimeoutError:
            raise StoreError(
                f"a build, gc or write-back is writing shards into {layout.root}; run "
                "`featbake verify --repair` again once it has finished"
            ) from None
        if fd is None:
            raise StoreError(
                f"cannot create {lock_path(layout)}: the store is not writable, so it cannot be "
                "repaired; run `featbake verify` without --repair to check it"
            )
        yield
