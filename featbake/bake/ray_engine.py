"""Builds on Ray Data: the encode step of a build spread over an actor pool, retried by Ray.

``featbake build --engine ray`` (:class:`RayEngine`) lists and keys the inputs as any build does
(bake/pipeline.py), the inputs of a folder or bucket prefix that the hash cache does not know read
and hashed by Ray tasks on the cluster (:class:`ClusterDigests`: the driver fills the hash cache
from what they return, and reads no input), and the tar shards and table files whose members and
cells it does not know likewise; only the misses become a Ray Dataset of :class:`WorkItem` rows,
and ``map_batches`` runs them through an actor pool: each actor (:class:`PathActor`) loads the
encoder once and is a :class:`PartEncoder`, encoding each task by the plain build's own step and
sealing shards and ``part`` fragments into the store (a shared filesystem, or a bucket through each
node's tier). The driver adds up what the tasks return, then seals the manifest and merges. It
connects to Ray (starting a local instance if no address is given) on a thread of its own while it
lists and stats the inputs (:meth:`RayEngine.started`), and waits for it there, before the first
hashing task. Decoding runs in the actor, beside the encoder, reading each input where the build
found it: a task is one round trip of names, not of bytes.

Ray restarts a dead actor and runs its task again (Ray Data sets ``max_restarts=-1`` and
``max_task_retries=-1`` for an actor pool): the task's items that its dead worker had sealed are
skipped (their fragments name them), the rest encoded again, so nothing is lost and no catalog
row is doubled. An input that fails to decode is a failed item in the task's result, never an
exception, so Ray never retries it.

:func:`encode` runs a user's own Ray Dataset (``read_binary_files``, ``read_parquet`` of a
binary column, ``read_webdataset``) the same way: each actor (:class:`BytesActor`) hashes the
bytes of ``column`` exactly as a folder build hashes a file, so a dataset over the same files
finds every feature.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import pickle
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

from featbake.bake.batching import budget_samples
from featbake.bake.options import BakeOptions
from featbake.bake.pipeline import (
    ENGINE_PROTOCOL,
    BuildEncoder,
    Engine,
    EngineJob,
    Failure,
    PartEncoder,
    PartResult,
    ProgressFn,
    RunnerSpec,
    WorkItem,
)
from featbake.bake.ray_hashing import HashedBatch, digest_batch, read_batch
from featbake.bake.report import BuildReport
from featbake.device import process_cpus
from featbake.encode.fingerprints import (
    ContainerAsk,
    ContainerDigested,
    DigestAsk,
    Digested,
    Digester,
    container_stat,
    digest_here,
    read_here,
)
from featbake.encode.hf import recipe_for_encoder
from featbake.errors import (
    BuildIncomplete,
    ConfigError,
    FeatbakeError,
    StoreError,
    first_line,
)
from featbake.keys import feature_key, root_id
from featbake.progress import Progress
from featbake.recipe import Recipe
from featbake.store.byteplace import CHANGED_WHILE_READ, BytePlace, bytes_at
from featbake.store.claims import this_host
from featbake.store.fragment_catalog import FragmentCatalog, RankPart
from featbake.store.hash_cache import FileStat
from featbake.store.open import Need, StoreRef, open_store, place_of
from featbake.store.roots import RootSpec

#: Inputs per Ray task at least: one task's work is sealed when it returns, and run again
#: whole (less what its worker sealed) when its worker dies. The bytes path
#: (:func:`featbake.ray.encode`, whose rows carry their inputs) keeps tasks of this size.
ROWS_PER_TASK = 64

#: How many times a task is run when its actor dies under it (Ray restarts the actor): a node
#: lost, a worker killed, then an input that ends every process that encodes it.
TASK_TRIES = 3


def bounded_task_tries() -> dict[str, int]:
    """The remote options each encoding actor is made with: a task run :data:`TASK_TRIES`
    times at most (Ray Data's default tries it for ever; the actor itself is still restarted
    whenever it dies, as by default)."""
    return {"max_task_retries": TASK_TRIES - 1}


def task_tries_option(map_batches: Callable[..., Any]) -> dict[str, Any]:
    """``map_batches``' option bounding a task's tries, where this Ray has it (``ray_remote_
    args_fn``, deprecated from Ray 2.60, to be removed in 2.64: without it, Ray's default)."""
    if "ray_remote_args_fn" in inspect.signature(map_batches).parameters:
        return {"ray_remote_args_fn": bounded_task_tries}
    return {}


#: Tasks per actor a folder build aims at: enough to balance the actors and tick the progress,
#: few enough that a large build's part fragments and last, partly filled shards (one of each
#: per task) stay few: 10M inputs on 8 actors were 156,250 tasks of 64, each a fragment for the
#: merge to fold; they are 1,221 of 8,192.
TASKS_PER_WORKER = 32
#: Inputs per task at most (a task's rows are paths; a retried task lists them again and
#: encodes only those its dead worker had not sealed).
MOST_ROWS_PER_TASK = 8192


def rows_per_task(inputs: int, workers: int, asked: int | None = None) -> int:
    """Inputs per task of a folder build of ``inputs`` on ``workers`` actors: ``asked`` when
    given, else about :data:`TASKS_PER_WORKER` tasks an actor, of :data:`ROWS_PER_TASK` to
    :data:`MOST_ROWS_PER_TASK` inputs each.

    Example:
        >>> rows_per_task(1_000, workers=2), rows_per_task(10_000_000, workers=8)
        (64, 8192)
    """
    if asked is not None:
        return asked
    even = -(-inputs // (max(1, workers) * TASKS_PER_WORKER))
    return max(ROWS_PER_TASK, min(MOST_ROWS_PER_TASK, even))


#: Inputs the hash cache does not know, at least, for a Ray build to read and hash them on the
#: cluster: fewer are hashed by the driver, where a few hundred reads cost less than Ray's tasks
#: (each scheduled, its worker's first task importing featbake, its results sent back).
CLUSTER_HASHING_FROM = 256
#: Inputs per hashing task at least and at most; between, about :data:`HASH_TASKS_PER_CPU` tasks
#: a CPU of the cluster (enough to balance the nodes and tick the progress).
LEAST_HASH_ROWS = 64
MOST_HASH_ROWS = 4096
HASH_TASKS_PER_CPU = 4


class HashSite(Enum):
    """Where a Ray build reads and hashes the inputs the hash cache does not know."""

    DRIVER = "driver"
    CLUSTER = "cluster"


def hash_site(uncached: int, cluster_from: int = CLUSTER_HASHING_FROM) -> HashSite:
    """Where ``uncached`` inputs (of one place) that the hash cache does not know are hashed:
    on the cluster if there are ``cluster_from`` or more of them (and any at all), else on the
    driver.

    Example:
        >>> hash_site(10), hash_site(10_000_000)
        (<HashSite.DRIVER: 'driver'>, <HashSite.CLUSTER: 'cluster'>)
    """
    return HashSite.CLUSTER if uncached > 0 and uncached >= cluster_from else HashSite.DRIVER


def hash_rows_per_task(inputs: int, cpus: int) -> int:
    """Inputs per hashing task for ``inputs`` on a cluster of ``cpus`` CPUs: about
    :data:`HASH_TASKS_PER_CPU` tasks a CPU, of :data:`LEAST_HASH_ROWS` to
    :data:`MOST_HASH_ROWS` inputs each.

    Example:
        >>> hash_rows_per_task(1_000, cpus=2), hash_rows_per_task(10_000_000, cpus=128)
        (125, 4096)
    """
    even = -(-inputs // (max(1, cpus) * HASH_TASKS_PER_CPU))
    return max(LEAST_HASH_ROWS, min(MOST_HASH_ROWS, even))


def container_tasks(items: Sequence[int], per_task: int) -> list[range]:
    """The hashing tasks of containers holding ``items`` new items each (in order): each task a
    run of whole containers (a container is read by one process, in its order), closed once it
    holds ``per_task`` items or more, or the next container would take it past them; so a task
    is one large container, or several small ones.

    Example:
        >>> container_tasks([10, 10, 100, 5, 5], per_task=64)
        [range(0, 2), range(2, 3), range(3, 5)]
    """
    tasks: list[range] = []
    start, held = 0, 0
    for i, n in enumerate(items):
        if i > start and held + n > per_task:
            tasks.append(range(start, i))
            start, held = i, 0
        held += n
    if start < len(items):
        tasks.append(range(start, len(items)))
    return tasks


#: The column of each task's result (:meth:`PartResult.to_json`).
RESULT = "result"


def _ray() -> Any:
    """The ``ray`` module, or a ConfigError saying how to install it."""
    try:
        import ray
        import ray.data  # Ray Data, the part of Ray the engine runs on
    except ImportError:
        raise ConfigError(
            "--engine ray needs Ray Data: pip install 'featbake[ray]' (or 'ray[data]')"
        ) from None
    return ray


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray, connected: the caller's session if Ray is initialised, else ``address`` (default
    ``$RAY_ADDRESS``), else a local instance started for the build and stopped after it."""
    ray = _ray()
    if ray.is_initialized():
        other = another_cluster(ray, address)
        if other is not None:
            raise ConfigError(other)
        yield ray
        return
    # "local": a new instance, never a `ray start` cluster found on this node by Ray's default.
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    # A local instance: as many CPUs as this process may use (its affinity and cgroup quota,
    # not the machine's), and no runtime_env: its workers inherit this process's environment
    # (PYTHONPATH included), and a job with a runtime_env cannot use the workers Ray starts
    # ahead with the instance, so each actor would wait for a process of its own to start.
    unanswered = nothing_answers(ray, address)
    if unanswered is not None:
        raise ConfigError(ray_unreached(address, unanswered))
    try:
        with quiet_stops(ray):
            ray.init(
                address=address,
                num_cpus=process_cpus() if address == "local" else None,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
            )
    except (ValueError, ConnectionError, RuntimeError) as e:  # ray.init's own errors
        raise ConfigError(ray_unreached(address, first_line(e))) from None
    except OSError as e:  # its temp folder: read-only, not a folder, full
        raise ConfigError(ray_unreached(address, ray_folder_unwritten(e))) from None
    try:
        yield ray
    finally:
        ray.shutdown()


@contextlib.contextmanager
def quiet_stops(ray: Any) -> Iterator[None]:
    """Keep Ray's crash handler out of this process (its workers keep theirs) for the
    ``ray.init`` run inside: it installs one on SIGTERM too, which printed a native stack
    dump above the build's one ``stopped`` line when SLURM, Kubernetes or docker stopped it
    (the build's own handler then kept what was sealed, as it does without Ray). Ray reads the
    switch, its ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, when ``ray.init`` starts this
    process's worker; it is put back after, for the process's own later ``ray.init`` calls."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is None or not hasattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"):
        yield
        return
    before = constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = before


#: Seconds a TCP connect to a Ray address may take before the build says nothing answers.
ADDRESS_CONNECT_S = 5.0


def nothing_answers(ray: Any, address: str) -> str | None:
    """Why nothing answers at ``address`` (``host:port``: a refused or timed-out TCP connect),
    or None (it answers, or it is not a host and port: ``"local"``, ``"auto"``, ``ray://``).

    ``ray.init`` retries an address nothing listens at for about 13 minutes (20 tries of
    about 40 s) before it raises; a mistyped port is said at once instead. ``localhost``
    is tried at this node's address, as Ray connects to it."""
    dialled = host_and_port(ray, address)
    if dialled is None:
        return None
    host, port = dialled
    try:
        socket.create_connection((host, port), timeout=ADDRESS_CONNECT_S).close()
    except OSError as e:
        return f"nothing answers at {host}:{port} ({e.strerror or type(e).__name__})"
    return None


def host_and_port(ray: Any, address: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` address, ``localhost`` as this node's address (as Ray
    connects to it); None for the other forms (``"local"``, ``"auto"``, ``ray://``)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 address: [::1]:6379
    if not sep or not port.isdigit() or "://" in address or not host:
        return None
    if host in ("localhost", "127.0.0.1", "::1"):
        host = ray.util.get_node_ip_address()
    return host, int(port)


def another_cluster(ray: Any, address: str | None) -> str | None:
    """Why a build given ``address`` (``host:port``) cannot use the Ray this process has
    already initialised: that session is connected to another cluster's address (the line to
    say); None where it is the same, or no such address was given (``$RAY_ADDRESS``, which
    ``ray.init`` itself ignores once Ray is initialised, and the other forms use the session).
    Before, the build used the session and encoded on a cluster the user did not name."""
    asked = None if address is None else host_and_port(ray, address)
    now = host_and_port(ray, ray.get_runtime_context().gcs_address)
    if asked is None or now is None or asked == now:
        return None
    return (
        f"Ray is already initialised in this process, connected to {now[0]}:{now[1]}, and "
        f"--ray-address names another cluster ({address}): call ray.shutdown() before the "
        "build, or give no --ray-address to build on this session"
    )


def ray_folder_unwritten(error: OSError) -> str:
    """Why Ray could not write its session folder (``ray.init``'s OSError: a read-only
    ``/tmp``, ``$RAY_TMPDIR`` not a folder), naming the folder and what chooses it (pure).
    Before, "internal error ... please report it".

    Example:
        >>> ray_folder_unwritten(NotADirectoryError(20, "Not a directory", "/x/ray"))
        "Ray could not write its temp folder /x/ray (Not a directory): set RAY_TMPDIR to a \
writable folder (Ray's temp folder is $RAY_TMPDIR/ray, else $TMPDIR/ray, else /tmp/ray)"
    """
    folder = error.filename or "under $RAY_TMPDIR"
    return (
        f"Ray could not write its temp folder {folder} ({error.strerror or first_line(error)}): "
        "set RAY_TMPDIR to a writable folder (Ray's temp folder is $RAY_TMPDIR/ray, else "
        "$TMPDIR/ray, else /tmp/ray)"
    )


def ray_unreached(address: str, why: str) -> str:
    """The one line of a build whose Ray did not start (``"local"``) or connect (an address)
    for reason ``why``, with what to do."""
    if address == "local":
        return (
            f"a local Ray instance did not start: {why}; see Ray's logs under "
            "/tmp/ray, or give a running cluster's address with --ray-address"
        )
    return (
        f"Ray did not connect to {address!r} (--ray-address, else $RAY_ADDRESS): "
        f"{why}; give a running cluster's address (the host:port `ray start` "
        "prints on its head node), or none for a local Ray instance started for the build"
    )


def quiet(ray: Any) -> None:
    """No progress bars or execution logs from Ray Data: featbake draws its own progress, and
    says what ended a run in its own one line (Ray Data logs a task's failure as an error
    with its traceback, twice, before it raises it)."""
    import logging

    logging.getLogger("ray").setLevel(logging.ERROR)
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    with contextlib.suppress(AttributeError):
        context.print_on_execution_start = False


@dataclass(frozen=True)
class RayEngine:
    """The Ray engine of a build (``build(..., engine=RayEngine(workers=8, gpus_per_worker=1))``).

    Args:
        workers: actors in the pool (each loads the encoder once).
        gpus_per_worker: GPUs each actor holds (Ray sets its ``CUDA_VISIBLE_DEVICES``).
        address: the Ray cluster (default ``$RAY_ADDRESS``, else a local instance).
        rows_per_task: inputs per task; None (the default) sizes tasks to the build (see
            :func:`rows_per_task`).
        cluster_hashing_from: inputs the hash cache does not know, at least, for the build to
            hash them in Ray tasks (fewer: on the driver; see :func:`hash_site`).
    """

    workers: int = 2
    gpus_per_worker: float = 0
    address: str | None = None
    rows_per_task: int | None = None
    cluster_hashing_from: int = CLUSTER_HASHING_FROM

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"--workers must be 1 or more Ray actors, got {self.workers!r}")
        if not 0 <= self.gpus_per_worker <= 64:
            raise ConfigError(
                f"--gpus-per-worker must be from 0 to 64, got {self.gpus_per_worker!r} "
                "(fractions share a GPU: 0.5 puts two workers on each)"
            )
        rows = self.rows_per_task
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ConfigError(f"rows_per_task must be 1 or more inputs per Ray task, got {rows!r}")
        least = self.cluster_hashing_from
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ConfigError(
                f"cluster_hashing_from must be 0 or more inputs (0: always on the cluster), "
                f"got {least!r}"
            )

    @contextlib.contextmanager
    def started(self) -> Iterator[Engine]:
        """This engine with Ray connecting on a thread once the build needs it (inputs the
        hash cache does not know: while they are hashed; else the first encoding; see
        :class:`Connecting`: ``ray.init`` of a local instance takes seconds, starting its
        processes), and Ray stopped after the build if the build started it."""
        connecting = Connecting(self.address)
        try:
            yield ConnectedEngine(self, connecting)
        finally:
            connecting.close()

    def digester(self) -> Digester:
        """Digests on the cluster (:class:`ClusterDigests`), Ray connected when first needed
        (the build's engine is the :class:`ConnectedEngine` of :meth:`started`)."""
        return ClusterDigests(self.address, self.cluster_hashing_from)

    def on_actors(self, ray: Any, ds: Any, actor: type, args: tuple[Any, ...], rows: int) -> Any:
        """``ds`` mapped by this engine's actor pool of ``actor(*args)``: ``workers`` actors of
        a CPU (and ``gpus_per_worker`` GPUs) each, a task every ``rows`` rows.

        A task whose actor died is tried again on a restarted actor :data:`TASK_TRIES` times,
        not for ever (Ray Data's default): an input that ends its process (a crash in the
        encoder's native code, the OOM killer) ends the build instead of looping.

        Raises:
            ConfigError: no node of a cluster that cannot grow holds a worker (see
                :meth:`check_placeable`), before anything is mapped.
        """
        self.check_placeable(ray)
        with warnings.catch_warnings():  # Ray 2.60 to 2.63 warn of the option, not of its use
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            return ds.map_batches(
                actor,
                fn_constructor_args=args,
                batch_size=rows,
                batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=self.workers),
                num_cpus=1,
                num_gpus=self.gpus_per_worker or None,
                **task_tries_option(ds.map_batches),
            )

    def check_placeable(self, ray: Any) -> None:
        """Refuse workers that no node of the cluster can hold (a CPU and ``gpus_per_worker``
        GPUs each, on one node): Ray Data waits for such actors for ever, saying nothing (its
        warnings are quieted, :func:`quiet`); before, ``--gpus-per-worker 1`` on a cluster
        without GPUs hung after hashing. Fewer nodes than workers is not refused: the actors
        that fit run every task.

        A cluster this process started (a build's local instance, or the caller's own
        ``ray.init()`` with no address) never gains a node: refused. A cluster connected to
        may have an autoscaler that adds nodes of the kind asked for once the pool asks (Ray
        Data requests them): a warning, and the build waits for them.

        Raises:
            ConfigError: the line saying what a worker asks and what the cluster has.
        """
        asked = {"CPU": 1.0, "GPU": float(self.gpus_per_worker)}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if any(all(node.get(k, 0) >= need for k, need in asked.items()) for node in nodes):
            return
        line = unplaceable(self.workers, asked, nodes)
        if started_here(ray):
            raise ConfigError(line)
        warnings.warn(
            f"{line}; the build waits for the cluster to add such a node (an autoscaler), "
            "Ctrl-C stops it",
            stacklevel=3,
        )

    def encode(
        self,
        job: EngineJob,
        items: Sequence[WorkItem],
        progress: ProgressFn | None,
        each: Callable[[PartResult], None] | None = None,
    ) -> PartResult:
        """Encode ``items`` on the actor pool; what the tasks did, added up, ``each`` told
        every task's result as it arrives.

        Raises:
            FeatbakeError: what a worker raised (``--strict``: the first bad input).
        """
        rows = [
            {
                "key": i.key,
                "path": i.path,
                "name": i.name,
                "stat": _stat_text(i.stat),
                "carried": _carried_bytes(i.carried),
            }
            for i in items
        ]
        total = PartResult()
        with ray_session(self.address) as ray:
            quiet(ray)
            per_task = rows_per_task(len(rows), self.workers, self.rows_per_task)
            ds = self.on_actors(ray, ray.data.from_items(rows), PathActor, (job,), per_task)
            for result in _results(ds):
                part = PartResult.from_json(result[RESULT])
                total.add(part)
                if each is not None:
                    each(part)
                _tick(progress, total, len(items))
        return total


def unplaceable(
    workers: int, asked: Mapping[str, float], nodes: Sequence[Mapping[str, Any]]
) -> str:
    """The line for ``workers`` actors, each asking ``asked`` (``CPU``, ``GPU``), that none of
    ``nodes`` (each node's total resources) can hold (pure).

    Example:
        >>> line = unplaceable(2, {"CPU": 1, "GPU": 1}, [{"CPU": 8.0}])
        >>> line[:25], line[line.index("it has") :][:41]
        ('workers asking 1 GPU each', 'it has 0 GPUs in all, at most 0 on a node')
    """
    gpus = asked.get("GPU", 0)
    most = {k: max((float(n.get(k, 0)) for n in nodes), default=0.0) for k in ("CPU", "GPU")}
    total = {k: sum(float(n.get(k, 0)) for n in nodes) for k in ("CPU", "GPU")}
    if gpus > most["GPU"]:
        return (
            f"workers asking {gpus:g} GPU each ({workers} workers, --gpus-per-worker / num_gpus) "
            f"fit no node of the Ray cluster: it has {total['GPU']:g} GPUs in all, at most "
            f"{most['GPU']:g} on a node (and {total['CPU']:g} CPUs); give fewer GPUs a worker "
            "(0: encode on CPU), or a cluster with GPUs (--ray-address)"
        )
    return (
        f"workers asking a CPU each fit no node of the Ray cluster (it has {total['CPU']:g} "
        "CPUs in all): give a cluster whose nodes have CPUs (--ray-address)"
    )


def started_here(ray: Any) -> bool:
    """Whether this process started the Ray instance it is connected to (a build's local
    instance, a caller's ``ray.init()`` with no address): one that no autoscaler grows. A
    cluster connected to (an address) is not."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "head", False))


class Connecting:
    """:func:`ray_session` held by a thread of its own, started when the build first needs Ray
    (:meth:`start`) and left by :meth:`close`; what connecting raised is raised by
    :meth:`wait`, when Ray is needed (the first hashing task, else the encoding).

    A build starts it when it finds inputs the hash cache does not know (Ray connects while
    this process hashes them, or before the first hashing task), else when it has features
    to encode: a rebuild with nothing to do starts no Ray (a local instance's start and stop
    are seconds, three times such a rebuild's own time).

    The thread that started a local instance lives as long as the instance: Ray's processes
    are killed when the thread that started them ends (``PR_SET_PDEATHSIG``). That holds for
    the GCS and the raylet; the raylet's agents (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``) see it gone within seconds, then try for up to 60 s (Ray 2.60) to
    tell the GCS, gone too, before they exit: a build killed with SIGKILL leaves them about a
    minute."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.error: BaseException | None = None
        self.connected = threading.Event()
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start connecting on the session's thread, unless it has started."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._hold, name="featbake-ray-session", daemon=True
                )
                self.thread.start()

    def _hold(self) -> None:
        try:
            with ray_session(self.address) as ray:
                quiet(ray)
                self.connected.set()
                self.done.wait()
        except BaseException as e:  # raised again by wait(), on the build's thread
            self.error = e
        finally:
            self.connected.set()

    def wait(self) -> None:
        """Return once Ray is connected (started now if it was not); raise what connecting
        raised (Ray not installed, an address that does not answer)."""
        self.start()
        self.connected.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Leave the session, if one was started: Ray stopped if this started it."""
        self.done.set()
        with self.lock:
            thread = self.thread
        if thread is not None:
            thread.join()


@dataclass(frozen=True)
class ConnectedEngine:
    """A :class:`RayEngine` whose Ray is connecting (:meth:`RayEngine.started`)."""

    engine: RayEngine
    connecting: Connecting

    @contextlib.contextmanager
    def started(self) -> Iterator[Engine]:
        yield self

    def encode(
        self,
        job: EngineJob,
        items: Sequence[WorkItem],
        progress: ProgressFn | None,
        each: Callable[[PartResult], None] | None = None,
    ) -> PartResult:
        """:meth:`RayEngine.encode`, once Ray is connected."""
        self.connecting.wait()
        return self.engine.encode(job, items, progress, each)

    def digester(self) -> Digester:
        """Digests on the cluster (:class:`ClusterDigests`) once Ray is connected: the build
        waits for the connection only if it has enough inputs to hash there."""
        engine = self.engine
        return ClusterDigests(engine.address, engine.cluster_hashing_from, self.connecting)


T = TypeVar("T")  # what a hashing task gives for each ask
A = TypeVar("A")  # an ask of a hashing task (an input, a container)


# == hashing on the cluster ========================================================================
# A first build of a large dataset hashed every input on the driver (one node reading every byte
# while the cluster waited), then the actors read each input again to decode it. The inputs the
# hash cache does not know are read and hashed by Ray tasks instead (plain tasks, no actors:
# hashing needs no encoder), :func:`hash_rows_per_task` inputs each; each task checks that it
# read the version the driver stat'ed (``BytePlace.digest``), and returns the digests. The driver
# keeps what ``hash_inputs`` does around them: the stats, the hash cache filled from the results
# (with the racy rule's recording time taken before the stats), the failures by name, the
# progress, the manifest published only once every digest is in.
#
# Tar shards and table files the hash cache does not know are read the same way (the
# ``containers`` reader of :class:`ClusterDigests`): each container by one task, whole (its
# members in tar order, its cells a row group at a time), a task taking several small ones up to
# :func:`hash_rows_per_task` new items (:func:`container_tasks`); what a task reads a container
# by is what the driver's scan found (:class:`~featbake.encode.fingerprints.ContainerRead`: a
# tar's member offsets and the stat it was listed at, a table's column, kind of cell and the stat
# its rows were scanned at: a local container that is not that version fails its items there),
# and it returns the digests with the container's stat as of its reading, which the driver checks
# against the one it looked up, as it checks its own readings. The threshold counts the new items
# (members, cells), as it counts a folder's new files: an item is an input either way, and one
# shard of a million members is worth a task where a folder of 10 small tars is not.
#
# The tasks themselves (:func:`digest_batch`, :func:`read_batch`) are in bake/ray_hashing.py: Ray
# pickles a task's function by its module, which the worker imports, and this one imports torch
# (seconds of CPU in each worker process, for a task that needs none).


@dataclass(frozen=True)
class ClusterDigests:
    """A Ray build's :class:`~featbake.encode.fingerprints.Digester`: inputs read and hashed in
    Ray tasks when there are enough of them (:func:`hash_site`), else on the driver
    (:func:`~featbake.encode.fingerprints.digest_here`).

    ``connecting``: the build's connection to Ray, waited for before the first task; None: a
    session of its own (:func:`ray_session`) for each call.
    """

    address: str | None
    cluster_from: int = CLUSTER_HASHING_FROM
    connecting: Connecting | None = None

    def __call__(self, place: BytePlace, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
        self.needed(len(asks))
        if hash_site(len(asks), self.cluster_from) is HashSite.DRIVER:
            return digest_here(place, asks)
        return self.on_cluster(asks, digested_by_tasks)

    def containers(self, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
        """The :class:`~featbake.encode.fingerprints.ContainerDigester` beside it: containers
        (a tar shard, a table file) read in Ray tasks when they hold enough new items (members,
        cells: :func:`hash_site` counts items, as it counts a folder's files), else on the
        driver (:func:`~featbake.encode.fingerprints.read_here`)."""
        self.needed(len(asks))
        if hash_site(sum(a.items for a in asks), self.cluster_from) is HashSite.DRIVER:
            return read_here(asks)
        return self.on_cluster(asks, containers_read_by_tasks)

    def needed(self, new: int) -> None:
        """Start connecting to Ray where the build has ``new`` inputs the hash cache does not
        know: new inputs are mostly encoded, so Ray starts while they are hashed here."""
        if new and self.connecting is not None:
            self.connecting.start()

    def on_cluster(
        self, asks: Sequence[A], by_tasks: Callable[[Any, Sequence[A]], Iterator[T]]
    ) -> Iterator[T]:
        """Each of ``asks`` done in Ray tasks by ``by_tasks`` (:func:`digested_by_tasks`,
        :func:`containers_read_by_tasks`), as the tasks return."""
        if self.connecting is None:
            with ray_session(self.address) as ray:
                yield from by_tasks(ray, asks)
            return
        self.connecting.wait()
        yield from by_tasks(_ray(), asks)


def digested_by_tasks(ray: Any, asks: Sequence[DigestAsk]) -> Iterator[Digested]:
    """``asks`` in Ray tasks of :func:`hash_rows_per_task` inputs, each task's results as it
    returns; tasks not yet done are cancelled if the caller stops (Ctrl-C, an error).

    Raises:
        FeatbakeError: what a task raised, as its own class with its own line.
    """
    per_task = hash_rows_per_task(len(asks), int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1)(digest_batch)
    driver = this_host()
    sent = [DigestAsk(a.path, a.stat) for a in asks]  # no holder: nothing kept on the driver
    runs = [sent[i : i + per_task] for i in range(0, len(sent), per_task)]
    yield from map(
        vouched, as_returned(ray, [task.remote(run, driver, ENGINE_PROTOCOL) for run in runs])
    )


def vouched(done: Digested) -> Digested:
    """A task's digest of a file, if the driver's own stat of the file is still the one the
    digest came back at (the one the driver asked with), else the file changed while read.

    A task on another host reads a file whose size and mtime are the driver's as that version
    (:class:`SeenHere`), but a file rewritten in place with its mtime put back keeps both: only
    its ctime moves, which the driver's host sees and another host's mount may not. Unchanged
    here from the driver's stat before the task to this one after it, the file had no write
    in between, so the task read the bytes the driver's stat is of: what the hash cache may
    record. An object's stat (its ETag) is every host's: taken as it came."""
    if isinstance(done.got, str) or bytes_at(done.path).versioned:
        return done
    if container_stat(done.path) == done.got.stat:
        return done
    return Digested(done.path, CHANGED_WHILE_READ)


def vouched_container(done: ContainerDigested) -> ContainerDigested:
    """A task's reading of a tar or table file, if the driver's own stat of it is still the one
    the reading came back at (the stat the driver listed its members or scanned its rows at),
    else at no stat: each of its items then fails as changed while read (see :func:`vouched`;
    a tar rewritten with its members reordered and its mtime kept would have each read at
    another member's offsets)."""
    stat = done.got.stat
    if stat is None or bytes_at(done.container).versioned or container_stat(done.container) == stat:
        return done
    return replace(done, got=done.got._replace(stat=None))


def containers_read_by_tasks(ray: Any, asks: Sequence[ContainerAsk]) -> Iterator[ContainerDigested]:
    """``asks``' containers in Ray tasks (:func:`container_tasks`: whole containers, about
    :func:`hash_rows_per_task` new items a task), each task's results as it returns; tasks not
    yet done are cancelled if the caller stops.

    Raises:
        FeatbakeError: what a task raised, as its own class with its own line.
    """
    items = [a.items for a in asks]
    per_task = hash_rows_per_task(sum(items), int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1)(read_batch)
    driver = this_host()
    sent = [replace(a, held=None) for a in asks]  # nothing kept on the driver
    runs = [[sent[i] for i in run] for run in container_tasks(items, per_task)]
    returned = as_returned(ray, [task.remote(run, driver, ENGINE_PROTOCOL) for run in runs])
    yield from map(vouched_container, returned)


def as_returned(ray: Any, pending: list[Any]) -> Iterator[Any]:
    """The results of the hashing tasks ``pending`` (:class:`HashedBatch`), each task's as it
    returns; the tasks not yet done cancelled if the caller stops (Ctrl-C, an error).

    Raises:
        FeatbakeError: what a task raised, as its own class with its own line.
    """
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                batch: HashedBatch[Any] = ray.get(ready[0])
            except ray.exceptions.RayError as e:  # its worker died, ran out of memory, ...
                raise task_lost(e, len(pending)) from None
            yield from batch.digested  # what it did before any error: kept
            batch.raise_error()
    finally:
        for ref in pending:
            ray.cancel(ref)


def task_lost(error: BaseException, pending: int) -> BuildIncomplete:
    """The one line for a hashing task Ray could not run to its end (its worker or node lost
    after Ray's own retries, out of memory, or an error that is not featbake's)."""
    return BuildIncomplete(
        f"a Ray task hashing the inputs failed ({_ray_why(error)}); {pending} more were "
        "cancelled. The digests that came back are kept: rerun the build to hash the rest (see "
        "the Ray dashboard or `ray logs` for the worker's side)"
    )


def encoding_lost(error: BaseException) -> BuildIncomplete:
    """The one line for an encoding task whose actor died under it :data:`TASK_TRIES` times
    (an input that ends the process encoding it, a node lost, out of memory)."""
    return BuildIncomplete(
        f"a Ray task encoding the inputs failed {TASK_TRIES} times, its actor gone each time "
        f"({_ray_why(error)}); what the tasks sealed is kept. If one input ends the process "
        "that encodes it (a crash in native code, out of memory), a plain build (--engine "
        "local) names it; then rerun the build (see `ray logs` for the worker's side)"
    )


def task_failed(error: BaseException) -> BuildIncomplete:
    """The one line for an encoding or reading task of Ray Data that raised what is not
    featbake's (a file of the dataset gone before it was read, a bug): before, Ray's wrapped
    traceback of dozens of lines, in colour."""
    return BuildIncomplete(
        f"a Ray task of the build failed ({_ray_why(error)}); what the tasks sealed is kept: "
        "rerun once the cause is fixed (see `ray logs` for the worker's side)"
    )


def _ray_why(error: BaseException) -> str:
    """What Ray's ``error`` says, in one line of at most 300 characters, without colours: a
    RayTaskError's cause (what the task raised); where that is Ray Data's wrapper of a map's
    error (``UserCodeException``, whose own line says only that a UDF failed), the last line
    of the traceback Ray carried back before it (the error the code raised)."""
    cause = getattr(error, "cause", None)  # a RayTaskError's: what the task itself raised
    wrapped, sep, _ = str(error).partition("\n\nThe above exception was the direct cause")
    if type(cause).__name__ == "UserCodeException" and sep and wrapped.strip():
        return re.sub(r"\x1b\[[0-9;]*m", "", wrapped.strip().splitlines()[-1].strip())[:300]
    error = cause if isinstance(cause, BaseException) else error
    first = re.sub(r"\x1b\[[0-9;]*m", "", first_line(error))  # Ray colours its lines
    name = type(error).__name__
    return (first if first == name else f"{name}: {first}")[:300]


def _results(ds: Any) -> Iterator[dict[str, Any]]:
    """``ds``'s rows as they come; the error a task carried back raised as itself (its class,
    its one line: Ray Data's ``UserCodeException`` keeps only a worker's traceback text); any
    other error of a task (a read of the dataset, code that is not featbake's) in one line.
    """
    from ray import exceptions as rx

    lost = (rx.ActorDiedError, rx.ActorUnavailableError, rx.WorkerCrashedError, rx.NodeDiedError)
    rows = iter(ds.iter_rows())
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (*lost, rx.OutOfMemoryError) as e:
            raise encoding_lost(e) from None
        except rx.RayTaskError as e:
            raise task_failed(e) from None
        if row[RESULT]:
            PartResult.from_json(row[RESULT]).raise_error()
        yield row


def _tick(progress: ProgressFn | None, total: PartResult, of: int) -> None:
    if progress is not None:
        failed = len(total.failed)
        progress(Progress("encode", total.items, of, total.bytes_written, failed, 0))


def _stat_text(stat: FileStat | None) -> str:
    return "" if stat is None else json.dumps(list(stat))


def _stat(text: str) -> FileStat | None:
    return None if not text else FileStat(*json.loads(text))


def _carried_bytes(value: object | None) -> bytes:
    """A work item's carried value (a manifest row's item, a text) as a column's bytes: pickled
    by the driver for its own actors, as Ray pickles what it sends them."""
    return b"" if value is None else pickle.dumps(value)


def _carried(data: Any) -> object | None:
    return None if not len(data) else pickle.loads(bytes(data))  # the driver pickled it


class PathActor:
    """One actor of a ``--engine ray`` build: a :class:`PartEncoder` over rows that name their
    inputs (read on the worker, where the build found them)."""

    def __init__(self, job: EngineJob) -> None:
        self.worker = Worker(job)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        columns = (batch["key"], batch["path"], batch["name"], batch["stat"], batch["carried"])
        items = [
            WorkItem(str(k), str(p), str(n), _stat(str(s)), _carried(c))
            for k, p, n, s, c in zip(*columns, strict=True)
        ]
        try:
            result = self.worker.part().encode(items)
        except FeatbakeError as e:  # --strict, a store that cannot be written: one line back
            result = PartResult.raised(e)
        return {RESULT: [result.to_json(self.worker.answering)]}


class Worker:
    """An actor's :class:`PartEncoder`, or the error making it raised (an encoder that does not
    load on this node), kept to be carried back by the actor's first task."""

    def __init__(self, job: EngineJob) -> None:
        self.error: FeatbakeError | None = None
        self.encoder: PartEncoder | None = None
        self.answering = job.sent_protocol()  # its driver's: the shape its results take
        try:
            self.encoder = PartEncoder(job)
        except FeatbakeError as e:
            self.error = e

    def part(self) -> PartEncoder:
        """The part encoder; raises the error that kept it from being made."""
        if self.encoder is None:
            assert self.error is not None
            raise self.error
        return self.encoder


# == a user's Ray Dataset ==========================================================================
class BytesActor:
    """One actor of :func:`encode`: hashes each row's bytes into its key (as a folder build
    hashes a file), encodes those the store lacks, returns (id, key) per row and the task's
    result on its first row."""

    def __init__(self, job: EngineJob, column: str, id_column: str | None) -> None:
        self.worker = Worker(job)
        self.job = job
        self.column = column
        self.id_column = id_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        try:
            return self.encoded(batch)
        except FeatbakeError as e:  # one row carries it back (see _results)
            answer = PartResult.raised(e).to_json(self.worker.answering)
            return {"id": [""], "key": [""], RESULT: [answer]}

    def encoded(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        """(id, key) of each row, the task's result on the first (see the class)."""
        worker, root = self.worker.part(), self.job.root
        datas = [_as_bytes(v, self.column) for v in batch[self.column]]
        keys = [
            feature_key(root.encoder_fp, root.recipe_fp, hashlib.sha256(d).hexdigest())
            for d in datas
        ]
        ids = [str(v) for v in batch[self.id_column]] if self.id_column else keys
        stored = worker.stored(keys)
        held: dict[str, bytes] = {}
        todo: dict[str, WorkItem] = {}
        for key, name, data in zip(keys, ids, datas, strict=True):
            if key not in stored and key not in todo:  # a key once, however many rows have it
                # Its bytes held by a name of their own: two rows of one id hold other bytes.
                path = name if name not in held else f"{name}#{key[:16]}"
                todo[key] = WorkItem(key, path, name)
                held[path] = data
        result = worker.encode(list(todo.values()), held)
        failed_alike(result, todo, zip(ids, keys, strict=True))
        result.reused = len({k for k in keys if k in stored})
        result.items = len(keys)
        first = [result.to_json(self.worker.answering)] + [""] * (len(keys) - 1)
        return {"id": ids, "key": keys, RESULT: first}


def failed_alike(
    result: PartResult, tried: Mapping[str, WorkItem], rows: Iterable[tuple[str, str]]
) -> None:
    """Add to ``result`` the failures of the other rows (id, key) of its batch holding the
    bytes of a row that failed (``tried``: the item tried for each key): each is an input that
    failed, as its twin did, not features a gc deleted.

    Example:
        >>> from featbake.bake.report import FailureCause
        >>> done = PartResult(failed=[Failure("a.wav", "bad")], causes=[FailureCause.DATA])
        >>> tried = {"k1": WorkItem("k1", "a.wav", "a.wav")}
        >>> failed_alike(done, tried, [("a.wav", "k1"), ("b.wav", "k1")])
        >>> [f.name for f in done.failed], len(done.causes)
        (['a.wav', 'b.wav'], 2)
    """
    why = {f.name: (f, cause) for f, cause in zip(result.failed, result.causes, strict=True)}
    tried_as = {key: it.name for key, it in tried.items()}
    for name, key in rows:
        twin = why.get(tried_as.get(key, ""))
        if twin is not None and name != twin[0].name:
            result.failed.append(Failure(name, twin[0].reason))
            result.causes.append(twin[1])


def repeated_id(items: Sequence[tuple[str, str]]) -> str | None:
    """An id that names two inputs of different bytes among ``items`` (id, key), if any (pure).

    Example:
        >>> repeated_id([("x", "k1"), ("y", "k2"), ("x", "k1")])
        >>> repeated_id([("x", "k1"), ("x", "k2")])
        'x'
    """
    seen: dict[str, str] = {}
    for name, key in items:
        if seen.setdefault(name, key) != key:
            return name
    return None


def _as_bytes(value: Any, column: str) -> bytes:
    """A cell's bytes: a binary cell, or the ``bytes`` field of an Audio/Image struct."""
    if isinstance(value, dict):
        value = value.get("bytes")
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        value = value.tobytes()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ConfigError(
            f"column {column!r} holds {type(value).__name__}, not bytes: give the column of each "
            "input's bytes (read_binary_files: 'bytes'; an Audio/Image struct with 'bytes')"
        )
    return bytes(value)


def encode(  # noqa: PLR0913  (public API: one keyword per option, as in build())
    ds: Any,
    *,
    encoder: str | os.PathLike[str] | torch.nn.Module,
    cache: StoreRef = None,
    column: str,
    id_column: str | None = None,
    workers: int = 2,
    num_gpus: float = 0,
    weights: str | os.PathLike[str] | None = None,
    trust_pickle: bool = False,
    batch_size: int = 16,
    **recipe_options: Any,
) -> BuildReport:
    """Encode a user's Ray Dataset into the store, the misses on an actor pool.

    Args:
        ds: a ``ray.data.Dataset`` whose ``column`` holds each input's bytes.
        encoder: a TorchScript/.pt2 path, an import path (importable on the workers), or a
            module (sent to each worker).
        cache: the store (a directory every worker sees, or a bucket).
        column: the column of bytes (``read_binary_files``: ``bytes``).
        id_column: the column naming each item in the root's manifest (e.g. ``path``); by
            default each item is named by its key.
        workers: actors in the pool; ``num_gpus``: GPUs each holds.
        weights, trust_pickle, batch_size: as in :func:`featbake.build`.
        recipe_options: :class:`featbake.Recipe`'s fields (``sample_rate=16000``, ``dtype=``).

    Returns:
        The build's :class:`BuildReport` (``failed`` names the inputs that did not decode).

    Example:
        >>> ds = ray.data.read_binary_files("/shared/audio", include_paths=True)  # doctest: +SKIP
        >>> featbake.ray.encode(ds, encoder="ckpt.pt", cache="/shared/feats", column="bytes",
        ...                     id_column="path", workers=8, num_gpus=1)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    recipe = recipe_for_encoder(encoder, Recipe(**recipe_options))
    layout = open_store(cache, need=Need.WRITE).ensure()
    where = f"ray:{id_column or column}"
    with contextlib.closing(FragmentCatalog(layout, RankPart(0, 1, ()))) as keyed:
        enc = BuildEncoder.named(encoder, weights, torch.device("cpu"), trust_pickle, recipe, keyed)
        enc_fp, recipe_fp = enc.fingerprint(keyed), recipe.fingerprint()
    root = RootSpec(root_id(where, enc.label, recipe_fp, column), where, enc.label, enc_fp,
                    recipe_fp, recipe.as_dict())  # fmt: skip
    options = BakeOptions(batch_size, 0, on_gpu=num_gpus > 0)
    runs = RunnerSpec("auto", batch_size, budget_samples(recipe, None, None))
    job = EngineJob(layout, root, enc.kind, encoder, weights, trust_pickle,
                    "cuda" if num_gpus > 0 else "cpu", recipe, runs, options, None,
                    encoder_state=enc.state())  # fmt: skip
    engine = RayEngine(workers, num_gpus)
    items, total = _encode_rows(ds, job, engine, column, id_column)
    if (twice := repeated_id(items)) is not None:
        raise ConfigError(
            f"the id {twice!r} of column {id_column!r} names inputs of different bytes; give "
            "each row an id of its own, or leave id_column out (each item is then named by its "
            "key). What was encoded is kept: the next run reuses it"
        )
    report = BuildReport(root.name, where, enc.label, enc_fp, recipe_fp, len(items))
    total.add_to(report)
    report.duplicates = len(items) - len({k for _, k in items})
    _publish(layout, root, enc.kind, items, {name for name, _ in report.failed})
    report.merged = True
    report.seconds = time.perf_counter() - t0
    return report


def _encode_rows(
    ds: Any, job: EngineJob, engine: RayEngine, column: str, id_column: str | None
) -> tuple[list[tuple[str, str]], PartResult]:
    """(id, key) of every row of ``ds``, and what the actors did."""
    items: list[tuple[str, str]] = []
    total = PartResult()
    with ray_session(engine.address) as ray:
        quiet(ray)
        _check_columns(ds, column, id_column)
        _leave_a_cpu_to_reads(ray, engine)
        per_task = engine.rows_per_task or ROWS_PER_TASK  # rows holding their bytes: small
        out = engine.on_actors(ray, ds, BytesActor, (job, column, id_column), per_task)
        for row in _results(out):
            items.append((str(row["id"]), str(row["key"])))
            if row[RESULT]:
                total.add(PartResult.from_json(row[RESULT]))
    return items, total


def _check_columns(ds: Any, column: str, id_column: str | None) -> None:
    """Refuse a ``column`` or ``id_column`` that ``ds`` lacks, on the driver, before anything
    is mapped: before, each actor's first task raised a KeyError that came back as Ray's
    traceback. A dataset whose schema is not known (None) is taken as it is.

    Raises:
        ConfigError: the name it lacks, and the columns it has.
        BuildIncomplete: reading the dataset for its schema failed (:func:`task_failed`).
    """
    from ray import exceptions as rx

    try:
        schema = ds.schema()
    except rx.RayTaskError as e:  # a read task of the dataset: its file gone, unreadable
        raise task_failed(e) from None
    names = [] if schema is None else list(schema.names)
    for option, name in (("column", column), ("id_column", id_column)):
        if names and name is not None and name not in names:
            raise ConfigError(
                f"{option}={name!r} is not a column of the dataset (its columns: "
                f"{', '.join(names)}): give {option} one of them"
            )


def _leave_a_cpu_to_reads(ray: Any, engine: RayEngine) -> None:
    """Refuse an actor pool that takes every CPU of the cluster: the dataset's read tasks
    (``read_binary_files``, ``read_parquet``) would wait for a CPU forever.

    Raises:
        ConfigError: ``workers`` CPU actors on a cluster of at most that many CPUs.
    """
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if engine.gpus_per_worker == 0 and engine.workers >= cpus:
        raise ConfigError(
            f"workers={engine.workers} actors take every CPU of the Ray cluster ({cpus}), and "
            f"the dataset's read tasks need one: use workers={max(1, cpus - 1)} or fewer"
        )


def _publish(
    layout: Any,
    root: RootSpec,
    encoder_kind: str,
    items: list[tuple[str, str]],
    failed: set[str],
) -> None:
    """Seal the root's manifest (items by id) as a build's ``done`` fragment, and merge; the
    keys the actors found stored are checked first (:func:`check_still_stored`).

    Raises:
        StoreError: a gc deleted some of what the actors reused (run it again).
    """
    items = sorted(dict(items).items())
    listing = [(name, 0) for name, _ in items]
    with contextlib.closing(FragmentCatalog(layout, RankPart(0, 1, listing))) as catalog:
        check_still_stored(catalog, [k for name, k in items if name not in failed])
        catalog.record_encoder(root.encoder_fp, root.encoder_label, encoder_kind)
        catalog.replace_root(root, items)
        catalog.finish()
    place_of(layout).merge()


def check_still_stored(catalog: FragmentCatalog, keys: Sequence[str]) -> None:
    """Raise unless every one of ``keys`` (the rows that did not fail) is stored or named by a
    sealed fragment (the actors' shards), looked up under the driver's own claim.

    An actor found some keys stored and reused them, claiming nothing: between its lookup and
    the ``done`` fragment naming them a gc may have deleted their rows. The driver claims them
    now (``present_keys``; a bucket store: the newest catalog version first, then its own look
    again before its ``done`` fragment, store/fragment_catalog.py), so nothing goes after this
    look; what went before it is said in one line.

    Raises:
        StoreError: some went (a gc deleted features the actors reused while they ran).
    """
    place_of(catalog.layout).sync_catalog()
    gone = set(keys) - catalog.present_keys(sorted(set(keys)))
    if gone:
        raise StoreError(
            f"a gc deleted {len(gone)} stored features this encode reused while it ran (the "
            "store lacks them now); run it again: it encodes them"
        )
