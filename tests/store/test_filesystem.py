"""store.filesystem: shared-filesystem detection and the catalog's journal mode."""

from __future__ import annotations

import sqlite3
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import featbake.store.catalog as catalog_module
from featbake.errors import ConfigError
from featbake.store.catalog import Catalog
from featbake.store.filesystem import (
    FsKind,
    SharedFilesystemWarning,
    detect,
    kind_of,
    mode_from_mounts,
    mount_of,
    parse_mountinfo,
    parse_mounts,
)
from featbake.store.layout import Layout

# Shared-filesystem detection on real mount-table lines, the journal mode, and the create race.

# /proc/self/mountinfo lines in the kernel's format (proc(5)); the local ones are from this
# machine, the cluster ones from NFS, Lustre, GPFS, CIFS and sshfs clients.
MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684096k
31 27 0:45 / /home rw,relatime shared:20 - nfs4 fs01:/export/home rw,vers=4.2,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.5,\
local_lock=none,addr=10.0.0.2
32 27 0:46 / /scratch rw,relatime shared:21 - lustre 10.1.0.1@o2ib:/scratch rw,localflock,\
lazystatfs
33 27 0:47 / /gpfs/projects rw,relatime shared:22 - gpfs projects rw
34 27 0:48 / /mnt/smb\\040share rw,relatime shared:23 - cifs //nas/share rw,vers=3.1.1,\
cache=strict,username=me
35 27 0:49 / /mnt/remote rw,nosuid,nodev,relatime shared:24 - fuse.sshfs me@host:/data \
rw,user_id=1000,group_id=1000
36 31 8:2 / /home/me/local-disk rw,relatime shared:25 - xfs /dev/sdb1 rw,attr2,inode64
"""

MOUNTS = """\
proc /proc proc rw,relatime 0 0
/dev/sda1 / ext4 rw,relatime 0 0
fs01:/export/data /data nfs rw,relatime,vers=3,nolock,proto=tcp 0 0
"""


def test_parse_mountinfo_reads_type_source_and_escaped_points() -> None:
    mounts = {m.mount_point: m for m in parse_mountinfo(MOUNTINFO)}
    assert mounts["/home"].fstype == "nfs4"
    assert mounts["/home"].source == "fs01:/export/home"
    assert mounts["/scratch"].fstype == "lustre" and "localflock" in mounts["/scratch"].options
    assert "/mnt/smb share" in mounts  # \040 is a space
    assert mounts["/mnt/remote"].fstype == "fuse.sshfs"
    assert mounts["/"].fstype == "ext4"


@pytest.mark.parametrize(
    ("path", "kind", "shared"),
    [
        ("/home/me/run/.featbake", FsKind.NFS, True),
        ("/home/me/local-disk/.featbake", FsKind.LOCAL, False),  # a local disk mounted under NFS
        ("/scratch/me/store", FsKind.LUSTRE, True),
        ("/gpfs/projects/x", FsKind.GPFS, True),
        ("/mnt/smb share/x", FsKind.CIFS, True),
        ("/mnt/remote/x", FsKind.FUSE, True),
        ("/tmp/x", FsKind.LOCAL, False),
        ("/homework", FsKind.LOCAL, False),  # a prefix of /home, not inside it
        ("/dev/shm/x", FsKind.LOCAL, False),
    ],
)
def test_the_mount_holding_a_store_decides(path: str, kind: FsKind, shared: bool) -> None:
    mode = mode_from_mounts(path, parse_mountinfo(MOUNTINFO))
    assert (mode.kind, mode.shared) == (kind, shared)
    assert mode.journal_mode == ("DELETE" if shared else "WAL")


def test_node_local_locks_are_called_out() -> None:
    assert "node-local" in mode_from_mounts("/scratch/a", parse_mountinfo(MOUNTINFO)).reason
    nfs3 = mode_from_mounts("/data/a", parse_mounts(MOUNTS))
    assert nfs3.kind is FsKind.NFS and "node-local" in nfs3.reason


def test_proc_mounts_format_and_kinds() -> None:
    mounts = parse_mounts(MOUNTS)
    assert mount_of("/data/x/y", mounts).fstype == "nfs"
    assert mount_of("/etc", mounts).mount_point == "/"
    assert kind_of("fuseblk") is FsKind.FUSE and kind_of("smb3") is FsKind.CIFS
    assert kind_of("overlay") is FsKind.LOCAL and kind_of("ceph") is FsKind.NETWORK
    # This machine's own table parses, and its /tmp is not a shared filesystem.
    assert parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    assert not detect("/tmp", {}).shared


def test_the_environment_forces_the_mode() -> None:
    assert detect("/tmp", {"FEATBAKE_SHARED_FS": "1"}).shared
    assert not detect("/tmp", {"FEATBAKE_SHARED_FS": "0"}).shared
    with pytest.raises(ConfigError, match="FEATBAKE_SHARED_FS"):
        detect("/tmp", {"FEATBAKE_SHARED_FS": "maybe"})


def journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()


def test_on_a_shared_filesystem_the_catalog_is_never_wal_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    layout = Layout(tmp_path / "shared").ensure()
    with pytest.warns(SharedFilesystemWarning, match="journal_mode=DELETE"):
        Catalog(layout).record_encoder("f" * 64, "enc", "torchscript")
    assert journal_mode(layout.catalog) == "delete"
    assert not Path(f"{layout.catalog}-wal").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second connection says nothing more
        Catalog(layout).encoder_rows()

    monkeypatch.setenv("FEATBAKE_SHARED_FS", "0")
    local = Layout(tmp_path / "local").ensure()
    Catalog(local).encoder_rows()
    assert journal_mode(local.catalog) == "wal"


def test_the_cli_says_it_switched_mode_in_one_line(tmp_path: Path, encoder_file: Path) -> None:
    from tests.conftest import invoke

    data = tmp_path / "one"
    from featbake.testing import write_audio_folder

    write_audio_folder(data, 2, seconds=0.3, seed=3)
    store = tmp_path / "s"
    env = {"FEATBAKE_SHARED_FS": "1"}
    done = invoke("build", "-e", encoder_file, "-d", data, "--cache", store, env=env)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "shared filesystem" in line]
    assert len(notes) == 1 and notes[0].startswith("featbake: ") and "WAL" in notes[0]
    assert journal_mode(store / "catalog.sqlite") == "delete"


def test_opening_a_catalog_another_process_is_creating_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The exit-5 race of two ranks on a fresh store: while one process still writes the new
    # catalog in rollback mode, the other's "PRAGMA journal_mode=WAL" fails at once with
    # "database is locked" (SQLite does not call the busy handler there). Now it waits. The
    # verdict needs the journal mode set while the other writer still holds the catalog: a
    # try where this thread got there only after the release (a loaded machine) is tried again.
    real = catalog_module.set_journal_mode
    for attempt in range(5):
        layout = Layout(tmp_path / f"fresh{attempt}").ensure()
        other = sqlite3.connect(layout.catalog, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        other.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        released = threading.Event()
        held_at_entry: list[bool] = []

        def recorded(
            *args: Any,
            _released: threading.Event = released,
            _held: list[bool] = held_at_entry,
            **kw: Any,
        ) -> Any:
            _held.append(not _released.is_set())
            return real(*args, **kw)

        def rollback(_other: sqlite3.Connection = other, _done: threading.Event = released) -> None:
            _other.execute("ROLLBACK")
            _done.set()

        monkeypatch.setattr(catalog_module, "set_journal_mode", recorded)
        release = threading.Timer(0.5, rollback)
        release.start()
        try:
            Catalog(layout, timeout=20).record_encoder("e" * 64, "enc", "torchscript")
        finally:
            release.join()
            other.close()
        assert journal_mode(layout.catalog) == "wal"
        if held_at_entry[0]:
            return
    pytest.fail("the journal mode was never set while the other writer held the catalog")
