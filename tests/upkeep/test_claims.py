"""gc and the builds still running that will name what it would delete (round seven, upkeep)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from featbake.bake.pipeline import build
from featbake.errors import StoreError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store import claims, fragment_catalog
from featbake.store.catalog import Catalog
from featbake.store.claims import (
    CLAIM_FORMAT,
    STALE_AFTER_S,
    Claim,
    ClaimFile,
    ClaimHead,
    ClaimState,
    claim_state,
    claimed_keys,
    claims_dir,
    claims_now,
    kept_keys,
    read_claims,
    this_host,
)
from featbake.store.filesystem import SharedFilesystemWarning
from featbake.store.fragment_catalog import FragmentCatalog
from featbake.store.fragments import FragmentKind, Use
from featbake.store.layout import Layout
from featbake.store.merge import merge
from featbake.store.roots import RootSpec
from featbake.upkeep import GcOptions, drop_root, execute_gc, plan_gc, verify
from tests.conftest import invoke
from tests.helpers import Live, age, assert_serves, bake, manifest

#: gc as eager as it can be: no grace for unnamed shards, no retention.
EAGER = GcOptions(grace=0.0, retention=0.0)


def test_gc_keeps_what_a_build_part_still_running_reused(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose root was dropped (its 16 features stored, no root reaching them), built
    again in two parts. Part 0/2 finds its features stored and reuses them; it is held just
    before it seals its ``done`` fragment (its lookups all made, nothing sealed naming the
    keys), and a gc runs then. Before, gc saw no sealed fragment naming them and deleted
    their rows: the merge published a root with part 0's items missing."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    sealing = FragmentCatalog.finish
    deleted: list[int] = []

    def gc_then_finish(self: FragmentCatalog) -> str | None:
        if self.part is not None and self.part.rank == 0 and not deleted:
            deleted.append(execute_gc(plan_gc(store, EAGER)).rows_deleted)
        return sealing(self)

    monkeypatch.setattr(FragmentCatalog, "finish", gc_then_finish)
    part0 = build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")
    assert part0.encoded == 0 and part0.reused > 0  # it relied on what was stored
    assert deleted == [16 - part0.reused]  # the rows only part 1 will name went, no others
    monkeypatch.setattr(FragmentCatalog, "finish", sealing)
    part1 = build(audio_dir, encoder_file, cache=store, workers=0, shard="1/2")
    assert part1.encoded == 16 - part0.reused  # gc freed them: encoded again

    assert read_claims(Layout(store)) == []  # each part let its claim go once sealed
    assert merge(Layout(store)).roots == [first.root]
    assert verify(store).status == "clean"
    assert assert_serves(store, first.root, audio_dir, encoder_file, Live()) == 16


# == the rules: pure, with an injected clock ==================================================
times = st.floats(min_value=0, max_value=1e9, allow_nan=False)
hosts = st.sampled_from(["a", "b"])


@given(hosts, st.booleans(), times, times, hosts)
def test_a_claim_is_live_until_its_process_is_gone_or_its_heartbeat_stops(
    host: str, alive: bool, heartbeat: float, later: float, here: str
) -> None:
    head = ClaimHead(host, 7, heartbeat)
    now = heartbeat + later
    state = claim_state(head, now, here, lambda pid: alive)
    if host == here and not alive:
        assert state is ClaimState.DEAD  # on its own host a dead pid is seen at once
    else:
        assert (state is ClaimState.LIVE) == (later <= STALE_AFTER_S)
    if state is not ClaimState.LIVE:  # stale stays stale: a later gc never revives it
        assert claim_state(head, now + 1.0, here, lambda pid: alive) is not ClaimState.LIVE


keys = st.frozensets(st.sampled_from("abcdef"), max_size=4)


@given(st.lists(st.tuples(keys, times, st.booleans()), max_size=6), times)
def test_the_kept_keys_are_those_of_live_claims(
    claims: list[tuple[frozenset[str], float, bool]], now: float
) -> None:
    made = [
        Claim(Path(f"{i}.claim"), ClaimHead("a", i, beat), "", named)
        for i, (named, beat, _) in enumerate(claims)
    ]
    dead = {i for i, (_, _, alive) in enumerate(claims) if not alive}
    kept = kept_keys(made, now, "a", lambda pid: pid not in dead)
    model: set[str] = set()
    for i, (named, beat, _) in enumerate(claims):
        if i not in dead and now - beat <= STALE_AFTER_S:
            model |= named
    assert kept == model


def test_a_part_stopped_longer_than_a_claim_holds_refuses_to_seal_in_one_line(
    tmp_path: Path,
) -> None:
    """A process stopped (SIGSTOP, a host asleep) past the stale rule: a gc may have taken
    what it reused, so it says to run the part again instead of naming keys maybe gone."""
    ticks = [0.0]
    claim = ClaimFile(Layout(tmp_path), "part 0/2", monotonic=lambda: ticks[0])
    claim.cover(["k1", "k2"])
    claim.check_held()  # just written: held
    ticks[0] += STALE_AFTER_S + 1.0
    with pytest.raises(StoreError, match="run this part again") as e:
        claim.check_held()
    assert "\n" not in str(e.value)
    claim.release()
    assert read_claims(Layout(tmp_path)) == []
    claim.cover(["k3"])  # claimed afresh after its release
    assert [c.keys for c in read_claims(Layout(tmp_path))] == [frozenset({"k3"})]
    claim.check_held()
    claim.release()


# == claims left behind ========================================================================
def _claim_file(store: Path, host: str, pid: int, named: list[str], age_s: float) -> Path:
    path = claims_dir(Layout(store)) / f"{host}-{pid}.claim"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": CLAIM_FORMAT, "host": host, "pid": pid, "owner": "test"}
    path.write_text(json.dumps(doc) + "\n" + "".join(f"{k}\n" for k in named))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


KILLED = """
import sys
from pathlib import Path
from featbake.store.claims import ClaimFile
from featbake.store.layout import Layout
claim = ClaimFile(Layout(Path(sys.argv[1])), "part 0/1")
claim.cover(sys.argv[2:4])
claim.cover(sys.argv[2:])  # the rest appended
print("claimed", flush=True)
sys.stdin.read()
"""


def test_a_claim_left_by_a_killed_build_does_not_block_gc(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A build part killed with its claim written (SIGKILL: nothing lets it go): on its own
    host gc sees its process gone, elsewhere its heartbeat stop; either way gc deletes what no
    root reaches and removes the claim. A live claim from another host keeps its keys."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    named = sorted({k for _, k in manifest(store, first.root)})
    drop_root(store, first.root)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(store), *named[:8]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "claimed\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    silent = _claim_file(store, "elsewhere", 1, named[8:12], STALE_AFTER_S + 60)
    live = _claim_file(store, "elsewhere", 2, named[12:], 30.0)
    (killed,) = [c.path for c in read_claims(Layout(store)) if c.head.host == this_host()]
    cut = claims_dir(Layout(store)) / "x.claim.1.abc.part"  # a write killed before its rename
    cut.write_text("{")
    t = time.time() - STALE_AFTER_S - 60
    os.utime(cut, (t, t))

    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 12  # all but the live claim's
    assert not killed.exists() and not silent.exists() and not cut.exists() and live.exists()
    live.unlink()
    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 4


# == round eight: a dataset on a shared filesystem ===============================================
def test_gc_keeps_what_a_dataset_on_a_shared_filesystem_found_stored_before_its_fragment(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose root was dropped (its 16 features stored, no root reaching them), opened
    by a dataset on a shared filesystem: it looks the 16 keys up, finds them stored, and holds
    the root naming them for its ``serve`` fragment. An eager gc runs between that lookup and
    the fragment's seal. Before, the dataset wrote no claim: gc deleted the 16 rows, and the
    merge published a root with all 16 missing."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    sealing = FragmentCatalog._seal
    deleted: list[int] = []
    claimed: list[int] = []  # claims when gc ran, then once the fragment was sealed

    def gc_then_seal(self: FragmentCatalog, kind: FragmentKind, uses: Sequence[Use] = ()):
        if self.part is None and self._spec is not None and not deleted:  # the root is held
            claimed.append(len(read_claims(Layout(store))))
            with monkeypatch.context() as on_its_host:  # gc runs on the store's own host
                on_its_host.delenv("FEATBAKE_SHARED_FS")
                deleted.append(execute_gc(plan_gc(store, EAGER)).rows_deleted)
            sealed = sealing(self, kind, uses)
            claimed.append(len(read_claims(Layout(store))))  # before the catalog is closed
            return sealed
        return sealing(self, kind, uses)

    monkeypatch.setattr(FragmentCatalog, "_seal", gc_then_seal)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    assert ds.stored() == len(ds) == 16
    ds.close()
    monkeypatch.undo()  # gc and the merge, on the store's own host
    assert (claimed, deleted) == ([1, 0], [0])  # let go once the fragment was sealed
    assert merge(Layout(store)).roots == [first.root]
    assert assert_serves(store, first.root, audio_dir, encoder_file, Live()) == 16
    assert verify(store).status == "clean"


# == review of round seven: namespaces, a claim gc removed, clocks apart ======================
def test_a_claim_gc_removed_is_never_written_again_without_its_header(tmp_path: Path) -> None:
    """A claim gc found stale and removed while its part still ran: the part's next batch
    appended to the path, making a file of keys without its header, which every later gc and
    stats refused as unreadable, and the part's check before sealing passed (its heartbeat
    touched the new file), so it sealed a fragment naming keys gc had deleted. Now the append
    never makes the file: the part says in one line that its claim lapsed, and gc reads on."""
    layout = Layout(tmp_path)
    claim = ClaimFile(layout, "part 0/2")
    claim.cover(["a" * 64, "b" * 64])
    claim.path.unlink()  # what gc's drop_stale does to a claim it judges stale
    with pytest.raises(StoreError, match="claim on the stored features it reuses lapsed") as e:
        claim.cover(["c" * 64])  # the part's next batch
    assert "\n" not in str(e.value) and not claim.path.exists()
    assert read_claims(layout) == []  # gc and stats read on
    with pytest.raises(StoreError, match="run this part again"):
        claim.check_held()
    claim.release()


def test_a_process_in_another_pid_namespace_is_another_host(tmp_path: Path) -> None:
    """Two containers sharing a host name (`--uts=host`, cloned machines) judged each other's
    claims by pid: a live part whose pid is not in gc's namespace had its claim called dead and
    its reused rows deleted. The host a claim names now includes its boot and pid namespace,
    so only the heartbeat judges a claim written in another namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to make a pid namespace")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
         "from featbake.store.claims import this_host; print(this_host())"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()[-200:]}")
    theirs = probe.stdout.strip()
    assert theirs.split("/")[:2] == this_host().split("/")[:2]  # same name, same boot
    assert theirs != this_host()
    head = ClaimHead(theirs, 1, heartbeat=1000.0)  # pid 1 of theirs: not a pid of ours to ask
    assert claim_state(head, 1060.0, this_host(), lambda pid: False) is ClaimState.LIVE


