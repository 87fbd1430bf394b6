"""`featbake gc`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from featbake.cli.app import (
    UPKEEP_EXIT_CODES,
    CacheOpt,
    JsonOpt,
    LocalCacheOpt,
    LocalCacheSizeOpt,
    app,
    console,
    out,
)
from featbake.cli.render import progress_bar, tick_bar
from featbake.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from featbake.store.layout import Layout
    from featbake.upkeep import GcOptions, GcPlan


@app.command(
    epilog=(
        "Examples:\n\n  featbake gc --dry-run\n\n  featbake gc\n\n"
        "  featbake gc --older-than 30d --max-bytes 200GiB\n\n"
        "  featbake gc --compact-below 0.8 --merge-small --json\n\n"
        "  featbake gc --cache s3://team-bucket/features --older-than 30d --retention 7d\n\n"
        + UPKEEP_EXIT_CODES
    )
)
def gc(
    cache: CacheOpt = None,
    older_than: Annotated[
        str | None,
        typer.Option(
            help="Drop roots neither built nor used for this long, e.g. 30d.", show_default=False
        ),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(
            help="Evict least-recently-used features until the shards fit, e.g. 200GiB.",
            show_default=False,
        ),
    ] = None,
    compact_below: Annotated[
        float,
        typer.Option(help="Rewrite a shard holding garbage once its live share falls under this."),
    ] = 0.5,
    merge_small: Annotated[
        bool, typer.Option(help="Also merge shards smaller than a quarter of --shard-size.")
    ] = False,
    grace: Annotated[
        str,
        typer.Option(help="Leave unnamed shard files and tmp/ files alone until this old."),
    ] = "1h",
    shard_size: Annotated[
        str, typer.Option(help="Target size of shards written by compaction.")
    ] = "256MiB",
    retention: Annotated[
        str,
        typer.Option(
            help="A bucket store (s3://): keep what catalog versions retired less than this long "
            "ago name, for readers still holding them."
        ),
    ] = "7d",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would go and how many bytes it frees.")
    ] = False,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Free what no live root reaches; optionally drop old roots and fit a byte budget.

    Removes features of old encoders, changed or deleted files and dropped roots; rewrites
    shards that are mostly garbage; removes stale tmp/ leftovers. Safe to interrupt at any point
    (a rerun finishes the job) and safe while training reads the store. On a bucket store it
    publishes the catalog's new version, never rewrites shards, and deletes objects only once
    no version younger than --retention names them.
    """
    from featbake.units import parse_duration
    from featbake.upkeep import GcOptions, execute_gc, plan_gc

    opts = GcOptions(
        older_than=parse_duration(older_than) if older_than else None,
        max_bytes=parse_bytes(max_bytes) if max_bytes else None,
        compact_below=compact_below,
        grace=parse_duration(grace),
        shard_bytes=parse_bytes(shard_size),
        merge_small=merge_small,
    )
    from featbake.store.open import Need, open_store

    layout = open_store(
        cache, need=Need.CATALOG, local_cache=local_cache, local_cache_size=local_cache_size
    )
    if layout.remote is not None:
        _gc_bucket(layout, opts, parse_duration(retention), dry_run, as_json)
        return
    plan = plan_gc(layout, opts)
    summary = plan.summary()
    if dry_run or not as_json:
        _print_gc_plan(plan, dry_run, as_json)
    if dry_run:
        return
    bar = progress_bar()
    with bar:
        result = execute_gc(plan, progress=tick_bar(bar, {}))
    if as_json:
        out.print_json(json.dumps({"plan": summary, "result": result.to_json()}))
    else:
        out.print(
            f"gc: dropped {len(result.roots_dropped)} roots, {result.rows_deleted:,} feature "
            f"rows, {result.shards_deleted:,} shards; wrote {result.shards_written} shards "
            f"({result.features_moved:,} moved); freed {format_bytes(max(0, result.bytes_freed))} "
            f"in {result.seconds:.2f}s"
        )
    for p in result.problems:
        console.print(f"[yellow]warning:[/] {escape(p)}")


def _gc_bucket(
    layout: Layout, opts: GcOptions, retention: float, dry_run: bool, as_json: bool
) -> None:
    """``featbake gc`` on a bucket store (featbake.upkeep.gc_bucket), and its one line."""
    from featbake.upkeep.gc_bucket import gc_bucket

    result = gc_bucket(layout, opts, retention=retention, dry_run=dry_run)
    if as_json:
        out.print_json(json.dumps({"dry_run": dry_run, "result": result.to_json()}))
        return
    c = result.catalog
    verb = "would drop" if dry_run else "dropped"
    out.print(
        f"gc{' (dry run)' if dry_run else ''} of {layout.remote}: {verb} "
        f"{len(c.roots_dropped)} roots and {c.rows_deleted:,} feature rows"
        f"{' (a new catalog version)' if result.published else ''}; "
        f"{'would delete' if dry_run else 'deleted'} {result.versions_deleted} old catalog "
        f"versions and {result.shards_deleted} shards ({format_bytes(result.bytes_freed)}); "
        f"{result.young_shards} unnamed shards kept until they pass the retention period"
    )


def _print_gc_plan(plan: GcPlan, dry_run: bool, as_json: bool) -> None:
    """The plan as ``gc --json`` (only the plan) or as lines: what goes, and the bytes freed."""
    s = plan.summary()
    if as_json:
        out.print_json(json.dumps({"plan": s}))
        return
    head = "would free" if dry_run else "frees"
    if plan.nothing_to_do:
        out.print(
            "gc: nothing to do"
            + (
                f" ({s['orphan_shards_in_grace']} unnamed shards are within the grace period)"
                if s["orphan_shards_in_grace"]
                else ""
            )
        )
        return
    for d in plan.drop_roots:
        out.print(f"drop root {d.name} ({escape(d.data)}, {escape(d.encoder_label)}): {d.reason}")
    out.print(
        f"{s['unreached_features']:,} unreached features ({format_bytes(s['unreached_bytes'])}), "
        f"{s['evicted_features']:,} evicted ({format_bytes(s['evicted_bytes'])}); "
        f"{s['shards_deleted']} shards deleted, {s['shards_rewritten']} rewritten, "
        f"{s['orphan_shards']} unnamed shard files, {s['tmp_files']} tmp/ files: "
        f"{head} about {format_bytes(plan.freed_bytes)} of {format_bytes(s['disk_bytes'])}"
    )
