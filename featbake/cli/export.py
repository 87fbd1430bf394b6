"""`featbake export`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from featbake.cli.app import (
    UPKEEP_EXIT_CODES,
    CacheOpt,
    JsonOpt,
    LocalCacheOpt,
    LocalCacheSizeOpt,
    app,
    out,
)
from featbake.cli.render import progress_bar, tick_bar
from featbake.units import format_bytes


@app.command(
    epilog=(
        "Examples:\n\n  featbake export --format zarr feats.zarr\n\n"
        "  featbake export --format zarr feats.zarr --root r-3f1c --overwrite\n\n"
        "Read it back without featbake:\n\n"
        "  g = zarr.open_group('feats.zarr', mode='r'); o = g['offsets'][:]\n\n"
        "  first = g['values'][o[0]:o[1]]\n\n" + UPKEEP_EXIT_CODES
    )
)
def export(
    out_path: Annotated[Path, typer.Argument(metavar="OUT", help="The Zarr store to create.")],
    fmt: Annotated[str, typer.Option("--format", help="Output format: zarr.")] = "zarr",
    root: Annotated[
        str | None,
        typer.Option(
            help="Root to export (name or prefix); needed if there are several.", show_default=False
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a root's features to Zarr (v3), readable by zarr, xarray or dask without featbake.

    Variable-length features become values [sum T, D] + offsets [N+1] + lengths; fixed-size ones
    a dense values [N, ...]; keys and paths [N] follow the root's file order.
    """
    from featbake.errors import ConfigError, StoreError
    from featbake.export.zarr import export_zarr
    from featbake.store.open import open_store

    if fmt != "zarr":
        raise ConfigError(f"unknown --format {fmt!r}; featbake exports zarr")
    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    bar = progress_bar()
    try:
        with bar:
            report = export_zarr(
                out_path, cache=store, root=root, overwrite=overwrite, progress=tick_bar(bar, {})
            )
    except OSError as e:  # the OS refused a path: OUT's folder is missing, read-only, not a folder
        where = e.filename if e.filename is not None else out_path
        raise StoreError(
            f"cannot write the export {out_path}: {e.strerror or e} ({where}); choose an OUT "
            "inside a folder you can write to"
        ) from e
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        out.print(
            f"exported {report.items:,} items of root {report.root} "
            f"({', '.join(f'{p or chr(39) * 2}: {k}' for p, k in report.layouts.items())}; "
            f"{format_bytes(report.bytes)}) to {escape(report.out)}"
            + (f"; {report.missing} items not stored were left out" if report.missing else "")
        )