def test_a_heartbeat_is_judged_by_the_store_s_clock_not_each_host_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats were set by the writing host's clock and judged by gc's host's clock, so a
    gc on a host 20 minutes ahead of a part's (or a part on a host 20 minutes behind) saw a
    live claim as stale and deleted what the part reused. Both now read the store's file
    system clock (a file server's on NFS: a heartbeat is a touch, gc's "now" a touch of
    claims.lock), so a claim just written is live whatever the hosts' clocks say."""
    layout = Layout(tmp_path)
    claim = ClaimFile(layout, "part 0/2")
    claim.cover(["a" * 64])
    claim.beat()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 20 * 60)  # gc's host, 20 min ahead
    (read,) = read_claims(layout)
    assert claims_now(layout) - read.head.heartbeat < STALE_AFTER_S
    assert claimed_keys(layout, drop_stale=True) == {"a" * 64}  # kept, and not removed
    monkeypatch.setattr(time, "time", real)
    claim.check_held()
    claim.release()


# == round nine: claims and engines =============================================================
def test_gc_keeps_a_claim_its_host_s_cached_listing_of_claims_lacks(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NFS client serves a listing of ``claims/`` from its cache for up to ``acdirmax``
    (60 s), and taking ``claims.lock`` revalidates that file, not the folder: a gc on another
    host than a part that just claimed the 16 features of a dropped root lists the folder as
    it was before the claim. Before, gc read claims from the listing alone and deleted the 16
    rows the part reuses. Now each claim's name is logged in ``claims/index``, a file (opened:
    revalidated), so gc keeps them; and once the claim is let go gc drops its name there."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    named = sorted({k for _, k in manifest(store, first.root)})
    drop_root(store, first.root)
    folder = claims_dir(Layout(store))
    cached = sorted(folder.iterdir()) if folder.exists() else []  # listed before the claim
    claim = ClaimFile(Layout(store), "part 0/1")
    claim.cover(named)
    listing = Path.iterdir

    def cached_listing(self: Path) -> Iterator[Path]:
        return iter(cached) if self == folder else listing(self)

    monkeypatch.setattr(Path, "iterdir", cached_listing)
    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 0  # kept: the part reuses them
    assert [c.keys for c in read_claims(Layout(store))] == [frozenset(named)]
    claim.release()
    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 16
    assert (folder / "index").read_text() == ""  # the claim gone: its name too


