"""The readers ``bench_serve.py`` compares, and the data each of them reads (the same features).

One set of fp32 or fp16 ``[T, 768]`` features is written five ways:

* one ``.npy`` file per item, read with ``np.load`` (a copy);
* one ``torch.save`` file per item, read with ``torch.load`` (a copy);
* one safetensors file per item, read with ``safetensors.torch.load_file`` (a copy);
* safetensors shards of up to 256 MiB, read with ``safe_open(...).get_tensor`` (a view into a
  private mmap of the shard; handles kept open per process, as a user would);
* a featbake store (shards + catalog) baked from the ``.npy`` files, read through
  :class:`featbake.CachedFeatureDataset` (a copy the caller owns; batches: views into one padded
  batch tensor).

``prepare_items`` writes the items of ``bench_peers.py`` and ``bench_cold.py`` (.npy files, a
featbake store, safetensors shards); ``prepare_litdata`` adds them as a litdata optimized
dataset beside, for ``bench_peers.py``'s third reader.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from featbake.bake.pipeline import build
from featbake.encode.encoders import LoadedEncoder, from_module
from featbake.recipe import Recipe
from featbake.serve.collate import pad_collate
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.shard import ST_TO_DTYPE, crc32c

WORK = Path(__file__).resolve().parent / "_work" / "serve"
DIM = 768
SHARD_BYTES = 256 * 1024 * 1024  # featbake's default shard size
DTYPES = ("float32", "float16")
DTYPE_LABEL = {"float32": "fp32", "float16": "fp16"}
#: T per dtype: fp32 items of ~600 KB (T ~ 200), fp16 items of ~430 KB (T ~ 280).
LENGTHS = {"float32": (150, 251), "float16": (200, 361)}


class Identity(torch.nn.Module):
    """The 'encoder' that bakes the benchmark's features: they are the inputs themselves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def identity_encoder() -> LoadedEncoder:
    # A fixed identity: the module's own name differs between `python bench_serve.py`
    # (__main__) and benchmarks/run.py, and would give other keys.
    return from_module(Identity(), label="bench-identity", identity="bench-identity-v1")


def recipe(dtype: str) -> Recipe:
    return Recipe(source="npy", dtype=dtype)


def prepare_items(base: Path, n: int, dtype: str, seed: int) -> Path:
    """``n`` random ``dtype`` items of ``[T, DIM]`` as .npy files in ``base``, baked into a
    featbake store and written as safetensors shards of up to :data:`SHARD_BYTES` (featbake's
    shard size) in the same item order, with ``index.json`` naming each item's shard; kept
    across runs (``base/ready``)."""
    if (base / "ready").exists():
        return base
    shutil.rmtree(base, ignore_errors=True)
    (base / "npy").mkdir(parents=True)
    (base / "shards").mkdir()
    rng = np.random.default_rng(seed)
    lo, hi = LENGTHS[dtype]
    index: list[tuple[str, str]] = []
    shard: dict[str, torch.Tensor] = {}
    size, k = 0, 0
    for i, t in enumerate(rng.integers(lo, hi, size=n)):
        arr = rng.standard_normal((int(t), DIM), dtype=np.float32).astype(dtype, copy=False)
        np.save(base / "npy" / f"item{i:05d}.npy", arr)
        if size + arr.nbytes > SHARD_BYTES:
            save_file(shard, str(base / "shards" / f"s{k:03d}.safetensors"))
            shard, size, k = {}, 0, k + 1
        shard[f"item{i:05d}"] = torch.from_numpy(arr)
        size += arr.nbytes
        index.append((str(base / "shards" / f"s{k:03d}.safetensors"), f"item{i:05d}"))
    save_file(shard, str(base / "shards" / f"s{k:03d}.safetensors"))
    (base / "index.json").write_text(json.dumps(index))
    (base / "ready").touch()
    build(base / "npy", identity_encoder(), cache=base / "store", recipe=recipe(dtype), workers=0)
    return base


def prepare_litdata(base: Path, chunk_bytes: int = SHARD_BYTES) -> Path | None:
    """The items :func:`prepare_items` wrote in ``base``, as a litdata optimized dataset in
    ``base/litdata`` (litdata's ``BinaryWriter``, item i = the tensor of ``item{i:05d}.npy``, in
    chunks of up to ``chunk_bytes``: featbake's shard size), written once and kept
    (``base/litdata.ready``); None where litdata is not importable."""
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError:
        return None
    out = base / "litdata"
    if (base / "litdata.ready").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    writer = BinaryWriter(str(out), chunk_bytes=chunk_bytes)
    for i, path in enumerate(sorted((base / "npy").glob("item*.npy"))):
        writer[i] = torch.from_numpy(np.load(path))
    writer.done()
    writer.merge()
    for p in out.iterdir():  # DONTNEED drops only clean pages: the chunks written to disk
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    (base / "litdata.ready").touch()
    return out


