"""FeatureLoader's state (issue 30 item 1): stopped anywhere and resumed by a new loader with the
same arguments, it yields exactly the rest of the epoch (same items, order and batches, labels
included), then the epochs the uninterrupted loader would; under two gloo ranks each rank's own.
A state from another world size, or from options that give another order, is refused.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import StackDataset

from featbake import CachedFeatureDataset, FeatureLoader, build
from featbake.errors import ConfigError
from tests.conftest import live_features

KINDS = [
    {"batch_size": 3},
    {"batch_size": 3, "shuffle": False, "drop_last": True},
    {"batch_frames": 400},
    {"batch_size": 2, "shuffle": "blocks", "window": 2},
]


@pytest.fixture
def baked(audio_dir: Path, encoder_file: Path, store_dir: Path) -> CachedFeatureDataset:
    build(audio_dir, encoder_file, cache=store_dir, workers=0, shard_bytes=4096)
    return CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")


def _epoch(loader: FeatureLoader, stop: int | None = None) -> list[tuple]:
    """An epoch's batches, or its first ``stop`` (the training loop takes no more)."""
    return list(itertools.islice(loader, stop))


def _same(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw", KINDS)
def test_a_resumed_loader_yields_the_rest_of_the_epoch_then_the_next_ones(
    baked: CachedFeatureDataset, encoder_file: Path, kw: dict
) -> None:
    ds = StackDataset(baked, torch.arange(len(baked)))
    whole = FeatureLoader(ds, seed=11, **kw)
    epochs = [_epoch(whole) for _ in range(3)]
    assert len(set(baked.placement().shards.tolist())) >= 4  # blocks have shards to visit
    for stop in range(len(epochs[1]) + 1):
        first = FeatureLoader(ds, seed=11, **kw)
        _epoch(first)
        _epoch(first, stop)  # preempted after `stop` batches of epoch 1
        state = json.loads(json.dumps(first.state_dict()))  # plain: survives any checkpoint
        assert state["epoch"] == (1 if stop < len(epochs[1]) else 2)
        again = FeatureLoader(ds, **kw)  # its own random seed: the state's wins
        again.load_state_dict(state)
        if state["epoch"] == 1:
            rest = _epoch(again)
            _same(rest, epochs[1][stop:])
        _same(_epoch(again), epochs[2])
    for padded, lengths, labels in epochs[1]:
        for row, n, i in zip(padded, lengths, labels, strict=True):
            want = live_features(encoder_file, Path(baked.path(int(i))))
            torch.testing.assert_close(row[:n], want, rtol=1e-5, atol=1e-5)


def test_set_epoch_keeps_a_resumed_epoch_and_drops_it_for_another(
    baked: CachedFeatureDataset,
) -> None:
    first = FeatureLoader(baked, batch_size=3, seed=2)
    whole = [_epoch(first) for _ in range(2)]
    first.set_epoch(1)
    _epoch(first, 2)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    again = FeatureLoader(baked, batch_size=3, seed=2)
    again.load_state_dict(state)
    again.set_epoch(1)  # the usual loop calls set_epoch before each epoch
    _same(_epoch(again), whole[1][2:])
    again.load_state_dict(state)
    again.set_epoch(0)
    _same(_epoch(again), whole[0])


def test_a_state_from_other_ranks_or_options_is_refused(baked: CachedFeatureDataset) -> None:
    state = FeatureLoader(baked, batch_size=4, rank=0, world_size=2).state_dict()
    with pytest.raises(ConfigError, match="saved over 2 ranks and this run has 1"):
        FeatureLoader(baked, batch_size=4).load_state_dict(state)
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(baked, batch_size=5, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="another order"):
        FeatureLoader(
            baked, batch_size=4, rank=1, world_size=2, even_batches=False
        ).load_state_dict(state)
    for bad in ({**state, "position": -1}, {**state, "epoch": "1"}, [1, 2]):
        with pytest.raises(ConfigError, match="state"):
            FeatureLoader(baked, batch_size=4, rank=0, world_size=2).load_state_dict(bad)  # type: ignore[arg-type]


RANK_SCRIPT = """\
import itertools, json, sys
import torch
import torch.distributed as dist
from torch.utils.data import StackDataset, Subset
from featbake import CachedFeatureDataset, FeatureLoader

data, encoder, store, out = sys.argv[1:5]
dist.init_process_group("gloo")
ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
ds = Subset(StackDataset(ds, torch.arange(len(ds))), range(15))  # 15: 2 ranks cannot split it
labels = lambda loader, stop=None: [b[2].tolist() for b in itertools.islice(loader, stop)]
report = {}
for name, kw in {"items": {"batch_size": 3}, "frames": {"batch_frames": 300},
                 "uneven": {"batch_size": 3, "even_batches": False},
                 "frames-uneven": {"batch_frames": 300, "even_batches": False}}.items():
    whole = FeatureLoader(ds, **kw)
    epochs = [labels(whole) for _ in range(2)]
    first = FeatureLoader(ds, **kw)
    stop = dist.get_rank() + 1  # each rank stops at its own place
    labels(first, stop)
    again = FeatureLoader(ds, **kw)
    again.load_state_dict(first.state_dict())
    resumed = [labels(again), labels(again)]
    mine = {"epochs": epochs, "resumed": resumed, "stop": stop}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    report[name] = every
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(report, f)
dist.destroy_process_group()
"""


def _torchrun(script: str, tmp_path: Path, *args: object) -> dict:
    path = tmp_path / "ranks.py"
    path.write_text(script)
    out = tmp_path / "report.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    repo = str(Path(__file__).resolve().parents[1])
    cmd = [torchrun, "--nproc-per-node", "2", "--standalone", path, *args, out]
    res = subprocess.run(
        [str(a) for a in cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo},
    )
    assert res.returncode == 0, res.stderr
    report: dict = json.loads(out.read_text())
    return report


def test_two_gloo_ranks_resume_their_own_epochs_and_even_batches_false_repeats_nothing(
    baked: CachedFeatureDataset,
    audio_dir: Path,
    encoder_file: Path,
    store_dir: Path,
    tmp_path: Path,
) -> None:
    report = _torchrun(RANK_SCRIPT, tmp_path, audio_dir, encoder_file, store_dir)
    n = 15  # of the 16 items: one over an even split
    for name, ranks in report.items():
        for r in ranks:
            stop = r["stop"]
            assert r["resumed"] == [r["epochs"][0][stop:], r["epochs"][1]], name
        counts = [len(r["epochs"][0]) for r in ranks]
        seen = sorted(i for r in ranks for b in r["epochs"][0] for i in b)
        if name.endswith("uneven"):  # for evaluation: each item read exactly once
            assert seen == list(range(n)), name
        else:  # every rank takes as many steps, as DDP needs (items or batches repeated)
            assert counts[0] == counts[1] and set(seen) == set(range(n)), name
    assert [sum(map(len, r["epochs"][0])) for r in report["uneven"]] == [8, 7]
    assert [sum(map(len, r["epochs"][0])) for r in report["items"]] == [8, 8]
