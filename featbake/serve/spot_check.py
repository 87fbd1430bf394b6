"""Spot checks: a seeded sample of a root's items encoded now and compared with what is stored.

``featbake verify`` checks a store's bytes: each shard against its content name and CRCs, the
catalog against the shards, the hash cache against the inputs. A feature that is well-formed but
wrong passes all of that: a shard forged or copied in (valid CRCs, other values), a build run
with the encoder in train mode or a nondeterministic op, a recipe bug, a store built by another
encoder file than the user thinks. :func:`spot_check` answers what those checks cannot: does the
store hold what this encoder gives now for these inputs?

It finds the root that (data, encoder as named, recipe) names, as a dataset does, indexes the
data through it (:func:`~featbake.serve.index.build_index`, nothing published), draws a seeded
sample of its items, decodes and encodes each with the dataset's own live path (the miss's
source, :class:`~featbake.serve.misses.LiveEncoder`, :func:`~featbake.serve.misses.encode_inputs`:
the same preprocessing), reads the stored feature (every CRC checked) and compares the two
within what the stored dtype promises (:func:`tolerance`). It never writes to the store: its
catalog is opened read-only (no hash rows, no encoder rows, no root, no last use), and an item the
store lacks is reported, never encoded into it.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from featbake.encode.encoders import (
    EXACT_TOLERANCE,
    LoadedEncoder,
    finite_max,
    max_error,
    training_submodule,
)
from featbake.encode.hf import recipe_for_encoder
from featbake.encode.inputs import inputs_at
from featbake.encode.sources import source_for
from featbake.errors import CacheMiss, ConfigError, FeatbakeError, StoreCorrupt
from featbake.keys import root_id
from featbake.quantize import damaged_positions, dequantize
from featbake.recipe import Recipe
from featbake.serve.index import Index, IndexSpec, build_index
from featbake.serve.misses import (
    LiveEncoder,
    decode_items,
    encode_inputs,
    miss_source,
    recipe_differences,
    stored_builds,
)
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.store.open import Need, describe, open_store

#: Items a spot check samples unless told otherwise.
DEFAULT_SAMPLE = 32

#: The exit code of a spot check that found stored features other than the encoder gives now.
#: Not verify's 11 ("damage remains, run --repair"): these features' bytes and checksums are
#: sound, so --repair keeps them; the fix is to drop the root and build again (or to find out
#: which encoder built it), and a script must be able to tell the two apart.
SPOT_CHECK_MISMATCH = 12

#: The exit code of a spot check that found a sampled item's stored bytes damaged (a checksum
#: that fails, or an int8/fp8 row scale that is not finite): verify's 11
#: (``featbake.upkeep.VERIFY_DAMAGED``), "damage remains, run --repair", which quarantines the
#: shard for a build to recompute; never 12, whose features --repair keeps.
SPOT_CHECK_DAMAGED = 11

#: The exit code of a spot check that compared no item (every sampled item missing from the
#: store, changed since the build, or unreadable): :class:`~featbake.errors.CacheMiss`'s, as
#: when the store holds no such root. Never 0: a check that compared nothing vouches for nothing.
NOTHING_COMPARED = 7

#: The exit code of a spot check whose compared items all matched but some of whose sampled
#: inputs changed since the build (their bytes now make another key than the build recorded):
#: the store is sound, but stale for that data; building again encodes them.
INPUTS_CHANGED = 13

#: Items decoded and encoded at a time (bounds the memory a large sample holds).
CHUNK = 8

#: Stored dtype -> the largest error storing a value adds, relative to the largest magnitude
#: of its feature: float16 and bfloat16 round to nearest (half an ulp: 2^-11, 2^-8); int8 keeps
#: a row within half a step of its scale (max|row| / 127); fp8 (e4m3) within half an ulp of 3
#: mantissa bits (2^-4) of each value (see featbake/quantize.py).
STORAGE_ERROR = {
    "float32": 0.0,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "int8": 0.5 / 127,
    "fp8": 2.0**-4,
}

#: The absolute floor of a tolerance: an all-zero feature is still compared, not divided by 0.
ABS_FLOOR = 1e-6


class Verdict(StrEnum):
    """What a spot check found of one sampled item."""

    MATCH = "match"  # stored within tolerance of the encoder's output now
    MISMATCH = "mismatch"  # stored, and not what the encoder gives now
    MISSING = "missing"  # the store does not hold this item's feature (not a mismatch)
    CHANGED = "changed"  # its input's bytes changed since the build: another key than recorded
    UNREADABLE = "unreadable"  # its input cannot be read now: nothing to compare
    DAMAGED = "damaged"  # its stored bytes are damaged (`featbake verify --repair`): not compared


@dataclass(frozen=True)
class ItemCheck:
    """One sampled item: its id and key, the verdict, and (compared items) the largest
    absolute error of any part against that part's tolerance."""

    item: str
    key: str
    verdict: Verdict
    max_abs_error: float = 0.0
    tolerance: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class SpotCheckReport:
    """What :func:`spot_check` found.

    Attributes:
        store: the store, as messages name it.
        root: the root checked (named by data, encoder as named and recipe).
        encoder: the encoder as named (its label) and ``encoder_fp`` its fingerprint.
        dtype: the stored dtype the tolerances are fitted to.
        items: the root's items (what the sample was drawn from).
        seed: the sample's seed: the same seed draws the same items.
        checks: one per sampled item, in item order.
        likely_cause: one line when the encoder itself explains mismatches (train mode, or two
            runs of one batch that differ), else None.
        seconds: how long the check took.
    """

    store: str
    root: str
    encoder: str
    encoder_fp: str
    dtype: str
    items: int
    seed: int
    checks: tuple[ItemCheck, ...]
    likely_cause: str | None
    seconds: float

    def of(self, verdict: Verdict) -> list[ItemCheck]:
        """The sampled items with this verdict."""
        return [c for c in self.checks if c.verdict is verdict]

    @property
    def checked(self) -> int:
        """Items compared (matched or not)."""
        return len(self.of(Verdict.MATCH)) + len(self.of(Verdict.MISMATCH))

    @property
    def mismatched(self) -> int:
        return len(self.of(Verdict.MISMATCH))

    @property
    def missing(self) -> int:
        return len(self.of(Verdict.MISSING))

    @property
    def unreadable(self) -> int:
        return len(self.of(Verdict.UNREADABLE))

    @property
    def changed(self) -> int:
        return len(self.of(Verdict.CHANGED))

    @property
    def damaged(self) -> int:
        return len(self.of(Verdict.DAMAGED))

    @property
    def exit_code(self) -> int:
        """:data:`SPOT_CHECK_DAMAGED` when a sampled item's stored bytes are damaged (repair
        first: what a rebuild recomputes is then checked again); else
        :data:`SPOT_CHECK_MISMATCH` when a compared item mismatched; else
        :data:`NOTHING_COMPARED` when no item was compared; else :data:`INPUTS_CHANGED` when a
        sampled input changed since the build; else 0 (items the store lacks, evicted or
        deleted, are reported, not failed)."""
        if self.damaged:
            return SPOT_CHECK_DAMAGED
        if self.mismatched:
            return SPOT_CHECK_MISMATCH
        if not self.checked:
            return NOTHING_COMPARED
        return INPUTS_CHANGED if self.changed else 0

    def nothing_compared(self) -> str | None:
        """The one line of a check that compared no item, saying why (None: some were, or some
        stored items are damaged, which the report's own lines say)."""
        if self.checked or self.damaged:
            return None
        n = len(self.checks)
        why = [
            f"{self.changed} changed since the build (their bytes now make other keys than it "
            "recorded: run `featbake build` again to encode them)" if self.changed else "",
            f"{self.missing} evicted or deleted from the store (`featbake build` again stores "
            "them)" if self.missing else "",
            f"{self.unreadable} unreadable now" if self.unreadable else "",
        ]  # fmt: skip
        return (
            f"nothing to compare: {n} of {n} sampled items of root {self.root} are not in the "
            f"store as its build stored them: " + "; ".join(w for w in why if w)
        )

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.update(
            checked=self.checked, mismatched=self.mismatched, missing=self.missing,
            unreadable=self.unreadable, changed=self.changed, damaged=self.damaged,
            exit_code=self.exit_code,
        )  # fmt: skip
        for check in doc["checks"]:  # JSON has no infinity: a shape that differs is null
            if not math.isfinite(check["max_abs_error"]):
                check["max_abs_error"] = None
        return doc


