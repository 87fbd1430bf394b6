"""The one thread pool every hashing loop uses (input files, bucket objects, the hash-cache
check), how many threads hash at once, and daemon threads a stop may leave behind (a leaf, no
I/O of its own)."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, wait
from typing import Any, TypeVar

#: Threads that hash files at once: hashlib releases the GIL, and a few keep a disk (or an NFS
#: mount) busy; more only queue on it.
HASH_THREADS = 4
#: Threads that hash a bucket's objects at once: each waits mostly on its GET.
OBJECT_THREADS = 8

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def map_in_threads(
    fn: Callable[[_In], _Out], items: Collection[_In], threads: int = HASH_THREADS
) -> Iterator[_Out]:
    """``fn`` over ``items`` on up to ``threads`` threads, results in ``items``' order, each as
    soon as it and those before it are done: the one pool every hashing loop uses (input files,
    bucket objects, the hash-cache check). One item or one thread runs inline, with no pool.
    """
    if len(items) <= 1 or threads <= 1:
        yield from map(fn, items)
        return
    with DaemonThreads(min(threads, len(items)), "featbake-hash") as pool:
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            yield result_of(future)


#: The longest the main thread waits on another thread's work in one go (seconds).
WAIT_SLICE_S = 0.25


def result_of(future: Future[_Out]) -> _Out:
    """``future``'s result, waited for in slices of :data:`WAIT_SLICE_S`.

    The kernel may hand a signal sent to the process (SIGTERM from SLURM, Kubernetes,
    ``featbake build``'s supervisor) to any of its threads, the one stuck in a read included;
    Python runs its handler only on the main thread, once that runs again, and a main thread
    waiting untimed on the stuck thread's work never runs again (shown on its own: a
    ``Future`` whose thread took the signal). A sliced wait runs the handler within a slice.
    """
    while not wait([future], timeout=WAIT_SLICE_S).done:
        pass
    return future.result()


class DaemonThreads:
    """Up to ``threads`` daemon threads running submitted calls in order, which a stop may leave
    behind: a call stuck in a read that never returns (an NFS server gone, a FIFO) holds its
    thread, never the process.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads when its ``with`` ends and
    again when the interpreter exits, so a thread stuck in ``read()`` kept a build stopped by
    SIGTERM from ever exiting. Here leaving the ``with`` on an exception (the stop itself)
    cancels what has not started and waits for nothing; leaving it normally runs what was
    submitted and waits for the threads (nothing is left running behind a caller that
    finished).

    Args:
        threads: the most threads at once (started as calls come).
        name: the threads' name prefix.
        initializer: run first on each thread.
    """

    def __init__(
        self, threads: int, name: str, initializer: Callable[[], object] | None = None
    ) -> None:
        self.size = threads
        self.name = name
        self.initializer = initializer
        self.todo: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> DaemonThreads:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.shutdown(wait=kind is None)

    def submit(self, fn: Callable[..., _Out], *args: Any) -> Future[_Out]:
        """Run ``fn(*args)`` on a thread; its future."""
        future: Future[_Out] = Future()
        self.todo.put((future, functools.partial(fn, *args)))
        if len(self.threads) < self.size:
            name = f"{self.name}_{len(self.threads)}"
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
        return future

    def shutdown(self, wait: bool) -> None:
        """With ``wait``, run what was submitted and wait for the threads to end; without,
        cancel the calls not started and wait for nothing (a stop)."""
        while not wait:
            try:
                got = self.todo.get_nowait()
            except queue.Empty:
                break
            if got is not None:
                got[0].cancel()
        for _ in self.threads:
            self.todo.put(None)
        if wait:
            for thread in self.threads:
                thread.join()

    def _run(self) -> None:
        failed: BaseException | None = None  # an initializer's error fails each call here
        if self.initializer is not None:
            try:
                self.initializer()
            except BaseException as e:  # a thread that died here would leave calls unanswered
                failed = e
        while (got := self.todo.get()) is not None:
            future, call = got
            if not future.set_running_or_notify_cancel():
                continue
            if failed is not None:
                future.set_exception(failed)
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # the caller's to raise, from result()
                future.set_exception(e)
