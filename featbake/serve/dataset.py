"""``CachedFeatureDataset``: a map-style Dataset that serves baked features.

Item -> key (built once, from the root manifest and hash cache) -> RAM LRU -> shard (pread, CRC
on first read) -> miss (encoded live, written back). It delegates by job: ``index`` (item ->
key and shard), ``state`` and ``process`` (what each process opens; the one rule for state
made before a ``fork``), ``reads`` (the read paths), ``live`` (a miss), ``writeback`` (storing
it), ``served`` (int8/fp8 dequantised) and ``lastuse``. One item is a batch of one: the
RAM tier or the store (``Reads.item``: planned, read once, served), else a miss
(``Misses.values``), then the layer view.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import featbake.device as dev
from featbake.encode.encoders import LoadedEncoder
from featbake.encode.fingerprints import hash_inputs
from featbake.encode.hf import recipe_for_encoder
from featbake.encode.inputs import inputs_at
from featbake.encode.outputs import layer_of_part, part_name
from featbake.encode.sources import source_for
from featbake.errors import ConfigError, SourceError, StoreError
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.recipe import Recipe
from featbake.serve.index import (
    Index,
    IndexSpec,
    ItemPlacement,
    build_index,
    names_from_parent,
    raise_unreadable,
)
from featbake.serve.misses import LiveEncoder, Misses
from featbake.serve.reads import Reads, served_for
from featbake.serve.state import (
    TOUCH_FLUSH_ITEMS,
    TOUCH_FLUSH_SECONDS,
    TOUCH_REPEAT_SECONDS,
    WRITEBACK_BYTES,
    WRITEBACK_ITEMS,
    WRITEBACK_SECONDS,
    ProcessState,
    SealPolicy,
    ServeStats,
    SharedFlags,
    WriteBack,
    handed_over_sealed,
    ram_budget_for_process,
    read_only_misses,
    save_at_exit,
    store_read_only,
)
from featbake.store.byteplace import resolved
from featbake.store.fragment_catalog import open_serving_catalog
from featbake.store.hash_cache import FileStat
from featbake.store.layout import Layout
from featbake.store.open import describe, open_store, place_of
from featbake.store.shard import SealedShard
from featbake.store.tier import window_fitting
from featbake.units import parse_bytes

# == options =======================================================================================
# The dataset's options: checked up front, and folded into the recipe that keys its items.
ON_MISS = ("encode", "error")
VERIFY = ("first", "always", "never")


def check_options(on_miss: str, verify: str, max_open_shards: int) -> None:
    """Raise ConfigError for a serving option outside its choices (a typo never passes)."""
    if on_miss not in ON_MISS:
        raise ConfigError(f"on_miss must be 'encode' or 'error', got {on_miss!r}")
    if verify not in VERIFY:
        raise ConfigError(f"verify must be 'first', 'always' or 'never', got {verify!r}")
    if max_open_shards < 1:
        raise ConfigError(f"max_open_shards must be at least 1, got {max_open_shards}")


def recipe_from(
    recipe: Recipe | None, options: Mapping[str, Any], layers: Sequence[int] | str | None
) -> Recipe:
    """``recipe`` (or the default) with every option that was given (not None) applied."""
    changes = {k: v for k, v in options.items() if v is not None}
    if layers is not None:
        changes["layers"] = tuple(layers) if isinstance(layers, (list, tuple)) else layers
    base = recipe or Recipe()
    return base.replace(**changes) if changes else base


def serving_layout(
    cache: str | os.PathLike[str] | None,
    on_miss: str,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
) -> Layout:
    """The store a dataset serves from; a missing one is an error or (encoding) said once.

    A mistyped ``cache=`` used to create an empty store silently and report every item "not
    in the store" (issue 18 item 6).

    Raises:
        StoreError: ``on_miss="error"`` and there is no store at ``cache``.
    """
    layout = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    if not layout.catalog.exists() and not layout.shards.exists():
        where = describe(layout)
        if on_miss == "error":
            raise StoreError(
                f"there is no featbake store at {where}; check cache= (or $FEATBAKE_CACHE), "
                "or make it with `featbake build --cache` first"
            )
        warnings.warn(
            f"there is no featbake store at {where} yet: creating one, and every item is "
            "encoded live and written back (check cache= if you meant an existing store)",
            stacklevel=3,
        )
    return layout.ensure()


# == layer_views ===================================================================================
# Serving hidden layers: one layer, several, or a stacked ``[L, T, D]`` tensor per item.
#
# A bake with ``--layers 0,6,12`` stores each layer as its own part (``layer0``, ``layer6``,
# ``layer12``) of one feature; a dataset item is then a dict of them. ``layer_view`` picks what a
# training loop wants from that dict, after the item's one read: an ``int`` gives that layer's
# ``[T, D]`` tensor (a linear probe), a sequence gives a stacked ``[L, T, D]`` tensor in that order
# (a SUPERB-style weighted sum), ``"stack"`` stacks the layers in the order ``layers=`` asked for
# them (``layers=[3, 1]``: layer 3, then layer 1, as ``layer_view=[3, 1]`` does), or every stored
# layer in layer order when ``layers`` named none (``"all"``, or a recipe's sorted layers).
#
# The view is applied on every read path (one item, a batch, the RAM tier), and a view the store
# cannot give (no layer parts, a layer not stored) is a :class:`ConfigError` at every read, or
# from the dataset's constructor when the stored items already tell.
STACK = "stack"

LayerView = int | Sequence[int] | str | None

_NO_LAYERS = (
    "layer_view needs features stored per layer, and these are stored as one tensor; bake with "
    "--layers (and pass the same layers= to the dataset), or drop layer_view"
)


def check_layer_view(view: LayerView, asked: Sequence[int] | str | None = None) -> LayerView:
    """Validate a ``layer_view`` option once, at construction; ``"stack"`` becomes the layers
    in the order ``asked`` (the dataset's ``layers=``) when that lists them.

    Raises:
        ConfigError: not None, an int, a sequence of ints or ``"stack"``.
    """
    if view == STACK and asked is not None and not isinstance(asked, str):
        view = tuple(dict.fromkeys(asked))  # the order asked for; a repeat once
    if view is None or view == STACK:
        return view
    if isinstance(view, (bool, str)):
        raise ConfigError(f"layer_view must be a layer, a list of layers or 'stack', got {view!r}")
    if isinstance(view, int):
        return view
    layers = tuple(view)
    if not layers or not all(isinstance(k, int) and not isinstance(k, bool) for k in layers):
        raise ConfigError(f"layer_view must list whole layer numbers, got {view!r}")
    return layers


def check_stored_parts(view: LayerView, parts: Sequence[str] | None) -> None:
    """Raise now what :func:`view_layers` would raise on every item stored with ``parts``.

    Raises:
        ConfigError: the stored items have no layer parts, or not a layer ``view`` asks for.
    """
    if view is None or parts is None:
        return  # no view, or items differ (each is checked when read)
    view_layers({p: torch.empty(0) for p in parts if p} if parts != ("",) else None, view)


def view_layers(item: Any, view: LayerView) -> Any:
    """``item`` (a dict of ``layerK`` parts) as ``view`` asks; unchanged when ``view`` is None.

    Raises:
        ConfigError: the item holds no such layer (name the layers the bake stored).
    """
    if view is None:
        return item
    if not isinstance(item, Mapping):
        raise ConfigError(_NO_LAYERS)
    if isinstance(view, str):  # STACK, the one string check_layer_view lets through
        stored = sorted((k, p) for p in item if (k := layer_of_part(p)) is not None)
        if not stored:
            raise ConfigError(_NO_LAYERS)
        return torch.stack([item[p] for _, p in stored])
    if isinstance(view, int):
        return _layer(item, view)
    return torch.stack([_layer(item, k) for k in view])


def _layer(item: Mapping[str, torch.Tensor], k: int) -> torch.Tensor:
    name = part_name(k)
    if name not in item:
        stored = ", ".join(sorted(item)) or "none"
        raise ConfigError(f"layer {k} is not stored for this item (stored: {stored})")
    return item[name]


# == revalidate ====================================================================================
# ``revalidate=True``: serve a file's feature as the file is now, not as it was indexed.
#
# A dataset maps each item to a key once, when it is made (:mod:`featbake.serve.index`); by
# default a file rewritten later keeps its old feature for that item. With ``revalidate=True``
# each read of an item first compares its file's stat (size, mtime_ns, inode, ctime_ns: one
# ``stat`` call) with the one its key was hashed at; when they differ the file is hashed again
# (through the hash cache), the item is re-keyed in this process, and the read goes on as usual:
# a hit when the store holds the new bytes' feature, else a miss under ``on_miss``. A file gone
# since keeps serving its stored feature, as without ``revalidate``.
def revalidate(
    index: Index, st: ProcessState, idx: Iterable[int], named: str | None = None
) -> None:
    """Re-key every item of ``idx`` whose file changed since its key was hashed. ``named``:
    the folder as the dataset was given it, where it is one (its items' paths are the folder
    it led to then: one that leads elsewhere now, a link retargeted, is refused).

    Raises:
        SourceError: a changed file cannot be read now (its old feature is not served), or the
            folder leads elsewhere now.
    """
    if named is not None and index.data_dir is not None:
        leads = resolved(named)
        if leads != index.data_dir:
            raise SourceError(
                f"the data folder {named} leads to {leads} now, not to {index.data_dir} as when "
                "this dataset was made (a link retargeted?); make the dataset again to serve "
                "what it holds now"
            )
    stats = index.stats
    for i in idx:
        path = index.path(i)
        try:
            now = FileStat.of(path)
        except OSError:
            continue  # gone: its stored feature is served, as when the dataset was made
        if now != tuple(stats[i]):
            _rekey(index, st, i, path)


def _rekey(index: Index, st: ProcessState, i: int, path: str) -> None:
    """Hash item ``i``'s file again, find its new key's feature, forget what was read of it."""
    hashed: dict[str, FileStat] = {}
    digests, failed = hash_inputs(st.catalog, [path], stats=hashed)
    raise_unreadable([p for p in (path,) if p in failed], failed)
    key = index.spec.key(digests[path])
    locs = st.catalog.locate_many([key]).get(key) or []
    shards = {loc.shard for loc in locs}
    index.rekey(i, key, hashed[path], shards.pop() if len(shards) == 1 else None)
    st.forget(i)


def named_folder(data: Any, index: Index) -> str | None:
    """The folder a dataset was given, as given (absolute, links kept), where its items are a
    folder's files: :func:`revalidate` refuses one that leads elsewhere later."""
    if index.data_dir is None or not isinstance(data, str | Path):
        return None
    return os.path.abspath(os.path.expanduser(os.fspath(data)))


def refuse_revalidate_of_objects(data: Any, revalidate: bool, column: str | None = None) -> None:
    """Raise when ``revalidate=True`` is asked of inputs a ``stat`` cannot revalidate.

    Raises:
        ConfigError: ``data`` is a bucket prefix (checking each object's ETag at every read
            would cost a request per item) or a manifest (its items are not files).
    """
    if not revalidate or not isinstance(data, str | os.PathLike):
        return
    inputs = inputs_at(data, column)
    if not inputs.stat_tells_change:
        raise ConfigError(
            f"revalidate=True is not built for inputs in a bucket or named by a manifest "
            f"({inputs.where}): the dataset "
            "keys each object by the ETag it had when the dataset was made. Make a new dataset "
            "(or run `featbake build`) after objects change"
        )


# == dataset =======================================================================================
def _tell_published(ds_ref: weakref.ref[CachedFeatureDataset], shard: SealedShard) -> None:
    if (ds := ds_ref()) is not None:
        ds._published(shard)


class CachedFeatureDataset(ProcessLocalState, Dataset):
    """A map-style Dataset of a folder's (or a list of files') encoder features.

    ``ds[i]`` is the feature tensor of item ``i`` (a dict of tensors for an encoder with several
    outputs), exactly what the store holds and equal, within the stored dtype, to running the
    encoder now. The same recipe options as ``featbake build`` select the same keys, so a folder
    baked with the CLI is served with zero encoding and without opening one raw input.

    It serves the folder as it was when the dataset was made (each key hashes a file's bytes
    then): a file rewritten later keeps its old feature, one added later is not an item, one
    deleted later is served from the store; ``revalidate=True`` serves changed files as they are.
    An input its ``featbake build`` could not decode (and recorded so) is not an item, as in the
    build's report: one warning names it; once fixed (other bytes) it is an item again.

    Args:
        data: a data folder (scanned recursively, sorted as ``featbake build`` does), a
            sequence of file paths (served in the given order), or a manifest, Kaldi data
            folder or lhotse cut manifest (its rows or segments, in its order: a miss encodes
            the segment live; :meth:`item_id` and :meth:`row` give each row's id and columns).
        encoder: as ``featbake build --encoder`` takes it, a loaded encoder, or an
            ``nn.Module``. A file encoder is loaded at the first miss (or once, to fingerprint
            it, when the store has never seen this file).
        cache, local_cache, local_cache_size: the store (directory or ``s3://bucket/prefix``)
            and a bucket's local tier, as :func:`featbake.store.open.open_store` takes them. On a
            shared filesystem or a bucket the catalog is only read; writes go to fragments.
        recipe: preprocessing and storage options; the keyword options below override its fields.
        source, sample_rate, mono, max_seconds, output, dtype: recipe fields, as in
            ``featbake build``.
        weights: safetensors weights for an import-path encoder.
        trust_pickle: allow a pickled whole-module checkpoint (runs its code).
        ram_cache: byte budget of the RAM tier (``"2GiB"`` or an int; 0 disables it). It is the
            total: each of N DataLoader workers gets ``ram_cache / N``; it lasts across epochs
            only with ``persistent_workers=True`` (else each epoch's workers start empty).
        on_miss: ``"encode"`` (encode live and write back) or ``"error"`` (raise CacheMiss).
        device: where misses are encoded. Inside a DataLoader worker forked after CUDA was
            initialised, CUDA cannot start, so misses there are encoded on the CPU; choose
            ``multiprocessing_context="spawn"`` (or ``"forkserver"``) to encode them on the GPU.
        verify, max_open_shards: CRC check (``"first"`` read, ``"always"``, ``"never"``); files.
        write_back: store features encoded on a miss so the next epoch hits. A store this
            process cannot write (a read-only mount, no write permission,
            ``$FEATBAKE_READ_ONLY=1``) is served as it is: its catalog is only read, no root is
            published, nothing is written back (:attr:`read_only` says so), and inputs it does
            not hold are misses under ``on_miss`` (encoded at each read, with a warning).
        clock: monotonic seconds, for write-back ageing and last-use flushing (tests pass a
            fake clock to check both without sleeping).
        layers, precision: recipe fields, as ``featbake build --layers/--precision``.
        revalidate: check each item's file (one ``stat``) at every read, and serve a changed
            file's new feature (a hit when the store holds it, else a miss under
            ``on_miss``). Re-keying is per process; :meth:`key` says the key in this process.
        layer_view: with ``layers``, serve one layer (``6``: ``[T, D]``), a stacked subset
            (``[0, 6]``: ``[L, T, D]``, in that order) or the layers stacked in the order
            ``layers`` lists them (``"stack"``; layer order for ``layers="all"``) instead of the
            dict of parts (see :mod:`featbake.serve.dataset`). Applied to single items and
            batches alike; a view the store cannot give is a ConfigError at every read (from
            the constructor when stored items already tell).
        serve_dtype, dequantize: int8/fp8 items are served in ``serve_dtype`` (float16, float32
            where the build found float16 cannot hold them) or packed with ``dequantize=False``
            (items of one dimension, ``[T]``, are then one packed row each, which
            :func:`pad_collate` refuses to pad: serve those dequantised to batch them).
        column: a manifest's column naming each item's input (default ``path``), as
            ``featbake build --column``.

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

    def __init__(  # noqa: PLR0913 - the public options, as `featbake build` takes them
        self,
        data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
        *,
        cache: str | os.PathLike[str] | None = None,
        local_cache: str | os.PathLike[str] | None = None,
        local_cache_size: int | str | None = None,
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
        clock: Callable[[], float] = time.monotonic,
        layers: Sequence[int] | str | None = None,
        precision: str | None = None,
        layer_view: LayerView = None,
        revalidate: bool = False,
        serve_dtype: str | torch.dtype | None = None,
        dequantize: bool = True,
        column: str | None = None,
    ) -> None:
        check_options(on_miss, verify, max_open_shards)
        options: dict[str, Any] = {"source": source, "sample_rate": sample_rate, "mono": mono}
        options.update(max_seconds=max_seconds, output=output, dtype=dtype, precision=precision)
        self.recipe = recipe_for_encoder(encoder, recipe_from(recipe, options, layers))
        self._layer_view = check_layer_view(layer_view, layers)
        self._served = served_for(self.recipe, serve_dtype, dequantize)
        self.on_miss = on_miss
        self.verify, self.max_open_shards = verify, max_open_shards
        self._clock = clock
        self.revalidate = revalidate
        refuse_revalidate_of_objects(data, revalidate, column)
        self._ram_total = parse_bytes(ram_cache)
        dev.resolve_device(device)  # validate now, not at the first miss
        self._layout = serving_layout(cache, on_miss, local_cache, local_cache_size)
        # A store this process cannot write is served as it is: nothing published or written.
        self.read_only = store_read_only(self._layout)
        self.write_back = write_back and not self.read_only
        self._shared = (
            not self.read_only and place_of(self._layout).serving_mode()
        )  # writes go to fragments
        self._recipe_fp = self.recipe.fingerprint()
        self._source = source_for(self.recipe)
        self._live = LiveEncoder(
            self._layout,
            None,
            os.fspath(weights) if weights is not None else None,
            trust_pickle,
            str(device),
            self.recipe.layers,
            shared=self._shared,
        )
        catalog = open_serving_catalog(self._layout, shared=self._shared)
        try:
            self._live.identify(encoder, catalog)
            spec = IndexSpec(
                self._live.fingerprint,
                self._live.label,
                self._recipe_fp,
                self.recipe.as_dict(),
                tuple(self._source.extensions),
            )
            # A refused miss must leave no root behind: on_miss="error" only refreshes one.
            new = on_miss == "encode"
            self._index = build_index(
                data, spec, catalog, publish=not self.read_only, new_root=new, column=column
            )
        finally:
            catalog.close()
        self._served = self._served and self._served.for_index(self._layout, self._index)
        self._named_folder = named_folder(data, self._index) if revalidate else None
        self._reads = Reads(self._index, self._layout, self._served)
        self._misses = Misses(self._index, self._reads, self._live, self._source, self.recipe)
        self._misses.configure(on_miss, self.write_back)  # warns of live encoding it can name
        check_stored_parts(self._layer_view, self._index.parts)  # a view the store cannot give
        if self.read_only and on_miss == "encode" and self.stored() < len(self):
            warnings.warn(read_only_misses(self._layout, len(self) - self.stored()), stacklevel=2)
        # Which items had their checksum checked and their last use recorded, in anonymous
        # shared memory that forked workers inherit (see SharedFlags).
        self._shared_map: Any = SharedFlags.allocate(len(self._index))
        self._items_digest: str | None = None  # items_digest(), made when a loader asks

    # -- the public surface -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index.keys)

    def key(self, i: int) -> str:
        """The store key of item ``i`` (64 hex characters)."""
        return self._index.key(self._index.position(i))

    def path(self, i: int) -> str:
        """The absolute path of item ``i``'s input file (for a manifest's row, where the
        manifest names it: ``/data/train.jsonl:12``)."""
        return self._index.path(self._index.position(i))

    def item_id(self, i: int) -> str:
        """Item ``i``'s id: its path relative to the folder, a manifest row's ``id`` (else its
        path, plus ``#start-end`` for a segment and ``@chN`` for a channel), a Kaldi utterance
        id, a cut's id."""
        return self._index.rel(self._index.position(i))

    def row(self, i: int) -> dict[str, Any]:
        """Item ``i``'s other columns (labels, speaker, text); ``{}`` for a folder's files.

        Example:
            >>> ds = CachedFeatureDataset("train.jsonl", "ckpt.pt")  # doctest: +SKIP
            >>> ds.row(0)["label"]  # doctest: +SKIP
        """
        inputs = self._index.inputs
        return inputs.row(self._index.rel(self._index.position(i))) if inputs else {}

    def items_digest(self) -> str:
        """A digest of this dataset's item ids in order (what its positions name): a loader's
        state carries it, so a state part way through an epoch is not resumed over other
        items (see :func:`featbake.serve.loader.items_of`). A list of files is named from the
        folder above the one they share (:func:`~featbake.serve.index.names_from_parent`), so
        the same files mounted elsewhere are the same items, and two speakers' lists of files
        of the same names are not."""
        if self._items_digest is None:
            h = hashlib.sha256(f"items\0{len(self)}\0".encode())
            ix = self._index
            if ix.data_dir is not None:  # the ids NUL-joined, as the index holds them
                h.update(ix.path_blob.tobytes())
            else:
                h.update(names_from_parent(ix.path_blob, ix.path_end).tobytes())
            self._items_digest = h.hexdigest()[:16]
        return self._items_digest

    @property
    def encoder_fingerprint(self) -> str:
        """The encoder's fingerprint, as hashed into every key."""
        return self._live.fingerprint

    def stored(self) -> int:
        """How many items the store held when the dataset was created (the rest will miss)."""
        return self._index.stored()

    def placement(self) -> ItemPlacement:
        """Each item's length and shard, from the catalog (no read): what loaders plan from."""
        return self._index.placement()

    def follow_blocks(self, windows: Sequence[Sequence[int]] | None) -> bool:
        """Tell a bucket store the shards (ids from :meth:`placement`) each window of a block
        order reads, in order, or None when the reads follow none: it then fetches a window's
        shards whole, the next window's ahead (see ``BucketStore.follow_blocks``). Whether the
        store follows it (a local store has nothing to fetch)."""
        names = self._index.shard_names
        return place_of(self._layout).follow_blocks(
            None if windows is None else [[names[s] for s in w] for w in windows]
        )

    def block_window(self, most: int) -> int:
        """The shards a window of a block order holds by default here: ``most``, or fewer
        where two windows of this dataset's largest shards would not fit a bucket store's
        tier (:func:`~featbake.store.tier.window_fitting`); a directory: ``most``."""
        place = place_of(self._layout)
        usage = place.tier_usage()
        if usage is None:
            return most
        sizes = place.named_shards()
        mine = [sizes.get(n, 0) for n in set(self._index.shard_names)]
        return window_fitting(mine, usage.budget, most)

    def will_need(self, indices: Sequence[int]) -> int:
        """Start reading items ``indices`` from disk, not waiting: a hint that lets a cold store's
        reads overlap (:class:`FeatureLoader` hints its next items). Returns the reads started."""
        idx = [self._index.position(i) for i in indices]
        return self._reads.will_need(self._state, idx)

    def ahead_items(self) -> int:
        """How many items a loader should hint ahead at least (the store's advice: a bucket
        read by ranges groups each shard's hinted items into one GET; 0: none)."""
        return place_of(self._layout).ahead_items()

    def cache_info(self) -> ServeStats:
        """This process's counters: RAM tier hits, misses, evictions and bytes, reads, encodes.

        DataLoader workers count in their own processes (a warning says so here once they have):
        read it inside a worker, or read with ``num_workers=0`` or :class:`FeatureLoader`.
        """
        return self._state.stats()

    def flush(self) -> None:
        """Seal this process's write-back shard and record last-use times now.

        Called automatically at process exit (workers included) and by :meth:`close`.
        """
        st = CachedFeatureDataset._state.peek(self)
        if st is not None:
            st.saver.flush()
        handed_over_sealed()  # and what dropped ones handed to the sealing thread

    def close(self) -> None:
        """Flush, then close this process's shard files and catalog connection."""
        st = CachedFeatureDataset._state.reset(self)  # a forked child's: closed, never saved
        if st is not None:
            st.close()

    def __getstate__(self) -> dict[str, Any]:
        # Handles, connections and caches never cross processes (ProcessLocalState). The extra
        # rule: the shared flags are anonymous memory that only forked workers share; a
        # pickled (spawned) copy keeps flags of its own.
        state = super().__getstate__()
        state["_shared_map"] = None
        return state

    # -- reading ------------------------------------------------------------------------------
    def _proc(self) -> ProcessState:
        """This process's state (made on first use here)."""
        return self._state

    def _new_state(self) -> ProcessState:
        """A new process's state; a finalizer saves its write-back and last uses at exit."""
        catalog = open_serving_catalog(self._layout, shared=self._shared)
        writeback = WriteBack(
            self._layout,
            self._recipe_fp,
            on_sealed=functools.partial(_tell_published, weakref.ref(self)),
            clock=self._clock,
            policy=SealPolicy(),
            catalog=catalog,
        )
        st = ProcessState(
            len(self),
            self._shared_map,
            writeback,
            catalog,
            self._index.keys,
            self._ram_total,
            self.verify,
            self.max_open_shards,
            self._clock,
        )
        # Runs at interpreter exit and in multiprocessing children (DataLoader workers)
        # when their loop ends, so a worker's last write-back shard is sealed.
        mp_util.Finalize(st, save_at_exit, args=(st.saver,), exitpriority=10)
        return st

    #: Everything this process opened to serve the dataset (handles, connection, RAM tier,
    #: write-back); a forked DataLoader worker closes its copies of the parent's shard files
    #: and makes its own, never saving the parent's write-back.
    _state: ProcessLocal[ProcessState] = ProcessLocal(
        _new_state, on_inherited=ProcessState.drop_inherited
    )

    def __getitem__(self, i: int) -> Any:
        st = self._state
        if type(i) is not int or not 0 <= i < len(self._index.keys):
            i = self._index.position(i)
        if self.revalidate:
            revalidate(self._index, st, (i,), self._named_folder)
        value = self._reads.item(st, i)  # the RAM tier or the store, as served
        if value is None:
            value = self._reads.as_served(self._misses.values(st, [i])[0])
        view = self._layer_view
        return value if view is None else view_layers(value, view)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Read a batch at once: the DataLoader calls this with each batch's indices.

        When every item is a stored single tensor, the items are read straight into one
        zero-padded batch tensor (in shared memory inside a worker) and returned as a
        :class:`~featbake.collate.PaddedBatch` of views into it, which :func:`pad_collate` hands
        on without copying again. Otherwise (misses, dict outputs, mixed shapes) each item is read
        on its own, and misses in the batch are encoded together.
        """
        st = self._state
        n = len(self._index.keys)
        idx = [i if type(i) is int and 0 <= i < n else self._index.position(i) for i in indices]
        if self.revalidate:
            revalidate(self._index, st, idx, self._named_folder)
        if self._index.parts == ("",) and idx and self._layer_view is None:
            batch = self._reads.padded(st, idx, self._served)  # served: dequantised as read
            if batch is not None:
                return batch
        reads = self._reads
        values = [reads.item(st, i) for i in idx]
        missing = [j for j, v in enumerate(values) if v is None]
        if missing:
            found = self._misses.values(st, [idx[j] for j in missing])
            for j, value in zip(missing, found, strict=True):
                values[j] = reads.as_served(value)
        view = self._layer_view
        return values if view is None else [view_layers(v, view) for v in values]

    def _published(self, shard: SealedShard) -> None:
        """A write-back shard was sealed: point its items at it (this process's state only)."""
        self._misses.published(CachedFeatureDataset._state.peek(self), shard)


__all__ = [
    "TOUCH_FLUSH_ITEMS",
    "TOUCH_FLUSH_SECONDS",
    "TOUCH_REPEAT_SECONDS",
    "WRITEBACK_BYTES",
    "WRITEBACK_ITEMS",
    "WRITEBACK_SECONDS",
    "CachedFeatureDataset",
    "ServeStats",
    "ram_budget_for_process",
    "refuse_revalidate_of_objects",
    "revalidate",
]