# == tolerance =====================================================================================
def tolerance(recipe: Recipe, live: torch.Tensor) -> float:
    """How far a stored part may be from ``live`` (the encoder's output now) and still be it:
    what the stored dtype adds (:data:`STORAGE_ERROR`) plus what running it again may (the
    build's exactness tolerance at the recipe's precision: another batch, other kernels), both
    relative to the part's largest magnitude.

    Example:
        >>> tolerance(Recipe(dtype="float16"), torch.tensor([2.0, -4.0])) > 4.0 * 2.0**-11
        True
    """
    scale = finite_max(live)  # a NaN or inf in it is compared by max_error, never a scale
    rel = EXACT_TOLERANCE[recipe.precision].relative + STORAGE_ERROR[recipe.dtype]
    return max(rel * scale, ABS_FLOOR)


def as_float(stored: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """A stored part as float32 values: dequantised (int8/fp8) or widened."""
    scheme = recipe.scheme
    return stored.float() if scheme is None else dequantize(stored, scheme, torch.float32)


def compare(
    item: str, key: str, stored: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor],
    recipe: Recipe,
) -> ItemCheck:  # fmt: skip
    """One item's verdict: every part within its tolerance, or the part furthest out of it."""
    if set(stored) != set(live):
        detail = f"parts {sorted(stored)} stored, {sorted(live)} now"
        return ItemCheck(item, key, Verdict.MISMATCH, math.inf, 0.0, detail)
    worst = (0.0, ABS_FLOOR, "")
    for part, now in live.items():
        got = as_float(stored[part], recipe)
        if got.shape != now.shape:
            shapes = f"shape {list(got.shape)} stored, {list(now.shape)} now"
            return ItemCheck(item, key, Verdict.MISMATCH, math.inf, 0.0, shapes)
        error = max_error(got, now)  # inf where one holds NaN or inf and the other not
        allowed = tolerance(recipe, now)
        if error / allowed >= worst[0] / worst[1]:
            worst = (error, allowed, part)
    error, allowed, part = worst
    verdict = Verdict.MATCH if error <= allowed else Verdict.MISMATCH
    return ItemCheck(item, key, verdict, error, allowed, f"part {part}" if part else "")


