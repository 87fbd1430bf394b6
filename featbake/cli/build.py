"""`featbake build`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from featbake.bake.report import BuildReport, FailureCause
from featbake.cli.app import (
    EXIT_CODES,
    CacheOpt,
    JsonOpt,
    LocalCacheOpt,
    LocalCacheSizeOpt,
    app,
    console,
    examples,
    note_inert_options,
    on_command_line,
    out,
    progress_bar,
    stdout_for_json_only,
    summary_lines,
    tick_bar,
)
from featbake.errors import BuildIncomplete, ConfigError
from featbake.gcpause import end_startup
from featbake.units import counted, format_bytes, parse_bytes

if TYPE_CHECKING:
    from featbake.recipe import Recipe


# == recipe options ================================================================================
# The options that name a build's root and decide its features (the recipe, the encoder, the
# data): `featbake build` takes them, and `featbake verify --encoder` takes the same ones, parsed
# by the same :func:`recipe_of`, so a spot check names the root the build wrote.
#: ``--encoder``, as build takes it (required) and verify (to spot-check the store against).
ENCODER_OPTION = typer.Option(
    "--encoder",
    "-e",
    help="TorchScript (.pt), torch.export (.pt2) file, Hugging Face model folder, or "
    "import path pkg.module:factory.",
)
EncoderOpt = Annotated[str, ENCODER_OPTION]
#: ``--data``, as build takes it (required) and verify.
DATA_OPTION = typer.Option(
    "--data",
    "-d",
    help="Folder of inputs (scanned recursively), or a bucket prefix s3://bucket/audio/ "
    "(objects listed and read from S3; credentials and endpoint from the AWS_* "
    "environment), or a manifest (train.jsonl, .csv, .tsv, a NeMo .json, each also "
    ".gz: a row per item, optional id and start/end, start/duration or "
    "offset/duration seconds), a Kaldi data folder (wav.scp [+ segments]) or a lhotse "
    "cut manifest (cuts.jsonl.gz or cuts.jsonl), webdataset shards (a .tar, a folder "
    "of them, 'shard-{000..009}.tar'), or parquet / a datasets.save_to_disk folder.",
)
DataOpt = Annotated[str, DATA_OPTION]
ColumnOpt = Annotated[
    str | None,
    typer.Option(
        help="The manifest column that names each item's input file (default: path), "
        "e.g. --column audio_filepath; a tar sample's member (--column jpg) or a table's "
        "Audio/Image/bytes column (--column audio) to encode.",
        show_default=False,
    ),
]
WeightsOpt = Annotated[
    Path | None, typer.Option(help="safetensors weights for an import-path encoder.")
]
SourceOpt = Annotated[
    str,
    typer.Option(
        help="Input kind: audio, npy, image (JPEG, PNG, WebP, BMP, TIFF) or text (UTF-8 "
        ".txt files, tokenised by the model folder's tokenizer); a Hugging Face vision "
        "folder implies image, a text folder (a tokenizer, no preprocessor) text."
    ),
]
SampleRateOpt = Annotated[int, typer.Option(help="Resample audio to this rate (Hz).")]
MonoOpt = Annotated[bool, typer.Option(help="Mix audio to one channel (--no-mono keeps [C, T]).")]
MaxSecondsOpt = Annotated[
    float | None, typer.Option(help="Crop audio to its first N seconds.", show_default=False)
]
OutputOpt = Annotated[
    str | None,
    typer.Option(
        help="Store only this encoder output (dict key or tuple index).", show_default=False
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        help="Stored dtype: float32, float16, bfloat16, or int8 / fp8 (a scale per frame, "
        "~25% of float32's bytes; served dequantised), e.g. --dtype int8."
    ),
]
PrecisionOpt = Annotated[
    str, typer.Option(help="Run the encoder in fp32, or under autocast in bf16 or fp16.")
]
LayerOpt = Annotated[
    int | None,
    typer.Option(help="Store this hidden layer (Hugging Face folders).", show_default=False),
]
LayersOpt = Annotated[
    str | None,
    typer.Option(
        help="Store these hidden layers, e.g. 0,6,12 or all; each is its own part (layer6).",
        show_default=False,
    ),
]
ResizeOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: resize the shortest edge (256), to an exact size (224x224) or not "
        "(none); at most 8192 a side. [default: the folder's processor, else 256]",
        show_default=False,
    ),
]
CropOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: centre crop after the resize, e.g. 224 or 224x160, or none. "
        "[default: the folder's processor, else 224]",
        show_default=False,
    ),
]
InterpolationOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: resampling filter, e.g. bicubic (nearest, bilinear, bicubic, lanczos, "
        "box, hamming). [default: the folder's processor, else bilinear]",
        show_default=False,
    ),
]
AntialiasOpt = Annotated[
    bool | None,
    typer.Option(
        help="Images: antialias when shrinking (Pillow); --no-antialias resamples as torch "
        "interpolate(antialias=False). [default: antialias]",
        show_default=False,
    ),
]
RescaleOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: multiply pixels by this, e.g. 1/255, or none. [default: 1/255]",
        show_default=False,
    ),
]
MeanOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: normalisation mean per channel, e.g. 0.485,0.456,0.406, or none. "
        "[default: the folder's processor, else ImageNet's]",
        show_default=False,
    ),
]
StdOpt = Annotated[
    str | None,
    typer.Option(
        help="Images: normalisation std per channel, e.g. 0.229,0.224,0.225, or none. "
        "[default: the folder's processor, else ImageNet's]",
        show_default=False,
    ),
]
ImageModeOpt = Annotated[
    str | None,
    typer.Option(help="Images: colour mode, rgb or grey. [default: rgb]", show_default=False),
]
ExifOpt = Annotated[
    bool | None,
    typer.Option(
        help="Images: apply the EXIF orientation tag (--no-exif: pixels as stored). "
        "[default: exif]",
        show_default=False,
    ),
]
MaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Text: tokens per text at most, special tokens included. [default: the "
        "tokenizer's and model's limit, e.g. 512 for BERT, 77 for CLIP]",
        show_default=False,
    ),
]
TruncateOpt = Annotated[
    bool | None,
    typer.Option(
        help="Text: cut a longer text to --max-tokens (--no-truncate: skip it as a bad "
        "input). [default: truncate]",
        show_default=False,
    ),
]
LowercaseOpt = Annotated[
    bool | None,
    typer.Option(
        help="Text: lowercase each text before the tokenizer. [default: no-lowercase]",
        show_default=False,
    ),
]
SpecialTokensOpt = Annotated[
    bool | None,
    typer.Option(
        help="Text: add the tokenizer's special tokens ([CLS] ... [SEP], </s>). "
        "[default: special-tokens]",
        show_default=False,
    ),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(help="Allow a pickled whole-module checkpoint (loading it runs its code)."),
]
DeviceOpt = Annotated[str, typer.Option(help="Where the encoder runs: cpu, cuda, cuda:N.")]


def recipe_of(params: Mapping[str, Any], encoder: str) -> Recipe:
    """The recipe the recipe options in ``params`` (a command's parsed options, by parameter
    name) ask of ``encoder``: the one parser of `featbake build` and `featbake verify`.

    Raises:
        ConfigError: both --layer and --layers, or an option the recipe refuses.
    """
    from featbake.encode.hf_folders import TEXT_OPTIONS, image_steps_for, text_steps_for
    from featbake.encode.naming import parse_layers
    from featbake.image_recipe import IMAGE_OPTIONS, parse_image_options
    from featbake.recipe import Recipe

    layer, layers = params["layer"], params["layers"]
    if layer is not None and layers is not None:
        raise ConfigError("give --layer or --layers, not both")
    chosen = (layer,) if layer is not None else parse_layers(layers) if layers else None
    # The image options by name from the parsed command line (nine keywords, one per option).
    image_changes = parse_image_options(**{k: params[k] for k in IMAGE_OPTIONS})
    return Recipe(
        source=params["source"],
        sample_rate=params["sample_rate"],
        mono=params["mono"],
        max_seconds=params["max_seconds"],
        output=params["output"],
        dtype=params["dtype"],
        precision=params["precision"],
        layers=chosen,
        image=image_steps_for(encoder, params["source"], image_changes),
        text=text_steps_for(encoder, {k: params[k] for k in TEXT_OPTIONS}),
    )


@app.command(
    epilog=(
        examples(
            "featbake build --encoder ckpt.pt --data ./audio",
            "featbake build --encoder encoder.pt2 --data ./audio --max-seconds 10 --dtype float16",
            "featbake build --encoder ./hubert-base --data ./audio --layers all --dtype int8",
            "featbake build --encoder mypkg.models:build --weights w.safetensors --data ./audio "
            "--device cuda --json",
            "featbake build --encoder ./wavlm-base-plus --data ./audio --layers 0,6,12 "
            "--precision bf16 --batch-seconds 200 --device cuda",
            "featbake build --encoder ./dinov2-small --data ./images   # transform from the folder",
            "featbake build --encoder ./clip-vit-b16-vision --data ./images --output pooled "
            "--crop 224 --interpolation bicubic",
            "featbake build --encoder ./dinov2-small --data ./images --views hflip",
            "featbake build --encoder ckpt.pt --data ./audio --cache s3://team-bucket/features "
            "--local-cache /scratch/featbake --local-cache-size 200GiB",
            "featbake build --encoder mypkg.vision:build --source image --data ./images "
            "--resize 256 --crop 224 --mean 0.485,0.456,0.406 --std 0.229,0.224,0.225",
            "torchrun --nproc-per-node 8 -m featbake build --encoder ckpt.pt --data ./audio "
            "--device cuda",
            "featbake build --encoder ckpt.pt --data ./audio --shard 0/2   "
            "# then --shard 1/2, merge",
            "OMP_NUM_THREADS=1 featbake build --encoder vad.pt --data ./audio   # or --threads 1",
            "featbake build --encoder ckpt.pt --data s3://bucket/audio/ --cache ./features   "
            "# inputs in a bucket",
            "featbake build --encoder ckpt.pt --data train.jsonl   # rows: path, start, end, id",
            "featbake build --encoder ckpt.pt --data data/train   # Kaldi wav.scp + segments",
        )
        + EXIT_CODES
    )
)
def build(
    ctx: typer.Context,
    encoder: EncoderOpt,
    data: DataOpt,
    column: ColumnOpt = None,
    cache: CacheOpt = None,
    local_cache: LocalCacheOpt = None,
    local_cache_size: LocalCacheSizeOpt = None,
    weights: WeightsOpt = None,
    source: SourceOpt = "audio",
    sample_rate: SampleRateOpt = 16000,
    mono: MonoOpt = True,
    max_seconds: MaxSecondsOpt = None,
    output: OutputOpt = None,
    dtype: DtypeOpt = "float32",
    max_error: Annotated[
        float,
        typer.Option(
            help="With --dtype int8/fp8: the relative RMS error against the encoder's output "
            "(measured on a sample) above which the build says so, e.g. --max-error 0.02."
        ),
    ] = 0.05,
    batch_size: Annotated[int, typer.Option(help="Inputs per encoder call at most.")] = 16,
    batching: Annotated[
        str,
        typer.Option(
            help="auto (padded length-sorted batches when the encoder takes lengths, and while "
            "they cost at most 1.1x per input what clips alone cost, timed by the guard), "
            "padded (always) or exact (equal shapes only)."
        ),
    ] = "auto",
    batch_seconds: Annotated[
        float | None,
        typer.Option(
            help="Audio per padded batch, padding included [default: 160].", show_default=False
        ),
    ] = None,
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
    views: Annotated[
        str | None,
        typer.Option(
            help="Images: also store these views' features, e.g. hflip (the horizontally "
            "flipped image, its own key); ViewsDataset serves one view per item.",
            show_default=False,
        ),
    ] = None,
    max_tokens: MaxTokensOpt = None,
    truncate: TruncateOpt = None,
    lowercase: LowercaseOpt = None,
    special_tokens: SpecialTokensOpt = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Decoding worker processes (0: decode in the encoder's process). Unset: none "
            "on 1-2 usable CPUs, one per 4 CPUs beyond (at most 8), all but one CPU for a GPU "
            "encoder. With --engine ray: the Ray actors, each decoding beside its encoder. "
            "[default: from the CPUs; 2 actors]",
            show_default=False,
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="The encoder's torch threads. Unset: torch's own count is kept "
            "(OMP_NUM_THREADS, or what the encoder's code set), lowered only to the CPUs this "
            "process may use. [default: torch's]",
            show_default=False,
        ),
    ] = None,
    device: DeviceOpt = "cpu",
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 256MiB.")] = "256MiB",
    seal_every: Annotated[
        float, typer.Option(help="Seal the shard being filled every N s: SIGKILL loses no more.")
    ] = 30.0,
    strict: Annotated[
        bool, typer.Option(help="Stop at the first bad input instead of skipping it.")
    ] = False,
    trust_pickle: TrustPickleOpt = False,
    allow_nonfinite: Annotated[
        bool,
        typer.Option(help="Store features that hold NaN or infinite values (default: refuse)."),
    ] = False,
    shard: Annotated[
        str | None,
        typer.Option(
            help="Do part I of N (I from 0), e.g. 0/4; under torchrun or a SLURM array the part "
            "comes from the environment. Parts write fragments; `featbake merge` folds them in.",
            show_default=False,
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Where the misses are encoded: local (this process) or ray (an actor pool on a "
            "Ray cluster: --workers actors, --gpus-per-worker, --ray-address; pip install "
            "'featbake[ray]'). Inputs are listed here either way; with ray, 256 or more "
            "inputs new to the hash cache are read and hashed by Ray tasks, not this process."
        ),
    ] = "local",
    gpus_per_worker: Annotated[
        float,
        typer.Option(
            help="--engine ray: GPUs each actor holds (its encoder runs on cuda), e.g. 1 or 0.5."
        ),
    ] = 0.0,  # a float default: an int one would be coerced by typer's pydantic adapter
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="--engine ray: the cluster's address, e.g. 10.0.0.5:6379 (the host:port "
            "`ray start` prints on its head node) or auto. [default: $RAY_ADDRESS, else a "
            "local Ray instance started for the build once it has inputs to hash or encode]",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run an encoder over a data folder once and store its features.

    Inputs already in the store are skipped (a rerun encodes nothing); bad inputs are skipped and
    listed at the end, and the exit code is then 3.
    """
    note_inert_options(ctx, cache)
    from featbake.bake.arguments import BATCHING_CHOICES, BuildArguments, refuse_a_missing_encoder
    from featbake.cpus import process_cpus
    from featbake.image_recipe import parse_views
    from featbake.store.open import open_store

    # The options' checks, in the order they always ran, need no torch; a missing encoder
    # path is named after them, before the build's modules (torch) are imported.
    if batching not in BATCHING_CHOICES:
        raise ConfigError(f"--batching must be auto, padded or exact, got {batching!r}")
    recipe = recipe_of(ctx.params, encoder)
    _note_unused(ctx, recipe.scheme is not None, batching)
    ray, workers, device = _ray_engine(engine, workers, gpus_per_worker, ray_address, device)
    chosen_views = parse_views(views)
    store = open_store(cache, local_cache=local_cache, local_cache_size=local_cache_size)
    shard_bytes = _shard_bytes(shard_size)
    sizes = BuildArguments(batching, batch_size, workers, shard_bytes, batch_seconds, None,
                           encoder, threads, seal_every)  # fmt: skip
    refuse_a_missing_encoder(encoder, recipe.source, chosen_views, sizes, process_cpus())
    from featbake.bake.views import build_views

    end_startup()  # torch and the build's modules are imported: the collector resumes
    bar = progress_bar()
    # Under torchrun only rank 0 draws a bar (it shows its own part), not N bars interleaved.
    on_progress = tick_bar(bar, {}) if os.environ.get("RANK", "0") == "0" else None
    with bar, stdout_for_json_only(as_json):
        reports = build_views(
            data,
            encoder,
            views=chosen_views,
            cache=store,
            recipe=recipe,
            weights=weights,
            trust_pickle=trust_pickle,
            batch_size=batch_size,
            workers=workers,
            device=device,
            strict=strict,
            shard_bytes=shard_bytes,
            progress=on_progress,
            allow_nonfinite=allow_nonfinite,
            batching=batching,
            batch_seconds=batch_seconds,
            shard=shard,
            threads=threads,
            max_error=max_error,
            seal_every=seal_every,
            column=column,
            engine=ray,
        )
    _report(reports, as_json)


