"""What a loaded encoder is: :class:`LoadedEncoder` (a module, its identity and fingerprint, run
without autograd) and :func:`from_module`; loading one from a path is
:mod:`featbake.encode.loaders`.

Every kind becomes a :class:`LoadedEncoder` that runs without autograd and turns any failure
of the encoder's own code into an :class:`EncodeError` that names the real cause.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from featbake.device import alloc_pinned
from featbake.encode.identity import (
    IN_TRAIN_MODE,
    foreign_global_hooks,
    forward_hooks,
    held_refusals,
    is_library_machinery,
    module_identity,
)
from featbake.errors import EncodeError, EncoderLoadError, FeatbakeError
from featbake.keys import module_fingerprint
from featbake.store.hash_cache import FileStat

if TYPE_CHECKING:
    from featbake.encode.fingerprints import FolderState


# == failures ======================================================================================
# What an encoder's failure or bad output says to the user: one line, with the real cause.
def refuse_complex(result: Any, label: str) -> None:
    """Raise EncodeError if any output tensor is complex (storing would drop its imaginary part).

    Raises:
        EncodeError: naming the output and its dtype.
    """
    if isinstance(result, torch.Tensor):
        named: Any = {"": result}
    elif isinstance(result, Mapping):
        named = result
    elif isinstance(result, (tuple, list)):
        named = dict(enumerate(result))
    else:
        return
    for name, value in named.items():
        if isinstance(value, torch.Tensor) and value.is_complex():
            output = f"output {name!r}" if name != "" else "output"
            raise EncodeError(
                f"the encoder {label} returned a complex {output} ({value.dtype}); featbake "
                "stores real tensors: return .real/.imag or torch.view_as_real(x) instead"
            )


#: TorchScript's generic first line; the cause is at the end of its message.
_TORCHSCRIPT_PREFIX = "The following operation failed in the TorchScript interpreter"


def error_cause(e: BaseException) -> str:
    """One line that says why ``e`` happened: the type and message of the real cause.

    A TorchScript error's first line is always the same sentence and its last line holds the
    raised exception (``builtins.ValueError: ...``); a ``KeyError``'s message alone is a bare key.
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith(_TORCHSCRIPT_PREFIX):
        cause = lines[-1]
        return cause.removeprefix("builtins.")
    text = lines[0] if lines else ""
    if isinstance(e, (RuntimeError, ValueError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# == lengths =======================================================================================
# The lengths protocol: ``forward(x, lengths) -> (features, out_lengths)``; pad and trim.
#
# An encoder that takes a second argument named ``lengths`` (an int64 ``[B]`` tensor of each
# row's valid samples) and returns ``(features, out_lengths)`` can run variable-length inputs in
# one padded batch: featbake pads ``[B, T_max]`` with zeros on the right, and keeps
# ``features[i, :out_lengths[i]]`` of each row. ``features`` is a ``[B, T', ...]`` tensor or a dict
# of them (e.g. one per hidden layer). TorchScript, ``.pt2`` and import-path encoders follow it by
# their ``forward`` signature; Hugging Face folders follow it through :mod:`featbake.encode.hf`.
LENGTHS_ARG = "lengths"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def accepts_lengths(module: Any) -> bool:
    """True when ``module.forward``'s second positional argument is named ``lengths``.

    The name is the opt-in: an encoder whose second argument is a mask or anything else keeps
    one input per row of equal shape, as before.
    """
    forward = getattr(module, "forward", None)
    schema = getattr(forward, "schema", None)
    if schema is not None:  # a TorchScript method: arguments are (self, x, lengths, ...)
        names = [a.name for a in schema.arguments]
        return len(names) >= 3 and names[2] == LENGTHS_ARG
    try:
        params = inspect.signature(forward).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    return len(positional) >= 2 and positional[1] == LENGTHS_ARG


@dataclass(frozen=True)
class PaddedInputs:
    """Inputs zero-padded on the right to the longest, with each row's valid length."""

    inputs: torch.Tensor
    lengths: torch.Tensor

    @property
    def padded_samples(self) -> int:
        """Elements the encoder will see, padding included."""
        return int(self.inputs.numel())


def pad_inputs(
    inputs: Sequence[torch.Tensor], *, pinned: bool = False, length: int | None = None
) -> PaddedInputs:
    """Stack inputs of different last-dimension lengths into one zero-padded batch.

    Args:
        inputs: tensors equal in every dimension but the last (time).
        pinned: build the batch in page-locked memory (for a non-blocking copy to a GPU).
        length: the padded length (default, and at least, the longest input's).

    Raises:
        EncodeError: the inputs differ in a dimension other than time.
    """
    lead = {tuple(x.shape[:-1]) for x in inputs}
    if len(lead) != 1:
        raise EncodeError(f"cannot pad inputs that differ outside time: {sorted(lead)}")
    lengths = [int(x.shape[-1]) for x in inputs]
    shape = (len(inputs), *inputs[0].shape[:-1], max([*lengths, length or 0]))
    dtype = inputs[0].dtype
    batch = alloc_pinned(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
    for row, (x, n) in enumerate(zip(inputs, lengths, strict=True)):
        batch[row, ..., :n] = x
        batch[row, ..., n:] = 0
    return PaddedInputs(batch, torch.tensor(lengths, dtype=torch.int64))


def split_lengths_result(result: Any, rows: int) -> tuple[Any, torch.Tensor]:
    """``(features, out_lengths)`` from a lengths-protocol encoder's return value.

    Raises:
        EncodeError: the result is not a pair, or ``out_lengths`` is not ``[rows]`` integers.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise EncodeError(
            "an encoder whose forward takes `lengths` must return (features, out_lengths); "
            f"it returned {type(result).__name__}"
        )
    features, out_lengths = result
    if not isinstance(out_lengths, torch.Tensor) or tuple(out_lengths.shape) != (rows,):
        shape = tuple(out_lengths.shape) if isinstance(out_lengths, torch.Tensor) else None
        raise EncodeError(
            f"out_lengths must be a [{rows}] tensor of frame counts, got "
            f"{type(out_lengths).__name__} {shape}"
        )
    return features, out_lengths.detach().to("cpu", torch.int64)


#: Parts of any lengths-protocol encoder that hold one row per input, by their documented names
#: (``pooled`` is ``[D]``): kept whole, never cut to an item's frames. A TorchScript module's
#: masked mean returned as ``{"tokens": x, "pooled": m}`` had ``pooled`` cut to its frame count.
PER_INPUT_PARTS = frozenset({"pooled", "image_embeds", "text_embeds", "sentence_embedding"})


def trim_rows(
    named: Mapping[str, torch.Tensor],
    out_lengths: torch.Tensor,
    encoded: Callable[[torch.Tensor], torch.Tensor],
    whole: frozenset[str] = frozenset(),
) -> list[dict[str, torch.Tensor]]:
    """Each row's parts cut to its own output length, on the CPU as ``encoded`` takes them
    (:meth:`Recipe.encoded`: float parts in the encode dtype), own storage.

    Parts named in ``whole`` hold one row per input (a pooled vector): each row is kept whole.
    The others are one row per frame, over the same frames: parts whose second dimensions
    differ are refused (one of them holds no frames: ``[B, 32 queries, D]`` beside the tokens
    was cut as frames, silently).

    Raises:
        EncodeError: a part is not ``[B, T', ...]``, is shorter than an output length, its
            frames are not the other parts', or an output length is negative.
    """
    rows = int(out_lengths.shape[0])
    lengths = out_lengths.tolist()
    if lengths and min(lengths) < 0:
        raise EncodeError(
            f"the encoder returned a negative output length ({min(lengths)}) for an input of "
            "this batch; its out_lengths formula must give 0 or more frames for every input "
            "length (clamp it, or pad short inputs inside the encoder)"
        )
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(rows)]
    frames: dict[str, tuple[int, ...]] = {}
    for part, value in named.items():
        if part in whole and value.dim() >= 1 and value.shape[0] == rows:
            value = encoded(value)
            for i in range(rows):
                out[i][part] = value[i].clone()
            continue
        if value.dim() < 2 or value.shape[0] != rows or value.shape[1] < max(lengths):
            raise EncodeError(
                f"encoder output {part or 'tensor'} has shape {tuple(value.shape)}; the lengths "
                f"protocol needs [{rows}, T', ...] with T' >= {max(lengths)} (the out_lengths)"
            )
        frames[part] = tuple(value.shape)
        value = encoded(value)
        for i, n in enumerate(lengths):
            out[i][part] = value[i, :n].clone()  # own storage: a slice would pin the whole batch
    if len({shape[1] for shape in frames.values()}) > 1:
        shown = ", ".join(f"{part or 'tensor'} {shape}" for part, shape in frames.items())
        raise EncodeError(
            f"encoder outputs {shown} differ in their frames (second dimension); with lengths, "
            "every output is [B, T', ...] over the same frames but one with a row per input, "
            f"named {' or '.join(sorted(PER_INPUT_PARTS))}: rename it, or store it apart"
        )
    return out


# == precision =====================================================================================
# Encoder precision: autocast around the encoder call, and what "exact" means per dtype.
#
# ``--precision`` is part of the recipe (bf16 features are not fp32 features), so keys differ by
# precision. The tolerance table is what the bake's exactness guard allows between an item run in
# a padded batch and the same item run alone; it is a relative error against the largest magnitude
# of the item's own output (``max|a - b| / max|b|``), per part.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Tolerance(NamedTuple):
    """How far a padded-batch output may be from the same input run alone."""

    relative: float
    why: str


#: precision -> the tolerance of the exactness guard. fp32 differs only by summation order
#: (a batched matmul picks other kernels than a single row); bf16 keeps 8 mantissa bits
#: (eps 2^-8 = 3.9e-3) and fp16 11 (eps 9.8e-4), and a dozen layers compound a few ulps each.
EXACT_TOLERANCE: dict[str, Tolerance] = {
    "fp32": Tolerance(1e-4, "summation order only; a padding leak is orders of magnitude larger"),
    "fp16": Tolerance(1e-2, "about 10 ulps of fp16 (eps 9.8e-4) through the layers"),
    "bf16": Tolerance(5e-2, "about 12 ulps of bf16 (eps 3.9e-3) through the layers"),
}


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """``torch.autocast`` for ``precision`` on ``device``; for ``fp32``, autocast switched
    off there.

    A recipe's precision is what runs, whatever the caller's context: a training loop reading
    a dataset's misses (``num_workers=0``) inside its own ``torch.autocast`` would otherwise
    encode an fp32 recipe's items in bf16 and store them under the fp32 key, served later as
    exact (0.4% off).

    Autocast (not ``module.half()``) keeps weights, norms and softmax in fp32 where torch's
    autocast lists say so, which is how mixed-precision inference is usually run. bf16 and fp16
    autocast both run on the CPU too, so every path works without a GPU.

    TorchScript's own autocast pass is off inside: scripted code then runs through the
    dispatcher's autocast, as eager code does (same dtypes, same outputs on the CPU). The pass
    crashed the process (a segfault, torch 2.11 on an H200) on a scripted ``nn.TransformerEncoder``
    under CUDA autocast, bf16 and fp16 alike; without it the same module ran.
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return _no_autocast(device.type)
    return _autocast(device.type, dtype)


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[None]:
    """Autocast off on ``device_type`` (a device autocast has no kind for, ``meta``: nothing
    to switch off; torch before 2.4 cannot say which those are, and runs each as it is)."""
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is None or not available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    set_jit_autocast = getattr(torch._C, "_jit_set_autocast_mode", None)
    jit_before = set_jit_autocast(False) if set_jit_autocast is not None else None
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    finally:
        if set_jit_autocast is not None:
            set_jit_autocast(jit_before)


def finite_max(x: torch.Tensor) -> float:
    """The largest magnitude among ``x``'s finite values (0.0 for none): the scale an error is
    measured against, which a NaN or an infinity elsewhere in ``x`` leaves as it is."""
    a = x.detach().double().abs()
    finite = a[torch.isfinite(a)] if not bool(torch.isfinite(a).all()) else a
    return float(finite.max()) if finite.numel() else 0.0


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want|`` in float64 over the positions both hold finite values; a position
    NaN in both, or the same infinity in both, counts equal; any other position where either is
    not finite makes the error inf (so a NaN never compares as within a tolerance). The shapes
    must be equal.

    Example:
        >>> nan = float("nan")
        >>> max_error(torch.tensor([1.0, nan]), torch.tensor([1.5, nan]))
        0.5
        >>> max_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, nan]))
        inf
    """
    if not want.numel():
        return 0.0
    a, b = got.detach().double(), want.detach().double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    if bool(finite.all()):
        return float((a - b).abs().max())
    same = (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))
    if not bool((finite | same).all()):
        return math.inf
    return float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64 (inf when the shapes differ), under
    :func:`max_error`'s rule for values that are not finite, scaled by ``want``'s finite values
    (:func:`finite_max`)."""
    if got.shape != want.shape:
        return math.inf
    diff = max_error(got, want)
    scale = finite_max(want)
    return diff / scale if scale > 0 else diff


# == encoders ======================================================================================
TORCHSCRIPT = "torchscript"


EXPORT = "export"


IMPORT = "import"


PICKLE = "pickle"


MODULE = "module"  # an in-process nn.Module handed to the API


class LoadedFrom(NamedTuple):
    """The stat of the file an encoder's weights were read from, taken before the read, and
    when (the racy rule's moment): its fingerprint may be cached for that file only while the
    file still has this stat (a checkpoint renamed over during the load is another file)."""

    stat: FileStat
    taken_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str] | None) -> LoadedFrom | None:
        """The stat of ``path`` now, before it is read (None: no file, or it cannot be
        stat'ed; the load then says why)."""
        if path is None:
            return None
        taken = time.time_ns()  # before the stat: what a racy entry is measured against
        try:
            return cls(FileStat.of(path), taken)
        except OSError:
            return None


