"""Decode workers: files -> preprocessed tensors; a bad file becomes an error record."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from featbake.encode.sources import Source
from featbake.errors import SourceError
from featbake.store.catalog import FileStat


# -- decoding in workers ---------------------------------------------------------------------
class DecodeDataset(Dataset):
    """Item i -> (i, tensor) or (i, reason) so one bad file cannot stop a worker.

    The key was computed from the bytes hashed earlier; a file rewritten since would put its new
    features under the old bytes' key (served to every copy of the old file). So after decoding,
    the file is stat'ed again: if it no longer matches the stat its digest belongs to, the item
    fails instead.
    """

    def __init__(
        self, paths: Sequence[str], source: Source, stats: Sequence[FileStat | None]
    ) -> None:
        self.paths = list(paths)
        self.source = source
        self.stats = list(stats)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | str]:
        path = self.paths[i]
        try:
            x = self.source.load(path)
            try:
                now: FileStat | None = FileStat.of(path)
            except OSError:
                now = None
            if self.stats[i] is None or now != self.stats[i]:
                return i, f"{path}: changed while featbake was reading it; rerun the build"
            return i, x
        except SourceError as e:
            return i, str(e)
        except Exception as e:
            return i, f"{self.paths[i]}: {type(e).__name__}: {e}"


def init_worker(_worker_id: int) -> None:
    """Set up a decode worker: one torch thread, Ctrl-C left to the main process."""
    # The encoder's threads own the other CPUs (see featbake.cpus.bake_threads).
    torch.set_num_threads(1)
    # A terminal's Ctrl-C reaches the whole process group: workers must leave it to the main
    # process, which stops at a safe point and shuts them down (see interrupt_at_safe_points).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_is(item: Any) -> Any:
    return item


class _ArrayDataset(Dataset):
    """``DecodeDataset`` whose tensors travel as numpy arrays: pickled through the worker's pipe.

    A tensor crossing a process boundary goes through a file in ``/dev/shm``; when that is full
    (Docker's 64 MB default) or ``ulimit -f`` caps file sizes, the worker's feeder thread fails
    after the item left the queue, and the main process waits for it forever. A pipe has
    neither limit.
    """

    def __init__(self, ds: DecodeDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        j, x = self.ds[i]
        return j, (x.numpy() if isinstance(x, torch.Tensor) else x)


def decoded_items(
    paths: Sequence[str], source: Source, workers: int, stats: Sequence[FileStat | None]
) -> Iterator[tuple[int, Any]]:
    """(index, tensor) for each path, or (index, reason) for one that cannot be decoded.

    Raises:
        SourceError: a decode worker died (killed by the OOM killer, or by hand).
    """
    ds = DecodeDataset(paths, source, stats)
    if workers == 0 or len(paths) < 2:
        yield from (ds[i] for i in range(len(ds)))
        return
    loader = DataLoader(
        _ArrayDataset(ds),
        batch_size=None,
        collate_fn=_as_is,
        num_workers=min(workers, len(paths)),
        prefetch_factor=8,
        persistent_workers=False,
        worker_init_fn=init_worker,
    )
    try:
        for i, x in loader:
            yield i, (torch.from_numpy(x) if isinstance(x, np.ndarray) else x)
    except RuntimeError as e:
        if "DataLoader worker" not in str(e):
            raise
        raise SourceError(
            f"a decode worker died ({_first_line(e)}): the OOM killer ends a worker that runs "
            "out of memory. Rerun with fewer --workers (or --workers 0) or a smaller "
            "--max-seconds; everything sealed so far is kept"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0].rstrip(". ") if lines else type(e).__name__
