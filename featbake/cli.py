"""The ``featbake`` command: parse options, call one library function, render with rich.

Known errors print one red line and exit with the code documented in :mod:`featbake.errors`;
a traceback appears only with ``FEATBAKE_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from featbake import __version__
from featbake.errors import BuildIncomplete, ConfigError, FeatbakeError
from featbake.units import format_bytes, parse_bytes

console = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False)

EXIT_CODES = """Exit codes: 0 ok, 2 bad option, 3 some inputs failed (the rest stored), 4 encoder
could not load or run, 5 store unwritable, 6 corrupt store data, 7 cache miss, 8 input unreadable,
130 interrupted (sealed work kept)."""

app = typer.Typer(
    name="featbake",
    help=(
        "Compute a frozen encoder's features once; serve them at training time.\n\n"
        "\b\n"
        "  featbake build --encoder ckpt.pt --data ./audio   # bake (again: nothing recomputed)\n"
        "  featbake stats                                    # what the store holds\n"
        "  featbake gc --dry-run                             # what gc would free\n"
        "  featbake verify                                   # check every checksum\n\n"
        "In Python: CachedFeatureDataset('./audio', encoder='ckpt.pt') serves the same keys.\n\n"
        "The store lives in --cache DIR (default $FEATBAKE_CACHE or ./.featbake). "
        "Run `featbake COMMAND --help` for a command's options and examples.\n\n" + EXIT_CODES
    ),
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache",
        envvar="FEATBAKE_CACHE",
        help="Store directory. [default: $FEATBAKE_CACHE or ./.featbake]",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print a JSON report on stdout, for scripts.")
]


def _version(value: bool) -> None:
    if value:
        out.print(f"featbake {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Compute a frozen encoder's features once; serve them at training time."""


class _Rate(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} items/s" if speed else "- items/s", style="cyan")


