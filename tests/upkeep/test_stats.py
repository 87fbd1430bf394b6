"""stats and roots: numbers checked against the shard files themselves, not the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featbake.errors import ConfigError, StoreError
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.roots import read_root_file
from featbake.store.shard import ShardReader
from featbake.testing import TinyConvEncoder, save_torchscript
from featbake.upkeep import GcOptions, drop_root, execute_gc, list_roots, plan_gc, stats
from tests.helpers import bake, manifest, shard_files


def _tensor_bytes(store: Path) -> dict[str, tuple[str, int]]:
    """key -> (encoder fp, bytes of its tensors), read from the shard headers."""
    out: dict[str, tuple[str, int]] = {}
    for p in shard_files(store):
        with ShardReader(p) as r:
            for name, info in r.tensors.items():
                key = name.partition("/")[0]
                fp, n = out.get(key, (r.metadata["encoder_fp"], 0))
                out[key] = (fp, n + info.end - info.begin)
    return out


def test_stats_match_the_shard_files(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    old = bake(audio_dir, encoder_file, store_dir)
    second = bake(audio_dir / "fixed", other, store_dir)
    save_torchscript(TinyConvEncoder(seed=7), encoder_file)
    new = bake(audio_dir, encoder_file, store_dir)
    (store_dir / "tmp" / "left.part").write_bytes(b"x" * 10)

    s = stats(store_dir)
    truth = _tensor_bytes(store_dir)
    live = {k for r in (new.root, second.root) for _, k in manifest(store_dir, r)}
    assert s.features == s.tensors == len(truth) == 16 + 4 + 16
    assert s.disk_bytes == sum(shard_files(store_dir).values())
    assert s.live_features == len(live) == 20
    assert s.live_bytes == sum(truth[k][1] for k in live)
    assert s.dead_bytes == sum(n for k, (_, n) in truth.items() if k not in live)
    assert (s.tmp_files, s.tmp_bytes) == (1, 10)
    by_fp = {e.fp: e for e in s.encoders}
    for report, n in ((old, 16), (new, 16), (second, 4)):
        e = by_fp[report.encoder_fp]
        assert e.tensors == n and e.label == report.encoder  # single-output: one tensor each
        assert e.bytes == sum(b for fp, b in truth.values() if fp == report.encoder_fp)
    roots = {r.name: r for r in s.roots}
    assert set(roots) == {new.root, second.root}
    assert (roots[new.root].items, roots[new.root].missing) == (16, 0)
    assert roots[second.root].data == str(audio_dir / "fixed")
    json.dumps(s.to_json())  # JSON-ready


def test_stats_count_missing_items_after_eviction(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    report = bake(audio_dir, encoder_file, store_dir, shard_bytes=40_000)
    budget = sum(shard_files(store_dir).values()) // 3
    plan = plan_gc(store_dir, GcOptions(max_bytes=budget))
    execute_gc(plan)
    (root,) = list_roots(store_dir)
    assert root.name == report.root
    assert root.missing == len({r.key for r in plan.evict}) > 0
    assert stats(store_dir).features == 16 - root.missing


def test_roots_have_manifest_files_and_drop_by_prefix(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    a = bake(audio_dir, encoder_file, store_dir)
    b = bake(audio_dir, other, store_dir)
    root, items = read_root_file(store_dir / "roots" / f"{a.root}.json")
    assert items == manifest(store_dir, a.root) and root.encoder_fp == a.encoder_fp
    for prefix in ("", "r", "r-", "r-" + a.root[2]):  # every root's, or too short to be one's
        with pytest.raises(ConfigError, match="too short a prefix"):
            drop_root(store_dir, prefix)
    with pytest.raises(ConfigError, match="no root"):
        drop_root(store_dir, "r-zzz")
    assert drop_root(store_dir, b.root[:8]).name == b.root
    assert [r.name for r in list_roots(store_dir)] == [a.root]
    assert not (store_dir / "roots" / f"{b.root}.json").exists()
    assert not list((store_dir / "roots").glob("*.dropped"))
    assert Catalog(Layout(store_dir)).root_items(b.root) == []


def test_stats_without_a_store_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no featbake store"):
        stats(tmp_path / "nowhere")


def test_a_multi_output_feature_counts_once(
    multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    bake(audio_dir, multi_encoder_file, store_dir)
    s = stats(store_dir)
    assert (s.features, s.live_features, s.dead_features) == (16, 16, 0)
    assert s.live_bytes == sum(n for _, n in _tensor_bytes(store_dir).values())


def test_dead_features_are_what_gc_frees_while_a_build_in_parts_waits_for_its_merge(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round six, upkeep: a build in two parts that reused every stored feature, its root
    dropped before the merge. gc keeps what sealed build fragments name, yet stats counted
    those 16 features dead ("gc frees them") while gc freed none. stats counts them live now,
    by gc's own rule; once the merge publishes the root, the numbers are those of the root."""
    from featbake.bake.pipeline import build
    from featbake.store.merge import merge

    first = bake(audio_dir, encoder_file, store_dir)
    before = stats(store_dir)
    for part in ("0/2", "1/2"):
        assert build(audio_dir, encoder_file, cache=store_dir, workers=0, shard=part).ok
    drop_root(store_dir, first.root)

    waiting = stats(store_dir)
    plan = plan_gc(store_dir, GcOptions())
    assert len({r.key for r in plan.unreached}) == waiting.dead_features == 0
    assert sum(r.nbytes for r in plan.unreached) == waiting.dead_bytes == 0
    assert (waiting.live_features, waiting.live_bytes) == (16, before.live_bytes)
    merge(Layout(store_dir))
    merged = stats(store_dir)
    assert (merged.live_features, merged.live_bytes, merged.dead_features) == (
        16,
        before.live_bytes,
        0,
    )