@dataclass
class LoadedEncoder:
    """A ready-to-run encoder with what identifies it.

    Attributes:
        module: the callable module, in eval mode, on ``device``.
        label: how the user named it (path or import string); roots are keyed by it.
        kind: torchscript, export, import, pickle or module.
        identity: the architecture's identity string hashed into the fingerprint.
        device: where it runs.
        takes_lengths: ``forward(x, lengths) -> (features, out_lengths)`` (see
            :mod:`featbake.encode.encoders`), so inputs of different lengths can share a batch.
        unpaddable: why padded batches would not be exact for this encoder, known up front
            (e.g. a group-norm wav2vec2 that must not get an attention mask), else ``None``.
        absent_outputs: outputs its kind gives but it cannot, with why (a ViT saved without
            its pooler has no ``pooled``): ``--output`` naming one is refused with that reason.
        whole_parts: outputs of a lengths-protocol encoder with one row per input, not one per
            frame (a text model's ``pooled`` ``[B, D]``): kept whole when rows are trimmed.
        loaded_from: the stat of the file its weights were read from, before the read (None:
            no file, or an in-process module); for a Hugging Face folder, that of the file
            of ``folder_state`` changed last.
        folder_state: a Hugging Face folder's state before its load, set only when the load
            left it unchanged: its fingerprint is remembered against it (see
            :class:`featbake.encode.fingerprints.FolderState`).
    """

    module: Any
    label: str
    kind: str
    identity: str
    device: torch.device
    _fingerprint: str | None = None
    takes_lengths: bool = False
    unpaddable: str | None = None
    absent_outputs: dict[str, str] = field(default_factory=dict)
    whole_parts: frozenset[str] = frozenset()
    loaded_from: LoadedFrom | None = None
    folder_state: FolderState | None = None

    @property
    def fingerprint(self) -> str:
        """``encoder_fp``: identity plus every weight (computed once, lazily)."""
        if self._fingerprint is None:
            self._fingerprint = module_fingerprint(self.module, self.identity)
        return self._fingerprint

    def run(self, batch: torch.Tensor, lengths: torch.Tensor | None = None) -> Any:
        """Run the encoder on ``batch`` without autograd.

        ``lengths`` goes to a lengths-protocol encoder as its second argument. The copies are
        non-blocking: from pinned memory they overlap with the GPU's work.

        Raises:
            EncodeError: the encoder raised (any ``Exception``: a TorchScript ``raise``, a
                ``KeyError`` in an import-path module) or returned a complex tensor; the
                message carries the real cause, not TorchScript's generic first line.
            EncoderLoadError: the encoder called ``sys.exit()`` (no input can fix that).
        """
        try:
            with torch.inference_mode():
                x = batch.to(self.device, non_blocking=True)
                if lengths is None:
                    result = self.module(x)
                else:
                    result = self.module(x, lengths.to(self.device, non_blocking=True))
        except SystemExit as e:
            raise EncoderLoadError(
                f"the encoder {self.label} called sys.exit({e.code!r}) while encoding; an "
                "encoder must return features or raise an exception"
            ) from None
        except FeatbakeError:
            raise  # e.g. a dead decode worker, reported through a signal
        except Exception as e:
            if str(e).startswith("DataLoader worker"):  # torch's SIGCHLD handler: not our input
                raise
            raise EncodeError(
                f"the encoder {self.label} failed on a batch of shape {tuple(batch.shape)}: "
                f"{error_cause(e)}"
            ) from e
        refuse_complex(result, self.label)
        return result


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def detect_kind(path: Path) -> str:
    """torchscript, export or pickle, from the archive's layout (never by unpickling)."""
    names = _zip_names(path)
    if not names:
        return PICKLE  # legacy (non-zip) torch.save files are plain pickles
    if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
        return TORCHSCRIPT
    if path.suffix == ".pt2" or any(n.endswith("serialized_exported_program.json") for n in names):
        return EXPORT
    return PICKLE


