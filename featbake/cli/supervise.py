"""`featbake build` runs in a child process, so a process that ends abruptly is still reported.

The encoder runs in the build's own process (it owns the GPU), and its code can end that process
in ways no ``try`` sees: ``os._exit(7)`` in ``forward`` skips every handler and ``finally``, and
the exit status 7 would read as featbake's documented "cache miss". So the command's process
only starts the build as a child and waits for it. The child is forked, not a second Python
started: it goes on from where the command's process stands (nothing imported beyond the
standard library, no thread yet), so no interpreter starts twice and no module is imported
twice (a second interpreter and its imports were ~0.05 s of CPU in every build, a no-op rebuild
included; issue 31 item 4). The child reports through an inherited pipe
that it is leaving through featbake's own exit path (one line and a documented code); a child
that ends without that word was ended from outside featbake's control (``os._exit``, a signal,
the kernel's OOM killer), and this process says so in one line and exits with
:class:`featbake.errors.BuildProcessDied`'s code.

Signals: the child runs in its own process group. A SIGINT (a terminal's Ctrl-C reaches this
process) is passed on to the child's whole group, as a terminal would; SIGTERM and SIGHUP (what
torchrun, SLURM and docker send) to the child alone. If this process is SIGKILLed, the child is
killed with it (``PR_SET_PDEATHSIG`` on Linux), as an unsupervised build would be.
``FEATBAKE_NO_SUPERVISOR=1`` runs the build in this process (no report of an abrupt end).

The child is also where OpenMP's wait policy can still be chosen (torch is not loaded yet): on a
busy node its idle threads sleep rather than spin (see :mod:`featbake.cpu_share`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import NamedTuple, NoReturn

#: Set in the child: the file descriptor on which it reports a clean exit.
STATUS_FD_ENV = "FEATBAKE_STATUS_FD"
NO_SUPERVISOR_ENV = "FEATBAKE_NO_SUPERVISOR"
_PR_SET_PDEATHSIG = 1


def wants_supervisor(argv: Sequence[str]) -> bool:
    """True for a ``build`` command run from the shell, not already a supervised child.

    Only a process that may fork safely forks the build: one thread, torch not imported (a
    caller's CUDA cannot be used in a forked child, and a lock another thread held stays held
    there). ``featbake build`` from the shell always may; a program calling
    :func:`featbake.cli.main.main` from its threads runs the build in its own process.
    """
    if os.environ.get(STATUS_FD_ENV) or os.environ.get(NO_SUPERVISOR_ENV):
        return False
    if threading.active_count() > 1 or "torch" in sys.modules:
        return False
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] == "build" and not {"-h", "--help"} & set(argv)


def supervise_if_build(args: Sequence[str]) -> None:
    """For a build run from the shell: fork the watched child, which returns from here to run
    the command, while this process waits and exits with the child's code (an abrupt end
    reported in one line). Any other command returns at once. Imports nothing beyond the
    standard library unless the child ended abruptly."""
    if not wants_supervisor(args):
        return
    outcome = run_supervised()
    if outcome is None:
        return  # the forked child: run the build
    if outcome.abrupt:
        report_abrupt_end(outcome.code)
    sys.exit(outcome.code)


def report_abrupt_end(code: int) -> NoReturn:
    """Say in one line that the watched build ended abruptly (status ``code``), and exit."""
    from featbake.cli.app import red_line  # rich: only when there is something to say
    from featbake.errors import BuildProcessDied

    error = BuildProcessDied(abrupt_line(code))
    red_line("error", in_part(str(error)))
    sys.exit(error.exit_code)


def in_part(message: str, *, failed: bool = True) -> str:
    """``message`` naming this process's part, when a launcher started several.

    Under torchrun one failing rank ends them all, and torchrun's own report follows: the one
    featbake line must say which rank failed, and that what every rank sealed is kept.
    """
    from featbake.bake.ranks import rank_from_env
    from featbake.errors import FeatbakeError

    try:
        spec = rank_from_env(os.environ)
    except FeatbakeError:
        return message  # the launcher's variables are themselves the error being reported
    if not spec.sharded:
        return message
    return (
        f"rank {spec.rank} ({spec.describe()}){' failed' if failed else ''}: {message}; "
        "every shard the ranks sealed "
        "is kept: rerun the same command to continue"
    )


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


def exit_code_of(code: object) -> int:
    """The process exit status ``sys.exit(code)`` gives (a message is printed, status 1).

    Example:
        >>> exit_code_of(None), exit_code_of(3)
        (0, 3)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave_child(code: object) -> NoReturn:
    """End a supervised build child as ``sys.exit(code)`` would, less the interpreter's teardown.

    Everything a normal exit does that is observable is done here, in the same order: wait for
    threads that are not daemons (and let ``concurrent.futures`` pools stop), run the ``atexit``
    handlers (the clean-exit word to the supervisor, multiprocessing's child cleanup, logging),
    flush stdout and stderr. What is skipped is freeing every module: with torch loaded that
    took 0.4-0.9 s after the last handler, measured beside a no-op rebuild whose own work is
    0.05 s (issue 32 item 15). Only the child the supervisor started leaves this way: a process
    that called :func:`featbake.cli.main` itself gets its ``SystemExit``.
    """
    import multiprocessing  # loaded by torch already: the child only

    if multiprocessing.active_children():  # workers still up (held in a cycle): the usual way
        raise SystemExit(code)
    status = exit_code_of(code)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class Outcome(NamedTuple):
    """How the supervised build ended: its exit ``code``, and whether that was abrupt."""

    code: int
    abrupt: bool


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # the child only

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _become_child(parent: int, read_end: int, write_end: int) -> None:
    """In the forked child: its own process group, killed with its parent, the status pipe's
    write end named in the environment (where :func:`status_channel` finds it), and OpenMP's
    wait policy chosen for the node (:func:`featbake.cpu_share.choose_wait_policy`)."""
    os.close(read_end)
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent, which passes it on
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(128 + signal.SIGKILL)
    os.environ[STATUS_FD_ENV] = str(write_end)
    # Before torch loads its OpenMP runtime, which reads the wait policy once: on a busy node
    # the encoder's idle threads sleep instead of spinning (see featbake.cpu_share).
    from featbake.cpu_share import choose_wait_policy  # the child only

    choose_wait_policy(os.environ)


def run_supervised() -> Outcome | None:
    """Fork the build's child and, in this process, wait for it.

    Returns:
        None in the child, which goes on to run the command. In this process: the child's own
        code when it left through featbake's exit path, ``128 + N`` when it died of a signal N
        passed on from here, else its status (negative: killed by a signal) marked abrupt.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # decode workers may hold the write end open past the end
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered is written twice
    child = os.fork()
    if child == 0:
        _become_child(parent, read_end, write_end)
        return None
    with contextlib.suppress(OSError):  # the child's group exists before a Ctrl-C is passed on
        os.setpgid(child, child)  # (it does the same itself; whichever runs first)
    os.close(write_end)
    forwarded: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            if signum == signal.SIGINT:
                os.killpg(child, signum)  # what a terminal's Ctrl-C does to a group
            else:
                os.kill(child, signum)

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), forward)
    _, status = os.waitpid(child, 0)  # retried after a signal's handler (PEP 475)
    code = os.waitstatus_to_exitcode(status)
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
