"""Claims: the keys a build part still running will name, which gc keeps before any sealed
fragment names them.

A build in parts (``--shard``, ranks) or a build writing fragments on a shared filesystem looks
its keys up in the catalog and reuses what it finds; until its ``done`` fragment is sealed no
fragment names the keys it reused (their rows are the catalog's), so gc, which keeps what sealed
fragments name (``waiting_keys``), saw nothing keeping them. Such a build now writes a *claim*
first, ``<store>/claims/<id>.claim`` (a JSON line: host, pid, owner; then a key a line, new
keys appended), and looks up only then:

- the claim is written under ``claims.lock`` held shared, and gc holds it alone from its last look
  at the claims until its DELETE has committed, so either gc sees the claim, or the build's
  lookup runs after gc's commit and finds the rows gone (and encodes them);
- a heartbeat thread sets the claim's mtime every :data:`HEARTBEAT_S`; the claim is let go
  (removed) once the ``done`` fragment naming the keys is sealed, or when the build ends;
- each claim's name is also logged in ``claims/index`` (appended under ``claims.lock`` held
  shared, one writer at a time by ``claims/index.lock``), and gc reads the names there as well
  as in the folder's listing: an NFS client serves a listing of ``claims/`` from its cache for
  up to ``acdirmax`` (60 s), so a gc on another host could miss a claim just written, while a
  file opened is revalidated (close-to-open consistency). The listing still finds claims
  written by older versions; gc rewrites the index without the claims gone, and so does the
  append that takes it past :data:`INDEX_COMPACT_BYTES` or a doubling of it
  (:func:`compact_index`), so it stays short however many claims come and go. A name is
  written on a line of its own (a newline before it: an append cut short never swallows the
  next name), and a claim made again after it was let go takes a new name (a host that found
  the old one gone may cache that);
- a claim that cannot be written whole, or under ``claims.lock``, is no claim: the cover
  fails, and the failure is kept until the claim is let go, so a caller that went on (a
  serving process: its root is a hint) seals no root of what it looked up.

A claim left by a killed build must not pin its keys forever: it is stale once its process is
gone (same host: ``kill(pid, 0)``) or its heartbeat is older than :data:`STALE_AFTER_S` (another
host, or a pid reused), and gc then ignores it and removes it. A build stopped longer than that
(suspended, a host that slept) finds its claim lapsed before it seals its ``done`` fragment and
refuses in one line (run the part again), since a gc may have deleted what it reused meanwhile.

:func:`claim_state` and :func:`kept_keys` are the pure rules (tested with an injected clock);
the rest is their I/O.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from featbake.errors import StoreError
from featbake.store.files import publish_file, remove_file, write_all
from featbake.store.layout import Layout
from featbake.store.locks import locked

CLAIM_FORMAT = "featbake-claim"
SUFFIX = ".claim"
#: How often a running build refreshes its claim's heartbeat (the claim file's mtime).
HEARTBEAT_S = 60.0
#: A claim whose heartbeat is older than this is stale: 15 missed heartbeats, far more than a
#: busy host delays a thread, and more than the clock skew between hosts of one cluster.
STALE_AFTER_S = 15 * 60.0

Alive = Callable[[int], bool]


class ClaimState(StrEnum):
    """Whether gc honours a claim: ``live``, or stale (its process gone, or its heartbeat)."""

    LIVE = "live"
    DEAD = "its process is gone"
    SILENT = "its heartbeat stopped"


@dataclass(frozen=True)
class ClaimHead:
    """Who holds a claim and its last heartbeat (seconds since the epoch)."""

    host: str
    pid: int
    heartbeat: float


@dataclass(frozen=True)
class Claim:
    """A claim file read whole."""

    path: Path
    head: ClaimHead
    owner: str
    keys: frozenset[str]


def claim_state(head: ClaimHead, now: float, here: str, alive: Alive) -> ClaimState:
    """Whether the claim ``head`` still keeps its keys at time ``now``, read on host ``here``.

    Example:
        >>> head = ClaimHead("a", 7, heartbeat=1000.0)
        >>> claim_state(head, 1060.0, "b", lambda pid: False)  # another host: the heartbeat
        <ClaimState.LIVE: 'live'>
        >>> claim_state(head, 1060.0, "a", lambda pid: False)  # this host, its pid is gone
        <ClaimState.DEAD: 'its process is gone'>
        >>> claim_state(head, 1000.0 + STALE_AFTER_S + 1, "b", lambda pid: True)
        <ClaimState.SILENT: 'its heartbeat stopped'>
    """
    if head.host == here and not alive(head.pid):
        return ClaimState.DEAD
    if now - head.heartbeat > STALE_AFTER_S:
        return ClaimState.SILENT
    return ClaimState.LIVE


def kept_keys(claims: Iterable[Claim], now: float, here: str, alive: Alive) -> set[str]:
    """The keys the live ``claims`` keep at ``now`` (stale ones keep nothing)."""
    kept: set[str] = set()
    for c in claims:
        if claim_state(c.head, now, here, alive) is ClaimState.LIVE:
            kept |= c.keys
    return kept


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal runs too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


@functools.cache
def this_host() -> str:
    """Where this process's pids mean something: the host's name, its boot, and this process's
    pid namespace (``name/boot/pidns``). Two containers sharing a host name (the host's UTS
    namespace, cloned machines) are other hosts to each other: a pid gone from one namespace
    may run in the other, so only the heartbeat judges a claim written there."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    return f"{socket.gethostname()}/{boot}/{namespace}"


