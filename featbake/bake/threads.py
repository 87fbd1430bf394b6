"""Decode workers: files -> preprocessed tensors; a bad file becomes an error record."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from featbake.bake.interrupt import stop_requested, stoppable_wait
from featbake.device import one_intra_op_thread_here
from featbake.encode.fingerprints import HeldBytes
from featbake.encode.sources import Source, load_unchanged
from featbake.errors import SourceError
from featbake.store.catalog import BuildCatalog, Catalog
from featbake.store.hash_cache import FileStat
from featbake.store.layout import Layout
from featbake.store.shard import DEFAULT_SHARD_ITEMS, ShardWriter
from featbake.threadpool import DaemonThreads, result_of

# == decode ========================================================================================
#: Inputs decoded ahead of the encoder when there are no decode workers (on a thread).
AHEAD = 4


# -- inputs read once ------------------------------------------------------------------------
class HeldSource:
    """``inner`` decoding each input from the bytes kept when it was hashed, if any.

    Those bytes are the ones its key was made from, so they need no check that the file is
    unchanged; an input without kept bytes is read from its file and checked as before
    (:func:`featbake.encode.sources.load_unchanged`). See :mod:`featbake.encode.fingerprints`.
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

    Each input is decoded under ``torch.inference_mode()``, so the encoder gets an inference
    tensor, as it does in the loop a user writes inside ``inference_mode``: the encoder's views
    and ops on a normal tensor pay autograd's view and version tracking even inside inference
    mode. An LSTM cell stepped over 10 ms frames (a view per step) ran 7% slower on normal
    tensors (312 ms against 292 ms for 120 clips; issue 42 item 4).
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
            with torch.inference_mode():
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
) -> Generator[tuple[int, Any], None, None]:
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
    with workers_unchecked_by_torch(loader) as batches, _WorkerWatch() as watch:
        while True:
            try:
                with watch.waiting(), stoppable_wait():
                    i, x = next(batches)
            except StopIteration:
                return
            except RuntimeError as e:  # torch's own status check in next(): a worker is gone
                raise (worker_death(e) or e) from None
            watch.arm()
            yield i, (inference_tensor(x) if isinstance(x, np.ndarray) else x)


def inference_tensor(x: np.ndarray) -> torch.Tensor:
    """A decode worker's array as an inference tensor, sharing its memory (see
    :class:`DecodeDataset`)."""
    with torch.inference_mode():
        return torch.from_numpy(x)


def worker_death(e: BaseException) -> SourceError | None:
    """The clear error for torch's "DataLoader worker ... killed" RuntimeError, else None."""
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


@contextlib.contextmanager
def workers_unchecked_by_torch(loader: DataLoader) -> Iterator[Iterator[Any]]:
    """``loader``'s iterator, with torch's SIGCHLD check kept off while its workers are up.

    torch installs (once per process) a SIGCHLD handler that raises "DataLoader worker ... is
    killed by signal" wherever the main thread is when any child ends while a dead worker is
    registered: in the iterator's ``__del__`` as it shuts the other workers down (an
    "Exception ignored" traceback on stderr), in a ``finally``, in the CLI printing its line.
    Which one it hit was a matter of timing (a busy machine printed the traceback). Here it
    never runs while this iterator's workers are registered: SIGCHLD keeps its default action
    (nothing) from before the iterator starts until it has shut its workers down, which
    unregisters them; torch's handler comes back only then. A dead worker is found by
    :class:`_WorkerWatch` and by torch's status check inside ``next`` instead, both raising in
    :func:`decoded_items`'s loop. An iterator not shut down (torch failed while starting it)
    leaves SIGCHLD at its default: restoring torch's handler would let it raise later.
    """
    main = threading.current_thread() is threading.main_thread()
    after: Any = signal.getsignal(signal.SIGCHLD) if main else None  # torch's, if set before
    if main:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    batches: Any = None
    try:
        batches = iter(loader)
        if main and signal.getsignal(signal.SIGCHLD) is not signal.SIG_DFL:
            after = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's, set just now
        yield batches
    finally:
        # torch's own shutdown (what __del__ calls), now, not when the last reference goes
        shut = getattr(batches, "_shutdown_workers", None)
        if shut is not None:
            if stop_requested() or workers_died(batches):  # one stuck in a read never ends
                kill_workers(batches)
            shut()  # does nothing at interpreter exit: its workers then stay registered
            if main and getattr(batches, "_worker_pids_set", True) is False:
                signal.signal(signal.SIGCHLD, after if after is not None else signal.SIG_DFL)


