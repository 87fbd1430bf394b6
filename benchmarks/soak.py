"""A bounded soak of one store under concurrent use (``make soak``; see docs/reliability.md).

For ``--seconds`` (default 60), against one store, at the same time:

- writer ``build``: ``featbake.build`` in a loop over the shared folder (overlapping work: all
  reused, its root published again) and over its own folder, which grows by two clips a round;
- writer ``write-back``: a ``CachedFeatureDataset`` with ``on_miss="encode"`` over its own
  folder, which grows by a clip and has one clip replaced each round (the old clip's feature
  becomes garbage for gc); its misses are encoded live and written back;
- reader ``stored``: a ``CachedFeatureDataset`` over the shared folder with ``on_miss="error"``
  (a miss would be a lost feature) through a DataLoader with ``num_workers=2``, a fresh dataset
  and a shuffled order every epoch;
- reader ``growing``: the same over the build writer's folder with ``on_miss="encode"`` (its
  workers encode what is not built yet and write it back, racing the builds);
- ``featbake gc`` in a loop (subprocess; ``--grace 1s``, compacting shards under 90% live and
  merging small ones), so shards are really removed and rewritten under the readers.

Every feature a role is served is compared with the encoder run on that file now. Afterwards
each folder is built once more (``featbake build``), ``featbake verify`` must exit 0, and every
item of every folder, read through a DataLoader with ``on_miss="error"``, must equal live
encoding. Roles are subprocesses of this script (``--role NAME``); each prints one JSON line.

    python benchmarks/soak.py [--seconds 60] [--work DIR]

Exits 0 when everything held, 1 with the failures listed otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import torch

from featbake.encode.encoders import torchscript_quietly
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder

SHARD_BYTES = 64_000  # small shards: many files for gc to compact, merge and remove
BATCH = 4
GC_ARGS = ["--grace", "1s", "--compact-below", "0.9", "--merge-small", "--shard-size", "64KB"]
ROLES = ("build", "write-back", "stored", "growing")
MAX_SHOWN = 20  # failures printed (all count)
ROUND_PAUSE = 0.5  # between writer rounds: the folders grow by a few hundred clips, not more


@dataclass
class Work:
    """The soak's folders: one store, one encoder, three data folders."""

    root: Path

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def encoder(self) -> Path:
        return self.root / "encoder.pt"

    def data(self, name: str) -> Path:
        return self.root / "data" / name

    @property
    def staging(self) -> Path:
        return self.root / "staging"


@dataclass
class Tally:
    """What one role did, and what went wrong (printed as its JSON line)."""

    role: str
    rounds: int = 0
    served: int = 0
    encoded: int = 0
    clips_added: int = 0
    errors: list[str] = field(default_factory=list)


class Live:
    """The encoder run on a file now (a fresh TorchScript load, as the tests' live_features)."""

    def __init__(self, encoder: Path) -> None:
        with torchscript_quietly():
            self.module = torch.jit.load(str(encoder))
        self.recipe = Recipe()
        self.source = source_for(self.recipe)
        self.memo: dict[str, torch.Tensor] = {}

    def __call__(self, path: str) -> torch.Tensor:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest not in self.memo:
            x = self.source.load(Path(path))
            with torch.inference_mode():
                out = self.module(x.unsqueeze(0))[0].to(self.recipe.torch_dtype)
            self.memo[digest] = out
        return self.memo[digest]


