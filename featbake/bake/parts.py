"""A build done in parts: pick this rank's inputs, and merge once every rank is done.

The pure half (which rank, which inputs) is bake/ranks.py; this module does the I/O around it:
stat the inputs to balance parts by bytes, hand the pipeline a :class:`RankCatalog` (so the
rank writes fragments, never the shared catalog), and under torchrun hold a barrier so that
rank 0 merges once every rank has sealed its fragment, and every rank returns with the store
merged.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from featbake.bake.ranks import RankSpec, my_part, owned_by_lower_ranks
from featbake.encode.inputs import Inputs
from featbake.store.catalog import Catalog
from featbake.store.catalog_api import BuildCatalog
from featbake.store.layout import Layout
from featbake.store.rank_catalog import RankCatalog
from featbake.store.remote.publish import merge_store

#: How long a rank waits at the barrier for the slowest one (a gloo default of 30 min is far
#: too short for a build whose parts end hours apart).
BARRIER_TIMEOUT = datetime.timedelta(days=7)


def catalog_for_part(
    layout: Layout, spec: RankSpec, inputs: Inputs, rel_paths: list[str]
) -> tuple[BuildCatalog, list[str]]:
    """The catalog this process writes through, and the inputs it does (all, for one process).

    Each rank stats every input (cheap) but hashes and encodes only its own part. A build into
    a bucket store always writes fragments (its tier's catalog is a published version, never
    written in place), after bringing in the bucket's fragments: a rerun on another node skips
    what the killed run sealed.
    """
    if not spec.sharded and layout.remote is None:
        return Catalog(layout), rel_paths
    if layout.remote is not None:
        layout.remote.sync_fragments()
    sizes = [inputs.size(p) for p in rel_paths]
    listing = list(zip(rel_paths, sizes, strict=True))
    mine = my_part(sizes, spec) if spec.sharded else list(range(len(rel_paths)))
    return RankCatalog(layout, spec.rank, spec.world, listing), [rel_paths[i] for i in mine]


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
    gathered: list[list[str] | None] = [None] * spec.world
    dist.all_gather_object(gathered, list(keys))
    return owned_by_lower_ranks(spec.rank, [g or [] for g in gathered])


def finish_part(layout: Layout, spec: RankSpec) -> bool:
    """Under torchrun: wait for all ranks, rank 0 merges, all return merged. True if merged here.

    Parts launched one by one (``--shard``, SLURM arrays) return at once: `featbake merge` runs
    when they are all done (a SLURM job with ``--dependency=afterok`` on the array). A single
    process building into a bucket store merges (publishes the next catalog version) itself.
    """
    if not spec.sharded and layout.remote is not None:
        merge_store(layout)
        return True
    if not spec.launched_together:
        return False
    with _process_group():
        dist.barrier()
        merged = spec.rank == 0
        if merged:
            merge_store(layout)
        dist.barrier()
    return merged