def workers_died(batches: Any) -> bool:
    """Whether one of a loader iterator's decode workers ended other than by torch's shutdown
    (the OOM killer, a kill by hand)."""
    return any(w.exitcode not in (None, 0) for w in getattr(batches, "_workers", ()))


def kill_workers(batches: Any) -> None:
    """SIGKILL a loader iterator's decode workers still alive, and keep torch's shutdown off the
    flag they shared.

    A stop signal ends the wait for a worker stuck in a read that never returns
    (:func:`stoppable_wait`); torch's shutdown then waits 5 s for each worker and sends it
    SIGTERM, which decode workers ignore (the main process stops them, :func:`init_worker`),
    and the interpreter's exit joins them: forever. A decode worker holds nothing to seal.

    The workers' "done" flag is a ``multiprocessing.Event``, guarded by a lock between
    processes that each worker takes as it receives an input. A worker killed while it held
    it (descheduled there on a busy machine; or the one the OOM killer ended) holds it for
    ever, and torch's shutdown, setting the flag, waited on it: the build stopped by SIGTERM
    never ended. Once every worker is gone nobody reads the flag: torch's shutdown sets a
    plain one of this process instead.
    """
    workers = getattr(batches, "_workers", ())
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    if workers and hasattr(batches, "_workers_done_event"):
        batches._workers_done_event = threading.Event()


class _WorkerWatch:
    """Ends any wait on a dead decode worker within a fraction of a second.

    A worker killed while writing a result leaves half a message in its pipe: the main
    process then blocks reading the rest, forever. This thread polls the workers and, when one
    has died, sends the main thread a signal every :data:`POLL_S` while it waits for an item
    (:meth:`waiting`), until the watch ends; the handler raises :class:`SourceError` only
    there. Elsewhere (the encoder) nothing interrupts it: the loop raises the same error
    itself before it waits again (:meth:`check`). A raise that lands in a finalizer the
    collector runs during the wait is kept off stderr (:meth:`_unraisable`) and the next
    signal raises it in the wait. Outside the main thread it does nothing.
    """

    POLL_S = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._previous_hook: Any = None
        self._waiting = False
        self.dead: str | None = None

    def __enter__(self) -> _WorkerWatch:
        return self

    def arm(self) -> None:
        """Start watching (after the first item: the workers exist by then)."""
        if self._thread is not None or threading.current_thread() is not threading.main_thread():
            return
        workers = [p for p in multiprocessing.active_children() if p.exitcode is None]
        self._previous = signal.signal(signal.SIGUSR1, self._raise)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self._thread = threading.Thread(
            target=self._poll, args=(workers, threading.main_thread().ident), daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the main thread's wait for the next item: where the signal may raise."""
        self.check()
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False

    def check(self) -> None:
        """Raise the worker's death, if one was seen."""
        if self.dead is not None:
            raise worker_died(self.dead)

    def _poll(self, workers: list[Any], main_ident: int) -> None:
        while not self._stop.wait(self.POLL_S):
            if self.dead is None:
                dead = [p for p in workers if p.exitcode not in (None, 0)]
                if not dead:
                    continue
                code = dead[0].exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                self.dead = f"pid {dead[0].pid}, {how}"
            if self._waiting:  # elsewhere check() raises it; the encoder is not interrupted
                signal.pthread_kill(main_ident, signal.SIGUSR1)  # again until the watch ends

    def _raise(self, signum: int, frame: Any) -> None:
        if self._waiting and not self._stop.is_set():
            self.check()

    def _unraisable(self, unraisable: Any) -> None:
        if not (self.dead is not None and isinstance(unraisable.exc_value, SourceError)):
            (self._previous_hook or sys.__unraisablehook__)(unraisable)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR1, self._previous or signal.SIG_DFL)
            sys.unraisablehook = self._previous_hook or sys.__unraisablehook__