def _note_unused(ctx: typer.Context, quantised: bool, batching: str) -> None:
    """One yellow line for each build option given that does nothing in this build: a user
    tuning it would otherwise see no effect and no word of why."""
    if on_command_line(ctx, "max_error") and not quantised:
        console.print("[yellow]note:[/] --max-error applies to --dtype int8 or fp8 builds only")
    if on_command_line(ctx, "batch_seconds") and batching == "exact":
        console.print("[yellow]note:[/] --batch-seconds sizes padded batches; --batching exact "
                      "makes none")  # fmt: skip


def _ray_engine(
    engine: str, workers: int | None, gpus: float, address: str | None, device: str
) -> tuple[Any, int | None, str]:
    """(the :class:`RayEngine` ``--engine ray`` asks for, the build's decode workers, the
    encoder's device), or (None, ``workers``, ``device``) for a build in this process (where
    the Ray options are refused). Under Ray, ``--workers`` counts the actors (default 2), each
    decoding beside its encoder, and ``--gpus-per-worker`` puts the encoder on cuda."""
    if engine == "local":
        if gpus or address:
            raise ConfigError("--gpus-per-worker and --ray-address go with --engine ray")
        return None, workers, device
    if engine != "ray":
        raise ConfigError(f"--engine must be local or ray, got {engine!r}")
    from featbake.bake.ray_engine import RayEngine

    ray = RayEngine(2 if workers is None else workers, gpus, address)
    return ray, None, "cuda" if gpus > 0 and device == "cpu" else device


