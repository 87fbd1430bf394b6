"""Padded items stored before padding was found inexact, encoded again on exact shapes.

The exactness guard (:mod:`featbake.bake.padded`) re-runs the most padded item of each padded
batch alone. An encoder whose drift depends on the amount of padding in another way (largest
when an item is padded a little, say) passes that check on early batches while their less
padded items are off; when a later batch fails the guard, the build goes on in exact shapes,
but the early batches are sealed by then. Once padding is known inexact for the encoder, every
item this build encoded in a padded batch is decoded and encoded again alone, and replaces the
stored one: the catalog's rows of those keys are dropped first (their old bytes are unreferenced
and gc reclaims them), so the new rows go in. A rank of a build in parts cannot change its
sealed fragments: its new rows go into later fragments, and the merge folds a build's newer
fragments first (store/merge.py), so they win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from featbake.bake.compact import Compactor
from featbake.bake.decode import decoded_items
from featbake.bake.finite import nonfinite_part
from featbake.bake.padded import BatchRunner
from featbake.bake.writer_thread import WriterThread
from featbake.encode.sources import Source
from featbake.errors import EncodeError
from featbake.store.catalog import Catalog, FileStat
from featbake.store.catalog_api import BuildCatalog


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
    catalog: BuildCatalog,
    runner: BatchRunner,
    compactor: Compactor,
    writer: WriterThread,
    source: Source,
    workers: int,
    allow_nonfinite: bool,
) -> Redone:
    """Encode ``items`` alone and store them in place of their padded features.

    ``writer`` is a fresh writer, closed here (every shard of the first pass is sealed before:
    the rows dropped are theirs). ``runner`` is in exact mode by now.
    """
    keys = [it.key for it in items]
    if isinstance(catalog, Catalog):
        catalog.forget_keys(keys)
    stored = 0
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