@contextlib.contextmanager
def torchscript_quietly() -> Iterator[None]:
    """Silence torch's "TorchScript is deprecated" warning around a jit save or load.

    torch 2.13 repeats it (as a FutureWarning) on every call; featbake still reads TorchScript on
    purpose, since most frozen encoders ship that way, so it does not pass the warning on.
    """
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings(
                "ignore", message=r".*(torch\.jit|TorchScript).*deprecated", category=category
            )
        yield


def from_module(
    module: Any,
    *,
    label: str | None = None,
    kind: str = MODULE,
    identity: str | None = None,
    device: str | torch.device | None = None,
) -> LoadedEncoder:
    """Wrap an in-process module as a :class:`LoadedEncoder` (eval mode, moved to ``device``)."""
    if identity is None:
        if kind == MODULE:
            identity = module_identity(module)
        else:
            identity = f"module:{type(module).__module__}.{type(module).__qualname__}\n{module!r}"
    if device is None:
        device = module_device(module) or torch.device("cpu")
    dev = torch.device(device)
    if hasattr(module, "eval") and kind != EXPORT:
        eval_mode(module)
    if (hasattr(module, "to") and kind != EXPORT) or (kind == EXPORT and dev.type != "cpu"):
        module = module.to(dev)
    enc = LoadedEncoder(module, label or type(module).__name__, kind, identity, dev)
    enc.takes_lengths = accepts_lengths(module)
    return enc


