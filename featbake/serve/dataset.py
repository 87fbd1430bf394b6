"""``CachedFeatureDataset``: a map-style Dataset that serves baked features.

::

    index i -> key        (built once, in the process that creates the dataset: from the build's
                           root manifest and the hash cache; no raw input is opened on a hit)
            -> RAM LRU    (byte budget, per process; split between DataLoader workers)
            -> shard      (pread from a lazily opened shard, per process; CRC on first read)
            -> miss       (decode + encode live, write back to this process's own shards)

Where the keys come from. A folder that ``featbake build`` baked has a *root*: the manifest of
(relative path, key) that the build wrote for (folder, encoder as named, recipe). The dataset
finds it without loading the encoder: a file encoder's fingerprint is remembered in the catalog's
hash cache against the file's (size, mtime, inode), and must equal the fingerprint the root was
built with, else the manifest is stale (a checkpoint retrained in place) and is not used. Input
files are looked up in the hash cache the same way; a changed file is hashed again and gets its new
key (which then misses and is encoded), a file deleted after the build keeps its manifest key and is
still served from the store. Without a root (no build ran, or a list of paths) the inputs are
hashed once through the hash cache.

Per-process state (catalog connection, open shards, the RAM LRU, the live encoder, the write-back
shard) is created on first use in each process and never crosses ``fork`` or pickling, so each
DataLoader worker opens its own. Tables indexed by item live in numpy arrays rather than Python
lists so that forked workers do not copy them page by page as reference counts change.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

import featbake.device as dev
from featbake.encode.encoders import LoadedEncoder, from_module, is_import_path, load_encoder
from featbake.encode.fingerprints import (
    cached_file_encoder_fp,
    encoder_fingerprint,
    file_fingerprint,
    hash_inputs,
    resolve_path,
)
from featbake.encode.hf import is_hf_folder, recipe_for_encoder
from featbake.encode.outputs import encode_batch
from featbake.encode.sources import scan, source_for
from featbake.errors import (
    CacheMiss,
    ConfigError,
    EncoderLoadError,
    ShardMissing,
    SourceError,
)
from featbake.keys import feature_key, root_id, sha256_hex
from featbake.lru import ByteLRU, CacheInfo
from featbake.recipe import Recipe
from featbake.serve.collate import PaddedBatch, alloc_batch
from featbake.serve.layers import LayerView, check_layer_view, view_layers
from featbake.store.catalog import Catalog, FileStat
from featbake.store.layout import Layout, default_cache_dir
from featbake.store.reader import ShardReader
from featbake.store.shard_format import ST_TO_DTYPE, tensor_name
from featbake.store.writer import ShardWriter
from featbake.units import parse_bytes

__all__ = ["CachedFeatureDataset", "ServeStats"]

ON_MISS = ("encode", "error")
#: Write-back shards are sealed at this size, item count or age, so a killed worker loses little.
WRITEBACK_BYTES = 64 * 1024 * 1024
WRITEBACK_ITEMS = 256
WRITEBACK_SECONDS = 5.0
#: Last-use times are recorded at most this often per process, and each key at most once per
#: TOUCH_REPEAT_SECONDS: coarse on purpose (gc's LRU eviction needs days, not milliseconds).
TOUCH_FLUSH_SECONDS = 30.0
TOUCH_REPEAT_SECONDS = 3600.0
TOUCH_FLUSH_ITEMS = 50_000

_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class ServeStats:
    """What one process's dataset did (DataLoader workers each count their own).

    Attributes:
        ram: the RAM LRU's counters (hits, misses, evictions, bytes, budget).
        store_reads: items read from shards.
        encoded: items encoded live (misses).
        written: items written back to this process's shards (sealed or pending).
    """

    ram: CacheInfo
    store_reads: int
    encoded: int
    written: int

    @property
    def hits(self) -> int:
        return self.ram.hits

    @property
    def misses(self) -> int:
        return self.ram.misses

    @property
    def evictions(self) -> int:
        return self.ram.evictions

    @property
    def bytes(self) -> int:
        return self.ram.bytes

    @property
    def items(self) -> int:
        return self.ram.items


#: RAM-tier entries at least this big get their own anonymous mapping (see _mapped_empty).
_MAP_MIN_BYTES = 64 * 1024


def _mapped_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in its own anonymous memory mapping.

    Entries of the RAM tier come and go in every size; from the heap, their evictions would leave
    holes that malloc keeps (the worker's memory creeps above the budget). A mapping of its own
    goes back to the OS the moment the entry is evicted and no batch still uses it.
    """
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes < _MAP_MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)


def _resident_bytes(value: Any) -> int:
    """What a RAM-tier entry really occupies: mapped entries take whole pages."""
    if isinstance(value, Mapping):
        return sum(_resident_bytes(v) for v in value.values())
    nbytes = value.nbytes
    if nbytes < _MAP_MIN_BYTES:
        return nbytes
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _epoch_at(n: int) -> int:
    return (2 * n + 7) // 8 * 8


def _shared_bytes(n: int) -> int:
    return _epoch_at(n) + 8


def _recipe_from(recipe: Recipe | None, options: Mapping[str, Any]) -> Recipe:
    base = recipe or Recipe()
    changes = {k: v for k, v in options.items() if v is not None}
    return base.replace(**changes) if changes else base


