"""Identities of encoders: what in code, attributes and archives must change an encoder's key.

An encoder's fingerprint hashes its identity string and its weights; these functions build the
identity part for each kind of encoder (see :mod:`featbake.encode.encoders`).
"""

from __future__ import annotations

import ast
import dis
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import sys
import sysconfig
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# == identity ======================================================================================
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


def is_plain(value: Any) -> bool:
    """Whether an attribute value enters :func:`attribute_identity`: a number, string, bool or
    None, or a tuple or list of them."""
    return _primitive(value)


def keyed_attribute(name: str) -> bool:
    """Whether an attribute called ``name`` may enter a key (:func:`attribute_identity`, a
    hook object's, the watch's reads): a public one but ``training`` (always eval here);
    private ones are torch's own bookkeeping."""
    return not name.startswith("_") and name != "training"


def attribute_identity(module: Any) -> str:
    """SHA-256 of every submodule's plain attributes (numbers, strings, tuples of them).

    ``self.scale = 2.0`` used in ``forward`` changes outputs without changing code or weights, so
    it must change the key. Private attributes (torch's own bookkeeping) and ``training`` (always
    eval here) are left out.
    """
    subs = module.named_modules() if hasattr(module, "named_modules") else [("", module)]
    rows = []
    for name, sub in subs:
        for key, value in vars(sub).items():
            if keyed_attribute(key) and _primitive(value):
                rows.append([name, key, repr(value)])
    return attribute_digest(rows)


def attribute_digest(rows: list[list[str]]) -> str:
    """SHA-256 of ``[submodule name, attribute, repr of its value]`` rows, in sorted order:
    :func:`attribute_identity`'s digest, also made from a glance of the values a watch read
    (:class:`featbake.serve.cached_encoder.Glance`).

    Example:
        >>> attribute_digest([["", "b", "2"], ["", "a", "1"]]) == attribute_digest(
        ...     [["", "a", "1"], ["", "b", "2"]]
        ... )
        True
    """
    return hashlib.sha256(json.dumps(sorted(rows)).encode()).hexdigest()


#: The forward hooks of a module, as its ``__dict__`` holds them (``register_forward_pre_hook``,
#: ``register_forward_hook``): they change what a forward returns, as its code does.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def is_torchs(obj: Any) -> bool:
    """Whether ``obj`` (a hook: a function, or an object of a class) is torch's own code, left
    out of keys as :func:`code_identity` leaves torch's classes out (the old-API
    ``torch.nn.utils.weight_norm`` and ``spectral_norm`` hooks: their effect is in the weights).

    Example:
        >>> is_torchs(len)
        False
    """
    owner = getattr(obj, "__module__", None) or type(obj).__module__ or ""
    return owner == "torch" or owner.startswith("torch.")


def forward_hooks(module: Any) -> list[tuple[str, str, Any]]:
    """``(submodule name, hook dict, hook)`` for each forward hook of every submodule, in
    order; a watch's own (marked ``featbake_bookkeeping``: they change nothing) left out."""
    subs = module.named_modules() if hasattr(module, "named_modules") else [("", module)]
    return [
        (name, kind, hook)
        for name, sub in subs
        for kind in HOOK_DICTS
        for hook in getattr(sub, kind, {}).values()
        if not getattr(hook, "featbake_bookkeeping", False)
    ]


def _held_text(value: Any) -> str:
    """A value a hook holds, as a key reads it: its repr where it is plain (as an attribute
    value is, :func:`is_plain`), else its type alone."""
    return repr(value) if _primitive(value) else f"<{type(value).__qualname__}>"


def written_names(code: Any, ops: frozenset[str]) -> frozenset[str]:
    """The names a code object, and the code nested in it, writes by ``ops``
    (``STORE_ATTR``: an attribute, ``STORE_DEREF``: a closure cell); kept per code object
    (by id, the object held so its id is not lent), as a watch reads what each hook holds
    at every forward.

    Example:
        >>> def bump(self):
        ...     self.calls += 1
        >>> sorted(written_names(bump.__code__, ATTRIBUTE_WRITES))
        ['calls']
    """
    kept = _WRITTEN.get((id(code), ops))
    if kept is not None:
        return kept[1]
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ops}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= written_names(const, ops)
    _WRITTEN[(id(code), ops)] = (code, frozenset(names))
    return frozenset(names)


