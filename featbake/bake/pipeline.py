"""The build: scan a data folder, key every input, encode what the store lacks, seal shards.

:func:`build` runs named steps in order: open the store and the encoder, key each input
(:meth:`_Bake.plan`), publish the manifest, then encode the missing items (:class:`_EncodeRun`)
behind decode workers while a writer thread fills shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from featbake.bake.arguments import BuildArguments, check_build_arguments, check_encoder_found
from featbake.bake.batching import Batching, BatchingMode, BatchRunner, budget_samples
from featbake.bake.derive import StoredSource, derivation_plan, stored_sources
from featbake.bake.engine_wire import ENGINE_PROTOCOL, CarriedError, check_protocol
from featbake.bake.interrupt import interrupt_at_safe_points
from featbake.bake.options import BakeOptions
from featbake.bake.ranks import (
    BuildView,
    RankSpec,
    check_views_agree,
    device_for_rank,
    listing_digest,
    my_part,
    owned_by_lower_ranks,
    resolve_rank,
)
from featbake.bake.report import BuildReport, FailureCause
from featbake.bake.stored import DEFAULT_MAX_ERROR, Compactor
from featbake.bake.threads import (
    DEFAULT_SEAL_SECONDS,
    HeldSource,
    WriterThread,
    decoded_items,
)
from featbake.device import check_device, process_cpus, torch_threads
from featbake.encode.encoders import LoadedEncoder, detect_kind, from_module
from featbake.encode.fingerprints import (
    Digester,
    HeldBytes,
    cached_file_encoder,
    digest_here,
    encoder_fingerprint,
    loaded_state,
)
from featbake.encode.hf import HF, check_recipe_supported, is_hf_folder, recipe_for_encoder
from featbake.encode.inputs import (
    Inputs,
    carried_values,
    carry_to,
    digested_anywhere,
    falling_back_to,
    inputs_at,
    paths_taken,
    takes_paths_from_workdir,
    taking_paths_as,
    workdir_of,
)
from featbake.encode.loaders import is_import_path, load_encoder
from featbake.encode.manifests import Item
from featbake.encode.outputs import nonfinite_build_failure, nonfinite_part
from featbake.encode.sources import ScanResult, Source, file_stat_or_none, source_for
from featbake.encode.tables import CarriedCell, Table
from featbake.encode.webdataset import WebDataset
from featbake.errors import (
    ConfigError,
    EncodeError,
    EncoderLoadError,
    FeatbakeError,
    SourceError,
    StoreError,
)
from featbake.gcpause import gc_paused
from featbake.keys import feature_key, root_id
from featbake.progress import Progress
from featbake.recipe import Recipe
from featbake.store.byteplace import bytes_at
from featbake.store.catalog import BuildCatalog, Catalog
from featbake.store.claims import this_host
from featbake.store.containers import container_cut
from featbake.store.features import Parts
from featbake.store.fidelity import Measured, recorded_serve_dtype
from featbake.store.fragment_catalog import FragmentCatalog, RankPart
from featbake.store.fragments import build_id, fragment_keys, parse_name, sealed_fragments
from featbake.store.hash_cache import FileStat, HashCache, HashCacheRow, HashEntry, HashRow
from featbake.store.layout import Layout
from featbake.store.merge import MergeReport, adopt_sealed_parts
from featbake.store.open import Need, StoreRef, open_store, place_of
from featbake.store.roots import (
    PaddingRecord,
    RootSpec,
    clear_padding,
    padding_file,
    padding_of,
    read_padding,
    write_held,
    write_padding,
    write_undecodable,
)
from featbake.store.shard import DEFAULT_SHARD_BYTES

# == parts =========================================================================================
# A build done in parts: pick this rank's inputs, and merge once every rank is done.
#
# The pure half (which rank, which inputs) is bake/ranks.py; this module does the I/O around it:
# stat the inputs to balance parts by bytes, hand the pipeline a :class:`FragmentCatalog` (so the
# rank writes fragments, never the shared catalog), and under torchrun hold a barrier so that
# rank 0 merges once every rank has sealed its fragment, and every rank returns with the store
# merged.
#: How long a rank waits at the barrier for the slowest one (a gloo default of 30 min is far
#: too short for a build whose parts end hours apart).
BARRIER_TIMEOUT = datetime.timedelta(days=7)

T = TypeVar("T")


class PartOfBuild(NamedTuple):
    """What :func:`catalog_for_part` gives a process: the catalog it writes through, the inputs
    it does, and (relative path, bytes) of every input of the build (empty for one process
    writing the catalog), which its build id is made of."""

    catalog: BuildCatalog
    inputs: list[str]
    listing: list[tuple[str, int]]


def catalog_for_part(
    layout: Layout, spec: RankSpec, inputs: Inputs, rel_paths: list[str], *, fragments: bool = False
) -> PartOfBuild:
    """The catalog this process writes through, the inputs it does (all, for one process), and
    the build's listing.

    Each rank stats every input (cheap) but hashes and encodes only its own part. A build into
    a bucket store always writes fragments (its tier's catalog is a published version, never
    written in place), after bringing in the bucket's fragments: a rerun on another node skips
    what the killed run sealed. One process on a local store adds the shards that parts sealed
    (a part killed before its end, parts not merged yet) to the catalog first, so it encodes
    none of them again. A build run by an :class:`Engine` (``fragments``) always writes
    fragments: its workers seal their own, and the driver merges them all at the end.
    """
    place = place_of(layout)
    if not spec.sharded and not place.builds_in_fragments() and not fragments:
        catalog = Catalog(layout)
        try:
            adopt_sealed_parts(catalog)
        except BaseException:
            catalog.close()
            raise
        return PartOfBuild(catalog, rel_paths, [])
    place.sync_fragments()
    sizes = [inputs.size(p) for p in rel_paths]
    listing = list(zip(rel_paths, sizes, strict=True))
    mine = my_part(sizes, spec) if spec.sharded else list(range(len(rel_paths)))
    part = RankPart(spec.rank, spec.world, listing)
    return PartOfBuild(FragmentCatalog(layout, part), [rel_paths[i] for i in mine], listing)


def scanned_inputs(place: Inputs, layout: Layout, extensions: Sequence[str]) -> ScanResult:
    """``place``'s scan; tars in a bucket look up their member listings in the store's hash
    cache (read-only here: the build records new ones as it hashes), so a rebuild over unchanged
    shards reads no tar header again. A Kaldi folder or cut manifest takes a relative path it
    does not find from here from the folder its last build took it from."""
    falling_back_to(place, last_build_workdir(place, layout))
    if not (isinstance(place, (WebDataset, Table)) and place.remote):
        return place.scan(extensions)
    with known_catalog(layout) as known:
        place.known = known  # None (no catalog yet, or none to read): nothing is known
        try:
            return place.scan(extensions)
        finally:
            place.known = None


@contextmanager
def known_catalog(layout: Layout) -> Iterator[Catalog | None]:
    """The store's catalog, read-only, for what earlier builds recorded; None where there is
    none yet or it cannot be opened (the build then knows nothing, and says so later)."""
    known: Catalog | None
    try:
        known = Catalog(layout, read_only=True)
        if not known.path.exists():
            known = None
    except (StoreError, sqlite3.Error):
        known = None
    if known is None:
        yield None
        return
    with contextlib.closing(known):
        yield known


def last_build_workdir(place: Inputs, layout: Layout) -> str:
    """The folder the last build of ``place`` took its relative paths from (its newest root's
    :attr:`~featbake.store.roots.Root.workdir`; ``""`` if none, or if ``place`` does not take
    them from the working directory). A rebuild run from another directory reads a path it
    does not find from there where that build read it: before, it failed every such row and
    published a root without them, whose features a gc then deleted."""
    if not takes_paths_from_workdir(place):
        return ""
    with known_catalog(layout) as known:
        roots = known.roots() if known is not None else []
    return next((r.workdir for r in roots if r.data == place.where and r.workdir), "")


@contextmanager
def _process_group() -> Iterator[None]:
    """torch.distributed's default group: the caller's, or a gloo one made (and torn down) here."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def rank_group(spec: RankSpec) -> Iterator[None]:
    """Under torchrun, one process group for the whole build (the key exchange, then the
    barrier before merging); nothing for a single process or parts launched one by one."""
    if not spec.launched_together:
        yield
        return
    with _process_group():
        yield


def keys_for_other_ranks(spec: RankSpec, keys: Sequence[str]) -> set[str]:
    """Under torchrun: the keys another rank encodes (identical files on two ranks are encoded
    once, by the lowest rank holding the key). Parts without a process group (``--shard``,
    SLURM arrays) exchange nothing: each encodes its own, and `featbake merge` keeps one copy.
    """
    if not spec.launched_together:
        return set()
    return owned_by_lower_ranks(spec.rank, gathered(spec, list(keys)))


def gathered(spec: RankSpec, mine: T) -> list[T]:
    """Every torchrun rank's ``mine``, in rank order (each rank calls it at the same step)."""
    out: list[T | None] = [None] * spec.world
    dist.all_gather_object(out, mine)
    return cast(list[T], out)


def check_ranks_agree(spec: RankSpec, view: BuildView, listing: list[tuple[str, int]]) -> None:
    """Under torchrun, before any rank encodes: stop every rank unless all see the build rank 0
    sees (the root, encoder, recipe and inputs its id is made of). Each rank would otherwise
    seal fragments of a build of its own that never completes: the job exited 0 and published
    no root. The listings are exchanged only where they differ, to name the inputs that do.

    Raises:
        RanksDisagree: on every rank alike, naming the first rank that differs and how.
    """
    if not spec.launched_together:
        return
    views = gathered(spec, view)
    differ = any(v.listing != views[0].listing for v in views)
    check_views_agree(views, gathered(spec, listing) if differ else ())