def check(tally: Tally, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Record a served feature that differs from live encoding (the CPU kernels may round
    differently by batch size: the tolerance the tests use)."""
    tally.served += 1
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        detail = " ".join(str(e).split())[:200]
        tally.errors.append(f"{what}: served feature differs from live encoding: {detail}")


def add_clips(work: Work, folder: Path, n: int, seed: int) -> list[Path]:
    """Write ``n`` clips into ``folder`` atomically (staged, then renamed into place), so a
    dataset scanning the folder never hashes half a file."""
    stage = work.staging / f"{os.getpid()}-{seed}"
    written = write_audio_folder(stage, n, seconds=(0.3, 0.9), seed=seed)
    out = []
    for i, p in enumerate(written):
        dest = folder / f"s{seed:06d}-{i}.wav"
        os.replace(p, dest)
        out.append(dest)
    shutil.rmtree(stage, ignore_errors=True)
    return out


# -- roles (each a subprocess running until the deadline) -------------------------------------
def role_build(work: Work, tally: Tally, until: float) -> None:
    from featbake.bake.pipeline import build

    while time.time() < until:
        tally.clips_added += len(add_clips(work, work.data("grow"), 2, 1000 + tally.rounds))
        # "grow" is built every other round: meanwhile the growing reader meets its new clips
        # as misses, encodes them in its workers and writes them back, racing this build.
        for name in ("shared", "grow") if tally.rounds % 2 else ("shared",):
            report = build(work.data(name), work.encoder, cache=work.store, workers=0,
                           batch_size=BATCH, shard_bytes=SHARD_BYTES)  # fmt: skip
            tally.encoded += report.encoded
            tally.errors += [f"build {name}: {p}: {r}" for p, r in report.failed]
        tally.rounds += 1
        time.sleep(ROUND_PAUSE)


def role_write_back(work: Work, tally: Tally, until: float) -> None:
    from featbake.serve.dataset import CachedFeatureDataset

    live = Live(work.encoder)
    folder = work.data("churn")
    while time.time() < until:
        tally.clips_added += len(add_clips(work, folder, 1, 2000 + tally.rounds))
        victim = sorted(folder.glob("*.wav"))[tally.rounds % 4]
        (new,) = add_clips(work, work.staging, 1, 3000 + tally.rounds)
        os.replace(new, victim)  # the old content's feature is now garbage
        ds = CachedFeatureDataset(folder, work.encoder, cache=work.store, on_miss="encode")
        for i in range(len(ds)):
            check(tally, ds[i], live(ds.path(i)), ds.path(i))
        batch = list(range(min(len(ds), BATCH)))
        for i, got in zip(batch, ds.__getitems__(batch), strict=True):
            check(tally, got, live(ds.path(i)), ds.path(i))
        ds.flush()
        tally.encoded += ds.cache_info().encoded
        ds.close()
        tally.rounds += 1
        time.sleep(ROUND_PAUSE)


def read_epoch(work: Work, folder: Path, on_miss: str, live: Live, tally: Tally) -> None:
    """One shuffled epoch of a fresh dataset through a DataLoader with two workers."""
    from torch.utils.data import DataLoader

    from featbake.serve.collate import pad_collate
    from featbake.serve.dataset import CachedFeatureDataset

    ds = CachedFeatureDataset(folder, work.encoder, cache=work.store, on_miss=on_miss)
    tally.encoded += len(ds) - ds.stored()  # misses: the workers encode them and write back
    order = torch.randperm(len(ds)).tolist()
    loader = DataLoader(ds, batch_size=BATCH, sampler=order, num_workers=2,
                        collate_fn=pad_collate)  # fmt: skip
    for b, (padded, lengths) in enumerate(loader):
        for j, n in enumerate(lengths.tolist()):
            path = ds.path(order[b * BATCH + j])
            check(tally, padded[j, :n], live(path), path)
    ds.close()


def role_reader(folder: str, on_miss: str) -> Callable[[Work, Tally, float], None]:
    def run(work: Work, tally: Tally, until: float) -> None:
        live = Live(work.encoder)
        while time.time() < until:
            read_epoch(work, work.data(folder), on_miss, live, tally)
            tally.rounds += 1

    return run


RUN: dict[str, Callable[[Work, Tally, float], None]] = {
    "build": role_build,
    "write-back": role_write_back,
    "stored": role_reader("shared", "error"),
    "growing": role_reader("grow", "encode"),
}


def run_role(name: str, work: Work, until: float) -> int:
    torch.set_num_threads(1)  # nine processes share the machine
    tally = Tally(name)
    try:
        RUN[name](work, tally, until)
    except Exception:
        tally.errors.append(f"{name} died: {traceback.format_exc()[-2000:]}")
    print(json.dumps(asdict(tally)), flush=True)
    return 1 if tally.errors else 0


# -- the parent: set up, start the roles, run gc, then check everything -----------------------
def featbake(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("FEATBAKE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "featbake", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)  # fmt: skip


def set_up(work: Work) -> None:
    save_torchscript(TinyConvEncoder(), work.encoder)
    for name, n, seed in (("shared", 24, 1), ("grow", 4, 2), ("churn", 6, 3)):
        work.data(name).mkdir(parents=True)
        add_clips(work, work.data(name), n, seed)
    res = featbake("build", "-e", work.encoder, "-d", work.data("shared"), "--cache", work.store,
                   "--shard-size", "64KB", "--json")  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"soak: the first build failed:\n{res.stderr}")


def gc_loop(work: Work, until: float, errors: list[str]) -> dict[str, int]:
    """``featbake gc`` again and again until the deadline; the totals of what it did."""
    totals = {"runs": 0, "rows_deleted": 0, "shards_deleted": 0, "shards_written": 0,
              "features_moved": 0, "orphans_removed": 0, "bytes_freed": 0}  # fmt: skip
    while time.time() < until:
        res = featbake("gc", "--cache", work.store, *GC_ARGS, "--json")
        if res.returncode != 0:
            errors.append(f"gc exited {res.returncode}: {res.stderr.strip()[-500:]}")
        else:
            result = json.loads(res.stdout)["result"]
            for k in totals:
                totals[k] += result.get(k, 0)
            errors += [f"gc problem: {p}" for p in result["problems"]]
        totals["runs"] += 1
        time.sleep(0.3)
    return totals


def start_roles(work: Work, until: float) -> dict[str, subprocess.Popen]:
    logs = work.root / "logs"
    logs.mkdir(exist_ok=True)
    procs = {}
    for name in ROLES:
        err = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed when the role is reaped
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--role", name, "--work", str(work.root),
             "--until", repr(until)],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    return procs


def reap(work: Work, procs: dict[str, subprocess.Popen], errors: list[str]) -> list[dict]:
    tallies = []
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            errors.append(f"role {name} did not finish within 90 s of the deadline (a hang)")
        lines = [x for x in (out or "").splitlines() if x.startswith("{")]
        if not lines:
            log = (work.root / "logs" / f"{name}.log").read_text()[-1500:]
            errors.append(f"role {name} exited {proc.returncode} without a report:\n{log}")
            continue
        tally = json.loads(lines[-1])
        errors += [f"{name}: {e}" for e in tally["errors"]]
        tallies.append(tally)
    return tallies


def final_check(work: Work, errors: list[str]) -> dict[str, int]:
    """Build every folder once more, verify must be clean, and every item must equal live."""
    out = {"encoded": 0, "served": 0}
    for name in ("shared", "grow", "churn"):
        res = featbake("build", "-e", work.encoder, "-d", work.data(name), "--cache", work.store,
                       "--json")  # fmt: skip
        if res.returncode != 0:
            errors.append(f"final build of {name} exited {res.returncode}: {res.stderr[-500:]}")
            continue
        out["encoded"] += json.loads(res.stdout)["encoded"]
    res = featbake("verify", "--cache", work.store)
    if res.returncode != 0:
        errors.append(f"featbake verify exited {res.returncode}:\n{res.stdout}{res.stderr}")
    out["verify"] = res.returncode
    live, tally = Live(work.encoder), Tally("final")
    for name in ("shared", "grow", "churn"):
        try:
            read_epoch(work, work.data(name), "error", live, tally)
        except Exception as e:
            errors.append(f"final read of {name}: {type(e).__name__}: {e}")
    errors += tally.errors
    out["served"] = tally.served
    return out


def summary(seconds: float, tallies: list[dict], gc: dict[str, int], final: dict) -> str:
    by = {t["role"]: t for t in tallies}
    lines = [f"soak: {seconds:.0f} s of 2 writers, 2 readers (2 workers each) and a gc loop"]
    if "build" in by:
        t = by["build"]
        lines.append(f"  writer build:      {t['rounds']} rounds, {t['clips_added']} clips added,"
                     f" {t['encoded']} features encoded")  # fmt: skip
    if "write-back" in by:
        t = by["write-back"]
        lines.append(f"  writer write-back: {t['rounds']} rounds, {t['served']} served and checked,"
                     f" {t['encoded']} encoded live and written back")  # fmt: skip
    for role in ("stored", "growing"):
        if role in by:
            t = by[role]
            lines.append(f"  reader {role + ':':12}{t['rounds']} epochs, {t['served']} served and"
                         f" checked, {t['encoded']} met as misses (encoded live)")  # fmt: skip
    lines.append(f"  gc:                {gc['runs']} runs, {gc['rows_deleted']} rows and "
                 f"{gc['shards_deleted']} shards deleted, {gc['shards_written']} shards written "
                 f"({gc['features_moved']} features moved), {gc['bytes_freed']:,} bytes "
                 "freed")  # fmt: skip
    lines.append(f"  final:             builds encoded {final['encoded']}, verify exit "
                 f"{final['verify']}, {final['served']} items served equal to live")  # fmt: skip
    return "\n".join(lines)


def soak(seconds: float, root: Path) -> int:
    t0 = time.monotonic()
    work = Work(root)
    set_up(work)
    until = time.time() + seconds
    procs = start_roles(work, until)
    errors: list[str] = []
    gc = gc_loop(work, until, errors)
    tallies = reap(work, procs, errors)
    if gc["rows_deleted"] + gc["shards_deleted"] + gc["shards_written"] == 0:
        errors.append("gc never removed or rewrote anything: the soak did not exercise it")
    final = final_check(work, errors)
    print(summary(seconds, tallies, gc, final))
    for e in errors[:MAX_SHOWN]:
        print(f"FAIL {e}")
    if len(errors) > MAX_SHOWN:
        print(f"FAIL ... and {len(errors) - MAX_SHOWN} more")
    verdict = "FAILED" if errors else "ok"
    print(f"soak: {verdict} in {time.monotonic() - t0:.1f} s wall")
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--work", type=Path, help="keep the store and logs here (default: a tmp dir)")
    ap.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return run_role(args.role, Work(args.work), args.until)
    if args.work:
        if args.work.exists():
            shutil.rmtree(args.work)
        args.work.mkdir(parents=True)
        return soak(args.seconds, args.work)
    with tempfile.TemporaryDirectory(prefix="featbake-soak-") as tmp:
        return soak(args.seconds, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
