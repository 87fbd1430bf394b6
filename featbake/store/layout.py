"""Where things live inside a store directory, and the file primitives every writer uses."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import sqlite3
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Generic, NamedTuple, Protocol, TypeVar

from featbake.errors import ConfigError, StoreCorrupt, StoreError
from featbake.store.url import is_url

# == layout ========================================================================================
#: A shard's name: the SHA-256 of its bytes, in hex. Nothing else is ever followed to a path or
#: an object key, whatever a catalog, fragment or listing says.
_SHARD_NAME = re.compile(r"^[0-9a-f]{64}$")
#: A root's name as a file name: one path component, no leading dot.
_ROOT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,250}$")


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is a shard name (64 lowercase hex digits).

    Example:
        >>> is_shard_name("ab" * 32), is_shard_name("../../victim/model")
        (True, False)
    """
    return isinstance(name, str) and _SHARD_NAME.match(name) is not None


def checked_shard_name(name: str) -> str:
    """``name``, once it is a shard name.

    Raises:
        StoreCorrupt: it is not one: a catalog, fragment or listing naming it was damaged or
            planted, and nothing it names is opened, fetched or deleted.
    """
    if not is_shard_name(name):
        raise StoreCorrupt(
            f"{name[:100]!r} is not a shard name (64 hex digits): the catalog or fragment naming "
            "it is damaged or was tampered with; nothing it names is touched. Run `featbake "
            "verify` on the store"
        )
    return name


def checked_root_name(name: str) -> str:
    """``name``, once it can name a file in ``roots/`` (one path component, no leading dot).

    Raises:
        StoreCorrupt: it cannot (a damaged or planted catalog row or manifest).
    """
    if not (isinstance(name, str) and _ROOT_NAME.match(name) and ".." not in name):
        raise StoreCorrupt(
            f"{str(name)[:100]!r} is not a root name: the catalog or manifest naming it is "
            "damaged or was tampered with; nothing it names is touched. Run `featbake verify`"
        )
    return name


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_file(
    final: Path, write: Callable[[Path], object], *, tmp_dir: Path, durable: bool = True
) -> None:
    """Write a file whole, then make it appear at ``final`` at once: ``write`` fills a unique
    temporary file in ``tmp_dir`` (same filesystem), which is fsynced (``durable``), renamed
    over ``final`` and its folder fsynced. A reader sees the old file or the new, never half of
    one; a crash leaves at most a temporary file (gc removes ``tmp/`` leftovers). The one
    write-then-publish of small store files (manifests, fidelity records, the tier's marks,
    downloaded fragments); shards and fragments being sealed have their own, streamed.

    Raises:
        OSError: the write or the rename failed (the temporary file is removed).
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.part"
    try:
        write(tmp)
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(final.parent)


class TierUsage(NamedTuple):
    """A node's tier of a bucket store: which catalog version it holds, its bytes and budget."""

    version: int
    bytes: int
    budget: int


# == place =========================================================================================
# Where a store's shards, fragments and catalog last: a local directory
# (:class:`featbake.store.open.LocalPlace`), or a bucket seen through this node's tier
# (:class:`featbake.store.bucket.BucketStore`), both a :class:`featbake.store.place.Place`.
# Upkeep runs one algorithm over either: gc plans, commits its catalog change through
# ``Place.commit``, then sweeps what the place holds that nothing names (:func:`unnamed_past`,
# one rule with the place's age); verify reads what the place names; repair runs where the
# place allows it.
T = TypeVar("T")


@dataclass
class Change(Generic[T]):
    """What a catalog change made of its copy: its report, whether the catalog changed (else
    nothing is published), and what to do once the change is committed."""

    value: T
    changed: bool
    after_publish: Callable[[], None] | None = None


class Held(NamedTuple):
    """Something a place holds that gc may sweep: how the place names it (a file's path, an
    object's name), its bytes, and its last change (epoch s)."""

    name: str
    size: int
    modified: float


