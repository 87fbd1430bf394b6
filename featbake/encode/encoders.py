"""What a loaded encoder is: :class:`LoadedEncoder` (a module, its identity and fingerprint, run
without autograd) and :func:`from_module`; loading one from a path is
:mod:`featbake.encode.loaders`.

Every kind becomes a :class:`LoadedEncoder` that runs without autograd and turns any failure
of the encoder's own code into an :class:`EncodeError` that names the real cause.
"""

from __future__ import annotations

import contextlib
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featbake.encode.failures import error_cause, refuse_complex
from featbake.encode.identity import (
    module_identity,
)
from featbake.encode.lengths import accepts_lengths
from featbake.errors import EncodeError, EncoderLoadError, FeatbakeError
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