def test_a_serving_process_stopped_past_its_claim_publishes_no_root_and_serves_on(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset on a shared filesystem claims the keys of the root it holds, finds the 16
    features of a dropped root stored, and is stopped (SIGSTOP, a host asleep; an injected
    clock) past :data:`STALE_AFTER_S` before its ``serve`` fragment is sealed: a gc finds the
    claim stale and deletes the 16 rows. Before, the seal carried the root anyway and the
    merge published a root whose 16 features were all gone, saying nothing. Now the seal
    finds the claim lapsed and leaves the root out (a hint), and the dataset serves on: every
    item equals the encoder run now."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    ticks = [0.0]
    monkeypatch.setattr(
        fragment_catalog, "ClaimFile", functools.partial(ClaimFile, monotonic=lambda: ticks[0])
    )
    sealing = FragmentCatalog._seal
    deleted: list[int] = []

    def stopped_then_seal(self: FragmentCatalog, kind: FragmentKind, uses: Sequence[Use] = ()):
        if self.part is None and self._spec is not None and not deleted:  # the root is held
            assert self.claim is not None and self.claim.keys  # claimed
            ticks[0] += STALE_AFTER_S + 1.0  # stopped that long
            age(self.claim.path, STALE_AFTER_S + 60)  # no heartbeat meanwhile
            with monkeypatch.context() as on_its_host:  # gc runs on the store's own host
                on_its_host.delenv("FEATBAKE_SHARED_FS")
                deleted.append(execute_gc(plan_gc(store, EAGER)).rows_deleted)
        return sealing(self, kind, uses)

    monkeypatch.setattr(FragmentCatalog, "_seal", stopped_then_seal)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
        assert len(ds) == 16
        assert deleted == [16]
        live = Live()
        for i in range(len(ds)):  # located before the gc: served from what is there now
            want = live(encoder_file, Path(ds.path(i)))
            torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-6)
        ds.close()
    monkeypatch.undo()
    assert merge(Layout(store)).roots == []  # no root naming features gone
    assert read_claims(Layout(store)) == []
    assert verify(store).status == "clean"
    again = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    for i in range(len(again)):
        want = live(encoder_file, Path(again.path(i)))
        torch.testing.assert_close(again[i], want, rtol=1e-5, atol=1e-6)
    again.close()


