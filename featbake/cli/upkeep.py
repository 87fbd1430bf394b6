"""`featbake stats` and `featbake roots [drop NAME]`."""

from __future__ import annotations

import errno
import json
import shlex
from typing import TYPE_CHECKING, Annotated, Any

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
    examples,
    format_when,
    note_inert_options,
    on_command_line,
    out,
    progress_bar,
    summary_lines,
    tick_bar,
)
from featbake.cli.build import (
    DATA_OPTION,
    ENCODER_OPTION,
    AntialiasOpt,
    ColumnOpt,
    CropOpt,
    DeviceOpt,
    DtypeOpt,
    ExifOpt,
    ImageModeOpt,
    InterpolationOpt,
    LayerOpt,
    LayersOpt,
    LowercaseOpt,
    MaxSecondsOpt,
    MaxTokensOpt,
    MeanOpt,
    MonoOpt,
    OutputOpt,
    PrecisionOpt,
    RescaleOpt,
    ResizeOpt,
    SampleRateOpt,
    SourceOpt,
    SpecialTokensOpt,
    StdOpt,
    TruncateOpt,
    TrustPickleOpt,
    WeightsOpt,
)
from featbake.errors import CacheMiss, ConfigError
from featbake.image_recipe import describe_fields
from featbake.units import counted, format_bytes, parse_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from featbake.store.catalog import Catalog
    from featbake.store.merge import PendingBuild
    from featbake.upkeep import GcPlan, GcResult
from pathlib import Path