# == the check =====================================================================================
def _root_of(
    catalog: Catalog, layout: Layout, data: str, name: str, live: LiveEncoder, recipe: Recipe
) -> None:
    """Raise unless the store holds root ``name`` of ``data``, built by this encoder.

    Raises:
        CacheMiss: no such root (another encoder file, other recipe options, other data, or
            a file rewritten since the build), in one line naming what the store does hold.
    """
    root = catalog.root(name)
    if root is not None and root.encoder_fp == live.fingerprint:
        return
    where = describe(layout)
    if root is not None:
        raise CacheMiss(
            f"the root of {data} in {where} was built by another version of {live.label} "
            f"(fingerprint {root.encoder_fp[:12]}, this file is {live.fingerprint[:12]}): "
            "nothing to spot-check; rebuild with this file, or check the one that built it"
        )
    builds = stored_builds(layout, data)
    held = (
        f"it holds {len(builds)} root(s) of this data, built with "
        + ", ".join(sorted({b.encoder_label for b in builds}))
        if builds
        else "it holds no root of this data"
    )
    same = [b for b in builds if b.encoder_label == live.label]  # newest first
    if same:  # this encoder, other options: name them
        held += "; with this encoder: " + "; ".join(
            recipe_differences(recipe.as_dict(), same[0].recipe)
        )
    raise CacheMiss(
        f"no root of {data} for encoder {live.label} with these options in {where} ({held}): "
        "nothing to spot-check; pass the --encoder, --data and recipe options the build was "
        "given (`featbake roots` lists each root's encoder and recipe)"
    )


def sample_of(n: int, sample: int, seed: int) -> list[int]:
    """``sample`` positions of ``n`` drawn by ``seed`` (all of them when fewer), in order.

    Example:
        >>> sample_of(10, 3, 0) == sample_of(10, 3, 0), sample_of(2, 5, 0)
        (True, [0, 1])
    """
    return sorted(random.Random(seed).sample(range(n), min(sample, n)))


