"""Builds into a bucket that are killed, split over nodes, merged, killed mid-merge, and
served misses written back: every run ends with every feature served equal to live encoding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from featbake import CachedFeatureDataset
from featbake.encode.sources import source_for
from featbake.store.bucket import merge_bucket
from featbake.store.catalog import Catalog
from featbake.store.fragment_catalog import Batching, FragmentCatalog, RankPart
from featbake.store.fragments import fragment_keys
from featbake.store.open import open_store
from featbake.store.roots import RootSpec
from featbake.store.shard import write_shard
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.conftest import REPO, encoded_rows, invoke, live_features
from tests.store.bucket.conftest import S3, Place, Remote, bucket_store

ENCODER = "countenc:build"


def build_args(data: Path, url: str) -> list[object]:
    args: list[object] = ["build", "-e", ENCODER, "-d", data, "--cache", url, "--workers", "0"]
    return [*args, "--shard-size", "1KiB", "--batch-size", "1"]  # one shard per input


def node(place: Remote | S3, name: str, tmp_path: Path, counting: dict[str, str]) -> dict[str, str]:
    """The environment of a process on node ``name``: its own local tier."""
    return {**place.env, **counting, "FEATBAKE_LOCAL_CACHE": str(tmp_path / f"node-{name}")}


def assert_bucket_serves_live(place: Remote | S3, data: Path, tmp_path: Path) -> None:
    """A fresh node serves every input from the bucket (on_miss="error"), equal to live
    encoding by the same encoder (the counting encoder is a TinyConvEncoder, seed 0)."""
    ds = CachedFeatureDataset(
        data, ENCODER, cache=place.url, local_cache=tmp_path / "reader", on_miss="error"
    )
    module = TinyConvEncoder().eval()
    source = source_for(ds.recipe)
    for i in range(len(ds)):
        with torch.inference_mode():
            want = module(source.load(Path(ds.path(i))).unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], want)


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    data = tmp_path / "clips"
    write_audio_folder(data, 24, seconds=(0.2, 0.4), seed=11)
    return data


@pytest.mark.slow
def test_a_build_killed_mid_run_is_finished_by_a_rerun_on_another_node(
    place: Place, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    # The encoder holds after 12 inputs, so the build is still running when it is killed; one
    # input every 0.15 s hands each over to the writer on the next (a build hands features over
    # every 0.1 s), so the part fragments (a rank batches them, each naming as many rows as
    # those before it) name 1, 2, 4 and 8 inputs by then, not only after the 30 s seal.
    env = {**os.environ, **node(place, "a", tmp_path, counting_encoder)}
    env |= {"COUNT_DELAY": "0.15", "COUNT_HOLD": "12"}
    said = tmp_path / "first-run.stderr"
    with said.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featbake", *map(str, build_args(clips, place.url))],
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    # Waits on the fragments (or the build's own end, a failure), however slow a loaded machine
    # makes the build; the bound only keeps a hung build from hanging the suite.
    deadline = time.monotonic() + 600
    while (
        len(place.objects("fragments/")) < 3 and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    ended = proc.poll()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    uploaded = len(place.objects("fragments/"))
    first_run = len(encoded_rows(counting_encoder))
    why = f"exit {ended}, {uploaded} fragments, {first_run} encoded: {said.read_text()[-2000:]}"
    assert ended is None and uploaded >= 3 and first_run <= 12, why
    assert not place.objects("catalog/")  # killed before it published anything

    rerun = invoke(*build_args(clips, place.url), env=node(place, "b", tmp_path, counting_encoder))
    assert rerun.returncode == 0, rerun.stderr
    # The rerun, on a node with an empty tier, skipped what the killed run's uploaded
    # fragments named (one input or more each: a rank batches its part fragments): at most
    # what it sealed since its last fragment, or had in the writer's hands, is encoded twice.
    assert len(encoded_rows(counting_encoder)) <= 24 + (first_run - uploaded)
    assert not place.objects("fragments/")
    assert_bucket_serves_live(place, clips, tmp_path)
    clean = invoke("verify", "--cache", place.url, env=node(place, "c", tmp_path, counting_encoder))
    assert clean.returncode == 0 and "verify: clean" in clean.stdout, clean.stderr


#: A build into a bucket SIGKILLed once it sealed its first part fragment in the node's tier,
#: before that fragment's upload (its shard went up as it was sealed: a rank ships each shard).
KILLED_BEFORE_THE_UPLOAD = """
import os, signal, sys
import featbake
from featbake.store import bucket