def finish_part(
    layout: Layout, spec: RankSpec, fragment: str | None, *, merge: bool = False
) -> bool:
    """Under torchrun: wait for all ranks, rank 0 merges, all return merged (True on every rank;
    the rank that merged checks its build was published, and tells the others).

    Parts launched one by one (``--shard``, SLURM arrays) return at once: `featbake merge` runs
    when they are all done (a SLURM job with ``--dependency=afterok`` on the array). A single
    process building into a bucket store merges (publishes the next catalog version) itself,
    as does the driver of an engine's build (``merge``: its workers' fragments, then its own).
    ``fragment``: this process's ``done`` fragment (None: it sealed none), whose build must
    not be left waiting by the merge.

    Raises:
        StoreError: the merge left this build waiting (its ranks formed other builds).
    """
    if not spec.sharded and (merge or place_of(layout).builds_in_fragments()):
        _raise_if_waiting(unmerged(place_of(layout).merge(), fragment))
        return True
    if not spec.launched_together:
        return False
    with _process_group():
        dist.barrier()
        said = [unmerged(place_of(layout).merge(), fragment) if spec.rank == 0 else ""]
        dist.broadcast_object_list(said, src=0)  # after the merge: every rank waits for it
    _raise_if_waiting(said[0])
    return True


def unmerged(report: MergeReport, fragment: str | None) -> str:
    """What the merge that gave ``report`` left of the build of ``fragment`` (a ``done``
    fragment's name): "" where it left nothing (merged, or no fragment), else one line."""
    name = parse_name(Path(fragment)) if fragment else None
    if name is None:
        return ""
    damaged = [f for f in report.damaged if f.startswith(f"{name.build_id}.")]
    if damaged:
        return f"its fragment {damaged[0]} could not be read"
    waiting = [p for p in report.pending if p.build_id == name.build_id]
    return waiting[0].describe() if waiting else ""


def _raise_if_waiting(left: str) -> None:
    """Raise where the merge left this build unpublished (``left``: what it left, see
    :func:`unmerged`): the build must not report itself merged."""
    if left:
        raise StoreError(
            f"every part of this build finished, but the merge published nothing of it "
            f"({left}); rerun the build (what its parts sealed is reused)"
        )


def fidelity_as_served(
    said: dict[str, Any] | None, measured: Measured | None, served: str | None
) -> dict[str, Any] | None:
    """The report's fidelity (``said``) measured in ``served``, the dtype the root's record
    says datasets serve it in, where that is another: a rebuild over a root recorded float32
    keeps serving float32 whatever the items it encoded hold (``write_fidelity``), and its
    summary named float16. ``said`` where nothing says otherwise, or nothing was measured."""
    if said is None or measured is None or served is None or said.get("served") == served:
        return said
    tally = measured.tallies.get(served)
    return tally.result(served).to_json() if tally is not None and tally.items else said


# == redo ==========================================================================================
# Padded items stored before padding was found inexact, encoded again on exact shapes.
#
# The exactness guard (:mod:`featbake.bake.batching`) re-runs the most padded item of each padded
# batch alone. An encoder whose drift depends on the amount of padding in another way (largest
# when an item is padded a little, say) passes that check on early batches while their less
# padded items are off; when a later batch fails the guard, the build goes on in exact shapes,
# but the early batches are sealed by then. Once padding is known inexact for the encoder, every
# item this build encoded in a padded batch is decoded and encoded again alone, and replaces the
# stored one: the catalog's rows of those keys are dropped first (their old bytes are unreferenced
# and gc reclaims them), so the new rows go in. A rank of a build in parts cannot change its
# sealed fragments: its new rows go into later fragments, and the merge folds a build's newer
# fragments first (store/merge.py), so they win.
class PaddedItem(NamedTuple):
    """An item a padded batch stored: its key, its input, and the stat its key was hashed at
    (decoding it again checks the file did not change since)."""

    key: str
    path: str
    stat: FileStat | None


@dataclass(frozen=True)
class Redone:
    """What the pass did: items encoded again and stored, and items that could not be (their
    features are dropped: a dataset encodes them live, exactly, on their next read)."""

    stored: int
    dropped: int

    def note(self) -> str:
        """The clause added to the build's batching note."""
        text = f"; the {self.stored + self.dropped} items padded before were encoded again alone"
        return text + (f" ({self.dropped} could not be, and were dropped)" if self.dropped else "")


def encode_padded_again(
    items: Sequence[PaddedItem],
    runner: BatchRunner,
    compactor: Compactor,
    writer: WriterThread,
    source: Source,
    workers: int,
    allow_nonfinite: bool,
) -> Redone:
    """Encode ``items`` alone and store them in place of their padded features.

    ``writer`` is a fresh writer, closed here (every shard of the first pass is sealed before:
    the rows dropped are theirs). ``runner`` is in exact mode by now. The caller forgot their
    rows first (``_Bake.forget_stored``: a rank's fragment sealed then says it replaces them).
    """
    keys, stored = [it.key for it in items], 0
    try:
        paths, stats = [it.path for it in items], [it.stat for it in items]
        for i, item in decoded_items(paths, source, workers, stats):
            if isinstance(item, str):
                continue  # the file changed or vanished since: its row is gone, nothing wrong
            try:
                parts = runner.encode_exact([item])[0]
            except EncodeError:
                continue  # it encoded padded, not alone: dropped, a read encodes it live
            if not allow_nonfinite and nonfinite_part(parts) is not None:
                continue
            writer.put(keys[i], compactor.store(keys[i], parts, measure=False))
            stored += 1
    finally:
        writer.close()
    return Redone(stored, len(items) - stored)


# == pipeline ======================================================================================
ProgressFn = Callable[[Progress], None]


