"""Identities of encoders: what in code, attributes and archives must change an encoder's key.

An encoder's fingerprint hashes its identity string and its weights; these functions build the
identity part for each kind of encoder (see :mod:`featbake.encode.encoders`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import zipfile
from pathlib import Path
from typing import Any


def code_identity(module: Any, *extra: Any) -> str:
    """SHA-256 of the source files that define ``module``'s own classes (and ``extra`` objects).

    An import-path or in-process encoder's architecture lives in Python code, not in a file of
    weights: editing ``forward`` must change the key, or a stale feature would be served. Classes
    from torch itself are left out (a torch upgrade should not rebake everything), and file
    contents are hashed, not paths (moving a checkout keeps the keys).
    """
    objs = [type(m) for m in module.modules()] if hasattr(module, "modules") else [type(module)]
    digests = set()
    for obj in [*objs, *extra]:
        owner = getattr(obj, "__module__", None) or ""
        if owner == "torch" or owner.startswith("torch."):
            continue
        try:
            src = inspect.getsourcefile(obj)
            if src is not None:
                digests.add(hashlib.sha256(Path(src).read_bytes()).hexdigest())
        except (TypeError, OSError):
            continue  # built-in or defined interactively: repr() in the identity still covers it
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


_PRIMITIVES = (bool, int, float, str, type(None))


def _primitive(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_primitive(v) for v in value)
    return isinstance(value, _PRIMITIVES)


def attribute_identity(module: Any) -> str:
    """SHA-256 of every submodule's plain attributes (numbers, strings, tuples of them).

    ``self.scale = 2.0`` used in ``forward`` changes outputs without changing code or weights, so
    it must change the key. Private attributes (torch's own bookkeeping) and ``training`` (always
    eval here) are left out.
    """
    subs = module.named_modules() if hasattr(module, "named_modules") else [("", module)]
    attrs = []
    for name, sub in sorted(subs, key=lambda kv: kv[0]):
        for key, value in sorted(vars(sub).items()):
            if not key.startswith("_") and key != "training" and _primitive(value):
                attrs.append([name, key, repr(value)])
    return hashlib.sha256(json.dumps(attrs).encode()).hexdigest()


def module_identity(module: Any) -> str:
    """An in-process module's identity: class, repr, code and plain attributes.

    Shared by :func:`from_module` and :class:`featbake.cached_encoder.CachedEncoder`, so the same
    module gets the same fingerprint either way.
    """
    ident = f"module:{type(module).__module__}.{type(module).__qualname__}\n{module!r}"
    return f"{ident}\ncode:{code_identity(module)}\nattrs:{attribute_identity(module)}"


def script_identity(module: Any, path: Path) -> str:
    """Code of every submodule, plus the archive's pickled attributes and constants.

    A scripted module's ``.code`` does not show attribute values (``self.scale = 2.0``); they
    live in the archive's ``data.pkl`` and ``constants.pkl``, whose bytes are the same each time
    one module is saved. The entries are matched by name suffix, because their folder inside the
    zip is named after the file.
    """
    parts = [f"torchscript:{getattr(module, 'original_name', type(module).__name__)}"]
    for name, sub in sorted(module.named_modules(), key=lambda kv: kv[0]):
        code = getattr(sub, "code", "")
        parts.append(f"{name}\n{code}")
    with zipfile.ZipFile(path) as z:
        for entry in sorted(z.namelist()):
            if entry.endswith(("/data.pkl", "/constants.pkl")):
                parts.append(
                    f"{entry.rsplit('/', 1)[1]}:{hashlib.sha256(z.read(entry)).hexdigest()}"
                )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
