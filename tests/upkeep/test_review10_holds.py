"""Review of up9.15-up9.19: locks a forked child keeps after its parent let them go."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from featbake.store.locks import locked
from featbake.store.place import held_folder, removed_leftover


def test_a_named_lock_let_go_by_its_owner_is_not_kept_by_its_forked_child(
    tmp_path: Path,
) -> None:
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


#: A maker whose hold is being made when a fork happens (another thread's fork right after the
#: hold's lock is taken, before the hold is returned): the child lives on, the maker waits.
_MAKER = """
import os, sys
from pathlib import Path
import featbake.store.files as files
real = files.lock_taken
def lock_taken(fd, **how):
    taken = real(fd, **how)
    child = os.fork()
    if child == 0:
        sys.stdin.readline()
        os._exit(0)
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
    maker = subprocess.Popen(
        [sys.executable, "-c", _MAKER, str(tmp_path)],
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
        assert removed_leftover(weighed) is not None  # kept: the child holds the lock
    finally:
        maker.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
