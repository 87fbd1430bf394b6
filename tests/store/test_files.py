"""store.files: publish_file replaces a file whole or not at all; held scratch."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import featbake.store.files as files
from featbake.errors import StoreError
from featbake.store.files import holding, publish_file
from featbake.store.layout import Layout
from featbake.store.open import LocalPlace
from featbake.store.place import Held, held_folder, removed_leftover


def test_publish_file_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "roots" / "r.json"
    publish_file(final, lambda tmp: tmp.write_text("old"), tmp_dir=tmp_path / "tmp")
    assert final.read_text() == "old"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        publish_file(final, half_then_fail, tmp_dir=tmp_path / "tmp")
    assert final.read_text() == "old"  # never half a file
    assert not list((tmp_path / "tmp").iterdir())  # no temporary left behind


# -- round nine, upkeep (corrections): held scratch on NFS, across a fork, held twice -------------
# The Linux NFS client emulates ``flock`` with a process-owned whole-file POSIX lock (``lockf``):
# these tests patch ``fcntl.flock`` so, in the maker and in the sweep, as the review did.


def nfs_flock(fd: int, op: int) -> None:
    """``flock`` as the Linux NFS client runs it: a POSIX lock of the whole file (EBADF for a
    write lock on a read-only descriptor; dropped by any close of the file in the process)."""
    fcntl.lockf(fd, op)


#: A live process that holds scratch and waits for a line: ``file`` a publish_file whose write()
#: opens and closes the .part itself (as every caller's does), ``folder`` a held folder; each
#: made older than any grace period, so that only its lock keeps it. ``nfs``: under NFS's
#: ``flock`` (:func:`nfs_flock`). ``fork``: it forks a
#: child that lives on (a fork-mode DataLoader worker), and prints the child's pid once the child
#: runs (a child not scheduled yet has not let go of what it inherited, whatever the code).
_MAKER = """
import fcntl, os, sys
from pathlib import Path
import featbake.store.files as files
if "nfs" in sys.argv:
    files.fcntl.flock = lambda fd, op: fcntl.lockf(fd, op)
kind, where = sys.argv[1], Path(sys.argv[2])
def hold(tmp):
    if kind == "file":
        tmp.write_bytes(b"x" * 100)
    os.utime(tmp, (0, 0))
    ready, running = os.pipe()
    child = os.fork() if "fork" in sys.argv else 1
    if child == 0:
        os.write(running, b"x")  # its fork hooks have run: it is the child the test means
        sys.stdin.readline()
        os._exit(0)
    if child != 1:
        os.read(ready, 1)
    print(tmp, child, flush=True)
    sys.stdin.readline()
if kind == "file":
    files.publish_file(where / "final", hold, tmp_dir=where / "tmp")
else:
    with files.holding(where / "tmp" / "work-x", folder=True) as held:
        hold(held.path)
