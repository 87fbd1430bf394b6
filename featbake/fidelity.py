"""Fidelity: how far what a store serves is from the encoder's own output (pure, no I/O).

A quantised build (``--dtype int8`` / ``fp8``) tallies a sample of items as it stores them
(:class:`FidelityTally`, whose running sums merge across the parts of a build done in parts) and
records the result (:class:`Fidelity`) beside its root (:mod:`featbake.store.fidelity`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Fidelity:
    """What quantisation did to a sample of items, against the encoder's float output.

    Attributes:
        items: items measured.
        rel_rms: relative RMS error over the whole sample, ``||x - x'|| / ||x||``.
        worst_rel_rms: the largest relative RMS error of one item.
        mean_cosine: mean cosine similarity of a row (frame) with its stored version.
        min_cosine: the smallest cosine similarity of any row.
        served: the float dtype the measured items were served in (the cast to it is measured
            too: it is what a reader gets).
    """

    items: int
    rel_rms: float
    worst_rel_rms: float
    mean_cosine: float
    min_cosine: float
    served: str = "float32"  # records from before the served dtype was measured: float32

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the root's fidelity record)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Fidelity:
        """Inverse of :meth:`to_json`."""
        rel, worst, mean, least = (
            float(doc[k]) for k in ("rel_rms", "worst_rel_rms", "mean_cosine", "min_cosine")
        )
        return cls(int(doc["items"]), rel, worst, mean, least, str(doc.get("served", "float32")))

    def summary(self) -> str:
        """One line, e.g. ``0.65% rel. RMS error (worst 0.71%), cosine 0.99998 (min 0.99995), 6
        items as float16`` (the served dtype named: it is part of what was measured)."""
        return (
            f"{self.rel_rms:.2%} rel. RMS error (worst {self.worst_rel_rms:.2%}), "
            f"cosine {self.mean_cosine:.5f} (min {self.min_cosine:.5f}), {self.items} items "
            f"as {self.served}"
        )


@dataclass
class FidelityTally:
    """Running sums behind a :class:`Fidelity`; :meth:`add` one item at a time.

    Example:
        >>> tally = FidelityTally()
        >>> x = torch.randn(50, 64)
        >>> tally.add(x, x + 0.001 * torch.randn(50, 64))
        >>> tally.result().rel_rms < 0.01
        True
    """

    items: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    worst: float = 0.0
    cos_sum: float = 0.0
    cos_rows: int = 0
    cos_min: float = 1.0

    def add(self, reference: torch.Tensor, stored: torch.Tensor) -> None:
        """Count one item: the encoder's output and what is served from the store."""
        shape = reference.shape
        rows = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        ref = reference.detach().to("cpu", torch.float64).reshape(rows)
        got = stored.detach().to("cpu", torch.float64).reshape(rows)
        err, norm = float((ref - got).square().sum()), float(ref.square().sum())
        self.items += 1
        self.err_sq += err
        self.ref_sq += norm
        self.worst = max(self.worst, math.sqrt(err / norm) if norm > 0 else 0.0)
        ref_n, got_n = ref.norm(dim=-1), got.norm(dim=-1)
        rows = ref_n > 0  # a zero row has no direction (it is stored exactly)
        if bool(rows.any()):
            cos = (ref * got).sum(-1)[rows] / (ref_n[rows] * got_n[rows]).clamp_min(1e-300)
            self.cos_sum += float(cos.sum())
            self.cos_rows += int(rows.sum())
            self.cos_min = min(self.cos_min, float(cos.min()))

    def add_parts(self, reference: dict[str, torch.Tensor], stored: dict[str, Any]) -> None:
        """Count one item of several parts (layers) as one: the parts' sums are pooled."""
        for name, ref in reference.items():
            before = self.items
            self.add(ref, stored[name])
            self.items = before
        self.items += 1

    def merged(self, other: FidelityTally) -> FidelityTally:
        """Both tallies as one (a build's parts, measured apart, merged)."""
        return FidelityTally(
            self.items + other.items, self.err_sq + other.err_sq, self.ref_sq + other.ref_sq,
            max(self.worst, other.worst), self.cos_sum + other.cos_sum,
            self.cos_rows + other.cos_rows, min(self.cos_min, other.cos_min),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The running sums, JSON-ready (a part's record, merged with the others')."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FidelityTally:
        """Inverse of :meth:`to_json`."""
        err_sq, ref_sq, worst, cos_sum = (float(doc[k]) for k in _SUMS)
        rows, least = int(doc["cos_rows"]), float(doc["cos_min"])
        return cls(int(doc["items"]), err_sq, ref_sq, worst, cos_sum, rows, least)

    def result(self, served: str = "float32") -> Fidelity:
        """The measurement so far, of items served as ``served``."""
        rel = math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0
        mean = self.cos_sum / self.cos_rows if self.cos_rows else 1.0
        return Fidelity(self.items, rel, self.worst, mean, self.cos_min, served)


_SUMS = ("err_sq", "ref_sq", "worst", "cos_sum")