@dataclass
class _Run:
    """What the check holds while it runs: the index, the encoder, the reader, the recipe."""

    index: Index
    live: LiveEncoder
    reader: FeatureReader
    recipe: Recipe
    fps: tuple[str, str]
    source: Any
    encoding: Recipe  # the recipe the encoder runs under: float32 outputs (see unrounded)
    recorded: Mapping[str, str]  # item -> the key its build recorded (the root's manifest)
    loaded: LoadedEncoder | None = None  # loaded once, at the first item encoded
    checkpoint: Callable[[], None] = lambda: None  # a stop signal's, before each item decoded

    def encoder(self) -> LoadedEncoder:
        """The encoder, loaded on first use as a dataset's miss loads it (then kept)."""
        if self.loaded is None:
            self.loaded = self.live.for_this_process()
        return self.loaded

    def check(self, picks: Sequence[int]) -> list[ItemCheck]:
        """The verdicts of items ``picks``: missing ones read nothing and encode nothing."""
        keys = {i: self.index.key(i) for i in picks}
        located = self.reader.catalog.locate_many(sorted(set(keys.values())))
        out: dict[int, ItemCheck] = {}
        present: list[int] = []
        for i in picks:
            if located.get(keys[i]):
                present.append(i)
            else:
                out[i] = self._absent(i, keys[i])
        decoded: dict[int, torch.Tensor] = {}
        for i in present:  # one by one: one unreadable input is its item's verdict, not all's
            self.checkpoint()
            try:
                decoded[i] = decode_items(self.source, self.index, [i], self.fps)[0]
            except FeatbakeError as e:
                out[i] = ItemCheck(self.index.rel(i), keys[i], Verdict.UNREADABLE, detail=str(e))
        order = list(decoded)
        enc = self.encoder()
        encoded = encode_inputs(enc, [decoded[i] for i in order], self.encoding) if order else []
        for i, parts in zip(order, encoded, strict=True):
            out[i] = self._verdict(i, keys[i], located[keys[i]], parts)
        return [out[i] for i in picks]

    def _absent(self, i: int, key: str) -> ItemCheck:
        """The verdict of an item whose key the store lacks: changed, when the build recorded
        another key for it (its bytes changed since; a rewrite that kept size and mtime
        too), else missing (evicted, deleted, or never built)."""
        item = self.index.rel(i)
        then = self.recorded.get(item)
        if then and then != key:
            detail = f"the build recorded key {then[:12]}, its bytes now make {key[:12]}"
            return ItemCheck(item, key, Verdict.CHANGED, detail=detail)
        return ItemCheck(item, key, Verdict.MISSING)

    def _verdict(
        self, i: int, key: str, locations: Any, live: Mapping[str, torch.Tensor]
    ) -> ItemCheck:
        item = self.index.rel(i)
        try:
            stored = self.reader.get_located(key, locations)
        except StoreCorrupt as e:  # a checksum that fails: the error names the shard
            return ItemCheck(item, key, Verdict.DAMAGED, detail=str(e))
        except FeatbakeError as e:
            return ItemCheck(item, key, Verdict.MISMATCH, math.inf, 0.0, f"unreadable: {e}")
        if stored is None:  # gone since it was looked up (gc moved it away)
            return ItemCheck(item, key, Verdict.MISSING)
        scheme = self.recipe.scheme
        if scheme is not None and any(damaged_positions(t, scheme) for t in stored.values()):
            detail = (
                "a stored row's scale is not finite (its shard is damaged); run `featbake verify "
                "--repair` to quarantine it, then `featbake build` to recompute what it held"
            )
            return ItemCheck(item, key, Verdict.DAMAGED, detail=detail)
        return compare(item, key, stored, live, self.recipe)

    def likely_cause(self, picks: Sequence[int]) -> str | None:
        """One line when the encoder explains mismatches by itself: a module left in train mode
        (a torch.export file keeps the mode it was exported in), or two runs of one input that
        differ beyond the fp32 tolerance (dropout, a nondeterministic op); else None."""
        enc = self.encoder()
        training = training_submodule(enc.module)
        if training is not None:
            return (
                f"the encoder {self.live.label} is in train mode ({training}): dropout or batch "
                "statistics change its output at every run, so the store cannot match it; "
                "export or save it after .eval() and build again"
            )
        for i in picks:
            try:
                x = decode_items(self.source, self.index, [i], self.fps)
            except FeatbakeError:
                continue
            first, second = (encode_inputs(enc, x, self.encoding)[0] for _ in range(2))
            if any(_differ(first[p], second[p], self.recipe) for p in first):
                return (
                    f"the encoder {self.live.label} is nondeterministic: two runs of the same "
                    "batch differ (dropout left on, or a nondeterministic op), so the store "
                    "cannot match it; fix the encoder and build again"
                )
            return None
        return None


def _differ(a: torch.Tensor, b: torch.Tensor, recipe: Recipe) -> bool:
    """Two runs of one input further apart than running it again may put them."""
    if a.shape != b.shape:
        return True
    scale = float(b.abs().max()) if b.numel() else 0.0
    allowed = max(EXACT_TOLERANCE[recipe.precision].relative * scale, ABS_FLOOR)
    return bool((a.double() - b.double()).abs().max() > allowed) if b.numel() else False


