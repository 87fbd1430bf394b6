"""Reproductions of defects left in round ten's lock registry (hd10.*).

Each test is marked ``xfail(strict=True)``: it fails on the code as it is, for the reason named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A CachedEncoder's write-back is sealed by a finalizer (weakref.finalize) when the wrapper is
# collected; the garbage collector runs it at whatever allocation comes next, here one made
# inside opened_lock, under _LOCKS_GUARD. The seal takes the store's write lock through
# opened_lock, which takes the guard again in the same thread. Where the collection falls is
# steered by the gen-0 threshold (gc counts allocations); each try uses a new wrapper.
_SCRIPT = """
import faulthandler, gc, os, sys, warnings
from pathlib import Path
import torch
from featbake.serve.cached_encoder import CachedEncoder
from featbake.store.files import opened_lock
from featbake.testing import TinyConvEncoder

faulthandler.dump_traceback_later(60, exit=True)  # a hang ends the run with its stack
warnings.simplefilter("ignore")
tmp = Path(sys.argv[1])
enc = TinyConvEncoder().eval()
for p in enc.parameters():
    p.requires_grad_(False)
(tmp / "tmp").mkdir(parents=True, exist_ok=True)
for extra in range(10):
    ce = CachedEncoder(enc, cache=tmp / "store")
    with torch.inference_mode():
        ce(torch.randn(2, 4000), ids=[f"a{extra}", f"b{extra}"])  # pending in its write-back
    name, flags = str(tmp / "tmp" / f"scratch{extra}"), os.O_RDWR | os.O_CREAT
    gc.collect()
    loop = [ce]
    loop.append(loop)  # the wrapper's last reference in a young reference cycle
    del ce
    del loop
    gc.set_threshold(gc.get_count()[0] + extra)
    lock = opened_lock(name, flags, hold=True)
    gc.set_threshold(700)
    lock.close()
print("done")
"""


@pytest.mark.xfail(
    strict=True,
    reason="_LOCKS_GUARD is a plain Lock held while opened_lock allocates; a garbage collection "
    "there runs a CachedEncoder's write-back finalizer, whose seal takes a lock through "
    "opened_lock in the same thread: the process hangs for ever",
)
def test_a_finalizer_run_by_gc_inside_opened_lock_does_not_hang_the_process(
    tmp_path: Path,
) -> None:
    script = tmp_path / "gc_in_guard.py"
    script.write_text(_SCRIPT)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "w")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]


@pytest.mark.xfail(
    strict=True,
    reason="opened_lock opens (and LockFile.close closes) under _LOCKS_GUARD, which every hold, "
    "named lock and fork of the process takes: an open of a store's lock file that hangs (a "
    "hard NFS mount whose server is gone) keeps a hold of a local scratch file, and any fork "
    "(a DataLoader worker), waiting for as long as it hangs",
)
def test_a_hung_open_of_one_lock_file_keeps_no_other_hold_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from featbake.store.files import holding
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