def _shard_bytes(shard_size: str) -> int:
    """``--shard-size`` in bytes (its error names the option)."""
    try:
        return parse_bytes(shard_size)
    except ConfigError as e:
        raise ConfigError(f"--shard-size: {e}") from e


def _report(reports: list[Any], as_json: bool) -> None:
    """Print each view's report (one JSON object, or a list with --views); exit 3 on failures."""
    if as_json:
        shown = [r.to_json() for r in reports]
        out.print_json(json.dumps(shown[0] if len(shown) == 1 else shown))
    else:
        for report in reports:
            _print_build_summary(report)
    for report in reports:
        if report.failed:
            raise incomplete(report, "in the JSON's failed" if as_json else "listed above")


#: What every input failing alike points at, by whose failure it is: the encoder's (a mono
#: encoder given --no-mono) or the data's (every row names a missing file, a typo'd column, a
#: table without bytes). The advice names the options that change each.
POINTS_AT = {
    FailureCause.ENCODER: (
        "That points at the encoder or the options (--source, --output, --layers; for audio "
        "--mono/--no-mono, --sample-rate, --max-seconds; for images --resize, --crop; for "
        "texts --max-tokens), not at the inputs: check them against what the encoder expects "
        "and rerun"
    ),
    FailureCause.DATA: (
        "That points at the data, not at the encoder: fix the inputs (the rows, files or "
        "cells named above) or how they are read (--data, --column, --source) and rerun"
    ),
}