#: (id of a code object, ops) -> (the code object, the names it writes): written_names's.
_WRITTEN: dict[tuple[int, frozenset[str]], tuple[Any, frozenset[str]]] = {}


#: The ops by which a hook's code writes an attribute, or a closure cell (``nonlocal``).
ATTRIBUTE_WRITES = frozenset({"STORE_ATTR", "DELETE_ATTR"})
CELL_WRITES = frozenset({"STORE_DEREF", "DELETE_DEREF"})


def _public_attributes(obj: Any, runs: Any) -> list[tuple[str, Any]]:
    """An object's public attributes (``training`` left out, for a bound method of a
    module) that the code ``runs`` (the hook's function) does not write itself: an attribute
    the hook sets as it runs (``self.calls += 1``) is its bookkeeping, and keying it would
    give the module another key at each forward. None where it has no ``__dict__``."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    code = getattr(runs, "__code__", None)
    own = written_names(code, ATTRIBUTE_WRITES) if code is not None else frozenset()
    return [(k, v) for k, v in sorted(attrs.items()) if keyed_attribute(k) and k not in own]


def _plain_attributes(obj: Any, runs: Any) -> list[str]:
    """``name=repr`` of an object's public plain attributes (the rules of
    :func:`attribute_identity`) that the hook's code ``runs`` does not write, sorted."""
    return [f"{k}={v!r}" for k, v in _public_attributes(obj, runs) if _primitive(v)]