def killed(self, fragment, shards):
    os.kill(os.getpid(), signal.SIGKILL)

bucket.BucketStore.publish_fragment = killed
data, url = sys.argv[1:]
featbake.build(data, "countenc:build", cache=url, workers=0, batch_size=1, shard_bytes=1024)
"""


def killed_before_the_upload(
    s3: S3,
    clips: Path,
    tmp_path: Path,
    counting_encoder: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """Node a's build into ``s3`` SIGKILLed between its first fragment's seal and its upload
    (:data:`KILLED_BEFORE_THE_UPLOAD`); node a's tier."""
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    env = {**os.environ, **node(s3, "a", tmp_path, counting_encoder)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_THE_UPLOAD, str(clips), s3.url],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return Path(env["FEATBAKE_LOCAL_CACHE"])


def test_a_fragment_sealed_but_never_uploaded_is_adopted_by_the_rerun(
    s3: S3, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    """A fragment the tier holds and the bucket never had (its build killed between the seal
    and the upload) is uploaded by the node's next sync: the rerun there reuses its feature
    and publishes a root missing nothing. Before, the rerun counted it stored (the tier's
    fragments/ holds it) but no merge folded it (the bucket never listed it): exit 0, what it named
    items missing in every later version, verify clean, the dataset's CacheMiss."""
    tier = killed_before_the_upload(s3, clips, tmp_path, counting_encoder, monkeypatch)
    unsent = list(tier.rglob("fragments/*.part.sqlite"))  # sealed here, never sent
    assert len(unsent) == 1 and not s3.objects("fragments/") and not s3.objects("catalog/")
    sealed = len(fragment_keys(unsent))
    first_run = len(encoded_rows(counting_encoder))
    assert sealed >= 1

    rerun = invoke(
        *build_args(clips, s3.url), "--json", env=node(s3, "a", tmp_path, counting_encoder)
    )
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert (report["encoded"], report["reused"]) == (24 - sealed, sealed)
    assert len(encoded_rows(counting_encoder)) == first_run + 24 - sealed
    assert not s3.objects("fragments/") and not list(tier.rglob("fragments/*.sqlite"))
    roots = invoke("roots", "--json", "--cache", s3.url, env=node(s3, "b", tmp_path, {}))
    assert [(r["items"], r["missing"]) for r in json.loads(roots.stdout)] == [(24, 0)]
    assert_bucket_serves_live(s3, clips, tmp_path)
    clean = invoke("verify", "--cache", s3.url, env=node(s3, "c", tmp_path, counting_encoder))
    assert clean.returncode == 0 and "verify: clean" in clean.stdout, clean.stderr
    assert "orphan" not in clean.stdout + clean.stderr


def test_a_tier_with_no_record_of_its_fragments_sends_none_and_encodes_again(
    s3: S3, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    """A tier older than its record of the fragments the bucket held (``fragments.seen``)
    cannot tell an unsent fragment from a copy another node merged and retired (a root
    dropped since would come back if it were sent): it sends none, lets go of what the bucket
    does not list, and the rerun encodes those features again, the root whole."""
    tier = killed_before_the_upload(s3, clips, tmp_path, counting_encoder, monkeypatch)
    for record in tier.rglob("fragments.seen"):
        record.unlink()
    rerun = invoke(
        *build_args(clips, s3.url), "--json", env=node(s3, "a", tmp_path, counting_encoder)
    )
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert (report["encoded"], report["reused"]) == (24, 0)
    assert not s3.objects("fragments/") and not list(tier.rglob("fragments/*.sqlite"))
    roots = invoke("roots", "--json", "--cache", s3.url, env=node(s3, "b", tmp_path, {}))
    assert [(r["items"], r["missing"]) for r in json.loads(roots.stdout)] == [(24, 0)]
    assert_bucket_serves_live(s3, clips, tmp_path)


@pytest.mark.slow
def test_torchrun_two_ranks_build_into_a_bucket_and_rank_0_publishes(
    place: Place, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    env = {**os.environ, **node(place, "a", tmp_path, counting_encoder), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    args = [torchrun, "--nproc-per-node", "2", "--standalone", "-m", "featbake"]
    done = subprocess.run(
        [str(a) for a in [*args, *build_args(clips, place.url)]],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(encoded_rows(counting_encoder)) == sorted(set(encoded_rows(counting_encoder)))
    assert len(encoded_rows(counting_encoder)) == 24  # each input once, across both ranks
    assert place.objects("catalog/") == ["catalog/v000000001.sqlite"]
    assert not place.objects("fragments/")
    assert_bucket_serves_live(place, clips, tmp_path)


def test_parts_built_on_two_nodes_are_merged_from_a_third(
    place: Remote | S3, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    for i, name in enumerate("ab"):
        part = invoke(
            *build_args(clips, place.url), "--shard", f"{i}/2",
            env=node(place, name, tmp_path, counting_encoder),
        )  # fmt: skip
        assert part.returncode == 0, part.stderr
    assert not place.objects("catalog/") and place.objects("fragments/")
    merged = invoke("merge", "--cache", place.url, env=node(place, "c", tmp_path, counting_encoder))
    assert merged.returncode == 0, merged.stderr
    assert "1 roots published" in merged.stdout or "roots published" in merged.stdout
    assert place.objects("catalog/") == ["catalog/v000000001.sqlite"]
    assert not place.objects("fragments/")
    assert len(encoded_rows(counting_encoder)) == 24
    assert_bucket_serves_live(place, clips, tmp_path)


def test_a_build_abandoned_from_another_node_is_retired_from_the_bucket(
    s3: S3, clips: Path, tmp_path: Path, counting_encoder: dict[str, str], monkeypatch
) -> None:
    """A bucket build one part of which was killed for good stayed pending for every node;
    `merge --abandon ROOT` from another node retires it: its fragment objects go, no node
    lists it, and a whole build reuses what it sealed."""
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    part = invoke(
        *build_args(clips, s3.url), "--shard", "0/2", env=node(s3, "a", tmp_path, counting_encoder)
    )
    assert part.returncode == 0, part.stderr
    sealed = len(encoded_rows(counting_encoder))
    listed = invoke("merge", "--cache", s3.url, env=node(s3, "b", tmp_path, counting_encoder))
    (line,) = [ln for ln in listed.stdout.splitlines() if ln.startswith("pending: root ")]
    root = line.split()[2].rstrip(":")
    assert f"`featbake merge --abandon {root}` if a part was killed for good" in line, line
    got = invoke(
        "merge", "--cache", s3.url, "--abandon", root,
        env=node(s3, "b", tmp_path, counting_encoder),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert f"abandoned: the unfinished builds of root {root}" in got.stdout
    assert not s3.objects("fragments/")
    fresh = invoke("roots", "--cache", s3.url, env=node(s3, "c", tmp_path, counting_encoder))
    assert fresh.returncode == 0 and "pending" not in fresh.stdout, fresh.stdout + fresh.stderr
    whole = invoke(*build_args(clips, s3.url), env=node(s3, "c", tmp_path, counting_encoder))
    assert whole.returncode == 0, whole.stderr
    assert len(encoded_rows(counting_encoder)) == 24  # the sealed half reused, the rest encoded
    assert 0 < sealed < 24
    assert_bucket_serves_live(s3, clips, tmp_path)


@pytest.mark.parametrize("step", ["rows", "published"])
def test_a_merge_killed_at_any_step_loses_nothing(
    place: Place,
    clips: Path,
    tmp_path: Path,
    counting_encoder: dict[str, str],
    step: str,
    monkeypatch,
) -> None:
    monkeypatch.syspath_prepend(counting_encoder["PYTHONPATH"].split(os.pathsep)[1])
    for i in range(2):
        part = invoke(
            *build_args(clips, place.url), "--shard", f"{i}/2",
            env=node(place, "a", tmp_path, counting_encoder),
        )  # fmt: skip
        assert part.returncode == 0, part.stderr
    killer = (
        "import os, sys\n"
        "from featbake.store.open import open_store\n"
        "from featbake.store.bucket import merge_bucket\n"
        "def hook(step):\n"
        f"    if step == {step!r}: os.kill(os.getpid(), 9)\n"
        f"merge_bucket(open_store({place.url!r}).remote, between=hook)\n"
    )
    env = {**os.environ, **node(place, "m", tmp_path, counting_encoder), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", killer], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert place.objects("fragments/")  # nothing deleted before the version was published
    rerun = merge_bucket(bucket_store(place.url, tmp_path / "node-m2"))
    assert rerun.fragments >= 2
    assert not place.objects("fragments/")
    assert_bucket_serves_live(place, clips, tmp_path)


def test_two_merges_racing_for_one_version_lose_nothing(
    place: Remote | S3, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Two nodes merge the same parts at once: the second publishes version 1 while the first
    is between its rows and its publish. The first's create-only put of version 1 is refused
    (on every cloud), it starts again from the newer version, and version 1 is never
    overwritten; every item is served, equal to the encoder run now."""
    from featbake.bake.pipeline import build
    from featbake.store.objects import ObjectStore
    from featbake.store.url import BucketURL

    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=place.url, workers=0, shard=part, shard_bytes=60_000)
    first = bucket_store(place.url, tmp_path / "m1")
    second = bucket_store(place.url, tmp_path / "m2")
    objects = ObjectStore(BucketURL.parse(place.url))
    published: list[str] = []

    def meanwhile(step: str) -> None:
        if step == "rows" and not published:
            merge_bucket(second)  # the other node wins the race for version 1
            info = objects.head("catalog/v000000001.sqlite")
            assert info is not None
            published.append(info.etag)

    merge_bucket(first, between=meanwhile)
    assert published  # the race happened
    kept = objects.head("catalog/v000000001.sqlite")
    assert kept is not None and kept.etag == published[0]  # never overwritten
    assert_merged_into_one_version(place, audio_dir, encoder_file, tmp_path / "reader")


def assert_merged_into_one_version(
    place: Remote | S3, data: Path, encoder: Path, reader: Path
) -> None:
    """The bucket holds one catalog version and no fragment, and a reader through the local
    cache ``reader`` serves all 16 items of ``data``, each equal to the encoder run now."""
    assert place.objects("catalog/") == ["catalog/v000000001.sqlite"]
    assert not place.objects("fragments/")
    ds = CachedFeatureDataset(data, encoder, cache=place.url, local_cache=reader, on_miss="error")
    assert len(ds) == 16
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder, Path(ds.path(i))))


#: Bounds on waiting for another thread: a hang fails, a slow machine passes.
BOUND_S = 300.0


def test_two_merges_on_one_node_take_turns_the_second_saying_so_once(
    s3: S3, audio_dir: Path, encoder_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two merges of a bucket through one node's local cache (two ranks' ends, a user's merge
    beside one): the second, started while the first folds, says once that it waits, naming
    the bucket and the node's cache, then finds nothing left; one version is published, no
    fragment is left, and every item is served equal to the encoder run now. Before, both
    folded the tier's copies of the same fragments at once (one's retire unlinking what the
    other links), as merges on two nodes race."""
    from featbake.bake.pipeline import build

    for part in ("0/2", "1/2"):
        build(audio_dir, encoder_file, cache=s3.url, workers=0, shard=part, shard_bytes=60_000)
    tier = tmp_path / "node-a"
    heard: list[str] = []
    folding, moved = threading.Event(), threading.Event()  # the first folds; the second moved

    def shown(message: object, category: type, *args: object, **kwargs: object) -> None:
        if "another merge of" in str(message):
            heard.append(str(message))
            moved.set()

    def hold(step: str) -> None:
        if step == "rows" and not folding.is_set():
            folding.set()
            assert moved.wait(BOUND_S)

    seconds: list[int] = []

    def second() -> None:
        try:
            assert folding.wait(BOUND_S)
            seconds.append(merge_bucket(bucket_store(s3.url, tier)).fragments)
        finally:
            moved.set()  # (where it never waited: the first goes on once it is done)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", shown)
        other = threading.Thread(target=second)
        other.start()
        try:
            first = merge_bucket(bucket_store(s3.url, tier), between=hold)
        finally:
            other.join(BOUND_S)
    assert len(heard) == 1 and "\n" not in heard[0], heard
    assert heard[0].startswith(f"another merge of {s3.url} on this node (local cache {tier}")
    assert first.fragments >= 2 and seconds == [0]
    assert_merged_into_one_version(s3, audio_dir, encoder_file, tmp_path / "reader")


def test_misses_served_from_a_bucket_are_written_back_and_merged(
    place: Place, audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "t1")
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))
    ds.close()  # seals the write-back shard: its fragment and shard go to the bucket
    assert place.objects("fragments/") and place.objects("shards/")
    other_node = {**place.env, "FEATBAKE_LOCAL_CACHE": str(tmp_path / "t2")}
    merged = invoke("merge", "--cache", place.url, env=other_node)
    assert merged.returncode == 0, merged.stderr
    again = CachedFeatureDataset(
        audio_dir, encoder_file, cache=place.url, local_cache=tmp_path / "t3", on_miss="error"
    )
    for i in range(len(again)):
        torch.testing.assert_close(again[i], live_features(encoder_file, Path(again.path(i))))


def test_a_read_never_waits_for_a_write_back_fragments_upload(
    place: Place, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A serving FragmentCatalog over a bucket store uploads each write-back's shard and
    fragment as it seals them; it held its lock through the upload, so every read of the
    process's other threads (a loader's read thread) waited for it. With the fragment's upload
    held up, a read of a key in an earlier fragment returns; released, the fragment reaches the
    bucket and a merge from another node publishes both features."""
    layout = open_store(place.url, local_cache=tmp_path / "tier")
    efp, rfp = "e" * 64, "r" * 64
    earlier_key, written_key = "a" * 64, "b" * 64
    earlier = FragmentCatalog(layout)  # this node's earlier write-back, not merged yet
    kept = write_shard(layout, {earlier_key: torch.ones(3)}, efp, rfp)
    earlier.add_shard(kept)
    earlier.close()

    assert layout.remote is not None
    bucket = layout.remote.bucket
    real_upload, entered, release = bucket.upload, threading.Event(), threading.Event()

    def held_up(name: str, src: Path, **kw: bool) -> bool:  # the one point patched
        if name.startswith("fragments/"):
            entered.set()
            release.wait(timeout=120)  # released by the test; bounded so nothing hangs for good
        return real_upload(name, src, **kw)

    monkeypatch.setattr(bucket, "upload", held_up)
    serving = FragmentCatalog(layout)
    shard = write_shard(layout, {written_key: torch.full((2,), 2.0)}, efp, rfp)
    sealer = threading.Thread(target=serving.add_shard, args=(shard,))
    found: dict = {}
    reader = threading.Thread(target=lambda: found.update(serving.locate_many([earlier_key])))
    try:
        sealer.start()
        assert entered.wait(timeout=60), "the seal never uploaded its fragment"
        reader.start()
        reader.join(timeout=30)  # a bound on a hang, not a speed: it returns in milliseconds
        assert not reader.is_alive(), "a read waited for another thread's fragment upload"
        assert sealer.is_alive() and len(place.objects("fragments/")) == 1  # still held up
    finally:
        release.set()
        sealer.join(timeout=60)
        reader.join(timeout=60)
    assert [loc.shard for loc in found[earlier_key]] == [kept.name]
    assert not sealer.is_alive() and len(serving.fragments) == 1
    assert len(place.objects("fragments/")) == 2
    serving.close()
    merge_bucket(bucket_store(place.url, tmp_path / "node-m"))
    fresh = bucket_store(place.url, tmp_path / "node-r")
    fresh.sync_catalog()
    with Catalog(fresh.layout, read_only=True) as cat:
        assert cat.present_keys([earlier_key, written_key]) == {earlier_key, written_key}


# A build into a bucket writes fragments, and recorded none of the inputs it could not decode:
# a dataset counted a corrupt input as an item and failed on it (on_miss="error"). Its done
# fragment now carries them, and the merge that publishes the catalog version records them.
@pytest.mark.parametrize("parts", [1, 2])
def test_a_bucket_build_records_an_undecodable_input_and_the_dataset_leaves_it_out(
    place: Place, clips: Path, tmp_path: Path, encoder_file: Path, parts: int
) -> None:
    (clips / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    env = {**place.env, "FEATBAKE_LOCAL_CACHE": str(tmp_path / "node")}
    args = ["build", "-e", encoder_file, "-d", clips, "--cache", place.url, "--workers", "0"]
    shards = [[]] if parts == 1 else [["--shard", f"{i}/{parts}"] for i in range(parts)]
    codes = [invoke(*args, *shard, env=env).returncode for shard in shards]
    assert sorted(codes)[-1] == 3, codes  # the part holding the broken input says so
    if parts > 1:
        merged = invoke("merge", "--cache", place.url, env=env)
        assert merged.returncode == 0, merged.stderr
    assert not place.objects("fragments/")
    with pytest.warns(UserWarning) as caught:
        ds = CachedFeatureDataset(
            clips, encoder_file, cache=place.url, local_cache=tmp_path / "node", on_miss="error"
        )
    said = [str(w.message) for w in caught if "could not be decoded" in str(w.message)]
    assert len(said) == 1 and "1 input(s)" in said[0] and "broken.wav" in said[0], said
    ids = [ds.item_id(i) for i in range(len(ds))]
    assert "broken.wav" not in ids and len(ids) == 24
    for i in range(len(ds)):
        want = live_features(encoder_file, Path(ds.path(i)))
        torch.testing.assert_close(ds[i], want, rtol=1e-4, atol=1e-5)


# The record of those inputs stayed in the merging node's tier (its roots/, never uploaded): a
# dataset on any other node called the broken input an item again, and a merge from a fresh
# tier started from no record. It now travels inside the catalog version publishing the root.
def test_a_bucket_builds_undecodable_record_reaches_a_dataset_on_a_fresh_tier(
    place: Place, clips: Path, encoder_file: Path, tmp_path: Path
) -> None:
    """Issue "round five" item 3: a dataset on another node (a fresh tier over the same
    bucket) leaves the input out with one warning, as on the node that merged."""
    from featbake.bake.pipeline import build

    (clips / "broken.wav").write_bytes(b"RIFF\x00\x00junk")
    report = build(clips, encoder_file, cache=place.url, workers=0)
    assert report.encoded == 24 and not place.objects("fragments/")
    with pytest.warns(UserWarning) as caught:
        ds = CachedFeatureDataset(
            clips, encoder_file, cache=place.url, local_cache=tmp_path / "fresh", on_miss="error"
        )
    said = [str(w.message) for w in caught if "could not be decoded" in str(w.message)]
    assert len(said) == 1 and "1 input(s)" in said[0] and "broken.wav" in said[0], said
    ids = [ds.item_id(i) for i in range(len(ds))]
    assert "broken.wav" not in ids and len(ids) == 24
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live_features(encoder_file, Path(ds.path(i))))


def _build_of_r(place: Place, tier: Path, keys: list[str], failed: dict[str, str]) -> None:
    """A finished build of root ``r`` from its own node (tier ``tier``) whose manifest names
    ``keys`` (none stored) and whose ``done`` fragment carries ``failed`` (none: as a rank of
    an earlier featbake wrote it)."""
    layout = open_store(place.url, local_cache=tier)
    efp = "e" * 64
    rank = FragmentCatalog(layout, RankPart(0, 1, [(f"{k[-3:]}.wav", 10) for k in keys]))
    rank.record_encoder(efp, "enc", "torchscript")
    items = [(f"{k[-3:]}.wav", k) for k in keys]
    rank.replace_root(RootSpec("r", "/d", "enc", efp, "r" * 64, {}), items)
    rank.record_undecodable("r", failed)
    assert rank.finish() is not None
    rank.close()


def test_a_bucket_merge_folds_the_undecodable_record_of_the_version_it_starts_from(
    place: Place, tmp_path: Path
) -> None:
    """Issue "round five" item 3: each merge, from a fresh tier, starts from the record the
    newest catalog version carries (a merge from a fresh tier lost an earlier build's record),
    and a tier installing a version gets exactly its records (one removed is gone there too)."""
    from featbake.store.roots import read_undecodable

    keys = [f"{i:064x}" for i in range(3)]
    broken = {keys[1]: "not audio"}

    def record_on_fresh_tier(name: str) -> dict[str, str]:
        return read_undecodable(open_store(place.url, local_cache=tmp_path / name), "r")

    _build_of_r(place, tmp_path / "b1", keys, broken)
    merge_bucket(bucket_store(place.url, tmp_path / "m1"))
    assert record_on_fresh_tier("reader1") == broken
    _build_of_r(place, tmp_path / "b2", keys, {})  # its rank recorded none: the record stands
    merger = bucket_store(place.url, tmp_path / "m2")
    merge_bucket(merger)
    assert read_undecodable(merger.layout, "r") == broken  # folded where it merged
    assert record_on_fresh_tier("reader2") == broken
    _build_of_r(place, tmp_path / "b3", [keys[0], keys[2]], {})  # the input is gone
    merge_bucket(bucket_store(place.url, tmp_path / "m3"))
    assert record_on_fresh_tier("reader3") == {}
    bucket_store(place.url, tmp_path / "reader1").sync_catalog()  # a tier that held the record
    assert read_undecodable(open_store(place.url, local_cache=tmp_path / "reader1"), "r") == {}


def _rank_of(place: Place, tmp_path: Path, n: int, clock: list[float]):
    """A build rank into ``place``'s bucket over ``n`` inputs (keys ``k0``..), its clock the
    test's; its manifest recorded, no shard sealed yet."""
    layout = open_store(place.url, local_cache=tmp_path / "tier")
    efp, rfp = "e" * 64, "r" * 64
    keys = [f"{i:064x}" for i in range(n)]
    listing = [(f"{i:03d}.wav", 10) for i in range(n)]
    rank = FragmentCatalog(
        layout, RankPart(0, 1, listing), batching=Batching(clock=lambda: clock[0])
    )
    rank.record_encoder(efp, "enc", "torchscript")
    items = [(path, key) for (path, _), key in zip(listing, keys, strict=True)]
    rank.replace_root(RootSpec("r", "/d", "enc", efp, rfp, {}), items)
    return layout, rank, keys


def test_a_bucket_build_uploads_its_part_fragments_in_batches_each_row_once(
    place: Place, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank into a bucket uploaded a ``part`` fragment after every shard it sealed: 50 PUTs
    for 50 shards. Now the fragment goes when the rows not named yet reach those named (or are
    ``max_age_s`` old, or at finish): O(log N) fragment PUTs, each row in one fragment, so the
    fragments' bytes stay within a constant of one fragment naming them all. Every shard is
    uploaded as it is sealed, and a merge from another node publishes every feature."""
    n, clock = 50, [0.0]
    layout, rank, keys = _rank_of(place, tmp_path, n, clock)
    assert layout.remote is not None
    bucket = layout.remote.bucket
    real_upload, puts = bucket.upload, []

    def counted(name: str, src: Path, **kw: bool) -> bool:  # the one point patched
        puts.append((name, src.stat().st_size))
        return real_upload(name, src, **kw)

    monkeypatch.setattr(bucket, "upload", counted)
    for i, key in enumerate(keys):
        rank.add_shard(write_shard(layout, {key: torch.full((3,), float(i))}, "e" * 64, "r" * 64))
        assert sum(1 for name, _ in puts if name.startswith("shards/")) == i + 1  # at once
    assert rank.finish() is not None
    rank.close()
    fragments = [(name, size) for name, size in puts if name.startswith("fragments/")]
    assert len(fragments) <= 2 + n.bit_length()  # 1, 1, 2, 4, ... shards each, then done
    one = max(size for _, size in fragments)  # the done fragment, the largest
    # A fragment is mostly its SQLite schema's pages (64 KiB for one shard here): the bytes
    # follow the count, 51 fragments (3.3 MB) before, 7 (0.47 MB) now.
    assert sum(size for _, size in fragments) <= (2 + n.bit_length()) * one

    merge_bucket(bucket_store(place.url, tmp_path / "node-m"))
    fresh = bucket_store(place.url, tmp_path / "node-r")
    fresh.sync_catalog()
    with Catalog(fresh.layout, read_only=True) as cat:
        assert cat.present_keys(keys) == set(keys)


def test_a_rank_uploads_a_fragment_once_its_oldest_unnamed_shard_is_old(
    place: Place, tmp_path: Path
) -> None:
    """However few rows are pending, a shard sealed ``max_age_s`` ago (the rank's own clock, no
    sleeps) is named by an uploaded fragment at the next seal: what a kill can lose is bounded
    in time too."""
    clock = [0.0]
    layout, rank, keys = _rank_of(place, tmp_path, 8, clock)
    for i, key in enumerate(keys[:5]):
        rank.add_shard(write_shard(layout, {key: torch.full((3,), float(i))}, "e" * 64, "r" * 64))
    assert len(place.objects("fragments/")) == 3  # 1, 1, 2 shards; the 5th waits (1 < 4)
    clock[0] += Batching().max_age_s
    rank.add_shard(write_shard(layout, {keys[5]: torch.ones(3)}, "e" * 64, "r" * 64))
    assert len(place.objects("fragments/")) == 4  # the 5th and 6th, though 2 < 4 named
    rank.close()
