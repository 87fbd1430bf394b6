"""`featbake merge`: fold the catalog fragments of sharded builds into the catalog."""

from __future__ import annotations

import json

from rich.markup import escape

from featbake.cli.app import UPKEEP_EXIT_CODES, CacheOpt, JsonOpt, app, console, out


@app.command(
    epilog=(
        "Examples:\n\n"
        "  featbake merge\n\n"
        "  sbatch --dependency=afterok:$ARRAY_JOB featbake-merge.sh   # after a SLURM array\n\n"
        + UPKEEP_EXIT_CODES
    )
)
def merge(cache: CacheOpt = None, as_json: JsonOpt = False) -> None:
    """Fold every finished sharded build (`build --shard I/N`, SLURM arrays) into the catalog.

    A build is merged once all its parts have sealed their fragment; builds still running are
    left for a later merge and listed. Safe to run while parts still run, safe to kill, and a
    second merge changes nothing. Under torchrun rank 0 merges by itself.
    """
    from featbake.store.open import Need, open_store
    from featbake.store.remote.publish import merge_store

    report = merge_store(open_store(cache, need=Need.STORE))
    if as_json:
        out.print_json(json.dumps(report.to_json()))
        return
    if report.roots or report.fragments:
        out.print(
            f"merged {report.fragments} fragments: {len(report.roots)} roots published, "
            f"{report.new_features:,} new features in {report.shards} shards"
        )
    else:
        out.print("nothing to merge")
    for p in report.pending:
        out.print(f"pending: {escape(p.describe())}")
    if report.missing_shards:
        console.print(
            f"[red]{len(report.missing_shards)} shards named by fragments are gone[/]; their "
            "features show as missing in `featbake roots`, and a rebuild encodes them again"
        )
