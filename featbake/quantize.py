"""Compact stored features: int8 and fp8 (e4m3) with one float32 scale per row (pure, no I/O).

A *row* is everything but the last dimension: a frame of a ``[T, D]`` output, a token, or the
single row of a pooled ``[D]`` embedding. SSL hidden states vary in scale by layer, frame and
dimension, so one scale per row (FAISS's and sentence-transformers' choice) tracks them where a
fixed precision (lilcom's) would not.

The stored form is **packed**: one tensor ``[..., D + 4]`` whose row is the ``D`` quantised
values followed by the 4 bytes of the row's float32 scale (little-endian). One tensor per
feature keeps every rule of the store as it is (one catalog row, one read span, one checksum,
gc, verify, merge, derive and export see an ordinary tensor), a zero-padded batch of packed
rows dequantises to zeros (a padding row's scale is 0.0), and the scale travels with its rows
through a host-to-device copy. The price: a plain safetensors reader sees an ``I8`` (or ``U8``)
tensor one row of 4 bytes wider and needs :func:`unpack` or :func:`dequantize` to read it.

Example:
    >>> import torch
    >>> x = torch.tensor([[254.0, -127.0, 2.0], [0.0, 0.0, 0.0]])
    >>> packed = quantize(x, Scheme.INT8)
    >>> tuple(packed.shape), packed.dtype
    ((2, 7), torch.int8)
    >>> dequantize(packed, Scheme.INT8, torch.float32)
    tensor([[ 254., -128.,    2.],
            [   0.,    0.,    0.]])
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a store's records needs none
    import torch

from featbake.errors import ConfigError, EncodeError
from featbake.native import kernels


# == fidelity ======================================================================================
# Fidelity: how far what a store serves is from the encoder's own output (pure, no I/O).
#
# A quantised build (``--dtype int8`` / ``fp8``) tallies a sample of items as it stores them
# (:class:`FidelityTally`, whose running sums merge across the parts of a build done in parts) and
# records the result (:class:`Fidelity`) beside its root (:mod:`featbake.store.fidelity`).
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
        dims: feature dimensions measured (the last axis, summed over an item's parts).
        dims_lost: those whose own relative RMS error, over every sampled row, is over
            :data:`LOST_DIM`: mostly rounding, where a few large dimensions set each row's
            scale and the small ones round to zero. The whole-sample error cannot see them: the
            large dimensions hold the norm.
    """

    items: int
    rel_rms: float
    worst_rel_rms: float
    mean_cosine: float
    min_cosine: float
    served: str = "float32"  # records from before the served dtype was measured: float32
    dims: int = 0  # records from before dimensions were measured: none
    dims_lost: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the root's fidelity record)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Fidelity:
        """Inverse of :meth:`to_json`."""
        rel, worst, mean, least = (
            float(doc[k]) for k in ("rel_rms", "worst_rel_rms", "mean_cosine", "min_cosine")
        )
        served, dims, lost = (
            str(doc.get("served", "float32")),
            doc.get("dims", 0),
            doc.get("dims_lost", 0),
        )
        return cls(int(doc["items"]), rel, worst, mean, least, served, int(dims), int(lost))

    def summary(self) -> str:
        """One line, e.g. ``0.65% rel. RMS error (worst 0.71%), cosine 0.99998 (min 0.99995), 6
        items as float16`` (the served dtype named: it is part of what was measured)."""
        lost = f", {self.dims_lost} of {self.dims} dimensions lost" if self.dims_lost else ""
        return (
            f"{self.rel_rms:.2%} rel. RMS error (worst {self.worst_rel_rms:.2%}), "
            f"cosine {self.mean_cosine:.5f} (min {self.min_cosine:.5f}), {self.items} items "
            f"as {self.served}{lost}"
        )


#: A feature dimension whose relative RMS error over the sampled rows is over this is *lost*:
#: the rounding is as large as its values (a signal-to-noise ratio of 6 dB at most).
LOST_DIM = 0.5