def claims_now(layout: Layout) -> float:
    """Now by the store's file system (the clock claims' heartbeats are set by: a file server's
    on NFS), read by touching ``claims.lock``; this host's clock where that cannot be touched
    (a read-only store, no claim ever written). Hosts whose clocks are apart by more than
    :data:`STALE_AFTER_S` then still judge heartbeats alike."""
    lock = claims_lock(layout)
    try:
        os.utime(lock)
        return lock.stat().st_mtime
    except OSError:
        return time.time()


# == I/O ===========================================================================================
def claims_dir(layout: Layout) -> Path:
    """``<store>/claims``: the claims of builds running now."""
    return layout.root / "claims"


def claims_lock(layout: Layout) -> Path:
    """``<store>/claims.lock``: claims are written under it shared; gc holds it alone."""
    return layout.root / "claims.lock"


@contextlib.contextmanager
def claims_held(layout: Layout, *, shared: bool) -> Iterator[None]:
    """Hold ``claims.lock``, shared (a claim written) or alone (gc), or refuse: where the lock
    file cannot be opened for writing, ``locked`` runs unlocked, and a claim written then
    could look up rows a gc's DELETE, already decided, removes.

    Raises:
        StoreError: the lock file cannot be made or opened for writing.
    """
    path = claims_lock(layout)
    with locked(path, shared=shared) as fd:
        if fd is None:
            raise StoreError(
                f"cannot open the store's claims lock {path} for writing, so claims and gc "
                "could not exclude each other; make it a file every user of the store may "
                "write (or remove it while nothing uses the store), then run this again"
            )
        yield


@contextlib.contextmanager
def claims_closed(layout: Layout) -> Iterator[None]:
    """Hold ``claims.lock`` alone: no claim is written meanwhile (gc, from its last look at the
    claims until its DELETE has committed; a build's claim waits that long).

    Raises:
        StoreError: the lock cannot be taken (:func:`claims_held`).
    """
    with claims_held(layout, shared=False):
        yield


def claims_index(layout: Layout) -> Path:
    """``<store>/claims/index``: the name of each claim written, a line each (see above)."""
    return claims_dir(layout) / "index"


def index_lock(layout: Layout) -> Path:
    """``<store>/claims/index.lock``: appends to the index one at a time (two NFS clients
    appending at once may write over each other's line: each appends at the size it knew)."""
    return claims_dir(layout) / "index.lock"