def _decoded_ahead(ds: DecodeDataset) -> Iterator[tuple[int, Any]]:
    """``ds``'s items in order, each decoded on one thread of this process while the caller
    encodes the one before (soundfile, soxr and Pillow release the GIL while they work). A stop
    signal ends the wait for a decode stuck in its read, and the thread is left behind.

    The thread runs torch's ops (an image resized by ``interpolate``) on itself alone: it starts
    no OpenMP team beside the encoder's (see :func:`featbake.device.one_intra_op_thread_here`).
    """
    pool = DaemonThreads(1, "featbake-decode", initializer=one_intra_op_thread_here)
    pending: deque[Future[tuple[int, Any]]] = deque()
    try:
        for i in range(len(ds)):
            pending.append(pool.submit(ds.__getitem__, i))
            if len(pending) > AHEAD:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        for f in pending:
            f.cancel()
        # Stopped by a signal, the decode may be stuck in a read that never returns: it is
        # left behind (a daemon thread); else the thread is waited for, as it ends at once.
        pool.shutdown(wait=not stop_requested())


def _result(decoded: Future[tuple[int, Any]]) -> tuple[int, Any]:
    """A decode's result, waited for where a stop signal ends the wait (:func:`stoppable_wait`)."""
    with stoppable_wait():
        return result_of(decoded)


# == writer_thread =================================================================================
# The writer thread: fills shards behind the encoder and commits their catalog rows.
#: Features handed to the writer thread at once: up to 32, fewer once they hold 8 MiB, and each
#: at once when 0.1 s passed since the last hand-off. One hand-off per feature woke the thread,
#: and moved the GIL, once per item: beside a small encoder on 2 CPUs, that cost more than the
#: thread's own work (issue 19). The time bound keeps a slow encoder's features written as they
#: come (as before: what a kill loses is no more than it was).
HANDOFF_ITEMS = 32
HANDOFF_BYTES = 8 << 20
HANDOFF_SECONDS = 0.1
#: A shard being filled is sealed once its oldest feature has waited this long (seconds), even
#: when it is far from ``--shard-size``: SIGKILL (spot preemption, the OOM killer, ``kill -9``)
#: runs no cleanup, so only what is sealed survives it (issue 32 item 1). Each seal costs one
#: small file and one catalog commit: every 30 s is nothing beside the encoding.
DEFAULT_SEAL_SECONDS = 30.0