def _cell_values(func: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of a function's closure cells (an empty one: ``_EMPTY``) but those
    its own code rebinds (``nonlocal n; n += 1``: its bookkeeping), then its defaults, then
    its keyword defaults; name ``""`` but for a keyword default."""
    cells = func.__closure__ or ()
    written = written_names(func.__code__, CELL_WRITES) if cells else frozenset()
    out: list[tuple[str, Any]] = []
    for name, cell in zip(func.__code__.co_freevars, cells, strict=False):
        if name in written:
            continue
        try:
            out.append(("", cell.cell_contents))
        except ValueError:
            out.append(("", _EMPTY))
    out += [("", v) for v in func.__defaults__ or ()]
    if func.__kwdefaults__:
        out += sorted(func.__kwdefaults__.items())
    return out


class _Empty:
    """An empty closure cell, as :func:`held_values` reads it."""

    def __repr__(self) -> str:
        return "<empty>"


_EMPTY = _Empty()


def _cells(func: Any) -> list[str]:
    """A function's closure cells, defaults and keyword defaults, as :func:`_held_text` reads
    them (an empty cell: ``<empty>``), those its own code rebinds left out."""
    return [
        "<empty>" if v is _EMPTY else f"{k}={_held_text(v)}" if k else _held_text(v)
        for k, v in _cell_values(func)
    ]


def _runs(hook: Any) -> Any:
    """The function a hook object runs (its class's ``__call__``), None where it has none."""
    return inspect.getattr_static(type(hook), "__call__", None)


def held_objects(hook: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of everything a hook holds that :func:`held_values` reads (plain or
    not): a partial's arguments and its function's, a function's cells and defaults, a bound
    method's or hook object's public attributes its code does not write; name ``""`` for a
    positional one."""
    if isinstance(hook, functools.partial):
        args = [("", a) for a in hook.args]
        return [*held_objects(hook.func), *args, *sorted(hook.keywords.items())]
    if inspect.ismethod(hook):
        own = _public_attributes(hook.__self__, hook.__func__)
        return [*held_objects(hook.__func__), *own]
    if inspect.isfunction(hook):
        return _cell_values(hook)
    return _public_attributes(hook, _runs(hook))


def held_values(hook: Any) -> list[str]:
    """What a hook holds that changes what it does, by the rules of attribute identity (plain
    values by repr, others by type): a ``functools.partial``'s function, arguments and
    keywords; a function's closure cells and defaults; a bound method's function and its
    object's public plain attributes; a hook object's public plain attributes. What the
    hook's own code writes (an attribute it sets, a cell it rebinds) is left out: its
    bookkeeping as it runs (a call counter), neither keyed nor watched.

    Example:
        >>> import functools
        >>> held_values(functools.partial(round, ndigits=2))
        ['partial', 'ndigits=2']
    """
    if isinstance(hook, functools.partial):
        kw = [f"{k}={_held_text(v)}" for k, v in sorted(hook.keywords.items())]
        return ["partial", *held_values(hook.func), *map(_held_text, hook.args), *kw]
    if inspect.ismethod(hook):
        return [*held_values(hook.__func__), *_plain_attributes(hook.__self__, hook.__func__)]
    if inspect.isfunction(hook):
        return _cells(hook)
    return _plain_attributes(hook, _runs(hook))


def code_digest(code: Any) -> str:
    """SHA-256 of a code object's bytecode, names and constants (nested code objects by their
    own digest): two lambdas of one line with other constants differ."""
    consts = [code_digest(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    h = hashlib.sha256(code.co_code)
    h.update(json.dumps([consts, list(code.co_names)]).encode())
    return h.hexdigest()


def hook_code(hook: Any) -> str:
    """A hook's code: the qualified name of what runs, its bytecode (:func:`code_digest`) and
    its source file (:func:`code_identity`); a partial's or bound method's by its function. A
    hook of the script run is named ``__main__``'s in a spawned worker too."""
    func = hook.func if isinstance(hook, functools.partial) else hook
    func = func.__func__ if inspect.ismethod(func) else func
    runs = (
        func if inspect.isfunction(func) else inspect.getattr_static(type(func), "__call__", None)
    )
    named = getattr(func, "__qualname__", type(func).__qualname__)
    owner = getattr(func, "__module__", None) or type(func).__module__
    owner = "__main__" if owner == "__mp_main__" else owner
    code = code_digest(runs.__code__) if inspect.isfunction(runs) else ""
    source = code_identity(func, func if inspect.isfunction(func) else type(func))
    return f"{owner}.{named}:{code}:{source}"


def hook_identity(module: Any) -> str:
    """SHA-256 of the forward hooks of every submodule, each by where it is, its code
    (:func:`hook_code`) and what it holds (:func:`held_values`); ``""`` where there is none.
    Hooks of torch's own code (:func:`is_torchs`: ``weight_norm``, ``spectral_norm``) and
    those marked ``featbake_bookkeeping`` (a watch's own) are left out, so a module carrying
    only those keeps the identity it had.

    A pre-hook that scales the input changes every output without changing code, weights or
    attributes: it must change the key, and so must the factor a partial or closure holds. Read
    when a module is fingerprinted only; a watch compares the hook objects themselves.

    Example:
        >>> hook_identity(torch.nn.Linear(2, 2))  # doctest: +SKIP
        ''
    """
    rows = [
        [name, kind, hook_code(hook), held_values(hook)]
        for name, kind, hook in forward_hooks(module)
        if not is_torchs(hook)
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest() if rows else ""


def module_identity(module: Any) -> str:
    """An in-process module's identity: class, repr, code, plain attributes, and its forward
    hooks where it has any (:func:`hook_identity`; none: the identity it always had).

    Shared by :func:`from_module` and :class:`featbake.cached_encoder.CachedEncoder`, so the same
    module gets the same fingerprint either way.
    """
    ident = f"module:{type(module).__module__}.{type(module).__qualname__}\n{module!r}"
    ident = f"{ident}\ncode:{code_identity(module)}\nattrs:{attribute_identity(module)}"
    hooks = hook_identity(module)
    return f"{ident}\nhooks:{hooks}" if hooks else ident


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


# == code_closure ==================================================================================
# The user's own code an import-path encoder runs: its modules' sources, followed by import.
#
# ``--encoder pkg.mod:make`` names one module, but ``forward`` may call a helper in
# ``pkg/other.py``; editing that helper changes the features, so it must change the key. The
# closure starts at the factory's module and follows its ``import`` statements (read from the
# source, never executed) to every module that is the user's own: not in the standard library and
# not installed in site-packages. Installed libraries count by distribution name and version
# instead (torch and featbake left out: a torch upgrade should not rebake everything, and
# featbake's own changes are versioned by the recipe).
#
# Why imports read from source and not the modules loaded in ``sys.modules``: a training script
# that serves the features has imported more of the user's package than the build did, and the key
# must be the same in both processes. What a ``importlib.import_module(name)`` call loads is not
# followed (it is not visible in the source); docs/encoders.md says so.
#: Libraries whose version never enters a key (see the module docstring).
UNVERSIONED = frozenset({"torch", "featbake"})


def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(Path(paths[n]).resolve() for n in names if n in paths)


@dataclass
class CodeClosure:
    """The user's modules reached from one module, and the libraries they import."""

    sources: dict[str, str] = field(default_factory=dict)  # module name -> sha256 of its file
    libraries: dict[str, str] = field(default_factory=dict)  # top-level name -> version
    installed: tuple[Path, ...] = field(default_factory=_installed_roots)

    def digest(self) -> str:
        """SHA-256 of the sorted (module, source hash) and (library, version) pairs."""
        lines = [f"src {m} {h}" for m, h in sorted(self.sources.items())]
        lines += [f"lib {n} {v}" for n, v in sorted(self.libraries.items())]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def add(self, name: str) -> None:
        """Add module ``name`` (and its parent packages) and what they import, transitively."""
        todo = [name]
        while todo:
            mod = todo.pop()
            if mod in self.sources or not mod:
                continue
            path = self._own_file(mod)
            if path is None:
                continue
            self.sources[mod] = hashlib.sha256(path.read_bytes()).hexdigest()
            parent = mod.rpartition(".")[0]
            todo.append(parent)
            is_package = path.name == "__init__.py"
            todo.extend(imported_names(path, mod if is_package else parent))

    def _own_file(self, name: str) -> Path | None:
        """The source file of ``name`` when it is the user's own; libraries are recorded."""
        top = name.partition(".")[0]
        if top in UNVERSIONED or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return None
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: finds, never imports
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        origin = Path(spec.origin).resolve() if spec.origin else None
        where = [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
        if any(_under(p, self.installed) for p in [*where, *([origin] if origin else [])]):
            self._library(top)
            return None
        if name == top:
            return origin if origin is not None and origin.suffix == ".py" else None
        return _submodule_file(where, name.split(".")[1:])

    def _library(self, top: str) -> None:
        if top in self.libraries:
            return
        dists = _distributions().get(top, [])
        versions = sorted(f"{d}=={importlib.metadata.version(d)}" for d in set(dists))
        self.libraries[top] = ",".join(versions) or "unknown"


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Top-level import name -> the distributions that provide it (read once per process)."""
    return importlib.metadata.packages_distributions()


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(r) for r in roots)


def _submodule_file(locations: list[Path], parts: list[str]) -> Path | None:
    for base in locations:
        stem = base.joinpath(*parts)
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


def imported_names(path: Path, package: str) -> list[str]:
    """Module names a source file imports (``from a import b`` gives ``a`` and ``a.b``).

    ``package`` resolves relative imports (the package the file's module lives in). A file
    that does not parse contributes its bytes only (Python would fail to import it anyway).
    """
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            if base is None:
                continue
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _absolute(module: str, level: int, package: str) -> str | None:
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    head = parts[: len(parts) - (level - 1)]
    return ".".join([*head, module] if module else head) or None


def code_closure_digest(module_name: str) -> str:
    """SHA-256 of the user's own code reached from ``module_name`` (see the module docstring).

    Example:
        >>> len(code_closure_digest("featbake.testing"))
        64
    """
    closure = CodeClosure()
    closure.add(module_name)
    return closure.digest()
