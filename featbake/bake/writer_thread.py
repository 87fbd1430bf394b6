"""The writer thread: fills shards behind the encoder and commits their catalog rows."""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.rank_catalog import RankCatalog
from featbake.store.shard_format import DEFAULT_SHARD_ITEMS
from featbake.store.writer import ShardWriter


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
            if self._sink is not None:
                self._sink.flush()  # what was sealed is recorded, also on Ctrl-C
            else:
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