def incomplete(report: BuildReport, where: str = "listed above") -> BuildIncomplete:
    """The error for a build that skipped inputs: each input's own (``where`` they are
    named: above, or under ``--json`` in the report's ``failed``), or, when every input
    failed the same way (see :meth:`BuildReport.common_failure`), what their one cause points
    at (:data:`POINTS_AT`, by :meth:`BuildReport.common_cause`)."""
    common, cause = report.common_failure(), report.common_cause()
    if common is not None and cause is not None:
        return BuildIncomplete(
            f"every input ({report.files}) failed the same way: {common}. {POINTS_AT[cause]}"
        )
    if cause is not None and len(report.failed) >= 2 and len(report.failed) >= report.files:
        # In ways that differ by more than numbers (an output of another shape for some
        # lengths), yet each in the same place: still not the inputs' fault, one by one.
        rel, reason = report.failed[0]
        first = reason.removeprefix(f"{rel}: ")
        return BuildIncomplete(
            f"every input ({report.files}) failed, each in the {cause.value} (the first: "
            f"{first}). {POINTS_AT[cause]}"
        )
    return BuildIncomplete(
        f"{len(report.failed)} of {report.files} inputs failed ({where}); "
        "everything else is stored. Fix or remove them and rerun; finished work is not redone"
    )


