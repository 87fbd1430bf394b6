"""Work handed to the sealing thread is never lost, whenever the collector hands it over.

A write-back finalizer the cyclic collector runs on a thread inside one of featbake's critical
sections (a store lock held, a catalog transaction open) hands its seal over instead of sealing
inline (featbake/serve/state.py, ``finalized``). The sealing thread is drained and stopped at
exit; these tests hand work over after that, as a process ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import featbake.serve.state as state_module
from featbake.process import PerProcess, critical_section, in_critical_section
from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder, make_tone
from tests.conftest import REPO


def frozen(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def clips() -> torch.Tensor:
    """The four clips the child encodes (the same here and in the child)."""
    return torch.stack([torch.from_numpy(make_tone(0.4, seed=s)[:, 0]) for s in range(4)])


#: A process that used a CachedEncoder (so its sealing thread started and is drained at exit),
#: then, in an exit hook that runs after that drain, encodes with a live CachedEncoder and a
#: second one dropped inside a reference cycle. The collector runs the dropped one's finalizer
#: inside the live one's ``add_shard`` transaction (forced at ``holds_shard``): an inline
#: commit there waits on its own thread's write lock for the whole busy timeout (shortened to
#: 0.5 s), then its features are dropped.
_AFTER_THE_DRAIN = """
import atexit, sys

def last_words():
    dropped_in_a_cycle()

if sys.argv[2] == "atexit":  # registered before multiprocessing.util: runs after its exit
    atexit.register(last_words)

import gc
from pathlib import Path
import multiprocessing.util as mp_util
import featbake.store.catalog as catalog_module
from featbake.serve.cached_encoder import CachedEncoder
from tests.serve.test_exit_seal import clips, frozen
from featbake.testing import TinyConvEncoder

store = Path(sys.argv[1])
enc = frozen(TinyConvEncoder())
x = clips()
catalog_module.Catalog.__init__.__kwdefaults__["timeout"] = 0.5


def dropped_in_a_cycle():
    live = CachedEncoder(enc, cache=store)
    live(x[1:2], ids=["live"])
    dropped = CachedEncoder(enc, cache=store)
    dropped(x[2:], ids=["dropped-0", "dropped-1"])
    dropped.cycle = [dropped]
    del dropped
    real_holds_shard, collected = catalog_module.holds_shard, []

    def collect_inside_the_transaction(layout, name):
        if not collected:
            collected.append(True)
            gc.collect()  # what any allocation here may do
        return real_holds_shard(layout, name)

    catalog_module.holds_shard = collect_inside_the_transaction
    live.flush()
    print("collected" if collected else "not collected", flush=True)


if sys.argv[2] == "finalizer":  # a multiprocessing finalizer below the drain's priority 0
    mp_util.Finalize(None, dropped_in_a_cycle, exitpriority=-1)

gc.disable()
first = CachedEncoder(enc, cache=store)
first(x[:1], ids=["first"])  # this process's sealing thread starts with its first write-back
print("exiting", flush=True)
"""


@pytest.mark.parametrize("hook", ["atexit", "finalizer"])
def test_a_write_back_collected_inside_a_transaction_after_the_exit_drain_is_kept(
    tmp_path: Path, hook: str
) -> None:
    """After the exit drain the finalizer sealed inline, inside the live transaction: its
    commit waited for the write lock its own thread holds, then dropped the features."""
    store = tmp_path / "store"
    args = [sys.executable, "-c", _AFTER_THE_DRAIN, str(store), hook]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting", "collected"], done.stderr
    enc, x = frozen(TinyConvEncoder()), clips()
    fresh = CachedEncoder(enc, cache=store, ram_cache=0)
    ids = ["first", "live", "dropped-0", "dropped-1"]
    torch.testing.assert_close(fresh(x, ids=ids), enc(x), rtol=1e-5, atol=1e-6)
    assert fresh.cache_info()["hits_store"] == len(ids), done.stderr
    assert "could not store" not in done.stderr, done.stderr


#: A process that ends by repairing its store in a multiprocessing finalizer run after the
#: sealing thread's drain (exit priority -1). It served a dataset there, one miss pending, and
#: dropped it inside a reference cycle: the collector runs its finalizer inside repair's
#: exclusive write lock (forced where repair scans the store). With ``before``, the process
#: served another dataset before it began to exit, so its sealing thread was started (and
#: drained); without, its first write-back is made at exit.
_REPAIR_AFTER_THE_DRAIN = """
import gc, importlib, sys
from pathlib import Path
import multiprocessing.util as mp_util
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import Layout

