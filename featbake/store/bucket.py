"""The store in a bucket (``s3://``, ``gs://``, ``az://``): one more place under ``store/``, with
a local disk tier. Its object calls go through the byte seam, :mod:`featbake.store.objects`.

A bucket store is the local store's layout as objects (``shards/ab/<name>.safetensors``,
``fragments/<name>.sqlite``) plus catalogs published as immutable, numbered versions
(``catalog/v<N>.sqlite``). Every process works through a *local tier*: a local store directory
holding the newest catalog version, the shards it has fetched (byte-budgeted, least recently
used evicted) and the fragments it writes before they are uploaded. See docs/object_store.md.

Here: :class:`BucketStore` (the place) and publishing the next catalog version (merge, gc). The
versions' names and gc's rule over them are :mod:`featbake.store.versions`, the reader by ranges
:mod:`featbake.store.ranged`, the plan a block order is followed by :mod:`featbake.store.blocks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import threading
import uuid
import warnings
from collections.abc import Callable, Collection, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

from featbake.errors import ConfigError, FeatbakeError, ShardMissing, StoreCorrupt, StoreError
from featbake.process import PerProcess, ProcessLocal, ProcessLocalState
from featbake.store.blocks import BlockPlan, BlockWindowWarning, windows_over
from featbake.store.catalog import (
    Access,
    catalog_file_problems,
    open_sqlite,
    whole_catalog_problem,
)
from featbake.store.files import Hold, fsync_file, holding, list_folder, publish_file
from featbake.store.fragments import (
    fragment_shard_names,
    fragment_shards,
    fragments_dir,
    parse_name,
    sealed_fragments,
)
from featbake.store.layout import Layout, checked_shard_name, is_shard_name
from featbake.store.locks import locked
from featbake.store.merge import MergeReport, merge, merging_alone
from featbake.store.objects import CLIENT_CONNECTIONS as CLIENT_CONNECTIONS
from featbake.store.objects import LIST_PAGE_KEYS as LIST_PAGE_KEYS
from featbake.store.objects import ObjectInfo, ObjectStore
from featbake.store.place import (
    SWEPT_PREFIX,
    Change,
    Held,
    Sweep,
    Swept,
    TierUsage,
    VerifyScope,
    held_folder,
    held_now,
    removed_leftover,
)
from featbake.store.ranged import RangedShardReader, head_ahead
from featbake.store.roots import carried_records, restore_records
from featbake.store.shard import (
    ShardReader,
    VerifyMode,
)
from featbake.store.tier import DiskTier, tier_locked
from featbake.store.url import BucketURL
from featbake.store.versions import (
    PREFIX,
    kept_versions,
    newest,
    newest_object,
    sweep,
    version_name,
    version_of,
)
from featbake.units import format_bytes

# == store =========================================================================================
# A store in a bucket, worked through a local tier: what every command and dataset opens.
#
# :class:`BucketStore` is the :class:`~featbake.store.place.RemotePlace` of the tier's
# :class:`~featbake.store.layout.Layout`: the local store code runs unchanged on the tier (the
# newest catalog version as ``catalog.sqlite``, read-only; fetched shards; fragments written
# here first), and calls back here for what must reach the bucket or come from it:
#
# - a shard missing from the tier is fetched whole into it (:class:`DiskTier`);
# - a sealed fragment is uploaded after the shards it names (write first, publish second), so a
#   build killed at any moment keeps every fragment it sealed, on any node (one killed between
#   its seal and its upload leaves it in the tier, and the node's next sync uploads it);
# - :meth:`sync_catalog` brings the newest published catalog version into the tier.
#
# Merging and gc, which publish new versions, are below (publish).
SHARDS = "shards/"
#: ``whole``, ``ranged`` or ``auto``: how shards missing from the tier are read.
READS_ENV = "FEATBAKE_BUCKET_READS"
FRAGMENTS = "fragments/"
#: Build parts' padding records (``featbake.store.roots.PaddingRecord``), while each runs: a
#: rerun on another node reads what a stopped part set out to encode.
PADDING = "padding/"
#: Whole-shard fetches a process runs ahead of its reads (litdata keeps two chunks ahead);
#: ``$FEATBAKE_BUCKET_PREFETCH=0`` turns them off (``make bench`` measures both).
PREFETCH_AHEAD = 2
PREFETCH_ENV = "FEATBAKE_BUCKET_PREFETCH"
_PREFETCH_POOL: PerProcess[ThreadPoolExecutor] = PerProcess(
    lambda: ThreadPoolExecutor(PREFETCH_AHEAD, thread_name_prefix="featbake-prefetch"), lock=True
)


#: The most bytes of hinted items a process reading by ranges holds ahead of its reads (see
#: :meth:`BucketStore.ahead_items`; the tier's budget when smaller).
AHEAD_BYTES = 256 << 20

#: Header GETs started ahead that wait for their readers to open, at most (64 KiB each).
HEADS_AHEAD = 64

#: ``<tier>/tier.json``: marks a folder as a bucket store's local tier, naming its bucket (a
#: tier given as ``--cache`` is refused: :func:`featbake.store.open.open_store`).
TIER_MARK = "tier.json"
#: ``<tier>/catalog.version``: the catalog version the tier holds (and its ETag).
VERSION_FILE = "catalog.version"
#: ``<tier>/fragments.seen``: the fragments this tier knows the bucket held (it uploaded or
#: downloaded them), so that one the bucket no longer lists is known retired, not unsent.
SEEN_FRAGMENTS = "fragments.seen"
#: ``<tier>/tmp/work-<id>``: the copy of the newest catalog version a change works on.
WORK_PREFIX = "work-"
#: ``<tier>/tmp/verify-<id>``: the folder of a tier's ``tmp/`` where one ``verify`` brings each
#: shard to check it (upkeep/check.py), each verify its own (:func:`verify_scratch`); a plain
#: ``tmp/verify`` is what an older featbake's killed verify left.
VERIFY_SCRATCH = "verify"
#: The folders of a tier's ``tmp/`` gc's sweep takes once nothing in them changed for the grace
#: period (:func:`tier_leftovers`); ``tmp/fetch``, where readers work, is not one.
LEFTOVER_PREFIXES = (WORK_PREFIX, VERIFY_SCRATCH, SWEPT_PREFIX)
#: ``<tier>/tmp/catalog.lock``: held while the tier's catalog is brought in; there for good, the
#: one file of a tier's ``tmp/`` that is no leftover.
CATALOG_LOCK = "catalog.lock"


class PinnedVersion(NamedTuple):
    """The published catalog version a tier holds, and the ETag of the object it came from."""

    version: int
    etag: str


def shard_object(name: str) -> str:
    """The object name of shard ``name`` (the local store's relative path).

    Raises:
        StoreCorrupt: ``name`` is not a shard name.
    """
    return f"{SHARDS}{checked_shard_name(name)[:2]}/{name}.safetensors"


class BucketStore(ProcessLocalState):
    """A bucket store and this node's tier of it (see the module docstring).

    Args:
        url: ``s3://bucket/prefix``.
        tier: the local tier's directory (``local_cache``).
        budget: the most bytes the tier's shards may take (``local_cache_size``).
    """

    def __init__(self, url: BucketURL, tier: Path, budget: int) -> None:
        self.url = url
        self.bucket = ObjectStore(url)
        self.layout = Layout(tier, remote=self)
        self.tier = DiskTier(self.layout, budget)
        self._sizes: dict[str, int] | None = None  # shard name -> bytes, listed once
        self._ranged: bool | None = None  # see reads_ranged
        self._fills_tier = False  # auto mode reading by ranges: shards that fit are kept
        self._uploaded: set[str] = set()  # shards this process uploaded: copies in the tier
        self._named: dict[str, int] | None = None  # see _named_shards
        self._named_total = 0
        self._warned_window = False
        self.listed_fragments: frozenset[str] = frozenset()  # the last sync_fragments' listing

    #: This process's background fetches (the shards they bring in) and their lock: a forked
    #: child has neither the parent's fetch threads nor a lock one of them may hold.
    _prefetch_lock: ProcessLocal[threading.Lock] = ProcessLocal(
        lambda self: threading.Lock(), lock=True
    )
    _prefetching: ProcessLocal[set[str]] = ProcessLocal(lambda self: set(), lock=True)
    #: Header GETs started ahead for shards read by ranges (see fetch_ahead), by shard name.
    _heads: ProcessLocal[dict[str, Future[bytes]]] = ProcessLocal(lambda self: {}, lock=True)
    #: The block plan this process's reads follow (see follow_blocks; a forked child never
    #: follows its parent's), and the lock the reads' threads take to move it.
    _plan: ProcessLocal[BlockPlan | None] = ProcessLocal(lambda self: None)
    _plan_lock: ProcessLocal[threading.Lock] = ProcessLocal(
        lambda self: threading.Lock(), lock=True
    )

    def __getstate__(self) -> dict:
        # The extra rule: a copy starts from its three arguments; what this process learned
        # of the bucket (listings, read mode, its uploads) is looked up again where it lands.
        return {"url": self.url, "tier": self.layout.root, "budget": self.tier.budget}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["tier"], state["budget"])  # type: ignore[misc]

    def __str__(self) -> str:
        return str(self.url)

    # -- RemotePlace: shards ---------------------------------------------------------------------
    def _listed(self) -> dict[str, int]:
        """Shard name -> bytes in the bucket, listed once per process (merge's checks)."""
        return self._sizes if self._sizes is not None else self.shard_objects()

    def _size_of(self, name: str) -> int | None:
        """Shard ``name``'s size in the bucket (from the listing if one was made, else a HEAD:
        a reader fetching a few shards never lists the whole bucket)."""
        if self._sizes is not None and name in self._sizes:
            return self._sizes[name]
        info = self.bucket.head(shard_object(name))
        return None if info is None else info.size

    def _known_size(self, name: str) -> int | None:
        """Shard ``name``'s size as the tier's catalog says it (no request), else as the bucket
        says it (:meth:`_size_of`: a shard the catalog does not name, e.g. one just built)."""
        size = self._named_shards().get(name)
        return size if size is not None else self._size_of(name)

    def fetch_shard(
        self,
        name: str,
        evicted: Callable[[], None] | None = None,
        *,
        keep: Collection[str] = (),
        wait: bool = True,
    ) -> Path | None:
        """Shard ``name`` fetched whole into the tier (see :meth:`DiskTier.fetch` for ``keep``
        and ``wait``); None when the bucket has none. One GET: the size comes from the catalog
        (a HEAD only for a shard it does not name)."""
        size = self._known_size(name)
        if size is None:
            # gc deleted it: bring in the newest version, through which the reader's lookup
            # of the feature runs again (a rebuild may have stored it in another shard).
            self.sync_catalog()
            return None
        obj = shard_object(name)
        if not keep:  # a read's fetch: never evicts what the block order holds either
            keep = self._protected()
        try:
            return self.tier.fetch(
                name,
                size,
                lambda dest: self.bucket.download(obj, dest),
                self.bucket.where(obj),
                evicted,
                keep=keep,
                wait=wait,
            )
        except FileNotFoundError:
            self.sync_catalog()  # as above: the catalog named a shard gc has deleted
            return None

    def reads_ranged(self) -> bool:
        """Whether shards not in the tier are read by ranges rather than fetched whole.

        ``$FEATBAKE_BUCKET_READS`` says ``whole`` or ``ranged``; by default (``auto``) ranged
        once the shards the catalog names outweigh the tier's budget: fetching whole shards
        into a tier that cannot keep them downloads each many times over a shuffled epoch. In
        ``auto`` the tier still keeps whole the shards that fit its budget without evicting.
        While the reads follow a block order (:meth:`follow_blocks`), whole.
        """
        if self._following() is not None:
            return False  # a window at a time fits the tier: each shard is fetched once
        if self._ranged is None:
            mode = os.environ.get(READS_ENV, "auto")
            if mode not in ("auto", "whole", "ranged"):
                raise ConfigError(f"${READS_ENV} must be auto, whole or ranged, got {mode!r}")
            if mode == "auto":
                self._ranged = self._named_bytes() > self.tier.budget
                self._fills_tier = self._ranged
            else:
                self._ranged = mode == "ranged"
        return self._ranged

    def ranged_reader(self, name: str, path: Path, verify: VerifyMode | str) -> ShardReader | None:
        """A reader of shard ``name`` by ranged GETs, or None when it is fetched whole: always
        in ``whole`` mode, and in ``ranged`` mode while the tier has room for it without evicting
        (a tier smaller than the store keeps what fits, so repeated items hit it).

        Raises:
            ShardMissing: the bucket has no such shard (gc deleted it).
        """
        if not self.reads_ranged():
            return None
        size = self._known_size(name)
        if (
            size is not None
            and self._fills_tier
            and (self._fetching(name) or self.tier.has_room(size))
        ):
            return None  # auto: the tier keeps what fits, so repeated reads of it hit the disk
        if size is None:
            self.sync_catalog()  # as fetch_shard: the reader looks the feature up again
            raise ShardMissing(f"shard {name} is gone from {self.url} (deleted by gc)")
        with self._prefetch_lock:
            head = self._heads.pop(name, None)
        obj = shard_object(name)
        return RangedShardReader(path, self._range_get(name), size, self.bucket.where(obj), verify,
                                 head)  # fmt: skip

    def _range_get(self, name: str) -> Callable[[int, int], bytes]:
        """Reads a byte range of shard ``name``'s object (a ``RangeGet``)."""
        obj = shard_object(name)

        def get(start: int, length: int) -> bytes:
            try:
                return self.bucket.read_range(obj, start, length)
            except FileNotFoundError:
                # gc relocated or dropped it while this reader was open: bring in the newest
                # version, through which the reader's lookup of the feature runs again.
                self.sync_catalog()
                raise ShardMissing(f"shard {name} is gone from {self.url}") from None

        return get

    def has_shard(self, name: str) -> bool:
        return name in self._listed() or self._size_of(name) is not None

    def describe(self) -> str:
        return str(self.url)  # never the tier folder

    def fetch_ahead(self, name: str) -> bool:
        """Shards not read by ranges are fetched whole: shard ``name``'s fetch is started in
        the background (see :meth:`prefetch`), and the caller does not open it now. Read by
        ranges (``auto``), a shard the tier has room for is kept whole: its fetch too is
        started in the background (a hint never waits for a download; the read that opens
        it waits for that fetch), else the caller opens it by ranges."""
        if not self.reads_ranged():
            self.prefetch(name)
            return True
        if self._fetching(name):
            return True
        sizes = self._named_shards()
        size = sizes.get(name)
        if size is None or self.layout.shard_path(name).is_file():
            return False
        with self._prefetch_lock:  # room beside the fetches already started, never evicting
            queued = sum(sizes.get(n, 0) for n in self._prefetching)
        if not self._fills_tier or not self.tier.has_room(size + queued):
            self._start_head(name)  # the caller opens it by ranges: its header is on the way
            return False
        return self._submit(name, partial(self.fetch_shard, keep=(), wait=False))

    def _start_head(self, name: str) -> None:
        """Start the GET of shard ``name``'s header (its reader, opened next, takes it) unless
        one is waiting; at most :data:`HEADS_AHEAD` wait."""
        with self._prefetch_lock:
            if name in self._heads or len(self._heads) >= HEADS_AHEAD:
                return
            self._heads[name] = head_ahead(self._range_get(name))

    def _fetching(self, name: str) -> bool:
        """Whether this process's background fetch of shard ``name`` is queued or running."""
        with self._prefetch_lock:
            return name in self._prefetching

    def ahead_items(self) -> int:
        """Items a loader should hint ahead when shards are read by ranges: as many as the
        tier's budget holds (at most :data:`AHEAD_BYTES`), by the catalog's mean item, so a
        shuffled order names several items of each shard before its grouped GET starts
        (:class:`~featbake.store.ranged.AheadQueue`); 0 when shards are fetched whole."""
        if not self.reads_ranged():
            return 0
        items = catalog_items(self.layout.catalog)
        if items <= 0:
            return 0
        mean = max(1, self._named_bytes() // items)
        return min(self.tier.budget, AHEAD_BYTES) // mean

    def opened(self, path: Path) -> None:
        """A read opened tier file ``path``: stamped as used; under a block order, the first
        read of a later window's shard moves the plan there (see :meth:`follow_blocks`)."""
        self.tier.touch(path)
        plan = self._following()
        if plan is None:
            return
        with self._plan_lock:
            k = plan.opened(path.name.removesuffix(".safetensors"))
            if k is not None and plan is self._plan:
                self._enter(plan, k)

    # -- block orders ------------------------------------------------------------------------
    def follow_blocks(self, windows: Sequence[Sequence[str]] | None) -> bool:
        """Follow a block order's epoch: ``windows`` are the shards each of its windows reads,
        in reading order (this process's share); None stops following. Whether it follows.

        While it follows, shards are fetched whole (``auto`` reads no ranges), the current
        and next windows' shards are fetched on a background thread (at most
        :data:`PREFETCH_AHEAD` at once, only into room that leaves both windows in the tier)
        and a window's shards are evicted once the reads have opened a later window's. A
        window that outweighs the tier is said once (:class:`BlockWindowWarning`) and the
        reads go on as without the order; so does ``$FEATBAKE_BUCKET_READS=ranged``.
        """
        with self._plan_lock:
            self._plan = None
        if windows is None or os.environ.get(READS_ENV, "auto") == "ranged":
            return False
        over = windows_over(windows, self._named_shards(), self.tier.budget)
        if over:
            if not self._warned_window:
                self._warned_window = True
                warnings.warn(
                    f"featbake: {over} block window(s) of {self.url} outweigh the local cache "
                    f"({format_bytes(self.tier.budget)}), so shards are not fetched a window at "
                    "a time; give a smaller window (window=) or raise local_cache_size",
                    BlockWindowWarning,
                    stacklevel=3,
                )
            return False
        plan = BlockPlan(windows)
        with self._plan_lock:
            self._plan = plan
            self._enter(plan, 0)
        return True

    def _following(self) -> BlockPlan | None:
        """The block plan the reads of this process follow (None: none)."""
        return self._plan

    def _enter(self, plan: BlockPlan, k: int) -> None:
        """The reads are in window ``k`` now (plan lock held): evict what the windows passed
        left, as much as the current and next windows need, and fetch their missing shards
        in the background."""
        plan.current = k
        self.tier.evict(self._room_for(plan, k))
        if os.environ.get(PREFETCH_ENV, "1") == "0":
            return
        for name in plan.keep(k):
            self._submit(name, partial(self._prefetch_planned, plan))

    def _room_for(self, plan: BlockPlan, k: int) -> list[str]:
        """The passed windows' shards to evict, oldest window first, so that window ``k``'s
        and the next one's shards fit the tier beside what it holds (none when they fit: a
        tier that holds the store keeps it for the next epoch)."""
        sizes = self._named_shards()
        here = [n for n in plan.keep(k) if self.layout.shard_path(n).is_file()]
        need = sum(sizes.get(n, 0) for n in plan.keep(k)) - sum(sizes.get(n, 0) for n in here)
        over = self.tier.used_bytes() + need - self.tier.budget
        doomed = []
        for name in plan.passed(k):
            if over <= 0:
                break
            if self.layout.shard_path(name).is_file():
                doomed.append(name)
                over -= sizes.get(name, 0)
        return doomed

    def _protected(self) -> tuple[str, ...]:
        """The shards a fetch must not evict: the current and next windows of the plan being
        followed, when both fit the tier (else none: the reads' fetches evict as before)."""
        plan = self._following()
        if plan is None:
            return ()
        keep = plan.keep(plan.current)
        sizes = self._named_shards()
        return keep if sum(sizes.get(n, 0) for n in keep) <= self.tier.budget else ()

    def _prefetch_planned(self, plan: BlockPlan, name: str) -> None:
        """Fetch ``name`` if the reads still need it in the tier (current or next window) and
        it fits beside them; a fetch that finds no room gives up (the read fetches it)."""
        keep = plan.keep(plan.current)
        size = self._named_shards().get(name)
        if plan is not self._plan or name not in keep or size is None:
            return
        if self.layout.shard_path(name).is_file() or not self.tier.fits_beside(keep, size):
            return
        self.fetch_shard(name, keep=keep, wait=False)

    def prefetch(self, name: str) -> bool:
        """Start fetching shard ``name`` whole into the tier on a background thread, not
        waiting (a reader's hint for its coming items: epoch 1 too). Nothing when shards are
        read by ranges, when the tier holds it, when the store does not fit the tier's budget
        whole or the shard does not fit it now without evicting (a prefetch never pushes out a
        shard the reads still need), or while
        :data:`PREFETCH_AHEAD` fetches of this process are in flight. A failed prefetch is
        silent: the read itself fetches again and says why. Under a block order
        (:meth:`follow_blocks`) nothing either: the order's windows say what comes.
        Returns whether a fetch was started."""
        if os.environ.get(PREFETCH_ENV, "1") == "0" or self._following() is not None:
            return False
        if self.reads_ranged() or not self._store_fits_tier():
            return False
        with self._prefetch_lock:  # cheap checks first: a hint names the same shards often
            if name in self._prefetching or len(self._prefetching) >= PREFETCH_AHEAD:
                return False
        if self.layout.shard_path(name).is_file():
            return False
        size = self._named_shards().get(name)  # the catalog says its bytes: no HEAD per hint
        if size is None or not self.tier.has_room(size):
            return False  # never evicts for a guess: what the reads still need stays
        with self._prefetch_lock:
            if len(self._prefetching) >= PREFETCH_AHEAD:
                return False
        return self._submit(name, self.fetch_shard)

    def _submit(self, name: str, fetch: Callable[[str], object]) -> bool:
        """Run ``fetch(name)`` on this process's prefetch threads unless one is queued for
        ``name`` or the tier holds it; failures are silent (the read fetches again and says
        why). Whether it was queued."""
        if self.layout.shard_path(name).is_file():
            return False
        with self._prefetch_lock:
            if name in self._prefetching:
                return False
            self._prefetching.add(name)
        _PREFETCH_POOL.get().submit(self._prefetch_one, name, fetch)
        return True

    def _store_fits_tier(self) -> bool:
        """Whether every shard the catalog names fits the tier's budget at once. Only then does
        a prefetch never push out a shard fetched for a read still to come; a tier smaller than
        the store fetches on demand (a blocks epoch: once each)."""
        return self._named_bytes() <= self.tier.budget

    def _named_shards(self) -> dict[str, int]:
        """The shards the tier's catalog names, with their bytes: read once per process (the
        read mode and prefetch ask it; both are settled per process, as they were)."""
        if self._named is None:
            self._named = catalog_shards(self.layout.catalog)
            self._named_total = sum(self._named.values())
        return self._named

    def _named_bytes(self) -> int:
        """The bytes of every shard the tier's catalog names (see :meth:`_named_shards`)."""
        self._named_shards()
        return self._named_total

    def _prefetch_one(self, name: str, fetch: Callable[[str], object]) -> None:
        try:
            fetch(name)
        except FeatbakeError:
            pass  # the read that needs it fetches again and reports the cause
        finally:
            with self._prefetch_lock:
                self._prefetching.discard(name)

    def prefetches_in_flight(self) -> int:
        """Background fetches of this process queued or running, not finished yet."""
        with self._prefetch_lock:
            return len(self._prefetching)

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        self.publish_shards(shards)
        self.bucket.upload(f"{FRAGMENTS}{fragment.name}", fragment)
        with locked(self._seen_lock):
            self._write_seen(self._seen_or_sealed() | {fragment.name})

    def defers_fragments(self) -> bool:
        return True  # each fragment is a PUT (and a fold for merge): a build batches them

    def publish_padding(self, record: Path) -> None:
        self.bucket.upload(f"{PADDING}{record.name}", record)

    def retire_padding(self, record: Path) -> None:
        self.bucket.delete([f"{PADDING}{record.name}"])

    def padding_texts(self, name: str, part: str | None = None) -> list[str]:
        """Each padding record of root ``name`` the bucket holds (of part ``part`` alone, if
        given), read whole; one whose part ended since the listing is left out. Nothing is
        written to the tier: another process on this node may be writing its part's record
        there."""
        prefix = f"{PADDING}{name}." + (f"{part}.padding" if part is not None else "")
        texts = []
        for o in self.bucket.list(prefix):
            if not o.name.endswith(".padding"):
                continue
            with contextlib.suppress(FileNotFoundError):
                texts.append(self.bucket.read(o.name).data.decode("utf-8", "replace"))
        return texts

    def publish_shards(self, shards: Sequence[str]) -> None:
        """Upload each shard of ``shards`` from the tier, where this process has not already.

        A shard the tier holds is uploaded even where a listing names its object: the listing
        may be older than a gc that swept that object as an unnamed leftover (a killed build's
        shard of the same bytes), and a catalog naming it would then name nothing. The upload
        reads a hard link, so another process's reads evicting the tier's copy meanwhile
        take nothing from under it. A shard already gone from the tier is there only if the
        bucket holds it (another process uploaded the same bytes), else it is written again.
        """
        for name in shards:
            if name not in self._uploaded:
                self._publish_shard(name)
        self._uploaded.update(shards)
        if shards:  # uploaded: a build bigger than this disk must not fill it
            self.tier.trim(uploaded=self._uploaded)

    def _publish_shard(self, name: str) -> None:
        """Shard ``name``'s bytes from the tier put as its object (see :meth:`publish_shards`).

        Raises:
            ShardMissing: the shard left the tier before its upload, and the bucket has none.
        """
        path = self.layout.shard_path(name)
        link = self.layout.tmp / f"{name}.{uuid.uuid4().hex[:8]}.upload"
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, link)
        except FileNotFoundError:
            if self.bucket.head(shard_object(name)) is not None:
                return  # evicted after another process uploaded the same bytes
            raise ShardMissing(
                f"shard {name} left the local tier before its upload; it is written again"
            ) from None
        except OSError:  # a tier on a filesystem without hard links: the copy itself
            link = path
        try:
            self.bucket.upload(shard_object(name), link)  # content-named: same bytes if again
            if self._sizes is not None:
                self._sizes[name] = link.stat().st_size
        finally:
            if link != path:
                link.unlink(missing_ok=True)

    def tier_usage(self) -> TierUsage:
        return TierUsage(self.local_version(), self.tier.used_bytes(), self.tier.budget)

    def shard_objects(self) -> dict[str, int]:
        listed = {
            name: o.size
            for o in self.bucket.list(SHARDS)
            if is_shard_name(name := Path(o.name).name.removesuffix(".safetensors"))
        }
        self._sizes = dict(listed)
        return listed

    def lost_its_catalog(self) -> bool:
        """Whether the bucket holds shard objects and no fragment (a listing request of one key
        each), asked where it holds no catalog version: its versions were deleted. A first
        build in parts not merged yet holds fragments; a first build still running may not
        have uploaded its first yet (the message says both)."""
        if not self.bucket.list_page(SHARDS, keys=1).objects:
            return False
        return not self.bucket.list_page(FRAGMENTS, keys=1).objects

    def download_shard(self, name: str, dest: Path) -> None:
        self.bucket.download(shard_object(name), dest)

    def shard_where(self, name: str) -> str:
        return self.bucket.where(shard_object(name))

    # -- Place: what upkeep asks of the bucket --------------------------------------------------
    def commit(self, change: Callable[[Layout], Change[T]]) -> T:
        """The change, on a copy of the newest version, published as the next one."""
        return publish_next(self, change)

    def settle(self) -> None:
        """Fold the bucket's fragments in first (readers' last uses wait in serving fragments,
        and a root read every day is not idle: issue 28 item 7), then bring the newest version
        into the tier (another merge may have published it meanwhile)."""
        merge_bucket(self)
        self.sync_catalog()

    def rewrites_shards(self) -> bool:
        return False  # compaction would download and upload every shard it touches

    def plan_sweep(self, now: float, grace: float, retention: float) -> Sweep:
        """Retired versions and unnamed shard objects past ``retention`` (``grace`` is the
        directory's age; the bucket's is the retention period, for readers of older versions).

        The order is what makes it safe beside a merge: shards are listed first, then
        fragments, then catalog versions. A shard in the first listing is named by a fragment
        still pending or, once a merge folded that fragment, by a version published before the
        last listing; a shard uploaded after the first listing is not in it, so never deleted.

        Raises:
            StoreCorrupt: a kept version names something that is not a shard name (nothing
                is deleted on a planted version's word).
        """
        shards = self.bucket.list(SHARDS)
        self.sync_fragments()
        pending = fragment_shard_names(self.layout)
        versions = self.bucket.list(PREFIX)
        keep = kept_versions(versions, now, retention)
        named_by = {n: self._version_shards(n) for n in keep}
        planned = sweep(versions, shards, named_by, pending, now, retention)
        return dataclasses.replace(planned, loose=self._left_work(now, grace))

    def _left_work(self, now: float, grace: float) -> tuple[Held, ...]:
        """The tier's leftovers (:meth:`leftovers`) untouched for ``grace``: left by a gc,
        merge, drop or verify killed before it could remove its own."""
        return tuple(h for h in self.leftovers() if now - h.modified >= grace)

    def leftovers(self) -> list[Held]:
        """What the tier's ``tmp/`` holds that gc's sweep weighs, of any age
        (:func:`tier_leftovers`)."""
        return [h for h in tier_leftovers(self.layout.tmp) if not held_now(h)]

    def _version_shards(self, version: int) -> set[str]:
        """The shard names catalog version ``version`` holds (the tier's copy when it is it)."""
        if version == self.local_version():
            return set(catalog_shards(self.layout.catalog))
        tmp = self.layout.tmp / f"gc-v{version}.{uuid.uuid4().hex[:8]}.sqlite"
        try:
            with holding(tmp):  # held: no gc's sweep on this node takes it while it is read
                self.bucket.download(version_name(version), tmp)
                return set(catalog_shards(tmp, required=True))
        except sqlite3.OperationalError as e:  # never a version read as naming nothing
            raise StoreError(
                f"gc lost its copy of catalog version {version} of {self.url} before reading it "
                f"({e}; another gc's sweep on this node, on a disk without locks?); "
                "nothing was deleted: run gc again"
            ) from e

    def sweep(self, plan: Sweep, crash: Callable[[str], None]) -> Swept:
        """Delete the plan's shard objects, each only as gc's listing saw it (one put again
        since is kept, and not counted), then its retired versions."""
        gone = self._swept_shards(plan)
        self.bucket.delete(h.name for h in plan.versions)
        # The tier's leftovers: only what no live process holds, weighed again as it goes,
        # counted by what this sweep removed (not the plan's weights).
        loose = [n for n in map(removed_leftover, plan.loose) if n is not None]
        objects = sum(h.size for h in (*gone, *plan.versions))
        return Swept(len(gone), len(loose), len(plan.versions), objects + sum(loose))

    def _swept_shards(self, plan: Sweep) -> list[Held]:
        """The plan's shard objects this sweep deleted: each only while it is the version gc
        listed (:attr:`~featbake.store.place.Held.version`). Another node building the same
        inputs with the same encoder puts the same bytes under the same content name, and
        publishes a fragment naming them: where that put came after gc's listing, the object
        gc found old and unnamed is the other node's now, and an unconditional delete took it
        (the next version named a shard the bucket no longer held)."""
        listed = [ObjectInfo(h.name, h.size, h.modified, h.version) for h in plan.shards]
        kept = set(self.bucket.delete(listed))
        return [h for h in plan.shards if h.name not in kept]

    def repair_refusal(self) -> str | None:
        return (
            f"--repair is not built for a bucket store ({self.url}); run `featbake verify "
            "--cache URL` to list damaged or missing shard objects, delete a damaged object, "
            "then build again (a build encodes again what a missing shard held)"
        )

    def verify_scope(self) -> VerifyScope:
        return VerifyScope.NAMED_SHARDS  # the bucket's objects: a tier's copy says nothing

    def named_shards(self) -> dict[str, int]:
        return catalog_shards(self.layout.catalog)

    # -- catalog versions and fragments ---------------------------------------------------------
    @property
    def version_file(self) -> Path:
        """``<tier>/catalog.version``: which published version the tier's catalog is, and the
        ETag the bucket gave that version's object (JSON)."""
        return self.layout.root / VERSION_FILE

    def _pinned(self) -> PinnedVersion | None:
        """The version and ETag the tier's catalog was downloaded as; None when the tier has no
        catalog, or only a number (a tier from before ETags were kept: fetched again), or a
        copy that is no whole catalog (:func:`whole_catalog_problem`: emptied, cut short, its
        tables gone), which is fetched again: trusted by its pin, an empty copy served nothing
        and a build published a next version from it, dropping every root in the bucket."""
        if whole_catalog_problem(self.layout.catalog) is not None:
            return None
        try:
            raw = json.loads(self.version_file.read_text())
            pinned = PinnedVersion(int(raw["version"]), str(raw["etag"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return pinned if pinned.version > 0 and pinned.etag else None

    def local_version(self) -> int:
        """The version of the tier's ``catalog.sqlite`` (0: none, or none this tier can vouch
        for)."""
        pinned = self._pinned()
        return pinned.version if pinned else 0

    def published_version(self) -> int:
        """The newest version in the bucket (0: none published yet)."""
        return newest(o.name for o in self.bucket.list(PREFIX))

    def sync_catalog(self) -> int:
        """Bring the newest published catalog into the tier (if it is not there); its version.

        The tier's copy is trusted only when it is the bucket's newest version *as the bucket
        holds it*: the same number and the same ETag. A tier whose catalog went missing, or
        one from before the prefix was wiped and rebuilt (same number, other bytes), fetches
        again: every publish starts from the bucket's newest version, so a stale tier can
        never publish over everyone else's work. The tier's ``catalog.sqlite`` is replaced by
        rename: a process reading the older one keeps reading it until it reopens.
        """
        self.layout.ensure()
        self._mark_tier()
        # One download per node: the node's processes (DataLoader workers that all found a
        # shard gone) wait here, and the first one's catalog serves the rest.
        with tier_locked(self.layout.tmp / CATALOG_LOCK):
            return self._sync_catalog_locked()

    def _sync_catalog_locked(self) -> int:
        newest_obj = newest_object(self.bucket.list(PREFIX))
        if newest_obj is None:
            if self.layout.catalog.exists() or self.version_file.exists():
                self._forget_catalog()  # the bucket was emptied: the tier's is not its catalog
            return 0
        want = PinnedVersion(version_of(newest_obj.name) or 0, newest_obj.etag)
        if self._pinned() == want:
            return want.version
        tmp = self.layout.tmp / f"catalog-v{want.version}.{uuid.uuid4().hex[:12]}.download"
        with holding(tmp):  # held: no gc's sweep on this node takes it before it is installed
            try:
                self.bucket.download(newest_obj.name, tmp)
            except FileNotFoundError:
                return self._sync_catalog_locked()  # retired between the listing and the read
            check_catalog_file(tmp, self.bucket.where(newest_obj.name))
            self.install_catalog(tmp, want.version, want.etag)
        return want.version

    def _mark_tier(self) -> None:
        """Write ``tier.json`` (the bucket's URL) once: a tier given as ``--cache`` is refused."""
        mark = self.layout.root / TIER_MARK
        if not mark.exists():
            doc = json.dumps({"url": str(self.url)})
            publish_file(mark, lambda tmp: tmp.write_text(doc), tmp_dir=self.layout.tmp)

    def _forget_catalog(self) -> None:
        """Drop the tier's catalog (its shards stay: content-named and checked, they are right
        for whatever store names them)."""
        with contextlib.suppress(OSError):
            self.version_file.unlink()
        self._unlink_catalog_files(("", "-wal", "-shm", "-journal"))

    def _unlink_catalog_files(self, suffixes: tuple[str, ...]) -> None:
        """Remove the tier's ``catalog.sqlite<suffix>`` files that exist."""
        for suffix in suffixes:
            with contextlib.suppress(OSError):
                os.unlink(f"{self.layout.catalog}{suffix}")

    def install_catalog(self, path: Path, version: int, etag: str | None = None) -> None:
        """Make ``path`` the tier's catalog, as published version ``version`` whose object has
        ``etag`` (asked of the bucket when not given: a version this process just published)."""
        if etag is None:
            info = self.bucket.head(version_name(version))
            etag = info.etag if info else ""
        self._unlink_catalog_files(("-wal", "-shm", "-journal"))
        records = root_records_in(path)
        if records is not None:  # the roots' records this version carries (see publish)
            restore_records(self.layout, records)
        fsync_file(path)  # on disk before its pin is (publish_file fsyncs the folder after)
        os.replace(path, self.layout.catalog)
        pin = json.dumps(PinnedVersion(version, etag)._asdict())
        publish_file(self.version_file, lambda tmp: tmp.write_text(pin), tmp_dir=self.layout.tmp)

    # -- Place: builds, merge, serving --------------------------------------------------------
    def builds_in_fragments(self) -> bool:
        return True  # the tier's catalog is a published version, never written in place

    def merge(self, abandon: AbstractSet[str] = frozenset()) -> MergeReport:
        return merge_bucket(self, abandon=abandon)

    def serving_mode(self) -> bool:
        return True  # written-back features go to fragments, published after their shards

    def sync_fragments(self) -> int:
        """Download the bucket's fragments the tier lacks (other nodes' ranks); how many.

        The tier's copies of fragments the bucket held (uploaded or downloaded here: see
        :data:`SEEN_FRAGMENTS`) and no longer lists are let go first: some node merged and
        retired them, and a copy kept would be merged again (a root dropped since would come
        back) and keep its keys from gc for ever. Fragments sealed here that the bucket never
        held (a process killed before their upload, or whose upload failed) are adopted next
        (:meth:`_adopted`): a rerun counts their features as stored, so the merge must fold
        them.
        """
        here = fragments_dir(self.layout)
        here.mkdir(parents=True, exist_ok=True)
        got = 0
        with locked(self._seen_lock):
            listed = {Path(o.name).name for o in self.bucket.list(FRAGMENTS)}
            sealed = {f.path.name for f in sealed_fragments(self.layout)}
            seen = self._seen_or_sealed(sealed)
            for name in retired_copies(seen, listed):
                with contextlib.suppress(FileNotFoundError):
                    (here / name).unlink()
            listed |= self._adopted(unsent_copies(sealed, seen, listed))
            for name in sorted(listed):
                final = here / name
                if parse_name(final) is None or final.exists():
                    continue
                try:
                    publish_file(
                        final,
                        partial(self.bucket.download, FRAGMENTS + name),
                        tmp_dir=self.layout.tmp,
                    )
                except FileNotFoundError:
                    # Merged and retired by another node since the listing (its catalog
                    # version holds it now): failed a build with "internal error".
                    listed.discard(name)
                    continue
                got += 1
            self._write_seen(seen & listed | {n for n in listed if (here / n).exists()})
        self.listed_fragments = frozenset(listed)
        return got

    def _adopted(self, names: Collection[str]) -> set[str]:
        """The tier's unsent fragments ``names`` uploaded now, after the shards they name; the
        names uploaded. One a live process holds is on its way up (its writer holds it until
        uploaded: :func:`~featbake.store.fragments.write_fragment`), and one unreadable is left
        as it is (neither counts as stored nor is merged). One naming a shard gone from both
        the tier and the bucket names features nobody can read: it is removed, so they count
        as missing and a build encodes them again."""
        adopted: set[str] = set()
        for name in sorted(names):
            path = fragments_dir(self.layout) / name
            if held_now(Held(str(path), 0, 0.0)):
                continue
            shards = fragment_shards(path)
            if shards is None:
                continue
            try:
                self.publish_shards(shards)
            except ShardMissing:
                path.unlink(missing_ok=True)
                continue
            self.bucket.upload(f"{FRAGMENTS}{name}", path)
            adopted.add(name)
        return adopted

    @property
    def _seen_lock(self) -> Path:
        return self.layout.root / "fragments.lock"

    def _seen_or_sealed(self, sealed: set[str] | None = None) -> set[str]:
        """:meth:`_read_seen`, or where the tier has no record yet (a tier older than it), its
        sealed fragments (``sealed``, else listed now): their history is unknown, so none is
        taken for unsent (and uploaded: a root dropped since would come back), and one the
        bucket lists no more is let go as a retired copy."""
        seen = self._read_seen()
        if seen is not None:
            return seen
        return {f.path.name for f in sealed_fragments(self.layout)} if sealed is None else sealed

    def _read_seen(self) -> set[str] | None:
        """The names of :data:`SEEN_FRAGMENTS`; None where it is missing or unreadable (see
        :meth:`sync_fragments`)."""
        try:
            names = json.loads((self.layout.root / SEEN_FRAGMENTS).read_text())
        except (OSError, ValueError):
            return None
        return {str(n) for n in names} if isinstance(names, list) else None

    def _write_seen(self, names: set[str]) -> None:
        path = self.layout.root / SEEN_FRAGMENTS
        text = json.dumps(sorted(names))
        publish_file(path, lambda p: p.write_text(text), tmp_dir=self.layout.tmp, durable=False)


def tier_leftovers(tmp: Path) -> list[Held]:
    """What a killed process leaves in a tier's ``tmp/``: each file but :data:`CATALOG_LOCK`
    (a catalog version a gc read, a download or publish cut short), and each folder named by
    :data:`LEFTOVER_PREFIXES` (a change's catalog copy, a verify's scratch, a sweep's renamed
    copy), weighed by :func:`~featbake.store.place.held_folder`. The one rule gc's sweep,
    stats and verify's note count a tier's leftovers by."""
    files = [
        Held(str(f.path), f.bytes, f.mtime)
        for f in list_folder(tmp, "*").files
        if f.path.name != CATALOG_LOCK
    ]
    try:
        names = sorted(p for p in tmp.iterdir() if p.name.startswith(LEFTOVER_PREFIXES))
    except OSError:
        return files  # no tmp/ yet
    return files + [h for h in map(held_folder, names) if h is not None]


def verify_scratch(tmp: Path) -> Path:
    """A scratch folder of its own for one verify in ``tmp/`` (made on first use): two verifies
    on one node never remove each other's."""
    return tmp / f"{VERIFY_SCRATCH}-{uuid.uuid4().hex[:12]}"


def retired_copies(seen: Collection[str], listed: Collection[str]) -> set[str]:
    """The fragments a tier holds copies of that the bucket held once (``seen``) and lists no
    more (``listed``): merged and retired by some node (pure).

    Example:
        >>> sorted(retired_copies({"a", "b"}, {"b", "c"}))
        ['a']
    """
    return set(seen) - set(listed)


def unsent_copies(
    sealed: Collection[str], seen: Collection[str], listed: Collection[str]
) -> set[str]:
    """The fragments sealed in a tier that the bucket neither lists nor ever held (``seen``):
    sealed here, never uploaded (pure).

    Example:
        >>> sorted(unsent_copies({"a", "b", "c"}, {"a"}, {"b"}))
        ['c']
    """
    return set(sealed) - set(seen) - set(listed)


def catalog_shards(catalog: Path, *, required: bool = False) -> dict[str, int]:
    """The shards a catalog file names, with their bytes (none without the file, unless
    ``required``): what gc, verify and the read mode of a bucket store ask of a catalog version.

    Raises:
        StoreCorrupt: it names something that is not a shard name (a damaged or planted
            version): gc then deletes nothing rather than trust the rest of it.
        sqlite3.OperationalError: ``required`` and there is no such file.
    """
    if not required and not catalog.exists():
        return {}
    conn = open_sqlite(catalog, Access.IMMUTABLE)
    try:
        named = dict(conn.execute("SELECT name, bytes FROM shards"))
    finally:
        conn.close()
    for name in named:
        checked_shard_name(name)
    return named


def catalog_items(catalog: Path) -> int:
    """The items the shards a catalog file names hold (0 without the file)."""
    if not catalog.exists():
        return 0
    conn = open_sqlite(catalog, Access.IMMUTABLE)
    try:
        return int(conn.execute("SELECT coalesce(sum(items), 0) FROM shards").fetchone()[0])
    finally:
        conn.close()


def check_catalog_file(path: Path, where: str) -> None:
    """Raise unless ``path`` is a usable SQLite catalog (a published version downloaded from
    ``where``): SQLite's ``quick_check`` finds a damaged page (one flipped byte in the object)
    that a query would meet later, as "database disk image is malformed" in whatever command
    read that page; a missing table or column is named too (:func:`catalog_file_problems`, as
    ``verify`` checks a directory's catalog).

    Raises:
        StoreCorrupt: it is not: the message names the bucket object and what to do.
    """
    problems = catalog_file_problems(path, Access.IMMUTABLE)
    if problems:
        raise StoreCorrupt(
            f"the catalog version {where} is damaged ({'; '.join(problems[:5])}); delete that "
            "object so the version before it serves again (`featbake verify --cache URL` then "
            "lists what it lacks), and rebuild what went missing"
        )


# == publish =======================================================================================
# Publishing a bucket store's next catalog version: merges and gc go through here.
#
# The tier's catalog is never written in place (readers of this node may have it open): a change
# runs on a copy in ``tmp/work-<id>/`` (:func:`publish_next`), and the result is published as
# version N+1 only if nobody published N+1 first (``If-None-Match: *``). A change that loses
# that race starts again from the newer version: merging is idempotent (first row wins, a root's
# newer manifest wins), and gc re-plans. What a change retires in the bucket (folded fragments)
# is deleted only after the version is published, so a merge killed at any moment loses
# nothing: its rerun folds them again.
#
# The records beside a root (``roots/<name>.undecodable``: store/roots.py, CARRIED_RECORDS) are
# files of the tier, which is never uploaded; they travel inside the catalog version that
# publishes the root (table :data:`ROOT_RECORDS`), so that they are exactly that version's: a
# change starts from the records of the version it starts from (a merge folds an earlier
# build's record, a drop removes its root's), and each tier installing a version gets its
# records with it (a dataset on any node leaves out what the build could not decode).
T = TypeVar("T")

#: The table of a published catalog version that carries its roots' records (file name ->
#: text); a version without it (published before it was kept) says nothing of them.
ROOT_RECORDS = "bucket_root_records"


class DamagedFragmentWarning(UserWarning):
    """A build fragment in a bucket cannot be read: it was left unmerged (named, with what to
    do), and every other build merged."""


#: A test hook: called with the name of each step a merge finished.
Between = Callable[[str], None] | None

#: Changes that lose the race for the next version before one gives up.
TRIES = 5


def publish_next(store: BucketStore, change: Callable[[Layout], Change[T]]) -> T:
    """Apply ``change`` to a copy of the newest version and publish it as the next one.

    The copy's folder (``tmp/work-<id>``) is held for the change's life
    (:func:`~featbake.store.files.holding`), so no gc's sweep on this node takes it; where the
    disk has no locks and one took it all the same, the change fails in one line
    (:func:`lost_work`) and publishes nothing, decided by the folder's identity (a folder made
    again meanwhile, by the change's own writes, is not its copy).

    Raises:
        StoreError: the bucket cannot be read or written, or others kept publishing first.
    """
    for _ in range(TRIES):
        version = store.sync_catalog()
        work = Layout(store.layout.tmp / f"{WORK_PREFIX}{uuid.uuid4().hex[:12]}", remote=store)
        with holding(work.root, folder=True) as hold:  # removed at the end, then let go
            done = _published_copy(store, work, version, change, hold)
        if done is not None:
            return done.value
    raise StoreError(
        f"other merges or gc runs published {TRIES} catalog versions of {store} while this one "
        "ran; run it again when they are done"
    )


def _published_copy(
    store: BucketStore,
    work: Layout,
    version: int,
    change: Callable[[Layout], Change[T]],
    hold: Hold,
) -> Change[T] | None:
    """``change`` run on a copy of version ``version`` in ``work`` (held: ``hold``), published
    as the next version; the change (its value), or None where another published it first."""
    try:
        work.ensure()
        if store.layout.catalog.exists():
            shutil.copyfile(store.layout.catalog, work.catalog)
            records = root_records_in(work.catalog)
            if records is not None:  # what the roots' last builds recorded: a merge folds
                restore_records(work, records)  # them in, a drop removes its root's
        outcome = change(work)
        if not outcome.changed:
            return outcome
        pack_root_records(work)
        _standalone(work)
        if not hold.intact():  # swept, then made again by a write: never publish that
            raise lost_work(store, work)
        if not store.bucket.upload(version_name(version + 1), work.catalog, create=True):
            return None
    except (OSError, sqlite3.Error) as e:
        if not hold.intact():  # never a raw error of a folder swept away
            raise lost_work(store, work) from e
        raise
    if outcome.after_publish:
        outcome.after_publish()
    _keep_roots(work, store.layout)
    store.install_catalog(work.catalog, version + 1)
    return outcome


def lost_work(store: BucketStore, work: Layout) -> StoreError:
    """The one line for a change whose catalog copy in the tier's ``tmp/`` went while it ran:
    a gc on this node took it as a killed change's leftover (its grace shorter than the run)."""
    return StoreError(
        f"the working copy of {store}'s catalog this change made ({work.root}) was removed "
        "while it ran, by a gc on this node whose --grace is shorter than the change took; run "
        "it again (with no gc of a shorter grace beside it)"
    )


def merge_bucket(
    store: BucketStore, *, between: Between = None, abandon: AbstractSet[str] = frozenset()
) -> MergeReport:
    """Fold the bucket's fragments into a new catalog version (see the module docstring);
    the unfinished builds of the roots in ``abandon`` are retired.

    ``between`` is a test hook, called with the local merge's steps, then ``published``.

    Raises:
        ConfigError: a root in ``abandon`` has no unfinished build in the bucket.
        StoreError: the bucket cannot be read or written, or others kept publishing first.
    """

    def fold(work: Layout) -> Change[MergeReport]:
        store.sync_fragments()
        here = fragments_dir(store.layout)
        fragments_dir(work).mkdir()
        # Only what the bucket holds: a copy left here of a fragment merged elsewhere is not
        # folded again (a root dropped since would come back).
        listed = store.listed_fragments
        folding = {f.path.name for f in sealed_fragments(store.layout) if f.path.name in listed}
        for name in folding:
            os.link(here / name, fragments_dir(work) / name)
        report = merge(work, between=between, skip_damaged=True, abandon=abandon)
        folded = folding - {f.path.name for f in sealed_fragments(work)}
        for name in report.damaged:
            warnings.warn(
                f"the build fragment {store.bucket.where(FRAGMENTS + name)} is damaged and was "
                "not merged (everything else was); delete that object and rerun the part that "
                "wrote it: it encodes again what the fragment named",
                DamagedFragmentWarning,
                stacklevel=2,
            )

        def retire() -> None:
            if between:
                between("published")
            store.bucket.delete(f"{FRAGMENTS}{name}" for name in folded)
            for name in folded:
                with contextlib.suppress(OSError):
                    (here / name).unlink()

        # Published where rows the version held were found void, though nothing was folded
        # for good (the build that replaced them waits for a part): else it served them on.
        return Change(report, bool(folded) or report.void_rows > 0, retire)

    # One merge at a time on this node, as gc runs take turns (upkeep/gc.py): two folding the
    # tier's copies at once each linked what the other's retire unlinked, and folded it twice.
    # Merges on two nodes race to publish the next version (see publish_next).
    with merging_alone(store.layout, f"{store} on this node (local cache {store.layout.root})"):
        return publish_next(store, fold)


def pack_root_records(work: Layout) -> None:
    """Write the records of ``work``'s ``roots/`` (the change's outcome) into its catalog's
    :data:`ROOT_RECORDS` table, replacing what it carried, before the version is uploaded."""
    records = carried_records(work)
    conn = open_sqlite(work.catalog)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {ROOT_RECORDS} (name TEXT PRIMARY KEY, body TEXT NOT NULL)"
        )
        conn.execute(f"DELETE FROM {ROOT_RECORDS}")
        conn.executemany(f"INSERT INTO {ROOT_RECORDS} VALUES (?, ?)", sorted(records.items()))
        conn.execute("COMMIT")
    finally:
        conn.close()


def root_records_in(catalog: Path) -> dict[str, str] | None:
    """The roots' records catalog version file ``catalog`` carries (file name -> text); None
    when it carries none (a version published before they were kept: it says nothing)."""
    conn = open_sqlite(catalog, Access.IMMUTABLE)
    try:
        rows = conn.execute(f"SELECT name, body FROM {ROOT_RECORDS}").fetchall()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return None
        raise
    finally:
        conn.close()
    return {str(name): str(body) for name, body in rows}


def _standalone(work: Layout) -> None:
    """Make the new catalog one self-contained file (no WAL beside it) before its upload."""
    conn = open_sqlite(work.catalog)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def _keep_roots(work: Layout, tier: Layout) -> None:
    """Move the root manifests the change wrote into the tier (they go with its catalog)."""
    if not work.roots.is_dir():
        return
    tier.roots.mkdir(parents=True, exist_ok=True)
    for f in work.roots.iterdir():
        os.replace(f, tier.roots / f.name)