def ram_budget_for_process(total: int) -> int:
    """The RAM tier's budget in this process: ``total`` split evenly between DataLoader workers.

    Splitting keeps the whole pipeline's memory at ``total`` plus a fixed overhead, whatever
    ``num_workers`` is (a per-worker budget would multiply it).

    Example:
        >>> ram_budget_for_process(1 << 30)  # in the main process
        1073741824
    """
    info = get_worker_info()
    return total if info is None else total // max(1, info.num_workers)


class _Sink:
    """What must be saved even when a dataset is dropped: write-back shards and last-use times.

    It holds no reference to the dataset or its caches, so the finalizer that saves it (at
    process exit, or when the dataset is collected) never keeps a dropped dataset alive.
    """

    def __init__(self, layout: Layout, keys: np.ndarray) -> None:
        self.gen = _fork_generation
        self.layout = layout
        self.catalog = Catalog(layout)
        self.thread = threading.get_ident()
        self.keys = keys
        self.writer: ShardWriter | None = None
        self.first_pending = 0.0
        self.touch_queue: list[int] = []
        self.last_touch_flush = time.monotonic()
        self.lock = threading.Lock()  # for the rare paths (write-back, flush), not for reads

    def catalog_here(self) -> Catalog:
        """The catalog connection for this thread (SQLite connections are bound to theirs).

        The finalizer can run in another thread when the garbage collector runs there.
        """
        if threading.get_ident() == self.thread:
            return self.catalog
        return Catalog(self.layout)

    @contextlib.contextmanager
    def catalog_scoped(self) -> Iterator[Catalog]:
        """:meth:`catalog_here`, closed afterwards when it was opened for another thread."""
        catalog = self.catalog_here()
        try:
            yield catalog
        finally:
            if catalog is not self.catalog:
                catalog.close()

    def seal(self) -> None:
        with self.lock:
            if self.writer is not None:
                self.writer.seal()
            self.first_pending = 0.0

    def flush_touch(self) -> None:
        self.last_touch_flush = time.monotonic()
        if not self.touch_queue:
            return
        queue = self.touch_queue[:]
        self.touch_queue.clear()
        catalog = self.catalog_here()
        with contextlib.suppress(Exception):  # last-use times are a hint: never fail a read
            catalog.touch(self.keys[i].decode() for i in queue)
        if catalog is not self.catalog:
            catalog.close()

    def close(self) -> None:
        self.seal()
        self.flush_touch()
        if threading.get_ident() == self.thread:
            self.catalog.close()


def _finalize(sink: _Sink) -> None:
    if sink.gen != _fork_generation:
        return  # a forked copy of the parent's sink: the parent saves its own
    try:
        sink.close()
    except Exception as e:  # at exit there is no caller left to raise to
        warnings.warn(f"featbake: could not seal written-back features: {e}", stacklevel=1)


class _Process:
    """Everything one process opens for the dataset; made on first use, never shared."""

    def __init__(self, ds: CachedFeatureDataset) -> None:
        self.gen = _fork_generation
        self.sink = _Sink(ds._layout, ds._keys)
        self.catalog = self.sink.catalog
        self.touch_queue = self.sink.touch_queue  # the same list: appended on the hot path
        self.readers: dict[int, ShardReader] = {}
        self.lru: ByteLRU[int, Any] = ByteLRU(
            ram_budget_for_process(ds._ram_total), getsizeof=_resident_bytes
        )
        self.use_lru = self.lru.max_bytes > 0
        self.encoder: LoadedEncoder | None = None
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # written, not yet sealed
        self.pending_idx: dict[str, list[int]] = {}
        n = len(ds)
        shared = ds._shared_map
        if shared is None:  # a spawned copy: this process keeps its own
            shared = mmap.mmap(-1, _shared_bytes(n))
        # [checksum checked: n bytes][last use recorded: n bytes][when recorded ones reset: f64]
        self.verified = np.frombuffer(shared, dtype=np.uint8, count=n)
        self.touched = np.frombuffer(shared, dtype=np.bool_, count=n, offset=n)
        self.touch_epoch = np.frombuffer(shared, dtype=np.float64, count=1, offset=_epoch_at(n))
        if not self.touch_epoch[0]:
            self.touch_epoch[0] = time.time()
        self.check_first = ds.verify == "first"
        self.check_always = ds.verify == "always"
        self.ops = 0
        self.store_reads = 0
        self.encoded = 0
        self.written = 0
        self.closed = False
        # Item -> (shard id, reader, file offset, nbytes, dtype, shape), filled on first read:
        # the hit path then costs one list index instead of key decoding and header lookups.
        # A per-process list (made after fork), so workers never copy the parent's pages.
        self.loc: list[tuple | None] = [None] * n


