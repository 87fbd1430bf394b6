"""`featbake build` runs in a child process, so a process that ends abruptly is still reported.

The encoder runs in the build's own process (it owns the GPU), and its code can end that process
in ways no ``try`` sees: ``os._exit(7)`` in ``forward`` skips every handler and ``finally``, and
the exit status 7 would read as featbake's documented "cache miss". So the command's process
only starts the build as a child and waits for it. The child reports through an inherited pipe
that it is leaving through featbake's own exit path (one line and a documented code); a child
that ends without that word was ended from outside featbake's control (``os._exit``, a signal,
the kernel's OOM killer), and this process says so in one line and exits with
:class:`featbake.errors.BuildProcessDied`'s code.

Signals: the child runs in its own process group. A SIGINT (a terminal's Ctrl-C reaches this
process) is passed on to the child's whole group, as a terminal would; SIGTERM and SIGHUP (what
torchrun, SLURM and docker send) to the child alone. If this process is SIGKILLed, the child is
killed with it (``PR_SET_PDEATHSIG`` on Linux), as an unsupervised build would be.
``FEATBAKE_NO_SUPERVISOR=1`` runs the build in this process (no report of an abrupt end).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NamedTuple

#: Set in the child: the file descriptor on which it reports a clean exit.
STATUS_FD_ENV = "FEATBAKE_STATUS_FD"
NO_SUPERVISOR_ENV = "FEATBAKE_NO_SUPERVISOR"
_PR_SET_PDEATHSIG = 1


def wants_supervisor(argv: Sequence[str]) -> bool:
    """True for a ``build`` command run from the shell, not already a supervised child."""
    if os.environ.get(STATUS_FD_ENV) or os.environ.get(NO_SUPERVISOR_ENV):
        return False
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] == "build" and not {"-h", "--help"} & set(argv)


def status_channel() -> int | None:
    """In a supervised child: the status pipe's descriptor, taken out of the environment.

    Taken out, so that processes this one starts (decode workers) never write to it.
    """
    fd = os.environ.pop(STATUS_FD_ENV, "")
    return int(fd) if fd.isdigit() else None


def report_clean_exit(fd: int) -> None:
    """Tell the supervisor featbake itself is ending the process (its one line is printed)."""
    with contextlib.suppress(OSError):
        os.write(fd, b"1")


class Outcome(NamedTuple):
    """How the supervised build ended: its exit ``code``, and whether that was abrupt."""

    code: int
    abrupt: bool


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_supervised(argv: Sequence[str]) -> Outcome:
    """Run ``featbake ARGV`` in a child and wait for it.

    Returns the child's own code when it left through featbake's exit path, ``128 + N`` when it
    died of a signal N passed on from here, else its status (negative: killed by a signal)
    marked abrupt.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # decode workers may hold the write end open past the end
    env = {**os.environ, STATUS_FD_ENV: str(write_end)}
    forwarded: list[int] = []
    child = subprocess.Popen(
        [sys.executable, "-m", "featbake", *argv],
        env=env,
        pass_fds=(write_end,),
        process_group=0 if os.name == "posix" else None,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    os.close(write_end)

    def forward(signum: int, _frame: FrameType | None) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            if signum == signal.SIGINT:
                os.killpg(child.pid, signum)  # what a terminal's Ctrl-C does to a group
            else:
                child.send_signal(signum)

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):  # no SIGHUP on Windows
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), forward)
    code = child.wait()
    try:
        clean = os.read(read_end, 1) == b"1"
    except BlockingIOError:
        clean = False
    os.close(read_end)
    if clean:
        return Outcome(code, False)
    if code < 0 and -code in forwarded:
        return Outcome(128 - code, False)
    return Outcome(code, True)


def abrupt_line(code: int) -> str:
    """The one line for a build process that ended without featbake's own exit."""
    return (
        "the build process ended abruptly, without featbake's own exit (an encoder or a library "
        "it calls ended the process, e.g. os._exit(), or the system killed it, e.g. out of "
        f"memory; {_status(code)}); every shard sealed before is kept: find the "
        "cause and rerun to continue"
    )


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"its exit status was {code}"
