"""`featbake stats` and `featbake roots [drop NAME]`."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from featbake.cli.app import (
    UPKEEP_EXIT_CODES,
    CacheOpt,
    JsonOpt,
    LocalCacheOpt,
    LocalCacheSizeOpt,
    app,
    out,
)
from featbake.cli.render import format_when
from featbake.image_recipe import describe_fields
from featbake.units import format_bytes


@app.command(
    epilog=(
        "Examples:\n\n  featbake stats\n\n  featbake stats --cache /data/.featbake --json\n\n"
        + UPKEEP_EXIT_CODES
    )
)
def stats(
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show what the store holds: features, bytes, live and dead, per encoder and per root.

    Reads the catalog's rows, never a shard (well under a second on a million features). Live
    features are those some root reaches; dead ones are what `featbake gc` frees. On a bucket
    store it names the bucket and this node's local tier (--local-cache, its budget).
    """
    from featbake.store.open import open_store
    from featbake.upkeep import stats as run_stats

    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    s = run_stats(store)
    if as_json:
        out.print_json(json.dumps(s.to_json()))
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("store", escape(s.path))
    table.add_row(
        "features",
        f"{s.features:,} inputs, {s.tensors:,} tensors ({format_bytes(s.feature_bytes)})",
    )
    table.add_row("live", f"{s.live_features:,} ({format_bytes(s.live_bytes)})")
    table.add_row("dead", f"{s.dead_features:,} ({format_bytes(s.dead_bytes)}): gc frees them")
    table.add_row("shards", f"{s.shards:,} files, {format_bytes(s.disk_bytes)} on disk")
    if s.unreferenced_bytes:
        table.add_row("unreferenced", f"{format_bytes(s.unreferenced_bytes)} inside shards")
    table.add_row("tmp/", f"{s.tmp_files} leftovers ({format_bytes(s.tmp_bytes)})")
    table.add_row("catalog", format_bytes(s.catalog_bytes))
    if s.tier is not None:
        table.add_row(
            "local tier",
            f"{escape(s.tier.path)}: catalog version {s.tier.version}, "
            f"{format_bytes(s.tier.bytes)} of {format_bytes(s.tier.budget)}",
        )
    out.print(table)
    _print_encoders(s.encoders)
    _print_roots(s.roots)
    _print_pending(store)


def recipe_brief(recipe: dict) -> str:
    """e.g. ``audio 16kHz mono float32 crop 10s`` (the root's name covers the exact recipe)."""
    bits = [str(recipe.get("source", "?"))]
    if recipe.get("sample_rate"):
        bits.append(f"{recipe['sample_rate'] / 1000:g}kHz")
    if recipe.get("mono") is False:
        bits.append("multichannel")
    bits.append(str(recipe.get("dtype", "")))
    if recipe.get("max_seconds"):
        bits.append(f"crop {recipe['max_seconds']:g}s")
    if recipe.get("output") is not None:
        bits.append(f"output {recipe['output']}")
    if isinstance(recipe.get("image"), dict):  # the whole transform: it decides the pixels
        bits.append(describe_fields(recipe["image"]))
    if recipe.get("layers"):  # two roots differing only in --layers must not look alike
        bits.append("layers " + ",".join(str(x) for x in recipe["layers"]))
    if recipe.get("precision") not in (None, "", "fp32"):
        bits.append(f"{recipe['precision']} compute")
    return " ".join(bits)


def _record(head: str, fields: list[tuple[str, str]]) -> None:
    """One thing as a head line and indented ``label  value`` lines (fits 80 columns: only a
    long path runs past, and off a terminal nothing is ever split)."""
    out.print(head)
    for label, value in fields:
        out.print(f"  {label:<8} {value}")


def _print_encoders(encoders: Any) -> None:
    out.print(f"[bold]encoders[/] ({len(encoders)})")
    for e in encoders:
        _record(
            f"{e.fp[:12]}  {e.tensors:,} tensors, {format_bytes(e.bytes)}, "
            f"last used {format_when(e.last_used)}",
            [("encoder", escape(e.label)), ("kind", escape(e.kind))],
        )


def _print_roots(roots: Any) -> None:
    out.print(f"[bold]roots[/] ({len(roots)})")
    for r in roots:
        missing = f"[yellow]{r.missing:,} missing[/]" if r.missing else "0 missing"
        _record(
            f"{r.name}  {r.items:,} items, {missing}, last used {format_when(r.last_used)}",
            [
                ("data", escape(r.data)),
                ("encoder", escape(r.encoder_label)),
                ("recipe", escape(recipe_brief(r.recipe))),
                *_fidelity_row(r.fidelity),
            ],
        )


def _fidelity_row(fidelity: dict | None) -> list[tuple[str, str]]:
    """An int8/fp8 root's measured error against the encoder, as its build recorded it."""
    if fidelity is None:
        return []
    from featbake.quantize import Fidelity

    return [("fidelity", Fidelity.from_json(fidelity).summary())]


roots_app = typer.Typer(
    help="List the roots (one per data folder x encoder as named x recipe), or drop one.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(roots_app, name="roots")


@roots_app.callback(
    epilog=(
        "Examples:\n\n  featbake roots\n\n  featbake roots --json\n\n  featbake roots drop r-3f1c"
    )
)
def roots(ctx: typer.Context, cache: CacheOpt = None, as_json: JsonOpt = False) -> None:
    """List the roots: what each build published, and how many of its items are missing.

    A root keeps its features live; `featbake roots drop NAME` lets gc free them.
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = cache
        return
    from dataclasses import asdict

    from featbake.upkeep import list_roots

    rs = list_roots(cache)
    if as_json:
        out.print_json(json.dumps([asdict(r) for r in rs]))
    else:
        _print_roots(rs)
        _print_pending(cache)


def _print_pending(cache: Any) -> None:
    """Sharded builds whose fragments are not merged yet: their roots are not published."""
    from featbake.store.merge import pending_builds, serving_fragments
    from featbake.store.open import Need, open_store

    layout = open_store(cache, need=Need.STORE)
    for p in pending_builds(layout):
        out.print(f"[yellow]pending[/] {escape(p.describe())}; `featbake merge` when all are done")
    served = len(serving_fragments(layout))
    if served:
        out.print(
            f"[yellow]pending[/] {served} serving fragments (write-back and last uses of datasets "
            "on a shared filesystem); `featbake merge` folds them in"
        )


@roots_app.command(
    "drop",
    epilog="Examples:\n\n  featbake roots drop r-3f1c9a0e12ab\n\n  featbake roots drop r-3f1c",
)
def roots_drop(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The root's name, or a unique prefix of it.")],
    cache: CacheOpt = None,
) -> None:
    """Drop one root; its features stay until `featbake gc` frees them."""
    from featbake.upkeep import drop_root

    root = drop_root(cache if cache is not None else ctx.obj, name)
    out.print(
        f"dropped root {root.name} ({escape(root.data)}, {escape(root.encoder_label)}, "
        f"{root.items:,} items); run `featbake gc` to free what nothing else reaches"
    )