def eval_mode(module: Any) -> None:
    """Put ``module`` in eval mode where its mode can be switched: ``torch.export``'s
    ``ep.module()`` refuses ``.eval()`` (``NotImplementedError``), since export fixed the mode
    each op runs in when it traced; its graph is judged as it is
    (:func:`training_submodule` reads it)."""
    with contextlib.suppress(NotImplementedError):
        module.eval()


def module_device(module: Any) -> torch.device | None:
    """The device a module's weights are on: its first parameter's, else its first buffer's
    (a front-end whose only state is a buffer, a mel filter bank); None without either.

    The one rule for where an in-process module runs: :func:`from_module` runs it there (the
    CPU where it has no weights), and a dataset follows it there after a move
    (:mod:`featbake.serve.misses`). Two rules (parameters only, here) moved a front-end of
    buffers only to the CPU, the user's own module with it.

    Example:
        >>> module_device(torch.nn.Linear(2, 2)), module_device(torch.nn.ReLU())
        (device(type='cpu'), None)
    """
    parameters = getattr(module, "parameters", None)
    buffers = getattr(module, "buffers", None)
    tensors = chain(parameters() if parameters else (), buffers() if buffers else ())
    first = next(iter(tensors), None)
    return None if first is None else first.device


def meta_tensor(module: Any) -> str | None:
    """The name of the first of a module's parameters and buffers on the meta device, which
    holds no values to encode with or to key by (None: none is, or no ``nn.Module``). Every
    tensor is looked at: ``load_state_dict(..., assign=True)`` after ``.to("meta")`` brings
    back what a state dict holds, and leaves a buffer registered with ``persistent=False``
    on the meta device.

    Example:
        >>> meta_tensor(torch.nn.Linear(2, 2).to("meta"))
        'weight'
    """
    if not isinstance(module, torch.nn.Module):
        return None
    named = chain(module.named_parameters(), module.named_buffers())
    return next((name for name, t in named if t.is_meta), None)