def spot_check(  # noqa: PLR0913 - the build's encoder and recipe options, and the sample's
    data: str | os.PathLike[str],
    encoder: str | os.PathLike[str],
    *,
    recipe: Recipe | None = None,
    cache: str | os.PathLike[str] | Layout | None = None,
    local_cache: str | os.PathLike[str] | None = None,
    local_cache_size: int | str | None = None,
    sample: int = DEFAULT_SAMPLE,
    seed: int = 0,
    weights: str | os.PathLike[str] | None = None,
    trust_pickle: bool = False,
    device: str = "cpu",
    column: str | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> SpotCheckReport:
    """Encode a seeded sample of the items of the root (data, encoder, recipe) now and compare
    each with its stored feature, within what the stored dtype promises. Writes nothing.

    Args:
        data, encoder, recipe, weights, trust_pickle, column: as ``featbake build`` took them
            (the root is named by data, encoder as named, recipe and column).
        cache, local_cache, local_cache_size: the store, as :func:`open_store` takes them.
        sample: items to check (all of the root's when it has fewer).
        seed: draws the sample: the same seed checks the same items.
        device: where the encoder runs.
        checkpoint: called before each item is decoded: the CLI's stop signal check
            (``featbake.bake.interrupt``), so Ctrl-C or SIGTERM stops between items (raised
            inside a decoder's callback, the stop was ignored and the check went on).

    Returns:
        The report: one :class:`ItemCheck` per sampled item, and the encoder's own likely
        cause of mismatches when it has one.

    Raises:
        ConfigError: ``sample`` below 1, or an option the recipe refuses.
        StoreError: there is no store at ``cache``.
        CacheMiss: the store holds no such root (another encoder, other options).
        EncoderLoadError: the encoder cannot be loaded.

    Example:
        >>> report = spot_check("./audio", "ckpt.pt", sample=16)  # doctest: +SKIP
        >>> report.mismatched, report.exit_code  # doctest: +SKIP
        (0, 0)
    """
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ConfigError(f"--sample must be a whole number from 1, got {sample!r}")
    started = time.monotonic()
    recipe = recipe_for_encoder(encoder, recipe or Recipe())
    layout = open_store(cache, need=Need.CATALOG, local_cache=local_cache,
                        local_cache_size=local_cache_size)  # fmt: skip
    live = LiveEncoder(
        layout, None, os.fspath(weights) if weights is not None else None, trust_pickle,
        device, recipe.layers, read_only=True,
    )  # fmt: skip
    reader = FeatureReader(layout, verify="always", read_only=True)
    try:
        run = _prepared(data, encoder, recipe, live, reader, column)
        if checkpoint is not None:
            run.checkpoint = checkpoint
        picks = sample_of(len(run.index), sample, seed)
        checks = [c for j in range(0, len(picks), CHUNK) for c in run.check(picks[j : j + CHUNK])]
        cause = run.likely_cause(picks)
    finally:
        reader.close()
    return SpotCheckReport(
        describe(layout), run.index.root or "", live.label, live.fingerprint, recipe.dtype,
        len(run.index), seed, tuple(checks), cause, time.monotonic() - started,
    )  # fmt: skip


def _prepared(
    data: str | os.PathLike[str], encoder: Any, recipe: Recipe, live: LiveEncoder,
    reader: FeatureReader, column: str | None,
) -> _Run:  # fmt: skip
    """The encoder identified, its root found (else :class:`CacheMiss`) and the data indexed
    through it, with nothing written: hashes and fingerprints are looked up, never recorded."""
    catalog = reader.catalog
    live.identify(encoder, catalog)
    source = source_for(recipe)
    recipe_fp = recipe.fingerprint()
    where = inputs_at(data, column, recipe.source).where
    name = root_id(where, live.label, recipe_fp, column)
    _root_of(catalog, live.layout, where, name, live, recipe)
    spec = IndexSpec(live.fingerprint, live.label, recipe_fp, recipe.as_dict(),
                     tuple(source.extensions))  # fmt: skip
    index = build_index(os.fspath(data), spec, catalog, publish=False, new_root=False,
                        column=column)  # fmt: skip
    fps = (live.fingerprint, recipe_fp)
    recorded = dict(catalog.root_items(name))
    return _Run(index, live, reader, recipe, fps, miss_source(index, source), unrounded(recipe),
                recorded)  # fmt: skip


def unrounded(recipe: Recipe) -> Recipe:
    """``recipe`` encoding in float32: the encoder's own output, which the stored feature is
    compared with (a float16 recipe's live path rounds to float16 first, and would compare
    float16 with float16: a tolerance fitted to float16 must see what rounding did)."""
    return recipe if recipe.scheme is not None else recipe.replace(dtype="float32")


__all__ = [
    "DEFAULT_SAMPLE",
    "INPUTS_CHANGED",
    "NOTHING_COMPARED",
    "SPOT_CHECK_MISMATCH",
    "STORAGE_ERROR",
    "ItemCheck",
    "SpotCheckReport",
    "Verdict",
    "compare",
    "sample_of",
    "spot_check",
    "tolerance",
]
