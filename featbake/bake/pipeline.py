"""BUILD_DOC"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from featbake.bake.batching import ShapeBatcher
from featbake.bake.decode import decoded_items
from featbake.bake.interrupt import interrupt_at_safe_points
from featbake.bake.parts import catalog_for_part, finish_part
from featbake.bake.ranks import device_for_rank, resolve_rank
from featbake.bake.report import BuildReport
from featbake.bake.writer_thread import WriterThread
from featbake.device import check_device
from featbake.encode.encoders import LoadedEncoder, from_module, load_encoder
from featbake.encode.fingerprints import (
    encoder_fingerprint,
    hash_inputs,
    resolve_path,
)
from featbake.encode.outputs import encode_batch
from featbake.encode.sources import Source, scan, source_for
from featbake.errors import ConfigError, EncodeError, FeatbakeError, SourceError
from featbake.keys import feature_key, root_id
from featbake.progress import Progress
from featbake.recipe import Recipe
from featbake.store.catalog import Catalog, FileStat
from featbake.store.layout import Layout, default_cache_dir
from featbake.store.rank_catalog import RankCatalog
from featbake.store.shard_format import DEFAULT_SHARD_BYTES


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
    shard: str | None = None,
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
        shard: ``"I/N"``: do part I of N (see bake/ranks.py); without it, the part torchrun or
            SLURM gave this process, if any. A part writes catalog fragments for `featbake merge`.

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
    spec = resolve_rank(shard, os.environ)
    dev = check_device(device_for_rank(str(device), spec))
    layout = Layout(Path(cache) if cache is not None else default_cache_dir()).ensure()
    source = source_for(recipe)
    data_dir = resolve_path(data)
    rel_paths = scan(data_dir, source.extensions)
    catalog, rel_paths = catalog_for_part(layout, spec, data_dir, rel_paths)

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
    report.part = spec.describe() if spec.sharded else ""

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
                catalog,
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
    if isinstance(catalog, RankCatalog):
        report.fragment = catalog.finish()
        report.merged = finish_part(layout, spec)
    catalog.close()
    report.seconds = time.perf_counter() - t0
    return report


def _encode_all(
    work: list[tuple[str, str]],
    enc: LoadedEncoder,
    recipe: Recipe,
    source: Source,
    layout: Layout,
    catalog: Catalog | RankCatalog,
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
    sink = catalog if isinstance(catalog, RankCatalog) else None
    writer = WriterThread(layout, enc.fingerprint, recipe.fingerprint(), shard_bytes, sink)
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

    with interrupt_at_safe_points() as checkpoint:
        try:
            stats = [hashed_stats.get(p) for p in paths]
            for i, item in decoded_items(paths, source, workers, stats):
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
