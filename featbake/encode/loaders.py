"""Loading an encoder from what the user names: a TorchScript (``.pt``) or torch.export (``.pt2``)
file, an import path (``pkg.mod:factory`` with optional ``--weights``), a trusted pickle, or a
Hugging Face model folder (:mod:`featbake.encode.hf`). Each becomes a
:class:`~featbake.encode.encoders.LoadedEncoder`.

The loaders sit above both :mod:`featbake.encode.encoders` and :mod:`featbake.encode.hf`, so
imports run one way (the Hugging Face loader builds on ``LoadedEncoder``; nothing below imports
the loaders).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
import pickle
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from featbake.encode.encoders import (
    EXPORT,
    IMPORT,
    TORCHSCRIPT,
    LoadedEncoder,
    LoadedFrom,
    detect_kind,
    from_module,
    torchscript_quietly,
)
from featbake.encode.identity import (
    attribute_identity,
    code_closure_digest,
    code_identity,
    script_identity,
    script_tree_identity,
)
from featbake.encode.naming import encoder_not_found, is_import_path
from featbake.errors import ConfigError, EncoderLoadError, first_line


def _load_torchscript(path: Path) -> tuple[Any, str]:
    with torchscript_quietly():
        module = torch.jit.load(str(path), map_location="cpu")
    return module, script_identity(module, path)


def _load_export(path: Path) -> tuple[Any, str]:
    program = torch.export.load(str(path))
    module = program.module()
    return module, export_identity(program)


def export_identity(program: Any) -> str:
    """The code of an exported program's graph and of every graph nested in it: the branches
    of ``torch.cond``, the bodies of ``while_loop`` and ``map`` live in submodules of their
    own (``true_graph_0``), which the top graph's code only calls (a program whose one
    branch changed from relu to tanh kept its key, and its old features were served)."""
    digest = hashlib.sha256(str(program.graph_module.code).encode())
    for name, sub in sorted(program.graph_module.named_modules(), key=lambda kv: kv[0]):
        if name and isinstance(sub, torch.fx.GraphModule):
            digest.update(f"\n{name}\n{sub.code}".encode())
    return "export:" + digest.hexdigest()


def _load_pickle(path: Path, trust_pickle: bool) -> tuple[Any, str]:
    try:
        with warnings.catch_warnings():
            # A file whose second byte is an unusual pickle protocol (any junk may start so)
            # makes torch warn on a line of its own, advising weights_only: the error below
            # says what the file is in featbake's one line.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
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
                f"--weights {path.with_suffix('.safetensors').name} ({to_safetensors(path)})"
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
    ident += f"\ncode:{code_identity(module)}"
    # The user's own modules the class's module imports (pkg/helpers.py's act), by content,
    # as for an import path: the pickle names the class, whose code is read where it lies now.
    ident += f"\nimports:{code_closure_digest(type(module).__module__)}"
    return module, f"{ident}\nattrs:{attribute_identity(module)}"


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
    script = script_tree_identity(module)  # a factory returning torch.jit.load(...)'s module
    identity = f"{identity}\nscript:{script}" if script else identity
    # The user's own modules the factory's module imports (pkg/other.py's helper), by content.
    identity += f"\nimports:{code_closure_digest(mod_name)}"
    return module, f"{identity}\nattrs:{attribute_identity(module)}"


def to_safetensors(path: Path) -> str:
    """How to turn a ``torch.save`` state dict at ``path`` into what ``--weights`` reads."""
    return (
        "convert a torch.save state dict with safetensors.torch.save_file(torch.load("
        f"'{path}'), '{path.with_suffix('.safetensors').name}')"
    )


def _load_weights(module: torch.nn.Module, weights: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not weights.is_file():
        raise EncoderLoadError(f"weights file {weights} does not exist")
    try:
        state = load_file(str(weights))
    except SafetensorError as e:
        raise EncoderLoadError(
            f"cannot read weights {weights} as safetensors ({first_line(e)}); --weights takes a "
            f"safetensors file: {to_safetensors(weights)}"
        ) from e
    except OSError as e:
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
        seen = LoadedFrom.of(weights_p)
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
        seen = LoadedFrom.of(path)
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
    enc = from_module(module, label=label, kind=kind, identity=identity, device=dev)
    enc.loaded_from = seen
    return enc
