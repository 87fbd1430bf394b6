"""The writer thread: fills shards behind the encoder and commits their catalog rows."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.rank_catalog import RankCatalog
from featbake.store.shard_format import DEFAULT_SHARD_ITEMS
from featbake.store.writer import ShardWriter

#: Features handed to the writer thread at once: up to 32, fewer once they hold 8 MiB, and each
#: at once when 0.1 s passed since the last hand-off. One hand-off per feature woke the thread,
#: and moved the GIL, once per item: beside a small encoder on 2 CPUs, that cost more than the
#: thread's own work (issue 19). The time bound keeps a slow encoder's features written as they
#: come (as before: what a kill loses is no more than it was).
HANDOFF_ITEMS = 32
HANDOFF_BYTES = 8 << 20
HANDOFF_SECONDS = 0.1
#: A shard being filled is sealed once its oldest feature has waited this long (seconds), even
#: when it is far from ``--shard-size``: SIGKILL (spot preemption, the OOM killer, ``kill -9``)
#: runs no cleanup, so only what is sealed survives it (issue 32 item 1). Each seal costs one
#: small file and one catalog commit: every 30 s is nothing beside the encoding.
DEFAULT_SEAL_SECONDS = 30.0


# -- writing behind --------------------------------------------------------------------------
class WriterThread:
    """Fills and seals shards in a background thread; the caller only enqueues features."""

    _STOP = object()

    def __init__(
        self,
        layout: Layout,
        encoder_fp: str,
        recipe_fp: str,
        shard_bytes: int,
        sink: RankCatalog | None = None,
        seal_seconds: float = DEFAULT_SEAL_SECONDS,
    ) -> None:
        self.layout = layout
        self._sink = sink  # a rank of a sharded build records its shards in fragments instead
        self.bytes_written = 0
        self.shards = 0
        self.new_rows = 0
        self.error: BaseException | None = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize=256)
        # The batch not yet handed over, its bytes and when its first feature came; the lock
        # lets the thread take it when it is due to seal (an encoder slower than the seal
        # interval would otherwise keep its last features out of every seal).
        self._lock = threading.Lock()
        self._batch: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._batch_bytes = 0
        self._batch_since = 0.0
        self._queued_bytes = 0  # handed over, not yet in the shard writer
        self._seal_seconds = seal_seconds
        self._handed_at = time.monotonic()  # the last hand-off: HANDOFF_SECONDS after, hand over
        self._writer = ShardWriter(
            layout,
            encoder_fp,
            recipe_fp,
            target_bytes=shard_bytes,
            max_items=DEFAULT_SHARD_ITEMS,
            seal_seconds=seal_seconds,
        )
        self._thread = threading.Thread(target=self._run, name="featbake-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # sqlite connections belong to the thread that made them
        catalog = self._sink or Catalog(self.layout)

        def publish(shard: Any) -> None:
            self.new_rows += catalog.add_shard(shard)
            self.bytes_written += shard.nbytes
            self.shards += 1

        self._writer.on_seal = publish
        try:
            while (items := self._next_or_due()) is not self._STOP:
                batch, nbytes = items
                for key, parts in batch:
                    self._writer.add(key, parts)
                with self._lock:
                    self._queued_bytes -= nbytes
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
            if self._sink is not None:
                self._sink.flush()  # what was sealed is recorded, also on Ctrl-C
            else:
                catalog.close()

    def _seconds_until_due(self) -> float | None:
        """Seconds until the oldest feature not sealed has waited ``seal_seconds`` (None:
        nothing is waiting)."""
        oldest = self._writer.oldest_pending
        with self._lock:
            if self._batch:
                oldest = self._batch_since if oldest is None else min(oldest, self._batch_since)
        if oldest is None:
            return None
        return max(0.0, oldest + self._seal_seconds - time.monotonic())

    def _next_or_due(self) -> Any:
        """The next hand-off from the queue; while waiting for it, seal what is pending as soon
        as it is due, the caller's batch not yet handed over included."""
        while True:
            wait = self._seconds_until_due()
            try:
                return self._q.get(timeout=None if wait is None else max(wait, 0.01))
            except queue.Empty:
                if self._seconds_until_due() == 0.0:
                    for key, parts in self._take_batch()[0]:
                        self._writer.add(key, parts)
                    self._writer.seal()

    @property
    def bytes_pending(self) -> int:
        """Bytes encoded but not sealed yet: what a SIGKILL now would lose (approximate)."""
        return self._writer.pending_bytes + self._queued_bytes + self._batch_bytes

    def put(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        """Queue one feature; features are handed to the thread a batch at a time."""
        if self.error is not None:
            raise self.error
        nbytes = sum(t.nbytes for t in parts.values())
        with self._lock:
            if not self._batch:
                self._batch_since = time.monotonic()
            self._batch.append((key, parts))
            self._batch_bytes += nbytes
            full = len(self._batch) >= HANDOFF_ITEMS or self._batch_bytes >= HANDOFF_BYTES
        if full or time.monotonic() - self._handed_at >= HANDOFF_SECONDS:
            self._hand_off()

    def _take_batch(self) -> tuple[list[tuple[str, dict[str, torch.Tensor]]], int]:
        # Called by the caller's thread (a hand-off) and by the writer's (a seal that is due).
        """The batch not yet handed over and its bytes, leaving an empty one."""
        with self._lock:
            batch, nbytes = self._batch, self._batch_bytes
            self._batch, self._batch_bytes = [], 0
            return batch, nbytes

    def _hand_off(self) -> None:
        self._handed_at = time.monotonic()
        batch, nbytes = self._take_batch()
        with self._lock:
            self._queued_bytes += nbytes
        if batch:
            self._q.put((batch, nbytes))

    def close(self) -> None:
        """Seal what is pending and wait; re-raise the thread's error, if any."""
        self._hand_off()
        self._q.put(self._STOP)
        # A KeyboardInterrupt that landed inside an earlier Queue.put can lose the wake-up of a
        # waiting get(): nudge the writer until it has seen the stop mark, never wait blindly.
        while self._thread.is_alive():
            self._thread.join(0.2)
            with self._q.not_empty:
                self._q.not_empty.notify_all()
        if self.error is not None:
            raise self.error
