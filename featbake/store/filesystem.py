"""Is a store on a shared (network or FUSE) filesystem, and which SQLite journal mode is safe
there (why: the comment below); the mount-table parsers are pure."""

from __future__ import annotations

import os
import sqlite3
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from featbake.errors import ConfigError, StoreError

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
