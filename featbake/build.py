"""The bake: plan missing keys -> decode in workers -> batch by shape -> encode -> write behind.

::

    scan files -> hash (cached) -> key -> publish the root manifest -> skip what is cataloged
               -> decode + preprocess (DataLoader workers) -> batches of equal shape -> encoder
               -> writer thread: fill shard -> seal (tmp, fsync, rename) -> catalog transaction

The encoder never waits on the disk: decoding runs ahead in workers, writing runs behind in a
thread. An interrupted build keeps every sealed shard and, on Ctrl-C, seals the one being filled;
a rerun encodes only what is not cataloged. A bad input is skipped, named with its reason, and
reported at the end (``strict=True`` stops at the first one instead).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from featbake.catalog import Catalog, FileStat
from featbake.encoders import (
    PICKLE,
    LoadedEncoder,
    detect_kind,
    from_module,
    load_encoder,
    split_outputs,
)
from featbake.errors import ConfigError, EncodeError, FeatbakeError, SourceError
from featbake.keys import feature_key, file_fingerprint, resolve_path, root_id, sha256_hex
from featbake.recipe import Recipe
from featbake.sources import Source, scan, source_for
from featbake.store import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_ITEMS,
    Layout,
    ShardWriter,
    default_cache_dir,
)

_HASH_THREADS = 4


@dataclass(frozen=True)
class Progress:
    """A progress report: ``phase`` is "hash" or "encode"; counts are items."""

    phase: str
    done: int
    total: int
    bytes_written: int = 0
    failed: int = 0


@dataclass
class BuildReport:
    """What a build did. ``failed`` lists (relative path, reason) for each skipped input."""

    root: str
    data: str
    encoder: str
    encoder_fp: str
    recipe_fp: str
    files: int = 0
    encoded: int = 0
    reused: int = 0
    duplicates: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    bytes_written: int = 0
    shards_written: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the report (``featbake build --json``)."""
        d = asdict(self)
        d["failed"] = [{"path": p, "reason": r} for p, r in self.failed]
        return d


# -- planning --------------------------------------------------------------------------------
def hash_inputs(
    catalog: Catalog,
    paths: Sequence[str],
    progress: Callable[[Progress], None] | None = None,
    stats: dict[str, FileStat] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """SHA-256 of each file, re-reading only files whose (size, mtime_ns, inode) changed.

    Args:
        catalog: whose hash cache to consult and fill.
        paths: the files to hash.
        progress: called as hashing advances.
        stats: if given, filled with path -> the FileStat each digest belongs to, so a later
            reader can tell whether the file changed since (see :class:`_Decode`).

    Returns:
        (path -> sha256, path -> reason for files that could not be read)
    """
    stats = {} if stats is None else stats
    failed: dict[str, str] = {}
    for p in paths:
        try:
            stats[p] = FileStat.of(p)
        except OSError as e:
            failed[p] = f"cannot stat: {e.strerror}"
    cached = catalog.cached_hashes(list(stats))
    digests = {p: cached[p][1] for p, st in stats.items() if p in cached and cached[p][0] == st}
    todo = [p for p in stats if p not in digests]
    done = len(digests)
    if progress:
        progress(Progress("hash", done, len(paths)))
    fresh: list[tuple[str, FileStat, str]] = []

    def one(p: str) -> tuple[str, str | None, str | None]:
        try:
            return p, file_fingerprint(p), None
        except OSError as e:
            return p, None, f"cannot read: {e.strerror}"

    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        for p, sha, err in pool.map(one, todo):
            done += 1
            if sha is None:
                failed[p] = err or "unreadable"
            else:
                digests[p] = sha
                fresh.append((p, stats[p], sha))
            if progress and (done % 256 == 0 or done == len(paths)):
                progress(Progress("hash", done, len(paths)))
    catalog.put_hashes(fresh)
    return digests, failed


def _encoder_cache_id(encoder: LoadedEncoder, weights: str | None) -> tuple[str, str] | None:
    """(hash-cache id, backing file) for an encoder whose fingerprint can be cached, else None.

    A TorchScript or .pt2 file holds its architecture and weights, so its fingerprint depends on
    the file alone. An import-path encoder's architecture lives in code, so its id includes the
    identity (its repr and code digest) beside the weights file. A pickle's class lives in code
    too: its id includes the identity beside the file, under an ``encoder-fp:pickle:`` prefix
    that :func:`cached_file_encoder_fp` never looks up (a pickle cannot be vouched for unloaded).
    """
    if weights is not None:
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(weights)}".encode())
        return f"encoder-fp:import:{ident}", weights
    if encoder.kind == PICKLE and os.path.isfile(encoder.label):
        ident = sha256_hex(f"{encoder.identity}\n{resolve_path(encoder.label)}".encode())
        return f"encoder-fp:pickle:{ident}", encoder.label
    if encoder.kind != "module" and os.path.isfile(encoder.label):
        return file_encoder_cache_id(encoder.label), encoder.label
    return None


