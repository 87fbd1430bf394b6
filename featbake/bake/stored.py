"""The build's step from encoded parts to stored ones (cast or quantised), and its fidelity.

The check that an encoder's output holds no NaN or infinity, once per stored item, is
:func:`featbake.encode.outputs.nonfinite_part`, shared with the paths that encode misses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featbake.bake.report import BuildReport
from featbake.encode.outputs import stored_parts
from featbake.quantize import LOST_DIM, Fidelity, ScaleSpan, Scheme, dequantize, unpack
from featbake.recipe import Recipe
from featbake.store.catalog import BuildCatalog
from featbake.store.fidelity import SERVED, Measured

# == compact =======================================================================================
# The build's quantising step (``--dtype int8`` / ``fp8``) and its fidelity measurement.
#
# Every encoded item passes through :meth:`Compactor.store` on its way to the writer: float
# dtypes go through untouched; quantised ones are packed
# (:func:`featbake.encode.outputs.stored_parts`) and, for a sample of items, what a reader will
# be served is compared with the encoder's own output, after the cast to the dtype it is served
# in (float16 when that holds every stored value, else float32: :class:`Measured`). The sample
# is the first
# :data:`FIRST_ITEMS` items plus one key in :data:`SAMPLE_EVERY` after that (chosen by key, so
# a rebuild measures the same items); measuring one ``[150, 768]`` item costs about a
# millisecond beside the encoder's tens.
#: Items always measured (a small build is measured whole).
FIRST_ITEMS = 64
#: After the first items, one key in this many is measured.
SAMPLE_EVERY = 16
#: The default bound on the relative RMS error (5%): int8 is ~0.5-1% and fp8 ~2.5-3% on
#: Gaussian-like frames; a build over it is told so (``--max-error`` sets it).
DEFAULT_MAX_ERROR = 0.05


def sampled(key: str, measured: int) -> bool:
    """Whether the item keyed ``key`` is measured, ``measured`` items having been so far.

    Example:
        >>> sampled("f" * 64, 0), sampled("f" * 64, 1000), sampled("0" * 64, 1000)
        (True, False, True)
    """
    return measured < FIRST_ITEMS or int(key[:8], 16) % SAMPLE_EVERY == 0


@dataclass
class Compactor:
    """Float parts in, stored parts out; the fidelity of quantised ones tallied on a sample.

    Example:
        >>> c = Compactor(Recipe(dtype="int8"))
        >>> c.store("00" * 32, {"": torch.randn(10, 8)})[""].dtype
        torch.int8
        >>> c.fidelity().items
        1
    """

    recipe: Recipe
    measured: Measured | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        scheme = self.recipe.scheme
        self.measured = Measured(scheme) if scheme is not None else None

    def store(
        self, key: str, parts: dict[str, torch.Tensor], *, measure: bool = True
    ) -> dict[str, torch.Tensor]:
        """``parts`` as stored (packed for int8/fp8), measured when the key is sampled (and
        ``measure``: an item stored again, see bake/pipeline.py, was measured the first time)."""
        m = self.measured
        if m is None:
            return parts
        stored = stored_parts(parts, self.recipe)
        for v in stored.values():  # every item: one value past float16 decides how it is served
            m.span = m.span.merged(ScaleSpan.of(unpack(v, m.scheme).scales))
        if measure and sampled(key, m.tallies["float16"].items):
            for name, dtype in SERVED.items():
                served = {n: dequantize(v, m.scheme, dtype) for n, v in stored.items()}
                m.tallies[name].add_parts(parts, served)
        return stored

    def copied(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``stored`` parts copied as they are from a build of this dtype (a derived build's
        copy): their scales join the span that decides the served dtype, as an encoded item's
        do. Nothing is tallied (there is no float output to compare with). Before, a root made
        of copies recorded no span, and a store past float16's range was refused by every
        dataset, where a fresh build of the same recipe is served as float32."""
        m = self.measured
        if m is not None:
            for v in stored.values():
                if v.dtype == m.scheme.packed_dtype:
                    m.span = m.span.merged(ScaleSpan.of(unpack(v, m.scheme).scales))
        return stored

    def fidelity(self) -> Fidelity | None:
        """What was measured on what is served, or None (a float dtype, or nothing encoded)."""
        return self.measured.fidelity() if self.measured is not None else None

    def record(self, report: BuildReport, catalog: BuildCatalog, max_error: float | None) -> None:
        """Put what int8/fp8 cost in the report and beside the root (``featbake roots``); a
        part of a build holds it for its done fragment, whose merge records it."""
        fidelity, measured = self.fidelity(), self.measured
        if measured is None or (fidelity is None and not measured.span.known()):
            return
        report.fidelity = None if fidelity is None else fidelity.to_json()
        notes = (
            over_bound(fidelity, max_error),
            dims_lost_note(fidelity, measured.scheme, max_error),
            served_note(measured),
        )
        report.fidelity_warning = "; ".join(n for n in notes if n)
        catalog.record_fidelity(report.root, measured, max_error)


def over_bound(fidelity: Fidelity | None, bound: float | None) -> str:
    """A line saying the measured error is over ``bound``, or ``""`` when it is not.

    Example:
        >>> over_bound(Fidelity(3, 0.08, 0.1, 0.99, 0.9), 0.05)[:40]
        'the stored features are 8.00% off the en'
    """
    if fidelity is None or bound is None or fidelity.rel_rms <= bound:
        return ""
    return (
        f"the stored features are {fidelity.rel_rms:.2%} off the encoder's output (relative RMS "
        f"error over {fidelity.items} sampled items), over the bound of {bound:.2%}: store a "
        "wider dtype (--dtype int8 over fp8, or float16: bfloat16 where values pass float16's "
        "65504), or raise --max-error"
    )


def dims_lost_note(fidelity: Fidelity | None, scheme: Scheme, bound: float | None) -> str:
    """A line saying some feature dimensions are lost to rounding (:data:`LOST_DIM`), whatever
    the whole error says, or ``""`` (none lost, or no bound: ``--max-error`` unset).

    Example:
        >>> dims_lost_note(Fidelity(3, 0.03, 0.03, 0.99, 0.99, dims=768, dims_lost=767),
        ...                Scheme.INT8, 0.05)[:46]
        '767 of 768 feature dimensions are mostly round'
    """
    if fidelity is None or bound is None or not fidelity.dims_lost:
        return ""
    floats = "float16 (bfloat16 where values pass float16's 65504)"
    wider = f"--dtype fp8 (its codes keep small values beside large ones) or {floats}"
    return (
        f"{fidelity.dims_lost} of {fidelity.dims} feature dimensions are mostly rounding error "
        f"as stored (each over {LOST_DIM:.0%} relative RMS error over {fidelity.items} sampled "
        "items: a few large dimensions set each row's scale, and the small ones round to "
        f"zero): store {wider if scheme is Scheme.INT8 else floats}"
    )


def served_note(measured: Measured | None) -> str:
    """A line saying the store is served as float32 by default because float16 cannot hold
    its values (an ``inf``, or a rounding coarser than the codes), or ``""``."""
    if measured is None or measured.served() == "float16":
        return ""
    return (
        f"the stored features hold {measured.span.describe(measured.scheme)}, which float16 "
        "cannot serve exactly: datasets serve this store as float32 by default (float16 is "
        "refused; serve_dtype='bfloat16' halves the bytes)"
    )
