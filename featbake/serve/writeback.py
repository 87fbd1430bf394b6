"""The one write-back object: features encoded while serving, on their way to this process's
own shards, under one sealing policy for the dataset and :class:`CachedEncoder` alike.

A pending feature is sealed into a shard when the pending shard is full (bytes or items) or
when its oldest feature is :data:`WRITEBACK_SECONDS` old, so a killed process loses little.
Sealing writes the shard, then commits its catalog rows (the caller's ``publish`` may add more
to that, e.g. a root), then tells the caller (``on_sealed``). On a shared filesystem the
"catalog" is the read-only stand-in of store/serving_fragments.py, which seals a fragment naming
the shard instead.

Write-back is an optimisation: it never fails a read. When a shard cannot be written or
published (a full disk, an unwritable store), the pending features are dropped, encoded again
when next needed, and the failure is reported once per process as a warning.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from featbake.errors import StoreError
from featbake.perprocess import ProcessStamp
from featbake.serve.process import Clock, ThreadCatalog
from featbake.store.catalog_api import ServingStore
from featbake.store.layout import Layout
from featbake.store.writer import SealedShard, ShardWriter

__all__ = ["WRITEBACK_BYTES", "WRITEBACK_ITEMS", "WRITEBACK_SECONDS", "SealPolicy", "WriteBack"]

#: Write-back shards are sealed at this size, item count or age, so a killed worker loses little.
WRITEBACK_BYTES = 64 * 1024 * 1024
WRITEBACK_ITEMS = 256
WRITEBACK_SECONDS = 5.0

#: What a failed seal may raise: the store's own errors, the OS's, and SQLite's.
_WRITE_FAILURES = (StoreError, OSError, sqlite3.Error)

Parts = Mapping[str, torch.Tensor]
Publish = Callable[[ServingStore, SealedShard], None]


@dataclass(frozen=True)
class SealPolicy:
    """When a pending write-back shard is sealed: whichever limit is reached first."""

    max_bytes: int = WRITEBACK_BYTES
    max_items: int = WRITEBACK_ITEMS
    max_seconds: float = WRITEBACK_SECONDS


def add_rows(catalog: ServingStore, shard: SealedShard) -> None:
    """The default publication: the shard's feature rows, nothing else."""
    catalog.add_shard(shard)


#: Every write-back of this process: what one reader wrote back and has not sealed yet, the
#: others over the same store read at once (issue 18 item 4: two CachedEncoders over one store
#: saw each other's features only after flush()).
_LIVE: weakref.WeakSet[WriteBack] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def pending_in_process(own: WriteBack, key: str) -> Parts | None:
    """``key``'s parts held, not sealed yet, by ``own`` or any other write-back of this process
    over the same store; None when none holds it."""
    parts = own.get(key)
    if parts is not None:
        return parts
    with _LIVE_LOCK:
        others = [w for w in _LIVE if w is not own and w.store_id == own.store_id]
    for w in others:
        if not w.lifetime.stale and (parts := w.get(key)) is not None:
            return parts
    return None