def file_encoder_cache_id(path: str | os.PathLike[str]) -> str:
    """The hash-cache id under which a file encoder's fingerprint is remembered."""
    return f"encoder-fp:file:{resolve_path(path)}"


def cached_file_encoder_fp(catalog: Catalog, path: str | os.PathLike[str]) -> str | None:
    """A file encoder's fingerprint without loading it, if the file is unchanged since last time.

    This lets a dataset map inputs to keys (and serve hits) without ever loading the encoder.
    Always None for a pickled module: its fingerprint depends on its class's source code too,
    which only loading it reveals (and the build never caches it under this file id).
    """
    if detect_kind(Path(path)) == PICKLE:
        return None  # also ignores file-id entries written before pickles were keyed by code
    ident = file_encoder_cache_id(path)
    hit = catalog.cached_hashes([ident]).get(ident)
    try:
        return hit[1] if hit and hit[0] == FileStat.of(path) else None
    except OSError:
        return None


def encoder_fingerprint(encoder: LoadedEncoder, catalog: Catalog, weights: str | None) -> str:
    """The encoder's fingerprint, cached in the hash cache against its file's stat.

    Hashing a large checkpoint's weights costs a full pass over them; an unchanged file (same
    size, mtime and inode) reuses the last result, as input files do.
    """
    cache = _encoder_cache_id(encoder, weights)
    if cache is None:
        return encoder.fingerprint
    ident, backing = cache
    st = FileStat.of(backing)
    hit = catalog.cached_hashes([ident]).get(ident)
    if hit and hit[0] == st:
        encoder._fingerprint = hit[1]
        return hit[1]
    fp = encoder.fingerprint
    catalog.put_hashes([(ident, st, fp)])
    return fp