def touch(t: torch.Tensor) -> None:
    """Read one element per 4 KiB page of ``t``: what a step at least does with its item."""
    flat = t.reshape(-1)
    float(flat[:: 4096 // flat.element_size()].sum())


class NpyFiles(Dataset):
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.load(self.paths[i]))


class TorchFiles(NpyFiles):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.load(self.paths[i], weights_only=True)


class SafetensorsFiles(NpyFiles):
    def __getitem__(self, i: int) -> torch.Tensor:
        return load_file(self.paths[i])["x"]


class _ShardFiles(Dataset):
    """Items in safetensors shards (``index``: item -> (shard path, tensor name)), each shard
    opened once in each process: a forked worker opens its own, a pickled copy none yet."""

    def __init__(self, index: list[tuple[str, str]]) -> None:
        self.index = index
        self._open: dict[str, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def opened(self, path: str, opener: Callable[[str], Any]) -> Any:
        """This process's handle of shard ``path`` (``opener(path)`` the first time)."""
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = opener(path)
        return handle

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("_open", "_pid")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _open={}, _pid=os.getpid())


class SafetensorsShards(_ShardFiles):
    """Items in safetensors shards, read through ``safe_open``; handles opened once per process."""

    def __getitem__(self, i: int) -> torch.Tensor:
        path, name = self.index[i]
        return self.opened(path, lambda p: safe_open(p, framework="pt")).get_tensor(name)


class OwnedCopies(_ShardFiles):
    """The same safetensors shards read as the least an owned copy costs: one ``os.preadv`` of
    each item into a new tensor, no check, no layer above it (the shards' headers parsed when
    it is made). With ``check``, the CRC-32C of those bytes too (featbake's function, the
    fastest loop here), as featbake checks a first read. The floor of any reader that hands
    out items of their own (a view of a mapping pays no copy): what featbake's own layers cost
    is its rate against this one."""

    def __init__(self, index: list[tuple[str, str]], check: bool = False) -> None:
        super().__init__(index)
        self.check = check
        self._where: list[tuple[str, int, int, list[int], torch.dtype]] = []
        headers: dict[str, tuple[int, dict[str, Any]]] = {}
        for path, name in index:
            if path not in headers:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    headers[path] = (8 + size, json.loads(f.read(size)))
            base, header = headers[path]
            begin, end = header[name]["data_offsets"]
            where = (path, base + begin, end - begin, header[name]["shape"])
            self._where.append((*where, ST_TO_DTYPE[header[name]["dtype"]]))

    def __getitem__(self, i: int) -> torch.Tensor:
        path, offset, nbytes, shape, dtype = self._where[i]
        fd = self.opened(path, lambda p: os.open(p, os.O_RDONLY))
        out = torch.empty(shape, dtype=dtype)
        buf = out.view(-1).view(torch.uint8).numpy()
        if os.preadv(fd, [buf], offset) != nbytes:
            raise OSError(f"short read of item {i}")
        if self.check:  # featbake's CRC-32C: the fastest loop this machine has
            crc32c(buf)
        return out


class InMemory(Dataset):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]


