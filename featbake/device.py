"""The single boundary between featbake and CUDA.

Every ``torch.cuda`` call in featbake goes through this module, so that the rest of
the code reads the same on a laptop without a GPU and on a training node: on the CPU
each helper is a no-op or a pass-through (streams and events are ``None``), and CUDA
is only touched when a CUDA device was actually asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from featbake.cpus import cgroup_cpu_limit, encoder_threads, process_cpus
from featbake.errors import ConfigError

__all__ = [
    "Event",
    "Stream",
    "alloc_pinned",
    "cgroup_cpu_limit",
    "cuda_available",
    "cuda_usable_here",
    "current_stream",
    "encoder_thread_count",
    "event_query",
    "event_synchronize",
    "is_cuda",
    "new_event",
    "new_stream",
    "pin",
    "process_cpus",
    "record_event",
    "record_stream",
    "resolve_device",
    "stream_context",
    "synchronize",
    "torch_threads",
    "wait_stream",
]

# Aliases so signatures say what they mean without importing torch.cuda types on CPU builds.
Stream = Any
Event = Any

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_DEVICE_HINT = "expected 'cpu', 'cuda' or 'cuda:N' (e.g. 'cuda:0')"


def cuda_available() -> bool:
    """Return whether a usable CUDA device is present.

    Example:
        >>> isinstance(cuda_available(), bool)
        True
    """
    return torch.cuda.is_available()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Validate a user-supplied device and return it as a ``torch.device``.

    ``None`` means "the best available": ``cuda`` when a GPU is present, else ``cpu``.
    Asking for CUDA explicitly on a machine without it is an error rather than a
    silent fallback, because a run that quietly trains on the CPU wastes hours.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``None``.

    Returns:
        The resolved device; a bare ``"cuda"`` becomes the current CUDA device index.

    Raises:
        ConfigError: If the string is not a valid device, CUDA is requested but not
            available, or the index is out of range.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        if cuda_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    text = str(device).strip().lower()
    match = _DEVICE_RE.match(text)
    if match is None:
        raise ConfigError(f"invalid device {device!r}: {_DEVICE_HINT}")
    kind, index = match[1], match[2]
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(f"invalid device {device!r}: {_DEVICE_HINT}")
        return torch.device("cpu")
    if not cuda_available():
        raise ConfigError(
            f"device {device!r} was requested but CUDA is not available "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            "use --device cpu (device='cpu' from Python), or install a CUDA build of PyTorch "
            "and check that `nvidia-smi` sees a GPU"
        )
    count = torch.cuda.device_count()
    idx = torch.cuda.current_device() if index is None else int(index)
    if idx >= count:
        raise ConfigError(
            f"device {device!r} does not exist: {count} CUDA device(s) visible "
            f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", idx)


def is_cuda(device: str | torch.device | None) -> bool:
    """Return whether ``device`` names a CUDA device (without validating it).

    Example:
        >>> is_cuda("cpu"), is_cuda("cuda:1")
        (False, True)
    """
    if device is None:
        return False
    return torch.device(device).type == "cuda"


def pin(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` in page-locked memory when CUDA is available, else ``t`` itself.

    Pinned memory is what makes ``non_blocking`` host-to-device copies truly
    asynchronous; without CUDA it cannot be allocated, so this is a pass-through.

    Example:
        >>> x = torch.zeros(2)
        >>> pin(x) is x or cuda_available()
        True
    """
    if not cuda_available() or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Allocate an uninitialised host tensor, page-locked when CUDA is available.

    Used for reusable staging buffers; on a machine without CUDA it is a plain
    ``torch.empty`` so callers need no special case.

    Example:
        >>> alloc_pinned((2, 3), torch.float32).shape
        torch.Size([2, 3])
    """
    return torch.empty(shape, dtype=dtype, pin_memory=cuda_available())


def new_stream(device: torch.device) -> Stream | None:
    """Create a side CUDA stream on ``device``; ``None`` on the CPU.

    Example:
        >>> new_stream(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def current_stream(device: torch.device) -> Stream | None:
    """Return the current CUDA stream of ``device``; ``None`` on the CPU.

    Example:
        >>> current_stream(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def stream_context(stream: Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Return a context manager that makes ``stream`` current; a no-op for ``None``.

    Example:
        >>> with stream_context(None):
        ...     pass
    """
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def wait_stream(device: torch.device, stream: Stream | None) -> None:
    """Make ``device``'s current stream wait for work queued on ``stream``.

    Example:
        >>> wait_stream(torch.device("cpu"), None)
    """
    if stream is None or device.type != "cuda":
        return
    torch.cuda.current_stream(device).wait_stream(stream)


def record_stream(t: torch.Tensor, stream: Stream | None) -> None:
    """Tell the caching allocator that ``t`` is used on ``stream``.

    Without this, memory allocated on a side stream could be reused by the allocator
    while the consumer stream still reads it.

    Example:
        >>> record_stream(torch.zeros(1), None)
    """
    if stream is None or t.device.type != "cuda":
        return
    t.record_stream(stream)


def new_event(device: torch.device) -> Event | None:
    """Create a CUDA event for ``device``; ``None`` on the CPU.

    Example:
        >>> new_event(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    return torch.cuda.Event()


def record_event(event: Event | None, stream: Stream | None = None) -> None:
    """Record ``event`` on ``stream`` (the current stream when ``None``); no-op on CPU.

    Example:
        >>> record_event(None)
    """
    if event is None:
        return
    if stream is None:
        event.record()
    else:
        event.record(stream)


def event_query(event: Event | None) -> bool:
    """Return whether the work before ``event`` has completed; always True for ``None``.

    Example:
        >>> event_query(None)
        True
    """
    if event is None:
        return True
    return bool(event.query())


def event_synchronize(event: Event | None) -> None:
    """Block the host until ``event`` has completed; no-op for ``None``.

    Example:
        >>> event_synchronize(None)
    """
    if event is None:
        return
    event.synchronize()


def synchronize(device: str | torch.device | None = None) -> None:
    """Block until all queued work on a CUDA ``device`` is done; no-op on the CPU.

    Example:
        >>> synchronize("cpu")
    """
    if device is None:
        if cuda_available():
            torch.cuda.synchronize()
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cuda_usable_here() -> bool:
    """Return whether CUDA can be used in this process.

    False in a process forked after its parent initialised CUDA (a DataLoader worker of a
    training script, with the default ``fork`` start method): CUDA cannot start there, and
    trying raises "Cannot re-initialize CUDA in forked subprocess". Spawned and forkserver
    workers can use CUDA.

    Example:
        >>> cuda_usable_here() in (True, False)
        True
    """
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)
    return not in_bad_fork() and cuda_available()


#: Device types a build can run its encoder on.
BUILD_DEVICE_TYPES = ("cpu", "cuda")


def check_device(device: str | torch.device) -> torch.device:
    """Validate a build's ``--device``: cpu, cuda or cuda:N, and CUDA must be present.

    Raises:
        ConfigError: an unknown device, a type that computes nothing (``meta``) or that
            featbake does not drive, or CUDA asked for where there is none.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from e
    if dev.type not in BUILD_DEVICE_TYPES:
        raise ConfigError(f"--device {device} is not supported; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for CUDA, but no CUDA device is available here")
    return dev


#: Environment variables that set torch's intra-op thread count at its start.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def encoder_thread_count(asked: int | None, cpus: int) -> int:
    """The encoder's threads now: ``--threads``, else torch's count as the user left it.

    See :func:`featbake.cpus.encoder_threads` for the rule (this reads torch and the
    environment).
    """
    pinned = any(os.environ.get(v, "").strip() for v in THREAD_ENV)
    return encoder_threads(asked, torch.get_num_threads(), cpus, env_pinned=pinned)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def one_intra_op_thread_here() -> bool:
    """Run torch's parallel ops on the calling thread alone; every other thread keeps its count.

    torch built on OpenMP gives each thread that runs a parallel op its own OpenMP team, of
    ``torch.get_num_threads()`` threads: featbake's decode-ahead thread resizing an image with
    ``interpolate`` started a second team beside the encoder's, twice as many busy threads as
    CPUs, each team waiting at its barriers for threads the other had preempted (issue 31 item
    4). ``torch.set_num_threads`` is process-wide (the encoder's count: the user's); OpenMP's
    own count is per thread, so it is set here, after torch's per-thread set-up (the first
    ``torch.get_num_threads()`` on a thread sets OpenMP's count from torch's).

    Returns:
        True if torch's ops on this thread now run on it alone; False (nothing changed) when
        torch is not built on OpenMP or its runtime is not found.
    """
    if torch.get_num_threads() == 1:  # also torch's per-thread set-up, which must come first
        return True
    setter = _openmp_set_num_threads()
    if setter is None:
        return False
    setter(1)
    return torch.get_num_threads() == 1


@functools.cache
def _openmp_set_num_threads() -> Any:
    """The OpenMP runtime's ``omp_set_num_threads`` that torch loaded globally, or None."""
    with contextlib.suppress(OSError, AttributeError):
        setter = ctypes.CDLL(None).omp_set_num_threads
        setter.argtypes, setter.restype = [ctypes.c_int], None
        return setter
    return None