repair_module = importlib.import_module("featbake.upkeep.repair")  # the package names a function
audio, encoder, store = map(Path, sys.argv[1:4])


def last_words():
    ds = CachedFeatureDataset(audio, encoder, cache=store)
    ds[0]  # a miss: encoded, its write-back pending
    ds.cycle = [ds]
    del ds
    scan = repair_module.scan_store

    def collecting_scan(*args, **kwargs):
        gc.collect()  # what any allocation under the lock may do
        return scan(*args, **kwargs)

    repair_module.scan_store = collecting_scan
    print("repairing", flush=True)
    repair_module.repair(Layout(store))
    print("repaired", flush=True)


mp_util.Finalize(None, last_words, exitpriority=-1)
gc.disable()
if sys.argv[4] == "before":
    CachedFeatureDataset(audio, encoder, cache=store)[1]
"""


@pytest.mark.parametrize("first", ["before", "at-exit"])
def test_a_dataset_collected_inside_repair_after_the_exit_drain_is_kept(
    audio_dir: Path, encoder_file: Path, store_dir: Path, first: str
) -> None:
    """The dropped dataset's miss is in the store once the process has ended, and it ended."""
    from featbake.serve.dataset import CachedFeatureDataset
    from tests.conftest import live_features
    from tests.helpers import run_past_a_marker

    args = [sys.executable, "-c", _REPAIR_AFTER_THE_DRAIN, audio_dir, encoder_file, store_dir]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert run_past_a_marker([str(a) for a in [*args, first]], "repairing", env) == "repaired"
    again = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    want = live_features(encoder_file, Path(again.path(0)))
    assert isinstance(want, torch.Tensor)
    torch.testing.assert_close(again[0], want, rtol=1e-5, atol=1e-6)


# == the sealer's stop, in this process ============================================================
@pytest.fixture
def sealer(monkeypatch: pytest.MonkeyPatch) -> Iterator[state_module.Sealer]:
    """A sealing thread of its own in place of this process's (drained at the end)."""
    made = state_module.Sealer()
    holder = PerProcess(lambda: made)
    holder.get()
    monkeypatch.setattr(state_module, "_SEALER", holder)
    yield made
    made.drain()


def test_what_the_sealing_thread_hands_over_as_the_drain_stops_it_is_done_outside_its_section(
    sealer: state_module.Sealer,
) -> None:
    """The sealing thread, still sealing inside a critical section as the drain stops it, runs
    a finalizer there. That one sealed inline, inside the section (a ``flock`` or a commit on
    its own thread's lock: a hang, or features dropped). It is done as the section is left,
    before the thread reads the stop, so the drain returns with it done."""
    inside = threading.Event()
    release = threading.Event()
    ran: list[tuple[str, bool]] = []

    def late() -> None:
        ran.append((threading.current_thread().name, in_critical_section()))

    def sealing() -> None:
        with critical_section():
            inside.set()
            assert release.wait(timeout=60)
            state_module.finalized(late)  # the collector, inside the thread's own seal

    with critical_section():
        state_module.finalized(sealing)  # handed over
    assert inside.wait(timeout=60)
    real_join = sealer.thread.join

    def join_once_stopped() -> None:
        assert sealer.stopped
        release.set()  # the thread goes on only once the drain has stopped it
        real_join()

    sealer.thread.join = join_once_stopped  # type: ignore[method-assign]
    sealer.drain()
    assert ran == [("featbake-seal", False)]