def test_a_serving_process_whose_claim_could_not_be_logged_publishes_no_root_gc_emptied(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cl9.2 added a second write to every claim (``claims/index``); where it fails (the index
    owned by another user of a shared store, a full quota) the claim is removed and a
    dataset's ``replace_root`` goes on unclaimed (its root is a hint). Before, the seal's
    check (``check_held`` of a claim never written) passed, so the root was published
    although a gc had deleted its 16 features meanwhile. Now a root whose claim failed is not
    held (and the failure is recorded: the seal leaves out any root until the claim is let
    go); the dataset serves on."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)

    def cannot_log(layout: Layout, name: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(claims, "log_claim", cannot_log)
    sealing = FragmentCatalog._seal
    deleted: list[int] = []

    def gc_then_seal(self: FragmentCatalog, kind: FragmentKind, uses: Sequence[Use] = ()):
        if self.part is None and not deleted:  # its first seal
            with monkeypatch.context() as on_its_host:  # gc runs on the store's own host
                on_its_host.delenv("FEATBAKE_SHARED_FS")
                deleted.append(execute_gc(plan_gc(store, EAGER)).rows_deleted)
        return sealing(self, kind, uses)

    monkeypatch.setattr(FragmentCatalog, "_seal", gc_then_seal)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
        assert deleted == [16]  # nothing claimed them
        live = Live()
        for i in range(len(ds)):
            want = live(encoder_file, Path(ds.path(i)))
            torch.testing.assert_close(ds[i], want, rtol=1e-5, atol=1e-6)
        ds.close()
    monkeypatch.undo()
    roots = merge(Layout(store)).roots
    status = verify(store).status
    assert (roots, status) == ([], "clean"), (roots, status)  # before: a root of 16 gone features
    assert read_claims(Layout(store)) == []


def test_a_claim_logged_after_an_index_line_cut_short_is_still_indexed(tmp_path: Path) -> None:
    """A writer killed mid-append (or a short write at ENOSPC) leaves ``claims/index`` without
    its last newline. Before, the next claim's name was glued to it, so gc found that claim
    only in the listing, the one a cached NFS listing lacks. Now each name is written on a
    line of its own whatever precedes it."""
    layout = Layout(tmp_path / "store")
    claims_dir(layout).mkdir(parents=True)
    claims.claims_index(layout).write_text("0123abcd")  # an append cut short
    claim = ClaimFile(layout, "part 0/1")
    claim.cover(["k1"])
    try:
        assert claims.indexed_names(layout) == {claim.path.name}
        assert [c.keys for c in read_claims(layout)] == [frozenset({"k1"})]
    finally:
        claim.release()


def test_the_claim_files_every_claiming_process_writes_are_made_as_the_umask_allows(
    tmp_path: Path,
) -> None:
    """In a store a group shares (umask 002), every member's processes append to
    ``claims/index`` and take ``claims.lock`` and ``claims/index.lock`` for writing. Before,
    the first claim made the three 0o644 whatever the umask, so another member's claims all
    failed at the index (cl9.7: its roots dropped) and its locks were skipped (opened for
    writing: refused, so run unlocked, gc's exclusion of claims gone); gc's rewrite of the
    index then made it 0o664. Now they follow the umask, as the claims themselves do."""
    layout = Layout(tmp_path / "store")
    layout.root.mkdir()
    before = os.umask(0o002)
    try:
        claim = ClaimFile(layout, "part 0/1")
        claim.cover(["k1"])
    finally:
        os.umask(before)
    files = [claim.path, claims.claims_index(layout), claims.index_lock(layout)]
    files.append(claims.claims_lock(layout))
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == {p.name: "0o664" for p in files}
    claim.release()


def test_a_claim_made_again_after_its_release_has_a_name_no_host_found_gone(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim let go (its fragment sealed) and made again (a dataset's next root, a part's
    next batch after a release) reused its file name. A gc that looked the name up while it
    was gone caches that on an NFS client (a negative lookup entry, kept until the folder's
    cached attributes expire: up to ``acdirmax``), so it found the claim made again gone and
    deleted the rows it keeps: 16 of a dropped root's. Now each claim made has a new name."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    named = sorted({k for _, k in manifest(store, first.root)})
    drop_root(store, first.root)
    claim = ClaimFile(Layout(store), "dataset")
    claim.cover(named)
    gone = {claim.path}  # what gc's host looks up once the claim is let go
    claim.release()
    stat, read_text = Path.stat, Path.read_text

    def cached_stat(self: Path, *, follow_symlinks: bool = True) -> os.stat_result:
        if self in gone:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return stat(self, follow_symlinks=follow_symlinks)

    def cached_read_text(self: Path, *args: object, **kwargs: object) -> str:
        if self in gone:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    claim.cover(named)  # made again
    with monkeypatch.context() as on_gcs_host:
        on_gcs_host.setattr(Path, "stat", cached_stat)
        on_gcs_host.setattr(Path, "read_text", cached_read_text)
        assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 0  # kept: claimed again
    claim.release()
    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 16


def test_a_claim_written_short_at_a_full_disk_is_no_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write(2)`` to a file may write part of what it is given and return the count (a disk
    or quota filling up mid-write), and the next write then fails with ENOSPC. Before, a
    claim's append and the index's took the first count as done: the cover returned, the
    part went on to look up keys its claim lacked (and the last of them torn), so a gc could
    delete what it then sealed. Now a short write is written on until it is whole or fails,
    and the cover fails in one line; the claim's seal check fails too."""
    layout = Layout(tmp_path / "store")
    layout.root.mkdir()
    claim = ClaimFile(layout, "part 0/1")
    claim.cover(["a" * 64])
    writev = os.writev
    written: list[int] = []

    def filling_up(fd: int, buffers: list[memoryview]) -> int:
        if written:
            raise OSError(28, "No space left on device")
        data = b"".join(buffers)
        written.append(writev(fd, [data[: len(data) // 2]]))
        return written[-1]

    batch = [f"{i:064x}" for i in range(8)]
    with monkeypatch.context() as full, pytest.raises(StoreError) as e:
        full.setattr(os, "writev", filling_up)
        claim.cover(batch)
    assert "\n" not in str(e.value) and "No space left" in str(e.value)
    with pytest.raises(StoreError, match="could not be written"):
        claim.check_held()
    assert claim.keys == {"a" * 64}
    claim.release()


def test_a_claim_that_cannot_take_the_claims_lock_is_no_claim(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """``claims.lock`` is what keeps a claim from being written between gc's last look at the
    claims and its DELETE. A process that cannot open it for writing (a lock file another user
    of the store made 0o644 before cl9.9; here a folder in its place) got no lock from
    ``locked`` and wrote its claim unlocked, so its lookup could find rows that gc's DELETE,
    already decided, then removed; gc likewise ran its DELETE unlocked. Now the cover fails
    in one line (recorded: a dataset's root is left out at its seal), and so does gc, before
    it deletes a row."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    layout = Layout(store)
    lock = claims.claims_lock(layout)
    lock.unlink(missing_ok=True)
    lock.mkdir()  # cannot be opened for writing
    claim = ClaimFile(layout, "part 0/1")
    with pytest.raises(StoreError, match=r"claims\.lock") as e:
        claim.cover(["a" * 64])
    assert "\n" not in str(e.value)
    with pytest.raises(StoreError, match="could not be written"):
        claim.check_held()
    claim.release()
    with pytest.raises(StoreError, match=r"claims\.lock") as e:
        execute_gc(plan_gc(store, EAGER))
    assert "\n" not in str(e.value)
    lock.rmdir()
    assert execute_gc(plan_gc(store, EAGER)).rows_deleted == 16


def test_a_root_held_after_the_seals_claim_check_by_a_failed_cover_is_not_sealed(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cl9.7's check at the seal and the seal's take of the held root were apart: another
    thread's ``replace_root`` landing between them, its cover failing (the index unwritable),
    held a root whose keys no claim kept, and the seal took it unchecked. Played here in one
    thread: right after the check, that ``replace_root``, then a gc deleting the 16 unclaimed
    rows. Before, the seal carried the root and the merge published it, all 16 gone. Now a
    root whose cover failed is never held."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    layout = Layout(store)
    with Catalog(layout, read_only=True) as catalog:
        (root,) = catalog.roots()
    spec = RootSpec(root.name, root.data, root.encoder_label, root.encoder_fp, root.recipe_fp,
                    root.recipe)  # fmt: skip
    items = manifest(store, first.root)
    drop_root(store, first.root)
    served = FragmentCatalog(layout)
    checking = FragmentCatalog._drop_root_if_claim_lapsed
    deleted: list[int] = []

    def cannot_log(layout: Layout, name: str) -> None:
        raise PermissionError(13, "Permission denied")

    def another_thread_after_the_check(self: FragmentCatalog) -> None:
        checking(self)
        if not deleted:
            self.replace_root(spec, items)  # its cover fails: its lookups run unclaimed
            deleted.append(execute_gc(plan_gc(store, EAGER)).rows_deleted)

    monkeypatch.setattr(claims, "log_claim", cannot_log)
    checked = another_thread_after_the_check
    monkeypatch.setattr(FragmentCatalog, "_drop_root_if_claim_lapsed", checked)
    served.flush()
    served.close()
    monkeypatch.undo()
    assert deleted == [16]
    roots = merge(layout).roots
    status = verify(store).status
    assert (roots, status) == ([], "clean"), (roots, status)  # before: a root of 16 gone features


# == round ten: upkeep ===========================================================================
def test_gc_max_bytes_passes_over_what_a_build_part_still_running_reused(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store built whole, then built again in two parts: part 0/2 finds its features stored
    and reuses them, and is held just before it seals its ``done`` fragment (its claim covering
    them, nothing sealed naming them) while ``gc --max-bytes`` runs with a budget every feature
    exceeds. Before, eviction ignored claims: it deleted the rows part 0 reused, part 0 sealed,
    reporting them reused, and the merge published the root with them gone (the build's work
    lost, and no one told). Now eviction passes over features a live claim covers, as the
    DELETE of unreached rows does, and the build's root is whole once it is merged."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    sealing = FragmentCatalog.finish
    evicted: list[int] = []

    def gc_then_finish(self: FragmentCatalog) -> str | None:
        if self.part is not None and self.part.rank == 0 and not evicted:
            budget = GcOptions(grace=0.0, retention=0.0, max_bytes=1)
            evicted.append(execute_gc(plan_gc(store, budget)).rows_deleted)
        return sealing(self)

    monkeypatch.setattr(FragmentCatalog, "finish", gc_then_finish)
    part0 = build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")
    assert part0.encoded == 0 and part0.reused > 0  # it relied on what was stored
    assert evicted == [16 - part0.reused]  # only what no live claim covers went
    monkeypatch.setattr(FragmentCatalog, "finish", sealing)
    part1 = build(audio_dir, encoder_file, cache=store, workers=0, shard="1/2")
    assert part1.encoded == 16 - part0.reused  # evicted: encoded again

    assert read_claims(Layout(store)) == []
    assert merge(Layout(store)).roots == [first.root]
    with Catalog(Layout(store), read_only=True) as cat:
        assert cat.missing_per_root().get(first.root, 0) == 0
    assert assert_serves(store, first.root, audio_dir, encoder_file, Live()) == 16
    assert verify(store).status == "clean"


def test_gc_max_bytes_keeps_what_a_claim_written_after_its_plan_covers(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """The same between gc's plan and its DELETE: a build part that claims 8 of the planned
    evictions then (its lookups to follow) keeps them; the others go."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    named = sorted({k for _, k in manifest(store, first.root)})
    plan = plan_gc(store, GcOptions(grace=0.0, retention=0.0, max_bytes=1))
    assert len({r.key for r in plan.evict}) == 16
    claim = ClaimFile(Layout(store), "part 0/2")
    claim.cover(named[:8])
    try:
        assert execute_gc(plan).rows_deleted == 8
        with Catalog(Layout(store), read_only=True) as cat:
            assert cat.present_keys(named) == set(named[:8])
    finally:
        claim.release()


def test_gc_max_bytes_left_over_budget_by_an_unmerged_part_says_so(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A store built whole, then part 0/2 of a build in two parts whose part 1 is never run:
    part 0's sealed ``done`` fragment names the 8 stored features it reused, so ``gc
    --max-bytes`` passes over them (up10.3) for as long as nothing merges it. Before, gc exited
    0 with 164 KiB still live and said nothing of the budget, the part or the merge. Now one
    note says by how much the budget stays exceeded, which build holds what, and what frees
    it; ``--json`` says the same in fields. Running part 1 and merging, as it says, frees it."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    part0 = build(audio_dir, encoder_file, cache=store, workers=0, shard="0/2")
    assert part0.reused == 8  # its sealed `done` fragment names 8 stored features

    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert r.returncode == 0, r.stderr  # a note, as gc's other notes are
    assert "live      8 (164 KiB)" in invoke("stats", "--cache", store).stdout
    note = [line for line in r.stderr.splitlines() if "over --max-bytes" in line]
    assert len(note) == 1, r.stderr
    assert f"root {first.root}'s build in parts (1 of 2 done) holds" in note[0]
    assert "part 1/2 not done" in note[0] and "--shard 1/2" in note[0]
    assert f"`featbake merge --cache {store}`" in note[0]
    dry = invoke("gc", "--cache", store, "--max-bytes", "1", "--dry-run", "--json")
    plan = json.loads(dry.stdout)["plan"]
    assert plan["over_budget_bytes"] > 0 and plan["kept_for_builds_bytes"] > 0
    assert [(k["kind"], k["features"]) for k in plan["kept_for"]] == [("parts", 8)]

    build(audio_dir, encoder_file, cache=store, workers=0, shard="1/2")
    assert merge(Layout(store)).roots == [first.root]
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert r.returncode == 0 and "over --max-bytes" not in r.stdout + r.stderr
    assert "live      0" in invoke("stats", "--cache", store).stdout


def test_gc_max_bytes_left_over_budget_by_a_running_build_says_who_holds_it(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A live claim (this process: a build part still running) on 8 of 16 stored features:
    gc evicts the other 8 and says, in one note, which process on which host holds the rest
    and to run gc again when it finishes."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    named = sorted({k for _, k in manifest(store, first.root)})
    claim = ClaimFile(Layout(store), "part 0/2")
    claim.cover(named[:8])
    try:
        r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    finally:
        claim.release()
    assert r.returncode == 0, r.stderr
    assert "8 feature rows" in r.stdout
    host = this_host().split("/", 1)[0]
    note = [line for line in r.stderr.splitlines() if "over --max-bytes" in line]
    assert len(note) == 1, r.stderr
    assert f"a running build (pid {os.getpid()} on host {host}) holds" in note[0]
    assert "run gc again when it finishes" in note[0]


def test_gc_max_bytes_left_over_budget_by_a_dataset_s_serve_fragment_says_merge(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root dropped, then published again by a dataset on a shared filesystem in a sealed
    ``serve`` fragment (a root in waiting): its 16 features are kept from eviction until a
    merge publishes it, and the note names the root and says to run `featbake merge` on it; after
    the merge the root's features are evicted as any root's are."""
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    assert ds.stored() == 16
    ds.close()
    monkeypatch.undo()

    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert r.returncode == 0, r.stderr
    assert "0 feature rows" in r.stdout
    note = [line for line in r.stderr.splitlines() if "over --max-bytes" in line]
    assert len(note) == 1, r.stderr
    assert f"root {first.root} in a dataset's 1 serve fragments" in note[0]
    assert f"run `featbake merge --cache {store}` to publish it" in note[0]
    assert merge(Layout(store)).roots == [first.root]
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert "16 feature rows" in r.stdout and "over --max-bytes" not in r.stderr


def test_claims_index_stays_short_however_many_claims_were_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``claims/index`` gained a line per claim and lost them only when a gc deleted rows (its
    rewrite under ``claims.lock``): a store many parts and datasets claim in grew it without
    bound, and gc then looked up every name under the lock (100,000 names: some 0.7 s). Now
    the append that takes the index past a size (or a doubling of it) rewrites it without the
    claims gone, so it stays short; claims still live keep their names, and gc on a host whose
    listing of ``claims/`` is cached (cl9.2) still finds them."""
    monkeypatch.setattr(claims, "INDEX_COMPACT_BYTES", 2048, raising=False)  # some 50 names
    layout = Layout(tmp_path)
    first = ClaimFile(layout, "part 0/2")
    first.cover(["a" * 64])
    later = ClaimFile(layout, "part 1/2")
    for i in range(200):
        if i == 100:
            later.cover(["b" * 64])  # live from the middle on
        gone = ClaimFile(layout, f"dataset {i}")
        gone.cover(["c" * 64])
        gone.release()
    try:
        index = claims.claims_index(layout)
        assert index.stat().st_size < 2 * 2048  # 202 names were logged: 8,080 bytes
        assert {first.path.name, later.path.name} <= claims.indexed_names(layout)
        monkeypatch.setattr(Path, "iterdir", lambda self: iter(()))  # a cached, empty listing
        assert claimed_keys(layout, drop_stale=True) == {"a" * 64, "b" * 64}
    finally:
        first.release()
        later.release()
