"""store.locks: the store's write lock (writers share it, repair holds it alone)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from featbake.errors import StoreError
from featbake.store import files
from featbake.store.layout import Layout
from featbake.store.locks import exclusive_write_lock, lock_path, locked, shared_write_lock
from featbake.store.shard import ShardWriter

# The store's write lock: writers share it, repair holds it alone (issue 11, item 10).

EFP, RFP = "e" * 64, "r" * 64


def test_writers_share_the_lock_and_repair_refuses_while_one_holds_it(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    with shared_write_lock(layout), shared_write_lock(layout):  # two writers at once
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="writing shards"), exclusive_write_lock(layout, 0.3):
            pass
        assert time.monotonic() - t0 >= 0.3  # it waited for the writers before refusing
    with exclusive_write_lock(layout, 0.3):  # released: repair gets it
        assert lock_path(layout).is_file()


def test_a_shard_writer_waits_while_repair_holds_the_lock(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "store").ensure()
    sealed: list[float] = []

    def write() -> None:
        with ShardWriter(layout, EFP, RFP, on_seal=lambda s: sealed.append(time.monotonic())) as w:
            w.add("k" * 64, {"": torch.ones(4)})

    with exclusive_write_lock(layout):
        t = threading.Thread(target=write)
        t.start()
        time.sleep(0.5)
        # Blocked before writing: repair never sees a shard file whose rows are not committed.
        assert not sealed and not list(layout.shards.glob("*/*.safetensors"))
        released = time.monotonic()
    t.join(10)
    assert len(sealed) == 1 and sealed[0] >= released
    assert len(list(layout.shards.glob("*/*.safetensors"))) == 1


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_filesystem_without_flock_does_not_stop_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """Lustre without -o flock fails every flock with ENOSYS, NFS without lockd with ENOLCK:
    shards are still sealed there (the lock only keeps repair away from writers)."""
    layout = Layout(tmp_path / "store").ensure()

    def no_locks(fd: int, **how: bool) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files, "lock_call", no_locks)
    sealed = []
    with ShardWriter(layout, EFP, RFP, on_seal=sealed.append) as w:
        w.add("k" * 64, {"": torch.ones(4)})
    assert len(sealed) == 1 and sealed[0].path.is_file()
    with exclusive_write_lock(layout, 0.1):  # repair: run alone there, as the docs say
        pass


def test_other_flock_failures_are_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    layout = Layout(tmp_path / "store").ensure()

    def broken(fd: int, **how: bool) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(files, "lock_call", broken)
    with pytest.raises(OSError, match="I/O error"), shared_write_lock(layout):
        pass


def test_a_writer_of_an_earlier_featbake_still_keeps_repair_away(tmp_path: Path) -> None:
    """The store's named locks stay ``flock``, as every featbake before took them: a writer of
    an earlier featbake still running on the store (its shared ``flock`` on ``write.lock``)
    keeps a new ``verify --repair`` away. On a local disk Linux's ``flock`` and OFD locks do
    not see each other: with the write lock taken as an OFD lock, repair went ahead beside the
    older writer and could forget the shard it was sealing."""
    import fcntl

    layout = Layout(tmp_path / "store").ensure()
    fd = os.open(lock_path(layout), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # an earlier featbake's writer sealing a shard
        with (
            pytest.raises(StoreError, match="is writing shards into"),
            exclusive_write_lock(layout, 0.1),
        ):
            pass
    finally:
        os.close(fd)
    with exclusive_write_lock(layout, 0.1):  # the writer gone: repair runs
        pass


def test_a_named_lock_let_go_by_its_owner_is_not_kept_by_its_forked_child(
    tmp_path: Path,
) -> None:
    """Round ten, holds (corrects up9.16): a child forked while a named lock was held (a
    fork-mode DataLoader worker started beside a write-back or a tier download) kept the
    ``flock``, which belongs to the open file it shares, after its parent's block ended: the
    next ``locked()`` of the file (``tier_locked`` waits for ever) waited on the child, and
    ``verify --repair`` was refused, for as long as the child lived. The child closes its copy
    at the fork, as it does a hold's."""
    path = tmp_path / "tier.lock"
    r, w = os.pipe()
    started_r, started_w = os.pipe()
    with locked(path) as fd:
        assert fd is not None
        pid = os.fork()
        if pid == 0:  # a worker that lives on (it never touches the lock)
            os.close(w)
            os.write(started_w, b"s")  # past the fork's hooks: it runs as a worker would
            os.read(r, 1)
            os._exit(0)
        os.close(started_w)
        assert os.read(started_r, 1) == b"s"
        os.close(started_r)
    os.close(r)
    try:
        with locked(path, wait=0) as again:  # TimeoutError: the child keeps the lock
            assert again is not None
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("reopened_by", ["proc", "name"])
def test_a_child_forked_between_a_lock_files_open_and_its_listing_does_not_keep_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reopened_by: str
) -> None:
    """Round ten, holds (hd10.8): a lock file is opened with no lock of the registry held (an
    open that hangs keeps nothing else waiting), so a fork may fall between the open and its
    listing: that child's copy of the open file is not closed at the fork. The file is then
    opened again, and its lock taken through the new open file, which no child shares: the
    lock let go is not kept by the child. ``name``: where there is no ``/proc/self/fd``."""
    if reopened_by == "name":
        monkeypatch.setattr(files, "_PROC_FDS", tmp_path / "no-proc")
    path = tmp_path / "tier.lock"
    r, w = os.pipe()
    started_r, started_w = os.pipe()
    real_open, children = os.open, []

    def open_then_fork(name: object, *args: object, **kwargs: object) -> int:
        fd = real_open(name, *args, **kwargs)  # type: ignore[arg-type]
        if str(name) == str(path) and not children:
            pid = os.fork()
            if pid == 0:  # a worker that lives on (it never touches the lock)
                os.close(w)
                os.write(started_w, b"s")
                os.read(r, 1)
                os._exit(0)
            children.append(pid)
        return fd

    monkeypatch.setattr(os, "open", open_then_fork)
    try:
        with locked(path) as fd:
            assert fd is not None and children
        os.close(started_w)
        assert os.read(started_r, 1) == b"s"
        os.close(started_r)
        monkeypatch.undo()
        with locked(path, wait=0) as again:  # TimeoutError: the child keeps the lock
            assert again is not None
    finally:
        os.close(r)
        os.write(w, b"x")
        os.close(w)
        for pid in children:
            os.waitpid(pid, 0)