def log_claim(layout: Layout, name: str) -> None:
    """Append claim ``name`` to the index, durable (the caller holds ``claims.lock`` shared).
    The name goes on a line of its own (a newline before it), so an append cut short before
    it (a writer killed, a write short at ENOSPC: no newline at its end) never swallows it;
    the empty lines that leaves are skipped.

    Raises:
        OSError: the append failed.
    """
    claims_dir(layout).mkdir(parents=True, exist_ok=True)
    line = f"\n{name}\n".encode()
    with locked(index_lock(layout)):
        # Every process claiming appends here: the umask decides who else may (a group's store),
        # as for the claims themselves and gc's rewrite of this file (``keep_index``).
        fd = os.open(claims_index(layout), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            before = os.fstat(fd).st_size
            write_all(fd, [line])
            os.fsync(fd)
        finally:
            os.close(fd)
        if compaction_due(before, before + len(line), INDEX_COMPACT_BYTES):
            compact_index(layout)  # still under the index's lock: no append meanwhile


#: ``claims/index`` is compacted (rewritten without the claims gone) by the append that takes
#: it past this size, or past a doubling of it: some 1,600 names, so a gc between the rewrites
#: that gc makes reads at most about twice as many plus the live ones.
INDEX_COMPACT_BYTES = 64 * 1024


def compaction_due(before: int, after: int, limit: int) -> bool:
    """Whether an append taking the index from ``before`` to ``after`` bytes crossed ``limit``
    or a doubling of it (``2 * limit``, ``4 * limit``, ...): an index mostly of live claims
    is looked at again only once it has doubled, so the lookups stay amortized (pure).

    Example:
        >>> [compaction_due(b, b + 40, 64) for b in (0, 40, 80, 100, 180, 240)]
        [False, True, False, True, False, True]
    """
    if after < limit:
        return False
    return before < limit or (after // limit).bit_length() > (before // limit).bit_length()


def compact_index(layout: Layout) -> None:
    """Rewrite the index without the names of claims gone (a claiming process, holding
    ``claims.lock`` shared and the index's lock: no append meanwhile, and gc, which rewrites
    it too, holds ``claims.lock`` alone). A name is dropped only where looking it up finds no
    file: a name is indexed only once its claim is published and never used again
    (:func:`new_claim_path`), so one gone is gone for good, and a cached listing is never
    asked. Best effort, as :func:`keep_index`: an index left as it was is only longer."""
    with contextlib.suppress(OSError):
        names = indexed_names(layout)
        live = {n for n in names if not claim_gone(claims_dir(layout) / n)}
        if live != names:
            rewrite_index(layout, live)


def claim_gone(path: Path) -> bool:
    """Whether the claim file at ``path`` is gone (a lookup says so; any other failure: not
    known to be gone)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def rewrite_index(layout: Layout, names: set[str]) -> None:
    """Publish the index naming ``names`` (whole: a reader sees the old one or this).

    Raises:
        OSError: the rewrite failed (the index is as it was).
    """
    text = "".join(f"{n}\n" for n in sorted(names))
    publish_file(claims_index(layout), lambda p: p.write_text(text), tmp_dir=claims_dir(layout))


def is_claim_name(name: str) -> bool:
    """Whether ``name`` can be a claim's file name (a line of the index cut short cannot)."""
    return name.endswith(SUFFIX) and "/" not in name and name not in ("", SUFFIX)


def indexed_names(layout: Layout) -> set[str]:
    """The claim names the index holds (none while there is no index); a last line without its
    newline is an append cut short, which no claim relied on, and empty lines are skipped.

    Raises:
        OSError: the index exists but cannot be read.
    """
    try:
        text = claims_index(layout).read_text()
    except FileNotFoundError:
        return set()
    return {n for n in text.split("\n")[:-1] if is_claim_name(n)}


def listed_names(layout: Layout) -> set[str]:
    """The claim names in the listing of ``claims/`` (maybe a cached one, on NFS).

    Raises:
        OSError: the folder exists but cannot be listed.
    """
    try:
        return {p.name for p in claims_dir(layout).iterdir() if is_claim_name(p.name)}
    except FileNotFoundError:
        return set()


def claim_paths(layout: Layout) -> list[Path]:
    """Every claim the index or the folder's listing names, sorted.

    Raises:
        StoreError: the folder or its index cannot be read.
    """
    try:
        names = indexed_names(layout) | listed_names(layout)
    except OSError as e:
        raise StoreError(
            f"cannot list the store's claims at {claims_dir(layout)} ({e.strerror or e}); it "
            "must be a folder the store's user can read: move what is there aside, then run "
            "this again"
        ) from e
    return [claims_dir(layout) / n for n in sorted(names)]


def read_claims(layout: Layout, now: float | None = None) -> list[Claim]:
    """Every claim in the store (one gone since it was named: skipped); ``now`` (default: this
    host's clock) judges whether one that cannot be read may be live.

    Raises:
        StoreError: a claim file that cannot be read (not written by featbake: claims are
            published whole) whose mtime says it may be live.
    """
    out = []
    for path in claim_paths(layout):
        claim = _read_claim(path, time.time() if now is None else now)
        if claim is not None:
            out.append(claim)
    return out


def parse_claim(text: str) -> tuple[dict, frozenset[str]]:
    """A claim file's header (JSON, its first line) and keys (one a line after it); a last
    line without its newline is an append cut short, which nothing relied on (pure).

    Example:
        >>> parse_claim('{"format": "featbake-claim"}\\na\\nb\\nc')[1] == {"a", "b"}
        True
    """
    lines = text.split("\n")
    head = json.loads(lines[0])
    if not isinstance(head, dict) or head.get("format") != CLAIM_FORMAT:
        raise ValueError("not a featbake claim")
    return head, frozenset(k for k in lines[1:-1] if k)


def _read_claim(path: Path, now: float) -> Claim | None:
    """The claim at ``path``; None when it went meanwhile or is unreadable but stale at
    ``now``."""
    try:
        mtime = path.stat().st_mtime
        doc, keys = parse_claim(path.read_text())
        head = ClaimHead(str(doc["host"]), int(doc["pid"]), mtime)
        return Claim(path, head, str(doc.get("owner", "")), keys)
    except FileNotFoundError:
        return None  # let go since the listing
    except (OSError, ValueError, KeyError, TypeError) as e:
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > STALE_AFTER_S:
                return None
        raise StoreError(
            f"the claim {path} is unreadable ({e}), so gc cannot know what a running build "
            "reuses; if no build is running into this store, remove it, then run gc again"
        ) from e


def claimed_keys(layout: Layout, now: float | None = None, *, drop_stale: bool = False) -> set[str]:
    """The keys live claims keep (gc keeps their rows); ``drop_stale``: remove stale claims
    (gc, holding :func:`claims_closed`: a killed build's claim is cleared away)."""
    now = claims_now(layout) if now is None else now
    here = this_host()
    claims = read_claims(layout, now)
    if drop_stale:
        live = []
        for c in claims:
            if claim_state(c.head, now, here, pid_alive) is ClaimState.LIVE:
                live.append(c)
            else:
                remove_file(c.path)
        drop_cut_writes(layout, now)
        keep_index(layout, {c.path.name for c in live})
    return kept_keys(claims, now, here, pid_alive)


def keep_index(layout: Layout, live: set[str]) -> None:
    """Rewrite the index to name only the ``live`` claims, if it names others (gc, holding
    :func:`claims_closed`: no claim is logged meanwhile). Best effort: an index left as it was
    only names claims gone, which are skipped."""
    with contextlib.suppress(OSError):
        if indexed_names(layout) - live:
            rewrite_index(layout, live)


def drop_cut_writes(layout: Layout, now: float) -> None:
    """Remove the temporary files of claims whose writer was killed mid-write (``*.part`` in
    ``claims/``) once older than :data:`STALE_AFTER_S`: no claim names them."""
    with contextlib.suppress(OSError):
        for path in claims_dir(layout).glob("*.part"):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > STALE_AFTER_S:
                    path.unlink()


def new_claim_path(layout: Layout) -> Path:
    """A name no claim had before: a host that looked up a claim let go may keep finding that
    name gone (an NFS client's negative lookup entry, until the folder's cached attributes
    expire), so a claim made again never reuses it."""
    return claims_dir(layout) / f"{uuid.uuid4().hex}{SUFFIX}"


class ClaimFile:
    """The claim of one build part: the keys it will name, written before it relies on them,
    its heartbeat kept by a daemon thread, let go once a sealed fragment names them.

    Args:
        layout: the store.
        owner: what holds it (a build id, a part), for a person reading the folder.
        clock: wall time for the heartbeat (a test's own clock); None: the file system's own
            (the file server's on NFS), so a host whose clock is behind is not taken as silent.
        monotonic: elapsed time, to find a heartbeat that lapsed (a stopped process).
        heartbeat_s: how often the heartbeat thread runs.
    """

    def __init__(
        self,
        layout: Layout,
        owner: str,
        *,
        clock: Callable[[], float] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.layout, self.owner = layout, owner
        self.path = new_claim_path(layout)
        self.keys: set[str] = set()
        self._clock, self._monotonic, self._every = clock, monotonic, heartbeat_s
        self._last_beat: float | None = None
        self._lapsed = False
        # A cover failed: keys the caller went on to look up are unclaimed (a serving process
        # goes on: its root is a hint), so a fragment must not name them as a root's.
        self._unwritten = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def cover(self, keys: Sequence[str]) -> None:
        """Claim ``keys`` too (the file rewritten with them) before the caller looks them up.

        Raises:
            StoreError: the claim could not be written (the build cannot rely on what it finds).
        """
        with self._lock:
            new = set(keys) - self.keys
            if not new:
                return
            try:
                with claims_held(self.layout, shared=True):  # waits while a gc deletes
                    self._write(sorted(new))
            except StoreError:
                self._unwritten = True  # a caller going on unclaimed learns it at its seal
                raise
            self.keys |= new
            self._last_beat = self._monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._beating, name="claim", daemon=True)
            self._thread.start()

    def _write(self, keys: list[str]) -> None:
        """Publish the claim with ``keys``, or append them to it (each key written once: a
        part's engine worker claims task after task), durable before the caller looks up."""
        lines = "".join(f"{k}\n" for k in keys)
        try:
            if self.keys:
                self._append(lines)
                return
            doc = {"format": CLAIM_FORMAT, "host": this_host(), "pid": os.getpid(),
                   "owner": self.owner}  # fmt: skip
            text = json.dumps(doc) + "\n" + lines
            publish_file(self.path, lambda p: p.write_text(text), tmp_dir=claims_dir(self.layout))
            try:
                log_claim(self.layout, self.path.name)  # what gc reads, whatever NFS lists
            except OSError:
                remove_file(self.path)  # not claimed: no claim left behind
                raise
        except OSError as e:
            raise StoreError(
                f"could not write the claim {self.path} ({e.strerror or e}); check that the "
                "store is writable and has space, then run the build again"
            ) from e

    def _append(self, lines: str) -> None:
        """Append ``lines`` to the claim published, never making it anew: a claim gone (a gc
        found it stale) has lapsed, and a file of keys without its header would stop every gc.

        Raises:
            StoreError: the claim is gone (:meth:`lapsed_error`).
            OSError: the write failed.
        """
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            self._lapsed = True
            raise self.lapsed_error() from None
        try:
            write_all(fd, [lines.encode()])
            os.fsync(fd)
        finally:
            os.close(fd)

    def lapsed_error(self) -> StoreError:
        """The one line for a claim that lapsed: what a gc may have done, and what to do."""
        return StoreError(
            f"this build part's claim on the stored features it reuses lapsed (a gc found it "
            f"stale: the process was stopped for over {STALE_AFTER_S / 60:.0f} minutes, or its "
            "heartbeats stopped reaching the store), so a gc may have deleted them; run this "
            "part again: it encodes whatever is gone"
        )

    def unwritten_error(self) -> StoreError:
        """The one line for a claim that could not be written: the keys looked up after it were
        never claimed, so a gc may have deleted them."""
        return StoreError(
            f"the claim {self.path} on the stored features this process reuses could not be "
            "written, so a gc may have deleted them; check that the store's claims/ folder and "
            "its index are writable by this user and the store has space, then run it again"
        )

    def beat(self) -> None:
        """Refresh the heartbeat; a beat later than :data:`STALE_AFTER_S` after the last one
        (the process was stopped) or a claim removed meanwhile (a gc found it stale) lapses it."""
        with self._lock:
            if self._last_beat is None:
                return
            now = self._monotonic()
            if now - self._last_beat > STALE_AFTER_S:
                self._lapsed = True
            self._last_beat = now
            try:
                if self._clock is None:
                    os.utime(self.path)  # now, by the file system's clock
                else:
                    t = self._clock()
                    os.utime(self.path, (t, t))
            except OSError:
                self._lapsed = True

    def _beating(self) -> None:
        while not self._stop.wait(self._every):
            self.beat()

    def check_held(self) -> None:
        """Raise if the claim lapsed, before the caller seals a fragment naming its keys.

        Raises:
            StoreError: the heartbeat stopped for longer than a gc honours it (the process was
                stopped or suspended), or a cover failed (the claim, or its line in the index,
                could not be written), so what this part reused may be gone.
        """
        self.beat()
        if self._lapsed:
            raise self.lapsed_error()
        if self._unwritten:
            raise self.unwritten_error()

    def release(self) -> None:
        """Let the claim go (its keys named by a sealed fragment, or the build ended)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._last_beat = None
            if self.keys:
                remove_file(self.path)
            self.path = new_claim_path(self.layout)  # never a name a host found gone (above)
            self.keys, self._lapsed, self._unwritten = set(), False, False  # claims afresh
            self._stop, self._thread = threading.Event(), None
