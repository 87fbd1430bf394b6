"""`featbake verify [--repair]`."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from featbake.cli.app import CacheOpt, JsonOpt, LocalCacheOpt, LocalCacheSizeOpt, app, out
from featbake.cli.render import progress_bar, tick_bar
from featbake.units import format_bytes

# == upkeep: stats, roots, gc, verify, export ===================================================
VERIFY_EXIT = """verify exit codes: 0 clean; 10 damage was found and repaired (--repair; features
in quarantined shards are gone: rebuild to recompute them); 11 damage remains (run with --repair,
or see the lines above). 5: the store cannot be opened at all."""


@app.command(
    epilog=(
        "Examples:\n\n  featbake verify\n\n  featbake verify --repair --json\n\n"
        "  featbake verify --cache s3://team-bucket/features\n\n" + VERIFY_EXIT
    )
)
def verify(
    cache: CacheOpt = None,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Rebuild the catalog from the shards and root manifests; quarantine damage.",
        ),
    ] = False,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check every shard's bytes and checksums, the catalog against the shards, and the hash
    cache against the input files it vouches for (read again).

    With --repair: intact tensors of a damaged shard are copied to a fresh shard, the damaged
    file moves to quarantine/, the catalog drops rows that point nowhere and indexes shards it
    lacked; a missing or unreadable catalog is rebuilt from the shard headers and roots/*.json;
    wrong hash-cache rows and all cached encoder fingerprints are dropped (computed again).
    --repair holds the store's write lock: builds, gc and write-back wait while it runs, and it
    refuses (exit 5) if they keep sealing shards for 10 s. A folder that is not a store is
    refused, never turned into one. A bucket store (s3://) is checked object by object (each
    shard object downloaded into the local tier's tmp/ and deleted after its check, whatever
    the tier holds), and named by its object key; there is no --repair there.
    """
    from featbake.upkeep import verify as run_verify

    bar = progress_bar()
    with bar:
        report = run_verify(
            cache,
            repair_damage=repair,
            progress=tick_bar(bar, {}),
            local_cache=local_cache,
            local_cache_size=local_cache_size,
        )
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        for f in report.findings:
            style = "red" if f.damage else "dim"
            out.print(f"[{style}]{f.kind}[/] {escape(f.subject)}: {escape(f.detail)}")
        for a in report.actions:
            out.print(f"[green]repair[/] {escape(a)}")
        for f in report.remaining if report.status != "clean" and repair else []:
            out.print(f"[red]remains[/] {f.kind} {escape(f.subject)}: {escape(f.detail)}")
        out.print(
            f"verify: {report.status} ({escape(report.store)}: {report.shards_checked} shards, "
            f"{format_bytes(report.bytes_checked)} read in {report.seconds:.2f}s)"
            + (
                f"; {report.features_lost} feature rows lost, rebuild to recompute them"
                if report.features_lost
                else ""
            )
        )
    if report.exit_code:
        raise typer.Exit(report.exit_code)
