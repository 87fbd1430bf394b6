"""Encoder adapters: load TorchScript, torch.export, import-path or (trusted) pickled encoders.

Every kind becomes a :class:`LoadedEncoder` that runs without autograd and turns any failure
of the encoder's own code into an :class:`EncodeError` that names the real cause.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import os
import pickle
import sys
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featbake.encode.code_closure import code_closure_digest
from featbake.encode.failures import error_cause, first_line, refuse_complex
from featbake.encode.identity import (
    attribute_identity,
    code_identity,
    module_identity,
    script_identity,
)
from featbake.encode.lengths import accepts_lengths
from featbake.errors import ConfigError, EncodeError, EncoderLoadError, FeatbakeError
from featbake.keys import module_fingerprint

TORCHSCRIPT = "torchscript"


EXPORT = "export"


IMPORT = "import"


PICKLE = "pickle"


MODULE = "module"  # an in-process nn.Module handed to the API


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
            :mod:`featbake.encode.lengths`), so inputs of different lengths can share a batch.
        unpaddable: why padded batches would not be exact for this encoder, known up front
            (e.g. a group-norm wav2vec2 that must not get an attention mask), else ``None``.
        absent_outputs: outputs its kind gives but it cannot, with why (a ViT saved without
            its pooler has no ``pooled``): ``--output`` naming one is refused with that reason.
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


def encoder_not_found(spec: str) -> EncoderLoadError:
    """The error for an encoder path that names nothing, with what ``--encoder`` takes."""
    return EncoderLoadError(
        f"encoder {spec} not found; give a TorchScript (.pt), torch.export (.pt2) file, a "
        "Hugging Face model folder (config.json + weights) or an import path like "
        "mypkg.models:build_encoder"
    )


def is_import_path(spec: str) -> bool:
    mod, sep, attr = spec.partition(":")
    return bool(sep) and bool(attr) and not os.path.exists(spec) and "/" not in mod


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


def _load_torchscript(path: Path) -> tuple[Any, str]:
    with torchscript_quietly():
        module = torch.jit.load(str(path), map_location="cpu")
    return module, script_identity(module, path)


def _load_export(path: Path) -> tuple[Any, str]:
    program = torch.export.load(str(path))
    module = program.module()
    identity = "export:" + hashlib.sha256(str(program.graph_module.code).encode()).hexdigest()
    return module, identity


def _load_pickle(path: Path, trust_pickle: bool) -> tuple[Any, str]:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" not in str(e):  # torch's words for "this pickle names code"
            raise EncoderLoadError(
                f"{path} is not a TorchScript (.pt), torch.export (.pt2) or torch.save file "
                f"({_unpickle_reason(e)}); check the path, or that the file is complete"
            ) from None
        obj = None
        holds_module = True  # a pickle naming classes: only a full unpickle can run it
    except Exception as e:  # the unpickler trips on garbage in many ways: one message for all
        raise EncoderLoadError(
            f"{path} is not a TorchScript (.pt), torch.export (.pt2) or torch.save file "
            f"({type(e).__name__}: {first_line(e)}); check the path, or that the file is complete"
        ) from e
    else:
        holds_module = False
    if not holds_module:
        if isinstance(obj, Mapping):
            raise EncoderLoadError(
                f"{path} holds a state dict, not a runnable encoder; name the architecture with "
                f"an import path and pass the weights: --encoder package.module:factory "
                f"--weights {path.with_suffix('.safetensors').name} (convert with "
                "safetensors.torch.save_file)"
            )
        raise EncoderLoadError(f"{path} does not hold an encoder (found {type(obj).__name__})")
    if not trust_pickle:
        raise EncoderLoadError(
            f"{path} is a pickled module (torch.save(model)); loading it runs arbitrary code, so "
            "featbake refuses it. Export it with torch.jit.save or torch.export.save, or pass "
            "--trust-pickle if you made this file yourself"
        )
    module = torch.load(str(path), map_location="cpu", weights_only=False)
    if not isinstance(module, torch.nn.Module):
        raise EncoderLoadError(f"{path} unpickled to {type(module).__name__}, not an nn.Module")
    ident = f"pickle:{type(module).__module__}.{type(module).__qualname__}\n{module!r}"
    return module, f"{ident}\ncode:{code_identity(module)}\nattrs:{attribute_identity(module)}"


def _unpickle_reason(e: BaseException) -> str:
    """What the unpickler tripped on, without torch's advice to retry with weights_only=False
    (which would run whatever code the file names)."""
    text = str(e)
    _, found, rest = text.partition("WeightsUnpickler error:")
    detail = next((line.strip() for line in rest.splitlines() if line.strip()), "") if found else ""
    if not detail and not text.startswith("Weights only load failed"):
        detail = first_line(e)
    return f"unreadable as a pickle: {detail}" if detail else "unreadable as a pickle"


def _import_from_path_or_cwd(mod_name: str) -> Any:
    """``mod_name`` imported as ``python -m`` would: from ``sys.path``, else the current folder.

    The ``featbake`` console script (and a training script run from elsewhere) does not have
    the current folder on ``sys.path``, so ``--encoder examples.mine:make`` failed from the
    folder that holds ``examples/`` while ``python -m featbake`` worked. As uvicorn does for
    ``main:app``, the current folder is added (first, as ``python -m`` puts it) when the module
    is not found otherwise.
    """
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        top = mod_name.split(".")[0]
        cwd = os.getcwd()
        if e.name != top or any(os.path.abspath(p or ".") == cwd for p in sys.path):
            raise
        if importlib.machinery.PathFinder.find_spec(top, [cwd]) is None:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(mod_name)


def _load_import(spec: str, weights: Path | None) -> tuple[Any, str]:
    mod_name, _, attr = spec.partition(":")
    try:
        factory: Any = _import_from_path_or_cwd(mod_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as e:
        raise EncoderLoadError(
            f"cannot import {spec}: {first_line(e)}; check the module is in the current folder "
            "or on PYTHONPATH, and the factory name after ':' exists"
        ) from e
    except SystemExit as e:
        raise EncoderLoadError(
            f"importing {mod_name} called sys.exit({e.code!r}); an encoder module must not exit"
        ) from None
    except Exception as e:
        raise EncoderLoadError(f"cannot import {spec}: {type(e).__name__}: {first_line(e)}") from e
    try:
        module = factory()
    except SystemExit as e:
        raise EncoderLoadError(
            f"{spec}() called sys.exit({e.code!r}); the factory must return an nn.Module"
        ) from None
    except Exception as e:
        raise EncoderLoadError(f"{spec}() raised {type(e).__name__}: {first_line(e)}") from e
    if not isinstance(module, torch.nn.Module):
        raise EncoderLoadError(f"{spec}() returned {type(module).__name__}, not an nn.Module")
    if weights is not None:
        _load_weights(module, weights)
    identity = f"import:{spec}\n{module!r}\ncode:{code_identity(module, factory)}"
    # The user's own modules the factory's module imports (pkg/other.py's helper), by content.
    identity += f"\nimports:{code_closure_digest(mod_name)}"
    return module, f"{identity}\nattrs:{attribute_identity(module)}"


def _load_weights(module: torch.nn.Module, weights: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not weights.is_file():
        raise EncoderLoadError(f"weights file {weights} does not exist")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise EncoderLoadError(f"cannot read weights {weights}: {first_line(e)}") from e
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise EncoderLoadError(f"weights {weights} do not fit the encoder: {first_line(e)}") from e


def load_encoder(
    spec: str | os.PathLike[str],
    *,
    weights: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    trust_pickle: bool = False,
    layers: tuple[int, ...] | str | None = None,
) -> LoadedEncoder:
    """Load an encoder named by a file path, a Hugging Face folder or ``package.module:factory``.

    Args:
        spec: TorchScript file, ``.pt2`` export, Hugging Face model folder, or import path.
        weights: safetensors weights for an import-path encoder.
        device: where to run it (``cpu``, ``cuda``, ``cuda:1``).
        trust_pickle: allow a pickled whole module (runs code from the file).
        layers: hidden layers a Hugging Face folder returns (the recipe's ``layers``).

    Returns:
        The encoder in eval mode on ``device``, not yet fingerprinted.

    Raises:
        EncoderLoadError: missing file, unknown format, refused pickle, import failure.

    Example:
        >>> enc = load_encoder("ckpt.pt", device="cpu")  # doctest: +SKIP
        >>> enc.fingerprint[:12]  # doctest: +SKIP
    """
    spec_s = os.fspath(spec)
    dev = torch.device(device)
    weights_p = Path(weights) if weights is not None else None
    if is_import_path(spec_s):
        module, identity = _load_import(spec_s, weights_p)
        kind, label = IMPORT, spec_s
    elif Path(spec_s).is_dir():
        from featbake.encode.hf import load_hf_folder  # transformers only when asked for

        if weights_p is not None:
            raise ConfigError("--weights applies only to an import-path encoder (pkg.mod:factory)")
        return load_hf_folder(spec_s, layers=layers, device=dev)
    else:
        path = Path(spec_s)
        if not path.is_file():
            raise encoder_not_found(spec_s)
        if weights_p is not None:
            raise ConfigError("--weights applies only to an import-path encoder (pkg.mod:factory)")
        kind = detect_kind(path)
        try:
            if kind == TORCHSCRIPT:
                module, identity = _load_torchscript(path)
            elif kind == EXPORT:
                module, identity = _load_export(path)
            else:
                module, identity = _load_pickle(path, trust_pickle)
        except EncoderLoadError:
            raise
        except Exception as e:
            raise EncoderLoadError(f"cannot load encoder {path} as {kind}: {first_line(e)}") from e
        label = str(path.resolve())
    return from_module(module, label=label, kind=kind, identity=identity, device=dev)


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
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    dev = torch.device(device)
    if hasattr(module, "eval") and kind != EXPORT:
        module.eval()
    if (hasattr(module, "to") and kind != EXPORT) or (kind == EXPORT and dev.type != "cpu"):
        module = module.to(dev)
    enc = LoadedEncoder(module, label or type(module).__name__, kind, identity, dev)
    enc.takes_lengths = accepts_lengths(module)
    return enc


def is_frozen(module: torch.nn.Module) -> bool:
    """True when no parameter requires grad and the module is in eval mode."""
    return not module.training and not any(p.requires_grad for p in module.parameters())