def test_a_hand_over_racing_the_drain_is_never_lost(
    sealer: state_module.Sealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread inside a critical section hands its finalizer's work over just as the drain
    stops the sealing thread. Where it saw the thread running, then put once the drain had
    swept the queue, the work lay in a queue nobody reads. It is done once, by the thread that
    ran the finalizer, as it leaves its section."""
    checking = threading.Event()
    drained = threading.Event()
    ran: list[bool] = []
    real_in_critical_section = state_module.in_critical_section

    def switching_here() -> bool:  # a thread switch to the draining thread, at this point
        if threading.current_thread().name == "finalizing":
            checking.set()
            assert drained.wait(timeout=60)
        return real_in_critical_section()

    monkeypatch.setattr(state_module, "in_critical_section", switching_here)

    def finalizing() -> None:
        with critical_section():
            state_module.finalized(lambda: ran.append(in_critical_section()))

    thread = threading.Thread(target=finalizing, name="finalizing")
    thread.start()
    assert checking.wait(timeout=60)
    sealer.drain()
    drained.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert ran == [False]


def test_a_sealer_first_made_as_the_process_exits_takes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Multiprocessing has run its exit finalizers: a sealing thread started now would never be
    drained (its work lost as the interpreter stops daemon threads). None starts, and work
    handed over inside a section is done as the section is left."""
    import multiprocessing.util as mp_util

    monkeypatch.setattr(mp_util, "_exiting", True)
    late = state_module.Sealer()
    assert late.stopped and not late.thread.is_alive()
    holder = PerProcess(lambda: late)
    holder.get()
    monkeypatch.setattr(state_module, "_SEALER", holder)
    ran: list[bool] = []
    with critical_section():
        state_module.finalized(lambda: ran.append(in_critical_section()))
        assert ran == []
    assert ran == [False]
    late.wait()  # returns: nothing is pending


def test_work_left_for_the_end_of_a_section_is_done_once_as_the_outermost_is_left() -> None:
    """Nested sections: the work runs as the outermost is left, once, even where it enters a
    section of its own (which leaves more work for its end)."""
    from featbake.process import after_critical_section

    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        with critical_section():
            after_critical_section(lambda: ran.append("nested"))
            ran.append("inside first")

    with critical_section():
        with critical_section():
            after_critical_section(first)
            after_critical_section(lambda: ran.append("second"))
        assert ran == []
    done = ["first", "inside first", "second", "nested"]  # in the order left
    assert ran == done
    with critical_section():
        pass
    assert ran == done


#: A process whose dataset encodes 12 misses and ends with them unsaved: its exit hook seals
#: them. A shard's digest of 1 MiB or more is computed on a thread beside its write; forced
#: here for any size (``DIGEST_BESIDE_BYTES`` 1).
_MISSES_AT_EXIT = """
import sys
import featbake.store.shard as shard_module
from featbake.serve.dataset import CachedFeatureDataset

shard_module.DIGEST_BESIDE_BYTES = 1
ds = CachedFeatureDataset(sys.argv[1], sys.argv[2], cache=sys.argv[3], on_miss="encode")
for i in range(len(ds)):
    ds[i]
"""


def test_a_datasets_write_back_sealed_at_exit_is_stored_whatever_its_size(
    tmp_path: Path, encoder_file: Path
) -> None:
    """At exit no new thread may start ("cannot schedule new futures after interpreter
    shutdown"): the exit seal of a write-back of 1 MiB or more failed there with a warning,
    and the next run encoded every item again. The digest is now computed inline there."""
    from featbake.testing import write_audio_folder
    from tests.helpers import Live

    data, store = tmp_path / "a", tmp_path / "store"
    write_audio_folder(data, 12, seconds=(0.3, 0.6), seed=4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", _MISSES_AT_EXIT, str(data), str(encoder_file), str(store)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and "could not save" not in run.stderr, run.stderr
    from featbake.serve.dataset import CachedFeatureDataset

    ds = CachedFeatureDataset(data, encoder_file, cache=store, on_miss="error")
    live = Live()
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live(encoder_file, Path(ds.path(i))))