"""


def held_elsewhere(
    tmp_path: Path, kind: str, *extra: str
) -> tuple[subprocess.Popen[str], Path, int]:
    """A maker process holding scratch of ``kind``; its path, and its forked child's pid."""
    maker = subprocess.Popen(
        [sys.executable, "-c", _MAKER, kind, str(tmp_path), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    path, child = maker.stdout.readline().split()  # type: ignore[union-attr]
    return maker, Path(path), int(child)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_live_process_scratch_is_kept_by_a_sweep_on_nfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Round nine, upkeep (corrects up9.9): under NFS's flock the sweep's read-only descriptor
    got EBADF (read as "no locks") and publish_file's own open and close of its .part dropped
    the maker's lock, so a live maker's scratch older than the grace period was removed. The
    lock is an OFD lock now (owned by the open file, taken on descriptors open for writing; a
    folder's through its lock file): the sweep keeps both."""
    maker, path, _ = held_elsewhere(tmp_path, kind, "nfs")
    try:
        monkeypatch.setattr(files.fcntl, "flock", nfs_flock)
        weighed = held_folder(path) if kind == "folder" else Held(str(path), 100, 0.0)
        assert weighed is not None
        assert removed_leftover(weighed) is None
        assert path.exists()
    finally:
        maker.communicate("\n")


def test_a_forked_child_does_not_keep_a_killed_owners_leftover(tmp_path: Path) -> None:
    """Round nine, upkeep (corrects up9.9): a forked child (a fork-mode DataLoader worker)
    inherited the held descriptor, so after its owner was killed the sweep kept the leftover
    while the child lived. The child closes the parent's held descriptors at the fork."""
    maker, path, child = held_elsewhere(tmp_path, "folder", "fork")
    try:
        maker.kill()
        maker.wait()
        weighed = held_folder(path)
        assert weighed is not None
        assert removed_leftover(weighed) is not None  # the child lives on: it holds nothing
        assert not path.exists()
    finally:
        assert maker.stdin is not None
        maker.stdin.close()  # the child reads its end: it exits
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


#: A maker whose hold is being made when a fork happens (another thread's fork right after the
#: hold's lock is taken, before the hold is returned): the child lives on, the maker waits.
_FORKED_AT_THE_LOCK = """
import os, sys
from pathlib import Path
import featbake.store.files as files
real = files.lock_taken
def lock_taken(fd, **how):
    taken = real(fd, **how)
    ready, running = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(running, b"x")  # its fork hooks have run: it is the child the test means
        sys.stdin.readline()
        os._exit(0)
    os.read(ready, 1)
    lock_taken.child = child
    return taken
files.lock_taken = lock_taken
with files.holding(Path(sys.argv[1]) / "tmp" / "work-x", folder=True) as held:
    os.utime(held.path, (0, 0))
    print(held.path, lock_taken.child, flush=True)
    sys.stdin.readline()
"""


def test_a_child_forked_while_a_hold_is_made_does_not_keep_a_killed_owners_leftover(
    tmp_path: Path,
) -> None:
    """Round ten, holds (corrects up9.16): a forked child closed only the holds listed at the
    fork, listed after their lock was taken: a child forked in between (or while the sweep or
    ``held_now`` held a lock) kept it, so a killed owner's leftover was kept while the child
    lived. A lock descriptor is listed from its open, under a lock every fork holds."""
    maker = subprocess.Popen(
        [sys.executable, "-c", _FORKED_AT_THE_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None and maker.stdin is not None
    path_text, child_text = maker.stdout.readline().split()
    path, child = Path(path_text), int(child_text)
    try:
        maker.kill()
        maker.wait()
        weighed = held_folder(path)
        assert weighed is not None
        assert removed_leftover(weighed) is not None  # the child lives on: it holds nothing
    finally:
        maker.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)


def test_holding_one_path_twice_in_a_process_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Round nine, upkeep (corrects up9.9): a second hold of a path this process holds waited
    on its own lock for ever (two descriptors conflict). It is refused in one line."""
    path, outcome, done = tmp_path / "tmp" / "same.part", [], threading.Event()

    def twice() -> None:
        with holding(path):
            try:
                with holding(path):
                    outcome.append("held twice")
            except StoreError as e:
                outcome.append(str(e))
        done.set()

    threading.Thread(target=twice, daemon=True).start()
    assert done.wait(60), "the second hold waits on the first"
    assert outcome[0].startswith(f"{path} is already held by this process")
    assert "\n" not in outcome[0]
    assert not path.exists()


def test_a_place_lists_no_leftover_a_live_process_holds(tmp_path: Path) -> None:
    """Round nine, upkeep (corrects up9.10): ``Place.leftovers`` (stats, verify's note, gc's
    dry run) listed what a live process holds, which the sweep keeps. It leaves it out now;
    a killed process's leftover is still listed."""
    layout = Layout(tmp_path / "store").ensure()
    place = LocalPlace(layout)
    dead = layout.tmp / "dead.part"
    dead.write_bytes(b"x" * 10)  # nothing holds it: a killed process's
    with holding(layout.tmp / "live.part"), holding(layout.tmp / "work-y", folder=True):
        assert [Path(h.name).name for h in place.leftovers()] == ["dead.part"]
    assert [Path(h.name).name for h in place.leftovers()] == ["dead.part"]


@pytest.mark.parametrize("spelled", ["relative", "link"])
def test_a_held_file_spelled_another_way_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelled: str
) -> None:
    """Round ten, holds (corrects up9.17): a second hold was refused only for the path as
    spelled, so the same file by a relative path or through a link waited on this process's
    own lock for ever. It is refused by the file's identity."""
    path, outcome, done = tmp_path / "tmp" / "same.part", [], threading.Event()
    monkeypatch.chdir(tmp_path)
    other = Path("tmp/same.part") if spelled == "relative" else tmp_path / "link.part"

    def twice() -> None:
        with holding(path):
            if spelled == "link":
                other.symlink_to(path)
            try:
                with holding(other):
                    outcome.append("held twice")
            except StoreError as e:
                outcome.append(str(e))
        done.set()

    threading.Thread(target=twice, daemon=True).start()
    assert done.wait(60), "the second hold waits on the first"
    assert outcome[0].startswith(f"{other} is already held by this process")
    assert "\n" not in outcome[0]
    assert not path.exists()


# A CachedEncoder's write-back is sealed by a finalizer (weakref.finalize) when the wrapper is
# collected, which a garbage collection runs at whatever allocation it falls on. Here it falls
# inside opened_lock, at the hold's fstat of the file just opened (the patch point), where the
# registry's guard was held; the seal takes the store's write lock through opened_lock.
_COLLECTED_IN_OPENED_LOCK = """
import faulthandler, gc, os, sys, warnings
from pathlib import Path
import torch
from featbake.serve.cached_encoder import CachedEncoder
from featbake.store.files import opened_lock
from featbake.testing import TinyConvEncoder

faulthandler.dump_traceback_later(30, exit=True)  # a hang ends the run with its stack
warnings.simplefilter("ignore")
tmp = Path(sys.argv[1])
enc = TinyConvEncoder().eval()
for p in enc.parameters():
    p.requires_grad_(False)
ce = CachedEncoder(enc, cache=tmp / "store")
with torch.inference_mode():
    ce(torch.randn(2, 4000), ids=["a", "b"])  # pending in its write-back
gc.disable()  # collected only where the test says
loop = [ce]
loop.append(loop)  # the wrapper's last reference in a reference cycle
del ce, loop
real_fstat, armed = os.fstat, [True]

def fstat_collecting(fd):
    if armed:
        armed.clear()
        shards = lambda: len(list((tmp / "store").rglob("*.safetensors")))
        before = shards()
        gc.collect()  # runs the wrapper's finalizer here, in this thread
        print("sealed by the finalizer:", shards() - before, flush=True)
    return real_fstat(fd)

os.fstat = fstat_collecting
(tmp / "tmp").mkdir(parents=True, exist_ok=True)
opened_lock(str(tmp / "tmp" / "scratch"), os.O_RDWR | os.O_CREAT, hold=True).close()
print("done")
"""


def test_a_finalizer_run_by_gc_inside_opened_lock_does_not_hang_the_process(
    tmp_path: Path,
) -> None:
    """Round ten, holds (hd10.7): ``opened_lock`` held the registry's guard, a plain lock,
    while it ran Python; a garbage collection there ran a ``CachedEncoder``'s write-back
    finalizer, whose seal took the write lock through ``opened_lock`` in the same thread,
    which waited on the guard for ever. The registry has no guard now."""
    script = tmp_path / "gc_in_opened_lock.py"
    script.write_text(_COLLECTED_IN_OPENED_LOCK)
    repo = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "w")],
        env={**os.environ, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # old code: the stack of the hang
    assert done.stdout.split("\n")[:2] == ["sealed by the finalizer: 1", "done"], done.stdout


def test_a_hung_open_of_one_lock_file_keeps_no_other_hold_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round ten, holds (hd10.8): ``opened_lock`` opened (and ``LockFile.close`` closed) under
    the registry's guard, which every hold, named lock and fork of the process took: an open
    of a store's lock file that hangs (a hard NFS mount whose server is gone) kept a hold of a
    local scratch file, and any fork (a DataLoader worker), waiting for as long as it hung.
    Nothing waits on another file's open now."""
    from featbake.store.locks import locked

    hung = tmp_path / "remote" / "write.lock"  # the store's lock file on a mount that hangs
    hung.parent.mkdir()
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real_open = os.open

    def open_that_hangs(path: object, *args: object, **kwargs: object) -> int:
        if str(path) == str(hung):  # the mount's server is gone: the open waits for it
            entered.set()
            release.wait()
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_that_hangs)

    def take_hung() -> None:
        with locked(hung):
            pass

    def hold_local() -> None:
        with holding(tmp_path / "local" / "tmp" / "scratch"):
            done.set()

    a = threading.Thread(target=take_hung, daemon=True)
    a.start()
    assert entered.wait(60)
    b = threading.Thread(target=hold_local, daemon=True)
    b.start()
    try:
        assert done.wait(30), "a hold of a local file waited on another file's hung open"
    finally:
        release.set()
        a.join()
        b.join()