@dataclass(frozen=True)
class Sweep:
    """What gc's sweep deletes from a place, in this order: unnamed shards past the place's
    age, leftovers of interrupted writes, catalog versions retired for longer than the age; and
    how many unnamed shards are still younger (kept).

    ``age`` names the period ("grace period" for a directory, "retention period" for a
    bucket); ``versioned``: the place keeps numbered catalog versions."""

    shards: tuple[Held, ...] = ()
    loose: tuple[Held, ...] = ()
    versions: tuple[Held, ...] = ()
    young_shards: int = 0
    age: str = "grace period"
    versioned: bool = False

    @property
    def bytes(self) -> int:
        return sum(h.size for h in (*self.shards, *self.loose, *self.versions))

    @property
    def empty(self) -> bool:
        return not (self.shards or self.loose or self.versions)


class Swept(NamedTuple):
    """What a sweep deleted: shards, leftovers, catalog versions, and their bytes."""

    shards: int = 0
    loose: int = 0
    versions: int = 0
    bytes: int = 0


def unnamed_past(
    held: Iterable[Held],
    shard: Callable[[str], str],
    named: AbstractSet[str],
    now: float,
    age: float,
) -> tuple[list[Held], int]:
    """gc's one rule for a place's shards: one that no kept catalog (version) and no pending
    fragment names goes once older than ``age``: the grace period in a directory, the retention
    period in a bucket (a build writes a shard before anything names it). ``shard`` turns a
    held name into its shard name. Returns (what goes, how many unnamed ones are younger).

    Example:
        >>> held = [Held("a", 1, 0.0), Held("b", 1, 90.0), Held("c", 1, 0.0)]
        >>> unnamed_past(held, str, {"c"}, now=100.0, age=50.0)
        ([Held(name='a', size=1, modified=0.0)], 1)
    """
    unnamed = [h for h in held if shard(h.name) not in named]
    doomed = [h for h in unnamed if now - h.modified >= age]
    return doomed, len(unnamed) - len(doomed)


@dataclass(frozen=True)
class LooseFile:
    """A file in the store that the catalog does not name (an orphan shard, a tmp leftover)."""

    path: Path
    bytes: int
    mtime: float


@dataclass(frozen=True)
class FolderListing:
    """Regular files matching a pattern, and the other things found there (links, FIFOs)."""

    files: tuple[LooseFile, ...]
    special: tuple[Path, ...]  # paths that are not regular files: never read, never followed


def list_folder(folder: Path, pattern: str) -> FolderListing:
    """What matches ``pattern`` in ``folder``, by ``lstat`` (a symlink loop or a FIFO is listed
    as special, never opened: opening a FIFO would hang, following a loop would raise)."""
    files, special = [], []
    if folder.is_dir():
        for p in sorted(folder.glob(pattern)):
            try:
                st = os.lstat(p)
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISREG(st.st_mode):
                files.append(LooseFile(p, st.st_size, st.st_mtime))
            elif not stat.S_ISDIR(st.st_mode):
                special.append(p)
    return FolderListing(tuple(files), tuple(special))


def shard_name(path: Path) -> str:
    """The shard name a ``shards/ab/<name>.safetensors`` path gives."""
    return path.name.removesuffix(".safetensors")


def shard_files(layout: Layout) -> dict[str, LooseFile]:
    """shard name -> file, for every regular ``shards/ab/<name>.safetensors``."""
    return {shard_name(f.path): f for f in list_folder(layout.shards, "*/*.safetensors").files}


class VerifyScope(StrEnum):
    """What ``featbake verify`` reads of a place."""

    FOLDER = "folder"  # every file of the store folder, its catalog, roots and hash cache
    NAMED_SHARDS = "named-shards"  # the place's own bytes of every shard the catalog names


class Remote(Protocol):
    """What a layout and the store's writers know of a bucket the layout is the local tier of:
    its name, whether it holds a shard, and where a sealed fragment goes. The whole place, for
    code above the layout, is :func:`featbake.store.open.place_of` (a
    :class:`featbake.store.place.Place`)."""

    def has_shard(self, name: str) -> bool:
        """Whether the bucket holds shard ``name``."""
        ...

    def publish_fragment(self, fragment: Path, shards: Sequence[str]) -> None:
        """Upload a sealed fragment after the shards it names."""
        ...