def build(  # noqa: PLR0913  (public API: one keyword per option, as in the CLI)
    data: str | os.PathLike[str],
    encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
    *,
    cache: StoreRef = None,
    recipe: Recipe | None = None,
    weights: str | os.PathLike[str] | None = None,
    trust_pickle: bool = False,
    batch_size: int = 16,
    workers: int | None = None,
    device: str | torch.device = "cpu",
    strict: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: ProgressFn | None = None,
    allow_nonfinite: bool = False,
    batching: str = "auto",
    batch_seconds: float | None = None,
    batch_samples: int | None = None,
    shard: str | None = None,
    threads: int | None = None,
    max_error: float | None = DEFAULT_MAX_ERROR,
    seal_every: float = DEFAULT_SEAL_SECONDS,
    column: str | None = None,
    engine: Engine | None = None,
) -> BuildReport:
    """Run ``encoder`` over every input under ``data`` once and store the features.

    Args:
        data: the data folder (scanned recursively, in sorted order), or a bucket prefix
            ``s3://bucket/audio/`` (its objects listed in name order, each read from its bytes;
            see :mod:`featbake.encode.inputs`), or a manifest, Kaldi data folder or lhotse cut
            manifest (one item per row or segment, in the data's order; see
            :mod:`featbake.encode.manifests`).
        encoder: a TorchScript/.pt2 path, an import path, or an already loaded encoder.
        cache: the store directory (default ``$FEATBAKE_CACHE`` or ``./.featbake``), a bucket
            (``s3://bucket/prefix``), or a layout from :func:`featbake.store.open.open_store`.
        recipe: preprocessing and storage options (part of every key).
        weights: safetensors weights for an import-path encoder.
        trust_pickle: allow a pickled whole-module checkpoint (runs its code).
        batch_size: inputs per encoder call at most.
        workers: DataLoader worker processes for decoding (0: decode in this process; None:
            chosen from the CPUs this process may use, see :func:`featbake.cpus.bake_threads`).
        device: where the encoder runs.
        strict: stop at the first bad input instead of skipping it.
        shard_bytes: target shard size.
        progress: called with :class:`Progress` as hashing and encoding advance.
        allow_nonfinite: store features holding NaN or infinite values (by default such an
            input fails: a NaN feature would poison every training step that reads it).
        batching: ``auto`` (padded length-sorted batches when the encoder takes lengths, else
            exact shapes), ``padded`` or ``exact`` (see :mod:`featbake.bake.batching`).
        batch_seconds: padded batches hold at most this much audio, padding included
            (default 160 s); ``batch_samples`` sets the same budget in samples.
        shard: ``"I/N"``: do part I of N (see bake/ranks.py); without it, the part torchrun or
            SLURM gave this process, if any. A part writes catalog fragments for `featbake merge`.
        threads: the encoder's torch intra-op threads while it encodes (restored after). None:
            the count torch has after the encoder loaded (``torch.set_num_threads``,
            ``OMP_NUM_THREADS`` or the encoder's own setting), lowered only when it exceeds
            the CPUs this process may use; see :func:`featbake.cpus.encoder_threads`.
        max_error: for ``int8``/``fp8``, the relative RMS error (measured on a sample against
            the encoder's output, see :mod:`featbake.bake.stored`) above which the report
            says so (``report.fidelity_warning``); None: no bound.
        seal_every: seconds after which a shard being filled is sealed whatever its size, so
            that a process killed with SIGKILL (preemption, the OOM killer) loses at most about
            this much encoding; a rerun encodes only what was not sealed.
        column: the manifest's column that names each item's input (default ``path``).
        engine: where the misses are encoded (:class:`Engine`, e.g.
            :class:`featbake.bake.ray_engine.RayEngine`): the inputs are listed and keyed here
            as always (the ones the hash cache does not know may be read and hashed by the
            engine's workers: :meth:`Engine.digester`), the engine's workers encode and seal
            what the store lacks (``device`` is theirs; this process only keys), and this
            process merges their fragments at the end. None: this process encodes.

    Returns:
        A :class:`BuildReport`; ``report.failed`` names each input that was skipped.

    Raises:
        SourceError, EncodeError: with ``strict``, the first bad input.
        ConfigError: an option out of range (see :mod:`featbake.bake.arguments`), before any
            work; also from the first batch, for an ``output`` the encoder does not return.
        EncoderLoadError, StoreError, ConfigError: nothing could be built.

    Example:
        >>> report = build("./audio", "ckpt.pt", cache=".featbake")  # doctest: +SKIP
        >>> report.encoded, report.reused  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    args = BuildArguments(
        batching, batch_size, workers, shard_bytes, batch_seconds, batch_samples, encoder, threads,
        seal_every,
    )  # fmt: skip
    check_build_arguments(args, process_cpus())
    check_encoder_found(encoder)  # before the data: a wrong path is named, not "no inputs"
    # A Hugging Face folder's preprocessor config sets the input (sample rate, normalisation)
    # and resolves layers="all": before the source is made from the recipe.
    recipe = recipe_for_encoder(encoder, recipe or Recipe())
    spec = resolve_rank(shard, os.environ)
    if engine is not None and spec.sharded:
        raise ConfigError(
            f"this process is {spec.describe()}, and an engine spreads the build itself: run "
            "one `featbake build --engine ray` (no --shard, torchrun or SLURM array)"
        )
    # An engine starts (its cluster, its workers) once needed, beside this process's hashing;
    # it may hash the inputs the hash cache does not know (Engine.digester).
    with started(engine) as engine:
        dev = check_device(device_for_rank(str(device), spec)) if engine is None else _cpu(device)
        on_gpu = dev.type != "cpu"
        options = BakeOptions(
            batch_size, workers, strict, shard_bytes, on_gpu, allow_nonfinite, threads, max_error,
            seal_every,
        )  # fmt: skip
        options.check_recipe(recipe)
        layout = open_store(cache, need=Need.WRITE).ensure()
        # A folder, a bucket prefix, a manifest (see OPENERS); a manifest's texts for source text.
        place = inputs_at(data, column, recipe.source)
        source = place.source(source_for(recipe))
        scanned = scanned_inputs(place, layout, source.extensions)
        catalog, inputs, listing = catalog_for_part(
            layout, spec, place, scanned.inputs, fragments=engine is not None
        )
        with contextlib.closing(catalog):
            enc = BuildEncoder.named(encoder, weights, dev, trust_pickle, recipe, catalog)
            budget = budget_samples(recipe, batch_seconds, batch_samples)
            runs = RunnerSpec(batching, batch_size, budget)
            elsewhere = None if engine is None else Elsewhere(engine, data, str(device))
            bake = _Bake(
                catalog, layout, enc, recipe, source, place, options, runs, progress, column=column,
                elsewhere=elsewhere,
            )  # fmt: skip
            # Files skipped at the scan (not regular files) are reported by one part only.
            skipped = scanned.skipped if spec.rank == 0 else []
            bake.start(len(inputs), skipped)
            bake.report.notes = list(scanned.notes) if spec.rank == 0 else []
            bake.report.part = spec.describe() if spec.sharded else ""
            bake.run(inputs, spec, listing, merge=engine is not None)
    bake.report.seconds = time.perf_counter() - t0
    return bake.report


def loaded_encoder(
    encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
    weights: str | os.PathLike[str] | None,
    device: torch.device,
    trust_pickle: bool,
    recipe: Recipe,
) -> LoadedEncoder:
    """The encoder ready to run: loaded from a path or import path, or wrapped as given.

    Raises:
        ConfigError: the recipe asks for hidden layers or an output this encoder cannot give.
    """
    if isinstance(encoder, LoadedEncoder):
        enc = encoder
    elif isinstance(encoder, torch.nn.Module):
        enc = from_module(encoder, device=device)
    else:
        enc = load_encoder(
            encoder, weights=weights, device=device, trust_pickle=trust_pickle, layers=recipe.layers
        )
    check_recipe_supported(enc, recipe)
    return enc


class RunnerSpec(NamedTuple):
    """How the build batches (the :class:`BatchRunner` made once the encoder is loaded)."""

    batching: str
    batch_size: int
    budget: int


@dataclass
class BuildEncoder:
    """The build's encoder, loaded only when the build needs it.

    A rebuild that finds every feature stored encodes nothing, and needs of the encoder only
    its key: a TorchScript or ``.pt2`` file's fingerprint is its bytes' digest, remembered in
    the hash cache against the file's stat, so it is known unloaded (loading a large
    checkpoint took longer than the rest of such a rebuild; issue 31 item 4). A Hugging Face
    folder's fingerprint is remembered against its files' stats and what builds its model
    (:class:`featbake.encode.fingerprints.FolderState`): a rebuild of an unchanged folder
    imports no transformers. An import path or a pickle is identified by its code too: it is
    loaded at once, as before.
    """

    spec: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module
    weights: str | os.PathLike[str] | None
    device: torch.device
    trust_pickle: bool
    recipe: Recipe
    label: str
    kind: str
    known_fp: str | None = None  # the fingerprint, known without loading (None once loaded)
    loaded: LoadedEncoder | None = None
    #: What ``known_fp`` was found cached for (a file's stat, a folder's state), where this
    #: process looked it up; None where it came from elsewhere (an engine's driver).
    known_state: FileStat | str | None = None

    @classmethod
    def named(
        cls,
        spec: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
        weights: str | os.PathLike[str] | None,
        device: torch.device,
        trust_pickle: bool,
        recipe: Recipe,
        cache: HashCache,
    ) -> BuildEncoder:
        """The encoder ``spec`` names, left unloaded when its file's fingerprint is cached.

        Raises:
            EncoderLoadError, ConfigError: it was loaded here, and could not be (see
                :func:`loaded_encoder`).
        """
        args = (spec, weights, device, trust_pickle, recipe)
        path = unloaded_file(spec, weights)
        cached = None if path is None else cached_file_encoder(cache, path)
        if path is None or cached is None:
            enc = loaded_encoder(*args)
            return cls(*args, enc.label, enc.kind, loaded=enc)
        kind = HF if os.path.isdir(path) else detect_kind(Path(path))
        label = str(Path(path).resolve())
        return cls(*args, label, kind, known_fp=cached.fp, known_state=cached.state)

    def fingerprint(self, catalog: HashCache) -> str:
        """``encoder_fp``: from the hash cache, or from the loaded encoder (and cached there)."""
        if self.loaded is None:
            assert self.known_fp is not None
            return self.known_fp
        return encoder_fingerprint(self.loaded, catalog, _weights_str(self.weights))

    def load(self) -> LoadedEncoder:
        """The encoder ready to run, loaded on the first call.

        Its fingerprint stays the one the hash cache gave where the file (or folder) loaded
        still has the stat it was cached against, the trust :func:`encoder_fingerprint` gives
        a loaded encoder's file as well. Elsewhere (an engine's worker, given the driver's
        fingerprint; a file replaced since it was looked up) its weights are hashed and must
        give that fingerprint: the build's keys were made with it.

        Raises:
            EncoderLoadError: the encoder cannot be loaded, or is not the one the build's keys
                name (it changed while the build ran).
        """
        if self.loaded is None:
            loaded = loaded_encoder(self.spec, self.weights, self.device,
                                    self.trust_pickle, self.recipe)  # fmt: skip
            if self.known_fp is not None:
                if self.known_state is None or loaded_state(loaded) != self.known_state:
                    self._check_same_encoder(loaded)
                loaded._fingerprint = self.known_fp
            self.loaded = loaded
        return self.loaded

    def state(self) -> FileStat | str | None:
        """What the encoder's file (a stat) or folder (its state) was when its fingerprint was
        found or made here; None where none stands for it (a module, a changed file). An
        engine's worker on this host that loads the file in that state trusts the fingerprint
        without hashing the weights again (:class:`EngineJob`'s ``encoder_state``). A loaded
        file's stat stands for it only past the racy window (a file rewritten within its
        stamps' tick keeps its stat), and a loaded folder's not at all: its worker hashes."""
        if self.loaded is None:
            return self.known_state  # a cached fingerprint's: trusted past the racy window
        seen = self.loaded.loaded_from
        if self.loaded.folder_state is not None or seen is None or seen.stat.racy(seen.taken_ns):
            return None
        return seen.stat

    def _check_same_encoder(self, loaded: LoadedEncoder) -> None:
        """Raise unless ``loaded``'s weights give the fingerprint the build keys by."""
        if loaded.fingerprint != self.known_fp:
            raise EncoderLoadError(
                f"the encoder {self.label} changed while this build ran (its weights are not "
                f"the ones its keys were made with, {str(self.known_fp)[:12]}); nothing was "
                "stored from it: run the build again"
            )


def unloaded_file(
    spec: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module,
    weights: str | os.PathLike[str] | None,
) -> str | None:
    """The file or folder an encoder can be keyed by unloaded (TorchScript or ``.pt2``, a
    Hugging Face folder; a pickle's key needs its class's code), else None."""
    if weights is not None or not isinstance(spec, (str, os.PathLike)):
        return None
    path = os.fspath(spec)
    if is_import_path(path) or not (os.path.isfile(path) or is_hf_folder(path)):
        return None
    return path


def _weights_str(weights: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(weights) if weights is not None else None


@dataclass
class _Bake:
    """One build's state between its steps (see :func:`build` for their order)."""

    catalog: BuildCatalog
    layout: Layout
    enc: BuildEncoder
    recipe: Recipe
    source: Source
    place: Inputs
    options: BakeOptions
    runs: RunnerSpec
    progress: ProgressFn | None
    report: BuildReport = field(init=False)
    manifest: list[tuple[str, str]] = field(default_factory=list)
    hashed_stats: dict[str, FileStat] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # key -> its input's SHA-256
    rel_of: dict[str, str] = field(default_factory=dict)  # path -> the item's name (its id)
    compactor: Compactor = field(init=False)  # quantises int8/fp8 and measures their fidelity
    held: HeldBytes = field(default_factory=HeldBytes)  # input bytes from hashing, to decode
    column: str | None = None  # the manifest's or table's column the user named (the root's)
    made_runner: BatchRunner | None = None  # made with the loaded encoder (see :attr:`runner`)
    stored: set[str] | None = None  # keys found stored before the manifest (see plan)
    #: the catalog's count of other writers' commits when ``stored`` was read (see others_commits)
    stored_at: int | None = None
    elsewhere: Elsewhere | None = None  # another engine encodes the misses (see encode)
    #: Keys the last :meth:`encode` stored from padded batches and did not encode again (its
    #: padding held every check): an engine's driver has them encoded again alone if another
    #: worker's check failed (see :meth:`encode_elsewhere`).
    padded_left: list[str] = field(default_factory=list)
    #: Keys :meth:`encode_missing` found stored and reused, and the catalog's count of other
    #: writers' commits when it looked (see :meth:`fail_lost_reuse`).
    reused_keys: set[str] = field(default_factory=set)
    reused_at: int | None = None
    #: An unfinished build's record of what it set out to encode while it may pad (see
    #: :class:`~featbake.store.roots.PaddingRecord`), and the keys of it found stored (key ->
    #: path): encoded again alone once padding is known inexact. Read by the build's driver.
    padding: PaddingRecord = field(default_factory=PaddingRecord)  # every part's together
    suspects: dict[str, str] = field(default_factory=dict)
    own_padding: PaddingRecord | None = None  # this part's record, once it wrote one
    padding_part: str = "0-of-1"  # this part of the build ("<rank>-of-<world>")

    @property
    def runner(self) -> BatchRunner:
        """The batch runner (see :meth:`ready_runner`)."""
        return self.ready_runner()

    def ready_runner(self) -> BatchRunner:
        """The batch runner, made (and the encoder loaded) on the first call.

        Raises:
            EncoderLoadError: the encoder cannot be loaded.
            ConfigError: ``--batching padded`` for an encoder that takes no lengths, or
                layers or an output it cannot give.
        """
        if self.made_runner is None:
            runs = self.runs
            enc = self.enc.load()
            self.made_runner = BatchRunner(enc, self.recipe, runs.batching, runs.batch_size,
                                           runs.budget)  # fmt: skip
        return self.made_runner

    def start(self, inputs: int, skipped: Sequence[tuple[str, str]]) -> None:
        """Fingerprint the encoder and recipe, and open the report with the skipped files."""
        enc_fp = self.enc.fingerprint(self.catalog)
        recipe_fp = self.recipe.fingerprint()
        self.catalog.record_encoder(enc_fp, self.enc.label, self.enc.kind)
        name = root_id(self.place.where, self.enc.label, recipe_fp, self.column)
        files = inputs + len(skipped)
        self.report = BuildReport(name, self.place.where, self.enc.label, enc_fp, recipe_fp, files)
        self.compactor = Compactor(self.recipe)
        # How inputs were batched is said once something was (see encode): a rebuild that
        # encodes nothing batches nothing, and may never load the encoder that decides it.
        for rel, reason in skipped:
            self.skip(rel, reason, SourceError(f"{rel}: {reason}"))

    def plan(self, rel_paths: Sequence[str]) -> dict[str, str]:
        """Hash every input and fill the manifest.

        Returns:
            key -> the absolute path of the first input with that key.
        """
        abs_paths = [self.place.path(p) for p in rel_paths]
        digests, unreadable = self.hashed(abs_paths)
        todo: dict[str, str] = {}
        for rel, path in zip(rel_paths, abs_paths, strict=True):
            self.rel_of[path] = rel
            if path in unreadable:
                self.skip(rel, unreadable[path], SourceError(f"{rel}: {unreadable[path]}"))
                continue
            key = feature_key(self.report.encoder_fp, self.report.recipe_fp, digests[path])
            self.manifest.append((rel, key))
            if key in todo:
                self.report.duplicates += 1
            todo.setdefault(key, path)
            self.digests.setdefault(key, digests[path])
        return todo

    def hashed(self, paths: list[str]) -> tuple[dict[str, str], dict[str, str]]:
        """(path -> SHA-256, path -> why it could not be read) of ``paths``, through the hash
        cache (``stats`` filled in :attr:`hashed_stats`).

        A plain build keeps the bytes it hashed, to decode them from (read once). With another
        engine, whose workers read their inputs themselves, none are kept, and the inputs the
        hash cache does not know (a folder's files, a bucket prefix's objects, the files a
        manifest names, the tar shards and table files of new members and cells) are read by
        the engine's :class:`Digester` (Ray: tasks on the cluster, not this process); a
        manifest's texts are hashed here (see :func:`digested_anywhere`).
        """
        elsewhere, digester = self.elsewhere, digest_here
        if elsewhere is not None and digested_anywhere(self.place):
            digester = engine_digester(elsewhere.engine)
        held = self.held if elsewhere is None else None  # an engine's workers read their own
        return self.place.hash(self.catalog, paths, self.progress, self.hashed_stats, held,
                               digester)  # fmt: skip

    def load_encoder_unless_stored(self, todo: Mapping[str, str]) -> None:
        """Load the encoder (and make the runner) unless every key in ``todo`` is stored.

        Before the manifest is published, as the encoder always was: an encoder that cannot
        load (or a ``--batching`` it cannot take) leaves the store as it was. A no-op rebuild
        of a file encoder whose fingerprint was cached loads nothing.
        """
        if self.enc.loaded is None:
            self.stored_at = self.catalog.others_commits()  # before: a commit meanwhile counts
            self.stored = self.catalog.present_keys(list(todo))
            if len(self.stored) == len(todo):
                return
        self.ready_runner()  # loaded (for its key, or to encode): its errors come now

    def run(
        self, inputs: list[str], spec: RankSpec, listing: list[tuple[str, int]], *, merge: bool
    ) -> None:
        """Key ``inputs``, publish the manifest, encode what is missing and record what failed;
        a part then seals its ``done`` fragment, and merges as :func:`finish_part` says
        (``merge``: an engine's driver merges its workers' fragments). Under torchrun the ranks
        first check that they all see one build (:func:`check_ranks_agree`), then exchange keys.
        """
        self.padding_part = f"{spec.rank}-of-{spec.world}"
        with rank_group(spec):
            check_ranks_agree(spec, self.view(listing), listing)
            with gc_paused():  # tens of thousands of small rows, no cycles: see gcpause.py
                todo = self.plan(inputs)
                self.load_encoder_unless_stored(todo)  # before the manifest, as it always was
                self.publish_manifest()
            self.encode_missing(self.leave_to_other_ranks(todo, spec))
            self.record_undecodable()
            self.fail_lost_reuse()  # after: decodable inputs, misses to a dataset (encoded)
            if self.catalog.fragmented:
                self.report.fragment = self.catalog.finish()
                self.report.merged = finish_part(
                    self.layout, spec, self.report.fragment, merge=merge
                )
                self.report.merged_by = "rank 0" if self.report.merged and spec.rank else ""

    def fail_lost_reuse(self) -> None:
        """Count failed, in one line each, the inputs whose stored features this build reused
        and another process deleted while it encoded the rest (a ``gc --max-bytes`` evicts
        what roots reach; a plain build holds no claim on what it reuses): the build said
        them reused and exited 0, its root missing them. The rerun encodes them. Looked up
        again (one query, a ``stat`` per shard) only after a build that encoded something and
        where a commit came since (the build's own writer threads count: their connections
        are others'). A part or a dataset's writer keeps its keys by its claim instead."""
        if not self.reused_keys or not self.report.encoded or self.catalog.fragmented:
            return  # nothing encoded: no window beside the lookup before the manifest
        if self.catalog.others_commits() == self.reused_at:
            return
        lost = self.reused_keys - self.catalog.present_keys(list(self.reused_keys))
        if not lost:
            return
        self.report.reused -= len(lost)
        why = (
            "its stored features were deleted while the build ran (a gc, e.g. --max-bytes, "
            "on another process); run the build again: it encodes them"
        )
        for rel, key in self.manifest:
            if key in lost:
                self.skip(rel, why, StoreError(f"{rel}: {why}"))

    def view(self, listing: list[tuple[str, int]]) -> BuildView:
        """What this process takes its build to be (see :func:`check_ranks_agree`)."""
        report = self.report
        recipe = tuple((k, str(v)) for k, v in sorted(self.recipe.as_dict().items()))
        return BuildView(
            report.root, self.place.where, self.column, report.encoder, report.encoder_fp,
            recipe, report.recipe_fp, len(listing), listing_digest(listing),
        )  # fmt: skip

    def leave_to_other_ranks(self, todo: dict[str, str], spec: RankSpec) -> dict[str, str]:
        """``todo`` less the keys another torchrun rank encodes (counted as duplicates)."""
        theirs = keys_for_other_ranks(spec, list(todo))
        self.report.duplicates += len(theirs)
        return {k: p for k, p in todo.items() if k not in theirs}

    def skip(self, rel: str, reason: str, error: FeatbakeError) -> None:
        """Record a failed input; with ``strict``, stop the build with ``error``."""
        self.report.fail(rel, reason, FailureCause.of(error))
        if self.options.strict:
            raise error

    def record_undecodable(self) -> None:
        """Record beside the root the keys of the inputs its manifest names that this build
        skipped (undecodable, or failing the encoder), so that a dataset leaves them out as
        the build did instead of calling them misses (see store/roots.py, ``undecodable``).
        Inputs skipped before they had a key (unreadable, not regular files) are not named.
        The driver of another engine sees every task's failures, so it records them although
        its catalog is a fragment writer (whose parts each see only their own)."""
        reasons = dict(self.report.failed)
        failed = {key: reasons[rel] for rel, key in self.manifest if rel in reasons}
        if self.elsewhere is not None:
            write_undecodable(self.layout, self.report.root, failed)
        else:
            self.catalog.record_undecodable(self.report.root, failed)

    def publish_manifest(self) -> None:
        """Publish the root's manifest before encoding.

        It names keys, not features, so readers can map index -> key (and gc keeps these keys
        live) while the features are still being encoded. The rows a dataset kept back
        (``roots/<name>.held``) are this build's to decide: its record goes once its root is
        published, here, or (a build in parts, into a bucket) by the merge that publishes it
        (``merge._fold_build``): taken before, the catalog's root still named a kept-back row
        with its record gone, and the next dataset served it as built.
        """
        self.catalog.replace_root(self.root_spec(), self.manifest)
        if not self.catalog.fragmented:
            write_held(self.layout, self.report.root, {})

    def root_spec(self) -> RootSpec:
        """The root this build publishes: its data, encoder and recipe, and the folder the
        data's relative paths were taken from where its readers take them from the working
        directory (a Kaldi folder, lhotse cuts: :attr:`~featbake.store.roots.Root.workdir`),
        so that its data is read again as built from anywhere."""
        return RootSpec(
            self.report.root, self.place.where, self.enc.label, self.report.encoder_fp,
            self.report.recipe_fp, self.recipe.as_dict(), workdir_of(self.place),
        )  # fmt: skip

    def stored_still(self) -> set[str]:
        """The keys found stored when the encoder's load was decided, if no other writer has
        committed to the catalog since (one ``PRAGMA`` read, not a second lookup of every key:
        7% of a no-op rebuild of 10,000 files); else those of them stored now. Before the
        manifest was published nothing kept them: a gc committing in between (of rows no root
        reached: a root dropped, then built again) deleted them, and the build reported them
        reused and published a root missing them."""
        if self.stored is None:
            return set()
        now = self.catalog.others_commits()
        if now is None or now != self.stored_at:
            return self.catalog.present_keys(list(self.stored))
        return self.stored

    def encode_missing(self, todo: dict[str, str]) -> None:
        """Encode the keys the store lacks; a wrong option un-publishes the manifest."""
        known = self.stored_still()
        self.reused_at = self.catalog.others_commits()
        present = known & set(todo) | self.catalog.present_keys([k for k in todo if k not in known])
        present = self.padded_before(present, todo)
        self.report.reused = len(present)
        self.reused_keys = present
        work = [(k, p) for k, p in todo.items() if k not in present]
        # An --output or --dtype build copies or converts what the store holds (bake/derive.py).
        digests = {k: self.digests[k] for k, _ in work}
        enc_fp = self.report.encoder_fp
        plan = derivation_plan(self.layout, self.recipe, enc_fp, digests, self.catalog)
        to_encode = [(k, p) for k, p in work if k not in plan]
        self.held.keep_only({p for _, p in to_encode})  # others are stored or derived
        if not work:
            self.clear_own_padding()
            return self.progress(Progress("encode", 0, 0)) if self.progress else None
        if self.padding.inexact:
            self.exact_from_the_start()
        self.record_padding([k for k, _ in to_encode])
        try:
            self.encode(to_encode, plan, dict(work))
        except ConfigError:  # a wrong option (--output): its manifest names keys never stored
            self.catalog.drop_root(self.report.root)
            raise
        self.clear_own_padding()  # all checked or redone

    def padded_before(self, present: set[str], todo: dict[str, str]) -> set[str]:
        """``present`` less what an unfinished build of this root stored after padding was
        found inexact (those are encoded again, as work); what it stored before that is kept
        in :attr:`suspects`, encoded again alone if a padding check fails now (see
        :class:`~featbake.store.roots.PaddingRecord`)."""
        self.padding = self.padding_kept()
        suspects = self.padding.suspects(present)
        if self.padding.inexact:
            self.forget_stored(sorted(suspects))
            return present - suspects
        self.suspects = {k: todo[k] for k in sorted(suspects)}
        return present

    def exact_from_the_start(self) -> None:
        """Batch on exact shapes from the first batch: an earlier run of this build found
        padding inexact for its encoder (its record says so). Here, or an engine's workers."""
        if self.elsewhere is not None:
            self.runs = self.runs._replace(batching=Batching.EXACT.value)
        else:
            self.runner.padding_known_inexact()

    def forget_stored(self, keys: list[str]) -> None:
        """Drop the rows of ``keys``, to be encoded again, wherever they would win over the
        new ones: in the catalog this build writes through, and in a directory store's own
        catalog where this build writes fragments (an engine's driver, a rank): a merge keeps
        a key's catalog row over a fragment's, and a stopped build's rows are there (written
        in place, or adopted from its fragments). Where this build writes fragments, the one
        sealed now says it replaces ``keys``: a merge drops their rows wherever it finds them (a
        bucket's published version included) and keeps those stored after (store/merge.py)."""
        self.catalog.forget_keys(keys)
        if keys and self.catalog.fragmented and not place_of(self.layout).builds_in_fragments():
            with contextlib.closing(Catalog(self.layout)) as catalog:
                catalog.forget_keys(keys)

    def record_padding(self, keys: list[str]) -> None:
        """Record ``keys`` as set out to encode, before any is sealed, where batches may be
        padded (an engine's workers decide per task: recorded whenever padding is allowed)."""
        if self.elsewhere is None and self.runner.mode is not BatchingMode.PADDED:
            return
        if self.elsewhere is not None and self.runs.batching == Batching.EXACT.value:
            return
        # This part's earlier record kept: what a stopped run of it stored stays suspect.
        before = self.padding_kept(self.padding_part)
        self.write_own_padding(before.with_keys(keys))

    def padding_kept(self, part: str | None = None) -> PaddingRecord:
        """The padding records of this root's build (every part's, or ``part``'s): the
        layout's files, and a bucket's objects, whichever node wrote them (a record whose
        upload failed is still read on its node; a stale copy only has items encoded again)."""
        here = read_padding(self.layout, self.report.root, part)
        texts = place_of(self.layout).padding_texts(self.report.root, part)
        return here if texts is None else here.joined(padding_of(texts))

    def padding_failed(self) -> None:
        """A padding check failed: this part's record says so at once, before the next batch
        (a rerun then encodes again what this build stored, whichever step it is stopped in)."""
        own = self.own_padding
        if own is not None and not own.inexact:
            self.write_own_padding(dataclasses.replace(own, inexact=True))

    def write_own_padding(self, record: PaddingRecord) -> None:
        """This part's padding record made ``record``, where a rerun on any node reads it."""
        self.own_padding = record
        written = write_padding(self.layout, self.report.root, self.padding_part, record)
        place_of(self.layout).publish_padding(written)

    def clear_own_padding(self) -> None:
        """This part came to its end: its padding record goes, here and where it was kept."""
        record = padding_file(self.layout, self.report.root, self.padding_part)
        kept = self.padding.marks or self.padding.inexact  # a record was kept when it began
        if self.own_padding is not None or kept or record.exists():  # else none to retire
            place_of(self.layout).retire_padding(record)
            clear_padding(self.layout, self.report.root, self.padding_part)

    def padded_again(self, padded: list[PaddedItem], inexact: bool) -> list[PaddedItem]:
        """What to encode again alone: ``padded`` (stored from this run's padded batches) and
        the :attr:`suspects` an unfinished build before it stored, once padding is known
        inexact (``inexact``: a check failed now; or the record says one failed before)."""
        if not (inexact or self.padding.inexact):
            return []
        mine = {it.key for it in padded}
        stats = self.hashed_stats
        before = [PaddedItem(k, p, stats.get(p)) for k, p in self.suspects.items() if k not in mine]
        return padded + before

    def encode(
        self, work: list[tuple[str, str]], plan: Mapping[str, StoredSource], paths: dict[str, str]
    ) -> None:
        """Derive ``plan``'s keys from the store, then decode, batch, encode, write ``work``
        (key, path) and what could not be derived; sealed work survives Ctrl-C. With another
        engine, its workers do the decoding and encoding (:meth:`encode_elsewhere`)."""
        if self.elsewhere is not None:
            return self.encode_elsewhere(self.elsewhere, work, plan, paths)
        runner = self.runner  # the encoder loaded, before any shard is begun
        writer = self.writer()
        run = _EncodeRun(self, writer, [], [])
        threads = self.options.threads()
        with interrupt_at_safe_points() as checkpoint, torch_threads(threads.encoder_threads):
            try:
                work = work + self.put_derived(writer, plan, paths, checkpoint)
                run = _EncodeRun(self, writer, [k for k, _ in work], [p for _, p in work])
                stats = [self.hashed_stats.get(p) for p in run.paths]
                source = HeldSource(self.source, self.held) if len(self.held) else self.source
                items = decoded_items(run.paths, source, threads.decode_workers, stats)
                with contextlib.closing(items):  # its workers shut down here, whatever is raised
                    run.feed(items, runner, checkpoint)
            finally:
                # Seal what was encoded, also on Ctrl-C or a strict failure: nothing is lost.
                self.held.clear()
                writer.close()
                self.report.bytes_written = writer.bytes_written
                self.report.shards_written = writer.shards
                if run.keys:  # a build that only copied or converted batched nothing
                    self.report.batching, self.report.batching_note = runner.mode, runner.note
        if runner.inexact:
            self.padding_failed()
        again = self.padded_again(run.padded, runner.inexact)
        if again:  # padding failed a later check: redo the rest
            self.encode_padded_again(again)
        self.padded_left = [] if runner.inexact else [it.key for it in run.padded]
        run.tick()  # the last word: every byte sealed, none pending
        self.record_fidelity()

    def encode_elsewhere(
        self,
        elsewhere: Elsewhere,
        work: list[tuple[str, str]],
        plan: Mapping[str, StoredSource],
        paths: dict[str, str],
    ) -> None:
        """Derive ``plan``'s keys here (copies of stored features), and have the engine's
        workers encode the rest: each seals its own shards and fragments (see
        :class:`PartEncoder`), and what they did is added to the report."""
        writer = self.writer()
        try:
            with interrupt_at_safe_points() as checkpoint:
                work = work + self.put_derived(writer, plan, paths, checkpoint)
        finally:
            self.held.clear()  # the workers read their inputs themselves
            writer.close()
            self.report.bytes_written = writer.bytes_written
            self.report.shards_written = writer.shards
        if not work:
            return
        items = self.work_items(work)
        job = self.job(elsewhere)
        done = engine_encode(elsewhere.engine, job, items, self.progress, self.task_done)
        redo = self.padded_elsewhere(items, done)
        if redo:
            self.encode_padded_elsewhere(elsewhere, job, redo, done)
        done.add_to(self.report)
        mine, theirs = self.compactor.measured, done.measured
        if theirs is not None:  # pooled with what converting stored features measured here
            self.compactor.measured = theirs if mine is None else mine.merged(theirs)
        self.record_fidelity()

    def record_fidelity(self) -> None:
        """Record what int8/fp8 cost beside the root (:meth:`Compactor.record`); the report
        names the dtype the root is served in (:func:`fidelity_as_served`)."""
        self.compactor.record(self.report, self.catalog, self.options.max_error)
        served = recorded_serve_dtype(self.layout, self.report.root)
        said = fidelity_as_served(self.report.fidelity, self.compactor.measured, served)
        self.report.fidelity = said

    def task_done(self, part: PartResult) -> None:
        """An engine task's result, as it arrives: a padding check it failed is recorded at
        once. Before, the driver recorded it once every task had returned: a driver stopped
        between (Ctrl-C, SIGTERM) left a record saying none had failed, and its rerun reused
        what the other tasks stored padded."""
        if part.padding_failed:
            self.padding_failed()

    def padded_elsewhere(self, items: list[WorkItem], done: PartResult) -> list[WorkItem]:
        """What the engine's workers encode again alone once padding is known inexact (a
        worker's check failed, or the record says one failed before): ``items`` other tasks
        stored from padded batches (``done.padded``) and the :attr:`suspects` an unfinished
        build before this one stored."""
        if not (done.padding_failed or self.padding.inexact):
            return []
        again = set(done.padded) | set(self.suspects)
        given = {it.key for it in items}
        before = [(k, p) for k, p in self.suspects.items() if k not in given]
        return [it for it in items if it.key in again] + self.work_items(before)

    def work_items(self, work: Sequence[tuple[str, str]]) -> list[WorkItem]:
        """``work`` (key, path) as an engine's workers take it."""
        stats = self.hashed_stats
        carried = carried_values(self.place, [p for _, p in work])
        return [
            WorkItem(k, p, self.item_name(p), stats.get(p), c)
            for (k, p), c in zip(work, carried, strict=True)
        ]

    def encode_padded_elsewhere(
        self, elsewhere: Elsewhere, job: EngineJob, items: list[WorkItem], done: PartResult
    ) -> None:
        """Padding is inexact for this encoder (a worker's check failed, now or in an
        unfinished build before): ``items``, stored from padded batches by other tasks and
        workers or by that build, are encoded again alone, on exact shapes, by the engine's
        workers (their fragments are newer: their rows win at the merge, as a plain build's
        encoded again do). Counted in ``done``."""
        self.forget_stored([it.key for it in items])
        exact = dataclasses.replace(job, runs=job.runs._replace(batching="exact"), redo=True)
        redone = elsewhere.engine.encode(exact, items, None)
        redone.raise_error()
        done.bytes_written += redone.bytes_written
        done.shards_written += redone.shards_written
        done.failed += redone.failed
        done.causes += redone.causes
        done.batching_note += (
            f"; a padding check failed on a worker: the {len(items)} items other tasks had "
            "padded before were encoded again alone"
        )

    def item_name(self, path: str) -> str:
        """The item at ``path`` as the data names it (a manifest row's id, not its path)."""
        return self.rel_of.get(path) or os.path.relpath(path, self.place.where)

    def job(self, elsewhere: Elsewhere) -> EngineJob:
        """What an engine's worker needs to encode as this build does."""
        data = os.fspath(elsewhere.data)
        if "://" not in data:
            data = os.path.abspath(data)  # a worker's working directory is not this one
        root = self.root_spec()
        opts = dataclasses.replace(self.options, workers=0, on_gpu=elsewhere.device != "cpu")
        return EngineJob(
            self.layout, root, self.enc.kind, self.enc.spec, self.enc.weights,
            self.enc.trust_pickle, elsewhere.device, self.recipe, self.runs, opts, data,
            self.column, encoder_state=self.enc.state(), workdirs=paths_taken(self.place),
        )  # fmt: skip

    def put_derived(
        self,
        writer: WriterThread,
        plan: Mapping[str, StoredSource],
        paths: Mapping[str, str],
        checkpoint: Callable[[], None],
    ) -> list[tuple[str, str]]:
        """Write what ``plan`` derives from stored features; returns (key, path) of the keys
        that could not be (a source gone or damaged since, a value fp16 cannot hold), to be
        encoded like any other."""
        left: list[tuple[str, str]] = []
        for key, source, parts in stored_sources(self.layout, plan, self.catalog):
            checkpoint()
            stored = None if parts is None else self.derived(key, source, parts)
            if stored is None:
                left.append((key, paths[key]))
                continue
            writer.put(key, stored)
            if source.how.convert:
                self.report.converted += 1
            else:
                self.report.derived += 1
        return left

    def derived(
        self, key: str, source: StoredSource, parts: Parts
    ) -> dict[str, torch.Tensor] | None:
        """A stored source's parts as this recipe stores them: copied, or (from float32) cast
        or quantised exactly as the build's own step does it (:meth:`Compactor.store`, which
        also measures int8/fp8 fidelity on the same sample a build of that dtype measures)."""
        if not source.how.convert:
            return self.compactor.copied(dict(parts))
        as_output = {n: self.recipe.encoded(v) for n, v in parts.items()}
        if not self.options.allow_nonfinite and nonfinite_part(as_output) is not None:
            return None  # e.g. past float16's range: encoded, and failed, as such a build does
        try:
            return self.compactor.store(key, as_output)
        except EncodeError:
            return None

    def writer(self) -> WriterThread:
        """A writer thread for this build's features (a rank's records its shards in fragments)."""
        sink = self.catalog if self.catalog.fragmented else None
        fps = (self.report.encoder_fp, self.report.recipe_fp)
        opts = self.options
        return WriterThread(self.layout, *fps, opts.shard_bytes, sink, opts.seal_seconds)

    def encode_padded_again(self, items: list[PaddedItem]) -> None:
        """Store ``items`` encoded alone in place of their padded features."""
        self.forget_stored([it.key for it in items])
        writer, opts = self.writer(), self.options
        redone = encode_padded_again(
            items, self.runner, self.compactor, writer, self.source,
            opts.threads().decode_workers, opts.allow_nonfinite,
        )  # fmt: skip
        self.report.bytes_written += writer.bytes_written
        self.report.shards_written += writer.shards
        self.report.batching_note += redone.note()


@dataclass
class _EncodeRun:
    """The encoding loop: decoded items -> batches -> encoder -> writer, counting as it goes."""

    bake: _Bake
    writer: WriterThread
    keys: list[str]
    paths: list[str]
    done: int = 0
    padded: list[PaddedItem] = field(default_factory=list)  # stored from padded batches

    def rel(self, i: int) -> str:
        """Item ``i``'s name as the data names it (a manifest row's id, not its path)."""
        return self.bake.item_name(self.paths[i])

    def fail(self, i: int, reason: str, exc: type[FeatbakeError]) -> None:
        self.done += 1
        self.bake.skip(self.rel(i), reason, exc(reason))

    def feed(
        self,
        items: Iterator[tuple[int, torch.Tensor | str]],
        batcher: BatchRunner,
        checkpoint: Callable[[], None],
    ) -> None:
        """Batch decoded items and encode each batch; a decode failure skips its item."""
        for i, item in items:
            checkpoint()
            if isinstance(item, str):
                self.fail(i, item, SourceError)
                continue
            for batch in batcher.add(tuple(item.shape), (i, item)):
                self.run(batch)
        for batch in batcher.flush():
            checkpoint()
            self.run(batch)

    def run(self, batch: list[tuple[int, torch.Tensor]]) -> None:
        """Encode one batch and queue its features; a failing batch is retried item by item."""
        try:
            results = self.bake.runner.encode([x for _, x in batch])
            if self.bake.runner.inexact:
                self.bake.padding_failed()  # recorded before the loop goes on
        except EncodeError as e:
            if len(batch) > 1:  # find the culprit: retry one by one
                for item in batch:
                    self.run([item])
                return
            self.fail(batch[0][0], f"{self.rel(batch[0][0])}: {e}", EncodeError)
            return
        if self.bake.runner.last_padded:
            stats = self.bake.hashed_stats
            self.padded += [
                PaddedItem(self.keys[i], self.paths[i], stats.get(self.paths[i])) for i, _ in batch
            ]
        for (i, _), parts in zip(batch, results, strict=True):
            bad = None if self.bake.options.allow_nonfinite else nonfinite_part(parts)
            if bad is not None:
                reason = nonfinite_build_failure(self.rel(i), bad, self.bake.recipe.dtype)
                self.fail(i, reason, EncodeError)
                continue
            self.writer.put(self.keys[i], self.bake.compactor.store(self.keys[i], parts))
            self.bake.report.encoded += 1
            self.done += 1
        self.tick()

    def tick(self) -> None:
        """Report progress: items done of all, bytes sealed (what survives a SIGKILL) and
        bytes still pending in the writer's hands, items failed."""
        if self.bake.progress:
            done, total, failed = self.done, len(self.keys), len(self.bake.report.failed)
            sealed, pending = self.writer.bytes_written, self.writer.bytes_pending
            self.bake.progress(Progress("encode", done, total, sealed, failed, pending))


# == engines =======================================================================================
# Another engine behind the build's one seam (``build(..., engine=...)``): this process lists and
# keys the inputs (the engine may read and hash the ones the hash cache does not know:
# :meth:`Engine.digester`), publishes the manifest and derives what the store can give; the
# misses go to the engine as :class:`WorkItem` rows, and each of its workers is a
# :class:`PartEncoder`: the encoder loaded once, each task encoded by the same step a plain build
# runs (:meth:`_Bake.encode`: padded batches and the exactness guard, precision, layers,
# int8/fp8, the NaN check), its shards sealed into ``part`` fragments of the workers' build (one
# id for all of them: :func:`workers_build`). A task's work is sealed when the task returns, and
# partly before (``seal_every``), so a worker killed mid-task loses only what it had not sealed;
# the engine runs the task again, and the worker skips what its build's fragments already name
# (:class:`SealedKeys`): nothing is encoded twice that was sealed, no row is doubled (the merge
# adds a key once). The driver seals its ``done`` fragment (the manifest) after every task
# returned and merges: the workers' build, never finished by a ``done`` of its own, has its
# shards folded and is retired as superseded by the root just published (store/fragments.py).
class Elsewhere(NamedTuple):
    """A build's other engine, with what its workers are told: the data and their device."""

    engine: Engine
    data: str | os.PathLike[str]
    device: str


class WorkItem(NamedTuple):
    """One input for an engine's worker: its key, what its source reads (a path, a member, an
    id whose bytes come with it), its name in the data (for reports), the stat its key was
    hashed at (None: no file, or bytes that came with it), and what the build's scan found
    that decoding it needs (a manifest row's file and span, a text, a table cell's column and
    kind: :func:`~featbake.encode.inputs.carried_values`)."""

    key: str
    path: str
    name: str
    stat: FileStat | None = None
    carried: object | None = None  # what decoding needs beyond its path (carried_values)


@dataclass(frozen=True)
class EngineJob:
    """What an engine's worker needs to encode as the build does (picklable: sent once per
    worker). ``data`` is opened again on the worker (``inputs_at``); None: each item's bytes
    come with it. ``driver_host``: where the build's process runs (:func:`this_host`), whose
    stats of the inputs each item carries (see :meth:`PartEncoder.keyed_here`). ``protocol``:
    the driver's :data:`ENGINE_PROTOCOL`, checked by each worker."""

    layout: Layout
    root: RootSpec
    encoder_kind: str
    encoder: str | os.PathLike[str] | LoadedEncoder | torch.nn.Module
    weights: str | os.PathLike[str] | None
    trust_pickle: bool
    device: str
    recipe: Recipe
    runs: RunnerSpec
    options: BakeOptions
    data: str | None
    column: str | None = None
    driver_host: str = field(default_factory=this_host)
    protocol: int = ENGINE_PROTOCOL
    #: The items are stored already, from padded batches another worker's check found
    #: inexact: each is encoded again alone, whatever this build's fragments name.
    redo: bool = False
    #: The encoder file's stat (or folder's state) the driver's fingerprint stands for
    #: (:meth:`BuildEncoder.state`): a worker on the driver's host that loads it unchanged
    #: skips hashing its weights; elsewhere (or None) the worker hashes them.
    encoder_state: FileStat | str | None = None
    #: Where the driver's inputs took relative paths from (its working directory, and the
    #: folder its last build took them from: :func:`~featbake.encode.inputs.paths_taken`), so
    #: a worker takes them from the same places, in the same order; ``("", "")``: from the
    #: root's folder alone (other kinds, or a job of a driver that did not send them).
    workdirs: tuple[str, str] = ("", "")

    def sent_protocol(self) -> object:
        """The engine protocol of the driver that made this job, read from its own state: a
        job pickled by the featbake before has no ``protocol`` there (its ``EngineJob`` had
        no such field), and is 1, not the class's default (this node's number) that reading
        the attribute would find."""
        return vars(self).get("protocol", 1)


def file_holding(path: str, carried: object | None = None) -> str:
    """The file whose stat item ``path`` is checked by: a manifest row's file (its carried
    :class:`Item`), a tar member's tar or a table cell's file (its name up to the container),
    else the input itself."""
    if isinstance(carried, Item):
        return carried.file
    cut = container_cut(path)
    return path if cut is None else path[:cut]


def scanned_here(it: WorkItem) -> WorkItem:
    """``it`` with a table cell's carried scan stat (the stat the driver's scan read its
    file's rows at) made this host's stat of the file: on another host than the driver's the
    driver's stats are not compared (the same mount may show that host other inode numbers
    and ctimes), the bytes read are (:meth:`PartEncoder.keyed_here`)."""
    value = it.carried
    if isinstance(value, CarriedCell) and value.scanned_here:
        here = file_stat_or_none(file_holding(it.path, value))
        return it._replace(carried=dataclasses.replace(value, scanned=here))
    return it


#: How many inputs' digests a worker on another host keeps (:class:`HostHashes`): about 200 bytes
#: each, so 64k rows are ~13 MB at most.
HOST_HASH_ROWS = 65_536


class HostHashes:
    """The hash cache of a worker on another host than the driver's, kept for the worker's life
    (an actor's: every task it runs) and by this host's own stats: the catalog's rows are of the
    driver's stats, which this host's mount may show otherwise, so none of them is used.

    A recording several tasks' segments name (a manifest's long recording) is read and hashed
    once per worker, not once per task: a later task finds its digest at this host's stat of
    it, size, mtime, inode and ctime, as a plain build finds a file's in the catalog (a racy
    row, one stat'ed within the filesystem's timestamp window of a change, is never trusted:
    :meth:`~featbake.store.hash_cache.HashCacheRow.trusted`). The least recently used rows go
    past :data:`HOST_HASH_ROWS`.
    """

    def __init__(self, rows: int = HOST_HASH_ROWS) -> None:
        self.rows = rows
        self._kept: OrderedDict[str, HashCacheRow] = OrderedDict()
        self._lock = threading.Lock()  # the build's hashing threads put rows

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        out: dict[str, HashEntry] = {}
        with self._lock:
            for p in paths:
                row = self._kept.get(p)
                entry = row.trusted() if row is not None else None
                if entry is not None:
                    self._kept.move_to_end(p)
                    out[p] = entry
        return out

    def put_hashes(self, rows: Iterable[HashRow], *, recorded_ns: int | None = None) -> None:
        recorded = time.time_ns() if recorded_ns is None else recorded_ns
        with self._lock:
            for path, stat, sha in map(HashRow._make, rows):
                self._kept[path] = HashCacheRow.of(path, stat, sha, recorded)
                self._kept.move_to_end(path)
            while len(self._kept) > self.rows:
                self._kept.popitem(last=False)


#: Why an item a worker on another host read is refused: its bytes there make another key.
NOT_THE_BYTES_HASHED = (
    "changed since it was hashed: its bytes on this node are not the ones its key was made "
    "from (rewritten in place, its mtime kept?); rerun the build"
)


@dataclass(frozen=True)
class Failure:
    """An input that failed on a worker: its name in the data and why."""

    name: str
    reason: str


@dataclass
class PartResult:
    """What a worker did with one task (or several, added up): items encoded, those that
    failed (name, reason, cause), bytes and shards sealed, how it batched, what an int8/fp8
    build measured. Travels as JSON (:meth:`to_json`)."""

    items: int = 0
    encoded: int = 0
    reused: int = 0  # found stored by the worker (items that came with their bytes)
    failed: list[Failure] = field(default_factory=list)
    causes: list[FailureCause] = field(default_factory=list)
    bytes_written: int = 0
    shards_written: int = 0
    batching: str = ""
    batching_note: str = ""
    measured: Measured | None = None
    error: CarriedError | None = None  # what a task raised (--strict's), raised by the driver
    padded: list[str] = field(default_factory=list)  # keys stored padded, not encoded again
    padding_failed: bool = False  # a padding check failed on the worker: padding is inexact

    @classmethod
    def raised(cls, e: FeatbakeError) -> PartResult:
        """A task's result that carries ``e`` back (:class:`CarriedError`)."""
        return cls(error=CarriedError.of(e))

    def raise_error(self) -> None:
        """Raise the error a task carried back (as its own class, with its own line), if any."""
        if self.error is not None:
            self.error.raise_again()

    def add(self, other: PartResult) -> None:
        """Add ``other``'s counts to these (a batching note that says more wins)."""
        self.items += other.items
        self.encoded += other.encoded
        self.reused += other.reused
        self.failed += other.failed
        self.causes += other.causes
        self.bytes_written += other.bytes_written
        self.shards_written += other.shards_written
        self.padded += other.padded
        self.padding_failed = self.padding_failed or other.padding_failed
        if other.batching and (
            not self.batching or len(other.batching_note) > len(self.batching_note)
        ):
            self.batching, self.batching_note = other.batching, other.batching_note
        if other.measured is not None:
            mine = self.measured
            self.measured = other.measured if mine is None else mine.merged(other.measured)

    def add_to(self, report: BuildReport) -> None:
        """Count this in the build's report."""
        report.encoded += self.encoded
        report.reused += self.reused
        for failure, cause in zip(self.failed, self.causes, strict=True):
            report.fail(failure.name, failure.reason, cause)
        report.bytes_written += self.bytes_written
        report.shards_written += self.shards_written
        report.batching, report.batching_note = self.batching, self.batching_note

    def to_json(self, answering: object = ENGINE_PROTOCOL) -> str:
        """This result as JSON (:meth:`from_json` gives it back equal), for a driver of engine
        protocol ``answering`` (:meth:`EngineJob.sent_protocol`). A driver of the featbake
        before (1) reads every key as a field and knows no protocol number, so it is answered
        without one: the refusal of its job (:func:`check_protocol`) reaches it as its one
        line, not as a ``TypeError`` inside the JSON."""
        doc = dataclasses.asdict(self) | {
            "causes": [str(c) for c in self.causes],
            "measured": None if self.measured is None else self.measured.to_json(),
        }
        if answering != 1:
            doc["protocol"] = ENGINE_PROTOCOL
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> PartResult:
        """The result :meth:`to_json` wrote.

        Raises:
            ConfigError: a worker of another featbake wrote it (:func:`check_protocol`).
        """
        doc = json.loads(text)
        check_protocol(doc.pop("protocol", 1), "a worker of the build")
        measured, error = doc.pop("measured"), doc.pop("error")
        return cls(
            **doc
            | {
                "failed": [Failure(**f) for f in doc["failed"]],
                "causes": [FailureCause(c) for c in doc["causes"]],
                "measured": None if measured is None else Measured.from_json(measured),
                "error": None if error is None else CarriedError(**error),
            }
        )


class Engine(Protocol):
    """Runs a build's encode step on workers of its own (see the section comment)."""

    def started(self) -> contextlib.AbstractContextManager[Engine]:
        """This engine, starting (its cluster connected, say) beside the build's listing and
        hashing once the build needs it, and stopped when the build is done: what
        ``digester`` and ``encode`` run on."""
        ...

    def encode(
        self,
        job: EngineJob,
        items: Sequence[WorkItem],
        progress: ProgressFn | None,
        each: Callable[[PartResult], None] | None = None,
    ) -> PartResult:
        """Encode ``items`` on the workers, each a :class:`PartEncoder` of ``job``; what they
        did, added up. ``each`` is told every task's result as it arrives (optional: an
        engine written before it existed takes three arguments, see :func:`engine_encode`).
        Raises the :class:`FeatbakeError` a worker raised (``--strict``)."""
        ...

    def digester(self) -> Digester:
        """How the build's inputs the hash cache does not know are read and hashed (a
        folder's files, a bucket prefix's objects, the files a manifest names: see
        :func:`digested_anywhere`): on the engine's workers, or here
        (:func:`~featbake.encode.fingerprints.digest_here`). A digester that also has a
        ``containers`` method (:class:`~featbake.encode.fingerprints.ReadsContainers`) reads
        tar shards and table files there too. Called once the engine is started, before the
        manifest: hashing is done before anything is encoded. Optional: an engine without it
        hashes in the build's process (:func:`engine_digester`)."""
        ...


def engine_encode(
    engine: Engine,
    job: EngineJob,
    items: Sequence[WorkItem],
    progress: ProgressFn | None,
    each: Callable[[PartResult], None],
) -> PartResult:
    """``engine``'s :meth:`Engine.encode`, ``each`` told every task's result as it arrives;
    for an engine written before it could say so, the whole result once, at the end."""
    if "each" in inspect.signature(engine.encode).parameters:
        return engine.encode(job, items, progress, each=each)
    done = engine.encode(job, items, progress)
    each(done)
    return done


def engine_digester(engine: Engine) -> Digester:
    """``engine``'s :meth:`Engine.digester`; this process's (:func:`digest_here`) for an
    engine written before engines could hash (it has no ``digester``)."""
    digester = getattr(engine, "digester", None)
    return digest_here if digester is None else digester()


def started(engine: Engine | None) -> contextlib.AbstractContextManager[Engine | None]:
    """``engine`` started for a build (:meth:`Engine.started`); None for a plain build."""
    return contextlib.nullcontext() if engine is None else engine.started()


def workers_build(root: RootSpec) -> str:
    """The build id every worker of an engine seals its fragments under (one id for one root,
    encoder and recipe: a rerun's workers see what a killed run's sealed)."""
    return build_id(root.name, root.encoder_fp, root.recipe_fp, 1, [])


class SealedKeys:
    """The keys the ``part`` fragments of build ``build`` name, read as fragments appear (each
    fragment once), so a task run again after its worker died skips what that worker sealed."""

    def __init__(self, layout: Layout, build: str) -> None:
        self.layout = layout
        self.build = build
        self.read: set[str] = set()
        self.keys: set[str] = set()

    def of(self, keys: Collection[str]) -> set[str]:
        """Those of ``keys`` a fragment of the build names (fragments fetched first from a
        bucket store: another node's worker may have sealed them)."""
        place_of(self.layout).sync_fragments()
        new = [
            n.path for n in sealed_fragments(self.layout)
            if n.build_id == self.build and n.path.name not in self.read
        ]  # fmt: skip
        self.keys |= fragment_keys(new)
        self.read.update(p.name for p in new)
        return self.keys & set(keys)


class PartEncoder:
    """One worker of an engine: the encoder loaded once, tasks encoded by the plain build's own
    step into ``part`` fragments of :func:`workers_build`. It looks nothing up in the catalog,
    so it writes no claim (store/claims.py): the build's one claim is the driver's, let go
    with its ``done`` fragment (items that come with their bytes: :meth:`stored`, checked
    again under the driver's claim before it seals).

    Example:
        >>> worker = PartEncoder(job)  # doctest: +SKIP
        >>> worker.encode([WorkItem(key, "/data/a.wav", "a.wav")]).encoded  # doctest: +SKIP
        1
    """

    def __init__(self, job: EngineJob) -> None:
        check_protocol(job.sent_protocol(), "the build's driver")
        self.job = job
        dev = check_device(job.device)
        catalog = FragmentCatalog(job.layout, RankPart(0, 1, ()))
        catalog.replace_root(job.root, [])  # this build's id (workers_build), no manifest
        place = worker_inputs(job)
        enc = BuildEncoder(
            job.encoder, job.weights, dev, job.trust_pickle, job.recipe, job.root.encoder_label,
            job.encoder_kind, known_fp=job.root.encoder_fp,
            known_state=job.encoder_state if job.driver_host == this_host() else None,
        )  # fmt: skip
        source = place.source(source_for(job.recipe))
        opts, runs = job.options, job.runs
        self.bake = _Bake(catalog, job.layout, enc, job.recipe, source, place, opts, runs, None)
        self.bake.ready_runner()  # loaded once, here: a task only encodes
        self.sealed = SealedKeys(job.layout, workers_build(job.root))
        self.hashes = HostHashes()  # another host's digests, for every task it runs

    def encode(
        self, items: Sequence[WorkItem], held: Mapping[str, bytes] | None = None
    ) -> PartResult:
        """Encode ``items`` (less those this build's fragments name: a task run again) as a
        plain build does, sealing every shard before returning. ``held``: path -> the bytes
        to decode (inputs that came with their bytes)."""
        bake, root = self.bake, self.job.root
        sealed = set() if self.job.redo else self.sealed.of([it.key for it in items])
        todo = [it for it in items if it.key not in sealed]
        bake.padded_left = []
        bake.report = BuildReport(root.name, root.data, root.encoder_label, root.encoder_fp,
                                  root.recipe_fp, len(items))  # fmt: skip
        bake.compactor = Compactor(self.job.recipe)
        bake.rel_of = {it.path: it.name for it in items}
        done_before = len(items) - len(todo)
        elsewhere = self.job.data is not None and self.job.driver_host != this_host()
        todo = self.carried_in([scanned_here(it) for it in todo] if elsewhere else todo)
        bake.hashed_stats = {it.path: it.stat for it in todo if it.stat is not None}
        bake.held = HeldBytes(budget=sum(map(len, (held or {}).values())))
        for path, data in (held or {}).items():
            bake.held.keep(path, data)
        if elsewhere:
            todo = self.keyed_here(todo)
        if todo:
            bake.encode([(it.key, it.path) for it in todo], {}, {})
        r = bake.report
        return PartResult(
            len(items), r.encoded + done_before, 0, [Failure(n, why) for n, why in r.failed],
            r.causes, r.bytes_written,
            r.shards_written, r.batching, r.batching_note, bake.compactor.measured,
            padded=bake.padded_left, padding_failed=bool(todo) and bake.runner.inexact,
        )  # fmt: skip

    def keyed_here(self, todo: list[WorkItem]) -> list[WorkItem]:
        """``todo`` less the items whose bytes on this host, another than the driver's, do
        not make their key, each counted failed in one line (``--strict``: raised).

        The driver's stat of an input cannot say whether this host reads the version it
        hashed: the same mount may show this host other inode numbers and ctimes, and size
        and mtime stay when a file is rewritten in place with its mtime put back (``cp -p``,
        ``touch -r``, ``rsync -t``). So the inputs in files are read and hashed here as a
        plain build hashes them (its inputs' ``hash``: a file's, a tar member's or a table
        cell's SHA-256, a segment's from its recording's), through this worker's own hash
        cache of this host's stats (:class:`HostHashes`), and keyed as the driver keyed them.
        The bytes read are kept to be decoded, as a plain build keeps them; what is read again
        (past the budget, a recording's segments) is checked against this host's stats taken
        by those reads, whole. An object keeps the driver's stat: its ETag is the same on
        every host and is checked by the read that decodes it.
        """
        bake, root = self.bake, self.job.root
        files = [it for it in todo if not bytes_at(file_holding(it.path, it.carried)).versioned]
        if not files:
            return todo
        bake.held = HeldBytes()
        digests, unreadable = bake.place.hash(
            self.hashes, [it.path for it in files], None, bake.hashed_stats, bake.held
        )
        refused: set[str] = set()
        for it in files:
            why = unreadable.get(it.path)
            if (
                why is None
                and feature_key(root.encoder_fp, root.recipe_fp, digests[it.path]) != it.key
            ):
                why = NOT_THE_BYTES_HASHED
            if why is not None:
                refused.add(it.path)
                bake.skip(it.name, why, SourceError(f"{it.name}: {why}"))
        return [it for it in todo if it.path not in refused]

    def carried_in(self, todo: list[WorkItem]) -> list[WorkItem]:
        """``todo`` with what the driver's scan found for each given to this worker's inputs
        (manifest rows, texts, table cells: :func:`carry_to`), less the items they refused,
        each counted failed (``--strict``: raised) as a plain build counts a missing file."""
        bake = self.bake
        refused = carry_to(bake.place, {i.path: i.carried for i in todo if i.carried is not None})
        for it in todo:
            if it.path in refused:
                bake.skip(it.name, refused[it.path], SourceError(refused[it.path]))
        return [it for it in todo if it.path not in refused]

    def stored(self, keys: Sequence[str]) -> set[str]:
        """Those of ``keys`` the store's catalog holds or this build's fragments name (for
        items that came with their bytes: the driver never saw their keys)."""
        found = self.sealed.of(keys)
        if self.job.layout.catalog.exists():
            with Catalog(self.job.layout, read_only=True) as catalog:
                found |= catalog.present_keys(keys)
        return found


def worker_inputs(job: EngineJob) -> Inputs:
    """``job``'s data opened again in a worker, whose working directory is not the driver's:
    relative paths taken from where the driver took them, in its order (its working
    directory's too: a new row's clip found only there), else from the root's folder; items
    that come with their bytes (no data) as they came."""
    if not job.data:
        return HeldInputs()
    place = inputs_at(job.data, job.column, job.recipe.source, job.root.workdir)
    taking_paths_as(place, vars(job).get("workdirs", ("", "")))  # a driver's before: none
    return place


class HeldInputs:
    """The :class:`Inputs` of a worker whose items come with their bytes (a user's Ray
    Dataset): nothing to scan or hash here, each item named as it came."""

    where = "(items with their bytes)"
    stat_tells_change = False

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        raise ConfigError("items that come with their bytes are not scanned (a bug)")

    def path(self, rel: str) -> str:
        return rel

    def size(self, rel: str) -> int:
        return 0

    def hash(self, *args: object, **kwargs: object) -> tuple[dict[str, str], dict[str, str]]:
        raise ConfigError("items that come with their bytes are hashed by their engine (a bug)")

    def source(self, inner: Source) -> Source:
        return inner

    def row(self, rel: str) -> dict[str, object]:
        return {}


def _cpu(device: str | torch.device) -> torch.device:
    """The driver's device when an engine's workers encode: the CPU, once ``device`` (theirs)
    is known to be a device's name.

    Raises:
        ConfigError: ``device`` names no device.
    """
    try:
        torch.device(str(device))
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    return torch.device("cpu")