class WriteBack:
    """Features encoded in this process, written to shards of its own and published.

    It holds no reference to its owner (a dataset or a CachedEncoder), so a finalizer that seals
    it never keeps a dropped owner alive. Thread-safe: adds and seals take one lock.

    Args:
        layout: the store.
        recipe_fp: the recipe fingerprint of every feature written.
        publish: commits a sealed shard to the catalog (default: its feature rows).
        on_sealed: told of each shard once it is published (e.g. to point an index at it).
        clock: monotonic seconds; tests pass a fake one to age pending features at will.
        policy: the sealing limits.
        what: how warnings name what is written (``"written-back features"``).
        catalogs: the owner's catalog connection (default: one of its own, opened on first
            use in the thread that made this object).
    """

    def __init__(
        self,
        layout: Layout,
        recipe_fp: str,
        *,
        publish: Publish = add_rows,
        on_sealed: Callable[[SealedShard], None] | None = None,
        clock: Clock = time.monotonic,
        policy: SealPolicy = SealPolicy(),
        what: str = "written-back features",
        catalogs: ThreadCatalog | None = None,
    ) -> None:
        self.layout = layout
        self.recipe_fp = recipe_fp
        self.publish = publish
        self.on_sealed = on_sealed
        self.clock = clock
        self.policy = policy
        self.what = what
        self.lifetime = ProcessStamp()
        self.lock = threading.Lock()
        #: key -> parts of every feature added and not yet sealed (readable before sealing).
        self.pending: dict[str, Parts] = {}
        #: clock time of the oldest pending feature; 0.0 while nothing is pending.
        self.first_pending = 0.0
        self.written = 0
        self.failures = 0
        self._writer: ShardWriter | None = None
        self._own_catalogs = catalogs is None
        self._catalogs = catalogs if catalogs is not None else ThreadCatalog(layout)
        self.store_id = os.path.realpath(layout.root)
        with _LIVE_LOCK:
            _LIVE.add(self)

    def add(self, encoder_fp: str, key: str, parts: Parts) -> None:
        """Queue one feature; seals when the shard is full or its oldest feature is due."""
        if self.lifetime.stale:
            self._adopt()
        with self.lock:
            if key in self.pending:
                return
            writer = self._writer_for(encoder_fp)
            if writer is None:
                return
            self.pending[key] = parts
            self.written += 1
            if not self.first_pending:
                self.first_pending = self.clock()
            try:
                writer.add(key, parts)  # seals (and publishes) when full
            except _WRITE_FAILURES as e:
                self._drop(e)
        self.seal_if_due()

    def get(self, key: str) -> Parts | None:
        """A pending feature's parts (not yet sealed), or None."""
        return self.pending.get(key)

    @property
    def due(self) -> bool:
        """True when the oldest pending feature is older than the policy allows."""
        first = self.first_pending
        return bool(first) and self.clock() - first >= self.policy.max_seconds

    def seal_if_due(self) -> None:
        if self.due:
            self.seal()

    def seal(self) -> SealedShard | None:
        """Seal what is pending now; None when nothing was (or it could not be) sealed."""
        if self.lifetime.stale:
            return None  # a forked copy of another process's write-back: that process seals it
        with self.lock:
            if self._writer is None:
                return None
            try:
                return self._writer.seal()
            except _WRITE_FAILURES as e:
                self._drop(e)
                return None

    def close(self) -> None:
        """Seal what is pending and close the catalog connection (once, by its own process)."""
        if self.lifetime.stale:
            return  # a forked copy of another process's write-back: that process saves it
        self.seal()
        if self._own_catalogs:
            self._catalogs.close()

    # -- internals ----------------------------------------------------------------------------
    def _adopt(self) -> None:
        """In a forked child: start afresh. What the parent had pending is the parent's to seal
        (its copy here is dropped), and the lock may have been held by a parent thread."""
        self.lifetime = ProcessStamp()
        self.lock = threading.Lock()
        self.pending = {}
        self.first_pending = 0.0
        self._writer = None
        self._own_catalogs = True
        self._catalogs = ThreadCatalog(self.layout, shared=self._catalogs.shared)

    def _writer_for(self, encoder_fp: str) -> ShardWriter | None:
        writer = self._writer
        if writer is not None and writer.encoder_fp == encoder_fp:
            return writer
        if writer is not None:  # another encoder: its features go to a shard of their own
            try:
                writer.seal()
            except _WRITE_FAILURES as e:
                self._drop(e)
        self._writer = ShardWriter(
            self.layout,
            encoder_fp,
            self.recipe_fp,
            target_bytes=self.policy.max_bytes,
            max_items=self.policy.max_items,
            on_seal=self._published,
        )
        return self._writer

    def _published(self, shard: SealedShard) -> None:
        with self._catalogs.scoped() as catalog:
            self.publish(catalog, shard)
        for entry in shard.entries:
            self.pending.pop(entry.key, None)
        self.first_pending = self.clock() if self.pending else 0.0
        if self.on_sealed is not None:
            self.on_sealed(shard)

    def _drop(self, error: Exception) -> None:
        """Forget what is pending after a failed seal; warn the first time only."""
        self.pending.clear()
        self.first_pending = 0.0
        self.failures += 1
        if self.failures == 1:
            warnings.warn(
                f"featbake: could not store {self.what} ({error}); they were dropped and are "
                "encoded again when next needed (reads of stored features are unaffected)",
                stacklevel=3,
            )