# == store =========================================================================================
@app.command(
    epilog=(
        examples("featbake stats", "featbake stats --cache /data/.featbake --json")
        + UPKEEP_EXIT_CODES
    )
)
def stats(
    ctx: typer.Context,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show what the store holds: features, bytes, live and dead, per encoder and per root.

    Reads the catalog's rows, never a shard (well under a second on a million features). Live
    features are those some root reaches (or a build in parts waiting for `featbake merge`);
    dead ones are what `featbake gc` frees. On a bucket store it names the bucket and this
    node's local tier (--local-cache, its budget).
    """
    note_inert_options(ctx, cache)
    from featbake.store.open import open_store
    from featbake.upkeep import stats as run_stats

    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    s = run_stats(store)
    if as_json:
        out.print_json(json.dumps(s.to_json()))
        return
    # Lines, not a rich Table: a table cut the store's path with "..." at 80 columns, and
    # padded every line with trailing spaces (build's summary_lines rule).
    rows = [
        ("store", escape(s.path)),
        (
            "features",
            f"{s.features:,} inputs, {s.tensors:,} tensors ({format_bytes(s.feature_bytes)})",
        ),
        ("live", f"{s.live_features:,} ({format_bytes(s.live_bytes)})"),
        ("dead", f"{s.dead_features:,} ({format_bytes(s.dead_bytes)}): gc frees them"),
        ("shards", f"{s.shards:,} files, {format_bytes(s.disk_bytes)} on disk"),
    ]
    if s.unreferenced_bytes:
        rows.append(("unreferenced", f"{format_bytes(s.unreferenced_bytes)} inside shards"))
    rows.append(("tmp/", f"{s.tmp_files} leftovers ({format_bytes(s.tmp_bytes)})"))
    rows.append(("catalog", format_bytes(s.catalog_bytes)))
    if s.tier is not None:
        tier = s.tier
        rows.append(("local tier", f"{escape(tier.path)}: catalog version {tier.version}, "
                     f"{format_bytes(tier.bytes)} of {format_bytes(tier.budget)}"))  # fmt: skip
    for line in summary_lines(rows):
        out.print(line)
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
        # A crop made before CROP_VERSION 2 (64 samples of the resampler's context) is its
        # own root, named so: the two look alike otherwise.
        older = " (older crop)" if recipe.get("crop") is None else ""
        bits.append(f"crop {recipe['max_seconds']:g}s{older}")
    if recipe.get("output") is not None:
        bits.append(f"output {recipe['output']}")
    if isinstance(recipe.get("image"), dict):  # the whole transform: it decides the pixels
        bits.append(describe_fields(recipe["image"]))
    if isinstance(recipe.get("text"), dict):  # the tokenizer and its options decide the ids
        from featbake.recipe import text_brief  # torch: only where a text root is shown

        bits.append(text_brief(recipe["text"]))
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
                *([("workdir", escape(r.workdir))] if r.workdir else []),
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
    help="List the roots, or drop one. A root is what a build publishes: its inputs' keys, one "
    "root per data folder x encoder as named x recipe (the options that change features: "
    "sample rate, dtype, layers, ...). gc keeps every feature a root reaches.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(roots_app, name="roots")


@roots_app.callback(
    epilog=examples("featbake roots", "featbake roots --json", "featbake roots drop r-3f1c")
    + UPKEEP_EXIT_CODES
)
def roots(
    ctx: typer.Context,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the roots: what each build published, and how many of its items are missing.

    A root keeps its features live; `featbake roots drop NAME` lets gc free them.
    """
    note_inert_options(ctx, cache)
    from featbake.store.open import open_store

    if ctx.invoked_subcommand is not None:
        ctx.obj = (cache, local_cache, local_cache_size)
        return
    from dataclasses import asdict

    from featbake.upkeep import list_roots

    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    rs = list_roots(store)
    if as_json:
        out.print_json(json.dumps([asdict(r) for r in rs]))
    else:
        _print_roots(rs)
        _print_pending(store)


def _print_pending(cache: Any) -> None:
    """Sharded builds whose fragments are not merged yet: their roots are not published."""
    from featbake.store.fragments import serving_fragments
    from featbake.store.merge import unmerged_builds
    from featbake.store.open import Need, open_store

    layout = open_store(cache, need=Need.STORE)
    for p in unmerged_builds(layout):  # a done build's root waits for `featbake merge` alone
        out.print(f"[yellow]pending[/] {escape(p.describe())}; {escape(_merged_when(p))}")
    served = len(serving_fragments(layout))
    if served:
        out.print(
            f"[yellow]pending[/] {served} serving fragments (write-back and last uses of datasets "
            "on a shared filesystem); `featbake merge` folds them in"
        )


def _merged_when(p: PendingBuild) -> str:
    """What a user runs to publish pending build ``p``'s root, or to give it up."""
    if p.complete:
        return "run `featbake merge`"
    return (
        f"`featbake merge` when all are done (`featbake merge --abandon {p.root}` if a part "
        "was killed for good)"
    )


@roots_app.command(
    "drop",
    epilog=examples("featbake roots drop r-3f1c9a0e12ab", "featbake roots drop r-3f1c")
    + UPKEEP_EXIT_CODES,
)
def roots_drop(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The root's name, or a unique prefix of it.")],
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
) -> None:
    """Drop one root; its features stay until `featbake gc` frees them."""
    note_inert_options(ctx, cache if cache is not None else (ctx.obj or (None,))[0])
    from featbake.store.open import open_store
    from featbake.upkeep import drop_root

    outer = ctx.obj or (None, None, None)  # what `featbake roots --cache ... drop` said
    store = open_store(
        cache if cache is not None else outer[0],
        local_cache=local_cache or outer[1],
        local_cache_size=local_cache_size or outer[2],
    )
    root = drop_root(store, name)
    out.print(
        f"dropped root {root.name} ({escape(root.data)}, {escape(root.encoder_label)}, "
        f"{root.items:,} items); run `featbake gc` to free what nothing else reaches"
    )


# == gc ============================================================================================
# `featbake gc`.
@app.command(
    epilog=(
        examples(
            "featbake gc --dry-run",
            "featbake gc",
            "featbake gc --older-than 30d --max-bytes 200GiB",
            "featbake gc --compact-below 0.8 --merge-small --json",
            "featbake gc --cache s3://team-bucket/features --older-than 30d --retention 7d",
        )
        + UPKEEP_EXIT_CODES
    )
)
def gc(
    ctx: typer.Context,
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
            help=(
                "Evict least-recently-used features until the shards fit, e.g. 200GiB. "
                "Features a build in parts still running reuses, or one not merged yet names "
                "(parts, a dataset's serve fragments), are kept and count toward the budget: a "
                "note then says by how much it stays exceeded, who holds them and what frees "
                "them (exit 0). A build in one process holds none: one whose reused features "
                "go meanwhile counts those inputs failed, and its rerun encodes them. A bucket "
                "store never rewrites a shard, so there whole shards go, least recently used "
                "first. The shards are measured once gc is done: features written while it ran "
                "have it plan once more (a note says so), and a warning says if it is still over."
            ),
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
        typer.Option(
            help="A directory store: leave unnamed shard files and tmp/ files alone until this "
            "old (a bucket's wait out --retention)."
        ),
    ] = "1h",
    shard_size: Annotated[
        str, typer.Option(help="Target size of shards written by compaction.")
    ] = "256MiB",
    retention: Annotated[
        str,
        typer.Option(
            help="A bucket store (s3://): keep what catalog versions retired less than this long "
            "ago name, for readers still holding them (shards nothing names stay an hour at "
            "least: a running build names its uploads in batches)."
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
    (a rerun finishes the job) and safe while training reads the store; a second gc of the
    store waits for the first (it says so), then plans afresh. On a bucket store it
    publishes the catalog's new version, never rewrites shards, and deletes objects only once
    no version younger than --retention names them.
    """
    note_inert_options(ctx, cache)
    from featbake.units import parse_duration
    from featbake.upkeep import GcOptions
    from featbake.upkeep import gc as run_gc

    opts = GcOptions(
        older_than=parse_duration(older_than) if older_than else None,
        max_bytes=parse_bytes(max_bytes) if max_bytes else None,
        compact_below=compact_below,
        grace=parse_duration(grace),
        retention=parse_duration(retention),
        shard_bytes=parse_bytes(shard_size),
        merge_small=merge_small,
    )
    plans: list[GcPlan] = []

    def show(plan: GcPlan) -> None:
        plans.append(plan)
        if len(plans) > 1 and not as_json:  # the budget measured after the first pass
            console.print(
                "[yellow]note:[/] the store was still over --max-bytes once gc had run "
                "(features written meanwhile); it plans again from what is there now"
            )
        if dry_run or not as_json:
            _print_gc_plan(plan, dry_run, as_json)

    bar = progress_bar()
    with bar:
        result = run_gc(
            cache,
            opts,
            dry_run=dry_run,
            progress=tick_bar(bar, {}),
            on_plan=show,
            local_cache=local_cache,
            local_cache_size=local_cache_size,
        )
    if dry_run:
        _note_over_budget(plans[0], as_json)
        return
    if as_json:
        out.print_json(json.dumps(_gc_json(plans, result)))
    else:
        out.print(
            f"gc: dropped {len(result.roots_dropped)} roots, {result.rows_deleted:,} feature "
            f"rows, {result.shards_deleted:,} shards"
            + (
                f", {result.versions_deleted} old catalog versions"
                if plans[0].sweep.versioned
                else ""
            )
            + f"; wrote {result.shards_written} shards ({result.features_moved:,} moved); freed "
            f"{format_bytes(max(0, result.bytes_freed))} in {result.seconds:.2f}s"
            + _kept(result.young_shards, plans[0])
        )
    for p in result.problems:
        console.print(f"[yellow]warning:[/] {escape(p)}")
    _note_over_budget(plans[-1], as_json)
    _warn_still_over(plans[-1], result, as_json)


def _gc_json(plans: list[GcPlan], result: GcResult) -> dict[str, object]:
    """``gc --json``'s document: the plan, the second pass's (``replanned``) where the first
    left the store over ``--max-bytes``, and the result."""
    again = {"replanned": plans[-1].summary()} if len(plans) > 1 else {}
    return {"plan": plans[0].summary(), **again, "result": result.to_json()}


def _warn_still_over(plan: GcPlan, result: GcResult, as_json: bool) -> None:
    """One warning when the shards measured after the run exceed ``--max-bytes`` by more than
    the plan's note explains (features kept for builds): written during the second pass too,
    or a shard gc skipped (its warning is above). ``--json``: the result's ``stored_bytes``."""
    budget = plan.options.max_bytes
    stored = result.stored_bytes
    if as_json or budget is None or stored is None or not plan.unforeseen_bytes(stored):
        return
    console.print(
        f"[yellow]warning:[/] the store holds {format_bytes(stored)} of shards after gc, over "
        f"--max-bytes {format_bytes(budget)}: features were written while it ran, or it "
        "skipped a shard (see above); run gc again"
    )


def _note_over_budget(plan: GcPlan, as_json: bool) -> None:
    """One note when --max-bytes is left exceeded by features builds not merged yet hold: by
    how much, who holds them, what frees them (``--json``: the plan's ``over_budget_bytes``,
    ``kept_for_builds_bytes`` and ``kept_for``). A note, not an error: gc did what it may."""
    if plan.shortfall is not None and not as_json:
        merge = f"featbake merge --cache {shlex.quote(str(plan.summary()['store']))}"
        console.print(f"[yellow]note:[/] {escape(plan.shortfall.line(merge))}")


def _kept(young: int, plan: GcPlan) -> str:
    """``; N unnamed shards kept until ...``: always where the place keeps catalog versions
    (a bucket), else when some are kept."""
    if not (young or plan.sweep.versioned):
        return ""
    return f"; {young} unnamed shards kept until they pass the {plan.sweep.age}"


def _print_gc_plan(plan: GcPlan, dry_run: bool, as_json: bool) -> None:
    """The plan as ``gc --json`` (only the plan) or as lines: what goes, and the bytes freed."""
    s = plan.summary()
    if as_json:
        out.print_json(json.dumps({"plan": s}))
        return
    head = "would free" if dry_run else "frees"
    if plan.nothing_to_do:
        out.print(
            f"gc{' (dry run)' if dry_run else ''} of {escape(s['store'])}: nothing to do"
            + (
                f" ({s['orphan_shards_in_grace']} unnamed shards are within the {plan.sweep.age})"
                if s["orphan_shards_in_grace"]
                else ""
            )
        )
        return
    for d in plan.drop_roots:
        out.print(f"drop root {d.name} ({escape(d.data)}, {escape(d.encoder_label)}): {d.reason}")
    versions = f"{s['old_versions']} old catalog versions, " if plan.sweep.versioned else ""
    out.print(
        f"gc{' (dry run)' if dry_run else ''} of {escape(s['store'])}: "
        f"{s['unreached_features']:,} unreached features ({format_bytes(s['unreached_bytes'])}), "
        f"{s['evicted_features']:,} evicted ({format_bytes(s['evicted_bytes'])}); "
        f"{s['shards_deleted']} shards deleted, {s['shards_rewritten']} rewritten, "
        f"{s['orphan_shards']} unnamed shard files, {s['tmp_files']} tmp/ files: "
        f"{head} about {format_bytes(plan.freed_bytes)} of {format_bytes(s['disk_bytes'])}"
    )
    if plan.sweep.versioned:
        out.print(
            f"sweep: {'would delete' if dry_run else 'deletes'} {versions}"
            f"{s['orphan_shards']} unnamed shards" + _kept(plan.young_orphans, plan)
        )


# == verify ========================================================================================
VERIFY_EXIT = """verify exit codes: 0 clean (notes, e.g. parts-waiting: a build in parts not
merged yet, are not damage); 10 damage was found and repaired (--repair; features
in quarantined shards are gone: rebuild to recompute them); 11 damage remains (run with --repair,
or see the lines above). 5: the store cannot be opened at all. 2: a spot check's options
(--sample, --dtype, ...) without --encoder and --data. With --encoder: 0 every sampled feature
the store holds matches the encoder now (items it lacks, evicted or deleted, are listed as
missing, not failed); 12 stored features differ from the encoder's output: a code of its own,
not 11, because their bytes and checksums are sound and --repair keeps them (drop the root and
build again, or find the encoder that built it); 11, as without --encoder, a sampled item's
stored bytes are damaged (a checksum that fails: run --repair, then build); 13 those compared
matched, but some sampled inputs changed since the build (their bytes now make other keys than
it recorded: build again); 7 the store holds no root for that encoder, data and recipe, or
nothing was compared (every sampled item missing, changed or unreadable: a check that compared
nothing vouches for nothing); 4 the encoder could not load."""


@app.command(
    epilog=(
        examples(
            "featbake verify",
            "featbake verify --repair --json",
            "featbake verify --cache s3://team-bucket/features",
            "featbake verify --encoder ckpt.pt --data ./audio --sample 64 --seed 1",
            "featbake verify --encoder ckpt.pt --data ./audio --dtype float16 --json",
        )
        + VERIFY_EXIT
    )
)
def verify(
    ctx: typer.Context,
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
    encoder: Annotated[str | None, ENCODER_OPTION] = None,
    data: Annotated[str | None, DATA_OPTION] = None,
    sample: Annotated[
        int, typer.Option(help="With --encoder: how many of the root's items to re-encode.")
    ] = 32,  # featbake.serve.spot_check.DEFAULT_SAMPLE, not imported here: it loads torch
    seed: Annotated[
        int,
        typer.Option(
            help="With --encoder: the seed that draws the sample (same seed, same items)."
        ),
    ] = 0,
    column: ColumnOpt = None,
    weights: WeightsOpt = None,
    source: SourceOpt = "audio",
    sample_rate: SampleRateOpt = 16000,
    mono: MonoOpt = True,
    max_seconds: MaxSecondsOpt = None,
    output: OutputOpt = None,
    dtype: DtypeOpt = "float32",
    precision: PrecisionOpt = "fp32",
    layer: LayerOpt = None,
    layers: LayersOpt = None,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    interpolation: InterpolationOpt = None,
    antialias: AntialiasOpt = None,
    rescale: RescaleOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
    image_mode: ImageModeOpt = None,
    exif: ExifOpt = None,
    max_tokens: MaxTokensOpt = None,
    truncate: TruncateOpt = None,
    lowercase: LowercaseOpt = None,
    special_tokens: SpecialTokensOpt = None,
    trust_pickle: TrustPickleOpt = False,
    device: DeviceOpt = "cpu",
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

    With --encoder and --data (and the recipe options the build was given: --dtype,
    --sample-rate, --column, ...), verify spot-checks what no byte check can: it re-encodes a
    seeded sample of the root's items with the encoder now (as a dataset's live miss does) and
    compares each with its stored feature within what the stored dtype promises (float32 near
    exact; float16, bfloat16, int8, fp8 by their rounding). A forged or copied-in shard, or
    features an encoder wrote in train mode: each shows as mismatching items (exit 12). A store
    built by another encoder file (or this file before it was replaced) holds no root of this
    one: verify names the file or version that built it (exit 7). It
    never writes to the store; items it lacks are listed as missing, not encoded, and inputs
    whose bytes changed since the build as changed. A view's root (`featbake build --views
    hflip`) cannot be spot-checked: verify has no --views, and checks the original's root.
    """
    note_inert_options(ctx, cache)
    if encoder is None and data is None:
        refuse_spot_check_options(ctx)
    else:
        if repair:
            raise ConfigError("--encoder spot-checks and never writes; run --repair on its own")
        _spot_check(ctx, encoder, data, as_json)
        return
    from featbake.upkeep import verify as run_verify

    bar = progress_bar()
    with bar:
        report = run_verify(
            cache,
            repair_damage=repair,
            progress=tick_bar(bar, {}),
            local_cache=local_cache,
            local_cache_size=local_cache_size,
            redigest=redigested,  # re-keys manifest, tar and table roots' items too
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
            f"verify: {report.status} ({counted(report.shards_checked, 'shard')}, "
            f"{format_bytes(report.bytes_checked)} read in {report.seconds:.2f}s)"
            + (
                f"; {report.features_lost} feature rows lost, rebuild to recompute them"
                if report.features_lost
                else ""
            )
        )
    if report.exit_code:
        raise typer.Exit(report.exit_code)


#: verify's own options: every other one is a spot check's (the build's encoder and recipe
#: options, --sample, --seed), meaningless without --encoder and --data.
VERIFY_OWN_OPTIONS = frozenset(
    {"cache", "repair", "local_cache", "local_cache_size", "as_json", "encoder", "data"}
)


def refuse_spot_check_options(ctx: typer.Context) -> None:
    """Raise if the command line gave verify a spot check's options but no --encoder and --data:
    the byte check would run and exit 0 as if the store's features had been spot-checked.

    Raises:
        ConfigError: naming the options given (exit 2).
    """
    given = [
        param.opts[0]
        for param in ctx.command.params
        if param.name and param.name not in VERIFY_OWN_OPTIONS and on_command_line(ctx, param.name)
    ]
    if given:
        raise ConfigError(
            f"{'/'.join(given)} {'are' if len(given) > 1 else 'is'} for a spot check: give "
            "--encoder and --data (as given to `featbake build`), or drop "
            f"{'them' if len(given) > 1 else 'it'} to check the store's bytes"
        )


#: Mismatching items a spot check prints one line each for (--json lists every one).
SHOWN_MISMATCHES = 20


def _spot_check(ctx: typer.Context, encoder: str | None, data: str | None, as_json: bool) -> None:
    """``verify --encoder``: the spot check of :func:`featbake.serve.spot_check.spot_check`,
    its lines (each mismatching item, the likely cause, a summary) and its exit code."""
    from featbake.bake.interrupt import interrupt_at_safe_points
    from featbake.cli.build import recipe_of
    from featbake.serve.spot_check import Verdict, spot_check

    if encoder is None or data is None:
        raise ConfigError(
            "a spot check needs both --encoder and --data (as given to `featbake build`)"
        )
    p = ctx.params
    with interrupt_at_safe_points() as checkpoint:  # stops between items (see spot_check)
        report = spot_check(
            data, encoder, recipe=recipe_of(p, encoder), cache=p["cache"],
            local_cache=p["local_cache"], local_cache_size=p["local_cache_size"],
            sample=p["sample"], seed=p["seed"], weights=p["weights"],
            trust_pickle=p["trust_pickle"], device=p["device"], column=p["column"],
            checkpoint=checkpoint,
        )  # fmt: skip
    if as_json:
        out.print_json(json.dumps(report.to_json()))
        raise typer.Exit(report.exit_code)
    nothing = report.nothing_compared()
    if nothing is not None:  # one line, exit 7: a check that compared nothing vouches for nothing
        raise CacheMiss(nothing)
    _print_spot_check(report, Verdict)
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def _print_spot_check(report: Any, verdict: Any) -> None:
    """A spot check's lines: each mismatching item and each input changed since the build (up
    to :data:`SHOWN_MISMATCHES` of each), the likely cause, and a summary."""
    bad = report.of(verdict.MISMATCH)
    for c in bad[:SHOWN_MISMATCHES]:
        out.print(
            f"[red]mismatch[/] {escape(c.item)}: max abs error {c.max_abs_error:.3g}, "
            f"tolerance {c.tolerance:.3g}" + (f" ({escape(c.detail)})" if c.detail else "")
        )
    if len(bad) > SHOWN_MISMATCHES:
        out.print(f"[red]... and {len(bad) - SHOWN_MISMATCHES} more mismatches (see --json)")
    changed = report.of(verdict.CHANGED)
    for c in changed[:SHOWN_MISMATCHES]:
        out.print(f"[yellow]changed since the build[/] {escape(c.item)}: {escape(c.detail)}")
    if len(changed) > SHOWN_MISMATCHES:
        out.print(f"[yellow]... and {len(changed) - SHOWN_MISMATCHES} more changed (see --json)")
    damaged = report.of(verdict.DAMAGED)
    for c in damaged[:SHOWN_MISMATCHES]:
        out.print(f"[red]damaged[/] {escape(c.item)}: {escape(c.detail)}")
    if len(damaged) > SHOWN_MISMATCHES:
        out.print(f"[red]... and {len(damaged) - SHOWN_MISMATCHES} more damaged (see --json)")
    if report.likely_cause:
        console.print(f"[yellow]likely cause:[/] {escape(report.likely_cause)}")
    out.print(
        f"verify --encoder: {report.checked} of {report.items} items of root {report.root} "
        f"checked against {escape(report.encoder)} ({report.dtype}, seed {report.seed}): "
        f"{report.mismatched} mismatched, {report.missing} missing"
        + (f", {report.changed} changed since the build" if report.changed else "")
        + (f", {report.damaged} damaged (run `featbake verify --repair`)" if report.damaged else "")
        + (f", {report.unreadable} unreadable inputs" if report.unreadable else "")
        + f" in {report.seconds:.2f}s"
    )


def redigested(
    data: str, source: str, catalog: Catalog, actual: Mapping[str, str], workdir: str
) -> Mapping[str, tuple[str, str]]:
    """:func:`featbake.encode.inputs.redigested`, imported only when a repair re-keys a
    manifest's, tar's or table's items: encode code loads torch, which checking a store's
    bytes never needs."""
    from featbake.encode.inputs import redigested as encode_redigested

    return encode_redigested(data, source, catalog, actual, workdir)


# == merge =========================================================================================
# `featbake merge`: fold the catalog fragments of sharded builds into the catalog.
@app.command(
    epilog=(
        examples(
            "featbake merge",
            "sbatch --dependency=afterok:$array merge.sbatch   # docs/scaling.md's merge job",
            "featbake merge --abandon r-3f1c9a0e12ab   # its killed build's part will not run",
        )
        + UPKEEP_EXIT_CODES
    )
)
def merge(
    ctx: typer.Context,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    abandon: Annotated[
        list[str] | None,
        typer.Option(
            "--abandon",
            metavar="ROOT",
            help="Retire the unfinished builds of root ROOT (its name or a unique prefix; "
            "repeatable): a build whose part "
            "was killed for good stays pending otherwise, and gc keeps what it sealed. Only "
            "once no part of it runs; its stored features are reused by a rebuild, or freed "
            "by gc once no root names them.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Fold every finished sharded build (`build --shard I/N`, SLURM arrays) into the catalog.

    A build is merged once all its parts have sealed their fragment; builds still running are
    left for a later merge and listed. Safe to run while parts still run, safe to kill, and a
    second merge changes nothing. Under torchrun rank 0 merges by itself. A build one part of
    which will never finish (killed for good, an array task cancelled) is pending until
    `--abandon` names its root.
    """
    note_inert_options(ctx, cache)
    from featbake.store.open import Need, open_store, place_of
    from featbake.upkeep.files import refuse_unmarked

    layout = open_store(
        cache, need=Need.STORE, local_cache=local_cache, local_cache_size=local_cache_size
    )
    if layout.remote is None:  # --cache at the wrong place: nothing to merge there
        refuse_unmarked(layout)
    report = place_of(layout).merge(frozenset(abandon or ()))
    if as_json:
        out.print_json(json.dumps(report.to_json()))
        return
    if report.roots or report.fragments or report.new_features:
        out.print(
            f"merged {report.fragments} fragments: {len(report.roots)} roots published, "
            f"{report.new_features:,} new features in {report.shards + report.waiting_shards} "
            "shards"
        )
    else:
        out.print("nothing to merge")
    if report.waiting_shards:
        out.print(
            f"parts not finished: {report.waiting_shards} shards they sealed are in the catalog "
            "(a rerun in any shape reuses them)"
        )
    for root in report.superseded:
        out.print(f"retired: the unfinished build of root {escape(root)} (built again since)")
    for root in report.abandoned:
        out.print(
            f"abandoned: the unfinished builds of root {escape(root)} (what they stored is "
            "reused by a rebuild, or freed by gc once no root names it)"
        )
    for p in report.pending:
        out.print(f"pending: {escape(p.describe())}; {escape(_merged_when(p))}")
    if report.missing_shards:
        console.print(
            f"[red]{len(report.missing_shards)} shards named by fragments are gone[/]; their "
            "features show as missing in `featbake roots`, and a rebuild encodes them again"
        )


# == export ========================================================================================
# `featbake export`.
#: The formats `featbake export` writes, each a module of featbake.export.
EXPORT_FORMATS = ("zarr", "parquet", "webdataset")


@app.command(
    epilog=(
        examples(
            "featbake export --format zarr feats.zarr",
            "featbake export --format parquet feats.parquet --root r-3f1c --overwrite",
            "featbake export --format zarr feats.zarr --compression zstd",
            "featbake export --format webdataset feats-wds --layers 6,12",
        )
        + "Read them back without featbake:\n\n"
        "  g = zarr.open_group('feats.zarr', mode='r'); v = g['values']  # one part;\n"
        "  g['offsets'] where the items differ in length (see the layouts above)\n\n"
        "  datasets.load_dataset('parquet', data_files='feats.parquet')\n\n"
        "  webdataset.WebDataset('feats-wds/shard-000000.tar').decode()\n\n" + UPKEEP_EXIT_CODES
    )
)
def export(
    ctx: typer.Context,
    out_path: Annotated[
        Path,
        typer.Argument(
            metavar="OUT",
            help="What to create: a Zarr folder, a Parquet file, or a folder of tar shards.",
        ),
    ],
    fmt: Annotated[
        str, typer.Option("--format", help="Output format: zarr, parquet or webdataset.")
    ] = "zarr",
    root: Annotated[
        str | None,
        typer.Option(
            help="Root to export (name or prefix); needed if there are several (`featbake roots`).",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            help="Export only this stored part (e.g. pooled, tokens).", show_default=False
        ),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            help="Export only these stored hidden layers, e.g. 0,6,12.", show_default=False
        ),
    ] = None,
    column: Annotated[
        str | None,
        typer.Option(
            help="The column the build named with --column, to read the rows' other columns "
            "(found without it where the rows carry it: the root's name tells which).",
            show_default=False,
        ),
    ] = None,
    compression: Annotated[
        str | None,
        typer.Option(
            help="Compression of the values: none, snappy or zstd. Defaults: Parquet snappy "
            "(pyarrow's own; within a few percent of none on float features), Zarr none (float "
            "features barely compress, and zstd made Zarr's writes 2-3x slower); webdataset "
            "writes plain tars.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Replace OUT if it is an earlier featbake export (never the store, the data a "
            "root was built from, or a folder or file that is not featbake's export of this "
            "format, another program's Parquet table or Zarr store included)."
        ),
    ] = False,
    strict_rows: Annotated[
        bool,
        typer.Option(
            "--strict-rows",
            help="Refuse, writing nothing, where the data no longer lists some items' rows "
            "(removed or renamed since the build), some items' files changed since the build "
            "or cannot be read, or the data cannot be read. Default: export unlisted rows' "
            "columns empty (null), leave changed items out, export unreadable ones as built, "
            "and say how many in one line each.",
        ),
    ] = False,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a root's features, with each item's id and the columns its row carries (labels),
    to Zarr (v3), Parquet or webdataset shards, readable without featbake.

    Zarr: variable-length features become values [sum T, D] + offsets [N+1] + lengths, fixed-size
    ones a dense values [N, ...]; keys, paths and columns/ [N] follow the root's order. Parquet:
    one row per item (id, key, one list column per part and its shape, the row's columns).
    webdataset: one sample per item (<id>.npy or <id>.<part>.npy, and <id>.json).

    The columns are read from the root's data (its manifest) as it is now: a label fixed since
    the build is exported fixed; an item whose row was removed or renamed since is exported with
    empty columns and counted in one line (--strict-rows refuses instead): rebuild the root to
    export the manifest as it is. Each item's file is checked against the bytes its features
    were computed from (a stat per file where the build's hash cache vouches for it, else the
    file hashed): an item whose file changed since the build is left out, one whose file cannot
    be read is exported as built, each counted in one line (--strict-rows refuses).
    """
    note_inert_options(ctx, cache)
    from featbake.errors import ConfigError, StoreError
    from featbake.store.open import open_store

    if fmt not in EXPORT_FORMATS:  # before export/source.py's import (torch): a typo is answered
        raise ConfigError(f"unknown --format {fmt!r}; featbake exports {', '.join(EXPORT_FORMATS)}")
    from featbake.bake.interrupt import interrupt_at_safe_points
    from featbake.export.source import drift_lines

    exporter = _exporter(fmt, compression)
    chosen = _export_layers(layers)
    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    bar = progress_bar()
    try:
        # Ctrl-C and SIGTERM stop it between runs of items, once the writes of the last are
        # done: stopped anywhere, zarr's own thread went on writing into the partial output
        # being removed ("Directory not empty", exit 5, the partial left behind).
        with bar, interrupt_at_safe_points(after=False) as checkpoint:
            report = exporter(
                out_path, cache=store, root=root, overwrite=overwrite, output=output,
                layers=chosen, rows_for=_root_rows(column, strict_rows),
                progress=_checked(tick_bar(bar, {}), checkpoint), strict_rows=strict_rows,
            )  # fmt: skip
    except OSError as e:  # the OS refused a path or a write: nothing is left at OUT
        raise StoreError(export_write_error(out_path, e)) from e
    for line in drift_lines(report):
        console.print(f"[yellow]{escape(line)}[/]")
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        out.print(
            f"exported {report.items:,} items of root {report.root} "
            f"({_layouts_text(report.layouts)}; "
            f"{format_bytes(report.bytes)}) to {escape(report.out)}"
            + (f"; {report.missing} items not stored were left out" if report.missing else "")
        )


def _layouts_text(layouts: dict[str, str]) -> str:
    """``ragged`` for a single-output encoder's one unnamed part, else ``pooled: dense, ...``.

    Example:
        >>> _layouts_text({"": "ragged"}), _layouts_text({"pooled": "dense", "tokens": "ragged"})
        ('ragged', 'pooled: dense, tokens: ragged')
    """
    return ", ".join(f"{part}: {kind}" if part else kind for part, kind in layouts.items())


def _export_layers(text: str | None) -> tuple[int, ...] | None:
    """``--layers`` as layer numbers (``all``, or none given: every stored part)."""
    from featbake.encode.naming import parse_layers

    if text is None:
        return None
    layers = parse_layers(text)
    return None if isinstance(layers, str) else layers


#: What to do when the OS refuses an export's write, by errno: a disk out of room or quota,
#: or a file over the process's size limit, is not fixed by another folder on the same disk.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _checked(progress: Callable[[Any], None], checkpoint: Callable[[], None]) -> Any:
    """``progress``, then a stop signal's checkpoint, at each step an export reports."""

    def ticked(step: Any) -> None:
        progress(step)
        checkpoint()

    return ticked


def export_write_error(out_path: Path, e: OSError) -> str:
    """The one line for an export the OS refused (OUT's folder missing, read-only, not a
    folder; or the disk full): what happened, where, and what to do.

    Example:
        >>> line = export_write_error(Path("f"), OSError(errno.ENOSPC, "No space left on device"))
        >>> line.startswith("cannot write the export f: No space left on device; nothing was left")
        True
        >>> line.endswith("free space or choose an OUT on another disk")
        True
    """
    where = f" ({e.filename})" if e.filename is not None else ""
    todo = (
        "free space or choose an OUT on another disk"
        if e.errno in _NO_ROOM
        else "choose an OUT inside a folder you can write to"
    )
    what = f"{e.strerror or e}{where}"
    return f"cannot write the export {out_path}: {what}; nothing was left there: {todo}"


def _exporter(fmt: str, compression: str | None = None) -> Any:
    """The export function of a format (each imports its own libraries), compressing as
    ``--compression`` says (None: the format's default).

    Raises:
        ConfigError: an unknown compression, or one the format does not offer.
    """
    from featbake.errors import ConfigError
    from featbake.export.source import Compression, compression_of, export_with

    chosen = None if compression is None else compression_of(compression)
    if fmt == "webdataset":
        from featbake.export.webdataset import WebDataset

        if chosen not in (None, Compression.NONE):
            raise ConfigError(
                "a webdataset export writes plain tars; drop --compression, or export "
                "--format zarr or parquet with it"
            )
        return lambda out, **options: export_with(WebDataset(), out, **options)
    if fmt == "parquet":
        from featbake.export.parquet import Parquet as Format
    else:
        from featbake.export.zarr import Zarr as Format  # type: ignore[assignment]
    writer = Format() if chosen is None else Format(chosen)
    return lambda out, **options: export_with(writer, out, **options)


def _root_rows(column: str | None, strict: bool = False) -> Any:
    """The reader of a root's data now (export/ never opens inputs): the root's data opened as
    the build opened it, each item's row or None where the data lists it no more, and its
    input's digest now (:class:`featbake.export.source.RootData`); where the data cannot be
    opened, one warning and no row columns (``strict``: a refusal)."""

    def rows_for(root: Any) -> Any:
        from featbake.encode.inputs import DigestView, gone_files, inputs_at
        from featbake.encode.sources import source_extensions
        from featbake.errors import ConfigError, FeatbakeError
        from featbake.export.source import RootData
        from featbake.serve.index import rows_edited_since, table_files_changed

        source = root.recipe.get("source")

        def opened(named: str | None) -> tuple[Any, set[str]]:
            # relative paths taken from where the build took them (a Kaldi folder's, cuts')
            inputs = inputs_at(root.data, named, source, root.workdir)
            # a manifest's rows are read by its scan
            return inputs, set(inputs.scan(source_extensions(source)).inputs)

        try:
            inputs, listed = _opened_as_built(root, column, opened)
        except (FeatbakeError, OSError) as e:
            if strict:
                raise ConfigError(
                    f"the rows of root {root.name} cannot be read: its data {root.data} cannot "
                    f"be opened ({e}); drop --strict-rows to export keys and ids without them"
                ) from e
            console.print(
                f"[yellow]the rows' columns are left out: the root's data {escape(root.data)} "
                f"cannot be opened ({escape(str(e))}); keys and ids are exported[/]"
            )
            return None

        def digests(paths: Sequence[str], hashes: Any) -> dict[str, str]:
            """Each listed item's digest now, as a build hashes it (the hash cache read,
            nothing written); those that cannot be read are left out."""
            named = {inputs.path(p): p for p in paths}
            try:
                now, bad = inputs.hash(DigestView(hashes, {}), list(named))
                gone = _inputs_not_in_files(inputs, [named[full] for full in bad])
            except (FeatbakeError, OSError):
                return {}
            return {named[full]: digest for full, digest in now.items()} | gone

        return RootData(
            lambda path: inputs.row(path) if path in listed else None,
            digests,
            frozenset(listed),
            lambda paths: gone_files(inputs, paths),
            lambda when: rows_edited_since(inputs, when) or bool(table_files_changed(inputs, when)),
        )

    return rows_for


def _opened_as_built(
    root: Any, column: str | None, opened: Callable[[str | None], tuple[Any, set[str]]]
) -> tuple[Any, set[str]]:
    """The root's data ``opened`` by the column its build named (:func:`_built_column`): the
    one given, else the default, else one of the columns the rows carry that the root's name
    says. Where the rows have no default column (a JSONL of ``wav`` rows built with ``--column
    wav``), the columns they do have are tried: before, such an export left every row's
    columns out and exported changed files' features as built.

    Raises:
        FeatbakeError, OSError: the data cannot be opened by any such column.
    """
    from featbake.errors import ColumnMissing

    built = _built_column(root, column)
    try:
        inputs, listed = opened(built)
    except ColumnMissing as e:
        found = _built_column(root, built, e.columns)
        if found == built:
            raise
        return opened(found)
    if not _names_column(root, built):  # the build named a column the rows carry?
        found = _built_column(root, built, _row_columns(inputs, listed))
        if found != built:
            return opened(found)
    return inputs, listed


def _inputs_not_in_files(inputs: Any, rels: Sequence[str]) -> dict[str, str]:
    """Of the listed items ``rels`` that cannot be hashed now, those still there (a segment
    past the end of a recording rewritten shorter, a tar member cut short:
    :func:`~featbake.encode.inputs.input_gone`, the rule a dataset serves by), each given
    :data:`~featbake.export.source.NO_INPUT`: the build read that item's input, so it changed
    since. An item whose input is gone is left out (unknown: exported as built)."""
    from featbake.encode.inputs import input_gone
    from featbake.export.source import NO_INPUT

    return {rel: NO_INPUT for rel in rels if not input_gone(inputs, rel, listed=True)}


def _built_column(root: Any, given: str | None, candidates: Sequence[str] = ()) -> str | None:
    """The column the root's build named (its name is ``keys.root_id`` of the data, encoder,
    recipe and that column): ``given`` where the name says so, else the build's default
    (None) or the first of ``candidates`` (columns the rows carry) the name says it was;
    ``given`` where none is (a root named otherwise: read as the user says).

    An export keys each item's input by this column: by another, every item read as another
    file's would be "changed" (a row's clean ``path`` read for a build of its ``noisy``).

    Example:
        >>> from types import SimpleNamespace
        >>> from featbake.keys import root_id
        >>> root = SimpleNamespace(data="/d/m.jsonl", encoder_label="e", recipe_fp="0" * 64)
        >>> root.name = root_id(root.data, "e", "0" * 64, "noisy")
        >>> _built_column(root, None, ["label", "noisy"]), _built_column(root, "x")
        ('noisy', 'x')
    """
    if _names_column(root, given):
        return given
    found = (c for c in (None, *candidates) if c != given and _names_column(root, c))
    return next(found, given)


def _names_column(root: Any, column: str | None) -> bool:
    """Whether the root's name is that of a build that named ``column`` (None: none)."""
    from featbake.keys import root_id

    return bool(root_id(root.data, root.encoder_label, root.recipe_fp, column) == root.name)


#: How many listed rows :func:`_row_columns` reads the column names of (every row the build
#: read had the column it named; a few, should some rows hold columns of their own).
ROWS_FOR_COLUMNS = 8


def _row_columns(inputs: Any, listed: set[str]) -> list[str]:
    """The names of the columns the first listed rows carry, sorted: where the build may
    have named one of them with --column (a row's other file columns, a table's other audio
    cells, are carried as labels)."""
    import heapq

    names: set[str] = set()
    for path in heapq.nsmallest(ROWS_FOR_COLUMNS, listed):
        names.update(k for k in inputs.row(path) if isinstance(k, str))
    return sorted(names)