def refuse_meta(label: str, module: Any, then: str) -> None:
    """Raise if ``module`` has a tensor on the meta device (see :func:`meta_tensor`);
    ``then`` says when it got there, as the message tells it.

    Raises:
        EncoderLoadError: naming the tensor, and how to bring its values back.
    """
    name = meta_tensor(module)
    if name is None:
        return
    raise EncoderLoadError(
        f"the encoder module {label} has its weights on the meta device ({name}){then}, which "
        "holds no values to encode with or key by; load its weights back before a miss and "
        "before a DataLoader starts its workers (load_state_dict(..., assign=True); a buffer "
        "registered with persistent=False is in no state dict: set it again), or give the "
        "dataset a module with weights"
    )


def refuse_held_tensors(label: str, module: Any) -> None:
    """Raise if a forward hook of ``module``, or a global forward hook of torch's (which runs
    on its forward too), holds what no key can read (:func:`held_refusals`): a tensor, an
    array or a module that is not the module's own (a closure's ``scale = torch.tensor(2.0)``,
    a tuple holding one, a bound method of another module), or a value too large to key. A
    key reads a hook's values by value, these by type only, so one edited in place
    (``scale.fill_(3.0)``) would serve stale features, and two processes holding other values
    would share keys. The module's own submodules, parameters and buffers (a closure over
    ``self``, a bound method of one of its submodules) are its key's already and pass.

    Raises:
        EncoderLoadError: naming the hook and what it holds, and what to do.
    """
    if not isinstance(module, torch.nn.Module):
        return
    own = {id(o) for o in chain(module.modules(), module.parameters(), module.buffers())}
    hooks = [*forward_hooks(module), *(("", "_global", h) for h in foreign_global_hooks())]
    for name, kind, hook in hooks:
        held = [] if is_library_machinery(hook) else held_refusals(hook, own)
        if held:
            what = getattr(hook, "__qualname__", type(hook).__qualname__)
            where = "global hook" if kind == "_global" else f"{kind[1:]} of {name or 'the module'}"
            if IN_TRAIN_MODE in held[0]:
                raise EncoderLoadError(
                    f"the encoder module {label} has a forward hook ({where}: {what}) that runs "
                    f"{held[0]}, so no stored feature could stand for what it returns; call "
                    f"{held[0].partition(' ')[0]}.eval() before a dataset encodes with it"
                )
            raise EncoderLoadError(
                f"the encoder module {label} has a forward hook ({where}: {what}) that holds "
                f"{held[0]}, which no key reads; make a tensor a buffer or parameter of the "
                "module and another module a submodule of it, or pass the hook plain values "
                "(numbers, strings, small tuples or dicts of them)"
            )