@dataclass(frozen=True)
class Layout:
    """Where things live inside a cache directory.

    ``remote`` is set when the store is a bucket: this directory is then its local tier, and
    shards missing here are fetched from ``remote`` (see :mod:`featbake.store.bucket`).
    """

    root: Path
    remote: Remote | None = field(default=None, compare=False, repr=False)

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.sqlite"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def roots(self) -> Path:
        """``<store>/roots``: a JSON manifest per root, so roots survive the loss of the catalog."""
        return self.root / "roots"

    def has_root_manifests(self) -> bool:
        """True if ``roots/`` holds a manifest: a catalog existed (they are written with it)."""
        try:
            with os.scandir(self.roots) as it:
                return any(e.name.endswith(".json") for e in it)
        except OSError:
            return False

    def refuse_fresh_catalog(self, *, allow: bool = False) -> None:
        """Raise instead of starting a new, empty catalog beside the surviving root manifests.

        Root manifests are written only together with catalog rows, so manifests without a
        catalog mean it was deleted or lost: a fresh one would re-encode everything and leave
        the intact shards orphaned. ``verify --repair`` rebuilds it from the shards
        (``allow=True`` is how it says so).

        Raises:
            StoreError: the catalog is missing but root manifests are not.
        """
        if not allow and not self.catalog.exists() and self.has_root_manifests():
            raise StoreError(
                f"the store {self.root} has root manifests (roots/*.json) but no catalog.sqlite "
                "(deleted or lost); run `featbake verify --repair` to rebuild it from them, "
                "then run this again (a new, empty catalog would re-encode everything; to start "
                "over, delete the store folder)"
            )

    def shard_path(self, name: str) -> Path:
        """``shards/ab/<name>.safetensors`` for a shard named ``ab...``.

        Raises:
            StoreCorrupt: ``name`` is not a shard name (:func:`checked_shard_name`).
        """
        checked_shard_name(name)
        return self.shards / name[:2] / f"{name}.safetensors"

    def has_shard(self, name: str) -> bool:
        """Whether the store holds shard ``name``: its file here, else (a bucket store) there."""
        if self.shard_path(name).is_file():
            return True
        return self.remote is not None and self.remote.has_shard(name)

    def describe(self) -> str:
        """How messages name the store: its bucket URL (never the tier folder), or its
        directory."""
        return str(self.remote) if self.remote is not None else str(self.root.absolute())

    def ensure(self) -> Layout:
        """Create the directories, or raise a StoreError that says why it could not."""
        try:
            for d in (self.root, self.shards, self.tmp):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the cache directory {self.root}: {e.strerror}; "
                "choose a writable place with --cache DIR or $FEATBAKE_CACHE"
            ) from e
        return self