def test_dead_features_are_what_gc_frees_while_a_build_part_still_runs(
    encoder_file: Path, audio_dir: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round seven, upkeep: a part still running that reused stored features holds them by a
    claim (gc keeps what live claims name, up7.1), yet stats counted them dead ("gc frees
    them") while the part ran. stats counts them live now, by gc's own rule: what stats calls
    dead, in features and bytes, is what gc's plan frees at that moment."""
    from featbake.bake.pipeline import build
    from featbake.store.fragment_catalog import FragmentCatalog

    first = bake(audio_dir, encoder_file, store_dir)
    drop_root(store_dir, first.root)
    sealing = FragmentCatalog.finish
    seen: list[tuple[int, int, int, int]] = []

    def look_then_finish(self: FragmentCatalog) -> str | None:
        if not seen:  # the part's lookups are made, its claim held, nothing sealed yet
            now = stats(store_dir)
            plan = plan_gc(store_dir, GcOptions())
            freed = (len({r.key for r in plan.unreached}), sum(r.nbytes for r in plan.unreached))
            seen.append((now.dead_features, now.dead_bytes, *freed))
        return sealing(self)

    monkeypatch.setattr(FragmentCatalog, "finish", look_then_finish)
    part = build(audio_dir, encoder_file, cache=store_dir, workers=0, shard="0/2")
    assert part.encoded == 0 and part.reused > 0
    ((dead, dead_bytes, freed, freed_bytes),) = seen
    assert (dead, dead_bytes) == (freed, freed_bytes)
    assert dead == 16 - part.reused  # only what the other part would name


def test_stats_while_a_build_commits_adds_up_one_moment(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path, monkeypatch
) -> None:
    """Round six, upkeep: stats read the shards' usage and the shard rows as two statements; a
    build committing between them made the new shards count in `shards`, their bytes on disk
    and "unreferenced inside shards" (their tensors missing from the usage), a state the store
    never was in. The shard reads are one snapshot now: the numbers are those of before the
    build, whole."""
    from featbake.store.catalog import UpkeepRows

    bake(audio_dir / "fixed", encoder_file, store_dir)
    before = stats(store_dir)
    real = UpkeepRows.shard_usage
    built: list[object] = []

    def usage_then_a_build(self):  # the build commits right after stats read the usage
        usage = real(self)
        if not built:
            built.append(bake(audio_dir, encoder_file, store_dir))
        return usage

    monkeypatch.setattr(UpkeepRows, "shard_usage", usage_then_a_build)
    during = stats(store_dir)
    assert built
    assert during.unreferenced_bytes == 0
    assert (during.shards, during.disk_bytes, during.tensors) == (
        before.shards,
        before.disk_bytes,
        before.tensors,
    )
    assert sum(e.shards for e in during.encoders) == during.shards