class InMemoryCopies(InMemory):
    """A list of tensors that hands out a copy of each, the caller's own (an in-place edit of
    an item served never changes a later read): what a RAM-tier hit serves."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i].clone()


@dataclass(frozen=True)
class Reader:
    """One reader in the comparison: its label says whether it hands out views or copies."""

    name: str
    label: str
    per_file: bool  # a per-file reader (the targets compare featbake against the best of these)


READERS = (
    Reader("npy", "np.load per file (copy)", True),
    Reader("torch", "torch.load per file (copy)", True),
    Reader("stfile", "safetensors file per item (copy)", True),
    Reader("stshards", "safetensors shards via safe_open (view)", False),
    Reader("featbake", "featbake (copy; batches: views into one padded batch)", False),
)
FLOOR = Reader("list", "list of tensors in memory (no read)", False)


@dataclass(frozen=True)
class Cell:
    """One measured condition: dtype, items per step, workers, and which epoch."""

    dtype: str
    batch: int | None  # None: one item per step
    workers: int
    fresh: bool  # the first epoch of a new dataset object, else a later epoch of a reused one

    @property
    def label(self) -> str:
        step = "1 item/step" if self.batch is None else f"batch {self.batch} pad_collate"
        epoch = "first epoch, fresh dataset" if self.fresh else "later epoch"
        return f"{DTYPE_LABEL[self.dtype]} {step}, workers={self.workers}, {epoch}"

    @property
    def target(self) -> float:
        """featbake / the best per-file reader this cell must reach (issue 8)."""
        if self.workers:
            return 1.0  # not slower than any
        return 1.5 if self.batch is None else 2.0

    def loader_kwargs(self, spawned: bool) -> dict[str, Any]:
        kw: dict[str, Any] = {"batch_size": self.batch, "num_workers": self.workers}
        if self.batch is not None:
            kw["collate_fn"] = pad_collate
        if self.workers and spawned:
            # A spawned process would make its DataLoader spawn workers too (seconds of
            # interpreter start-up per epoch); a training script forks them.
            kw["multiprocessing_context"] = "fork"
        return kw


CELLS = [
    Cell(dtype, batch, workers, fresh)
    for dtype, fresh, batch, workers in itertools.product(DTYPES, (True, False), (None, 32), (0, 2))
]


def _lengths(n: int, dtype: str, seed: int = 0) -> list[int]:
    lo, hi = LENGTHS[dtype]
    return [int(t) for t in np.random.default_rng(seed).integers(lo, hi, size=n)]


def _write_files(base: Path, n: int, dtype: str) -> None:
    """The same n arrays as .npy, torch.save, one safetensors file each, and safetensors shards."""
    for d in ("npy", "pt", "st", "shards"):
        (base / d).mkdir(parents=True)
    rng = np.random.default_rng(1)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            save_file(shard, str(base / "shards" / f"shard{len(index):05d}.safetensors"))
            index.append(sorted(shard))
            shard, shard_bytes = {}, 0

    for i, t in enumerate(_lengths(n, dtype)):
        arr = rng.standard_normal((t, DIM), dtype=np.float32).astype(dtype)
        x = torch.from_numpy(arr)
        np.save(base / "npy" / f"item{i:05d}.npy", arr)
        torch.save(x, base / "pt" / f"item{i:05d}.pt")
        save_file({"x": x}, str(base / "st" / f"item{i:05d}.safetensors"))
        if shard_bytes + x.nbytes > SHARD_BYTES:
            flush()
        shard[f"item{i:05d}"] = x
        shard_bytes += x.nbytes
    flush()
    shards = {
        name: str(base / "shards" / f"shard{s:05d}.safetensors")
        for s, names in enumerate(index)
        for name in names
    }
    (base / "index.json").write_text(json.dumps(shards))


def prepare(n: int, dtype: str) -> dict[str, Any]:
    """The data of one dtype, written once (``benchmarks/_work``) and read once (warm cache)."""
    base = WORK / f"{dtype}-n{n}"
    marker = base / "ready.json"
    if not marker.exists():
        shutil.rmtree(base, ignore_errors=True)
        _write_files(base, n, dtype)
        marker.write_text(json.dumps({"n": n, "dtype": dtype}))
    store = base / "store"
    # A no-op when complete; re-bakes if featbake's fingerprint definition changed since.
    build(
        base / "npy", identity_encoder(), cache=store, recipe=recipe(dtype), workers=0, batch_size=1
    )
    shards = json.loads((base / "index.json").read_text())
    data = {
        "dtype": dtype,
        "npy_dir": str(base / "npy"),
        "store": str(store),
        "npy": sorted(str(p) for p in (base / "npy").glob("*.npy")),
        "torch": sorted(str(p) for p in (base / "pt").glob("*.pt")),
        "stfile": sorted(str(p) for p in (base / "st").glob("*.safetensors")),
        "stshards": [(shards[name], name) for name in sorted(shards)],
    }
    warm_page_cache(base)
    return data


def warm_page_cache(base: Path) -> None:
    """Give every reader's files the same warm page cache: dropped, then read back once.

    How a file's pages came into the page cache changes how fast they are copied out: on this
    VM, 600 KB preads from the fp32 store's shards ran at ~5.5 GB/s, and at ~14 GB/s once the
    same shards were dropped and read back through readahead (larger page-cache folios); other
    readers' files happened to be in the fast state. Left as they are, the ratios measured each
    file's page-cache history, not the readers. ``POSIX_FADV_DONTNEED`` drops only clean
    pages (all of these files are fsynced and closed), and needs no privileges.
    """
    for p in base.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                while f.read(1 << 22):
                    pass


def featbake_ds(data: dict[str, Any], **kw: Any) -> CachedFeatureDataset:
    ds = CachedFeatureDataset(
        data["npy_dir"],
        identity_encoder(),
        cache=data["store"],
        recipe=recipe(data["dtype"]),
        on_miss="error",
        **kw,
    )
    assert ds.stored() == len(ds), "the benchmark store is incomplete: delete benchmarks/_work"
    return ds


def make_reader(name: str, data: dict[str, Any]) -> Dataset:
    """A new dataset object of reader ``name`` over ``data`` (fresh: nothing opened or checked)."""
    if name == "npy":
        return NpyFiles(data["npy"])
    if name == "torch":
        return TorchFiles(data["torch"])
    if name == "stfile":
        return SafetensorsFiles(data["stfile"])
    if name == "stshards":
        return SafetensorsShards(data["stshards"])
    fb = featbake_ds(data)
    if name == "featbake":
        return fb
    tensors = [fb[i] for i in range(len(fb))]
    fb.close()
    return InMemory(tensors)