#: Where the classes of the submodules torch's graph machinery adds to a graph come from
#: (``torch.export``'s ``_guards_fn``): they compute nothing of the output and have no mode.
GRAPH_MACHINERY = ("torch.export.", "torch.fx.")


def training_submodule(module: Any) -> str | None:
    """The first part of ``module`` that runs in train mode, named (None: all in eval mode).

    A module is judged by ``.training``, but a ``torch.fx.GraphModule`` (what
    ``torch.export``'s ``ep.module()`` returns) by its graph: export fixes the mode each op runs
    in when it traces, and torch sets ``.training`` on the module it returns whatever that mode
    was (``.eval()`` on it raises). So its ops that take a ``train``/``training`` flag (dropout,
    batch norm) are read, and each submodule it calls is judged by the same rule (torch's
    own, :data:`GRAPH_MACHINERY`, left out).

    Example:
        >>> training_submodule(torch.nn.Sequential(torch.nn.Dropout()).train())
        "'Sequential' has .training set"
    """
    if not isinstance(module, torch.nn.Module):
        return None
    return _training_in(module, "", type(module).__name__)


def _training_in(module: torch.nn.Module, name: str, top: str) -> str | None:
    """:func:`training_submodule` of ``module``, named ``name`` inside the module ``top``."""
    if isinstance(module, torch.fx.GraphModule):
        return _training_in_graph(module, name, top)
    if module.training:
        return f"{name or top!r} has .training set"
    for child, sub in module.named_children():
        found = _training_in(sub, f"{name}.{child}" if name else child, top)
        if found is not None:
            return found
    return None