@dataclass
class DimSums:
    """One part's squared error and squared value, summed over every sampled row, per feature
    dimension (the last axis): a dimension rounded away is seen even where a larger one holds
    each row's norm (a trained model's outlier dimension, hundreds of times the others, sets
    the per-row int8 scale, and the rest round to zero).

    Example:
        >>> DimSums([1.0, 0.0], [1.0, 4.0]).lost(), DimSums([1.0, 0.0], [1.0, 4.0]).measured()
        (1, 2)
    """

    err: list[float]
    ref: list[float]

    def plus(self, other: DimSums) -> DimSums:
        """Both sums as one (the same part, measured in two tallies); ``self`` where the widths
        differ (not one part: nothing can be pooled)."""
        if len(other.ref) != len(self.ref):
            return self
        err = np.add(self.err, other.err).tolist()
        return DimSums(err, np.add(self.ref, other.ref).tolist())

    def measured(self) -> int:
        """Dimensions holding a value other than zero in a sampled row."""
        return sum(r > 0 for r in self.ref)

    def lost(self) -> int:
        """Dimensions whose relative RMS error is over :data:`LOST_DIM`."""
        return sum(r > 0 and e > LOST_DIM**2 * r for e, r in zip(self.err, self.ref, strict=True))


@dataclass
class FidelityTally:
    """Running sums behind a :class:`Fidelity`; :meth:`add` one item at a time.

    Example:
        >>> tally = FidelityTally()
        >>> import torch
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
    dims: dict[str, DimSums] = field(default_factory=dict)  # per part (``""``: a single one)

    def add(self, reference: torch.Tensor, stored: torch.Tensor, part: str = "") -> None:
        """Count one item (or ``part`` of one): the encoder's output and what is served from
        the store."""
        import torch

        shape = reference.shape
        rows = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        ref = reference.detach().to("cpu", torch.float64).reshape(rows)
        got = stored.detach().to("cpu", torch.float64).reshape(rows)
        err_d, ref_d = (ref - got).square().sum(0), ref.square().sum(0)  # per dimension
        err, norm = float(err_d.sum()), float(ref_d.sum())
        self.items += 1
        self.err_sq += err
        self.ref_sq += norm
        self.worst = max(self.worst, math.sqrt(err / norm) if norm > 0 else 0.0)
        self.dims = _pooled_dims(self.dims, {part: DimSums(err_d.tolist(), ref_d.tolist())})
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
            self.add(ref, stored[name], name)
            self.items = before
        self.items += 1

    def merged(self, other: FidelityTally) -> FidelityTally:
        """Both tallies as one (a build's parts, measured apart, merged)."""
        return FidelityTally(
            self.items + other.items, self.err_sq + other.err_sq, self.ref_sq + other.ref_sq,
            max(self.worst, other.worst), self.cos_sum + other.cos_sum,
            self.cos_rows + other.cos_rows, min(self.cos_min, other.cos_min),
            _pooled_dims(self.dims, other.dims),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The running sums, JSON-ready (a part's record, merged with the others')."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FidelityTally:
        """Inverse of :meth:`to_json`."""
        err_sq, ref_sq, worst, cos_sum = (float(doc[k]) for k in _SUMS)
        rows, least = int(doc["cos_rows"]), float(doc["cos_min"])
        dims = {  # none in a record from before dimensions were measured
            str(part): DimSums([float(e) for e in d["err"]], [float(r) for r in d["ref"]])
            for part, d in doc.get("dims", {}).items()
        }
        return cls(int(doc["items"]), err_sq, ref_sq, worst, cos_sum, rows, least, dims)

    def result(self, served: str = "float32") -> Fidelity:
        """The measurement so far, of items served as ``served``."""
        rel = math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0
        mean = self.cos_sum / self.cos_rows if self.cos_rows else 1.0
        dims = sum(d.measured() for d in self.dims.values())
        lost = sum(d.lost() for d in self.dims.values())
        return Fidelity(self.items, rel, self.worst, mean, self.cos_min, served, dims, lost)


def _pooled_dims(mine: dict[str, DimSums], theirs: dict[str, DimSums]) -> dict[str, DimSums]:
    """Two tallies' per-dimension sums as one, part by part."""
    pooled = dict(mine)
    for part, sums in theirs.items():
        pooled[part] = pooled[part].plus(sums) if part in pooled else sums
    return pooled


_SUMS = ("err_sq", "ref_sq", "worst", "cos_sum")


# == quantize ======================================================================================
#: Bytes of the per-row float32 scale at the end of each packed row.
SCALE_BYTES = 4

#: Rows whose largest magnitude is below this are stored as zeros (scale 0): dividing by a
#: subnormal scale would overflow, and such a row is zero at any precision a model uses.
TINY = 2.0**-100


class Scheme(enum.Enum):
    """A quantised stored dtype: its name in a recipe, its packed dtype, its largest code."""

    INT8 = "int8"
    FP8 = "fp8"

    @property
    def packed_dtype(self) -> torch.dtype:
        """The dtype of the packed tensor (``int8``; fp8 codes are stored as ``uint8`` bytes)."""
        import torch

        return torch.int8 if self is Scheme.INT8 else torch.uint8

    @property
    def top(self) -> float:
        """The code a row's largest magnitude maps to: 127 (int8) or 448 (e4m3's largest)."""
        return 127.0 if self is Scheme.INT8 else 448.0

    @property
    def max_scale(self) -> float:
        """The largest scale whose ``top * scale`` is a finite float32."""
        return _MAX_SCALE[self]


def _largest_scale(top: float) -> float:
    """``float32 max / top`` rounded down until ``top * scale`` stays finite."""
    scale = np.float32(np.finfo(np.float32).max / np.float32(top))
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(scale * np.float32(top))):
            scale = np.nextafter(scale, np.float32(0))
    return float(scale)


_MAX_SCALE = {s: _largest_scale(s.top) for s in Scheme}


def scheme_of(dtype: str) -> Scheme | None:
    """The scheme of a recipe's stored dtype name, or None for a float dtype.

    Example:
        >>> scheme_of("int8"), scheme_of("float16")
        (<Scheme.INT8: 'int8'>, None)
    """
    return _SCHEMES.get(dtype)  # a dict, not Scheme(dtype): its ValueError for floats cost
    # ~10 us, twice per item in a build


_SCHEMES = {scheme.value: scheme for scheme in Scheme}


class Unpacked(NamedTuple):
    """A packed tensor's two halves: ``values [..., D]`` (int8 or float8_e4m3fn) and
    ``scales [...]`` (float32), so that ``values * scales[..., None]`` is the feature."""

    values: torch.Tensor
    scales: torch.Tensor


def quantize(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Quantise a float tensor row by row into its packed form ``[..., D + 4]`` (on the CPU).

    int8 is symmetric: ``round(x * 127 / max|row|)``; fp8 rounds ``x * 448 / max|row|`` to
    e4m3. The row's scale ``max|row| / top`` is stored as float32 after its codes.

    Args:
        x: a float tensor of at least one dimension; all values finite.
        scheme: int8 or fp8.

    Returns:
        A new CPU tensor of ``scheme.packed_dtype``.

    Raises:
        ConfigError: ``x`` is a scalar (there is no row to scale).
        EncodeError: ``x`` holds NaN or an infinity (neither code can hold one).

    Example:
        >>> import torch
        >>> quantize(torch.tensor([0.5, -1.0]), Scheme.INT8)[:2]
        tensor([  64, -127], dtype=torch.int8)
    """
    import torch

    if x.dim() == 0:
        raise ConfigError(
            f"--dtype {scheme.value} stores rows with a scale each; this output is a scalar: "
            "store it with --dtype float32 or float16"
        )
    rows = x.detach().to("cpu", torch.float32)
    absmax = rows.abs().amax(dim=-1, keepdim=True) if rows.shape[-1] else rows.sum(-1, True)
    if not bool(torch.isfinite(absmax).all()):  # NaN and inf reach every row's max
        raise EncodeError(
            f"features hold NaN or infinite values, which {scheme.value} cannot store; "
            "fix the encoder or store them with --dtype float32 --allow-nonfinite"
        )
    live = absmax >= TINY
    # Capped so that top * scale stays finite in float32 (absmax / 127 rounds up near 3.4e38).
    scale = torch.where(live, (absmax / scheme.top).clamp_(max=scheme.max_scale), 0.0)
    factor = torch.where(live, 1.0 / torch.where(live, scale, 1.0), 0.0)
    scaled = (rows * factor).clamp_(-scheme.top, scheme.top)
    if scheme is Scheme.INT8:
        codes = scaled.round_().to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty((*rows.shape[:-1], rows.shape[-1] + SCALE_BYTES), dtype=scheme.packed_dtype)
    out[..., : rows.shape[-1]] = codes
    out[..., rows.shape[-1] :] = scale.view(scheme.packed_dtype)
    return out


def unpack(packed: torch.Tensor, scheme: Scheme) -> Unpacked:
    """Split a packed tensor into its codes (a view) and its scales (a strided view of the
    packed rows when they are 4-byte aligned, as every store's are with D a multiple of 4; a
    small copy otherwise).

    Works on any device, so a raw batch can be copied to the GPU and dequantised there.

    Raises:
        ConfigError: ``packed`` is not a packed tensor of ``scheme``.

    Example:
        >>> import torch
        >>> codes, scales = unpack(quantize(torch.ones(2, 3), Scheme.INT8), Scheme.INT8)
        >>> codes.tolist(), scales.tolist()
        ([[127, 127, 127], [127, 127, 127]], [0.007874015718698502, 0.007874015718698502])
    """
    import torch

    if packed.dtype != scheme.packed_dtype or packed.dim() == 0 or packed.shape[-1] < SCALE_BYTES:
        raise ConfigError(
            f"expected a packed {scheme.value} tensor ({scheme.packed_dtype}, last dimension "
            f"D + {SCALE_BYTES}), got {packed.dtype} of shape {tuple(packed.shape)}; pass what "
            f"a --dtype {scheme.value} store serves with dequantize=False"
        )
    d = packed.shape[-1] - SCALE_BYTES
    codes = packed[..., :d]
    if scheme is Scheme.FP8:
        codes = codes.view(torch.float8_e4m3fn)
    if (
        d % SCALE_BYTES == 0
        and packed.storage_offset() % SCALE_BYTES == 0
        and (packed.stride(-1) == 1 and all(st % SCALE_BYTES == 0 for st in packed.stride()[:-1]))
    ):  # every row's scale sits at a 4-byte aligned offset: a float32 view, no copy
        return Unpacked(codes, packed.view(torch.float32)[..., -1])
    # A contiguous copy (4 bytes a row): a view of the packed rows is not 4-byte aligned.
    tail = packed[..., d:].clone(memory_format=torch.contiguous_format)
    scales = tail.view(torch.float32).squeeze(-1)
    return Unpacked(codes, scales)


def damaged_positions(packed: torch.Tensor, scheme: Scheme) -> list[int]:
    """The positions along ``packed``'s first dimension (an item's rows, a batch's items) whose
    rows hold a scale that is not finite; empty for sound rows and for a tensor that is not
    packed rows of ``scheme``. One strided read of the scale column, nothing dequantised.

    Example:
        >>> import torch
        >>> packed = quantize(torch.ones(3, 4), Scheme.INT8)
        >>> packed[1, 4:] = torch.tensor([float("nan")]).view(torch.int8)
        >>> damaged_positions(packed, Scheme.INT8), damaged_positions(packed[0], Scheme.INT8)
        ([1], [])
    """
    if packed.dtype != scheme.packed_dtype or not packed.dim() or packed.shape[-1] < SCALE_BYTES:
        return []
    scales = unpack(packed, scheme).scales
    # numpy on the CPU: ~2 us for an item's column, where torch's isfinite takes ~5
    host = scales.numpy() if scales.device.type == "cpu" else scales.cpu().numpy()
    finite = np.asarray(np.isfinite(host))
    if finite.all():
        return []
    if not finite.ndim:  # one row ([D + 4]): its only position
        return [0]
    return np.flatnonzero(~finite.reshape(len(finite), -1).all(axis=1)).tolist()


#: torch runs an elementwise op on the calling thread below this many elements
#: (``at::internal::GRAIN_SIZE``). Dequantising on the CPU works in chunks of rows this small:
#: one op over a whole item wakes torch's OpenMP pool, whose spinning threads cost milliseconds
#: on a busy 2-CPU machine (measured: 2.9 ms against 0.14 ms for a [200, 768] item) and take
#: the CPUs the training step and the readers need.
_GRAIN = 32768


def dequantize(
    packed: torch.Tensor,
    scheme: Scheme,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The feature a packed tensor holds, in ``dtype``: ``codes * scale`` computed in float32.

    On the CPU one pass of the compiled kernel (:func:`dequantize_native`) where it is built,
    else on the calling thread a chunk of rows at a time (see :func:`dequantize_unpacked`), with
    the same bits; on a GPU it is two ops.

    Args:
        packed: what :func:`quantize` made (or a zero-padded batch of it), on any device.
        scheme: the scheme it was quantised with.
        dtype: the float dtype served (None: float16, as int8 and fp8 hold less precision).
        out: where to write it (e.g. a batch in shared memory); its dtype wins over ``dtype``.

    Example:
        >>> import torch
        >>> dequantize(quantize(torch.tensor([[2.0, -1.0]]), Scheme.FP8), Scheme.FP8)
        tensor([[ 2., -1.]], dtype=torch.float16)
    """
    import torch

    dtype = torch.float16 if dtype is None else dtype
    if out is None and packed.device.type == "cpu" and packed.dim() and packed.shape[-1] >= 4:
        out = torch.empty((*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES), dtype=dtype)
    if out is not None and dequantize_native(packed, scheme, out) is not None:
        return out
    return dequantize_unpacked(unpack(packed, scheme), scheme, dtype, out)


#: The compiled kernel's codes for a scheme and a served dtype (featbake/kernels.c).
_KERNEL_SCHEME = {Scheme.INT8: 0, Scheme.FP8: 1}


@functools.cache
def _kernel_out() -> dict[torch.dtype, int]:
    """The compiled kernel's code of each served dtype (made on first use: torch)."""
    import torch

    return {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class PackedRows(NamedTuple):
    """Stored packed rows served dequantised as they are read (``featbake.store.shard``'s
    ``read_spans``): their scheme, the dtype served, and ``width``, the values of a row (D)."""

    scheme: Scheme
    dtype: torch.dtype
    width: int

    def kernel_codes(self) -> tuple[int, int, int]:
        """The compiled kernels' arguments: scheme code, dtype code, D.

        Raises:
            ConfigError: ``dtype`` is not float32, float16 or bfloat16.
        """
        code = _kernel_out().get(self.dtype)
        if code is None:
            raise ConfigError(
                f"int8/fp8 rows are served as float32, float16 or bfloat16, not {self.dtype}"
            )
        return _KERNEL_SCHEME[self.scheme], code, self.width


def dequantize_native(packed: torch.Tensor, scheme: Scheme, out: torch.Tensor) -> ScaleSpan | None:
    """``packed`` dequantised into ``out`` in one pass by the compiled kernel, outside the GIL:
    the span of its row scales, to check against ``out``'s dtype (:meth:`ScaleSpan.holds`).

    The same bits as :func:`dequantize_unpacked` (each value ``float32(code) * scale``, rounded
    once to ``out``'s dtype; the tests compare both bit for bit), with no float32 buffer between:
    measured ~8 us for a ``[200, 768]`` int8 item into float16 (a float16 copy of it: ~5 us).

    Returns:
        None where the kernel does not apply (not built or turned off, not on the CPU, a layout
        other than contiguous packed rows into a contiguous ``out`` of their shape): nothing is
        written then, and the caller takes the Python path.
    """
    native = kernels()
    code = _kernel_out().get(out.dtype)
    if (
        native is None
        or code is None
        or packed.dtype != scheme.packed_dtype
        or packed.device.type != "cpu"
        or out.device.type != "cpu"
        or not packed.dim()
        or packed.shape[-1] < SCALE_BYTES
        or out.shape != (*packed.shape[:-1], packed.shape[-1] - SCALE_BYTES)
        or not packed.is_contiguous()
        or not out.is_contiguous()
    ):
        return None
    width = packed.shape[-1]
    rows = packed.numel() // width if width else 0
    low, high, damaged = native.dequant(
        packed.data_ptr(), width, rows, width - SCALE_BYTES, out.data_ptr(),
        _KERNEL_SCHEME[scheme], code,
    )  # fmt: skip
    return ScaleSpan(low, high, damaged=damaged)


def dequantize_unpacked(
    parts: Unpacked, scheme: Scheme, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`dequantize` of what :func:`unpack` returned (a reader checks the scales first).

    On the CPU, a chunk of rows at a time: into a float32 ``out``, codes are copied (exactly)
    and multiplied in place (measured 1.5-2x one mixed-dtype multiply, whose casting loop is
    scalar); into float16/bfloat16, one fused multiply (codes times float32 scales, rounded once
    to ``dtype``): the three vectorised passes through a cache-sized float32 chunk measured
    0.7-0.9x that on the loaded 2-CPU machine, as torch's per-op cost outweighs them there.

    A row whose scale is not finite (a damaged shard's) is ``dtype``'s quiet NaN in every
    value, as the compiled kernel writes it: torch's own casts keep a NaN's payload and sign
    differently by CPU and loop, so its bits are set here, not left to them.
    """
    import torch

    codes, scales = parts
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    if codes.device.type != "cpu":
        torch.mul(codes.to(torch.float32), scales.unsqueeze(-1), out=out)
        return out.masked_fill_(~torch.isfinite(scales).unsqueeze(-1), math.nan)
    if not out.is_contiguous():
        return out.copy_(dequantize_unpacked(parts, scheme, out.dtype))
    _dequantize_rows(codes, scales, scheme, out)
    damaged = ~torch.isfinite(scales)
    if bool(damaged.any()):
        out[damaged] = math.nan
    return out


def _dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, scheme: Scheme, out: torch.Tensor
) -> None:
    """:func:`dequantize_unpacked` on the CPU into a contiguous ``out``, a chunk of rows at a
    time (see there)."""
    import torch

    if scheme is Scheme.FP8:
        codes = codes.view(torch.uint8)
    rows, d = math.prod(codes.shape[:-1]), codes.shape[-1]
    flat, flat_out = codes.reshape(rows, d), out.view(rows, d)
    flat_scales = scales.reshape(rows, 1)
    step = max(1, _GRAIN // max(d, 1))
    direct = out.dtype == torch.float32
    bits = torch.empty((min(step, rows), d), dtype=torch.int32) if scheme is Scheme.FP8 else None
    for a in range(0, rows, step):
        n = min(step, rows - a)
        src, dst, row_scales = flat[a : a + n], flat_out[a : a + n], flat_scales[a : a + n]
        if bits is not None:
            src = _fp8_as_float32(src, dst.view(torch.int32) if direct else bits[:n])
        if direct:
            if bits is None:
                dst.copy_(src)
            dst.mul_(row_scales)
        else:
            torch.mul(src, row_scales, out=dst)


def _fp8_as_float32(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (as uint8) as float32, exactly, written into the int32 buffer ``bits``.

    The code's 4 exponent and 3 mantissa bits move to bits 20-26 of a float32 and its sign to
    bit 31; the exponent biases differ by 120, so the result times 2**120 is the value (e4m3's
    subnormals land on float32 subnormals, which the scaling makes normal; the two NaN codes,
    never written, would read as +-480). About 1.6x faster
    than a numpy table lookup here, and torch's own float8 cast is slower still.
    """
    import torch

    bits.copy_(codes)
    sign = bits.bitwise_and(0x80).bitwise_left_shift_(24)
    bits.bitwise_and_(0x7F).bitwise_left_shift_(20).bitwise_or_(sign)
    return bits.view(torch.float32).mul_(2.0**120)


@dataclass(frozen=True)
class ScaleSpan:
    """The smallest non-zero and the largest row scale of some packed tensors: which float
    dtypes can serve them (:meth:`holds`) follows from these two numbers alone.

    Example:
        >>> import torch
        >>> span = ScaleSpan.of(unpack(quantize(torch.tensor([[1e7, 1.0]]), Scheme.INT8),
        ...     Scheme.INT8).scales)
        >>> span.holds(torch.float16, Scheme.INT8), span.holds(torch.float32, Scheme.INT8)
        (False, True)
    """

    low: float = math.inf  # the smallest finite scale of a non-zero row (inf: none seen)
    high: float = 0.0  # the largest finite scale
    #: Rows whose scale is NaN or +-inf (quantize never writes one: a damaged shard's).
    damaged: int = field(default=0, kw_only=True)

    @classmethod
    def of(cls, scales: torch.Tensor) -> ScaleSpan:
        """The span of one tensor's row scales (zero rows, a padding's or a silent frame's,
        dequantise to zeros in any dtype and are left out; rows whose scale is not finite
        are counted as damaged)."""
        import torch

        if not scales.numel():
            return cls()
        finite = torch.isfinite(scales)
        damaged = int(finite.numel() - finite.sum())
        if damaged:
            scales = scales[finite]
            if not scales.numel():
                return cls(damaged=damaged)
        low, high = (float(v) for v in torch.aminmax(scales))
        if low <= 0:  # zero rows (padding): the smallest of the others
            live = scales[scales > 0]
            if not live.numel():
                return cls(math.inf, high, damaged=damaged)
            low = float(live.min())
        return cls(low, high, damaged=damaged)

    def known(self) -> bool:
        """Whether any row's scale was seen (a non-zero row, or a zero one's ``high``)."""
        return self.low < math.inf or self.high > 0.0

    def merged(self, other: ScaleSpan) -> ScaleSpan:
        """The span of both."""
        return ScaleSpan(
            min(self.low, other.low),
            max(self.high, other.high),
            damaged=self.damaged + other.damaged,
        )

    def holds(self, dtype: torch.dtype, scheme: Scheme) -> bool:
        """Whether ``dtype`` serves these rows without an infinity or a loss of precision.

        The largest value a row dequantises to is ``top * scale``: past ``dtype``'s largest
        finite value it would round to ``inf``. A row's step between codes is about its scale:
        below 16 of ``dtype``'s smallest subnormal steps (float16: 2**-20) the cast to
        ``dtype`` rounds coarser than the codes themselves (features ~1e-6 served as float16
        were 28% off).
        """
        import torch

        info = torch.finfo(dtype)
        if self.high * scheme.top > info.max:
            return False
        return self.low == math.inf or self.low >= 16 * info.tiny * info.eps

    def describe(self, scheme: Scheme) -> str:
        """The values' magnitudes, e.g. ``values up to 1.2e+07 (rows as small as 3.1e-06)``."""
        if self.low == math.inf:
            return "only zeros"
        high, low = self.high * scheme.top, self.low * scheme.top
        return f"values up to {high:.3g} (rows as small as {low:.3g})"


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a packed tensor for a feature of ``shape`` (rows kept, 4 bytes a row more).

    Example:
        >>> packed_shape((150, 768))
        (150, 772)
    """
    return (*shape[:-1], shape[-1] + SCALE_BYTES)
