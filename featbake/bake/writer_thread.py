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
    ) -> None:
        self.layout = layout
        self._sink = sink  # a rank of a sharded build records its shards in fragments instead
        self.bytes_written = 0
        self.shards = 0
        self.new_rows = 0
        self.error: BaseException | None = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize=256)
        self._batch: list[tuple[str, dict[str, torch.Tensor]]] = []  # not yet handed over
        self._batch_bytes = 0
        self._handed_at = time.monotonic()  # the last hand-off: HANDOFF_SECONDS after, hand over
        self._writer = ShardWriter(
            layout, encoder_fp, recipe_fp, target_bytes=shard_bytes, max_items=DEFAULT_SHARD_ITEMS
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
            while (items := self._q.get()) is not self._STOP:
                for key, parts in items:
                    self._writer.add(key, parts)
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

    @property
    def bytes_so_far(self) -> int:
        """Bytes sealed plus bytes waiting to be (approximate, lock-free)."""
        return self.bytes_written + self._writer.pending_bytes + self._batch_bytes

    def put(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        """Queue one feature; features are handed to the thread a batch at a time."""
        if self.error is not None:
            raise self.error
        self._batch.append((key, parts))
        self._batch_bytes += sum(t.nbytes for t in parts.values())
        if (
            len(self._batch) >= HANDOFF_ITEMS
            or self._batch_bytes >= HANDOFF_BYTES
            or time.monotonic() - self._handed_at >= HANDOFF_SECONDS
        ):
            self._hand_off()

    def _hand_off(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._handed_at = time.monotonic()
        if batch:
            self._q.put(batch)

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