def _training_in_graph(module: torch.fx.GraphModule, name: str, top: str) -> str | None:
    """The first op of ``module``'s graph run in train mode, or submodule it calls that is."""
    for node in module.graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(str(node.target))
            if type(sub).__module__.startswith(GRAPH_MACHINERY):
                continue  # torch's own (export's input guards): no mode, .training always set
            found = _training_in(sub, f"{name}.{node.target}" if name else str(node.target), top)
            if found is not None:
                return found
        elif node.op == "call_function" and train_flag(node):
            return f"{name or top!r} runs {node.target} with train=True in its graph"
    return None


def train_flag(node: torch.fx.Node) -> bool:
    """Whether an op node of a graph is given ``train=True`` or ``training=True`` (an aten op
    whose schema has such an argument: dropout, batch norm); False for any other node."""
    schema = getattr(node.target, "_schema", None)
    for i, argument in enumerate(getattr(schema, "arguments", ())):
        if argument.name in ("train", "training"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            return value is True
    return False


def is_frozen(module: torch.nn.Module) -> bool:
    """True when no parameter requires grad and no part of the module runs in train mode
    (:func:`training_submodule`)."""
    return training_submodule(module) is None and not any(
        p.requires_grad for p in module.parameters()
    )


__all__ = [
    "error_cause",
    "refuse_complex",
]
