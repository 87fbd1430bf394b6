"""Decode workers: files -> preprocessed tensors; a bad file becomes an error record."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import multiprocessing
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from featbake.encode.held import HeldBytes
from featbake.encode.sources import Source, load_unchanged
from featbake.errors import SourceError
from featbake.store.catalog import FileStat

#: Inputs decoded ahead of the encoder when there are no decode workers (on a thread).
AHEAD = 4


# -- inputs read once ------------------------------------------------------------------------
class HeldSource:
    """``inner`` decoding each input from the bytes kept when it was hashed, if any.

    Those bytes are the ones its key was made from, so they need no check that the file is
    unchanged; an input without kept bytes is read from its file and checked as before
    (:func:`featbake.encode.sources.load_unchanged`). See :mod:`featbake.encode.held`.
    """

    def __init__(self, inner: Source, held: HeldBytes) -> None:
        self.inner = inner
        self.held = held
        self.kind = getattr(inner, "kind", "")
        self.extensions = inner.extensions

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        return self.inner.load(path, data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        data = self.held.take(path)
        if data is None:
            return load_unchanged(self.inner, path, stat)
        return self.inner.load(path, io.BytesIO(data))


# -- decoding in workers ---------------------------------------------------------------------
class DecodeDataset(Dataset):
    """Item i -> (i, tensor) or (i, reason) so one bad file cannot stop a worker.

    The key was computed from the bytes hashed earlier; a file rewritten since would put its new
    features under the old bytes' key (served to every copy of the old file). So an input that
    no longer matches the stat its digest belongs to fails instead (see
    :func:`featbake.encode.sources.load_unchanged`: a file is stat'ed again after decoding, an
    object checked by the response that carried its bytes).
    """

    def __init__(
        self, paths: Sequence[str], source: Source, stats: Sequence[FileStat | None]
    ) -> None:
        self.paths = list(paths)
        self.source = source
        self.stats = list(stats)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | str]:
        try:
            return i, load_unchanged(self.source, self.paths[i], self.stats[i])
        except SourceError as e:
            return i, str(e)
        except Exception as e:
            return i, f"{self.paths[i]}: {type(e).__name__}: {e}"


def init_worker(_worker_id: int, parent_pid: int | None = None) -> None:
    """Set up a decode worker: one torch thread, Ctrl-C and SIGTERM left to the main process,
    and death with its parent.

    A build killed with SIGKILL cannot shut its workers down; torch's watchdog then ends the
    worker loop, but the worker's exit joins a queue feeder blocked on a full pipe that nobody
    reads any more, and the worker (with its decoded clips) stays forever. On Linux the kernel
    kills the worker when the build dies (``PR_SET_PDEATHSIG``).
    """
    die_with_parent(parent_pid)
    # A worker decodes one clip at a time: its own torch thread pool would only compete with
    # the encoder's threads (see featbake.cpus.bake_threads).
    torch.set_num_threads(1)
    # A terminal's Ctrl-C and SLURM's SIGTERM reach every process of the job: workers must
    # leave them to the main process, which stops at a safe point and shuts them down (see
    # interrupt_at_safe_points); if it dies instead, PR_SET_PDEATHSIG ends them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before the request took effect


def _as_is(item: Any) -> Any:
    return item


class _ArrayDataset(Dataset):
    """``DecodeDataset`` whose tensors travel as numpy arrays: pickled through the worker's pipe.

    A tensor crossing a process boundary goes through a file in ``/dev/shm``; when that is full
    (Docker's 64 MB default) or ``ulimit -f`` caps file sizes, the worker's feeder thread fails
    after the item left the queue, and the main process waits for it forever. A pipe has
    neither limit.
    """

    def __init__(self, ds: DecodeDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        j, x = self.ds[i]
        return j, (x.numpy() if isinstance(x, torch.Tensor) else x)


def decoded_items(
    paths: Sequence[str], source: Source, workers: int, stats: Sequence[FileStat | None]
) -> Iterator[tuple[int, Any]]:
    """(index, tensor) for each path, or (index, reason) for one that cannot be decoded.

    Without decode workers (``workers=0``, the default on 2 CPUs beside a CPU encoder) the
    inputs are decoded on one thread, :data:`AHEAD` ahead of the encoder: the decoders release
    the GIL, so decoding overlaps encoding as it cannot in the loop a user would write (a
    FrameLSTM build measured 1.18-1.21x that loop before, 1.05-1.14x after, quiet runs).

    Raises:
        SourceError: a decode worker died (killed by the OOM killer, or by hand).
    """
    ds = DecodeDataset(paths, source, stats)
    if workers == 0 or len(paths) < 2:
        yield from _decoded_ahead(ds)
        return
    loader = DataLoader(
        _ArrayDataset(ds),
        batch_size=None,
        collate_fn=_as_is,
        num_workers=min(workers, len(paths)),
        prefetch_factor=8,
        persistent_workers=False,
        worker_init_fn=functools.partial(init_worker, parent_pid=os.getpid()),
    )
    with _WorkerWatch() as watch:
        try:
            for i, x in loader:
                watch.arm()
                yield i, (torch.from_numpy(x) if isinstance(x, np.ndarray) else x)
        except RuntimeError as e:
            raise (worker_death(e) or e) from None


def worker_death(e: BaseException) -> SourceError | None:
    """The clear error for torch's "DataLoader worker ... killed" RuntimeError, else None.

    torch raises it from a SIGCHLD handler, so it can surface anywhere in the main thread.
    """
    text = str(e)
    if not isinstance(e, RuntimeError) or not text.startswith("DataLoader worker"):
        return None
    return worker_died(text.splitlines()[0].rstrip(". "))


def worker_died(what: str) -> SourceError:
    return SourceError(
        f"a decode worker died ({what}): the OOM killer ends a worker that runs out of "
        "memory. Rerun with fewer --workers (or --workers 0) or a smaller --max-seconds; "
        "everything sealed so far is kept"
    )


class _WorkerWatch:
    """Ends any wait on a dead decode worker within a fraction of a second.

    A worker killed while writing a result leaves half a message in its pipe: the main
    process then blocks reading the rest, forever, and torch's own SIGCHLD check may have
    fired elsewhere (or in another thread). This thread polls the workers and, when one has
    died, raises :class:`SourceError` in the main thread through a signal that interrupts
    the blocked read. Outside the main thread it does nothing.
    """

    POLL_S = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self.dead: str | None = None

    def __enter__(self) -> _WorkerWatch:
        return self

    def arm(self) -> None:
        """Start watching (after the first item: the workers exist by then)."""
        if self._thread is not None or threading.current_thread() is not threading.main_thread():
            return
        workers = [p for p in multiprocessing.active_children() if p.exitcode is None]
        self._previous = signal.signal(signal.SIGUSR1, self._raise)
        self._thread = threading.Thread(
            target=self._poll, args=(workers, threading.main_thread().ident), daemon=True
        )
        self._thread.start()

    def _poll(self, workers: list[Any], main_ident: int) -> None:
        while not self._stop.wait(self.POLL_S):
            dead = [p for p in workers if p.exitcode not in (None, 0)]
            if dead:
                code = dead[0].exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                self.dead = f"pid {dead[0].pid}, {how}"
                signal.pthread_kill(main_ident, signal.SIGUSR1)
                return

    def _raise(self, signum: int, frame: Any) -> None:
        if self.dead is not None and not self._stop.is_set():
            raise worker_died(self.dead)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR1, self._previous or signal.SIG_DFL)


def _decoded_ahead(ds: DecodeDataset) -> Iterator[tuple[int, Any]]:
    """``ds``'s items in order, each decoded on one thread of this process while the caller
    encodes the one before (soundfile, soxr and Pillow release the GIL while they work)."""
    with ThreadPoolExecutor(1, thread_name_prefix="featbake-decode") as pool:
        pending: deque[Future[tuple[int, Any]]] = deque()
        try:
            for i in range(len(ds)):
                pending.append(pool.submit(ds.__getitem__, i))
                if len(pending) > AHEAD:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
