"""A root's measured fidelity: what a quantised build measured, and its ``.fidelity`` record.

Why a file beside the manifest and not a catalog column: the measurement belongs to the root
(its data, encoder and recipe), is written once per build and read only by ``stats`` and
``roots``; a small JSON file needs no schema migration, and the manifest itself is written
before encoding starts (so readers can map items to keys), when nothing has been measured yet.
Dropping a root removes it with the manifest (:meth:`featbake.store.catalog.RootRows.drop_root`).

A build done in parts (``--shard I/N``, torchrun ranks, any build into a bucket) has no root
file to write while it runs: each rank carries its :class:`Measured` sums in its ``done``
fragment (:mod:`featbake.store.fragments`), and the merge (:mod:`featbake.store.merge`) pools
them and writes the record.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featbake.errors import StoreError
from featbake.quantize import Fidelity, FidelityTally, ScaleSpan, Scheme
from featbake.store.files import publish_file
from featbake.store.layout import Layout, checked_root_name

#: The dtypes whose roots carry a fidelity record.
QUANTISED = ("int8", "fp8")


#: The dtypes a quantised store is measured and served in: float16 (the default) when it holds
#: every stored value, float32 when it does not (see :meth:`ScaleSpan.holds`).
SERVED_NAMES = ("float16", "float32")

if TYPE_CHECKING:
    import torch

    #: :data:`SERVED_NAMES` -> its torch dtype (made on first use: :func:`served_dtypes`).
    SERVED: dict[str, torch.dtype]


@functools.cache
def served_dtypes() -> dict[str, torch.dtype]:
    """:data:`SERVED_NAMES` -> its torch dtype, made once, when first asked for: ``stats``,
    ``roots``, ``gc`` and ``merge`` read fidelity records without loading torch."""
    import torch

    return {d: getattr(torch, d) for d in SERVED_NAMES}


def __getattr__(name: str) -> Any:
    """``SERVED``, importable as before but made on first use (PEP 562)."""
    if name == "SERVED":
        return served_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _empty_tallies() -> dict[str, FidelityTally]:
    return {d: FidelityTally() for d in SERVED_NAMES}


@dataclass
class Measured:
    """What a quantised build (or one part of it) measured: a tally per dtype it may be served
    in, and the span of every stored row's scale (every item, not only the sampled ones).

    Example:
        >>> m = Measured(Scheme.INT8)
        >>> m.merged(Measured(Scheme.INT8)).served()
        'float16'
    """

    scheme: Scheme
    tallies: dict[str, FidelityTally] = field(default_factory=_empty_tallies)
    span: ScaleSpan = field(default_factory=ScaleSpan)

    def served(self) -> str:
        """The dtype this store is served in by default: float16 unless a value does not fit."""
        import torch

        return "float16" if self.span.holds(torch.float16, self.scheme) else "float32"

    def fidelity(self) -> Fidelity | None:
        """The fidelity of what is served by default, or None (nothing measured)."""
        tally = self.tallies[self.served()]
        return tally.result(self.served()) if tally.items else None

    def merged(self, other: Measured) -> Measured:
        """Both measurements as one (the parts of one build)."""
        tallies = {d: t.merged(other.tallies[d]) for d, t in self.tallies.items()}
        return Measured(self.scheme, tallies, self.span.merged(other.span))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the running sums, so that parts merge exactly."""
        tallies = {d: t.to_json() for d, t in self.tallies.items()}
        span = [self.span.low, self.span.high] if self.span.low < float("inf") else None
        return {"scheme": self.scheme.value, "tallies": tallies, "span": span}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Measured:
        """Inverse of :meth:`to_json`.

        Raises:
            KeyError, ValueError, TypeError: not a record :meth:`to_json` wrote.
        """
        tallies = {d: FidelityTally.from_json(doc["tallies"][d]) for d in SERVED_NAMES}
        span = ScaleSpan(*map(float, doc["span"])) if doc["span"] else ScaleSpan()
        return cls(Scheme(doc["scheme"]), tallies, span)


def fidelity_file(layout: Layout, name: str) -> Path:
    """``roots/<name>.fidelity`` (not ``.json``: upkeep reads every ``*.json`` as a manifest)."""
    return layout.roots / f"{checked_root_name(name)}.fidelity"


def write_fidelity(layout: Layout, name: str, measured: Measured, bound: float | None) -> None:
    """Record what a build measured (tmp, rename: a reader sees the old record or the new):
    its error on the sampled items (null where it only copied packed rows) and the dtype its
    rows' scales can be served in; nothing when it stored nothing quantised.

    A build measures the items it encodes, not those it reuses: over a root whose record says
    float32, the record stays float32 (float16 could not hold an earlier build's rows, which
    the root still holds), its error measured in float32 too.

    Raises:
        StoreError: the store is not writable.

    Example:
        >>> write_fidelity(layout, "r-3f1c", compactor.measured, 0.05)  # doctest: +SKIP
    """
    if measured.fidelity() is None and not measured.span.known():
        return
    served = measured.served()  # by the span alone where nothing was tallied (copies)
    if recorded_serve_dtype(layout, name) == "float32":
        served = "float32"  # kept: the items of the builds before still need it (see above)
    tally = measured.tallies[served]
    measured_json = tally.result(served).to_json() if tally.items else None
    doc: dict[str, Any] = {"fidelity": measured_json, "bound": bound, "serve_dtype": served}
    final = fidelity_file(layout, name)
    try:
        publish_file(
            final,
            lambda tmp: tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8"),
            tmp_dir=layout.tmp,
        )
    except OSError as e:
        raise StoreError(
            f"could not record the measured fidelity in {final}: {e.strerror or e}; "
            "check that the cache directory is writable"
        ) from e


def read_fidelity(layout: Layout, name: str) -> Fidelity | None:
    """The fidelity recorded for root ``name``, or None (none measured, or unreadable).

    Example:
        >>> read_fidelity(Layout(Path(".featbake")), "r-3f1c").rel_rms  # doctest: +SKIP
        0.0077
    """
    try:
        doc = json.loads(fidelity_file(layout, name).read_text(encoding="utf-8"))
        return Fidelity.from_json(doc["fidelity"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorded_serve_dtype(layout: Layout, name: str) -> str | None:
    """The dtype root ``name``'s build found holds its values (``"float16"`` or
    ``"float32"``), or None (no record, or one from before it was recorded)."""
    try:
        doc = json.loads(fidelity_file(layout, name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    served = doc.get("serve_dtype") if isinstance(doc, dict) else None
    return served if served in SERVED_NAMES else None