class CachedFeatureDataset(Dataset):
    """A map-style Dataset of a folder's (or a list of files') encoder features.

    ``ds[i]`` is the feature tensor of item ``i`` (a dict of tensors for an encoder with several
    outputs), exactly what the store holds and equal, within the stored dtype, to running the
    encoder now. The same recipe options as ``featbake build`` select the same keys, so a folder
    baked with the CLI is served with zero encoding and without opening one raw input.

    Args:
        data: a data folder (scanned recursively, sorted as ``featbake build`` does), or a
            sequence of file paths (served in the given order).
        encoder: the encoder as ``featbake build --encoder`` takes it (a TorchScript or ``.pt2``
            file, or an import path), a loaded encoder, or an ``nn.Module``. A file encoder is
            loaded only when the first miss happens (or once, to fingerprint it, when the store
            has never seen this file).
        cache: the store directory (default ``$FEATBAKE_CACHE`` or ``./.featbake``).
        recipe: preprocessing and storage options; the keyword options below override its fields.
        source, sample_rate, mono, max_seconds, output, dtype: recipe fields, as in
            ``featbake build``.
        weights: safetensors weights for an import-path encoder.
        trust_pickle: allow a pickled whole-module checkpoint (runs its code).
        ram_cache: byte budget of the RAM tier (``"2GiB"`` or an int; 0 disables it). It is the
            total for the whole pipeline: each of N DataLoader workers gets ``ram_cache / N``.
        on_miss: ``"encode"`` (encode live and write back) or ``"error"`` (raise CacheMiss).
        device: where misses are encoded. Inside a DataLoader worker forked after CUDA was
            initialised, CUDA cannot start, so misses there are encoded on the CPU; choose
            ``multiprocessing_context="spawn"`` (or ``"forkserver"``) to encode them on the GPU.
        verify: check each tensor's CRC-32 on its ``"first"`` read in a process, ``"always"``
            or ``"never"``.
        max_open_shards: open shard files kept per process.
        write_back: store features encoded on a miss so the next epoch hits.
        layers, precision: recipe fields, as ``featbake build --layers/--precision``.
        layer_view: with ``layers``, serve one layer (``6``: ``[T, D]``), a stacked subset
            (``[0, 6]``: ``[L, T, D]``) or every stored layer stacked (``"stack"``) instead of
            the dict of parts (see :mod:`featbake.serve.layers`).

    Raises:
        ConfigError: an invalid option.
        SourceError: the folder holds no inputs (and no build manifest), or inputs that are not
            in the store cannot be read.
        EncoderLoadError: the encoder had to be loaded (to fingerprint it) and could not be.

    Example:
        >>> ds = CachedFeatureDataset("./audio", "ckpt.pt", ram_cache="2GiB")  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=4,
        ...                     collate_fn=pad_collate)  # doctest: +SKIP
        >>> labels = [label_of(ds.path(i)) for i in range(len(ds))]  # doctest: +SKIP
    """

    def __init__(
        self,
        data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
        *,
        cache: str | os.PathLike[str] | None = None,
        recipe: Recipe | None = None,
        source: str | None = None,
        sample_rate: int | None = None,
        mono: bool | None = None,
        max_seconds: float | None = None,
        output: str | None = None,
        dtype: str | None = None,
        weights: str | os.PathLike[str] | None = None,
        trust_pickle: bool = False,
        ram_cache: int | str = 0,
        on_miss: str = "encode",
        device: str | torch.device = "cpu",
        verify: str = "first",
        max_open_shards: int = 64,
        write_back: bool = True,
        layers: Sequence[int] | str | None = None,
        precision: str | None = None,
        layer_view: LayerView = None,
    ) -> None:
        if on_miss not in ON_MISS:
            raise ConfigError(f"on_miss must be 'encode' or 'error', got {on_miss!r}")
        if verify not in ("first", "always", "never"):
            raise ConfigError(f"verify must be 'first', 'always' or 'never', got {verify!r}")
        if max_open_shards < 1:
            raise ConfigError(f"max_open_shards must be at least 1, got {max_open_shards}")
        self.recipe = _recipe_from(
            recipe,
            {
                "source": source,
                "sample_rate": sample_rate,
                "mono": mono,
                "max_seconds": max_seconds,
                "output": output,
                "dtype": dtype,
                "layers": tuple(layers) if isinstance(layers, (list, tuple)) else layers,
                "precision": precision,
            },
        )
        self._layer_view = check_layer_view(layer_view)
        self.recipe = recipe_for_encoder(encoder, self.recipe)  # a Hugging Face folder's input
        self.on_miss = on_miss
        self.verify = verify
        self.write_back = write_back
        self.max_open_shards = max_open_shards
        self._ram_total = parse_bytes(ram_cache)
        self._device = str(device)
        dev.resolve_device(device)  # validate now, not at the first miss
        self._layout = Layout(Path(cache) if cache is not None else default_cache_dir()).ensure()
        self._weights = os.fspath(weights) if weights is not None else None
        self._trust_pickle = trust_pickle
        self._recipe_fp = self.recipe.fingerprint()
        self._source = source_for(self.recipe)
        self._encoder_spec: str | None = None
        self._encoder_obj: LoadedEncoder | None = None
        self._state: _Process | None = None

        catalog = Catalog(self._layout)
        try:
            self._enc_fp, self._enc_label = self._fingerprint_encoder(encoder, catalog)
            rel_paths, keys, self._data_dir = self._index(data, catalog)
            self._set_tables(rel_paths, keys, catalog)
        finally:
            catalog.close()

    # -- construction (main process, once) ---------------------------------------------------
    def _fingerprint_encoder(self, encoder: Any, catalog: Catalog) -> tuple[str, str]:
        if isinstance(encoder, LoadedEncoder):
            self._encoder_obj = encoder
            return encoder_fingerprint(encoder, catalog, self._weights), encoder.label
        if isinstance(encoder, torch.nn.Module):
            enc = from_module(encoder, device=None)
            self._encoder_obj = enc
            return enc.fingerprint, enc.label
        spec = os.fspath(encoder)
        self._encoder_spec = spec
        if is_import_path(spec):
            label = spec  # the architecture lives in code: only loading it can fingerprint it
        else:
            if not os.path.isfile(spec) and not is_hf_folder(spec):
                raise EncoderLoadError(
                    f"encoder {spec} not found; give the TorchScript (.pt) or torch.export "
                    "(.pt2) file or the import path you passed to `featbake build --encoder`"
                )
            label = str(Path(spec).resolve())
            fp = cached_file_encoder_fp(catalog, spec) if self._weights is None else None
            if fp is not None:
                return fp, label
        enc = self._load_encoder(torch.device("cpu"))
        catalog.record_encoder(enc.fingerprint, enc.label, enc.kind)
        self._encoder_obj = enc  # reused for misses in this process
        return enc.fingerprint, label

    def _load_encoder(self, device: torch.device) -> LoadedEncoder:
        assert self._encoder_spec is not None
        enc = load_encoder(
            self._encoder_spec,
            weights=self._weights,
            device=device,
            trust_pickle=self._trust_pickle,
            layers=self.recipe.layers,
        )
        catalog = Catalog(self._layout)
        try:
            encoder_fingerprint(enc, catalog, self._weights)
        finally:
            catalog.close()
        return enc

    def _index(self, data: Any, catalog: Catalog) -> tuple[list[str], list[str], str | None]:
        """(paths relative to the folder, or absolute; keys; the resolved folder or None)."""
        if isinstance(data, (str, os.PathLike)):
            return self._index_folder(resolve_path(data), catalog)
        paths = [resolve_path(p) for p in data]
        if not paths:
            raise SourceError("the list of input files is empty")
        digests, failed = hash_inputs(catalog, paths)
        self._raise_unreadable([p for p in paths if p in failed], failed)
        keys = [feature_key(self._enc_fp, self._recipe_fp, digests[p]) for p in paths]
        # Published like a folder's root (named from the set of files), so gc keeps what this
        # list is served from and writes back, and `roots drop` / `gc --older-than` manage it.
        label = "paths:" + sha256_hex("\n".join(sorted(set(paths))).encode())[:16]
        self._publish_root(
            catalog,
            root_id(label, self._enc_label, self._recipe_fp),
            label,
            list(zip(paths, keys, strict=True)),
        )
        return paths, keys, None

    def _publish_root(
        self, catalog: Catalog, name: str, data: str, items: list[tuple[str, str]]
    ) -> None:
        """Replace root ``name`` with ``items`` unless it already holds exactly them."""
        root = catalog.root(name)
        if (
            root is not None
            and root.encoder_fp == self._enc_fp
            and [tuple(x) for x in catalog.root_items(name)] == items
        ):
            return
        catalog.replace_root(
            name,
            data=data,
            encoder_label=self._enc_label,
            encoder_fp=self._enc_fp,
            recipe_fp=self._recipe_fp,
            recipe=self.recipe.as_dict(),
            items=items,
        )

    def _index_folder(self, data_dir: str, catalog: Catalog) -> tuple[list[str], list[str], str]:
        name = root_id(data_dir, self._enc_label, self._recipe_fp)
        root = catalog.root(name)
        manifest: dict[str, str] = {}
        if root is not None and root.encoder_fp == self._enc_fp:
            manifest = dict(catalog.root_items(name))
        try:
            scanned = scan(data_dir, self._source.extensions)
        except SourceError:
            if not manifest:
                raise
            scanned = []  # the inputs are gone, the features are not
        rel_paths = sorted(set(scanned) | set(manifest)) if manifest else scanned
        on_disk = [os.path.join(data_dir, r) for r in scanned]
        digests, failed = hash_inputs(catalog, on_disk)
        keys: list[str] = []
        bad: list[str] = []
        for rel in rel_paths:
            path = os.path.join(data_dir, rel)
            if path in digests:
                keys.append(feature_key(self._enc_fp, self._recipe_fp, digests[path]))
            elif rel in manifest:
                keys.append(manifest[rel])  # deleted (or unreadable) since the build
            else:
                bad.append(path)
                keys.append("")
        self._raise_unreadable(bad, failed)
        items = list(zip(rel_paths, keys, strict=True))
        if items != list(manifest.items()) or root is None or root.encoder_fp != self._enc_fp:
            # Publish what this dataset serves, so gc keeps it (and features written back on
            # misses) live, and the next start finds every key without hashing.
            catalog.replace_root(
                name,
                data=data_dir,
                encoder_label=self._enc_label,
                encoder_fp=self._enc_fp,
                recipe_fp=self._recipe_fp,
                recipe=self.recipe.as_dict(),
                items=items,
            )
        return rel_paths, keys, data_dir

    @staticmethod
    def _raise_unreadable(bad: list[str], failed: Mapping[str, str]) -> None:
        if bad:
            shown = "; ".join(f"{p}: {failed.get(p, 'unreadable')}" for p in bad[:5])
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise SourceError(
                f"{len(bad)} input(s) cannot be read and are not in the store: {shown}{more}; "
                "fix or remove them, or run `featbake build` to see every failure"
            )

    def _set_tables(self, rel_paths: list[str], keys: list[str], catalog: Catalog) -> None:
        n = len(keys)
        self._keys = np.array(keys, dtype="S64") if n else np.zeros(0, dtype="S64")
        blob = "\0".join(rel_paths).encode("utf-8", "surrogateescape")
        self._path_blob = np.frombuffer(blob, dtype=np.uint8).copy()
        ends = np.cumsum([len(p.encode("utf-8", "surrogateescape")) + 1 for p in rel_paths])
        self._path_end = (ends - 1).astype(np.int64)
        located = catalog.locate_many(sorted(set(keys)))
        self._shard_names: list[str] = []
        sid_of: dict[str, int] = {}
        self._shard = np.full(n, -1, dtype=np.int32)
        parts: set[tuple[str, ...]] = set()
        for i, key in enumerate(keys):
            locs = located.get(key)
            if not locs or len({loc.shard for loc in locs}) != 1:
                continue  # a feature split over shards is not written by featbake: re-read it
            shard = locs[0].shard
            if shard not in sid_of:
                sid_of[shard] = len(self._shard_names)
                self._shard_names.append(shard)
            self._shard[i] = sid_of[shard]
            parts.add(tuple(loc.part for loc in locs))
        self._sid_of = sid_of
        # Which items had their checksum checked and their last use recorded, in anonymous
        # shared memory that forked workers inherit: workers started afresh each epoch neither
        # check everything again nor write every key's last use again.
        self._shared_map: mmap.mmap | None = mmap.mmap(-1, _shared_bytes(n))
        # One encoder and recipe give every item the same outputs; anything else is looked up.
        self._parts: tuple[str, ...] | None = parts.pop() if len(parts) == 1 else None

    # -- the public surface -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._keys)

    def key(self, i: int) -> str:
        """The store key of item ``i`` (64 hex characters)."""
        return self._keys[self._index_of(i)].decode()

    def path(self, i: int) -> str:
        """The absolute path of item ``i``'s input file."""
        i = self._index_of(i)
        start = int(self._path_end[i - 1]) + 1 if i else 0
        rel = self._path_blob[start : int(self._path_end[i])].tobytes()
        rel_s = rel.decode("utf-8", "surrogateescape")
        return os.path.join(self._data_dir, rel_s) if self._data_dir else rel_s

    @property
    def encoder_fingerprint(self) -> str:
        """The encoder's fingerprint, as hashed into every key."""
        return self._enc_fp

    def stored(self) -> int:
        """How many items the store held when the dataset was created (the rest will miss)."""
        return int((self._shard >= 0).sum())

    def cache_info(self) -> ServeStats:
        """This process's counters: RAM tier hits, misses, evictions and bytes, reads, encodes.

        DataLoader workers count in their own processes; call it at the end of an epoch with
        ``num_workers=0``, or inside a worker (e.g. from ``worker_init_fn``'s dataset copy).
        """
        st = self._proc()
        return ServeStats(st.lru.info(), st.store_reads, st.encoded, st.written)

    def flush(self) -> None:
        """Seal this process's write-back shard and record last-use times now.

        Called automatically at process exit (workers included) and by :meth:`close`.
        """
        st = self._state
        if st is None or st.gen != _fork_generation:
            return
        st.sink.seal()
        st.sink.flush_touch()

    def close(self) -> None:
        """Flush, then close this process's shard files and catalog connection."""
        st = self._state
        if st is None or st.gen != _fork_generation or st.closed:
            return
        self.flush()
        for r in st.readers.values():
            r.close()
        st.readers.clear()
        st.sink.close()
        st.closed = True
        self._state = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None  # handles, connections and caches never cross processes
        state["_shared_map"] = None
        if self._encoder_spec is not None:
            state["_encoder_obj"] = None  # reloaded from the file on the first miss
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- reading ------------------------------------------------------------------------------
    def _index_of(self, i: int) -> int:
        n = len(self._keys)
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for a dataset of {n} items")
        return j

    def _proc(self) -> _Process:
        st = self._state
        if st is None or st.gen != _fork_generation:
            if st is not None:  # forked: these fds are this process's copies of the parent's
                for r in st.readers.values():
                    r.close()
            st = self._state = _Process(self)
            # Runs at interpreter exit and in multiprocessing children (DataLoader workers)
            # when their loop ends, so a worker's last write-back shard is sealed.
            mp_util.Finalize(st, _finalize, args=(st.sink,), exitpriority=10)
        return st

    def __getitem__(self, i: int) -> Any:
        value = self._get_one(i)
        return value if self._layer_view is None else view_layers(value, self._layer_view)

    def _get_one(self, i: int) -> Any:
        st = self._state
        if st is None or st.gen != _fork_generation:
            st = self._proc()
        if type(i) is not int or not 0 <= i < len(self._keys):
            i = self._index_of(i)
        loc = st.loc[i]
        if loc is not None and not st.use_lru and (st.verified[i] or not st.check_first):
            sid, reader, begin, nbytes, dtype, shape = loc
            # Valid while the shard is open in this process and the item was not relocated.
            if st.readers.get(sid) is reader and self._shard[i] == sid and not st.check_always:
                out = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes and os.preadv(reader.fd, (out.numpy(),), begin) != nbytes:
                    raise reader.cut_short(self._keys[i].decode())
                st.store_reads += 1
                self._touch(st, i)
                return out.view(dtype).view(shape)
        if st.use_lru:
            value = st.lru.get(i)
            if value is not None:
                self._touch(st, i)
                return value
        sid = int(self._shard[i])
        value = self._read(st, i, sid) if sid >= 0 else None
        if value is None:
            value = self._miss(st, [i])[0]
        else:
            self._touch(st, i)
        if st.use_lru:
            st.lru.put(i, value)
        return value

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch at once: the DataLoader calls this with each batch's indices.

        When every item is a stored single tensor, the items are read straight into one
        zero-padded batch tensor (in shared memory inside a worker) and returned as a
        :class:`~featbake.collate.PaddedBatch` of views into it, which :func:`pad_collate` hands
        on without copying again. Otherwise (misses, dict outputs, mixed shapes) each item is read
        on its own, and misses in the batch are encoded together.
        """
        st = self._state
        if st is None or st.gen != _fork_generation:
            st = self._proc()
        idx = [
            i if type(i) is int and 0 <= i < len(self._keys) else self._index_of(i) for i in indices
        ]
        if self._parts == ("",) and idx:
            batch = self._read_padded(st, idx)
            if batch is not None:
                return batch
        if self._layer_view is not None:
            return [view_layers(v, self._layer_view) for v in self._getitems_each(st, idx)]
        return self._getitems_each(st, idx)

    def _read_padded(self, st: _Process, idx: list[int]) -> PaddedBatch | None:
        """The batch read in place into a padded tensor, or None to take the general path."""
        if not st.use_lru and not st.check_always:
            batch = self._read_padded_located(st, idx)
            if batch is not None:
                return batch
        if st.use_lru:
            if any(self._shard[i] < 0 and i not in st.lru for i in idx):
                return None  # a miss: checked before any lookup so hits are counted once
        elif (self._shard[idx] < 0).any():
            return None
        sources: list[Any] = []
        lengths: list[int] = []
        trailing = None
        for i in idx:
            value = st.lru.get(i) if st.use_lru else None
            if value is not None:
                shape, dtype = tuple(value.shape), value.dtype
                sources.append(value)
            else:
                sid = int(self._shard[i])
                if sid < 0:
                    return None
                reader = st.readers.get(sid)
                if reader is None:
                    try:
                        reader = self._open_shard(st, sid)
                    except ShardMissing:
                        return None
                info = reader.tensors.get(self._keys[i].decode())
                if info is None:
                    return None
                shape, dtype = info.shape, ST_TO_DTYPE.get(info.dtype)
                sources.append(sid)  # not the reader: opening a later one may close it
            if not shape:
                return None
            if trailing is None:
                trailing, first_dtype = (shape[1:], dtype)
            elif shape[1:] != trailing or dtype != first_dtype:
                return None
            lengths.append(shape[0])
        t_max = max(lengths)
        like = torch.empty(0, dtype=first_dtype)
        padded = alloc_batch(like, (len(idx), t_max, *trailing))
        for row, i, src, n in zip(padded, idx, sources, lengths, strict=True):
            if n < t_max:
                row[n:].zero_()
            dest = row[:n]
            if isinstance(src, torch.Tensor):
                dest.copy_(src)
            else:
                reader = st.readers.get(src)
                if reader is None:
                    try:
                        reader = self._open_shard(st, src)
                    except ShardMissing:
                        return None  # moved meanwhile: the general path relocates it
                check = st.check_always or (st.check_first and not st.verified[i])
                key = self._keys[i].decode()
                reader.read_into(key, dest, verify=check)
                self._remember(st, i, src, reader, key)
                if check:
                    st.verified[i] = 1
                st.store_reads += 1
                if st.use_lru:  # the RAM tier owns its copy, not a view of this batch
                    st.lru.put(i, _mapped_empty(dest.shape, dest.dtype).copy_(dest))
            self._touch(st, i)
        return PaddedBatch.of(padded, lengths)

    def _read_padded_located(self, st: _Process, idx: list[int]) -> PaddedBatch | None:
        """The hit path of a batch whose items were all read (and checked) before here.

        One pread per item straight into its row of the batch, no per-item tensor or view;
        None (take the general path) if any item is not located, not yet checked, or moved.
        """
        locs = st.loc
        readers = st.readers
        shard = self._shard
        verified = st.verified
        check_first = st.check_first
        first = locs[idx[0]]
        if first is None:
            return None
        dtype, trailing = first[4], first[5][1:]
        if not trailing:
            return None
        got = []
        for i in idx:
            loc = locs[i]
            if (
                loc is None
                or (check_first and not verified[i])
                or readers.get(loc[0]) is not loc[1]
                or shard[i] != loc[0]
                or loc[4] is not dtype
                or loc[5][1:] != trailing
            ):
                return None
            got.append(loc)
        lengths = [loc[5][0] for loc in got]
        t_max = max(lengths)
        padded = alloc_batch(torch.empty(0, dtype=dtype), (len(idx), t_max, *trailing))
        flat = padded.view(-1).view(torch.uint8).numpy()
        row_bytes = padded[0].nbytes if len(idx) else 0
        preadv = os.preadv
        start = 0
        for i, loc, n in zip(idx, got, lengths, strict=True):
            nbytes = loc[3]
            end = start + nbytes
            if nbytes and preadv(loc[1].fd, (flat[start:end],), loc[2]) != nbytes:
                raise loc[1].cut_short(self._keys[i].decode())
            if n < t_max:
                flat[end : start + row_bytes] = 0
            start += row_bytes
            self._touch(st, i)
        st.store_reads += len(idx)
        return PaddedBatch.of(padded, lengths)

    def _getitems_each(self, st: _Process, idx: list[int]) -> list[Any]:
        out: list[Any] = [None] * len(idx)
        missing: list[int] = []
        for j, i in enumerate(idx):
            value = st.lru.get(i) if st.use_lru else None
            if value is None:
                sid = int(self._shard[i])
                if sid >= 0:
                    value = self._read(st, i, sid)
                if value is None:
                    missing.append(j)
                    continue
                if st.use_lru:
                    st.lru.put(i, value)
            self._touch(st, i)
            out[j] = value
        if missing:
            miss_idx = [idx[j] for j in missing]
            for j, i, value in zip(missing, miss_idx, self._miss(st, miss_idx), strict=True):
                out[j] = value
                if st.use_lru:
                    st.lru.put(i, value)
        return out

    def _read(self, st: _Process, i: int, sid: int) -> Any:
        """Item ``i`` from shard ``sid``; None when the store no longer has it."""
        reader = st.readers.get(sid)
        try:
            if reader is None:
                reader = self._open_shard(st, sid)
            key = self._keys[i].decode()
            check = (
                "always" if st.check_always or (st.check_first and not st.verified[i]) else "never"
            )
            parts = self._parts
            if parts == ("",) and st.use_lru:
                info = reader.tensors.get(key)
                dtype = ST_TO_DTYPE.get(info.dtype) if info is not None else None
                if info is None or dtype is None:
                    value: Any = reader.read(key, verify=check)  # raises StoreCorrupt
                else:
                    value = _mapped_empty(info.shape, dtype)
                    reader.read_into(key, value, verify=check == "always")
            elif parts == ("",):
                value = reader.read(key, verify=check)
                self._remember(st, i, sid, reader, key)
            elif parts is not None:
                value = {p: reader.read(tensor_name(key, p), verify=check) for p in parts}
            else:
                value = self._read_located(st, key)
        except ShardMissing:
            # gc compacted or dropped the shard after the index was built: look it up again.
            st.readers.pop(sid, None)
            return self._relocate(st, i)
        if check == "always":
            st.verified[i] = 1
        st.store_reads += 1
        return value

    @staticmethod
    def _remember(st: _Process, i: int, sid: int, reader: ShardReader, key: str) -> None:
        info = reader.tensors.get(key)
        dtype = ST_TO_DTYPE.get(info.dtype) if info is not None else None
        if info is not None and dtype is not None:
            st.loc[i] = (sid, reader, info.begin, info.end - info.begin, dtype, info.shape)

    def _open_shard(self, st: _Process, sid: int) -> ShardReader:
        path = self._layout.shard_path(self._shard_names[sid])
        reader = ShardReader(path, verify=self.verify)
        if len(st.readers) >= self.max_open_shards:
            oldest = next(iter(st.readers))  # dicts keep insertion order: close the oldest
            st.readers.pop(oldest).close()
        st.readers[sid] = reader
        return reader

    def _read_located(self, st: _Process, key: str) -> Any:
        with st.sink.catalog_scoped() as catalog:
            locs = catalog.locate(key)
        if not locs:
            raise ShardMissing(f"feature {key} is no longer in the store")
        value = {}
        for loc in locs:
            sid = self._sid(loc.shard)
            reader = st.readers.get(sid) or self._open_shard(st, sid)
            value[loc.part] = reader.read(loc.tensor)
        return value[""] if list(value) == [""] else value

    def _sid(self, shard: str) -> int:
        sid = self._sid_of.get(shard)
        if sid is None:
            sid = self._sid_of[shard] = len(self._shard_names)
            self._shard_names.append(shard)
        return sid

    def _relocate(self, st: _Process, i: int) -> Any:
        key = self._keys[i].decode()
        with st.sink.catalog_scoped() as catalog:
            locs = catalog.locate(key)
        if not locs:
            self._shard[i] = -1
            return None
        self._shard[i] = self._sid(locs[0].shard)
        if self._parts is None:
            self._parts = tuple(loc.part for loc in locs)
        value = self._read_located(st, key)
        st.store_reads += 1
        return value

    def _touch(self, st: _Process, i: int) -> None:
        if not st.touched[i]:
            st.touched[i] = True
            st.touch_queue.append(i)
        st.ops += 1
        if st.sink.first_pending or not st.ops & 255:
            self._tick(st)

    def _tick(self, st: _Process) -> None:
        """Time-driven upkeep, checked every 256 reads (or each read while a write is pending)."""
        now = time.monotonic()
        sink = st.sink
        if sink.first_pending and now - sink.first_pending >= WRITEBACK_SECONDS:
            sink.seal()
        if len(sink.touch_queue) >= TOUCH_FLUSH_ITEMS or (
            sink.touch_queue and now - sink.last_touch_flush >= TOUCH_FLUSH_SECONDS
        ):
            sink.flush_touch()
        wall = time.time()
        if wall - st.touch_epoch[0] >= TOUCH_REPEAT_SECONDS:
            st.touched[:] = False
            st.touch_epoch[0] = wall

    # -- misses -------------------------------------------------------------------------------
    def _miss(self, st: _Process, idx: list[int]) -> list[Any]:
        """Values for items not in the store: written back by this process, or encoded now."""
        out: dict[int, Any] = {}
        todo: list[int] = []
        for i in idx:
            key = self._keys[i].decode()
            if key in st.pending:
                out[i] = _unpack(st.pending[key])
            else:
                value = self._relocate(st, i)  # another process may have written it since
                if value is None:
                    todo.append(i)
                else:
                    self._touch(st, i)
                    out[i] = value
        if todo:
            if self.on_miss == "error":
                path = self.path(todo[0])
                raise CacheMiss(
                    f"{path} is not in the store {self._layout.root} for this encoder and recipe; "
                    f"run `featbake build --encoder {self._enc_label} --data "
                    f"{self._data_dir or os.path.dirname(path)}` with the same recipe options, "
                    "or use on_miss='encode'"
                )
            with st.sink.lock:
                for i, parts in zip(todo, self._encode(st, todo), strict=True):
                    out[i] = _unpack(parts)
                    if self.write_back:
                        self._write_back(st, i, parts)
        return [out[i] for i in idx]

    def _encoder(self, st: _Process) -> LoadedEncoder:
        if st.encoder is not None:
            return st.encoder
        enc = self._encoder_obj
        if self._encoder_spec is None:  # an in-process module: it runs where it lives
            assert enc is not None
            if enc.device.type == "cuda" and not dev.cuda_usable_here():
                raise EncoderLoadError(
                    "a miss must be encoded in a DataLoader worker forked after CUDA started, "
                    "where CUDA cannot run, but the encoder module lives on the GPU; pass the "
                    "encoder as a file, or use DataLoader(..., multiprocessing_context='spawn')"
                )
        else:
            device = dev.resolve_device(self._device)
            if device.type == "cuda" and not dev.cuda_usable_here():
                device = torch.device("cpu")  # forked after CUDA started: CUDA cannot start here
            if enc is None or enc.device != device:
                enc = self._load_encoder(device)
        if enc.fingerprint != self._enc_fp:
            raise EncoderLoadError(
                f"the encoder {self._enc_label} changed since this dataset was created "
                f"(fingerprint {enc.fingerprint[:12]}, expected {self._enc_fp[:12]}); "
                "create the dataset again so its keys match the encoder"
            )
        st.encoder = enc
        return enc

    def _encode(self, st: _Process, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        enc = self._encoder(st)
        paths = [self.path(i) for i in idx]
        inputs = [self._source.load(p) for p in paths]
        self._check_unchanged(st, idx, paths)
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, x in enumerate(inputs):
            groups.setdefault(tuple(x.shape), []).append(j)
        results: list[dict[str, torch.Tensor] | None] = [None] * len(idx)
        for members in groups.values():
            for j, parts in zip(
                members, encode_batch(enc, [inputs[j] for j in members], self.recipe), strict=True
            ):
                results[j] = parts
        st.encoded += len(idx)
        return results  # type: ignore[return-value]

    def _check_unchanged(self, st: _Process, idx: list[int], paths: list[str]) -> None:
        """Raise if a file decoded for a miss no longer holds the bytes its key was hashed from.

        Keys are hashed when the dataset is created and the file is decoded later: one
        rewritten in between must not be encoded and stored under the old bytes' key (which
        every other copy of the old bytes shares). Checked after decoding, against the hash
        cache (same stat) or, when that does not say, a fresh hash of the file.
        """
        with st.sink.catalog_scoped() as catalog:
            cached = catalog.cached_hashes(paths)
        for i, path in zip(idx, paths, strict=True):
            try:
                now = FileStat.of(path)
                hit = cached.get(path)
                if hit is not None and hit[0] == now:
                    sha = hit[1]
                else:
                    sha = file_fingerprint(path)
                    if FileStat.of(path) != now:
                        sha = ""  # changing while it is read
            except OSError:
                sha = ""
            if feature_key(self._enc_fp, self._recipe_fp, sha) != self._keys[i].decode():
                raise SourceError(
                    f"{path} changed since this dataset was created (its bytes no longer match "
                    "the key they were indexed under), so its feature is not stored; create the "
                    "dataset again once the file stops changing"
                )

    def _write_back(self, st: _Process, i: int, parts: dict[str, torch.Tensor]) -> None:
        key = self._keys[i].decode()
        sink = st.sink
        if sink.writer is None:
            ds_ref, st_ref = weakref.ref(self), weakref.ref(st)

            def on_seal(shard: Any) -> None:
                catalog = sink.catalog_here()
                catalog.add_shard(shard)
                if catalog is not sink.catalog:
                    catalog.close()
                ds, proc = ds_ref(), st_ref()
                if ds is not None and proc is not None:
                    ds._published(proc, shard)

            sink.writer = ShardWriter(
                self._layout,
                self._enc_fp,
                self._recipe_fp,
                target_bytes=WRITEBACK_BYTES,
                max_items=WRITEBACK_ITEMS,
                on_seal=on_seal,
            )
        if key not in st.pending:
            st.pending[key] = parts
            st.pending_idx.setdefault(key, []).append(i)
            st.written += 1
            if not sink.first_pending:
                sink.first_pending = time.monotonic()
            sink.writer.add(key, parts)  # seals (and publishes) when full

    def _published(self, st: _Process, shard: Any) -> None:
        sid = self._sid(shard.name)
        for entry in shard.entries:
            for i in st.pending_idx.pop(entry.key, ()):
                self._shard[i] = sid
            st.pending.pop(entry.key, None)
        if self._parts is None:
            self._parts = tuple(sorted({e.part for e in shard.entries}))
        st.sink.first_pending = 0.0 if not st.pending else time.monotonic()


def _unpack(parts: Mapping[str, torch.Tensor]) -> Any:
    return parts[""] if len(parts) == 1 and "" in parts else dict(parts)