# -- writing behind --------------------------------------------------------------------------
class WriterThread:
    """Fills and seals shards in a background thread; the caller only enqueues features."""

    _STOP = object()

    def __init__(
        self,
        layout: Layout,
        encoder_fp: str,
        recipe_fp: str,
        shard_bytes: int,
        sink: BuildCatalog | None = None,
        seal_seconds: float = DEFAULT_SEAL_SECONDS,
    ) -> None:
        self.layout = layout
        self._sink = sink  # a rank of a sharded build records its shards in fragments instead
        self.bytes_written = 0
        self.shards = 0
        self.new_rows = 0
        self.error: BaseException | None = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize=256)
        # The batch not yet handed over, its bytes and when its first feature came; the lock
        # lets the thread take it when it is due to seal (an encoder slower than the seal
        # interval would otherwise keep its last features out of every seal).
        self._lock = threading.Lock()
        self._batch: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._batch_bytes = 0
        self._batch_since = 0.0
        self._queued_bytes = 0  # handed over, not yet in the shard writer
        self._seal_seconds = seal_seconds
        self._handed_at = time.monotonic()  # the last hand-off: HANDOFF_SECONDS after, hand over
        self._writer = ShardWriter(
            layout,
            encoder_fp,
            recipe_fp,
            target_bytes=shard_bytes,
            max_items=DEFAULT_SHARD_ITEMS,
            seal_seconds=seal_seconds,
        )
        self._thread = threading.Thread(target=self._run, name="featbake-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # sqlite connections belong to the thread that made them
        catalog = self._sink or Catalog(self.layout)

        def publish(shard: Any) -> None:
            self.new_rows += catalog.add_shard(shard)
            self.bytes_written += shard.nbytes
            self.shards += 1

        self._writer.on_seal = publish
        try:
            while (items := self._next_or_due()) is not self._STOP:
                batch, nbytes = items
                for key, parts in batch:
                    self._writer.add(key, parts)
                with self._lock:
                    self._queued_bytes -= nbytes
        except BaseException as e:
            self.error = e
            while self._q.get() is not self._STOP:  # drain so the producer never blocks
                pass
        else:
            try:
                self._writer.seal()
            except BaseException as e:
                self.error = e
        finally:
            self._finish(catalog)

    def _finish(self, catalog: Any) -> None:
        """Record what was sealed (also on Ctrl-C), or close this thread's own catalog. A
        failure here (a fragment's upload refused) is the build's error, raised where the
        build joins this thread, not a traceback printed from it; the first error stays."""
        try:
            if self._sink is not None:
                self._sink.flush()
            else:
                catalog.close()
        except BaseException as e:
            self.error = self.error or e

    def _seconds_until_due(self) -> float | None:
        """Seconds until the oldest feature not sealed has waited ``seal_seconds`` (None:
        nothing is waiting)."""
        oldest = self._writer.oldest_pending
        with self._lock:
            if self._batch:
                oldest = self._batch_since if oldest is None else min(oldest, self._batch_since)
        if oldest is None:
            return None
        return max(0.0, oldest + self._seal_seconds - time.monotonic())

    def _next_or_due(self) -> Any:
        """The next hand-off from the queue; while waiting for it, seal what is pending as soon
        as it is due, the caller's batch not yet handed over included."""
        while True:
            wait = self._seconds_until_due()
            # Nothing pending yet: look again after seal_seconds anyway, since the caller's
            # next batch starts without waking this thread (a slow encoder may not hand it
            # over before it is due).
            wait = self._seal_seconds if wait is None else wait
            try:
                return self._q.get(timeout=min(max(wait, 0.01), 3600.0))
            except queue.Empty:
                if self._seconds_until_due() == 0.0:
                    for key, parts in self._take_batch()[0]:
                        self._writer.add(key, parts)
                    self._writer.seal()

    @property
    def bytes_pending(self) -> int:
        """Bytes encoded but not sealed yet: what a SIGKILL now would lose (approximate)."""
        return self._writer.pending_bytes + self._queued_bytes + self._batch_bytes

    def put(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        """Queue one feature; features are handed to the thread a batch at a time."""
        if self.error is not None:
            raise self.error
        nbytes = sum(t.nbytes for t in parts.values())
        with self._lock:
            if not self._batch:
                self._batch_since = time.monotonic()
            self._batch.append((key, parts))
            self._batch_bytes += nbytes
            full = len(self._batch) >= HANDOFF_ITEMS or self._batch_bytes >= HANDOFF_BYTES
        if full or time.monotonic() - self._handed_at >= HANDOFF_SECONDS:
            self._hand_off()

    def _take_batch(self) -> tuple[list[tuple[str, dict[str, torch.Tensor]]], int]:
        # Called by the caller's thread (a hand-off) and by the writer's (a seal that is due).
        """The batch not yet handed over and its bytes, leaving an empty one."""
        with self._lock:
            batch, nbytes = self._batch, self._batch_bytes
            self._batch, self._batch_bytes = [], 0
            return batch, nbytes

    def _hand_off(self) -> None:
        self._handed_at = time.monotonic()
        batch, nbytes = self._take_batch()
        with self._lock:
            self._queued_bytes += nbytes
        if batch:
            self._q.put((batch, nbytes))

    def close(self) -> None:
        """Seal what is pending and wait; re-raise the thread's error, if any."""
        self._hand_off()
        self._q.put(self._STOP)
        # A KeyboardInterrupt that landed inside an earlier Queue.put can lose the wake-up of a
        # waiting get(): nudge the writer until it has seen the stop mark, never wait blindly.
        while self._thread.is_alive():
            self._thread.join(0.2)
            with self._q.not_empty:
                self._q.not_empty.notify_all()
        if self.error is not None:
            raise self.error