class _Bytes(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(format_bytes(int(task.fields.get("bytes", 0))), style="green")


def _progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<7}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        _Bytes(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


@app.command(
    epilog=(
        "Examples:\n\n"
        "  featbake build --encoder ckpt.pt --data ./audio\n\n"
        "  featbake build --encoder encoder.pt2 --data ./audio --max-seconds 10 --dtype float16\n\n"
        "  featbake build --encoder mypkg.models:build --weights w.safetensors --data ./audio "
        "--device cuda --json\n\n" + EXIT_CODES
    )
)
def build(
    encoder: Annotated[
        str,
        typer.Option(
            "--encoder",
            "-e",
            help="TorchScript (.pt), torch.export (.pt2) file, or import path pkg.module:factory.",
        ),
    ],
    data: Annotated[
        Path, typer.Option("--data", "-d", help="Folder of inputs (scanned recursively).")
    ],
    cache: CacheOpt = None,
    weights: Annotated[
        Path | None, typer.Option(help="safetensors weights for an import-path encoder.")
    ] = None,
    source: Annotated[str, typer.Option(help="Input kind: audio or npy.")] = "audio",
    sample_rate: Annotated[int, typer.Option(help="Resample audio to this rate (Hz).")] = 16000,
    mono: Annotated[
        bool, typer.Option(help="Mix audio to one channel (--no-mono keeps [C, T]).")
    ] = True,
    max_seconds: Annotated[
        float | None, typer.Option(help="Crop audio to its first N seconds.", show_default=False)
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            help="Store only this encoder output (dict key or tuple index).", show_default=False
        ),
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="Stored dtype: float32, float16 or bfloat16.")
    ] = "float32",
    batch_size: Annotated[int, typer.Option(help="Inputs per encoder call.")] = 16,
    workers: Annotated[int, typer.Option(help="Decoding worker processes (0: none).")] = 2,
    device: Annotated[str, typer.Option(help="Where the encoder runs: cpu, cuda, cuda:N.")] = "cpu",
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 256MiB.")] = "256MiB",
    strict: Annotated[
        bool, typer.Option(help="Stop at the first bad input instead of skipping it.")
    ] = False,
    trust_pickle: Annotated[
        bool,
        typer.Option(help="Allow a pickled whole-module checkpoint (loading it runs its code)."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run an encoder over a data folder once and store its features.

    Inputs already in the store are skipped (a rerun encodes nothing); bad inputs are skipped and
    listed at the end, and the exit code is then 3.
    """
    from featbake.build import build as run_build
    from featbake.recipe import Recipe

    recipe = Recipe(
        source=source,
        sample_rate=sample_rate,
        mono=mono,
        max_seconds=max_seconds,
        output=output,
        dtype=dtype,
    )
    try:
        shard_bytes = parse_bytes(shard_size)
    except ConfigError as e:
        raise ConfigError(f"--shard-size: {e}") from e
    bar = _progress_bar()
    on_progress = _tick_bar(bar, {})
    with bar:
        report = run_build(
            data,
            encoder,
            cache=cache,
            recipe=recipe,
            weights=weights,
            trust_pickle=trust_pickle,
            batch_size=batch_size,
            workers=workers,
            device=device,
            strict=strict,
            shard_bytes=shard_bytes,
            progress=on_progress,
        )
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        _print_build_summary(report)
    if report.failed:
        raise BuildIncomplete(
            f"{len(report.failed)} of {report.files} inputs failed (listed above); "
            "everything else is stored. Fix or remove them and rerun; finished work is not redone"
        )


def _print_build_summary(report: Any) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("root", report.root)
    table.add_row("encoder", f"{escape(report.encoder)} ({report.encoder_fp[:12]})")
    table.add_row("files", f"{report.files:,}")
    table.add_row("encoded", f"{report.encoded:,}")
    table.add_row("reused", f"{report.reused:,}")
    if report.duplicates:
        table.add_row("duplicates", f"{report.duplicates:,} (identical files share a feature)")
    table.add_row("failed", f"[red]{len(report.failed):,}[/]" if report.failed else "0")
    table.add_row(
        "written", f"{format_bytes(report.bytes_written)} in {report.shards_written} shards"
    )
    table.add_row("time", f"{report.seconds:.2f}s")
    out.print(table)
    for path, reason in report.failed[:50]:
        console.print(f"[red]failed[/] {escape(path)}: {escape(reason)}")
    if len(report.failed) > 50:
        console.print(f"[red]... and {len(report.failed) - 50} more (see --json)")


# == upkeep: stats, roots, gc, verify, export ===================================================
VERIFY_EXIT = """verify exit codes: 0 clean; 10 damage was found and repaired (--repair; features
in quarantined shards are gone: rebuild to recompute them); 11 damage remains (run with --repair,
or see the lines above). 5: the store cannot be opened at all."""


def _when(ts: float) -> str:
    import datetime as _dt

    if not ts:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


#: Without a terminal (CI logs, nohup), progress is one plain line per phase this often.
LOG_EVERY_S = 10.0


def _tick_bar(bar: Progress, tasks: dict[str, Any]) -> Any:
    """A library progress callback that drives ``bar``, or writes log lines without a terminal."""
    last_line: dict[str, float] = {}
    started: dict[str, float] = {}
    finished: set[str] = set()

    def log_line(p: Any, now: float) -> None:
        rate = p.done / max(now - started[p.phase], 1e-9)
        eta = f", ETA {(p.total - p.done) / rate:.0f}s" if rate and p.total else ""
        size = f", {format_bytes(p.bytes_written)}" if getattr(p, "bytes_written", 0) else ""
        console.print(f"{p.phase}: {p.done:,}/{p.total:,} ({rate:,.0f} items/s{eta}{size})")

    def on_progress(p: Any) -> None:
        if p.phase not in tasks:
            tasks[p.phase] = bar.add_task(p.phase, total=p.total or None)
            started[p.phase] = time.monotonic()
        bar.update(
            tasks[p.phase],
            completed=p.done,
            total=p.total or None,
            bytes=getattr(p, "bytes_written", 0),
        )
        if console.is_terminal or not p.total or p.phase in finished:
            return
        now = time.monotonic()
        if p.done >= p.total:
            finished.add(p.phase)
            log_line(p, now)
        elif now - last_line.get(p.phase, started[p.phase]) >= LOG_EVERY_S:
            last_line[p.phase] = now
            log_line(p, now)

    return on_progress


@app.command(
    epilog=(
        "Examples:\n\n  featbake stats\n\n  featbake stats --cache /data/.featbake --json\n\n"
        + EXIT_CODES
    )
)
def stats(cache: CacheOpt = None, as_json: JsonOpt = False) -> None:
    """Show what the store holds: features, bytes, live and dead, per encoder and per root.

    Reads the catalog only (well under a second on a million features). Live features are those
    some root reaches; dead ones are what `featbake gc` frees.
    """
    from featbake.upkeep import stats as run_stats

    s = run_stats(cache)
    if as_json:
        out.print_json(json.dumps(s.to_json()))
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("store", escape(s.path))
    table.add_row("features", f"{s.features:,} ({format_bytes(s.feature_bytes)})")
    table.add_row("live", f"{s.live_features:,} ({format_bytes(s.live_bytes)})")
    table.add_row("dead", f"{s.dead_features:,} ({format_bytes(s.dead_bytes)}): gc frees them")
    table.add_row("shards", f"{s.shards:,} files, {format_bytes(s.disk_bytes)} on disk")
    if s.unreferenced_bytes:
        table.add_row("unreferenced", f"{format_bytes(s.unreferenced_bytes)} inside shards")
    table.add_row("tmp/", f"{s.tmp_files} leftovers ({format_bytes(s.tmp_bytes)})")
    table.add_row("catalog", format_bytes(s.catalog_bytes))
    out.print(table)
    enc = Table(title="encoders", title_justify="left")
    for col in ("fingerprint", "encoder", "features", "bytes", "first seen", "last used"):
        enc.add_column(col, justify="right" if col in ("features", "bytes") else "left")
    for e in s.encoders:
        enc.add_row(
            e.fp[:12],
            escape(e.label),
            f"{e.features:,}",
            format_bytes(e.bytes),
            _when(e.first_seen),
            _when(e.last_used),
        )
    out.print(enc)
    _print_roots(s.roots)


def _recipe_brief(recipe: dict) -> str:
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
    return " ".join(bits)


def _print_roots(roots: Any) -> None:
    t = Table(title="roots", title_justify="left")
    for col in ("name", "data", "encoder", "recipe", "items", "missing", "last used"):
        t.add_column(col, justify="right" if col in ("items", "missing") else "left")
    for r in roots:
        recipe = _recipe_brief(r.recipe)
        t.add_row(
            r.name,
            escape(r.data),
            escape(r.encoder_label),
            escape(recipe),
            f"{r.items:,}",
            f"[yellow]{r.missing:,}[/]" if r.missing else "0",
            _when(r.last_used),
        )
    out.print(t)


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


@app.command(
    epilog=(
        "Examples:\n\n  featbake gc --dry-run\n\n  featbake gc\n\n"
        "  featbake gc --older-than 30d --max-bytes 200GiB\n\n"
        "  featbake gc --compact-below 0.8 --merge-small --json\n\n" + EXIT_CODES
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
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would go and how many bytes it frees.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Free what no live root reaches; optionally drop old roots and fit a byte budget.

    Removes features of old encoders, changed or deleted files and dropped roots; rewrites
    shards that are mostly garbage; removes stale tmp/ leftovers. Safe to interrupt at any point
    (a rerun finishes the job) and safe while training reads the store.
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
    plan = plan_gc(cache, opts)
    summary = plan.summary()
    if dry_run or not as_json:
        _print_gc_plan(plan, dry_run, as_json)
    if dry_run:
        return
    bar = _progress_bar()
    with bar:
        result = execute_gc(plan, progress=_tick_bar(bar, {}))
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


def _print_gc_plan(plan: Any, dry_run: bool, as_json: bool) -> None:
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


@app.command(
    epilog=("Examples:\n\n  featbake verify\n\n  featbake verify --repair --json\n\n" + VERIFY_EXIT)
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
    as_json: JsonOpt = False,
) -> None:
    """Check every shard's bytes and checksums, and the catalog against the shards.

    With --repair: intact tensors of a damaged shard are copied to a fresh shard, the damaged
    file moves to quarantine/, the catalog drops rows that point nowhere and indexes shards it
    lacked; a missing or unreadable catalog is rebuilt from the shard headers and roots/*.json.
    Run it while no build or training uses the store.
    """
    from featbake.upkeep import verify as run_verify

    bar = _progress_bar()
    with bar:
        report = run_verify(cache, repair_damage=repair, progress=_tick_bar(bar, {}))
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
            f"verify: {report.status} ({report.shards_checked} shards, "
            f"{format_bytes(report.bytes_checked)} read in {report.seconds:.2f}s)"
            + (
                f"; {report.features_lost} feature rows lost, rebuild to recompute them"
                if report.features_lost
                else ""
            )
        )
    if report.exit_code:
        raise typer.Exit(report.exit_code)


@app.command(
    epilog=(
        "Examples:\n\n  featbake export --format zarr feats.zarr\n\n"
        "  featbake export --format zarr feats.zarr --root r-3f1c --overwrite\n\n"
        "Read it back without featbake:\n\n"
        "  g = zarr.open_group('feats.zarr', mode='r'); o = g['offsets'][:]\n\n"
        "  first = g['values'][o[0]:o[1]]\n\n" + EXIT_CODES
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
    as_json: JsonOpt = False,
) -> None:
    """Export a root's features to Zarr (v3), readable by zarr, xarray or dask without featbake.

    Variable-length features become values [sum T, D] + offsets [N+1] + lengths; fixed-size ones
    a dense values [N, ...]; keys and paths [N] follow the root's file order.
    """
    from featbake.errors import ConfigError
    from featbake.export import export_zarr

    if fmt != "zarr":
        raise ConfigError(f"unknown --format {fmt!r}; featbake exports zarr")
    bar = _progress_bar()
    with bar:
        report = export_zarr(
            out_path, cache=cache, root=root, overwrite=overwrite, progress=_tick_bar(bar, {})
        )
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        out.print(
            f"exported {report.items:,} items of root {report.root} "
            f"({', '.join(f'{p or chr(39) * 2}: {k}' for p, k in report.layouts.items())}; "
            f"{format_bytes(report.bytes)}) to {escape(report.out)}"
            + (f"; {report.missing} items not stored were left out" if report.missing else "")
        )


# == end of upkeep commands ====================================================================


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning featbake errors into one red line and an exit code."""
    try:
        # Without standalone mode typer *returns* the code of a `raise typer.Exit(code)`, and 130
        # when it caught a KeyboardInterrupt itself: dropping it would turn Ctrl-C into success.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code != 0:
            if code == 130:
                console.print(
                    "[bold red]interrupted:[/] everything sealed so far is kept; rerun to continue"
                )
            sys.exit(code)
    except FeatbakeError as e:
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        console.print(
            "[bold red]interrupted:[/] everything sealed so far is kept; rerun to continue"
        )
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        console.print("[bold red]aborted")
        sys.exit(130)
    except Exception as e:
        # Usage errors (unknown command or option): typer's own exceptions in typer >= 0.20,
        # click's before. Both know how to show themselves and carry an exit code.
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if os.environ.get("FEATBAKE_DEBUG"):
            raise
        console.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
            "(rerun with FEATBAKE_DEBUG=1 for a traceback, and please report it)"
        )
        sys.exit(1)