def remove_file(path: Path) -> int:
    """Remove a file; its size in bytes, or 0 if it was already gone."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def layout_at(cache: str | os.PathLike[str] | None) -> Layout:
    """The layout of the store in directory ``cache`` (``$FEATBAKE_CACHE``, else ``./.featbake``,
    for None); nothing is created.

    Raises:
        ConfigError: ``cache`` is a URL (``s3://...``): bucket stores are opened by
            :func:`featbake.store.open.open_store`, and a URL read as a path would make a local
            folder named ``s3:``.

    Example:
        >>> layout_at("/data/features").root
        PosixPath('/data/features')
    """
    where = os.fspath(cache) if cache is not None else os.environ.get("FEATBAKE_CACHE")
    where = where or ".featbake"
    if is_url(where):
        raise ConfigError(
            f"{where!r} is a bucket URL, and this needs a store directory; pass a directory, or "
            "open the bucket store with featbake.store.open.open_store (CachedEncoder, "
            "CachedFeatureDataset and the featbake commands take --cache s3://... as it is)"
        )
    return Layout(Path(where))


# == filesystem ====================================================================================
# Is the store on a shared (network or FUSE) filesystem, and which SQLite journal mode is safe.
#
# SQLite's WAL mode keeps its index in shared memory, which only works between processes of one
# host: "WAL does not work over a network filesystem" (sqlite.org/wal.html). fcntl locks are also
# broken on many NFS setups, and Lustre mounted with ``localflock`` makes locks node-local, which
# has corrupted databases across nodes. So on NFS, Lustre, GPFS, CIFS/SMB and FUSE mounts the
# catalog uses the rollback journal (``journal_mode=DELETE``), rank builds never write it (they
# write fragments that one ``featbake merge`` folds in), and readers open it read-only.
#
# Detection reads the mount table (``/proc/self/mountinfo``, else ``/proc/mounts``) and takes the
# longest mount point that contains the store. ``FEATBAKE_SHARED_FS=1`` or ``=0`` forces the mode
# (for tests, and for a filesystem the table does not tell about). The parsers are pure.
ENV_VAR = "FEATBAKE_SHARED_FS"


class FsKind(StrEnum):
    """The families of filesystems featbake tells apart."""

    LOCAL = "local"
    NFS = "NFS"
    LUSTRE = "Lustre"
    GPFS = "GPFS"
    CIFS = "CIFS/SMB"
    FUSE = "FUSE"
    NETWORK = "network"  # other cluster filesystems: CephFS, BeeGFS, WekaFS, AFS, 9p, ...


_KINDS: dict[str, FsKind] = {
    "nfs": FsKind.NFS,
    "nfs4": FsKind.NFS,
    "lustre": FsKind.LUSTRE,
    "gpfs": FsKind.GPFS,
    "cifs": FsKind.CIFS,
    "smb3": FsKind.CIFS,
    "smbfs": FsKind.CIFS,
    "ceph": FsKind.NETWORK,
    "beegfs": FsKind.NETWORK,
    "wekafs": FsKind.NETWORK,
    "afs": FsKind.NETWORK,
    "9p": FsKind.NETWORK,
    "glusterfs": FsKind.NETWORK,
    "ocfs2": FsKind.NETWORK,
    "gfs2": FsKind.NETWORK,
}


class SharedFilesystemWarning(UserWarning):
    """featbake switched the catalog to its shared-filesystem mode (said once per store)."""


@dataclass(frozen=True)
class Mount:
    """One line of the mount table: where, what type, from where, with which options."""

    mount_point: str
    fstype: str
    source: str
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class FsMode:
    """How featbake treats a store: shared or not, why, and the catalog's journal mode."""

    shared: bool
    kind: FsKind
    reason: str

    @property
    def journal_mode(self) -> str:
        return "DELETE" if self.shared else "WAL"


def _unescape(field: str) -> str:
    r"""The kernel writes space, tab, newline and backslash in mount paths as ``\040`` etc."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts from ``/proc/self/mountinfo`` (``id parent dev root point opts - type src super``).

    Example:
        >>> line = ("36 25 0:32 / /mnt/data rw,relatime shared:1 - nfs4 srv:/export "
        ...         "rw,vers=4.2")
        >>> parse_mountinfo(line)[0].fstype
        'nfs4'
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        options = tuple(fields[5].split(",")) + tuple(fields[sep + 3].split(",")[:64])
        mounts.append(
            Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]), options)
        )
    return mounts


def parse_mounts(text: str) -> list[Mount]:
    """Mounts from ``/proc/mounts`` or ``/etc/mtab`` (``source point type opts freq pass``).

    Example:
        >>> parse_mounts("lustre@tcp:/scratch /scratch lustre rw,localflock 0 0")[0].options
        ('rw', 'localflock')
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            point, source = _unescape(fields[1]), _unescape(fields[0])
            mounts.append(Mount(point, fields[2], source, tuple(fields[3].split(","))))
    return mounts


def kind_of(fstype: str) -> FsKind:
    """The family of a mount type: ``nfs4`` -> NFS, ``fuse.sshfs`` -> FUSE, ``ext4`` -> local."""
    base = fstype.lower()
    if base.startswith("fuse") or base == "virtiofs":
        return FsKind.FUSE
    return _KINDS.get(base, FsKind.LOCAL)


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding ``path`` (absolute, resolved): the longest mount point above it."""
    best: Mount | None = None
    for m in mounts:
        point = m.mount_point.rstrip("/") or "/"
        inside = path == point or path.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = m  # a later mount over the same point hides the earlier one
    return best


def mode_from_mounts(path: str, mounts: list[Mount]) -> FsMode:
    """Shared or local, from the mount that holds ``path``."""
    m = mount_of(path, mounts)
    if m is None:
        return FsMode(False, FsKind.LOCAL, "its mount is not in the mount table")
    kind = kind_of(m.fstype)
    if kind is FsKind.LOCAL:
        return FsMode(False, kind, f"{m.mount_point} is {m.fstype}")
    locks = ""
    if {"localflock", "nolock", "local_lock=all", "local_lock=flock"} & set(m.options):
        locks = "; its locks are node-local, so merge only while no other node reads the store"
    return FsMode(True, kind, f"{m.mount_point} is {m.fstype} ({kind.value}){locks}")


def _forced(env: Mapping[str, str]) -> FsMode | None:
    value = env.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes"):
        return FsMode(True, FsKind.NETWORK, f"${ENV_VAR}={env[ENV_VAR]}")
    if value in ("0", "false", "no"):
        return FsMode(False, FsKind.LOCAL, f"${ENV_VAR}={env[ENV_VAR]}")
    raise ConfigError(f"${ENV_VAR}={env[ENV_VAR]!r}: use 1 (shared), 0 (local) or auto")


def _mount_table() -> list[Mount]:
    for path, parse in (("/proc/self/mountinfo", parse_mountinfo), ("/proc/mounts", parse_mounts)):
        try:
            return parse(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return []


def detect(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> FsMode:
    """How featbake should treat a store at ``path`` (forced by ``$FEATBAKE_SHARED_FS``).

    Example:
        >>> detect("/tmp", {"FEATBAKE_SHARED_FS": "1"}).journal_mode
        'DELETE'
    """
    forced = _forced(os.environ if env is None else env)
    if forced is not None:
        return forced
    return mode_from_mounts(os.path.realpath(path), _mount_table())


_ANNOUNCED: set[str] = set()


def set_journal_mode(conn: sqlite3.Connection, path: Path, timeout: float) -> FsMode:
    """The catalog's hook: set the journal mode this store's filesystem allows, and say so once.

    Changing the journal mode needs an exclusive lock and SQLite does not call the busy handler
    for it: two processes opening a new catalog at once got "database is locked" here (a 2-rank
    build failed with exit 5). So this retries until ``timeout``.

    Raises:
        StoreError: the mode could not be set within ``timeout``.
    """
    mode = detect(path.parent)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute(f"PRAGMA journal_mode={mode.journal_mode}")
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise StoreError(
                    f"the catalog {path} stayed locked for {timeout:.0f}s while opening it; "
                    "another featbake process holds it; retry when it is done"
                ) from e
            time.sleep(0.02)
    if mode.shared:
        announce(
            str(path),
            f"the store {path.parent} is on a shared filesystem ({mode.reason}): the catalog "
            "uses journal_mode=DELETE instead of WAL, which SQLite does not support across hosts",
        )
    return mode


def announce(what: str, message: str) -> None:
    """Say ``message`` as a :class:`SharedFilesystemWarning`, once per ``what`` per process."""
    if what not in _ANNOUNCED:
        _ANNOUNCED.add(what)
        warnings.warn(message, SharedFilesystemWarning, stacklevel=3)


# == locks =========================================================================================
# The store's advisory write lock: writers share it, ``verify --repair`` takes it alone.
#
# A shard writer holds the lock *shared* while it seals a shard and commits its catalog rows; repair
# holds it *exclusive* for its whole scan-and-fix. Repair therefore never sees a shard file whose
# rows are about to be committed (and forgets them as "missing"), and a writer that seals while
# repair runs waits until repair has finished. The lock is ``flock(2)`` on ``<store>/write.lock``:
# the kernel drops it when its holder dies, so a killed build never leaves the store locked.
#
# On shared filesystems: Linux emulates ``flock`` on NFS (and on CIFS since 5.5) with byte-range
# locks on the whole file, so it spans hosts where the server's locking works; Lustre mounted with
# ``-o flock`` spans hosts, ``localflock`` (and NFS ``local_lock``) only one node, and a Lustre
# mount with neither fails every ``flock`` with ENOSYS, as NFS without a lock daemon does with
# ENOLCK. There the lock is skipped rather than failing every write: it only keeps repair away
# from writers, and on a shared filesystem repair is run while nothing else uses the store.
# Shards themselves need no lock: each is written under a unique temporary name and renamed to
# its content name, which is atomic on every one of these filesystems.
#: How long repair waits for writers that are sealing a shard right now before it refuses.
EXCLUSIVE_WAIT_S = 10.0

#: ``flock`` errors that mean "no locks on this filesystem", not "someone holds the lock".
_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


def lock_path(layout: Layout) -> Path:
    """``<store>/write.lock``: the file writers and repair ``flock``."""
    return layout.root / "write.lock"


def open_lock_file(path: Path) -> int | None:
    """A lock file's descriptor (created if missing); None where it cannot be created."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None


@contextlib.contextmanager
def locked(path: Path, *, shared: bool = False, wait: float | None = None) -> Iterator[int | None]:
    """``flock`` on the file at ``path`` (created), shared or alone, held for the block: the one
    lock primitive (the store's write lock, the tier's budget, its downloads and its catalog).

    ``wait`` None blocks until the lock is free; a number tries for that many seconds, then
    raises :class:`TimeoutError`. The kernel drops the lock when its holder dies. A filesystem
    without locks (see above) is run unlocked; a file that cannot be created yields None (the
    caller decides whether that is an error).
    """
    fd = open_lock_file(path)
    if fd is None:
        yield None
        return
    op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        if wait is None:
            _flock(fd, op)
        else:
            deadline = time.monotonic() + wait
            while True:
                try:
                    _flock(fd, op | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"{path} is held by another process") from None
                    time.sleep(0.05)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def shared_write_lock(layout: Layout) -> Iterator[None]:
    """Hold the store's lock shared (a writer sealing a shard); waits while repair runs.

    A store where the lock file cannot be created is not writable either: the write that follows
    fails with its own clear error, so this does not add one.
    """
    with locked(lock_path(layout), shared=True):
        yield


def _flock(fd: int, op: int) -> None:
    """``flock(fd, op)``, or nothing where the filesystem has no locks (see the module doc)."""
    try:
        fcntl.flock(fd, op)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise


@contextlib.contextmanager
def exclusive_write_lock(layout: Layout, wait_s: float | None = None) -> Iterator[None]:
    """Hold the store's lock alone (``verify --repair``), or refuse if writers keep it.

    Raises:
        StoreError: a build, gc or a training loop's write-back is sealing shards into the store
            and did not stop within ``wait_s`` seconds (default :data:`EXCLUSIVE_WAIT_S`); or
            the lock file cannot be created.
    """
    wait = EXCLUSIVE_WAIT_S if wait_s is None else wait_s
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(locked(lock_path(layout), wait=wait))
        except TimeoutError:
            raise StoreError(
                f"a build, gc or write-back is writing shards into {layout.root}; run "
                "`featbake verify --repair` again once it has finished"
            ) from None
        if fd is None:
            raise StoreError(
                f"cannot create {lock_path(layout)}: the store is not writable, so it cannot be "
                "repaired; run `featbake verify` without --repair to check it"
            )
        yield