def _part_said(report: Any) -> str:
    """A part's summary row: its fragment sealed, then merged (by rank 0 under torchrun, for
    the other ranks: it merged before any rank returned) or the merge still to run."""
    if not report.merged:
        return f"{report.part}: fragment sealed, run `featbake merge` once every part is done"
    by = f" by {report.merged_by}" if report.merged_by else ""
    return f"{report.part}: fragment sealed, merged{by}"


def _print_build_summary(report: Any) -> None:
    from featbake.quantize import Fidelity  # torch: imported when a build ran, not for --help

    rows: list[tuple[str, str]] = []
    rows.append(("root", report.root))
    rows.append(("encoder", f"{escape(report.encoder)} ({report.encoder_fp[:12]})"))
    rows.append(("files", f"{report.files:,}"))
    rows.append(("encoded", f"{report.encoded:,}"))
    rows.append(("reused", f"{report.reused:,}"))
    if report.derived:
        rows.append(("copied", f"{report.derived:,} parts a whole-output build stored"))
    if report.converted:
        rows.append(("converted", f"{report.converted:,} from the store's float32 features"))
    if report.duplicates:
        rows.append(("duplicates", f"{report.duplicates:,} (identical files share a feature)"))
    rows.append(("failed", f"[red]{len(report.failed):,}[/]" if report.failed else "0"))
    written = f"{format_bytes(report.bytes_written)} in {counted(report.shards_written, 'shard')}"
    rows.append(("written", written))
    if report.batching_note:
        rows.append(("batching", escape(report.batching_note)))
    if report.fidelity:
        rows.append(("fidelity", Fidelity.from_json(report.fidelity).summary()))
    rows.append(("time", f"{report.seconds:.2f}s"))
    if report.part:
        rows.append(("part", _part_said(report)))
    for line in summary_lines(rows):
        out.print(line)
    for path, reason in report.failed[:50]:
        reason = reason.removeprefix(f"{path}: ")  # most reasons name their file already
        console.print(f"[red]failed[/] {escape(path)}: {escape(reason)}")
    if len(report.failed) > 50:
        console.print(f"[red]... and {len(report.failed) - 50} more (see --json)")
    if report.fidelity_warning:
        console.print(f"[yellow]warning[/] {escape(report.fidelity_warning)}")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