# -- batching (pure) ---------------------------------------------------------------------------
class ShapeBatcher:
    """Groups items of equal shape into batches of up to ``batch_size``.

    Items of a shape seen rarely would wait forever; once more than ``max_pending`` items are
    held, the largest group is released as a (smaller) batch, so memory stays bounded.
    """

    def __init__(self, batch_size: int, max_pending: int | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.max_pending = max_pending or 4 * batch_size
        self._groups: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()
        self._pending = 0

    def add(self, shape: tuple[int, ...], item: Any) -> list[list[Any]]:
        """Add an item; return the batches that are now ready (possibly none)."""
        group = self._groups.setdefault(shape, [])
        group.append(item)
        self._pending += 1
        ready = []
        if len(group) >= self.batch_size:
            ready.append(self._take(shape))
        while self._pending > self.max_pending:
            largest = max(self._groups, key=lambda s: len(self._groups[s]))
            ready.append(self._take(largest))
        return ready

    def flush(self) -> list[list[Any]]:
        """Every remaining group as a batch."""
        return [self._take(s) for s in list(self._groups)]

    def _take(self, shape: tuple[int, ...]) -> list[Any]:
        group = self._groups.pop(shape)
        self._pending -= len(group)
        return group


# -- decoding in workers ---------------------------------------------------------------------
class _Decode(Dataset):
    """Item i -> (i, tensor) or (i, reason) so one bad file cannot stop a worker.

    The key was computed from the bytes hashed earlier; a file rewritten since would put its new
    features under the old bytes' key (served to every copy of the old file). So after decoding,
    the file is stat'ed again: if it no longer matches the stat its digest belongs to, the item
    fails instead.
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
        path = self.paths[i]
        try:
            x = self.source.load(path)
            try:
                now: FileStat | None = FileStat.of(path)
            except OSError:
                now = None
            if self.stats[i] is None or now != self.stats[i]:
                return i, f"{path}: changed while featbake was reading it; rerun the build"
            return i, x
        except SourceError as e:
            return i, str(e)
        except Exception as e:
            return i, f"{self.paths[i]}: {type(e).__name__}: {e}"


def _ignore_sigint(_worker_id: int) -> None:
    # A terminal's Ctrl-C reaches the whole process group: workers must leave it to the main
    # process, which stops at a safe point and shuts them down (see _interrupt_at_safe_points).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _decoded(
    paths: Sequence[str], source: Source, workers: int, stats: Sequence[FileStat | None]
) -> Iterator[tuple[int, Any]]:
    ds = _Decode(paths, source, stats)
    if workers == 0 or len(paths) < 2:
        yield from (ds[i] for i in range(len(ds)))
        return
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=min(workers, len(paths)),
        prefetch_factor=8,
        persistent_workers=False,
        worker_init_fn=_ignore_sigint,
    )
    yield from loader


# -- writing behind --------------------------------------------------------------------------
class _WriterThread:
    """Fills and seals shards in a background thread; the caller only enqueues features."""

    _STOP = object()

    def __init__(self, layout: Layout, encoder_fp: str, recipe_fp: str, shard_bytes: int) -> None:
        self.layout = layout
        self.bytes_written = 0
        self.shards = 0
        self.new_rows = 0
        self.error: BaseException | None = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize=256)
        self._writer = ShardWriter(
            layout, encoder_fp, recipe_fp, target_bytes=shard_bytes, max_items=DEFAULT_SHARD_ITEMS
        )
        self._thread = threading.Thread(target=self._run, name="featbake-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        catalog = Catalog(self.layout)  # sqlite connections belong to the thread that made them

        def publish(shard: Any) -> None:
            self.new_rows += catalog.add_shard(shard)
            self.bytes_written += shard.nbytes
            self.shards += 1

        self._writer.on_seal = publish
        try:
            while (item := self._q.get()) is not self._STOP:
                self._writer.add(*item)
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
            catalog.close()

    @property
    def bytes_so_far(self) -> int:
        """Bytes sealed plus bytes waiting in the shard being filled (approximate, lock-free)."""
        return self.bytes_written + self._writer.pending_bytes

    def put(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        if self.error is not None:
            raise self.error
        self._q.put((key, parts))

    def close(self) -> None:
        """Seal what is pending and wait; re-raise the thread's error, if any."""
        self._q.put(self._STOP)
        # A KeyboardInterrupt that landed inside an earlier Queue.put can lose the wake-up of a
        # waiting get(): nudge the writer until it has seen the stop mark, never wait blindly.
        while self._thread.is_alive():
            self._thread.join(0.2)
            with self._q.not_empty:
                self._q.not_empty.notify_all()
        if self.error is not None:
            raise self.error


@contextmanager
def _interrupt_at_safe_points() -> Iterator[Callable[[], None]]:
    """Turn Ctrl-C into a KeyboardInterrupt at the next checkpoint (between items).

    A KeyboardInterrupt raised at an arbitrary bytecode can land inside ``queue.Queue.put`` and
    lose the writer's wake-up, hanging the seal that Ctrl-C promises. The first SIGINT only
    sets a flag; a second one raises at once. Outside the main thread (where signal handlers
    cannot be installed) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    hits: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    def checkpoint() -> None:
        if hits:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield checkpoint
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if hits:  # a Ctrl-C that came after the last checkpoint still stops the caller
        raise KeyboardInterrupt


# -- encoding ----------------------------------------------------------------------------------
def encode_batch(
    encoder: LoadedEncoder, inputs: Sequence[torch.Tensor], recipe: Recipe
) -> list[dict[str, torch.Tensor]]:
    """Encode equal-shape inputs together; one dict of output parts per input, on the CPU.

    Raises:
        EncodeError: the encoder failed or returned outputs without a matching batch dimension.
    """
    batch = torch.stack(list(inputs))
    named = split_outputs(encoder.run(batch), recipe.output)
    out: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
    for part, value in named.items():
        if value.dim() == 0 or value.shape[0] != len(inputs):
            raise EncodeError(
                f"encoder output {part or 'tensor'} has shape {tuple(value.shape)}, expected a "
                f"leading batch dimension of {len(inputs)}"
            )
        value = value.detach().to("cpu", recipe.torch_dtype)
        for i in range(len(inputs)):
            out[i][part] = value[i].clone()  # own storage: a slice would pin the whole batch
    return out


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for CUDA, but no CUDA device is available here")
    return dev


def build(
    data: str | os.PathLike[str],
    encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
    *,
    cache: str | os.PathLike[str] | None = None,
    recipe: Recipe | None = None,
    weights: str | os.PathLike[str] | None = None,
    trust_pickle: bool = False,
    batch_size: int = 16,
    workers: int = 2,
    device: str | torch.device = "cpu",
    strict: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[Progress], None] | None = None,
) -> BuildReport:
    """Run ``encoder`` over every input under ``data`` once and store the features.

    Args:
        data: the data folder (scanned recursively, in sorted order).
        encoder: a TorchScript/.pt2 path, an import path, or an already loaded encoder.
        cache: the store directory (default ``$FEATBAKE_CACHE`` or ``./.featbake``).
        recipe: preprocessing and storage options (part of every key).
        weights: safetensors weights for an import-path encoder.
        trust_pickle: allow a pickled whole-module checkpoint (runs its code).
        batch_size: inputs per encoder call (inputs of equal shape batch together).
        workers: DataLoader worker processes for decoding (0: decode in this process).
        device: where the encoder runs.
        strict: stop at the first bad input instead of skipping it.
        shard_bytes: target shard size.
        progress: called with :class:`Progress` as hashing and encoding advance.

    Returns:
        A :class:`BuildReport`; ``report.failed`` names each input that was skipped.

    Raises:
        SourceError, EncodeError: with ``strict``, the first bad input.
        ConfigError: also from the first batch, for an ``output`` the encoder does not return.
        EncoderLoadError, StoreError, ConfigError: nothing could be built.

    Example:
        >>> report = build("./audio", "ckpt.pt", cache=".featbake")  # doctest: +SKIP
        >>> report.encoded, report.reused  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    recipe = recipe or Recipe()
    if workers < 0:
        raise ConfigError(f"--workers must be 0 or more, got {workers}")
    dev = _check_device(device)
    layout = Layout(Path(cache) if cache is not None else default_cache_dir()).ensure()
    catalog = Catalog(layout)
    source = source_for(recipe)
    data_dir = resolve_path(data)
    rel_paths = scan(data_dir, source.extensions)

    if isinstance(encoder, LoadedEncoder):
        enc = encoder
    elif isinstance(encoder, torch.nn.Module):
        enc = from_module(encoder, device=dev)
    else:
        enc = load_encoder(encoder, weights=weights, device=dev, trust_pickle=trust_pickle)
    enc_fp = encoder_fingerprint(enc, catalog, os.fspath(weights) if weights else None)
    recipe_fp = recipe.fingerprint()
    catalog.record_encoder(enc_fp, enc.label, enc.kind)
    name = root_id(data_dir, enc.label, recipe_fp)
    report = BuildReport(name, data_dir, enc.label, enc_fp, recipe_fp, files=len(rel_paths))

    abs_paths = [os.path.join(data_dir, p) for p in rel_paths]
    hashed_stats: dict[str, FileStat] = {}
    digests, unreadable = hash_inputs(catalog, abs_paths, progress, hashed_stats)
    manifest: list[tuple[str, str]] = []
    todo: dict[str, str] = {}  # key -> absolute path of its first file
    for rel, path in zip(rel_paths, abs_paths, strict=False):
        if path in unreadable:
            report.failed.append((rel, unreadable[path]))
            if strict:
                raise SourceError(f"{rel}: {unreadable[path]}")
            continue
        key = feature_key(enc_fp, recipe_fp, digests[path])
        manifest.append((rel, key))
        if key in todo:
            report.duplicates += 1
        todo.setdefault(key, path)
    # The manifest goes in first: it names keys, not features, so readers can map index -> key
    # (and gc keeps these keys live) while the features are still being encoded.
    catalog.replace_root(
        name,
        data=data_dir,
        encoder_label=enc.label,
        encoder_fp=enc_fp,
        recipe_fp=recipe_fp,
        recipe=recipe.as_dict(),
        items=manifest,
    )
    present = catalog.present_keys(list(todo))
    report.reused = len(present)
    work = [(k, p) for k, p in todo.items() if k not in present]
    if work:
        try:
            _encode_all(
                work,
                enc,
                recipe,
                source,
                layout,
                report,
                batch_size,
                workers,
                strict,
                shard_bytes,
                progress,
                data_dir,
                hashed_stats,
            )
        except ConfigError:
            # A wrong option (e.g. --output) stopped the build: the manifest it published would
            # only name keys that never get features.
            catalog.drop_root(name)
            catalog.close()
            raise
    elif progress:
        progress(Progress("encode", 0, 0))
    catalog.close()
    report.seconds = time.perf_counter() - t0
    return report


def _encode_all(
    work: list[tuple[str, str]],
    enc: LoadedEncoder,
    recipe: Recipe,
    source: Source,
    layout: Layout,
    report: BuildReport,
    batch_size: int,
    workers: int,
    strict: bool,
    shard_bytes: int,
    progress: Callable[[Progress], None] | None,
    data_dir: str,
    hashed_stats: dict[str, FileStat],
) -> None:
    keys = [k for k, _ in work]
    paths = [p for _, p in work]
    writer = _WriterThread(layout, enc.fingerprint, recipe.fingerprint(), shard_bytes)
    batcher = ShapeBatcher(batch_size)
    done = 0

    def rel(i: int) -> str:
        return os.path.relpath(paths[i], data_dir)

    def fail(i: int, reason: str, exc: type[FeatbakeError]) -> None:
        report.failed.append((rel(i), reason))
        if strict:
            raise exc(reason)

    def run(batch: list[tuple[int, torch.Tensor]]) -> None:
        nonlocal done
        try:
            results = encode_batch(enc, [x for _, x in batch], recipe)
        except EncodeError as e:
            if len(batch) > 1:  # find the culprit: retry one by one
                for item in batch:
                    run([item])
                return
            done += 1
            fail(batch[0][0], f"{rel(batch[0][0])}: {e}", EncodeError)
            return
        for (i, _), parts in zip(batch, results, strict=False):
            writer.put(keys[i], parts)
            report.encoded += 1
        done += len(batch)
        if progress:
            progress(Progress("encode", done, len(work), writer.bytes_so_far, len(report.failed)))

    with _interrupt_at_safe_points() as checkpoint:
        try:
            stats = [hashed_stats.get(p) for p in paths]
            for i, item in _decoded(paths, source, workers, stats):
                checkpoint()
                if isinstance(item, str):
                    done += 1
                    fail(i, item, SourceError)
                    continue
                for batch in batcher.add(tuple(item.shape), (i, item)):
                    run(batch)
            for batch in batcher.flush():
                checkpoint()
                run(batch)
        finally:
            # Seal what was encoded, also on Ctrl-C or a strict failure: nothing encoded is lost.
            writer.close()
            report.bytes_written = writer.bytes_written
            report.shards_written = writer.shards
    if progress:  # the last word has the bytes actually sealed (the writer runs behind)
        progress(Progress("encode", done, len(work), report.bytes_written, len(report.failed)))
